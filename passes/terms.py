"""How ops become e-nodes: the identity of an op is its name, its semantic
attributes, its result type and (for ops with bodies) the shape of its regions.

Both the per-device program and the terms that lemmas propose are spelled with
``op_head``, so a lemma's proposed local op finds the distributed op that
computes it by a hash-cons lookup.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Optional

import numpy as np

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.collectives import reducer_kind

# Attributes that do not change what an op computes.
_NON_SEMANTIC = {"channel_handle", "precision_config", "precision", "result_accuracy",
                 "mhlo.sharding", "mhlo.frontend_attributes", "sdy.sharding",
                 "algorithm", "metadata", "backend_config", "operand_layouts",
                 "result_layouts", "mhlo.sharding_rule", "sdy.sharding_rule",
                 "use_global_device_ids", "gg.permutation",
                 # Physical layouts (HLO's {2,0,1}): a value's memory order,
                 # never its logical content.
                 "result_layout", "xla_shape"}

COMMUTATIVE = {"add", "multiply", "maximum", "minimum", "and", "or", "xor"}


def freeze(value: Any) -> Hashable:
  if isinstance(value, dict):
    return tuple(sorted((k, freeze(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(freeze(v) for v in value)
  if isinstance(value, np.ndarray):
    return ("array", value.shape, str(value.dtype), value.tobytes())
  if isinstance(value, ir.Graph):
    return region_fingerprint(value)
  return value


def attrs_key(attrs: dict[str, Any]) -> Hashable:
  return tuple(sorted((k, freeze(v)) for k, v in attrs.items() if k not in _NON_SEMANTIC))


# Ops with effects beyond their results: they draw, read or write anew each
# time they run (loop rewrites never copy them, conditionals holding them
# stay conditionals).
EFFECTS = frozenset({"custom_call", "outfeed", "infeed", "send", "recv", "rng",
                     "rng_bit_generator"})
# Ops two of which on the same operands may differ (HLO's rng state read too).
_NOT_SHARED = EFFECTS | {"rng_get_and_update_state"}


def region_fingerprint(g: ir.Graph) -> Hashable:
  """A structural hash of a region: equal for alpha-equivalent bodies, in
  whatever order their ops are listed (jax and XLA's partitioner list an
  argmax's reducer in two orders).  The ops are numbered in a depth-first
  walk from the results, operands in order, so the numbering is the DAG's
  own; ops that reach no result compute nothing it returns and are left out.
  Two equal pure ops on the same operands are one value (XLA's CSE merges a
  sort comparator's repeated constants; jax writes one per use)."""
  kind = reducer_kind(g)
  if kind is not None:
    return ("reducer", kind, tuple(p.type for p in g.params))
  args = {id(p): ("arg", i) for i, p in enumerate(g.params)}
  numbered: dict[int, int] = {}  # id(op) -> its place in the walk
  entries: list[tuple] = []
  seen: dict[tuple, int] = {}  # entry -> its place: equal pure ops are one

  def ref(v: ir.Value) -> tuple:
    if id(v) in args:
      return args[id(v)]
    op = v.producer
    if op is None or id(op) not in numbered:
      # A value from outside: the Python object, never equal to another
      # program's (value ids count per module: %7 of one is not %7 of the other).
      return ("free", id(v))
    return ("op", numbered[id(op)], op.results.index(v))

  inside = {id(op) for op in g.ops}
  for root in g.results:
    stack = [(root.producer, False)] if root.producer is not None else []
    while stack:  # an explicit stack: loop bodies may be long chains
      op, expanded = stack.pop()
      if id(op) in numbered or id(op) not in inside:
        continue
      if not expanded:
        stack.append((op, True))
        stack.extend((v.producer, False) for v in reversed(op.operands)
                     if v.producer is not None and id(v.producer) not in numbered)
        continue
      entry = (op.name, attrs_key(op.attrs), tuple(ref(v) for v in op.operands),
               tuple(r.type for r in op.results),
               tuple(region_fingerprint(r) for r in op.regions))
      if entry in seen and not op.regions and op.name not in _NOT_SHARED:
        numbered[id(op)] = seen[entry]  # the same value computed twice (XLA's CSE shares it)
        continue
      entries.append(entry)
      numbered[id(op)] = seen[entry] = len(entries) - 1
  return ("region", tuple(p.type for p in g.params), tuple(entries),
          tuple(ref(v) for v in g.results))


def normalize_compare_types(module: ir.Module) -> None:
  """A compare's ``compare_type`` as one spelling: dropped where it is its
  operands' own order (FLOAT, SIGNED for signed integers, UNSIGNED for
  unsigned ones and booleans: XLA drops it, jax prints it), kept where it is
  not (TOTALORDER floats order -0.0 and NaN; an UNSIGNED compare of signed
  integers reads their bits), so ops comparing differently never match."""
  for g in module.functions.values():
    for op in g.walk():
      if op.name != "compare" or "compare_type" not in op.attrs or not op.operands:
        continue
      given = str(op.attrs["compare_type"])
      kind = next((k for k in ("TOTALORDER", "UNSIGNED", "SIGNED", "FLOAT") if k in given), None)
      if kind is None or kind == _own_order(op.operands[0].type.dtype):
        del op.attrs["compare_type"]
      else:
        op.attrs["compare_type"] = f"#stablehlo<comparison_type {kind}>"


def _own_order(dtype: str) -> str:
  if dtype in ("pred", "i1") or dtype.startswith("ui"):
    return "UNSIGNED"
  if dtype.startswith("i"):
    return "SIGNED"
  return "FLOAT"


def op_head(name: str, attrs: dict[str, Any], result_type: ir.TensorType,
            regions: tuple = (), result_index: int = 0) -> Hashable:
  if name == "transpose":
    attrs = {**attrs, "permutation": unit_dims_in_order(attrs["permutation"], result_type.shape)}
  return (name, attrs_key(attrs), result_type,
          tuple(region_fingerprint(r) if isinstance(r, ir.Graph) else r for r in regions),
          result_index)


def unit_dims_in_order(perm: tuple[int, ...], result_shape: tuple[int, ...]) -> tuple[int, ...]:
  """A transpose's permutation with the operand's unit dims taken in order:
  a transpose that swaps two size-1 dims moves no element, so every order
  of them spells one op (XLA picks any)."""
  units = [i for i, n in enumerate(result_shape) if n == 1]
  out = list(perm)
  for i, d in zip(units, sorted(perm[i] for i in units)):
    out[i] = d
  return tuple(out)


def splat_value(v: ir.Value) -> Optional[float]:
  """The scalar a value is filled with, if it is a constant splat (through
  broadcasts, reshapes, slices and converts, each convert applied to it)."""
  op = v.producer
  converts: list[str] = []  # the types converted to, outermost first
  while op is not None and op.name in ("broadcast_in_dim", "reshape", "slice", "convert", "copy"):
    if op.name == "convert":
      converts.append(op.results[0].type.dtype)
    op = op.operands[0].producer
  if op is None or op.name != "constant" or not isinstance(op.attrs.get("value"), np.ndarray):
    return None  # complex constants are kept as text
  arr = np.asarray(op.attrs["value"])
  if arr.dtype.kind not in "biuf":
    return None
  if arr.size == 0:
    return None
  flat = arr.reshape(-1)
  if arr.size > 1 and not np.all(flat == flat[0]):
    return None
  return _converted(flat[0], converts[::-1])


def scalar_of_broadcast(v: ir.Value) -> Optional[ir.Value]:
  """The scalar ``v`` broadcasts to every element, if ``v`` is such a
  broadcast (a select's flag, a zero-initialized stack or buffer)."""
  op = v.producer
  if op is None or op.name != "broadcast_in_dim" or op.operands[0].type.rank:
    return None
  return op.operands[0]


def is_zero(v: ir.Value) -> bool:
  """A splat of zero (through broadcasts, reshapes and converts)."""
  return splat_value(v) == 0


def sums_from_zero(op: ir.Op) -> bool:
  """Is ``op`` a reduce of one input that adds, from zero?  Over pieces of
  its input its result is the sum of the pieces' results: any other reducer
  (max, product) or a nonzero init (counted once a piece) breaks that."""
  return op.name == "reduce" and len(op.operands) == 2 and bool(op.regions) and \
      reducer_kind(op.regions[0]) == "sum" and is_zero(op.operands[1])


def converted(value: float, dtype: str) -> Optional[float]:
  """A splat's ``value`` converted to ``dtype`` (None: see ``_converted``)."""
  return _converted(np.float64(value), [dtype])


def _converted(value: np.generic, dtypes: list[str]) -> Optional[float]:
  """``value`` converted to each of ``dtypes`` in turn, as XLA converts; None
  where that is not the reference's cast (a float out of an int's range:
  XLA saturates it, numpy wraps)."""
  out = np.asarray(value)
  for dtype in dtypes:
    bounds = reference.type_bounds(dtype)
    to_int = reference.is_integer_type(dtype) and dtype not in ("pred", "i1")
    if out.dtype.kind == "f" and to_int and not (
        np.isfinite(out) and bounds[0] <= np.trunc(out) <= bounds[1]):
      return None
    try:
      out = reference.cast(out, dtype)
    except NotImplementedError:
      return None
  return float(out)


SPLAT_DIGITS = 7  # float32 carries ~7 significant digits


def splat_head(value: float, type: ir.TensorType) -> Hashable:
  """Splats are identified by value: integers exactly, floats to float32
  precision (``(1/4)/16`` folded on the devices and ``1/64`` folded
  sequentially are the same constant)."""
  return ("splat", canonical_float(value, type.dtype), type)


_NAN = float("nan")  # one NaN object: NaN != NaN, but a tuple holding it equals itself


def canonical_float(value: float, dtype: str) -> float:
  if math.isnan(value):
    return _NAN
  if reference.is_integer_type(dtype):
    return float(value)  # exact: rounding would make 10000001 and 10000000 one constant
  return float(f"{value:.{SPLAT_DIGITS}g}")


# Elementwise ops whose result IEEE arithmetic fixes to the bit (correctly
# rounded, or exact): folding them on splats gives what XLA computes.  An
# exponential, a logistic or an erfc is XLA's own polynomial, which may differ
# from the reference's in the last bit: folded, a program holding the
# correctly rounded constant would be proved equal to one computing the op.
# Left unfolded they are still matched op for op (the same op of the same
# splat is one e-class).
EXACTLY_FOLDED = frozenset({
    "add", "subtract", "multiply", "divide", "sqrt", "negate", "abs", "maximum", "minimum",
    "convert", "copy", "floor", "ceil", "round_nearest_even", "round_nearest_afz", "sign",
    "remainder", "select", "clamp", "and", "or", "xor", "not", "chlo.square", "real", "imag"})


def fold_scalar(name: str, attrs: dict, values: list[float], type: ir.TensorType
                ) -> Optional[float]:
  """The value of an elementwise op on splats, computed in the result's dtype,
  for the ops whose value that fixes (``EXACTLY_FOLDED``)."""
  if type.dtype in ("pred", "i1") or name == "compare" or name not in EXACTLY_FOLDED:
    return None  # booleans: masks are matched structurally
  try:
    with np.errstate(all="ignore"):
      out = reference.evaluate(name, attrs, [np.array(v) for v in values],
                               ir.TensorType((), type.dtype))
  except (NotImplementedError, KeyError, ValueError, TypeError):
    return None
  out = float(np.asarray(out).reshape(-1)[0])
  return out if np.isfinite(out) or np.isinf(out) else None
