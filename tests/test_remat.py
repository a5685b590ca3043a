"""Saved residuals recomputed where they are read (``passes/remat.py``) and
constant loop invariants sunk into the loops (``passes/loop_constants.py``):
the rewritten programs compute what jax does; near misses are left alone;
a scan trained with and without ``jax.checkpoint`` is proved either way, and
a seeded bug is still found."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo import api
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes import loop_constants, remat
from graphguard_hlo.pipeline import prepare_seq
from tools.zoo.cases import mesh_of

L, B, D, H = 3, 4, 8, 16
X = jax.ShapeDtypeStruct((B, D), np.float32)
W1 = jax.ShapeDtypeStruct((L, D, H), np.float32)
W2 = jax.ShapeDtypeStruct((L, H, D), np.float32)


def _layer(x, w):
  """A pre-norm residual block: the plain backward saves the norm's centred
  input, never x itself."""
  w1, w2 = w
  c = x - jnp.mean(x, axis=-1, keepdims=True)
  h = jnp.tanh((c * lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-5)) @ w1)
  return x + h @ w2


def _grads(layer=_layer, policy="none", reverse=False):
  if policy != "none":
    layer = jax.checkpoint(layer, policy=None if policy == "nothing" else
                           jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

  def loss(x, w1, w2):
    y, _ = lax.scan(lambda c, w: (layer(c, w), None), x, (w1, w2), reverse=reverse)
    return jnp.sum(y * y)
  return jax.grad(loss, argnums=(0, 1, 2))


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(a.shape).astype(np.float32) for a in (X, W1, W2)]


def _prepared(fn, *args):
  return prepare_seq(lower_sequential(fn, *args))


def _counting(monkeypatch, module, name):
  """Calls of ``module.name`` record what they return."""
  counts, original = [], getattr(module, name)

  def counted(*args):
    counts.append(original(*args))
    return counts[-1]
  monkeypatch.setattr(module, name, counted)
  return counts


def _runs_as_jax(fn, graph):
  args = _inputs()
  want = jax.jit(fn)(*args)
  env = Interpreter(1).run(graph, [[a] for a in args])
  for v, w in zip(graph.results, jax.tree.leaves(want)):
    w = np.asarray(w)  # f32 round-off, relative to the output's scale
    np.testing.assert_allclose(env[v.id][0], w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def _loops(graph):
  return [op for op in graph.ops if op.name == "while"]


@pytest.mark.parametrize("policy,fires", [("none", True), ("dots", True), ("nothing", False)])
def test_recomputed_rows_compute_what_jax_does(monkeypatch, policy, fires):
  """Without remat, or with matmuls saved, rows are recomputed; full remat
  already saves only the layer's input."""
  counts = _counting(monkeypatch, remat, "rematerialize_saved_rows")
  fn = _grads(policy=policy)
  g = _prepared(fn, X, W1, W2).main
  assert (sum(counts) > 0) == fires
  _runs_as_jax(fn, g)
  # Full remat: the forward loop saves the layer's input and nothing else.
  forward, _ = _loops(g)
  stacks = [v for v in forward.results if v.shape[:1] == (L,) and v.type.rank == 3
            and v.shape[1:] == (B, D)]
  assert len(stacks) == 1, forward.results
  assert not [v for v in forward.results if v.shape[:1] == (L,) and v.shape[1:] == (B, H)]


def test_a_reversed_scan_is_left_alone_and_still_right(monkeypatch):
  """reverse=True writes row N-1-i at iteration i: not the form the pass proves."""
  counts = _counting(monkeypatch, remat, "rematerialize_saved_rows")
  fn = _grads(reverse=True)
  g = _prepared(fn, X, W1, W2).main
  assert sum(counts) == 0
  _runs_as_jax(fn, g)


# -- near misses, by hand --------------------------------------------------------

