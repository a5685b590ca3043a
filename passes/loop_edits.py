"""Editing ``while`` loops in place: their carries, copies of their ops, and
which carries are dead.  Shared by the loop normal forms (``remat.py``,
``loop_constants.py``)."""

from __future__ import annotations

from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.canonicalize import _fresh, drop_dead_ops
from graphguard_hlo.passes.terms import EFFECTS, scalar_of_broadcast

# Ops a loop rewrite never copies: effects, and loops (a copy would need its
# own proof).
NOT_COPIED = EFFECTS | {"while", "conditional", "call", "optimization_barrier"}


def invariant(body: ir.Graph, j: int) -> bool:
  """Carry ``j`` is passed through the body unchanged."""
  return j < len(body.results) and body.results[j] is body.params[j]


def add_carry(module: ir.Module, loop: ir.Op, init: ir.Value) -> tuple[ir.Value, int]:
  """A new carry starting as ``init``: (its body parameter, its index).  The
  caller sets its body result."""
  cond, body = loop.regions
  loop.operands.append(init)
  for region, tag in ((cond, "r0"), (body, "r1")):
    region.params.append(module.new_value(init.type, None, 0, f"while.{tag}.remat"))
  loop.results.append(module.new_value(init.type, loop, len(loop.results)))
  return body.params[-1], len(loop.operands) - 1


def clone_region(module: ir.Module, g: ir.Graph, mapping: dict[int, ir.Value]) -> ir.Graph:
  out = ir.Graph(g.name)
  inner = dict(mapping)
  for p in g.params:
    out.params.append(module.new_value(p.type, None, 0, p.name))
    inner[p.id] = out.params[-1]
  out.param_attrs, out.param_locations = list(g.param_attrs), list(g.param_locations)
  out.ops = [clone_op(module, op, inner) for op in g.ops]
  out.results = [inner.get(v.id, v) for v in g.results]
  out.result_attrs = list(g.result_attrs)
  return out


def clone_op(module: ir.Module, op: ir.Op, mapping: dict[int, ir.Value]) -> ir.Op:
  new = ir.Op(op.name, [mapping.get(v.id, v) for v in op.operands], dict(op.attrs),
              [clone_region(module, r, mapping) for r in op.regions], op.location)
  new.results = [module.new_value(r.type, new, i, r.name) for i, r in enumerate(op.results)]
  mapping.update((r.id, x) for r, x in zip(op.results, new.results))
  return new


def replace_uses(g: ir.Graph, replace: dict[int, ir.Value]) -> None:
  """Every read of a value in ``replace`` (by id), in ``g`` and its nested bodies."""
  for op in g.walk():
    op.operands = [replace.get(v.id, v) for v in op.operands]
  g.results = [replace.get(v.id, v) for v in g.results]


def used_ids(ops: list[ir.Op], results: list[ir.Value]) -> set[int]:
  used = {v.id for v in results}
  for op in ops:
    used.update(v.id for v in op.operands)
    for region in op.regions:
      used.update(v.id for inner in region.walk() for v in inner.operands)
      used.update(v.id for v in region.results)
  return used


def cone(g: ir.Graph, roots: list[ir.Value]) -> set[int]:
  """Ids of the values ``roots`` are computed from within ``g`` (nested bodies' captures too)."""
  producers = {r.id: op for op in g.ops for r in op.results}
  out, todo = set(), [v.id for v in roots]
  while todo:
    v = todo.pop()
    if v in out:
      continue
    out.add(v)
    op = producers.get(v)
    if op is not None:
      todo.extend(x.id for x in op.operands)
      for region in op.regions:
        todo.extend(x.id for inner in region.walk() for x in inner.operands)
        todo.extend(x.id for x in region.results)
  return out


def needed_carries(loop: ir.Op, carries: set[int]) -> set[int]:
  """``carries``, the condition's, and every carry they (or an op with effects)
  are computed from over the iterations."""
  cond, body = loop.regions
  cond_cone = cone(cond, cond.results)
  live = set(carries) | {j for j, p in enumerate(cond.params) if p.id in cond_cone}
  effects = [v for op in body.ops if op.name in EFFECTS for v in op.operands]
  while True:
    reached = cone(body, [body.results[j] for j in live] + effects)
    grown = live | {j for j, p in enumerate(body.params) if p.id in reached}
    if grown == live:
      return live
    live = grown


def drop_dead_carries(loop: ir.Op, used_outside: set[int]) -> int:
  """Remove the carries whose results nobody reads and that no live carry
  (nor the condition, nor an op with effects) is computed from; returns how
  many.  The ops only they read go too: left in the body they would read the
  dropped parameters, values no longer defined there."""
  cond, body = loop.regions
  live = needed_carries(loop, {j for j, r in enumerate(loop.results) if r.id in used_outside})
  carries = len(loop.results)
  if len(live) == carries:
    return 0
  keep = sorted(live)
  loop.operands = [loop.operands[j] for j in keep]
  loop.results = [loop.results[j] for j in keep]
  for i, r in enumerate(loop.results):
    r.index = i
  for region in (cond, body):
    region.params = [region.params[j] for j in keep]
    if len(region.param_attrs) == carries:
      region.param_attrs = [region.param_attrs[j] for j in keep]
    if len(region.param_locations) == carries:
      region.param_locations = [region.param_locations[j] for j in keep]
  body.results = [body.results[j] for j in keep]
  for region in (cond, body):
    drop_dead_ops(region)
  return carries - len(keep)


def rows(module: ir.Module, x: ir.Value, d: int, lo: int, hi: int,
         location: ir.Location) -> ir.Op:
  """A fresh slice of rows lo .. hi - 1 of ``x`` along ``d``, every other dim whole."""
  starts, limits, shape = [0] * x.type.rank, list(x.shape), list(x.shape)
  starts[d], limits[d], shape[d] = lo, hi, hi - lo
  return _fresh(module, "slice", [x], {"start_indices": tuple(starts),
                                       "limit_indices": tuple(limits),
                                       "strides": (1,) * x.type.rank},
                tuple(shape), x.type.dtype, location)


def splat_at(module: ir.Module, x: ir.Value, shape: tuple,
             location: ir.Location) -> Optional[ir.Op]:
  """``x``'s splat made afresh at ``shape``, if ``x`` broadcasts a scalar (a
  zero-initialized stack): any rows of it, as a splat the passes read."""
  scalar = scalar_of_broadcast(x)
  if scalar is None:
    return None
  return _fresh(module, "broadcast_in_dim", [scalar], {"broadcast_dimensions": ()},
                tuple(shape), x.type.dtype, location)
