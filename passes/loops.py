"""Loops (``lax.scan``, ``fori_loop``) by one inductive step, never by unrolling.

For a sequential ``while`` and a ``while`` of the per-device program:
  1. list how each sequential carry may relate to a per-device carry, from
     their initial values (a related value, or the same splat under any tiling
     that fits: zero-initialized gradient and residual accumulators);
  2. assume all of these at once for the bodies' parameters, run relation
     inference on the two bodies, and drop every candidate the body results do
     not re-establish by the SAME layout; repeat until nothing is dropped
     (Houdini's algorithm: what survives held initially and is kept by one
     iteration, so it is an inductive invariant);
  3. check the two conditions agree under it (same trip count);
  4. then the surviving relations hold for the loops' results, by induction
     on the trip count.  A sequential carry left without one fails the loop.
A scan over 126 identical layers is thus proved by checking one layer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from graphguard_hlo import ir
from graphguard_hlo.passes.layout import Layout, tilings_with_local_shape


@dataclasses.dataclass(frozen=True)
class CarryMatch:
  """The hypothesis: sequential carry ``seq_index`` ~ ``layout`` of per-device
  carry ``dist_index``, before and after every iteration."""
  seq_index: int
  dist_index: int
  layout: Layout


MAX_HOUDINI_ROUNDS = 8


def prove_loop(inf, op: ir.Op) -> Iterator[tuple[ir.Value, object]]:
  from graphguard_hlo.passes.inference import Relation
  failures, unmatched, partners = [], [], 0
  for candidate in _dist_loops(inf):
    hypotheses = _candidate_matches(inf, op, candidate)
    if isinstance(hypotheses, int):
      unmatched.append((hypotheses, candidate))
      continue
    proved, failure = _inductive_invariant(inf, op, candidate, hypotheses)
    if failure is None:
      inf.loop_failure = None
      partners += 1
      for m in proved:
        yield op.results[m.seq_index], Relation(
            inf.deg.of(candidate.results[m.dist_index]), m.layout, "loop-induction")
      continue  # (every partner: a bubble's loop on clamped rows may come first)
    failures.append(failure)
  if partners:
    return
  if failures:
    inf.loop_failure = failures[0]
  elif unmatched:
    # The candidate with as many carries that matched the most (one with fewer
    # carries fails past its last, which says nothing of the carry there).
    inf.loop_failure = _unmatched_carry(inf, op, *max(
        unmatched, key=lambda u: (len(u[1].operands) == len(op.operands), u[0])))


def _unmatched_carry(inf, op: ir.Op, k: int, loop: ir.Op):
  from graphguard_hlo.passes.inference import Failure
  s = op.operands[k]
  known = inf.describe(s)
  piece = getattr(inf.seq, "microbatch_pieces", {}).get(id(op))
  return Failure("while", op.location, [(f"carry {k}: {s.type}", known)],
                 f"loop carry {k} ({s.type}) starts from a value related to none of the "
                 f"initial values of the per-device loop at {loop.location}"
                 + ("" if known else " (its initial value has no relation at all)")
                 + (f"; this loop runs on {piece}, and no per-device loop there starts "
                    f"from its rows (a microbatch skipped, a stage's saved input read "
                    f"at another step, or another chunk run there?)" if piece else ""))


def _dist_loops(inf) -> list[ir.Op]:
  return [op for op in inf.dist.graph.ops if op.name == "while" and len(op.regions) == 2]


def _candidate_matches(inf, op: ir.Op, loop: ir.Op) -> list[CarryMatch] | int:
  """Every way a sequential carry may correspond to a per-device carry, judged
  by their initial values: the known relations of the sequential init, or for
  a splat init (a counter, a zero accumulator) every tiling of a per-device
  carry that starts as the same splat.  The index of the first carry without
  a candidate if there is one."""
  classes = [inf.deg.of(v) for v in loop.operands]
  matches = []
  for k, s in enumerate(op.operands):
    options = []
    if s.id in inf.splats:
      for j, d in enumerate(loop.operands):
        if inf.deg.splat(classes[j]) == inf.splats[s.id] and d.type.dtype == s.type.dtype:
          for layout in tilings_with_local_shape(s.shape, d.shape, inf.mesh):
            options.append(CarryMatch(k, j, layout))
            options.extend(CarryMatch(k, j, reordered)
                           for reordered in inf.chunk_sources.reordered(layout, s.shape))
    else:
      for r in inf.carried_relations(s):
        options.extend(CarryMatch(k, j, r.layout) for j, c in enumerate(classes) if c == r.cls)
    if not options:
      return k
    matches.extend(dict.fromkeys(options))
  zeros = {k for k, s in enumerate(op.operands) if inf.splats.get(s.id) == 0.0}
  return matches + _pinned_weakenings(matches, zeros)


def _pinned_weakenings(matches: list[CarryMatch], zeros: set[int]) -> list[CarryMatch]:
  """Each unpinned candidate also pinned at the coordinates other candidates
  are pinned at.  A pipeline stage's loop runs its rows of the layers, pinned
  to that stage, on activations every rank starts with: after one iteration
  they are the sequential ones at that stage only.  Sound: a relation that
  holds at every rank holds at some.  A carry starting as zeros on every rank
  (``zeros``, by sequential index) is also zero elsewhere: a stage's
  gradients, where the other stages' cotangents are zeros."""
  pins = {pin for m in matches for pin in m.layout.at}
  out = []
  for m in matches:
    if m.layout.at:
      continue
    for axis, coord in sorted(pins):
      if axis in m.layout.used_axes():
        continue
      for zero_elsewhere in ((False, True) if m.seq_index in zeros else (False,)):
        weaker = m.layout.with_(at=((axis, coord),), zero_elsewhere=zero_elsewhere)
        if weaker.is_valid():
          out.append(CarryMatch(m.seq_index, m.dist_index, weaker))
  return list(dict.fromkeys(out))


