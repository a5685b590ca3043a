"""Symbolic index arithmetic on partition-id, with sympy.

The per-device program is one program for all ranks; the only thing that
differs between them is ``partition_id`` (and values computed from it).  We
evaluate scalar integer computations over it to a sympy expression in one
symbol per mesh axis, ``r_<axis>``, so that e.g. a dynamic-slice offset can be
proved equal to ``r_tp * 8`` once, for every rank at the same time.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import sympy

from graphguard_hlo import ir
from graphguard_hlo.reference import COMPARISONS, is_integer_type, type_bounds


def broadcast_scalar(v: ir.Value) -> ir.Value:
  """The one-element value a splat-shaped ``v`` broadcasts or reshapes (or
  converts to a type holding every value of its own)."""
  op = v.producer
  while op is not None and op.name in ("broadcast_in_dim", "reshape", "convert") and \
      math.prod(op.operands[0].shape) == 1 and (op.name != "convert" or _widens(op)):
    v = op.operands[0]
    op = v.producer
  return v


def _widens(convert: ir.Op) -> bool:
  """Does ``convert`` keep every value of its operand's type?"""
  src, dst = convert.operands[0].type.dtype, convert.results[0].type.dtype
  inner, outer = type_bounds(src), type_bounds(dst)
  return src == dst or inner is not None and outer is not None and outer[0] <= inner[0] and \
      inner[1] <= outer[1] and (src[0] not in "fb" or dst[0] in "fb")


def held_exactly(values: np.ndarray, dtype: str) -> bool:
  """Does a scalar of ``dtype`` hold each of ``values`` (its value at every
  partition) exactly, as XLA computes it?"""
  bounds = type_bounds(dtype)
  values = np.asarray(values)
  return bounds is not None and bool(
      ((values >= bounds[0]) & (values <= bounds[1]) & (values == np.round(values))).all())


def rank_symbol(axis: str) -> sympy.Symbol:
  return sympy.Symbol(f"r_{axis}", integer=True, nonnegative=True)


