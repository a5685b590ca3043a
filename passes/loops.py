"""Loops (``lax.scan``, ``fori_loop``) by one inductive step, never by unrolling.

For a sequential ``while`` and a ``while`` of the per-device program:
  1. guess how each sequential carry relates to a per-device carry, from the
     relations of their initial values (the counter is a replica of the counter);
  2. assume those relations for the bodies' parameters and run relation
     inference on the two bodies: each sequential body result must relate to
     the matching per-device body result by the SAME layout (the step keeps the
     invariant), and the two conditions must agree (same trip count);
  3. then the relations hold for the loops' results, by induction on the trip
     count.
A scan over 126 identical layers is thus proved by checking one layer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from graphguard_hlo import ir
from graphguard_hlo.passes import terms
from graphguard_hlo.passes.layout import Layout


@dataclasses.dataclass(frozen=True)
class CarryMatch:
  seq_index: int
  dist_index: int
  layout: Layout


def prove_loop(inf, op: ir.Op) -> Iterator[tuple[ir.Value, object]]:
  from graphguard_hlo.passes.inference import Relation
  failures = []
  for candidate in _dist_loops(inf):
    matches = _match_carries(inf, op, candidate)
    if matches is None:
      continue
    failure = _inductive_step(inf, op, candidate, matches)
    if failure is None:
      inf.loop_failure = None
      for m in matches:
        yield op.results[m.seq_index], Relation(
            inf.deg.of(candidate.results[m.dist_index]), m.layout, "loop-induction")
      return
    failures.append(failure)
  if failures:
    inf.loop_failure = failures[0]


def _dist_loops(inf) -> list[ir.Op]:
  return [op for op in inf.dist.graph.ops if op.name == "while" and len(op.regions) == 2]


def _match_carries(inf, op: ir.Op, loop: ir.Op) -> Optional[list[CarryMatch]]:
  """Each sequential carry's per-device counterpart, from the initial values."""
  classes = [inf.deg.of(v) for v in loop.operands]
  matches, taken = [], set()
  for k, s in enumerate(op.operands):
    options = []
    if s.id in inf.splats:
      for j, d in enumerate(loop.operands):
        if terms.splat_value(d) == inf.splats[s.id] and d.type == s.type:
          options.append((j, Layout.replicated(s.type.rank)))
    else:
      for r in inf.relations.get(s.id, []):
        options.extend((j, r.layout) for j, c in enumerate(classes) if c == r.cls)
    options.sort(key=lambda o: o[0] in taken)
    if not options:
      return None
    j, layout = options[0]
    taken.add(j)
    matches.append(CarryMatch(k, j, layout))
  return matches


def _region_inference(inf, seq_region: ir.Graph, dist_region: ir.Graph,
                      matches: list[CarryMatch]):
  from graphguard_hlo.passes.dist_program import DistProgram
  from graphguard_hlo.passes.inference import Relation, RelationInference
  program = DistProgram(inf.dist.module, dist_region, inf.mesh, [], [], inf.dist.kind)
  sub = RelationInference(inf.seq_module, program, [], seq_graph=seq_region)
  for m in matches:
    sub.add_relation(seq_region.params[m.seq_index],
                     Relation(sub.deg.of(dist_region.params[m.dist_index]), m.layout,
                              "loop-invariant"))
  return sub


def _inductive_step(inf, op: ir.Op, loop: ir.Op, matches: list[CarryMatch]):
  """None if the bodies keep every carry's relation and the conditions agree;
  else the Failure to report (inside the loop body)."""
  from graphguard_hlo.passes.diagnose import diagnose_output
  seq_cond, seq_body = op.regions
  dist_cond, dist_body = loop.regions
  cond = _region_inference(inf, seq_cond, dist_cond, matches)
  failure = cond.walk_ops()
  if failure is None and not cond.relates(seq_cond.results[0], dist_cond.results[0],
                                          Layout.replicated(0)):
    failure = diagnose_output(cond, 0, seq_cond.results[0], dist_cond.results[0],
                              Layout.replicated(0))
    failure.diagnosis = "loop conditions differ (trip counts may differ): " + failure.diagnosis
  if failure is not None:
    return failure
  body = _region_inference(inf, seq_body, dist_body, matches)
  failure = body.walk_ops()
  if failure is not None:
    return failure
  for m in matches:
    s, d = seq_body.results[m.seq_index], dist_body.results[m.dist_index]
    if not body.relates(s, d, m.layout):
      f = diagnose_output(body, m.seq_index, s, d, m.layout)
      f.diagnosis = (f"loop carry {m.seq_index} does not keep its relation "
                     f"{m.layout.describe('carry')} across one iteration: " + f.diagnosis)
      return f
  return None