def _inductive_invariant(inf, op: ir.Op, loop: ir.Op, hypotheses: list[CarryMatch]):
  """Houdini: assume every candidate at once, run one iteration of both bodies,
  drop the candidates the iteration does not re-establish, repeat.  What is
  left held initially and is kept by an iteration, so it holds after any
  number of iterations.  Returns (invariant, None) or (_, Failure)."""
  from graphguard_hlo.passes.diagnose import diagnose_output
  seq_body, dist_body = op.regions[1], loop.regions[1]
  current = list(hypotheses)
  for _ in range(MAX_HOUDINI_ROUNDS):
    body = _region_inference(inf, op, loop, 1, current)
    failure = body.walk_ops()
    if failure is not None:
      return current, failure
    kept = [m for m in current if body.relates(seq_body.results[m.seq_index],
                                               dist_body.results[m.dist_index], m.layout)]
    lost = {m.seq_index for m in current} - {m.seq_index for m in kept}
    if lost:
      k = min(lost)
      m = next(m for m in current if m.seq_index == k)
      s, d = seq_body.results[k], dist_body.results[m.dist_index]
      # A sum that never came together is reported where it began (sums.py).
      f = body.deferred_failure([s]) if body.deferred_origin([s]) is not None else \
          diagnose_output(body, k, s, d, m.layout)
      f.diagnosis = (f"loop carry {k} does not keep its relation "
                     f"{m.layout.describe('carry', inf.mesh)} across one iteration: " + f.diagnosis)
      return current, f
    if kept == current:
      return current, _conditions_agree(inf, op, loop, current)
    current = kept
  return current, _too_many_rounds(op)


def _conditions_agree(inf, op: ir.Op, loop: ir.Op, invariant: list[CarryMatch]):
  """None if, under the invariant, both loop conditions compute the same
  boolean (the same trip count); else the Failure."""
  from graphguard_hlo.passes.diagnose import diagnose_output
  seq_cond, dist_cond = op.regions[0], loop.regions[0]
  cond = _region_inference(inf, op, loop, 0, invariant)
  failure = cond.walk_ops()
  if failure is None and not cond.relates(seq_cond.results[0], dist_cond.results[0],
                                          Layout.replicated(0)):
    failure = diagnose_output(cond, 0, seq_cond.results[0], dist_cond.results[0],
                              Layout.replicated(0))
    failure.diagnosis = "loop conditions differ (trip counts may differ): " + failure.diagnosis
  return failure


def _too_many_rounds(op: ir.Op):
  from graphguard_hlo.passes.inference import Failure
  return Failure("while", op.location, [], f"no loop invariant found within "
                 f"{MAX_HOUDINI_ROUNDS} rounds of pruning the carries' candidate relations")


def _invariant_carries(loop: ir.Op) -> list[int]:
  """Carries the body passes through unchanged: they hold their initial value
  in every iteration (jax passes a scan body's constants in as carries, XLA
  hoists loop-invariant index arithmetic into them)."""
  body = loop.regions[1]
  return [j for j, param in enumerate(body.params)
          if j < len(body.results) and body.results[j] is param]


def _invariant_splats(loop: ir.Op, splat_of) -> dict[int, float]:
  out = {}
  for j in _invariant_carries(loop):
    value = splat_of(loop.operands[j])
    if value is not None:
      out[j] = value
  # A loop that runs once (0 while < 1): its counter is 0 inside, and XLA
  # already substituted that (a scan over one layer).
  from graphguard_hlo.passes.loop_copies import counter_of
  counter = counter_of(loop)
  if counter is not None and counter[1] == 1:
    out[counter[0]] = 0.0
  return out


def _region_inference(inf, seq_loop: ir.Op, dist_loop: ir.Op, region: int,
                      matches: list[CarryMatch]):
  from graphguard_hlo.passes.dist_program import DistProgram
  from graphguard_hlo.passes.inference import Relation, RelationInference
  seq_region, dist_region = seq_loop.regions[region], dist_loop.regions[region]
  splats = _invariant_splats(dist_loop, lambda v: inf.deg.splat(inf.deg.of(v)))
  program = DistProgram(inf.dist.module, dist_region, inf.mesh, [], [], inf.dist.kind, splats)
  # Each Houdini round relates the same region under fewer assumptions; its
  # per-device e-graph does not depend on them, so it is built once.
  key = (id(dist_region), tuple(sorted(splats.items())))
  cached = inf.region_egraphs.get(key)
  sub = RelationInference(inf.seq_module, program, [], seq_graph=seq_region,
                          deg=cached[1] if cached else None, max_relations=inf.max_relations)
  inf.region_egraphs[key] = (dist_region, sub.deg)  # (the region keeps its id unique)
  sub.region_egraphs = inf.region_egraphs
  sub.whole_dist = inf.whole_dist
  sub.arith.aliases.update(inf.arith.aliases)  # nested loops see outer invariants
  sub.arith.aliases.update({dist_region.params[j].id: dist_loop.operands[j]
                            for j in _invariant_carries(dist_loop)})
  for j, value in _invariant_splats(seq_loop, lambda v: inf.splats.get(v.id)).items():
    sub.splats[seq_region.params[j].id] = value
  for m in matches:
    sub.add_relation(seq_region.params[m.seq_index],
                     Relation(sub.deg.of(dist_region.params[m.dist_index]), m.layout,
                              "loop-invariant"), assumed=True)
  return sub
