"""Reordered chunks (passes/chunk_order.py): zig-zag context parallelism's
rows, carried through ops that treat rows alike; the ops that do not, and
rows paired with rows of another order, are not proved."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo import ir
from graphguard_hlo.api import verify
from graphguard_hlo.passes.layout import (Layout, assemble, reorder_chunks,
                                          restore_chunk_order, shard)
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("cp",))
X = jnp.zeros((16, 8))
W = jnp.zeros((8, 8))


def _chunks(x, order, axis="cp"):
  """Rank r's chunks ``order[r]`` (chunk numbers per rank) of x's rows: each
  offset an arithmetic of the rank (an array constant would be an operand)."""
  size = x.shape[0] // (len(order) * len(order[0]))
  r = lax.axis_index(axis)
  pieces = []
  for j in range(len(order[0])):
    chunk = sum(c * (r == k).astype(jnp.int32) for k, c in enumerate(row[j] for row in order))
    pieces.append(lax.dynamic_slice_in_dim(x, chunk * size, size, 0))
  return jnp.concatenate(pieces)


def _zigzag(x, axis="cp", dim=0):
  n = lax.axis_size(axis)
  size = x.shape[dim] // (2 * n)
  r = lax.axis_index(axis)
  return jnp.concatenate([lax.dynamic_slice_in_dim(x, r * size, size, dim),
                          lax.dynamic_slice_in_dim(x, (2 * n - 1 - r) * size, size, dim)], dim)


def _agree(seq, dist, *shapes) -> bool:
  rng = np.random.default_rng(0)
  args = [rng.standard_normal(a.shape).astype(np.float32) for a in shapes]
  return np.allclose(jax.jit(seq)(*args), jax.jit(dist)(*args), rtol=1e-5, atol=1e-5)


def _loss(x, w):
  return jnp.sum(jnp.tanh(x @ w) * jnp.exp(x))


def test_zigzag_rows_through_rowwise_ops_and_a_sum_are_proved():
  dist = shard_map(lambda x, w: lax.psum(_loss(_zigzag(x), w), "cp"), mesh=MESH,
                   in_specs=(P(), P()), out_specs=P())
  assert _agree(_loss, dist, X, W)
  result = verify(_loss, dist, X, W)
  assert result.refines, result


@pytest.mark.parametrize("order", [((3,), (2,), (1,), (0,)),          # reversed shards
                                   ((0, 5), (4, 1), (2, 3), (7, 6))])  # any table
def test_any_order_of_chunks_is_proved(order):
  dist = shard_map(lambda x, w: lax.psum(_loss(_chunks(x, order), w), "cp"), mesh=MESH,
                   in_specs=(P(), P()), out_specs=P())
  assert _agree(_loss, dist, X, W)
  result = verify(_loss, dist, X, W)
  assert result.refines, result


def test_zigzag_under_a_batch_split_over_another_axis_is_proved():
  mesh = mesh_of((2, 4), ("dp", "cp"))
  x3 = jnp.zeros((2, 16, 8))

  def seq(x, w):
    return jnp.sum(jnp.tanh(x @ w))

  def local(x, w):
    return lax.psum(seq(_zigzag(x, dim=1), w), ("dp", "cp"))
  dist = shard_map(local, mesh=mesh, in_specs=(P("dp", None, None), P()), out_specs=P())
  assert _agree(seq, dist, x3, W)
  result = verify(seq, dist, x3, W)
  assert result.refines, result


def test_rows_paired_with_contiguous_rows_are_not_proved():
  def seq(x, y):
    return jnp.sum(x * y)

  def local(x, y):
    mine = lax.dynamic_slice_in_dim(y, lax.axis_index("cp") * 4, 4, 0)
    return lax.psum(jnp.sum(_zigzag(x) * mine), "cp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(), P()), out_specs=P())
  assert not _agree(seq, dist, X, X)
  result = verify(seq, dist, X, X)
  assert not result.refines
  assert result.failure.op_name == "multiply"
  assert "(zig-zag), operand" in result.failure.diagnosis
  assert "in sequence order (contiguous shards)" in result.failure.diagnosis


def test_a_running_sum_along_reordered_rows_is_not_proved():
  def seq(x, w):
    return jnp.sum(jnp.cumsum(x @ w, axis=0) ** 2)
  dist = shard_map(lambda x, w: lax.psum(seq(_zigzag(x), w), "cp"), mesh=MESH,
                   in_specs=(P(), P()), out_specs=P())
  assert not _agree(seq, dist, X, W)
  assert not verify(seq, dist, X, W).refines


def test_reordered_rows_returned_as_they_are_are_not_proved():
  # The output is the rows in zig-zag order: a permutation of the sequential
  # output, which no output relation reads.
  dist = shard_map(lambda x, w: jnp.tanh(_zigzag(x) @ w), mesh=MESH, in_specs=(P(), P()),
                   out_specs=P("cp", None))

  def seq(x, w):
    return jnp.tanh(x @ w)
  assert not _agree(seq, dist, X, W)
  assert not verify(seq, dist, X, W).refines


def _taken(x, chunks_of_rank, axis="cp", roll_columns=False):
  """Megatron's index_select form: x's rows viewed as 8 chunks, the rank's
  taken by index.  ``roll_columns``: the columns also rolled by the rank
  (a gather moving another dim's elements)."""
  r = lax.axis_index(axis)
  chunks = x.reshape((8, x.shape[0] // 8) + x.shape[1:])
  mine = jnp.take(chunks, jnp.stack(chunks_of_rank(r)), axis=0)
  if roll_columns:
    mine = jnp.take(mine, (jnp.arange(x.shape[1]) + r) % x.shape[1], axis=2)
  return mine.reshape((-1,) + x.shape[1:])


def _zigzag_indices(r):
  return [r, 7 - r]


def test_chunks_taken_by_index_are_proved():
  dist = shard_map(lambda x, w: lax.psum(_loss(_taken(x, _zigzag_indices), w), "cp"),
                   mesh=MESH, in_specs=(P(), P()), out_specs=P())
  assert _agree(_loss, dist, X, W)
  result = verify(_loss, dist, X, W)
  assert result.refines, result


@pytest.mark.parametrize("bug", ["roll_columns", "fill"])
def test_chunks_taken_with_other_elements_moved_or_filled_are_not_proved(bug):
  # The rows are the zig-zag chunks either way; but the columns move with
  # the rank, or rank 0 takes index 8, past the end (jnp.take fills it).
  def seq(x, w):
    return jnp.sum(jnp.tanh(x) * w[0])

  indices = (lambda r: [r + 1, 8 - r]) if bug == "fill" else _zigzag_indices
  dist = shard_map(lambda x, w: lax.psum(
      seq(_taken(x, indices, roll_columns=bug == "roll_columns"), w), "cp"),
      mesh=MESH, in_specs=(P(), P()), out_specs=P())
  assert not _agree(seq, dist, X, W)
  assert not verify(seq, dist, X, W).refines


def test_a_fill_naming_an_element_is_not_read_as_that_element():
  # Eight one-token chunks; rank 3 takes index 8, past the end, for its late
  # chunk 4, and jnp.take fills it with 5.0: the probe's id of token 4.  The
  # bounds mask picks the fill there, so the chunk is not token 4 at all.
  def local(t):
    r = lax.axis_index("cp")
    late = jnp.where(r == 3, 8, 7 - r)
    mine = jnp.take(t, jnp.stack([r, late]), mode="fill", fill_value=5.0)
    return lax.psum(jnp.sum(jnp.tanh(mine)), "cp")

  def seq(t):
    return jnp.sum(jnp.tanh(t))
  t = jnp.zeros(8)
  dist = shard_map(local, mesh=MESH, in_specs=(P(),), out_specs=P())
  assert not _agree(seq, dist, t)
  assert not verify(seq, dist, t).refines


@pytest.mark.parametrize("declared_sorted", [False, True])
def test_chunks_taken_late_first_are_proved_unless_declared_sorted(declared_sorted):
  # [7 - r, r] is another chunk table, but not sorted: a gather declaring
  # it sorted computes what XLA's implementation makes of it.
  def local(x, w):
    r = lax.axis_index("cp")
    chunks = x.reshape((8, x.shape[0] // 8) + x.shape[1:])
    mine = jnp.take(chunks, jnp.stack([7 - r, r]), axis=0, indices_are_sorted=declared_sorted)
    return lax.psum(_loss(mine.reshape((-1,) + x.shape[1:]), w), "cp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(), P()), out_specs=P())
  assert _agree(_loss, dist, X, W)
  assert verify(_loss, dist, X, W).refines == (not declared_sorted)


def _cut_by_data(x, form):
  """Zig-zag chunks at offsets, indices or a predicate that also read the
  data (shifted one row, or chunk, or swapped where x[0, 0] > 0): the probe,
  which runs on ids, would see one shift only."""
  r, size = lax.axis_index("cp"), x.shape[0] // 8
  shift = (x[0, 0] > 0).astype(jnp.int32)
  if form == "offset":
    return jnp.concatenate([lax.dynamic_slice_in_dim(x, r * size + shift, size, 0),
                            lax.dynamic_slice_in_dim(x, (7 - r) * size, size, 0)])
  if form == "index":
    chunks = x.reshape((8, size) + x.shape[1:])
    return jnp.take(chunks, (jnp.stack([r, 7 - r]) + shift) % 8, axis=0).reshape(x.shape[0] // 4, -1)
  early = lax.dynamic_slice_in_dim(x, r * size, size, 0)
  late = lax.dynamic_slice_in_dim(x, (7 - r) * size, size, 0)
  flip = x[0, 0] > 0
  return jnp.concatenate([jnp.where(flip, late, early), jnp.where(flip, early, late)])


def _weighted_by_position(x, w):
  return jnp.sum(jnp.tanh(x @ w) * jnp.arange(x.shape[0], dtype=jnp.float32)[:, None])


@pytest.mark.parametrize("form", ["offset", "index", "predicate"])
def test_chunks_cut_at_offsets_read_from_the_data_are_not_proved(form):
  def local(x, w):
    positions = _zigzag(jnp.arange(x.shape[0], dtype=jnp.float32))
    return lax.psum(jnp.sum(jnp.tanh(_cut_by_data(x, form) @ w) * positions[:, None]), "cp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(), P()), out_specs=P())
  assert not _agree(_weighted_by_position, dist, X, W)
  assert not verify(_weighted_by_position, dist, X, W).refines


def test_chunks_cut_at_offsets_from_the_rank_alone_are_proved():
  dist = shard_map(lambda x, w: lax.psum(jnp.sum(jnp.tanh(_zigzag(x) @ w) * _zigzag(
      jnp.arange(x.shape[0], dtype=jnp.float32))[:, None]), "cp"),
      mesh=MESH, in_specs=(P(), P()), out_specs=P())
  assert _agree(_weighted_by_position, dist, X, W)
  assert verify(_weighted_by_position, dist, X, W).refines


def test_chunks_of_a_long_bfloat16_sequence_taken_by_index_are_proved():
  # 1024 rows of bf16 (which holds integers exactly only to 256): the probe's
  # ids are int64 whatever the value's type.
  x = jnp.zeros((1024, 8), jnp.bfloat16)
  w = jnp.zeros((8, 8), jnp.bfloat16)

  def seq(x, w):
    return jnp.sum(jnp.tanh(x @ w).astype(jnp.float32))
  dist = shard_map(lambda x, w: lax.psum(seq(_taken(x, _zigzag_indices), w), "cp"),
                   mesh=MESH, in_specs=(P(), P()), out_specs=P())
  assert verify(seq, dist, x, w).refines


def _ring_gathered(own, passed, axis="cp"):
  """A ring gather's buffer: ``own`` written at the rank's place, then the
  blocks of ``passed`` received round the ring at theirs."""
  n, r = lax.axis_size(axis), lax.axis_index(axis)
  size = own.shape[0]
  buf = lax.dynamic_update_slice_in_dim(jnp.zeros((n * size,) + own.shape[1:]), own, r * size, 0)
  block = passed
  for t in range(1, n):
    block = lax.ppermute(block, axis, [(i, (i + 1) % n) for i in range(n)])
    buf = lax.dynamic_update_slice_in_dim(buf, block, ((r - t) % n) * size, 0)
  return buf


def _scores(x, w):
  return jnp.tanh(x @ w) @ jnp.tanh(x @ w).T


def test_zigzag_rows_gathered_round_a_ring_are_proved():
  def local(x, w):
    q = _zigzag(x)
    return lax.psum(jnp.sum(jnp.tanh(q @ w) @ _ring_gathered(jnp.tanh(q @ w), jnp.tanh(q @ w)).T),
                    "cp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(), P()), out_specs=P())
  seq = lambda x, w: jnp.sum(_scores(x, w))
  assert _agree(seq, dist, X, W)
  assert verify(seq, dist, X, W).refines


def test_a_ring_buffer_of_rows_in_two_orders_is_not_proved():
  # The rank's own block in contiguous order, the blocks passed round in
  # zig-zag order: no order holds of the whole buffer.
  def local(x, w):
    mine = lax.dynamic_slice_in_dim(x, lax.axis_index("cp") * 4, 4, 0)
    keys = _ring_gathered(jnp.tanh(mine @ w), jnp.tanh(_zigzag(x) @ w))
    return lax.psum(jnp.sum(jnp.tanh(_zigzag(x) @ w) @ keys.T), "cp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(), P()), out_specs=P())
  seq = lambda x, w: jnp.sum(_scores(x, w))
  assert not _agree(seq, dist, X, W)
  assert not verify(seq, dist, X, W).refines


@pytest.mark.parametrize("seed", range(5))
def test_reorder_and_restore_are_inverse(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 5)) * 2
  shape = (3, n * int(rng.integers(1, 4)), 2)
  x = rng.standard_normal(shape)
  chunks = tuple(int(c) for c in rng.permutation(n))
  moved = reorder_chunks(x, 1, chunks)
  size = shape[1] // n
  for j, c in enumerate(chunks):
    np.testing.assert_array_equal(moved[:, j * size:(j + 1) * size], x[:, c * size:(c + 1) * size])
  np.testing.assert_array_equal(restore_chunk_order(moved, 1, chunks), x)


@pytest.mark.parametrize("seed", range(5))
def test_a_reordered_layout_shards_and_assembles_back(seed):
  rng = np.random.default_rng(seed)
  mesh = ir.Mesh((("dp", 2), ("cp", 4)))
  layout = Layout(((), ("cp",), ("dp",)), partial=("dp",) if seed % 2 else (),
                  order=((1, tuple(int(c) for c in rng.permutation(8))),))
  if layout.partial:
    layout = layout.with_(dims=((), ("cp",), ()))
  assert layout.is_valid() and not layout.is_plain()
  x = rng.standard_normal((3, 16, 4))
  np.testing.assert_allclose(assemble(layout, mesh, shard(layout, mesh, x, rng)), x, atol=1e-12)
  # The order is part of the relation: without it the tiles rebuild another tensor.
  assert not np.allclose(assemble(layout.with_(order=()), mesh, shard(layout, mesh, x, rng)), x)


def test_an_order_that_is_no_permutation_is_invalid():
  assert not Layout(((), ("cp",)), order=((1, (0, 0, 1, 2)),)).is_valid()
  assert not Layout(((), ("cp",)), order=((2, (1, 0)),)).is_valid()
  assert "chunks[dim1: 0 7 1 6 2 5 3 4](concat[dim1:cp](d@r))" == str(
      Layout(((), ("cp",)), order=((1, (0, 7, 1, 6, 2, 5, 3, 4)),)))
