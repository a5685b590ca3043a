"""unsaved_loops: a sequential loop that saves rows for the backward pass,
copied without its saves for its other readers where the per-device program
runs the loop both ways (a stage's vjp taken by hand, 1F1B) -- and not where
it runs it one way only."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.canonicalize import canonicalize_module
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.unsaved_loops import copy_unsaved_loops

B, D, LAYERS = 4, 8, 3
ARGS = (jax.ShapeDtypeStruct((B, D), jnp.float32),
        jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32))


def _layers(h, ws):  # one source line: every program's loop shares it
  return lax.scan(lambda h, w: (jnp.tanh(h @ w) + h, None), h, ws)[0]


def _loss(h, ws):
  return jnp.sum(_layers(h, ws) ** 2)


SEQ = jax.grad(_loss, argnums=(0, 1))


def _vjp_by_hand(h, ws):
  """The forward run plainly for its output, and again under jax.vjp."""
  y = _layers(h, ws)
  _, vjp = jax.vjp(_layers, h, ws)
  return vjp(2 * y)


def _modules(dist_fn):
  seq, dist = lower_sequential(SEQ, *ARGS), lower_sequential(dist_fn, *ARGS)
  for m in (seq, dist):
    inline_calls(m)
    canonicalize_module(m)
  return seq, dist


def _loops(graph):
  return [len(op.operands) for op in graph.ops if op.name == "while"]


def test_a_saving_loop_is_copied_for_its_output_and_computes_the_same():
  seq, dist = _modules(_vjp_by_hand)
  before = _loops(seq.main)
  assert copy_unsaved_loops(seq, dist.main) == 1
  canonicalize_module(seq)
  after = _loops(seq.main)
  assert len(after) == len(before) + 1 and sorted(set(after)) == sorted(set(_loops(dist.main)))
  rng = np.random.default_rng(0)
  h = rng.standard_normal((B, D)).astype(np.float32)
  ws = (rng.standard_normal((LAYERS, D, D)) / 3).astype(np.float32)
  env = Interpreter(1).run(seq.main, [[h], [ws]])
  for r, want in zip(seq.main.results, jax.jit(SEQ)(h, ws)):
    np.testing.assert_allclose(np.asarray(env[r.id][0]), np.asarray(want), rtol=1e-4,
                               atol=1e-4)


def test_a_loop_the_device_runs_one_way_only_is_not_copied():
  seq, dist = _modules(SEQ)  # autodiff: the forward saves, as the sequential one
  assert copy_unsaved_loops(seq, dist.main) == 0


def test_a_loop_at_another_line_is_no_reason_to_copy():
  def elsewhere(h, ws):
    return lax.scan(lambda h, w: (jnp.tanh(h @ w) + h, None), h, ws)[0]

  def plain_elsewhere(h, ws):
    y = elsewhere(h, ws)
    _, vjp = jax.vjp(_layers, h, ws)
    return vjp(2 * y)
  seq, dist = _modules(plain_elsewhere)
  assert copy_unsaved_loops(seq, dist.main) == 0
