"""The online softmax telescopes, and a softmax's division moves past its
matmul: each canonical form of ``passes/online_softmax.py`` (and the dot
operand order of ``canonicalize.py``) computes what the
graph computed, on random sizes, steps and spellings; and the telescoped
form is really reached (no rescaling multiply is left)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.canonicalize import canonicalize_graph

F64 = "f64"
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _t(*shape):
  return ir.TensorType(tuple(shape), F64)


class Builder:
  def __init__(self, param_types):
    self.m = ir.Module("<test>", "stablehlo")
    self.g = ir.Graph("main")
    self.g.params = [self.m.new_value(t, name=f"p{i}") for i, t in enumerate(param_types)]

  def op(self, name, operands, t, regions=(), **attrs):
    return self.m.add_op(self.g, name, list(operands), [t], attrs, list(regions)).result

  def splat(self, value, shape):
    c = self.op("constant", [], _t(), value=np.array(value, np.float64))
    return self.op("broadcast_in_dim", [c], _t(*shape), broadcast_dimensions=())

  def reduce(self, x, kind, dims, out_shape):
    region = ir.Graph(kind)
    a, b = self.m.new_value(_t(), name="a"), self.m.new_value(_t(), name="b")
    region.params = [a, b]
    region.results = [self.m.add_op(region, {"sum": "add", "max": "maximum"}[kind], [a, b],
                                    [_t()]).result]
    init = self.op("constant", [], _t(), value=np.array(0.0 if kind == "sum" else -np.inf))
    red = self.m.add_op(self.g, "reduce", [x, init], [_t(*out_shape)],
                        {"dimensions": tuple(dims), "gg.reduction": kind}, [region])
    return red.result

  def values(self, inputs) -> dict:
    """Every value of the graph on ``inputs``, by value id."""
    env = {p.id: x for p, x in zip(self.g.params, inputs)}
    for op in self.g.ops:
      env[op.results[0].id] = reference.evaluate(
          op.name, op.attrs, [env[v.id] for v in op.operands], op.results[0].type)
    return env

  def run(self, inputs):
    env = self.values(inputs)
    return [env[v.id] for v in self.g.results]


def _dot(b: Builder, p, v, p_first: bool, rows, s, d):
  """p [rows, s] @ v [s, d] -> [rows, d], written either way round (the other
  way a transpose follows, as jnp.einsum writes it)."""
  if p_first:
    return b.op("dot_general", [p, v], _t(rows, d), lhs_batch=(), rhs_batch=(),
                lhs_contract=(1,), rhs_contract=(0,))
  vp = b.op("dot_general", [v, p], _t(d, rows), lhs_batch=(), rhs_batch=(),
            lhs_contract=(0,), rhs_contract=(1,))
  return b.op("transpose", [vp], _t(rows, d), permutation=(1, 0))


def online_softmax_graph(steps, rows, s, d, spelling, wrong_scale_at=None):
  """out = o / l after ``steps`` online-softmax steps over blocks s_j, v_j.
  ``spelling``: per step, (scale on the left?, p @ v or v @ p).  With
  ``wrong_scale_at`` = t, step t rescales by exp(m_t - m_t) (a bug) instead."""
  b = Builder([_t(rows, s)] * steps + [_t(s, d)] * steps)
  scores, values = b.g.params[:steps], b.g.params[steps:]
  m = b.splat(-np.inf, (rows,))
  l = b.splat(0.0, (rows,))
  o = b.splat(0.0, (rows, d))
  for t in range(steps):
    left, p_first = spelling[t]
    m_new = b.op("maximum", [m, b.reduce(scores[t], "max", [1], (rows,))], _t(rows))
    diff = b.op("subtract", [m, m if t == wrong_scale_at else m_new], _t(rows))
    rescale = b.op("exponential", [diff], _t(rows))
    shifted = b.op("broadcast_in_dim", [m_new], _t(rows, s), broadcast_dimensions=(0,))
    p = b.op("exponential", [b.op("subtract", [scores[t], shifted], _t(rows, s))], _t(rows, s))
    mul = lambda a, x, shape: b.op("multiply", [a, x] if left else [x, a], _t(*shape))
    l = b.op("add", [mul(rescale, l, (rows,)), b.reduce(p, "sum", [1], (rows,))], _t(rows))
    wide = b.op("broadcast_in_dim", [rescale], _t(rows, d), broadcast_dimensions=(0,))
    o = b.op("add", [mul(wide, o, (rows, d)), _dot(b, p, values[t], p_first, rows, s, d)],
             _t(rows, d))
    m = m_new
  norm = b.op("broadcast_in_dim", [l], _t(rows, d), broadcast_dimensions=(0,))
  b.g.results = [b.op("divide", [o, norm], _t(rows, d))]
  return b


@SETTINGS
@given(st.integers(1, 4), st.integers(2, 3), st.integers(2, 4), st.integers(2, 3),
       st.data())
def test_online_softmax_telescopes(steps, rows, s, d, data):
  # (sizes of 1 would meet the unit-dim forms first: a transpose of unit dims
  # is a reshape there, in both programs alike)
  spelling = [(data.draw(st.booleans()), data.draw(st.booleans())) for _ in range(steps)]
  b = online_softmax_graph(steps, rows, s, d, spelling)
  rng = np.random.default_rng(steps * 100 + rows * 10 + s)
  inputs = [rng.standard_normal((rows, s)) * 3 for _ in range(steps)] + [
      rng.standard_normal((s, d)) for _ in range(steps)]
  before = b.run(inputs)
  canonicalize_graph(b.m, b.g, rings=True)
  after = b.run(inputs)
  np.testing.assert_allclose(after[0], before[0], rtol=1e-9, atol=1e-12)
  # The recurrence is gone: the output is (sum_j exp(s_j - m) @ v_j) / l.
  assert not any(op.name == "multiply" for op in b.g.ops), [op.name for op in b.g.ops]
  assert sum(op.name == "exponential" for op in b.g.ops) >= steps


def test_a_wrong_rescale_is_not_telescoped():
  """exp(m - m) at step 1 rescales by 1, not exp(m_1 - m_2): no rewrite may
  claim the telescoped form, and the graph still computes what it did."""
  b = online_softmax_graph(3, 2, 3, 2, [(True, True)] * 3, wrong_scale_at=1)
  rng = np.random.default_rng(0)
  inputs = [rng.standard_normal((2, 3)) * 3 for _ in range(3)] + [
      rng.standard_normal((3, 2)) for _ in range(3)]
  before = b.run(inputs)
  canonicalize_graph(b.m, b.g, rings=True)
  np.testing.assert_allclose(b.run(inputs)[0], before[0], rtol=1e-9)
  assert any(op.name == "multiply" for op in b.g.ops)


@pytest.mark.parametrize("p_first", [True, False])
def test_softmax_divides_after_its_matmul(p_first):
  """dot(p / l, v) -> dot(p, v) / l, the division on either dot operand."""
  b = Builder([_t(3, 4), _t(3), _t(4, 2)])
  p, l, v = b.g.params
  norm = b.op("broadcast_in_dim", [l], _t(3, 4), broadcast_dimensions=(0,))
  probs = b.op("divide", [p, norm], _t(3, 4))
  b.g.results = [_dot(b, probs, v, p_first, 3, 4, 2)]
  rng = np.random.default_rng(1)
  inputs = [rng.standard_normal((3, 4)), rng.uniform(0.5, 2, 3), rng.standard_normal((4, 2))]
  before = b.run(inputs)
  canonicalize_graph(b.m, b.g, rings=True)
  np.testing.assert_allclose(b.run(inputs)[0], before[0], rtol=1e-12)
  (last,) = [op for op in b.g.ops if op.results[0] is b.g.results[0]]
  assert last.name in ("divide", "transpose")
  assert any(op.name == "divide" and op.operands[0].producer.name == "dot_general"
             for op in b.g.ops)


def test_a_column_scale_stays_before_the_matmul():
  """dot(p / l, v) with l along p's contracted dim is not a row scale."""
  b = Builder([_t(3, 4), _t(4), _t(4, 2)])
  p, l, v = b.g.params
  norm = b.op("broadcast_in_dim", [l], _t(3, 4), broadcast_dimensions=(1,))
  probs = b.op("divide", [p, norm], _t(3, 4))
  b.g.results = [_dot(b, probs, v, True, 3, 4, 2)]
  canonicalize_graph(b.m, b.g, rings=True)
  (dot,) = [op for op in b.g.ops if op.name == "dot_general"]
  assert probs in dot.operands


