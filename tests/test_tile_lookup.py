"""Lookups in a table split by rows (``passes/tile_lookup.py``): the lane
intervals are sound, the spellings of ``gg.tile_gather`` / ``gg.tile_scatter``
that are one are proved, and near misses are not."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo import ir, reference
from graphguard_hlo.lowering import lower_distributed, lower_sequential
from graphguard_hlo.passes import tile_lookup
from graphguard_hlo.pipeline import verify_modules
from tools.zoo.cases import mesh_of

# -- intervals ----------------------------------------------------------------------

_LOC = ir.Location("test", 0, 0)
_BINARY = ("add", "subtract", "multiply", "maximum", "minimum")
_BOOL = ("and", "or")


def _op(name, arity, dtype, attrs=None):
  operands = [ir.Value(k, ir.TensorType((), "i32")) for k in range(arity)]
  op = ir.Op(name, operands, attrs or {}, [], _LOC)
  op.results = [ir.Value(99, ir.TensorType((), dtype), op, 0)]
  return op


@st.composite
def intervals(draw, lo=-6, hi=6):
  a = draw(st.integers(lo, hi))
  return a, draw(st.integers(a, hi))


@st.composite
def interval_cases(draw):
  """An op the lanes read, with random operand intervals (bools as 0/1)."""
  kind = draw(st.sampled_from(["binary", "negate", "clamp", "compare", "bool", "not",
                               "select", "to_pred"]))
  if kind == "binary":
    return _op(draw(st.sampled_from(_BINARY)), 2, "i32"), [draw(intervals()) for _ in "ab"]
  if kind == "negate":
    return _op("negate", 1, "i32"), [draw(intervals())]
  if kind == "clamp":
    return _op("clamp", 3, "i32"), [draw(intervals()) for _ in "abc"]
  if kind == "compare":
    direction = draw(st.sampled_from(sorted(reference.COMPARISONS)))
    op = _op("compare", 2, "pred", {"comparison_direction": direction})
    return op, [draw(intervals()) for _ in "ab"]
  if kind == "bool":
    return _op(draw(st.sampled_from(_BOOL)), 2, "pred"), [draw(intervals(0, 1)) for _ in "ab"]
  if kind == "not":
    return _op("not", 1, "pred"), [draw(intervals(0, 1))]
  if kind == "select":
    return _op("select", 3, "i32"), [draw(intervals(0, 1)), draw(intervals()),
                                     draw(intervals())]
  return _op("convert", 1, "pred"), [draw(intervals())]


def _concrete(op, values):
  """The op on concrete values, by the reference evaluator."""
  name = op.name
  args = [np.array(v, np.int32) for v in values]
  if name in _BOOL + ("not",):
    args = [a.astype(bool) for a in args]
    return int({"and": np.logical_and, "or": np.logical_or}[name](*args)
               if name != "not" else np.logical_not(args[0]))
  if name == "select":
    args[0] = args[0].astype(bool)
  out = reference.evaluate(name, op.attrs, args, op.results[0].type)
  return int(np.asarray(out).astype(np.int64))


@settings(max_examples=600, deadline=None, derandomize=True)
@given(interval_cases())
def test_lane_intervals_hold_every_value_they_stand_for(case):
  """Whatever concrete operands the intervals hold, the op's result lies in
  the interval ``_apply`` gives (exactly, where it says decided)."""
  op, args = case
  out = tile_lookup._apply(op, [(np.array([a]), np.array([b])) for a, b in args])
  assert out is not None, op.name
  lo, hi = int(out[0][0]), int(out[1][0])
  for values in itertools.product(*(range(a, b + 1) for a, b in args)):
    assert lo <= _concrete(op, values) <= hi, (op.name, op.attrs, args, values, (lo, hi))


# -- programs -----------------------------------------------------------------------

V, D, N = 16, 4, 4  # table rows, width, ranks


def _mesh():
  return mesh_of((N,), ("tp",))


def _take(ids, table):
  return jnp.take(table, ids, axis=0, mode="clip")


def _masked_lookup(clip=True, first=0, offset=0, mask_rows=True, local_rows=True):
  """Megatron's vocab-parallel lookup, and near misses of it."""
  def local(ids, table):
    n = table.shape[0]
    if clip:
      ids = jnp.clip(ids, 0, n * N - 1)
    lo = lax.axis_index("tp") * n + offset
    mine = (ids >= lo + first) & (ids < lo + n)
    rows = jnp.take(table, jnp.where(mine, ids - lo if local_rows else ids, 0), axis=0,
                    mode="clip")
    if mask_rows:
      rows = jnp.where(mine[..., None], rows, 0.0)
    return lax.psum(rows, "tp")
  return local


