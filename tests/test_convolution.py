"""Convolutions: a small CNN and a ViT patch embedding, data parallel (images
split over dp) and tensor parallel (output channels split over tp, the next
convolution contracting them), forward and gradients, under shard_map and
GSPMD, each with every relation held on numbers; a gradient not averaged
over dp and an image split along its rows (a window needs its neighbours'
rows) refused.  A depthwise-separable block (MobileNet's), data parallel
and with its channels split over tp.  The reference convolution, grouped
too, is held against XLA's."""

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
    (lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=3),
     (jax.ShapeDtypeStruct((2, 6, 8, 8), jnp.float32),
      jax.ShapeDtypeStruct((9, 2, 3, 3), jnp.float32))),
    (jax.grad(lambda x, k: jnp.sum(jnp.sin(lax.conv_general_dilated(
        x, k, (1, 1), "SAME", feature_group_count=6))), argnums=(0, 1)),
     (jax.ShapeDtypeStruct((2, 6, 8, 8), jnp.float32),
      jax.ShapeDtypeStruct((12, 1, 3, 3), jnp.float32))),
    (lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "VALID", batch_group_count=2),
     (jax.ShapeDtypeStruct((4, 3, 6, 6), jnp.float32),
      jax.ShapeDtypeStruct((4, 3, 3, 3), jnp.float32))),
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


DW = jax.ShapeDtypeStruct((8, 1, 3, 3), jnp.float32)
PW = jax.ShapeDtypeStruct((4, 8, 1, 1), jnp.float32)
FEATURES = jax.ShapeDtypeStruct((8, 8, 8, 8), jnp.float32)


def separable(dw, pw, x):
  """A depthwise 3 x 3 convolution (one group per channel), then a
  pointwise one; its kernel gradients are a batch-grouped convolution and
  a 1 x 1 kernel's flip."""
  y = lax.conv_general_dilated(x, dw, (1, 1), "SAME", feature_group_count=x.shape[1])
  return lax.conv_general_dilated(jax.nn.relu(y), pw, (1, 1), "VALID")


separable_grads = jax.grad(lambda dw, pw, x: jnp.mean(separable(dw, pw, x) ** 2), argnums=(0, 1))


def dp_separable_grads(dw, pw, x):
  return jax.tree.map(lambda g: lax.pmean(g, "dp"), separable_grads(dw, pw, x))


def tp_separable(dw, pw, x):
  """Each rank convolves its own channels, depthwise; the pointwise
  convolution contracts them, a partial sum reduced once."""
  return lax.psum(separable(dw, pw, x), "tp")


def tp_separable_grads(dw, pw, x):
  return jax.grad(lambda dw, pw: jnp.mean(tp_separable(dw, pw, x) ** 2), argnums=(0, 1))(dw, pw)


SEPARABLE_TP = (P("tp"), P(None, "tp"), P(None, "tp"))


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_a_depthwise_separable_block_is_proved_data_and_tensor_parallel(style):
  dp_in, out = (P(), P(), P("dp")), (P("tp"), P(None, "tp"))
  runs = [(separable, separable, MESH, dp_in, P("dp")),
          (separable_grads, dp_separable_grads, MESH, dp_in, (P(), P())),
          (separable, tp_separable, TP, SEPARABLE_TP, P()),
          (separable_grads, tp_separable_grads, TP, SEPARABLE_TP, out)]
  for seq, dist, mesh, specs, out_specs in runs:
    if style == "shard_map":
      result = _verify(seq, shard_map(dist, mesh=mesh, in_specs=specs, out_specs=out_specs,
                                      check_vma=dist is not dp_separable_grads), DW, PW,
                       FEATURES)
    else:
      result = _verify(seq, seq, DW, PW, FEATURES, mesh=mesh, in_specs=specs,
                       out_specs=out_specs)
    assert result.refines, to_text(result, "seq", "dist")


def test_a_depthwise_block_without_its_psum_over_tp_is_reported():
  result = _verify(separable, shard_map(separable, mesh=TP, in_specs=SEPARABLE_TP,
                                        out_specs=P(), check_vma=False), DW, PW, FEATURES)
  assert not result.refines
  assert "partial sum over 'tp' never reduced (missing all-reduce)" in result.failure.diagnosis


def test_depthwise_gradients_not_averaged_over_dp_are_reported():
  result = _verify(separable_grads, shard_map(separable_grads, mesh=MESH,
                                              in_specs=(P(), P(), P("dp")),
                                              out_specs=(P(), P()), check_vma=False),
                   DW, PW, FEATURES)
  assert not result.refines
  assert "partial sum over 'dp' never reduced (missing all-reduce)" in result.failure.diagnosis
