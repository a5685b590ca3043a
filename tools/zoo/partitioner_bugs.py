"""Seeded bugs for GSPMD programs: one instruction of XLA's per-device module
edited.

Under ``jax.jit`` with shardings XLA's partitioner writes the collectives, so
the user cannot get them wrong; a wrong per-device program then comes from
the partitioner itself (or from a dump edited by hand).  These bugs reach the
verifier as such a program would reach ``gg-hlo-verify``: XLA's HLO text
right after spmd-partitioning, with one instruction changed.

The ground truth is the reference interpreter (``graphguard_hlo/interpret.py``)
running the edited module on every rank, on each rank's shards of the
inputs: it follows the module's own replica groups, and shares nothing with
the passes it checks.  ``run_partitioned`` runs the unedited module the same
way, so the harness itself is checked against jax's run.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import numpy as np

from graphguard_hlo import ir

_ALL_REDUCE = re.compile(r"^(\s*(?:ROOT )?%\S+ = [^=]*?) all-reduce\((%[^,()]+)\), (.*)$")
_METADATA = re.compile(r"metadata=\{[^{}]*\}")
# XLA's three spellings of replica groups: listed, a mesh and its axes, an iota.
# (A mesh's device ids may be an iota with its own transpose: ``([2,2,2]T(0,2,1))``.)
_GROUPS = re.compile(r"replica_groups=(\{\{[^=]*?\}\}|\{\}|mesh\[[^\]]*\]"
                     r"(?:, device_ids=\((?:[^()]|\([^()]*\))*\))?"
                     r" \{[^}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")


@dataclasses.dataclass(frozen=True)
class Edit:
  """A change to XLA's per-device HLO text, named for what it does."""
  words: str
  apply: Callable[[str], str]


def _edit_nth(text: str, found: Callable[[list[str]], list[int]], nth: int, what: str,
              rewrite: Callable[[str], str]) -> str:
  """``text`` with the ``nth`` of the lines ``found`` picks (negative: from
  the end) rewritten; ``what`` names them in the error if there is none."""
  lines = text.split("\n")
  picked = found(lines)
  if not -len(picked) <= nth < len(picked):
    raise ValueError(f"the module has {len(picked)} {what}s; no {what} {nth}")
  i = picked[nth]
  lines[i] = rewrite(lines[i])
  return "\n".join(lines)


def _all_reduces(lines: list[str]) -> list[int]:
  return [i for i, line in enumerate(lines) if _ALL_REDUCE.match(line)]


def drop_all_reduce(nth: int) -> Edit:
  """The ``nth`` all-reduce (in text order) becomes a copy of its operand:
  each rank keeps its partial sum (a missing aggregation)."""
  def rewrite(line: str) -> str:
    head, operand, rest = _ALL_REDUCE.match(line).groups()
    metadata = _METADATA.search(rest)
    return f"{head} copy({operand})" + (f", {metadata.group(0)}" if metadata else "")
  return Edit(f"all-reduce {nth} dropped",
              lambda text: _edit_nth(text, _all_reduces, nth, "all-reduce", rewrite))


def _collectives(kind: str) -> Callable[[list[str]], list[int]]:
  """A finder of the lines of ``kind`` collectives (``all-reduce``,
  ``all-gather``, ...)."""
  pattern = re.compile(rf"^\s*(?:ROOT )?%\S+ = [^=]*? {re.escape(kind)}\(")
  return lambda lines: [i for i, line in enumerate(lines) if pattern.match(line)]


def regroup(kind: str, nth: int, groups: tuple[tuple[int, ...], ...]) -> Edit:
  """The ``nth`` ``kind`` collective (in text order) runs over ``groups`` of
  devices instead of its own: another mesh axis (wrong replica groups), or
  its own devices in another order (an all-gather then concatenates the
  tiles in that order)."""
  text_groups = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"

  def rewrite(line: str) -> str:
    line, n = _GROUPS.subn(f"replica_groups={text_groups}", line, count=1)
    if n != 1:
      raise ValueError(f"{kind} {nth} has no replica groups to replace: {line}")
    return line
  return Edit(f"{kind} {nth} over {text_groups}",
              lambda text: _edit_nth(text, _collectives(kind), nth, kind, rewrite))


_RANK_TABLE = re.compile(r"^(\s*%\S+ = s32\[\d+\]\{0\} constant\(\{)([0-9, ]+)(\}\).*)$")