def _verify(local, seq=_take, rows=V):
  mesh = _mesh()
  ids = jax.ShapeDtypeStruct((2, 8), jnp.int32, sharding=NamedSharding(mesh, P()))
  table = jax.ShapeDtypeStruct((rows, D), jnp.float32,
                               sharding=NamedSharding(mesh, P("tp", None)))
  dist = shard_map(local, mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P())
  seq_module = lower_sequential(seq, jax.ShapeDtypeStruct((2, 8), jnp.int32),
                                jax.ShapeDtypeStruct((rows, D), jnp.float32))
  return verify_modules(seq_module, lower_distributed(dist, ids, table)), dist


def _outputs_differ(dist, seq, ids, rows=V):
  table = np.random.default_rng(0).standard_normal((rows, D)).astype(np.float32)
  sharded = jax.device_put(table, NamedSharding(_mesh(), P("tp", None)))
  return not np.allclose(np.asarray(jax.jit(seq)(ids, table)),
                         np.asarray(jax.jit(dist)(ids, sharded)))


def test_megatron_lookup_with_clipped_ids_is_proved():
  result, _ = _verify(_masked_lookup())
  assert result.refines, result


def test_xla_partitioned_lookup_is_proved():
  """jit with the table split by rows: XLA's partitioner clamps, offsets,
  masks and all-reduces."""
  mesh = _mesh()
  ids = jax.ShapeDtypeStruct((2, 8), jnp.int32, sharding=NamedSharding(mesh, P()))
  table = jax.ShapeDtypeStruct((V, D), jnp.float32, sharding=NamedSharding(mesh, P("tp", None)))
  seq_module = lower_sequential(_take, jax.ShapeDtypeStruct((2, 8), jnp.int32),
                                jax.ShapeDtypeStruct((V, D), jnp.float32))
  result = verify_modules(seq_module, lower_distributed(_take, ids, table))
  assert result.refines, result


def test_gradient_of_the_lookup_is_proved():
  """Its transpose: each rank scatter-adds the rows it holds (masked updates)."""
  result, _ = _verify_grad(_masked_lookup())
  assert result.refines, result


@pytest.mark.parametrize("near_miss, words", [
    # take(mode="clip") gives an out-of-range id the edge row; unclipped, the
    # masked lookup gives zeros.
    (_masked_lookup(clip=False), "index -2147483648 clamps to row 0 of the rows it holds "
                                 "but is masked to zero (the sequential gather clamps ids into "
                                 "the table: clip them first?)"),
    (_masked_lookup(first=1), "index 0 is row 0 of the rows it holds but is masked"),
    (_masked_lookup(offset=1), "index 0 is row 0 of the rows it holds but is masked"),
    (_masked_lookup(local_rows=False), "at rank tp=1, index 4 looks up local row 3, not its "
                                       "row 0 (the table's row minus the rank's offset 4)"),
])
def test_near_misses_are_not_proved(near_miss, words):
  result, dist = _verify(near_miss)
  assert not result.refines
  assert result.failure.op_name == "gather" and words in result.failure.diagnosis, result
  ids = np.array([[-3, 0, 3, 4, 7, 8, 15, 19]] * 2, np.int32)
  assert _outputs_differ(dist, _take, ids)


def _lookup_at(offset_of, keep=lambda ids: True, index_of=lambda ids, lo: ids - lo):
  """The masked lookup with the rank's first row ``offset_of(rank, rows)``,
  the mask also requiring ``keep(ids)``, the local row ``index_of(ids, lo)``."""
  def local(given, table):
    n = table.shape[0]
    ids = jnp.clip(given, 0, n * N - 1)
    lo = offset_of(lax.axis_index("tp"), n)
    mine = (ids >= lo) & (ids < lo + n) & keep(given)
    rows = jnp.take(table, jnp.where(mine, index_of(ids, lo), 0), axis=0, mode="clip")
    return lax.psum(jnp.where(mine[..., None], rows, 0.0), "tp")
  return local


