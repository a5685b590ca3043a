"""Sums over the blocks a ring passes round.

Ring attention never holds a row's keys at once: at step t rank r holds key
block r - t (a *rotated* axis, ``layout.py``).  A sequential op summing over
the keys is, per device, a sum of per-block results; one keeping the keys
and summing over the queries (the keys' and values' gradients) is, per
device, one rank's share of each block, which must travel round the ring
with the block to meet the other ranks' shares.  Neither per-block result
relates to a sequential value on its own.

* A *fold*: ``reduce(S, k)``, or a dot contracting k, where each rank holds
  block ``r + j`` of dim k in a different value for each j.  The blocks of
  every j cover the dim, so the result is the per-device program's fold of
  the per-block results, by adds (or maxima) in any order (``fold_classes``).
* A *scatter*: a dot contracting dim c tiled over ring axis x, keeping a dim
  k that its operands tile by ``x + j`` (the ring's j-th diagonal: rank r
  holds rows r and columns r + j).  The local dot is tile r + j along k of
  rank r's share of a partial sum over x.  Passed round the ring and added up
  (``Transfer.ring_terms``), every rank's shares of its own tile make the sum.

Zig-zag context parallelism's blocks are reordered chunks (``chunk_order.py``
names them by the ring's rotated axis over the zig-zag order).  Folds and
scatters read them if every step's operands are reordered alike: the blocks
r + j then tile the reordered dim, which a sum or max does not see, each
rank contracts the same rows at every step, and the other dims keep their
order (``result_order``), carried with the blocks not added up yet.

The program may scale or transpose each block's result before adding it up
(a softmax's scale, an einsum's output order); so does the sequential one,
after its op.  Blocks not added up yet are kept on the sequential value and
carried through such ops (linear in the one operand holding them, every
other operand a constant) until they are; the value is left unrelated
meanwhile (``RelationInference.defer``), so a reader needing it whole
reports the op that began it.
"""

from __future__ import annotations

import collections
import math
from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.ir import axis_base, axis_shift
from graphguard_hlo.passes.chunk_order import result_order
from graphguard_hlo.passes.layout import Layout
from graphguard_hlo.passes.lemmas import SeqOp, Step, dot_tiling
from graphguard_hlo.passes.pieces import Pieces

_FOLD = {"sum": "add", "max": "maximum", "min": "minimum"}

# Ops that carry blocks not added up yet to theirs: linear in the one operand
# holding them (by position), every other operand a constant splat.
_CARRIERS = {"transpose": (0,), "reshape": (0,), "negate": (0,), "copy": (0,),
             "convert": (0,), "divide": (0,), "multiply": (0, 1)}


def _relation(cls: int, layout: Layout, how: str):
  from graphguard_hlo.passes.inference import Relation
  return Relation(cls, layout, how)


