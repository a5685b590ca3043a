"""Ring attention masked with -inf: where a row of every block so far is
masked, the running max is -inf and the program computes exp(-inf + inf) =
NaN (flash attention's classic bug).  The online softmax's telescoping is an
identity only for a finite max, so such steps are not rewritten
(``online_softmax._max_may_be_infinite``); a finite mask (-1e9) is proved."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo.api import verify
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("cp",))
B, T, H, HD = 1, 8, 1, 4


def _attention(mask_value, spelling=None):
  """``spelling``: the causal mask as the ring spells it (default: ``tril``)."""
  def seq(q, k, v):
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.float32(2.0)
    if spelling is None:
      scores = jnp.where(jnp.tril(jnp.ones((T, T), dtype=bool)), scores, mask_value)
    else:
      positions = jnp.arange(T, dtype=jnp.int32)
      scores = _SPELLINGS[spelling](positions, positions, scores, mask_value)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhst,bthd->bshd", probs, v).reshape(B, T, H * HD)
  return seq


_SPELLINGS = {  # the causal mask of rows against columns, three ways
    "rows_ge_cols": lambda rows, cols, s, fill: jnp.where(rows[:, None] >= cols[None, :], s, fill),
    "cols_le_rows": lambda rows, cols, s, fill: jnp.where(cols[None, :] <= rows[:, None], s, fill),
    "fill_where_lt": lambda rows, cols, s, fill: jnp.where(rows[:, None] < cols[None, :], fill, s),
}


def _ring(mask_value, passed_first=True, spelling="rows_ge_cols"):
  """Online-softmax ring attention whose k/v are passed on once before the
  first step: rank r starts on key block r - 1, which for rank 0 is wholly
  masked (correct in real arithmetic; NaN with an infinite mask).
  ``passed_first=False``: each rank starts on its own block, whose diagonal
  it keeps (finite from the first step on, whatever the mask value)."""
  first = 1 if passed_first else 0

  def local(q, k, v):
    b, s, h, hd = q.shape
    n, r = lax.axis_size("cp"), lax.axis_index("cp")
    perm = [(i, (i + 1) % n) for i in range(n)]
    if passed_first:
      k, v = lax.ppermute(k, "cp", perm), lax.ppermute(v, "cp", perm)
    m = jnp.full((b, h, s), -jnp.inf, jnp.float32)
    l, o = jnp.zeros((b, h, s), jnp.float32), jnp.zeros((b, h, s, hd), jnp.float32)
    for t in range(n):
      rows = jnp.arange(s, dtype=jnp.int32) + r * s
      cols = jnp.arange(s, dtype=jnp.int32) + ((r - t - first) % n) * s
      scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.float32(2.0)
      scores = _SPELLINGS[spelling](rows, cols, scores, mask_value)
      m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
      rescale = jnp.exp(m - m_new)
      p = jnp.exp(scores - m_new[..., None])
      l = rescale * l + jnp.sum(p, axis=-1)
      o = rescale[..., None] * o + jnp.einsum("bhst,bthd->bhsd", p, v)
      m = m_new
      if t < n - 1:
        k, v = lax.ppermute(k, "cp", perm), lax.ppermute(v, "cp", perm)
    return (o / l[..., None]).transpose(0, 2, 1, 3).reshape(b, s, h * hd)
  spec = P(None, "cp")
  return jax.jit(shard_map(local, mesh=MESH, in_specs=(spec,) * 3, out_specs=spec))


@pytest.mark.parametrize("mask_value, passed_first, proved", [
    (-1e9, True, True), (-np.inf, True, False), (-np.inf, False, True)],
    ids=["finite_mask", "infinite_mask", "infinite_mask_own_block_first"])
def test_a_ring_masked_with_minus_infinity_is_proved_only_if_its_max_is_finite(
    mask_value, passed_first, proved):
  """With -inf, only the ring whose first block keeps a key in every row (its
  own block's diagonal) computes finite numbers, and only it is proved."""
  seq, dist = _attention(mask_value), _ring(mask_value, passed_first)
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, T, H, HD)).astype(np.float32) for _ in range(3))
  assert np.allclose(np.asarray(dist(q, k, v)), np.asarray(seq(q, k, v)), atol=1e-5) == proved
  z = jax.ShapeDtypeStruct((B, T, H, HD), np.float32, sharding=NamedSharding(MESH, P(None, "cp")))
  assert verify(seq, dist, z, z, z).refines == proved


# Masks an audit found the first guard blind to: it looked for infinite
# constants only.  Rows 0..7 (rank 0's) have their first ring block (their
# own) wholly masked, so the device computes NaN there with an infinite mask.
S, D, N = 8, 4, 4
MIN = float(np.finfo(np.float32).min)
_MASKS = {
    # keep: a 0/1 float mask; bias: an additive bias (input) -- see _biased_case
    "log_of_mask": lambda s, keep, bias: s + jnp.log(keep),          # log(0) = -inf
    "bias_input": lambda s, keep, bias: s + bias,                    # -inf given as input
    "two_min_masks": lambda s, keep, bias: (jnp.where(keep > 0, s, MIN)   # overflow
                                            + jnp.where(keep > 0, 0.0, MIN)),
    "one_min_mask": lambda s, keep, bias: jnp.where(keep > 0, s, MIN),    # finite
    "finite_mask": lambda s, keep, bias: jnp.where(keep > 0, s, -1e9),
}