PAD = np.iinfo(np.int32).max


@pytest.mark.parametrize("rows, local, exact", [
    # r * n through int8: exact for 16 rows (4 a rank); for 256 (64 a rank)
    # it wraps to 0, 64, -128, -64.
    (V, _lookup_at(lambda r, n: (r * n).astype(jnp.int8).astype(jnp.int32)), True),
    (256, _lookup_at(lambda r, n: (r * n).astype(jnp.int8).astype(jnp.int32)), False),
    # constants 7 significant digits would round together: ids - lo + 1.
    (V, _lookup_at(lambda r, n: r * n,
                   index_of=lambda ids, lo: (ids + 10_000_001) - (10_000_000 + lo)), False),
    # a padding id (int32 max) masked out, which the sequential clamp keeps.
    (V, _lookup_at(lambda r, n: r * n, keep=lambda ids: ids != PAD), False),
], ids=["offset_in_int8", "offset_wrapping_in_int8", "offset_by_large_constants",
        "pad_id_masked"])
def test_offsets_and_masks_are_read_as_their_types_hold_them(rows, local, exact):
  result, dist = _verify(local, rows=rows)
  ids = np.array([[0, 3, 4, 63, 64, 130, 200, PAD]] * 2, np.int32)
  assert _outputs_differ(dist, _take, ids, rows) != exact
  assert result.refines == exact, result


def test_unmasked_rows_are_not_a_tile_lookup():
  """Without the select the other ranks' rows are not zeroed: the sum adds
  every rank's clamped row."""
  result, dist = _verify(_masked_lookup(mask_rows=False))
  assert not result.refines and result.failure.op_name == "gather"
  assert _outputs_differ(dist, _take, np.array([[0, 5, 9, 13] * 2] * 2, np.int32))


def _grad(f):
  return lambda ids, table, g: jax.vjp(lambda t: f(ids, t), table)[1](g)[0]


def _verify_grad(local):
  mesh = _mesh()
  dist = shard_map(_grad(local), mesh=mesh, in_specs=(P(), P("tp", None), P()),
                   out_specs=P("tp", None))
  shapes = [((2, 8), jnp.int32, P()), ((V, D), jnp.float32, P("tp", None)),
            ((2, 8, D), jnp.float32, P())]
  seq_module = lower_sequential(_grad(_take),
                                *(jax.ShapeDtypeStruct(s, t) for s, t, _ in shapes))
  dist_module = lower_distributed(dist, *(jax.ShapeDtypeStruct(
      s, t, sharding=NamedSharding(mesh, spec)) for s, t, spec in shapes))
  return verify_modules(seq_module, dist_module), dist


def test_unmasked_scatter_updates_are_not_a_tile_scatter():
  """The gradient of the lookup without its mask: every rank adds the
  updates of other ranks' ids into its row 0."""
  result, dist = _verify_grad(_masked_lookup(mask_rows=False))
  assert not result.refines and result.failure.op_name == "scatter", result
  ids = np.array([[1, 5, 9, 13] * 2] * 2, np.int32)
  table = np.zeros((V, D), np.float32)
  g = np.ones((2, 8, D), np.float32)
  assert not np.allclose(np.asarray(jax.jit(_grad(_take))(ids, table, g)),
                         np.asarray(jax.jit(dist)(ids, table, g)))


def test_lanes_wrap_round_the_type():
  """x - 5 for x near the least int32 wraps round to the greatest (XLA's ints
  wrap): a lane wholly beyond the end comes round by 2^32, one straddling it
  is anything the type holds (a mask may still drop it); the rest is exact."""
  from graphguard_hlo.passes.dist_egraph import DistEGraph
  from graphguard_hlo.passes.rank_arith import RankArithmetic
  module = lower_sequential(lambda x: x - 5, jax.ShapeDtypeStruct((4,), jnp.int32))
  graph = module.main
  xs = (np.array([-2**31, -2**31, 0]), np.array([-2**31 + 2, -2**31 + 9, 9]))
  lanes = tile_lookup._Lanes(DistEGraph(graph), RankArithmetic(ir.Mesh((("x", 1),))),
                             graph.params[0], {}, xs)
  lo, hi = lanes.of(graph.results[0])
  assert (list(lo), list(hi)) == ([2**31 - 5, -2**31, -5], [2**31 - 3, 2**31 - 1, 4])
