"""Saved residuals recomputed where they are read: scan's ways of saving for
the backward pass, brought to one normal form.

Under ``value_and_grad`` a ``lax.scan``'s forward loop saves, per layer, the
values its backward loop needs: one row per iteration of a zero-initialized
stack, which the backward loop reads back row by row.  Which values are saved
is jax's choice, and the two programs need not agree: ``jax.checkpoint``
(remat) saves a layer's input and what its policy allows, and recomputes the
rest; without it the activations themselves are saved; and partial
evaluation may pick different values in the two bodies (a per-device body
with all-gathers in it saves a layernorm's centred input where the
sequential one saves a projection).  A stack saved by one program and not
the other leaves a loop carry without a counterpart.

This pass rewrites both programs to full remat: the forward loop saves the
carries its saved rows are computed from (a layer's input), and every read of
another saved row ``j`` in a later loop becomes its recomputation from rows
``j`` of those, as ``jax.checkpoint`` would; the stacks, unread, then leave
both loops (``drop_dead_carries``)::

    F: i = 0; while i < N: ...; S = dus(S, h(c, ds(W, i)), i); c = ...
    B: while ...: ... ds(S, j) ...
  ->
    F: i = 0; while i < N: ...; X = dus(X, c, i); c = ...
    B: while ...: ... h(ds(X, j), ds(W, j)) ...

Why it is an identity: F writes every row 0..N-1 of S and X exactly once (its
counter runs 0..N-1 and indexes the row), at iteration i with that
iteration's values; so row j of S is h of rows j of X and W for every j, and
dynamic slices clamp j alike on stacks of N rows.  The counter may only index
rows; ops with effects and loops are never copied.  (Tested on the reference
interpreter against jax's own runs, ``tests/test_remat.py``.)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from graphguard_hlo import ir, reference
from graphguard_hlo.passes import terms
from graphguard_hlo.passes.canonicalize import _fresh
from graphguard_hlo.passes.loop_edits import (NOT_COPIED, add_carry, clone_op, drop_dead_carries,
                                              invariant, replace_uses, used_ids)
from graphguard_hlo.passes.loop_copies import at_counter, counter_of, through_unit_dims


@dataclasses.dataclass
class _Recipe:
  """How to recompute row i of a saved stack from rows i of others.

  ``ops``: the forward body's ops to copy, in order.  ``rows``: values of the
  body that are rows of outer stacks, ``{id: (outer stack, value)}`` (a
  dynamic slice of a stacked input at the counter, or a value another stack
  saves).  ``outer``: invariant parameters, ``{id: outer value}``.
  ``result``: the update written into the stack, shaped as one row of it.
  """
  ops: list[ir.Op]
  rows: dict[int, tuple[ir.Value, ir.Value]]
  outer: dict[int, ir.Value]
  result: ir.Value


def _is_row_slice(op: ir.Op, stack: ir.Value) -> bool:
  """``op`` is ``dynamic_slice(stack, [j, 0, ...])`` of one whole row (the
  callers say which ``j``)."""
  return (op.name == "dynamic_slice" and op.operands[0] is stack
          and stack not in op.operands[1:] and all(terms.is_zero(s) for s in op.operands[2:])
          and tuple(op.attrs.get("slice_sizes", ())) == (1, *stack.shape[1:]))


def _saved_rows(loop: ir.Op, counter: int, n: int) -> dict[int, ir.Value]:
  """Carries the body writes one whole row of, at the counter: {k: the row}."""
  body = loop.regions[1]
  out = {}
  for k, result in enumerate(body.results):
    dus = result.producer
    if dus is None or dus.name != "dynamic_update_slice" or dus.operands[0] is not body.params[k]:
      continue
    stack, update, first, *rest = dus.operands
    if at_counter(first, body.params[counter], n) and all(terms.is_zero(s) for s in rest) and \
        stack.shape[:1] == (n,) and update.shape == (1, *stack.shape[1:]):
      out[k] = update
  return out


def _recipe(loop: ir.Op, update: ir.Value, counter: int, n: int,
            rows_of: dict[int, int]) -> tuple[Optional[_Recipe], set[int]]:
  """How ``update`` (a row written at iteration i) is computed from rows i:
  searched back to ``rows_of`` (body values that are rows of saved stacks,
  {value id: carry}), invariant values and row slices of stacked inputs.
  Returns (the recipe or None, the carries it reads that no stack saves)."""
  body = loop.regions[1]
  params = {p.id: j for j, p in enumerate(body.params)}
  in_body = {id(op) for op in body.ops}
  rows: dict[int, tuple[ir.Value, ir.Value]] = {}
  outer: dict[int, ir.Value] = {}
  unsaved: set[int] = set()
  needed: set[int] = set()  # ids of the ops to copy
  todo, seen, copyable = [update], set(), True
  while todo:
    v = todo.pop()
    if v.id in seen:
      continue
    seen.add(v.id)
    if v.id in rows_of and v is not update:
      rows[v.id] = (loop.results[rows_of[v.id]], v)
      continue
    if v.id in params:
      j = params[v.id]
      if invariant(body, j):
        outer[v.id] = loop.operands[j]
      elif j == counter:
        copyable = False  # the layer's number used as a value
      else:
        unsaved.add(j)
      continue
    op = v.producer
    if op is None or id(op) not in in_body:
      continue  # captured from outside the loop: the same value everywhere
    source = op.operands[0] if op.operands else None
    if source is not None and source.id in params and invariant(body, params[source.id]) \
        and source.shape[:1] == (n,) and _is_row_slice(op, source) \
        and at_counter(op.operands[1], body.params[counter], n):
      rows[v.id] = (loop.operands[params[source.id]], v)
      continue
    if op.name in NOT_COPIED:
      copyable = False
      continue
    needed.add(id(op))
    todo.extend(op.operands)
    for region in op.regions:  # values a nested body captures
      todo.extend(x for inner in region.walk() for x in inner.operands)
  if not copyable or unsaved:
    return None, unsaved if copyable else set()
  return _Recipe([op for op in body.ops if id(op) in needed], rows, outer, update), set()


def _rows_of(saved: dict[int, ir.Value]) -> dict[int, int]:
  out: dict[int, int] = {}
  for k, update in saved.items():
    out.setdefault(update.id, k)
    out.setdefault(through_unit_dims(update).id, k)
  return out


def _recipes(module: ir.Module, graph: ir.Graph, loop: ir.Op, counter: int, n: int
             ) -> dict[int, _Recipe]:
  """The saved stacks to recompute, {carry: recipe}; saves, as new stacks,
  the carries they are computed from that no stack saves yet."""
  saved = _saved_rows(loop, counter, n)
  if not saved:
    return {}
  body = loop.regions[1]
  params = {p.id: j for j, p in enumerate(body.params) if not invariant(body, j)}
  as_is = {params[through_unit_dims(u).id] for u in saved.values() if through_unit_dims(u).id in params}
  carries: set[int] = set()
  for update in saved.values():
    carries |= _recipe(loop, update, counter, n, {})[1]
  # (A row read off another saved stack's state stays saved: a stack of stacks
  # would be no normal form.)
  for j in sorted(carries - as_is - set(saved)):
    _save_carry(module, graph, loop, j, counter, n)
  saved = _saved_rows(loop, counter, n)
  rows_of = _rows_of({k: u for k, u in saved.items() if through_unit_dims(u).id in params})
  out = {}
  for k, update in saved.items():
    if through_unit_dims(update).id not in params:
      recipe, _ = _recipe(loop, update, counter, n, rows_of)
      if recipe is not None:
        out[k] = recipe
  return out


# -- editing loops -------------------------------------------------------------

def _constant(module: ir.Module, dtype: str, value, location) -> ir.Op:
  return _fresh(module, "constant", [], {"value": reference.constant_array(value, dtype)}, (),
                dtype, location)


def _view(module: ir.Module, loop: ir.Op, outer: ir.Value) -> ir.Value:
  """The body parameter of ``loop`` holding ``outer`` unchanged; a new
  invariant carry if there is none."""
  body = loop.regions[1]
  for j, v in enumerate(loop.operands):
    if v is outer and invariant(body, j):
      return body.params[j]
  param, _ = add_carry(module, loop, outer)
  body.results.append(param)
  return param


def _save_carry(module: ir.Module, graph: ir.Graph, loop: ir.Op, j: int, counter: int,
                n: int) -> None:
  """Add a stack saving carry ``j``'s value at every iteration, row by row."""
  body = loop.regions[1]
  value = body.params[j]
  dtype, where = value.type.dtype, loop.location
  zero = _constant(module, dtype, 0, where)
  zeros = _fresh(module, "broadcast_in_dim", [zero.results[0]], {"broadcast_dimensions": ()},
                 (n, *value.shape), dtype, where)
  at = graph.ops.index(loop)
  graph.ops[at:at] = [zero, zeros]
  stack, _ = add_carry(module, loop, zeros.results[0])
  row = _fresh(module, "broadcast_in_dim", [value],
               {"broadcast_dimensions": tuple(range(1, value.type.rank + 1))},
               (1, *value.shape), dtype, where)
  index = body.params[counter]
  start = _constant(module, index.type.dtype, 0, where)
  write = _fresh(module, "dynamic_update_slice",
                 [stack, row.results[0], index] + [start.results[0]] * value.type.rank, {},
                 stack.shape, dtype, where)
  body.ops.extend([row, start, write])
  body.results.append(write.results[0])


