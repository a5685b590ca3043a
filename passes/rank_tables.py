"""Rank tables: what each rank holds, rank by rank, where a value is
resharded or gathered through collectives no layout speaks of.

To move a value tiled over one mesh axis onto a tiling over others, XLA's
partitioner sometimes writes a small program of its own: a collective-permute
only some ranks send on (the rest receive zeros), a concat of the received
block under the local one, a slice at a row read off the partition id, a
permute that renames mesh axes, a mask that zeroes the padding ranks, an update
into zeros and an all-reduce.  Each step holds a clean relation on some ranks
only, and which block a rank holds depends on two or three mesh coordinates at
once; a ``Layout`` (one relation for every rank) cannot carry the steps in
between, though the end is plain again (every rank holds the whole value).

A rank table follows the value rank by rank instead.  For a sequential tensor
``S`` and a per-device value ``d`` it holds, for each partition ``r``, either
``None`` (nothing is known of ``d@r``) or pieces with disjoint boxes:

  ``Piece(box, shift)``    ``d@r[p] == S[p + shift]`` for every index ``p`` in
                           ``box`` (a half-open box of ``d``'s indices),

and ``d@r[p] == 0`` at every index no piece covers (no pieces: all zeros).

Every step below is the op's exact semantics on these facts (XLA's clamping
of slice starts, the zeros a permute hands ranks nobody sends to), so a table
is a proof, rank by rank, of what each rank holds.  Where every rank (or every
rank with some coordinates pinned, the others zero or unknown) holds a whole
tile at the offsets a mesh tiling gives, the table is read back as a
``Layout`` and the ordinary rules take over.

The same steps serve a gather written by hand: a binomial tree of ppermutes
(half the ranks send, then a quarter) leaves rank 0 with the whole value and
the others with parts, a pinned layout.  A diagnosis reads a table too: it
says which part of S each rank ends up holding (``describe``).

Tables are as large as the mesh, so they are only built from a permute some
rank receives nothing from, or a pad with zeros, on meshes of at most
``MAX_RANKS`` partitions (in iota device order), and only for ``MAX_STEPS``
ops after it (an operand not reached is computed at most ``MAX_PULL`` ops
back): a local detour, not a second engine.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Iterator, Optional

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.reference import COMPARISONS
from graphguard_hlo.passes.dist_egraph import DistEGraph
from graphguard_hlo.passes.layout import Layout, tile_index
from graphguard_hlo.passes.rank_arith import apply_table_op, held_exactly, partition_id_table

MAX_RANKS = 64
MAX_STEPS = 8
MAX_PULL = 3  # ops back from a followed value, for an operand not followed

Box = tuple[tuple[int, int], ...]  # half-open [lo, hi) per dim
# Elementwise ops a per-partition predicate is read through (rank_arith's
# evaluator), by arity.
_ELEMENTWISE = {"add": 2, "subtract": 2, "multiply": 2, "divide": 2, "remainder": 2,
                "maximum": 2, "minimum": 2, "and": 2, "or": 2, "negate": 1, "abs": 1}
MAX_PIECES = 16  # per rank: more, and the rank's entry is given up (None)


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
  """``d@r[p] == S[p + shift]`` for every index ``p`` in ``box``."""
  box: Box
  shift: tuple[int, ...]


# What one rank holds: pieces with disjoint boxes, zeros off them (``()``: all
# zeros); None: unknown.  A table has one entry per partition id.
Held = tuple[Piece, ...]
Table = list[Optional[Held]]


def _intersect(a: Box, b: Box) -> Optional[Box]:
  out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
  return None if any(lo >= hi for lo, hi in out) else out


def _joined(a: Box, b: Box) -> Optional[Box]:
  """``a`` and ``b`` as one box, if they are equal on all dims but one and meet there."""
  differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
  if len(differ) != 1:
    return None
  (k,) = differ
  (a0, a1), (b0, b1) = a[k], b[k]
  if a1 == b0 or b1 == a0:
    return tuple((min(a0, b0), max(a1, b1)) if i == k else x for i, x in enumerate(a))
  return None


def _combined(helds) -> Optional[Held]:
  """The elementwise sum of what ``helds`` hold, if their pieces do not
  overlap (a sum of two values of S at one place is not S); pieces of one
  shift that meet are merged."""
  if any(h is None for h in helds):
    return None
  pieces = [p for h in helds for p in h]
  if any(_intersect(a.box, b.box) is not None for a, b in itertools.combinations(pieces, 2)):
    return None
  merged = True
  while merged:
    merged = False
    for i, j in itertools.combinations(range(len(pieces)), 2):
      a, b = pieces[i], pieces[j]
      box = _joined(a.box, b.box) if a.shift == b.shift else None
      if box is not None:
        pieces = [p for n, p in enumerate(pieces) if n not in (i, j)] + [Piece(box, a.shift)]
        merged = True
        break
  return tuple(sorted(pieces)) if len(pieces) <= MAX_PIECES else None


def _placed(held: Optional[Held], at) -> Optional[Held]:
  """``held`` written at offset ``at`` of a larger value."""
  if held is None:
    return None
  return tuple(Piece(tuple((lo + a, hi + a) for (lo, hi), a in zip(p.box, at)),
                     tuple(s - a for s, a in zip(p.shift, at))) for p in held)


def _cut(held: Optional[Held], window: Box) -> Optional[Held]:
  """What of ``held`` lies in ``window``, read from the window's corner."""
  if held is None:
    return None
  out = []
  for p in held:
    box = _intersect(p.box, window)
    if box is not None:
      out.append(Piece(box, p.shift))
  return _placed(tuple(out), tuple(-lo for lo, _ in window))


