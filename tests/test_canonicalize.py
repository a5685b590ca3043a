"""Each canonicalization pattern fires and preserves what the graph computes."""

import numpy as np
import pytest

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.canonicalize import canonical_local_op, canonicalize_graph

F32 = "f32"


def _t(*shape, dtype=F32):
  return ir.TensorType(tuple(shape), dtype)


def _run(g: ir.Graph, inputs):
  env = {p.id: x for p, x in zip(g.params, inputs)}
  for op in g.ops:
    env[op.results[0].id] = reference.evaluate(op.name, op.attrs,
                                               [env[v.id] for v in op.operands],
                                               op.results[0].type)
  return [env[v.id] for v in g.results]


def _graph(param_types):
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  g.params = [m.new_value(t, name=f"p{i}") for i, t in enumerate(param_types)]
  return m, g


def _op(m, g, name, operands, t, **attrs):
  return m.add_op(g, name, operands, [t], attrs).result


def _check(m, g, inputs, expect_ops):
  before = _run(g, inputs)
  rewrites = canonicalize_graph(m, g)
  after = _run(g, inputs)
  assert rewrites > 0
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)
  assert [op.name for op in g.ops] == expect_ops


def test_xla_broadcast_chain_meets_jax_spelling():
  """XLA: reshape [16]->[1,16]; broadcast; reshape back; broadcast (1,)."""
  m, g = _graph([_t(16)])
  x = g.params[0]
  r1 = _op(m, g, "reshape", [x], _t(1, 16))
  b1 = _op(m, g, "broadcast_in_dim", [r1], _t(1, 16), broadcast_dimensions=(0, 1))
  r2 = _op(m, g, "reshape", [b1], _t(16))
  g.results = [_op(m, g, "broadcast_in_dim", [r2], _t(8, 16), broadcast_dimensions=(1,))]
  _check(m, g, [np.arange(16.0)], ["broadcast_in_dim"])
  assert g.ops[0].operands == [x] and g.ops[0].attrs["broadcast_dimensions"] == (1,)


def test_jax_broadcast_chain_composes():
  m, g = _graph([_t(16)])
  b1 = _op(m, g, "broadcast_in_dim", [g.params[0]], _t(1, 16), broadcast_dimensions=(1,))
  g.results = [_op(m, g, "broadcast_in_dim", [b1], _t(8, 16), broadcast_dimensions=(0, 1))]
  _check(m, g, [np.arange(16.0)], ["broadcast_in_dim"])
  assert g.ops[0].attrs["broadcast_dimensions"] == (1,)


def test_broadcast_stretching_unit_dims_squeezes_first():
  m, g = _graph([_t(8, 1)])
  g.results = [_op(m, g, "broadcast_in_dim", [g.params[0]], _t(8, 16),
                   broadcast_dimensions=(0, 1))]
  _check(m, g, [np.arange(8.0).reshape(8, 1)], ["reshape", "broadcast_in_dim"])
  assert g.ops[0].results[0].shape == (8,)


def test_identity_ops_vanish_and_double_reshape_merges():
  m, g = _graph([_t(4, 6)])
  x = g.params[0]
  c = _op(m, g, "convert", [x], _t(4, 6))
  r = _op(m, g, "reshape", [c], _t(4, 6))
  r2 = _op(m, g, "reshape", [_op(m, g, "reshape", [r], _t(24))], _t(6, 4))
  g.results = [r2]
  _check(m, g, [np.arange(24.0).reshape(4, 6)], ["reshape"])


@pytest.mark.parametrize("low, high, interior, vanishes", [
    ((0, 0), (0, 0), (0, 0), True),
    ((-1, 0), (1, 0), (0, 0), False),  # the same shape, shifted
    ((0, 0), (0, 1), (0, 0), False)])
