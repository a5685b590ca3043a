"""Recognize lookups in (and gradients into) a table split by rows.

A table split by rows over an axis x, rank r holding rows ``[r*n, r*n + n)``,
is looked up by every rank in its own rows, with zeros for the rows another
rank holds; a psum then adds the one rank's row (``gg.tile_gather``,
``reference.tile_gather``, the ``gather-from-table-tiles`` lemma).  Megatron's
vocab-parallel embedding writes that by hand and XLA's partitioner emits it
for a gather from a table split along the dim it indexes, each in its own
spelling::

    XLA:       c = clamp(0, i, V - 1)
               select((c < r*n) | (c > r*n + n - 1), 0, gather(table_r, c - r*n))
    Megatron:  c = clip(i, 0, V - 1);  mine = (c >= r*n) & (c < r*n + n)
               select(mine, gather(table_r, select(mine, c - r*n, 0)), 0)

Its gradient scatter-adds each row into the rank that holds it
(``gg.tile_scatter``): XLA offsets the indices so that other ranks' rows fall
beyond the tile (and are skipped), autodiff of Megatron's form adds zeros.

Rather than match one spelling, we read the select's predicate and the
gather's (scatter's) index as functions of one index value ``x`` and the rank,
lane by lane, and check them against the definition for every ``x`` of the
index's type: exhaustively on the table's rows ``[0, V)``, and by interval
arithmetic on each side of them, where ``tile_gather`` clamps ``x`` to row 0
or ``V - 1`` (so Megatron's form without the clip, which gives zeros where the
sequential gather clamps, is *not* one).  The rank offsets are evaluated by
``rank_arith`` at every coordinate of the axes they depend on.  An op that
passes is unioned with its ``gg.tile_gather`` (``gg.tile_scatter``) in the
e-graph; ``explain_tile_gather`` says where one that fails departs.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional

import numpy as np
import sympy

from graphguard_hlo import ir
from graphguard_hlo.passes import terms
from graphguard_hlo.passes.canonicalize import canonical_local_op
from graphguard_hlo.passes.dist_egraph import DistEGraph
from graphguard_hlo.passes.egraph import ENode
from graphguard_hlo.passes.rank_arith import RankArithmetic, broadcast_scalar, rank_symbol
from graphguard_hlo.reference import COMPARISONS, dimension_numbers

MAX_LANES = 1 << 22  # |x| * V index values checked one by one
MAX_LEAF_CANDIDATES = 16
MAX_TILE_AXES = 3  # orders of the axes tried: at most 3! = 6

Interval = tuple[np.ndarray, np.ndarray]  # per-lane [lo, hi], int64 (bools as 0/1)


def _int_range(dtype: str) -> Optional[tuple[int, int]]:
  if dtype in ("pred", "i1"):
    return 0, 1
  if dtype.startswith("ui") and dtype[2:].isdigit() and int(dtype[2:]) <= 32:
    return 0, 2 ** int(dtype[2:]) - 1
  if dtype.startswith("i") and dtype[1:].isdigit() and int(dtype[1:]) <= 32:
    bits = int(dtype[1:])
    return -2 ** (bits - 1), 2 ** (bits - 1) - 1
  return None  # floats, and 64-bit ints (int64 lanes could overflow silently)


def _non_unit(shape) -> tuple[int, ...]:
  return tuple(d for d in shape if d != 1)


class _Lanes:
  """Values of the per-device program as intervals per index value ``x``
  (one lane per value of the leaf), at one rank coordinate.  Only ops whose
  result at a position depends on the same position of their operands are
  read (elementwise ops, and reshapes and broadcasts that keep the leaf's
  non-unit dims in order); anything else is unknown (None)."""

  def __init__(self, deg: DistEGraph, arith: RankArithmetic, leaf: ir.Value,
               coords: dict[str, int], xs: Interval):
    self.deg, self.arith, self.leaf = deg, arith, leaf
    self.leaf_cls = deg.of(leaf)
    self.lane_shape = _non_unit(leaf.shape)
    self.at = {rank_symbol(a): c for a, c in coords.items()}
    self.xs = xs
    self.memo: dict[int, Optional[Interval]] = {}

  def of(self, v: ir.Value) -> Optional[Interval]:
    if v.id not in self.memo:
      self.memo[v.id] = None  # (SSA: no cycles)
      self.memo[v.id] = self._eval(v)
    return self.memo[v.id]

  def _scalar(self, v: ir.Value) -> Optional[Interval]:
    """A value equal at every position: a splat, or a rank-dependent scalar."""
    splat = self.deg.splat(self.deg.of(v))
    if splat is not None:
      if not float(splat).is_integer():  # (NaN and infinities too)
        return None
      c = np.array(int(splat), np.int64)
      return c, c
    scalar = broadcast_scalar(v)
    expr = self.arith.value(scalar) if math.prod(scalar.shape) == 1 else None
    if expr is None or not expr.free_symbols <= set(self.at):
      return None
    value = expr.subs(self.at)
    if not isinstance(value, sympy.Integer):
      return None
    c = np.array(int(value), np.int64)
    return c, c

  def _eval(self, v: ir.Value) -> Optional[Interval]:
    if v is self.leaf or self.deg.of(v) == self.leaf_cls:
      return self.xs
    scalar = self._scalar(v)
    if scalar is not None:
      return scalar
    op = v.producer
    bounds = _int_range(v.type.dtype)
    if op is None or bounds is None or _non_unit(v.shape) != self.lane_shape:
      return None
    args = [self.of(a) for a in op.operands]
    if any(a is None for a in args):
      return None
    out = _apply(op, args)
    if out is None:
      return None
    if op.name == "broadcast_in_dim" and list(op.attrs["broadcast_dimensions"]) != sorted(
        op.attrs["broadcast_dimensions"]):
      return None  # a transposing broadcast moves lanes
    return _wrapped(out, bounds)


def _wrapped(out: Interval, bounds: tuple[int, int]) -> Interval:
  """An interval computed in exact integers, as the type holds it: XLA's ints
  wrap (they do not trap), so one wholly beyond an end comes round by the
  type's size; one straddling an end is anything the type holds."""
  lo, hi = out
  size = bounds[1] - bounds[0] + 1
  shift = np.where(hi < bounds[0], size, np.where(lo > bounds[1], -size, 0))
  lo, hi = lo + shift, hi + shift
  straddles = (lo < bounds[0]) | (hi > bounds[1])
  return np.where(straddles, bounds[0], lo), np.where(straddles, bounds[1], hi)


