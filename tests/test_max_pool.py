"""Max pooling: its gradient is a ``select_and_scatter``.  A small CNN with
max pools, data parallel (images split over dp) and with channels split over
tp, forward, gradients and an SGD step, under shard_map and GSPMD, each with
every relation held on numbers; gradients not averaged over dp reported,
a 2 x 2 pool of rows split over ranks in even tiles proved, an overlapping
3 x 3 pool of them refused at the pool; an average pool of partial sums
before the psum proved, a max pool of them refused.  The reference's select_and_scatter
is held against XLA's, ties included."""

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

DP = Mesh(np.array(jax.devices()[:4]), ("dp",))
TP = Mesh(np.array(jax.devices()[:4]), ("tp",))
IMAGES = jax.ShapeDtypeStruct((8, 3, 16, 16), jnp.float32)
K1 = jax.ShapeDtypeStruct((8, 3, 3, 3), jnp.float32)
K2 = jax.ShapeDtypeStruct((4, 8, 3, 3), jnp.float32)


def max_pool(y, window=(2, 2), strides=(2, 2), padding="VALID"):
  return lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, *window), (1, 1, *strides), padding)


def conv(x, k):
  return lax.conv_general_dilated(x, k, (1, 1), "SAME")


def cnn(k1, k2, x):
  """A ResNet-like stem (3 x 3 pool, stride 2, padded) and a 2 x 2 pool."""
  y = max_pool(jax.nn.relu(conv(x, k1)), (3, 3), (2, 2), "SAME")
  return max_pool(conv(y, k2))


def cnn_loss(k1, k2, x):
  return jnp.mean(cnn(k1, k2, x) ** 2)


grads = jax.grad(cnn_loss, argnums=(0, 1))


def sgd_step(k1, k2, x):
  return jax.tree.map(lambda p, g: p - 0.1 * g, (k1, k2), grads(k1, k2, x))


def _verify(seq, dist, *args, **kw):
  result = gg.verify(seq, dist, *args, check_relations=True, **kw)
  assert result.relation_check is None or not result.relation_check.failures
  return result


def _pool_grad(window, strides, padding, reducer=lax.max, init=-jnp.inf):
  pool = lambda y: lax.reduce_window(y, init, reducer, window, strides, padding)
  return jax.grad(lambda y: jnp.sum(jnp.sin(pool(y))))


@pytest.mark.parametrize("fn, shape", [
    (_pool_grad((1, 1, 2, 2), (1, 1, 2, 2), "VALID"), (2, 3, 8, 8)),
    (_pool_grad((1, 1, 3, 3), (1, 1, 2, 2), "SAME"), (2, 3, 9, 8)),
    (_pool_grad((1, 1, 3, 3), (1, 1, 1, 1), ((0, 0), (0, 0), (1, 2), (2, 0))), (2, 3, 5, 6)),
    (_pool_grad((1, 1, 2, 2), (1, 1, 2, 2), "VALID", lax.min, jnp.inf), (2, 3, 8, 8)),
    (_pool_grad((2, 3), (1, 2), "SAME"), (6, 7)),
])
def test_the_reference_scatters_to_the_selected_elements_as_xla_does(fn, shape):
  """Values rounded to integers: most windows hold ties, and the first
  greatest element is the one selected."""
  arg = jax.ShapeDtypeStruct(shape, jnp.float32)
  value = np.round(np.random.default_rng(0).standard_normal(shape)).astype(np.float32)
  module = lower_sequential(fn, arg)
  inline_calls(module)
  assert "select_and_scatter" in [op.name for op in module.main.walk()]
  env = Interpreter().run(module.main, [[value]])
  np.testing.assert_allclose(env[module.main.results[0].id][0], np.asarray(jax.jit(fn)(value)),
                             rtol=1e-6, atol=1e-6)


def dp_step(k1, k2, x):
  """As a shard_map user writes it: the loss averaged over dp, so jax's
  autodiff reduces the weights' cotangents itself."""
  g = jax.grad(lambda k1, k2: lax.pmean(cnn_loss(k1, k2, x), "dp"), argnums=(0, 1))(k1, k2)
  return jax.tree.map(lambda p, g: p - 0.1 * g, (k1, k2), g)


def dp_grads(k1, k2, x):
  return jax.tree.map(lambda g: lax.pmean(g, "dp"), grads(k1, k2, x))


IN = (P(), P(), P("dp"))


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_a_data_parallel_cnn_with_max_pools_is_proved(style):
  for seq, dist, out in ((cnn, cnn, P("dp")), (grads, dp_grads, (P(), P())),
                         (sgd_step, dp_step, (P(), P()))):
    if style == "shard_map":
      result = _verify(seq, shard_map(dist, mesh=DP, in_specs=IN, out_specs=out,
                                      check_vma=dist is not dp_grads), K1, K2, IMAGES)
    else:
      result = _verify(seq, seq, K1, K2, IMAGES, mesh=DP, in_specs=IN, out_specs=out)
    assert result.refines, to_text(result, "seq", "dist")


