"""Canonical forms for a softmax's backward, the way flash attention writes it.

Autodiff of ``out = (e / l) @ v`` (``e = exp(s - m)``, ``l = rowsum(e)``)
gives the scores' cotangent through the division as

    e * (dP / l - rowsum(dP * e * (1 / (l * l))))     dP = dout @ v^T

while flash and ring attention (a hand-written ``custom_vjp``) recompute each
block's probabilities from the saved log-sum-exp ``lse = m + log(l)`` and
never sum over the keys:

    p = exp(s - lse);  D = rowsum(dout * out);  ds = p * (dP - D)

The two agree because a sum over the keys of ``(dout @ v^T) * e`` is a sum
over the head dims of ``dout * (e @ v)`` (both are sum_{t,d} dout[d] v[t,d]
e[t]).  These patterns rewrite both spellings to the flash one:

  exp(x - (m + log(l))), l > 0             -> exp(x - m) / l
  e * (dP / l - rowsum(dP * e * 1/(l*l)))  -> (e / l) * (dP - rowsum(dout * ((e @ v) / l)))

(row vectors broadcast along the keys).  Each is an identity of real
arithmetic (the first needs ``l > 0``, which ``_positive`` proves from how l
is computed: sums and products of exponentials); tested numerically in
``tests/test_softmax_backward.py``.  The second only fires on exactly
autodiff's form: the same ``e`` and ``l`` throughout, ``1/(l*l)`` scaling
rows, the sum over the keys ``v`` brings.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.loop_copies import through_unit_dims
from graphguard_hlo.passes.online_softmax import _producer
from graphguard_hlo.passes.terms import splat_value, sums_from_zero

_SHAPE_ONLY = ("broadcast_in_dim", "reshape", "transpose", "copy")


def _positive(v: ir.Value, depth: int = 0) -> bool:
  """Is every element of v > 0, by how it is computed (in real arithmetic)?"""
  return _sign(v, depth) == "positive"


def _sign(v: ir.Value, depth: int = 0) -> Optional[str]:
  """"positive", "nonnegative" or None (unknown), from v's producers."""
  splat = splat_value(v)
  if splat is not None:
    return "positive" if splat > 0 else "nonnegative" if splat == 0 else None
  op = v.producer
  if op is None or depth > 32:
    return None
  if op.name == "exponential":
    return "positive"
  if op.name in _SHAPE_ONLY:
    return _sign(op.operands[0], depth + 1)
  signs = [_sign(x, depth + 1) for x in op.operands[:2]]
  if op.name == "add":
    if None in signs:
      return None
    return "positive" if "positive" in signs else "nonnegative"
  if op.name in ("multiply", "divide"):
    if signs == ["positive", "positive"]:
      return "positive"
    return "nonnegative" if op.name == "multiply" and None not in signs else None
  if op.name == "maximum":
    return "positive" if "positive" in signs else \
        "nonnegative" if "nonnegative" in signs else None
  if sums_from_zero(op):
    # a sum of positives over dims with at least one element (the init is 0)
    empty = any(op.operands[0].shape[d] == 0 for d in op.attrs["dimensions"])
    return None if empty or signs[0] is None else signs[0]
  return None


def lse_as_division(module, graph, op: ir.Op) -> Optional[ir.Value]:
  """exp(x - broadcast(m + log(l))) -> exp(x - broadcast(m)) / broadcast(l), l > 0."""
  from graphguard_hlo.passes.canonicalize import _emit, _fresh, _simplified_and_placed
  if op.name != "exponential":
    return None
  diff = _producer(op.operands[0], "subtract")
  bcast = None if diff is None else _producer(diff.operands[1], "broadcast_in_dim")
  lse = None if bcast is None else _producer(bcast.operands[0], "add")
  if lse is None:
    return None
  for m, log_l in (lse.operands, lse.operands[::-1]):
    log = _producer(log_l, "log")
    if log is None or not _positive(log.operands[0]):
      continue
    l = log.operands[0]
    x = diff.operands[0]
    place = lambda o: _simplified_and_placed(module, graph, o)
    out = op.results[0]
    shape, dtype, at = out.shape, out.type.dtype, op.location

    def broadcast(row):
      return place(_fresh(module, "broadcast_in_dim", [row], dict(bcast.attrs), shape, dtype, at))
    shifted = place(_fresh(module, "subtract", [x, broadcast(m)], {}, shape, dtype, at))
    e = place(_fresh(module, "exponential", [shifted], {}, shape, dtype, at))
    return _emit(module, graph, op, "divide", [e, broadcast(l)], {})
  return None


