"""A ring written as ``lax.fori_loop`` over its steps (``passes/ring_loops.py``):
unrolled into the Python loop's form, then proved or reported like it.  Loops
that are not rings are left alone; unrolling computes what the loop did; the
two canonical forms an unrolled loop needs hold on random tensors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo import api, ir
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_distributed
from graphguard_hlo.passes.canonicalize import UNROLLED_RING_PATTERNS, canonicalize_graph
from graphguard_hlo.passes.dist_program import canonicalize_dist
from graphguard_hlo.passes import ring_loops
from graphguard_hlo.passes.ring_loops import unroll_ring_loops
from graphguard_hlo.passes.terms import splat_value
from tests.test_online_softmax import SETTINGS, Builder, _t
from tests.numbers import random_inputs, run_placed
from tools.zoo.cases import mesh_of

N, S, T, D = 4, 8, 8, 3
MESH = mesh_of((N,), ("cp",))
SPEC = P("cp")


def _seq(q, k):
  return jnp.tanh(q @ k.T)


def _ring(shift=1, steps=N, scan=False):
  """Rank r holds rows r of q and key block r; the keys go round the ring
  r -> r + ``shift`` under a fori_loop (or a scan), each step writing the
  block in hand at its place, (r - t) mod N, before the scores."""
  def body(q, k):
    r = lax.axis_index("cp")
    perm = [(i, (i + shift) % N) for i in range(N)]

    def step(t, carry):
      k, keys = carry
      keys = lax.dynamic_update_slice_in_dim(keys, k, ((r - t) % N) * (T // N), 0)
      return lax.ppermute(k, "cp", perm), keys

    keys = jnp.zeros((T, D), jnp.float32)
    keys = lax.pcast(keys, ("cp",), to="varying")
    if scan:
      _, keys = lax.scan(lambda c, t: (step(t, c), None), (k, keys), jnp.arange(steps))[0]
    else:
      _, keys = lax.fori_loop(0, steps, step, (k, keys))
    return jnp.tanh(q @ keys.T)
  return jax.jit(shard_map(body, mesh=MESH, in_specs=(SPEC, SPEC), out_specs=SPEC))


def _args():
  return [jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(MESH, SPEC))
          for shape in ((S, D), (T, D))]


def _values(seed=0):
  return random_inputs(_args(), seed)


def _run(dist):
  return run_placed(dist, _args(), _values())


@pytest.mark.parametrize("scan", [False, True])
def test_a_ring_under_fori_loop_or_scan_is_proved(scan):
  dist = _ring(scan=scan)
  np.testing.assert_allclose(_run(dist), _seq(*_values()), rtol=1e-5)
  result = api.verify(_seq, dist, *_args())
  assert result.refines, result


def test_a_ring_running_past_its_ranks_is_proved():
  """N + 1 steps: the last writes each rank's own block home again."""
  result = api.verify(_seq, _ring(steps=N + 1), *_args())
  assert result.refines, result


@pytest.mark.parametrize("bug", [dict(shift=-1), dict(steps=N - 1),
                                 dict(shift=-1, steps=N + 1)])
def test_a_wrong_ring_under_fori_loop_is_reported_at_the_dot(bug):
  """Blocks sent the other way from where they are written; a step missing
  (one block never written: zeros there)."""
  dist = _ring(**bug)
  assert not np.allclose(_run(dist), _seq(*_values()), rtol=1e-3)
  result = api.verify(_seq, dist, *_args())
  assert not result.refines
  assert result.failure.op_name == "dot_general", result.failure
  line = next(i for i, text in enumerate(open(__file__), 1) if "return jnp.tanh(q @ k.T)" in text)
  assert result.failure.location.line == line, result.failure


def _per_device(dist, unroll: bool) -> ir.Graph:
  module = lower_distributed(dist, *_args())
  if unroll:
    assert unroll_ring_loops(module) >= 1
  return canonicalize_dist(module).graph


