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

from graphguard_hlo.api import _abstract_args, verify
from graphguard_hlo.lowering import lower_distributed, lower_sequential
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


def _seq(t):
  return jnp.tanh(t) * 3.0


def _by_hand(cut=ZIGZAG, back=ZIGZAG, sum_over="cp"):
  def local(t):
    return lax.psum(_written_back(_seq(_cut(t, cut)), t, back), sum_over)
  return local


def _by_autodiff(t):
  """The cut's transpose as jax writes it: one chunk updated into zeros, the
  other a select over ranks of pads, each summed, then added."""
  rows, write_back = jax.vjp(lambda t: _cut(t, ZIGZAG), t)
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


@pytest.mark.parametrize("seed", range(6))
def test_proved_exactly_when_the_rows_go_back_where_they_came_from(seed):
  """Random chunk tables for the cut and the write-back (the same one, the
  same chunks swapped within a rank, or another): the verdict is refines
  exactly when the outputs agree."""
  rng = np.random.default_rng(seed)
  cut = tuple(map(tuple, rng.permutation(8).reshape(4, 2).tolist()))
  back = [cut, tuple(row[::-1] for row in cut),
          tuple(map(tuple, rng.permutation(8).reshape(4, 2).tolist()))][seed % 3]
  dist = shard_map(_by_hand(cut, back), mesh=MESH, in_specs=(P(),), out_specs=P())
  assert verify(_seq, dist, T).refines == outputs_agree(_seq, dist, T) == (back == cut)
