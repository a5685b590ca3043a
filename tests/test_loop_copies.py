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


def _copy(first=0, last=3, read=lambda i: i, write=lambda i: i, normalized=False):
  """The same loop by hand, with the near misses it must not be confused with
  (``normalized``: indices as jax normalizes them, ``select(i < 0, i + 3, i)``)."""
  def f(w):
    def body(carry):
      i, acc = carry
      row = lax.dynamic_slice_in_dim(w, read(i), 1, axis=0, allow_negative_indices=normalized)
      return i + 1, lax.dynamic_update_slice_in_dim(acc, row, write(i), axis=0,
                                                   allow_negative_indices=normalized)
    _, out = lax.while_loop(lambda c: c[0] < last, body, (first, jnp.zeros_like(w)))
    return out * 2.0
  return f


def _reads_input_directly(fn) -> bool:
  g = prepare_seq(lower_sequential(fn, W)).main
  (mul,) = [op for op in g.ops if op.name == "multiply"]
  return mul.operands[0] is g.params[0] or mul.operands[1] is g.params[0]


@pytest.mark.parametrize("fn", [_scan_ys, _copy(), _copy(normalized=True)],
                         ids=["scan_ys", "while_loop", "normalized_indices"])
def test_copying_loop_is_its_input(fn):
  assert _reads_input_directly(fn)


@pytest.mark.parametrize("fn", [
    _copy(last=2),                                  # the last row is never written
    _copy(first=1),                                 # nor the first
    _copy(read=lambda i: (i + 1) % 3),              # rows rotated
    _copy(write=lambda i: 2 - i),                   # rows reversed
    _copy(last=2, normalized=True),                 # short, indices normalized
], ids=["short", "late_start", "rotated", "reversed", "short_normalized"])
def test_near_misses_are_left_alone(fn):
  assert not _reads_input_directly(fn)


# -- FSDP: the saved row is the all-gathered weight row -------------------------------

def _gathering_copy(gather_axis=1, rows=3):
  """shard_map over 4 ranks: a loop saving all_gather(W[i]) row by row, as
  scan's forward pass saves ZeRO-3's gathered weights (``gather_axis``: the
  dim of the row the gather runs along; ``rows``: how many rows are written)."""
  from jax import shard_map
  from jax.sharding import PartitionSpec as P
  from tools.zoo.cases import mesh_of

  def body(w):
    def step(carry):
      i, acc = carry
      row = lax.dynamic_slice_in_dim(w, i, 1, axis=0, allow_negative_indices=False)[0]
      full = lax.all_gather(row, "dp", axis=gather_axis - 1, tiled=True)
      return i + 1, lax.dynamic_update_slice_in_dim(acc, full[None], i, axis=0,
                                                   allow_negative_indices=False)
    shape = list(w.shape)
    shape[gather_axis] *= 4
    _, out = lax.while_loop(lambda c: c[0] < rows, step,
                            (0, jnp.zeros(shape, w.dtype)))
    return out * 2.0
  spec = P(*[None] * gather_axis, "dp")
  mesh = mesh_of((4,), ("dp",))
  fn = shard_map(body, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)
  arg = jax.ShapeDtypeStruct((3, 8, 8), np.float32,
                             sharding=jax.sharding.NamedSharding(mesh, spec))
  return fn, arg


def _dist_program(fn, arg):
  from graphguard_hlo.lowering import lower_distributed
  from graphguard_hlo.pipeline import prepare_dist
  return prepare_dist(lower_distributed(fn, arg))


@pytest.mark.parametrize("gather_axis", [1, 2])
def test_loop_saving_gathered_rows_is_one_gather_of_the_stack(gather_axis):
  from graphguard_hlo.interpret import Interpreter
  fn, arg = _gathering_copy(gather_axis)
  program = _dist_program(fn, arg)
  g = program.graph
  assert not [op for op in g.ops if op.name == "while"]
  (gather,) = [op for op in g.ops if op.name == "all_gather"]
  assert gather.operands[0] is g.params[0]
  assert gather.attrs["all_gather_dimension"] == gather_axis
  # The rewritten program computes what jax does, rank by rank.
  w = np.random.default_rng(0).standard_normal((3, 8, 8)).astype(np.float32)
  want = np.asarray(jax.jit(fn)(jax.device_put(w, arg.sharding)))
  shards = [np.split(w, 4, axis=gather_axis)[r] for r in range(4)]
  out = Interpreter(4).run(g, [shards])[g.results[0].id]
  for r in range(4):
    np.testing.assert_allclose(out[r], want, rtol=1e-6)


def test_loop_saving_some_gathered_rows_is_left_alone():
  program = _dist_program(*_gathering_copy(rows=2))
  assert [op for op in program.graph.walk() if op.name == "while"]
