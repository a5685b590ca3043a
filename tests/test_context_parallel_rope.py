"""Context parallelism as a user writes it: keys, values and segment ids
all-gathered over "cp", RoPE by ``rotate_half`` at float positions made as
``(jnp.arange(n) + rank * n).astype(jnp.float32)``, a packed-sequence mask
(segment ids equal) and a causal mask from the positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg

MESH = Mesh(np.array(jax.devices()[:4]), ("cp",))
B, T, H, D = 2, 16, 2, 8
QKV = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)
SEGMENTS = jax.ShapeDtypeStruct((B, T), jnp.int32)
SPECS = (P(None, "cp"),) * 4


def rotate_half(x):
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def rope(x, positions):
  inv_freq = 1.0 / (10000 ** (jnp.arange(0, D, 2) / D))
  angles = positions[:, None] * inv_freq[None, :]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[None, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[None, :, None, :]
  return x * cos + rotate_half(x) * sin


def attention(q, k, v, seg_q, seg_k, pos_q, pos_k):
  q, k = rope(q, pos_q), rope(k, pos_k)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
  mask = (seg_q[:, None, :, None] == seg_k[:, None, None, :]) & \
      (pos_q[None, None, :, None] >= pos_k[None, None, None, :])
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)


def sequential(q, k, v, segments):
  positions = jnp.arange(T, dtype=jnp.float32)
  return attention(q, k, v, segments, segments, positions, positions)


def context_parallel(offset: bool):
  def body(q, k, v, segments):
    n = T // 4
    start = jax.lax.axis_index("cp") * n if offset else 0
    pos_q = (jnp.arange(n) + start).astype(jnp.float32)
    gather = lambda x: jax.lax.all_gather(x, "cp", axis=1, tiled=True)
    return attention(q, gather(k), gather(v), segments, gather(segments), pos_q,
                     jnp.arange(T, dtype=jnp.float32))
  return shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P(None, "cp"))


@pytest.mark.parametrize("offset", [True, False])
def test_shard_map(offset):
  result = gg.verify(sequential, context_parallel(offset), QKV, QKV, QKV, SEGMENTS,
                     mesh=MESH, in_specs=SPECS)
  assert result.refines == offset, result
  if not offset:  # RoPE's first product reading the positions' angles
    assert result.failure.op_name == "multiply"
    assert "counts 0..15; the per-device program counts 0..3" in result.failure.diagnosis
    assert "with no rank offset" in result.failure.diagnosis


def test_gspmd():
  result = gg.verify(sequential, sequential, QKV, QKV, QKV, SEGMENTS, mesh=MESH,
                     in_specs=SPECS, out_specs=P(None, "cp"))
  assert result.refines, result


@pytest.mark.parametrize("dtype, refines", [(jnp.int8, False), (jnp.int16, True)])
def test_integer_positions_that_wrap_are_not_a_float_iota(dtype, refines):
  """int8 positions 120 + 0..39 wrap to -128 at 128; the float iota counts
  on (a helper audit's false proof)."""
  length = 160
  seq = lambda x: x * jnp.arange(length, dtype=jnp.float32)

  def body(x):
    n = length // 4
    start = (jax.lax.axis_index("cp") * n).astype(dtype)
    return x * (jnp.arange(n, dtype=dtype) + start).astype(jnp.float32)
  dist = shard_map(body, mesh=MESH, in_specs=(P("cp"),), out_specs=P("cp"))
  result = gg.verify(seq, dist, jax.ShapeDtypeStruct((length,), jnp.float32), mesh=MESH,
                     in_specs=(P("cp"),))
  assert result.refines == refines, result
