"""A softmax's backward in flash attention's form (``passes/softmax_backward.py``)
and dot operands read through their transposes (``canonicalize._dot_of_transpose``):
each rewrite computes what jax does, on random shapes and values; the flash
form is really reached; near misses are left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes import softmax_backward
from graphguard_hlo.passes.canonicalize import canonicalize_module
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.terms import splat_value
from tests.test_online_softmax import SETTINGS, Builder, _t


def _canonical(fn, *args):
  """``fn`` lowered and canonicalized as a ring's programs are."""
  module = lower_sequential(fn, *args)
  inline_calls(module)
  canonicalize_module(module, rings=True)
  return module.main


def _runs_as_jax(fn, graph, values):
  want = jax.tree.leaves(jax.jit(fn)(*values))
  env = Interpreter(1).run(graph, [[x] for x in values])
  for v, w in zip(graph.results, want):
    w = np.asarray(w)
    np.testing.assert_allclose(env[v.id][0], w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


def _shapes(draw):
  """Scores [b, h, s, t], values [b, t, h, d], dout [b, s, h, d]; the summed
  dims t and d of two or more (a sum over one element is a reshape here)."""
  b, h, s = (draw(st.integers(1, 3)) for _ in range(3))
  t, d = (draw(st.integers(2, 3)) for _ in range(2))
  return (b, h, s, t), (b, t, h, d), (b, s, h, d)


def _values(shapes, seed):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def _by_hand(s):
  """A softmax written out: the max held constant, as jax.nn.softmax holds it."""
  e = jnp.exp(s - lax_stop(jnp.max(s, axis=-1, keepdims=True)))
  return e / jnp.sum(e, axis=-1, keepdims=True)


def lax_stop(x):
  return jax.lax.stop_gradient(x)


def _attention_vjp(softmax, einsum_out="bshd"):
  """The cotangents of scores and values through softmax(s) @ v."""
  def f(s, v, dout):
    def attend(s, v):
      return jnp.einsum(f"bhst,bthd->{einsum_out}", softmax(s), v)
    return jax.vjp(attend, s, v)[1](dout)
  return f


def _reciprocal_squares(graph):
  return [op for op in graph.ops if op.name == "divide" and splat_value(op.operands[0]) == 1.0
          and op.operands[1].producer is not None and op.operands[1].producer.name == "multiply"]


def _flash_differences(graph):
  """dP - rowsum(dout * out): the subtract the flash form centres dP with."""
  return [op for op in graph.ops if op.name == "subtract"
          and op.operands[0].producer is not None
          and op.operands[0].producer.name == "dot_general"
          and op.operands[1].producer is not None
          and op.operands[1].producer.name == "broadcast_in_dim"]


@SETTINGS
@given(st.data(), st.sampled_from([jax.nn.softmax, _by_hand]), st.sampled_from(["bshd", "bhsd"]))
def test_softmax_backward_becomes_flash_and_computes_what_jax_does(data, softmax, out_dims):
  shapes = list(_shapes(data.draw))
  if out_dims == "bhsd":
    b, s, h, d = shapes[2]
    shapes[2] = (b, h, s, d)
  fn = _attention_vjp(softmax, out_dims)
  graph = _canonical(fn, *(jax.ShapeDtypeStruct(x, np.float32) for x in shapes))
  assert not _reciprocal_squares(graph)
  assert _flash_differences(graph)
  _runs_as_jax(fn, graph, _values(shapes, data.draw(st.integers(0, 9))))


def _near_miss(kind):
  """e * (dP / l - rowsum(dP * e * c)) written out with c not 1 / (l * l), or
  the rowsum over another e: not the softmax's backward, left alone."""
  def f(s, v, dout):
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    l = jnp.sum(e, axis=-1, keepdims=True)
    dp = jnp.einsum("bshd,bthd->bhst", dout, v)
    if kind == "scale":
      c = 1.0 / l
    else:
      c = 1.0 / (l * l)
    other = e * 2.0 if kind == "other_e" else e
    return e * (dp / l - jnp.sum(dp * other * c, axis=-1, keepdims=True))
  return f


@pytest.mark.parametrize("kind,fires", [("exact", True), ("scale", False), ("other_e", False)])
def test_only_the_softmax_backward_becomes_flash(kind, fires):
  fn = _near_miss(kind)
  shapes = [(2, 3, 4, 5), (2, 5, 3, 2), (2, 4, 3, 2)]
  graph = _canonical(fn, *(jax.ShapeDtypeStruct(x, np.float32) for x in shapes))
  assert bool(_flash_differences(graph)) == fires
  _runs_as_jax(fn, graph, _values(shapes, 0))


# -- exp(x - (m + log l)) -> exp(x - m) / l, for l > 0 ---------------------------

def _lse_graph(l_kind):
  """exp(x - broadcast(m + log(l))) with l a sum of exponentials (positive)
  or a parameter (any sign)."""
  b = Builder([_t(3, 4), _t(3), _t(3, 5), _t(3)])
  x, m, y, p = b.g.params
  e = b.op("exponential", [y], _t(3, 5))
  l = b.reduce(e, "sum", (1,), (3,)) if l_kind == "sum_of_exps" else p
  lse = b.op("add", [m, b.op("log", [l], _t(3))], _t(3))
  shifted = b.op("subtract", [x, b.op("broadcast_in_dim", [lse], _t(3, 4),
                                       broadcast_dimensions=(0,))], _t(3, 4))
  b.g.results = [b.op("exponential", [shifted], _t(3, 4))]
  return b


@pytest.mark.parametrize("l_kind,fires", [("sum_of_exps", True), ("parameter", False)])
def test_log_sum_exp_becomes_a_division_only_when_l_is_positive(l_kind, fires):
  from graphguard_hlo.passes.canonicalize import canonicalize_graph
  b = _lse_graph(l_kind)
  rng = np.random.default_rng(0)
  inputs = [rng.standard_normal(p.type.shape) for p in b.g.params]
  inputs[3] = np.abs(inputs[3]) + 0.5  # (positive here, but not by how it is computed)
  before = b.run(inputs)
  canonicalize_graph(b.m, b.g, rings=True)
  assert any(op.name == "log" for op in b.g.ops) != fires
  np.testing.assert_allclose(b.run(inputs)[0], before[0], rtol=1e-12)


@pytest.mark.parametrize("build,sign", [
    (lambda b, x: b.op("exponential", [x], _t(3)), "positive"),
    (lambda b, x: b.op("add", [b.op("exponential", [x], _t(3)), b.splat(0.0, (3,))], _t(3)),
     "positive"),
    (lambda b, x: b.op("multiply", [b.splat(0.0, (3,)), b.op("exponential", [x], _t(3))], _t(3)),
     "nonnegative"),
    (lambda b, x: b.op("maximum", [x, b.op("exponential", [x], _t(3))], _t(3)), "positive"),
    (lambda b, x: b.op("subtract", [b.op("exponential", [x], _t(3)), x], _t(3)), None),
    (lambda b, x: b.op("divide", [b.splat(1.0, (3,)), x], _t(3)), None),
    (lambda b, x: x, None)])
def test_sign_of_a_value_by_how_it_is_computed(build, sign):
  b = Builder([_t(3)])
  assert softmax_backward._sign(build(b, b.g.params[0])) == sign


# -- dot(transpose(x), y) -> dot(x, y), dims renamed ------------------------------

@SETTINGS
@given(st.data())
def test_dot_reads_its_operand_through_a_transpose(data):
  """A batched dot of x [b, m, k] (held transposed, any permutation) with
  y [b, k, n]: folded when the permutation keeps x's free dims in order (one
  free dim always does), computing the same product; a transpose moving only
  unit dims is a reshape by then, and folds too."""
  from graphguard_hlo.passes.canonicalize import canonicalize_graph
  sizes = dict(zip("bmkn", data.draw(st.tuples(*[st.integers(1, 3)] * 4))))
  stored = data.draw(st.permutations("bmk"))        # how x is held
  perm = tuple(stored.index(c) for c in "bmk")      # transpose back to [b, m, k]
  builder = Builder([_t(*(sizes[c] for c in stored)), _t(sizes["b"], sizes["k"], sizes["n"])])
  x, y = builder.g.params
  xt = builder.op("transpose", [x], _t(sizes["b"], sizes["m"], sizes["k"]), permutation=perm)
  side = data.draw(st.sampled_from(["lhs", "rhs"]))
  out = _t(sizes["b"], sizes["m"], sizes["n"]) if side == "lhs" else \
      _t(sizes["b"], sizes["n"], sizes["m"])
  operands = [xt, y] if side == "lhs" else [y, xt]
  contract = {"lhs": (2,), "rhs": (1,)} if side == "lhs" else {"lhs": (1,), "rhs": (2,)}
  builder.g.results = [builder.op("dot_general", operands, out, lhs_batch=(0,), rhs_batch=(0,),
                                  lhs_contract=contract["lhs"], rhs_contract=contract["rhs"])]
  rng = np.random.default_rng(0)
  inputs = [rng.standard_normal(p.type.shape) for p in builder.g.params]
  before = builder.run(inputs)[0]
  canonicalize_graph(builder.m, builder.g, rings=True)
  np.testing.assert_allclose(builder.run(inputs)[0], before, rtol=1e-12)
  dot = next(op for op in builder.g.ops if op.name == "dot_general")
  assert x in dot.operands  # (one free dim: always in order)
