"""Give the CPU backend 8 devices before anything imports jax.

XLA reads ``XLA_FLAGS`` once, when the backend starts, so this must run before
any test module (or ``tools.zoo``) touches ``jax.devices()``.
"""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count"

if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" {_DEVICE_FLAG}=8").strip()