class _RowsAt:
  """Recomputations in a later loop's body at one row index: each forward
  op is copied once, however many saved rows read it."""

  def __init__(self, module: ir.Module, later: ir.Op, index: ir.Value, location):
    self.module, self.later, self.index, self.location = module, later, index, location
    self.mapping: dict[int, ir.Value] = {}
    self.ops: list[ir.Op] = []
    self.zero: Optional[ir.Value] = None

  def _row(self, stack: ir.Value, like: ir.Value) -> ir.Value:
    if self.zero is None:
      self.ops.append(_constant(self.module, self.index.type.dtype, 0, self.location))
      self.zero = self.ops[-1].results[0]
    source = _view(self.module, self.later, stack)
    row = _fresh(self.module, "dynamic_slice",
                 [source, self.index] + [self.zero] * (stack.type.rank - 1),
                 {"slice_sizes": (1, *stack.shape[1:])}, (1, *stack.shape[1:]),
                 stack.type.dtype, self.location)
    self.ops.append(row)
    if row.results[0].type == like.type:
      return row.results[0]
    self.ops.append(_fresh(self.module, "reshape", [row.results[0]], {}, like.shape,
                           like.type.dtype, self.location))
    return self.ops[-1].results[0]

  def value(self, recipe: _Recipe) -> ir.Value:
    for v_id, outer in recipe.outer.items():
      if v_id not in self.mapping:
        self.mapping[v_id] = _view(self.module, self.later, outer)
    for v_id, (stack, v) in recipe.rows.items():
      if v_id not in self.mapping:
        self.mapping[v_id] = self._row(stack, v)
    for op in recipe.ops:
      if op.results[0].id not in self.mapping:
        self.ops.append(clone_op(self.module, op, self.mapping))
    return self.mapping[recipe.result.id]