class RankArithmetic:
  """Memoized evaluation of integer scalars of the per-device program."""

  def __init__(self, mesh: ir.Mesh):
    self.mesh = mesh
    self._memo: dict[int, Optional[sympy.Expr]] = {}
    # Loop-body parameters that hold an outer value unchanged (invariant
    # carries: jax and XLA hoist index arithmetic out of loops).
    self.aliases: dict[int, ir.Value] = {}
    self.bounds = {rank_symbol(a): (0, n - 1) for a, n in mesh.axes}

  def partition_id(self) -> sympy.Expr:
    if self.mesh.device_ids is not None and tuple(self.mesh.device_ids) != tuple(
        range(self.mesh.size)):
      raise NotImplementedError("non-iota device order")
    expr, stride = sympy.Integer(0), 1
    for name, size in reversed(self.mesh.axes):
      expr += rank_symbol(name) * stride
      stride *= size
    return expr

  def value(self, v: ir.Value) -> Optional[sympy.Expr]:
    if v.id in self._memo:
      return self._memo[v.id]
    self._memo[v.id] = None  # cycles cannot happen in SSA, but be safe
    result = self._eval(v)
    if result is None and math.prod(v.shape) == 1 and is_integer_type(v.type.dtype):
      result = self._fitted(v)
    if result is not None and not self._held_exactly(result, v.type.dtype):
      result = None  # wraps or rounds at some partition
    self._memo[v.id] = result
    return result

  def _held_exactly(self, e: sympy.Expr, dtype: str) -> bool:
    """Is ``e`` within ``dtype``'s exact integers at every partition?"""
    bounds = type_bounds(dtype)
    if bounds is None:
      return False
    try:
      found = self.range_of(e)
    except (sympy.PolynomialError, TypeError, ValueError):
      found = None
    if found is None:  # not linear: evaluated at every partition
      symbols = list(self.bounds)
      if math.prod(b - a + 1 for a, b in self.bounds.values()) > 1 << 12:
        return False
      at = sympy.lambdify(symbols, e, "math")
      grid = np.indices([b - a + 1 for a, b in self.bounds.values()]).reshape(len(symbols), -1)
      values = [at(*map(int, point)) for point in grid.T]
      found = min(values), max(values)
    return bounds[0] <= found[0] and found[1] <= bounds[1]

  def rotated_tile(self, v: ir.Value, size: int) -> Optional[tuple[str, int]]:
    """(x, j) if the integer scalar ``v`` is ``size * ((r_x + j) mod |x|)`` on
    every partition: the offset of tile ``r_x + j``, where a ring that moved
    tiles ``-j`` steps writes what it received."""
    if math.prod(v.shape) != 1 or type_bounds(v.type.dtype) is None:
      return None  # (a float too: RoPE's positions; the table checks it holds them)
    try:
      self.partition_id()  # coordinates below assume iota device order
    except NotImplementedError:
      return None
    table = partition_id_table(v, self.mesh.size, aliases=self.aliases)
    if table is None:
      return None
    coords = np.indices([n for _, n in self.mesh.axes]).reshape(len(self.mesh.axes), -1)
    for (name, n), coord in zip(self.mesh.axes, coords):
      if n == 1:
        continue
      for j in range(n):
        if np.array_equal(table, size * ((coord + j) % n)):
          return name, j
    return None

  def _fitted(self, v: ir.Value) -> Optional[sympy.Expr]:
    """An integer that only depends on partition-id, evaluated for every
    partition and read back as ``base + step * digits`` of the mesh (nested
    offset tables: ``{0, 8}[{0, 0, 1, 1}[{0, 1, 2, 3, 0, 1, 2, 3}[pid]]]``)."""
    try:
      self.partition_id()  # the digits below assume iota device order
    except NotImplementedError:
      return None
    table = partition_id_table(v, self.mesh.size, aliases=self.aliases)
    if table is None:
      return None
    form = table_form(table)
    if form is None:
      return self._linear_in_coordinates(table)
    base, step, block, period = form
    digits = sympy.Integer(0)
    stride = 1
    for name, size in reversed(self.mesh.axes):
      if block <= stride and (period is None or stride * size <= period):
        digits += rank_symbol(name) * (stride // block)
      elif size > 1 and (stride < block < stride * size or (
          period is not None and stride < period < stride * size)):
        return None  # the table cuts inside a mesh axis
      stride *= size
    return sympy.expand(base + step * digits)

  def _linear_in_coordinates(self, table: np.ndarray) -> Optional[sympy.Expr]:
    """``base + sum_x c_x * r_x`` if the per-partition ``table`` is that at
    every partition: XLA's offsets for a dim split over axes in another
    order than the mesh's (``{0, 4, 8, 12, 2, 6, 10, 14}`` on a 2 x 4 mesh,
    tiles ``("y", "x")`` of 2 rows), which no one-digit form spells."""
    coords = np.indices([n for _, n in self.mesh.axes]).reshape(len(self.mesh.axes), -1)
    base = int(table[0])
    expr, fitted = sympy.Integer(base), np.full(len(table), base, dtype=np.int64)
    for (name, n), coord in zip(self.mesh.axes, coords):
      if n == 1:
        continue
      unit = int(np.argmax((coord == 1) & (coords.sum(axis=0) == 1)))  # r_x = 1, others 0
      c = int(table[unit]) - base
      expr += c * rank_symbol(name)
      fitted = fitted + c * coord
    return sympy.expand(expr) if np.array_equal(fitted, table) else None

  def _eval(self, v: ir.Value) -> Optional[sympy.Expr]:
    op = v.producer
    if op is None and v.id in self.aliases:
      return self.value(self.aliases[v.id])
    if op is None or math.prod(v.shape) != 1:
      return None
    if v.type.dtype.startswith(("f", "bf")) and op.name not in ("convert", "reshape",
                                                                "broadcast_in_dim", "copy"):
      return None
    name = op.name
    args = op.operands
    if name in ("partition_id",):
      return self.partition_id()
    if name == "constant":
      arr = np.asarray(op.attrs["value"])
      if arr.dtype.kind in "iub":
        return sympy.Integer(int(arr.reshape(-1)[0]))
      return None
    if name in ("convert", "reshape", "broadcast_in_dim", "copy"):
      # Exact where the result type holds the value (value() checks).
      return self.value(args[0])
    if name in ("add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum"):
      a, b = self.value(args[0]), self.value(args[1])
      if a is None or b is None:
        return None
      if name == "add":
        return sympy.expand(a + b)
      if name == "subtract":
        return sympy.expand(a - b)
      if name == "multiply":
        return sympy.expand(a * b)
      if name == "divide":
        return self._floordiv(a, b)
      if name == "remainder":
        q = self._floordiv(a, b)
        return None if q is None else sympy.expand(a - q * b)
      return self._minmax(name, a, b)
    if name == "clamp":
      lo, x, hi = (self.value(a) for a in args)
      if None in (lo, x, hi):
        return None
      inner = self._minmax("minimum", x, hi)
      return None if inner is None else self._minmax("maximum", inner, lo)
    if name in ("dynamic_slice", "slice"):
      return self._table_lookup(op)
    return None

  # A linear form with non-negative integer coefficients is bounded by the mesh.
  def range_of(self, e: sympy.Expr) -> Optional[tuple[int, int]]:
    poly = sympy.Poly(e, *self.bounds) if e.free_symbols else None
    if poly is None:
      return int(e), int(e)
    if poly.total_degree() > 1:
      return None
    lo = hi = int(poly.coeff_monomial(1))
    for s, (a, b) in self.bounds.items():
      c = int(poly.coeff_monomial(s))
      lo += min(c * a, c * b)
      hi += max(c * a, c * b)
    return lo, hi

  def _minmax(self, name: str, a: sympy.Expr, b: sympy.Expr) -> Optional[sympy.Expr]:
    ra, rb = self.range_of(a), self.range_of(b)
    if ra is None or rb is None:
      return None
    if name == "minimum":
      if ra[1] <= rb[0]:
        return a
      if rb[1] <= ra[0]:
        return b
    else:
      if ra[0] >= rb[1]:
        return a
      if rb[0] >= ra[1]:
        return b
    return None

  def _floordiv(self, a: sympy.Expr, b: sympy.Expr) -> Optional[sympy.Expr]:
    """``a / b`` as XLA divides integers, truncating toward zero: the floor
    forms below are that only where ``a`` is never negative and ``b`` > 0."""
    if not b.is_Integer or int(b) <= 0:
      return None
    try:
      low = self.range_of(a)
    except (sympy.PolynomialError, TypeError, ValueError):
      low = None
    if low is None or low[0] < 0:
      return None
    q = sympy.expand(a / b)
    # Exact when every coefficient divides; otherwise only mixed radix splits.
    if all(c.is_Integer for c in sympy.Poly(q, *self.bounds).coeffs()) if q.free_symbols else q.is_Integer:
      return q
    return self._mixed_radix_div(a, int(b))

  def _mixed_radix_div(self, a: sympy.Expr, b: int) -> Optional[sympy.Expr]:
    """floor((sum c_i r_i) / b) when the terms split cleanly at b (mesh digits)."""
    if not a.free_symbols:
      return sympy.Integer(int(a) // b)
    poly = sympy.Poly(a, *self.bounds)
    if poly.total_degree() > 1 or int(poly.coeff_monomial(1)) != 0:
      return None
    high, low_max = sympy.Integer(0), 0
    for s, (_, top) in self.bounds.items():
      c = int(poly.coeff_monomial(s))
      if c % b == 0:
        high += (c // b) * s
      elif c > 0:
        low_max += c * top
      else:
        return None
    return high if low_max < b else None

  def _table_lookup(self, op: ir.Op) -> Optional[sympy.Expr]:
    """``constant_table[index]``: GSPMD's per-partition offset tables."""
    if op.name != "dynamic_slice":
      return None
    table_v, *indices = op.operands
    if table_v.producer is None or table_v.producer.name != "constant" or len(indices) != 1:
      return None
    table = np.asarray(table_v.producer.attrs["value"]).reshape(-1)
    idx = self.value(indices[0])
    if idx is None or table.dtype.kind not in "iu":
      return None
    if len(table) == 1:
      return sympy.Integer(int(table[0]))
    rng = self.range_of(idx)
    if rng is None or rng[0] < 0 or rng[1] >= len(table):
      return None
    form = table_form(table)
    if form is None:
      return None
    base, step, block, period = form
    digit = idx
    if period is not None:
      q = self._floordiv(idx, sympy.Integer(period))
      digit = None if q is None else sympy.expand(idx - q * period)
    if digit is not None and block > 1:
      digit = self._floordiv(digit, sympy.Integer(block))
    return None if digit is None else sympy.expand(base + step * digit)


_TABLE_OPS = ("constant", "iota", "partition_id", "reshape", "convert", "broadcast_in_dim", "copy",
              "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum",
              "dynamic_slice", "compare", "select", "and", "or", "negate", "abs", "sign")


def per_coordinate(table: np.ndarray, mesh: ir.Mesh) -> Optional[tuple[str, list[int]]]:
  """(x, [value at r_x = 0, .., |x| - 1]) if a per-partition ``table`` depends
  on the mesh coordinate r_x alone (the first such axis if it is constant);
  None if on several axes or if the devices are not in iota order."""
  if mesh.device_ids is not None and tuple(mesh.device_ids) != tuple(range(mesh.size)):
    return None
  coords = np.unravel_index(np.arange(mesh.size), tuple(n for _, n in mesh.axes))
  for (axis, n), at in zip(mesh.axes, coords):
    values = [table[at == c] for c in range(n)]
    if all(len(set(v.tolist())) == 1 for v in values):
      return axis, [int(v[0]) for v in values]
  return None


def moves_with_one_axis(v: ir.Value, mesh: ir.Mesh, memo: Optional[dict] = None
                        ) -> Optional[tuple[str, list[int]]]:
  """(x, values at r_x = 0 .. |x| - 1) of a scalar computed from the
  partition id that takes at least two values and depends on the mesh
  coordinate r_x alone (evaluated on every partition, wrapping and clamping
  included); None otherwise."""
  table = partition_id_table(v, mesh.size, memo)
  if table is None or len(set(table.tolist())) < 2:
    return None
  return per_coordinate(table, mesh)


def tile_turn(values: list[int], size: int) -> Optional[int]:
  """j if ``values`` (an offset at r = 0 .. n - 1) are ``((r + j) mod n) *
  size``: rank r's own tile (j = 0), or the tile of the rank j after it."""
  n = len(values)
  return next((j for j in range(n) if values == [((c + j) % n) * size for c in range(n)]), None)


def partition_id_table(v: ir.Value, n: int, _memo: Optional[dict] = None,
                       aliases: Optional[dict] = None, iota: bool = True) -> Optional[np.ndarray]:
  """``v`` (an integer scalar) on each of the ``n`` partitions, if it is
  computed from partition-id and constants only (``aliases``: loop-body
  parameters that hold an outer value, read through).  A one-element iota is
  0: ``jnp.arange(n)`` split one row per rank, as a schedule written for
  GSPMD numbers its stages (``iota=False``: not read, see
  ``dist_program._partition_id_strides``)."""
  memo = {} if _memo is None else _memo
  if v.id in memo:
    return memo[v.id]
  if aliases and v.producer is None and v.id in aliases:
    memo[v.id] = out = partition_id_table(aliases[v.id], n, memo, aliases, iota)
    return out
  memo[v.id] = None
  op = v.producer
  out = None
  if op is not None and op.name in _TABLE_OPS and math.prod(v.shape) == 1:
    if op.name == "partition_id":
      out = np.arange(n, dtype=np.int64)
    elif op.name == "constant":
      arr = np.asarray(op.attrs["value"])
      out = np.full(n, int(arr.reshape(-1)[0]), np.int64) if arr.dtype.kind in "iub" else None
    elif op.name == "iota":
      out = np.zeros(n, np.int64) if iota else None
    elif op.name == "dynamic_slice":
      table_v, *idx = op.operands
      t = table_v.producer
      if t is not None and t.name == "constant" and len(idx) == 1:
        table = np.asarray(t.attrs["value"]).reshape(-1)
        i = partition_id_table(idx[0], n, memo, aliases, iota)
        if i is not None and table.dtype.kind in "iu":
          out = table[np.clip(i, 0, len(table) - 1)].astype(np.int64)
    elif op.name == "compare":
      args = [partition_id_table(a, n, memo, aliases, iota) for a in op.operands]
      holds = COMPARISONS.get(op.attrs.get("comparison_direction"))
      if all(a is not None for a in args) and holds is not None:
        out = np.asarray(holds(*args), dtype=np.int64)
    elif op.name == "select":
      args = [partition_id_table(a, n, memo, aliases, iota) for a in op.operands]
      if all(a is not None for a in args):
        out = np.where(args[0] != 0, args[1], args[2])
    else:
      args = [partition_id_table(a, n, memo, aliases, iota) for a in op.operands]
      if all(a is not None for a in args):
        out = apply_table_op(op.name, args, v.type.dtype)
  if out is not None and not held_exactly(out, v.type.dtype):
    out = None  # wraps or rounds at some partition, which int64 does not
  memo[v.id] = out
  return out


def apply_table_op(name: str, args: list[np.ndarray], dtype: str) -> Optional[np.ndarray]:
  """An elementwise op of ``_TABLE_OPS`` on per-partition values whose
  result has type ``dtype`` (None on a division by zero).  The caller checks
  the type holds the result."""
  if len(args) == 1:
    return {"negate": np.negative, "abs": np.abs, "sign": np.sign}.get(name, lambda a: a)(args[0])
  a, b = args
  if name in ("divide", "remainder") and np.any(b == 0):
    return None
  if name == "divide" and dtype.startswith(("f", "bf")):
    return a / b  # a float quotient: held exactly only if whole
  if name == "divide":
    return np.trunc(a / b).astype(np.int64)
  if name == "remainder":
    return np.fmod(a, b)
  return {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
          "maximum": np.maximum, "minimum": np.minimum, "and": np.bitwise_and,
          "or": np.bitwise_or}[name](a, b)


def table_form(table: np.ndarray) -> Optional[tuple[int, int, int, Optional[int]]]:
  """``table[i] == base + step * ((i % period) // block)``: GSPMD's offset tables
  (``{0, 0, 1, 1}`` for the major half of 4 devices, ``{0, 1, 0, 1}`` for the minor).

  Returns (base, step, block, period) with period None for "no wrap", or None.
  """
  n = len(table)
  i = np.arange(n)
  for period in [None] + [m for m in range(1, n) if n % m == 0]:
    span = n if period is None else period
    for block in [b for b in range(1, span + 1) if span % b == 0]:
      digits = (i if period is None else i % period) // block
      if digits.max() == 0:
        if np.all(table == table[0]):
          return int(table[0]), 0, 1, None
        continue
      step = (int(table[block]) - int(table[0])) if block < n else 0
      if np.array_equal(table, table[0] + step * digits):
        return int(table[0]), step, block, period
  return None


def table_strides(table: np.ndarray) -> set[int]:
  """Device-id strides a partition-id table cuts at (for mesh inference)."""
  form = table_form(table)
  if form is None:
    return set()
  _, _, block, period = form
  return {block} | ({period} if period else set())
