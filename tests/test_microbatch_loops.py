"""microbatch_loops: a sequential loop over a batch split into one loop per
microbatch, where the body keeps rows apart -- and not where it mixes them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.canonicalize import canonicalize_module
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.microbatch_loops import split_microbatch_loops

B, MICRO, D, LAYERS = 4, 1, 8, 3


def _layers(mix):
  """A scan over layers whose step is ``mix(h, w)``; one source line, so the
  loops of every batch size share a location."""
  def run(h, ws):
    return lax.scan(lambda h, w: (mix(h, w), None), h, ws)[0]
  return run


KEEPS_ROWS = {
    "mlp": lambda h, w: jnp.tanh(h @ w) + h,
    "layernorm": lambda h, w: (h - h.mean(-1, keepdims=True)) @ w,
    "bias_and_scale": lambda h, w: h * w[0] + w[1],
    "attention_over_features": lambda h, w: jax.nn.softmax(
        (h[:, :, None] * h[:, None, :]), axis=-1).sum(-1) @ w,
}
MIXES_ROWS = {
    "batch_mean": lambda h, w: (h - h.mean(0, keepdims=True)) @ w,
    "rows_against_rows": lambda h, w: (h @ h.T) @ h @ w,
    "roll_over_batch": lambda h, w: jnp.roll(h, 1, axis=0) @ w,
    "cumsum_over_batch": lambda h, w: jnp.cumsum(h, axis=0) @ w,
    "first_row_added": lambda h, w: (h + h[0]) @ w,
    "reversed_batch": lambda h, w: h[::-1] @ w,
    "summed_by_a_matmul": lambda h, w: h + (h.T @ jnp.ones((h.shape[0], 1), h.dtype)).T @ w,
    "gathered_rows": lambda h, w: jnp.take(h, jnp.arange(h.shape[0])[::-1], axis=0) @ w,
}


def _per_microbatch(f, batch_dim):
  """``f`` run on each microbatch in turn, as a pipeline's steps run it."""
  def run(h, ws):
    cut = lambda m: lax.slice_in_dim(h, m * MICRO, (m + 1) * MICRO, axis=batch_dim)
    return jnp.concatenate([f(cut(m), ws) for m in range(B // MICRO)], axis=batch_dim)
  return run


def _modules(mix, batch_dim=0, microbatched=True):
  f = _layers(mix) if batch_dim == 0 else _layers(lambda h, w: mix(h.T, w).T)
  shape = lambda n: (n, D) if batch_dim == 0 else (D, n)
  ws = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
  seq = lower_sequential(f, jax.ShapeDtypeStruct(shape(B), jnp.float32), ws)
  dist = lower_sequential(_per_microbatch(f, batch_dim), jax.ShapeDtypeStruct(shape(B), jnp.float32),
                          ws) if microbatched else \
      lower_sequential(f, jax.ShapeDtypeStruct(shape(MICRO), jnp.float32), ws)
  for m in (seq, dist):
    inline_calls(m)
    canonicalize_module(m)
  return f, seq, dist


def _run(module, *args):
  env = Interpreter(1).run(module.main, [[a] for a in args])
  return np.asarray(env[module.main.results[0].id][0])


@pytest.mark.parametrize("name", sorted(KEEPS_ROWS))
@pytest.mark.parametrize("batch_dim", [0, 1])
def test_a_loop_keeping_rows_apart_is_split_and_computes_the_same(name, batch_dim):
  f, seq, dist = _modules(KEEPS_ROWS[name], batch_dim)
  rng = np.random.default_rng(0)
  h = rng.standard_normal((B, D) if batch_dim == 0 else (D, B)).astype(np.float32)
  ws = rng.standard_normal((LAYERS, D, D)).astype(np.float32) / 3
  assert split_microbatch_loops(seq, dist.main) == 1
  loops = [op for op in seq.main.ops if op.name == "while"]
  assert len(loops) == B // MICRO
  assert all(op.operands[-1].shape[batch_dim] == MICRO for op in loops)
  np.testing.assert_allclose(_run(seq, h, ws), np.asarray(jax.jit(f)(h, ws)), rtol=1e-4,
                             atol=1e-5)


@pytest.mark.parametrize("name", sorted(MIXES_ROWS))
def test_a_loop_mixing_rows_is_not_split(name):
  _, seq, dist = _modules(MIXES_ROWS[name])
  assert split_microbatch_loops(seq, dist.main) == 0


def test_one_loop_on_a_tile_is_not_split():
  """A data-parallel rank runs the loop once, on its tile: that is a tiling
  (loops.py proves it as one), not a loop per microbatch."""
  _, seq, dist = _modules(KEEPS_ROWS["mlp"], microbatched=False)
  assert split_microbatch_loops(seq, dist.main) == 0


def _layers_elsewhere(mix):
  def run(h, ws):  # _layers' loop at another source line
    return lax.scan(lambda h, w: (mix(h, w), None), h, ws)[0]
  return run


def test_a_loop_whose_microbatched_partner_is_elsewhere_is_not_split():
  """The per-device loop on microbatches must be the same loop (its source
  line): another one of the right shapes is no reason to split."""
  _, seq, _ = _modules(KEEPS_ROWS["mlp"])
  elsewhere = lower_sequential(_per_microbatch(_layers_elsewhere(KEEPS_ROWS["mlp"]), 0),
                               jax.ShapeDtypeStruct((B, D), jnp.float32),
                               jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32))
  inline_calls(elsewhere)
  assert split_microbatch_loops(seq, elsewhere.main) == 0


def test_a_branch_reading_the_batch_itself_is_not_split():
  """lax.cond's branches read h without it being the cond's operand (an
  audit's case: the split cut h under a branch mixing its rows)."""
  mix = lambda h, w: jnp.tanh(h @ lax.cond(w[0, 0] > -100.0,
                                           lambda: (h.T @ h)[:D, :D] / 4, lambda: w))
  _, seq, dist = _modules(mix)
  assert split_microbatch_loops(seq, dist.main) == 0


@pytest.mark.parametrize("seq_rows, dist_rows", [(B, 0), (0, MICRO)])
def test_empty_batches_are_not_split(seq_rows, dist_rows):
  """An empty microbatch divided by zero, an empty batch made zero pieces
  (an audit's crashes)."""
  f = _layers(KEEPS_ROWS["mlp"])
  ws = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
  seq = lower_sequential(f, jax.ShapeDtypeStruct((seq_rows, D), jnp.float32), ws)
  dist = lower_sequential(lambda h, ws: [f(h, ws) for _ in range(B)][0],
                          jax.ShapeDtypeStruct((dist_rows, D), jnp.float32), ws)
  assert split_microbatch_loops(seq, dist.main) == 0
