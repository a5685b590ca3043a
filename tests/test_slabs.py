"""Sums of zero-padded slabs become concatenations (passes/slabs.py): the
gradient of a tensor read in slices, added in any order, evaluated before and
after on random shapes, slabs and orders; and what is left alone."""

import contextlib
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from graphguard_hlo import ir, reference
from graphguard_hlo.passes import slabs
from graphguard_hlo.passes.canonicalize import canonicalize_graph, canonicalize_module

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


def _t(shape, dtype="f32"):
  return ir.TensorType(tuple(shape), dtype)


def _run(g: ir.Graph, inputs):
  env = {p.id: x for p, x in zip(g.params, inputs)}
  for op in g.ops:
    env[op.results[0].id] = reference.evaluate(op.name, op.attrs, [env[v.id] for v in op.operands],
                                               op.results[0].type)
  return [env[v.id] for v in g.results]


def _program(shape, k, pads, order, padding=0.0, interior=0):
  """sum over ``order`` of pad(param_j, slab pads[j]) along dim k."""
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  zero = m.add_op(g, "constant", [], [_t(())], {"value": np.array(padding, np.float32)}).result
  g.params, padded = [], []
  for j, (start, stop) in enumerate(pads):
    piece = list(shape)
    piece[k] = stop - start
    p = m.new_value(_t(piece), name=f"p{j}")
    g.params.append(p)
    lo = tuple(start if d == k else 0 for d in range(len(shape)))
    hi = tuple(shape[k] - stop if d == k else 0 for d in range(len(shape)))
    padded.append(m.add_op(g, "pad", [p, zero], [_t(shape)],
                           {"edge_padding_low": lo, "edge_padding_high": hi,
                            "interior_padding": (interior,) * len(shape)}).result)
  total = padded[order[0]]
  for j in order[1:]:
    total = m.add_op(g, "add", [total, padded[j]], [_t(shape)], {}).result
  g.results = [total]
  return m, g


@st.composite
def _slab_sums(draw):
  rank = draw(st.integers(1, 3))
  shape = [draw(st.integers(1, 4)) for _ in range(rank)]
  k = draw(st.integers(0, rank - 1))
  cuts = sorted(draw(st.sets(st.integers(1, 7), min_size=1, max_size=4)))  # (a pad of no room is no slab)
  bounds = [0] + cuts + [8]
  shape[k] = bounds[-1] + draw(st.integers(0, 2))  # room the slabs may leave uncovered
  first = draw(st.integers(0, shape[k] - 8))
  slabs = [(first + a, first + b) for a, b in zip(bounds, bounds[1:])]
  uses = [s for s in slabs for _ in range(draw(st.integers(1, 3)))]  # a layer per step
  order = draw(st.permutations(range(len(uses))))
  return shape, k, uses, order


def _inputs(g, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(-4, 5, p.shape).astype(np.float32) for p in g.params]  # exact sums


@SETTINGS
@given(_slab_sums(), st.integers(0, 2**16))
def test_sum_of_pads_keeps_its_value(case, seed):
  shape, k, uses, order = case
  m, g = _program(shape, k, uses, order)
  inputs = _inputs(g, seed)
  before = _run(g, inputs)
  canonicalize_graph(m, g)
  np.testing.assert_array_equal(_run(g, inputs)[0], before[0])


@SETTINGS
@given(_slab_sums(), st.booleans())
def test_slabs_added_in_stack_order_become_one_concatenation(case, reverse):
  """Added slab after slab (each use of a slab next to its others, as a
  sequential stack's layers are), the sum is one concatenation of per-slab
  sums, padded where the slabs leave the dim uncovered: no add of pads left."""
  shape, k, uses, _ = case
  order = sorted(range(len(uses)), key=lambda j: uses[j], reverse=reverse)
  m, g = _program(shape, k, uses, order)
  canonicalize_graph(m, g)
  top = g.results[0].producer
  assert top.name in ("concatenate", "pad"), [op.name for op in g.ops]
  assert not any(op.name == "add" and all(v.producer is not None and v.producer.name == "pad"
                                         for v in op.operands)
                 for op in g.ops)


