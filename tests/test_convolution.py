"""Convolutions: a small CNN and a ViT patch embedding, data parallel (images
split over dp) and tensor parallel (output channels split over tp, the next
convolution contracting them), forward and gradients, under shard_map and
GSPMD, each with every relation held on numbers; a gradient not averaged
over dp and an image split along its rows (a window needs its neighbours'
rows) refused.  The reference convolution is held against XLA's."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.report import to_text

MESH = Mesh(np.array(jax.devices()[:4]), ("dp",))
TP = Mesh(np.array(jax.devices()[:4]), ("tp",))
IMAGES = jax.ShapeDtypeStruct((8, 3, 16, 16), jnp.float32)
K1 = jax.ShapeDtypeStruct((8, 3, 3, 3), jnp.float32)
K2 = jax.ShapeDtypeStruct((4, 8, 3, 3), jnp.float32)
PATCHES = jax.ShapeDtypeStruct((16, 3, 4, 4), jnp.float32)


def conv(x, k, stride=(1, 1), padding="SAME"):
  return lax.conv_general_dilated(x, k, stride, padding)


def cnn(k1, k2, x):
  return conv(jax.nn.relu(conv(x, k1)), k2)


def cnn_loss(k1, k2, x):
  return jnp.mean(cnn(k1, k2, x) ** 2)


def vit_tokens(k, x):
  """Patches of 4 x 4 as tokens: a strided convolution, then [batch, tokens, dim]."""
  y = conv(x, k, (4, 4), "VALID")
  return jnp.tanh(y.reshape(y.shape[0], y.shape[1], -1).transpose(0, 2, 1))


grads = jax.grad(cnn_loss, argnums=(0, 1))


def _verify(seq, dist, *args, **kw):
  result = gg.verify(seq, dist, *args, check_relations=True, **kw)
  assert result.relation_check is None or not result.relation_check.failures
  return result


@pytest.mark.parametrize("fn, args", [
    (lambda x, k: conv(x, k), (IMAGES, K1)),
    (lambda x, k: conv(x, k, (2, 1), ((1, 2), (0, 1))), (IMAGES, K1)),
    (jax.grad(lambda x, k: jnp.sum(jnp.sin(conv(x, k, (2, 2), "VALID"))), argnums=(0, 1)),
     (IMAGES, K1)),
    (lambda x, k: lax.conv_general_dilated(x, k, (1,), "SAME",
                                           dimension_numbers=("NWC", "WIO", "NWC")),
     (jax.ShapeDtypeStruct((2, 10, 3), jnp.float32), jax.ShapeDtypeStruct((3, 3, 4),
                                                                           jnp.float32))),
])
def test_the_reference_convolves_as_xla_does(fn, args):
  rng = np.random.default_rng(0)
  values = [rng.standard_normal(a.shape).astype(np.float32) for a in args]
  module = lower_sequential(fn, *args)
  inline_calls(module)
  env = Interpreter().run(module.main, [[v] for v in values])
  for r, want in zip(module.main.results, jax.tree.leaves(jax.jit(fn)(*values))):
    np.testing.assert_allclose(env[r.id][0], np.asarray(want), rtol=2e-5, atol=2e-5)


def dp_grads(k1, k2, x):
  return jax.tree.map(lambda g: lax.pmean(g, "dp"), grads(k1, k2, x))


DP = (P(), P(), P("dp"))


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_a_data_parallel_cnn_forward_and_gradients_are_proved(style):
  for seq, dist, out in ((cnn, cnn, P("dp")), (grads, dp_grads, (P(), P()))):
    if style == "shard_map":  # (check_vma=False: jax would psum the weights' cotangents)
      result = _verify(seq, shard_map(dist, mesh=MESH, in_specs=DP, out_specs=out,
                                      check_vma=False), K1, K2, IMAGES)
    else:
      result = _verify(seq, seq, K1, K2, IMAGES, mesh=MESH, in_specs=DP, out_specs=out)
    assert result.refines, to_text(result, "seq", "dist")


def test_a_vit_patch_embedding_is_proved_data_parallel():
  result = _verify(vit_tokens, shard_map(vit_tokens, mesh=MESH, in_specs=(P(), P("dp")),
                                         out_specs=P("dp")), PATCHES, IMAGES)
  assert result.refines, to_text(result, "seq", "dist")


def tp_cnn(k1, k2, x):
  """The first convolution's output channels split over tp; the second
  contracts them, a partial sum reduced once."""
  return lax.psum(cnn(k1, k2, x), "tp")


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_output_channels_split_over_tp_are_proved(style):
  specs = (P("tp"), P(None, "tp"), P())
  if style == "shard_map":
    result = _verify(cnn, shard_map(tp_cnn, mesh=TP, in_specs=specs, out_specs=P()), K1, K2,
                     IMAGES)
  else:
    result = _verify(cnn, cnn, K1, K2, IMAGES, mesh=TP, in_specs=specs, out_specs=P())
  assert result.refines, to_text(result, "seq", "dist")


def test_gradients_not_averaged_over_dp_are_reported():
  result = _verify(grads, shard_map(grads, mesh=MESH, in_specs=DP, out_specs=(P(), P()),
                                    check_vma=False), K1, K2, IMAGES)
  assert not result.refines
  assert "partial sum over 'dp' never reduced (missing all-reduce)" in result.failure.diagnosis


def test_images_split_along_their_rows_are_refused_at_the_convolution():
  """Each rank convolves its own rows: the windows at the tile's edges miss
  their neighbours' rows (no halo exchange)."""
  def first_layer(k1, x):
    return conv(x, k1)
  rows = P(None, None, "dp")
  result = _verify(first_layer, shard_map(first_layer, mesh=MESH, in_specs=(P(), rows),
                                          out_specs=rows), K1, IMAGES)
  assert not result.refines and result.failure.op_name == "convolution"
  assert result.failure.location.line == inspect.getsourcelines(conv)[1] + 1
