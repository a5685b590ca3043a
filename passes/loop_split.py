"""Split a sequential layer loop into the loops a pipeline's stages run.

A pipeline whose stages scan over their own layers runs, at round s, a loop of
k = N / S steps over its k rows of the stacked weights; the sequential program
scans all N rows in one loop.  No per-device loop has N steps, so ``loops.py``
finds no partner to prove the sequential loop against by induction.
Strip-mining it into N / k loops of k steps, each reading and writing its own
k rows of every stack, changes no value: the bodies see the same rows in the
same order.  Each piece then has a partner, and each is still proved by one
inductive step, never unrolled::

    i = 0; while i < N: h = f(h, ds(W, i)); Y = dus(Y, g(h), i); i += 1
 -> for s in 0 .. N/k - 1:                      (rows b = s*k .. s*k + k - 1)
      i = 0; while i < k: h = f(h, ds(W[b], i)); Y_s = dus(Y_s, g(h), i); i += 1
    Y = concat(Y_0, ..., Y_{N/k - 1})

The transposed scan of a training step runs the rows backwards, at index
N - 1 - i: its pieces take the blocks from the last, at k - 1 - i.

Only where the body reads its counter as nothing but that row index, of stacks
it reads nowhere else: rows of ones it passes through unchanged (weights,
saved activations) and one row written per step into carries it returns
(stacked outputs, gradients).  Then no value in a body depends on which piece
it runs in.  Sequential program only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.canonicalize import _fresh
from graphguard_hlo.passes.loop_copies import counter_of
from graphguard_hlo.passes.loop_edits import (clone_region, cone, invariant, replace_uses, rows,
                                              splat_at)
from graphguard_hlo.passes.terms import splat_value


@dataclasses.dataclass
class _Rows:
  """How a loop's body reads its counter: which carries it reads a row of
  (``read``) and writes a row of (``written``), and whether at i or at
  N - 1 - i (``reversed_at``: the body ops computing N - 1 - i, by position,
  with how far below N their constant is)."""
  read: set[int]
  written: set[int]
  reversed_at: list[tuple[int, int]]

  @property
  def backwards(self) -> bool:
    return bool(self.reversed_at)


def trip_counts(graph: ir.Graph) -> set[int]:
  """The trip counts of ``graph``'s counter loops (nested ones too)."""
  return {trips[1] for op in graph.walk() if op.name == "while"
          for trips in [counter_of(op)] if trips is not None}


def split_layer_loops(module: ir.Module, dist_counts: set[int]) -> int:
  """Split each loop of ``module``'s main whose trip count is none of
  ``dist_counts`` (the per-device program's, ``trip_counts``) into loops of
  the largest of them dividing it.  The number of loops split."""
  graph, split = module.main, 0
  for loop in [op for op in graph.ops if op.name == "while"]:
    trips = counter_of(loop)
    if trips is None or trips[1] in dist_counts:
      continue
    counter, n = trips
    k = max((c for c in dist_counts if 1 <= c < n and n % c == 0), default=None)
    rows = _rows_at_counter(loop, counter, n)
    if k is None or rows is None:
      continue
    _split(module, graph, loop, counter, n, k, rows)
    split += 1
  return split


def _rows_at_counter(loop: ir.Op, counter: int, n: int) -> Optional[_Rows]:
  """How the body reads its counter, if only as one row index (dim 0) of
  stacks of N rows read nowhere else; else None."""
  body = loop.regions[1]
  i = body.params[counter]
  reversed_at, index_ops = _reversed_indices(body, i, n)
  # The row index: i, or N - 1 - i (the last of each spelling); never both.
  index_ids = ({id(index_ops[at].results[0]) for at in _spelling_ends(index_ops)}
               if reversed_at else {id(i)})
  skipped = {id(body.results[counter].producer)} | {id(op) for op in index_ops}
  rows = _Rows(set(), set(), reversed_at)
  param_index = {id(p): j for j, p in enumerate(body.params)}
  live = cone(body, body.results)  # (ops left dead by earlier rewrites do not count)
  body_ops = {id(op) for op in body.ops}
  ops = [op for op in body.walk()
         if id(op) not in body_ops or any(r.id in live for r in op.results)]
  step = body.results[counter]
  if any(r is step for m, r in enumerate(body.results) if m != counter) or any(
      v is step for op in ops for v in op.operands):
    return None  # i + 1 read as a value
  row_ops: set[int] = set()
  for op in ops:
    if id(op) in skipped:
      continue
    if any(v is i for v in op.operands) and reversed_at:
      return None  # rows read both ways
    reads = [v for v in op.operands if id(v) in index_ids]
    if not reads:
      continue
    if len(reads) != 1 or id(op) not in body_ops:
      return None  # (a nested region's read, too)
    j = param_index.get(id(op.operands[0]))
    if op.name == "dynamic_slice" and id(op.operands[1]) in index_ids:
      if splat_value(op.operands[0]) is not None:
        continue  # every row of a splat is the same (a cotangent of ones)
      if j is None or op.attrs["slice_sizes"][0] != 1 or not invariant(body, j):
        return None
      rows.read.add(j)
    elif op.name == "dynamic_update_slice" and id(op.operands[2]) in index_ids:
      if j is None or op.operands[1].shape[0] != 1 or body.results[j] is not op.results[0]:
        return None
      rows.written.add(j)
    else:
      return None
    row_ops.add(id(op))
  stacks = rows.read | rows.written
  if rows.read & rows.written or any(body.params[j].shape[:1] != (n,) for j in stacks):
    return None
  # Each stack is read by its row ops alone: not whole, not by the condition,
  # not returned as another carry.
  for op in ops:
    if any(param_index.get(id(v)) in stacks and not (pos == 0 and id(op) in row_ops)
           for pos, v in enumerate(op.operands)):
      return None
  cond = loop.regions[0]
  cond_reads = {id(v) for op in cond.walk() for v in op.operands}
  if any(id(cond.params[j]) in cond_reads for j in stacks):
    return None
  if any(param_index.get(id(r)) in stacks and param_index[id(r)] != m
         for m, r in enumerate(body.results)):
    return None
  return rows