def test_interleaved_layers_group_by_slab():
  """A pipeline stage's stack gradient: layers 1, 0, 1, 0 of two steps."""
  m, g = _program([4, 3], 0, [(2, 4), (0, 2), (2, 4), (0, 2)], [0, 1, 2, 3])
  inputs = _inputs(g, 0)
  before = _run(g, inputs)
  canonicalize_graph(m, g)
  top = g.results[0].producer
  assert top.name == "concatenate"
  assert [v.producer.name for v in top.operands] == ["add", "add"]
  np.testing.assert_array_equal(_run(g, inputs)[0], before[0])


def test_overlapping_slabs_are_left_alone():
  m, g = _program([6, 2], 0, [(0, 4), (2, 6)], [0, 1])
  assert canonicalize_graph(m, g) == 0


def test_slabs_with_a_gap_between_are_left_alone():
  m, g = _program([6, 2], 0, [(0, 2), (4, 6)], [0, 1])
  assert canonicalize_graph(m, g) == 0


def test_pads_of_another_value_or_interior_padding_are_left_alone():
  m, g = _program([4, 2], 0, [(0, 2), (2, 4)], [0, 1], padding=1.0)
  assert canonicalize_graph(m, g) == 0
  m, g = _program([3, 1], 0, [(0, 1), (1, 2)], [0, 1], interior=1)  # (units: no room added)
  assert canonicalize_graph(m, g) == 0
  m, g = _program([3, 1], 0, [(0, 1), (1, 2)], [0, 1])
  assert canonicalize_graph(m, g) > 0  # the control: the same sum, plain pads


# -- buffers set row by row, batches reshaped into microbatches (lowered from jax) ------

def _lowered(fn, *args):
  from graphguard_hlo.lowering import lower_sequential
  from graphguard_hlo.passes.inline import inline_calls
  m = lower_sequential(fn, *args)
  inline_calls(m)
  return m, m.main


def _interpret(g, args):
  from graphguard_hlo.interpret import Interpreter
  env = Interpreter(1).run(g, [[np.asarray(a)] for a in args])
  return [np.asarray(env[v.id][0]) for v in g.results]


def _same_after_canonicalizing(fn, *args):
  """fn's lowered graph, canonicalized, computes what it did; its op names after."""
  m, g = _lowered(fn, *args)
  before = _interpret(g, args)
  canonicalize_module(m)
  after = _interpret(g, args)
  for a, b in zip(before, after):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  return {op.name for op in g.walk()}


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(2, 4), st.integers(1, 3), st.data())
def test_a_buffer_set_row_by_row_is_a_concatenation(rows, size, data):
  """x.reshape(rows, size, 3)[i] read and ``.at[j].set`` written in any order
  (a row may be written twice; the last write wins), then the buffer reshaped
  back: the same numbers, and, while the rows written leave no gap, slices,
  pads and concatenations only (a gap is left a scatter)."""
  import jax.numpy as jnp
  order = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows + 2))
  x = np.random.default_rng(rows * 10 + size).standard_normal((rows * size, 3)).astype(
      np.float32)

  def fn(x):
    batches = x.reshape(rows, size, 3)
    out = jnp.zeros_like(batches)
    for step, j in enumerate(order):
      out = out.at[j].set(jnp.tanh(batches[(j + step) % rows]) * (step + 1))
    return out.reshape(x.shape)
  names = _same_after_canonicalizing(fn, x)
  written = [set(order[:k + 1]) for k in range(len(order))]
  if all(max(w) - min(w) + 1 == len(w) for w in written):  # rows without gaps, always
    assert "scatter" not in names and "gather" not in names, names


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.integers(2, 4), st.integers(1, 3))
def test_the_gradient_of_a_buffered_pipeline_reads_rows_by_slices(rows, size):
  """The transpose of ``.at[m].set``: the cotangent's row read by a gather, the
  row zeroed by a scatter, an in-bounds check on the constant index: slices."""
  import jax
  import jax.numpy as jnp
  x = np.random.default_rng(rows + size).standard_normal((rows * size, 3)).astype(np.float32)

  def loss(x):
    batches = x.reshape(rows, size, 3)
    out = jnp.zeros_like(batches)
    for m in range(rows):
      out = out.at[m].set(jnp.tanh(batches[m]))
    return jnp.sum(out.reshape(x.shape) ** 2)
  names = _same_after_canonicalizing(jax.grad(loss), x)
  assert not names & {"scatter", "gather", "select"}, names


