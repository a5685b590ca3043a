"""graphguard-hlo: prove a distributed XLA program refines its sequential one."""

__version__ = "0.1.0"