def _spelling_ends(index_ops: list[ir.Op]) -> list[int]:
  """Positions in ``index_ops`` of the ops whose result is N - 1 - i."""
  return [at for at, op in enumerate(index_ops)
          if not any(op.results[0] is v for other in index_ops for v in other.operands)]


def _reversed_indices(body: ir.Graph, i: ir.Value, n: int
                      ) -> tuple[list[tuple[int, int]], list[ir.Op]]:
  """The body's spellings of N - 1 - i: ``subtract(N - 1, i)``, or
  ``subtract(subtract(N, i), 1)`` as canonicalization leaves it.  Returns the
  positions of the ops holding N - d (with d) and the ops computing the
  index, the last of each spelling its value."""
  users: dict[int, list[ir.Op]] = {}
  for op in body.ops:
    for v in op.operands:
      users.setdefault(id(v), []).append(op)
  at, index_ops = [], []
  for pos, op in enumerate(body.ops):
    if op.name != "subtract" or op.operands[1] is not i:
      continue
    c = splat_value(op.operands[0])
    outer = users.get(id(op.results[0]), [])
    if c == n - 1:
      at.append((pos, 1))
      index_ops.append(op)
    elif (c == n and len(outer) == 1 and outer[0].name == "subtract"
          and outer[0].operands[0] is op.results[0] and splat_value(outer[0].operands[1]) == 1):
      at.append((pos, 0))
      index_ops.extend([op, outer[0]])
  return at, index_ops


def _split(module: ir.Module, graph: ir.Graph, loop: ir.Op, counter: int, n: int, k: int,
           rows: _Rows) -> None:
  at = graph.ops.index(loop)
  new_ops: list[ir.Op] = []
  carries = list(loop.operands)
  blocks = range(n // k)
  written: dict[int, list[ir.Value]] = {j: [] for j in rows.written}
  for s in (reversed(blocks) if rows.backwards else blocks):
    operands = list(carries)
    operands[counter] = loop.operands[counter]  # (0: counter_of checked it)
    for j in rows.read | rows.written:
      operands[j] = _block(module, new_ops, loop.operands[j], s * k, k, loop.location)
    piece = ir.Op("while", operands, dict(loop.attrs),
                  [_bounded_cond(module, loop.regions[0], k),
                   _piece_body(module, loop.regions[1], rows, k)], loop.location)
    _retype_blocks(piece, rows.read | rows.written, k)
    piece.results = [module.new_value(v.type, piece, r) for r, v in enumerate(operands)]
    new_ops.append(piece)
    carries = list(piece.results)
    for j in rows.read:  # the next piece takes its block of the whole stack
      carries[j] = loop.operands[j]
    for j in rows.written:
      written[j].append(piece.results[j])
  for j, pieces in written.items():
    blocks_in_order = pieces[::-1] if rows.backwards else pieces
    new_ops.append(_fresh(module, "concatenate", blocks_in_order, {"dimension": 0},
                          loop.results[j].shape, loop.results[j].type.dtype, loop.location))
    carries[j] = new_ops[-1].results[0]
  # The counter ends at N, as the loop's did.
  new_ops.append(_constant(module, n, loop.results[counter].type, loop.location))
  carries[counter] = new_ops[-1].results[0]
  graph.ops[at:at + 1] = new_ops
  replace_uses(graph, {r.id: c for r, c in zip(loop.results, carries)})


def _retype_blocks(piece: ir.Op, stacks: set[int], k: int) -> None:
  """A piece's stacks hold k rows: its regions' parameters, and the row
  writes returning them."""
  for j in stacks:
    block = piece.operands[j].type
    for region in piece.regions:
      region.params[j].type = block
    written = piece.regions[1].results[j]
    if written is not piece.regions[1].params[j]:
      written.type = block


def _piece_body(module: ir.Module, body: ir.Graph, rows: _Rows, k: int) -> ir.Graph:
  """The body, a backwards one indexing its block at k - 1 - i."""
  out = clone_region(module, body, {})
  for at, below in rows.reversed_at:
    subtract = out.ops[at]
    last = _constant(module, k - below, subtract.operands[0].type, subtract.location)
    subtract.operands[0] = last.results[0]
    out.ops.insert(0, last)
  return out


def _bounded_cond(module: ir.Module, cond: ir.Graph, k: int) -> ir.Graph:
  """``cond`` (counter < N, checked by ``counter_of``) with the bound k."""
  out = clone_region(module, cond, {})
  compare = out.results[0].producer
  bound = _constant(module, k, compare.operands[1].type, compare.location)
  out.ops.insert(0, bound)
  compare.operands[1] = bound.results[0]
  return out


def _block(module: ir.Module, ops: list[ir.Op], stack: ir.Value, start: int, k: int,
           location: ir.Location) -> ir.Value:
  """Rows start .. start + k - 1 of ``stack``; of a splat (a zero-initialized
  stack), the same splat."""
  ops.append(splat_at(module, stack, (k,) + tuple(stack.shape[1:]), location)
             or rows(module, stack, 0, start, start + k, location))
  return ops[-1].results[0]


def _constant(module: ir.Module, value: int, type: ir.TensorType,
              location: ir.Location) -> ir.Op:
  return _fresh(module, "constant", [], {"value": reference.constant_array(value, type.dtype)},
                type.shape, type.dtype, location)
