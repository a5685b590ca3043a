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