def _row_reads(later: ir.Op, j: int) -> Optional[list[ir.Op]]:
  """The ops of ``later``'s body reading invariant carry ``j``, if every one
  is a slice of one whole row (and its condition does not read it)."""
  cond, body = later.regions
  param = body.params[j]
  if not invariant(body, j) or any(param in op.operands for op in cond.walk()):
    return None
  reads = []
  for op in body.ops:
    if param in op.operands:
      if not _is_row_slice(op, param):
        return None
      reads.append(op)
    elif any(param in inner.operands for region in op.regions for inner in region.walk()):
      return None
  return reads


def _recompute_reads(module: ir.Module, loop: ir.Op, recipes: dict[int, _Recipe],
                     later: ir.Op) -> int:
  """Replace ``later``'s row reads of the stacks ``recipes`` rebuild; returns how many."""
  body = later.regions[1]
  reads: list[tuple[ir.Op, _Recipe]] = []
  for k, recipe in recipes.items():
    for j, v in enumerate(list(later.operands)):
      if v is loop.results[k]:
        reads.extend((op, recipe) for op in _row_reads(later, j) or ())
  at: dict[int, _RowsAt] = {}
  replace: dict[int, ir.Value] = {}
  for read, recipe in reads:
    index = read.operands[1]
    rows = at.setdefault(index.id, _RowsAt(module, later, index, read.location))
    replace[read.results[0].id] = rows.value(recipe)
  # Each index's recomputation goes right after the index is computed (it
  # reads only the index, invariant carries and constants).
  after: dict[int, list[ir.Op]] = {}
  first: list[ir.Op] = []
  for rows in at.values():
    producer = rows.index.producer
    if producer is not None and any(op is producer for op in body.ops):
      after.setdefault(id(producer), []).extend(rows.ops)
    else:
      first.extend(rows.ops)
  body.ops = first + [new for op in body.ops for new in [op] + after.get(id(op), [])]
  replace_uses(body, replace)
  return len(reads)


# -- the pass ------------------------------------------------------------------

def rematerialize_saved_rows(module: ir.Module, graph: ir.Graph) -> int:
  """Rewrite reads of saved rows in ``graph`` (and nested bodies) to
  recomputations; returns how many reads were rewritten."""
  count = sum(rematerialize_saved_rows(module, region)
              for op in graph.ops for region in op.regions)
  loops = [op for op in graph.ops if op.name == "while" and len(op.regions) == 2]
  touched = []
  for i, loop in enumerate(loops):
    found = counter_of(loop)
    if found is None:
      continue
    carries = len(loop.operands)
    recipes = _recipes(module, graph, loop, *found)
    if len(loop.operands) != carries:
      touched.append(loop)  # it saves a carry now: dropped again if unread
    for later in loops[i + 1:]:
      done = _recompute_reads(module, loop, recipes, later) if recipes else 0
      if done:
        count += done
        touched.extend([loop, later])
  changed = bool(touched)
  while changed:  # a later loop's dead carry can leave an earlier one's dead
    changed = False
    for loop in reversed(loops):
      if loop in touched:
        changed |= bool(drop_dead_carries(loop, used_ids(graph.ops, graph.results)))
  return count
