"""Rows written back into place and summed over ranks (passes/write_backs.py):
the gradient of a replicated table whose chunks each rank cut out.  Written
back where they came from and summed once, they are the whole table; at
other rows, over each other, or summed over ranks holding the same rows,
they are not proved."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo import ir
from graphguard_hlo.api import _abstract_args, verify
from graphguard_hlo.lowering import lower_distributed, lower_sequential
from graphguard_hlo.interpret import Unsupported
from graphguard_hlo.passes.write_backs import MIXED, ZERO, _reshaped, _scattered
from graphguard_hlo.relation_check import verify_and_check
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("cp",))
T = jnp.zeros((16, 8))
ZIGZAG = ((0, 7), (1, 6), (2, 5), (3, 4))      # rank r: chunks r and 7 - r
CONTIGUOUS = ((0, 1), (2, 3), (4, 5), (6, 7))


def _chunk_number(table, j, axis="cp"):
  """Rank r's j-th chunk, ``table[r][j]``, as arithmetic of the rank (an
  array constant would be an operand of the program)."""
  r = lax.axis_index(axis)
  return sum(row[j] * (r == k).astype(jnp.int32) for k, row in enumerate(table))


def _cut(t, table, axis="cp"):
  size = t.shape[0] // (len(table) * len(table[0]))
  return jnp.concatenate([lax.dynamic_slice_in_dim(t, _chunk_number(table, j, axis) * size,
                                                   size, 0) for j in range(len(table[0]))])


def _written_back(rows, like, table, axis="cp"):
  """``rows`` (the rank's chunks, in the table's order) written at their
  chunks' places in zeros shaped ``like``."""
  size = rows.shape[0] // len(table[0])
  out = jnp.zeros_like(like)
  for j in range(len(table[0])):
    out = lax.dynamic_update_slice_in_dim(out, rows[j * size:(j + 1) * size],
                                          _chunk_number(table, j, axis) * size, 0)
  return out


def _chunk_numbers(table, axis="cp"):
  """Rank r's chunk numbers ``table[r]``, as an int vector computed from the rank."""
  return jnp.stack([_chunk_number(table, j, axis) for j in range(len(table[0]))])


def _taken(t, table, axis="cp"):
  """``_cut`` as Megatron writes it: the rows viewed as chunks, the rank's
  taken by index (a gather), viewed as rows again."""
  chunks = t.reshape((len(table) * len(table[0]), -1) + t.shape[1:])
  return jnp.take(chunks, _chunk_numbers(table, axis), axis=0).reshape((-1,) + t.shape[1:])


def _scattered_back(rows, like, table, axis="cp"):
  """``_written_back`` as the gather's transpose writes it: the rank's chunks
  scatter-added into zeros viewed as chunks."""
  n = len(table) * len(table[0])
  chunks = jnp.zeros((n, like.shape[0] // n) + like.shape[1:], like.dtype)
  mine = rows.reshape((len(table[0]), -1) + rows.shape[1:])
  return chunks.at[_chunk_numbers(table, axis)].add(mine).reshape(like.shape)


def _seq(t):
  return jnp.tanh(t) * 3.0


def _by_hand(cut=ZIGZAG, back=ZIGZAG, sum_over="cp", by_index=False):
  take, put = (_taken, _scattered_back) if by_index else (_cut, _written_back)

  def local(t):
    return lax.psum(put(_seq(take(t, cut)), t, back), sum_over)
  return local


def _by_autodiff(t):
  """The cut's transpose as jax writes it: one chunk updated into zeros, the
  other a select over ranks of pads, each summed, then added."""
  rows, write_back = jax.vjp(lambda t: _cut(t, ZIGZAG), t)
  return write_back(_seq(rows))[0]


def _by_index_autodiff(t):
  """Chunks taken by index; the gather's transpose (a scatter-add into zeros
  viewed as chunks, summed) writes them back."""
  rows, write_back = jax.vjp(lambda t: _taken(t, ZIGZAG), t)
  return write_back(_seq(rows))[0]


def _proved_and_checked(local, mesh=MESH, spec=P(), out_spec=P(), t=T):
  dist = shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=out_spec)
  assert outputs_agree(_seq, dist, t)
  result, check = verify_and_check(lower_sequential(_seq, t), lower_distributed(
      dist, *_abstract_args((t,), mesh, (spec,))))
  assert result.refines and check.ok and check.unknown == 0, (result, check.failures[:3])
  return result


def _not_proved(local, mesh=MESH, spec=P(), out_spec=P(), t=T, check_vma=True):
  dist = shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=out_spec, check_vma=check_vma)
  assert not outputs_agree(_seq, dist, t)
  result = verify(_seq, dist, t)
  assert not result.refines
  return result


