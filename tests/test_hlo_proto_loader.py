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
