"""Give the CPU backend 8 devices before anything imports jax, compile without
LLVM's optimizations, and let go of compiled programs between tests.

XLA reads ``XLA_FLAGS`` once, when the backend starts, so this must run before
any test module (or ``tools.zoo``) touches ``jax.devices()``.
"""

import os
import sys

import pytest

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# The zoo's numeric ground truth compiles about 330 program pairs.  Level 0
# skips LLVM's optimization passes, which took 20-30% of the compile time of
# four zoo programs measured here; it leaves the HLO passes alone, so XLA's partitioning of
# GSPMD programs (what the verifier reads) is the same op for op (checked on
# three GSPMD training steps), and results differ by rounding at most.
_OPT_FLAG = "--xla_backend_optimization_level"

for flag, value in ((_DEVICE_FLAG, 8), (_OPT_FLAG, 0)):
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}={value}").strip()


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  """Drop jax's compiled programs after each test.  Each XLA CPU executable
  keeps its machine code mapped, and jax's caches keep every executable: over
  the whole suite one process crossed the kernel's limit of 65,530 memory maps
  (vm.max_map_count) and died inside the compiler."""
  yield
  jax = sys.modules.get("jax")
  if jax is not None:
    jax.clear_caches()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the markers
def pytest_collection_modifyitems(items):
  """Under ``pytest -n 2 --dist loadgroup`` (pytest-xdist, the README's test
  command), keep every test of one zoo program on one worker, so the
  verification ``zoo_verdicts`` shares between test files is done once, not
  once per worker that happens to get one of its tests."""
  for item in items:
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    name = getattr(case, "name", None)
    if isinstance(name, str):
      item.add_marker(pytest.mark.xdist_group(name))