def _row_broadcast(v: ir.Value, rows: tuple[int, ...]) -> Optional[ir.Value]:
  """x if v = broadcast_in_dim(x, dims), a row vector stretched along the keys:
  dims among ``rows``, in order, x's dims whole, and the rows it leaves out
  of size 1 (XLA squeezes a row vector's unit dims before broadcasting it)."""
  b = _producer(v, "broadcast_in_dim")
  if b is None:
    return None
  x, dims = b.operands[0], tuple(b.attrs["broadcast_dimensions"])
  if list(dims) != sorted(dims) or not set(dims) <= set(rows) or \
      any(x.shape[i] != v.shape[d] for i, d in enumerate(dims)) or \
      any(v.shape[d] != 1 for d in rows if d not in dims):
    return None
  return x


def _row_vector(v: ir.Value, rows_shape: tuple[int, ...]) -> Optional[ir.Value]:
  """v, or what v squeezes, if that has the rows' shape."""
  if v.shape != rows_shape:
    v = through_unit_dims(v)
  return v if v.shape == rows_shape else None


def _negated(v: ir.Value) -> tuple[ir.Value, bool]:
  """(x, negated?) with v = x or -x, through unit-dim reshapes and negations."""
  negated = False
  while True:
    v = through_unit_dims(v)
    neg = _producer(v, "negate")
    if neg is None:
      return v, negated
    v, negated = neg.operands[0], not negated


def _is_inverse_square(c: ir.Value, l: ir.Value) -> bool:
  """c = 1 / (l * l), l maybe reshaped to unit dims."""
  div = _producer(through_unit_dims(c), "divide")
  if div is None or splat_value(div.operands[0]) != 1.0:
    return False
  sq = _producer(div.operands[1], "multiply")
  return sq is not None and all(through_unit_dims(x) is through_unit_dims(l)
                                for x in sq.operands)


def _factors(v: ir.Value, limit: int = 3) -> Optional[list[ir.Value]]:
  """The leaves of a tree of multiplies (at most ``limit``)."""
  op = _producer(v, "multiply")
  if op is None:
    return [v]
  out: list[ir.Value] = []
  for x in op.operands:
    part = _factors(x, limit)
    if part is None:
      return None
    out += part
  return out if len(out) <= limit else None


class _DotDims(NamedTuple):
  """dP = dot(dout, v)'s dims: its result is [batch, rows (dout's free dims),
  keys (v's free dims)]."""
  n_batch: int
  dout_free: list[int]
  v_free: list[int]

  @property
  def rows(self) -> tuple[int, ...]:
    """The result's batch and row dims: what l and the rowsums are indexed by."""
    return tuple(range(self.n_batch + len(self.dout_free)))

  @property
  def keys(self) -> tuple[int, ...]:
    n = len(self.rows)
    return tuple(range(n, n + len(self.v_free)))


def _dot_dims(dot: ir.Op) -> _DotDims:
  at = dot.attrs
  a, v = dot.operands
  return _DotDims(len(at["lhs_batch"]), *ir.dot_free_dims(at, a.type.rank, v.type.rank))


def division_vjp_as_flash(module, graph, op: ir.Op) -> Optional[ir.Value]:
  """e * (dP / l - rowsum(dP * e / (l*l))) -> (e / l) * (dP - rowsum(dout * (e @ v) / l)),
  dP = dot(dout, v) summing the head dims, the rowsums over the keys v brings."""
  if op.name != "multiply" or len(op.operands) != 2:
    return None
  for x, e in (op.operands, op.operands[::-1]):
    found = _division_vjp(x, e)
    if found is not None:
      return _flash(module, graph, op, e, *found)
  return None


