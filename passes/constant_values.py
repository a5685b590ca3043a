"""Values both programs compute from constants alone, related by their numbers.

A sequential value that depends on no input (positions ``iota(n)``, a causal
mask built from them) may have a per-device counterpart the per-device program
computes differently: load-balanced context parallelism under GSPMD reorders
the positions into zig-zag chunks as a table, which XLA's partitioner folds
into a constant and cuts per rank with a ``dynamic_slice`` at the partition's
offset.  No lemma turns ``iota`` into that table; but both sides are numbers
we can compute, the sequential value once and the per-device one on every
rank, and a relation between two known values is checked by comparing them.

``ConstantValues.relations`` proposes the layouts the per-device value may
have (the tilings giving its shape, each also with its dims' chunks in any
order an input's relation uses) and keeps those under which every rank's value
equals its tile of the sequential value exactly.  That is a proof, rank by
rank, for these inputs-free values, the way ``rank_tables`` follows pieces
rank by rank.  Values past ``MAX_ELEMENTS`` (on either side) are not computed:
this is for tables, not for whole activations.

The numbers are the reference interpreter's, so only values it computes
exactly as XLA does are trusted (``_exact``): constants, data movement,
comparisons and selects, integer arithmetic that stays in range, and converts
that lose nothing.  Float arithmetic (XLA's transcendentals, bfloat16
rounding, f32 products are not numpy's to the last bit) and converts that
round, wrap or saturate make a value untrusted, and so does everything after.
An audit found such false proofs before this rule: a float to int convert out
of range (numpy wraps, XLA saturates), ``tanh``'s last bits, bfloat16 sums
kept in f32.  Values are compared bit for bit in their own type (-0.0 is not
0.0, int64 past 2^53 is not rounded through float64).
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.interpret import Interpreter, Unsupported, mesh_coords
from graphguard_hlo.passes.layout import (Layout, reorder_chunks, tile_slices,
                                          tilings_with_local_shape)
from graphguard_hlo.reference import is_integer_type, numpy_dtype, type_bounds

MAX_ELEMENTS = 1 << 16

# Ops whose result the interpreter computes exactly as XLA does, whatever the
# (trusted) operands: they only move or pick values (dynamic slices but for
# their starts, ``_index_folds_as_it_runs``).
_MOVES = frozenset({"constant", "broadcast_in_dim", "reshape", "transpose", "slice",
                    "concatenate", "reverse", "copy", "pad", "select", "dynamic_slice",
                    "dynamic_update_slice", "partition_id"})
# Integer arithmetic, exact while the result stays in its type's range
# (checked against Python's integers).
_INTEGER_ARITHMETIC = {
    "add": lambda a, b: a + b, "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b, "negate": lambda a: -a, "abs": abs,
    "maximum": max, "minimum": min, "and": lambda a, b: a & b, "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
}


def small_ops(graph: ir.Graph) -> list[ir.Op]:
  """The graph's ops an input-free value may come from: not loops (their
  bodies are related by loops.py), no result past MAX_ELEMENTS."""
  return [op for op in graph.ops if op.name != "while"
          and all(int(np.prod(r.type.shape)) <= MAX_ELEMENTS for r in op.results)]


def _integral(x: np.ndarray, dtype: str) -> bool:
  """Are all of ``x`` integers that ``dtype`` holds exactly?"""
  bounds = type_bounds(dtype)
  if bounds is None:
    return False
  if x.size == 0:
    return True
  if x.dtype.kind == "f" and not np.all(np.isfinite(x) & (np.trunc(x) == x)):
    return False
  values = _python_ints(x, x.shape)
  return bounds[0] <= min(values) and max(values) <= bounds[1]


def _in_own_type(x: np.ndarray, dtype: str) -> Optional[np.ndarray]:
  """``x`` held in the numpy type of IR type ``dtype``, if that loses nothing
  (a splat read as float64 for an f32 constant); None for types numpy has
  none of (bfloat16, f8, 4-bit ints: the interpreter holds them in wider
  types and does not round as XLA does) or values the type cannot hold."""
  target = numpy_dtype(dtype)
  if target is None:
    return None
  x = np.asarray(x)
  if x.dtype == target:
    return x
  with np.errstate(all="ignore"):
    y = x.astype(target)
    back = y.astype(x.dtype)
  return y if _same_bits(back, x) else None


def _index_folds_as_it_runs(v: ir.Value, x: np.ndarray) -> bool:
  """XLA's constant folding reads an unsigned start with its top bit set as
  negative (a u8 200, a u32 2^32 - 1: folded to 0, run at the clamped end),
  so such starts are not trusted; signed ones fold as they run."""
  dtype = v.type.dtype
  if not dtype.startswith("ui"):
    return True
  return bool(np.all(np.asarray(x).astype(object) < (1 << (int(dtype[2:]) - 1))))


def _exact(op: ir.Op, args: list[np.ndarray], out: np.ndarray) -> bool:
  """Did the interpreter compute ``out`` of ``op`` on ``args`` as XLA does?"""
  name, dtype = op.name, op.results[0].type.dtype
  if name in ("dynamic_slice", "dynamic_update_slice"):
    first = 1 if name == "dynamic_slice" else 2
    return all(_index_folds_as_it_runs(v, x) for v, x in zip(op.operands[first:], args[first:]))
  if name in _MOVES:
    return True
  if name == "iota":
    return is_integer_type(dtype) or _integral(np.asarray(op.results[0].type.shape), dtype)
  if name in ("compare", "convert") and any(_subnormal(a) for a in args):
    return False  # XLA:CPU reads them as zero at run time, not when it folds
  if name == "compare":
    # TOTALORDER (-0.0 below 0.0, NaNs ordered) is read by the interpreter but
    # was never checked against XLA: not trusted.
    if "TOTALORDER" in str(op.attrs.get("compare_type", "")):
      return not any(a.dtype.kind == "f" for a in args)
    return not any(a.dtype.kind == "f" and np.isnan(a).any() for a in args)
  if name == "convert":
    (x,), source = args, op.operands[0].type.dtype
    if source == dtype or source in ("pred", "i1") or x.size == 0:
      return True
    if dtype in ("pred", "i1"):
      return not (x.dtype.kind == "f" and np.isnan(x).any())
    if is_integer_type(dtype) or is_integer_type(source):
      return _integral(x, dtype)  # no rounding, wrapping or saturating
    return (source, dtype) in {("f16", "f32"), ("bf16", "f32"), ("f16", "f64"), ("bf16", "f64"),
                               ("f32", "f64")}  # widening
  if not is_integer_type(dtype) or (dtype in ("pred", "i1") and name not in ("and", "or", "xor")):
    return False  # float arithmetic, transcendentals, reductions: not bit for bit
  if name in ("divide", "remainder"):
    # XLA truncates toward zero (Python floors), and the remainder has the
    # dividend's sign: jnp's ``(r - t) % n`` is a remainder of a negative.
    a, b = (_python_ints(x, out.shape) for x in args)
    if any(y == 0 for y in b):
      return False
    quotients = [_truncated_quotient(x, y) for x, y in zip(a, b)]
    exact = quotients if name == "divide" else [x - y * q for x, y, q in zip(a, b, quotients)]
    low, high = type_bounds(dtype)
    return exact == _python_ints(out, out.shape) and all(low <= v <= high for v in exact)
  if name in _INTEGER_ARITHMETIC:
    operands = [_python_ints(a, out.shape) for a in args]
    exact = [_INTEGER_ARITHMETIC[name](*vs) for vs in zip(*operands)]
    got = _python_ints(out, out.shape)
    bounds = type_bounds(dtype)
    return exact == got and all(bounds[0] <= v <= bounds[1] for v in exact)
  return False


def _truncated_quotient(x: int, y: int) -> int:
  """x / y rounded toward zero, as XLA divides integers."""
  q = abs(x) // abs(y)
  return q if (x >= 0) == (y > 0) else -q


def _subnormal(x: np.ndarray) -> bool:
  """Does float ``x`` hold a subnormal number?  XLA's CPU code runs with
  denormals flushed to zero: ``1e-45 != 0`` is false there, true when folded."""
  x = np.asarray(x)
  if x.dtype.kind != "f" or x.size == 0:
    return False
  with np.errstate(invalid="ignore"):
    return bool(np.any((x != 0) & (np.abs(x) < np.finfo(x.dtype).tiny)))


def _python_ints(x: np.ndarray, shape: tuple[int, ...]) -> list[int]:
  """``x`` broadcast to ``shape``, flat, as Python's (unbounded) integers."""
  return [int(v) for v in np.broadcast_to(x, shape).ravel().tolist()]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
  """Equal in their own type, bit for bit (-0.0 is not 0.0; no float64 detour)."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype or a.shape != b.shape:
    return False
  if a.dtype.kind == "f":
    a, b = a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}")
  return bool(np.array_equal(a, b))


def exact_values(ops: list[ir.Op], ranks: int) -> dict:
  """The values of ``ops`` the interpreter computes as XLA does on every rank,
  from constants (and the partition id) alone."""
  interpreter, env = Interpreter(ranks), {}
  for op in ops:
    if len(op.results) != 1 or any(v.id not in env for v in op.operands):
      continue
    interpreter.run_ops([op], env)
    r = op.results[0]
    if r.id not in env:
      continue
    held = [_in_own_type(x, r.type.dtype) for x in env[r.id]]
    if any(x is None for x in held) or not all(
        _exact(op, [env[v.id][k] for v in op.operands], held[k]) for k in range(ranks)):
      del env[r.id]
    else:
      env[r.id] = held
  return env


class ConstantValues:
  def __init__(self, seq: ir.Graph, dist: ir.Graph, mesh: ir.Mesh,
               orders: frozenset[tuple[int, ...]]):
    """``orders``: the chunk orders the inputs' relations use (tried on every
    dim they cut evenly)."""
    self.seq, self.dist, self.mesh, self.orders = seq, dist, mesh, orders
    self._seq_env: Optional[dict] = None
    self._dist_by_type: Optional[dict] = None
    self._dist_env: dict = {}
    self._coords: list = []

  def relations(self, s: ir.Value) -> Iterator[tuple[ir.Value, Layout]]:
    """(per-device value, layout) pairs with ``d@r == tile_r(s)`` on every rank."""
    for d, layout, wrong in self._compared(s):
      if not wrong:
        yield d, layout

  def nearest(self, s: ir.Value) -> Optional[tuple[ir.Value, Layout, list, list]]:
    """For a report: the per-device value and layout holding ``s``'s tiles on
    the most ranks but not all, with the coordinates where it does and does
    not (None if no rank holds one)."""
    best = None
    for d, layout, wrong in self._compared(s):
      if wrong and len(wrong) < len(self._coords) and (best is None or len(wrong) < len(best[2])):
        best = (d, layout, wrong)
    if best is None:
      return None
    d, layout, wrong = best
    return d, layout, [c for c in self._coords if c not in wrong], wrong

  def _compared(self, s: ir.Value) -> Iterator[tuple[ir.Value, Layout, list]]:
    """Every candidate (value, layout) with the coordinates of the ranks whose
    value is not their tile of ``s``."""
    want = self._seq_value(s)
    if want is None:
      return
    for (shape, dtype), values in self._dist_values().items():
      if dtype != s.type.dtype or len(shape) != s.type.rank:
        continue
      for layout in self._layouts(s.type.shape, shape):
        tiles = {c: self._tile(want, layout, c) for c in self._coords}
        for d in values:
          per_rank = self._dist_env[d.id]
          yield d, layout, [c for k, c in enumerate(self._coords)
                            if not _same_bits(per_rank[k], tiles[c])]

  def _tile(self, whole: np.ndarray, layout: Layout, coord: tuple) -> np.ndarray:
    """Rank ``coord``'s tile of ``whole`` under ``layout`` (plain, maybe reordered)."""
    for k, chunks in layout.order:
      whole = reorder_chunks(whole, k, chunks)
    return whole[tile_slices(layout, self.mesh, whole.shape,
                             dict(zip(self.mesh.axis_names, coord)))]

  def is_known(self, s: ir.Value) -> bool:
    """Is ``s`` input-free (and small enough to compute)?"""
    return self._seq_value(s) is not None

  def _layouts(self, whole: tuple[int, ...], tile: tuple[int, ...]) -> Iterator[Layout]:
    per_dim = [[None] + [c for c in sorted(self.orders) if n % len(c) == 0] for n in whole]
    for plain in tilings_with_local_shape(whole, tile, self.mesh):
      for choice in itertools.product(*per_dim):
        order = tuple((k, c) for k, c in enumerate(choice) if c is not None)
        yield plain.with_(order=order) if order else plain

  def _seq_value(self, s: ir.Value) -> Optional[np.ndarray]:
    if self._seq_env is None:
      self._seq_env = exact_values(small_ops(self.seq), 1)
    found = self._seq_env.get(s.id)
    return None if found is None else np.asarray(found[0])

  def _dist_values(self) -> dict:
    """Per-device values known on every rank, by (shape, dtype)."""
    if self._dist_by_type is None:
      self._dist_by_type = {}
      try:
        self._coords = mesh_coords(self.mesh)
      except Unsupported:
        return self._dist_by_type
      self._dist_env = exact_values(small_ops(self.dist), len(self._coords))
      for op in self.dist.ops:
        for r in op.results:
          if r.id in self._dist_env:
            self._dist_by_type.setdefault((r.type.shape, r.type.dtype), []).append(r)
    return self._dist_by_type