@pytest.mark.parametrize("local", [_by_hand(), _by_hand(cut=((0, 5), (4, 1), (2, 3), (7, 6)),
                                                         back=((0, 5), (4, 1), (2, 3), (7, 6))),
                                   _by_hand(cut=CONTIGUOUS, back=CONTIGUOUS), _by_autodiff],
                         ids=["zigzag_by_hand", "any_table_by_hand", "contiguous_by_hand",
                              "zigzag_by_autodiff"])
def test_rows_written_back_where_they_were_cut_are_proved(local):
  _proved_and_checked(local)


def test_rows_written_back_in_another_order_are_reported_at_the_output():
  result = _not_proved(_by_hand(back=CONTIGUOUS))
  assert result.failure.op_name == "output"
  assert "is laid out as chunks[dim0: 0 7 1 6 2 5 3 4](replica(out@r))" in result.failure.diagnosis
  assert "in another order" in result.failure.diagnosis


def test_rows_written_over_each_other_are_not_proved():
  # Both chunks at the first chunk's place: the second overwrites the first,
  # and the rows of chunks 4..7 stay zero.
  result = _not_proved(_by_hand(back=((0, 0), (1, 1), (2, 2), (3, 3))))
  assert result.failure.op_name == "output"


def test_rows_never_summed_are_not_proved():
  result = _not_proved(lambda t: _written_back(_seq(_cut(t, ZIGZAG)), t, ZIGZAG),
                       check_vma=False)
  assert result.failure.op_name == "output"


def test_rows_summed_over_ranks_holding_the_same_rows_are_not_proved():
  # dp replicates the table: summed over dp too, every row counts twice
  # (jax's varying-axes check refuses this psum: only its old semantics take it).
  mesh = mesh_of((2, 4), ("dp", "cp"))
  result = _not_proved(_by_hand(sum_over=("dp", "cp")), mesh=mesh, check_vma=False)
  assert result.failure.op_name == "output"


def test_rows_of_a_tile_of_another_dim_are_written_back_within_it():
  mesh = mesh_of((2, 4), ("dp", "cp"))
  _proved_and_checked(_by_hand(), mesh=mesh, spec=P(None, "dp"), out_spec=P(None, "dp"))


def test_rows_summed_across_tiles_of_another_dim_are_not_proved():
  # dp splits the columns: summing over dp adds the two halves' columns.
  mesh = mesh_of((2, 4), ("dp", "cp"))
  dist = shard_map(_by_hand(sum_over=("dp", "cp")), mesh=mesh, in_specs=(P(None, "dp"),),
                   out_specs=P(None, "dp"), check_vma=False)
  assert not outputs_agree(_seq, dist, T)
  assert not verify(_seq, dist, T).refines


@pytest.mark.parametrize("local", [_by_index_autodiff, _by_hand(by_index=True),
                                   _by_hand(cut=((0, 5), (4, 1), (2, 3), (7, 6)),
                                            back=((0, 5), (4, 1), (2, 3), (7, 6)),
                                            by_index=True)],
                         ids=["zigzag_by_autodiff", "zigzag_by_hand", "any_table_by_hand"])
def test_rows_taken_by_index_and_scattered_back_are_proved(local):
  _proved_and_checked(local)


def test_rows_scattered_back_within_a_tile_of_another_dim_are_proved():
  mesh = mesh_of((2, 4), ("dp", "cp"))
  _proved_and_checked(_by_hand(by_index=True), mesh=mesh, spec=P(None, "dp"),
                      out_spec=P(None, "dp"))


def test_rows_scattered_back_in_another_order_are_reported_at_the_output():
  result = _not_proved(_by_hand(back=CONTIGUOUS, by_index=True))
  assert result.failure.op_name == "output"
  assert "in another order" in result.failure.diagnosis


@pytest.mark.parametrize("back", [((0, 0), (1, 1), (2, 2), (3, 3)),   # added onto each other
                                  ((0, 8), (1, 9), (2, 10), (3, 11))],  # past the end: dropped
                         ids=["onto_each_other", "past_the_end"])
def test_rows_scattered_onto_each_other_or_past_the_end_are_not_proved(back):
  result = _not_proved(_by_hand(back=back, by_index=True))
  assert result.failure.op_name == "output"


