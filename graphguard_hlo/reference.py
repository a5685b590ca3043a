"""Numpy reference semantics of the IR ops the lemmas reason about.

``evaluate(name, attrs, operands, result_type)`` computes one op on numpy
arrays, following the StableHLO spec.  It is the ground truth the lemma and
transfer tests compare against, and it can cross-check the verifier by running
both programs numerically, so it favours obviously-correct over fast.

Ops compute in their operands' precision (tests pass float64); only
``convert`` and ``iota`` look at ``result_type.dtype``.  ``partition_id`` and
the collectives depend on the rank and are not here.  ``reduce`` (and
``reduce_window``, ``scatter``) reads its reducer from ``attrs["gg.reduction"]``
("sum", "max", "min", "mul"), the form ``inference`` gives it; ``reduce`` takes
``[operand, init]``.  ``sort`` reads its comparator as a function from
``attrs["gg.comparator"]`` (the interpreter runs the region itself), and
``select_and_scatter`` its select region from ``attrs["gg.select"]``, its
scatter's reducer from ``attrs["gg.reduction"]``.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Callable, Optional, Sequence

import numpy as np

from graphguard_hlo import ir

# -- dtypes ----------------------------------------------------------------------

_NUMPY_DTYPES = {
    "f64": np.float64, "f32": np.float32, "f16": np.float16,
    "i64": np.int64, "i32": np.int32, "i16": np.int16, "i8": np.int8,
    "ui64": np.uint64, "ui32": np.uint32, "ui16": np.uint16, "ui8": np.uint8,
    "i1": np.bool_, "pred": np.bool_,
}


def _round_to_bf16(x: np.ndarray) -> np.ndarray:
  """Round float32 to the nearest bfloat16 (ties to even), kept as float32."""
  bits = np.asarray(x, dtype=np.float32).view(np.uint32)
  bias = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
  rounded = ((bits + bias) & np.uint32(0xFFFF0000)).view(np.float32)
  return np.where(np.isfinite(x), rounded, np.asarray(x, dtype=np.float32))


def numpy_dtype(dtype: str) -> Optional[type]:
  """The numpy type holding IR type ``dtype`` as XLA does; None for the types
  numpy has none of (bfloat16, f8, 4-bit ints), which values are held in
  wider types here and not rounded as XLA rounds them."""
  return _NUMPY_DTYPES.get(dtype)


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
  """``convert`` to an IR dtype: floats round, ints truncate toward zero, i1 is ``!= 0``."""
  x = np.asarray(x)
  if dtype == "bf16":
    return _round_to_bf16(x.astype(np.float32))
  if dtype not in _NUMPY_DTYPES:
    raise NotImplementedError(f"reference: dtype {dtype}")
  target = _NUMPY_DTYPES[dtype]
  if target is np.bool_:
    return x != 0
  if np.issubdtype(target, np.integer) and np.issubdtype(x.dtype, np.floating):
    x = np.trunc(x)
  return x.astype(target)



# The largest integer each float type holds exactly, with every one below it.
_EXACT_INTEGERS = {"f16": 1 << 11, "bf16": 1 << 8, "f32": 1 << 24, "f64": 1 << 53}


def is_integer_type(dtype: str) -> bool:
  """Is ``dtype`` a signed or unsigned integer type?  Booleans count, under
  both their names (StableHLO's ``i1``, HLO's ``pred``), so a module reads the
  same whichever form it was dumped in."""
  return dtype == "pred" or (dtype.startswith(("i", "ui")) and dtype.lstrip("ui").isdigit())


def type_bounds(dtype: str) -> Optional[tuple[int, int]]:
  """The integers a scalar of ``dtype`` holds exactly, as (lowest, highest);
  None for other types.  XLA wraps, rounds or saturates what falls outside."""
  if dtype in ("pred", "i1"):
    return 0, 1
  if is_integer_type(dtype):
    bits = int(dtype.lstrip("ui"))
    return (-(1 << bits - 1), (1 << bits - 1) - 1) if dtype[0] == "i" else (0, (1 << bits) - 1)
  top = _EXACT_INTEGERS.get(dtype)
  return None if top is None else (-top, top)


def constant_array(value, dtype: str) -> ir.ConstantArray:
  """What a new ``constant`` op of IR type ``dtype`` holds: ``value`` cast to it.
  Formats numpy has no type for (the f8s) are kept in f32, as loaders keep them."""
  try:
    return ir.ConstantArray(cast(np.asarray(value), dtype))
  except NotImplementedError:
    return ir.ConstantArray(np.asarray(value, np.float32))

# -- elementwise -------------------------------------------------------------------

def _round_afz(x):
  return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _integers(a, b) -> bool:
  return np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer)


def _divide(a, b):
  """Integer division truncates toward zero (C), not toward -inf (numpy
  ``//``); as XLA defines the rest, x / 0 is -1 (all ones, unsigned) and
  INT_MIN / -1 wraps to INT_MIN (computed in 64 bits, wrapped back)."""
  if not _integers(a, b):
    return np.divide(a, b)
  wide_a, wide_b = a.astype(np.int64), b.astype(np.int64)
  safe = np.where(wide_b == 0, 1, wide_b)
  q = np.sign(wide_a) * np.sign(safe) * (np.abs(wide_a) // np.abs(safe))
  return np.where(wide_b == 0, -1, q).astype(a.dtype)


def _remainder(a, b):
  """The sign of the dividend, as in C; x % 0 is x, as XLA defines it."""
  if not _integers(a, b):
    return np.fmod(a, b)
  safe = np.where(b == 0, 1, b)
  return np.where(b == 0, a, np.fmod(a.astype(np.int64), safe.astype(np.int64))).astype(a.dtype)


UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "negate": np.negative, "copy": lambda x: x.copy(), "abs": np.abs,
    "exponential": np.exp, "exponential_minus_one": np.expm1,
    "log": np.log, "log_plus_one": np.log1p, "logistic": lambda x: 1 / (1 + np.exp(-x)),
    "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "cbrt": np.cbrt,
    "tanh": np.tanh, "sine": np.sin, "cosine": np.cos, "tan": np.tan,
    "ceil": np.ceil, "floor": np.floor, "sign": np.sign,
    "round_nearest_even": np.round, "round_nearest_afz": _round_afz,
    "is_finite": np.isfinite, "not": np.invert,  # logical on i1, bitwise on ints
    "erf": np.vectorize(math.erf, otypes=[np.float64]),
    "chlo.square": np.square,
    "chlo.erf": np.vectorize(math.erf, otypes=[np.float64]),
    "chlo.erfc": np.vectorize(math.erfc, otypes=[np.float64]),
    "chlo.lgamma": np.vectorize(math.lgamma, otypes=[np.float64]),
    "chlo.sinh": np.sinh, "chlo.cosh": np.cosh, "chlo.tan": np.tan,
    "chlo.asin": np.arcsin, "chlo.acos": np.arccos, "chlo.atan": np.arctan,
    "chlo.asinh": np.arcsinh, "chlo.acosh": np.arccosh, "chlo.atanh": np.arctanh,
    "chlo.is_inf": np.isinf, "chlo.is_pos_inf": np.isposinf, "chlo.is_neg_inf": np.isneginf,
}

BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": _divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power,
    "remainder": _remainder,
    "atan2": np.arctan2,
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,  # also on i1
}

COMPARISONS = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
               "GT": np.greater, "GE": np.greater_equal}


def ordered_as(x: np.ndarray, compare_type) -> np.ndarray:
  """``x`` as numbers that order the way ``compare_type`` compares it: an
  UNSIGNED compare of signed ints reads their bits unsigned (XLA checks
  ``0 <= i < n`` in one compare so), a SIGNED one of unsigned ints signed,
  and TOTALORDER floats by their bits (-NaN < -inf < -0.0 < 0.0 < inf < NaN).
  The default (no type, or the dtype's own) leaves ``x`` as it is."""
  kind = str(compare_type or "")
  if x.dtype.kind in "iu" and ("UNSIGNED" in kind or "SIGNED" in kind):
    signed = "UNSIGNED" not in kind
    want = np.dtype(f"{'i' if signed else 'u'}{x.dtype.itemsize}")
    return x.view(want) if x.dtype != want else x
  if x.dtype.kind == "f" and "TOTALORDER" in kind:
    bits = x.view(f"i{x.dtype.itemsize}").astype(np.int64)
    magnitude = (1 << (8 * x.dtype.itemsize - 1)) - 1
    return np.where(bits < 0, bits ^ magnitude, bits)  # negatives reversed below the positives
  return x


# -- structural ops ----------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def dot_general(lhs: np.ndarray, rhs: np.ndarray, attrs: dict) -> np.ndarray:
  """Result dims: batch (in lhs_batch order), lhs free, rhs free, as in StableHLO."""
  lb, rb = attrs["lhs_batch"], attrs["rhs_batch"]
  lc, rc = attrs["lhs_contract"], attrs["rhs_contract"]
  letters = iter(_LETTERS)
  lhs_sub = [next(letters) for _ in range(lhs.ndim)]
  rhs_sub = [""] * rhs.ndim
  for i, j in zip(lb, rb):
    rhs_sub[j] = lhs_sub[i]
  for i, j in zip(lc, rc):
    rhs_sub[j] = lhs_sub[i]
  rhs_sub = [s or next(letters) for s in rhs_sub]
  out = ([lhs_sub[i] for i in lb]
         + [lhs_sub[i] for i in range(lhs.ndim) if i not in lb and i not in lc]
         + [rhs_sub[j] for j in range(rhs.ndim) if j not in rb and j not in rc])
  spec = f"{''.join(lhs_sub)},{''.join(rhs_sub)}->{''.join(out)}"
  return np.einsum(spec, lhs, rhs)


def broadcast_in_dim(x: np.ndarray, dims: Sequence[int], shape: Sequence[int]) -> np.ndarray:
  """Operand dim i becomes result dim dims[i] (size equal, or 1 and expanded)."""
  order = sorted(range(x.ndim), key=lambda i: dims[i])
  placed = [1] * len(shape)
  for i in order:
    placed[dims[i]] = x.shape[i]
  return np.broadcast_to(np.transpose(x, order).reshape(placed), tuple(shape)).copy()


REDUCERS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "mul": np.multiply}


def reduce(x: np.ndarray, init: np.ndarray, dims: Sequence[int], kind: str) -> np.ndarray:
  """Combine the init once with every element along ``dims`` (none: with each element)."""
  if kind not in REDUCERS:
    raise NotImplementedError(f"reference: reduce with reducer {kind!r}")
  return REDUCERS[kind].reduce(x, axis=tuple(dims), initial=np.asarray(init).item())


def window_config(attrs: dict, rank: int) -> tuple:
  """A reduce_window's (window, strides, padding per dim, base dilations,
  window dilations), StableHLO's defaults filled in."""
  ones = (1,) * rank
  padding = attrs.get("padding")
  pads = [(0, 0)] * rank if padding is None else [
      (int(lo), int(hi)) for lo, hi in np.asarray(padding, dtype=np.int64).reshape(rank, 2)]
  return (tuple(attrs["window_dimensions"]), tuple(attrs.get("window_strides") or ones), pads,
          tuple(attrs.get("base_dilations") or ones), tuple(attrs.get("window_dilations") or ones))


def reduce_window(x: np.ndarray, init: np.ndarray, attrs: dict, kind: str) -> np.ndarray:
  """Each output element combines the init with the window of x (padded with
  the init) at its strided position.  Dilations other than 1 are not modelled."""
  if kind not in REDUCERS:
    raise NotImplementedError(f"reference: reduce_window with reducer {kind!r}")
  window, strides, pads, base_dilations, window_dilations = window_config(attrs, x.ndim)
  if set(base_dilations) | set(window_dilations) != {1}:
    raise NotImplementedError("reference: dilated reduce_window")
  fill = np.asarray(init).item()
  padded = np.pad(np.asarray(x), pads, constant_values=fill)
  shape = tuple((n - w) // s + 1 for n, w, s in zip(padded.shape, window, strides))
  out = np.empty(shape, dtype=padded.dtype)
  for index in np.ndindex(*shape):
    block = padded[tuple(slice(i * s, i * s + w) for i, s, w in zip(index, strides, window))]
    out[index] = REDUCERS[kind].reduce(block.reshape(-1), initial=fill)
  return out


def select_and_scatter(operand: np.ndarray, source: np.ndarray, init: np.ndarray, attrs: dict,
                       select: Callable, kind: str) -> np.ndarray:
  """``select_and_scatter`` (max pooling's gradient): each window of the
  operand (placed as ``reduce_window`` places it) selects one element,
  scanning the window in row-major order and moving to a later element e
  whenever ``select(selected, e)`` is false; padding is never selected.  The
  source element of that window is then combined (``kind``) into the result,
  an operand-shaped tensor of ``init``, at the selected place.  ``select``
  takes and returns arrays (every window's scan runs at once)."""
  if kind not in REDUCERS:
    raise NotImplementedError(f"reference: select_and_scatter with scatter {kind!r}")
  operand, source = np.asarray(operand), np.asarray(source)
  window, strides, pads, _, _ = window_config(attrs, operand.ndim)
  padded = np.pad(operand, pads)
  real = np.pad(np.ones(operand.shape, bool), pads)
  place = np.arange(padded.size).reshape(padded.shape)
  chosen = held = have = None
  for offset in np.ndindex(*window):
    # This offset's element of every window: one array of the source's shape.
    at = tuple(slice(o, o + k * (n - 1) + 1, k)
               for o, k, n in zip(offset, strides, source.shape))
    value, valid, where = padded[at], real[at], place[at]
    if chosen is None:
      chosen, held, have = where.copy(), value.copy(), valid.copy()
      continue
    move = valid & (~have | ~np.asarray(select(held, value), bool))
    chosen, held, have = (np.where(move, where, chosen), np.where(move, value, held),
                          have | valid)
  flat = np.full(padded.size, np.asarray(init).item(), dtype=np.result_type(source, init))
  REDUCERS[kind].at(flat, chosen[have], source[have])
  out = flat.reshape(padded.shape)
  return out[tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, operand.shape))]


