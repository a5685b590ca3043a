"""The e-graph's hash-cons stays congruent: after any unions and a rebuild,
every node added is found again from its children's current classes."""

from hypothesis import given, settings, strategies as st

from graphguard_hlo.passes.egraph import EGraph, ENode


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
