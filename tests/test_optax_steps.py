"""Training steps written as users write them: optax's AdamW after clipping
by the global norm, data parallel under GSPMD and ZeRO-style under shard_map
(gradients reduce-scattered, the optimizer run on each rank's rows, its state
sharded, the global norm psum'd), each proved, each with the bug users make."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.report import to_text

RANKS = 4
MESH = Mesh(np.array(jax.devices()[:RANKS]), ("dp",))
D, H, B = 16, 32, 8
PARAMS = {"w1": jax.ShapeDtypeStruct((D, H), jnp.float32),
          "w2": jax.ShapeDtypeStruct((H, D), jnp.float32)}
X = jax.ShapeDtypeStruct((B, D), jnp.float32)
CLIP = optax.clip_by_global_norm(1.0)
ADAMW = optax.adamw(1e-3)
TX = optax.chain(CLIP, ADAMW)


def loss(p, x, y):
  return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)


def rows(tree):
  """Each array leaf split by rows over dp (a scalar, Adam's count, replicated)."""
  return jax.tree.map(lambda a: P("dp") if a.ndim else P(), tree)


def step(p, state, x, y):
  updates, state = TX.update(jax.grad(loss)(p, x, y), state, p)
  return optax.apply_updates(p, updates), state


def clipped_adamw_step(p, state, x, y):
  """The sequential step of the ZeRO programs: clip, then AdamW."""
  g, _ = CLIP.update(jax.grad(loss)(p, x, y), optax.EmptyState())
  updates, state = ADAMW.update(g, state, p)
  return optax.apply_updates(p, updates), state


def _verify(seq, dist, *args, **kw):
  return gg.verify(seq, dist, *args, mesh=MESH, **kw)


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_adamw_with_global_norm_clipping_under_gspmd_is_proved(fsdp):
  """The batch split over dp; with ``fsdp`` the weights and Adam's moments too."""
  state = jax.eval_shape(TX.init, PARAMS)
  pspec, sspec = (P("dp"), rows(state)) if fsdp else (P(), P())
  result = _verify(step, step, PARAMS, state, X, X, in_specs=(pspec, sspec, P("dp"), P("dp")),
                   out_specs=(pspec, sspec))
  assert result.refines, to_text(result, "seq", "dist")


def test_clipping_each_shard_by_its_own_norm_under_gspmd_is_reported():
  """FSDP written with per-shard clipping (each leaf clipped by its own norm,
  ``optax.clip_by_block_rms``' kin) is not the global-norm step."""
  state = jax.eval_shape(TX.init, PARAMS)
  per_leaf = optax.chain(optax.clip(1.0), ADAMW)

  def wrong(p, state, x, y):
    updates, state = per_leaf.update(jax.grad(loss)(p, x, y), state, p)
    return optax.apply_updates(p, updates), state
  result = _verify(step, wrong, PARAMS, state, X, X,
                   in_specs=(P("dp"), rows(state), P("dp"), P("dp")),
                   out_specs=(P("dp"), rows(state)))
  assert not result.refines


# How a rank picks its own rows of a replicated weight (for the update).
OWN_ROWS = {
    "reshape_index": lambda t: t.reshape(RANKS, -1, t.shape[1])[jax.lax.axis_index("dp")],
    "dynamic_slice": lambda t: jax.lax.dynamic_slice_in_dim(
        t, jax.lax.axis_index("dp") * (t.shape[0] // RANKS), t.shape[0] // RANKS, 0),
}


def _zero_step(own_rows, norm_psum=True, grad_scale=1.0 / RANKS, gathered=False):
  """ZeRO: each rank's rows of the gradient (reduce-scattered, averaged),
  clipped by the global norm, AdamW on its rows; weights come in whole, or
  (``gathered``) as rows all-gathered for the forward."""
  def clip(g):
    sq = optax.tree.norm(g, squared=True)
    if norm_psum:
      sq = jax.lax.psum(sq, "dp")
    norm = jnp.sqrt(sq)
    return jax.tree.map(lambda t: jax.lax.select(norm < 1.0, t, (t / norm) * 1.0), g)

  def body(p, state, x, y):
    whole = jax.tree.map(lambda t: jax.lax.all_gather(t, "dp", tiled=True), p) if gathered else p
    g = jax.grad(loss)(whole, x, y)
    g = jax.tree.map(lambda t: jax.lax.psum_scatter(t, "dp", tiled=True) * grad_scale, g)
    mine = p if gathered else jax.tree.map(own_rows, p)
    updates, state = ADAMW.update(clip(g), state, mine)
    return optax.apply_updates(mine, updates), state
  return body


def _zero(**kw):
  state = jax.eval_shape(ADAMW.init, PARAMS)
  pspec = P("dp") if kw.get("gathered") else P()
  specs = (pspec, rows(state), P("dp"), P("dp"))
  dist = shard_map(_zero_step(OWN_ROWS[kw.pop("rows", "dynamic_slice")], **kw), mesh=MESH,
                   in_specs=specs, out_specs=(P("dp"), rows(state)), check_vma=False)
  return _verify(clipped_adamw_step, dist, PARAMS, state, X, X, in_specs=specs)


@pytest.mark.parametrize("how", ["reshape_index", "dynamic_slice", "gathered"])
def test_zero_adamw_with_global_norm_clipping_is_proved(how):
  result = _zero(gathered=True) if how == "gathered" else _zero(rows=how)
  assert result.refines, to_text(result, "seq", "dist")


@pytest.mark.parametrize("how", ["reshape_index", "gathered"])
def test_a_global_norm_of_the_local_rows_is_reported_at_the_sqrt(how):
  """The norm of a rank's own rows only: the squared norm is a partial sum
  over dp never psum'd, and the report says so where it is rooted."""
  kw = {"gathered": True} if how == "gathered" else {"rows": how}
  result = _zero(norm_psum=False, **kw)
  assert not result.refines
  f = result.failure
  assert f.op_name == "sqrt", to_text(result, "seq", "dist")
  assert "partial sum over 'dp'" in f.diagnosis and "missing all-reduce" in f.diagnosis


def test_a_gradient_summed_not_averaged_over_the_batch_is_reported():
  """psum_scatter without the 1/ranks: each rank's gradient rows are 4 times
  the batch mean's."""
  result = _zero(grad_scale=1.0)
  assert not result.refines
  text = to_text(result, "seq", "dist")
  assert "4 times the sequential" in text and "psum where pmean belongs" in text, text
