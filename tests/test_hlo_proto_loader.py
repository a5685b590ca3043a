"""HLO protos keep the replica groups XLA wrote, including mesh device lists
with a transposed device order (XLA's own HLO-to-StableHLO converter drops
the order: a collective over the middle mesh axis came out over the major)."""

import glob
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from graphguard_hlo import xla_partition
from graphguard_hlo.loaders import hlo_proto
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.pipeline import verify_modules


def _sum(x):
  return jnp.sum(x, axis=0)


@pytest.fixture(scope="module")
def middle_axis_proto():
  """sum over rows split on the middle axis "b" of a 2x2x2 mesh, partitioned."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))
  x = jax.ShapeDtypeStruct((4, 8), np.float32, sharding=NamedSharding(mesh, P("b", None)))
  lowered = jax.jit(_sum, out_shardings=NamedSharding(mesh, P())).lower(x)
  with tempfile.TemporaryDirectory() as tmp:
    lowered.compile(compiler_options=dict(xla_partition.DUMP_OPTIONS, xla_dump_to=tmp))
    (path,) = glob.glob(f"{tmp}/*after_spmd-partitioning*.hlo.pb")
    with open(path, "rb") as f:
      return f.read()


def _groups(module):
  return [op.attrs["replica_groups"] for op in module.main.walk() if op.name == "all_reduce"]


def test_mesh_replica_groups_keep_their_device_order(middle_axis_proto):
  # Devices (a, b, c) have id 4a + 2b + c: the groups over "b" pair ids 2 apart.
  assert _groups(hlo_proto.load_hlo_proto("m.pb", middle_axis_proto)) == [
      ((0, 2), (1, 3), (4, 6), (5, 7))]
  # What XLA's converter makes of the same proto (why it is not used).
  assert _groups(hlo_proto.load_hlo_proto_via_converter("m.pb", middle_axis_proto)) == [
      ((0, 4), (1, 5), (2, 6), (3, 7))]


def test_collective_over_the_middle_axis_is_proved(middle_axis_proto):
  seq = lower_sequential(_sum, jax.ShapeDtypeStruct((4, 8), np.float32))
  dist = hlo_proto.load_hlo_proto("m.pb", middle_axis_proto)
  assert verify_modules(seq, dist).refines


# A constant of more elements than XLA prints by default (it elides them as
# {...} unless asked): a proto holds every value, so the loader prints them all.
_TABLE = np.arange(64, dtype=np.float32).reshape(8, 8)


def _times_table(a):
  return a * jnp.asarray(_TABLE)


def _times_other_table(a):
  return a * jnp.asarray(_TABLE[::-1])


def _row_split(fn):
  import graphguard_hlo as gg
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  return gg.verify(_times_table, fn, jnp.zeros((8, 8)), mesh=mesh, in_specs=(P("x"),),
                   out_specs=P("x"))


def test_large_constant_of_a_partitioned_module_is_read_whole():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  x = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
  module = xla_partition.partition_lowered(
      jax.jit(_times_table, out_shardings=NamedSharding(mesh, P("x"))).lower(x))
  values = [np.asarray(op.attrs["value"]) for op in module.main.walk()
            if op.name == "constant" and op.results[0].type.shape == (8, 8)]
  assert any(np.array_equal(v, _TABLE) for v in values)


def test_large_constant_under_gspmd_is_proved_and_another_is_not():
  assert _row_split(_times_table).refines
  result = _row_split(_times_other_table)
  assert not result.refines and result.failure.op_name in ("constant", "multiply")


def test_large_constant_in_the_partitioned_text_dump():
  from graphguard_hlo.loaders.hlo_text import load_hlo_text
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  x = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x")))
  text = xla_partition.partitioned_hlo_text(
      jax.jit(_times_table, out_shardings=NamedSharding(mesh, P("x"))).lower(x))
  assert "{...}" not in text
  module = load_hlo_text("<dump>", text)
  assert any(np.array_equal(np.asarray(op.attrs["value"]), _TABLE) for op in module.main.walk()
             if op.name == "constant" and op.results[0].type.shape == (8, 8))


@pytest.mark.parametrize("same", [True, False])
def test_constants_differing_in_a_nan_payload_are_different(same):
  # Under GSPMD the per-device module is read from XLA's HLO: its NaN printed
  # with the payload, nan(0x400001), read back bit for bit.
  import graphguard_hlo as gg
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  canonical = np.arange(8, dtype=np.float32)
  canonical[3] = np.float32("nan")
  other = canonical.copy()
  if not same:
    other.view(np.uint32)[3] = 0x7FC00001

  def bits_of(table):
    return lambda a: jax.lax.bitcast_convert_type(a + jnp.asarray(table), jnp.int32)
  result = gg.verify(bits_of(canonical), bits_of(other), jnp.zeros(8), mesh=mesh,
                     in_specs=(P("x"),), out_specs=P("x"))
  assert result.refines == same


def test_ops_of_a_proto_keep_their_source_lines(middle_axis_proto):
  """The proto's stack frames (which as_hlo_text does not print) give each
  op the user's line."""
  import inspect
  module = hlo_proto.load_hlo_proto("<pb>", middle_axis_proto)
  line = inspect.getsourcelines(_sum)[1] + 1
  (reduce,) = [op for op in module.main.walk() if op.name == "reduce"]
  assert reduce.location.file == __file__ and reduce.location.line == line
  assert reduce.location.op_name.endswith("reduce_sum")