def _kept(held: Optional[Held], window: Box) -> Optional[Held]:
  """What of ``held`` lies in ``window``, in place (zeros off it)."""
  if held is None:
    return None
  return tuple(Piece(box, p.shift) for p in held
               for box in [_intersect(p.box, window)] if box is not None)


def _without(held: Optional[Held], window: Box) -> Optional[Held]:
  """``held`` with ``window`` overwritten: pieces wholly in it go, pieces
  wholly out of it stay; one cut by its edge is given up (None)."""
  if held is None:
    return None
  kept = []
  for p in held:
    box = _intersect(p.box, window)
    if box is None:
      kept.append(p)
    elif box != p.box:
      return None
  return tuple(kept)


def _held_words(held: Optional[Held], shape: tuple[int, ...], s_name: str) -> str:
  if held is None:
    return "not known"
  if not held:
    return "zeros"

  def ranges(box, shift):
    return ", ".join(f"{lo + s}:{hi + s}" for (lo, hi), s in zip(box, shift))
  words = [f"{s_name}[{ranges(p.box, p.shift)}] at [{ranges(p.box, (0,) * len(shape))}]"
           for p in held]
  covered = sum(math.prod(hi - lo for lo, hi in p.box) for p in held)
  return ", ".join(words) + (", zeros elsewhere" if covered < math.prod(shape) else "")


def _rebased(held: Optional[Held], window: Box) -> Optional[Held]:
  """What a rank holds of S, as pieces of ``S' = S[window]``: None (unknown)
  if some piece holds elements of S outside the window, which are no zeros
  of S' (a table's uncovered indices are zeros)."""
  if held is None:
    return None
  out = []
  for p in held:
    if any(lo + s < w0 or hi + s > w1 for (lo, hi), s, (w0, w1) in zip(p.box, p.shift, window)):
      return None
    out.append(Piece(p.box, tuple(s - w0 for s, (w0, _) in zip(p.shift, window))))
  return tuple(out)


def _clamped(start: int, size: int, full: int) -> int:
  """XLA clamps a dynamic slice's start so the slice stays in bounds."""
  return min(max(start, 0), full - size)


