"""A fused q|k|v projection under tensor parallelism, as users write it.

Split by heads within each of q, k and v (the weight as [d, 3, h], heads
split), it is proved under shard_map and GSPMD.  Split as one [d, 3h] weight
by columns, each rank's third of its columns is not its heads of q: under
shard_map that is the classic bug, reported at the split's slice with the
windows each rank really takes; under GSPMD, XLA reshards it correctly by
exchanging parts of tiles, followed rank by rank and proved."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.report import to_text

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
HEADS, HEAD_DIM = 4, 4
WIDTH = HEADS * HEAD_DIM
X = jax.ShapeDtypeStruct((2, 8, WIDTH), jnp.float32)
W_OUT = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)


def attention(q, k, v):
  b, s, _ = q.shape
  q, k, v = (t.reshape(b, s, -1, HEAD_DIM) for t in (q, k, v))
  w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0, -1)
  return jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, -1)


def by_parts(x, w, w_out):
  qkv = jnp.einsum("bsd,dte->bste", x, w)
  return attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]) @ w_out


def as_one(x, w, w_out):
  q, k, v = jnp.split(x @ w, 3, -1)
  return attention(q, k, v) @ w_out


def _tp(block, specs):
  return shard_map(lambda *a: jax.lax.psum(block(*a), "tp"), mesh=MESH, in_specs=specs,
                   out_specs=P(), check_vma=False)


PARTS = (P(), P(None, None, "tp"), P("tp", None))
ONE = (P(), P(None, "tp"), P("tp", None))
W_PARTS = jax.ShapeDtypeStruct((WIDTH, 3, WIDTH), jnp.float32)
W_ONE = jax.ShapeDtypeStruct((WIDTH, 3 * WIDTH), jnp.float32)


def test_qkv_split_by_heads_within_each_part_is_proved():
  for dist in (_tp(by_parts, PARTS), by_parts):
    kw = {} if dist is not by_parts else {"out_specs": P()}
    result = gg.verify(by_parts, dist, X, W_PARTS, W_OUT, mesh=MESH, in_specs=PARTS, **kw)
    assert result.refines, to_text(result, "seq", "dist")


def test_a_fused_weight_split_as_one_is_reported_at_the_split():
  result = gg.verify(as_one, _tp(as_one, ONE), X, W_ONE, W_OUT, mesh=MESH, in_specs=ONE)
  assert not result.refines
  f = result.failure
  assert f.op_name == "slice", to_text(result, "seq", "dist")
  assert ("cuts [0, 4) out of every rank's tile, that is [0, 4), [12, 16), [24, 28), "
          "[36, 40) of the whole") in f.diagnosis and "fused q|k|v" in f.diagnosis


def test_gspmd_resharding_a_fused_weights_split_is_proved():
  """XLA reshards each third across the tiles: slices of each rank's tile,
  half permutes, selects and dynamic slices on the partition id, followed rank
  by rank (``RankTables.sliced``); the relations hold on numbers."""
  result = gg.verify(as_one, as_one, X, W_ONE, W_OUT, mesh=MESH, in_specs=ONE, out_specs=P(),
                     check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")


def test_gspmd_with_q_and_k_taken_in_the_wrong_order_is_refused():
  def swapped(x, w, w_out):
    k, q, v = jnp.split(x @ w, 3, -1)
    return attention(q, k, v) @ w_out
  result = gg.verify(as_one, swapped, X, W_ONE, W_OUT, mesh=MESH, in_specs=ONE, out_specs=P())
  assert not result.refines


def test_a_reshard_not_followed_is_said_to_be_a_limitation(monkeypatch):
  """Where the rank-by-rank walk finds no tiles of the slice (a reshard past
  its reach), the report says the program exchanges parts of tiles, not that
  it has a bug."""
  from graphguard_hlo.passes.rank_tables import RankTables
  monkeypatch.setattr(RankTables, "sliced", lambda self, *a: iter(()))
  result = gg.verify(as_one, as_one, X, W_ONE, W_OUT, mesh=MESH, in_specs=ONE, out_specs=P())
  assert not result.refines and result.failure.op_name == "slice"
  assert "moves parts of the tiles between ranks" in result.failure.diagnosis
  assert "a limitation" in result.failure.diagnosis
