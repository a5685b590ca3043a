"""Rows written back into place and summed over ranks.

A rank that cuts rows out of a replicated tensor (its chunks of a position
table, under zig-zag context parallelism) gets a gradient that autodiff
writes back: each cut's transpose puts the rank's rows at their place in
zeros (a ``dynamic_update_slice``, or a select over ranks of pads, as
``rank_cases.py`` writes a rank's own offset), an all-reduce sums the ranks'
buffers, and the buffers of several cuts are added.  No value on the way is
related to the sequential gradient: each holds some of its rows and zeros
elsewhere.  Only the last sum is the whole tensor again.

Such a value ``W`` is linear in one related value ``X``: it only moves,
selects and adds rows of ``X`` along one dim ``k`` and sums them over ranks.
This pass follows, at every rank, where each row of ``W`` comes from (its
*provenance*): zero, one row ``j`` of ``X`` at rank ``r'``, or a mix.  The
ops never scale or subtract, so a mix of rows never becomes one row again,
and a row that is one row ``j`` of ``X@r'`` is exactly that row.  When
``X``'s relation says which sequential row each ``(r', j)`` is, and each
rank's rows of ``W`` are a tile of the sequential tensor (or all of it, in
order), ``W`` is related: the rows' provenance is a proof, not a sample.

Rows taken by index (Megatron's ``index_select`` of chunks) are written back
by the gather's transpose: dim ``k`` viewed as chunks by a reshape, a
scatter-add of the rank's chunks into zeros, a reshape back.  So a row is
an entry of a provenance array over several dims: it keeps the dims that
still index ``k``'s rows, and holds one entry for each dim every op keeps
whole and in place (``_whole``).  A reshape may split or merge the former,
never the latter; a scatter's windows must cover the latter whole.

The offsets and predicates are computed from the rank by the reference
interpreter, as ``chunk_order.py`` does.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from graphguard_hlo import ir, reference
from graphguard_hlo.interpret import Interpreter, Unsupported, mesh_coords, replica_groups
from graphguard_hlo.passes.chunk_order import chunk_tiling, integer_arithmetic, rank_cone
from graphguard_hlo.passes.collectives import reducer_kind
from graphguard_hlo.passes.layout import Layout, tile_index
from graphguard_hlo.passes.rank_arith import broadcast_scalar

ZERO, MIXED = -1, -2  # provenance of a zero row, of a sum of rows

# The ops that only move, select and add rows, and which operands are data.
_DATA = {"slice": (0,), "pad": (0,), "concatenate": None, "dynamic_slice": (0,),
         "dynamic_update_slice": (0, 1), "select": (1, 2), "add": (0, 1),
         "all_reduce": (0,), "copy": (0,), "reshape": (0,), "scatter": (0, 2),
         "broadcast_in_dim": (0,)}  # one inserting unit dims only: a reshape


def _summed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """The provenance of ``a + b``: a row where the other is zero, else a mix
  (nothing here subtracts, so a mix never becomes one row again)."""
  return np.where(a == ZERO, b, np.where(b == ZERO, a, MIXED))


def _whole(rows: np.ndarray, v: ir.Value) -> frozenset[int]:
  """The dims of ``v`` that its provenance ``rows`` keeps whole and in place:
  those it holds one entry for where ``v`` has more."""
  return frozenset(i for i, (a, n) in enumerate(zip(rows.shape, v.shape)) if a == 1 and n > 1)


def _zeros(v: ir.Value, whole: frozenset[int]) -> np.ndarray:
  """The provenance of a zero splat shaped as ``v``, ``whole`` kept whole."""
  return np.full([1 if i in whole else n for i, n in enumerate(v.shape)], ZERO, np.int64)


def _data_operands(op: ir.Op) -> list[ir.Value]:
  data = _DATA[op.name]
  return [v for k, v in enumerate(op.operands) if data is None or k in data]


class WriteBacks:
  """The values of a per-device program that sum rows of one value over ranks."""

  def __init__(self, graph: ir.Graph, mesh: ir.Mesh, class_of, splat_of):
    self.graph = graph
    self.mesh = mesh
    self.class_of = class_of
    self.is_zero = lambda v: splat_of(class_of(v)) == 0.0
    self._index: Optional[dict[int, list[ir.Value]]] = None  # class -> sources
    self._sourced: dict[int, list[ir.Op]] = {}  # source id -> ops moving its rows
    self._probes: dict[tuple[int, int], Optional[dict]] = {}

  def relations(self, cls: int, layout: Layout, tile: tuple[int, ...]
                ) -> list[tuple[int, Layout]]:
    """``(class, layout)`` of each value summing rows of ``cls``'s value (of
    local shape ``tile``, related to a sequential tensor by ``layout``) that
    holds whole tiles of that tensor."""
    if self._index is None:
      self._build_index()
    if (layout.partial or layout.at or layout.filled
        or any(a != ir.axis_base(a) for d in layout.dims for a in d)):
      return []
    out = []
    for source in self._index.get(cls, ()):
      if tuple(source.shape) != tuple(tile):
        continue  # (a unit dim dropped or added: rows would be named off the wrong dims)
      for k in range(source.type.rank):
        for root, held in (self._probe(source, k) or {}).items():
          new = self._layout_of(held, layout, k, tile)
          if new is not None:
            out.append((self.class_of(root), new))
    return out

  # -- which values are sums of one value's rows ---------------------------------
  def _build_index(self) -> None:
    """One pass in program order: the one value each move's rows come from
    (zeros aside), and whether an all-reduce summed them on the way."""
    source_of: dict[int, Optional[ir.Value]] = {}
    summed: set[int] = set()
    self._index = {}
    for op in self.graph.ops:
      if op.name not in _DATA or len(op.results) != 1 or op.regions and op.name not in (
          "all_reduce", "scatter"):
        continue
      if op.name == "all_reduce" and (len(op.operands) != 1
                                      or op.attrs.get("gg.reduction") != "sum"):
        continue
      if op.name == "scatter" and (len(op.operands) != 3
                                   or reducer_kind(op.regions[0]) != "sum"):
        continue
      sources = set()
      for v in _data_operands(op):
        if self.is_zero(v):
          continue
        sources.add(source_of[v.id] if v.id in source_of else v)
      if len(sources) != 1 or None in sources:
        source_of[op.results[0].id] = None
        continue
      (source,) = sources
      result = op.results[0]
      source_of[result.id] = source
      self._sourced.setdefault(source.id, []).append(op)
      if op.name == "all_reduce" or any(v.id in summed for v in _data_operands(op)):
        summed.add(result.id)
        by_class = self._index.setdefault(self.class_of(source), [])
        if source not in by_class:
          by_class.append(source)

  # -- the provenance of rows, at every rank -----------------------------------------
  def _probe(self, source: ir.Value, k: int) -> Optional[dict[ir.Value, list[np.ndarray]]]:
    """Each value summing rows of ``source`` moved along dim ``k``, with the
    provenance of its rows at every rank (``r' * rows + j``, ZERO or MIXED)."""
    key = (source.id, k)
    if key not in self._probes:
      self._probes[key] = self._run_probe(source, k)
    return self._probes[key]

  def _run_probe(self, source: ir.Value, k: int):
    try:
      coords = mesh_coords(self.mesh)
    except Unsupported:
      return None
    ranks, rows = len(coords), source.shape[k]
    along_k = [-1 if i == k else 1 for i in range(source.type.rank)]
    prov = {source.id: [(np.arange(rows, dtype=np.int64) + r * rows).reshape(along_k)
                        for r in range(ranks)]}
    summed = set()
    for op in self._sourced.get(source.id, ()):  # in program order
      if any(v.id not in prov and not self.is_zero(v) for v in _data_operands(op)):
        continue  # reads rows this probe could not follow
      if not self._follows(op):
        continue  # mixes in more than zeros, or selects by an elementwise mask
      scalars = self._scalars(op, ranks)
      if scalars is None:
        continue  # offsets or a predicate not computed from the rank alone
      args = [prov.get(v.id) for v in op.operands]  # None: a zero splat, or no data
      try:
        if op.name == "all_reduce":
          held = _all_reduced(op, args[0], ranks)
        else:
          held = [_moved(op, [None if a is None else a[r] for a in args], scalars[r])
                  for r in range(ranks)]
      except Unsupported:
        continue
      prov[op.results[0].id] = held
      if op.name == "all_reduce" or any(v.id in summed for v in _data_operands(op)):
        summed.add(op.results[0].id)

    def rows_of_k(v: ir.Value) -> bool:  # source's shape, every dim but k kept whole
      off_k = lambda shape: shape[:k] + shape[k + 1:]
      return (v.type.rank == source.type.rank and off_k(v.shape) == off_k(source.shape)
              and prov[v.id][0].shape == tuple(n if i == k else 1 for i, n in enumerate(v.shape)))

    return {v: [p.reshape(-1) for p in prov[v.id]]
            for v in (op.results[0] for op in self._sourced.get(source.id, ()))
            if v.id in summed and rows_of_k(v)}

  def _follows(self, op: ir.Op) -> bool:
    """Does ``op`` add nothing but zeros to its data, and select by the rank
    alone?  (Whether it keeps whole dims whole, ``_moved`` checks.)"""
    out = op.results[0].type
    if any(v.type.dtype != out.dtype for v in _data_operands(op)):
      return False
    if op.name == "pad":
      return self.is_zero(op.operands[1])
    if op.name == "select":
      return math.prod(broadcast_scalar(op.operands[0]).shape) == 1
    return True

  def _scalars(self, op: ir.Op, ranks: int) -> Optional[list[list]]:
    """The op's offsets, predicate or indices at every rank (one list per rank)."""
    if op.name == "select":
      values = [op.operands[0]]  # a splat (_follows): the first element is all of it
    elif op.name == "dynamic_slice":
      values = [op.operands[1 + k] for k in range(op.operands[0].type.rank)]
    elif op.name == "dynamic_update_slice":
      values = op.operands[2:]
    elif op.name == "scatter":
      values = [op.operands[1]]
    else:
      return [[] for _ in range(ranks)]
    cones = [rank_cone(v.producer) if v.producer is not None else None for v in values]
    if None in cones or not all(integer_arithmetic(op) for cone in cones for op in cone):
      return None
    env: dict = {}
    # The offsets share most of their cone (the rank's coordinates): run it once.
    Interpreter(ranks).run_ops(list(dict.fromkeys(op for cone in cones for op in cone)), env)
    if any(v.id not in env for v in values):
      return None
    return [[np.asarray(env[v.id][r]) for v in values] for r in range(ranks)]

  # -- the layout the rows make ------------------------------------------------------
  def _layout_of(self, held: list[np.ndarray], layout: Layout, k: int, tile) -> Optional[Layout]:
    """``layout`` with dim ``k`` re-tiled as ``held`` holds it, or None unless
    every rank holds, in each row, one sequential row of its own tile of
    the other dims."""
    coords = mesh_coords(self.mesh)
    names = self.mesh.axis_names
    rows = tile[k]
    n = rows * math.prod(self.mesh.axis_size(a) for a in layout.dims[k])
    chunks = dict(layout.order).get(k)

    def seq_row(r: int, j: int) -> int:
      q = tile_index(layout.dims[k], dict(zip(names, coords[r])), self.mesh) * rows + j
      if chunks is None:
        return q
      size = n // len(chunks)
      return chunks[q // size] * size + q % size

    def other_tiles(r: int) -> tuple:
      at = dict(zip(names, coords[r]))
      return tuple(tile_index(axes, at, self.mesh) for i, axes in enumerate(layout.dims) if i != k)

    at = {}
    for r, prov in enumerate(held):
      if (prov < 0).any():
        return None
      sources = prov // rows
      if any(other_tiles(int(s)) != other_tiles(r) for s in set(sources.tolist())):
        return None
      at[coords[r]] = tuple(seq_row(int(s), int(j)) for s, j in zip(sources, prov % rows))
    found = chunk_tiling(at, self.mesh, n)
    if found is None:
      return None
    axes, new_chunks = found
    if set(axes) & {a for i, d in enumerate(layout.dims) if i != k for a in d}:
      return None
    order = tuple((d, c) for d, c in layout.order if d != k)
    if new_chunks != tuple(range(len(new_chunks))):
      order += ((k, new_chunks),)
    new = layout.with_(dims=tuple(axes if i == k else d for i, d in enumerate(layout.dims)),
                       order=order)
    return new if new.is_valid() else None


def _moved(op: ir.Op, args: list, scalars: list) -> np.ndarray:
  """The provenance of ``op``'s result at one rank, from its operands' (None:
  a zero splat, or no data); Unsupported unless ``op`` keeps the dims its
  data keeps whole whole and in place."""
  if op.name == "reshape":
    return _reshaped(op, args[0])
  if op.name == "broadcast_in_dim":
    dims = op.attrs["broadcast_dimensions"]
    if math.prod(op.operands[0].shape) != math.prod(op.results[0].shape) or list(dims) != sorted(dims):
      raise Unsupported("broadcast_in_dim that broadcasts")
    return _reshaped(op, args[0])
  if op.name == "scatter":
    return _scattered(op, args[0], args[2], scalars[0])
  wholes = {_whole(a, v) for a, v in zip(args, op.operands) if a is not None}
  if len(wholes) != 1:
    raise Unsupported("operands kept whole along different dims")
  (whole,) = wholes
  rows_of = lambda i: _zeros(op.operands[i], whole) if args[i] is None else args[i]
  at = lambda index: tuple(slice(None) if i in whole else s for i, s in enumerate(index))

  def keeps_whole(sizes, of: ir.Value) -> None:
    if any(sizes[i] != of.shape[i] for i in whole):
      raise Unsupported(f"{op.name} cuts a dim kept whole")

  def clamped(starts, sizes, of: ir.Value) -> list[slice]:  # as XLA clamps
    return [slice(s, s + n) for s, n in zip(
        (min(max(int(s), 0), m - n) for s, m, n in zip(starts, of.shape, sizes)), sizes)]

  name, attrs = op.name, op.attrs
  if name == "copy":
    return rows_of(0)
  if name == "add":
    return _summed(rows_of(0), rows_of(1))
  if name == "select":
    (pred,) = scalars
    return rows_of(1) if bool(np.asarray(pred).reshape(-1)[0]) else rows_of(2)
  if name == "slice":
    start, limit = attrs["start_indices"], attrs["limit_indices"]
    strides = attrs.get("strides") or [1] * len(start)
    if any((start[i], limit[i], strides[i]) != (0, op.operands[0].shape[i], 1) for i in whole):
      raise Unsupported("slice cuts a dim kept whole")
    return rows_of(0)[at([slice(*s) for s in zip(start, limit, strides)])].copy()
  if name == "pad":
    low, high, interior = (attrs[f] for f in ("edge_padding_low", "edge_padding_high",
                                              "interior_padding"))
    if any(low[i] or high[i] or interior[i] for i in whole):
      raise Unsupported("pad widens a dim kept whole")
    return reference.pad(rows_of(0), np.int64(ZERO), low, high, interior)
  if name == "concatenate":
    if attrs["dimension"] in whole:
      raise Unsupported("concatenate along a dim kept whole")
    return np.concatenate([rows_of(i) for i in range(len(op.operands))], attrs["dimension"])
  if name == "dynamic_slice":
    sizes = attrs["slice_sizes"]
    keeps_whole(sizes, op.operands[0])
    return rows_of(0)[at(clamped(scalars, sizes, op.operands[0]))].copy()
  if name == "dynamic_update_slice":
    base, update = rows_of(0).copy(), rows_of(1)
    keeps_whole(op.operands[1].shape, op.operands[0])
    base[at(clamped(scalars, op.operands[1].shape, op.operands[0]))] = update
    return base
  raise Unsupported(name)


def _reshaped(op: ir.Op, rows: np.ndarray) -> np.ndarray:
  """A reshape keeps in place the dims of a prefix and a suffix it leaves as
  they are, and regroups the rows in between: dims kept whole must be among
  the former."""
  s, t = op.operands[0].shape, op.results[0].shape
  a = next((i for i, (m, n) in enumerate(zip(s, t)) if m != n), min(len(s), len(t)))
  b = next((i for i, (m, n) in enumerate(zip(s[::-1], t[::-1])) if m != n),
           min(len(s), len(t)))
  b = min(b, len(s) - a, len(t) - a)
  if any(a <= i < len(s) - b for i in _whole(rows, op.operands[0])):
    raise Unsupported("reshape regroups a dim kept whole")
  return rows.reshape(rows.shape[:a] + tuple(t[a:len(t) - b]) + rows.shape[len(s) - b:])


def _scattered(op: ir.Op, base: Optional[np.ndarray], updates: np.ndarray,
               indices: np.ndarray) -> np.ndarray:
  """A scatter-add of rows: every window must land (XLA skips one that does
  not fit, which the spec leaves open) and cover the dims kept whole, which
  no index may address."""
  dn = reference.dimension_numbers(op.attrs["scatter_dimension_numbers"])
  if dn.get("input_batching_dims"):
    raise Unsupported("scatter with batching dims")
  covered = [d for d in range(op.operands[0].type.rank)
             if d not in dn.get("inserted_window_dims", ())]
  to_operand = dict(zip(dn.get("update_window_dims", ()), covered))
  kept = _whole(updates, op.operands[2])
  if not kept <= set(to_operand):
    raise Unsupported("scatter indexes along a dim kept whole")
  whole = frozenset(to_operand[d] for d in kept)
  if whole & set(dn.get("scatter_dims_to_operand_dims", ())) or any(
      op.operands[2].shape[d] != op.operands[0].shape[to_operand[d]] for d in kept):
    raise Unsupported("scatter cuts a dim kept whole")
  base = _zeros(op.operands[0], whole) if base is None else base
  if _whole(base, op.operands[0]) != whole:
    raise Unsupported("scatter into rows kept whole along other dims")
  add = lambda x: reference.scatter(np.zeros_like(base), indices, x, op.attrs, "sum")
  landed = add(np.ones_like(updates))
  if landed.sum() != updates.size or op.attrs.get("unique_indices") and landed.max() > 1:
    raise Unsupported("a scatter's window skipped, or indices declared unique that are not")
  if op.attrs.get("indices_are_sorted") and not reference.indices_sorted(
      indices, dn["index_vector_dim"]):
    raise Unsupported("indices declared sorted that are not")
  # Count the rows each entry sums (a mix counts two) and add their ids:
  # where exactly one row lands, the sum of ids is that row's.
  count = lambda p: (p != ZERO).astype(np.int64) + (p == MIXED)
  ident = lambda p: np.where(p >= 0, p + 1, 0)
  total = count(base) + add(count(updates))
  ids = ident(base) + add(ident(updates))
  return np.where(total == 0, ZERO, np.where(total == 1, ids - 1, MIXED))


def _all_reduced(op: ir.Op, args: Optional[list[np.ndarray]], ranks: int) -> list[np.ndarray]:
  """The provenance of a sum over each replica group: one row, if exactly
  one rank of the group holds a row there."""
  if args is None:
    raise Unsupported("an all-reduce of zeros")
  out: list = [None] * ranks
  for group in replica_groups(op, ranks):
    total = np.full_like(args[group[0]], ZERO)
    for d in group:
      total = _summed(total, args[d])
    for d in group:
      out[d] = total
  if any(o is None for o in out):
    raise Unsupported("a rank in no replica group")
  return out