_DIM_FIELD = re.compile(r"(\w+) = (\[[^\]]*\]|-?\d+)")


def dimension_numbers(text: str) -> dict:
  """``#stablehlo.gather<offset_dims = [2], index_vector_dim = 2>`` (or
  scatter's) -> {field: tuple or int}; absent fields are () (lists) or 0
  (``index_vector_dim``), as the printers omit them."""
  out: dict = {"index_vector_dim": 0}
  for key, value in _DIM_FIELD.findall(text):
    out[key] = (tuple(int(x) for x in value[1:-1].split(",") if x.strip())
                if value.startswith("[") else int(value))
  return out


def _index_rows(indices: np.ndarray, index_vector_dim: int) -> np.ndarray:
  """indices with the index vector last (a trailing 1 if it is implicit)."""
  if index_vector_dim == indices.ndim:
    indices = indices[..., None]
  return np.moveaxis(indices, index_vector_dim, -1)


def indices_sorted(indices: np.ndarray, index_vector_dim: int) -> bool:
  """Are a gather's or scatter's index vectors in lexicographic order (what
  ``indices_are_sorted`` declares, and XLA may rely on)?"""
  vectors = _index_rows(indices, index_vector_dim)
  vectors = vectors.reshape(-1, vectors.shape[-1])
  return all(tuple(a) <= tuple(b) for a, b in zip(vectors, vectors[1:]))


