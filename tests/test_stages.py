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