_MONOTONE = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum}


def _apply(op: ir.Op, args: list[Interval]) -> Optional[Interval]:
  """``op`` on intervals: the tightest bounds we can state, or None."""
  name = op.name
  if name in ("broadcast_in_dim", "reshape", "copy") and len(args) == 1:
    return args[0]
  if name == "convert" and len(args) == 1:
    if op.results[0].type.dtype in ("pred", "i1"):
      lo, hi = args[0]
      nonzero_only = (lo > 0) | (hi < 0)
      zero_only = (lo == 0) & (hi == 0)
      return (nonzero_only.astype(np.int64), (~zero_only).astype(np.int64))
    return args[0]  # int to int: the caller checks the bounds fit the type
  if name in _MONOTONE and len(args) == 2:
    (a, b), (c, d) = args
    return _MONOTONE[name](a, c), _MONOTONE[name](b, d)
  if name == "subtract" and len(args) == 2:
    (a, b), (c, d) = args
    return a - d, b - c
  if name == "negate" and len(args) == 1:
    return -args[0][1], -args[0][0]
  if name == "multiply" and len(args) == 2:
    (a, b), (c, d) = args
    products = [a * c, a * d, b * c, b * d]
    return np.minimum.reduce(products), np.maximum.reduce(products)
  if name == "clamp" and len(args) == 3:
    (lo_a, lo_b), (x_a, x_b), (hi_a, hi_b) = args
    return np.minimum(np.maximum(x_a, lo_a), hi_a), np.minimum(np.maximum(x_b, lo_b), hi_b)
  if name == "compare" and len(args) == 2:
    if "UNSIGNED" in str(op.attrs.get("compare_type", "")) and \
        op.operands[0].type.dtype.startswith("i"):
      return None  # the bits of a signed int read unsigned: not its value's order
    (a, b), (c, d) = args
    direction = op.attrs["comparison_direction"]
    if direction in ("EQ", "NE"):  # not monotone: decided between points or apart
      apart = (b < c) | (d < a)
      same_point = (a == b) & (c == d) & (a == c)
      always, never = (same_point, apart) if direction == "EQ" else (apart, same_point)
    else:  # decided where every pair of the two intervals' ends compares alike
      corners = [COMPARISONS[direction](x, y) for x in (a, b) for y in (c, d)]
      always = np.logical_and.reduce(corners)
      never = ~np.logical_or.reduce(corners)
    return always.astype(np.int64), (~never).astype(np.int64)
  if op.results[0].type.dtype in ("pred", "i1"):
    if name == "and" and len(args) == 2:
      return np.minimum(args[0][0], args[1][0]), np.minimum(args[0][1], args[1][1])
    if name == "or" and len(args) == 2:
      return np.maximum(args[0][0], args[1][0]), np.maximum(args[0][1], args[1][1])
    if name == "not" and len(args) == 1:
      return 1 - args[0][1], 1 - args[0][0]
  if name == "select" and len(args) == 3:
    (p_lo, p_hi), (a, b), (c, d) = args
    lo = np.where(p_lo == 1, a, np.where(p_hi == 0, c, np.minimum(a, c)))
    hi = np.where(p_lo == 1, b, np.where(p_hi == 0, d, np.maximum(b, d)))
    return lo, hi
  return None


