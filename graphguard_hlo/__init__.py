"""graphguard-hlo: prove a distributed XLA program refines its sequential one.

``verify``, ``verify_files`` and ``assert_refines`` live in ``graphguard_hlo.api``;
they are imported on first use so that ``import graphguard_hlo`` stays cheap.
"""

__version__ = "0.1.0"
__all__ = ["verify", "verify_files", "assert_refines"]


def __getattr__(name):
  if name in __all__:
    from graphguard_hlo import api
    return getattr(api, name)
  raise AttributeError(f"module 'graphguard_hlo' has no attribute {name!r}")
