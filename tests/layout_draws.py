"""Hypothesis draws shared by the lemma and transfer-rule property tests."""

import math

from hypothesis import strategies as st

from graphguard_hlo import ir


@st.composite
def meshes(draw) -> ir.Mesh:
  """1-3 axes x, y, z of sizes 1-4 (2 drawn more often)."""
  n = draw(st.integers(1, 3))
  return ir.Mesh(tuple((name, draw(st.sampled_from([1, 2, 2, 3, 4]))) for name in "xyz"[:n]))


def tiles(mesh: ir.Mesh, axes) -> int:
  """How many tiles ``axes`` cut a dim into."""
  return math.prod(mesh.axis_size(a) for a in axes)


def axis_slots(draw, mesh: ir.Mesh, rank: int, other: str
               ) -> tuple[tuple[tuple[str, ...], ...], list[str]]:
  """Each mesh axis, in a random order, tiles a random dim, goes to ``other``
  (the caller's: partial, pinned), or is replicated.  (dims, the others.)"""
  dims: list[list[str]] = [[] for _ in range(rank)]
  others = []
  for a in draw(st.permutations(mesh.axis_names)):
    slot = draw(st.sampled_from(list(range(rank)) + [other, None]))
    if slot == other:
      others.append(a)
    elif slot is not None:
      dims[slot].append(a)
  return tuple(map(tuple, dims)), others