def test_rows_scattered_across_the_columns_are_not_proved():
  # The chunks' columns are scattered at an offset computed from the rank
  # (half the columns each): an index addressing a dim the rows keep whole.
  def local(t):
    rows = _seq(_taken(t, ZIGZAG)).reshape(2, 2, 8)[..., :4]
    half = (lax.axis_index("cp") % 2) * 4
    at = jnp.stack([_chunk_numbers(ZIGZAG), jnp.full((2,), half)], axis=1)
    out = lax.scatter_add(jnp.zeros((8, 2, 8)), at, rows, lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2), inserted_window_dims=(0,),
        scatter_dims_to_operand_dims=(0, 2)))
    return lax.psum(out.reshape(16, 8), "cp")
  result = _not_proved(local)
  assert result.failure.op_name == "output"


@pytest.mark.parametrize("by_index", [False, True], ids=["updated", "scattered"])
@pytest.mark.parametrize("seed", range(6))
def test_proved_exactly_when_the_rows_go_back_where_they_came_from(seed, by_index):
  """Random chunk tables for the cut and the write-back (the same one, the
  same chunks swapped within a rank, or another): the verdict is refines
  exactly when the outputs agree."""
  rng = np.random.default_rng(seed)
  cut = tuple(map(tuple, rng.permutation(8).reshape(4, 2).tolist()))
  back = [cut, tuple(row[::-1] for row in cut),
          tuple(map(tuple, rng.permutation(8).reshape(4, 2).tolist()))][seed % 3]
  dist = shard_map(_by_hand(cut, back, by_index=by_index), mesh=MESH, in_specs=(P(),),
                   out_specs=P())
  assert verify(_seq, dist, T).refines == outputs_agree(_seq, dist, T) == (back == cut)


@pytest.mark.parametrize("seed", range(8))
def test_a_scatters_rows_are_one_row_only_where_one_row_lands(seed):
  """The provenance of a scatter-add against a count by hand: an entry is one
  row where exactly one row lands on it (a zero base, or that row as the
  base), zero where none does, and a mix otherwise.  Random indices with
  repeats, windows of one row or several, bases of rows, zeros and mixes;
  dim 1 kept whole."""
  rng = np.random.default_rng(seed)
  n, m, cols = 6, 5, 3
  width = 1 + seed % 3  # rows per window; one: the window dim inserted
  inserted = width == 1
  dn = (f"#stablehlo.scatter<update_window_dims = {[1] if inserted else [1, 2]}, "
        f"inserted_window_dims = {[0] if inserted else []}, "
        "scatter_dims_to_operand_dims = [0], index_vector_dim = 1>")
  upd_shape = (m, cols) if inserted else (m, width, cols)
  values = [ir.Value(i, ir.TensorType(shape, "f32")) for i, shape in
            enumerate([(n, cols), (m, 1), upd_shape])]
  op = ir.Op("scatter", values, {"scatter_dimension_numbers": dn}, [], ir.Location())
  starts = rng.integers(0, n - width + 1, m)
  some_rows = lambda shape: rng.choice([ZERO, MIXED, *range(20)], shape, p=[
      0.3, 0.1] + [0.6 / 20] * 20).astype(np.int64)
  base = some_rows((n, 1)) if seed % 2 else None
  updates = some_rows(upd_shape[:-1] + (1,))
  got = _scattered(op, base, updates, starts.reshape(m, 1).astype(np.int32))
  for row in range(n):
    landing = [updates[i].reshape(-1)[row - starts[i]] for i in range(m)
               if 0 <= row - starts[i] < width]
    held = [p for p in [ZERO if base is None else base[row, 0], *landing] if p != ZERO]
    want = ZERO if not held else held[0] if held == [held[0]] and held[0] >= 0 else MIXED
    assert got[row, 0] == want, (row, held)


