"""Rank tables (passes/rank_tables.py) say what every rank holds: checked on numbers.

The property test builds random per-device programs of the ops tables follow
(half permutes, pads, concats, rank-dependent slices and updates, masks on
the partition id, all-reduces) after a value sharded by a random layout, runs
them over the mesh (``tests/test_transfer.py``'s simulator) and checks every
table entry against the run: ``d@r[box] == S[box + shift]`` and zeros off
the box.  Every layout read back from a table must rebuild ``S``.  Fixed
cases follow the reshard XLA writes for Llama-3's FSDP x TP gradient (proved)
and three seeded bugs in it (nothing read back).
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, strategies as st

from graphguard_hlo import ir
from graphguard_hlo.passes.dist_egraph import DistEGraph
from graphguard_hlo.passes.layout import Layout, assemble, shard
from graphguard_hlo.passes.rank_arith import RankArithmetic
from graphguard_hlo.passes.rank_tables import RankTables
from graphguard_hlo.passes.transfer import Transfer
from tests.layout_draws import axis_slots, meshes
from tests.test_transfer import SETTINGS, Hits, Program, ranks

# -- building the per-device program --------------------------------------------------------


def per_rank(prog: Program, values) -> ir.Value:
  """An i32 scalar that is ``values[partition id]`` (GSPMD's offset tables)."""
  table = prog.add("constant", [], (len(values),), "i32",
                   {"value": np.array(values, np.int32)}).result
  pid = prog.add("partition_id", [], (), "ui32").result
  row = prog.add("dynamic_slice", [table, pid], (1,), "i32", {"slice_sizes": (1,)}).result
  return prog.add("reshape", [row], (), "i32").result


def zeros(prog: Program, shape) -> ir.Value:
  zero = prog.const(0.0, "f32")
  return prog.add("broadcast_in_dim", [zero], shape, attrs={"broadcast_dimensions": ()}).result


def rank_mask(prog: Program, values, shape) -> ir.Value:
  """A pred splat, true where ``values[partition id] < 1``."""
  lt = prog.add("compare", [per_rank(prog, values), prog.const(1, "i32")], (), "pred",
                {"comparison_direction": "LT"}).result
  return prog.add("broadcast_in_dim", [lt], shape, "pred", {"broadcast_dimensions": ()}).result


def permute(prog: Program, v: ir.Value, pairs) -> ir.Value:
  pairs = tuple(pairs)
  return prog.add("collective_permute", [v], v.shape,
                  attrs={"source_target_pairs": pairs, "test.device_pairs": pairs}).result


def pad(prog: Program, v: ir.Value, lo, hi) -> ir.Value:
  out = tuple(m + a + b for m, a, b in zip(v.shape, lo, hi))
  return prog.add("pad", [v, prog.const(0.0, "f32")], out, attrs={
      "edge_padding_low": tuple(lo), "edge_padding_high": tuple(hi),
      "interior_padding": (0,) * len(v.shape)}).result


def some_pairs(draw, n: int):
  """A random partial injective map of partition ids (some ranks get nothing)."""
  sources = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
  targets = draw(st.permutations(range(n)))[:len(sources)]
  return list(zip(sources, targets))


KINDS = ("permute", "concat", "slice", "select", "update", "pad", "all_reduce")


def draw_step(draw, prog: Program, v: ir.Value, kinds=KINDS) -> ir.Value:
  """One random op after ``v``, of those rank tables follow."""
  mesh, shape, n = prog.mesh, v.shape, prog.mesh.size
  kind = draw(st.sampled_from(kinds))
  if kind == "static_slice":
    starts = [draw(st.integers(0, m - 1)) for m in shape]
    limits = [draw(st.integers(a + 1, m)) for a, m in zip(starts, shape)]
    return prog.add("slice", [v], [b - a for a, b in zip(starts, limits)], attrs={
        "start_indices": tuple(starts), "limit_indices": tuple(limits),
        "strides": (1,) * len(shape)}).result
  if kind == "permute":
    return permute(prog, v, some_pairs(draw, n))
  if kind == "concat":
    k = draw(st.integers(0, len(shape) - 1))
    other = draw(st.sampled_from(["self", "param", "zeros"]))
    w = {"self": v, "param": prog.param, "zeros": None}[other]
    if w is None or w.shape != shape:
      w = zeros(prog, shape)
    out = list(shape)
    out[k] *= 2
    first, second = (v, w) if draw(st.booleans()) else (w, v)
    return prog.add("concatenate", [first, second], out, attrs={"dimension": k}).result
  if kind == "slice":
    sizes = tuple(draw(st.integers(1, m)) for m in shape)
    starts = [per_rank(prog, draw(st.lists(st.integers(-1, m), min_size=n, max_size=n)))
              for m in shape]
    return prog.add("dynamic_slice", [v, *starts], sizes, attrs={"slice_sizes": sizes}).result
  if kind == "select":
    mask = rank_mask(prog, draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), shape)
    z = zeros(prog, shape)
    operands = [mask, v, z] if draw(st.booleans()) else [mask, z, v]
    return prog.add("select", operands, shape).result
  if kind == "update":
    big = tuple(m + draw(st.integers(0, 2)) for m in shape)
    starts = [per_rank(prog, draw(st.lists(st.integers(-1, m), min_size=n, max_size=n)))
              for m in big]
    base, update = zeros(prog, big), v
    if draw(st.booleans()):  # into v itself, padded: some pieces overwritten, some cut
      base = pad(prog, v, (0,) * len(shape), tuple(b - m for b, m in zip(big, shape)))
      update = draw(st.sampled_from([v, zeros(prog, shape)]))
    return prog.add("dynamic_update_slice", [base, update, *starts], big).result
  if kind == "pad":
    lo = tuple(draw(st.integers(-1, 2)) if m > 1 else draw(st.integers(0, 2)) for m in shape)
    hi = tuple(draw(st.integers(0, 2)) for _ in shape)
    return pad(prog, v, lo, hi)
  axes = tuple(a for a in mesh.axis_names if draw(st.booleans())) or mesh.axis_names[:1]
  return prog.add("all_reduce", [v], shape,
                  attrs={"gg.axes": axes, "gg.reduction": "sum"}).result


