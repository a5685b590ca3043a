"""The e-graph's hash-cons stays congruent: after any unions and a rebuild,
every node added is found again from its children's current classes; and the
per-device e-graph's identities hold."""

import numpy as np
from hypothesis import given, settings, strategies as st

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.dist_egraph import DistEGraph
from graphguard_hlo.passes.egraph import EGraph, ENode
from tests.test_online_softmax import Builder, _t


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.data())
def test_every_node_is_found_after_unions_and_rebuilds(data):
  eg = EGraph()
  classes = [eg.add(ENode(("leaf", k))) for k in range(data.draw(st.integers(2, 5)))]
  added = []
  for _ in range(data.draw(st.integers(1, 12))):
    if data.draw(st.booleans()):
      children = tuple(data.draw(st.lists(st.sampled_from(classes), min_size=1, max_size=3)))
      node = ENode((data.draw(st.sampled_from(["f", "g"])),), children)
      c = eg.add(node)
      classes.append(c)
      added.append((node, c))
    else:
      eg.union(data.draw(st.sampled_from(classes)), data.draw(st.sampled_from(classes)))
      if data.draw(st.booleans()):
        eg.rebuild()
  eg.rebuild()
  for node, c in added:
    assert eg.lookup(node) == eg.find(c), node


def test_a_node_repaired_through_one_child_is_found_through_another():
  """f(a, b): merge b's class, rebuild, then merge a's: the second repair
  must find the entry the first one rewrote (it once missed it, and XLA's
  clamp of token ids between two folded constants was not found)."""
  eg = EGraph()
  a, a2, b, b2 = (eg.add(ENode(("leaf", k))) for k in range(4))
  f = eg.add(ENode(("f",), (a, b)))
  eg.union(b2, b)  # b2 becomes the root: f is rekeyed as f(a, b2)
  eg.rebuild()
  eg.union(a2, a)
  eg.rebuild()
  assert eg.lookup(ENode(("f",), (a2, b2))) == eg.find(f)


def test_identities_the_per_device_egraph_reads():
  """max(x, -inf) is x, min(x, +inf) is x and select(p, y, y) is y (NaN
  included, by the reference semantics), and nothing weaker is taken for
  them: max with another constant, select of two values."""
  b = Builder([_t(3), _t(3), ir.TensorType((3,), "i1")])
  x, y, p = b.g.params
  same = [b.op("maximum", [b.splat(-np.inf, (3,)), x], _t(3)),
          b.op("minimum", [x, b.splat(np.inf, (3,))], _t(3)),
          b.op("select", [p, y, y], _t(3))]
  other = [b.op("maximum", [x, b.splat(-1e9, (3,))], _t(3)),
           b.op("select", [p, x, y], _t(3))]
  deg = DistEGraph(b.g)
  assert [deg.of(v) for v in same] == [deg.of(x), deg.of(x), deg.of(y)]
  assert all(deg.of(v) not in (deg.of(x), deg.of(y)) for v in other)
  values = np.array([1.0, np.nan, -np.inf])
  for name, c in (("maximum", -np.inf), ("minimum", np.inf)):
    got = reference.evaluate(name, {}, [values, np.full(3, c)], _t(3))
    np.testing.assert_array_equal(got, values)


def test_a_min_of_a_max_is_a_clamp():
  """jnp.clip(x, a, b) = min(max(x, a), b) is clamp(a, x, b) (either operand
  order); max(min(x, b), a), which differs where a > b, is not."""
  i32 = ir.TensorType((4,), "i32")
  b = Builder([i32, i32, i32])
  x, lo, hi = b.g.params
  clip = b.op("minimum", [b.op("maximum", [lo, x], i32), hi], i32)
  other = b.op("maximum", [b.op("minimum", [x, hi], i32), lo], i32)
  clamp = b.op("clamp", [lo, x, hi], i32)
  deg = DistEGraph(b.g)
  assert deg.of(clip) == deg.of(clamp) != deg.of(other)
  xs, a, c = np.array([-3, 0, 5, 9]), np.array([0, 0, 4, 8]), np.array([4, 4, 4, 6])
  np.testing.assert_array_equal(
      reference.evaluate("clamp", {}, [a, xs, c], i32),
      np.minimum(np.maximum(xs, a), c))
  assert not np.array_equal(reference.evaluate("clamp", {}, [a, xs, c], i32),
                            np.maximum(np.minimum(xs, c), a))


def test_a_splat_sliced_transposed_or_reversed_is_a_splat():
  """jnp.cumsum's exclusive form concatenates a slice of broadcast zeros."""
  b = Builder([_t(3)])
  zeros, ones = b.splat(0.0, (4, 6)), b.splat(1.0, (4, 6))
  sliced = b.op("slice", [zeros], _t(1, 6), start_indices=(0, 0), limit_indices=(1, 6),
                strides=(1, 1))
  turned = b.op("transpose", [ones], _t(6, 4), permutation=(1, 0))
  flipped = b.op("reverse", [ones], _t(4, 6), dimensions=(0,))
  deg = DistEGraph(b.g)
  assert [deg.splat(deg.of(v)) for v in (sliced, turned, flipped)] == [0.0, 1.0, 1.0]
  assert deg.of(flipped) == deg.of(ones) != deg.of(turned)  # (types differ)
  env = b.values([np.zeros(3)])  # the reference agrees: every element is the splat
  for v in (sliced, turned, flipped):
    assert env[v.id].shape == v.type.shape and np.all(env[v.id] == deg.splat(deg.of(v)))