class RingBlocks:
  """The ring folds and scatters of one inference run (``inf``: a
  ``RelationInference``)."""

  def __init__(self, inf) -> None:
    self.inf = inf
    # sequential value id -> {(result layout, ring axis): {turn: class}}
    self.folds: dict[int, dict[tuple, dict[int, int]]] = collections.defaultdict(dict)
    # sequential value id -> {(the partial sum's layout, ring axis): {class: terms}}
    self.shares: dict[int, dict[tuple, dict[int, set]]] = collections.defaultdict(dict)

  def apply(self, op: ir.Op, seq_op: SeqOp) -> None:
    if op.name in ("reduce", "dot_general"):
      self._fold(op, seq_op)
    if op.name == "dot_general":
      self._scatter(op, seq_op)
    if any(v.id in self.folds or v.id in self.shares for v in op.operands):
      self._carry(op)

  # -- folds -------------------------------------------------------------------
  def _fold(self, op: ir.Op, seq_op: SeqOp) -> None:
    # Keyed by the operands' orders too: blocks of two reorderings of the dim
    # need not cover it between them.
    pieces: dict[tuple, dict[int, int]] = {}
    for combo in self.inf._operand_combinations(op, self.inf.known_relations):
      found = self._fold_piece(op, seq_op, combo)
      if found is not None:
        layout, axis, j, cls = found
        orders = tuple(l.order for _, l in combo if l is not None)
        pieces.setdefault((layout, axis, orders), {}).setdefault(j, cls)
    kind = "sum" if op.name == "dot_general" else seq_op.attrs.get("gg.reduction")
    self._relate_folds(op, pieces, kind)

  def _relate_folds(self, op: ir.Op, pieces: dict[tuple[Layout, str], dict[int, int]],
                    kind: str) -> None:
    """Relate ``op``'s result to the per-device fold of its blocks' results;
    keep a sum not folded yet."""
    inf = self.inf
    for (layout, axis, *_), by_turn in pieces.items():
      if len(by_turn) != inf.mesh.axis_size(axis):
        continue
      folded = self.fold_classes(by_turn, _FOLD[kind])
      if folded is not None:
        inf.add_relation(op.results[0], _relation(folded, layout, "ring-fold"))
      elif kind == "sum":
        self.folds[op.results[0].id][(layout, axis)] = by_turn
    self._defer(op)

  def _fold_piece(self, op: ir.Op, seq_op: SeqOp, combo):
    """(result layout, x, j, class) if the operands hold the blocks x+j of
    the reduced dim (and nothing else of it) and the per-device program runs
    the op on them."""
    from graphguard_hlo.passes.inference import inits_are_identities
    inf = self.inf
    layouts = [l for _, l in combo]
    if any(l.partial or l.at or not l.is_clean() for l in layouts):
      return None
    order = result_order(op, [None if r == "splat" else l for r, l in combo],
                         Pieces.constant_along)
    if order is None:
      return None  # the op does not commute with its operands' chunk orders
    layouts = [l.with_(order=()) for l in layouts]
    if op.name == "reduce":
      if len(op.operands) != 2 or not inits_are_identities(
          inf.splats, op, seq_op.attrs.get("gg.reduction")):
        return None  # each block's reduction adds the init once
      a = layouts[0]
      dims = op.attrs["dimensions"]
      names = [x for d in dims for x in a.dims[d]]
      result = Layout(tuple(a.dims[d] for d in range(a.rank) if d not in dims))
    elif op.name == "dot_general":
      tiling = dot_tiling(op.attrs, *layouts)
      if tiling is None:
        return None
      result, names = Layout(tiling[0]), tiling[1]
    else:
      return None
    if len(names) != 1 or axis_base(names[0]) not in inf.transfer.rings or not result.is_valid():
      return None
    local = result.local_shape(seq_op.result_type.shape, inf.mesh)
    if local is None:
      return None
    attrs = {k: v for k, v in op.attrs.items() if k != "gg.reduction"}
    step = Step(attrs, ir.TensorType(local, seq_op.result_type.dtype), result, "ring-fold")
    cls = inf.local_class(op, combo, step)
    return None if cls is None else (
        result.with_(order=order), axis_base(names[0]), axis_shift(names[0]), cls)

  def fold_classes(self, by_turn: dict[int, int], combiner: str) -> Optional[int]:
    """A class the per-device program computes as ``combiner`` over exactly
    the classes ``by_turn`` (each once), in any order and association, with
    the combiner's identity (a 0 or -inf splat) anywhere."""
    deg, users = self.inf.deg, self.inf.users
    identity = {"add": 0.0, "maximum": -math.inf, "minimum": math.inf}[combiner]
    covers: dict[int, frozenset] = {}
    for j, cls in by_turn.items():
      if cls in covers:
        return None  # one value for two blocks
      covers[cls] = frozenset({j})
    whole = frozenset(by_turn)
    work = list(covers)
    while work:
      c = work.pop()
      for d_op in users.get(c, ()):
        if d_op.name != combiner or len(d_op.operands) != 2:
          continue
        x, y = (deg.of(v) for v in d_op.operands)
        other = y if x == c else x
        if other in covers and other != c and not covers[other] & covers[c]:
          cover = covers[c] | covers[other]
        elif deg.splat(other) == identity:
          cover = covers[c]
        else:
          continue
        out = deg.of(d_op.results[0])
        if len(covers.get(out, ())) < len(cover):
          covers[out] = cover
          if cover == whole:
            return out
          work.append(out)
    return None

  # -- scatters ----------------------------------------------------------------
  def _scatter(self, op: ir.Op, seq_op: SeqOp) -> None:
    # Keyed by the operands' orders too (as folds are): each rank's rows of
    # the contracted dim must be the same at every step, or the shares a
    # tile gathers round the ring need not cover the dim.
    shares: dict[tuple, dict[int, set]] = {}
    for combo in self.inf._operand_combinations(op, self.inf.known_relations):
      found = self._scatter_piece(op, seq_op, combo)
      if found is not None:
        whole, x, k, j, cls = found
        orders = tuple(l.order for _, l in combo if l is not None)
        shares.setdefault((whole, x, orders), {}).setdefault(cls, set()).add(
            (k, j, frozenset({0})))
    self._relate_shares(op, shares)

  def _scatter_piece(self, op: ir.Op, seq_op: SeqOp, combo):
    """(the partial sum's layout, x, k, j, class) if the operands hold a ring's
    j-th diagonal of the dot and the per-device program runs the dot on them."""
    inf = self.inf
    layouts = [l for _, l in combo]
    if any(l.partial or l.at or not l.is_clean() for l in layouts):
      return None
    order = result_order(op, [None if r == "splat" else l for r, l in combo],
                         Pieces.constant_along)
    if order is None:
      return None  # the dot does not commute with its operands' chunk orders
    layouts = [l.with_(order=()) for l in layouts]
    tiling = dot_tiling(op.attrs, *layouts)
    if tiling is None:
      return None
    dims, names = tiling
    if len(names) != 1 or names[0] not in inf.transfer.rings:
      return None  # the contracted dim: tiled by a plain ring axis, alone
    x = names[0]
    turned = [k for k, d in enumerate(dims) if any(axis_base(a) == x for a in d)]
    if len(turned) != 1 or len(dims[turned[0]]) != 1:
      return None
    (k,) = turned
    j = axis_shift(dims[k][0])
    plain = list(dims)
    plain[k] = (x,)  # tile r + j, the size of tile r
    local_layout = Layout(tuple(plain))
    if not local_layout.is_valid():
      return None
    local = local_layout.local_shape(seq_op.result_type.shape, inf.mesh)
    if local is None:
      return None
    step = Step(dict(op.attrs), ir.TensorType(local, seq_op.result_type.dtype), local_layout,
                "ring-scatter")
    cls = inf.local_class(op, combo, step)
    if cls is None:
      return None
    plain[k] = ()
    return Layout(tuple(plain), (x,), order=order), x, k, j, cls

  def _relate_shares(self, op: ir.Op, shares: dict[tuple, dict[int, set]]) -> None:
    """Relate ``op``'s result to the per-device sum of a ring's shares; keep
    shares not added up yet (also to say which diagonals are missing)."""
    inf = self.inf
    for (whole, x, *_), by_class in shares.items():
      every_diagonal = len({t[1] for ts in by_class.values() for t in ts}) == \
          inf.mesh.axis_size(x)
      found = list(inf.transfer.ring_terms(by_class, whole, x)) if every_diagonal else []
      for cls, layout, how in found:
        inf.add_relation(op.results[0], _relation(cls, layout, how))
      if not found:
        self.shares[op.results[0].id][(whole, x)] = by_class
    self._defer(op)

  # -- carrying blocks not added up yet ----------------------------------------
  def _defer(self, op: ir.Op) -> None:
    v = op.results[0]
    if (self.folds.get(v.id) or self.shares.get(v.id)) and not self.inf.whole_relations(v):
      self.inf.defer(v, op)

  def _carry(self, op: ir.Op) -> None:
    """``op`` applied to each block its operand holds, as the per-device
    program applies it: the blocks of its result."""
    held = [k for k, v in enumerate(op.operands) if v.id in self.folds or v.id in self.shares]
    floats = all(v.type.dtype.startswith(("f", "bf")) for v in op.operands + op.results)
    if len(held) != 1 or held[0] not in _CARRIERS.get(op.name, ()) or len(op.results) != 1 or \
        not floats or any(v.id not in self.inf.splats
                          for k, v in enumerate(op.operands) if k != held[0]):
      return
    (i,) = held
    v = op.operands[i]
    pieces: dict[tuple[Layout, str], dict[int, int]] = {}
    for (layout, x), by_turn in self.folds.get(v.id, {}).items():
      order = self._moved_order(op, i, layout)
      if order is None:
        continue
      bare = layout.with_(order=())
      moved = {j: self._apply_locally(op, i, cls, bare) for j, cls in by_turn.items()}
      results = {m[1] for m in moved.values() if m is not None}
      if None not in moved.values() and len(results) == 1:
        pieces[(results.pop().with_(order=order), x)] = {j: m[0] for j, m in moved.items()}
    if pieces:
      self._relate_folds(op, pieces, "sum")
    shares: dict[tuple, dict[int, set]] = {}
    for (whole, x), by_class in self.shares.get(v.id, {}).items():
      for key, by_moved in self._moved_shares(op, i, whole, x, by_class).items():
        shares.setdefault(key, {}).update(by_moved)
    if shares:
      self._relate_shares(op, shares)

  def _moved_shares(self, op: ir.Op, i: int, whole: Layout, x: str,
                    by_class: dict[int, set]) -> dict[tuple, dict[int, set]]:
    """A ring's shares with ``op`` applied to each; empty unless the program
    carries every one."""
    out: dict[tuple, dict[int, set]] = {}
    order = self._moved_order(op, i, whole)
    if order is None:
      return out
    for cls, ts in by_class.items():
      for k, j, r in ts:
        dims = list(whole.dims)
        dims[k] = (x,)  # the share's tile r + j, held like tile r
        moved = self._apply_locally(op, i, cls, Layout(tuple(dims)))
        if moved is None:
          return {}
        cls2, tile = moved
        turned = [d for d, axes in enumerate(tile.dims) if x in axes]
        if len(turned) != 1 or tile.dims[turned[0]] != (x,):
          return {}
        dims2 = list(tile.dims)
        dims2[turned[0]] = ()
        out.setdefault((Layout(tuple(dims2), (x,), order=order), x), {}).setdefault(
            cls2, set()).add((turned[0], j, r))
    return out

  @staticmethod
  def _moved_order(op: ir.Op, i: int, layout: Layout) -> Optional[tuple]:
    """The order ``layout``'s reordered dims have after ``op`` (its operand i
    so laid out, the rest splats), None if ``op`` does not keep them rows:
    the lemmas carry the blocks without their order (``_apply_locally``)."""
    if not layout.order:
      return ()
    return result_order(op, [layout if n == i else None for n in range(len(op.operands))],
                        Pieces.constant_along)

  def _apply_locally(self, op: ir.Op, i: int, cls: int, layout: Layout
                     ) -> Optional[tuple[int, Layout]]:
    """(class, result layout) of the local op the lemmas propose for ``op``
    with operand i held as ``cls`` under ``layout`` (the rest splats), if the
    per-device program computes it; plain, unscaled, not partial."""
    inf = self.inf
    combo = [(_relation(cls, layout, "ring-block"), layout) if n == i else ("splat", None)
             for n in range(len(op.operands))]
    combo = inf._adopt_splat_layouts(op, combo)
    for step in inf.lemma_steps(op, [l for _, l in combo]):
      res = step.layout
      if res.partial or res.at or not res.is_clean() or not res.is_plain():
        continue
      found = inf.local_class(op, combo, step)
      if found is not None:
        return found, res
    return None