def test_a_pad_adding_no_room_is_its_operand(low, high, interior, vanishes):
  m, g = _graph([_t(3, 4)])
  zero = _op(m, g, "constant", [], _t(), value=np.array(0.0, np.float32))
  shape = [n + lo + hi for n, lo, hi in zip((3, 4), low, high)]
  g.results = [_op(m, g, "pad", [g.params[0], zero], _t(*shape), edge_padding_low=low,
                   edge_padding_high=high, interior_padding=interior)]
  x = np.arange(12.0).reshape(3, 4)
  before = _run(g, [x])
  canonicalize_graph(m, g)
  assert (g.results[0] is g.params[0]) == vanishes
  np.testing.assert_array_equal(_run(g, [x])[0], before[0])


@pytest.mark.parametrize("dims, vanishes", [((), True), ((1, 2), True), ((0, 1), False)])
def test_a_reverse_along_size_one_dims_is_its_operand(dims, vanishes):
  m, g = _graph([_t(3, 1, 1)])
  g.results = [_op(m, g, "reverse", [g.params[0]], _t(3, 1, 1), dimensions=dims)]
  x = np.arange(3.0).reshape(3, 1, 1)
  before = _run(g, [x])
  canonicalize_graph(m, g)
  assert (g.results[0] is g.params[0]) == vanishes
  np.testing.assert_array_equal(_run(g, [x])[0], before[0])


def test_iota_becomes_broadcast_of_a_line():
  m, g = _graph([])
  g.results = [_op(m, g, "iota", [], _t(4, 5, dtype="i32"), iota_dimension=1)]
  _check(m, g, [], ["iota", "broadcast_in_dim"])
  assert g.ops[0].results[0].shape == (5,)


def test_add_zero():
  m, g = _graph([_t(3, 3)])
  zero = _op(m, g, "constant", [], _t(), value=np.array(0.0, np.float32))
  z = _op(m, g, "broadcast_in_dim", [zero], _t(3, 3), broadcast_dimensions=())
  g.results = [_op(m, g, "add", [g.params[0], z], _t(3, 3))]
  before = _run(g, [np.ones((3, 3))])
  canonicalize_graph(m, g)
  assert g.results[0] is g.params[0]
  np.testing.assert_array_equal(before[0], np.ones((3, 3)))


def test_nothing_to_do_is_left_alone():
  m, g = _graph([_t(4, 6), _t(6, 2)])
  g.results = [_op(m, g, "dot_general", g.params, _t(4, 2), lhs_batch=(), rhs_batch=(),
                   lhs_contract=(1,), rhs_contract=(0,))]
  assert canonicalize_graph(m, g) == 0 and [o.name for o in g.ops] == ["dot_general"]


@pytest.mark.parametrize("name,attrs,src,dst,expect", [
    ("reshape", {}, (8,), (8,), None),
    ("reshape", {}, (8, 2), (8, 1, 2), ("broadcast_in_dim", {"broadcast_dimensions": (0, 2)})),
    ("reshape", {}, (8, 2), (16,), ("reshape", {})),
    ("broadcast_in_dim", {"broadcast_dimensions": (0, 1)}, (8, 2), (8, 2), None),
])
def test_local_ops_get_the_same_normal_form(name, attrs, src, dst, expect):
  got = canonical_local_op(name, attrs, [_t(*src)], _t(*dst))
  assert got == expect


def test_local_reduce_over_unit_dims_gets_the_reshape_normal_form():
  # A tile with one row per device: the sequential reduce over that dim is,
  # locally, the reshape the per-device program was canonicalized to.
  attrs = {"dimensions": (0,)}
  assert canonical_local_op("reduce", attrs, [_t(1, 16, 4), _t()], _t(16, 4)) == ("reshape", {})
  assert canonical_local_op("reduce", {"dimensions": ()}, [_t(2, 16), _t()], _t(2, 16)) is None
  assert canonical_local_op("reduce", attrs, [_t(2, 16), _t()], _t(16)) == ("reduce", attrs)