def test_a_row_set_over_part_of_another_is_left_alone():
  import jax.numpy as jnp

  def fn(x):
    out = jnp.zeros((4, 3)).at[0:2].set(x[0:2]).at[1:3].set(x[2:4])
    return out
  names = _same_after_canonicalizing(fn, np.ones((4, 3), np.float32))
  assert "scatter" in names or "dynamic_update_slice" in names, names


def test_a_row_set_at_a_traced_index_is_left_alone():
  import jax.numpy as jnp

  def fn(x, i):
    return jnp.zeros((4, 3)).at[i].set(x)
  names = _same_after_canonicalizing(fn, np.ones((3,), np.float32), np.int32(2))
  assert names & {"scatter", "dynamic_update_slice"}, names


def test_slices_past_a_set_row_read_the_buffer_and_the_set_row_reads_the_update():
  def fn(x, y):
    out = x.at[1].set(y)
    return out[0:1], out[2:4], out[1:2], out[0:2]
  names = _same_after_canonicalizing(fn, np.arange(12.0, dtype=np.float32).reshape(4, 3),
                                     -np.ones((3,), np.float32))
  assert "scatter" in names  # (read over the row it set: the set stays)


def test_a_row_set_inside_a_wider_slab_is_left_alone():
  """pad(x, rows 0..2) then .at[1].set(u): row 1 of a two-row slab."""
  import jax.numpy as jnp

  def fn(x, u):
    return jnp.pad(x, ((0, 2), (0, 0))).at[1].set(u)
  names = _same_after_canonicalizing(fn, np.ones((2, 3), np.float32), -np.ones((3,), np.float32))
  assert "scatter" in names, names


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(1, 3), st.integers(0, 5), st.booleans())
def test_a_row_set_outside_the_buffer_or_over_all_of_it(rows, at, add):
  """``x.at[i].set(u)`` with i past the rows writes nothing (XLA skips the
  window): x.  Over a one-row buffer it overwrites everything: u.  GSPMD's
  partitioned set is such a scatter at each rank (rank_cases.py)."""
  def fn(x, u):
    row = x.at[at]
    return row.add(u, mode="drop") if add else row.set(u, mode="drop")
  rng = np.random.default_rng(rows * 10 + at)
  x = rng.standard_normal((rows, 3)).astype(np.float32)
  names = _same_after_canonicalizing(fn, x, rng.standard_normal((3,)).astype(np.float32))
  if at >= rows or (rows == 1 and not add):
    assert "scatter" not in names, names


# -- stacks masked as a whole and added up (a hand-written schedule's gradient) --------

