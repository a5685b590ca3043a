"""Iterative relation inference: prove the per-device program refines the
sequential one, op by op.

Walk the sequential graph in order.  Each sequential value ``s`` collects
relations ``s ~ layout of d`` to e-classes ``d`` of the per-device program.
For an op ``s = f(s1, ..., sn)`` the lemmas (``lemmas.py``) rewrite ``f``
applied to its operands' layouts into a local op ``f'(d1, ..., dn)`` and a
result layout; if the per-device e-graph holds ``f'(d1, ..., dn)`` the
relation is earned.  Every new relation is then closed under the
per-device program's collectives and rank-dependent slicing (``transfer.py``):
an all-reduce of a partial sum is a replica, a dynamic-slice at offset
``r_tp * 8`` of a replica is a tile.

Relations of all earlier values stay available, so the distributed program
may recompute from any of them.  The first sequential op on the way to an
output that gets no relation is reported, with what its operands had.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError
from graphguard_hlo.gcutil import without_cyclic_gc
from graphguard_hlo.passes import terms
from graphguard_hlo.passes.canonicalize import canonical_local_op
from graphguard_hlo.passes.chunk_order import ChunkSources, result_order
from graphguard_hlo.passes.unit_dims import only_unit_dims_change, squeeze, squeezed_variants
from graphguard_hlo.passes.collectives import reducer_kind
from graphguard_hlo.passes.constant_values import ConstantValues
from graphguard_hlo.passes.dist_egraph import DistEGraph
from graphguard_hlo.passes.dist_program import DistProgram
from graphguard_hlo.passes.layout import Layout, tilings_with_local_shape
from graphguard_hlo.passes.lemmas import (ELEMENTWISE, SeqOp, apply_lemmas, is_modelled)
from graphguard_hlo.passes.pieces import Pieces
from graphguard_hlo.passes.rank_arith import RankArithmetic
from graphguard_hlo.passes.ring_blocks import RingBlocks
from graphguard_hlo.passes.sums import SumRegrouping
from graphguard_hlo.passes.stages import stage_joins
from graphguard_hlo.passes.tile_lookup import recognize_tile_lookups
from graphguard_hlo.passes.transfer import Transfer, invertible_scale
from graphguard_hlo.passes.write_backs import WriteBacks

MAX_RELATIONS_PER_VALUE = 24
MAX_COMBINATIONS = 256


@dataclasses.dataclass(frozen=True)
class Relation:
  cls: int
  layout: Layout
  how: str  # the lemma or transfer rule that earned it


@dataclasses.dataclass
class Failure:
  op_name: str
  location: ir.Location
  inputs: list[tuple[str, list[str]]]  # operand name, its relations in words
  diagnosis: str
  output_index: Optional[int] = None
  # The ops around the failure: the sequential ops that made its operands and
  # the per-device ops that read the values related to them.
  seq_context: list[str] = dataclasses.field(default_factory=list)
  dist_context: list[str] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict:
    return {"op": self.op_name, "location": str(self.location),
            "inputs": [{"operand": n, "relations": r} for n, r in self.inputs],
            "diagnosis": self.diagnosis, "output_index": self.output_index,
            "seq_context": self.seq_context, "dist_context": self.dist_context}


@dataclasses.dataclass
class OutputRelation:
  index: int
  relation: str
  layout: Optional[Layout]


@dataclasses.dataclass
class Result:
  verdict: str                      # "refines" | "not_proved"
  outputs: list[OutputRelation]
  failure: Optional[Failure]
  stats: dict
  # ``relation_check.RelationCheck``, when the caller asked for one (API and
  # CLI's check_relations): the proof's relations held against numbers.
  relation_check: Optional[object] = None

  @property
  def refines(self) -> bool:
    return self.verdict == "refines"

  @property
  def withdrawn(self) -> bool:
    """A proof whose relations fail on numbers: a verifier bug, not to be trusted."""
    check = self.relation_check
    return self.refines and check is not None and bool(check.failures)

  def __repr__(self) -> str:
    if self.refines:
      outs = ", ".join(f"out{o.index} = {o.relation}" for o in self.outputs)
      return f"<refines: {outs}>"
    f = self.failure
    return f"<not proved at {f.op_name} ({f.location}): {f.diagnosis}>"

  def _repr_html_(self) -> str:
    import html
    if self.refines:
      rows = "".join(f"<li><code>out{o.index} = {html.escape(o.relation)}</code></li>"
                     for o in self.outputs)
      return f"<b style='color:#1a7f37'>refines</b><ul>{rows}</ul>"
    f = self.failure
    ins = "".join(f"<li><code>{html.escape(n)}</code>: {html.escape('; '.join(r) or 'no relation')}</li>"
                  for n, r in f.inputs)
    return (f"<b style='color:#cf222e'>not proved</b> at <code>{html.escape(f.op_name)}</code> "
            f"({html.escape(str(f.location))})<br>{html.escape(f.diagnosis)}<ul>{ins}</ul>")

  def to_json(self) -> dict:
    return {"verdict": self.verdict,
            "outputs": [{"index": o.index, "relation": o.relation} for o in self.outputs],
            "failure": None if self.failure is None else self.failure.to_json()}


def _value_name(v: Optional[ir.Value]) -> str:
  if v is None:
    return "%?"
  if v.producer is not None:
    return f"%{v.producer.name}.{v.id}"
  return f"%{v.name or v.id}"


def _tied_first(operands: list[ir.Value], choices: list[list]):
  """Every combination of the operands' choices, those that give one value
  read twice (``x * x``) the same choice first: the per-device program most
  likely computes ``d * d``, and a value with many relations (a pipeline
  stage's input, held by many buffer reads) would push that pair past the
  cap on combinations."""
  first = {}
  for k, v in enumerate(operands):
    first.setdefault(v.id, k)
  if len(first) == len(operands):
    yield from itertools.product(*choices)
    return
  own = [k for k, v in enumerate(operands) if first[v.id] == k]
  tied = set()
  for picks in itertools.product(*(choices[k] for k in own)):
    chosen = dict(zip(own, picks))
    combo = tuple(chosen[first[v.id]] if chosen[first[v.id]] in choices[k] else None
                  for k, v in enumerate(operands))
    if None not in combo:
      tied.add(combo)
      yield combo
  for combo in itertools.product(*choices):
    if combo not in tied:
      yield combo


def _operand_combinations_to_try(operands: list[ir.Value], choices: list[list]):
  """The first MAX_COMBINATIONS combinations of the operands' choices in
  ``_tied_first``'s order; when there are more, then up to as many again of
  those giving the operands of one rank one layout: the per-device program
  most likely computes the op on tiles laid out alike (a row written into an
  accumulator), and a loop accumulator that starts as zeros is assumed under
  every tiling of every zero carry (loops.py), which can push the pair laid
  out alike past the cap.  Only ever more than the cap alone tries, in the
  same order first, so no relation found within it is lost."""
  tried = list(itertools.islice(_tied_first(operands, choices), MAX_COMBINATIONS))
  yield from tried
  if len(tried) < MAX_COMBINATIONS:
    return
  seen = set(tried)
  alike = (c for c in _laid_out_alike(operands, choices) if c not in seen)
  yield from itertools.islice(alike, MAX_COMBINATIONS)


def _laid_out_alike(operands: list[ir.Value], choices: list[list]):
  """The combinations in which every operand of a layout's rank, if there
  are two, takes that layout (operands of other ranks, an index, take any
  choice; a splat, which adopts its neighbours' layout, stays), for each
  layout in the order the choices list them."""
  layouts = dict.fromkeys(l for choice in choices for _, l in choice if l is not None)
  ranks = collections.Counter(v.type.rank for v in operands)
  for layout in layouts:
    if ranks[layout.rank] < 2:
      continue  # no two operands to lay out alike (an index's rank)
    picks = [[c for c in choice if c[1] in (layout, None)] if v.type.rank == layout.rank
             else choice for v, choice in zip(operands, choices)]
    yield from itertools.product(*picks)



# Ops whose splat operands take their neighbours' tiling: elementwise ops, and
# a concatenation (jnp.select stacks its conditions with a splat of false).
_ADOPTING = ELEMENTWISE | {"concatenate"}


def _splat_tiled(op_name: str, k: int) -> bool:
  """May operand k of the op, a splat, take a tiling the per-device program
  holds it as a splat in?  A scatter's base (zeros of a table split by rows)
  and updates (a mean's constant cotangent, rows split like their indices);
  either operand of a matmul (the cotangent of a sum is ones, split like the
  batch it is summed over).  Elementwise ops adopt their neighbours' tilings
  instead; indices keep theirs."""
  return (op_name == "scatter" and k != 1) or op_name == "dot_general"


def _holds_of_copies(layout: Layout) -> bool:
  """Does ``layout`` relate a value to copies of it at every rank?  Not if
  the other ranks must hold zeros, the copies are summed (a max or min of
  copies is the value), or scaled: a loop's carry that starts at zero on
  every rank and is 1 after one iteration is not zero elsewhere."""
  return not layout.zero_elsewhere and layout.scale == 1.0 and \
      (not layout.partial or layout.partial_kind in ("max", "min"))

class RelationInference:
  def __init__(self, seq: ir.Module, dist: DistProgram,
               input_layouts: Optional[list[Layout]] = None,
               seq_graph: Optional[ir.Graph] = None,
               deg: Optional[DistEGraph] = None,
               max_relations: int = MAX_RELATIONS_PER_VALUE):
    self.seq_module = seq
    self.seq = seq_graph or seq.main
    self.dist = dist
    # The whole per-device program: ``dist`` is a loop's body when this
    # relates two loop bodies (loops.py); reports name its collectives.
    self.whole_dist: DistProgram = dist
    self.loop_failure: Optional[Failure] = None
    self.opaque_ops: list[ir.Op] = []  # ops only known as opaque functions
    self.on_progress = None  # called with the number of ops done, for progress bars
    self.mesh = dist.mesh
    # ``deg``: the same program's e-graph, built before (a loop body's, from
    # an earlier Houdini round).  It holds facts of the per-device program
    # alone, never of relations, so it is the same whatever is assumed.
    self.deg = deg or DistEGraph(dist.graph, dist.mesh, dist.param_splats)
    # Loop regions' e-graphs by (region, splat parameters), kept across
    # Houdini rounds and shared with nested loops (loops.py).
    self.region_egraphs: dict[tuple, tuple[ir.Graph, DistEGraph]] = {}
    self.arith = RankArithmetic(self.mesh)
    recognize_tile_lookups(dist.module, dist.graph, self.deg, self.arith, self.mesh)
    self.transfer = Transfer(self.deg, self.arith, self.mesh, dist.graph)
    self.chunk_sources = ChunkSources(dist.graph, self.mesh, self.deg.of, self.transfer.rings)
    self.write_backs = WriteBacks(dist.graph, self.mesh, self.deg.of, self.deg.splat)
    self.users = self.transfer.users
    self.relations: dict[int, list[Relation]] = {}
    # The cap on relations per value, and the values that reached it: a
    # relation dropped there may be the one a later op needs, and "not
    # proved" far from the cap would not say so (diagnose.py does).
    self.max_relations = max_relations
    self.capped: set[int] = set()
    self._transfer_memo: dict[tuple, list[Relation]] = {}
    self._step_memo: dict[tuple, list] = {}
    self._variant_memo: dict[tuple, list] = {}
    self.splats: dict[int, float] = {}
    self.input_layouts = input_layouts or dist.param_layouts
    self.constant_values = ConstantValues(
        self.seq, dist.graph, self.mesh,
        frozenset(chunks for l in self.input_layouts if l for _, chunks in l.order))
    self.lookups = 0
    self.sums = SumRegrouping(self)
    self.pieces = Pieces(self)
    self.ring_blocks = RingBlocks(self)
    self._next_term_id = -1
    # Values left unrelated on purpose (a sum not yet brought together, a
    # broadcast pieces may take in their own shapes): the op to report if a
    # reader needs them whole.
    self.deferred: dict[int, ir.Op] = {}

  # -- relations ---------------------------------------------------------------
  def add_relation(self, s: ir.Value, rel: Relation, assumed: bool = False) -> None:
    """Relate ``s`` by ``rel`` and by what follows from it.  Each value keeps
    at most ``max_relations``, except that an ``assumed`` relation (a loop's
    candidate invariant) always goes in: a hypothesis cut here could never be
    re-established, and the loop would fail for want of it."""
    work = [rel]
    while work:
      r = work.pop()
      r = Relation(self.deg.find(r.cls), r.layout, r.how)
      known = self.relations.setdefault(s.id, [])
      if any(k.cls == r.cls and k.layout == r.layout for k in known):
        continue
      if len(known) >= self.max_relations and not assumed:
        self.capped.add(s.id)
        return
      assumed = False  # ``rel`` is popped first; what follows from it is capped
      known.append(r)
      if not r.layout.order:  # reordered chunks: only data movement reads them
        self.pieces.cut(s, r)
        summed = r.layout.summed_over_pins()
        if summed is not None:
          work.append(Relation(r.cls, summed, "zero-elsewhere"))
      work.extend(self._transferred(r, r.layout.local_shape(s.shape, self.mesh)))
      if self.transfer.ring_writes_by_class:
        work.extend(self._ring_unions(s, r))

  def _transferred(self, r: Relation, tile) -> list[Relation]:
    """The relations the per-device program's data movement makes of ``r``.

    They depend on the class, layout and tile only, so they are computed once:
    identical layers hash-cons to shared classes (a RoPE table's broadcast in
    every layer is one class with a user per layer), and without the memo
    each layer would walk every layer's users again."""
    key = (r.cls, r.layout, tile)
    found = self._transfer_memo.get(key)
    if found is None:
      # Data movement never reads the sequential tensor, so a transfer holds
      # of a reordered one alike: applied without the order, which it keeps.
      order = r.layout.order
      bare = r.layout.with_(order=()) if order else r.layout
      found = list(dict.fromkeys(
          Relation(cls, layout.with_(order=order) if order else layout, how)
          for op in self.users.get(r.cls, ())
          for cls, layout, how in self.transfer.apply(op, r.cls, bare, tile)))
      if self.transfer.rings and set(r.layout.partial) & self.transfer.rings:
        found += [Relation(cls, layout.with_(order=order) if order else layout, how)
                  for cls, layout, how in self.transfer.ring_sums(r.cls, bare)]
      found += [Relation(cls, layout, "chunks-reordered")
                for cls, layout in self.chunk_sources.relations(r.cls, r.layout)]
      found += [Relation(cls, layout, "rows-written-back")
                for cls, layout in self.write_backs.relations(r.cls, r.layout, tile)]
      self._transfer_memo[key] = found
    return found

  def _ring_unions(self, s: ir.Value, r: Relation) -> list[Relation]:
    """A ring writing tiles of ``s`` into a buffer: the buffer's known tiles
    and the written one, once both are related to ``s`` (transfer.fill_union).
    Both may be of ``s`` with its chunks reordered alike: writing tiles where
    they belong is data movement, which holds of any tensor."""
    out = []
    order = r.layout.order
    for op in self.transfer.ring_writes_by_class.get(r.cls, ()):
      base, update = (self.deg.of(v) for v in op.operands[:2])
      for other in self.relations.get(s.id, ()):
        if other.layout.order != order:
          continue
        if r.cls == base and other.cls == update:
          pair = (r.layout, other.layout)
        elif r.cls == update and other.cls == base:
          pair = (other.layout, r.layout)
        else:
          continue
        union = self.transfer.fill_union(op, *(l.with_(order=()) for l in pair))
        if union is not None:
          out.append(Relation(self.deg.of(op.results[0]), union.with_(order=order),
                              "ring-buffer-fill"))
    return out

  def plain_relations(self, s: ir.Value) -> list[Relation]:
    """The relations loops and outputs read (layout.py: not rotated, not
    partly known)."""
    return [r for r in self.relations.get(s.id, ()) if r.layout.is_plain()]

  def carried_relations(self, s: ir.Value) -> list[Relation]:
    """The relations a loop carries (loops.py): the plain ones, and those
    plain but for a reordering of chunks, which no iteration changes (the
    induction holds of any relation the body re-establishes)."""
    return [r for r in self.relations.get(s.id, ()) if r.layout.with_(order=()).is_plain()]

  def whole_relations(self, s: ir.Value) -> list[Relation]:
    """The relations lemmas read: every tile they speak of is known (rotated
    tiles and a ring's diagonal blocks are; a partly filled buffer is not)."""
    return [r for r in self.relations.get(s.id, ()) if not r.layout.filled
            and not r.layout.order and not r.layout.halo]

  def lemma_relations(self, s: ir.Value) -> list[Relation]:
    """The whole relations and the haloed ones (a tile with its neighbours'
    rows, layout.py), which ``apply_lemmas`` hands only to lemmas that read
    them."""
    return self.whole_relations(s) + [r for r in self.relations.get(s.id, ())
                                      if r.layout.halo]

  def known_relations(self, s: ir.Value) -> list[Relation]:
    """The whole relations and the reordered ones (chunk_order.py): every
    tile is known, possibly of the tensor with its chunks reordered."""
    return [r for r in self.relations.get(s.id, ()) if not r.layout.filled
            and not r.layout.halo]

  def describe(self, s: ir.Value) -> list[str]:
    if s.id in self.splats:
      return [f"constant splat {self.splats[s.id]:g}"]
    return [f"{r.layout.describe(self.value_name(r.cls), self.mesh)} [{r.how}]"
            for r in self.relations.get(s.id, [])] + self.sums.describe(s) + \
        self.pieces.describe(s) + self._describe_deferred_broadcast(s)

  def deferred_broadcast_operand(self, s: ir.Value) -> Optional[ir.Value]:
    """The operand of a broadcast left for pieces to read (``walk_ops``) and
    not related on its own: what reports show in its place."""
    p = s.producer
    if (s.id in self.deferred and p is not None and p.name == "broadcast_in_dim"
        and not self.relations.get(s.id)):
      return p.operands[0]
    return None

  def _describe_deferred_broadcast(self, s: ir.Value) -> list[str]:
    x = self.deferred_broadcast_operand(s)
    if x is None:
      return []
    return [f"a broadcast of %{x.id}, left for pieces to read; "
            f"%{x.id} is " + (" or ".join(self.describe(x)[:2]) or "unrelated")]

  def new_term(self, type: ir.TensorType) -> ir.Value:
    """A value of no program: a sequential tensor ``sums.py`` or ``pieces.py``
    relates on its own (a negative id, never a sequential value's)."""
    term = ir.Value(self._next_term_id, type)
    self._next_term_id -= 1
    return term

  def term_words(self, t: ir.Value) -> str:
    """A term's (or value's) first two relations, as a report lists them."""
    return " or ".join(r.layout.describe(self.value_name(r.cls), self.mesh)
                       for r in self.whole_relations(t)[:2])

  def value_name(self, cls: int) -> str:
    """A per-device value of e-class ``cls``, as reports name it."""
    return _value_name(self.deg.value(cls))

  # -- driver ------------------------------------------------------------------
  @without_cyclic_gc
  def run(self) -> Result:
    self._bind_inputs()
    failure = self.walk_ops()
    if failure is not None:
      return Result("not_proved", [], failure, self._stats(self.processed))
    return self._check_outputs(self.processed)

  def walk_ops(self) -> Optional[Failure]:
    """Relate every live op in order; the first op left without a relation fails."""
    from graphguard_hlo.passes.diagnose import diagnose_op, held_at_different_ranks
    live = _live_ops(self.seq)
    self.processed = 0
    for op in self.seq.ops:
      if id(op) not in live:
        continue
      self.processed += 1
      if not is_modelled(op.name):
        self.opaque_ops.append(op)
      self.step(op)
      if self.on_progress is not None:
        self.on_progress(self.processed)
      unrelated = [r for r in op.results if r.id not in self.splats
                   and not self.known_relations(r) and r.id not in self.deferred
                   and not self.pieces.has(r)]
      if unrelated and all(self.constant_values.is_known(r) for r in op.results):
        # Input-free, with no counterpart yet (an iota the per-device program
        # only has folded into a table): a reader computed from it alone may
        # relate by its numbers; any other reader reports this op.
        for r in op.results:
          self.defer(r, op)
        continue
      if unrelated and self.deferred_origin(op.operands) is not None:
        pin_words = held_at_different_ranks(self, op)
        if pin_words:
          # Two stages' values meet here (a broadcast deferred for pieces
          # read with activations sent to the wrong stage): this op is the
          # first one wrong, not where the broadcast began.
          return _with_reason(diagnose_op(self, op, pin_words), self.pieces.explain(op))
        if self.pieces.computed_on_some(op) or self._whole_reader_of_a_broadcast(op):
          # A weight's broadcast left for pieces, read here on some pieces
          # (a stage that ran one microbatch with another layer's weights),
          # or with no pieces at all (a whole value the per-device program
          # computed otherwise): this op goes wrong, not the broadcast.
          return _with_reason(diagnose_op(self, op), self.pieces.explain(op))
        return self.deferred_failure(op.operands)
      if unrelated and self.pieces.splits and op.name == "broadcast_in_dim" and (
          self.whole_relations(op.operands[0]) or op.operands[0].id in self.splats):
        # Pieces read a broadcast in their own shapes (a one-hot's iota).
        self.defer(op.results[0], op)
        continue
      if unrelated and op.name == "while" and self.loop_failure is not None:
        return self.loop_failure
      if unrelated:
        return _with_reason(diagnose_op(self, op), self.pieces.explain(op))
    return None

  def _whole_reader_of_a_broadcast(self, op: ir.Op) -> bool:
    """Does ``op`` read a broadcast left for pieces (not an input-free
    constant's) beside operands none of which is cut into pieces?"""
    return any(self.deferred_broadcast_operand(v) is not None
               and not self.constant_values.is_known(v) for v in op.operands) \
        and not any(v.id in self.pieces.splits for v in op.operands)

  def defer(self, v: ir.Value, origin: ir.Op) -> None:
    """Leave ``v`` unrelated for now; if a reader needs it whole, report the
    op that began it (``origin``, or what its operands were deferred for)."""
    self.deferred[v.id] = self.deferred_origin(origin.operands) or origin

  def deferred_origin(self, values) -> Optional[ir.Op]:
    return next((self.deferred[v.id] for v in values if v.id in self.deferred), None)

  def deferred_failure(self, values) -> Failure:
    """A deferred value a reader needed whole: a sum (``sums.py``) that never
    came together, or a broadcast no piece took, reported where it began."""
    from graphguard_hlo.passes.diagnose import diagnose_op
    return _with_reason(diagnose_op(self, self.deferred_origin(values)),
                        self.sums.explain(values))

  def relates(self, s: ir.Value, d: ir.Value, layout: Layout) -> bool:
    """Is ``s ~ layout of d`` known (splats: d is the same splat, and the
    layout holds of a splat at every rank: a nonzero one is neither zero
    elsewhere, nor summed over ranks, nor scaled)?"""
    if s.id in self.splats:
      local = layout.local_shape(s.shape, self.mesh)
      if self.splats[s.id] != 0.0 and not _holds_of_copies(layout):
        return False
      return local is not None and self.deg.lookup_splat(
          self.splats[s.id], ir.TensorType(local, s.type.dtype)) == self.deg.of(d)
    target = self.deg.of(d)
    return any(r.cls == target and r.layout == layout for r in self.relations.get(s.id, []))

  def _stats(self, processed: int) -> dict:
    return {"opaque_ops": [f"{op.name} at {op.location}" for op in self.opaque_ops],
            "seq_ops": len(self.seq.ops), "seq_ops_checked": processed,
            "dist_ops": len(self.dist.graph.ops), "egraph_nodes": len(self.deg.eg),
            "lookups": self.lookups, "mesh": dict(self.mesh.axes),
            # (outputs whose layout DIST does not say: any clean one is taken)
            "undeclared_outputs": [i for i, l in enumerate(self.dist.result_layouts)
                                   if l is None]}

  def _bind_inputs(self) -> None:
    seq_params, dist_params = self.seq.params, self.dist.graph.params
    path = self.dist.module.path
    if len(seq_params) != len(dist_params):
      raise InputError(path, f"the distributed module has {len(dist_params)} parameters, "
                       f"the sequential one {len(seq_params)}: they must correspond by position")
    for i, (s, d, layout) in enumerate(zip(seq_params, dist_params, self.input_layouts)):
      if layout is None:
        layout = Layout.replicated(s.type.rank)
      if layout.rank != s.type.rank:
        raise InputError(path, f"parameter {i}: relation has rank {layout.rank}, "
                         f"the sequential parameter {s.type}")
      local = layout.local_shape(s.shape, self.mesh)
      if local != d.shape:
        raise InputError(path, f"parameter {i}: sequential {s.type} under "
                         f"{layout.describe('d', self.mesh)} gives per-device shape {local}, "
                         f"but the distributed parameter is {d.type}")
      self.add_relation(s, Relation(self.deg.of(d), layout, "input"))

  def step(self, op: ir.Op) -> None:
    if op.name == "while":
      from graphguard_hlo.passes.loops import prove_loop
      for result, rel in prove_loop(self, op):
        self.add_relation(result, rel)
      return
    if len(op.results) == 1:
      splat = terms.splat_value(op.results[0])
      if splat is None and op.name in ("broadcast_in_dim", "reshape", "copy") and \
          op.operands[0].id in self.splats:
        splat = self.splats[op.operands[0].id]
      elif splat is None and op.name in ELEMENTWISE and op.operands and all(
          v.id in self.splats for v in op.operands):
        splat = terms.fold_scalar(op.name, op.attrs, [self.splats[v.id] for v in op.operands],
                                  op.results[0].type)
      if splat is not None:
        self.splats[op.results[0].id] = splat
        return
    seq_op = self.seq_op(op)
    self._scale_by_constant(op)
    self._with_identity(op)
    if op.name == "iota":
      for cls, layout in self.transfer.offset_iotas(op.results[0].type, op.attrs):
        self.add_relation(op.results[0], Relation(cls, layout, "iota-plus-rank-offset"))
    for combo in self._operand_combinations(op, self.lemma_relations):
      layouts = [l for _, l in combo]
      for k, result in enumerate(op.results):
        rop = seq_op if k == 0 else dataclasses.replace(seq_op, result_type=result.type)
        for step in self._steps(rop, layouts):
          if not self._inits_are_identities(op, step):
            continue
          cls = self.local_class(op, combo, step, k)
          if cls is not None:
            self.add_relation(result, Relation(cls, step.layout, step.lemma))
    if any(r.layout.order for v in op.operands for r in self.relations.get(v.id, ())):
      for combo in self._operand_combinations(op, self.known_relations):
        self._step_reordered(op, seq_op, combo)
    if self.transfer.rings:
      self.ring_blocks.apply(op, seq_op)
    if op.name == "concatenate" and not self.whole_relations(op.results[0]):
      for cls, layout in stage_joins(self, op):
        self.add_relation(op.results[0], Relation(cls, layout, "stages-joined"))
      if not self.whole_relations(op.results[0]):
        self.pieces.concatenated(op)
    if op.name == "slice" and self.pieces.has(op.operands[0]):
      self.pieces.taken(op)
    if op.name == "slice" and not self.whole_relations(op.results[0]):
      self._slice_resharded(op)
    if len(op.results) == 1 and not self.whole_relations(op.results[0]):
      self.pieces.apply(op)
    if len(op.results) == 1 and not self.whole_relations(op.results[0]) \
        and not self.pieces.has(op.results[0]):
      self.sums.apply_linear(op)
    if op.name == "add" and not self.whole_relations(op.results[0]) \
        and not self.pieces.has(op.results[0]):
      self.sums.regroup_add(op)
    if len(op.results) == 1 and not self.relations.get(op.results[0].id) \
        and not self.pieces.has(op.results[0]) and op.results[0].id not in self.deferred:
      # An input-free value computed another way (a table XLA folded): by its numbers.
      for d, layout in self.constant_values.relations(op.results[0]):
        self.add_relation(op.results[0], Relation(self.deg.of(d), layout, "same-numbers"))

  def _slice_resharded(self, op: ir.Op) -> None:
    """A slice across the tiles of a split dim, which the per-device program
    reshards by passing parts of tiles between ranks: followed rank by rank
    (``RankTables.sliced``)."""
    x = op.operands[0]
    start, limit = op.attrs["start_indices"], op.attrs["limit_indices"]
    if set(op.attrs["strides"]) != {1}:
      return
    for r in self.whole_relations(x):
      l = r.layout
      if not l.is_plain() or not l.is_clean() or l.partial or not any(
          l.dims[d] and (start[d], limit[d]) != (0, n) for d, n in enumerate(x.shape)):
        continue
      tile = l.local_shape(x.shape, self.mesh)
      if tile is None:
        continue
      for cls, layout in self.transfer.rank_tables.sliced(start, limit, r.cls, l, tile):
        self.add_relation(op.results[0], Relation(cls, layout, "rank-by-rank-slice"))

  def seq_op(self, op: ir.Op) -> SeqOp:
    """What lemmas read of a sequential op, with the facts they cannot see
    for themselves: a reduce's (or scatter's, or select_and_scatter's
    scatter's) reducer, a pad's constant padding value, a scatter's
    constant base; and for a broadcast, the shapes of the per-device
    program's broadcasts of its operand (``SeqOp.tile_shapes``)."""
    attrs = dict(op.attrs)
    if op.name in ("reduce", "reduce_window", "scatter") and op.regions:
      attrs["gg.reduction"] = reducer_kind(op.regions[0])
    if op.name == "pad" and op.operands[1].id in self.splats:
      attrs["gg.padding_value"] = self.splats[op.operands[1].id]
    if op.name == "scatter" and op.operands[0].id in self.splats:
      attrs["gg.base_value"] = self.splats[op.operands[0].id]
    if op.name == "select_and_scatter":
      attrs["gg.reduction"] = reducer_kind(op.regions[1])
    return SeqOp(op.name, attrs, tuple(v.type for v in op.operands),
                 op.results[0].type if op.results else ir.TensorType((), "none"), self.mesh,
                 self.transfer.rings, self._broadcast_tiles(op))

  def _broadcast_tiles(self, op: ir.Op) -> frozenset:
    """The result shapes of the per-device broadcasts of values related to a
    broadcast's operand: the tiles its result likely has."""
    if op.name != "broadcast_in_dim":
      return frozenset()
    rank = op.results[0].type.rank
    return frozenset(tuple(user.results[0].type.shape)
                     for r in self.relations.get(op.operands[0].id, ())
                     for user in self.users.get(r.cls, ())
                     if user.name == "broadcast_in_dim" and user.results[0].type.rank == rank)

  def lemma_steps(self, op: ir.Op, layouts: list[Layout]) -> list:
    """The local ops lemmas propose for ``op`` on operands with these layouts."""
    return self._steps(self.seq_op(op), layouts)

  def _steps(self, op: SeqOp, layouts: list[Layout]) -> list:
    """The lemmas' steps for an op signature and operand layouts, memoized.

    A pure function of its key (lemmas never look at either program), so
    every layer of a stack of identical layers derives its steps once; what
    differs per layer, the per-device classes, is the hash-cons lookup after."""
    if any(l.order for l in layouts):
      return []  # lemmas read reordered chunks only through chunk_order.py
    key = (op.name, terms.attrs_key(op.attrs), op.operand_types, op.result_type,
           tuple(layouts), op.tile_shapes)
    steps = self._step_memo.get(key)
    if steps is None:
      steps = self._step_memo[key] = list(apply_lemmas(op, layouts))
    return steps

  def local_class(self, op: ir.Op, combo, step, k: int = 0) -> Optional[int]:
    """The e-class of result k of the local op ``step`` proposes for ``op`` on
    the operands in ``combo``, if the per-device program computes it."""
    children = self._children(op, combo, step)
    return None if children is None else self._lookup_local(op, combo, step, children, k)

  def _lookup_local(self, op: ir.Op, combo, step, children, k: int) -> Optional[int]:
    """The e-class of the local op a lemma proposes, in the same normal form
    the per-device program was canonicalized to."""
    operand_types = []
    for v, (_, layout) in zip(op.operands, combo):
      local = layout.local_shape(v.shape, self.mesh)
      operand_types.append(ir.TensorType(local or v.shape, v.type.dtype))
    canon = canonical_local_op(step.name or op.name, step.attrs, operand_types,
                               step.result_type)
    if canon is None:
      return children[0]
    name, attrs = canon
    head = terms.op_head(name, attrs, step.result_type, tuple(op.regions), k)
    self.lookups += 1
    found = self.deg.lookup(head, children)
    if found is not None or (op.regions and op.name != "reduce"):
      return found
    if name == "broadcast_in_dim":
      found = self._lookup_composed_broadcast(attrs, children[0], step.result_type)
      if found is not None:
        return found
    if operand_types and only_unit_dims_change(name, attrs, operand_types[0],
                                               step.result_type):
      # The operand itself is the tile, up to unit dims (unit_dims.py),
      # whether or not the device reshapes it.
      return children[0]
    # Tiles with unit dims: the device may hold them squeezed (unit_dims.py).
    child_types = tuple(self.deg.class_type(c) for c in children)
    key = (name, terms.attrs_key(attrs), tuple(operand_types), child_types, step.result_type)
    variants = self._variant_memo.get(key)
    if variants is None:  # (a pure function of the types: identical layers ask alike)
      variants = self._variant_memo[key] = list(squeezed_variants(
          name, attrs, operand_types, list(child_types), step.result_type))
    for attrs2, result_type in variants:
      self.lookups += 1
      head2 = terms.op_head(name, attrs2, result_type, tuple(op.regions), k)
      found = self.deg.lookup(head2, children)
      if found is not None:
        return found
    return None

  def _lookup_composed_broadcast(self, attrs: dict, child: int,
                                 result_type: ir.TensorType) -> Optional[int]:
    """broadcast(broadcast(x)) as the one broadcast of x the per-device
    program was canonicalized to (its broadcasts of broadcasts are composed)."""
    outer = attrs["broadcast_dimensions"]
    for node in list(self.deg.eg.nodes(child)):
      if node.op != "broadcast_in_dim" or node.head[2].rank != len(outer):
        continue  # (a class may hold the tile up to unit dims)
      inner = dict(node.head[1])["broadcast_dimensions"]
      composed = {"broadcast_dimensions": tuple(outer[d] for d in inner)}
      self.lookups += 1
      found = self.deg.lookup(terms.op_head("broadcast_in_dim", composed, result_type),
                              node.children)
      if found is not None:
        return found
    return None

  def _with_identity(self, op: ir.Op) -> None:
    """max(s, -inf), min(s, +inf), s + 0 and s - 0 are s (``jnp.max(...,
    initial=-inf)``; optax squares a real gradient's imaginary part, zeros,
    and adds it; ``jnp.logaddexp(s, 0)``, softplus, subtracts its zero, which
    XLA's simplifier drops): they relate wherever s does.  Read here rather
    than canonicalized away, since either program may hold the constant as a
    loop's invariant carry, or compute it (0 * 0)."""
    identity = {"maximum": -math.inf, "minimum": math.inf, "add": 0.0,
                "subtract": 0.0}.get(op.name)
    if identity is None or len(op.operands) != 2:
      return
    orders = [op.operands] if op.name == "subtract" else [op.operands, op.operands[::-1]]
    for s, other in orders:  # (0 - s is not s)
      c = self.splats.get(other.id)
      if op.name == "subtract" and c is not None and math.copysign(1.0, c) < 0:
        continue  # -0.0 - (-0.0) is +0.0: only s - (+0.0) is s bit for bit
      if c == identity and s.id not in self.splats:
        for r in list(self.relations.get(s.id, [])):
          self.add_relation(op.results[0], Relation(r.cls, r.layout, f"{op.name}-identity"))

  def _scale_by_constant(self, op: ir.Op) -> None:
    """s * c, s / c and -s relate wherever s does, with the scale adjusted."""
    if op.name == "negate" and op.operands[0].id not in self.splats and \
        op.results[0].type.dtype.startswith(("f", "bf")):
      for r in list(self.relations.get(op.operands[0].id, [])):
        self.add_relation(op.results[0], Relation(r.cls, r.layout.scaled(-1.0),
                                                  f"scale-by-constant({r.how})"))
      return
    if op.name not in ("multiply", "divide") or len(op.operands) != 2:
      return
    a, b = op.operands
    if op.name == "multiply" and a.id in self.splats and b.id not in self.splats:
      a, b = b, a
    c = self.splats.get(b.id)
    if not invertible_scale(c) or a.id in self.splats:
      return
    factor = c if op.name == "multiply" else 1.0 / c
    if not op.results[0].type.dtype.startswith(("f", "bf")):
      return
    for r in list(self.relations.get(a.id, [])):
      self.add_relation(op.results[0], Relation(r.cls, r.layout.scaled(factor),
                                                f"scale-by-constant({r.how})"))

  def _step_reordered(self, op: ir.Op, seq_op: SeqOp, combo) -> None:
    """``op`` on operands some of which are related with reordered chunks
    (chunk_order.py): the lemmas' steps on the layouts without their order,
    the order carried to the result, if ``op`` commutes with it."""
    layouts = [l for _, l in combo]  # a splat's too (_adopt_splat_layouts)
    if not any(l.order for l in layouts):
      return
    order = result_order(op, [None if r == "splat" else l for r, l in combo],
                         Pieces.constant_along)
    if order is None:
      return
    for step in self._steps(seq_op, [l.with_(order=()) for l in layouts]):
      if not self._inits_are_identities(op, step):
        continue
      cls = self.local_class(op, combo, step)
      if cls is not None:
        self.add_relation(op.results[0], Relation(
            cls, step.layout.with_(order=order), f"reordered-chunks({step.lemma})"))

  def _operand_combinations(self, op: ir.Op, relations_of=None):
    """Each operand's (relation, layout) choices, combined; ``relations_of``
    (default ``whole_relations``) gives a value's relations."""
    relations_of = relations_of or self.whole_relations
    choices = []
    for k, v in enumerate(op.operands):
      if v.id in self.splats:
        choices.append([("splat", None)] + ([("splat", l) for l in self._splat_tilings(v)]
                                             if _splat_tiled(op.name, k) else []))
      else:
        rels = relations_of(v)
        if not rels:
          return
        choices.append([(r, r.layout) for r in rels])
    if op.name in ELEMENTWISE:
      for k, v in enumerate(op.operands):
        if v.id not in self.splats:
          choices[k] = choices[k] + self._scalar_broadcast_tilings(v, choices, k)
    for combo in _operand_combinations_to_try(op.operands, choices):
      yield self._adopt_splat_layouts(op, list(combo))

  def _scalar_broadcast_tilings(self, v: ir.Value, choices, k: int) -> list:
    """A replicated scalar broadcast to ``v`` is every rank's tile under any
    tiling: give it the tilings of its neighbours in an elementwise op.  Its
    lemma's tilings of the new dims are many (every order of every subset of
    the axes per dim) and are cut at MAX_RELATIONS_PER_VALUE, so the one a
    neighbour needs may be missing (optax's clip divides every gradient, tiled
    its own way, by the broadcast global norm)."""
    spread = terms.scalar_of_broadcast(v)
    if spread is None:
      return []
    scalars = [r for r in self.whole_relations(spread) if r.layout.is_plain()
               and r.layout.is_clean() and not r.layout.partial and not r.layout.at]
    known = {(r.cls, l) for r, l in choices[k] if r != "splat"}
    out = []
    for j, choice in enumerate(choices):
      for r, l in choice if j != k else ():
        if l is None or l.rank != v.type.rank or not l.is_plain():
          continue
        tiling = Layout(l.dims)
        local = tiling.local_shape(v.shape, self.mesh)
        if local is None:
          continue
        head = terms.op_head("broadcast_in_dim", {"broadcast_dimensions": ()},
                             ir.TensorType(local, v.type.dtype))
        for scalar in scalars:
          self.lookups += 1
          cls = self.deg.lookup(head, (scalar.cls,))
          if cls is not None and (cls, tiling) not in known:
            known.add((cls, tiling))
            out.append((Relation(cls, tiling, "broadcast-of-replicated-scalar"), tiling))
    return out

  def _splat_tilings(self, v: ir.Value) -> list[Layout]:
    """The tilings of splat ``v`` whose tile the per-device program holds as a
    splat (a scatter's base: zeros of a table split by rows; its updates: the
    constant cotangent of a mean, rows split like their indices)."""
    out = []
    for t in self.deg.splat_types(self.splats[v.id], v.type.dtype):
      if t.shape != v.shape:
        out.extend(tilings_with_local_shape(v.shape, t.shape, self.mesh, limit=4))
    return out

  def _adopt_splat_layouts(self, op: ir.Op, combo):
    """A splat tiles any way: give it the tiling of its non-splat neighbours
    (unless a tiling was chosen for it)."""
    non_splat = [l for r, l in combo if r != "splat"]
    model = non_splat[0] if non_splat else None
    out = []
    for (r, l), v in zip(combo, op.operands):
      if r == "splat" and l is not None:
        out.append((r, l))
        continue
      if r == "splat":
        if op.name in _ADOPTING and model is not None and v.type.rank == model.rank:
          l = Layout(model.dims)
        else:
          l = Layout.replicated(v.type.rank)
        # Zeros are also a partial sum (or max) of zeros, at any scale: a pad or
        # select with 0 keeps its neighbours' partial sums and scale.  (Not a reduce's
        # init: that is the reduction's identity, added once per rank.)
        summed = next((m for m in non_splat if m.partial or not m.is_clean()), None)
        if self.splats[v.id] == 0.0 and summed is not None and op.name != "reduce":
          l = l.with_(partial=summed.partial, partial_kind=summed.partial_kind,
                      scale=summed.scale)
        # Zeros are zero at every rank: pinned anywhere, zero elsewhere.
        pinned = next((m for m in non_splat if m.zero_elsewhere), None)
        if self.splats[v.id] == 0.0 and pinned is not None:
          l = l.with_(at=pinned.at, zero_elsewhere=True)
      out.append((r, l))
    return out

  def _children(self, op: ir.Op, combo, step) -> Optional[tuple[int, ...]]:
    # An elementwise op's splat pairs with its other operands element by
    # element: the device may hold their tiles with other unit dims
    # (unit_dims.py), its splats too.  Any other op reads its operands' shapes
    # (a dynamic_update_slice's update: a row or a column): the tile's own.
    elementwise = op.name in ELEMENTWISE
    partners = {self.deg.class_type(r.cls) for r, _ in combo
                if r != "splat"} if elementwise else None
    children = []
    for v, (r, l) in zip(op.operands, combo):
      if r == "splat":
        local = l.local_shape(v.shape, self.mesh)
        if local is None:
          return None
        local = ir.TensorType(local, v.type.dtype)
        cls = self._splat_class(self.splats[v.id], local, partners) if elementwise else \
            self.deg.lookup_splat(self.splats[v.id], local)
        if cls is None:
          return None
        children.append(cls)
      else:
        children.append(r.cls)
    return tuple(children)

  def _splat_class(self, value: float, local: ir.TensorType, partners) -> Optional[int]:
    """An elementwise op's per-device splat of ``value`` shaped as the tile,
    or as the tile up to unit dims: a piece of ``x + 0.5`` has the
    sequential shape, a pipeline stage's tile one more unit dim, and so has
    its splat.  Of the splats equal up to unit dims, one shaped as a partner
    operand first, then the tile's own shape."""
    found = self.deg.lookup_splat(value, local)
    if found is not None and local in partners:
      return found  # (the common case, one lookup)
    alike = [t for t in self.deg.splat_types(value, local.dtype) if squeeze(t) == squeeze(local)]
    best = min(alike, key=lambda t: (t not in partners, t != local), default=None)
    return None if best is None else self.deg.lookup_splat(value, best)

  def _inits_are_identities(self, op: ir.Op, step) -> bool:
    """A reduction split over ranks adds its init once per rank, and a scaled
    one adds it scaled: then it must be the identity."""
    if op.name != "reduce" or (not step.layout.partial and step.layout.is_clean()):
      return True
    return inits_are_identities(self.splats, op, step.layout.partial_kind)

  # -- outputs -------------------------------------------------------------------
  def _check_outputs(self, processed: int) -> Result:
    outputs = []
    dist = self.dist
    if len(self.seq.results) != len(dist.graph.results):
      raise InputError(dist.module.path, f"the distributed module returns "
                       f"{len(dist.graph.results)} values, the sequential one "
                       f"{len(self.seq.results)}")
    for i, (s, d) in enumerate(zip(self.seq.results, dist.graph.results)):
      declared = dist.result_layouts[i] if i < len(dist.result_layouts) else None
      target = self.deg.of(d)
      if s.id in self.splats:
        local = (declared or Layout.replicated(s.type.rank)).local_shape(s.shape, self.mesh)
        if local and self.deg.lookup_splat(self.splats[s.id],
                                           ir.TensorType(local, s.type.dtype)) == target:
          outputs.append(OutputRelation(i, f"constant {self.splats[s.id]:g}", declared))
          continue
      ok = [r for r in self.plain_relations(s) if r.cls == target and r.layout.is_clean()
            and not r.layout.partial and not r.layout.at
            and (declared is None or r.layout.with_(scale=1.0) == declared)]
      if not ok and self.deferred_origin([s]) is not None:
        return Result("not_proved", outputs, self.deferred_failure([s]),
                      self._stats(processed))
      if not ok:
        from graphguard_hlo.passes.diagnose import diagnose_output
        failure = diagnose_output(self, i, s, d, declared, dist.graph.results)
        return Result("not_proved", outputs, failure, self._stats(processed))
      outputs.append(OutputRelation(i, ok[0].layout.describe(f"out{i}", self.mesh), ok[0].layout))
    return Result("refines", outputs, None, self._stats(processed))


def _with_reason(failure: Failure, why: str) -> Failure:
  """``failure`` with ``why`` (what pieces or sums say of it) put first."""
  return dataclasses.replace(failure, diagnosis=f"{why}; {failure.diagnosis}") if why \
      else failure


def inits_are_identities(splats: dict[int, float], op: ir.Op, kind: str) -> bool:
  """Are a reduce's inits splats of the identity of ``kind`` (sum, max, min)?"""
  identity = {"sum": (0.0,), "max": (-math.inf,), "min": (math.inf,)}.get(kind)
  if identity is None:
    return False
  for init in op.operands[len(op.operands) // 2:]:
    value = splats.get(init.id)
    if value is None or (value not in identity and not (kind != "sum" and abs(value) >= 3.0e38)):
      return False
  return True


def _live_ops(g: ir.Graph) -> set[int]:
  """Ops whose results reach an output: dead sequential code need not be matched."""
  producer_of = {id(r): op for op in g.ops for r in op.results}
  live: set[int] = set()
  stack = [producer_of.get(id(v)) for v in g.results]
  while stack:
    op = stack.pop()
    if op is None or id(op) in live:
      continue
    live.add(id(op))
    stack.extend(producer_of.get(id(v)) for v in op.operands)
  return live


@without_cyclic_gc
def verify_programs(seq: ir.Module, dist: DistProgram,
                    input_layouts: Optional[list[Layout]] = None,
                    max_relations: int = MAX_RELATIONS_PER_VALUE) -> Result:
  return RelationInference(seq, dist, input_layouts, max_relations=max_relations).run()
