"""Values the per-device program computes in pieces: microbatches.

Gradient accumulation and pipeline schedules slice each rank's batch into
microbatches, run the model on each, and put the results back together (a
concatenate) or add them up (the loss and the weight gradients).  No
per-device value is a tile of the sequential activations in between: each is
a piece of a tile.

A sequential value ``S`` that the per-device program slices along dim ``d``
(static slices of a value related to ``S``, covering each rank's tile of
``d``, which the relation tiles over axes ``A`` or not at all) is related as
a *split*: pieces ``T_0 .. T_{M-1}``.  ``T_m`` is the sequential tensor made
of the rows of ``S`` that are piece ``m`` of some rank's tile, rank by rank;
the piece the device holds is its tile under the same layout.  The ``T_m``
are genuine sequential tensors, so lemmas apply to them as to any value, and
rows partition dim ``d``.  So:

* an op that treats the rows of ``d`` independently (elementwise ops,
  broadcasts, transposes, reshapes keeping ``d``, a dot or a reduce not
  summing over ``d``) is applied piece by piece: ``f(S)``'s pieces are
  ``f(T_m)``, each earned by the lemmas on the piece's own relations, and
  operands split alike (the same dim, axes and piece sizes) pair up;
* a sum over ``d`` (a reduce, a dot contracting it) is the sum over pieces of
  the pieces' sums: a sum of terms (``sums.py``), which come together as
  the per-device program adds them (the microbatches' losses, their weight
  gradients);
* the device concatenating the pieces along ``d``, in order, under a layout
  tiling ``d`` over ``A`` again, holds its tile of ``S``.

The sequential program may concatenate pieces itself (a loop split per
microbatch, ``microbatch_loops.py``): a concatenation of related values no
per-device op puts together is a split of them, tiled over no axis
(``concatenated``); and a slice taking exactly one piece of such a split is
that piece (``taken``).  Anything else reading a split (another slice, a
gather, a scan) is not proved.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.collectives import reducer_kind
from graphguard_hlo.passes.terms import sums_from_zero

# Ops applied piece by piece along any dim they map one to one.
_ROWWISE_ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "convert",
    "cosine", "divide", "exponential", "exponential_minus_one", "floor", "is_finite",
    "log", "log_plus_one", "logistic", "maximum", "minimum", "multiply", "negate",
    "not", "or", "power", "remainder", "round_nearest_afz", "round_nearest_even",
    "rsqrt", "select", "sign", "sine", "sqrt", "subtract", "tan", "tanh", "xor", "erf"})


@dataclasses.dataclass(frozen=True)
class Split:
  """``S``'s pieces along ``dim``: ``axes`` tile that dim in the relation the
  pieces were cut from, ``sizes`` are the pieces' sizes in each rank's tile."""
  dim: int
  axes: tuple[str, ...]
  sizes: tuple[int, ...]
  terms: tuple  # the pieces, ir.Values with their own relations

  def moved(self, dim: int, terms) -> "Split":
    return Split(dim, self.axes, self.sizes, tuple(terms))

  def alike(self, other: "Split") -> bool:
    return (self.dim, self.axes, self.sizes) == (other.dim, other.axes, other.sizes)


def dim_map(op: ir.Op, k: int, d: int) -> Optional[tuple[int, bool]]:
  """Where dim ``d`` of operand ``k`` goes in the result, and whether the op
  sums over it (then the result has no such dim); None: not row by row."""
  name, attrs = op.name, op.attrs
  src, dst = op.operands[k].type, op.results[0].type
  if name in _ROWWISE_ELEMENTWISE:
    return (d, False) if src.shape == dst.shape else None
  if name == "concatenate":
    return (d, False) if attrs["dimension"] != d else None
  if name == "slice":
    whole = (attrs["start_indices"][d], attrs["limit_indices"][d]) == (0, src.shape[d])
    steps = attrs.get("strides") or (1,) * src.rank
    return (d, False) if whole and steps[d] == 1 else None
  if name == "pad" and k == 0:
    edges = (attrs["edge_padding_low"][d], attrs["edge_padding_high"][d],
             (attrs.get("interior_padding") or (0,) * src.rank)[d])
    return (d, False) if edges == (0, 0, 0) else None
  if name == "broadcast_in_dim":
    e = tuple(attrs["broadcast_dimensions"])[d]
    return (e, False) if dst.shape[e] == src.shape[d] else None
  if name == "transpose":
    return tuple(attrs["permutation"]).index(d), False
  if name == "reshape":
    before = math.prod(src.shape[:d])
    for e, n in enumerate(dst.shape):
      if math.prod(dst.shape[:e]) == before and n == src.shape[d]:
        return e, False
    return None
  if name == "reduce" and k == 0 and len(op.operands) == 2:  # one input, its init
    dims = tuple(attrs["dimensions"])
    if d in dims:  # combined in any order: only by a commutative, associative reducer
      return (None, True) if op.regions and reducer_kind(op.regions[0]) in (
          "sum", "max", "min", "mul") else None
    return d - sum(1 for x in dims if x < d), False
  if name == "dot_general":
    lb, rb, lc, rc = (tuple(attrs[k]) for k in ("lhs_batch", "rhs_batch",
                                                "lhs_contract", "rhs_contract"))
    batch, contract = (lb, rb)[k], (lc, rc)[k]
    if d in contract:
      return None, True
    if d in batch:
      return batch.index(d), False
    lhs_free = [i for i in range(op.operands[0].type.rank) if i not in lb + lc]
    rhs_free = [i for i in range(op.operands[1].type.rank) if i not in rb + rc]
    if k == 0:
      return len(lb) + lhs_free.index(d), False
    return len(lb) + len(lhs_free) + rhs_free.index(d), False
  return None


def partner_dim(op: ir.Op, k: int, d: int, j: int) -> Optional[int]:
  """The dim of operand ``j`` that pairs with dim ``d`` of operand ``k``
  (the same dim of an elementwise op, the other side of a dot's batch or
  contracting dim); None: operand ``j`` does not meet it."""
  if op.name in _ROWWISE_ELEMENTWISE or op.name == "concatenate":
    return d
  if op.name == "dot_general":
    sides = ((tuple(op.attrs["lhs_batch"]), tuple(op.attrs["rhs_batch"])),
             (tuple(op.attrs["lhs_contract"]), tuple(op.attrs["rhs_contract"])))
    for pair in sides:
      if d in pair[k]:
        return pair[j][pair[k].index(d)]
  return None


def block_source(v: ir.Value, d: int, r: int, tiles: int) -> Optional[ir.Value]:
  """``x`` if ``v`` is block ``r`` of ``tiles`` equal blocks of ``x`` along
  ``d`` (rows r*n .. r*n + n of ``tiles * n``, every other dim whole)."""
  op = v.producer
  if op is None or op.name != "slice" or any(s != 1 for s in op.attrs["strides"]):
    return None
  x, n = op.operands[0], v.shape[d]
  if x.shape[d] != tiles * n:
    return None  # a block of something larger: not one of its tiles
  for k, (lo, hi) in enumerate(zip(op.attrs["start_indices"], op.attrs["limit_indices"])):
    if (lo, hi) != ((r * n, r * n + n) if k == d else (0, x.shape[k])):
      return None
  return x


class Pieces:
  """The splits of one inference run (``inf``: a ``RelationInference``)."""

  def __init__(self, inf) -> None:
    self.inf = inf
    self.splits: dict[int, Split] = {}
    # id(op) -> (split dim, pieces, the pieces no per-device op computed)
    self.missed: dict[int, tuple[int, int, list[int], tuple]] = {}
    # sequential value id -> (dim, the rows of each tile its slices cover, tile size)
    self.partial_cuts: dict[int, tuple[int, list, int]] = {}
    self._sliced: Optional[set[int]] = None  # the classes some static slice reads
    self._seq_sliced: Optional[set[tuple[int, int]]] = None  # (value, dim) the sequential slices

  def has(self, v: ir.Value) -> bool:
    return v.id in self.splits

  # -- cutting: slices of a related value --------------------------------------
  def cut(self, s: ir.Value, rel) -> None:
    """Static slices of ``rel``'s class that cover one dim of each rank's tile,
    one per piece: ``s`` is split along that dim."""
    inf = self.inf
    if s.id in self.splits or s.id < 0 or not rel.layout.is_plain() or s.type.rank == 0:
      return
    if self._sliced is None:  # (every relation comes here: most classes are never sliced)
      self._sliced = {inf.deg.find(inf.deg.of(op.operands[0]))
                      for op in inf.dist.graph.ops if op.name == "slice"}
    if inf.deg.find(rel.cls) not in self._sliced:
      return
    local = rel.layout.local_shape(s.shape, inf.mesh)
    if local is None:
      return
    by_dim: dict[int, list] = {}
    for op in inf.users.get(rel.cls, ()):
      if op.name != "slice" or inf.deg.of(op.operands[0]) != rel.cls or \
          op.operands[0].shape != local:
        continue  # (a class may hold the tile up to unit dims: not cut here)
      start, limit = tuple(op.attrs["start_indices"]), tuple(op.attrs["limit_indices"])
      strides = tuple(op.attrs.get("strides") or (1,) * len(start))
      cut = [i for i, (a, b) in enumerate(zip(start, limit)) if (a, b) != (0, local[i])]
      if len(cut) != 1 or any(x != 1 for x in strides):
        continue
      by_dim.setdefault(cut[0], []).append((start[cut[0]], limit[cut[0]], op))
    if self._seq_sliced is None:  # where the sequential program slices too, it needs no pieces
      self._seq_sliced = {(op.operands[0].id, d) for op in inf.seq.ops if op.name == "slice"
                          for d, (a, b) in enumerate(zip(op.attrs["start_indices"],
                                                         op.attrs["limit_indices"]))
                          if (a, b) != (0, op.operands[0].shape[d])}
    for d, cuts in sorted(by_dim.items()):
      if (s.id, d) in self._seq_sliced:
        continue
      cuts = sorted(dict(((a, b), op) for a, b, op in cuts).items())
      bounds = [ab for ab, _ in cuts]
      if len(cuts) < 2 or bounds[0][0] != 0 or bounds[-1][1] != local[d] or any(
          x[1] != y[0] for x, y in zip(bounds, bounds[1:])):
        if len(cuts) > 1 and all(b - a == bounds[0][1] - bounds[0][0] for a, b in bounds):
          self.partial_cuts.setdefault(s.id, (d, bounds, local[d]))  # for the report
        continue
      axes = rel.layout.dims[d]
      ranks = math.prod(inf.mesh.axis_size(a) for a in axes)
      from graphguard_hlo.passes.inference import Relation
      terms = []
      for (a, b), op in cuts:
        shape = list(s.shape)
        shape[d] = (b - a) * ranks
        term = inf.new_term(ir.TensorType(tuple(shape), s.type.dtype))
        inf.add_relation(term, Relation(inf.deg.of(op.results[0]), rel.layout, "piece"))
        terms.append(term)
      self.splits[s.id] = Split(d, tuple(axes), tuple(b - a for a, b in bounds), tuple(terms))
      return

  def concatenated(self, op: ir.Op) -> None:
    """A sequential concatenation of values each related whole, none of which
    the per-device program concatenates: its operands are its pieces along
    the dim, tiled over no axis."""
    inf = self.inf
    if op.results[0].id in self.splits or len(op.operands) < 2 or \
        not all(inf.whole_relations(v) for v in op.operands):
      return
    if any(user.name == "concatenate" for v in op.operands for r in inf.whole_relations(v)
           for user in inf.users.get(r.cls, ())):
      return  # the program does put them together, elsewhere or otherwise: report it here
    d = op.attrs["dimension"]
    self.splits[op.results[0].id] = self._tiled_blocks(op) or \
        Split(d, (), tuple(v.shape[d] for v in op.operands), tuple(op.operands))

  def _tiled_blocks(self, op: ir.Op) -> Optional[Split]:
    """The split of a concatenation of each tile's block of every piece in
    turn: block r of piece m at ``r * K + m`` (``microbatch_loops.py`` puts a
    data-parallel rank's microbatches back so), the pieces related as tiles
    over axes of as many ranks as there are blocks each."""
    d, n = op.attrs["dimension"], len(op.operands)
    for tiles in range(2, n // 2 + 1):
      if n % tiles or any(v.shape[d] * n != op.results[0].shape[d] for v in op.operands):
        continue  # (blocks of one size: a piece's rows are the same in every tile)
      k = n // tiles
      terms = []
      for m in range(k):
        sources = {block_source(op.operands[r * k + m], d, r, tiles) for r in range(tiles)}
        if len(sources) != 1 or None in sources:
          break
        terms.append(sources.pop())
      else:
        for r0 in self.inf.whole_relations(terms[0]):
          axes = tuple(r0.layout.dims[d])
          if axes and r0.layout.is_plain() and \
              math.prod(self.inf.mesh.axis_size(a) for a in axes) == tiles and all(
                  any(r.layout.is_plain() and tuple(r.layout.dims[d]) == axes
                      for r in self.inf.whole_relations(t)) for t in terms):
            return Split(d, axes, tuple(t.shape[d] // tiles for t in terms), tuple(terms))
    return None

  def taken(self, op: ir.Op) -> None:
    """A static slice of a split taking exactly the rows of one piece in one
    tile along the split dim, and all of every other dim: that piece, or
    (tiled over axes) its rows of that tile."""
    from graphguard_hlo.passes.inference import Relation
    split = self.splits.get(op.operands[0].id)
    if split is None or op.name != "slice":
      return
    start, limit = op.attrs["start_indices"], op.attrs["limit_indices"]
    strides = op.attrs.get("strides") or (1,) * len(start)
    shape, d = op.operands[0].shape, split.dim
    if any(x != 1 for x in strides) or any(
        (start[k], limit[k]) != (0, shape[k]) for k in range(len(shape)) if k != d):
      return
    tile = sum(split.sizes)
    r, lo = divmod(start[d], tile)
    bounds = [sum(split.sizes[:m]) for m in range(len(split.sizes) + 1)]
    if (lo, lo + limit[d] - start[d]) not in zip(bounds, bounds[1:]) or \
        (not split.axes and r):
      return
    m = bounds.index(lo)
    piece = split.terms[m]
    if split.axes:  # rows r*size .. r*size + size of the piece (T_m holds each tile's rows)
      size = split.sizes[m]
      starts, limits = [0] * len(shape), list(piece.shape)
      starts[d], limits[d] = r * size, (r + 1) * size
      rows = ir.Op("slice", [piece], {"start_indices": tuple(starts),
                                      "limit_indices": tuple(limits),
                                      "strides": (1,) * len(shape)}, [], op.location)
      rows.results = [self.inf.new_term(op.results[0].type)]
      self.inf.step(rows)
      piece = rows.results[0]
    for rel in self.inf.whole_relations(piece):
      self.inf.add_relation(op.results[0], Relation(rel.cls, rel.layout, "piece-taken"))

  # -- row by row ---------------------------------------------------------------
  def apply(self, op: ir.Op) -> None:
    """Relate ``op``'s result piece by piece (``op`` read a split and the
    lemmas left its result unrelated)."""
    inf = self.inf
    if len(op.results) != 1 or op.regions and op.name != "reduce":
      return
    k = next((k for k, v in enumerate(op.operands) if v.id in self.splits), None)
    if k is None:
      return
    split = self.splits[op.operands[k].id]
    mapped = dim_map(op, k, split.dim)
    if mapped is None:
      return
    e, summed = mapped
    if summed and op.name == "reduce" and not sums_from_zero(op):
      return  # the pieces' results add up only for a sum from 0 (not a max; no init twice)
    # Every other operand: split alike along its partner dim, a splat, or
    # (a dot's other side, a reduce's init) not meeting the dim at all.
    per_operand = []
    for j, v in enumerate(op.operands):
      if j == k:
        per_operand.append(split.terms)
        continue
      partner = partner_dim(op, k, split.dim, j)
      other = self.splits.get(v.id)
      if partner is not None and v.type.rank == 0:
        partner = None  # a clamp's scalar bound, a select's scalar flag: every row's
      if partner is not None and other is not None:
        # Pieces pair only if they are the same rows.  (Pieces cut otherwise
        # differ in shape or layout, which the lemmas refuse too; kept explicit.)
        if not other.alike(dataclasses.replace(split, dim=partner)):
          return
        per_operand.append(other.terms)
      elif partner is not None and v.id in inf.splats:
        per_operand.append(tuple(self._splat_piece(v, partner, t.shape[split.dim])
                                 for t in split.terms))
      elif partner is None and inf.whole_relations(v) or v.id in inf.splats:
        per_operand.append((v,) * len(split.terms))
      elif partner is not None and self.constant_along(v, partner):
        pieces = tuple(self._broadcast_piece(v, partner, t.shape[split.dim])
                       for t in split.terms)
        if any(p is None for p in pieces):
          return
        per_operand.append(pieces)
      else:
        return
    results, missed = [], []
    for m, operands in enumerate(zip(*per_operand)):
      shape = list(op.results[0].shape)
      if not summed:
        shape[e] = split.terms[m].shape[split.dim]
      attrs = op.attrs
      if op.name == "slice":  # the piece's whole dim e
        attrs = {**attrs, "limit_indices": tuple(
            shape[e] if i == e else x for i, x in enumerate(attrs["limit_indices"]))}
      piece = ir.Op(op.name, list(operands), attrs, op.regions, op.location)
      piece.results = [inf.new_term(ir.TensorType(tuple(shape), op.results[0].type.dtype))]
      inf.step(piece)
      if not inf.whole_relations(piece.results[0]):
        missed.append(m)
      results.append(piece.results[0])
    if missed:
      self.missed[id(op)] = (split.dim, len(results), missed,
                             self._common_pins(results[m] for m in range(len(results))
                                               if m not in missed))
      return
    if summed:
      inf.sums.start(op, results)
    else:
      self.splits[op.results[0].id] = split.moved(e, results)
      self.join(op.results[0])

  @staticmethod
  def constant_along(v: ir.Value, dim: int) -> bool:
    """Is ``v`` a broadcast that does not vary along ``dim`` (a one-hot's
    iota, a mask's rows)?"""
    op = v.producer
    if op is None or op.name != "broadcast_in_dim":
      return False
    dims = tuple(op.attrs["broadcast_dimensions"])
    return dim not in dims or op.operands[0].shape[dims.index(dim)] == 1

  def _broadcast_piece(self, v: ir.Value, dim: int, size: int) -> Optional[ir.Value]:
    """The same broadcast to one piece's shape, related by the lemmas."""
    op = v.producer
    shape = list(v.shape)
    shape[dim] = size
    piece = ir.Op(op.name, list(op.operands), op.attrs, [], op.location)
    piece.results = [self.inf.new_term(ir.TensorType(tuple(shape), v.type.dtype))]
    self.inf.step(piece)
    result = piece.results[0]
    return result if self.inf.whole_relations(result) or result.id in self.inf.splats else None

  def _splat_piece(self, v: ir.Value, dim: int, size: int) -> ir.Value:
    shape = list(v.shape)
    shape[dim] = size
    term = self.inf.new_term(ir.TensorType(tuple(shape), v.type.dtype))
    self.inf.splats[term.id] = self.inf.splats[v.id]
    return term

  # -- joining: the pieces concatenated back -----------------------------------
  def join(self, s: ir.Value) -> None:
    """The device concatenating ``s``'s pieces in order along the split dim,
    under a layout tiling that dim as the cut did: its tile of ``s``."""
    from graphguard_hlo.passes.inference import Relation
    inf = self.inf
    split = self.splits[s.id]
    first = split.terms[0]
    for r0 in inf.whole_relations(first):
      if not r0.layout.is_plain() or tuple(r0.layout.dims[split.dim]) != split.axes:
        continue
      joins = [op for op in inf.users.get(r0.cls, ()) if op.name == "concatenate"
               and op.attrs.get("dimension") == split.dim
               and len(op.operands) == len(split.terms)]
      if not joins:
        continue
      # Each piece may be held by several values alike (the all-reduce that
      # brought it together and its reshape): any of them may be the operand,
      # if it holds the piece's tile in the tile's own shape (one with other
      # unit dims, concatenated, would interleave other elements).
      held = [{r.cls for r in inf.whole_relations(t) if r.layout == r0.layout}
              for t in split.terms]
      tiles = [r0.layout.local_shape(t.shape, inf.mesh) for t in split.terms]
      for op in joins:
        if all(inf.deg.of(v) in h and tuple(v.shape) == tuple(tile or ())
               for v, h, tile in zip(op.operands, held, tiles)):
          inf.add_relation(s, Relation(inf.deg.of(op.results[0]), r0.layout,
                                       "pieces-concatenated"))

  def explain(self, op: ir.Op) -> str:
    """Which pieces ``op`` was computed on, if it was on some; or which rows
    the per-device program never cut from an operand it cut into pieces."""
    for v in op.operands:
      if v.id in self.partial_cuts and v.id not in self.splits:
        dim, bounds, size = self.partial_cuts[v.id]
        covered = set().union(*(range(a, b) for a, b in bounds))
        never = [i for i in range(size) if i not in covered]
        if never:
          return (f"the per-device program cuts each rank's tile of this op's operand "
                  f"into pieces of {bounds[0][1] - bounds[0][0]} along dim {dim} "
                  f"({', '.join(f'{a}:{b}' for a, b in bounds)} of {size}) but never takes "
                  f"rows {', '.join(map(str, never))} (a microbatch skipped?)")
    for v in op.operands:
      order = self._joined_in_another_order(v)
      if order:
        return (f"the per-device program puts this op's operand together from its "
                f"{len(order)} pieces along dim {self.splits[v.id].dim} in the order "
                f"{', '.join(map(str, order))} (pieces concatenated, or written into a "
                f"buffer, in the wrong order?)")
    if id(op) not in self.missed:
      return ""
    dim, count, missed, pins = self.missed[id(op)]
    done = [m for m in range(count) if m not in missed]
    if not done:
      return ""
    where = "".join(f" at {a}={c}" for a, c in pins)
    return (f"the per-device program computes this {op.name}{where} on pieces "
            f"{', '.join(map(str, done))} of the {count} its operand is cut into along "
            f"dim {dim}, but never on piece{'s' if len(missed) > 1 else ''} "
            f"{', '.join(map(str, missed))} (a microbatch skipped, or taken twice?)")

  def computed_on_some(self, op: ir.Op) -> bool:
    """Was ``op`` related piece by piece on some of its pieces, not all?"""
    found = self.missed.get(id(op))
    return found is not None and len(found[2]) < found[1]

  def _common_pins(self, pieces) -> tuple[tuple[str, int], ...]:
    """The mesh coordinates every relation of every computed piece is pinned
    to, if they all are to the same ones (a pipeline stage's pieces): where
    the missing pieces were due."""
    pin_sets = {r.layout.at for t in pieces for r in self.inf.whole_relations(t)}
    return next(iter(pin_sets)) if len(pin_sets) == 1 else ()

  def _joined_in_another_order(self, v: ir.Value) -> Optional[list[int]]:
    """The order of the pieces a per-device concatenation of all of ``v``'s
    pieces takes, if not theirs."""
    split = self.splits.get(v.id)
    if split is None:
      return None
    inf = self.inf
    piece_of = {r.cls: m for m, t in enumerate(split.terms)
                for r in inf.relations.get(t.id, ())}
    for cls in piece_of:
      for user in inf.users.get(cls, ()):
        if user.name != "concatenate" or len(user.operands) != len(split.terms):
          continue
        order = [piece_of.get(inf.deg.of(x)) for x in user.operands]
        if None not in order and sorted(order) == list(range(len(order))) \
            and order != sorted(order):
          return order
    return None

  def describe(self, v: ir.Value) -> list[str]:
    split = self.splits.get(v.id)
    if split is None:
      return []
    parts = [self.inf.term_words(t) for t in split.terms]
    return [f"in {len(parts)} pieces along dim {split.dim} the per-device program never "
            f"puts together: " + ", ".join(f"[{p}]" for p in parts)]

