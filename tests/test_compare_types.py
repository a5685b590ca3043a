"""A compare's type is part of what it computes: TOTALORDER orders -0.0
below 0.0 and NaN above everything (jax's sort comparators), and an UNSIGNED
compare of signed integers reads their bits.  Both programs spell it one way
(``terms.normalize_compare_types``); compares of different types never match
(an audit's false proofs, as a compare and inside an argmax's reducer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo import ir
from graphguard_hlo.passes.terms import attrs_key, normalize_compare_types

MESH = Mesh(np.array(jax.devices()[:4]), ("dp",))
X = jax.ShapeDtypeStruct((8, 4), jnp.float32)


@pytest.mark.parametrize("dtype, given, kept", [
    ("f32", "FLOAT", None), ("f32", "TOTALORDER", "TOTALORDER"), ("i32", "SIGNED", None),
    ("i32", "UNSIGNED", "UNSIGNED"), ("ui32", "UNSIGNED", None), ("ui32", "SIGNED", "SIGNED"),
    ("pred", "UNSIGNED", None)])
def test_a_compare_type_is_kept_only_where_it_is_not_the_operands_own(dtype, given, kept):
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  m.functions["main"] = g
  t = ir.TensorType((), dtype)
  g.params = [m.new_value(t), m.new_value(t)]
  op = m.add_op(g, "compare", g.params, [ir.TensorType((), "pred")], {
      "comparison_direction": "LT", "compare_type": f"#stablehlo<comparison_type {given}>"})
  normalize_compare_types(m)
  assert (kept is None) == ("compare_type" not in op.attrs)
  if kept:
    assert kept in op.attrs["compare_type"]
    assert attrs_key(op.attrs) != attrs_key({"comparison_direction": "LT"})


def _rowwise(f):
  return shard_map(f, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"), check_vma=False)


@pytest.mark.parametrize("total", [lax.lt_to_p, lax.eq_to_p])
def test_a_totalorder_compare_is_not_a_float_one(total):
  float_one = {lax.lt_to_p: lambda x: x < 0, lax.eq_to_p: lambda x: x == 0}[total]
  seq = lambda x: total.bind(x, jnp.zeros_like(x)).astype(jnp.float32)
  assert not gg.verify(seq, _rowwise(lambda x: float_one(x).astype(jnp.float32)), X,
                       mesh=MESH, in_specs=(P("dp"),)).refines
  assert gg.verify(seq, _rowwise(seq), X, mesh=MESH, in_specs=(P("dp"),)).refines


def test_an_argmax_comparing_in_total_order_is_not_jaxs():
  def argmax_by(lt, eq):
    def body(a, b):
      (av, ai), (bv, bi) = a, b
      take = lt(bv, av) | (eq(av, bv) & (ai < bi))
      return lax.select(take, av, bv), lax.select(take, ai, bi)

    def f(x):
      idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)
      return lax.reduce((x, idx), (np.float32(-np.inf), np.int32(0)), body, (1,))[1]
    return f
  floats = argmax_by(lambda a, b: a < b, lambda a, b: a == b)
  total = argmax_by(lambda a, b: lax.lt_to_p.bind(a, b), lambda a, b: lax.eq_to_p.bind(a, b))
  dist = shard_map(total, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"), check_vma=False)
  assert not gg.verify(floats, dist, X, mesh=MESH, in_specs=(P("dp"),)).refines
