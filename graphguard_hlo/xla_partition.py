"""Run XLA's own SPMD partitioner and keep the per-device program it makes.

GSPMD/Shardy programs (``jax.jit`` with shardings) carry only annotations;
their collectives appear when XLA partitions them.  We compile with the dump
flags for the ``spmd-partitioning`` pass and read back the module right after
it, as an HLO proto, before any fusion: the program every device runs.
"""

from __future__ import annotations

import glob
import os
import tempfile

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError
from graphguard_hlo.loaders.hlo_proto import load_hlo_proto

# Large constants in full: a text dump elides them as {...} otherwise, and a
# constant the verifier cannot read can relate to nothing.
DUMP_OPTIONS = {"xla_dump_hlo_pass_re": "spmd-partitioning", "xla_dump_hlo_as_proto": True,
                "xla_dump_hlo_as_text": False, "xla_dump_large_constants": True}


def _partitioned_dump_file(dump_dir: str, ext: str, path_hint: str) -> str:
  """The dump of the module right after spmd-partitioning, as ``ext``."""
  found = sorted(glob.glob(os.path.join(dump_dir, f"*after_spmd-partitioning*{ext}")))
  if not found:
    raise InputError(path_hint, "XLA produced no partitioned module (is it sharded?)")
  # The last partitioning pass of the main module is the one we want.
  return found[-1]


def partitioned_from_dump(dump_dir: str, path_hint: str) -> ir.Module:
  with open(_partitioned_dump_file(dump_dir, ".pb", path_hint), "rb") as f:
    return load_hlo_proto(path_hint, f.read())


def partitioned_hlo_text(lowered) -> str:
  """XLA's per-device module of a ``jax.stages.Lowered``, as HLO text (what
  ``--xla_dump_hlo_as_text`` writes after spmd-partitioning)."""
  with tempfile.TemporaryDirectory(prefix="gg-hlo-") as tmp:
    lowered.compile(compiler_options=dict(DUMP_OPTIONS, xla_dump_to=tmp,
                                          xla_dump_hlo_as_proto=False,
                                          xla_dump_hlo_as_text=True))
    with open(_partitioned_dump_file(tmp, ".txt", "<jax>")) as f:
      return f.read()


def partition_lowered(lowered, path_hint: str = "<jax>") -> ir.Module:
  """Compile a ``jax.stages.Lowered`` and return XLA's per-device module."""
  with tempfile.TemporaryDirectory(prefix="gg-hlo-") as tmp:
    compiled = lowered.compile(compiler_options=dict(DUMP_OPTIONS, xla_dump_to=tmp))
    module = partitioned_from_dump(tmp, path_hint)
  _with_jax_partition_count(module, compiled)
  return module


def _with_jax_partition_count(module: ir.Module, compiled) -> None:
  """XLA's partitioned proto does not record the partition count: a program
  whose inputs are replicated (only its output split) tells no mesh without
  it.  jax's shardings say how many devices it runs on."""
  import jax
  shardings = jax.tree.leaves(compiled.input_shardings) + jax.tree.leaves(
      compiled.output_shardings)
  module.num_partitions = max([module.num_partitions] + [
      len(s.device_set) for s in shardings if hasattr(s, "device_set")])


def ensure_cpu_devices(n: int) -> None:
  """Ask for ``n`` fake CPU devices, if the backend is not up yet."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def partition_stablehlo_text(path: str, text: str, num_partitions: int) -> ir.Module:
  """Partition a sharded StableHLO module file with XLA on CPU devices."""
  ensure_cpu_devices(max(num_partitions, 8))
  import jax
  from jax._src import compiler
  from jax._src.interpreters import mlir as jax_mlir
  from jaxlib.mlir import ir as mlir_ir
  devices = jax.devices("cpu")
  if len(devices) < num_partitions:
    raise InputError(path, f"needs {num_partitions} devices to partition; this process has "
                     f"{len(devices)} (set XLA_FLAGS=--xla_force_host_platform_device_count="
                     f"{num_partitions} before starting)")
  backend = devices[0].client
  with tempfile.TemporaryDirectory(prefix="gg-hlo-") as tmp:
    with jax_mlir.make_ir_context():
      module = mlir_ir.Module.parse(text)
      options = compiler.get_compile_options(
          num_replicas=1, num_partitions=num_partitions,
          device_assignment=[devices[:num_partitions]])  # (replicas x partitions)
      # (Set on the build options: jax 0.10 dropped these keywords.)
      options.executable_build_options.use_spmd_partitioning = True
      options.executable_build_options.use_shardy_partitioner = True
      debug = options.executable_build_options.debug_options
      debug.xla_dump_to = tmp
      debug.xla_dump_hlo_pass_re = DUMP_OPTIONS["xla_dump_hlo_pass_re"]
      debug.xla_dump_hlo_as_proto = True
      try:
        from jax._src import xla_bridge
        backend.compile_and_load(
            jax_mlir.module_to_bytecode(module),
            xla_bridge.get_device_list(devices[:num_partitions]) if hasattr(
                xla_bridge, "get_device_list") else devices[:num_partitions], options)
      except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(path, f"XLA could not partition this module: {first}") from None
    module = partitioned_from_dump(tmp, path)
  module.num_partitions = num_partitions  # (a proto does not record it)
  return module
