"""A loop that saves rows for the backward pass, copied for the readers of
its other results: the per-device program may run that loop without saving.

Under ``jax.grad`` a scanned forward loop saves each layer's input (in
``remat.py``'s normal form) for its transpose to read back.  A schedule that
takes each stage's vjp by hand (1F1B: ``jax.vjp`` per stage and step) runs a
stage's forward twice: plainly, its output sent on to the next stage, saving
nothing; and under the vjp, saving, its output unread.  The sequential loop
does both at once, so neither per-device loop is its partner: the plain one
has fewer carries, the saving one's output goes nowhere.

Where the per-device program runs, at the loop's source line, loops with
the sequential loop's carries and loops with only the carries its other
results need, the sequential loop is copied: the copy, without the saving
carries (``drop_dead_carries``), serves every reader but the saved rows';
the loop itself serves those::

    h, X = while(h0, X0)   ->   h, _ = while(h0)        (the copy: partner of the plain loop)
                                _, X = while(h0, X0)    (partner of the vjp's loop)

A loop computed twice is the same value twice: nothing changes but which
loop a reader reads (loops with effects are left alone).
"""

from __future__ import annotations

from graphguard_hlo import ir
from graphguard_hlo.passes.loop_edits import clone_op, drop_dead_carries, \
    needed_carries, replace_uses, used_ids
from graphguard_hlo.passes.terms import EFFECTS


def copy_unsaved_loops(module: ir.Module, dist: ir.Graph) -> int:
  """Copy each loop of ``module``'s main without its saving carries where
  ``dist`` runs loops of both kinds of carries (``_carry_kinds``) at its
  source line; the number of loops copied."""
  kinds: dict[str, set[tuple]] = {}
  for op in dist.walk():
    if op.name == "while":
      kinds.setdefault(str(op.location), set()).add(_carry_kinds(op))
  graph, copied = module.main, 0
  for loop in [op for op in graph.ops if op.name == "while"]:
    here = kinds.get(str(loop.location), set())
    if _carry_kinds(loop) not in here or \
        any(op.name in EFFECTS for op in loop.regions[1].walk()):
      continue
    used = used_ids(graph.ops, graph.results)
    read = {j for j, r in enumerate(loop.results) if r.id in used}
    saving = {j for j in read if j not in needed_carries(loop, read - {j})}
    if not saving or saving == read:
      continue
    copy = clone_op(module, loop, {})
    whole = list(copy.results)
    drop_dead_carries(copy, {whole[j].id for j in read - saving})
    if _carry_kinds(copy) not in here:
      continue  # no per-device loop runs without those carries: nothing to pair the copy with
    graph.ops.insert(graph.ops.index(loop) + 1, copy)
    replace_uses(graph, {loop.results[j].id: whole[j] for j in read - saving})
    copied += 1
  return copied


def _carry_kinds(loop: ir.Op) -> tuple:
  """Each carry's element type and rank: a per-device loop's are the same
  (its shapes may be tiles, or microbatches, of the sequential ones)."""
  return tuple((v.type.dtype, v.type.rank) for v in loop.operands)
