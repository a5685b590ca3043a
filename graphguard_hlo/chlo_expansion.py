"""chlo ops as XLA expands them, for a per-device program that went through XLA.

jax lowers ``erfc`` (exact GELU), ``lgamma``, ``sinh``, ``asin``... to chlo ops.
A shard_map program keeps them as ops, but one XLA has read (a GSPMD program
it partitioned, or any HLO dump) holds XLA's expansion of each into elementary
ops: a polynomial, selects on ranges.  The sequential program, still in
StableHLO, keeps the chlo op, and the two never meet.

So each chlo op of the sequential program is replaced by what XLA makes of it:
a one-op StableHLO module, converted to HLO by XLA's own converter and read
back by our HLO loader, spliced in its place.  Both programs then carry XLA's
polynomial, and relation inference matches it op by op, as it matches any
elementwise op.  Nothing here chooses an expansion: an op XLA keeps whole
(``erf`` is an HLO op) is spliced as that op.
"""

from __future__ import annotations

import functools
from typing import Optional

from graphguard_hlo import ir

# chlo ops that carry no attributes and compute elementwise: what jax emits for
# jax.lax's special functions and trigonometry.
_EXPANDED = frozenset({
    "chlo.erf", "chlo.erfc", "chlo.erf_inv", "chlo.lgamma", "chlo.digamma", "chlo.sinh",
    "chlo.cosh", "chlo.tan", "chlo.asin", "chlo.acos", "chlo.atan", "chlo.asinh", "chlo.acosh",
    "chlo.atanh", "chlo.is_inf", "chlo.is_pos_inf", "chlo.is_neg_inf", "chlo.bessel_i1e",
    "chlo.polygamma", "chlo.zeta", "chlo.next_after"})

_MLIR_TYPES = {"pred": "i1", "i1": "i1"}


def holds_xla_expansions(module: ir.Module) -> bool:
  """Did ``module`` come through XLA (an HLO dump, or XLA's partitioner)?"""
  return module.format in ("hlo_text", "hlo_proto")


def expand_chlo(module: ir.Module) -> int:
  """Replace every expandable chlo op of ``module`` by XLA's expansion of it, in
  place; returns how many were replaced."""
  from graphguard_hlo.passes.splice import splice
  return sum(splice(g, lambda op: _expanded(module, op)) for g in module.functions.values())


def _expanded(module: ir.Module, op: ir.Op):
  """XLA's expansion of ``op`` cloned in its place (``splice``'s stand-in)."""
  from graphguard_hlo.passes.inline import clone_into
  if op.name not in _EXPANDED:
    return None
  expansion = _expansion(op.name, tuple(v.type for v in op.operands),
                         tuple(r.type for r in op.results))
  if expansion is None:
    return None
  body = ir.Graph(op.name)
  results = clone_into(module, expansion, op.operands, body, op.location)
  return body.ops, results


def _mlir_type(t: ir.TensorType) -> str:
  dtype = _MLIR_TYPES.get(t.dtype, t.dtype)
  return f"tensor<{''.join(f'{n}x' for n in t.shape)}{dtype}>"


@functools.lru_cache(maxsize=256)
def _expansion(name: str, operand_types: tuple, result_types: tuple) -> Optional[ir.Graph]:
  """XLA's HLO for ``name`` on these types, as a graph (None if XLA refuses it:
  the op is then left as it is)."""
  from jax._src.lib import xla_client
  from graphguard_hlo.loaders.hlo_text import load_hlo_text
  args = ", ".join(f"%arg{i}: {_mlir_type(t)}" for i, t in enumerate(operand_types))
  uses = ", ".join(f"%arg{i}" for i in range(len(operand_types)))
  ins = ", ".join(_mlir_type(t) for t in operand_types)
  outs = ", ".join(_mlir_type(t) for t in result_types)
  text = (f"func.func @main({args}) -> ({outs}) {{\n"
          f"  %0 = \"{name}\"({uses}) : ({ins}) -> ({outs})\n"
          f"  return %0 : {outs}\n}}\n")
  try:
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
        text, use_tuple_args=False, return_tuple=False)
    graph = load_hlo_text(f"<XLA's {name}>", computation.as_hlo_text(
        print_large_constants=True)).main
  except Exception:  # (XLA raises its own error types; our loader InputError)
    return None
  if [r.type for r in graph.results] != list(result_types) or any(
      op.name in _EXPANDED or op.regions for op in graph.walk()):
    return None
  return graph