@st.composite
def plain_layouts(draw, mesh: ir.Mesh, rank: int) -> Layout:
  """Each axis tiles a dim, is pinned at a coordinate, or is replicated."""
  dims, pinned = axis_slots(draw, mesh, rank, "pin")
  pins = tuple((a, draw(st.integers(0, mesh.axis_size(a) - 1))) for a in pinned)
  return Layout(dims, at=pins, zero_elsewhere=bool(pins) and draw(st.booleans()))


def tables_of(prog: Program):
  """RankTables over ``prog``, and its e-graph."""
  prog.graph.results = [prog.graph.ops[-1].result]
  deg = DistEGraph(prog.graph)
  transfer = Transfer(deg, RankArithmetic(prog.mesh), prog.mesh, prog.graph)
  return transfer.rank_tables, deg


def check_entries(table, held: dict, value: np.ndarray) -> int:
  """Every entry holds on the run; the number of ranks holding some of S."""
  holding = 0
  for r, coord in enumerate(sorted(held)):
    pieces, got = table[r], held[coord]
    if pieces is None:
      continue
    expect = np.zeros(got.shape)
    covered = np.zeros(got.shape, dtype=int)
    for piece in pieces:
      box = tuple(slice(lo, hi) for lo, hi in piece.box)
      src = tuple(slice(lo + s, hi + s) for (lo, hi), s in zip(piece.box, piece.shift))
      expect[box] = value[src]
      covered[box] += 1
    assert covered.max(initial=0) <= 1, f"pieces overlap at rank {coord}: {pieces}"
    holding += bool(pieces)
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-8, err_msg=f"rank {coord}")
  return holding


# -- the property ------------------------------------------------------------------------------

def test_every_entry_holds_on_a_run():
  followed, read_back = Hits(), Hits()

  @SETTINGS
  @given(st.data())
  def check(data):
    draw = data.draw
    mesh = draw(meshes())
    rank = draw(st.integers(1, 3))
    layout = draw(plain_layouts(mesh, rank))
    tile = tuple(draw(st.integers(1, 3)) for _ in range(rank))
    value_shape = [t * math.prod(mesh.axis_size(a) for a in axes)
                   for t, axes in zip(tile, layout.dims)]
    prog = Program(mesh, tile)
    first = permute(prog, prog.param, some_pairs(draw, mesh.size)) if draw(st.booleans()) \
        else draw_step(draw, prog, prog.param)
    start = first.producer
    v = first
    for _ in range(draw(st.integers(0, 4))):
      v = draw_step(draw, prog, v)
    tables, deg = tables_of(prog)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    value = rng.standard_normal(value_shape)
    run = prog.run(shard(layout, mesh, value, rng))
    value_of = {deg.of(op.result): op.result for op in prog.graph.ops}
    entries = tables.follow(start, deg.of(prog.param), layout, tile)
    followed.add(sum(check_entries(t, run[value_of[c].id], value) for c, t, _ in entries))
    found = list(tables.walk(start, deg.of(prog.param), layout, tile))
    read_back.add(found)
    for c, new in found:
      what = f"{layout} -> {new} on {mesh.axes}"
      np.testing.assert_allclose(assemble(new, mesh, run[value_of[c].id]), value,
                                 rtol=1e-6, atol=1e-8, err_msg=what)

  check()
  # A generator drifting away from what tables follow would check nothing.
  followed.check(0.3)
  read_back.check(0.1)