def _row_gather(g: ir.Op) -> Optional[int]:
  """The table dim k if ``g`` gathers one row (slice size 1 along k) per
  one-number index."""
  if g.name != "gather" or len(g.operands) != 2:
    return None
  dn = dimension_numbers(g.attrs["dimension_numbers"])
  index_shape = g.operands[1].shape
  ivd = dn["index_vector_dim"]
  start_map = dn.get("start_index_map", ())
  if len(start_map) != 1 or (ivd < len(index_shape) and index_shape[ivd] != 1):
    return None  # (batching dims are rows like the others: each reads its own batch)
  k = start_map[0]
  return k if g.attrs["slice_sizes"][k] == 1 else None


def _lane_mask(select: ir.Op, window_dims) -> Optional[ir.Value]:
  """The select's predicate with the lanes of the index rows, for a select
  on a gather's result or a scatter's updates (``window_dims``: the slices'
  dims, the rest are the rows'): the predicate itself if its non-unit dims
  are the rows', else what a broadcast along the slices' dims stretched."""
  shape = select.results[0].shape
  batch = [d for d in range(len(shape)) if d not in window_dims]
  rows = tuple(shape[d] for d in batch if shape[d] != 1)
  p = select.operands[0]
  if all(shape[d] == 1 for d in window_dims):
    return p
  b = p.producer
  if b is None or b.name != "broadcast_in_dim":
    return None
  m = b.operands[0]
  dims = list(b.attrs["broadcast_dimensions"])
  kept = [dims[i] for i, n in enumerate(m.shape) if n != 1]
  if kept != sorted(kept) or any(d not in batch for d in kept) or \
      tuple(shape[d] for d in kept) != rows:
    return None
  return m


def _uniform(v: ir.Value) -> bool:
  """A constant, or a broadcast of one element: the same in every lane."""
  op = v.producer
  return math.prod(v.shape) == 1 or (op is not None and (
      op.name == "constant" or op.name == "broadcast_in_dim" and
      math.prod(op.operands[0].shape) == 1))


def _leaf_candidates(index: ir.Value) -> list[ir.Value]:
  """Values the gather's index is computed from, nearest first."""
  out, seen, work = [], {index.id}, [index]
  while work and len(out) < MAX_LEAF_CANDIDATES:
    v = work.pop(0)
    if v is not index and not _uniform(v):
      out.append(v)
    if v.producer is not None:
      for a in v.producer.operands:
        if a.id not in seen:
          seen.add(a.id)
          work.append(a)
  return out


