"""Mixture-of-experts MLPs on ``lax.ragged_dot`` (tokens sorted by expert,
group sizes per expert), experts' hidden dim split over tp: jax lowers a
ragged dot on CPU into a masked dense one over an exclusive cumsum of the
group sizes (a slice of zeros concatenated in front).  Forward and weight
gradients proved under shard_map and GSPMD; the missing psum and group sizes
in another expert order refused.  Also ``jnp.flip`` (``reverse``), which
the reversed group sizes read."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.report import to_text

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
T, D, F, E = 16, 8, 32, 4
ARGS = (jax.ShapeDtypeStruct((T, D), jnp.float32), jax.ShapeDtypeStruct((E, D, F), jnp.float32),
        jax.ShapeDtypeStruct((E, F, D), jnp.float32), jax.ShapeDtypeStruct((E,), jnp.int32))
TP = (P(), P(None, None, "tp"), P(None, "tp", None), P())
GRADS = (P(None, None, "tp"), P(None, "tp", None))


def moe_mlp(x, w1, w2, sizes):
  h = jax.nn.relu(lax.ragged_dot(x, w1, sizes))
  return lax.ragged_dot(h, w2, sizes)


def loss(x, w1, w2, sizes):
  return jnp.mean(moe_mlp(x, w1, w2, sizes) ** 2)


def tp_forward(x, w1, w2, sizes):
  return lax.psum(moe_mlp(x, w1, w2, sizes), "tp")


def tp_loss(x, w1, w2, sizes):
  return jnp.mean(tp_forward(x, w1, w2, sizes) ** 2)


grads = jax.grad(loss, argnums=(1, 2))


def _verify(seq, dist, args=ARGS, **kw):
  return gg.verify(seq, dist, *args, check_relations=True, **kw)


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_tensor_parallel_ragged_moe_forward_and_weight_gradients(style):
  for seq, dist, out in ((moe_mlp, tp_forward, P()),
                         (grads, jax.grad(tp_loss, argnums=(1, 2)), GRADS)):
    if style == "shard_map":
      result = _verify(seq, shard_map(dist, mesh=MESH, in_specs=TP, out_specs=out))
    else:
      result = _verify(seq, seq, mesh=MESH, in_specs=TP, out_specs=out)
    assert result.refines, to_text(result, "seq", "dist")


def test_a_missing_psum_after_the_ragged_dot_is_reported():
  dist = shard_map(moe_mlp, mesh=MESH, in_specs=TP, out_specs=P(), check_vma=False)
  result = _verify(moe_mlp, dist)
  assert not result.refines
  assert "output 0 is a partial sum over 'tp' never reduced (missing all-reduce)" in \
      result.failure.diagnosis


def test_group_sizes_in_another_expert_order_are_reported_at_the_cumsum():
  def reversed_sizes(x, w1, w2, sizes):
    return tp_forward(x, w1, w2, sizes[::-1])
  result = _verify(moe_mlp, shard_map(reversed_sizes, mesh=MESH, in_specs=TP, out_specs=P()))
  assert not result.refines and result.failure.op_name == "reduce_window"
  assert result.failure.location.line == inspect.getsourcelines(moe_mlp)[1] + 1
  assert "it is a reverse (dimensions [0]) of" in result.failure.diagnosis
  assert "(argument 3, sizes) as replica(d@r)" in result.failure.diagnosis


@pytest.mark.parametrize("dim, refines", [(1, True), (0, False)])
def test_a_flip_along_a_whole_dim_is_proved_and_along_the_split_one_is_not(dim, refines):
  """Rows split over tp: flipping the columns flips each rank's tile; flipping
  the rows also swaps the tiles between ranks, which each rank alone cannot."""
  def f(x):
    return jnp.tanh(jnp.flip(x, dim))
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  result = _verify(f, shard_map(f, mesh=MESH, in_specs=P("tp"), out_specs=P("tp")), (x,))
  assert result.refines == refines, to_text(result, "seq", "dist")
  if not refines:
    assert result.failure.op_name == "reverse"