@SETTINGS
@given(st.data())
def test_dot_operands_come_in_one_order(data):
  """Swapping a dot's operands (and transposing back) changes nothing, and
  both spellings of one product reach the same canonical dot (unless the
  operands tie on (batch dims, contracting dims, rank))."""
  nb, na, nc, nf = (data.draw(st.integers(0, 2)) for _ in range(4))
  sizes = [data.draw(st.integers(1, 3)) for _ in range(nb + na + nc + nf)]
  batch, afree = sizes[:nb], sizes[nb:nb + na]
  contract, bfree = sizes[nb + na:nb + na + nc], sizes[nb + na + nc:]
  # a: [batch, afree, contract] in a drawn order; b: [contract, batch, bfree]
  a_dims = data.draw(st.permutations(range(nb + na + nc)))
  a_shape = [(batch + afree + contract)[k] for k in a_dims]
  b_shape = contract + batch + bfree
  lb = tuple(a_dims.index(k) for k in range(nb))
  lc = tuple(a_dims.index(nb + na + k) for k in range(nc))
  rb, rc = tuple(nc + k for k in range(nb)), tuple(range(nc))
  afree = [a_shape[i] for i in range(len(a_shape)) if i not in lb + lc]  # in a's order
  out_shape = batch + afree + bfree
  rng = np.random.default_rng(len(sizes))
  xa, xb = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
  results = []
  for flip in (False, True):
    b = Builder([_t(*a_shape), _t(*b_shape)])
    pa, pb = b.g.params
    if not flip:
      b.g.results = [b.op("dot_general", [pa, pb], _t(*out_shape), lhs_batch=lb,
                          rhs_batch=rb, lhs_contract=lc, rhs_contract=rc)]
    else:
      swapped = b.op("dot_general", [pb, pa], _t(*(batch + bfree + afree)), lhs_batch=rb,
                     rhs_batch=lb, lhs_contract=rc, rhs_contract=lc)
      perm = tuple(range(nb)) + tuple(nb + len(bfree) + i for i in range(na)) + tuple(
          nb + j for j in range(len(bfree)))
      b.g.results = [b.op("transpose", [swapped], _t(*out_shape), permutation=perm)]
    before = b.run([xa, xb])
    canonicalize_graph(b.m, b.g, rings=True)
    np.testing.assert_allclose(b.run([xa, xb])[0], before[0], rtol=1e-12)
    dots = [op for op in b.g.ops if op.name == "dot_general"]
    results.append([(op.operands[0] is pa, op.attrs["lhs_batch"], op.attrs["lhs_contract"])
                    for op in dots])
  if (lb, lc, len(a_shape)) != (rb, rc, len(b_shape)):  # (a tie keeps the order given)
    assert results[0] == results[1]
