"""Canonical forms for softmax-weighted sums: the online softmax, telescoped.

Ring attention (and flash attention) never form a row's softmax at once: each
step folds one block of scores ``s`` into a running row max ``m``, denominator
``l`` and output ``o``, rescaling what it has by ``exp(m - m')``::

    m' = max(m, rowmax(s));  p = exp(s - m')
    l' = exp(m - m') * l + rowsum(p);  o' = exp(m - m') * o + p @ v

By ``exp(s - m) * exp(m - m') = exp(s - m')`` the rescaling telescopes: after
the last step ``o = sum_j exp(s_j - m) @ v_j`` and ``l = sum_j rowsum(exp(s_j - m))``
with the final max ``m``, which is the sequential softmax, block by block.
These patterns rewrite the recurrence to that form, one step at a time (each
step's ``o`` is already telescoped when the next one rescales it):

  exp(m - m') * 0                         -> 0
  exp(m - m') * (x + y)                   -> exp(m - m') * x + exp(m - m') * y
                                             (when x, y rescale below)
  exp(m - m') * (exp(s - m) @ v)          -> exp(s - m') @ v   (or v @ ..., transposed)
  exp(m - m') * rowsum(exp(s - m))        -> rowsum(exp(s - m'))

``exp(m - m')`` may be broadcast along the dims it scales rows of.  And the
sequential softmax divides before its matmul where the online one divides
after, so both programs get

  (p / l) @ v                             -> (p @ v) / l      (l scales rows of p)

Each is an identity of real arithmetic on finite values, and needs the new
max ``m'`` finite: where a row of every block so far is masked with -inf,
``m' = -inf`` and the program computes ``exp(-inf + inf) = NaN`` (flash
attention's classic bug), which no rewrite may hide.  So a step whose scores
may be infinite is not rewritten (``why_max_may_be_infinite``: masked, biased
or padded with an infinite constant, a ``log``, an input, or two ``finfo.min``
masks added); a finite mask value (-1e9) keeps ``m'`` finite.
Tested numerically in ``tests/test_online_softmax.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.passes.finite_rows import FiniteRows
from graphguard_hlo.passes.nonfinite import Nonfinite
from graphguard_hlo.passes.terms import sums_from_zero


def _producer(v: ir.Value, name: str) -> Optional[ir.Op]:
  op = v.producer
  return op if op is not None and op.name == name else None


def _exp_difference(v: ir.Value) -> Optional[tuple[ir.Value, ir.Value]]:
  """(a, b) if v = exp(a - b)."""
  e = _producer(v, "exponential")
  d = None if e is None else _producer(e.operands[0], "subtract")
  return None if d is None else (d.operands[0], d.operands[1])


def _row_scale(v: ir.Value) -> Optional[tuple[ir.Value, ir.Value, tuple[int, ...]]]:
  """(m, m', dims) if v = broadcast(exp(m - m'), dims) with m, m' alike (no
  broadcast: dims the identity)."""
  b = _producer(v, "broadcast_in_dim")
  inner = v if b is None else b.operands[0]
  found = _exp_difference(inner)
  if found is None or found[0].type != found[1].type or found[0].type != inner.type:
    return None
  dims = tuple(range(inner.type.rank)) if b is None else tuple(b.attrs["broadcast_dimensions"])
  return found[0], found[1], dims


def _shifted_exp(e: ir.Value, m: ir.Value) -> Optional[tuple[ir.Value, ir.Op]]:
  """(s, broadcast op) if e = exp(s - broadcast(m))."""
  found = _exp_difference(e)
  if found is None:
    return None
  s, shifted = found
  b = _producer(shifted, "broadcast_in_dim")
  if b is None or b.operands[0] is not m:
    return None
  return s, b


def _dot_rows(dot: ir.Op, side: int) -> dict[int, int]:
  """Operand ``side``'s dims the dot keeps -> their result dims (batch dims
  first, then the lhs's free dims, then the rhs's)."""
  at = dot.attrs
  batch = [at["lhs_batch"], at["rhs_batch"]]
  free = ir.dot_free_dims(at, *(v.type.rank for v in dot.operands))
  rows = {i: k for k, i in enumerate(batch[side])}
  start = len(batch[0]) + (len(free[0]) if side == 1 else 0)
  rows.update({i: start + k for k, i in enumerate(free[side])})
  return rows


def _reduce_rows(red: ir.Op) -> dict[int, int]:
  """operand dim -> result dim, for the dims a reduce keeps."""
  kept = [i for i in range(red.operands[0].type.rank) if i not in red.attrs["dimensions"]]
  return {i: k for k, i in enumerate(kept)}


def _scales_rows(bcast: ir.Op, rows: dict[int, int], scale_dims: tuple[int, ...]) -> bool:
  """Does ``scale`` (broadcast by ``scale_dims`` to the result) scale the same
  rows ``bcast`` (m into the operand) shifts?  Dim i of m must land in a kept
  operand dim that maps to where the scale puts its dim i."""
  shift_dims = bcast.attrs["broadcast_dimensions"]
  return len(shift_dims) == len(scale_dims) and all(
      d in rows and rows[d] == r for d, r in zip(shift_dims, scale_dims))


def _rescaled(module, graph, scale, x: ir.Value, location) -> Optional[ir.Value]:
  """``scale * x`` with x a telescoped term (a dot or rowsum of exp(s - m)),
  rebuilt over exp(s - m'); None if x is not one."""
  from graphguard_hlo.passes.canonicalize import _fresh, _simplified_and_placed
  m, m_new, _ = scale
  found = _telescoped_term(scale, x)
  if found is None:
    return None
  op, side, s, bcast = found
  place = lambda o: _simplified_and_placed(module, graph, o)
  shifted = place(_fresh(module, "broadcast_in_dim", [m_new], dict(bcast.attrs),
                         bcast.results[0].shape, bcast.results[0].type.dtype, location))
  diff = place(_fresh(module, "subtract", [s, shifted], {}, s.shape, s.type.dtype, location))
  e = place(_fresh(module, "exponential", [diff], {}, s.shape, s.type.dtype, location))
  operands = list(op.operands)
  operands[side] = e
  inner = op.results[0]
  new = _fresh(module, op.name, operands, dict(op.attrs), inner.shape, inner.type.dtype,
               location)
  new.regions = op.regions  # the reducer (read only)
  if inner is x:
    return place(new)
  return place(_fresh(module, "transpose", [place(new)], dict(x.producer.attrs), x.shape,
                      x.type.dtype, location))


def _telescoped_term(scale, x: ir.Value) -> Optional[tuple[ir.Op, int, ir.Value, ir.Op]]:
  """(the term's op, side, s, broadcast) if x is ``exp(s - m) @ v`` (either
  side, maybe transposed after) or ``rowsum(exp(s - m))`` with ``scale`` =
  exp(m - m') scaling its rows."""
  m, _, scale_dims = scale
  op = x.producer
  outer = {}
  if op is not None and op.name == "transpose":
    perm = op.attrs["permutation"]
    outer = {k: perm.index(k) for k in range(len(perm))}  # inner dim -> result dim
    op = op.operands[0].producer
  if op is None:
    return None
  if op.name == "dot_general" and len(op.operands) == 2:
    sides = [(k, _dot_rows(op, k)) for k in (0, 1)]
  elif sums_from_zero(op) and not outer:
    sides = [(0, _reduce_rows(op))]
  else:
    return None
  for side, rows in sides:
    if outer:
      rows = {i: outer[k] for i, k in rows.items()}
    found = _shifted_exp(op.operands[side], m)
    if found is not None and _scales_rows(found[1], rows, scale_dims):
      return op, side, found[0], found[1]
  return None


def _rescalable(scale, x: ir.Value, depth: int = 0) -> bool:
  """Is x a sum of terms ``_rescaled`` takes (checked before distributing)?"""
  op = x.producer
  if op is None or depth > 64:
    return False
  if op.name == "add":
    return all(_rescalable(scale, v, depth + 1) for v in op.operands)
  return _telescoped_term(scale, x) is not None


# Ops through which an infinite mask value reaches a row max (and where it
# is met: a select's or pad's fill, an added bias).
_TO_THE_MAX = ("maximum", "reduce", "broadcast_in_dim", "reshape", "convert", "transpose",
               "copy", "select", "add", "subtract", "multiply", "divide", "negate", "pad",
               "slice", "dynamic_slice", "concatenate")
# Where a mask meets the scores: operands that fill or bias them.
_MET = {"select": (1, 2), "pad": (1,), "add": (0, 1), "subtract": (0, 1)}
# Ops with a pole, infinite at a finite argument (log(0), x / 0).
_POLES = ("log", "log_plus_one", "rsqrt", "power", "remainder", "atan2")


def _may_overflow(value: float, dtype: str) -> bool:
  """Could ``value`` added to another such become infinite (two masks of
  ``finfo.min`` added: -inf)?"""
  from graphguard_hlo.reference import numpy_dtype
  target = numpy_dtype(dtype)
  top = float(np.finfo(target).max) if target is not None and np.dtype(target).kind == "f" \
      else 3.0e38 if dtype == "bf16" else math.inf
  return abs(value) >= top / 2


def why_max_may_be_infinite(m_new: ir.Value, budget: int = 256,
                            finite: Optional[FiniteRows] = None,
                            scores: bool = False) -> Optional[str]:
  """(See ``_why_infinite``.)  The walk without ``finite`` first: it is
  stricter, and where it finds nothing (a -1e9 mask) the rows' proofs, which
  compute masks on every rank, are not needed."""
  nonfinite = finite.nonfinite if finite is not None else Nonfinite()
  why = _why_infinite(m_new, budget, None, scores, nonfinite)
  if why is None or finite is None:
    return why
  return _why_infinite(m_new, budget, finite, scores, nonfinite)


def _why_infinite(m_new: ir.Value, budget: int, finite: Optional[FiniteRows],
                  scores: bool, nonfinite: Nonfinite) -> Optional[str]:
  """Why a row of ``m_new`` could be -inf (or +inf), in words; None if it
  cannot.  The walk follows the ops a mask reaches the max through, and
  answers where the scores are filled or biased with an infinite constant,
  with a value from an op with a pole (``log`` of a 0/1 mask), or with an
  input (an attention bias given as an argument may hold -inf); or where a
  constant of half the type's range meets a sum (two ``finfo.min`` masks
  added overflow to -inf).  Scores the walk leaves at other ops (``q @ k``)
  are finite for finite inputs.  ``finite``: where it proves a max finite
  (a mask keeping a key in every row, ``finite_rows.py``), the walk stops.
  At every row max, and for ``m_new`` itself when ``scores`` (the scores a
  mask keeps), ``nonfinite.py`` looks for infinities the program writes
  (constants, poles, constants overflowing) between the matmul and the max,
  failing closed on ops it does not know."""
  from graphguard_hlo.passes.terms import splat_value
  seen, work = set(), [(m_new, False, False)]
  if scores:
    why = nonfinite.why(m_new)
    if why is not None:
      return f"the scores may be infinite: {why}"
  while work and budget > 0:
    v, in_sum, in_mask = work.pop()
    op = v.producer
    if op is None or id(op) in seen or op.name not in _TO_THE_MAX:
      continue
    if op.name == "maximum" and finite is not None and finite.is_finite(v):
      continue
    if op.name == "reduce":  # a row max: what it is the max of, masks and all
      why = nonfinite.why(op.operands[0])
      if why is not None:
        return f"the scores may be infinite: {why}"
    seen.add(id(op))
    budget -= 1
    in_sum = in_sum or op.name in ("add", "subtract")
    met = _MET.get(op.name, ())
    for k, x in enumerate(op.operands):
      value = splat_value(x)
      if value is not None:
        if k in met and math.isinf(value):
          return f"the {op.name} at {op.location} fills or biases the scores with {value}"
        if k in met and in_sum and _may_overflow(value, x.type.dtype):
          return (f"the {op.name} at {op.location} meets the scores with {value:.4g}, half "
                  f"the type's range, under a sum: two such masks added are -inf")
        if op.name == "divide" and k == 1 and value == 0.0:
          return f"the divide at {op.location} divides by zero"
        continue
      if op.name == "divide" and k == 1:
        return f"the divide at {op.location} divides by a value that may be zero"
      masks = in_mask or k in met  # x fills or biases the scores (or is cut from what does)
      if masks and x.producer is None:
        return (f"the {op.name} at {op.location} masks or biases the scores with an input, "
                f"which may hold -inf")
      if x.producer is not None and x.producer.name in _POLES:
        return (f"the {x.producer.name} at {x.producer.location} feeds the scores and is "
                f"infinite at a finite argument (log(0) = -inf)")
      work.append((x, in_sum, masks))
  return None if budget > 0 else "the scores come from more ops than the walk follows"


def finite_rows(module: ir.Module, graph: ir.Graph) -> FiniteRows:
  """The graph's proofs of finite row maxima, made once per graph."""
  found = getattr(graph, "_finite_rows", None)
  if found is None:
    found = FiniteRows(module, graph, lambda v: why_max_may_be_infinite(
        v, finite=found, scores=True) is not None)
    graph._finite_rows = found  # type: ignore[attr-defined]
  return found


def infinite_max_words(module: ir.Module, graph: ir.Graph) -> Optional[str]:
  """For a report: why some online-softmax rescale ``exp(m - m')`` of
  ``graph`` was not telescoped (the first such), or None."""
  finite = finite_rows(module, graph)
  for op in graph.walk():
    if op.name != "multiply":
      continue
    for v in op.operands:
      scale = _row_scale(v)
      why = None if scale is None else why_max_may_be_infinite(scale[1], finite=finite)
      if why is not None:
        return why
  return None


def online_rescale(module, graph, op: ir.Op) -> Optional[ir.Value]:
  """``exp(m - m') * t`` for t zero, a sum, or a telescoped term (see above)."""
  from graphguard_hlo.passes.canonicalize import _emit, _fresh, _simplified_and_placed
  from graphguard_hlo.passes.terms import splat_value
  if op.name != "multiply" or len(op.operands) != 2:
    return None
  for scale_v, x in (op.operands, op.operands[::-1]):
    scale = _row_scale(scale_v)
    if scale is None or why_max_may_be_infinite(
        scale[1], finite=finite_rows(module, graph)) is not None:
      continue
    if splat_value(x) == 0.0 and x.type == op.results[0].type:
      return x
    if _producer(x, "add") is not None and _rescalable(scale, x):
      parts = []
      for v in x.producer.operands:
        mul = _fresh(module, "multiply", [scale_v, v], {}, v.shape, v.type.dtype, op.location)
        parts.append(_simplified_and_placed(module, graph, mul))
      return _emit(module, graph, op, "add", parts, {})
    rescaled = _rescaled(module, graph, scale, x, op.location)
    if rescaled is not None:
      return rescaled
  return None


def divide_after_dot(module, graph, op: ir.Op) -> Optional[ir.Value]:
  """dot(p / broadcast(l), v) -> dot(p, v) / broadcast(l): l scales rows of p
  (dims the dot keeps), so it scales the same rows of the product."""
  from graphguard_hlo.passes.canonicalize import _emit, _fresh, _simplified_and_placed
  if op.name != "dot_general" or len(op.operands) != 2:
    return None
  for side in (0, 1):
    div = _producer(op.operands[side], "divide")
    if div is None:
      continue
    p, denom = div.operands
    b = _producer(denom, "broadcast_in_dim")
    if b is None:
      continue
    l = b.operands[0]
    rows = _dot_rows(op, side)
    dims = b.attrs["broadcast_dimensions"]
    # l's dims must be kept dims of p, whole (a row scale, not a stretched one)
    if any(d not in rows for d in dims) or any(
        l.shape[i] != p.shape[d] for i, d in enumerate(dims)):
      continue
    out_dims = tuple(rows[d] for d in dims)
    if list(out_dims) != sorted(out_dims):
      continue  # (a transposing broadcast: not the canonical form)
    out = op.results[0]
    operands = list(op.operands)
    operands[side] = p
    dot = _fresh(module, "dot_general", operands, dict(op.attrs), out.shape, out.type.dtype,
                 op.location)
    scaled = _fresh(module, "broadcast_in_dim", [l], {"broadcast_dimensions": out_dims},
                    out.shape, l.type.dtype, op.location)
    return _emit(module, graph, op, "divide",
                 [_simplified_and_placed(module, graph, dot),
                  _simplified_and_placed(module, graph, scaled)], {})
  return None
