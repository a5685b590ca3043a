"""The row-coverage arithmetic ``finite_rows`` proves finite maxima with,
against brute force on random vectors."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from graphguard_hlo.passes.finite_rows import FLIPPED, NEGATED, _some_column
from graphguard_hlo.reference import COMPARISONS

vectors = st.lists(st.integers(-5, 5), min_size=0, max_size=6).map(
    lambda xs: np.array(xs, np.int32))
directions = st.sampled_from(sorted(COMPARISONS))


@settings(max_examples=500, deadline=None, derandomize=True)
@given(directions, vectors, vectors)
def test_some_column_is_any_over_the_columns(direction, a, b):
  brute = np.any(COMPARISONS[direction](a[:, None], b[None, :]), axis=1)
  assert np.array_equal(_some_column(direction, a, b), brute)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(directions, vectors, vectors)
def test_flipped_and_negated_directions(direction, a, b):
  if a.size != b.size:
    b = np.resize(b, a.shape) if b.size else np.zeros_like(a)
  cmp = COMPARISONS
  assert np.array_equal(cmp[direction](a, b), cmp[FLIPPED[direction]](b, a))
  assert np.array_equal(~cmp[direction](a, b), cmp[NEGATED[direction]](a, b))
