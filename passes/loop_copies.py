"""Loops that copy a stacked input row by row: their result is that input.

Under ``value_and_grad`` the forward ``lax.scan`` saves residuals for the
backward scan by writing one row per iteration into a zero-initialized stack.
When the residual is a layer's weight slice itself (in shard_map a replicated
weight is ``pvary``'d per layer, and the pvary'd value is what is saved), the
stack is rebuilt row by row from the stacked weights, and the backward loop
reads the copy instead of the weights.  The sequential program reads the
weights.  This pass replaces uses of such a loop result by the stacked input:

    i = 0;  while i < N:  acc = dynamic_update_slice(acc, units(ds(W, [i,0..]), [i,0..]);  i += 1

with ``W`` a carry the body passes through unchanged, ``N == W.shape[0]``, the
slice one full row of ``W`` and ``units`` only dropping or inserting unit dims.
An index may also be jax's normalization of ``i``, ``select(i < 0, i + N, i)``
(a hand-written ``fori_loop``'s), which is ``i`` for 0 <= i < N.
Every row 0..N-1 of ``acc`` is overwritten with the same row of ``W``, so the
loop result is ``W`` whatever ``acc`` started as.

Under FSDP the saved row is the all-gathered weight row, ``all_gather(units(ds(W,
[i,..])), k)``: the rows of ``acc`` are then those of ``all_gather(W, k')``
(the same replica groups; ``k'`` the dim of ``W`` that grows), and the loop
result is replaced by that one all-gather of the whole stack, placed before
the loop.
"""

from __future__ import annotations

from typing import Optional

from graphguard_hlo import ir, reference
from graphguard_hlo.passes import terms
from graphguard_hlo.passes.unit_dims import only_unit_dims_change


def _invariant(body: ir.Graph, v: ir.Value) -> Optional[int]:
  """The carry index if ``v`` is a body parameter passed through unchanged."""
  for j, p in enumerate(body.params):
    if p is v:
      return j if j < len(body.results) and body.results[j] is p else None
  return None


def _splat(loop: ir.Op, body: ir.Graph, v: ir.Value) -> Optional[float]:
  """The constant ``v`` holds: a splat, or an invariant carry starting as one."""
  value = terms.splat_value(v)
  if value is not None:
    return value
  j = _invariant(body, v)
  return None if j is None else terms.splat_value(loop.operands[j])


def counter_of(loop: ir.Op) -> Optional[tuple[int, int]]:
  """(carry index, bound N) of a counter going 0, 1, ... while < N."""
  cond, body = loop.regions
  if len(cond.results) != 1 or cond.results[0].producer is None:
    return None
  cmp = cond.results[0].producer
  if cmp.name != "compare" or cmp.attrs.get("comparison_direction") != "LT":
    return None
  x, bound = cmp.operands
  n = terms.splat_value(bound)
  i = next((j for j, p in enumerate(cond.params) if p is x), None)
  held = reference.type_bounds(x.type.dtype)
  if n is None or i is None or not reference.is_integer_type(x.type.dtype) or held is None or n != int(n) \
      or not held[0] <= n <= held[1]:
    return None  # a float counter runs ceil(n) steps; a bound its type cannot reach, forever
  step = body.results[i].producer if i < len(body.results) else None
  if step is None or step.name != "add" or terms.splat_value(loop.operands[i]) != 0:
    return None
  a, b = step.operands
  if not ((a is body.params[i] and terms.splat_value(b) == 1)
          or (b is body.params[i] and terms.splat_value(a) == 1)):
    return None
  return i, int(n)


def at_counter(v: ir.Value, counter: ir.Value, n: int) -> bool:
  """``v`` is the counter (0 <= i < n in the body), as it is or as jax's
  index normalization ``select(i < 0, i + n, i)`` spells it."""
  if v is counter:
    return True
  op = v.producer
  if op is None or op.name != "select" or op.operands[2] is not counter:
    return False
  test, wrapped = op.operands[0].producer, op.operands[1].producer
  return (test is not None and test.name == "compare"
          and test.attrs.get("comparison_direction") == "LT"
          and test.operands[0] is counter and terms.splat_value(test.operands[1]) == 0
          and wrapped is not None and wrapped.name == "add"
          and {id(x) for x in wrapped.operands} >= {id(counter)}
          and any(terms.splat_value(x) == n for x in wrapped.operands))


