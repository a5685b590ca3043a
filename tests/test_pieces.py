"""Microbatches (passes/pieces.py): each rank's batch sliced into pieces, the
model run on each, the pieces concatenated back or their sums (losses,
weight gradients) added up.  Proved; the near misses are not."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo.api import verify
from graphguard_hlo.relation_check import verify_and_check
from graphguard_hlo.lowering import lower_distributed, lower_sequential
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("dp",))
X = jnp.zeros((16, 8))
W = jnp.zeros((8, 8))


def _layer(x, w):
  return jnp.tanh(x @ w)


def _pieces(x, n):
  rows = x.shape[0] // n
  return [x[m * rows:(m + 1) * rows] for m in range(n)]


def _dist(local, out_specs=P("dp", None), **kw):
  return shard_map(local, mesh=MESH, in_specs=(P("dp", None), P()), out_specs=out_specs, **kw)


def _numbers(seq, dist):
  rng = np.random.default_rng(0)
  x, w = (rng.standard_normal(a.shape).astype(np.float32) for a in (X, W))
  return jax.tree.map(np.asarray, (jax.jit(seq)(x, w), jax.jit(dist)(x, w)))


def _agree(seq, dist) -> bool:
  a, b = _numbers(seq, dist)
  return all(np.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(jax.tree.leaves(a),
                                                                       jax.tree.leaves(b)))


def test_microbatches_concatenated_back_are_the_tile():
  dist = _dist(lambda x, w: jnp.concatenate([_layer(p, w) for p in _pieces(x, 2)]))
  assert _agree(_layer, dist)
  result = verify(_layer, dist, X, W)
  assert result.refines, result


def test_scalar_operands_meet_every_piece():
  def seq(x, w):
    return jnp.clip(_layer(x, w), -0.5, 0.5)
  dist = _dist(lambda x, w: jnp.concatenate([seq(p, w) for p in _pieces(x, 2)]))
  assert _agree(seq, dist)
  assert verify(seq, dist, X, W).refines


def test_microbatches_concatenated_in_the_wrong_order_are_not():
  dist = _dist(lambda x, w: jnp.concatenate([_layer(p, w) for p in _pieces(x, 2)][::-1]))
  assert not _agree(_layer, dist)
  result = verify(_layer, dist, X, W)
  assert not result.refines
  assert "in 2 pieces along dim 0 the per-device program never puts together" in str(
      result.failure.inputs)


def test_pieces_gathered_then_joined_interleave_the_ranks_rows():
  """all_gather(piece m) is rows m of every rank's tile, rank by rank: joined,
  they are not the sequential rows in order (join needs the cut's tiling)."""
  def local(x, w):
    return jnp.concatenate([lax.all_gather(_layer(p, w), "dp", tiled=True)
                            for p in _pieces(x, 2)])
  dist = _dist(local, out_specs=P(), check_vma=False)
  assert not _agree(_layer, dist)
  assert not verify(_layer, dist, X, W).refines


def _loss(x, w):
  return jnp.mean(_layer(x, w) ** 2)


def _accumulated(n, divide=True):
  def local(x, w):
    loss, grad = 0.0, 0.0
    for p in _pieces(x, n):
      l, g = jax.value_and_grad(lambda w: lax.pmean(_loss(p, w), "dp"))(w)
      loss, grad = loss + l, grad + g
    return loss / n, grad / (n if divide else 1)
  return _dist(local, out_specs=(P(), P()))


def _seq_step(x, w):
  return jax.value_and_grad(_loss, argnums=1)(x, w)


def test_accumulated_gradients_are_proved():
  for n in (2, 4):
    assert _agree(_seq_step, _accumulated(n))
    result = verify(_seq_step, _accumulated(n), X, W)
    assert result.refines, result


def test_accumulated_gradients_not_divided_are_reported():
  assert not _agree(_seq_step, _accumulated(2, divide=False))
  result = verify(_seq_step, _accumulated(2, divide=False), X, W)
  assert not result.refines
  assert "2 times the sequential one" in result.failure.diagnosis


def test_a_microbatch_left_out_of_the_sum_is_not_proved():
  def local(x, w):
    first, _ = _pieces(x, 2)
    # Scaled as if it were every row: only the missing rows are wrong.
    return lax.psum(jnp.sum(_layer(first, w) ** 2), "dp") / np.float32(X.size)

  dist = _dist(local, out_specs=P())
  assert not _agree(_loss, dist)
  assert not verify(_loss, dist, X, W).refines


def test_every_piece_relation_holds_numerically():
  seq = lower_sequential(_seq_step, X, W)
  from graphguard_hlo.api import _abstract_args
  dist = lower_distributed(_accumulated(2), *_abstract_args((X, W), MESH, (P("dp", None), P())))
  result, check = verify_and_check(seq, dist)
  assert result.refines and check.ok and check.unknown == 0, check.failures[:3]
  assert check.checked > 0


def _reduce_from(init):
  return lambda y: lax.reduce(y, np.float32(init), lax.add, (0,))


@pytest.mark.parametrize("reduce, combine, proved", [
    (lambda y: jnp.sum(y, axis=0), jnp.add, True),
    (lambda y: jnp.max(y, axis=0), jnp.add, False),     # maxima added
    (_reduce_from(1.0), jnp.add, False),                 # the init counted once a piece
], ids=["sums_added", "maxima_added", "init_twice"])
def test_a_reduce_over_pieces_combines_as_its_reducer(reduce, combine, proved):
  def seq(x, w):
    return reduce(jnp.tanh(x @ w))
  dist = shard_map(lambda x, w: combine(reduce(jnp.tanh(x[:4] @ w)), reduce(jnp.tanh(x[4:] @ w))),
                   mesh=MESH, in_specs=(P(), P()), out_specs=P())
  rng = np.random.default_rng(0)
  x, w = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
  assert np.allclose(jax.jit(dist)(x, w), seq(x, w), atol=1e-5) == proved
  assert verify(seq, dist, jnp.zeros((8, 8)), jnp.zeros((8, 8))).refines == proved


# The sequential program concatenating pieces itself (a loop split per
# microbatch): its operands are the pieces, tiled over no axis; a slice of
# exactly one piece is that piece.  Every rank holds all of x here.
def _halves_seq(read):
  """Both halves of x through the layer, concatenated, and ``read`` of that."""
  return lambda x, w: read(jnp.concatenate([_layer(x[:8], w), _layer(x[8:], w)]))


def _halves_dist(read_halves):
  return shard_map(lambda x, w: read_halves(_layer(x[:8], w), _layer(x[8:], w)), mesh=MESH,
                   in_specs=(P(), P()), out_specs=P())  # (P() for each output)


_JOINED = {  # read of the concatenation (sequential) and of its halves (per device)
    "rowwise_then_joined": (lambda h: jnp.sin(h) * 2,
                            lambda a, b: jnp.concatenate([jnp.sin(a) * 2, jnp.sin(b) * 2])),
    "summed_over_rows": (lambda h: jnp.sum(jnp.tanh(h), 0, keepdims=True),
                         lambda a, b: jnp.sum(jnp.tanh(a), 0, keepdims=True)
                         + jnp.sum(jnp.tanh(b), 0, keepdims=True)),
    "halves_taken": (lambda h: jnp.sin(h)[8:] * 3 + jnp.sin(h)[:8],
                     lambda a, b: jnp.sin(b) * 3 + jnp.sin(a)),
}
_JOINED_WRONGLY = {
    "one_half_summed_twice": lambda a, b: 2 * jnp.sum(jnp.tanh(a), 0, keepdims=True),
    "halves_swapped": lambda a, b: jnp.sin(a) * 3 + jnp.sin(b),
    # (rows 4:12 sequentially: one half taken instead; both halves' sines computed)
    "rows_straddling_the_halves": lambda a, b: (jnp.sin(a) * 3 + a, jnp.sin(b)),
}


@pytest.mark.parametrize("name", sorted(_JOINED))
def test_a_sequential_concatenation_of_pieces_is_read_piece_by_piece(name):
  read, read_halves = _JOINED[name]
  seq, dist = _halves_seq(read), _halves_dist(read_halves)
  assert _agree(seq, dist)
  result, check = verify_and_check(lower_sequential(seq, X, W),
                                   lower_distributed(dist, *_abstract(X, W)))
  assert result.refines, result
  assert check.ok, check


@pytest.mark.parametrize("name", sorted(_JOINED_WRONGLY))
def test_a_sequential_concatenation_of_pieces_read_otherwise_is_not_proved(name):
  read = {"one_half_summed_twice": _JOINED["summed_over_rows"][0],
          "halves_swapped": _JOINED["halves_taken"][0],
          "rows_straddling_the_halves": lambda h: (jnp.sin(h)[4:12] * 3 + h[:8],
                                                   jnp.sin(h)[8:])}[name]
  seq, dist = _halves_seq(read), _halves_dist(_JOINED_WRONGLY[name])
  assert not _agree(seq, dist)
  assert not verify(seq, dist, X, W).refines


def _abstract(*args):
  from graphguard_hlo.api import _abstract_args
  return _abstract_args(args, MESH, (P(), P()))


# A concatenation of each tile's block of every piece in turn (how
# microbatch_loops.py puts a data-parallel rank's microbatches back) is a
# split tiled over "dp"; a slice of one tile's block of a piece is that
# piece's rows there.  Only blocks that are exactly a source's tiles: an
# audit's false proof read rows of a 4-row source, cut in 1-row blocks, as
# its 2-row tiles.
DP2 = mesh_of((2,), ("dp",))


@pytest.mark.parametrize("block, proved", [(2, True), (1, False)])
def test_each_tiles_block_of_every_piece_is_a_tiled_split(block, proved):
  def seq(a, b):
    n = block
    c = jnp.concatenate([a[0:n], b[0:n], a[n:2 * n], b[n:2 * n]])
    return c[0:2], a[0:n], b[0:n], a[n:2 * n], b[n:2 * n]

  def per_device(a, b):
    ga, gb = lax.all_gather(a, "dp", tiled=True), lax.all_gather(b, "dp", tiled=True)
    n = block
    return ga[0:2], ga[0:n], gb[0:n], ga[n:2 * n], gb[n:2 * n]
  dist = shard_map(per_device, mesh=DP2, in_specs=(P("dp"), P("dp")), out_specs=(P(),) * 5,
                   check_vma=False)
  rng = np.random.default_rng(0)
  a, b = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
  agree = all(np.allclose(p, q) for p, q in zip(jax.jit(seq)(a, b), jax.jit(dist)(a, b)))
  assert agree == proved
  assert verify(seq, dist, a, b).refines == proved
