"""Sequential layer loops cut into the loops a pipeline's stages run
(``passes/loop_split.py``): the cut program computes what the loop did, and
only loops reading their counter as a row index are cut.  The pipelines that
need it (``pp_scan``, forward and trained, and its bugs) are in the zoo."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from graphguard_hlo import ir
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.canonicalize import canonicalize_module
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.loop_copies import counter_of
from graphguard_hlo.passes.loop_split import split_layer_loops


def _layers(h, w, b):
  """h through one tanh layer per row of the stacks; every layer's output stacked."""
  def layer(h, wb):
    h = jnp.tanh(h @ wb[0] + wb[1])
    return h, h * 2.0
  return lax.scan(layer, h, (w, b))


def _forward(h, w, b):
  return _layers(h, w, b)


def _trained(h, w, b):
  """A training step: the forward scan saves rows, the transposed scan reads
  them backwards (at N - 1 - i) and writes each layer's gradient row."""
  def loss(w, b):
    out, ys = _layers(h, w, b)
    return jnp.sum(out ** 2) + jnp.sum(ys)
  return jax.value_and_grad(loss, argnums=(0, 1))(w, b)


def _prepared(fn, n):
  rng = np.random.default_rng(n)
  args = [rng.standard_normal((3, 4)).astype(np.float32),
          (rng.standard_normal((n, 4, 4)) / 2).astype(np.float32),
          rng.standard_normal((n, 4)).astype(np.float32)]
  module = lower_sequential(fn, *args)
  inline_calls(module)
  canonicalize_module(module)
  return module, args


def _outputs(module, args):
  env = Interpreter(1).run(module.main, [[a] for a in args])
  return [env[v.id][0] for v in module.main.results]


def _loop_counts(module):
  return sorted(counter_of(op)[1] for op in module.main.ops if op.name == "while")


@pytest.mark.parametrize("fn", [_forward, _trained], ids=["forward", "trained"])
@pytest.mark.parametrize("n, k", [(8, 2), (8, 4), (6, 3), (4, 1)])
def test_a_cut_loop_computes_what_the_loop_did(fn, n, k):
  module, args = _prepared(fn, n)
  loops = len(_loop_counts(module))
  before = _outputs(module, args)
  assert split_layer_loops(module, {k}) == loops
  assert _loop_counts(module) == [k] * (loops * n // k)
  for a, b in zip(before, _outputs(module, args)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_loop_the_per_device_program_has_is_not_cut():
  module, _ = _prepared(_forward, 8)
  assert split_layer_loops(module, {8, 2}) == 0
  assert split_layer_loops(module, {3}) == 0  # no count divides 8
  assert _loop_counts(module) == [8]


def _forward_loop(module):
  loop = next(op for op in module.main.ops if op.name == "while")
  counter, _ = counter_of(loop)
  body = loop.regions[1]
  h = next(j for j, p in enumerate(body.params) if p.shape == (3, 4))
  return body, counter, h


def _add_to_carry(module, body, j, extra):
  """Carry j's next value plus ``extra`` (broadcast to it)."""
  t = body.results[j].type
  spread = module.add_op(body, "broadcast_in_dim", [extra], [t],
                         {"broadcast_dimensions": ()}).results[0]
  body.results[j] = module.add_op(body, "add", [body.results[j], spread], [t]).results[0]


@pytest.mark.parametrize("read", ["counter", "increment"])
def test_a_loop_reading_its_counter_as_a_value_is_not_cut(read):
  """A body adding its counter i, or the increment's i + 1: each piece would
  count from 0 (or 1) again."""
  module, _ = _prepared(_forward, 8)
  body, counter, h = _forward_loop(module)
  value = (body.params if read == "counter" else body.results)[counter]
  step = module.add_op(body, "convert", [value], [ir.TensorType((), "f32")]).results[0]
  _add_to_carry(module, body, h, step)
  assert split_layer_loops(module, {2}) == 0


def test_a_loop_reading_a_stack_otherwise_is_not_cut():
  """A stack read at a fixed row as well as at the counter: a piece would
  see its own block's row there."""
  module, _ = _prepared(_forward, 8)
  body, counter, h = _forward_loop(module)
  rows = next(p for p in body.params if p.shape == (8, 4))
  first = module.add_op(body, "slice", [rows], [ir.TensorType((1, 1), "f32")],
                        {"start_indices": (0, 0), "limit_indices": (1, 1),
                         "strides": (1, 1)}).results[0]
  scalar = module.add_op(body, "reshape", [first], [ir.TensorType((), "f32")]).results[0]
  _add_to_carry(module, body, h, scalar)
  assert split_layer_loops(module, {2}) == 0