def _row_start(rows: np.ndarray, row: tuple, index_map: Sequence[int], rank: int) -> list[int]:
  """The operand index row ``row`` of the indices starts at (0 off ``index_map``)."""
  start = [0] * rank
  for k, d in enumerate(index_map):
    start[d] = int(rows[row + (k,)])
  return start


def _batch_starts(start: list[int], row: tuple, indices_ndim: int, index_vector_dim: int,
                  operand_dims: Sequence[int], index_dims: Sequence[int]) -> list[int]:
  """``start`` with each operand batching dim at the row's coordinate along
  the index dim paired with it (row: the index dims but the index vector's)."""
  row_dims = [d for d in range(indices_ndim) if d != index_vector_dim]
  for o, i in zip(operand_dims, index_dims):
    start[o] = row[row_dims.index(i)]
  return start


def gather(x: np.ndarray, indices: np.ndarray, attrs: dict) -> np.ndarray:
  """StableHLO gather: result[batch, offset] reads x at the start its row of
  indices gives (clamped so the slice fits) plus offset; along a batching
  dim, at the row's own coordinate on the index dim paired with it."""
  dn = dimension_numbers(attrs["dimension_numbers"])
  sizes, collapsed = attrs["slice_sizes"], dn.get("collapsed_slice_dims", ())
  offset_dims, start_map = dn.get("offset_dims", ()), dn.get("start_index_map", ())
  batching = dn.get("operand_batching_dims", ())
  rows = _index_rows(indices, dn["index_vector_dim"])
  window = [d for d in range(x.ndim) if d not in collapsed and d not in batching]
  out = np.empty(rows.shape[:-1] + tuple(sizes[d] for d in window), x.dtype)
  for b in np.ndindex(rows.shape[:-1]):
    start = [int(np.clip(s, 0, n - k)) for s, n, k in
             zip(_row_start(rows, b, start_map, x.ndim), x.shape, sizes)]
    start = _batch_starts(start, b, indices.ndim, dn["index_vector_dim"], batching,
                          dn.get("start_indices_batching_dims", ()))
    block = x[tuple(slice(s, s + n) for s, n in zip(start, sizes))]
    out[b] = block.reshape([sizes[d] for d in window])
  n_batch = rows.ndim - 1
  batch_out = [d for d in range(n_batch + len(window)) if d not in offset_dims]
  perm = [n_batch + offset_dims.index(d) if d in offset_dims else batch_out.index(d)
          for d in range(n_batch + len(window))]
  return np.transpose(out, perm).copy()


