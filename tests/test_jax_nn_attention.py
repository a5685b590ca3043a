"""``jax.nn.dot_product_attention``, as Flax and MaxText call it, under
Megatron TP (heads split over 4 ranks): forward and training step, shard_map
and GSPMD, causal or not; the missing all-reduce reported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
B, T, H, D = 2, 8, 4, 8
X = jax.ShapeDtypeStruct((B, T, H * D), jnp.float32)
PARAMS = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in [
    ("wq", (H * D, H, D)), ("wk", (H * D, H, D)), ("wv", (H * D, H, D)), ("wo", (H, D, H * D))]}
HEADS = {"wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp")}
SPECS = (P(), HEADS)


def attention(causal: bool):
  def attend(x, p):
    q, k, v = (jnp.einsum("btc,chd->bthd", x, p[w]) for w in ("wq", "wk", "wv"))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    return jnp.einsum("bthd,hdc->btc", o, p["wo"])
  return attend


def training_step(attend):
  return jax.value_and_grad(lambda x, p: jnp.mean(attend(x, p) ** 2), argnums=1)


@pytest.mark.parametrize("causal", [True, False])
def test_gspmd_forward_and_training_step(causal):
  """XLA's backward transposes a tile whose heads dim is 1 on each rank,
  putting its unit dims in another order than the sequential reshape does."""
  attend = attention(causal)
  result = gg.verify(attend, attend, X, PARAMS, mesh=MESH, in_specs=SPECS, out_specs=P())
  assert result.refines, result
  step = training_step(attend)
  result = gg.verify(step, step, X, PARAMS, mesh=MESH, in_specs=SPECS, out_specs=(P(), HEADS))
  assert result.refines, result


@pytest.mark.parametrize("reduce", [True, False])
def test_shard_map_training_step(reduce):
  attend = attention(True)

  def step(x, p):
    def loss(x, p):
      y = attend(x, p)
      return jnp.mean((jax.lax.psum(y, "tp") if reduce else y) ** 2)
    return jax.value_and_grad(loss, argnums=1)(x, p)
  dist = shard_map(step, mesh=MESH, in_specs=SPECS, out_specs=(P(), HEADS), check_vma=reduce)
  result = gg.verify(training_step(attend), dist, X, PARAMS, mesh=MESH, in_specs=SPECS)
  assert result.refines == reduce, result
  if not reduce:
    assert result.failure.op_name == "multiply"
    assert "a partial sum over 'tp' that is never reduced before this multiply (missing " \
           "all-reduce)" in result.failure.diagnosis
