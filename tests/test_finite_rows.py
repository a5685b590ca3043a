"""The row-coverage arithmetic ``finite_rows`` proves finite maxima with,
against brute force on random vectors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.finite_rows import FLIPPED, NEGATED, FiniteRows, _some_column
from graphguard_hlo.passes.inline import inline_calls
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



def _row_max(init, mask):
  def f(s):
    masked = jnp.where(mask(jnp.arange(4)[:, None], jnp.arange(4)[None, :]), s, -jnp.inf)
    return lax.reduce(masked, np.float32(init), lax.max, (1,))
  return f


@pytest.mark.parametrize("init, mask, finite", [
    (-np.inf, lambda r, c: r >= c, True),     # causal: the diagonal kept
    (-np.inf, lambda r, c: r > c, False),     # row 0 keeps nothing
    (np.inf, lambda r, c: r >= c, False),     # an init of +inf is the max
    (np.nan, lambda r, c: r >= c, False),
    (0.0, lambda r, c: r >= c, True),
])
def test_a_row_max_is_finite_where_each_row_keeps_a_key(init, mask, finite):
  module = lower_sequential(_row_max(init, mask), jax.ShapeDtypeStruct((4, 4), jnp.float32))
  inline_calls(module)
  rows = FiniteRows(module, module.main, lambda v: False)
  assert rows.is_finite(module.main.results[0]) == finite
