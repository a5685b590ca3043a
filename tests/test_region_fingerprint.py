"""A region's structural hash (``terms.region_fingerprint``) names what the
region computes, not the order its ops are listed in: jax lists an argmax's
reducer one way, XLA's partitioner another, and a reduce is looked up in the
per-device program by its head, which holds the fingerprint."""

import random

import numpy as np

from hypothesis import given, settings, strategies as st

from graphguard_hlo import ir
from graphguard_hlo.passes.terms import region_fingerprint

F32 = ir.TensorType((), "f32")
OPS = ("add", "multiply", "maximum", "subtract")


def _region(plan, order_seed, extra_dead=False):
  """A scalar region of two params: op j of ``plan`` is (name, a, b), a and b
  naming params (-1, -2) or earlier ops; its results are the last two ops.
  The ops are listed in a random topological order of that DAG."""
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("body")
  g.params = [m.new_value(F32, name=f"p{i}") for i in range(2)]
  deps = {j: {x for x in (a, b) if x >= 0} for j, (_, a, b) in enumerate(plan)}
  rng, placed, listed = random.Random(order_seed), set(), []
  while len(listed) < len(plan):
    j = rng.choice(sorted(k for k in deps if k not in placed and deps[k] <= placed))
    placed.add(j)
    listed.append(j)
  values = {-1: g.params[0], -2: g.params[1]}
  for j in listed:
    name, a, b = plan[j]
    values[j] = m.add_op(g, name, [values[a], values[b]], [F32], {}).result
  if extra_dead:
    m.add_op(g, "add", [g.params[0], g.params[0]], [F32], {})
  g.results = [values[len(plan) - 1], values[len(plan) - 2]]
  return g


@st.composite
def plans(draw):
  n = draw(st.integers(2, 8))
  plan = []
  for j in range(n):
    pick = st.integers(-2, j - 1)
    plan.append((draw(st.sampled_from(OPS)), draw(pick), draw(pick)))
  return plan


@settings(max_examples=100, deadline=None, derandomize=True)
@given(plans(), st.integers(0, 1000), st.integers(0, 1000))
def test_the_same_dag_listed_in_any_order_has_one_fingerprint(plan, s1, s2):
  assert region_fingerprint(_region(plan, s1)) == region_fingerprint(_region(plan, s2))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(plans(), st.integers(0, 1000), st.data())
def test_another_op_or_operand_is_another_fingerprint(plan, seed, data):
  j = data.draw(st.integers(0, len(plan) - 1))
  name, a, b = plan[j]
  changed = list(plan)
  if data.draw(st.booleans()):
    changed[j] = (data.draw(st.sampled_from([o for o in OPS if o != name])), a, b)
  else:
    if a == b:
      return
    changed[j] = (name, b, a)  # operand order matters (subtract; the others are kept as written)
  reached = _reaches_results(plan, j)
  if reached:
    assert region_fingerprint(_region(plan, seed)) != region_fingerprint(_region(changed, seed))


def _reaches_results(plan, j):
  """Does op j feed one of the results (the last two ops)?"""
  users = {k for k, (_, a, b) in enumerate(plan) if j in (a, b)}
  return j >= len(plan) - 2 or any(_reaches_results(plan, k) for k in users)


def test_ops_feeding_no_result_do_not_count():
  plan = [("add", -1, -2), ("multiply", 0, -1), ("maximum", 1, 0)]
  assert region_fingerprint(_region(plan, 0)) == region_fingerprint(
      _region(plan, 0, extra_dead=True))


def test_a_long_chain_is_walked_without_recursion():
  plan = [("add", -1, -2)] + [("multiply", j, -1) for j in range(5000)]
  assert region_fingerprint(_region(plan, 0)) == region_fingerprint(_region(plan, 1))


def test_values_from_outside_never_match_another_programs():
  """A branch's captured value enters the fingerprint as itself: two programs
  whose captured values happen to share an id (ids count per module) do not
  match (an audit's false proof: a cond left opaque was matched on its index
  alone, its branches reading unrelated values with the same id)."""
  def captured(op_name):
    m = ir.Module("<test>", "stablehlo")
    g = ir.Graph("body")
    outside = m.new_value(F32, name="outside")
    r = m.add_op(g, op_name, [outside, outside], [F32], {}).result
    g.results = [r]
    return g, outside
  (a, va), (b, vb) = captured("add"), captured("add")
  assert va.id == vb.id
  assert region_fingerprint(a) != region_fingerprint(b)
  assert region_fingerprint(a) == region_fingerprint(a)


def _scalar_region(uses, draw_op=None):
  """compare(select(x == c0, c1, x), y) with each constant its own op (jax
  writes one per use) or one shared (XLA's CSE); ``draw_op``: the two
  operands drawn by that op instead, once each or once for both."""
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("body")
  x, y = g.params = [m.new_value(F32, name="x"), m.new_value(F32, name="y")]
  def zero():
    return m.add_op(g, "constant", [], [F32], {"value": np.array(0.0, np.float32)}).result
  shared = zero()
  c0, c1 = (shared, shared) if uses == "shared" else (zero(), zero())
  if draw_op is not None:
    a = m.add_op(g, draw_op, [], [F32], {}).result
    c0, c1 = a, (a if uses == "shared" else m.add_op(g, draw_op, [], [F32], {}).result)
  pred = ir.TensorType((), "i1")
  eq = m.add_op(g, "compare", [x, c0], [pred], {"comparison_direction": "EQ"}).result
  picked = m.add_op(g, "select", [eq, c1, x], [F32], {}).result
  g.results = [m.add_op(g, "compare", [picked, y], [pred], {"comparison_direction": "LT"}).result]
  return g


def test_a_value_computed_twice_is_the_value_computed_once():
  """jax's sort comparator writes a constant per use, XLA's CSE shares one;
  two draws of a random number are two numbers, though."""
  assert region_fingerprint(_scalar_region("own")) == region_fingerprint(_scalar_region("shared"))
  assert region_fingerprint(_scalar_region("own", "rng")) != region_fingerprint(
      _scalar_region("shared", "rng"))