def tp_grads(k1, k2, x):
  """The first convolution's output channels split over tp, pooled each on
  its own rank; the second convolution contracts them (a partial sum,
  reduced before its pool).  Each kernel's gradient is split as it is.
  (jax's varying-axis check makes the psum's transpose the identity.)"""
  def loss(k1, k2):
    y = max_pool(jax.nn.relu(conv(x, k1)), (3, 3), (2, 2), "SAME")
    return jnp.mean(max_pool(lax.psum(conv(y, k2), "tp")) ** 2)
  return jax.grad(loss, argnums=(0, 1))(k1, k2)


TP_IN = (P("tp"), P(None, "tp"), P())


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_channels_split_over_tp_are_proved_through_the_pools(style):
  if style == "shard_map":
    result = _verify(grads, shard_map(tp_grads, mesh=TP, in_specs=TP_IN,
                                      out_specs=(P("tp"), P(None, "tp"))),
                     K1, K2, IMAGES)
  else:
    result = _verify(grads, grads, K1, K2, IMAGES, mesh=TP, in_specs=TP_IN,
                     out_specs=(P("tp"), P(None, "tp")))
  assert result.refines, to_text(result, "seq", "dist")


def test_gradients_not_averaged_over_dp_are_reported():
  result = _verify(grads, shard_map(grads, mesh=DP, in_specs=IN, out_specs=(P(), P()),
                                    check_vma=False), K1, K2, IMAGES)
  assert not result.refines
  assert "partial sum over 'dp' never reduced (missing all-reduce)" in result.failure.diagnosis


def test_images_split_along_their_rows_are_refused_at_the_pool():
  """Each rank pools its own rows: a 3 x 3 window at a tile's edge misses
  its neighbour's row."""
  def stem_grad(y):
    return jax.grad(lambda y: jnp.sum(jnp.sin(max_pool(y, (3, 3), (2, 2), "SAME"))))(y)
  rows = P(None, None, "dp")
  y = jax.ShapeDtypeStruct((2, 8, 16, 16), jnp.float32)
  result = _verify(stem_grad, shard_map(stem_grad, mesh=DP, in_specs=rows, out_specs=rows), y)
  assert not result.refines and result.failure.op_name == "reduce_window"
  assert result.failure.location.line == inspect.getsourcelines(max_pool)[1] + 1


def rows_pool_grad(y):
  """Each rank's rows pooled 2 x 2 and differentiated: no window crosses
  into a neighbour's rows when each rank holds an even number of them."""
  return jax.grad(lambda y: jnp.sum(jnp.sin(max_pool(y))))(y)


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_a_pool_of_rows_split_in_even_tiles_is_proved(style):
  rows = P(None, None, "dp")
  y = jax.ShapeDtypeStruct((2, 8, 16, 16), jnp.float32)
  for fn in (max_pool, rows_pool_grad):
    out = P(None, None, "dp")
    if style == "shard_map":
      result = _verify(fn, shard_map(fn, mesh=DP, in_specs=rows, out_specs=out), y)
    else:
      result = _verify(fn, fn, y, mesh=DP, in_specs=(rows,), out_specs=out)
    assert result.refines, to_text(result, "seq", "dist")


def avg_pool(y):
  return lax.reduce_window(y, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4


def pooled_head(k1, k2, x, pool):
  return pool(conv(jax.nn.relu(conv(x, k1)), k2))


def avg_head(k1, k2, x):
  return pooled_head(k1, k2, x, avg_pool)


def tp_avg_head(k1, k2, x, pool=avg_pool):
  """The second convolution contracts channels split over tp: each rank's
  output is a partial sum, pooled before the psum (an average is linear)."""
  return lax.psum(pooled_head(k1, k2, x, pool), "tp")


@pytest.mark.parametrize("differentiate", [False, True])
def test_an_average_pool_of_partial_sums_before_the_psum_is_proved(differentiate):
  seq, dist = avg_head, tp_avg_head
  if differentiate:
    seq = jax.grad(lambda *a: jnp.mean(avg_head(*a) ** 2), argnums=(0, 1))
    dist = jax.grad(lambda *a: jnp.mean(tp_avg_head(*a) ** 2), argnums=(0, 1))
  out = (P("tp"), P(None, "tp")) if differentiate else P()
  result = _verify(seq, shard_map(dist, mesh=TP, in_specs=TP_IN, out_specs=out), K1, K2, IMAGES)
  assert result.refines, to_text(result, "seq", "dist")


def test_a_max_pool_of_partial_sums_before_the_psum_is_refused_at_the_pool():
  """The max of each rank's partial sums is not the max of their sum."""
  def tp_max_head(k1, k2, x):
    return tp_avg_head(k1, k2, x, max_pool)

  def max_head(k1, k2, x):
    return pooled_head(k1, k2, x, max_pool)

  result = _verify(max_head, shard_map(tp_max_head, mesh=TP, in_specs=TP_IN, out_specs=P()),
                   K1, K2, IMAGES)
  assert not result.refines and result.failure.op_name == "reduce_window"
  assert result.failure.location.line == inspect.getsourcelines(max_pool)[1] + 1