def _rank_axes(values: list[ir.Value], arith: RankArithmetic, leaf: ir.Value
               ) -> set[sympy.Symbol]:
  """The rank symbols the scalars feeding ``values`` (from the leaf on) depend on."""
  out: set[sympy.Symbol] = set()
  seen: set[int] = {leaf.id}
  work = list(values)
  while work:
    v = work.pop()
    if v.id in seen:
      continue
    seen.add(v.id)
    if math.prod(v.shape) == 1:
      expr = arith.value(v)
      if expr is not None:
        out |= expr.free_symbols
        continue
    if v.producer is not None:
      work.extend(v.producer.operands)
  return out


def _leaf_range(deg: DistEGraph, leaf: ir.Value) -> Optional[tuple[int, int]]:
  """The values the leaf can take: its type's, narrowed by a clamp between
  constants (XLA clamps indices before it offsets them)."""
  bounds = _int_range(leaf.type.dtype)
  op = leaf.producer
  if bounds is not None and op is not None and op.name == "clamp":
    lo, hi = (deg.splat(deg.of(v)) for v in (op.operands[0], op.operands[2]))
    if lo is not None and hi is not None and float(lo).is_integer() and \
        float(hi).is_integer() and lo <= hi:
      bounds = max(bounds[0], int(lo)), min(bounds[1], int(hi))
  return bounds


def _lane_domain(deg: DistEGraph, leaf: ir.Value, total: int) -> Optional[Interval]:
  """One lane per row of a table of ``total`` rows, and one per run of the
  leaf's values beyond each end (which must each act alike throughout).  The
  ``total`` values at each end of the type get a lane each: a rank offset
  (at most a table) added to them may wrap round, point by point."""
  bounds = _leaf_range(deg, leaf)
  if bounds is None:
    return None
  lo, hi = [np.arange(total, dtype=np.int64)], [np.arange(total, dtype=np.int64)]

  def span(a: int, b: int, edge_first: bool) -> None:
    """Values a..b: points within ``total`` of the type's end, one run for the rest."""
    if b - a + 1 <= 2 * total:
      points = np.arange(a, b + 1, dtype=np.int64)
      lo.append(points), hi.append(points)
      return
    edge = np.arange(a, a + total) if edge_first else np.arange(b - total + 1, b + 1)
    run = (a + total, b) if edge_first else (a, b - total)
    lo.extend([edge.astype(np.int64), np.array([run[0]])])
    hi.extend([edge.astype(np.int64), np.array([run[1]])])

  if bounds[0] < 0:
    span(bounds[0], min(-1, bounds[1]), edge_first=True)
  if bounds[1] >= total:
    span(max(total, bounds[0]), bounds[1], edge_first=False)
  return np.concatenate(lo), np.concatenate(hi)


def _tile_coordinates(tiles):
  """(tile index, {axis: coordinate}) for every rank coordinate of ``tiles``."""
  for coords in itertools.product(*(range(size) for _, size in tiles)):
    t = 0
    for (_, size), c in zip(tiles, coords):
      t = t * size + c  # mixed radix, major to minor
    yield t, {a: c for (a, _), c in zip(tiles, coords)}


_CLIP_HINT = " (the sequential gather clamps ids into the table: clip them first?)"


def _lane_words(xs: Interval, k: int) -> str:
  lo, hi = int(xs[0][k]), int(xs[1][k])
  return f"index {lo}" if lo == hi else f"indices {lo}..{hi}"


