"""Loop-invariant constants computed inside the loops that read them: one form
for hoisted and recomputed ones.

A scan body's values that depend on no carry are computed once, before the
loop, and passed in as carries the body never changes: jax's scan hoists such
residuals (a causal mask built from iotas) out of its backward loop.  Under
``jax.checkpoint`` the backward loop rebuilds the same mask inside its body
instead.  Either way the value is the same in every iteration, but a carry
in one program has no counterpart in the other.

This pass moves every invariant carry computed from constants alone (no
parameter, no captured value, no op with effects or a body; at most
``MAX_OPS`` ops) into the body and the condition that read it; uses of the
loop's result read the value before the loop, which it is.  The carry, now
unread, is dropped.
"""

from __future__ import annotations

from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.loop_edits import (NOT_COPIED, clone_op, drop_dead_carries, invariant,
                                              replace_uses, used_ids)

MAX_OPS = 256


def _constant_cone(graph: ir.Graph, v: ir.Value) -> Optional[list[ir.Op]]:
  """The ops of ``graph`` computing ``v`` from constants alone, in order, or None."""
  position = {id(op): i for i, op in enumerate(graph.ops)}
  ops: dict[int, ir.Op] = {}
  todo = [v]
  while todo:
    x = todo.pop()
    op = x.producer
    if op is None or id(op) not in position:
      return None  # a parameter, or captured from an enclosing body
    if id(op) in ops:
      continue
    if op.name in NOT_COPIED or op.regions or len(ops) >= MAX_OPS:
      return None
    ops[id(op)] = op
    todo.extend(op.operands)
  return sorted(ops.values(), key=lambda op: position[id(op)])


def _sink(module: ir.Module, region: ir.Graph, param: ir.Value, cone: list[ir.Op]) -> None:
  """``cone`` copied to the top of ``region``, read where ``param`` was."""
  if not any(param in op.operands for op in region.walk()) and param not in region.results:
    return
  mapping: dict[int, ir.Value] = {}
  copies = [clone_op(module, op, mapping) for op in cone]
  value = mapping[cone[-1].results[0].id]
  region.ops = copies + region.ops
  replace_uses(region, {param.id: value})


def sink_constant_carries(module: ir.Module, graph: ir.Graph) -> int:
  """Sink constant invariant carries in ``graph`` (and nested bodies); returns how many."""
  count = sum(sink_constant_carries(module, region)
              for op in graph.ops for region in op.regions)
  for loop in [op for op in graph.ops if op.name == "while" and len(op.regions) == 2]:
    cond, body = loop.regions
    sunk = False
    for j, v in enumerate(loop.operands):
      if not invariant(body, j):
        continue
      cone = _constant_cone(graph, v)
      if not cone or cone[-1].results[0] is not v:
        continue
      _sink(module, cond, cond.params[j], cone)
      _sink(module, body, body.params[j], cone)
      body.results[j] = body.params[j]  # still passed through, now unread
      replace_uses(graph, {loop.results[j].id: v})
      sunk = True
      count += 1
    if sunk:
      drop_dead_carries(loop, used_ids(graph.ops, graph.results))
  return count
