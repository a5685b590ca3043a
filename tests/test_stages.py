"""A stack put together from pipeline stages (passes/stages.py): each stage
computes its own rows, pinned there, and the sequential program concatenates
every layer's.  Proved; the near misses (rows in the wrong order, a layer
computed twice) are not."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo.api import verify
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("pp",))
W = jnp.zeros((8, 3, 5))  # 8 layers, 2 per stage


def _layer(w):
  return jnp.tanh(w) * 2


def _seq(w):
  return jnp.concatenate([_layer(w[l:l + 1]) for l in range(8)])


def _dist(slots=(0, 1)):
  def local(w):
    return jnp.concatenate([_layer(w[i:i + 1]) for i in slots])
  return shard_map(local, mesh=MESH, in_specs=P("pp"), out_specs=P("pp"))


def _agree(dist) -> bool:
  return outputs_agree(_seq, dist, W)


def test_stages_rows_concatenated_are_the_stack():
  assert _agree(_dist())
  result = verify(_seq, _dist(), W)
  assert result.refines, result
  assert "concat[dim0:pp]" in str(result)


@pytest.mark.parametrize("slots,where", [((1, 0), "concatenate"), ((0, 0), "slice")],
                         ids=["rows_swapped", "layer_twice"])
def test_rows_out_of_place_are_not_proved(slots, where):
  """Swapped, every layer is computed but not where the stack has it; twice,
  layer 1's rows are never read (its slice is the first unrelated value)."""
  assert not _agree(_dist(slots))
  result = verify(_seq, _dist(slots), W)
  assert not result.refines
  assert result.failure.op_name == where


def test_rows_of_the_previous_stage_are_not_proved():
  """Each stage concatenates the rows its neighbour sent: every operand is
  known, but at the next stage, not its own."""
  ring = [(i, (i + 1) % 4) for i in range(4)]

  def local(w):
    return jnp.concatenate([lax.ppermute(_layer(w[i:i + 1]), "pp", ring) for i in (0, 1)])
  dist = shard_map(local, mesh=MESH, in_specs=P("pp"), out_specs=P("pp"))
  assert not _agree(dist)
  assert not verify(_seq, dist, W).refines


def test_one_layer_per_stage():
  w = jnp.zeros((4, 3))
  seq = lambda w: jnp.concatenate([_layer(w[l:l + 1]) for l in range(4)])
  dist = shard_map(lambda w: _layer(w[0:1]), mesh=MESH, in_specs=P("pp"), out_specs=P("pp"))
  assert verify(seq, dist, w).refines


def _summed_then_zeros(zero_term, count: int):
  """Each stage's row as a sum of terms masked per stage, then ``count``
  terms ``zero_term(stage, row)`` that are zero at every stage."""
  def local(w):
    stage = lax.axis_index("pp")
    acc = jnp.zeros((1, 3))
    for s in range(4):
      acc = acc + jnp.where(stage == s, _layer(w[0:1]), 0.0)
    for _ in range(count):
      acc = acc + zero_term(stage, _layer(w[0:1]))
    return acc[None]
  return shard_map(local, mesh=MESH, in_specs=P("pp"), out_specs=P(None, "pp"))


def _stacked_seq(w):
  return jnp.concatenate([_layer(w[l:l + 1]) for l in range(4)])[None]


def test_a_stage_sum_before_and_after_adding_zeros_is_joined():
  """The sums before and after adding zeros (``x * 0``) are different
  per-device values related alike at every stage (8 of them), and the program
  concatenates the last.  (Joining only the first one found, as this pass
  once did, proved it for 1 order of those classes in 8.)"""
  w = jnp.zeros((4, 3))
  dist = _summed_then_zeros(lambda stage, x: x * 0.0, 4)
  assert outputs_agree(_stacked_seq, dist, w)
  result = verify(_stacked_seq, dist, w)
  assert result.refines, result


def test_terms_masked_on_no_stage_are_folded():
  """``where(stage > 7, x, 0)`` is zero on every partition: folded (rank
  cases), the sum has no 12 equal values to choose from (beyond the join's
  cap on choices), and the stack is joined."""
  w = jnp.zeros((4, 3))
  dist = _summed_then_zeros(lambda stage, x: jnp.where(stage > 7, x, 0.0), 12)
  assert outputs_agree(_stacked_seq, dist, w)
  result = verify(_stacked_seq, dist, w)
  assert result.refines, result
