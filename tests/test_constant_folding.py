"""Constants computed from constants fold, on both sides, so backward passes'
cotangent scalars ((1/4)/16 on the devices, 1/64 sequentially) meet."""

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.passes.dist_program import DistProgram
from graphguard_hlo.passes.inference import verify_programs
from graphguard_hlo.passes.layout import Layout

MESH = ir.Mesh((("dp", 4),))


def _const(m, g, v, shape=()):
  c = m.add_op(g, "constant", [], [ir.TensorType((), "f32")],
               {"value": np.array(v, np.float32)}).result
  if shape:
    c = m.add_op(g, "broadcast_in_dim", [c], [ir.TensorType(shape, "f32")],
                 {"broadcast_dimensions": ()}).result
  return c


def _program(shape, scale_ops):
  m = ir.Module("<t>", "stablehlo")
  g = ir.Graph("main")
  x = m.new_value(ir.TensorType(shape, "f32"), name="x")
  g.params, g.param_attrs, g.param_locations = [x], [{}], [ir.UNKNOWN_LOCATION]
  y = x
  for name, a, b in scale_ops:
    k = m.add_op(g, name, [_const(m, g, a), _const(m, g, b)], [ir.TensorType((), "f32")]).result
    kb = m.add_op(g, "broadcast_in_dim", [k], [ir.TensorType(shape, "f32")],
                  {"broadcast_dimensions": ()}).result
    y = m.add_op(g, "multiply", [y, kb], [ir.TensorType(shape, "f32")]).result
  g.results = [y]
  m.functions["main"] = g
  return m, g


def test_folded_scalars_meet():
  seq, _ = _program((8, 4), [("divide", 1.0, 64.0)])
  dist, dg = _program((2, 4), [("divide", 1.0, 4.0), ("divide", 1.0, 16.0)])
  layout = Layout((("dp",), ()))
  prog = DistProgram(dist, dg, MESH, [layout], [layout], "shard_map")
  assert verify_programs(seq, prog).refines


def test_a_different_constant_is_caught():
  seq, _ = _program((8, 4), [("divide", 1.0, 64.0)])
  dist, dg = _program((2, 4), [("divide", 1.0, 4.0), ("divide", 1.0, 4.0)])
  layout = Layout((("dp",), ()))
  prog = DistProgram(dist, dg, MESH, [layout], [layout], "shard_map")
  result = verify_programs(seq, prog)
  assert not result.refines
  assert "4 times" in result.failure.diagnosis or "0.25 times" in result.failure.diagnosis


# -- folding only what IEEE fixes to the bit (a helper audit's false proofs) ----

def _verify_jax(seq, dist_body):
  import jax
  import jax.numpy as jnp
  from jax import shard_map
  from jax.sharding import Mesh, PartitionSpec as P
  import graphguard_hlo as gg
  mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
  dist = shard_map(dist_body, mesh=mesh, in_specs=(P("tp"),), out_specs=P("tp"))
  return gg.verify(seq, dist, jax.ShapeDtypeStruct((8,), jnp.float32), mesh=mesh,
                   in_specs=(P("tp"),))


def test_a_transcendental_of_a_constant_is_not_folded():
  """erfc(0.07957394) is 0.9103996 in XLA's float32 polynomial and
  0.91039956 correctly rounded: a program holding the latter must not be
  proved equal to one computing the former.  Computed on both sides, it is
  the same op of the same splat."""
  import math
  import jax.numpy as jnp
  from jax import lax
  c = np.float32(0.07957394)
  rounded = np.float32(math.erfc(float(c)))
  seq = lambda x: x * lax.erfc(jnp.float32(c))
  assert not _verify_jax(seq, lambda x: x * rounded).refines
  assert _verify_jax(seq, seq).refines


def test_only_s_minus_positive_zero_is_s():
  """-0.0 - (-0.0) is +0.0: 1 / (x - (-0.0)) is +inf where 1 / x is -inf."""
  import jax.numpy as jnp
  assert _verify_jax(lambda x: 1 / (x - jnp.float32(0.0)), lambda x: 1 / x).refines
  assert not _verify_jax(lambda x: 1 / (x - jnp.float32(-0.0)), lambda x: 1 / x).refines


def test_a_bitwise_or_reduce_of_integers_is_no_max():
  """reduce_or([1, 2]) is 3, not max = 2 (an audit's false proof: the
  sequential select on it was folded to its other branch)."""
  import jax
  import jax.numpy as jnp
  from jax import lax, shard_map
  from jax.sharding import Mesh, PartitionSpec as P
  import graphguard_hlo as gg
  from graphguard_hlo import ir
  from graphguard_hlo.passes.collectives import reducer_kind
  mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))

  def seq(x):
    c = lax.reduce(jnp.array([1, 2], jnp.int32), np.int32(0), lax.bitwise_or, (0,))
    return jnp.where(c == 3, x * 2, x * 3)
  thrice = shard_map(lambda x: x * 3, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"),
                     check_vma=False)
  x = jax.ShapeDtypeStruct((8, 1), jnp.float32)
  assert not gg.verify(seq, thrice, x, mesh=mesh, in_specs=(P("dp"),)).refines

  def region(dtype, name):
    m = ir.Module("<test>", "stablehlo")
    g = ir.Graph("r")
    t = ir.TensorType((), dtype)
    g.params = [m.new_value(t), m.new_value(t)]
    g.results = [m.add_op(g, name, g.params, [t], {}).result]
    return g
  assert reducer_kind(region("i32", "or")) is None and reducer_kind(region("i32", "and")) is None
  assert (reducer_kind(region("pred", "or")), reducer_kind(region("pred", "and"))) == ("max", "min")