def test_fresh_ops_made_inside_a_pattern_are_placed():
  # broadcast stretching the unit dims of reshape(x): the squeeze the pattern
  # makes is itself a reshape of a reshape, i.e. a fresh reshape(x) that must
  # land in the graph (it once dangled).
  m, g = _graph([_t(4, 8)])
  r = _op(m, g, "reshape", [g.params[0]], _t(1, 1, 1, 32))
  b = _op(m, g, "broadcast_in_dim", [r], _t(2, 16, 4, 32), broadcast_dimensions=(0, 1, 2, 3))
  g.results = [b]
  x = np.arange(32.0).reshape(4, 8)
  _check(m, g, [x], ["reshape", "broadcast_in_dim"])
  defined = {id(p) for p in g.params}
  for op in g.ops:
    assert all(id(v) in defined for v in op.operands), op
    defined.update(id(v) for v in op.results)


@pytest.mark.parametrize("p1,p2,expect", [
    ((1, 0, 2), (1, 0, 2), []),                       # back to x
    ((1, 2, 0), (2, 0, 1), []),
    ((1, 0, 2), (0, 2, 1), ["transpose"]),            # one composed transpose
])
def test_transpose_of_transpose(p1, p2, expect):
  m, g = _graph([_t(2, 3, 4)])
  x = g.params[0]
  t1 = _op(m, g, "transpose", [x], _t(*[x.shape[i] for i in p1]), permutation=p1)
  t2 = _op(m, g, "transpose", [t1], _t(*[t1.shape[i] for i in p2]), permutation=p2)
  g.results = [t2]
  _check(m, g, [np.arange(24.0).reshape(2, 3, 4)], expect)


def test_transposes_around_an_all_reduce_meet():
  """jax's backward of a tied head under shard_map: T(psum(T(x))) is psum(x),
  checked on 4 simulated ranks."""
  from graphguard_hlo.interpret import Interpreter
  m, g = _graph([_t(2, 3)])
  t1 = _op(m, g, "transpose", [g.params[0]], _t(3, 2), permutation=(1, 0))
  ar = m.add_op(g, "all_reduce", [t1], [_t(3, 2)], {"replica_groups": ((0, 1, 2, 3),)},
                [_sum_region(m)]).result
  g.results = [_op(m, g, "transpose", [ar], _t(2, 3), permutation=(1, 0))]
  xs = [np.arange(6.0).reshape(2, 3) * (k + 1) for k in range(4)]
  before = Interpreter(4).run(g, [xs])[g.results[0].id]
  assert canonicalize_graph(m, g) > 0
  assert [op.name for op in g.ops] == ["all_reduce"] and g.ops[0].operands[0] is g.params[0]
  after = Interpreter(4).run(g, [xs])[g.results[0].id]
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)


def _sum_region(m):
  r = ir.Graph("sum")
  a, b = m.new_value(_t(), name="a"), m.new_value(_t(), name="b")
  r.params = [a, b]
  r.results = [m.add_op(r, "add", [a, b], [_t()]).result]
  return r


def test_sum_over_unit_dims_is_a_reshape():
  m, g = _graph([_t(4, 1, 16, 1)])
  zero = _op(m, g, "constant", [], _t(), value=np.array(0.0, np.float32))
  red = m.add_op(g, "reduce", [g.params[0], zero], [_t(4, 16)], {"dimensions": (1, 3)},
                 [_sum_region(m)])
  red.attrs["gg.reduction"] = "sum"  # for the reference evaluator
  g.results = [red.result]
  _check(m, g, [np.arange(64.0).reshape(4, 1, 16, 1)], ["reshape"])


def test_sum_over_unit_dims_with_another_init_is_kept():
  m, g = _graph([_t(4, 1)])
  one = _op(m, g, "constant", [], _t(), value=np.array(1.0, np.float32))
  red = m.add_op(g, "reduce", [g.params[0], one], [_t(4)], {"dimensions": (1,)},
                 [_sum_region(m)])
  g.results = [red.result]
  assert canonicalize_graph(m, g) == 0


