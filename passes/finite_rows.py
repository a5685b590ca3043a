"""Row maxima that are finite: a mask that keeps a key in every row.

An online softmax masked with -inf computes ``exp(-inf + inf) = NaN`` where
every key of a row is masked in every block so far, so its telescoping is
only sound for a finite running max (``online_softmax.py``).  The max is
``m' = max(m, rowmax(s))``, and a max with one finite operand is finite: once
one step's block keeps a key in every row, every later max is finite too.
Causal ring attention that starts on its own block keeps the diagonal at
step 0, on every rank.

``FiniteRows.is_finite(v)`` proves that of a value:

  max(a, b)                            finite if a or b is
  broadcast / reshape / transpose (a)  finite if a is
  reduce(max, select(keep, s, fill), dims D)
                                       finite if s has no infinite source
                                       and on every rank every row (index
                                       off D) has a key along D that keep
                                       keeps (the fill is then never the max)

``keep`` depends on no input: its numbers on every rank come from the
interpreter ``constant_values`` trusts (``exact_values``).  A mask the size
of a real block (4096 x 4096) is past what that computes, but it is a
compare of two vectors, ``rows[:, None] >= cols[None, :]``: every row keeps a
key iff each row's value compares true against some column's, which only
needs the vectors (``_compare_covers``).  Anything else is not proved finite.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.reference import ordered_as
from graphguard_hlo.passes.collectives import reducer_kind
from graphguard_hlo.passes.nonfinite import Nonfinite
from graphguard_hlo.passes.terms import splat_value

# a dir b  <=>  b FLIPPED[dir] a;  not (a dir b)  <=>  a NEGATED[dir] b
FLIPPED = {"GE": "LE", "GT": "LT", "LE": "GE", "LT": "GT", "EQ": "EQ", "NE": "NE"}
NEGATED = {"GE": "LT", "GT": "LE", "LE": "GT", "LT": "GE", "EQ": "NE", "NE": "EQ"}
_PASS_THROUGH = ("broadcast_in_dim", "reshape", "transpose", "copy")


def _some_column(direction: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """For each value of ``a``: is ``a direction b_j`` true for some j?"""
  a, b = a.ravel(), b.ravel()
  if b.size == 0:
    return np.zeros(a.shape, bool)
  if direction in ("GE", "GT"):
    low = b.min()
    return a >= low if direction == "GE" else a > low
  if direction in ("LE", "LT"):
    high = b.max()
    return a <= high if direction == "LE" else a < high
  if direction == "EQ":
    return np.isin(a, b)
  return (a != b[0]) | np.any(b != b[0])  # NE: some column differs from a


def _peel_broadcast(v: ir.Value) -> tuple[ir.Value, dict[int, int]]:
  """(v0, map) with v = broadcast_in_dim(v0): v0's dims -> v's (identity if
  v is no broadcast)."""
  op = v.producer
  if op is not None and op.name == "broadcast_in_dim":
    return op.operands[0], dict(enumerate(op.attrs["broadcast_dimensions"]))
  return v, {d: d for d in range(v.type.rank)}


def _varying(v0: ir.Value, where: dict[int, int]) -> set[int]:
  """The dims (of the broadcast result) along which ``v0`` takes more than one value."""
  return {where[d] for d, n in enumerate(v0.type.shape) if n != 1}


class FiniteRows:
  def __init__(self, module: ir.Module, graph: ir.Graph, has_infinite_source):
    """``has_infinite_source(v)``: online_softmax's walk, true unless v is
    finite for finite inputs (scores from ``q @ k``)."""
    self.ranks = max(module.num_partitions, 1)
    self.graph = graph
    self.has_infinite_source = has_infinite_source
    self._values: Optional[dict] = None
    self._computed_at = -1
    self.nonfinite = Nonfinite()  # facts of this graph's values (ids are per module)

  def is_finite(self, v: ir.Value, depth: int = 0) -> bool:
    op = v.producer
    if op is None or depth > 64:
      return False
    if op.name == "maximum":
      return any(self.is_finite(x, depth + 1) for x in op.operands)
    if op.name in _PASS_THROUGH:
      return self.is_finite(op.operands[0], depth + 1)
    if op.name == "reduce" and len(op.operands) == 2 and op.regions and \
        reducer_kind(op.regions[0]) == "max":
      init = splat_value(op.operands[1])  # -inf or finite: never the max of a kept key
      if init is None or math.isnan(init) or init == math.inf:
        return False
      return self._row_max_is_finite(op.operands[0], set(op.attrs["dimensions"]))
    return False

  def _row_max_is_finite(self, x: ir.Value, dims: set[int]) -> bool:
    select = x.producer
    if select is None or select.name != "select":
      return False
    keep, a, b = select.operands
    for scores, fill, kept_when in ((a, b, True), (b, a, False)):
      if splat_value(fill) is not None and splat_value(scores) is None and \
          not self.has_infinite_source(scores) and self._keeps_a_key(keep, dims, kept_when):
        return True
    return False

  def _keeps_a_key(self, keep: ir.Value, dims: set[int], when: bool) -> bool:
    """On every rank, does every row of ``keep`` (indices off ``dims``) hold
    ``when`` somewhere along ``dims``?"""
    p0, where = _peel_broadcast(keep)
    reduced = tuple(d for d in range(p0.type.rank) if where[d] in dims)
    values = self._per_rank(p0)
    if values is not None:
      return all(np.all(np.any(np.asarray(v) == when, axis=reduced) if reduced else
                        np.asarray(v) == when) for v in values)
    compare = p0.producer
    if compare is None or compare.name != "compare":
      return False
    direction = compare.attrs["comparison_direction"]
    if not when:
      direction = NEGATED[direction]
    return self._compare_covers(direction, *compare.operands, set(reduced),
                                compare.attrs.get("compare_type"))

  def _compare_covers(self, direction: str, a: ir.Value, b: ir.Value, dims: set[int],
                      compare_type=None) -> bool:
    """Is ``a direction b`` (broadcasts of vectors) true somewhere along
    ``dims`` in every row, on every rank?  Needs one operand varying only off
    ``dims`` (the rows) and the other only along them (the keys)."""
    (a0, a_at), (b0, b_at) = _peel_broadcast(a), _peel_broadcast(b)
    if _varying(a0, a_at) & dims or not _varying(b0, b_at) <= dims:
      if _varying(b0, b_at) & dims or not _varying(a0, a_at) <= dims:
        return False
      (a0, b0), direction = (b0, a0), FLIPPED[direction]
    rows, keys = self._per_rank(a0), self._per_rank(b0)
    if rows is None or keys is None:
      return False
    ordered = lambda x: ordered_as(np.asarray(x), compare_type)  # (an UNSIGNED compare)
    return all(np.all(_some_column(direction, ordered(r), ordered(k)))
               for r, k in zip(rows, keys))

  def _per_rank(self, v: ir.Value) -> Optional[list]:
    """``v``'s numbers on every rank, if the interpreter computes them as XLA does."""
    from graphguard_hlo.passes.constant_values import exact_values, small_ops
    if self._values is None or (v.id not in self._values and
                                self._computed_at != len(self.graph.ops)):
      # once, and again only if canonicalization has placed ops since
      self._values = exact_values(small_ops(self.graph), self.ranks)
      self._computed_at = len(self.graph.ops)
    found = self._values.get(v.id)
    if found is None or any(np.asarray(x).dtype.kind == "f" and np.isnan(x).any()
                            for x in found):
      return None
    return found
