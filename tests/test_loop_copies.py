"""A loop that rebuilds a stacked input row by row is that input (the residual
copies of replicated weights that scan's forward pass saves under shard_map);
near misses are left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.pipeline import prepare_seq

W = jax.ShapeDtypeStruct((3, 4, 5), np.float32)


def _scan_ys(w):
  """scan's ys stacking the xs unchanged: the copy scan's forward pass makes."""
  return lax.scan(lambda c, x: (c, x), 0.0, w)[1] * 2.0


def _copy(first=0, last=3, read=lambda i: i, write=lambda i: i):
  """The same loop by hand, with the near misses it must not be confused with."""
  def f(w):
    def body(carry):
      i, acc = carry
      row = lax.dynamic_slice_in_dim(w, read(i), 1, axis=0, allow_negative_indices=False)
      return i + 1, lax.dynamic_update_slice_in_dim(acc, row, write(i), axis=0,
                                                   allow_negative_indices=False)
    _, out = lax.while_loop(lambda c: c[0] < last, body, (first, jnp.zeros_like(w)))
    return out * 2.0
  return f


def _reads_input_directly(fn) -> bool:
  g = prepare_seq(lower_sequential(fn, W)).main
  (mul,) = [op for op in g.ops if op.name == "multiply"]
  return mul.operands[0] is g.params[0] or mul.operands[1] is g.params[0]


@pytest.mark.parametrize("fn", [_scan_ys, _copy()], ids=["scan_ys", "while_loop"])
def test_copying_loop_is_its_input(fn):
  assert _reads_input_directly(fn)


@pytest.mark.parametrize("fn", [
    _copy(last=2),                                  # the last row is never written
    _copy(first=1),                                 # nor the first
    _copy(read=lambda i: (i + 1) % 3),              # rows rotated
    _copy(write=lambda i: 2 - i),                   # rows reversed
], ids=["short", "late_start", "rotated", "reversed"])
def test_near_misses_are_left_alone(fn):
  assert not _reads_input_directly(fn)
