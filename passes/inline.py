"""Inline ``func.call``s: jax emits private functions for nested jits
(``softmax``, ``_where``, ``silu``...); relation inference wants one flat graph.

Callees are cloned with fresh values (a function may be called twice), the
call's location is kept on ops that have none of their own, with the op's
name path under the call's (``jit(_uniform)/iota_2x32_shape``: a diagnosis
reads what jax op an inlined op came from).
"""

from __future__ import annotations

import dataclasses

from graphguard_hlo import ir

MAX_DEPTH = 64


def inline_calls(module: ir.Module) -> None:
  for name in list(module.functions):
    _inline_graph(module, module.functions[name], 0)


def _callee(module: ir.Module, op: ir.Op):
  if op.name != "call":
    return None
  name = str(op.attrs.get("callee", "")).lstrip("@").strip('"')
  return module.functions.get(name)


def _inline_graph(module: ir.Module, g: ir.Graph, depth: int) -> None:
  if depth > MAX_DEPTH:
    return
  new_ops: list[ir.Op] = []
  replace: dict[int, ir.Value] = {}
  for op in g.ops:
    op.operands = [replace.get(v.id, v) for v in op.operands]
    for region in op.regions:
      _inline_graph(module, region, depth + 1)
    callee = _callee(module, op)
    if callee is None or callee is g:
      new_ops.append(op)
      continue
    body = ir.Graph(callee.name)
    clone_into(module, callee, op.operands, body, op.location)
    _inline_graph(module, body, depth + 1)  # (may replace values body returns)
    new_ops.extend(body.ops)
    for r, v in zip(op.results, body.results):
      replace[r.id] = v
  g.ops = new_ops
  g.results = [replace.get(v.id, v) for v in g.results]
  # Later ops in nested regions may read replaced values too.
  if replace:
    for op in g.walk():
      op.operands = [replace.get(v.id, v) for v in op.operands]


def clone_into(module: ir.Module, callee: ir.Graph, args: list[ir.Value], into: ir.Graph,
                call_loc: ir.Location) -> list[ir.Value]:
  mapping = {p.id: a for p, a in zip(callee.params, args)}

  def clone_graph(src: ir.Graph, dst: ir.Graph) -> None:
    for op in src.ops:
      regions = []
      for r in op.regions:
        rg = ir.Graph(r.name)
        for p in r.params:
          q = module.new_value(p.type, name=p.name)
          mapping[p.id] = q
          rg.params.append(q)
        rg.param_attrs = [dict() for _ in r.params]
        rg.param_locations = list(r.param_locations)
        clone_graph(r, rg)
        regions.append(rg)
      loc = op.location if op.location.file is not None else _under(call_loc, op.location)
      new = module.add_op(dst, op.name, [mapping.get(v.id, v) for v in op.operands],
                          [r.type for r in op.results], dict(op.attrs), regions, loc)
      for old, nv in zip(op.results, new.results):
        mapping[old.id] = nv
    dst.results = [mapping.get(v.id, v) for v in src.results]

  clone_graph(callee, into)
  return into.results


def _under(call_loc: ir.Location, own: ir.Location) -> ir.Location:
  """The call's source position, and the op's name path under the call's."""
  if not own.op_name:
    return call_loc
  path = f"{call_loc.op_name}/{own.op_name}" if call_loc.op_name else own.op_name
  return dataclasses.replace(call_loc, op_name=path)
