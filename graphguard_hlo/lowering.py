"""Lower JAX functions to the modules graphguard-hlo verifies.

The sequential function is lowered to StableHLO with source locations.  The
distributed one is lowered as written: a ``shard_map`` gives StableHLO whose
``sdy.manual_computation`` body is already the per-device program; a
``jax.jit`` with shardings is partitioned by XLA (``xla_partition``).
Abstract arguments (``jax.ShapeDtypeStruct``) are enough: nothing is run.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from graphguard_hlo import ir
from graphguard_hlo.loaders.stablehlo import load_stablehlo
from graphguard_hlo.passes.dist_program import is_one_shard_map, named_from
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.xla_partition import partition_lowered


def abstract_value(a, sharding=None):
  """An array (or ``ShapeDtypeStruct``) as an abstract value: its shape,
  dtype and named sharding (``sharding``, or its own; one without a mesh,
  a single device's, is dropped)."""
  import jax
  if sharding is not None and not hasattr(sharding, "mesh"):
    sharding = None
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def abstract_args(args: Sequence[Any], keep_sharding: bool) -> list:
  """``args`` (arrays or ``ShapeDtypeStruct``s, in pytrees) as abstract
  values of the same structure, with their named shardings if
  ``keep_sharding``."""
  import jax
  own = (lambda a: getattr(a, "sharding", None)) if keep_sharding else (lambda a: None)
  return [jax.tree.map(lambda x: abstract_value(x, own(x)), a) for a in args]


def sequential_text(fn: Callable, *args) -> str:
  import jax
  return jax.jit(fn, keep_unused=True).lower(*abstract_args(args, False)).as_text(debug_info=True)


def lower_sequential(fn: Callable, *args, name: str = "<sequential>") -> ir.Module:
  return load_stablehlo(name, sequential_text(fn, *args))


def lower_distributed(fn: Callable, *args, in_shardings=None, out_shardings=None,
                      name: str = "<distributed>") -> ir.Module:
  """The per-device program of ``fn`` on sharded abstract ``args``."""
  import jax
  kw = {"keep_unused": True}
  if in_shardings is not None:
    kw["in_shardings"] = in_shardings
  if out_shardings is not None:
    kw["out_shardings"] = out_shardings
  lowered = jax.jit(fn, **kw).lower(*abstract_args(args, True))
  module = load_stablehlo(name, lowered.as_text(debug_info=True))
  # ``jax.jit(shard_map(f))`` inside this jit is a call of the manual
  # computation: inlined, it is read with its own mesh and axis names rather
  # than partitioned by XLA onto atomic axes (a0, a1, ...).
  inline_calls(module)
  if is_one_shard_map(module):
    return module
  return named_from(partition_lowered(lowered, name), module)