def through_unit_dims(v: ir.Value) -> ir.Value:
  """Back through reshapes and increasing broadcasts that only change unit dims."""
  while v.producer is not None and only_unit_dims_change(
      v.producer.name, v.producer.attrs, v.producer.operands[0].type, v.type):
    v = v.producer.operands[0]
  return v


def _copied_input(loop: ir.Op, k: int, counter: int, n: int
                  ) -> Optional[tuple[int, Optional[ir.Op]]]:
  """(the invariant carry whose rows carry ``k`` is rebuilt from, the
  all-gather applied to each row or None), if it is."""
  body = loop.regions[1]
  dus = body.results[k].producer
  if dus is None or dus.name != "dynamic_update_slice" or dus.operands[0] is not body.params[k]:
    return None
  update, *starts = dus.operands[1:]
  row = through_unit_dims(update)
  gather = None
  if row.producer is not None and row.producer.name == "all_gather" and \
      len(row.producer.operands) == 1:
    gather = row.producer
    row = through_unit_dims(gather.operands[0])
  ds = row.producer
  if ds is None or ds.name != "dynamic_slice":
    return None
  w, *ds_starts = ds.operands
  src = _invariant(body, w)
  if src is None or w.shape[0] != n or update.shape[0] != 1:
    return None
  if gather is None and w.type != body.params[k].type:
    return None
  if gather is not None and _gathered_dim(gather, w, body.params[k].type) is None:
    return None
  if tuple(ds.attrs["slice_sizes"]) != (1, *w.shape[1:]):
    return None
  for idx in (starts, ds_starts):
    if not at_counter(idx[0], body.params[counter], n) or any(
        _splat(loop, body, s) != 0 for s in idx[1:]):
      return None
  return src, gather


def _gathered_dim(gather: ir.Op, w: ir.Value, stacked: ir.TensorType) -> Optional[int]:
  """The dim of ``w`` whose rows' all-gather grows it into ``stacked``: the
  one dim that differs, and the same non-unit dim the gather runs along."""
  if stacked.dtype != w.type.dtype or stacked.rank != w.type.rank:
    return None
  grown = [d for d in range(w.type.rank) if stacked.shape[d] != w.shape[d]]
  if len(grown) != 1 or grown[0] == 0:
    return None
  j = gather.attrs.get("all_gather_dimension")
  src = gather.operands[0].shape
  if j is None or src[j] == 1:
    return None
  nth = sum(1 for x in src[:j] if x != 1)  # unit-dim changes keep non-unit dims' order
  row_non_unit = [d for d in range(1, w.type.rank) if w.shape[d] != 1]
  return grown[0] if nth < len(row_non_unit) and row_non_unit[nth] == grown[0] else None


def forward_stacked_copies(module: ir.Module, graph: ir.Graph) -> int:
  """Replace uses of copying-loop results by the copied input; returns how many."""
  replace: dict[int, ir.Value] = {}
  hoisted: dict[int, list[ir.Op]] = {}  # loop -> all-gathers placed before it
  nested = 0
  for op in graph.ops:
    for region in op.regions:
      nested += forward_stacked_copies(module, region)
    if op.name != "while" or len(op.regions) != 2:
      continue
    found = counter_of(op)
    if found is None:
      continue
    counter, n = found
    for k in range(len(op.results)):
      copied = _copied_input(op, k, counter, n)
      if copied is None:
        continue
      src, gather = copied
      if gather is None:
        replace[op.results[k].id] = op.operands[src]
        continue
      dim = _gathered_dim(gather, op.operands[src], op.results[k].type)
      whole = ir.Op("all_gather", [op.operands[src]],
                    {**gather.attrs, "all_gather_dimension": dim}, [], gather.location)
      whole.results = [module.new_value(op.results[k].type, whole, 0)]
      hoisted.setdefault(id(op), []).append(whole)
      replace[op.results[k].id] = whole.results[0]
  if hoisted:
    graph.ops = [new for old in graph.ops for new in hoisted.get(id(old), []) + [old]]
  if replace:
    for op in graph.walk():
      op.operands = [replace.get(v.id, v) for v in op.operands]
    graph.results = [replace.get(v.id, v) for v in graph.results]
  return len(replace) + nested