def _masked_stacks(shape, k, cuts_per_term, zero_first=()):
  """sum over terms j of select(flag_j, concat_k(params of term j), 0) (or
  the zero first when j is in ``zero_first``), each term cut by its own cuts."""
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  g.params, terms = [], []
  zero = m.add_op(g, "constant", [], [_t(())], {"value": np.array(0.0, np.float32)}).result
  zeros = m.add_op(g, "broadcast_in_dim", [zero], [_t(shape)],
                   {"broadcast_dimensions": ()}).result
  for j, cuts in enumerate(cuts_per_term):
    bounds = [0] + list(cuts) + [shape[k]]
    parts = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
      piece = list(shape)
      piece[k] = b - a
      parts.append(m.new_value(_t(piece), name=f"p{j}_{i}"))
    g.params += parts
    stack = m.add_op(g, "concatenate", parts, [_t(shape)], {"dimension": k}).result
    # A flag the canonicalizer cannot fold: a compare of a parameter, as a rank's is.
    r = m.new_value(_t((), "i32"), name=f"r{j}")
    g.params.append(r)
    zero_i = m.add_op(g, "constant", [], [_t((), "i32")], {"value": np.array(0, np.int32)}).result
    pred = m.add_op(g, "compare", [r, zero_i], [_t((), "i1")],
                    {"comparison_direction": "EQ"}).result
    spread = m.add_op(g, "broadcast_in_dim", [pred], [_t(shape, "i1")],
                      {"broadcast_dimensions": ()}).result
    branches = [zeros, stack] if j in zero_first else [stack, zeros]
    terms.append(m.add_op(g, "select", [spread, *branches], [_t(shape)], {}).result)
  total = terms[0]
  for t in terms[1:]:
    total = m.add_op(g, "add", [total, t], [_t(shape)], {}).result
  g.results = [total]
  return m, g


def _masked_inputs(g, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(-1, 2, p.shape).astype(np.int32) if p.type.dtype == "i32"
          else rng.integers(-4, 5, p.shape).astype(np.float32) for p in g.params]


@SETTINGS
@given(st.integers(1, 3), st.integers(2, 4), st.integers(1, 4), st.data())
def test_masked_stacks_added_keep_their_value(rank, rows, terms, data):
  """Evaluated before and after, on random flags and values: the form is an
  identity whatever the masks hold."""
  shape = [data.draw(st.integers(1, 3)) for _ in range(rank)]
  k = data.draw(st.integers(0, rank - 1))
  shape[k] = rows
  cuts = sorted(data.draw(st.sets(st.integers(1, rows - 1), min_size=1)))
  zero_first = data.draw(st.sets(st.integers(0, terms - 1)))
  m, g = _masked_stacks(shape, k, [cuts] * terms, zero_first)
  inputs = _masked_inputs(g, data.draw(st.integers(0, 2**16)))
  before = _run(g, inputs)
  canonicalize_graph(m, g)
  np.testing.assert_array_equal(_run(g, inputs)[0], before[0])


def test_masked_stacks_become_a_stack_of_sums():
  """Each term masked as a whole, added: one concatenation of per-row sums."""
  m, g = _masked_stacks([4, 3], 0, [(2,), (2,), (2,)], zero_first={1})
  canonicalize_graph(m, g)
  top = g.results[0].producer
  assert top.name == "concatenate" and len(top.operands) == 2
  assert [v.producer.name for v in top.operands] == ["add", "add"]


def test_stacks_cut_at_other_rows_are_not_added_row_by_row():
  m, g = _masked_stacks([4, 3], 0, [(2,), (1,)])
  canonicalize_graph(m, g)
  assert g.results[0].producer.name == "add"


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(2, 4), st.data())
def test_a_buffer_updated_at_constant_rows_keeps_its_value(rows, data):
  """dynamic_update_slice at constant rows (clamped past either end), some
  writes masked by a flag, then rows read back: the same numbers after the
  slab forms (a written row is a slab; a slice of a select is a select of
  slices; a slice of a set row is the update, past it the buffer)."""
  import jax.numpy as jnp
  from jax import lax
  writes = data.draw(st.lists(st.tuples(st.integers(-1, rows), st.booleans()), min_size=1,
                              max_size=rows + 2))
  reads = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=3))
  x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
  flag = np.int32(data.draw(st.integers(0, len(writes))))

  def fn(x, flag):
    out = jnp.zeros((rows, 3))
    for step, (j, masked) in enumerate(writes):
      new = lax.dynamic_update_slice(out, jnp.tanh(x[step % rows])[None] * (step + 1),
                                     (np.int32(j), np.int32(0)))
      out = jnp.where(flag > step, new, out) if masked else new
    return [out[j:j + 1] for j in reads] + [out]
  _same_after_canonicalizing(fn, x, flag)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(2, 4), st.integers(1, 3), st.data())