def _save_then_read(first=0, last=L, write=lambda i: i, row=lambda x, w, i: jnp.tanh(x @ w),
                    read_whole=False, normalized=True, weight_row=lambda k: k):
  """A forward loop saving row i = row(x_i, W[i], i) and the carry x_i, and a
  second loop reading the saved rows back in reverse; with the near misses."""
  def f(x, w1, w2):
    def forward(carry):
      i, x, saved, xs = carry
      w = lax.dynamic_index_in_dim(w1, i, 0, keepdims=False)
      # Indices normalized as jax does by hand, select(i < 0, i + L, i), or
      # not, as scan writes.
      put = lambda stack, v, at: lax.dynamic_update_slice_in_dim(
          stack, v[None], at, 0, allow_negative_indices=normalized)
      saved, xs = put(saved, row(x, w, i), write(i)), put(xs, x, i)
      return i + 1, x + jnp.tanh(x @ w) @ w2[0], saved, xs
    zeros = (jnp.zeros((L, B, H), np.float32), jnp.zeros((L, B, D), np.float32))
    _, y, saved, xs = lax.while_loop(lambda c: c[0] < last, forward, (first, x, *zeros))

    def backward(j, acc):
      k = L - 1 - j
      if read_whole:
        return acc + jnp.sum(saved, axis=0) @ w2[k]
      t = lax.dynamic_index_in_dim(saved, k, 0, keepdims=False)
      return acc + t @ w2[weight_row(k)] + lax.dynamic_index_in_dim(xs, k, 0, keepdims=False)
    return lax.fori_loop(0, L, backward, y)
  return f


def _no_weights(x, w, i):
  return jnp.tanh(jnp.concatenate([x, x], axis=-1))


@pytest.mark.parametrize("kwargs,fires", [
    ({}, True),
    ({"row": _no_weights}, True),
    ({"last": L - 1}, False),                                  # the last row is never written
    ({"last": L - 1, "row": _no_weights}, False),              # (nor a weight row read)
    ({"last": L - 1, "row": _no_weights, "normalized": False}, False),
    ({"first": 1}, False),                                     # nor the first
    ({"write": lambda i: L - 1 - i}, False),                   # rows written reversed
    ({"row": lambda x, w, i: jnp.tanh(x @ w) * i}, False),     # the layer's number as a value
    ({"read_whole": True}, False),                             # the stack read whole
], ids=["saved_rows", "no_weights", "short", "short_no_weights",
    "short_scan_indices", "late_start", "reversed", "reads_counter", "read_whole"])
def test_near_misses_are_left_alone(monkeypatch, kwargs, fires):
  counts = _counting(monkeypatch, remat, "rematerialize_saved_rows")
  fn = _save_then_read(**kwargs)
  g = _prepared(fn, X, W1, W2).main
  assert (sum(counts) > 0) == fires
  _runs_as_jax(fn, g)


# -- constants sunk into loops ---------------------------------------------------------

def _masked_scan(mask_from_param=False):
  def f(x, w1, w2):
    mask = jnp.arange(B)[:, None] >= jnp.arange(H)[None, :] if not mask_from_param else x[:, :1] > 0
    def step(c, w):
      return c + jnp.where(mask, jnp.tanh(c @ w), 0.0) @ w2[0], None
    return lax.scan(step, x, w1)[0]
  return f


def test_a_mask_built_before_the_loop_is_built_in_it(monkeypatch):
  counts = _counting(monkeypatch, loop_constants, "sink_constant_carries")
  fn = _masked_scan()
  g = _prepared(fn, X, W1, W2).main
  assert sum(counts) > 0
  (loop,) = _loops(g)
  assert not [v for v in loop.operands if v.type.dtype == "pred"]
  assert [op for op in loop.regions[1].walk() if op.name == "iota"]
  _runs_as_jax(fn, g)


def test_an_invariant_read_off_a_parameter_stays_a_carry(monkeypatch):
  fn = _masked_scan(mask_from_param=True)
  g = _prepared(fn, X, W1, W2).main
  (loop,) = _loops(g)
  assert [v for v in loop.operands if v.type.dtype == "pred"]
  _runs_as_jax(fn, g)