def test_unrolling_computes_what_the_loop_did():
  local = [np.split(v, N) for v in _values(3)]
  outs = []
  for unroll in (False, True):
    graph = _per_device(_ring(), unroll)
    assert any(op.name == "while" for op in graph.walk()) != unroll
    env = Interpreter(N).run(graph, local)
    outs.append(env[graph.results[0].id])
  for rank in range(N):
    np.testing.assert_allclose(outs[1][rank], outs[0][rank], rtol=1e-6)


def _loop_over(step, steps=N):
  def body(x):
    return lax.fori_loop(0, steps, lambda t, h: step(h), x)
  return jax.jit(shard_map(body, mesh=MESH, in_specs=SPEC, out_specs=SPEC))


def _unrolled(step, steps=N) -> int:
  module = lower_distributed(_loop_over(step, steps), jax.ShapeDtypeStruct(
      (S, D), np.float32, sharding=NamedSharding(MESH, SPEC)))
  return unroll_ring_loops(module)


_SEND = lambda h: lax.ppermute(h, "cp", [(i, (i + 1) % N) for i in range(N)])


def test_a_stage_output_sent_on_is_a_ring_loop():
  """A pipeline's rounds: each stage computes, then sends its output on."""
  assert _unrolled(lambda h: _SEND(jnp.tanh(h))) >= 1


@pytest.mark.parametrize("step,steps", [
    (lambda h: jnp.tanh(_SEND(h)), N),        # what is received is computed on: a layer
    (_SEND, ring_loops.MAX_STEPS + 1)])        # more steps than are worth copying
def test_loops_that_are_not_rings_stay_loops(step, steps):
  assert _unrolled(step, steps) == 0


# -- the canonical forms an unrolled loop needs ---------------------------------------

def _i32(builder, value):
  return builder.op("constant", [], ir.TensorType((), "i32"), value=np.array(value, np.int32))


@SETTINGS
@given(st.data())
def test_dynamic_slice_at_constant_starts_is_a_slice(data):
  """Starts past either end are clamped, as dynamic_slice clamps them."""
  shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
  sizes = [data.draw(st.integers(1, n)) for n in shape]
  starts = [data.draw(st.integers(-2, n + 2)) for n in shape]
  b = Builder([_t(*shape)])
  x = b.g.params[0]
  b.g.results = [b.op("dynamic_slice", [x] + [_i32(b, s) for s in starts], _t(*sizes),
                      slice_sizes=tuple(sizes))]
  inputs = [np.random.default_rng(0).standard_normal(shape)]
  before = b.run(inputs)[0]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  assert not any(op.name == "dynamic_slice" for op in b.g.walk())
  np.testing.assert_array_equal(b.run(inputs)[0], before)


@SETTINGS
@given(st.data())
def test_reshape_of_a_broadcast_moving_units_is_one_broadcast(data):
  """y broadcast to new dims and unit dims, then reshaped dropping or adding
  units: one broadcast of y to the reshape's shape."""
  y_shape = data.draw(st.lists(st.integers(2, 3), min_size=1, max_size=2))
  new = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
  full = data.draw(st.permutations(list(y_shape) + new))
  dims = []
  for n in y_shape:  # where each of y's dims lands (distinct sizes or not)
    dims.append(next(i for i, m in enumerate(full) if m == n and i not in dims))
  dims = sorted(dims)
  y_shape = [full[i] for i in dims]
  non_units = [n for n in full if n != 1]
  units = data.draw(st.lists(st.integers(0, len(non_units)), max_size=2))
  out = list(non_units)
  for u in sorted(units, reverse=True):
    out.insert(u, 1)
  b = Builder([_t(*y_shape)])
  wide = b.op("broadcast_in_dim", [b.g.params[0]], _t(*full), broadcast_dimensions=tuple(dims))
  b.g.results = [b.op("reshape", [wide], _t(*out))]
  inputs = [np.random.default_rng(1).standard_normal(y_shape)]
  before = b.run(inputs)[0]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  out = b.g.results[0]   # (y itself where the broadcast only added units)
  assert out is b.g.params[0] or out.producer.name == "broadcast_in_dim"
  np.testing.assert_array_equal(b.run(inputs)[0], before)


