"""Activations as ``jax.nn`` writes them, in a Megatron TP block's training
step (a norm, the MLP split over 4 ranks, a cross entropy head).

softplus and mish go through ``jnp.logaddexp(x, 0)``, whose ``x - 0`` XLA's
simplifier drops; exact GELU is ``chlo.erfc``, which shard_map keeps and
XLA expands into a polynomial before partitioning (the sequential program is
given XLA's expansion too: ``chlo_expansion.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
X = jax.ShapeDtypeStruct((4, 8, 32), jnp.float32)
LABELS = jax.ShapeDtypeStruct((4, 8), jnp.int32)
PARAMS = {"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
          "w2": jax.ShapeDtypeStruct((64, 32), jnp.float32),
          "scale": jax.ShapeDtypeStruct((32,), jnp.float32),
          "head": jax.ShapeDtypeStruct((32, 16), jnp.float32)}
WEIGHTS = {"w1": P(None, "tp"), "w2": P("tp", None), "scale": P(), "head": P()}
SPECS = (P(), P(), WEIGHTS)
ACTIVATIONS = {
    "silu": jax.nn.silu, "gelu_tanh": jax.nn.gelu, "relu": jax.nn.relu,
    "softplus": jax.nn.softplus, "mish": lambda h: h * jnp.tanh(jax.nn.softplus(h)),
    "gelu_exact": lambda h: jax.nn.gelu(h, approximate=False)}


def block(act, reduce=lambda y: y):
  def loss(x, labels, p):
    mean = jnp.mean(x, -1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * p["scale"]
    h = x + reduce(act(h @ p["w1"]) @ p["w2"])
    logp = jax.nn.log_softmax(h @ p["head"])
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))
  return jax.value_and_grad(loss, argnums=2)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("reduce", [True, False], ids=["psum", "no_psum"])
def test_shard_map_training_step(name, reduce):
  step = block(ACTIVATIONS[name], (lambda y: jax.lax.psum(y, "tp")) if reduce else
               (lambda y: y))
  dist = shard_map(step, mesh=MESH, in_specs=SPECS, out_specs=(P(), WEIGHTS),
                   check_vma=reduce)
  result = gg.verify(block(ACTIVATIONS[name]), dist, X, LABELS, PARAMS, mesh=MESH,
                     in_specs=SPECS)
  assert result.refines == reduce, result
  if not reduce:
    assert "(missing all-reduce)" in result.failure.diagnosis, result


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_gspmd_training_step(name):
  step = block(ACTIVATIONS[name])
  result = gg.verify(step, step, X, LABELS, PARAMS, mesh=MESH, in_specs=SPECS,
                     out_specs=(P(), WEIGHTS))
  assert result.refines, result