# -- verified both ways ------------------------------------------------------------------

MESH = mesh_of((4,), ("tp",))
SPECS = (P(), P(None, None, "tp"), P(None, "tp", None))


def _tp_layer(reduce=True):
  def layer(x, w):
    w1, w2 = w
    c = x - jnp.mean(x, axis=-1, keepdims=True)
    h = jnp.tanh((c * lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-5)) @ w1)
    out = h @ w2
    return x + (lax.psum(out, "tp") if reduce else out)
  return layer


def _tp_grads(policy="none", reduce=True):
  return shard_map(_grads(_tp_layer(reduce), policy), mesh=MESH, in_specs=SPECS,
                   out_specs=SPECS, check_vma=reduce)


def _args():
  return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(MESH, s))
          for a, s in zip((X, W1, W2), SPECS)]


@pytest.mark.parametrize("seq_policy,dist_policy", [
    ("none", "nothing"), ("none", "dots"), ("nothing", "none"), ("dots", "nothing")])
def test_scan_trained_with_or_without_remat_is_proved(seq_policy, dist_policy):
  result = api.verify(_grads(policy=seq_policy), jax.jit(_tp_grads(dist_policy)), *_args())
  assert result.refines, result


@pytest.mark.parametrize("seq_policy,dist_policy", [("none", "nothing"), ("nothing", "nothing")])
def test_scan_trained_with_remat_is_proved_under_gspmd(seq_policy, dist_policy):
  """XLA partitions the remat'd program: its barriers and recomputed rows too."""
  dist = jax.jit(_grads(policy=dist_policy),
                 out_shardings=tuple(NamedSharding(MESH, s) for s in SPECS))
  result = api.verify(_grads(policy=seq_policy), dist, *_args())
  assert result.refines, result


def test_a_missing_all_reduce_under_remat_is_reported_in_the_layer():
  result = api.verify(_grads(), jax.jit(_tp_grads("nothing", reduce=False)), *_args())
  assert not result.refines
  assert "(missing all-reduce)" in result.failure.diagnosis, result.failure.diagnosis
  assert result.failure.op_name == "add", result.failure


def test_a_row_read_with_another_layers_weights_is_reported_there():
  """The second loop reads saved row k with the weights of layer k + 1: still
  wrong once the rows are recomputed, and reported in that loop."""
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(MESH, P()))
          for a in (X, W1, W2)]
  seq = _save_then_read()

  def dist(fn):
    return jax.jit(shard_map(fn, mesh=MESH, in_specs=(P(), P(), P()), out_specs=P()))
  assert api.verify(seq, dist(seq), *args).refines
  result = api.verify(seq, dist(_save_then_read(weight_row=lambda k: (k + 1) % L)), *args)
  assert not result.refines
  line = next(i for i, text in enumerate(open(__file__), 1) if "t @ w2[weight_row(k)]" in text)
  assert result.failure.location.line == line, result.failure


@pytest.mark.parametrize("checkpointed", ["seq", "dist"])
def test_a_checkpointed_layer_outside_a_scan_is_proved(checkpointed):
  """jax.checkpoint alone: its optimization barriers are the identity."""
  layer = _tp_layer()
  def loss(layer_fn):
    return jax.grad(lambda x, w1, w2: jnp.sum(layer_fn(x, (w1[0], w2[0])) ** 2),
                    argnums=(0, 1, 2))
  seq_layer = jax.checkpoint(_layer) if checkpointed == "seq" else _layer
  dist_layer = jax.checkpoint(layer) if checkpointed == "dist" else layer
  dist = shard_map(loss(dist_layer), mesh=MESH, in_specs=SPECS, out_specs=SPECS)
  result = api.verify(loss(seq_layer), jax.jit(dist), *_args())
  assert result.refines, result