def _gather_departure(deg, arith, leaf, index, mask, zero_when_true, tiles, n
                      ) -> Optional[str]:
  """Where select(mask, 0, gather(t, index)) (or with the branches swapped)
  departs from tile_gather(t, leaf) at some rank coordinate of the ``tiles``
  axes ((axis, size) pairs, major to minor) for some leaf value, in words;
  None if it never does."""
  total = math.prod(size for _, size in tiles) * n
  xs = _lane_domain(deg, leaf, total)
  if xs is None:
    return f"the index {leaf} is not an integer of at most 32 bits"
  clamped = np.clip(xs[0], 0, total - 1)  # lanes beyond the table: all clamp alike
  for t, coords in _tile_coordinates(tiles):
    rank = ", ".join(f"{a}={c}" for a, c in coords.items())
    lanes = _Lanes(deg, arith, leaf, coords, xs)
    m, j = lanes.of(mask), lanes.of(index)
    if m is None or j is None:
      return "its mask or index is not a function of the index alone"
    m_lo, m_hi = (np.broadcast_to(a, xs[0].shape) for a in m)
    mine = (clamped >= t * n) & (clamped < t * n + n)
    zeroed = m_lo.astype(bool) == zero_when_true
    for k in np.flatnonzero((m_lo != m_hi) | (zeroed == mine)):
      beyond = xs[0][k] < 0 or xs[0][k] >= total  # ids the gather clamps into the table
      plural = xs[0][k] != xs[1][k]
      is_ = ("clamp to" if plural else "clamps to") if beyond else "is"
      are = "are" if plural else "is"
      if m_lo[k] != m_hi[k]:
        what = f"{are} masked for some values and not for others"
      elif mine[k]:
        what = f"{is_} row {clamped[k] - t * n} of the rows it holds but {are} masked to zero"
      else:
        what = f"{is_} another rank's row but {are} not masked to zero"
      hint = _CLIP_HINT if beyond else ""
      return f"at rank {rank}, {_lane_words(xs, k)} {what}{hint}"
    j_lo, j_hi = (np.broadcast_to(np.clip(a, 0, n - 1), xs[0].shape) for a in j)
    want = clamped - t * n
    for k in np.flatnonzero(mine & ((j_lo != want) | (j_hi != want))):
      got = f"row {j_lo[k]}" if j_lo[k] == j_hi[k] else f"rows {j_lo[k]}..{j_hi[k]}"
      return (f"at rank {rank}, {_lane_words(xs, k)} looks up local {got}, not its row "
              f"{want[k]} (the table's row minus the rank's offset {t * n})")
  return None


def _check(deg, arith, leaf, index, mask, zero_when_true, tiles, n) -> bool:
  return _gather_departure(deg, arith, leaf, index, mask, zero_when_true, tiles, n) is None


def _check_scatter(deg, arith, leaf, index, mask, zero_when_true, tiles, n) -> bool:
  """Does scatter_add(b, index, u') equal tile_scatter(b, leaf, u) at every
  rank coordinate of ``tiles``, for every leaf value, where u' is u, or
  select(mask, 0, u) (``zero_when_true``; else select(mask, u, 0))?  A row
  whose leaf is in the rank's tile must land at its local row with its
  update; any other must be skipped (its index beyond the base) or add zeros."""
  xs = _lane_domain(deg, leaf, math.prod(size for _, size in tiles) * n)
  if xs is None:
    return False
  for t, coords in _tile_coordinates(tiles):
    lanes = _Lanes(deg, arith, leaf, coords, xs)
    j = lanes.of(index)
    if j is None:
      return False
    j_lo, j_hi = (np.broadcast_to(a, xs[0].shape) for a in j)
    mine = (xs[0] >= t * n) & (xs[1] < t * n + n)  # (the runs beyond are never mine)
    skipped = (j_hi < 0) | (j_lo > n - 1)
    zeroed = np.zeros(xs[0].shape, bool)
    kept = np.ones(xs[0].shape, bool)
    if mask is not None:
      m = lanes.of(mask)
      if m is None:
        return False
      m_lo, m_hi = (np.broadcast_to(a, xs[0].shape) for a in m)
      decided = m_lo == m_hi
      zeroed = decided & (m_lo.astype(bool) == zero_when_true)
      kept = decided & ~zeroed
    want = xs[0] - t * n
    if np.any(mine & ~(kept & (j_lo == want) & (j_hi == want))):
      return False
    if np.any(~mine & ~(skipped | zeroed)):
      return False
  return True


def _zero_masked(deg: DistEGraph, v: ir.Value, window_dims
                 ) -> tuple[ir.Value, Optional[ir.Value], bool]:
  """(u, the mask's lanes, zero when true) if v = select(mask, 0, u) or
  select(mask, u, 0); else (v, None, False)."""
  op = v.producer
  if op is not None and op.name == "select" and len(op.operands) == 3:
    for zero, kept in ((1, 2), (2, 1)):
      if deg.splat(deg.of(op.operands[zero])) == 0.0:
        mask = _lane_mask(op, window_dims)
        if mask is not None:
          return op.operands[kept], mask, zero == 1
  return v, None, False


