"""The whole job on loaded modules: canonicalize DIST, then infer relations."""

from __future__ import annotations

from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.gcutil import without_cyclic_gc
from graphguard_hlo.passes.dist_program import canonicalize_dist, needs_partitioning
from graphguard_hlo.passes.canonicalize import canonicalize_module
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.inference import Result, verify_programs
from graphguard_hlo.passes.layout import Layout


@without_cyclic_gc
def prepare_dist(dist: ir.Module, num_partitions: Optional[int] = None, text: Optional[str] = None):
  if needs_partitioning(dist):
    from graphguard_hlo.xla_partition import partition_stablehlo_text
    if text is None:
      with open(dist.path) as f:
        text = f.read()
    dist = partition_stablehlo_text(dist.path, text, num_partitions or dist.num_partitions)
  inline_calls(dist)
  canonicalize_module(dist)
  return canonicalize_dist(dist, num_partitions)


@without_cyclic_gc
def prepare_seq(seq: ir.Module) -> ir.Module:
  inline_calls(seq)
  canonicalize_module(seq)
  return seq


@without_cyclic_gc
def verify_modules(seq: ir.Module, dist: ir.Module, input_layouts: Optional[list[Layout]] = None,
                   num_partitions: Optional[int] = None) -> Result:
  prepare_seq(seq)
  program = prepare_dist(dist, num_partitions)
  return verify_programs(seq, program, input_layouts)
