"""A stack put together from pipeline stages: each stage's rows pinned there.

Pipeline stage s holds rows s*m .. s*m+m-1 of every stacked weight and
computes their gradients, pinned to it: ``g_{s*m+i} ~ at[pp=s](d_i)``, one
per-device value ``d_i`` for local layer i, holding layer s*m+i's gradient
at stage s.  The sequential stack's gradient is (``slabs.py``)
``concat(g_0, .., g_{n*m-1})``; the per-device one ``concat(d_0, .., d_{m-1})``.
At rank s that is ``concat(g_{s*m}, .., g_{s*m+m-1})``, the stack's tile s:

  concat_k(x_0, .., x_{n*m-1}),  x_{s*m+i} ~ at[x=s](L of d_i) for every s,
  L not tiling k, widths along k the same at every stage
    =>  ~ L with k tiled over x, of concat_k(d_0, .., d_{m-1})

(an equation at each rank s, where the pins hold; L linear in each operand,
partial sums included).  No single operand says this: each is known at one
stage only, and lemmas lift pins only when the operands share them.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

from graphguard_hlo import ir
from graphguard_hlo.passes import terms
from graphguard_hlo.passes.layout import Layout

# Beyond this many (class, layout) choices per layer of several, a join is
# not tried; at most this many combinations of them are looked up.  One layer
# a stage (a data-parallel rank's microbatch) needs no combination: each
# choice is a join of its own.
_MAX_CHOICES = 8
_MAX_JOINS = 64


def _unpinned(layout: Layout, axis: str) -> Layout:
  return layout.with_(at=tuple((a, c) for a, c in layout.at if a != axis), zero_elsewhere=False)


def _slot_choices(inf, op: ir.Op, axis: str, n: int, m: int, i: int) -> set:
  """(class, layout without the pin on ``axis``) that layer slot i of every
  stage s is related to at ``axis = s``."""
  common: Optional[set] = None
  for s in range(n):
    found = {(r.cls, _unpinned(r.layout, axis)) for r in inf.whole_relations(op.operands[s * m + i])
             if dict(r.layout.at).get(axis) == s and r.layout.is_plain()}
    common = found if common is None else common & found
    if not common:
      return _summed_over_stages(inf, op, axis, n, m, i)
  return common


def _summed_over_stages(inf, op: ir.Op, axis: str, n: int, m: int, i: int) -> set:
  """Slot i held by a different per-device value at each stage, zero at the
  others (``x_{s*m+i} ~ at[axis=s; 0 elsewhere](L of w_s)``), that the
  program adds up: ``D = w_0 + .. + w_{n-1}`` is ``w_s`` at stage s, so
  ``x_{s*m+i} ~ at[axis=s](L of D)``.  A pipeline whose stages scan their
  layers computes each stage's gradients in the loop of its round."""
  # Per stage, the per-device value it holds slot i as, by layout (the axis
  # unpinned); the first such relation of each layout stands for the stage.
  held_at: list[dict[Layout, int]] = []
  for s in range(n):
    held: dict[Layout, int] = {}
    for r in inf.whole_relations(op.operands[s * m + i]):
      if r.layout.zero_elsewhere and r.layout.at == ((axis, s),) and r.layout.is_plain():
        held.setdefault(_unpinned(r.layout, axis), r.cls)
    held_at.append(held)
  out = set()
  for layout in held_at[0]:
    parts = [held.get(layout) for held in held_at]
    if None in parts or len(set(parts)) != n:
      continue
    total = _sum_of(inf, parts)
    if total is not None:
      out.add((total, layout))
  return out


def _sum_of(inf, classes: list[int]) -> Optional[int]:
  """The class of a per-device value adding exactly ``classes`` (each once),
  by a tree of ``add`` ops, if the program computes one."""
  sums = {c: frozenset({c}) for c in classes}   # class -> the parts it adds
  want = frozenset(classes)
  frontier = list(classes)
  while frontier:
    cls = frontier.pop()
    for user in inf.users.get(cls, ()):
      if user.name != "add" or len(user.operands) != 2:
        continue
      a, b = (sums.get(inf.deg.of(v)) for v in user.operands)
      if a is None or b is None or a & b:
        continue
      result = inf.deg.of(user.results[0])
      if result not in sums:
        sums[result] = a | b
        if a | b == want:
          return result
        frontier.append(result)
  return None


def stage_joins(inf, op: ir.Op) -> Iterator[tuple[int, Layout]]:
  """(class, layout) of the seq concatenation ``op``'s result, put together
  from stages over some mesh axis."""
  if op.name != "concatenate" or len(op.results) != 1:
    return
  k, parts = op.attrs["dimension"], op.operands
  for axis, n in inf.mesh.axes:
    if n < 2 or len(parts) % n:
      continue
    m = len(parts) // n
    if any(parts[s * m + i].shape[k] != parts[i].shape[k] for s in range(n) for i in range(m)):
      continue
    slots = [_slot_choices(inf, op, axis, n, m, i) for i in range(m)]
    if not all(slots) or (m > 1 and any(len(c) > _MAX_CHOICES for c in slots)):
      continue
    for layout in {l for _, l in slots[0]}:
      if layout.dims[k] or axis in layout.used_axes():
        continue
      classes = [[c for c, l in slot if l == layout] for slot in slots]
      joined = layout.with_(dims=tuple((axis,) if d == k else axes
                                       for d, axes in enumerate(layout.dims)))
      local = joined.local_shape(op.results[0].shape, inf.mesh)
      if local is None or not joined.is_valid():
        continue
      # Every class the per-device program has: one slot may hold several
      # values equal at every stage (a sum before and after adding terms that
      # are zero everywhere), and the program concatenates one of them.
      for children in itertools.islice(itertools.product(*classes), _MAX_JOINS):
        cls = children[0] if m == 1 else _concatenated(inf, children, k, local,
                                                       op.results[0].type.dtype)
        if cls is not None:
          yield cls, joined


def _concatenated(inf, children, k: int, local, dtype: str) -> Optional[int]:
  inf.lookups += 1
  return inf.deg.lookup(terms.op_head("concatenate", {"dimension": k},
                                      ir.TensorType(tuple(local), dtype)), tuple(children))