def test_a_parameter_row_picked_by_flags_squeezed_keeps_its_value(rows, cases, data):
  """A stack's row picked by nested selects on flags (rank_cases.py's form of
  a chunk read at a row computed from the stage), squeezed to the row's
  shape: the same numbers after the squeeze is pushed into the branches, and
  the result is a select of squeezed rows."""
  import jax.numpy as jnp
  picks = data.draw(st.lists(st.integers(0, rows - 1), min_size=cases + 1, max_size=cases + 1))
  w = np.random.default_rng(rows * 10 + cases).standard_normal((rows, 1, 3)).astype(np.float32)
  flags = np.array(data.draw(st.lists(st.booleans(), min_size=cases, max_size=cases)))

  def fn(w, flags):
    picked = w[picks[-1]:picks[-1] + 1]
    for j in reversed(range(cases)):
      picked = jnp.where(flags[j], w[picks[j]:picks[j] + 1], picked)
    return picked.reshape(3)
  _same_after_canonicalizing(fn, w, flags)
  m, g = _lowered(fn, w, flags)
  canonicalize_module(m)
  top = g.results[0].producer
  assert top.name == "select" and top.operands[1].producer.name == "reshape", top.name


def test_a_squeezed_select_of_computed_values_is_left_alone():
  """Pushed into a buffer's selects (one per step and rank case) the reshape
  would be copied into every case: only rows of a parameter are read so."""
  import jax.numpy as jnp

  def fn(w, flag):
    return jnp.where(flag, jnp.tanh(w[0:1]), w[1:2]).reshape(3)
  w = np.zeros((2, 1, 3), np.float32)
  m, g = _lowered(fn, w, np.bool_(True))
  canonicalize_module(m)
  assert g.results[0].producer.name == "reshape"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_a_one_window_gather_at_a_traced_start_is_a_dynamic_slice(data):
  """``jax.vmap`` of a ``dynamic_slice`` over a batch of one (each pipeline
  stage picking its repeat's weights from its own row of a stack split over
  the stages) gathers one window at a traced start: the same numbers as a
  dynamic_slice, starts drawn past both ends (both clamp the window in)."""
  import jax
  from jax import lax
  rank = data.draw(st.integers(1, 3))
  shape = [data.draw(st.integers(1, 4)) for _ in range(rank)]
  sizes = [data.draw(st.integers(1, n)) for n in shape]
  starts = np.array([[data.draw(st.integers(-2, n + 1)) for n in shape]], np.int32)
  x = np.random.default_rng(rank).standard_normal([1] + shape).astype(np.float32)

  def fn(x, starts):
    return jax.vmap(lambda x, i: lax.dynamic_slice(x, tuple(i), sizes))(x, starts)
  names = _same_after_canonicalizing(fn, x, starts)
  assert "gather" not in names, names


def test_a_stage_picking_its_repeat_by_a_traced_index_reads_a_dynamic_slice():
  """MaxText's ``vmap_parallel_gather``: ``dynamic_index_in_dim`` vmapped,
  jnp's negative index wrapped first; a batch of two stays a gather."""
  import jax
  from jax import lax

  def pick(w, repeat):
    return jax.vmap(lambda w, r: lax.dynamic_index_in_dim(w, r, 0, keepdims=False))(w, repeat)
  w = np.arange(1 * 3 * 2 * 4, dtype=np.float32).reshape(1, 3, 2, 4)
  for r in (-1, 0, 2, 5):
    assert "gather" not in _same_after_canonicalizing(pick, w, np.array([r], np.int32))
  two = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
  assert "gather" in _same_after_canonicalizing(pick, two, np.array([1, 2], np.int32))


