"""Ring loops of the per-device program, unrolled.

Ring attention and ring exchanges are written in two ways: a Python loop
over the ring's steps (jax traces it flat) or ``lax.fori_loop`` / ``lax.scan``
over them (a ``while`` whose body passes the block in hand to the next rank).
The sequential program has no such loop, so there is no loop of its own to
prove the ring's one against by induction (loops.py), and what a carry holds
changes every step (the block of rank r - t at step t) where Houdini's
candidates are fixed layouts.  So the ring loop is unrolled into the form a
Python loop gives, and everything that reads rings (ring_blocks.py, the ring
forms of canonicalize.py, rank arithmetic on the now constant step) applies.

A loop is unrolled when it is one: a counter runs 0, 1, ... < N with N a
constant (``loop_copies.counter_of``) of at most ``MAX_STEPS``, and some
carry's next value is what a ``collective_permute``
sends round the ring (the block in hand, or a pipeline stage's output; under
GSPMD a copy of it, the sharding constraint on the state it rolls on).  A
scan over layers is never one: a layer's output is computed, not received.
Also unrolled: a counter
loop of the same N at the same source line as a ring loop.  jax makes such
loops of one when it transposes it (a ring gather's transpose runs the steps
backwards, a ring reduce-scatter) and when it differentiates a scan over
layers holding one (what each step computes from the rank and the step
alone, ring attention's block masks, is hoisted out of the layers' loop into
a loop of its own, stacked per step).  Unrolling costs N copies of the body,
the same as the Python loop would have; it is sound for any loop.
"""

from __future__ import annotations

from typing import Optional

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.inline import clone_into
from graphguard_hlo.passes.loop_copies import counter_of
from graphguard_hlo.passes.splice import splice


# A ring runs as many steps as it has ranks (or one less); a pipeline's
# schedule M + S - 1.  Past this, the copies would cost more than they tell.
MAX_STEPS = 64


def unroll_ring_loops(module: ir.Module) -> int:
  """Unroll every ring loop in ``module`` (nested ones too), and the loops
  jax split off them; how many."""
  split_off = set()
  for g in module.functions.values():
    for op in g.walk():
      trips = _ring_trips(op)
      if trips is not None and op.location.file is not None:
        split_off.add(_line_and_trips(op, trips))
  return sum(_unroll_in(module, g, split_off) for g in module.functions.values())


def _line_and_trips(op: ir.Op, trips: tuple[int, int]):
  return op.location.file, op.location.line, op.location.column, trips[1]


def _unroll_in(module: ir.Module, graph: ir.Graph, split_off: set) -> int:
  def unrolled(op: ir.Op):
    trips = _ring_trips(op)
    if trips is None and op.name == "while" and len(op.regions) == 2:
      counter = counter_of(op)
      if counter is not None and _line_and_trips(op, counter) in split_off:
        trips = counter
    if trips is None:
      return None
    copies = ir.Graph(graph.name)
    carries = _unroll(module, op, trips, copies)
    return copies.ops, carries
  return splice(graph, unrolled)


def _ring_trips(op: ir.Op) -> Optional[tuple[int, int]]:
  """(counter carry, trip count) if ``op`` is a ring loop."""
  if op.name != "while" or len(op.regions) != 2:
    return None
  counter = counter_of(op)
  if counter is None:
    return None
  sends_on = any(sender is not None and sender.name == "collective_permute"
                 and sender.attrs.get("source_target_pairs")
                 for sender in map(_producer_past_copies, op.regions[1].results))
  return counter if sends_on and counter[1] <= MAX_STEPS else None


def _producer_past_copies(v: ir.Value) -> Optional[ir.Op]:
  """The op computing ``v``, read through copies (a GSPMD sharding
  constraint on the state a pipeline rolls on is a copy of the permute)."""
  op = v.producer
  while op is not None and op.name == "copy":
    op = op.operands[0].producer
  return op


def _unroll(module: ir.Module, loop: ir.Op, trips: tuple[int, int], into: ir.Graph
            ) -> list[ir.Value]:
  """Copies of ``loop``'s body, one per step with the counter a constant, into
  ``into``: the loop's results."""
  counter, n = trips
  body = loop.regions[1]
  carries = list(loop.operands)
  for t in range(n):
    carries[counter] = _constant(module, into, t, body.params[counter].type, loop.location)
    carries = list(clone_into(module, body, carries, into, loop.location))
  if n > 0:
    carries[counter] = _constant(module, into, n, body.params[counter].type, loop.location)
  return carries


def _constant(module: ir.Module, graph: ir.Graph, value: int, type: ir.TensorType,
              location: ir.Location) -> ir.Value:
  return module.add_op(graph, "constant", [], [type],
                       {"value": reference.constant_array(value, type.dtype)}, [],
                       location).results[0]
