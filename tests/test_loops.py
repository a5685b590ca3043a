"""lax.scan over stacked layers: proved by one inductive step; bugs inside the
loop body are reported at their op."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
LAYERS = 3
ARGS = [jax.ShapeDtypeStruct((8, 16), jnp.float32),
        jax.ShapeDtypeStruct((LAYERS, 16, 32), jnp.float32),
        jax.ShapeDtypeStruct((LAYERS, 32, 16), jnp.float32)]
SPECS = (P(), P(None, None, "tp"), P(None, "tp", None))


def seq(x, w1, w2):
  def layer(h, w):
    a, b = w
    return h + jnp.tanh(h @ a) @ b, None
  return jax.lax.scan(layer, x, (w1, w2))[0]


def _dist(reduce, steps=LAYERS):
  def body(x, w1, w2):
    def layer(h, w):
      a, b = w
      return h + reduce(jnp.tanh(h @ a) @ b), None
    return jax.lax.scan(layer, x, (w1[:steps], w2[:steps]))[0] if steps != LAYERS else \
        jax.lax.scan(layer, x, (w1, w2))[0]
  return shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P(), check_vma=False)


def _verify(dist):
  return gg.verify(seq, dist, *ARGS, mesh=MESH, in_specs=SPECS)


def test_scan_is_proved_by_induction():
  result = _verify(_dist(lambda y: jax.lax.psum(y, "tp")))
  assert result.refines, result


def test_scan_under_gspmd_is_proved():
  result = gg.verify(seq, seq, *ARGS, mesh=MESH, in_specs=SPECS, out_specs=P())
  assert result.refines, result


def test_missing_psum_inside_the_body_is_reported_there():
  result = _verify(_dist(lambda y: y))
  assert not result.refines
  assert result.failure.op_name == "add"
  assert "missing all-reduce" in result.failure.diagnosis
  assert "test_loops.py" in str(result.failure.location)


def test_wrong_scale_inside_the_body_breaks_the_invariant():
  result = _verify(_dist(lambda y: jax.lax.pmean(y, "tp")))
  assert not result.refines
  assert "pmean where psum belongs" in result.failure.diagnosis


def test_different_trip_count_is_not_proved():
  def body(x, w1, w2):
    def layer(h, w):
      a, b = w
      return h + jax.lax.psum(jnp.tanh(h @ a) @ b, "tp"), None
    return jax.lax.scan(layer, x, (w1[:2], w2[:2]))[0]
  dist = shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P())
  assert not _verify(dist).refines