def _row_scatter(op: ir.Op) -> Optional[int]:
  """The base dim k if ``op`` scatter-adds one row (window size 1 along k) per
  one-number index."""
  from graphguard_hlo.passes.collectives import reducer_kind
  if op.name != "scatter" or len(op.operands) != 3 or not op.regions or \
      reducer_kind(op.regions[0]) != "sum":
    return None
  dn = dimension_numbers(op.attrs["scatter_dimension_numbers"])
  to_operand = dn.get("scatter_dims_to_operand_dims", ())
  index_shape, ivd = op.operands[1].shape, dn["index_vector_dim"]
  if len(to_operand) != 1 or (ivd < len(index_shape) and index_shape[ivd] != 1):
    return None
  k = to_operand[0]
  inserted, batching = dn.get("inserted_window_dims", ()), dn.get("input_batching_dims", ())
  covered = [d for d in range(op.operands[0].type.rank) if d not in inserted and
             d not in batching]
  window_dims = dn.get("update_window_dims", ())
  if k in covered and op.operands[2].shape[window_dims[covered.index(k)]] != 1:
    return None
  return k


class _Placer:
  """Writes the leaf in the shape the gather (scatter) reads into the
  per-device program, when it only differs by unit dims: the e-node needs that
  class, and the relation checker a value of it to hold relations against."""

  def __init__(self, module: ir.Module, graph: ir.Graph, deg: DistEGraph):
    self.module, self.graph, self.deg = module, graph, deg
    self.before: Optional[ir.Op] = None  # the op being recognized: place ahead of it

  def index_class(self, leaf: ir.Value, index: ir.Value) -> int:
    canon = canonical_local_op("reshape", {}, [leaf.type], index.type)
    if canon is None:
      return self.deg.of(leaf)
    name, attrs = canon
    found = self.deg.lookup(terms.op_head(name, attrs, index.type), (self.deg.of(leaf),))
    if found is not None:
      return found
    op = ir.Op(name, [leaf], attrs, [], self.before.location)
    op.results = [self.module.new_value(index.type, op, 0)]
    self.graph.ops.insert(self.graph.ops.index(self.before), op)
    self.deg.add_op(op)
    return self.deg.of(op.results[0])


def _masked_gathers(op: ir.Op, deg: DistEGraph
                    ) -> Iterator[tuple[ir.Op, int, ir.Value, bool]]:
  """(gather, its table's row dim, the mask's lanes, zero when true) if ``op``
  is select(mask, 0, gather) or select(mask, gather, 0) of a one-row gather."""
  if op.name != "select" or len(op.operands) != 3:
    return
  for zero, looked_up in ((1, 2), (2, 1)):
    g = op.operands[looked_up].producer
    k = None if g is None else _row_gather(g)
    if k is None or deg.splat(deg.of(op.operands[zero])) != 0.0:
      continue
    mask = _lane_mask(op, dimension_numbers(g.attrs["dimension_numbers"]).get(
        "offset_dims", ()))
    if mask is not None:
      yield g, k, mask, zero == 1


def _as_tile_gather(op: ir.Op, deg: DistEGraph, arith: RankArithmetic, mesh: ir.Mesh,
                    place: _Placer) -> Iterator[ENode]:
  """``gg.tile_gather(table, i)`` if ``op`` is select(mask, 0, gather(table, j))
  (or select(mask, gather, 0)) computing it, for every leaf ``i`` it holds for
  (the ids, and XLA's clamp of them, say: both are true)."""
  for g, k, mask, zero_when_true in _masked_gathers(op, deg):
    table, index = g.operands
    n = table.shape[k]
    for leaf in _leaf_candidates(index):
      tiles = _tiles(arith, mesh, [index, mask], leaf, n, lambda t: _check(
          deg, arith, leaf, index, mask, zero_when_true, t, n))
      if tiles is not None:
        head = terms.op_head("gg.tile_gather", dict(g.attrs, **{"gg.tiles": tiles}),
                             op.results[0].type)
        yield ENode(head, (deg.of(table), place.index_class(leaf, index)))