@pytest.mark.parametrize("init, folds", [(False, True), (True, False)])
def test_any_over_a_unit_index_vector_is_a_reshape(init, folds):
  """XLA's vocab-parallel mask: or-reduce over the index vector's one element
  (init false, the or's identity; true is not)."""
  m, g = _graph([_t(2, 8, 1, dtype="pred")])
  r = ir.Graph("or")
  a, b = m.new_value(_t(dtype="pred"), name="a"), m.new_value(_t(dtype="pred"), name="b")
  r.params = [a, b]
  r.results = [m.add_op(r, "or", [a, b], [_t(dtype="pred")]).result]
  start = _op(m, g, "constant", [], _t(dtype="pred"), value=np.array(init))
  red = m.add_op(g, "reduce", [g.params[0], start], [_t(2, 8, dtype="pred")],
                 {"dimensions": (2,)}, [r])
  red.attrs["gg.reduction"] = "max"
  g.results = [red.result]
  if folds:
    _check(m, g, [np.arange(16).reshape(2, 8, 1) % 3 == 0], ["reshape"])
  else:
    assert canonicalize_graph(m, g) == 0


def test_clamp_of_a_unit_broadcast_clamps_first():
  """jax clamps a gather's indices [2, 8, 1] (take's gradient); clipping the
  ids [2, 8] first is the same clamp, broadcast."""
  m, g = _graph([_t(2, 8, dtype="i32")])
  lo = _op(m, g, "constant", [], _t(dtype="i32"), value=np.array(0, np.int32))
  hi = _op(m, g, "constant", [], _t(1, dtype="i32"), value=np.array([15], np.int32))
  wide = _t(2, 8, 1, dtype="i32")
  ids = _op(m, g, "broadcast_in_dim", [g.params[0]], wide, broadcast_dimensions=(0, 1))
  bounds = [_op(m, g, "broadcast_in_dim", [c], wide, broadcast_dimensions=d)
            for c, d in ((lo, ()), (hi, (2,)))]
  g.results = [_op(m, g, "clamp", [bounds[0], ids, bounds[1]], wide)]
  _check(m, g, [np.arange(-4, 20, dtype=np.int32)[:16].reshape(2, 8)],
         ["constant", "constant", "broadcast_in_dim", "reshape", "broadcast_in_dim", "clamp",
          "broadcast_in_dim"])
  assert g.ops[-2].results[0].shape == (2, 8) and g.ops[-2].operands[1] is g.params[0]


def test_rank_offset_is_added_before_the_broadcast():
  """A device's mask rows: broadcast(iota) + broadcast(r * n) -> broadcast(iota + r * n)."""
  m, g = _graph([_t(dtype="i32")])
  line = _op(m, g, "iota", [], _t(4, dtype="i32"), iota_dimension=0)
  rows = _op(m, g, "broadcast_in_dim", [line], _t(4, 16, dtype="i32"), broadcast_dimensions=(0,))
  offset = _op(m, g, "broadcast_in_dim", [g.params[0]], _t(4, 16, dtype="i32"),
               broadcast_dimensions=())
  g.results = [_op(m, g, "add", [rows, offset], _t(4, 16, dtype="i32"))]
  _check(m, g, [np.array(8, np.int32)], ["iota", "broadcast_in_dim", "add", "broadcast_in_dim"])
  added = g.ops[2]
  assert added.results[0].shape == (4,) and added.operands[0] is line


def test_float_offsets_keep_their_order():
  m, g = _graph([_t()])
  line = _op(m, g, "iota", [], _t(4), iota_dimension=0)
  rows = _op(m, g, "broadcast_in_dim", [line], _t(4, 16), broadcast_dimensions=(0,))
  offset = _op(m, g, "broadcast_in_dim", [g.params[0]], _t(4, 16), broadcast_dimensions=())
  g.results = [_op(m, g, "add", [rows, offset], _t(4, 16))]
  assert canonicalize_graph(m, g) == 0