def _biased_case(mask):
  def seq(q, k, v, keep, bias):
    s = _MASKS[mask](q @ k.T, keep, bias)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return (p @ v) / jnp.sum(p, axis=-1, keepdims=True)

  def local(q, k, v, keep, bias):
    r = lax.axis_index("cp")
    m = jnp.full((S,), -jnp.inf, jnp.float32)
    l, o = jnp.zeros((S,), jnp.float32), jnp.zeros((S, D), jnp.float32)
    perm = [(i, (i + 1) % N) for i in range(N)]
    for t in range(N):
      block = lambda x: lax.dynamic_slice_in_dim(x, ((r - t) % N) * S, S, axis=1)
      s = _MASKS[mask](q @ k.T, block(keep), block(bias))
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      rescale = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new[:, None])
      l = rescale * l + jnp.sum(p, axis=-1)
      o = rescale[:, None] * o + p @ v
      m = m_new
      if t < N - 1:
        k, v = lax.ppermute(k, "cp", perm), lax.ppermute(v, "cp", perm)
    return o / l[:, None]

  dist = jax.jit(shard_map(local, mesh=MESH, in_specs=(P("cp"),) * 5, out_specs=P("cp"),
                           check_vma=False))
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((N * S, D)).astype(np.float32) for _ in range(3))
  keep = np.ones((N * S, N * S), np.float32)
  keep[:S, :S] = 0.0
  bias = np.where(keep > 0, 0.0, -np.inf if mask == "bias_input" else -1e9).astype(np.float32)
  return seq, dist, (q, k, v, keep, bias)


@pytest.mark.parametrize("mask, proved", [
    ("log_of_mask", False), ("bias_input", False), ("two_min_masks", False),
    ("one_min_mask", True), ("finite_mask", True)])
def test_a_ring_mask_infinite_at_run_time_is_not_proved(mask, proved):
  seq, dist, args = _biased_case(mask)
  agree = np.allclose(np.asarray(dist(*args)), np.asarray(seq(*args)), atol=1e-5)
  assert agree == proved  # each refused mask really makes NaN rows
  result = verify(seq, dist, *args, mesh=MESH, in_specs=(P("cp"),) * 5)
  assert result.refines == proved
  if not proved:
    assert "running max may be infinite" in result.failure.diagnosis
    assert {"log_of_mask": "log", "bias_input": "with an input",
            "two_min_masks": "may overflow to inf"}[mask] in result.failure.diagnosis


@pytest.mark.parametrize("spelling", sorted(_SPELLINGS))
@pytest.mark.parametrize("passed_first", [False, True], ids=["own_block_first", "passed_first"])
@pytest.mark.parametrize("vectors_only", [False, True], ids=["mask_computed", "vectors_only"])
def test_a_causal_mask_keeping_a_key_in_every_row_is_seen_however_spelled(
    spelling, passed_first, vectors_only, monkeypatch):
  """``finite_rows`` reads the mask's numbers on every rank; a real block's
  mask is too large for that (4096^2), and then only the row and column
  vectors are computed (``vectors_only``: tables past 3 elements are not)."""
  from graphguard_hlo.passes import constant_values
  if vectors_only:
    monkeypatch.setattr(constant_values, "MAX_ELEMENTS", 3)
  seq, dist = _attention(-np.inf, spelling), _ring(-np.inf, passed_first, spelling)
  z = jax.ShapeDtypeStruct((B, T, H, HD), np.float32, sharding=NamedSharding(MESH, P(None, "cp")))
  assert verify(seq, dist, z, z, z).refines == (not passed_first)


F32 = np.float32
_HIDDEN = {  # an outer mask keeping every key, an inner causal one (an audit's false proofs)
    "inner_overflow": lambda rows, cols, s, fill: jnp.where(
        rows[:, None] + 1000 >= cols[None, :],
        jnp.where(rows[:, None] >= cols[None, :], s * F32(1e-30), F32(-1e30)) * F32(1e30), fill),
    "inner_minimum": lambda rows, cols, s, fill: jnp.where(
        rows[:, None] + 1000 >= cols[None, :],
        jnp.minimum(s, jnp.where(rows[:, None] >= cols[None, :], F32(np.inf), F32(-np.inf))),
        fill),
    "inner_finite": lambda rows, cols, s, fill: jnp.where(
        rows[:, None] + 1000 >= cols[None, :],
        jnp.where(rows[:, None] >= cols[None, :], s, F32(-1e9)), fill),
}


@pytest.mark.parametrize("spelling, proved", [
    ("inner_overflow", False), ("inner_minimum", False), ("inner_finite", True)])
def test_an_infinite_mask_behind_another_op_is_seen(spelling, proved, monkeypatch):
  """The outer mask keeps a key in every row, but an inner causal mask makes
  rank 0's first block -inf anyway: by overflow (-1e30 * 1e30) or through a
  minimum.  The walk looked at fills and biases of infinite constants only;
  nonfinite.py follows every op between the scores' matmul and their max."""
  monkeypatch.setitem(_SPELLINGS, spelling, _HIDDEN[spelling])
  seq, dist = _attention(-np.inf, spelling), _ring(-np.inf, True, spelling)
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, T, H, HD)).astype(np.float32) for _ in range(3))
  assert np.allclose(np.asarray(dist(q, k, v)), np.asarray(seq(q, k, v)), atol=1e-5) == proved
  z = jax.ShapeDtypeStruct((B, T, H, HD), np.float32, sharding=NamedSharding(MESH, P(None, "cp")))
  result = verify(seq, dist, z, z, z)
  assert result.refines == proved
  if not proved:
    assert "the scores may be infinite" in result.failure.diagnosis