def _division_vjp(x: ir.Value, e: ir.Value):
  """(dP's dot, its dims, the broadcast of l, l, the rowsum) if x = dP / l - rowsum(dP * e / (l*l)),
  written as a subtract or (autodiff's way) as an add of the negated rowsum."""
  op = x.producer
  if op is None or e.type != x.type or len(op.operands) != 2:
    return None
  if op.name == "add":
    spellings = [(*op.operands, True), (*op.operands[::-1], True)]
  elif op.name == "subtract":
    spellings = [(*op.operands, False)]
  else:
    return None
  for quotient, correction, negate in spellings:
    div = _producer(quotient, "divide")
    dot = None if div is None else _producer(div.operands[0], "dot_general")
    if dot is None or len(dot.operands) != 2:
      continue
    dims = _dot_dims(dot)
    rows, keys = dims.rows, dims.keys
    rows_shape = dot.results[0].shape[:len(rows)]
    l_rows = _row_broadcast(div.operands[1], rows)
    l = None if l_rows is None else _row_vector(l_rows, rows_shape)
    inner = _row_broadcast(correction, rows)
    if l is None or inner is None:
      continue
    total, negated = _negated(inner)
    red = _producer(total, "reduce")
    if negated != negate or red is None or not sums_from_zero(red) or \
        tuple(red.attrs["dimensions"]) != keys or red.results[0].type != l.type:
      continue
    factors = _factors(red.operands[0])
    if factors is None or len(factors) != 3:
      continue
    dP = dot.results[0]
    rest = [f for f in factors if f is not dP and f is not e]
    if len(rest) != 1 or sum(f is dP for f in factors) != 1 or sum(f is e for f in factors) != 1:
      continue
    scale = _row_broadcast(rest[0], rows)
    if scale is None or not _is_inverse_square(scale, l):
      continue
    return dot, dims, div.operands[1], l, red
  return None


def _flash(module, graph, op: ir.Op, e: ir.Value, dot: ir.Op, dims: _DotDims,
           l_rows: ir.Value, l: ir.Value, red: ir.Op) -> ir.Value:
  from graphguard_hlo.passes.canonicalize import _emit, _fresh, _simplified_and_placed
  place = lambda o: _simplified_and_placed(module, graph, o)
  at = op.location
  dtype = e.type.dtype
  dout, v = dot.operands
  attrs = dot.attrs
  nb, rows, keys = dims.n_batch, dims.rows, dims.keys
  # e @ v: batch dims, e's rows, then v's head dims (dout's contracted ones)
  heads = sorted(attrs["rhs_contract"])
  ev_shape = e.shape[:len(rows)] + tuple(v.shape[d] for d in heads)
  ev = place(_fresh(module, "dot_general", [e, v], {
      "lhs_batch": tuple(range(nb)), "rhs_batch": tuple(attrs["rhs_batch"]),
      "lhs_contract": keys, "rhs_contract": tuple(dims.v_free)}, ev_shape, dtype, at))
  head_dims = tuple(range(len(rows), len(ev_shape)))
  l_heads = place(_fresh(module, "broadcast_in_dim", [l], {"broadcast_dimensions": rows},
                         ev_shape, dtype, at))
  out = place(_fresh(module, "divide", [ev, l_heads], {}, ev_shape, dtype, at))
  # dout with its dims in out's order: batch, rows, heads as v's are sorted
  by_head = dict(zip(attrs["rhs_contract"], attrs["lhs_contract"]))
  perm = tuple(attrs["lhs_batch"]) + tuple(dims.dout_free) + tuple(by_head[d] for d in heads)
  dout_t = dout if perm == tuple(range(len(perm))) else place(_fresh(
      module, "transpose", [dout], {"permutation": perm}, ev_shape, dtype, at))
  # dP again, from dout in that order: autodiff reads dout transposed for
  # dP, the hand-written backward does not, and dP's dims are the same
  dp = place(_fresh(module, "dot_general", [dout_t, v], {
      "lhs_batch": tuple(range(nb)), "rhs_batch": tuple(attrs["rhs_batch"]),
      "lhs_contract": head_dims, "rhs_contract": tuple(heads)}, e.shape, dtype, at))
  weighted = place(_fresh(module, "multiply", [dout_t, out], {}, ev_shape, dtype, at))
  d = _fresh(module, "reduce", [weighted, red.operands[1]], {"dimensions": head_dims},
             l.shape, dtype, at)
  d.regions = red.regions  # the sum (read only)
  d_rows = place(_fresh(module, "broadcast_in_dim", [place(d)], {"broadcast_dimensions": rows},
                        e.shape, dtype, at))
  centred = place(_fresh(module, "subtract", [dp, d_rows], {}, e.shape, dtype, at))
  probs = place(_fresh(module, "divide", [e, l_rows], {}, e.shape, dtype, at))
  return _emit(module, graph, op, "multiply", [probs, centred], {})
