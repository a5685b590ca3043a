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

The offsets and predicates are computed from the rank by the reference
interpreter, as ``chunk_order.py`` does.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.interpret import Interpreter, Unsupported, mesh_coords, replica_groups
from graphguard_hlo.passes.chunk_order import chunk_tiling, rank_cone
from graphguard_hlo.passes.layout import Layout, tile_index
from graphguard_hlo.passes.rank_arith import broadcast_scalar

ZERO, MIXED = -1, -2  # provenance of a zero row, of a sum of rows

# The ops that only move, select and add rows, and which operands are data.
_DATA = {"slice": (0,), "pad": (0,), "concatenate": None, "dynamic_slice": (0,),
         "dynamic_update_slice": (0, 1), "select": (1, 2), "add": (0, 1),
         "all_reduce": (0,), "copy": (0,)}


def _summed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """The provenance of ``a + b``: a row where the other is zero, else a mix
  (nothing here subtracts, so a mix never becomes one row again)."""
  return np.where(a == ZERO, b, np.where(b == ZERO, a, MIXED))


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
      if op.name not in _DATA or len(op.results) != 1 or op.regions and op.name != "all_reduce":
        continue
      if op.name == "all_reduce" and (len(op.operands) != 1
                                      or op.attrs.get("gg.reduction") != "sum"):
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
    prov = {source.id: [np.arange(rows, dtype=np.int64) + r * rows for r in range(ranks)]}
    summed = set()
    for op in self._sourced.get(source.id, ()):  # in program order
      if any(v.id not in prov and not self.is_zero(v) for v in _data_operands(op)):
        continue  # reads rows this probe could not follow
      if not self._moves_rows_of(op, k):
        continue  # moves more than rows of dim k (a select by an elementwise mask)
      scalars = self._scalars(op, ranks)
      if scalars is None:
        continue  # offsets or a predicate not computed from the rank alone
      args = [prov.get(v.id) for v in op.operands]  # None: a zero splat, or no data
      try:
        if op.name == "all_reduce":
          held = _all_reduced(op, args[0], ranks)
        else:
          held = [_moved(op, k, [None if a is None else a[r] for a in args], scalars[r])
                  for r in range(ranks)]
      except Unsupported:
        continue
      prov[op.results[0].id] = held
      if op.name == "all_reduce" or any(v.id in summed for v in _data_operands(op)):
        summed.add(op.results[0].id)
    return {op.results[0]: prov[op.results[0].id] for op in self._sourced.get(source.id, ())
            if op.results[0].id in summed}

  def _moves_rows_of(self, op: ir.Op, k: int) -> bool:
    """Does ``op`` treat every index off dim ``k`` alike, keeping dims in place?"""
    out = op.results[0].type
    for v in _data_operands(op):
      if v.type.rank != out.rank or v.type.dtype != out.dtype or any(
          a != b for i, (a, b) in enumerate(zip(v.shape, out.shape)) if i != k):
        return False
    a = op.attrs
    if op.name == "slice":
      return all(s == 1 for s in a.get("strides") or ()) and all(
          (a["start_indices"][i], a["limit_indices"][i]) == (0, n)
          for i, n in enumerate(op.operands[0].shape) if i != k)
    if op.name == "pad":
      return self.is_zero(op.operands[1]) and not any(a["interior_padding"]) and all(
          a["edge_padding_low"][i] >= 0 and a["edge_padding_high"][i] >= 0 for i in range(out.rank))
    if op.name == "concatenate":
      return a["dimension"] == k
    if op.name == "select":
      return math.prod(broadcast_scalar(op.operands[0]).shape) == 1
    return True  # (dynamic) slices and updates: other dims whole, checked above

  def _scalars(self, op: ir.Op, ranks: int) -> Optional[list[list]]:
    """The op's offsets or predicate at every rank (one list per rank)."""
    if op.name == "select":
      values = [broadcast_scalar(op.operands[0])]
    elif op.name == "dynamic_slice":
      values = [op.operands[1 + k] for k in range(op.operands[0].type.rank)]
    elif op.name == "dynamic_update_slice":
      values = op.operands[2:]
    else:
      return [[] for _ in range(ranks)]
    cones = [rank_cone(v.producer) if v.producer is not None else None for v in values]
    if None in cones:
      return None
    env: dict = {}
    # The offsets share most of their cone (the rank's coordinates): run it once.
    Interpreter(ranks).run_ops(list(dict.fromkeys(op for cone in cones for op in cone)), env)
    if any(v.id not in env for v in values):
      return None
    return [[np.asarray(env[v.id][r]).reshape(()).item() for v in values] for r in range(ranks)]

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


def _moved(op: ir.Op, k: int, args: list, scalars: list) -> np.ndarray:
  """The provenance of ``op``'s result rows at one rank, from its operands'
  (None: a zero splat)."""
  out_rows = op.results[0].shape[k]

  def rows_of(i: int) -> np.ndarray:
    a = args[i]
    return np.full(op.operands[i].shape[k], ZERO, np.int64) if a is None else a

  name, attrs = op.name, op.attrs
  if name == "copy":
    return rows_of(0)
  if name == "slice":
    return rows_of(0)[attrs["start_indices"][k]:attrs["limit_indices"][k]]
  if name == "pad":
    low, high = attrs["edge_padding_low"][k], attrs["edge_padding_high"][k]
    zeros = lambda n: np.full(n, ZERO, np.int64)
    return np.concatenate([zeros(low), rows_of(0), zeros(high)])
  if name == "concatenate":
    return np.concatenate([rows_of(i) for i in range(len(op.operands))])
  if name == "select":
    (pred,) = scalars
    return rows_of(1) if pred else rows_of(2)
  if name == "add":
    return _summed(rows_of(0), rows_of(1))
  if name == "dynamic_slice":
    whole = rows_of(0)
    start = min(max(int(scalars[k]), 0), len(whole) - out_rows)  # clamped, as XLA does
    return whole[start:start + out_rows]
  if name == "dynamic_update_slice":
    base, update = rows_of(0).copy(), rows_of(1)
    start = min(max(int(scalars[k]), 0), len(base) - len(update))
    base[start:start + len(update)] = update
    return base
  raise Unsupported(name)


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
