"""Sums added up in another order by the per-device program (passes/sums.py):
optax's global norm adds each tensor's squares in parameter order; under
shard_map the tiles' squares are psum'd as a group and the replicated
tensors' added once.  Proved; the near misses are not, each reported at the
add that began the sum."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo.api import verify
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("tp",))
SPECS = (P(None, "tp"), P(), P("tp"), P())  # split, replicated, split, replicated


def _norm_in_order(a, b, c, d):
  """optax.tree.norm's order: every tensor's squares, one after the other."""
  total = 0.0
  for x in (a, b, c, d):
    total = total + jnp.sum(jnp.square(x))
  return jnp.sqrt(total)


def _seq(a, b, c, d):
  return a / _norm_in_order(a, b, c, d)


def _dist(group):
  def local(a, b, c, d):
    return a / jnp.sqrt(group(a, b, c, d))
  return shard_map(local, mesh=MESH, in_specs=SPECS, out_specs=P(None, "tp"))


def _grouped(a, b, c, d):
  """The tiles' squares psum'd once, then the replicated ones added."""
  split = jnp.sum(jnp.square(a)) + jnp.sum(jnp.square(c))
  return lax.psum(split, "tp") + (jnp.sum(jnp.square(b)) + jnp.sum(jnp.square(d)))


def _replicas_too(a, b, c, d):
  """The bug: the replicated squares in the psum too, counted |tp| times."""
  return lax.psum(sum(jnp.sum(jnp.square(x)) for x in (a, b, c, d)), "tp")


def _never_reduced(a, b, c, d):
  """The bug: the tiles' squares never psum'd (optax's norm inside shard_map)."""
  return sum(jnp.sum(jnp.square(x)) for x in (a, b, c, d))


def _psum_each(a, b, c, d):
  """Each split tensor psum'd on its own, in optax's order: no regrouping."""
  total = 0.0
  for x, split in ((a, True), (b, False), (c, True), (d, False)):
    s = jnp.sum(jnp.square(x))
    total = total + (lax.psum(s, "tp") if split else s)
  return total


ARGS = (jnp.zeros((8, 16)), jnp.zeros((4, 4)), jnp.zeros((16,)), jnp.zeros((3,)))


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(a.shape).astype(np.float32) for a in ARGS]


def _numerically_equal(group) -> bool:
  xs = _inputs()
  return bool(np.allclose(jax.jit(_seq)(*xs), jax.jit(_dist(group))(*xs), rtol=1e-5))


def test_regrouped_norm_is_proved():
  assert _numerically_equal(_grouped)
  result = verify(_seq, _dist(_grouped), *ARGS)
  assert result.refines, result


def test_norm_in_the_same_order_needs_no_regrouping():
  assert _numerically_equal(_psum_each)
  assert verify(_seq, _dist(_psum_each), *ARGS).refines


def test_replicas_psummed_with_the_tiles_are_reported_at_the_first_add():
  assert not _numerically_equal(_replicas_too)
  result = verify(_seq, _dist(_replicas_too), *ARGS)
  assert not result.refines
  assert result.failure.op_name == "add"
  assert "into the partial sum over 'tp'" in result.failure.diagnosis
  assert "counted 4 times" in result.failure.diagnosis


def test_tiles_never_reduced_are_not_proved():
  # (jax's varying-axes checker rejects this one; with it off it lowers.)
  dist = shard_map(lambda a, b, c, d: a / jnp.sqrt(_never_reduced(a, b, c, d)), mesh=MESH,
                   in_specs=SPECS, out_specs=P(None, "tp"), check_vma=False)
  xs = _inputs()
  assert not np.allclose(jax.jit(_seq)(*xs), jax.jit(dist)(*xs), rtol=1e-5)
  result = verify(_seq, dist, *ARGS)
  assert not result.refines
  assert result.failure.op_name == "add"
  assert "partial sum over 'tp'" in result.failure.diagnosis


def test_a_sum_read_by_another_op_reports_its_terms():
  """The sum of a tile's and a replica's squares, used as is: never formed."""
  def seq(a, b):
    return jnp.sum(jnp.square(a)) + jnp.sum(jnp.square(b))

  def local(a, b):
    return jnp.sum(jnp.square(a)) + jnp.sum(jnp.square(b))

  dist = shard_map(local, mesh=MESH, in_specs=(P(None, "tp"), P()), out_specs=P(),
                   check_vma=False)
  result = verify(seq, dist, *ARGS[:2])
  assert not result.refines
  assert result.failure.op_name == "add"


def test_a_tile_divided_by_an_unreduced_partial_sum_is_not_proved():
  """A broadcast scalar takes its neighbour's tiling only when it is a replica
  (inference: _scalar_broadcast_tilings), not a partial sum."""
  def seq(a, c):
    return a / jnp.sum(c)

  dist = shard_map(lambda a, c: a / jnp.sum(c), mesh=MESH, in_specs=(P(None, "tp"), P("tp")),
                   out_specs=P(None, "tp"), check_vma=False)
  assert not verify(seq, dist, ARGS[0], ARGS[2]).refines

  # The scalar related both ways: the psum'd replica broadcast for the second
  # output, the unreduced local sum broadcast for the division.
  def seq2(a, c):
    s = jnp.broadcast_to(jnp.sum(c), a.shape)
    return a / s, s

  def local2(a, c):
    return a / jnp.sum(c), jnp.broadcast_to(lax.psum(jnp.sum(c), "tp"), a.shape)

  dist2 = shard_map(local2, mesh=MESH, in_specs=(P(None, "tp"), P("tp")),
                    out_specs=(P(None, "tp"), P(None, "tp")), check_vma=False)
  result = verify(seq2, dist2, ARGS[0], ARGS[2])
  assert not result.refines and result.failure.op_name == "divide"
  fixed = shard_map(lambda a, c: a / lax.psum(jnp.sum(c), "tp"), mesh=MESH,
                    in_specs=(P(None, "tp"), P("tp")), out_specs=P(None, "tp"))
  assert verify(seq, fixed, ARGS[0], ARGS[2]).refines


@pytest.mark.parametrize("reduce, proved", [("pmax_each", True), ("pmax_of_the_sum", False)])
def test_partial_maxima_are_never_added(reduce, proved):
  # max(a) + max(b) over columns split over tp: each pmax'd, then added; or
  # added first and the sum pmax'd, which is max_r(a_r + b_r), no sum of maxima.
  def seq(x, w):
    return jnp.max(x, axis=1) + jnp.max(w, axis=1)

  def local(x, w):
    if reduce == "pmax_each":
      return lax.pmax(jnp.max(x, axis=1), "tp") + lax.pmax(jnp.max(w, axis=1), "tp")
    return lax.pmax(jnp.max(x, axis=1) + jnp.max(w, axis=1), "tp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P())
  x = jnp.zeros((8, 16))
  assert outputs_agree(seq, dist, x, x) == proved
  assert verify(seq, dist, x, x).refines == proved
