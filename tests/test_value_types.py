"""Values as their types hold them.  Computed from the rank in a type that
cannot hold them, XLA wraps an unsigned or narrow integer and rounds a
float: the passes reading offsets, rows and masks from the rank
(rank_arith's sympy forms and partition-id tables, rank_tables' masks) must
not read them as exact integers.  Integer division truncates and follows XLA
at zero (x / 0 = -1, x % 0 = x).  Integer constants are compared exactly, and
a constant converted is the converted value."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo.api import verify
from graphguard_hlo.reference import BINARY
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("cp",))


def _identity(x):
  return x


# (type the offset r * size is computed in, tile size): each rank cuts its
# "own" tile of a replicated input at that offset.
@pytest.mark.parametrize("dtype, size", [(jnp.int32, 4), (jnp.uint8, 128), (jnp.int8, 64),
                                         (jnp.int16, 16384), (jnp.float16, 2049)],
                         ids=["i32", "u8_wraps", "i8_wraps", "i16_wraps", "f16_rounds"])
def test_a_tile_offset_is_read_only_where_its_type_holds_it(dtype, size):
  def local(x):
    offset = (lax.axis_index("cp") * size).astype(dtype).astype(jnp.int32) \
        if dtype == jnp.float16 else lax.axis_index("cp").astype(dtype) * jnp.asarray(size, dtype)
    return lax.dynamic_slice_in_dim(x, offset, size, 0)
  x = jnp.zeros((4 * size, 1))
  dist = shard_map(local, mesh=MESH, in_specs=(P(),), out_specs=P("cp"), check_vma=False)
  exact = dtype == jnp.int32
  assert outputs_agree(_identity, dist, x) == exact
  assert verify(_identity, dist, x).refines == exact


def test_a_row_index_wrapping_below_zero_is_not_read_as_row_zero():
  # u32(stage) - 1 is 2**32 - 1 at stage 0, which XLA clamps to the last row.
  def seq(w):
    return jnp.tanh(w[0]) * 3

  def local(w):
    stage = lax.axis_index("cp")
    row = stage.astype(jnp.uint32) - jnp.uint32(1)
    picked = lax.dynamic_index_in_dim(w, row, 0, keepdims=False)
    return lax.psum(jnp.where(stage == 0, jnp.tanh(picked) * 3, 0.0), "cp")
  w = jnp.zeros((4, 8))
  dist = shard_map(local, mesh=MESH, in_specs=P(), out_specs=P())
  assert not outputs_agree(seq, dist, w)
  assert not verify(seq, dist, w).refines


def test_a_mask_wrapping_in_unsigned_arithmetic_is_not_read_as_signed():
  # A binomial gather to rank 0 (half permutes: a rank table), then a mask
  # u32(r) - 1 < 0, false at every rank in u32 (true at rank 0 in int64).
  def local(x):
    r = lax.axis_index("cp")
    a = jnp.concatenate([x, lax.ppermute(x, "cp", [(1, 0), (3, 2)])], 0)
    b = jnp.concatenate([a, lax.ppermute(a, "cp", [(2, 0)])], 0)
    keep = (r.astype(jnp.uint32) - jnp.uint32(1)) < jnp.uint32(0)
    return lax.psum(jnp.where(keep, b, 0.0), "cp")
  x = jnp.zeros((16, 8))
  dist = shard_map(local, mesh=MESH, in_specs=(P("cp"),), out_specs=P(), check_vma=False)
  assert not outputs_agree(_identity, dist, x)
  assert not verify(_identity, dist, x).refines


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int8])
def test_integer_division_and_remainder_are_xlas(dtype):
  info = np.iinfo(dtype)
  values = np.array([7, 0, 1, 5, info.max, info.min, 3], dtype)
  divisors = np.array([2, 3, 0, 0, 7, 1, 1], dtype)
  if info.min < 0:
    values = np.append(values, [info.min, -7]).astype(dtype)
    divisors = np.append(divisors, [-1, 2]).astype(dtype)
  for name, op in (("divide", lax.div), ("remainder", lax.rem)):
    np.testing.assert_array_equal(BINARY[name](values, divisors),
                                  np.asarray(jax.jit(op)(values, divisors)), err_msg=name)


def test_a_quotient_of_a_negative_rank_expression_truncates():
  # lax.div truncates toward zero: (r_y - 4 r_x) / 4 is 0 at r_x = 1, r_y > 0,
  # not the floor -1.  Read as the floor, the tile offset would be n * r_x.
  mesh = mesh_of((2, 4), ("x", "y"))
  rows = 16

  def seq(table, ids):
    return jnp.take(table, ids, axis=0, mode="clip")

  def local(table, ids):
    n = table.shape[0]
    q = lax.div(lax.axis_index("y") - 4 * lax.axis_index("x"), 4)
    lo = q * (-n)
    ids = jnp.clip(ids, 0, rows - 1)
    ok = (ids >= lo) & (ids < lo + n)
    looked_up = jnp.take(table, jnp.where(ok, ids - lo, 0), axis=0, mode="clip")
    return lax.psum(jnp.where(ok[:, None], looked_up, 0.0), "x")
  dist = shard_map(local, mesh=mesh, in_specs=(P("x"), P("y")), out_specs=P("y"),
                   check_vma=False)
  table = np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32)
  ids = np.array([0, 9, 3, 12, 8, 15, 1, 10], np.int32)
  assert not np.allclose(jax.jit(dist)(table, ids), seq(table, ids))
  assert not verify(seq, dist, jnp.zeros((rows, 4)), jnp.zeros((8,), jnp.int32)).refines


@pytest.mark.parametrize("constant, proved", [(10_000_000, True), (10_000_001, False)])
def test_integer_constants_are_compared_exactly(constant, proved):
  # 7 significant digits (the float splats' precision) would make the two one.
  def seq(x):
    return x + 10_000_000
  dist = shard_map(lambda x: x + constant, mesh=MESH, in_specs=(P(),), out_specs=P())
  assert verify(seq, dist, jnp.zeros((6,), jnp.int32)).refines == proved


@pytest.mark.parametrize("through, proved", [(jnp.float32, True), (jnp.int32, False)])
def test_a_constant_converted_is_the_converted_value(through, proved):
  # 0.5 through int32 is 0: x * 0.5 and x * f32(i32(0.5)) differ.
  def seq(x):
    return x * 0.5
  dist = shard_map(lambda x: x * jnp.full_like(x, 0.5).astype(through).astype(jnp.float32),
                   mesh=MESH, in_specs=(P(),), out_specs=P())
  x = jnp.zeros((6,))
  assert outputs_agree(seq, dist, x) == proved
  assert verify(seq, dist, x).refines == proved


@pytest.mark.parametrize("dtype, integer", [
    ("i1", True), ("pred", True), ("i8", True), ("i32", True), ("ui8", True), ("ui64", True),
    ("f32", False), ("bf16", False), ("f8E4M3FN", False), ("index", False), ("complex64", False)])
def test_integer_types_are_named_one_way(dtype, integer):
  """Booleans are integers under both their names (StableHLO's i1, HLO's
  pred), so a rank computation reads the same from either dump; every
  integer type has exact bounds."""
  from graphguard_hlo.reference import is_integer_type, type_bounds
  assert is_integer_type(dtype) == integer
  if integer:
    assert type_bounds(dtype) is not None


def test_compares_read_their_operands_as_their_compare_type_says():
  """StableHLO's compare type: XLA's optimized HLO checks 0 <= i < n with one
  UNSIGNED compare of signed ints (a negative i reads as huge), and a
  TOTALORDER compare orders -0.0 below 0.0 and NaNs past the infinities.
  The interpreter read every compare by its operands' dtype."""
  from graphguard_hlo.reference import evaluate
  from graphguard_hlo import ir
  pred = ir.TensorType((3,), "i1")
  i = np.array([-1, 2, 9], np.int32)
  n = np.array([4, 4, 4], np.int32)
  lt = {"comparison_direction": "LT"}
  unsigned = {**lt, "compare_type": "#stablehlo<comparison_type UNSIGNED>"}
  np.testing.assert_array_equal(evaluate("compare", lt, [i, n], pred), [True, True, False])
  np.testing.assert_array_equal(evaluate("compare", unsigned, [i, n], pred), [False, True, False])
  u = np.array([2**32 - 1, 1, 0], np.uint32)
  signed = {**lt, "compare_type": "#stablehlo<comparison_type SIGNED>"}
  np.testing.assert_array_equal(evaluate("compare", signed, [u, np.ones(3, np.uint32)], pred),
                                [True, False, True])
  x = np.array([-0.0, np.nan, -np.nan], np.float32)
  y = np.array([0.0, np.inf, -np.inf], np.float32)
  total = {**lt, "compare_type": "#stablehlo<comparison_type TOTALORDER>"}
  np.testing.assert_array_equal(evaluate("compare", lt, [x, y], pred), [False, False, False])
  np.testing.assert_array_equal(evaluate("compare", total, [x, y], pred), [True, False, True])
