"""Where a per-device value is zero: a dataflow over the per-device program.

A pipeline's backward pass runs on zeros.  The masked psum that ends the
forward transposes to the cotangent at the last stage and zeros at the others;
permutes pass those zeros stage to stage, and a stage's cotangent at step t is
what the later stage sent plus a zero, or zero in a bubble.  A relation pinned
at stage s survives adding a value that is zero at s (``Transfer._add``); this
pass says where values are zero.

A fact is a *pattern*: a set of mesh coordinates ``{(x, c), ...}`` meaning
"zero at every rank whose coordinates match", the empty pattern meaning zero
at every rank.  A value's facts are a set of patterns (zero where any
matches).  Read in real arithmetic, as ``lemmas.ZERO_PRESERVING`` is: ``0 * x
= 0`` for the finite values the other ranks compute.

  splat 0                         zero everywhere
  select(r_x in T, a, b)          a's patterns at x in T, b's at x not in T
  collective-permute over x       a pattern at x = c moves to x = perm(c);
                                  ranks that receive nothing hold zeros
  ZERO_PRESERVING ops             zero where every operand of some group is
                                  (a product: either; a sum: both)
  collectives over X              patterns not naming X (every rank of a
                                  group shares those coordinates)
  while                           a carry's patterns at its start that every
                                  iteration keeps, given the carries' (a
                                  stage's scanned backward on a bubble's zero
                                  cotangent gives zeros)
"""

from __future__ import annotations

import itertools
from typing import Iterable, Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.collectives import reducer_kind
from graphguard_hlo.passes.dist_egraph import DistEGraph
from graphguard_hlo.passes.lemmas import ZERO_PRESERVING
from graphguard_hlo.passes.terms import splat_value

Pattern = frozenset  # of (axis, coordinate) pairs
EVERYWHERE: frozenset = frozenset({Pattern()})
NOWHERE: frozenset = frozenset()

# Rounds of a loop's invariant search; a search that has not settled by then
# knows nothing (each round only drops patterns, so it rarely takes more than two).
MAX_LOOP_ROUNDS = 8

# Collectives combining a group's values along ``gg.axes``.
_GROUP_COLLECTIVES = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}


def _meet(p: Pattern, q: Pattern) -> Optional[Pattern]:
  """The ranks matching both patterns, None if no rank does."""
  both = dict(p)
  for axis, c in q:
    if both.setdefault(axis, c) != c:
      return None
  return Pattern(both.items())


def _minimal(patterns: Iterable[Pattern]) -> frozenset:
  """Drop patterns another one covers (a pattern covers those it is a subset of)."""
  ps = set(patterns)
  return frozenset(p for p in ps if not any(q < p for q in ps))


def intersect(a: frozenset, b: frozenset) -> frozenset:
  """Zero where both are: every pattern of one met with every pattern of the other."""
  return _minimal(m for p, q in itertools.product(a, b) for m in [_meet(p, q)] if m is not None)


def covers(facts: frozenset, pins: Iterable[tuple[str, int]]) -> bool:
  """Is a value with these facts zero at every rank matching ``pins``?"""
  pins = Pattern(pins)
  return any(p <= pins for p in facts)