@pytest.mark.parametrize("t,f,folds", [(True, False, True), (False, True, False)])
def test_select_of_true_and_false_is_the_predicate(t, f, folds):
  """jnp.tril(ones(bool)) is select(mask, true, false): the mask itself."""
  m, g = _graph([_t(3, 3), _t(3, 3)])
  p = _op(m, g, "compare", g.params, _t(3, 3, dtype="pred"), comparison_direction="GE")
  consts = [_op(m, g, "broadcast_in_dim",
                [_op(m, g, "constant", [], _t(dtype="pred"), value=np.array(v))],
                _t(3, 3, dtype="pred"), broadcast_dimensions=()) for v in (t, f)]
  g.results = [_op(m, g, "select", [p, *consts], _t(3, 3, dtype="pred"))]
  x = np.arange(9.0).reshape(3, 3)
  before = _run(g, [x, x.T])
  canonicalize_graph(m, g)
  assert (g.results[0] is p) == folds
  np.testing.assert_array_equal(_run(g, [x, x.T])[0], before[0])


def test_square_is_a_product():
  """jnp.square lowers to chlo.square; XLA writes x * x."""
  m, g = _graph([_t(3, 4)])
  g.results = [_op(m, g, "chlo.square", g.params, _t(3, 4))]
  _check(m, g, [np.arange(-6.0, 6.0).reshape(3, 4)], ["multiply"])
  assert g.ops[0].operands == [g.params[0], g.params[0]]


def test_select_of_a_scalar_predicate_broadcasts_it():
  """optax's clip selects each gradient on one flag; HLO broadcasts it first."""
  x, y = np.arange(12.0).reshape(3, 4), -np.arange(12.0).reshape(3, 4)
  for flag in (True, False):
    m, g = _graph([_t(dtype="pred"), _t(3, 4), _t(3, 4)])
    g.results = [_op(m, g, "select", g.params, _t(3, 4))]
    _check(m, g, [np.array(flag), x, y], ["broadcast_in_dim", "select"])
    assert g.ops[0].results[0].type == _t(3, 4, dtype="pred")


def test_select_of_scalars_is_left_alone():
  m, g = _graph([_t(dtype="pred"), _t(), _t()])
  g.results = [_op(m, g, "select", g.params, _t())]
  assert canonicalize_graph(m, g) == 0


# -- all-to-alls as XLA writes them (split dim = concat dim) ---------------------------

def _run_ranks(g: ir.Graph, inputs, ranks: int):
  from graphguard_hlo.interpret import Interpreter
  env = Interpreter(ranks).run(g, inputs)
  return [env[v.id] for v in g.results]


def _a2a(m, g, x, split, concat, shape, groups=((0, 1, 2, 3),)):
  return _op(m, g, "all_to_all", [x], _t(*shape), split_dimension=split,
             concat_dimension=concat, replica_groups=groups, split_count=len(groups[0]))


def _check_ranks(m, g, inputs, ranks=4):
  before = _run_ranks(g, inputs, ranks)
  assert canonicalize_graph(m, g) > 0
  after = _run_ranks(g, inputs, ranks)
  for a, b in zip(before, after):
    for ra, rb in zip(a, b):
      np.testing.assert_array_equal(ra, rb)
  return [op for op in g.ops if op.name == "all_to_all"]


@pytest.mark.parametrize("shape,k,perm,groups", [
    ((2, 4, 3), 1, (1, 0, 2), ((0, 1, 2, 3),)),   # ranks' pieces land before dim 0
    ((2, 4, 3), 1, (0, 1, 2), ((0, 1, 2, 3),)),   # ... before dim 2, no transpose
    ((3, 2, 5), 1, (1, 2, 0), ((0, 1), (2, 3))),  # two groups of two
])
def test_all_to_all_within_one_dim_becomes_split_concat(shape, k, perm, groups):
  """transpose(a2a(x, k -> k), p) = reshape(transpose(a2a(x, k -> c), p)), rank by rank."""
  m, g = _graph([_t(*shape)])
  y = _a2a(m, g, g.params[0], k, k, shape, groups)
  g.results = [_op(m, g, "transpose", [y], _t(*[shape[d] for d in perm]), permutation=perm)]
  rng = np.random.default_rng(0)
  xs = [[rng.standard_normal(shape) for _ in range(4)]]
  (a2a,) = _check_ranks(m, g, xs)
  assert a2a.attrs["split_dimension"] == k and a2a.attrs["concat_dimension"] == perm[
      perm.index(k) + 1]


