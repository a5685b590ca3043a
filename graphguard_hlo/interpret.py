"""A reference interpreter for the IR: one program, or one per-device program
run on every rank of a mesh at once (SPMD), collectives included.

It is the ground truth the relation checker (``relation_check.py``) holds
inferred relations against, so it follows the modules' own attributes
(replica groups, source-target pairs, partition ids), never the passes'
canonical ``gg.*`` annotations it is meant to check.  Ops it cannot run
(sorts, gathers, custom calls, ...) leave their results, and everything
computed from them, unknown.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.collectives import overwrites, reducer_kind

Env = dict[int, list[np.ndarray]]  # value id -> its value on each rank

_COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "mul": np.multiply}
_MAX_TRIPS = 10_000


class Unsupported(Exception):
  pass


class Interpreter:
  """Runs graphs on ``ranks`` ranks; rank ``k`` is partition id ``k``."""

  def __init__(self, ranks: int = 1):
    self.ranks = ranks

  def run(self, graph: ir.Graph, inputs: Sequence[Sequence[np.ndarray]]) -> Env:
    """``inputs[i][k]`` is parameter ``i`` on rank ``k``; returns every value
    that could be computed."""
    env: Env = {p.id: [np.asarray(x) for x in xs] for p, xs in zip(graph.params, inputs)}
    self._run_ops(graph, env)
    return env

  # -- graphs ----------------------------------------------------------------
  def _run_ops(self, graph: ir.Graph, env: Env) -> None:
    self.run_ops(graph.ops, env)

  def run_ops(self, ops: Sequence[ir.Op], env: Env) -> None:
    """Runs ``ops``, in order, adding what they compute to ``env`` (a part of
    a graph, its inputs given)."""
    for op in ops:
      if any(v.id not in env for v in op.operands):
        continue  # an input is unknown
      try:
        outs = self._op(op, [env[v.id] for v in op.operands], env)
      except (Unsupported, NotImplementedError, KeyError, ValueError, IndexError):
        continue
      for r, per_rank in zip(op.results, outs):
        env[r.id] = per_rank

  def _region(self, region: ir.Graph, args: list[list[np.ndarray]], outer: Env
              ) -> list[list[np.ndarray]]:
    env = dict(outer)
    env.update({p.id: a for p, a in zip(region.params, args)})
    self._run_ops(region, env)
    if any(v.id not in env for v in region.results):
      raise Unsupported("region result unknown")
    return [env[v.id] for v in region.results]

  # -- ops -------------------------------------------------------------------
  def _op(self, op: ir.Op, args: list[list[np.ndarray]], env: Env) -> list[list[np.ndarray]]:
    name = op.name
    if name == "while":
      return self._while(op, args, env)
    if name == "partition_id":
      return [[np.array(k, np.uint32) for k in range(self.ranks)]]
    if name == "replica_id":
      return [[np.array(0, np.uint32)] * self.ranks]
    if name == "optimization_barrier":
      return args
    if name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                "collective_permute"):
      return [self._collective(op, args)]
    attrs = op.attrs
    if name in ("reduce", "reduce_window", "scatter"):
      if len(op.operands) != (3 if name == "scatter" else 2) or not op.regions:
        raise Unsupported(f"variadic {name}")
      kind = reducer_kind(op.regions[0])
      if kind is None and name == "scatter" and overwrites(op.regions[0]):
        kind = "replace"  # x.at[i].set(u)
      if kind is None:
        raise Unsupported("reducer")
      attrs = dict(attrs, **{"gg.reduction": kind})
    elif name == "sort":
      less = _comparator(op.regions[0])
      per_rank = [reference.sort([a[k] for a in args], attrs["dimension"], less)
                  for k in range(self.ranks)]
      return [[sorted_[j] for sorted_ in per_rank] for j in range(len(op.results))]
    elif name == "select_and_scatter":
      kind = reducer_kind(op.regions[1])
      if kind is None:
        raise Unsupported("select_and_scatter's scatter")
      attrs = dict(attrs, **{"gg.select": _scalar_function(op.regions[0], "select"),
                             "gg.reduction": kind})
    elif name == "chlo.top_k":
      per_rank = [reference.top_k(a, attrs["k"]) for a in args[0]]
      return [[v for v, _ in per_rank], [i for _, i in per_rank]]
    elif op.regions or len(op.results) != 1:
      raise Unsupported(name)
    t = op.results[0].type
    return [[reference.evaluate(name, attrs, [a[k] for a in args], t)
             for k in range(self.ranks)]]

  def _while(self, op: ir.Op, args, env: Env):
    cond, body = op.regions
    carries = args
    for _ in range(_MAX_TRIPS):
      (go,) = self._region(cond, carries, env)
      flags = {bool(np.asarray(g)) for g in go}
      if len(flags) != 1:
        raise Unsupported("ranks disagree on the loop condition")
      if not flags.pop():
        return carries
      carries = self._region(body, carries, env)
    raise Unsupported("too many iterations")

  # -- collectives -----------------------------------------------------------
  def _collective(self, op: ir.Op, args) -> list[np.ndarray]:
    (xs,) = args
    out: list[Optional[np.ndarray]] = [None] * self.ranks
    if op.name == "collective_permute":
      for k in range(self.ranks):
        out[k] = np.zeros_like(xs[k])
      for src, dst in op.attrs["source_target_pairs"]:
        out[dst] = xs[src]
      return out
    kind = reducer_kind(op.regions[0]) if op.regions else None
    for group in replica_groups(op, self.ranks):
      members = [xs[d] for d in group]
      if op.name == "all_reduce":
        total = _combine(kind, members)
        for d in group:
          out[d] = total
      elif op.name == "all_gather":
        whole = np.concatenate(members, axis=op.attrs["all_gather_dimension"])
        for d in group:
          out[d] = whole
      elif op.name == "reduce_scatter":
        parts = np.split(_combine(kind, members), len(group), axis=op.attrs["scatter_dimension"])
        for p, d in enumerate(group):
          out[d] = parts[p]
      else:  # all_to_all
        i, j = op.attrs["split_dimension"], op.attrs["concat_dimension"]
        chunks = [np.split(m, len(group), axis=i) for m in members]
        for p, d in enumerate(group):
          out[d] = np.concatenate([chunks[q][p] for q in range(len(group))], axis=j)
    if any(o is None for o in out):
      raise Unsupported("a rank in no replica group")
    return out


def _scalar_function(region: ir.Graph, what: str) -> Callable[..., np.ndarray]:
  """A region that reads nothing but its parameters and constants (a sort's
  comparator, a select_and_scatter's select) as a function of its
  parameters; elementwise, so it takes arrays as well as scalars."""
  if any(op.regions or len(op.results) != 1 for op in region.ops):
    raise Unsupported(what)

  def run(*xs) -> np.ndarray:
    env = {p.id: np.asarray(x) for p, x in zip(region.params, xs)}
    for op in region.ops:
      if any(v.id not in env for v in op.operands):
        raise Unsupported(f"{what} reads an outer value")
      env[op.results[0].id] = reference.evaluate(op.name, op.attrs,
                                                 [env[v.id] for v in op.operands],
                                                 op.results[0].type)
    return env[region.results[0].id]
  return run


def _comparator(region: ir.Graph) -> Callable[..., bool]:
  """A sort's comparator region as a function of its scalars."""
  run = _scalar_function(region, "sort comparator")
  return lambda *scalars: bool(run(*scalars))


def replica_groups(op: ir.Op, ranks: int) -> list[tuple[int, ...]]:
  """A collective's groups of ranks as its module lists them (none: all ranks)."""
  groups = op.attrs.get("replica_groups")
  if not groups or groups == ((),):
    return [tuple(range(ranks))]
  return [tuple(int(d) for d in g) for g in groups]


def _combine(kind: Optional[str], members: list[np.ndarray]) -> np.ndarray:
  if kind not in _COMBINE:
    raise Unsupported(f"reduction {kind}")
  total = members[0]
  for m in members[1:]:
    total = _COMBINE[kind](total, m)
  return total


def mesh_coords(mesh: ir.Mesh) -> list[tuple[int, ...]]:
  """Mesh coordinates by partition id (row-major over the axes, the order the
  relation layouts and ``rank_arith`` use)."""
  if mesh.device_ids is not None and tuple(mesh.device_ids) != tuple(range(mesh.size)):
    raise Unsupported("non-iota device order")
  return list(np.ndindex(*[n for _, n in mesh.axes])) or [()]