class ZeroFacts:
  """For each e-class of the per-device program, where it is known zero."""

  def __init__(self, deg: DistEGraph, mesh: ir.Mesh, graph: ir.Graph, rank_predicate):
    self.deg = deg
    self.mesh = mesh
    self.rank_predicate = rank_predicate  # Transfer.rank_predicate
    self._facts: dict[int, frozenset] = {}
    self._local: dict[int, frozenset] = {}  # value id -> facts, inside a loop's body
    for op in graph.ops:  # program order: operands before their users
      if op.name == "while":
        results = list(zip(op.results, self._loop(op)))
      elif len(op.results) == 1:
        results = [(op.results[0], self._of_op(op))]
      else:
        continue
      for result, found in results:
        if found:
          cls = deg.of(result)
          self._facts[cls] = _minimal(self._facts.get(cls, NOWHERE) | found)

  def of(self, cls: int) -> frozenset:
    cls = self.deg.find(cls)
    found = self._facts.get(cls)
    if found is None:  # (memoized: the constructor adds to it, never takes away)
      found = self._facts[cls] = EVERYWHERE if self.deg.splat(cls) == 0.0 else NOWHERE
    return found

  def _operand(self, op: ir.Op, i: int) -> frozenset:
    return self._value(op.operands[i])

  def _value(self, v: ir.Value) -> frozenset:
    if v.id in self._local:
      return self._local[v.id]
    if v.id in self.deg.class_of:
      return self.of(self.deg.of(v))
    return EVERYWHERE if splat_value(v) == 0 else NOWHERE  # a loop body's own constant

  def _loop(self, op: ir.Op) -> list[frozenset]:
    """Each carry's facts after a while: those of its initial value that one
    iteration keeps when every carry has its facts (an inductive invariant,
    weakened until it is one).  Values inside the body hold them on every
    iteration, so nested loops are read the same way."""
    body = op.regions[1]
    facts = [self._value(v) for v in op.operands]
    outside = self._local
    try:
      for _ in range(MAX_LOOP_ROUNDS):
        if not any(facts):
          return facts
        self._local = {**outside, **{p.id: f for p, f in zip(body.params, facts)}}
        for inner in body.ops:
          if inner.name == "while":
            self._local.update((r.id, f) for r, f in zip(inner.results, self._loop(inner)))
          elif len(inner.results) == 1 and (found := self._of_op(inner)):
            self._local[inner.results[0].id] = found  # (else as _value reads it: a splat?)
        kept = [intersect(f, self._value(r)) for f, r in zip(facts, body.results)]
        if kept == facts:
          return facts
        facts = kept
      return [NOWHERE] * len(facts)
    finally:
      self._local = outside

  def _of_op(self, op: ir.Op) -> frozenset:
    name = op.name
    if name == "select":
      return self._select(op)
    if name == "collective_permute":
      return self._permute(op)
    if name in _GROUP_COLLECTIVES:
      axes = set(op.attrs.get("gg.axes") or ())
      if not axes or (name == "all_reduce" and op.attrs.get("gg.reduction") not in
                      ("sum", "max", "min")):
        return NOWHERE
      return frozenset(p for p in self._operand(op, 0) if not {a for a, _ in p} & axes)
    if name not in ZERO_PRESERVING:
      return NOWHERE
    facts = [self._operand(op, i) for i in range(len(op.operands))]
    if not any(facts):
      return NOWHERE  # (most ops: nothing known zero anywhere)
    if name == "reduce" and (len(op.operands) != 2 or not op.regions or
                             reducer_kind(op.regions[0]) not in ("sum", "max", "min")):
      return NOWHERE  # a reducer body of its own need not map zeros to zero
    groups = ZERO_PRESERVING[name] or (tuple(range(len(op.operands))),)
    found: set = set()
    for group in groups:
      if any(i >= len(facts) for i in group):
        continue
      zero = EVERYWHERE
      for i in group:
        zero = intersect(zero, facts[i])
      found |= zero
    if name == "divide":  # 0 / 0 is no zero: not where the divisor is known zero anywhere
      found = {p for p in found if all(_meet(p, q) is None for q in facts[1])}
    return _minimal(found)

  def _select(self, op: ir.Op) -> frozenset:
    on_true, on_false = self._operand(op, 1), self._operand(op, 2)
    picked = self.rank_predicate(op.operands[0])
    if picked is None:
      return intersect(on_true, on_false)
    axis, true_at = picked
    n = self.mesh.axis_size(axis)
    found = set(intersect(on_true, on_false))
    for c in range(n):
      for p in (on_true if c in true_at else on_false):
        m = _meet(p, Pattern({(axis, c)}))
        if m is not None:
          found.add(m)
    return _minimal(found)

  def _permute(self, op: ir.Op) -> frozenset:
    axes, pairs = op.attrs.get("gg.axes"), op.attrs.get("gg.permutation")
    if not axes or pairs is None or len(axes) != 1:
      return NOWHERE
    (axis,) = axes
    sent = dict(pairs)
    found = {Pattern({(axis, c)}) for c in range(self.mesh.axis_size(axis))
             if c not in sent.values()}  # nothing received: zeros
    for p in self._operand(op, 0):
      at = dict(p)
      if axis not in at:
        found.add(p)  # zero at every source matching p: so at their receivers
      elif at[axis] in sent:
        found.add(Pattern({**at, axis: sent[at[axis]]}.items()))
    return _minimal(found)