@pytest.mark.parametrize("shape,split,k,c,out,moved", [
    # XLA reshapes [1,4,32] to [1,4,4,8] and exchanges the 4: the same as
    # splitting the 32 into 4 pieces of 8 directly.
    ((1, 4, 32), (1, 4, 4, 8), 2, 1, (1, 16, 1, 8), (2, 1)),
    # GSPMD's router cotangent, one expert per rank: [8,16,1] as [4,2,16,1],
    # the 4 exchanged into the unit expert dim, which is kept as the concat.
    ((8, 16, 1), (4, 2, 16, 1), 0, 3, (1, 2, 16, 4), (0, 2)),
])
def test_all_to_all_of_a_split_reshape_runs_on_the_unsplit_value(shape, split, k, c, out, moved):
  m, g = _graph([_t(*shape)])
  x = _op(m, g, "reshape", [g.params[0]], _t(*split))
  g.results = [_a2a(m, g, x, k, c, out)]
  rng = np.random.default_rng(1)
  (a2a,) = _check_ranks(m, g, [[rng.standard_normal(shape) for _ in range(4)]])
  assert a2a.operands[0] is g.params[0]
  assert (a2a.attrs["split_dimension"], a2a.attrs["concat_dimension"]) == moved


def test_all_to_all_of_a_minor_split_is_left_alone():
  """The exchanged dim is the minor part of a split: its pieces are strided in
  the unsplit value, so nothing may be rewritten."""
  m, g = _graph([_t(3, 16)])
  x = _op(m, g, "reshape", [g.params[0]], _t(3, 4, 4))
  g.results = [_a2a(m, g, x, 2, 0, (12, 4, 1))]
  assert canonicalize_graph(m, g) == 0


@pytest.mark.parametrize("perm,folds", [((1, 0, 2), True), ((0, 2, 1), False)])
def test_transpose_moving_only_unit_dims_is_a_reshape(perm, folds):
  m, g = _graph([_t(1, 4, 3)])
  g.results = [_op(m, g, "transpose", [g.params[0]], _t(*[(1, 4, 3)[d] for d in perm]),
                   permutation=perm)]
  x = np.arange(12.0).reshape(1, 4, 3)
  before = _run(g, [x])
  assert (canonicalize_graph(m, g) > 0) == folds
  assert ([op.name for op in g.ops] == ["reshape"]) == folds
  np.testing.assert_array_equal(_run(g, [x])[0], before[0])


def test_select_on_a_constant_predicate_is_its_branch():
  """jax checks a constant index is in bounds: and(i >= 0, i <= n - 1), a constant."""
  for index, want in ((2, "on_true"), (7, "on_false")):
    m, g = _graph([_t(3), _t(3)])
    i = _op(m, g, "constant", [], _t(dtype="i32"), value=np.array(index, np.int32))
    lo = _op(m, g, "constant", [], _t(dtype="i32"), value=np.array(0, np.int32))
    hi = _op(m, g, "constant", [], _t(dtype="i32"), value=np.array(3, np.int32))
    ge = _op(m, g, "compare", [i, lo], _t(dtype="pred"), comparison_direction="GE",
             compare_type="SIGNED")
    le = _op(m, g, "compare", [i, hi], _t(dtype="pred"), comparison_direction="LE",
             compare_type="SIGNED")
    ok = _op(m, g, "and", [ge, le], _t(dtype="pred"))
    mask = _op(m, g, "broadcast_in_dim", [ok], _t(3, dtype="pred"), broadcast_dimensions=())
    g.results = [_op(m, g, "select", [mask, *g.params], _t(3))]
    inputs = [np.arange(3.0), -np.arange(3.0)]
    before = _run(g, inputs)
    assert canonicalize_graph(m, g) > 0
    assert g.results[0] is g.params[0 if want == "on_true" else 1]
    np.testing.assert_array_equal(_run(g, inputs)[0], before[0])