def test_what_is_read_back_of_a_window_rebuilds_it():
  """``sliced``: where the ops after a tiled value hold tiles of a window of
  it (a slice across the tiles), the layout read back rebuilds the window,
  on random programs of the ops tables follow."""
  read_back = Hits()

  @SETTINGS
  @given(st.data())
  def check(data):
    draw = data.draw
    mesh = draw(meshes())
    rank = draw(st.integers(1, 2))
    layout = draw(plain_layouts(mesh, rank))
    tile = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    value_shape = [t * math.prod(mesh.axis_size(a) for a in axes)
                   for t, axes in zip(tile, layout.dims)]
    start = tuple(draw(st.integers(0, n - 1)) for n in value_shape)
    limit = tuple(draw(st.integers(a + 1, n)) for a, n in zip(start, value_shape))
    prog = Program(mesh, tile)
    v = prog.param
    for _ in range(draw(st.integers(1, 4))):
      v = draw_step(draw, prog, v, KINDS + ("static_slice",))
    tables, deg = tables_of(prog)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    value = rng.standard_normal(value_shape)
    run = prog.run(shard(layout, mesh, value, rng))
    value_of = {deg.of(op.result): op.result for op in prog.graph.ops}
    window = value[tuple(slice(a, b) for a, b in zip(start, limit))]
    found = list(tables.sliced(start, limit, deg.of(prog.param), layout, tile))
    read_back.add(found)
    for c, new in found:
      np.testing.assert_allclose(assemble(new, mesh, run[value_of[c].id]), window,
                                 rtol=1e-6, atol=1e-8, err_msg=f"{layout} {start}:{limit} "
                                                               f"-> {new} on {mesh.axes}")

  check()
  read_back.check(0.02)


def test_a_window_across_tiles_picked_by_rank_is_read_back():
  """Rows [2, 6) of 8 rows split in two: rank 0 holds rows 2:4 of its own
  tile, rank 1 rows 4:6 at the start of its own: one dynamic_slice at a
  per-rank offset gives each rank its tile of the window."""
  mesh = ir.Mesh((("x", 2),))
  prog = Program(mesh, (4, 3))
  at = per_rank(prog, [2, 0])
  zero = per_rank(prog, [0, 0])
  prog.add("dynamic_slice", [prog.param, at, zero], (2, 3), attrs={"slice_sizes": (2, 3)})
  tables, deg = tables_of(prog)
  found = list(tables.sliced((2, 0), (6, 3), deg.of(prog.param), Layout((("x",), ())), (4, 3)))
  assert [l for _, l in found] == [Layout((("x",), ()))]
  value = np.arange(24.0).reshape(8, 3)
  rng = np.random.default_rng(0)
  run = prog.run(shard(Layout((("x",), ())), mesh, value, rng))
  np.testing.assert_array_equal(assemble(found[0][1], mesh, run[prog.graph.ops[-1].result.id]),
                                value[2:6])


# -- the reshard XLA writes for a batch tiled over a0 onto (a1, a2) ----------------------------

MESH = ir.Mesh((("a0", 2), ("a1", 2), ("a2", 2)))
ROWS_TILED = Layout((("a0",), (), ()))  # a batch of 2 rows, one per a0


