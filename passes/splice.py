"""Replacing ops of a graph by other ops, in place: the one loop behind the
passes that expand an op into several (conditionals into selects, chlo ops
into XLA's expansions)."""

from __future__ import annotations

from typing import Callable, Optional

from graphguard_hlo import ir

# An op's stand-in: the ops that replace it, in order, and the values that
# replace its results; or None to keep the op.
Rewrite = Callable[[ir.Op], Optional[tuple[list[ir.Op], list[ir.Value]]]]


def splice(graph: ir.Graph, rewrite: Rewrite) -> int:
  """Rewrite ``graph`` (nested regions first) by ``rewrite``; later ops, the
  graph's results and ops in nested regions read the new values.  Returns
  how many ops were replaced."""
  count = 0
  ops: list[ir.Op] = []
  replace: dict[int, ir.Value] = {}
  for op in graph.ops:
    op.operands = [replace.get(v.id, v) for v in op.operands]
    for region in op.regions:
      count += splice(region, rewrite)
    found = rewrite(op)
    if found is None:
      ops.append(op)
      continue
    new_ops, values = found
    ops.extend(new_ops)
    # (a stand-in may be a value replaced earlier: a branch returning one)
    replace.update((r.id, replace.get(v.id, v)) for r, v in zip(op.results, values))
    count += 1
  graph.ops = ops
  graph.results = [replace.get(v.id, v) for v in graph.results]
  if replace:  # (ops moved in from a replaced op's regions read them too)
    for op in graph.walk():
      op.operands = [replace.get(v.id, v) for v in op.operands]
  return count