def tile_gather(table: np.ndarray, indices: np.ndarray, attrs: dict,
                coords: dict[str, int]) -> np.ndarray:
  """``gg.tile_gather`` at the rank with mesh coordinates ``coords``: a gather
  of one row per index from a table split by rows over the axes
  ``gg.tiles`` ((axis, size) pairs, major to minor), as the rank holding
  tile t, rows ``[t*n, t*n + n)`` (its ``table``, n rows), computes its share.
  Each index is first clamped to the whole table, as a gather from it clamps;
  the rank gives the row if it falls in its tile and zeros if another rank
  holds it.  Summed over the tiles' ranks: the whole gather."""
  dn = dimension_numbers(attrs["dimension_numbers"])
  (k,) = dn["start_index_map"]
  n = table.shape[k]
  t, count = _tile_of(attrs, coords)
  rows = _index_rows(indices, dn["index_vector_dim"])[..., 0]
  local = np.clip(rows, 0, count * n - 1) - t * n
  mine = (local >= 0) & (local < n)
  looked_up = gather(table, np.where(mine, local, 0).reshape(indices.shape), attrs)
  mine = np.expand_dims(mine, tuple(dn.get("offset_dims", ())))
  return np.where(mine, looked_up, np.zeros((), table.dtype))


def top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """``chlo.top_k``: the k largest along the last dim, largest first, and
  their positions (the lower position first among equals, as XLA's sort is
  stable)."""
  order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
  return np.take_along_axis(x, order, axis=-1), order.astype(np.int32)