def reshard(row_of_a1=(0, 0, 1, 1, 0, 0, 1, 1), renaming=True, mask=(0, 0, 1, 1) * 2,
            pairs=((4, 0), (5, 1), (6, 2), (7, 3))):
  """What XLA writes for the logits' gradient of ``llama3/fsdp_tp_grad/gspmd``
  (ranks are a0 a1 a2, major to minor): rank a0=1 sends its row to a0=0, the
  concat [own row; received] holds both rows at a0=0; each rank slices row
  r_a1, a permute renames a0 a1 a2 to a1 a2 a0, padding ranks (2 r_a1 + r_a2
  >= 2) are masked to zeros, each row is written at 2 r_a1 + r_a2 into zeros
  and an all-reduce over (a1, a2) adds them up."""
  prog = Program(MESH, (1, 3, 2))
  received = permute(prog, prog.param, pairs)
  both = prog.add("concatenate", [prog.param, received], (2, 3, 2),
                  attrs={"dimension": 0}).result
  zero_i = prog.const(0, "i32")
  row = prog.add("dynamic_slice", [both, per_rank(prog, row_of_a1), zero_i, zero_i], (1, 3, 2),
                 attrs={"slice_sizes": (1, 3, 2)}).result
  if renaming:  # rank (a0, a1, a2) gets what (a1, a2, a0) held
    row = permute(prog, row, [(0, 0), (1, 4), (2, 1), (3, 5), (4, 2), (5, 6), (6, 3), (7, 7)])
  padded = prog.add("select", [rank_mask(prog, mask, (1, 3, 2)), row, zeros(prog, (1, 3, 2))],
                    (1, 3, 2)).result
  at = per_rank(prog, [0, 1, 2, 3] * 2)
  placed = prog.add("dynamic_update_slice", [zeros(prog, (2, 3, 2)), padded, at, zero_i, zero_i],
                    (2, 3, 2)).result
  total = prog.add("all_reduce", [placed], (2, 3, 2),
                   attrs={"gg.axes": ("a1", "a2"), "gg.reduction": "sum"}).result
  return prog, received.producer, padded, total


def read_back(prog: Program, start: ir.Op) -> dict:
  """{value: layout} for what the transfer rules read back after ``start``."""
  prog.graph.results = [prog.graph.ops[-1].result]
  deg = DistEGraph(prog.graph)
  rules = Transfer(deg, RankArithmetic(MESH), MESH, prog.graph)
  value_of = {deg.of(op.result): op.result for op in prog.graph.ops}
  return {value_of[c]: new for c, new, how in rules.apply(start, deg.of(prog.param), ROWS_TILED,
                                                           (1, 3, 2)) if how == "rank-by-rank"}


def run(prog: Program, value):
  return prog.run(shard(ROWS_TILED, MESH, value, np.random.default_rng(1)))


def test_the_reshard_is_followed_to_a_replica():
  prog, start, padded, total = reshard()
  found = read_back(prog, start)
  assert found[total] == Layout(((), (), ()))
  # Before the all-reduce: row r_a2 at the ranks with r_a1 = 0, zeros elsewhere.
  assert found[padded] == Layout((("a2",), (), ()), at=(("a1", 0),), zero_elsewhere=True)
  value = np.random.default_rng(0).standard_normal((2, 3, 2))
  env = run(prog, value)
  for v, layout in found.items():
    np.testing.assert_allclose(assemble(layout, MESH, env[v.id]), value)


def test_seeded_reshard_bugs_read_back_nothing_whole():
  """A slice at r_a2 instead of r_a1, no renaming permute, a mask that lets
  a padding rank through, a half permute the wrong way: the all-reduce no
  longer rebuilds the batch, and the tables say so."""
  value = np.random.default_rng(0).standard_normal((2, 3, 2))
  bugs = {"slice at r_a2": dict(row_of_a1=(0, 1) * 4),
          "no renaming": dict(renaming=False),
          "padding let through": dict(mask=(0, 0, 0, 1) * 2),
          "permute a0=0 to a0=1": dict(pairs=((0, 4), (1, 5), (2, 6), (3, 7)))}
  for name, bug in bugs.items():
    prog, start, _, total = reshard(**bug)
    assert total not in read_back(prog, start), name
    outcome = run(prog, value)[total.id]
    assert any(not np.allclose(outcome[c], value) for c in ranks(MESH)), name


def test_tables_wait_for_a_small_mesh_and_a_half_permute():
  """Tables are as large as the mesh: none on meshes past MAX_RANKS, and none
  from a permute every rank receives from (the layout rules read those)."""
  prog, start, _, _ = reshard()
  deg = DistEGraph(prog.graph)
  assert RankTables(deg, MESH, {}, {}).starts_at(start)
  big = ir.Mesh((("a", 128),))
  assert not RankTables(deg, big, {}, {}).starts_at(start)
  full = Program(MESH, (1, 3, 2))
  ring = permute(full, full.param, [(i, (i + 1) % 8) for i in range(8)]).producer
  assert not RankTables(DistEGraph(full.graph), MESH, {}, {}).starts_at(ring)
