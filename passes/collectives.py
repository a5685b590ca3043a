"""Canonicalize collectives into a few ops over named mesh axes.

After this pass every collective of the per-device program carries
``gg.axes`` (the mesh axes its replica groups run over, or ``None`` when the
groups match no set of axes: the "wrong replica groups" bug) and, for
reductions, ``gg.reduction`` ("sum", "max", "min", "mul", or None when the
reducer body is not recognized).
"""

from __future__ import annotations

from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.sharding import axes_of_pairs, axis_renaming_of_pairs, group_axes

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")

_REDUCER_OPS = {"add": "sum", "maximum": "max", "minimum": "min", "multiply": "mul",
                "or": "max", "and": "min"}  # (or and and: of booleans only)


def reducer_kind(region: ir.Graph) -> Optional[str]:
  """"sum" for ``^bb(a, b): return add(a, b)`` and the like; None otherwise."""
  if len(region.params) != 2 or len(region.ops) != 1 or len(region.results) != 1:
    return None
  op = region.ops[0]
  if op.results[0] is not region.results[0]:
    return None
  if {id(v) for v in op.operands} != {id(p) for p in region.params}:
    return None
  if op.name in ("or", "and") and region.params[0].type.dtype not in ("pred", "i1"):
    return None  # bitwise on integers: 1 | 2 is 3, no max
  return _REDUCER_OPS.get(op.name)


def overwrites(region: ir.Graph) -> bool:
  """A scatter's combiner that keeps the update, ``^bb(a, b): return b``
  (``x.at[i].set(u)``)."""
  return (len(region.params) == 2 and not region.ops and len(region.results) == 1
          and region.results[0] is region.params[1])


def canonicalize_collectives(graph: ir.Graph, mesh: ir.Mesh) -> None:
  for op in graph.walk():
    if op.name not in COLLECTIVES:
      continue
    if op.name == "collective_permute":
      found = axes_of_pairs(op.attrs.get("source_target_pairs", ()), mesh)
      op.attrs["gg.axes"] = (found[0],) if found else None
      op.attrs["gg.permutation"] = tuple(sorted(found[1].items())) if found else None
      if not found:
        op.attrs["gg.renaming"] = axis_renaming_of_pairs(
            op.attrs.get("source_target_pairs", ()), mesh)
      continue
    groups = op.attrs.get("replica_groups")
    if not groups or groups == ((),):
      groups = (tuple(range(mesh.size)),)  # empty groups: all devices
    op.attrs["gg.axes"] = group_axes(groups, mesh)
    if op.regions:
      op.attrs["gg.reduction"] = reducer_kind(op.regions[0])
