"""Sums the two programs add up in different orders.

optax's global norm adds every gradient's sum of squares in parameter order:
``((s0 + s1) + s2) + ...``.  A per-device program whose gradients are tiles
must group them: the tensors split over "tp" first, psum'd once, then the
replicated ones (adding a replicated ``s1`` into a partial sum over "tp"
before the psum would count it |tp| times).  So ``s0 + s1`` has no
per-device value: it is a partial sum over "tp" plus a replica, which no
layout is.

Such a sequential value is related as a *sum of terms*: a list of summands,
each a sequential value or a merged term, with its own relations.  Two terms
merge when their relations have the same layout and the per-device e-graph
adds their classes (``L of a + L of b = L of (a + b)`` for one layout: each
rank's tile is linear in what it holds, sums over the partial axes
included).  A merged term's relations are closed under the program's
collectives like any value's, so a partial sum over "tp" that the program
all-reduces becomes a replica, which can merge with the replicated terms.
When one term is left, the sequential value has its relations.  Until then
it has none: an op other than ``add`` reading it (or an output) is not
proved, and the failure is reported at the add that began the sum, as it was
before sums were regrouped (a psum where a pmean belongs is an add of two
differently scaled terms, and the report should say so there).

Every step is an equation on real numbers (addition reassociated and
commuted); floating-point rounding differs, as it does between any two
orders of a sum.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes import terms

# Beyond this many unmerged terms a sum is given up on (not proved).
MAX_TERMS = 64


@dataclasses.dataclass(frozen=True, eq=False)
class Term:
  """A summand with no sequential value of its own: the merge of two terms.
  Its relations live in the inference's table under ``id`` (negative, so
  never a sequential value's)."""
  id: int
  type: ir.TensorType

  @property
  def shape(self) -> tuple[int, ...]:
    return self.type.shape


class SumRegrouping:
  """The sums of one inference run (``inf``: a ``RelationInference``)."""

  def __init__(self, inf) -> None:
    self.inf = inf
    self.sums: dict[int, list] = {}  # sequential value id -> its terms
    self.origins: dict[int, ir.Op] = {}  # ... -> the add that began the sum
    self._next_id = -1

  def is_sum(self, v: ir.Value) -> bool:
    return v.id in self.sums

  def origin(self, values) -> Optional[ir.Op]:
    """The add that began the first of ``values`` that is a sum, if any."""
    return next((self.origins[v.id] for v in values if v.id in self.origins), None)

  def summands(self, v: ir.Value) -> Optional[list]:
    if v.id in self.sums:
      return self.sums[v.id]
    if self.inf.whole_relations(v):
      return [v]
    return None

  def regroup_add(self, op: ir.Op) -> None:
    """``op`` (an add the lemmas left unrelated): relate its result as the sum
    of its operands' terms, merged as far as the per-device program adds them."""
    parts = [self.summands(v) for v in op.operands]
    if any(p is None for p in parts):
      return
    merged = self._merge(parts[0] + parts[1])
    if len(merged) > MAX_TERMS:
      return
    result = op.results[0]
    if len(merged) == 1:
      from graphguard_hlo.passes.inference import Relation
      for r in list(self.inf.whole_relations(merged[0])):
        self.inf.add_relation(result, Relation(r.cls, r.layout, "sum-regrouped"))
    else:
      self.sums[result.id] = merged
      self.origins[result.id] = self.origin(op.operands) or op

  def _merge(self, pending: list) -> list:
    pending = list(pending)
    merged = True
    while merged and len(pending) > 1:
      merged = False
      for i, j in itertools.combinations(range(len(pending)), 2):
        term = self._merged_pair(pending[i], pending[j])
        if term is not None:
          pending = [t for k, t in enumerate(pending) if k not in (i, j)] + [term]
          merged = True
          break
    return pending

  def _merged_pair(self, a, b) -> Optional[Term]:
    from graphguard_hlo.passes.inference import Relation
    inf = self.inf
    for ra, rb in itertools.product(inf.whole_relations(a), inf.whole_relations(b)):
      if ra.layout != rb.layout or not ra.layout.is_plain():
        continue
      local = ra.layout.local_shape(a.shape, inf.mesh)
      if local is None:
        continue
      local_type = ir.TensorType(local, a.type.dtype)
      head = terms.op_head("add", {}, local_type, (), 0)
      inf.lookups += 1
      cls = inf.deg.lookup(head, (ra.cls, rb.cls))
      if cls is None:
        continue
      term = Term(self._next_id, a.type)
      self._next_id -= 1
      inf.add_relation(term, Relation(cls, ra.layout, "sum-regrouped"))
      return term
    return None

  def explain(self, values) -> str:
    """Why the first sum among ``values`` never came together: a replica the
    per-device program adds into a partial sum (the replicated tensors' squares
    psum'd with the split ones') is counted once per rank of the sum."""
    v = next((v for v in values if v.id in self.sums), None)
    if v is None:
      return ""
    inf = self.inf
    pending = self.sums[v.id]
    for a, b in itertools.permutations(pending, 2):
      for ra, rb in itertools.product(inf.whole_relations(a), inf.whole_relations(b)):
        if ra.layout.partial or not rb.layout.partial or ra.layout.dims != rb.layout.dims:
          continue
        local = ra.layout.local_shape(a.shape, inf.mesh)
        if local is None:
          continue
        cls = inf.deg.lookup(terms.op_head("add", {}, ir.TensorType(local, a.type.dtype),
                                           (), 0), (ra.cls, rb.cls))
        if cls is not None:
          axes = rb.layout.partial
          count = 1
          for axis in axes:
            count *= inf.mesh.axis_size(axis)
          return (f"the per-device program adds {ra.layout.describe(inf.value_name(ra.cls))} "
                  f"into the partial sum over {', '.join(map(repr, axes))} "
                  f"{inf.value_name(rb.cls)}, so summed over those ranks it is counted "
                  f"{count} times: reduce the partial sums alone, then add the replicated "
                  f"terms once")
    return f"the value is {self.describe(v)[0]}"

  def describe(self, v: ir.Value) -> list[str]:
    """The terms of a sum, as the report shows them."""
    inf = self.inf
    parts = []
    for t in self.sums.get(v.id, ()):
      rels = inf.whole_relations(t)
      parts.append(" or ".join(
          r.layout.describe(inf.value_name(r.cls)) for r in rels[:2]) or "?")
    return [f"a sum of {len(parts)} terms the per-device program never adds up: "
            + " + ".join(f"({p})" for p in parts)] if parts else []