def _as_tile_scatter(op: ir.Op, deg: DistEGraph, arith: RankArithmetic, mesh: ir.Mesh,
                     place: _Placer) -> Iterator[ENode]:
  """``gg.tile_scatter(base, i, u)`` if ``op`` is scatter_add(base, j, u) or
  scatter_add(base, j, select(mask, 0, u)) computing it, for every leaf ``i``
  it holds for."""
  k = _row_scatter(op)
  if k is None:
    return
  base, index, updates = op.operands
  n = base.shape[k]
  window_dims = dimension_numbers(op.attrs["scatter_dimension_numbers"]).get(
      "update_window_dims", ())
  u, mask, zero_when_true = _zero_masked(deg, updates, window_dims)
  for leaf in _leaf_candidates(index):
    tiles = _tiles(arith, mesh, [index] + ([mask] if mask is not None else []), leaf, n,
                   lambda t: _check_scatter(deg, arith, leaf, index, mask, zero_when_true, t, n))
    if tiles is not None:
      head = terms.op_head("gg.tile_scatter", dict(op.attrs, **{"gg.tiles": tiles}),
                           op.results[0].type, tuple(op.regions))
      yield ENode(head, (deg.of(base), place.index_class(leaf, index), deg.of(u)))


def explain_tile_gather(op: ir.Op, deg: DistEGraph, arith: RankArithmetic, mesh: ir.Mesh
                        ) -> Optional[str]:
  """If ``op`` is a masked lookup of a table tile, select(mask, 0, gather) that
  is not ``gg.tile_gather``: where it departs from one, in words."""
  for g, k, mask, zero_when_true in _masked_gathers(op, deg):
    table, index = g.operands
    found = []  # the departure from each leaf the lanes are a function of
    for leaf in _leaf_candidates(index):
      symbols = _rank_axes([index, mask], arith, leaf)
      axes = tuple((a, size) for a, size in mesh.axes if rank_symbol(a) in symbols)
      if axes and len(axes) == len(symbols) and _lane_domain(deg, leaf, 1) is not None and \
          math.prod(size for _, size in axes) ** 2 * table.shape[k] <= MAX_LANES:
        words = _gather_departure(deg, arith, leaf, index, mask, zero_when_true, axes,
                                  table.shape[k])
        if words is None:
          return None  # it is one (in another order of the axes, say)
        found.append(words)
    # Prefer what the ids in the table meet (and then a leaf the lanes are a
    # function of) over what only ids beyond it do.
    found.sort(key=lambda w: (not w.startswith("at rank"), w.endswith(_CLIP_HINT)))
    return found[0] if found else None
  return None


def recognize_tile_lookups(module: ir.Module, graph: ir.Graph, deg: DistEGraph,
                           arith: RankArithmetic, mesh: ir.Mesh) -> int:
  """Union every lookup in (and scatter-add into) a table split by rows of the
  per-device program with its ``gg.tile_gather`` (``gg.tile_scatter``);
  returns how many."""
  found = 0
  place = _Placer(module, graph, deg)
  for op in list(graph.ops):
    place.before = op
    nodes = [*_as_tile_gather(op, deg, arith, mesh, place),
             *_as_tile_scatter(op, deg, arith, mesh, place)]
    for node in nodes:
      deg.eg.union(deg.of(op.results[0]), deg.eg.add(node))
    found += bool(nodes)
  if found:
    deg.eg.rebuild()
  return found


def _tiles(arith, mesh, values, leaf, n, check) -> Optional[tuple[tuple[str, int], ...]]:
  """The axes (with sizes, major to minor) tiling a table of n-row tiles for
  which ``check`` holds: those the rank offsets in ``values`` depend on, in
  some order."""
  if _non_unit(leaf.shape) != _non_unit(values[0].shape):
    return None
  symbols = _rank_axes(values, arith, leaf)
  axes = [(a, size) for a, size in mesh.axes if rank_symbol(a) in symbols]
  if not axes or len(axes) != len(symbols) or len(axes) > MAX_TILE_AXES or \
      math.prod(size for _, size in axes) ** 2 * n > MAX_LANES:
    return None
  return next((t for t in itertools.permutations(axes) if check(t)), None)