def test_select_on_a_mixed_constant_predicate_is_left_alone():
  m, g = _graph([_t(2), _t(2)])
  p = _op(m, g, "constant", [], _t(2, dtype="pred"), value=np.array([True, False]))
  g.results = [_op(m, g, "select", [p, *g.params], _t(2))]
  canonicalize_graph(m, g)
  assert g.results[0].producer.name == "select"


def test_reshape_undoing_a_unit_broadcast_wherever_it_put_the_unit():
  """[1, 3] -> [1, 1, 3] by dims (1, 2) (the unit inserted first) and back."""
  m, g = _graph([_t(1, 3)])
  b = _op(m, g, "broadcast_in_dim", g.params, _t(1, 1, 3), broadcast_dimensions=(1, 2))
  g.results = [_op(m, g, "reshape", [b], _t(1, 3))]
  assert canonicalize_graph(m, g) > 0
  assert g.results[0] is g.params[0]


# -- nested selects on flags sharing a branch ----------------------------------------

def _nested_selects(shape_case, outer_side, shared):
  """select(p, a, select(q, c, d)) or select(p, select(q, c, d), b), with the
  inner select sharing one branch (c or d) with the outer one."""
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  t = ir.TensorType(shape_case, "f32")
  flag_t, spread_t = ir.TensorType((), "pred"), ir.TensorType(shape_case, "pred")
  p_s, q_s = m.new_value(flag_t, name="p"), m.new_value(flag_t, name="q")
  x, y = m.new_value(t, name="x"), m.new_value(t, name="y")
  g.params = [p_s, q_s, x, y]
  p, q = (m.add_op(g, "broadcast_in_dim", [f], [spread_t], {"broadcast_dimensions": ()}).result
          for f in (p_s, q_s))
  inner = m.add_op(g, "select", [q, x, y] if shared == "c" else [q, y, x], [t], {}).result
  operands = [p, x, inner] if outer_side == "b" else [p, inner, x]
  g.results = [m.add_op(g, "select", operands, [t], {}).result]
  return m, g


@pytest.mark.parametrize("outer_side", ["a", "b"])
@pytest.mark.parametrize("shared", ["c", "d"])
def test_nested_selects_sharing_a_branch_become_one(outer_side, shared):
  """Every flag combination evaluates alike before and after; one select left."""
  import itertools
  m, g = _nested_selects((2, 3), outer_side, shared)

  def run(inputs):
    env = {v.id: a for v, a in zip(g.params, inputs)}
    for op in g.ops:
      env[op.results[0].id] = reference.evaluate(op.name, op.attrs,
                                                 [env[v.id] for v in op.operands],
                                                 op.results[0].type)
    return env[g.results[0].id]
  xs = [np.arange(6.0, dtype=np.float32).reshape(2, 3), -np.ones((2, 3), np.float32)]
  cases = [[np.bool_(p), np.bool_(q)] + xs for p, q in itertools.product([False, True], repeat=2)]
  before = [run(c) for c in cases]
  canonicalize_graph(m, g)
  assert [op.name for op in g.ops].count("select") == 1, [op.name for op in g.ops]
  for c, want in zip(cases, before):
    np.testing.assert_array_equal(run(c), want)


@pytest.mark.parametrize("dtype,bits,folds", [
    ("f32", (8, 23), True), ("bf16", (8, 7), True), ("f16", (5, 10), True),
    ("f32", (8, 7), False), ("f32", (5, 10), False), ("bf16", (5, 7), False)])
def test_reduce_precision_to_its_own_format_is_the_identity(dtype, bits, folds):
  """A checkpoint policy marks saved values with a reduce_precision that
  changes nothing; one to a narrower format rounds, and stays."""
  m, g = _graph([_t(4, dtype=dtype)])
  g.results = [_op(m, g, "reduce_precision", [g.params[0]], _t(4, dtype=dtype),
                   exponent_bits=bits[0], mantissa_bits=bits[1])]
  canonicalize_graph(m, g)
  assert (g.results[0] is g.params[0]) == folds


