"""Hold every inferred relation against numbers: a guard on the verifier itself.

Run the sequential program on random inputs and the per-device program on
every rank with those inputs laid out by the input relations (the reference
interpreter, ``interpret.py``), then, for each relation ``s ~ layout of d``
the inference earned, rebuild ``s`` from the ranks' values of ``d`` by the
layout (``layout.assemble``) and compare.  A wrong lemma, transfer rule,
normalization rule or canonicalization shows up as a relation that does not
hold, at the first value where it goes wrong.  Values of one e-class must
agree too (the e-graph's equalities).

Relations are claims about every input, so random inputs can only refute
them; a run where all hold is evidence, not proof.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from graphguard_hlo import ir, reference
from graphguard_hlo.interpret import Interpreter, Unsupported, mesh_coords
from graphguard_hlo.passes.layout import Layout, assemble, shard

RTOL = 2e-3
# bfloat16 values hold 8 significant bits: a sum rounded before or after it is
# added over the ranks differs by a few units in the last place (2^-8 each),
# and so does every float32 value computed from it.  A program with any
# bfloat16 value is checked to this tolerance throughout.
RTOL_BF16 = 2e-2
INT_HIGH = 8  # integer inputs (token ids, labels) are drawn from [0, INT_HIGH)


@dataclasses.dataclass
class RelationCheck:
  checked: int = 0          # relations held against numbers
  unknown: int = 0          # relations on values the interpreter could not compute
  classes_checked: int = 0  # e-classes with several values, all agreeing
  zeros_checked: int = 0    # per-device values known zero at some ranks (zeros.py)
  failures: list[str] = dataclasses.field(default_factory=list)
  rtol: float = RTOL        # the relative tolerance the numbers were held to
  skipped: str = ""         # why nothing was checked (a mesh the interpreter cannot run)
  # The run the relations were held on: the sequential program's inputs, and
  # the per-device program's inputs and outputs, each a list over its ranks.
  # A caller that can run the original distributed program (XLA's, from the
  # JAX function) holds the per-device program against it: relations are
  # checked on the *prepared* program, and cannot see a preparation that
  # changed what it computes.
  seq_inputs: list = dataclasses.field(default_factory=list, repr=False)
  dist_inputs: list = dataclasses.field(default_factory=list, repr=False)
  dist_outputs: list = dataclasses.field(default_factory=list, repr=False)

  @property
  def ok(self) -> bool:
    return not self.failures and not self.skipped


def random_value(t: ir.TensorType, rng: np.random.Generator) -> np.ndarray:
  if t.dtype in ("pred", "i1"):
    return rng.integers(0, 2, t.shape).astype(bool)
  if reference.is_integer_type(t.dtype):  # (in its own type: u64 meets u64 constants)
    return reference.cast(rng.integers(0, INT_HIGH, t.shape), t.dtype)
  return rng.standard_normal(t.shape) * 0.5


def close(got: np.ndarray, want: np.ndarray, rtol: float) -> bool:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    return False
  scale = max(1.0, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)))
  return bool(np.allclose(got, want, rtol=rtol, atol=rtol * scale, equal_nan=True))


def check_relations(inference, seed: int = 0, nonnegative: Sequence[int] = ()) -> RelationCheck:
  """``inference``: a ``RelationInference`` that has run.  ``nonnegative``:
  parameters drawn as magnitudes (Adam's second moments: negative ones make
  NaNs downstream, and NaN matches NaN, which would check nothing)."""
  rng = np.random.default_rng(seed)
  mesh = inference.mesh
  out = RelationCheck()
  try:
    coords = mesh_coords(mesh)
  except Unsupported as e:
    out.skipped = f"cannot simulate the mesh: {e}"
    return out
  seq_graph, dist_graph = inference.seq, inference.dist.graph
  if any(v.type.dtype == "bf16" for op in seq_graph.walk() for v in op.results):
    out.rtol = RTOL_BF16
  seq_inputs, dist_inputs = [], []
  for i, p in enumerate(seq_graph.params):
    x = random_value(p.type, rng)
    if i in nonnegative:
      x = np.abs(x)
    layout = inference.input_layouts[i] if i < len(inference.input_layouts) else None
    layout = layout or Layout.replicated(p.type.rank)
    local = shard(layout, mesh, x, rng)
    seq_inputs.append([x])
    dist_inputs.append([np.asarray(local[c]).astype(x.dtype) for c in coords])
  seq_env = Interpreter(1).run(seq_graph, seq_inputs)
  dist_env = Interpreter(len(coords)).run(dist_graph, dist_inputs)
  out.seq_inputs = [x for [x] in seq_inputs]
  out.dist_inputs = dist_inputs
  out.dist_outputs = [dist_env.get(r.id) for r in dist_graph.results]

  seq_values = {p.id: p for p in seq_graph.params}
  seq_values.update({r.id: r for op in seq_graph.ops for r in op.results})
  members = inference.deg.members()
  for sid, rels in inference.relations.items():
    s = seq_values.get(sid)
    if s is None:
      continue  # a loop body's value: checked by its loop's relations
    for r in rels:
      d = members.get(inference.deg.find(r.cls), [None])[0]
      if sid not in seq_env or d is None or d.id not in dist_env:
        out.unknown += 1
        continue
      problem = _relation_problem(s, seq_env[sid][0], r.layout, dist_env[d.id], mesh, coords,
                                  out.rtol)
      out.checked += 1
      if problem:
        out.failures.append(f"{_name(s)} ~ {r.layout.describe(_name(d))} [{r.how}]: {problem}")
  _check_pieces(inference, seq_values, seq_env, dist_env, members, coords, out)
  _check_classes(members, dist_env, out)
  _check_zeros(inference, members, dist_env, coords, out)
  return out


def _nan(x: np.ndarray) -> np.ndarray:
  return np.isnan(x) if x.dtype.kind in "fc" else np.zeros(x.shape, bool)


def _check_zeros(inference, members, dist_env, coords, out: RelationCheck) -> None:
  """Every value the zero dataflow (``passes/zeros.py``) says is zero at some
  ranks is zero there.  NaN elements are not counted against it: the facts
  are read in real arithmetic (``0 * x = 0``), and a device that computes
  ``0 * NaN`` (an online softmax's rescale of a wholly masked row, a seeded
  bug) is outside it."""
  zeros = inference.transfer.zeros
  axes = [name for name, _ in inference.mesh.axes]
  for cls, values in members.items():
    facts = zeros.of(cls)
    known = [v for v in values if v.id in dist_env]
    if not facts or not known:
      continue
    out.zeros_checked += 1
    for pattern in facts:
      at = dict(pattern)
      for rank, c in enumerate(coords):
        x = np.asarray(dist_env[known[0].id][rank])
        if all(c[axes.index(a)] == k for a, k in at.items()) and \
            np.any((x != 0) & ~_nan(x)):
          out.failures.append(f"{_name(known[0])} is not zero at rank {dict(zip(axes, c))} "
                              f"(zeros.py: zero at {at or 'every rank'})")
          break


def _check_pieces(inference, seq_values, seq_env, dist_env, members, coords,
                  out: RelationCheck) -> None:
  """Each microbatch piece of a split value (``passes/pieces.py``) against the
  rows of the sequential value it stands for: piece m of every rank's tile
  along the split dim, rank by rank."""
  mesh = inference.mesh
  for sid, split in inference.pieces.splits.items():
    s = seq_values.get(sid)
    if s is None or sid not in seq_env:
      continue
    whole = np.asarray(seq_env[sid][0])
    tile = sum(split.sizes)
    offsets = np.cumsum((0,) + split.sizes)
    for m, term in enumerate(split.terms):
      rows = [j * tile + r for j in range(whole.shape[split.dim] // tile)
              for r in range(offsets[m], offsets[m + 1])]
      want = np.take(whole, rows, axis=split.dim)
      for r in inference.relations.get(term.id, ()):
        d = members.get(inference.deg.find(r.cls), [None])[0]
        if d is None or d.id not in dist_env:
          out.unknown += 1
          continue
        problem = _relation_problem(term, want, r.layout, dist_env[d.id], mesh, coords,
                                    out.rtol)
        out.checked += 1
        if problem:
          out.failures.append(f"piece {m} of {_name(s)} ~ {r.layout.describe(_name(d))} "
                              f"[{r.how}]: {problem}")


def _relation_problem(s: ir.Value, want: np.ndarray, layout: Layout, per_rank: list,
                      mesh: ir.Mesh, coords, rtol: float) -> Optional[str]:
  tile = layout.local_shape(s.shape, mesh)
  if tile is None:
    return "the layout does not tile the sequential shape"
  local_at = {}
  for c, x in zip(coords, per_rank):
    x = np.asarray(x)
    if x.size != int(np.prod(tile)):
      return f"per-device value has {x.size} elements, the tile {tuple(tile)}"
    local_at[c] = x.reshape(tile)  # relations hold up to unit dims
  try:
    got = assemble(layout, mesh, local_at)
  except AssertionError:
    return "ranks that should hold the same tile disagree"
  if not layout.is_plain():  # a ring's blocks: only the known tiles are claimed
    known = ~np.isnan(np.asarray(got, np.float64))
    got, want = np.asarray(got)[known], np.asarray(want)[known]
  if not close(got, want, rtol):
    err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    return f"does not hold (max abs difference {err:.3g})"
  return None


def _check_classes(members, dist_env, out: RelationCheck) -> None:
  for cls, values in members.items():
    known = [v for v in values if v.id in dist_env]
    if len(known) < 2:
      continue
    first = known[0]
    for v in known[1:]:
      for a, b in zip(dist_env[first.id], dist_env[v.id]):
        if np.size(a) != np.size(b) or not close(np.reshape(b, np.shape(a)), a, out.rtol):
          out.failures.append(f"e-class {cls}: {_name(first)} and {_name(v)} differ")
          break
    out.classes_checked += 1


def _name(v: ir.Value) -> str:
  return f"%{v.producer.name}.{v.id}" if v.producer is not None else f"%{v.name or v.id}"


class ProofWithdrawn(RuntimeError):
  """A proof whose relations fail on numbers: a bug in graphguard-hlo, not in
  the programs, so the verdict "refines" cannot be trusted."""

  def __init__(self, check: RelationCheck):
    self.check = check
    super().__init__(f"the proof's relations fail on numbers ({len(check.failures)} of "
                     f"{check.checked}); the verdict 'refines' is withdrawn. First: "
                     f"{check.failures[0]}. Please report this pair.")


def checked(inference, seed: int = 0):
  """``inference.run()``'s result with its relations held against numbers
  (``result.relation_check``); raises ``ProofWithdrawn`` if it refines and
  some relation fails."""
  result = inference.run()
  result.relation_check = check_relations(inference, seed)
  if result.withdrawn:
    raise ProofWithdrawn(result.relation_check)
  return result


def verify_and_check(seq: ir.Module, dist: ir.Module, seed: int = 0,
                     input_layouts: Optional[list[Layout]] = None,
                     nonnegative: Sequence[int] = (), relation: Optional[str] = None):
  """(Result, RelationCheck) for two loaded modules.  ``relation``:
  relation-file text applied on top of the derived input layouts."""
  from graphguard_hlo.passes.inference import RelationInference
  from graphguard_hlo.pipeline import prepare_dist, prepare_seq
  program = prepare_dist(dist)
  prepare_seq(seq, program)
  if relation is not None:
    from graphguard_hlo.relation_file import relation_layouts
    input_layouts = relation_layouts(relation, seq, program)
  inference = RelationInference(seq, program, input_layouts)
  result = inference.run()
  return result, check_relations(inference, seed, nonnegative)