def _rank_tables(lines: list[str]) -> list[int]:
  """Lines of the integer constants XLA indexes by partition id to find a
  rank's tile: 0, k, 2k, ... (one entry per partition or per axis rank)."""
  found = []
  for i, line in enumerate(lines):
    m = _RANK_TABLE.match(line)
    values = [int(v) for v in m.group(2).split(",")] if m else []
    if len(values) > 1 and values[1] > 0 and values == list(range(0, values[1] * len(values),
                                                                   values[1])):
      found.append(i)
  return found


def rotate_rank_table(nth: int) -> Edit:
  """The ``nth`` table of tile offsets (in text order) rotated by one: each
  rank reads the tile of the next (a wrong shard offset)."""
  def rewrite(line: str) -> str:
    head, values, rest = _RANK_TABLE.match(line).groups()
    values = values.split(", ")
    return head + ", ".join(values[1:] + values[:1]) + rest
  return Edit(f"rank table {nth} rotated by one",
              lambda text: _edit_nth(text, _rank_tables, nth, "rank table", rewrite))


def partitioned_text(case) -> str:
  """XLA's per-device HLO text of a GSPMD case, with the case's edit made."""
  from graphguard_hlo.xla_partition import partitioned_hlo_text
  lowered = jax.jit(case.dist_fn, in_shardings=case.in_shardings,
                    out_shardings=case.out_shardings).lower(*case.dist_args)
  text = partitioned_hlo_text(lowered)
  return text if case.dist_edit is None else case.dist_edit.apply(text)


def load_partitioned(case) -> ir.Module:
  from graphguard_hlo.loaders import load_module_bytes
  name = f"<{case.name}>.hlo.txt"
  return load_module_bytes(name, partitioned_text(case).encode())


def run_partitioned_per_rank(case, inputs) -> tuple[list[list], list[list]]:
  """The case's per-device module (edited, if it has an edit) run on every
  rank by the reference interpreter on that rank's shards of ``inputs``:
  (each input's shards, each output's values), listed by rank."""
  from graphguard_hlo.interpret import Interpreter
  from graphguard_hlo.passes.inline import inline_calls
  devices = list(case.mesh.devices.flat)
  # Partition k runs on the k-th device of the mesh (XLA's device assignment).
  assert [d.id for d in devices] == list(range(len(devices))), "mesh devices out of order"
  module = load_partitioned(case)
  inline_calls(module)
  graph = module.main
  assert len(graph.params) == len(inputs), (len(graph.params), len(inputs))
  per_rank = []
  for x, a in zip(inputs, case.dist_args):
    index = a.sharding.devices_indices_map(np.shape(x))
    per_rank.append([np.asarray(x)[index[d]] for d in devices])
  env = Interpreter(len(devices)).run(graph, per_rank)
  for k, result in enumerate(graph.results):
    if result.id not in env:
      raise ValueError(f"the interpreter could not compute output {k} of {case.name}")
  return per_rank, [env[r.id] for r in graph.results]


def run_partitioned(case, inputs):
  """The outputs of the case's per-device module (edited, if it has an edit),
  run on every rank by the reference interpreter on that rank's shards of
  ``inputs``, put together as the output shardings lay them out."""
  devices = list(case.mesh.devices.flat)
  _, per_rank = run_partitioned_per_rank(case, inputs)
  seq_out = jax.eval_shape(case.seq_fn, *case.seq_args)
  shapes, tree = jax.tree.flatten(seq_out)
  shardings = jax.tree.leaves(case.out_shardings) if isinstance(
      case.out_shardings, (tuple, list)) else [case.out_shardings] * len(shapes)
  outputs = []
  for shape, sharding, values in zip(shapes, shardings, per_rank):
    out = np.zeros(shape.shape, shape.dtype)
    written = np.zeros(shape.shape, bool)
    for d, index in sharding.devices_indices_map(shape.shape).items():
      tile = values[devices.index(d)]
      # Ranks holding one replica must agree: where they do not, no output
      # is right (NaN matches nothing the sequential program gives).
      differs = written[index] & ~np.isclose(out[index], tile, rtol=1e-5, atol=1e-6)
      out[index] = np.where(differs, np.nan, tile)
      written[index] = True
    outputs.append(out)
  return jax.tree.unflatten(tree, outputs)