def test_a_start_sliced_from_a_splat_is_that_constant():
  """The window's other starts, sliced from the index vector's splat part,
  read as constants (``terms.splat_value``): the dynamic_slice then moves
  along one dim only, which rank cases split.  A slice of a constant that is
  not one splat is not read as one."""
  from graphguard_hlo.passes.terms import splat_value
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  three = m.add_op(g, "constant", [], [_t((), "i32")], {"value": np.array(3, np.int32)}).result
  row = m.add_op(g, "broadcast_in_dim", [three], [_t((1, 2), "i32")],
                 {"broadcast_dimensions": ()}).result
  table = m.add_op(g, "constant", [], [_t((2,), "i32")],
                   {"value": np.array([3, 4], np.int32)}).result

  def sliced(x, start, limit):
    return m.add_op(g, "slice", [x], [_t([b - a for a, b in zip(start, limit)], "i32")],
                    {"start_indices": start, "limit_indices": limit,
                     "strides": (1,) * len(start)}).result
  assert splat_value(sliced(row, (0, 1), (1, 2))) == 3
  assert splat_value(sliced(table, (0,), (1,))) is None


_UNVERIFIED_GATHERS = {
    # offset dims out of order: the window transposed (StableHLO's verifier
    # refuses it; HLO text is read as written).
    "unsorted_offset_dims": ("f32[4,3]", "s32[1]", "f32[3,4]",
                             "offset_dims={1,0}, collapsed_slice_dims={}, start_index_map={1}, "
                             "index_vector_dim=0, slice_sizes={4,3}"),
    # a start on a batching dim of two rows.
    "start_on_a_batching_dim": ("f32[2,3]", "s32[1,1]", "f32[1,3]",
                                "offset_dims={1}, collapsed_slice_dims={}, "
                                "operand_batching_dims={0}, start_indices_batching_dims={0}, "
                                "start_index_map={0}, index_vector_dim=1, slice_sizes={1,3}"),
}


def _unverified_gather_text(name: str) -> str:
  x_type, i_type, out_type, dims = _UNVERIFIED_GATHERS[name]
  return f"""HloModule m

ENTRY main {{
  x = {x_type} parameter(0)
  i = {i_type} parameter(1)
  ROOT g = {out_type} gather(x, i), {dims}
}}
"""


@pytest.mark.parametrize("name", sorted(_UNVERIFIED_GATHERS))
def test_the_loader_refuses_a_gather_outside_stablehlo(name):
  from graphguard_hlo.errors import InputError
  from graphguard_hlo.loaders.hlo_text import load_hlo_text
  with pytest.raises(InputError, match=r"^<test>.hlo:6:\d+: error: %g \(gather\): "):
    load_hlo_text("<test>.hlo", _unverified_gather_text(name))


@pytest.mark.parametrize("name", sorted(_UNVERIFIED_GATHERS))
def test_a_gather_hlo_text_spells_outside_stablehlo_keeps_its_value(name, monkeypatch):
  """Found by an audit: these gathers were rewritten into dynamic_slices of
  other elements.  The loader now refuses them (above); the rule's own
  guard is kept and tested here, the loader's check bypassed."""
  from graphguard_hlo.interpret import Interpreter
  from graphguard_hlo.loaders import hlo_text
  monkeypatch.setattr(hlo_text, "gather_violation", lambda *args: None)
  m = hlo_text.load_hlo_text("<test>.hlo", _unverified_gather_text(name))
  g = m.main
  x = np.arange(12, dtype=np.float32)[:math.prod(g.params[0].shape)].reshape(g.params[0].shape)
  i = np.ones(g.params[1].shape, np.int32)
  run = lambda: np.asarray(Interpreter(1).run(g, [[x], [i]])[g.results[0].id][0])
  before = run()
  canonicalize_module(m)
  np.testing.assert_array_equal(run(), before)

# -- a rank's own rows of a split reshape -------------------------------------------------

@contextlib.contextmanager
def _any_index_is_the_ranks():
  """The rule fires on indices computed from the rank alone; these tests draw
  the index as an argument, to run it at any value (past both ends too)."""
  saved = slabs._of_the_rank_alone
  slabs._of_the_rank_alone = lambda v: True
  try:
    yield
  finally:
    slabs._of_the_rank_alone = saved