def conv_dims(dimension_numbers: str) -> tuple[tuple[int, ...], ...]:
  """``#stablehlo.conv<[b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1]>`` as the
  positions of (batch, feature, spatial...) of the input, (output feature,
  input feature, spatial...) of the kernel, (batch, feature, spatial...) of
  the result."""
  sides = re.findall(r"\[([^\]]*)\]", dimension_numbers)
  if len(sides) != 3:
    raise NotImplementedError(f"reference: conv dimension numbers {dimension_numbers!r}")
  out = []
  for labels, (first, second) in zip(sides, ("bf", "oi", "bf")):
    names = [x.strip() for x in labels.split(",")]
    spatial = sorted((int(x), k) for k, x in enumerate(names) if x.isdigit())
    out.append((names.index(first), names.index(second)) + tuple(k for _, k in spatial))
  return tuple(out)


def convolution(lhs: np.ndarray, rhs: np.ndarray, attrs: dict) -> np.ndarray:
  """``convolution`` (StableHLO's spec).  With ``feature_group_count`` g
  (or ``batch_group_count``), the input's features (or batch) and the
  kernel's output features are cut into g blocks, block j convolved with
  block j, the results concatenated along the output features.  One group:
  the input dilated and padded, the kernel dilated (and reversed where
  asked), each output position the sum over input features and the window."""
  lhs_spec, rhs_spec, out_spec = conv_dims(attrs["dimension_numbers"])
  one = {**attrs, "feature_group_count": 1, "batch_group_count": 1}
  for key, lhs_dim in (("feature_group_count", lhs_spec[1]), ("batch_group_count", lhs_spec[0])):
    groups = attrs.get(key, 1)
    if groups != 1:
      return np.concatenate([convolution(x, k, one) for x, k in zip(
          np.split(lhs, groups, lhs_dim), np.split(rhs, groups, rhs_spec[0]))], out_spec[1])
  x = np.transpose(lhs, lhs_spec)  # (b, f, spatial...)
  k = np.transpose(rhs, rhs_spec)  # (o, i, spatial...)
  n = x.ndim - 2
  ones = (1,) * n
  # Dilation is interior padding with zeros (``pad``, which crops negative edges).
  pads = attrs.get("padding")
  pads = np.zeros((n, 2), int) if pads is None else np.asarray(pads).reshape(n, 2)
  x = pad(x, 0, [0, 0, *pads[:, 0]], [0, 0, *pads[:, 1]],
          [0, 0, *(d - 1 for d in attrs.get("lhs_dilation") or ones)])
  k = pad(k, 0, [0] * k.ndim, [0] * k.ndim,
          [0, 0, *(d - 1 for d in attrs.get("rhs_dilation") or ones)])
  for j, flip in enumerate(attrs.get("window_reversal") or ()):
    if flip:
      k = np.flip(k, 2 + j)
  strides = attrs.get("window_strides") or ones
  window = k.shape[2:]
  out_sizes = [max((x.shape[2 + j] - window[j]) // strides[j] + 1, 0) for j in range(n)]
  out = np.zeros((x.shape[0], k.shape[0], *out_sizes), np.result_type(x, k))
  for offset in np.ndindex(*window) if out.size else ():  # (an empty slice's end wraps)
    index = (slice(None), slice(None)) + tuple(
        slice(o, o + (m - 1) * s + 1, s) for o, m, s in zip(offset, out_sizes, strides))
    out += np.einsum("bi...,oi->bo...", x[index], k[(slice(None), slice(None)) + offset])
  return np.transpose(out, np.argsort(out_spec))


def sort(operands: Sequence[np.ndarray], dimension: int,
         less: Callable[..., bool]) -> list[np.ndarray]:
  """``sort``: every 1-D slice along ``dimension`` of all operands reordered
  alike, stably, by ``less`` (the comparator region as a function: called on
  the scalars of positions i and j in its parameter order, x0[i], x0[j],
  x1[i], x1[j], ...)."""
  moved = [np.moveaxis(np.asarray(x), dimension, -1) for x in operands]
  out = [m.copy() for m in moved]
  for index in np.ndindex(*moved[0].shape[:-1]):
    rows = [m[index] for m in moved]

    def compare(i: int, j: int) -> int:
      if less(*[v for row in rows for v in (row[i], row[j])]):
        return -1
      return 1 if less(*[v for row in rows for v in (row[j], row[i])]) else 0
    order = sorted(range(rows[0].shape[0]), key=functools.cmp_to_key(compare))
    for o, row in zip(out, rows):
      o[index] = row[order]
  return [np.moveaxis(o, -1, dimension) for o in out]


def _tile_of(attrs: dict, coords: dict[str, int]) -> tuple[int, int]:
  """(the tile a rank holds, the tile count) of a table split by rows over the
  axes ``gg.tiles`` ((axis, size) pairs, major to minor)."""
  t = 0
  for axis, size in attrs["gg.tiles"]:
    t = t * size + coords[axis]
  return t, math.prod(size for _, size in attrs["gg.tiles"])


def tile_scatter(base: np.ndarray, indices: np.ndarray, updates: np.ndarray, attrs: dict,
                 coords: dict[str, int]) -> np.ndarray:
  """``gg.tile_scatter`` (add) at the rank with mesh coordinates ``coords``: a
  scatter-add of one row per index into a table split by rows over the axes
  ``gg.tiles``, as the rank holding tile t, rows ``[t*n, t*n + n)`` (its
  ``base``, n rows), computes its share: the rows whose index falls in its
  tile, at their local row; the others are another rank's, or beyond the
  table (which the whole scatter skips too).  Concatenated over the tiles:
  the whole scatter."""
  dn = dimension_numbers(attrs["scatter_dimension_numbers"])
  (k,) = dn["scatter_dims_to_operand_dims"]
  n = base.shape[k]
  t, _ = _tile_of(attrs, coords)
  local = _index_rows(indices, dn["index_vector_dim"])[..., 0] - t * n
  local = np.where((local >= 0) & (local < n), local, -1)  # -1: skipped
  return scatter(base, local.reshape(indices.shape), updates, attrs, "sum")


def scatter(x: np.ndarray, indices: np.ndarray, updates: np.ndarray, attrs: dict,
            kind: str) -> np.ndarray:
  """StableHLO scatter, combining by ``kind``: each row of indices starts a
  window of updates in x (along a batching dim, at the row's own coordinate
  on the index dim paired with it); a window that does not fit is skipped, as
  XLA does (the spec leaves it to the implementation)."""
  dn = dimension_numbers(attrs["scatter_dimension_numbers"])
  window_dims, inserted = dn.get("update_window_dims", ()), dn.get("inserted_window_dims", ())
  to_operand = dn.get("scatter_dims_to_operand_dims", ())
  batching = dn.get("input_batching_dims", ())
  rows = _index_rows(indices, dn["index_vector_dim"])
  scatter_dims = [d for d in range(updates.ndim) if d not in window_dims]
  windows = np.transpose(updates, scatter_dims + list(window_dims))
  sizes = [1] * x.ndim
  covered = [d for d in range(x.ndim) if d not in inserted and d not in batching]
  for d, n in zip(covered, windows.shape[rows.ndim - 1:]):
    sizes[d] = n
  out = x.copy()
  for b in np.ndindex(rows.shape[:-1]):
    start = _batch_starts(_row_start(rows, b, to_operand, x.ndim), b, indices.ndim,
                          dn["index_vector_dim"], batching,
                          dn.get("scatter_indices_batching_dims", ()))
    if any(s < 0 or s + n > dim for s, n, dim in zip(start, sizes, x.shape)):
      continue
    place = tuple(slice(s, s + n) for s, n in zip(start, sizes))
    window = windows[b].reshape(sizes)
    out[place] = window if kind == "replace" else REDUCERS[kind](out[place], window)
  return out


def slice_(x: np.ndarray, start: Sequence[int], limit: Sequence[int],
           strides: Sequence[int]) -> np.ndarray:
  return x[tuple(slice(s, l, k) for s, l, k in zip(start, limit, strides))].copy()


def dynamic_slice(x: np.ndarray, offsets: Sequence[np.ndarray], sizes: Sequence[int]
                  ) -> np.ndarray:
  """Offsets are clamped so the slice stays in bounds, as in StableHLO."""
  starts = [min(max(int(np.asarray(o).item()), 0), n - k)
            for o, n, k in zip(offsets, x.shape, sizes)]
  return x[tuple(slice(s, s + k) for s, k in zip(starts, sizes))].copy()


def dynamic_update_slice(x: np.ndarray, update: np.ndarray, offsets: Sequence[np.ndarray]
                         ) -> np.ndarray:
  """Offsets are clamped so the update stays in bounds, as in StableHLO."""
  starts = [min(max(int(np.asarray(o).item()), 0), n - k)
            for o, n, k in zip(offsets, x.shape, update.shape)]
  out = x.copy()
  out[tuple(slice(s, s + k) for s, k in zip(starts, update.shape))] = update
  return out


def pad(x: np.ndarray, value: np.ndarray, low: Sequence[int], high: Sequence[int],
        interior: Sequence[int]) -> np.ndarray:
  """Interior padding between elements, then edge padding (negative edges crop)."""
  spread = [n + max(n - 1, 0) * k for n, k in zip(x.shape, interior)]
  full = [max(lo, 0) + s + max(hi, 0) for lo, s, hi in zip(low, spread, high)]
  out = np.full(full, np.asarray(value).item(), dtype=x.dtype)
  out[tuple(slice(max(lo, 0), max(lo, 0) + s, k + 1)
            for lo, s, k in zip(low, spread, interior))] = x
  crop = tuple(slice(max(-lo, 0), f - max(-hi, 0)) for lo, f, hi in zip(low, full, high))
  return out[crop].copy()


def iota(shape: Sequence[int], dim: int, dtype: str) -> np.ndarray:
  line = np.arange(shape[dim]).reshape([-1 if d == dim else 1 for d in range(len(shape))])
  return cast(np.broadcast_to(line, tuple(shape)), dtype)


def _check_elementwise_shapes(name: str, xs: list[np.ndarray]) -> None:
  """No numpy broadcasting: StableHLO only lets select's predicate and clamp's
  bounds be scalars."""
  shape = xs[1].shape if name in ("select", "clamp") else xs[0].shape
  for k, x in enumerate(xs):
    scalar_ok = (name == "select" and k == 0) or (name == "clamp" and k != 1)
    if x.shape != shape and not (scalar_ok and x.ndim == 0):
      raise ValueError(f"reference: {name} operand {k} has shape {x.shape}, expected {shape}")


# -- dispatch ----------------------------------------------------------------------

def evaluate(name: str, attrs: dict, operands: list[np.ndarray],
             result_type: ir.TensorType, coords: Optional[dict[str, int]] = None
             ) -> np.ndarray:
  """The result of op ``name`` with canonical ``attrs`` (see ``ir``) on ``operands``;
  ``coords``, the rank's mesh coordinates, for the ops that read them."""
  xs = [np.asarray(x) for x in operands]
  if name in BINARY or name in ("compare", "select", "clamp"):
    _check_elementwise_shapes(name, xs)
  if name in UNARY:
    return UNARY[name](xs[0])
  if name in BINARY:
    return BINARY[name](xs[0], xs[1])
  if name == "compare":
    a, b = (ordered_as(x, attrs.get("compare_type")) for x in xs)
    return COMPARISONS[attrs["comparison_direction"]](a, b)
  if name == "select":
    return np.where(xs[0].astype(bool), xs[1], xs[2])
  if name == "clamp":
    lo, x, hi = xs
    return np.minimum(np.maximum(x, lo), hi)
  if name == "convert":
    return cast(xs[0], result_type.dtype)
  if name == "dot_general":
    return dot_general(xs[0], xs[1], attrs)
  if name == "convolution":
    return convolution(xs[0], xs[1], attrs)
  if name == "transpose":
    return np.transpose(xs[0], attrs["permutation"]).copy()
  if name == "reverse":
    return np.flip(xs[0], tuple(attrs["dimensions"])).copy()
  if name == "sort":  # (its first result; the comparator as a function, see ``sort``)
    return sort(xs, attrs["dimension"], attrs["gg.comparator"])[0]
  if name == "reshape":
    return xs[0].reshape(result_type.shape).copy()
  if name == "broadcast_in_dim":
    return broadcast_in_dim(xs[0], attrs["broadcast_dimensions"], result_type.shape)
  if name == "reduce":
    return reduce(xs[0], xs[1], attrs["dimensions"], attrs["gg.reduction"])
  if name == "reduce_window":
    return reduce_window(xs[0], xs[1], attrs, attrs["gg.reduction"])
  if name == "select_and_scatter":
    return select_and_scatter(xs[0], xs[1], xs[2], attrs, attrs["gg.select"],
                              attrs["gg.reduction"])
  if name == "slice":
    return slice_(xs[0], attrs["start_indices"], attrs["limit_indices"], attrs["strides"])
  if name == "dynamic_slice":
    return dynamic_slice(xs[0], xs[1:], attrs["slice_sizes"])
  if name == "dynamic_update_slice":
    return dynamic_update_slice(xs[0], xs[1], xs[2:])
  if name == "constant":
    value = np.asarray(attrs["value"])
    if is_integer_type(result_type.dtype):
      value = cast(value, result_type.dtype)  # loaders may hold i32 in int64: wrap as i32 does
    return np.broadcast_to(value, result_type.shape).copy()
  if name == "concatenate":
    return np.concatenate(xs, axis=attrs["dimension"])
  if name == "pad":
    return pad(xs[0], xs[1], attrs["edge_padding_low"], attrs["edge_padding_high"],
               attrs["interior_padding"])
  if name == "gather":
    return gather(xs[0], xs[1], attrs)
  if name == "scatter":
    return scatter(xs[0], xs[1], xs[2], attrs, attrs["gg.reduction"])
  if name == "chlo.top_k":  # two results: the values, or (an int type) their positions
    values, positions = top_k(xs[0], attrs["k"])
    return positions if is_integer_type(result_type.dtype) else values
  if name == "gg.tile_gather":
    if coords is None:
      raise NotImplementedError("reference: gg.tile_gather needs the rank's coordinates")
    return tile_gather(xs[0], xs[1], attrs, coords)
  if name == "gg.tile_scatter":
    if coords is None:
      raise NotImplementedError("reference: gg.tile_scatter needs the rank's coordinates")
    return tile_scatter(xs[0], xs[1], xs[2], attrs, coords)
  if name == "iota":
    return iota(result_type.shape, attrs["iota_dimension"], result_type.dtype)
  raise NotImplementedError(f"reference: op {name}")
