"""A ring's blocks in zig-zag order (chunk_order.py, ring_blocks.py): folds and scatters.

At ring step t rank r holds rank r - t's zig-zag chunks.  Read plainly their
order differs at every step; read with the ring's axis rotated it is the
zig-zag order at every step, and the steps' blocks fold (a sum or max over
the dim) as contiguous ones do.  Blocks of different orders do not: their
union need not be the dim.  A matmul's shares carried round the ring with
their block (ring attention's dk and dv) add up alike, if every step reads
the contracted rows in one order."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo import ir
from graphguard_hlo.api import verify
from graphguard_hlo.passes.chunk_order import chunk_tiling, rotated_chunk_tilings
from tools.zoo.cases import mesh_of

N = 4
MESH = mesh_of((N,), ("cp",))
X = jnp.zeros((16, 8))


def _zigzag_of(x, r):
  size = x.shape[0] // (2 * N)
  return jnp.concatenate([lax.dynamic_slice_in_dim(x, r * size, size, 0),
                          lax.dynamic_slice_in_dim(x, (2 * N - 1 - r) * size, size, 0)])


def _contiguous_of(x, r):
  return lax.dynamic_slice_in_dim(x, r * (x.shape[0] // N), x.shape[0] // N, 0)


def _column_sums(x):
  return jnp.sum(jnp.exp(x), axis=0)


def _ring_sums(block_at_step):
  """Each rank adds up its column sums of the block it holds at each step:
  ``block_at_step(zigzag, contiguous, t)``, of two rings passing rank r's
  zig-zag chunks and its contiguous tile."""
  def local(x):
    r = lax.axis_index("cp")
    zigzag, contiguous = _zigzag_of(x, r), _contiguous_of(x, r)
    total = jnp.zeros(x.shape[1:], x.dtype)
    for t in range(N):
      total = total + _column_sums(block_at_step(zigzag, contiguous, t))
      zigzag, contiguous = (lax.ppermute(b, "cp", [(i, (i + 1) % N) for i in range(N)])
                            for b in (zigzag, contiguous))
    return total
  return shard_map(local, mesh=MESH, in_specs=(P(),), out_specs=P(), check_vma=False)


def _agree(dist) -> bool:
  x = np.random.default_rng(0).standard_normal(X.shape).astype(np.float32)
  return np.allclose(jax.jit(_column_sums)(x), jax.jit(dist)(x), rtol=1e-5)


def test_zigzag_blocks_passed_round_a_ring_fold_into_the_sum():
  dist = _ring_sums(lambda zigzag, contiguous, t: zigzag)
  assert _agree(dist)
  assert verify(_column_sums, dist, X).refines


def test_contiguous_blocks_passed_round_a_ring_fold_into_the_sum():
  dist = _ring_sums(lambda zigzag, contiguous, t: contiguous)
  assert _agree(dist)
  assert verify(_column_sums, dist, X).refines


def test_blocks_of_two_orders_do_not_fold():
  # Even steps: rank r - t's zig-zag chunks; odd steps: its contiguous tile.
  # Every step holds a tile r - t, but of two different reorderings of the
  # rows, which together miss rows and count others twice.
  dist = _ring_sums(lambda zigzag, contiguous, t: zigzag if t % 2 == 0 else contiguous)
  assert not _agree(dist)
  result = verify(_column_sums, dist, X)
  assert not result.refines
  # Each step's column sums are a partial sum over the ranks; their local
  # total is none.
  assert result.failure.op_name == "output"


def test_a_ring_step_s_chunks_are_named_in_the_zigzag_order():
  mesh = ir.Mesh((("cp", N),))
  for t in range(N):
    # Rank r holds rank (r - t)'s chunks: rows of 1 per chunk, 2N chunks.
    at = {(r,): ((r - t) % N, 2 * N - 1 - (r - t) % N) for r in range(N)}
    axes, plain = chunk_tiling(at, mesh, 2 * N)
    assert axes == ("cp",)
    named = min([(axes, plain), *rotated_chunk_tilings(at, mesh, 2 * N, axes)],
                key=lambda found: found[1])
    assert named == ((ir.rotated_axis("cp", -t, N),), (0, 7, 1, 6, 2, 5, 3, 4))


# -- scatters: shares of a matmul carried round the ring with their block -----
A = jnp.zeros((16, 8))   # [queries, keys]: each rank's rows, its keys block by block
B = jnp.zeros((16, 4))


def _transposed_product(a, b):
  """Sum over the queries: ring attention's dv = p^T dout, by blocks of keys."""
  return a.T @ b


def _shares_round_a_ring(rows_at_step):
  """Rank r's share of each key block of ``a.T @ b``, from its rows of a and
  b (``rows_at_step(x, r, t)``), added to that block's running sum, which
  goes round the ring with the block: after n steps each rank holds its own
  block's sum."""
  ring = [(i, (i + 1) % N) for i in range(N)]

  def local(a, b):
    r = lax.axis_index("cp")
    block = a.shape[1] // N
    cols = lax.dynamic_slice_in_dim(a, r * block, block, 1)  # goes round with its sum
    acc = jnp.zeros((block, b.shape[1]), a.dtype)
    for t in range(N):
      acc = acc + rows_at_step(cols, r, t).T @ rows_at_step(b, r, t)
      cols, acc = lax.ppermute(cols, "cp", ring), lax.ppermute(acc, "cp", ring)
    return acc
  return shard_map(local, mesh=MESH, in_specs=(P(), P()), out_specs=P("cp"), check_vma=False)


def _agree2(dist) -> bool:
  rng = np.random.default_rng(0)
  a, b = (rng.standard_normal(x.shape).astype(np.float32) for x in (A, B))
  return np.allclose(jax.jit(_transposed_product)(a, b), jax.jit(dist)(a, b), rtol=1e-5,
                     atol=1e-5)


def test_shares_of_zigzag_rows_summed_round_a_ring_are_proved():
  dist = _shares_round_a_ring(lambda x, r, t: _zigzag_of(x, r))
  assert _agree2(dist)
  assert verify(_transposed_product, dist, A, B).refines


def _chunk_pair_of(x, r):
  """Chunks 2r and 2r + 1: the contiguous tile, cut as zig-zag's are."""
  size = x.shape[0] // (2 * N)
  return jnp.concatenate([lax.dynamic_slice_in_dim(x, 2 * r * size, size, 0),
                          lax.dynamic_slice_in_dim(x, (2 * r + 1) * size, size, 0)])


def test_shares_of_rows_in_two_orders_are_not_proved():
  # Even steps: the rank's zig-zag rows; odd steps: its contiguous tile.  A
  # block's sum then gathers some rows twice and misses others.
  dist = _shares_round_a_ring(
      lambda x, r, t: _zigzag_of(x, r) if t % 2 == 0 else _chunk_pair_of(x, r))
  assert not _agree2(dist)
  assert not verify(_transposed_product, dist, A, B).refines
