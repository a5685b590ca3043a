"""The whole job on loaded modules: canonicalize DIST, then infer relations."""

from __future__ import annotations

from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.gcutil import without_cyclic_gc
from graphguard_hlo.passes.dist_program import (DistProgram, canonicalize_dist, named_from,
                                                needs_partitioning)
from graphguard_hlo.passes.canonicalize import (UNROLLED_RING_PATTERNS, canonicalize_graph,
                                                canonicalize_module)
from graphguard_hlo.passes.transfer import ring_axes
from graphguard_hlo.chlo_expansion import expand_chlo, holds_xla_expansions
from graphguard_hlo.passes.conditionals import select_conditionals
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.terms import normalize_compare_types
from graphguard_hlo.passes.loop_split import split_layer_loops, trip_counts
from graphguard_hlo.passes.microbatch_loops import split_microbatch_loops
from graphguard_hlo.passes.rank_cases import rank_case_patterns
from graphguard_hlo.passes.unsaved_loops import copy_unsaved_loops
from graphguard_hlo.passes.ring_loops import unroll_ring_loops
from graphguard_hlo.passes.inference import Result, verify_programs
from graphguard_hlo.passes.layout import Layout


@without_cyclic_gc
def prepare_dist(dist: ir.Module, num_partitions: Optional[int] = None, text: Optional[str] = None):
  # Inlined first: a dumped ``jax.jit(shard_map(f))`` calls its manual
  # computation from main, and read from there it keeps the user's mesh.
  inline_calls(dist)
  if needs_partitioning(dist):
    from graphguard_hlo.xla_partition import partition_stablehlo_text
    if text is None:
      with open(dist.path) as f:
        text = f.read()
    dist = named_from(partition_stablehlo_text(dist.path, text,
                                               num_partitions or dist.num_partitions), dist)
    inline_calls(dist)
  normalize_compare_types(dist)
  select_conditionals(dist)
  # A ring written as a fori_loop or scan over its steps reads as the Python
  # loop it replaces (ring_loops.py): the sequential program has no loop to
  # prove it against by induction.
  unrolled = unroll_ring_loops(dist)
  canonicalize_module(dist)
  program = canonicalize_dist(dist, num_partitions)
  program.unrolled_ring_loops = unrolled
  # Rings are seen once collectives read as mesh axes: then the ring forms
  # (canonicalize.RING_PATTERNS) for this program, and for the sequential one.
  program.rings = ring_axes(program.graph, program.mesh)
  # And buffers read and written at rows that depend on a rank (rank_cases.py).
  cases = rank_case_patterns(program.graph, program.mesh, program.param_layouts)
  extra = cases + (UNROLLED_RING_PATTERNS if unrolled else ())
  if program.rings or extra:
    canonicalize_graph(dist, program.graph, rings=bool(program.rings), extra=extra)
  return program


@without_cyclic_gc
def prepare_seq(seq: ir.Module, program: Optional[DistProgram] = None) -> ir.Module:
  """``program``: the per-device program it is checked against, prepared
  first (its rings ask for the ring forms here too)."""
  inline_calls(seq)
  normalize_compare_types(seq)
  select_conditionals(seq)
  # A per-device program read from HLO holds XLA's expansion of each chlo op
  # (erfc's polynomial): the sequential program is given the same.
  if program is not None and holds_xla_expansions(program.module):
    expand_chlo(seq)
  rings = bool(program is not None and program.rings)
  extra = UNROLLED_RING_PATTERNS if program is not None and program.unrolled_ring_loops else ()
  canonicalize_module(seq, rings=rings, extra=extra)
  # A pipeline's stages scan their own rows of the layers: the sequential
  # scan over all of them, split into loops of that many steps (once in the
  # loops' normal form, saving the same rows as the per-device ones).
  if program is not None and split_layer_loops(seq, trip_counts(program.graph)):
    canonicalize_module(seq, rings=rings, extra=extra)
  # A stage's vjp taken by hand (1F1B) runs its forward once saving nothing
  # and once saving: the sequential loop, copied without its saves for the
  # readers of its output.
  if program is not None and copy_unsaved_loops(seq, program.graph):
    canonicalize_module(seq, rings=rings, extra=extra)
  # And GPipe runs each stage's loop on one microbatch at a time: the
  # sequential loop over the whole batch, split into one per microbatch.
  if program is not None and split_microbatch_loops(seq, program.graph, program.param_layouts,
                                                    program.mesh):
    canonicalize_module(seq, rings=rings, extra=extra)
  return seq


@without_cyclic_gc
def verify_modules(seq: ir.Module, dist: ir.Module, input_layouts: Optional[list[Layout]] = None,
                   num_partitions: Optional[int] = None, relation: Optional[str] = None) -> Result:
  """``relation``: relation-file text applied on top of the derived input layouts."""
  program = prepare_dist(dist, num_partitions)
  prepare_seq(seq, program)
  if relation is not None:
    from graphguard_hlo.relation_file import relation_layouts
    input_layouts = relation_layouts(relation, seq, program)
  return verify_programs(seq, program, input_layouts)
