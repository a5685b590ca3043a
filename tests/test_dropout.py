"""Dropout as users write it, ``jax.random.bernoulli`` on a key argument,
inside a tensor-parallel MLP.  Under GSPMD, XLA partitions the draw (jax's
partitionable threefry numbers each element by its place in the whole shape):
proved.  Under shard_map a rank's mask is its tile of the sequential one only
if it draws the whole shape and slices it; a rank drawing a mask of its
local shape, or with a key folded with its rank, gets other bits, and each is
reported inside the draw with words that say so."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.report import to_text

RANKS = 4
MESH = Mesh(np.array(jax.devices()[:RANKS]), ("tp",))
B, D, H = 8, 16, 32
KEEP = 0.9
ARGS = (jax.ShapeDtypeStruct((D, H), jnp.float32), jax.ShapeDtypeStruct((H, D), jnp.float32),
        jax.ShapeDtypeStruct((B, D), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32))
TP = (P(None, "tp"), P("tp", None), P(), P())


def dropped(h, keep):
  return jnp.where(keep, h / KEEP, 0)


def mlp(w1, w2, x, key, keep_prob=KEEP):
  h = jax.nn.relu(x @ w1)
  keep = jax.random.bernoulli(key, keep_prob, h.shape)
  return dropped(h, keep) @ w2


# Where the sequential draw is: each bug must be reported there.
DRAW_LINE = inspect.getsourcelines(mlp)[1] + 2


def mlp_seeded(w1, w2, x, seed):
  """A typed key made from an integer seed (jax masks it with 0xFFFFFFFF)."""
  return mlp(w1, w2, x, jax.random.key_data(jax.random.key(seed)))


def tp_whole_draw_sliced(w1, w2, x, key):
  h = jax.nn.relu(x @ w1)
  keep = jax.random.bernoulli(key, KEEP, (B, H))
  keep = lax.dynamic_slice_in_dim(keep, lax.axis_index("tp") * (H // RANKS), H // RANKS, 1)
  return lax.psum(dropped(h, keep) @ w2, "tp")


def tp_local_draw(w1, w2, x, key):
  """The bug: every rank draws a mask of its own [B, H / 4] shape."""
  h = jax.nn.relu(x @ w1)
  return lax.psum(dropped(h, jax.random.bernoulli(key, KEEP, h.shape)) @ w2, "tp")


def tp_rank_key_whole_draw(w1, w2, x, key):
  """The bug: the whole shape drawn, but with a key folded with the rank."""
  h = jax.nn.relu(x @ w1)
  r = lax.axis_index("tp")
  keep = jax.random.bernoulli(jax.random.fold_in(key, r), KEEP, (B, H))
  keep = lax.dynamic_slice_in_dim(keep, r * (H // RANKS), H // RANKS, 1)
  return lax.psum(dropped(h, keep) @ w2, "tp")


def _shard_map(f):
  return shard_map(f, mesh=MESH, in_specs=TP, out_specs=P())


def _verify(seq, dist, args=ARGS, **kw):
  return gg.verify(seq, dist, *args, check_relations=True, **kw)


def _gspmd(specs):
  return {"mesh": MESH, "in_specs": specs, "out_specs": P()}


@pytest.mark.parametrize("specs", [TP, (P(), P(), P("tp"), P())], ids=["tp", "dp"])
def test_dropout_under_gspmd_is_proved(specs):
  out = {"out_specs": P("tp") if specs[2] == P("tp") else P()}
  result = _verify(mlp, mlp, **{**_gspmd(specs), **out})
  assert result.refines, to_text(result, "seq", "dist")


def test_dropout_with_a_key_made_from_a_seed_under_gspmd_is_proved():
  """The seed's 0xFFFFFFFF mask, which XLA drops, is the identity."""
  args = ARGS[:3] + (jax.ShapeDtypeStruct((), jnp.uint32),)
  result = _verify(mlp_seeded, mlp_seeded, args, **_gspmd(TP))
  assert result.refines, to_text(result, "seq", "dist")


def test_whole_draw_sliced_per_rank_under_shard_map_is_proved():
  result = _verify(mlp, _shard_map(tp_whole_draw_sliced))
  assert result.refines, to_text(result, "seq", "dist")


def _failure_words(result):
  assert not result.refines
  f = result.failure
  assert f.location.line == DRAW_LINE, to_text(result, "seq", "dist")
  return f.diagnosis


def test_a_local_shaped_draw_is_reported_at_the_draws_counters():
  words = _failure_words(_verify(mlp, _shard_map(tp_local_draw)))
  assert f"element counters of a jax.random draw of shape {(B, H)}" in words
  assert "draws for another shape" in words


def test_a_key_folded_with_the_rank_is_reported_inside_the_draw():
  words = _failure_words(_verify(mlp, _shard_map(tp_rank_key_whole_draw)))
  assert "part of a jax.random draw (_bernoulli)" in words
  assert "another key (one folded with the rank" in words


def test_another_key_under_gspmd_is_reported_inside_the_draw():
  def other_key(w1, w2, x, key):
    return mlp(w1, w2, x, jax.random.fold_in(key, 1))
  words = _failure_words(_verify(mlp, other_key, **_gspmd(TP)))
  assert "part of a jax.random draw (_bernoulli)" in words


def test_another_keep_probability_is_reported_at_the_comparison():
  def keeps_less(w1, w2, x, key):
    return mlp(w1, w2, x, key, keep_prob=0.8)
  result = _verify(mlp, keeps_less, **_gspmd(TP))
  assert not result.refines and result.failure.op_name == "compare"
  assert "the constant 0.8 where the sequential compare reads 0.9" in result.failure.diagnosis
