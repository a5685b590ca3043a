"""shard_map as one part of a program partitioned by XLA: a shard_map'd block
inside a jitted training step whose other ops GSPMD partitions, and a
shard_map over some mesh axes only (``axis_names``), the rest left to GSPMD.
Both are handed to XLA's partitioner whole; each is proved, and a missing
psum inside the manual part is reported where the sequential program first
reads the unreduced value.  Also jax's explicit sharding mode
(``jax.make_mesh``'s default axis types): ``out_sharding`` and ``reshard``."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.report import to_text

MESH = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
D, H, B = 16, 32, 8
W1, W2 = jax.ShapeDtypeStruct((D, H), jnp.float32), jax.ShapeDtypeStruct((H, D), jnp.float32)
X = jax.ShapeDtypeStruct((B, D), jnp.float32)
PARAMS = {"w1": W1, "w2": W2}
TP = {"w1": P(None, "tp"), "w2": P("tp", None)}


def block(w1, w2, x, reduce=True):
  y = jax.nn.gelu(x @ w1) @ w2
  return lax.psum(y, "tp") if reduce else y


def loss(p, x):
  return jnp.mean(block(p["w1"], p["w2"], x, reduce=False) ** 2)


def step(p, x, loss=loss):
  g = jax.grad(loss)(p, x)
  return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def manual_block_loss(p, x, reduce=True):
  """The MLP block by hand over tp (batch split over dp), the rest GSPMD's."""
  f = jax.shard_map(lambda a, b, c: block(a, b, c, reduce), mesh=MESH,
                    in_specs=(P(None, "tp"), P("tp", None), P("dp")), out_specs=P("dp"),
                    check_vma=False)
  return jnp.mean(f(p["w1"], p["w2"], x) ** 2)


def _verify(seq, dist, *args, **kw):
  return gg.verify(seq, dist, *args, mesh=MESH, check_relations=True, **kw)


@pytest.mark.parametrize("reduce", [True, False], ids=["psum", "no_psum"])
def test_a_shard_mapped_block_in_a_gspmd_training_step(reduce):
  result = _verify(step, lambda p, x: step(p, x, lambda p, x: manual_block_loss(p, x, reduce)),
                   PARAMS, X, in_specs=(TP, P("dp")), out_specs=TP)
  if reduce:
    assert result.refines, to_text(result, "seq", "dist")
    return
  assert not result.refines  # at the gradient of w2, the first to read the unreduced sum
  assert result.failure.op_name == "dot_general"
  assert result.failure.location.line == inspect.getsourcelines(block)[1] + 1, to_text(
      result, "seq", "dist")
  assert "never reduced" in result.failure.diagnosis and "missing all-reduce" in \
      result.failure.diagnosis


def head(w1, w2, x):
  return jnp.tanh(block(w1, w2, x, reduce=False))


def manual_over_tp_only(w1, w2, x, reduce=True):
  """A shard_map over tp alone: dp stays GSPMD's (the batch, split over it)."""
  f = jax.shard_map(lambda a, b, c: block(a, b, c, reduce), mesh=MESH,
                    in_specs=(P(None, "tp"), P("tp", None), P()), out_specs=P(),
                    axis_names={"tp"}, check_vma=False)
  return jnp.tanh(f(w1, w2, x))


@pytest.mark.parametrize("reduce", [True, False], ids=["psum", "no_psum"])
def test_a_shard_map_over_some_axes_only(reduce):
  result = _verify(head, lambda *a: manual_over_tp_only(*a, reduce=reduce), W1, W2, X,
                   in_specs=(P(None, "tp"), P("tp", None), P("dp")), out_specs=P("dp"))
  if reduce:
    assert result.refines, to_text(result, "seq", "dist")
    return
  assert not result.refines and result.failure.op_name == "tanh"
  assert result.failure.location.line == inspect.getsourcelines(head)[1] + 1
  assert "partial sum" in result.failure.diagnosis and "missing all-reduce" in \
      result.failure.diagnosis


EXPLICIT = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def explicit_fsdp_tp_loss(p, x):
  """FSDP storage (weights split over dp) regathered for TP by ``reshard``."""
  w1 = jax.sharding.reshard(p["w1"], P(None, "tp"))
  w2 = jax.sharding.reshard(p["w2"], P("tp", None))
  y = jnp.dot(jax.nn.gelu(x @ w1), w2, out_sharding=P("dp", None))
  return jnp.mean(y ** 2)


@pytest.mark.parametrize("storage", [{"w1": P(), "w2": P()},
                                     {"w1": P("dp", None), "w2": P(None, "dp")}],
                         ids=["replicated", "fsdp"])
def test_explicit_sharding_mode_training_step(storage):
  with jax.set_mesh(EXPLICIT):
    result = gg.verify(step, lambda p, x: step(p, x, explicit_fsdp_tp_loss), PARAMS, X,
                       mesh=EXPLICIT, in_specs=(storage, P("dp")), out_specs=storage,
                       check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")


def test_explicit_sharding_mode_with_a_wrong_weight_is_refused():
  """The second layer reading the first layer's weight transposed: caught."""
  def wrong(p, x):
    return explicit_fsdp_tp_loss({"w1": p["w1"], "w2": p["w1"].T}, x)
  with jax.set_mesh(EXPLICIT):
    result = gg.verify(step, lambda p, x: step(p, x, wrong), PARAMS, X, mesh=EXPLICIT,
                       in_specs=(TP, P("dp")), out_specs=TP)
  assert not result.refines


@pytest.mark.parametrize("reduce", [True, False], ids=["psum", "no_psum"])
def test_dumped_stablehlo_holding_a_shard_map_over_some_axes(tmp_path, reduce):
  """gg-hlo-verify on the sharded StableHLO file: partitioned by XLA too."""
  from jax.sharding import NamedSharding
  from graphguard_hlo.lowering import abstract_value
  specs = (P(None, "tp"), P("tp", None), P("dp"))
  seq = tmp_path / "seq.mlir"
  seq.write_text(jax.jit(head).lower(W1, W2, X).as_text())
  args = [abstract_value(a, NamedSharding(MESH, s)) for a, s in zip((W1, W2, X), specs)]
  dist = tmp_path / "dist.mlir"
  dist.write_text(jax.jit(lambda *a: manual_over_tp_only(*a, reduce=reduce),
                          out_shardings=NamedSharding(MESH, P("dp"))).lower(*args).as_text())
  result = gg.verify_files(str(seq), str(dist))
  assert result.refines == reduce, to_text(result, "seq", "dist")