def test_the_rule_reads_indices_of_the_rank_alone():
  """An index from axis_index is the rank's; one from an argument (a
  pipeline's step) is not, and its dynamic_slice keeps its spelling."""
  import jax
  from jax import lax, shard_map
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)

  def own_rows(w, t):
    return w.reshape(4, 2, 3)[lax.axis_index("x")], w.reshape(4, 2, 3)[t]
  fn = shard_map(own_rows, mesh=mesh, in_specs=(P(), P()), out_specs=(P("x"), P("x")),
                 check_vma=False)
  m, g = _lowered(fn, w, np.int32(1))
  canonicalize_module(m)
  cuts = [op for op in g.walk() if op.name == "dynamic_slice"]
  assert sorted(op.operands[0].type.rank for op in cuts) == [2, 3]  # x itself; the reshape


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_rows_picked_from_a_split_reshape_at_a_traced_index_are_a_dynamic_slice(data):
  """``x.reshape(..., m, n, ...)`` cut at a traced row of the m (each rank
  reading its own rows, ``x.reshape(ranks, -1)[axis_index]``) reads x's own
  rows: the same numbers, the index drawn past both ends (both clamp) and
  far enough that the row's offset would wrap unclamped, and the window then
  cuts x itself."""
  from jax import lax
  rank = data.draw(st.integers(1, 3))
  shape = [data.draw(st.integers(1, 4)) for _ in range(rank)]
  k = data.draw(st.integers(0, rank - 1))
  m, n = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
  shape[k] = m * n
  split = shape[:k] + [m, n] + shape[k + 1:]
  sizes = [data.draw(st.integers(1, d)) for d in split]
  sizes[k + 1] = n
  far = st.sampled_from([2**31 - 1, 2**30 + 1, -2**31])  # i * n would wrap
  starts = np.array([data.draw(st.integers(-2, d + 1) | far) for d in split], np.int32)
  x = np.random.default_rng(rank).standard_normal(shape).astype(np.float32)

  def fn(x, starts):
    return lax.dynamic_slice(x.reshape(split), tuple(starts), sizes)
  m_, g = _lowered(fn, x, starts)
  before = _interpret(g, [x, starts])
  with _any_index_is_the_ranks():
    canonicalize_module(m_)
  np.testing.assert_array_equal(before[0], _interpret(g, [x, starts])[0])
  (cut,) = [op for op in g.walk() if op.name == "dynamic_slice"]
  assert cut.operands[0] is g.params[0], "the window should cut x itself"


def test_rows_picked_from_the_minor_part_of_a_split_are_left_alone():
  """``x.reshape(m, n)[:, i]`` takes every n-th element: strided, not a window of x."""
  from jax import lax
  x = np.arange(12, dtype=np.float32)

  def fn(x, i):
    return lax.dynamic_slice(x.reshape(3, 4), (0, i), (3, 1))
  with _any_index_is_the_ranks():
    names = _same_after_canonicalizing(fn, x, np.int32(2))
    assert "reshape" in names and "dynamic_slice" in names
    m_, g = _lowered(fn, x, np.int32(2))
    canonicalize_module(m_)
  (cut,) = [op for op in g.walk() if op.name == "dynamic_slice"]
  assert cut.operands[0] is not g.params[0]


@pytest.mark.parametrize("row", [2**31 - 1, 2**30 + 1, -2**31, -1, 5])
def test_a_row_far_past_the_end_is_clamped_before_it_is_scaled(row):
  """Row 2**31 - 1 of ``x.reshape(4, 3)`` is the last row (the slice clamps
  it); scaled by 3 unclamped it would wrap to a negative offset, row 0."""
  from jax import lax
  x = np.arange(12, dtype=np.float32)

  def fn(x, i):
    return lax.dynamic_slice(x.reshape(4, 3), (i, 0), (1, 3))
  with _any_index_is_the_ranks():
    names = _same_after_canonicalizing(fn, x, np.int32(row))
  assert "reshape" not in names  # the window cuts x itself
