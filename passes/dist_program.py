"""Canonicalize a distributed module into one per-device program over a named mesh.

Three kinds of DIST module reach us:
  * shard_map StableHLO: ``main`` wraps an ``sdy.manual_computation`` whose body
    is the per-device program; mesh and layouts come from ``sdy.mesh`` and the
    computation's in/out shardings.
  * SPMD-partitioned modules (XLA's ``after_spmd-partitioning`` dump as text or
    proto): ``main`` is the per-device program; parameters carry GSPMD sharding
    strings, from which the mesh is inferred (``sharding.infer_mesh``).
  * sharded StableHLO from ``jax.jit`` with shardings (``sdy.sharding`` on the
    arguments, no manual computation): XLA's own partitioner turns it into the
    previous kind (``graphguard_hlo.xla_partition``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from graphguard_hlo import ir, reference
from graphguard_hlo.errors import InputError
from graphguard_hlo.passes import sharding as shd
from graphguard_hlo.passes.collectives import COLLECTIVES, canonicalize_collectives
from graphguard_hlo.passes.layout import Layout


@dataclasses.dataclass
class DistProgram:
  module: ir.Module
  graph: ir.Graph                      # the per-device program
  mesh: ir.Mesh
  param_layouts: list[Optional[Layout]]
  result_layouts: list[Optional[Layout]]  # None: not declared, any clean layout will do
  kind: str                            # "shard_map" | "spmd"
  # Parameters known to hold one constant (loop-invariant splat carries).
  param_splats: dict[int, float] = dataclasses.field(default_factory=dict)
  # Mesh axes a ring of collective-permutes passes blocks round.
  rings: frozenset = frozenset()
  # Ring loops unrolled into the Python loop's form (ring_loops.py).
  unrolled_ring_loops: int = 0
  # Other names of mesh axes a relation file may use, with the axes they
  # mean: XLA's atomic ones (a0, ...) of axes named after the mesh the
  # program was written over; an axis of that mesh XLA cut finer, for its
  # parts major to minor; None for one the program does not hold (XLA joined
  # it with another, or it has size 1).
  axis_aliases: dict[str, Optional[tuple[str, ...]]] = dataclasses.field(default_factory=dict)


def is_manual(module: ir.Module) -> bool:
  return any(op.name == "sdy.manual_computation" for op in module.main.ops)


def is_one_shard_map(module: ir.Module) -> bool:
  """``main`` is one shard_map over every mesh axis (and constants it
  reads): its body is the per-device program as written.  Anything else
  holding a shard_map (shard_maps inside a jit with shardings, one over some
  axes only) is partitioned by XLA like any sharded program."""
  compute = [op for op in module.main.ops if op.name != "constant"]
  if len(compute) != 1 or compute[0].name != "sdy.manual_computation":
    return False
  op = compute[0]
  meshes = {s.mesh for s in tuple(op.attrs.get("in_shardings", ()))
            + tuple(op.attrs.get("out_shardings", ()))}
  mesh = module.meshes.get(next(iter(meshes))) if len(meshes) == 1 else None
  manual_axes = set(op.attrs.get("manual_axes", ()))
  return mesh is None or not manual_axes or \
      manual_axes == set(mesh.axis_names) - {a for a, n in mesh.axes if n == 1}


def needs_partitioning(module: ir.Module) -> bool:
  """Sharded StableHLO that XLA must still partition (jit with shardings,
  shard_maps within it included)."""
  if module.num_partitions <= 1:
    return False
  if is_manual(module):
    return not is_one_shard_map(module)
  g = module.main
  annotated = any("sdy.sharding" in a for a in g.param_attrs + g.result_attrs)
  has_collectives = any(op.name in COLLECTIVES or op.name == "partition_id" for op in g.walk())
  return annotated and not has_collectives


# The mesh a program partitioned by XLA was written over (``named_from``).
SOURCE_MESH = "gg.source_mesh"


def named_from(partitioned: ir.Module, source: ir.Module) -> ir.Module:
  """Record on XLA's per-device module the mesh ``source`` (the sharded
  StableHLO it was partitioned from) names, if it names one: the inferred
  atomic axes take its names where they are its axes."""
  meshes = [m for m in source.meshes.values() if m.size > 1]
  if len(meshes) == 1:
    partitioned.attrs[SOURCE_MESH] = meshes[0]
  return partitioned


def canonicalize_dist(module: ir.Module, num_partitions: Optional[int] = None) -> DistProgram:
  if is_manual(module):
    prog = _from_manual(module)
  else:
    prog = _from_spmd(module, num_partitions)
  canonicalize_collectives(prog.graph, prog.mesh)
  return prog


def _from_manual(module: ir.Module) -> DistProgram:
  main = module.main
  compute = [op for op in main.ops if op.name not in ("constant",)]
  manual = [op for op in compute if op.name == "sdy.manual_computation"]
  if len(manual) != 1 or len(compute) != 1:
    others = sorted({op.name for op in compute if op.name != "sdy.manual_computation"})
    raise InputError(module.path, "only a main function that is one shard_map is supported; "
                     f"found {len(manual)} shard_map(s) and also {others}")
  op = manual[0]
  in_sh, out_sh = op.attrs.get("in_shardings", ()), op.attrs.get("out_shardings", ())
  mesh_names = {s.mesh for s in tuple(in_sh) + tuple(out_sh)}
  if len(mesh_names) > 1:
    raise InputError(module.path, f"shard_map over several meshes {sorted(mesh_names)}")
  mesh_name = mesh_names.pop() if mesh_names else next(iter(module.meshes), None)
  if mesh_name not in module.meshes:
    raise InputError(module.path, f"mesh @{mesh_name} is not defined")
  mesh = module.meshes[mesh_name]
  manual_axes = set(op.attrs.get("manual_axes", ()))
  if manual_axes and manual_axes != set(mesh.axis_names) - {a for a, n in mesh.axes if n == 1}:
    raise InputError(module.path, "shard_map over a subset of mesh axes "
                     f"({sorted(manual_axes)} of {list(mesh.axis_names)}) is not supported")
  body = op.regions[0]
  # The body's parameters stand for main's parameters: map by operand position.
  positions = {id(p): i for i, p in enumerate(main.params)}
  param_layouts: list[Optional[Layout]] = [None] * len(main.params)
  graph = ir.Graph("per_device")
  graph.params = [None] * len(main.params)  # type: ignore[list-item]
  hoisted: list[ir.Op] = []
  for operand, body_param, sh in zip(op.operands, body.params, in_sh):
    i = positions.get(id(operand))
    layout = shd.layout_from_sdy(sh, operand.type.rank)
    if i is None and operand.producer is not None and operand.producer.name == "constant" \
        and layout == Layout.replicated(operand.type.rank):
      # A constant the body closes over (a numpy table), passed in whole:
      # every rank's copy is that constant.
      hoisted.append(_constant_as(operand.producer, body_param))
      continue
    if i is None:
      raise InputError(module.path, "shard_map operands must be main's parameters "
                       "or constants given whole")
    graph.params[i] = body_param
    param_layouts[i] = layout
  missing = [i for i, p in enumerate(graph.params) if p is None]
  if missing:
    raise InputError(module.path, f"parameters {missing} are not used by the shard_map")
  graph.param_locations = list(main.param_locations)
  graph.param_attrs = list(main.param_attrs)
  graph.ops = hoisted + body.ops
  graph.results = body.results
  results = {id(r): i for i, r in enumerate(op.results)}
  order = [results.get(id(r)) for r in main.results]
  if None in order:
    raise InputError(module.path, "main's results must be the shard_map's results")
  graph.results = [body.results[i] for i in order]  # type: ignore[index]
  result_layouts = [shd.layout_from_sdy(out_sh[i], op.results[i].type.rank)  # type: ignore[index]
                    for i in order]
  return DistProgram(module, graph, mesh, param_layouts, result_layouts, "shard_map")


def _constant_as(constant: ir.Op, value: ir.Value) -> ir.Op:
  """A copy of ``constant`` producing ``value`` (a body parameter it fed)."""
  op = ir.Op("constant", [], dict(constant.attrs), [], constant.location)
  op.results = [value]
  value.producer, value.index = op, 0
  return op


def _from_spmd(module: ir.Module, num_partitions: Optional[int]) -> DistProgram:
  g = module.main
  n = num_partitions or module.num_partitions
  path = module.path
  try:
    param_sh = [_parse(a.get("mhlo.sharding")) for a in g.param_attrs]
    out_text = module.attrs.get("mhlo.spmd_output_sharding")
    result_sh: list[Optional[shd.HloSharding]]
    if g.result_attrs and any("mhlo.sharding" in a for a in g.result_attrs):
      result_sh = [_parse(a.get("mhlo.sharding")) for a in g.result_attrs]
    elif out_text:
      parsed = shd.parse_hlo_sharding(out_text)
      result_sh = list(parsed) if isinstance(parsed, list) else [parsed] * len(g.results)
    else:
      result_sh = [None] * len(g.results)
    if len(result_sh) != len(g.results):
      result_sh = [None] * len(g.results)
    groups = [op.attrs.get("replica_groups", ()) for op in g.walk() if op.name in COLLECTIVES]
    # HLO protos do not record the partition count: every device named counts.
    n = max([n] + [math.prod(s.tile_dims) for s in param_sh + result_sh
                   if s is not None and s.kind == "tiled"]
            + [max(grp) + 1 for gs in groups for grp in gs if grp])
    module.num_partitions = n
    tiled = [s for s in param_sh + result_sh if s is not None]
    strides = _partition_id_strides(g, n)
    mesh = shd.infer_mesh(tiled, n, groups, strides)
    pairs = [op.attrs.get("source_target_pairs", ()) for op in g.walk()
             if op.name == "collective_permute"]
    if not shd.permutes_read(pairs, mesh):
      # XLA moves parts of axes (resharding P("x", "y") to P(("y", "x"))):
      # read its permutes on the finest mesh, when they read there.
      finer = shd.infer_mesh(tiled, n, groups, strides | shd.prime_strides(mesh))
      if shd.permutes_read(pairs, finer):
        mesh = finer
    atomic, mesh = mesh, shd.named_after(mesh, module.attrs.get(SOURCE_MESH))
    param_layouts = [
        None if s is None else shd.layout_from_hlo_sharding(s, mesh, v.type.rank)
        for s, v in zip(param_sh, g.params)]
  except shd.ShardingError as e:
    raise InputError(path, str(e)) from None
  result_layouts: list[Optional[Layout]] = []
  for s, v in zip(result_sh, g.results):
    try:
      result_layouts.append(None if s is None else shd.layout_from_hlo_sharding(s, mesh, v.type.rank))
    except shd.ShardingError:
      result_layouts.append(None)
  # Parameters without a sharding on an N-way module are replicated.
  param_layouts = [l if l is not None else Layout.replicated(v.type.rank)
                   for l, v in zip(param_layouts, g.params)]
  aliases: dict[str, Optional[tuple[str, ...]]] = {
      a: (b,) for a, b in zip(atomic.axis_names, mesh.axis_names) if a != b}
  source = module.attrs.get(SOURCE_MESH)
  if source is not None:  # (the user's own axis a0 is never XLA's a0)
    for a in source.axis_names:
      if a not in mesh.axis_names:
        parts = sorted((p[1], n) for n in mesh.axis_names
                       for p in [ir.sub_axis(n)] if p and p[0] == a)
        aliases[a] = tuple(n for _, n in parts) or None
  return DistProgram(module, g, mesh, param_layouts, result_layouts, "spmd",
                     axis_aliases=aliases)


def _partition_id_strides(g: ir.Graph, n: int) -> set[int]:
  """Device-id strides that partition-id arithmetic cuts at: every integer
  computed from partition-id and constants alone (GSPMD's offset tables, also
  nested, divisions and remainders), evaluated on each partition.  They refine
  the mesh so that e.g. ``partition_id // 2`` is one mesh axis.  Not read
  through a one-element iota: that is a user's ``jnp.arange`` over an axis
  split one row per rank (a GSPMD pipeline's stage numbers), and what it
  computes is a schedule (stage s runs repeat ``(t - s) // m``), which cuts
  the axis at no stride the layouts have."""
  from graphguard_hlo.passes.rank_arith import partition_id_table, table_strides
  strides: set[int] = set()
  memo: dict = {}
  for op in g.walk():
    for r in op.results:
      if reference.is_integer_type(r.type.dtype) and math.prod(r.shape) == 1:
        table = partition_id_table(r, n, memo, iota=False)
        if table is not None:
          strides |= {s for s in table_strides(table) if 1 < s < n and n % s == 0}
  return strides


def _parse(text) -> Optional[shd.HloSharding]:
  if text is None:
    return None
  parsed = shd.parse_hlo_sharding(text)
  if isinstance(parsed, list):
    raise shd.ShardingError(f"tuple sharding {text!r} on a single value")
  return parsed
