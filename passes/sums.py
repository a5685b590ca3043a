"""Sums the two programs add up in different orders.

optax's global norm adds every gradient's sum of squares in parameter order:
``((s0 + s1) + s2) + ...``.  A per-device program whose gradients are tiles
must group them: the tensors split over "tp" first, psum'd once, then the
replicated ones (adding a replicated ``s1`` into a partial sum over "tp"
before the psum would count it |tp| times).  So ``s0 + s1`` has no
per-device value: it is a partial sum over "tp" plus a replica, which no
layout is.

Such a sequential value is related as a *sum of terms*: a list of summands,
each a sequential value or a term (``RelationInference.new_term``: a merge of
two, or a microbatch's share, ``pieces.py``) with its own relations.  Two terms
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

import itertools
import math
from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes import terms

# Beyond this many unmerged terms a sum is given up on (not proved).
MAX_TERMS = 64

# Ops linear in these operands: f(.., sum of t, ..) = sum of f(.., t, ..).  (A
# reduce only when it sums from zero; a convert only between floats.)
_LINEAR_IN = {"transpose": (0,), "reshape": (0,), "broadcast_in_dim": (0,), "negate": (0,),
              "copy": (0,), "convert": (0,), "slice": (0,), "reduce": (0,),
              "dot_general": (0, 1), "multiply": (0, 1), "divide": (0,)}


class SumRegrouping:
  """The sums of one inference run (``inf``: a ``RelationInference``)."""

  def __init__(self, inf) -> None:
    self.inf = inf
    self.sums: dict[int, list] = {}  # sequential value id -> its terms

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
    self.start(op, parts[0] + parts[1])

  def apply_linear(self, op: ir.Op) -> None:
    """``op`` reads a sum in an operand it is linear in: its result is the sum
    of ``op`` applied to each term (a weight gradient summed over microbatches,
    then transposed, before the program adds the microbatches' up)."""
    inf = self.inf
    sums = [k for k, v in enumerate(op.operands) if v.id in self.sums]
    if len(sums) != 1 or len(op.results) != 1 or sums[0] not in _LINEAR_IN.get(op.name, ()):
      return
    k = sums[0]
    if op.name == "convert" and not (op.operands[0].type.dtype.startswith(("f", "bf"))
                                     and op.results[0].type.dtype.startswith(("f", "bf"))):
      return
    if op.name == "reduce" and (inf.seq_op(op).attrs.get("gg.reduction") != "sum" or any(
        inf.splats.get(v.id) != 0.0 for v in op.operands[1:])):
      return
    results = []
    for t in self.sums[op.operands[k].id]:
      piece = ir.Op(op.name, [t if j == k else v for j, v in enumerate(op.operands)],
                    op.attrs, op.regions, op.location)
      piece.results = [inf.new_term(op.results[0].type)]
      inf.step(piece)
      if not inf.whole_relations(piece.results[0]):
        return
      results.append(piece.results[0])
    self.start(op, results)

  def start(self, op: ir.Op, summands: list) -> None:
    """Relate ``op``'s result as the sum of ``summands`` (values or terms with
    relations), merged as far as the per-device program adds them."""
    merged = self._merge(summands)
    if len(merged) > MAX_TERMS:
      return
    result = op.results[0]
    if len(merged) == 1:
      from graphguard_hlo.passes.inference import Relation
      for r in list(self.inf.whole_relations(merged[0])):
        self.inf.add_relation(result, Relation(r.cls, r.layout, "sum-regrouped"))
    else:
      self.sums[result.id] = merged
      self.inf.defer(result, op)

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

  def _added(self, a, ra, rb) -> Optional[int]:
    """The class of the per-device add of ``ra``'s and ``rb``'s classes, in the
    shape of ``a``'s tile under ``ra``."""
    inf = self.inf
    local = ra.layout.local_shape(a.shape, inf.mesh)
    if local is None:
      return None
    inf.lookups += 1
    return inf.deg.lookup(terms.op_head("add", {}, ir.TensorType(local, a.type.dtype)),
                          (ra.cls, rb.cls))

  def _merged_pair(self, a, b) -> Optional[ir.Value]:
    from graphguard_hlo.passes.inference import Relation
    inf = self.inf
    for ra, rb in itertools.product(inf.whole_relations(a), inf.whole_relations(b)):
      # Pinned alike, the sum is known at the pins; zero elsewhere if both are.
      zeros = ra.layout.zero_elsewhere and rb.layout.zero_elsewhere
      layout = ra.layout.with_(zero_elsewhere=zeros)
      if layout != rb.layout.with_(zero_elsewhere=zeros) or not layout.is_plain() or (
          layout.partial and layout.partial_kind != "sum"):
        continue  # (partial maxima do not add: max(a) + max(b) is no max of a + b)
      cls = self._added(a, ra, rb)
      if cls is None:
        continue
      term = inf.new_term(a.type)
      inf.add_relation(term, Relation(cls, layout, "sum-regrouped"))
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
        if self._added(a, ra, rb) is not None:
          axes = rb.layout.partial
          count = math.prod(inf.mesh.axis_size(axis) for axis in axes)
          return (f"the per-device program adds {ra.layout.describe(inf.value_name(ra.cls), inf.mesh)} "
                  f"into the partial sum over {', '.join(map(repr, axes))} "
                  f"{inf.value_name(rb.cls)}, so summed over those ranks it is counted "
                  f"{count} times: reduce the partial sums alone, then add the replicated "
                  f"terms once")
    return f"the value is {self.describe(v)[0]}"

  def describe(self, v: ir.Value) -> list[str]:
    """The terms of a sum, as the report shows them."""
    parts = [self.inf.term_words(t) or "?" for t in self.sums.get(v.id, ())]
    return [f"a sum of {len(parts)} terms the per-device program never adds up: "
            + " + ".join(f"({p})" for p in parts)] if parts else []