@SETTINGS
@given(st.data())
def test_one_element_of_an_iota_is_a_constant(data):
  shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
  dim = data.draw(st.integers(0, len(shape) - 1))
  start = [data.draw(st.integers(0, n - 1)) for n in shape]
  b = Builder([])
  iota = b.op("iota", [], ir.TensorType(tuple(shape), "i32"), iota_dimension=dim)
  b.g.results = [b.op("slice", [iota], ir.TensorType((1,) * len(shape), "i32"),
                      start_indices=tuple(start), limit_indices=tuple(s + 1 for s in start),
                      strides=(1,) * len(shape))]
  before = b.run([])[0]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  # (a slice of all of a one-element iota is that iota)
  assert splat_value(b.g.results[0]) == before.item() or set(shape) == {1}
  np.testing.assert_array_equal(b.run([])[0], before)


@SETTINGS
@given(st.data())
def test_a_permute_of_zeros_is_zeros(data):
  """Whoever sends, and whether or not a rank is sent to (it then receives zeros)."""
  ranks = 4
  pairs = data.draw(st.lists(st.tuples(st.integers(0, ranks - 1), st.integers(0, ranks - 1)),
                             max_size=ranks, unique_by=(lambda p: p[0], lambda p: p[1])))
  b = Builder([_t(3)])
  sent = b.op("collective_permute", [b.splat(0.0, (3,))], _t(3),
              source_target_pairs=tuple(pairs))
  b.g.results = [b.op("add", [b.g.params[0], sent], _t(3))]
  x = [np.random.default_rng(k).standard_normal(3) for k in range(ranks)]
  before = Interpreter(ranks).run(b.g, [x])[b.g.results[0].id]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  assert not any(op.name == "collective_permute" for op in b.g.walk())
  after = Interpreter(ranks).run(b.g, [x])[b.g.results[0].id]
  np.testing.assert_array_equal(np.stack(after), np.stack(before))


_INT_OPS = ("add", "subtract", "multiply", "minimum", "maximum", "divide", "remainder")
_COMPARISONS = ("LT", "LE", "EQ", "NE", "GE", "GT")


def _scalar_expression(b, data, leaves, depth, leaf_ok=True):
  """A random i32 scalar over ``leaves`` (constants, or a parameter among them)
  by the ops a loop computes from its counter; divisors kept nonzero."""
  if depth == 0 or (leaf_ok and data.draw(st.booleans())):
    return data.draw(st.sampled_from(leaves))
  kind = data.draw(st.sampled_from(("int", "select", "negate")))
  x = _scalar_expression(b, data, leaves, depth - 1)
  if kind == "negate":
    return b.op("negate", [x], ir.TensorType((), "i32"))
  y = _scalar_expression(b, data, leaves, depth - 1)
  if kind == "select":
    p = b.op("compare", [x, y], ir.TensorType((), "pred"),
             comparison_direction=data.draw(st.sampled_from(_COMPARISONS)))
    if data.draw(st.booleans()):
      q = b.op("compare", [y, _i32(b, 2)], ir.TensorType((), "pred"), comparison_direction="GE")
      p = b.op(data.draw(st.sampled_from(("and", "or"))), [p, q], ir.TensorType((), "pred"))
    return b.op("select", [p, x, y], ir.TensorType((), "i32"))
  name = data.draw(st.sampled_from(_INT_OPS))
  if name in ("divide", "remainder"):
    y = b.op("maximum", [y, _i32(b, 1)], ir.TensorType((), "i32"))
  return b.op(name, [x, y], ir.TensorType((), "i32"))


