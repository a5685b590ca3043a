"""Which values may be infinite near a softmax's max: a dataflow that fails closed.

An online softmax is telescoped only where its scores cannot be -inf
(``online_softmax.py``).  Inputs are read as finite, as everywhere (the
README's model), and so is what the model computes from them by matmuls,
reductions and exponentials (``_DATA``: the flow stops there; overflow of
arithmetic on data is not modelled).  Between those and the max, where masks
and biases meet the scores, this pass finds the infinities a program writes:

  a constant holding inf or NaN (a table too)    jnp.where(mask, s, -inf)
  an op with a pole                              log(mask), x / y
  constants overflowing as they combine          finfo.min + finfo.min,
                                                 -1e30 * 1e30

For the last, each value carries a bound on the magnitude its constants give
it (data counts 0), and a sum, product, quotient or conversion whose bound
passes its type's largest finite value may be infinite.  Any op not listed
may give anything: an unknown op's result may be infinite.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from graphguard_hlo import ir


@dataclasses.dataclass(frozen=True)
class Fact:
  why: Optional[str]  # why the value may be infinite (None: it is finite)
  bound: float        # what its constants contribute to its magnitude, at most


_FINITE_DATA = Fact(None, 0.0)
# Where the flow stops: values the model computes from its inputs (finite).
_DATA = frozenset({"dot_general", "convolution", "reduce", "reduce_window", "exponential",
                   "exponential_minus_one"})
# Finite where their operands are, with their operands' bound (or less).
_KEEPS = frozenset({
    "broadcast_in_dim", "reshape", "transpose", "copy", "slice", "dynamic_slice",
    "concatenate", "reverse", "pad", "select", "maximum", "minimum", "clamp", "abs",
    "negate", "dynamic_update_slice", "sign", "floor", "ceil", "round_nearest_even",
    "round_nearest_afz", "real", "imag", "all_gather", "all_to_all", "collective_permute"})
# Ops that only spread a constant (its reason is given where it is read).
_SPLATS = frozenset({"broadcast_in_dim", "reshape", "convert", "copy"})
# Finite and at most 1 in magnitude, whatever finite operand.
_BOUNDED = frozenset({"tanh", "logistic", "sine", "cosine", "erf"})
# Results that are never infinite (predicates, integers) are decided by type.
_POLES = frozenset({"log", "log_plus_one", "rsqrt", "power", "remainder", "atan2", "sqrt",
                    "tan"})


def _largest(dtype: str) -> float:
  from graphguard_hlo.reference import numpy_dtype
  if dtype == "bf16":
    return 3.3895313892515355e38
  target = numpy_dtype(dtype)
  if target is not None and np.dtype(target).kind == "f":
    return float(np.finfo(target).max)
  return 448.0 if dtype.startswith("f8") else math.inf  # (f8e4m3's, the smallest)


def _is_float(v: ir.Value) -> bool:
  return v.type.dtype.startswith(("f", "bf", "complex"))


class Nonfinite:
  def __init__(self):
    self._facts: dict[int, Fact] = {}

  def why(self, v: ir.Value) -> Optional[str]:
    """Why ``v`` may be infinite (or NaN), in words; None if it is finite."""
    return self.fact(v).why

  def fact(self, v: ir.Value) -> Fact:
    stack = [v]
    while stack:  # operands first, without recursion (a model is deep)
      top = stack[-1]
      if top.id in self._facts:
        stack.pop()
        continue
      op = top.producer
      todo = [] if op is None or op.name in _DATA else [
          x for x in op.operands if x.id not in self._facts]
      if todo:
        stack.extend(todo)
        continue
      stack.pop()
      self._facts[top.id] = _FINITE_DATA if op is None or op.name in _DATA else \
          self._of(op, top)
    return self._facts[v.id]

  def _of(self, op: ir.Op, v: ir.Value) -> Fact:
    if not _is_float(v):
      return _FINITE_DATA  # integers and predicates are never infinite
    name, where = op.name, f"the {op.name} at {op.location}"
    ins = [self._facts[x.id] for x in op.operands]
    if name == "constant":
      value = op.attrs.get("value")
      if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
        return Fact(f"{where} (a constant not read as numbers)", math.inf)
      x = np.asarray(value, np.float64)
      if not np.all(np.isfinite(x)):  # (named by the op that reads it: a constant's
        # location is where jax lowered it)
        return Fact(f"a constant holding {x[~np.isfinite(x)].ravel()[0]}", math.inf)
      return Fact(None, float(np.max(np.abs(x), initial=0.0)))
    if name in ("iota", "rng", "partition_id", "replica_id"):
      return Fact(None, float(max(v.type.shape, default=1)))
    inherited = next((f.why for f, x in zip(ins, op.operands) if _is_float(x) and f.why), None)
    if inherited is not None:
      if inherited.startswith("a constant") and name not in _SPLATS:
        inherited = f"{where} reads {inherited}"
      return Fact(inherited, math.inf)
    bounds = [f.bound for f, x in zip(ins, op.operands) if _is_float(x)]
    largest = _largest(v.type.dtype)
    if name in _POLES:
      return Fact(f"{where} is infinite at a finite argument (log(0) = -inf)", math.inf)
    if name in _BOUNDED:
      return Fact(None, 1.0)
    if name in _KEEPS or name == "convert":
      bound = max(bounds, default=0.0)
    elif name in ("add", "subtract"):
      bound = sum(bounds)
    elif name == "multiply":
      bound = math.prod(bounds) if all(b > 0 for b in bounds) else 0.0
    elif name == "divide":  # by a constant (through broadcasts) that is never zero
      from graphguard_hlo.passes.terms import splat_value
      divisor = splat_value(op.operands[1])
      if divisor is None or divisor == 0 or not math.isfinite(divisor):
        return Fact(f"{where} divides by a value that may be zero", math.inf)
      bound = bounds[0] / abs(divisor)
    else:
      return Fact(f"{where} is not known to keep values finite", math.inf)
    if bound > largest:
      return Fact(f"{where} combines constants up to {bound:.3g}, past the largest "
                  f"{v.type.dtype} ({largest:.3g}): it may overflow to inf", math.inf)
    return Fact(None, bound)