class RankTables:
  """Tables over one per-device program: built from a layout at a permute or
  pad (``walk``, for the transfer rules), or for one value (``table_of``, for
  a diagnosis)."""

  def __init__(self, deg: DistEGraph, mesh: ir.Mesh, users: dict[int, list[ir.Op]],
               id_tables: dict):
    self.deg = deg
    self.mesh = mesh
    self.users = users
    self._id_tables = id_tables  # partition_id_table's memo, shared with Transfer
    n = mesh.size
    iota = mesh.device_ids is None or tuple(mesh.device_ids) == tuple(range(n))
    self.usable = iota and 1 < n <= MAX_RANKS
    self._coords = np.stack(np.unravel_index(np.arange(n), tuple(s for _, s in mesh.axes)),
                            axis=1) if self.usable else None

  # -- where to start ------------------------------------------------------------
  def starts_before(self, op: ir.Op) -> bool:
    """A slice some reader of which starts a table: a halo exchange sends
    each tile's edge rows to a neighbour, the ranks at the end receiving
    none."""
    return op.name == "slice" and self.usable and any(
        self.starts_at(user) for user in self.users.get(self.deg.of(op.results[0]), ()))

  def starts_at(self, op: ir.Op) -> bool:
    """A collective-permute some partition receives nothing from, or a pad
    with zeros (the padding ranks of an uneven reshard slice into it)."""
    if not self.usable:
      return False
    if op.name == "pad":
      return self.deg.splat(self.deg.of(op.operands[1])) == 0.0
    if op.name == "collective_permute":
      pairs = op.attrs.get("source_target_pairs") or ()
      return len({dst for _, dst in pairs}) < self.mesh.size
    return False

  def walk(self, op: ir.Op, cls: int, layout: Layout, tile: tuple[int, ...]
           ) -> Iterator[tuple[int, Layout]]:
    """From ``S ~ layout of cls`` (``cls`` read by ``op``), follow ``op`` and
    the ops after it rank by rank; yield (class, layout) wherever a table
    reads back as a layout."""
    whole = layout.whole_shape(tile, self.mesh)
    for out, table, shape in self.follow(op, cls, layout, tile):
      found = self._as_layout(table, shape, whole) or self._as_halo_layout(table, shape, whole)
      if found is not None:
        yield out, found

  def follow(self, op: ir.Op, cls: int, layout: Layout, tile: tuple[int, ...]
             ) -> Iterator[tuple[int, Table, tuple[int, ...]]]:
    """(class, table, shape) of ``op``'s result and of the ops after it
    (breadth first, ``MAX_STEPS`` deep) whose tables follow from ``cls``'s."""
    return self._follow([op], cls, layout, tile)

  def sliced(self, start: tuple[int, ...], limit: tuple[int, ...], cls: int, layout: Layout,
             tile: tuple[int, ...]) -> Iterator[tuple[int, Layout]]:
    """For ``S' = S[start:limit]`` where ``S ~ layout of cls``: (class, layout
    of S') wherever the ops after ``cls`` hold tiles of S'.  XLA reshards a
    slice across tiles (a fused q|k|v projection split as one) by cutting
    each tile, passing the parts between ranks and picking each rank's by
    its partition id: followed from every reader of ``cls``."""
    if not self.usable:
      return
    window = tuple(zip(start, limit))
    whole = tuple(hi - lo for lo, hi in window)
    for out, table, shape in self._follow(self.users.get(cls, ()), cls, layout, tile):
      found = self._as_layout([_rebased(h, window) for h in table], shape, whole)
      if found is not None:
        yield out, found

  def _follow(self, ops, cls: int, layout: Layout, tile: tuple[int, ...]
              ) -> Iterator[tuple[int, Table, tuple[int, ...]]]:
    leaf = self._leaf(layout, tile) if self.usable else None
    if leaf is None:
      return
    tables: dict = {cls: leaf}
    frontier = list(ops)
    for _ in range(MAX_STEPS):
      reached = []
      for step in frontier:
        if len(step.results) != 1 or tables.get(self.deg.of(step.results[0])) is not None:
          continue
        table = self._step(step, tables, len(tile))
        if table is None:
          continue
        out = self.deg.of(step.results[0])
        tables[out] = table
        yield out, table, step.results[0].shape
        reached.extend(self.users.get(out, ()))
      frontier = list({id(o): o for o in reached}.values())

  # -- tables from a layout, and back ------------------------------------------------
  def _leaf(self, l: Layout, tile: tuple[int, ...]) -> Optional[Table]:
    if not l.is_plain() or l.partial or not l.is_clean():
      return None
    whole_tile = tuple((0, t) for t in tile)
    table: Table = []
    for r in range(self.mesh.size):
      coord = self._coord(r)
      if not l.holds_at(coord):
        table.append(() if l.zero_elsewhere else None)
        continue
      shift = tuple(tile_index(axes, coord, self.mesh) * t for t, axes in zip(tile, l.dims))
      table.append((Piece(whole_tile, shift),))
    return table

  def _coord(self, r: int) -> dict[str, int]:
    """Partition ``r``'s mesh coordinates, by axis name."""
    return {a: int(c) for (a, _), c in zip(self.mesh.axes, self._coords[r])}

  def _as_layout(self, table: Table, shape: tuple[int, ...], whole: tuple[int, ...]
                 ) -> Optional[Layout]:
    """The layout saying what ``table`` says, if one does: every rank holds
    a whole tile of S, or the ranks at some pinned coordinates do (zeros
    elsewhere if every other rank holds zeros)."""
    full = tuple((0, n) for n in shape)
    holding = [r for r, h in enumerate(table) if h is not None and len(h) == 1 and
               h[0].box == full]
    if not holding:
      return None
    others = [h for r, h in enumerate(table) if r not in set(holding)]
    names = [a for a, _ in self.mesh.axes]
    held = self._coords[holding]
    pins = {names[i]: int(held[0, i]) for i in range(len(names))
            if self.mesh.axis_size(names[i]) > 1 and len(set(held[:, i].tolist())) == 1}
    if len(holding) * math.prod(self.mesh.axis_size(a) for a in pins) != self.mesh.size:
      return None  # not every rank at the pinned coordinates
    free = [a for a in names if a not in pins and self.mesh.axis_size(a) > 1]
    coords = [self._coord(r) for r in holding]
    dims: list[tuple[str, ...]] = []
    for k, (t, n) in enumerate(zip(shape, whole)):
      axes = self._tiling([table[r][0].shift[k] for r in holding], coords, t, n, free)
      if axes is None:
        return None
      free = [a for a in free if a not in axes]
      dims.append(axes)
    # Off the pins a rank may hold part of a tile (a gather to one rank, half
    # way): the layout then says nothing there.
    zero_elsewhere = bool(pins) and all(h == () for h in others)
    return Layout(tuple(dims), at=tuple(sorted(pins.items())), zero_elsewhere=zero_elsewhere)

  def _as_halo_layout(self, table: Table, shape: tuple[int, ...], whole: tuple[int, ...]
                      ) -> Optional[Layout]:
    """The haloed layout saying what ``table`` says, if one does: every rank
    holds its tile of S extended along some dims by ``lo`` elements before and
    ``hi`` after, cut where S ends (zeros beyond: a halo exchange's, the
    ranks at the ends receiving nothing)."""
    if any(h is None or len(h) != 1 for h in table):
      return None
    coords = [self._coord(r) for r in range(self.mesh.size)]
    free = [a for a, n in self.mesh.axes if n > 1]
    dims, halo = [], []
    for k, (m, n) in enumerate(zip(shape, whole)):
      shifts = [h[0].shift[k] for h in table]
      boxes = [h[0].box[k] for h in table]
      # Every rank holds a tile: as many tiles as shifts, each n / tiles long.
      lo, tiles = max(0, -min(shifts)), len(set(shifts))
      t = n // tiles
      hi = m - t - lo
      if n % tiles or hi < 0 or max(lo, hi) > t:
        return None
      axes = self._tiling([s + lo for s in shifts], coords, t, n, free)
      if axes is None or ((lo or hi) and not axes) or any(
          box != (max(0, -s), min(m, n - s)) for s, box in zip(shifts, boxes)):
        return None
      free = [a for a in free if a not in axes]
      dims.append(axes)
      if lo or hi:
        halo.append((k, lo, hi))
    return Layout(tuple(dims), halo=tuple(halo)) if halo else None

  def _tiling(self, shifts: list[int], coords: list[dict], tile: int, whole: int,
              free: list[str]) -> Optional[tuple[str, ...]]:
    """The mesh axes (major to minor) whose tile index times ``tile`` is the
    shift at every holding rank (``coords``), covering ``whole``."""
    if whole % tile:
      return None
    for n_axes in range(len(free) + 1):
      for axes in itertools.permutations(free, n_axes):
        if math.prod(self.mesh.axis_size(a) for a in axes) * tile == whole and all(
            tile_index(axes, c, self.mesh) * tile == shift for c, shift in zip(coords, shifts)):
          return tuple(axes)
    return None

  # -- words -------------------------------------------------------------------------
  def describe(self, table: Table, shape: tuple[int, ...], s_name: str, limit: int = 4) -> str:
    """'at dp = 0: %1[0:8, :] at [0:8, :], %1[12:16, :] at [8:12, :], zeros
    elsewhere; at dp = 1, 2, 3: zeros': ranks grouped by what they hold."""
    groups: dict = {}
    for r, held in enumerate(table):
      groups.setdefault(held, []).append(r)
    names = [a for a, n in self.mesh.axes if n > 1]
    shown = []
    for held, ranks in list(groups.items())[:limit]:
      if len(groups) == 1:
        where = "on every rank"
      else:
        coords = [tuple(self._coord(r)[a] for a in names) for r in ranks]
        text = [str(c[0]) if len(c) == 1 else str(c) for c in coords[:limit]]
        more = ", ..." if len(coords) > limit else ""
        where = f"at {', '.join(names) if len(names) == 1 else '(' + ', '.join(names) + ')'}" \
                f" = {', '.join(text)}{more}"
      shown.append(f"{where}: {_held_words(held, shape, s_name)}")
    if len(groups) > limit:
      shown.append(f"and {len(groups) - limit} more kinds of rank")
    return "; ".join(shown)

  # -- one op, rank by rank ---------------------------------------------------------
  def table_of(self, v: ir.Value, cls: int, layout: Layout, tile: tuple[int, ...],
               ops_back: int) -> Optional[Table]:
    """``v``'s table from ``S ~ layout of cls``, ``v`` computed from ``cls``
    by at most ``ops_back`` ops (for a diagnosis: what each rank holds)."""
    leaf = self._leaf(layout, tile) if self.usable else None
    return None if leaf is None else self._operand(v, {cls: leaf}, len(tile), ops_back)

  def _operand(self, v: ir.Value, tables: dict, rank: int, budget: int) -> Optional[Table]:
    """``v``'s table: followed already, zeros, or computed from its own
    operands' (at most ``budget`` ops back: a mask the canonical forms
    pushed into a concat's operands reads the start value through a select
    of its own)."""
    c = self.deg.of(v)
    if c in tables:
      return tables[c]  # (None: in progress, or not known to this walk)
    if self.deg.splat(c) == 0.0:
      return [()] * self.mesh.size
    op = v.producer
    if op is None or budget <= 0 or len(op.results) != 1:
      return None
    tables[c] = None
    table = self._step(op, tables, rank, budget - 1)
    tables[c] = table
    return table

  def _scalars(self, vs) -> Optional[list[np.ndarray]]:
    out = [partition_id_table(v, self.mesh.size, self._id_tables) for v in vs]
    return None if any(t is None for t in out) else out

  def _step(self, op: ir.Op, tables: dict, rank: int, budget: int = MAX_PULL
            ) -> Optional[Table]:
    rule = getattr(self, f"_{op.name}", None)
    if rule is None or op.results[0].type.rank != rank:
      return None
    return rule(op, functools.partial(self._operand, tables=tables, rank=rank, budget=budget))

  def _collective_permute(self, op, operand):
    src = operand(op.operands[0])
    if src is None:
      return None
    out: Table = [()] * self.mesh.size  # ranks nobody sends to get zeros
    for s, t in op.attrs.get("source_target_pairs") or ():
      out[t] = src[s]
    return out

  def _pad(self, op, operand):
    src = operand(op.operands[0])
    lo, inner = op.attrs["edge_padding_low"], op.attrs["interior_padding"]
    if src is None or any(inner) or self.deg.splat(self.deg.of(op.operands[1])) != 0.0:
      return None
    bounds = tuple((0, n) for n in op.results[0].shape)
    # (Negative low padding cuts the operand: the cut keeps what stays in bounds.)
    return [_cut(_placed(h, lo), bounds) for h in src]

  def _concatenate(self, op, operand):
    k = op.attrs["dimension"]
    parts = [operand(v) for v in op.operands]
    if any(p is None for p in parts):
      return None
    starts = np.cumsum([0] + [v.shape[k] for v in op.operands])
    at = [tuple(int(s) if i == k else 0 for i in range(op.results[0].type.rank))
          for s in starts]
    return [_combined([_placed(part[r], a) for part, a in zip(parts, at)])
            for r in range(self.mesh.size)]

  def _dynamic_slice(self, op, operand):
    sliced, *offsets = op.operands
    src, starts = operand(sliced), self._scalars(offsets)
    if src is None or starts is None:
      return None
    sizes = op.attrs["slice_sizes"]
    out: Table = []
    for r, h in enumerate(src):
      at = [_clamped(int(s[r]), size, full)
            for s, size, full in zip(starts, sizes, sliced.shape)]
      out.append(_cut(h, tuple((a, a + size) for a, size in zip(at, sizes))))
    return out

  def _slice(self, op, operand):
    src = operand(op.operands[0])
    if src is None or set(op.attrs["strides"]) != {1}:
      return None
    window = tuple(zip(op.attrs["start_indices"], op.attrs["limit_indices"]))
    return [_cut(h, window) for h in src]

  def _dynamic_update_slice(self, op, operand):
    base_v, update_v, *offsets = op.operands
    base, update = operand(base_v), operand(update_v)
    starts = self._scalars(offsets)
    if base is None or update is None or starts is None:
      return None
    out: Table = []
    for r in range(self.mesh.size):
      at = [_clamped(int(s[r]), size, full)
            for s, size, full in zip(starts, update_v.shape, base_v.shape)]
      window = tuple((a, a + size) for a, size in zip(at, update_v.shape))
      out.append(_combined([_without(base[r], window), _placed(update[r], at)]))
    return out

  def _select(self, op, operand):
    pred_v, on_true, on_false = op.operands
    pred = self._rank_splat(pred_v)
    a, b = operand(on_true), operand(on_false)
    if a is None or b is None:
      return None
    if pred is None:
      return self._masked_rows(pred_v, a, b)
    return [a[r] if pred[r] else b[r] for r in range(self.mesh.size)]

  def _masked_rows(self, pred_v: ir.Value, a: Table, b: Table) -> Optional[Table]:
    """select(mask, a, 0) where the mask keeps, at each rank, one run of
    indices along one dim: ``iota + offset(partition id)`` compared with
    constants (XLA zeroes a halo's rows beyond the ends so)."""
    if any(held != () for held in b):
      return None
    for k, n in enumerate(pred_v.shape):
      mask = self._row_mask(pred_v, k)
      if mask is None:
        continue
      mask = np.broadcast_to(mask, (self.mesh.size, n)).astype(bool)
      out: Table = []
      for r in range(self.mesh.size):
        kept = np.flatnonzero(mask[r])
        if len(kept) and kept[-1] - kept[0] + 1 != len(kept):
          return None  # (not one run)
        run = (int(kept[0]), int(kept[-1]) + 1) if len(kept) else (0, 0)
        window = tuple(run if i == k else (0, m) for i, m in enumerate(pred_v.shape))
        out.append(_kept(a[r], window))
      return out
    return None

  def _row_mask(self, v: ir.Value, k: int) -> Optional[np.ndarray]:
    """``v`` at each rank as a function of its index along dim ``k`` alone,
    an array broadcasting to (ranks, ``v.shape[k]``); None if it is not one
    or its type would not hold it exactly."""
    found = self._rank_splat(v)
    if found is not None:
      return found[:, None]
    op = v.producer
    if op is None:
      return None
    if op.name == "iota":
      found = np.arange(v.shape[k])[None, :] if op.attrs["iota_dimension"] == k else None
    elif op.name in ("convert", "copy"):
      found = self._row_mask(op.operands[0], k)  # (a narrower type wraps: held_exactly)
    else:
      found = self._row_mask_of_op(op, v, k)
    return found if found is not None and held_exactly(found, v.type.dtype) else None

  def _row_mask_of_op(self, op: ir.Op, v: ir.Value, k: int) -> Optional[np.ndarray]:
    if op.name == "broadcast_in_dim":  # (of an iota along k; a splat is one above)
      (x,), dims = op.operands, op.attrs["broadcast_dimensions"]
      if k not in dims or any(n != 1 for j, n in enumerate(x.shape) if dims[j] != k) or \
          x.shape[dims.index(k)] != v.shape[k]:
        return None
      return self._row_mask(x, dims.index(k))
    args = [self._row_mask(a, k) for a in op.operands]
    if not args or any(a is None for a in args):
      return None
    if op.name == "compare":
      holds = COMPARISONS.get(op.attrs.get("comparison_direction"))
      if holds is None or op.attrs.get("compare_type") == "UNSIGNED":
        return None
      return np.asarray(holds(*args), dtype=np.int64)
    if op.name not in _ELEMENTWISE or len(args) != _ELEMENTWISE[op.name]:
      return None
    return apply_table_op(op.name, np.broadcast_arrays(*args), v.type.dtype)

  def _all_reduce(self, op, operand):
    axes = op.attrs.get("gg.axes")
    src = operand(op.operands[0]) if len(op.operands) == 1 else None
    if src is None or axes is None or op.attrs.get("gg.reduction") != "sum":
      return None
    names = [a for a, _ in self.mesh.axes]
    kept = [i for i, a in enumerate(names) if a not in axes]
    groups: dict[tuple, list[int]] = {}
    for r in range(self.mesh.size):
      groups.setdefault(tuple(self._coords[r][kept]), []).append(r)
    out: Table = [None] * self.mesh.size
    for members in groups.values():
      total = _combined([src[m] for m in members])
      for m in members:
        out[m] = total
    return out

  def _rank_splat(self, v: ir.Value) -> Optional[np.ndarray]:
    """Per partition, the one value a predicate splat holds: it is computed
    from the partition id, constants, broadcasts and iotas along unit dims
    (a mask ``iota + offset < n`` over a one-row tile).  None where its type
    would not hold it exactly (XLA wraps or rounds; int64 does not)."""
    found = self._rank_splat_of(v)
    return found if found is None or held_exactly(found, v.type.dtype) else None

  def _rank_splat_of(self, v: ir.Value) -> Optional[np.ndarray]:
    op = v.producer
    if op is None:
      return None
    if math.prod(v.shape) == 1:
      found = partition_id_table(v, self.mesh.size, self._id_tables)
      if found is not None:
        return found
    if op.name == "iota":
      return np.zeros(self.mesh.size, np.int64) if v.shape[op.attrs["iota_dimension"]] == 1 \
          else None
    if op.name in ("broadcast_in_dim", "reshape", "convert", "copy"):
      return self._rank_splat(op.operands[0])
    args = [self._rank_splat(a) for a in op.operands]
    if not args or any(a is None for a in args):
      return None
    if op.name == "compare":
      holds = COMPARISONS.get(op.attrs.get("comparison_direction"))
      return None if holds is None else np.asarray(holds(*args), dtype=np.int64)
    if op.name not in _ELEMENTWISE or len(args) != _ELEMENTWISE[op.name]:
      return None
    return apply_table_op(op.name, args, v.type.dtype)
