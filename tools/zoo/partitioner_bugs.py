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
_GROUPS = re.compile(r"replica_groups=(\{\{[^=]*?\}\}|\{\}|mesh\[[^\]]*\](?:, device_ids=\([^)]*\))?"
                     r" \{[^}]*\})")


@dataclasses.dataclass(frozen=True)
class Edit:
  """A change to XLA's per-device HLO text, named for what it does."""
  words: str
  apply: Callable[[str], str]


def _nth_all_reduce(lines: list[str], nth: int) -> int:
  """The line of the ``nth`` single-operand all-reduce (negative: from the end)."""
  found = [i for i, line in enumerate(lines) if _ALL_REDUCE.match(line)]
  if not -len(found) <= nth < len(found):
    raise ValueError(f"the module has {len(found)} single-operand all-reduces; no all-reduce {nth}")
  return found[nth]


def drop_all_reduce(nth: int) -> Edit:
  """The ``nth`` all-reduce (in text order) becomes a copy of its operand:
  each rank keeps its partial sum (a missing aggregation)."""
  def apply(text: str) -> str:
    lines = text.split("\n")
    i = _nth_all_reduce(lines, nth)
    head, operand, rest = _ALL_REDUCE.match(lines[i]).groups()
    metadata = _METADATA.search(rest)
    lines[i] = f"{head} copy({operand})" + (f", {metadata.group(0)}" if metadata else "")
    return "\n".join(lines)
  return Edit(f"all-reduce {nth} dropped", apply)


def regroup_all_reduce(nth: int, groups: tuple[tuple[int, ...], ...]) -> Edit:
  """The ``nth`` all-reduce sums over ``groups`` of devices instead of its own
  (wrong replica groups: another mesh axis)."""
  text_groups = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"

  def apply(text: str) -> str:
    lines = text.split("\n")
    i = _nth_all_reduce(lines, nth)
    lines[i], n = _GROUPS.subn(f"replica_groups={text_groups}", lines[i], count=1)
    if n != 1:
      raise ValueError(f"all-reduce {nth} has no replica groups to replace: {lines[i]}")
    return "\n".join(lines)
  return Edit(f"all-reduce {nth} over {text_groups}", apply)


_RANK_TABLE = re.compile(r"^(\s*%\S+ = s32\[\d+\]\{0\} constant\(\{)([0-9, ]+)(\}\).*)$")


def _rank_tables(lines: list[str]) -> list[int]:
  """Lines of the integer constants XLA indexes by partition id to find a
  rank's tile: 0, k, 2k, ... (one entry per partition or per axis rank)."""
  found = []
  for i, line in enumerate(lines):
    m = _RANK_TABLE.match(line)
    if m:
      values = [int(v) for v in m.group(2).split(",")]
      step = values[1] - values[0] if len(values) > 1 else 0
      if len(values) > 1 and step > 0 and values == list(range(0, step * len(values), step)):
        found.append(i)
  return found


def rotate_rank_table(nth: int) -> Edit:
  """The ``nth`` table of tile offsets (in text order) rotated by one: each
  rank reads the tile of the next (a wrong shard offset)."""
  def apply(text: str) -> str:
    lines = text.split("\n")
    tables = _rank_tables(lines)
    if not -len(tables) <= nth < len(tables):
      raise ValueError(f"the module has {len(tables)} rank tables; no rank table {nth}")
    i = tables[nth]
    head, values, rest = _RANK_TABLE.match(lines[i]).groups()
    values = values.split(", ")
    lines[i] = head + ", ".join(values[1:] + values[:1]) + rest
    return "\n".join(lines)
  return Edit(f"rank table {nth} rotated by one", apply)


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


def run_partitioned(case, inputs):
  """The outputs of the case's per-device module (edited, if it has an edit),
  run on every rank by the reference interpreter on that rank's shards of
  ``inputs``, put together as the output shardings lay them out."""
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
  seq_out = jax.eval_shape(case.seq_fn, *case.seq_args)
  shapes, tree = jax.tree.flatten(seq_out)
  shardings = jax.tree.leaves(case.out_shardings) if isinstance(
      case.out_shardings, (tuple, list)) else [case.out_shardings] * len(shapes)
  outputs = []
  for k, (shape, sharding, result) in enumerate(zip(shapes, shardings, graph.results)):
    if result.id not in env:
      raise ValueError(f"the interpreter could not compute output {k} of {case.name}")
    out = np.zeros(shape.shape, shape.dtype)
    written = np.zeros(shape.shape, bool)
    for d, index in sharding.devices_indices_map(shape.shape).items():
      tile = env[result.id][devices.index(d)]
      # Ranks holding one replica must agree: where they do not, no output
      # is right (NaN matches nothing the sequential program gives).
      differs = written[index] & ~np.isclose(out[index], tile, rtol=1e-5, atol=1e-6)
      out[index] = np.where(differs, np.nan, tile)
      written[index] = True
    outputs.append(out)
  return jax.tree.unflatten(tree, outputs)