def test_a_reshape_regroups_rows_as_it_regroups_the_elements():
  """A provenance array holds one entry for each dim kept whole: reshaping it
  by ``_reshaped`` and spreading it over the whole dims must give the
  reshape of it spread first.  Random shapes, whole dims and reshapes (split
  a dim, merge neighbours, or any other factorization); refusing is allowed,
  giving another provenance is not."""
  rng = np.random.default_rng(0)
  accepted = refused = 0
  for _ in range(400):
    shape = tuple(int(n) for n in rng.integers(1, 5, rng.integers(2, 5)))
    whole = {i for i in range(len(shape)) if shape[i] > 1 and rng.random() < 0.4}
    rows = rng.integers(0, 1000, [1 if i in whole else n for i, n in enumerate(shape)])
    size, target = int(np.prod(shape)), []
    while size > 1:  # a random factorization of the same size, in some order
      f = int(rng.choice([d for d in range(2, size + 1) if size % d == 0]))
      target.append(f)
      size //= f
    if rng.random() < 0.5:  # or one dim split or two merged, the rest as they were
      i = int(rng.integers(len(shape) - 1))
      target = list(shape[:i]) + [shape[i] * shape[i + 1]] + list(shape[i + 2:])
    values = [ir.Value(0, ir.TensorType(shape, "f32")),
              ir.Value(1, ir.TensorType(tuple(target), "f32"))]
    op = ir.Op("reshape", values[:1], {}, [], ir.Location())
    op.results.append(values[1])
    try:
      got = _reshaped(op, rows)
    except Unsupported:
      refused += 1
      continue
    accepted += 1
    spread = np.broadcast_to(rows, shape).reshape(target)
    np.testing.assert_array_equal(np.broadcast_to(got, target), spread)
  assert accepted > 100 and refused > 20, (accepted, refused)


@pytest.mark.parametrize("declared", ["unique_indices", "indices_are_sorted"])
def test_a_scatter_whose_indices_break_what_it_declares_is_not_proved(declared):
  # XLA may assume what a scatter declares of its indices; where they break
  # it, the result is the implementation's, so the rows are not followed
  # (on CPU these programs happen to compute the right rows).  Declared
  # unique: the early chunk's index again, adding a window of zeros there.
  # Declared sorted: the indices late chunk first, [7 - r, r].
  def local(t):
    rows = _seq(_taken(t, ZIGZAG)).reshape(2, 2, 8)
    at = _chunk_numbers(ZIGZAG)
    if declared == "unique_indices":
      rows = jnp.concatenate([rows, jnp.zeros((1, 2, 8))])
      at = jnp.concatenate([at, at[:1]])
    else:
      rows, at = jnp.concatenate([rows[1:], rows[:1]]), jnp.stack([at[1], at[0]])
    out = jnp.zeros((8, 2, 8)).at[at].add(rows, **{declared: True})
    return lax.psum(out.reshape(16, 8), "cp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(),), out_specs=P())
  assert outputs_agree(_seq, dist, T)
  assert not verify(_seq, dist, T).refines


@pytest.mark.parametrize("shift", ["exp", "convert"])
def test_offsets_computed_through_floats_are_not_proved(shift):
  # 1.0 computed from the rank, then a float op whose result numpy and XLA
  # round differently: exp(2.944439) is 19.0 on XLA's CPU and 18.999998 in
  # numpy (floored: 19 or 18); 3e9 converted to i32 saturates in XLA and
  # wraps in numpy.  Either shifts the write-back by one row on device.
  def offset_shift():
    one = (lax.axis_index("cp") >= 0).astype(jnp.float32)
    if shift == "exp":
      return jnp.floor(jnp.exp(np.float32(2.944439) * one)).astype(jnp.int32) - 18
    return ((3e9 * one).astype(jnp.int32) > 0).astype(jnp.int32)

  def local(t):
    rows, out = _seq(_cut(t, ZIGZAG)), jnp.zeros_like(t)
    for j in range(2):
      out = lax.dynamic_update_slice_in_dim(out, rows[2 * j:2 * j + 2],
                                            _chunk_number(ZIGZAG, j) * 2 + offset_shift(), 0)
    return lax.psum(out, "cp")
  result = _not_proved(local)
  assert result.failure.op_name == "output"


def test_a_source_whose_tile_has_other_dims_is_passed_over():
  # The rows' source here is a [1, 4] max whose sequential value keeps its
  # unit dim differently (once crashed naming rows off a dim the tile lacks).
  mesh = mesh_of((2, 4), ("a", "b"))

  def seq(x):
    return jnp.max(x, 0, keepdims=True)
  dist = shard_map(lambda x: lax.psum(lax.pmax(jnp.max(x, 0, keepdims=True), "b"), "a") * 0.5,
                   mesh=mesh, in_specs=(P("b"),), out_specs=P(), check_vma=False)
  x = jnp.zeros((8, 4))
  assert outputs_agree(seq, dist, x)
  assert verify(seq, dist, x).refines