def test_optimization_barrier_passes_its_operands_through():
  m, g = _graph([_t(4), _t(2, dtype="i32")])
  barrier = m.add_op(g, "optimization_barrier", list(g.params), [_t(4), _t(2, dtype="i32")])
  g.results = [_op(m, g, "negate", [barrier.results[0]], _t(4)), barrier.results[1]]
  canonicalize_graph(m, g)
  assert [op.name for op in g.ops] == ["negate"]
  assert g.ops[0].operands[0] is g.params[0] and g.results[1] is g.params[1]


@pytest.mark.parametrize("direction, holds", [("EQ", True), ("NE", False), ("LT", False),
                                               ("LE", True), ("GT", False), ("GE", True)])
@pytest.mark.parametrize("dtype", ["i32", "pred", "ui8"])
def test_an_integer_compared_with_itself_in_a_reducer_is_its_answer(direction, holds, dtype):
  from graphguard_hlo.passes.canonicalize import REDUCER_PATTERNS
  m, g = _graph([_t(dtype=dtype)])
  x = g.params[0]
  c = _op(m, g, "compare", [x, x], _t(dtype="pred"), comparison_direction=direction)
  g.results = [_op(m, g, "or", [c, c], _t(dtype="pred"))]
  values = {"i32": np.int32(-7), "pred": np.bool_(True), "ui8": np.uint8(200)}
  before = _run(g, [values[dtype]])
  assert canonicalize_graph(m, g, extra=REDUCER_PATTERNS) > 0
  assert [op.name for op in g.ops] == ["constant"]
  np.testing.assert_array_equal(_run(g, [values[dtype]]), before)
  assert bool(before[0]) == holds


def test_a_float_compared_with_itself_is_left_alone():
  """NaN != NaN: the comparison depends on the value."""
  from graphguard_hlo.passes.canonicalize import REDUCER_PATTERNS
  m, g = _graph([_t()])
  x = g.params[0]
  g.results = [_op(m, g, "compare", [x, x], _t(dtype="pred"), comparison_direction="NE")]
  canonicalize_graph(m, g, extra=REDUCER_PATTERNS)
  assert [op.name for op in g.ops] == ["compare"]


_INTS = {"i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
         "ui8": np.uint8, "ui16": np.uint16, "ui32": np.uint32, "ui64": np.uint64}


@pytest.mark.parametrize("dtype", sorted(_INTS))
@pytest.mark.parametrize("name", ["and", "or", "xor"])
@pytest.mark.parametrize("constant_first", [False, True])
def test_bitwise_op_with_its_identity_is_its_operand(dtype, name, constant_first):
  """Both sides on random integers; a constant one bit off the identity (or a
  64-bit one, which a float would not hold exactly) is left alone."""
  np_type = _INTS[dtype]
  identity = np_type(-1) if name == "and" and dtype.startswith("i") else (
      np.iinfo(np_type).max if name == "and" else np_type(0))
  x = np.random.default_rng(0).integers(np.iinfo(np_type).min, np.iinfo(np_type).max,
                                        size=(4, 3), dtype=np_type, endpoint=True)
  for constant, folds in ((identity, "64" not in dtype), (identity ^ np_type(1), False)):
    m, g = _graph([_t(4, 3, dtype=dtype)])
    c = _op(m, g, "constant", [], _t(dtype=dtype), value=np.array(constant, np_type))
    c = _op(m, g, "broadcast_in_dim", [c], _t(4, 3, dtype=dtype), broadcast_dimensions=())
    operands = [c, g.params[0]] if constant_first else [g.params[0], c]
    g.results = [_op(m, g, name, operands, _t(4, 3, dtype=dtype))]
    before = _run(g, [x])
    canonicalize_graph(m, g)
    assert (g.results[0] is g.params[0]) == folds, (constant, folds)
    np.testing.assert_array_equal(_run(g, [x])[0], before[0])