@SETTINGS
@given(st.data())
def test_integer_scalars_of_constants_are_constants(data):
  """What an unrolled loop computes from its constant counter folds to one
  constant; with a parameter among the leaves, what depends on it stays."""
  with_param = data.draw(st.booleans())
  b = Builder([ir.TensorType((), "i32")])
  leaves = [_i32(b, data.draw(st.integers(-9, 9))) for _ in range(3)]
  if with_param:
    leaves.append(b.g.params[0])
  b.g.results = [_scalar_expression(b, data, leaves, depth=4, leaf_ok=False)]
  x = [np.array(data.draw(st.integers(-9, 9)), np.int32)]
  before = b.run(x)[0]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  if not with_param:
    assert b.g.results[0].producer.name == "constant"
  np.testing.assert_array_equal(b.run(x)[0], before)


@pytest.mark.parametrize("name", _INT_OPS + ("negate",) + _COMPARISONS)
def test_each_integer_op_of_constants_folds(name):
  b = Builder([])
  x, y = _i32(b, -7), _i32(b, 3)
  if name == "negate":
    out = b.op(name, [x], ir.TensorType((), "i32"))
  elif name in _COMPARISONS:
    out = b.op("compare", [x, y], ir.TensorType((), "pred"), comparison_direction=name)
  else:
    out = b.op(name, [x, y], ir.TensorType((), "i32"))
  b.g.results = [out]
  before = b.run([])[0]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  assert b.g.results[0].producer.name == "constant"
  np.testing.assert_array_equal(b.run([])[0], before)


@SETTINGS
@given(st.data())
def test_logic_with_a_constant_is_an_operand(data):
  """and(p, true) is p and and(p, false) false; or the other way round."""
  shape = data.draw(st.lists(st.integers(1, 3), max_size=2))
  name = data.draw(st.sampled_from(("and", "or")))
  value = data.draw(st.booleans())
  b = Builder([ir.TensorType(tuple(shape), "pred")])
  c = b.op("constant", [], ir.TensorType((), "pred"), value=np.array(value))
  splat = b.op("broadcast_in_dim", [c], ir.TensorType(tuple(shape), "pred"),
               broadcast_dimensions=())
  operands = [b.g.params[0], splat][::data.draw(st.sampled_from((1, -1)))]
  b.g.results = [b.op(name, operands, ir.TensorType(tuple(shape), "pred"))]
  p = [np.random.default_rng(len(shape)).random(shape) < 0.5]
  before = b.run(p)[0]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  assert not any(op.name == name for op in b.g.walk())
  np.testing.assert_array_equal(b.run(p)[0], before)


@SETTINGS
@given(st.sampled_from(("sum", "max", "min")), st.sampled_from((((0, 1, 2, 3),),
                                                                 ((0, 2), (1, 3)))),
       st.sampled_from((0.0, 1.5)))
def test_a_reduction_of_zeros_over_ranks_is_zeros(kind, groups, value):
  """... and a sum of another splat stays: it is |group| times the splat."""
  ranks = 4
  b = Builder([_t(3)])
  region = ir.Graph(kind)
  u, v = b.m.new_value(_t(), name="u"), b.m.new_value(_t(), name="v")
  region.params = [u, v]
  region.results = [b.m.add_op(region, {"sum": "add", "max": "maximum", "min": "minimum"}[kind],
                               [u, v], [_t()]).result]
  reduced = b.m.add_op(b.g, "all_reduce", [b.splat(value, (3,))], [_t(3)],
                       {"replica_groups": groups}, [region]).result
  b.g.results = [b.op("add", [b.g.params[0], reduced], _t(3))]
  x = [np.random.default_rng(k).standard_normal(3) for k in range(ranks)]
  before = Interpreter(ranks).run(b.g, [x])[b.g.results[0].id]
  canonicalize_graph(b.m, b.g, rings=True, extra=UNROLLED_RING_PATTERNS)
  assert any(op.name == "all_reduce" for op in b.g.walk()) == (value != 0.0)
  after = Interpreter(ranks).run(b.g, [x])[b.g.results[0].id]
  np.testing.assert_array_equal(np.stack(after), np.stack(before))
