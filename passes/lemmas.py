"""Rewrite lemmas: how a sequential op acts on sharded operands.

Each lemma is the equation of the paper read left to right, e.g. for
``dot_general`` with both contracting dims split over axis ``tp``::

    dot(concat[tp](a@r, dim 1), concat[tp](b@r, dim 0)) = sum[tp](dot(a@r, b@r))

In the flat form used here a lemma takes the *layouts* of the sequential op's
operands and returns the local op the distributed program must run (same op,
attributes rewritten for local shapes) and the layout of its result.  Whether
the distributed program really runs that op is a separate question, answered
by a hash-cons lookup in its e-graph (``inference``).  Lemmas never look at
the distributed program, so each one is a pure statement we can test on its
own: ``tests/test_lemmas.py`` checks every lemma on random shapes, meshes,
layouts and values against numpy (both sides evaluated, rank by rank).

Every lemma lists the ops it covers and states its equation.  They are tried
in order and all results are kept: one op may relate in several ways.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.ir import axis_base, axis_shift, rotated_axis
from graphguard_hlo.passes.layout import Layout, merged_pins, scales_equal
from graphguard_hlo.reference import conv_dims, dimension_numbers, window_config

# -- op classes ----------------------------------------------------------------

UNARY_LINEAR = frozenset({"negate", "copy", "real", "imag"})
FLOAT_TYPES = ("f", "bf")
UNARY_NONLINEAR = frozenset({
    "abs", "cbrt", "ceil", "cosine", "exponential", "exponential_minus_one", "floor",
    "is_finite", "log", "log_plus_one", "logistic", "not", "popcnt", "round_nearest_afz",
    "round_nearest_even", "rsqrt", "sign", "sine", "sqrt", "tan", "tanh", "erf",
    "count_leading_zeros", "convert", "bitcast_convert", "reduce_precision", "negate", "copy"}
    # chlo's pointwise math, which jax emits (exact GELU is ``chlo.erfc``).
    | {"chlo.erfc", "chlo.erf", "chlo.lgamma", "chlo.sinh", "chlo.cosh", "chlo.tan",
       "chlo.asin", "chlo.acos", "chlo.atan", "chlo.asinh", "chlo.acosh", "chlo.atanh",
       "chlo.is_inf", "chlo.is_pos_inf", "chlo.is_neg_inf"})
BINARY_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "remainder",
    "atan2", "and", "or", "xor", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "compare", "complex"})
TERNARY_ELEMENTWISE = frozenset({"select", "clamp"})
ELEMENTWISE = UNARY_NONLINEAR | BINARY_ELEMENTWISE | TERNARY_ELEMENTWISE


@dataclasses.dataclass(frozen=True)
class SeqOp:
  """What a lemma may read of a sequential op: name, attributes, global types."""
  name: str
  attrs: dict
  operand_types: tuple[ir.TensorType, ...]
  result_type: ir.TensorType
  mesh: ir.Mesh
  # Mesh axes the per-device program passes tiles round (a ring of
  # collective-permutes): dims free to tile may take them rotated, too.
  rings: frozenset = frozenset()
  # Per-device shapes the program holds of what this op may compute (its
  # broadcasts of an operand's related values).  Dims a lemma may tile freely
  # have too many tilings to try on a mesh of many small axes; those giving
  # these shapes are tried first.  A hint only: each is still looked up.
  tile_shapes: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class Step:
  """The local op (same name; ``attrs``; result type) and its result's layout."""
  attrs: dict
  result_type: ir.TensorType
  layout: Layout
  lemma: str
  name: Optional[str] = None  # the local op's, if not the sequential op's (``LOCAL_OP``)


@dataclasses.dataclass(frozen=True)
class Lemma:
  name: str
  ops: frozenset[str]
  statement: str
  rule: Callable[[SeqOp, Sequence[Layout]], Iterator[tuple[dict, Layout]]]
  # Most lemmas speak of every rank alike and see the operands' layouts with
  # their pins dropped (``apply_lemmas`` pins the result); these read pins.
  reads_pins: bool = False
  # Haloed layouts (a tile with its neighbours' rows) reach only these.
  reads_halos: bool = False


def _local_type(op: SeqOp, layout: Layout) -> Optional[ir.TensorType]:
  shape = layout.local_shape(op.result_type.shape, op.mesh)
  return None if shape is None else ir.TensorType(shape, op.result_type.dtype)


def _same_dims(layouts: Sequence[Layout]) -> bool:
  return all(l.dims == layouts[0].dims for l in layouts)


def _is_float(t: ir.TensorType) -> bool:
  return t.dtype.startswith(FLOAT_TYPES)


# -- elementwise ------------------------------------------------------------------

def _elementwise_tiles(op: SeqOp, ls: Sequence[Layout]):
  """f(concat(a_r), concat(b_r)) = concat(f(a_r, b_r)): any elementwise f,
  operands tiled alike, no partial sums, unscaled."""
  if _same_dims(ls) and all(not l.partial and l.is_clean() for l in ls):
    yield op.attrs, Layout(ls[0].dims)


def _linear_sum(op: SeqOp, ls: Sequence[Layout]):
  """add/subtract/negate/convert are linear: f(k*sum_r a_r, k*sum_r b_r) =
  k*sum_r f(a_r, b_r), when all operands are partial over the same axes (or
  none) and carry the same scale."""
  if op.name == "convert" and not (_is_float(op.operand_types[0]) and _is_float(op.result_type)):
    return
  first = ls[0]
  if first.partial and first.partial_kind != "sum":
    return
  if _same_dims(ls) and all(l.partial == first.partial and l.partial_kind == first.partial_kind
                            and scales_equal(l.scale, first.scale) for l in ls):
    yield op.attrs, first


def _product(op: SeqOp, ls: Sequence[Layout]):
  """(sum_r a_r) * b = sum_r (a_r * b) when b is not partial; scales multiply."""
  a, b = ls
  if not _same_dims(ls) or (a.partial and b.partial):
    return
  p = a if a.partial else b
  if p.partial and p.partial_kind != "sum":
    return
  yield op.attrs, Layout(a.dims, p.partial, p.partial_kind, a.scale * b.scale)


def _quotient(op: SeqOp, ls: Sequence[Layout]):
  """(sum_r a_r) / b = sum_r (a_r / b) when b is not partial; scales divide."""
  a, b = ls
  if not _same_dims(ls) or b.partial or (a.partial and a.partial_kind != "sum"):
    return
  if not _is_float(op.result_type):
    return
  yield op.attrs, Layout(a.dims, a.partial, a.partial_kind, a.scale / b.scale)


def _select_linear(op: SeqOp, ls: Sequence[Layout]):
  """select(p, k*sum a_r, k*sum b_r) = k*sum_r select(p, a_r, b_r) when p is
  not partial (a and b may be unreduced, or just scaled)."""
  p, a, b = ls
  if not _same_dims(ls) or p.partial or not p.is_clean():
    return
  if not a.partial and a.is_clean():
    return  # plain tiles: elementwise-over-tiles
  if a.partial == b.partial and (not a.partial or a.partial_kind == b.partial_kind == "sum") \
      and scales_equal(a.scale, b.scale):
    yield op.attrs, a


def _monotone_max(op: SeqOp, ls: Sequence[Layout]):
  """max(max_r a_r, max_r b_r) = max_r max(a_r, b_r): partial maxima combine."""
  if not _same_dims(ls) or not ls[0].partial:
    return
  kind = {"maximum": "max", "minimum": "min"}[op.name]
  if all(l.partial == ls[0].partial and l.partial_kind == kind and l.is_clean() for l in ls):
    yield op.attrs, ls[0]


# -- structural ops -----------------------------------------------------------------

def dot_tiling(attrs: dict, a: Layout, b: Layout
               ) -> Optional[tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]]:
  """(the tiling of a dot's result dims: batch, lhs free, rhs free; the axes
  tiling its contracting dims) for operands tiled by ``a`` and ``b``, or None
  if they tile a batch or contracting dim differently."""
  lb, rb = attrs["lhs_batch"], attrs["rhs_batch"]
  lc, rc = attrs["lhs_contract"], attrs["rhs_contract"]
  if any(a.dims[i] != b.dims[j] for i, j in zip(lb + lc, rb + rc)):
    return None
  lfree, rfree = ir.dot_free_dims(attrs, a.rank, b.rank)
  dims = tuple(a.dims[i] for i in lb) + tuple(a.dims[i] for i in lfree) + tuple(
      b.dims[j] for j in rfree)
  return dims, tuple(ax for i in lc for ax in a.dims[i])


def _dot_general(op: SeqOp, ls: Sequence[Layout]):
  """dot(concat[x](a_r, k), concat[x](b_r, k')) = sum[x](dot(a_r, b_r)) over split
  contracting dims; batch dims must be split alike; free dims keep their split."""
  a, b = ls
  at = op.attrs
  if (a.partial and b.partial) or any(l.partial and l.partial_kind != "sum" for l in ls):
    return
  tiling = dot_tiling(at, a, b)
  if tiling is None:
    return
  dims, contracted = tiling
  partial = tuple(a.partial or b.partial) + tuple(axis_base(x) for x in contracted)
  out = Layout(dims, partial, "sum", a.scale * b.scale)
  if out.is_valid():
    yield at, out


def _convolution(op: SeqOp, ls: Sequence[Layout]):
  """conv(concat[x](a_r, f), concat[x](k_r, i)) = sum[x](conv(a_r, k_r)) over
  input features split alike; the input's batch dim and the kernel's output
  features keep their split (a data-parallel CNN, output channels split over
  tp; a kernel's gradient, whose "features" are the images).  Feature groups
  (a depthwise or grouped convolution) split with the kernel's output
  features: each rank convolves its own groups; batch groups (such a
  convolution's kernel gradient) alike with the input's batch.  Spatial
  dims are whole: a window reads its neighbours."""
  a, k = ls
  at = op.attrs
  if (a.partial and k.partial) or any(l.partial and l.partial_kind != "sum" for l in ls):
    return
  (lb, lf, *lsp), (ko, ki, *ksp), (ob, of, *osp) = conv_dims(at["dimension_numbers"])
  if any(a.dims[d] for d in lsp) or any(k.dims[d] for d in ksp):
    return
  groups = k.dims[ko]  # the output features' tiling, which grouped dims follow
  n = math.prod(op.mesh.axis_size(x) for x in groups)
  local, dims = dict(at), [()] * op.result_type.rank
  dims[of] = groups
  if at.get("feature_group_count", 1) != 1:
    g = at["feature_group_count"]
    if a.dims[lf] != groups or k.dims[ki] or g % n:
      return
    local["feature_group_count"] = g // n
    dims[ob], contracted = a.dims[lb], ()
  elif at.get("batch_group_count", 1) != 1:
    g = at["batch_group_count"]
    if a.dims[lb] != groups or a.dims[lf] != k.dims[ki] or g % n:
      return
    local["batch_group_count"] = g // n
    contracted = a.dims[lf]
  else:
    if a.dims[lf] != k.dims[ki]:
      return
    dims[ob], contracted = a.dims[lb], a.dims[lf]
  partial = tuple(a.partial or k.partial) + tuple(axis_base(x) for x in contracted)
  out = Layout(tuple(dims), partial, "sum", a.scale * k.scale)
  if out.is_valid():
    yield local, out


def _convolution_over_halos(op: SeqOp, ls: Sequence[Layout]):
  """conv(x, k) along a spatial dim split over ranks, padded (lo, hi), is
  each rank's conv, unpadded there, of its tile with lo rows of the rank
  before and h of the rank after (zeros at the ends: the padding's own).
  Output row i of rank r reads padded rows r t + i s .. + window, which its
  haloed tile holds from row i s, when s divides the tile t, each rank has
  (t + lo + h - window) / s + 1 = t / s outputs and the whole n / s.  (h
  may be less than hi: a strided window may never read the last padding.)
  A kernel's gradient convolves the images with the output's gradient as
  its window, split alike: output row j of rank r sums its window rows i
  times padded rows r t + j s + i d, which its haloed tile holds when t
  is its window tile times the window dilation d and it has every output
  row, unreversed: a partial sum over the split.  Undilated input; the
  other dims as the convolution lemma splits them."""
  a, k = ls
  if not a.halo or a.partial_kind != "sum" or k.halo:
    return
  at = op.attrs
  (lb, lf, *lsp), (ko, ki, *ksp), (ob, of, *osp) = conv_dims(at["dimension_numbers"])
  ones = (1,) * len(lsp)
  if tuple(at.get("lhs_dilation") or ones) != ones or at.get("padding") is None:
    return
  pads = np.array(at["padding"]).reshape(len(lsp), 2)
  strides = at.get("window_strides") or ones
  rhs_dilation = at.get("rhs_dilation") or ones
  halos = {d: (lo, hi) for d, lo, hi in a.halo}
  tile = a.local_shape(op.operand_types[0].shape, op.mesh)
  kernel_tile = k.local_shape(op.operand_types[1].shape, op.mesh)
  if tile is None or kernel_tile is None or any(d not in lsp for d in halos):
    return
  local_pads = pads.copy()
  out_dims, summed = {}, []
  for j, d in enumerate(lsp):
    if not a.dims[d]:
      if k.dims[ksp[j]]:
        return  # (a window split over whole rows)
      continue
    if d not in halos or pads[j][0] != halos[d][0]:
      return
    lo, hi = halos[d]
    t, s, dilation = tile[d] - lo - hi, strides[j], rhs_dilation[j]
    window = (kernel_tile[ksp[j]] - 1) * dilation + 1
    if t + lo + hi < window:
      return
    outputs = (t + lo + hi - window) // s + 1
    if not k.dims[ksp[j]]:  # each rank its own output rows
      ranks = op.operand_types[0].shape[d] // t
      if t % s or outputs != t // s or op.result_type.shape[osp[j]] != ranks * (t // s):
        return
      out_dims[osp[j]] = a.dims[d]
    elif k.dims[ksp[j]] == a.dims[d]:  # each rank its own window rows: every output row
      reversed_ = (at.get("window_reversal") or (False,) * len(lsp))[j]
      if reversed_ or t != kernel_tile[ksp[j]] * dilation \
          or outputs != op.result_type.shape[osp[j]]:
        return  # (a reversed window's tiles turn end for end)
      summed += a.dims[d]
    else:
      return
    local_pads[j] = 0
  whole_a = a.with_(halo=(), dims=tuple(() if d in lsp else x for d, x in enumerate(a.dims)))
  whole_k = k.with_(dims=tuple(() if d in ksp else x for d, x in enumerate(k.dims)))
  for local, out in _convolution(op, [whole_a, whole_k]):
    local = {**local, "padding": local_pads.reshape(np.shape(at["padding"]))}
    out = out.with_(dims=tuple(out_dims.get(d, x) for d, x in enumerate(out.dims)),
                    partial=tuple(out.partial) + tuple(summed))
    if out.is_valid():
      yield local, out


def _transpose(op: SeqOp, ls: Sequence[Layout]):
  """transpose(concat(a_r, k)) = concat(transpose(a_r), perm^-1(k))."""
  (a,) = ls
  perm = op.attrs["permutation"]
  yield op.attrs, a.with_(dims=tuple(a.dims[p] for p in perm))


def reshape_groups(src: Sequence[int], dst: Sequence[int]
                   ) -> Optional[list[tuple[list[int], list[int]]]]:
  """Split a reshape into minimal groups of dims with equal products."""
  groups, i, j = [], 0, 0
  while i < len(src) or j < len(dst):
    gi, gj = [], []
    pi = pj = 1
    while True:
      if pi == pj and gi and gj:
        break
      if (pi <= pj and i < len(src)) or j >= len(dst):
        if i >= len(src):
          return None
        gi.append(i); pi *= src[i]; i += 1
      else:
        gj.append(j); pj *= dst[j]; j += 1
    # absorb trailing size-1 dims into this group
    while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
      gi.append(i); i += 1
    while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
      gj.append(j); j += 1
    groups.append((gi, gj))
  return groups


def _reshape(op: SeqOp, ls: Sequence[Layout]):
  """reshape(concat(a_r, k)) = concat(reshape(a_r), k'), group by group of dims
  with equal products.  Inside a group the tiles must be contiguous blocks of
  the flattened group (every dim before the first one a rank holds more than
  one index of is split completely, every dim after it is whole); the group's
  axes, major to minor, then tile the result dims major to minor the same way."""
  (a,) = ls
  src, dst = op.operand_types[0].shape, op.result_type.shape
  groups = reshape_groups(src, dst)
  if groups is None:
    return
  sizes = {x: op.mesh.axis_size(x) for axes in a.dims for x in axes}  # (rotated ones, too)
  dims: list[tuple[str, ...]] = [() for _ in dst]
  for gi, gj in groups:
    axes = _contiguous_group_axes([src[i] for i in gi], [a.dims[i] for i in gi], sizes)
    if axes is None:
      return
    out = _spread_axes(axes, [dst[j] for j in gj], sizes)
    if out is None:
      return
    for j, assigned in zip(gj, out):
      dims[j] = assigned
  yield {}, a.with_(dims=tuple(dims))


def _contiguous_group_axes(shape: list[int], dims: list[tuple[str, ...]],
                           sizes: dict[str, int]) -> Optional[tuple[str, ...]]:
  """The axes tiling a group of dims as one flat dim (major to minor), if each
  rank's tile is a contiguous block of it."""
  axes: list[str] = []
  partial_seen = False  # a dim where a rank holds more than one index
  for n, d in zip(shape, dims):
    if d and partial_seen:
      return None
    axes += d
    if n // math.prod(sizes[x] for x in d) > 1:
      partial_seen = True
  return tuple(axes)


def _spread_axes(axes: tuple[str, ...], shape: list[int], sizes: dict[str, int]
                 ) -> Optional[list[tuple[str, ...]]]:
  """Split flat-dim axes over ``shape`` (major to minor): each dim takes the
  axes whose product is its whole size, until one takes the rest."""
  out: list[tuple[str, ...]] = []
  rest = list(axes)
  for n in shape:
    take, p = 0, 1
    while take < len(rest) and n % (p * sizes[rest[take]]) == 0:
      p *= sizes[rest[take]]
      take += 1
    if p != n and take < len(rest):
      return None  # an axis would straddle two dims
    out.append(tuple(rest[:take]))
    rest = rest[take:]
  return None if rest else out


def _free_axis_choices(op: SeqOp, taken: set[str], free_dims: Sequence[int],
                       base: list[tuple[str, ...]], limit: int = 24, hinted_limit: int = 64):
  """Ways to tile dims whose content does not depend on the position along them.

  The choices grow as (2^axes)^dims, so at most ``limit`` are tried, after
  those giving a tile of ``op.tile_shapes`` (the per-device program's own
  shapes pick how many ranks split each dim: the 6 orders of three axes on
  one dim for HSDP's one-hot), of which at most ``hinted_limit``."""
  options_per_dim = [_dim_options(op, taken, op.result_type.shape[d]) for d in free_dims]
  hinted: dict[tuple, None] = {}  # (ordered, and read in constant time below)
  for shape in op.tile_shapes:
    options = _options_for_tile(op, free_dims, base, options_per_dim, shape)
    if options is None:
      continue
    for choice in itertools.islice(itertools.product(*options), 16 * hinted_limit):
      if len(hinted) >= hinted_limit:
        break
      if _axes_distinct(choice):
        hinted[choice] = None
  yield from (_placed(base, free_dims, choice) for choice in hinted)
  others = (c for c in itertools.product(*options_per_dim)
            if c not in hinted and _axes_distinct(c))
  yield from (_placed(base, free_dims, choice) for choice in itertools.islice(others, limit))


def _axes_distinct(choice) -> bool:
  flat = [x for c in choice for x in c]
  return len(flat) == len(set(flat))


def _placed(base, free_dims, choice) -> tuple:
  dims = list(base)
  for d, c in zip(free_dims, choice):
    dims[d] = c
  return tuple(dims)


def _dim_options(op: SeqOp, taken: set[str], extent: int) -> list[tuple[str, ...]]:
  """The axis tuples that may tile a free dim of ``extent``: none, the
  untaken axes in any order and number whose sizes divide it, and any turn of
  a ring axis (the diagonal blocks a ring visits; ``is_valid`` rejects what
  cannot be)."""
  avail = [a for a, n in op.mesh.axes if a not in taken and n > 1]
  turns = [(rotated_axis(x, j, op.mesh.axis_size(x)),) for x in sorted(op.rings)
           for j in range(op.mesh.axis_size(x))]
  opts: list[tuple[str, ...]] = [()]
  for k in range(1, len(avail) + 1):
    for combo in itertools.permutations(avail, k):
      if extent % math.prod(op.mesh.axis_size(x) for x in combo) == 0:
        opts.append(combo)
    if k == 1:
      opts += [t for t in turns if t not in opts and extent % op.mesh.axis_size(t[0]) == 0]
  if not avail:
    opts += [t for t in turns if extent % op.mesh.axis_size(t[0]) == 0]
  return opts


def _options_for_tile(op: SeqOp, free_dims, base, options_per_dim, shape):
  """Each free dim's options that give the tile ``shape``, or None if the
  other dims (tiled as ``base``) do not."""
  dst = op.result_type.shape
  if len(shape) != len(dst):
    return None
  size = lambda axes: math.prod(op.mesh.axis_size(x) for x in axes)
  if any(d not in free_dims and dst[d] != shape[d] * size(base[d]) for d in range(len(dst))):
    return None
  return [[c for c in opts if dst[d] == shape[d] * size(c)]
          for d, opts in zip(free_dims, options_per_dim)]


def _broadcast_in_dim(op: SeqOp, ls: Sequence[Layout]):
  """broadcast(concat(a_r, k)) = concat(broadcast(a_r), map(k)); the new and the
  size-1-expanded dims may be tiled over any axis a is invariant along (every
  tile of a broadcast holds the same values)."""
  (a,) = ls
  bdims = op.attrs["broadcast_dimensions"]
  src = op.operand_types[0].shape
  dst = op.result_type.shape
  base: list[tuple[str, ...]] = [() for _ in dst]
  for i, d in enumerate(bdims):
    if a.dims[i]:
      if src[i] != dst[d]:
        return
      base[d] = a.dims[i]
  free = [d for d in range(len(dst)) if d not in bdims or src[bdims.index(d)] != dst[d]]
  for dims in _free_axis_choices(op, a.used_axes(), free, base):
    yield op.attrs, a.with_(dims=dims)


def _iota(op: SeqOp, ls: Sequence[Layout]):
  """iota along k is invariant along every other dim: tile those freely."""
  k = op.attrs["iota_dimension"]
  free = [d for d in range(op.result_type.rank) if d != k]
  for dims in _free_axis_choices(op, set(), free, [() for _ in range(op.result_type.rank)]):
    yield op.attrs, Layout(dims)


def _reduce(op: SeqOp, ls: Sequence[Layout]):
  """reduce_+(concat[x](a_r, k), k) = sum[x](reduce_+(a_r, k)); likewise max/min.
  A variadic reduce (argmax) over untiled dims of operands tiled alike is the
  reduce of the tiles.  The init operands must be the reduction's identity (checked by the caller,
  which knows their values) and are not tiled."""
  n = len(ls) // 2
  a = ls[0]
  if any(not l.is_full_replica() or not l.is_clean() for l in ls[n:]):
    return  # every rank adds its own init: it must be the same whole value
  kind = op.attrs.get("gg.reduction")
  dims = op.attrs["dimensions"]
  if n != 1:
    # Variadic (argmax's values and indices): each rank reduces whole rows of
    # its tile, element for element the operands' same rows, with any reducer.
    if any(l != a for l in ls[1:n]) or a.partial or not a.is_clean() \
        or any(a.dims[d] for d in dims):
      return
    out = Layout(tuple(a.dims[d] for d in range(a.rank) if d not in dims))
    if out.is_valid():
      yield {k: v for k, v in op.attrs.items() if k != "gg.reduction"}, out
    return
  # Summed over every rank of an axis, its turn does not matter.
  reduced_axes = tuple(axis_base(x) for d in dims for x in a.dims[d])
  kept = tuple(a.dims[d] for d in range(a.rank) if d not in dims)
  if kind == "sum":
    if a.partial and a.partial_kind != "sum":
      return
    out = Layout(kept, tuple(a.partial) + reduced_axes, "sum", a.scale)
  elif kind in ("max", "min"):
    if a.partial or not a.is_clean():
      return
    out = Layout(kept, reduced_axes, kind)
  else:
    if reduced_axes or a.partial or not a.is_clean():
      return
    out = Layout(kept)
  if out.is_valid():
    yield {k: v for k, v in op.attrs.items() if k != "gg.reduction"}, out


def _slice_frame(op: SeqOp, a: Layout):
  """(global shape, local shape, start, limit, strides as lists) of a slice of
  an operand laid out by ``a``; None if ``a`` does not divide the operand."""
  shape = op.operand_types[0].shape
  local = a.local_shape(shape, op.mesh)
  if local is None:
    return None
  return (shape, local, *(list(op.attrs[k]) for k in ("start_indices", "limit_indices",
                                                        "strides")))


def _slice(op: SeqOp, ls: Sequence[Layout]):
  """slice(concat(a_r, k)) = concat(slice(a_r), k) when dim k is taken whole."""
  (a,) = ls
  frame = _slice_frame(op, a)
  if frame is None:
    return
  shape, local, start, limit, strides = frame
  for d, axes in enumerate(a.dims):
    if axes:
      if (start[d], limit[d], strides[d]) != (0, shape[d], 1):
        return
      limit[d] = local[d]
  yield {"start_indices": tuple(start), "limit_indices": tuple(limit),
         "strides": tuple(strides)}, a


def _reverse(op: SeqOp, ls: Sequence[Layout]):
  """reverse(concat(a_r, k), d) = concat(reverse(a_r, d), k) when no reversed
  dim d is tiled.  Reversing moves elements only, so partial sums, maxima,
  scales and pins pass through.  (Reordered chunks are refused:
  pieces.dim_map does not map a reversed dim.)"""
  (a,) = ls
  if not any(a.dims[d] for d in op.attrs["dimensions"]):
    yield op.attrs, a


def _sort(op: SeqOp, ls: Sequence[Layout]):
  """sort(concat(a_r, k), d) = concat(sort(a_r, d), k), each operand tiled
  alike, when dim d is not tiled: a sort reorders each slice along d by
  itself, whatever its comparator.  Clean operands only (a scale could turn
  the order round; a partial sum is sorted only once summed)."""
  a = ls[0]
  if any(l != a for l in ls) or a.partial or not a.is_clean() or a.dims[op.attrs["dimension"]]:
    return
  yield op.attrs, a


def _slice_one_tile(op: SeqOp, ls: Sequence[Layout]):
  """slice(concat(a_r, k), [s, e)) = slice(a_t, [s - t*n, e - t*n)) at the ranks
  holding tile t, when [s, e) lies inside tile t of dim k: a layer's weights
  out of a stack split over pipeline stages are stage t's (pinned there)."""
  (a,) = ls
  frame = _slice_frame(op, a)
  if frame is None:
    return
  shape, local, start, limit, strides = frame
  dims, pins = list(a.dims), dict(a.at)
  for d, axes in enumerate(a.dims):
    if not axes:
      continue
    if (start[d], limit[d], strides[d]) == (0, shape[d], 1):
      limit[d] = local[d]
      continue
    n = local[d]
    t = start[d] // n
    if strides[d] != 1 or limit[d] <= start[d] or (limit[d] - 1) // n != t:
      return
    start[d], limit[d] = start[d] - t * n, limit[d] - t * n
    for axis in reversed(axes):  # t's mixed-radix digits, minor axis last
      n_axis = op.mesh.axis_size(axis)
      # a rotated axis x+j holds digit t at r_x = t - j
      coord = (t % n_axis - axis_shift(axis)) % n_axis
      if pins.setdefault(axis_base(axis), coord) != coord:
        return  # a block off a ring's diagonal: no rank holds it
      t //= n_axis
    dims[d] = ()
  if len(pins) == len(a.at):
    return  # every tiled dim taken whole: slice-untiled-dims
  yield ({"start_indices": tuple(start), "limit_indices": tuple(limit),
          "strides": tuple(strides)}, a.with_(dims=tuple(dims), at=tuple(pins.items())))


def _concatenate(op: SeqOp, ls: Sequence[Layout]):
  """concat(concat(a_r, j), concat(b_r, j), k) = concat(concat(a_r, b_r, k), j), j != k."""
  k = op.attrs["dimension"]
  first = ls[0]
  if first.dims[k] or any(l != first for l in ls):
    return
  yield op.attrs, first


def _pad(op: SeqOp, ls: Sequence[Layout]):
  """pad leaves untouched dims' tiling intact (padding value is not tiled)."""
  a, v = ls
  lo, hi, inner = (op.attrs[k] for k in ("edge_padding_low", "edge_padding_high",
                                         "interior_padding"))
  if any(a.dims[d] and (lo[d] or hi[d] or inner[d]) for d in range(a.rank)):
    return
  # Every rank pads with its own v: the pieces of v must combine like a's
  # (same partial axes and scale); a replica only survives a max/min combine
  # (under a sum it would count once per rank).
  same = v.partial == a.partial and v.partial_kind == a.partial_kind
  if not scales_equal(v.scale, a.scale) or not (
      same or (not v.partial and a.partial_kind != "sum")):
    return
  yield _pad_attrs(op), a


def _pad_attrs(op: SeqOp) -> dict:
  return {k: v for k, v in op.attrs.items() if k != "gg.padding_value"}


def _pad_into_one_tile(op: SeqOp, ls: Sequence[Layout]):
  """pad(x, 0) with x inside tile t of dim k, where the operand is the
  sequential x at the ranks holding tile t and zero at all others: every
  rank's pad of its value into tile-sized room is its tile of the result
  (the inverse of slice-of-one-tile: a stage's gradient padded into its rows
  of a stack).  The padding value must be 0 (``gg.padding_value``, a splat the
  caller read) at every rank, since the other ranks' tiles are all padding."""
  a, v = ls
  if op.attrs.get("gg.padding_value") != 0.0 or not a.zero_elsewhere:
    return
  if v.partial or (v.at and not v.zero_elsewhere):
    return  # pieces of 0, or junk off its pins: some rank would not pad with 0
  lo, hi, inner = (list(op.attrs[k]) for k in ("edge_padding_low", "edge_padding_high",
                                               "interior_padding"))
  out = op.result_type.shape
  padded = [d for d in range(a.rank) if lo[d] or hi[d]]
  if any(inner) or any(a.dims[d] for d in padded) or len(padded) != 1:
    return
  (k,) = padded
  pins = dict(a.at)
  for axes in _pin_tilings(pins, op.mesh):
    n = math.prod(op.mesh.axis_size(x) for x in axes)
    if out[k] % n:
      continue
    size = out[k] // n
    t = 0
    for x in axes:  # the tile the pins name, major axis first
      t = t * op.mesh.axis_size(x) + pins[x]
    start, width = lo[k] - t * size, op.operand_types[0].shape[k]
    if lo[k] < 0 or hi[k] < 0 or start < 0 or start + width > size:
      continue
    local_lo, local_hi = list(lo), list(hi)
    local_lo[k], local_hi[k] = start, size - start - width
    dims = tuple(axes if d == k else a.dims[d] for d in range(a.rank))
    rest = tuple((x, c) for x, c in a.at if x not in axes)
    yield ({**_pad_attrs(op), "edge_padding_low": tuple(local_lo),
            "edge_padding_high": tuple(local_hi)},
           a.with_(dims=dims, at=rest, zero_elsewhere=bool(rest)))


def _pin_tilings(pins: dict, mesh: ir.Mesh) -> Iterator[tuple[str, ...]]:
  """Orders of pinned axes a padded dim may be tiled by (every nonempty
  sequence of distinct pinned axes of size > 1)."""
  axes = [x for x in sorted(pins) if mesh.axis_size(x) > 1]
  for n in range(1, len(axes) + 1):
    yield from itertools.permutations(axes, n)


def _dynamic_slice(op: SeqOp, ls: Sequence[Layout]):
  """dynamic_slice(concat(a_r,k), i) = concat(dynamic_slice(a_r, i), k) when dim k
  is taken whole (its start is then clamped to 0 on every rank) and the start
  indices are whole replicas (the same on every rank)."""
  a, *offsets = ls
  if any(not o.is_full_replica() or not o.is_clean() for o in offsets):
    return
  shape = op.operand_types[0].shape
  local = a.local_shape(shape, op.mesh)
  if local is None:
    return
  sizes = list(op.attrs["slice_sizes"])
  for d, axes in enumerate(a.dims):
    if axes:
      if sizes[d] != shape[d]:
        return
      sizes[d] = local[d]
  yield {"slice_sizes": tuple(sizes)}, a


def _dynamic_update_slice(op: SeqOp, ls: Sequence[Layout]):
  """dus(concat(a_r,k), concat(u_r,k), i) = concat(dus(a_r, u_r, i), k) when the
  update covers tiled dims whole (start clamped to 0) and is tiled alike; linear
  in (a, u) together, so equal partial sums and scales carry through."""
  a, u, *offsets = ls
  if any(not o.is_full_replica() or not o.is_clean() for o in offsets):
    return
  if u.dims != a.dims or u.partial != a.partial or u.partial_kind != a.partial_kind \
      or not scales_equal(u.scale, a.scale):
    return
  shape, ushape = op.operand_types[0].shape, op.operand_types[1].shape
  if any(axes and ushape[d] != shape[d] for d, axes in enumerate(a.dims)):
    return
  if a.partial and a.partial_kind != "sum":
    return
  yield op.attrs, a


def _windows_stay_in_tiles(op: SeqOp, a: Layout) -> bool:
  """Does every window of a reduce_window or select_and_scatter lie inside
  one rank's tile along each tiled dim?  So when it is one element,
  unstrided and unpadded (a cumulative sum along another dim), or when the
  windows do not overlap (window <= stride, unpadded) and a whole number of
  strides fills a tile (a 2 x 2 pool of rows split over ranks, each holding
  an even number).  Undilated either way; chunks reordered before tiling
  are left alone."""
  window, strides, pads, base_dilations, window_dilations = window_config(op.attrs, a.rank)
  local = a.local_shape(op.operand_types[0].shape, op.mesh)
  ordered = {d for d, _ in a.order}
  for d, axes in enumerate(a.dims):
    if not axes:
      continue
    if (base_dilations[d], window_dilations[d], pads[d]) != (1, 1, (0, 0)) or local is None:
      return False
    if (window[d], strides[d]) != (1, 1) and (
        window[d] > strides[d] or local[d] % strides[d] or d in ordered or a.filled):
      return False
  return True


def _reduce_window(op: SeqOp, ls: Sequence[Layout]):
  """reduce_window(concat(a_r,k)) = concat(reduce_window(a_r),k) when the
  windows along dim k stay inside each rank's tile (``_windows_stay_in_tiles``):
  a cumulative sum along an untiled dim (jnp.cumsum) is every rank's own,
  and so is a pool of its own rows.  Each rank combines its own init per
  window.  Windows that add are linear in operand and init together, so
  their common partial sum and scale pass through (an average pool of a
  partial sum, its zero init a partial sum of zeros); max (min) windows of
  a partial maximum (minimum) are the ranks' windows' maximum, each with the
  whole init (taken twice, it counts once).  One operand only: a variadic
  window (an argmax's values and indices) is left alone."""
  if len(ls) != 2:
    return
  a, init = ls
  kind = op.attrs.get("gg.reduction")
  whole_init = init.is_full_replica() and init.is_clean()
  if a.partial or not a.is_clean():
    adds = kind == "sum" and a.partial_kind == "sum" and init == Layout((), a.partial, "sum",
                                                                          a.scale)
    idempotent = kind in ("max", "min") and a.partial_kind == kind and a.is_clean()
    if not (adds or (idempotent and whole_init)):
      return
  elif not whole_init:
    return
  if _windows_stay_in_tiles(op, a):
    yield {k: v for k, v in op.attrs.items() if k != "gg.reduction"}, a


def _select_and_scatter(op: SeqOp, ls: Sequence[Layout]):
  """select_and_scatter(concat(a_r,k), concat(s_r,k), i) =
  concat(select_and_scatter(a_r, s_r, i), k) when the windows along every
  tiled dim k stay inside each rank's tile (``_windows_stay_in_tiles``):
  they, and the places they select, are the rank's own (max pooling's
  gradient with the images split over dp, or their rows in even tiles).
  The operand is a clean whole value (the select compares its elements),
  the source tiled as it.  A scatter that adds is linear in the source and
  init together (the init fills the result, the source adds), so their
  common partial sum and scale pass to the result."""
  a, s, init = ls
  if a.filled or a.order or s.with_(partial=(), scale=1.0) != a:
    return  # (so the operand has no sum or scale: the source alone may)
  if init != Layout((), s.partial, s.partial_kind, s.scale):
    return
  if (s.partial or not s.is_clean()) and (
      s.partial_kind != "sum" or op.attrs.get("gg.reduction") != "sum"):
    return
  if _windows_stay_in_tiles(op, a):
    yield {k: v for k, v in op.attrs.items() if k != "gg.reduction"}, s


def _index_batch_dims(rank: int, index_vector_dim: int) -> list[int]:
  """The dims of gather's or scatter's indices that number the rows."""
  return [d for d in range(rank) if d != index_vector_dim]


def _clean_indices(i: Layout, index_vector_dim: int) -> bool:
  """Indices a lemma may split: whole values (no sum, no scale), each row's
  index vector on one rank."""
  return not i.partial and i.is_clean() and (
      index_vector_dim >= i.rank or not i.dims[index_vector_dim])


def _gather_result(op: SeqOp, a: Layout, i: Layout, skip: set[int]
                   ) -> Optional[tuple[dict, tuple]]:
  """(local attrs, result dims) of a gather: each index row's tiling on its
  result dim, and the tiling of every operand dim not in ``skip`` (the
  caller's own) on its offset dim, which the slices must take whole and no
  index move; None if one does not."""
  dn = dimension_numbers(op.attrs["dimension_numbers"])
  offset_dims, collapsed = dn.get("offset_dims", ()), dn.get("collapsed_slice_dims", ())
  start_map, sizes = dn.get("start_index_map", ()), op.attrs["slice_sizes"]
  batching = set(dn.get("operand_batching_dims", ()))
  window = [d for d in range(a.rank) if d not in collapsed and d not in batching]
  out_rank = op.result_type.rank
  batch_out = [d for d in range(out_rank) if d not in offset_dims]
  dims: list[tuple] = [()] * out_rank
  for j, d in zip(_index_batch_dims(i.rank, dn["index_vector_dim"]), batch_out):
    dims[d] = i.dims[j]
  for d, axes in enumerate(a.dims):
    if axes and d not in skip:
      if d in start_map or d in collapsed or sizes[d] != op.operand_types[0].shape[d]:
        return None
      dims[offset_dims[window.index(d)]] = axes
  local = a.local_shape(op.operand_types[0].shape, op.mesh)
  if local is None:
    return None
  local_sizes = tuple(local[d] if a.dims[d] and d not in skip else n
                      for d, n in enumerate(sizes))
  return dict(op.attrs, slice_sizes=local_sizes), tuple(dims)


def _gather(op: SeqOp, ls: Sequence[Layout]):
  """gather(a, concat(i_r, k)) = concat(gather(a, i_r), k') for a row dim k
  of the indices (k' its result dim): each result row reads one slice of a
  at the start its own index row gives.  And gather(concat(a_r, j), i) =
  concat(gather(a_r, i), j') for an operand dim j the slices take whole and
  no index moves (j' its offset dim).  Picking elements commutes with the
  operand's sums, maxima and scale (the indices must not vary over those
  axes, which no valid layout lets them).  An embedding lookup of tokens
  split over the batch or sequence is the first; a table split along
  d_model, the second."""
  a, i = ls
  dn = dimension_numbers(op.attrs["dimension_numbers"])
  if dn.get("operand_batching_dims") or not _clean_indices(i, dn["index_vector_dim"]):
    return
  found = _gather_result(op, a, i, set())
  if found is not None:
    yield found[0], Layout(found[1], a.partial, a.partial_kind, a.scale)


# A lemma whose local op is not the sequential op's own names it under this key.
LOCAL_OP = "gg.local_op"


def _gather_table_tiles(op: SeqOp, ls: Sequence[Layout]):
  """gather(concat_r(a_r, k), i) = sum_r tile_gather(a_r, i) for the one dim k
  the indices pick a row along: rank r looks each index up in its own rows
  ``[r*n, r*n + n)`` and gives zeros for rows another rank holds (Megatron's
  vocab-parallel embedding, and XLA's partitioning of a gather from a table
  split by rows).  ``gg.tile_gather`` clamps each index to the whole table
  first, as the sequential gather does (``reference.tile_gather``).  Each
  index row is then in exactly one rank's tile, so the sum over the axis
  rebuilds the row.  The indices must be the same on every rank of that axis;
  the table's other tilings, sums and scale pass through as in
  ``gather-split-rows-or-whole-slices``."""
  a, i = ls
  dn = dimension_numbers(op.attrs["dimension_numbers"])
  start_map, sizes = dn.get("start_index_map", ()), op.attrs["slice_sizes"]
  ivd = dn["index_vector_dim"]
  index_shape = op.operand_types[1].shape
  pairs = list(zip(dn.get("operand_batching_dims", ()), dn.get("start_indices_batching_dims", ())))
  if len(start_map) != 1 or (ivd < len(index_shape) and index_shape[ivd] != 1) or \
      not _clean_indices(i, ivd) or any(a.dims[o] != i.dims[j] for o, j in pairs):
    return  # (batching dims tiled alike: each rank its own batches, as in _batched)
  (k,) = start_map
  tiling = a.dims[k]
  if not tiling or any(axis_shift(x) for x in tiling) or sizes[k] != 1 or (
      a.partial and a.partial_kind != "sum"):
    return
  if any(axis_base(b) in tiling for axes in i.dims for b in axes):
    return  # each rank must look up the same indices (no valid result layout else)
  found = _gather_result(op, a, i, {k} | {o for o, _ in pairs})
  if found is None:
    return
  attrs, dims = found
  attrs.update({LOCAL_OP: "gg.tile_gather",
                "gg.tiles": tuple((x, op.mesh.axis_size(x)) for x in tiling)})
  yield attrs, Layout(dims, tuple(sorted(set(a.partial) | set(tiling))), "sum", a.scale)


def _batched(op: SeqOp, ls: Sequence[Layout]):
  """gather(concat(a_r, o), concat(i_r, j)) = concat(gather(a_r, i_r), j') for
  each batching pair (operand dim o, index dim j) tiled alike (the rows of
  batch b read operand batch b only), and scatter alike with its updates' row
  dims; every other dim whole (a gather's operand dims its slices take whole
  may stay tiled, as in ``gather-split-rows-or-whole-slices``).  The sums and
  scale of the operand (of base and updates together, for a scatter-add) pass
  through.  top_k's gradient is one: it picks k of each row's E values."""
  if op.name == "gather":
    a, i = ls
    dn = dimension_numbers(op.attrs["dimension_numbers"])
    pairs = list(zip(dn.get("operand_batching_dims", ()),
                     dn.get("start_indices_batching_dims", ())))
  else:
    a, i, u = ls
    dn = dimension_numbers(op.attrs["scatter_dimension_numbers"])
    pairs = list(zip(dn.get("input_batching_dims", ()),
                     dn.get("scatter_indices_batching_dims", ())))
    if op.attrs.get("gg.reduction") != "sum" or u.partial != a.partial or \
        u.partial_kind != a.partial_kind or not scales_equal(u.scale, a.scale):
      return
  ivd = dn["index_vector_dim"]
  if not pairs or not _clean_indices(i, ivd) or a.partial and a.partial_kind != "sum":
    return
  paired_index_dims = {j for _, j in pairs}
  if any(a.dims[o] != i.dims[j] for o, j in pairs) or any(
      i.dims[j] for j in range(i.rank) if j != ivd and j not in paired_index_dims):
    return
  rows = _index_batch_dims(i.rank, ivd)
  if op.name == "scatter":
    window_dims = dn.get("update_window_dims", ())
    scatter_rows = [d for d in range(u.rank) if d not in window_dims]
    if any(u.dims[d] != i.dims[j] for d, j in zip(scatter_rows, rows)) or \
        any(u.dims[w] for w in window_dims) or \
        any(a.dims[d] for d in range(a.rank) if d not in {o for o, _ in pairs}):
      return
    attrs = {k: v for k, v in op.attrs.items() if k not in ("gg.reduction", "gg.base_value")}
    yield attrs, a
    return
  found = _gather_result(op, a, i, {o for o, _ in pairs})
  if found is not None:
    yield found[0], Layout(found[1], a.partial, a.partial_kind, a.scale)


def _top_k(op: SeqOp, ls: Sequence[Layout]):
  """top_k(concat(a_r, j)) = concat(top_k(a_r), j) for any dim j but the last,
  which top_k picks along (both results: the values and their positions).  A
  sum over ranks, or a scale (a negative one reverses the order), does not
  commute with picking the largest."""
  (a,) = ls
  if a.rank == 0 or a.dims[-1] or a.partial or not scales_equal(a.scale, 1.0):
    return
  yield {"k": op.attrs["k"]}, Layout(a.dims)


def _scatter_into_table_tiles(op: SeqOp, ls: Sequence[Layout]):
  """scatter_add(concat_r(b_r, k), i, u) = concat_r(tile_scatter(b_r, i, u), k)
  for the one dim k the indices pick a row along: rank r adds the rows whose
  index falls in its own rows ``[r*n, r*n + n)`` (the gradient of
  ``gather-from-table-tiles``).  Each index in the table is in exactly one
  tile, and one beyond it is skipped by both.  The indices and updates must be
  the same on every rank of the tiling axes; the base is split along k only.
  Index rows split over other axes (with their updates), or updates that are
  partial sums over them, make the result a partial sum over those axes, as in
  ``scatter-add-split-rows``: into a zero base only."""
  b, i, u = ls
  dn = dimension_numbers(op.attrs["scatter_dimension_numbers"])
  to_operand = dn.get("scatter_dims_to_operand_dims", ())
  ivd = dn["index_vector_dim"]
  index_shape = op.operand_types[1].shape
  pairs = list(zip(dn.get("input_batching_dims", ()), dn.get("scatter_indices_batching_dims", ())))
  if op.attrs.get("gg.reduction") != "sum" or len(to_operand) != 1 or \
      (ivd < len(index_shape) and index_shape[ivd] != 1) or not _clean_indices(i, ivd) or \
      any(b.dims[o] != i.dims[j] for o, j in pairs):
    return  # (batching dims tiled alike: each rank its own batches, as in _batched)
  (k,) = to_operand
  tiling = b.dims[k]
  batching = {o for o, _ in pairs}
  inserted, window_dims = dn.get("inserted_window_dims", ()), dn.get("update_window_dims", ())
  covered = [d for d in range(b.rank) if d not in inserted and d not in batching]
  if k in covered and op.operand_types[2].shape[window_dims[covered.index(k)]] != 1:
    return  # a window of more than one row may straddle two tiles
  if not tiling or any(axis_shift(x) for x in tiling) or b.partial or \
      any(axes for d, axes in enumerate(b.dims) if d != k and d not in batching) or \
      any(u.dims[w] for w in window_dims) or (u.partial and u.partial_kind != "sum") or \
      not scales_equal(b.scale, u.scale):
    return
  rows = [d for d in range(u.rank) if d not in window_dims]
  split: list[str] = []
  paired = {j for _, j in pairs}
  for r, d in zip(_index_batch_dims(i.rank, ivd), rows):
    if i.dims[r] != u.dims[d]:
      return  # each rank must hold its rows' indices with their updates
    if r not in paired:  # (a batching row's axes tile the base's batch dim instead)
      split += list(i.dims[r])
  if len(split) != len(set(split)) or any(axis_shift(x) for x in split):
    return  # diagonal blocks, or rotated ones: not every row once
  partial = tuple(sorted(set(split) | set(u.partial)))
  if set(partial) & set(tiling) or (partial and op.attrs.get("gg.base_value") != 0.0):
    return  # every rank of the tiling axes adds the same rows (is_valid says so too); a base once
  attrs = {k2: v for k2, v in op.attrs.items() if k2 not in ("gg.reduction", "gg.base_value")}
  attrs.update({LOCAL_OP: "gg.tile_scatter",
                "gg.tiles": tuple((x, op.mesh.axis_size(x)) for x in tiling)})
  yield attrs, Layout(b.dims, partial, "sum", b.scale)


def _scatter_add(op: SeqOp, ls: Sequence[Layout]):
  """scatter-add(0, concat(i_r, k), concat(u_r, k')) = sum_r scatter-add(0,
  i_r, u_r): each index row adds its window once, on the one rank that holds
  it (an embedding's gradient from tokens split over the batch, summed by the
  all-reduce that follows).  scatter-add is linear in (base, updates) jointly,
  so partial sums of both (or of the updates, into 0) stay one; and
  scatter(concat(b_r, j), i, concat(u_r, j')) = concat(scatter(b_r, i, u_r),
  j) for an operand dim j the windows cover whole and no index moves.  The
  base must be 0 (``gg.base_value``) wherever ranks add their own pieces, or
  it would be counted once per rank."""
  b, i, u = ls
  dn = dimension_numbers(op.attrs["scatter_dimension_numbers"])
  if op.attrs.get("gg.reduction") != "sum" or dn.get("input_batching_dims") or \
      not _clean_indices(i, dn["index_vector_dim"]):
    return
  window_dims, inserted = dn.get("update_window_dims", ()), dn.get("inserted_window_dims", ())
  to_operand = dn.get("scatter_dims_to_operand_dims", ())
  rows = [d for d in range(u.rank) if d not in window_dims]
  split: list[str] = []
  for k, d in zip(_index_batch_dims(i.rank, dn["index_vector_dim"]), rows):
    if i.dims[k] != u.dims[d]:
      return  # each rank must hold its rows' indices with their updates
    split += [axis_base(a) for a in i.dims[k]]
  if len(split) != len(set(split)):
    return  # an axis on two row dims: ranks hold diagonal blocks, not every row
  covered = [d for d in range(b.rank) if d not in inserted]
  base_shape, update_shape = op.operand_types[0].shape, op.operand_types[2].shape
  for w, d in zip(window_dims, covered):
    if u.dims[w] != b.dims[d] or (b.dims[d] and (
        d in to_operand or update_shape[w] != base_shape[d])):
      return
  if any(b.dims[d] for d in range(b.rank) if d not in covered):
    return
  if u.partial and u.partial_kind != "sum":
    return
  partial = tuple(sorted(set(split) | set(u.partial)))
  if split or not (b.partial == u.partial and b.partial_kind == u.partial_kind and
                   scales_equal(b.scale, u.scale)):
    # Each rank adds its own base: it must be 0, or pieces of 0 summed with
    # the result (then each piece is added once per rank of the other axes,
    # which still sums to 0).
    if op.attrs.get("gg.base_value") != 0.0 or (b.partial and (
        b.partial_kind != "sum" or not set(b.partial) <= set(partial))):
      return
  attrs = {k: v for k, v in op.attrs.items() if k not in ("gg.reduction", "gg.base_value")}
  yield attrs, Layout(b.dims, partial, "sum", u.scale)


def _replicas(op: SeqOp, ls: Sequence[Layout]):
  """f(x) = f(x): any op, opaque or not, on whole unscaled replicas gives a whole
  replica.  This is the only lemma unknown ops get."""
  if all(l.is_full_replica() and l.is_clean() for l in ls):
    yield op.attrs, Layout.replicated(op.result_type.rank)


LEMMAS: tuple[Lemma, ...] = (
    Lemma("elementwise-over-tiles", ELEMENTWISE,
          "f(concat(a_r,k), concat(b_r,k)) = concat(f(a_r,b_r),k)", _elementwise_tiles),
    Lemma("linear-over-partial-sum",
          frozenset({"add", "subtract", "negate", "convert", "copy"}),
          "f(sum_r a_r, sum_r b_r) = sum_r f(a_r, b_r)  (f linear)", _linear_sum),
    Lemma("product-with-partial-sum", frozenset({"multiply"}),
          "(sum_r a_r) * b = sum_r (a_r * b);  (s*a) * (t*b) = st * (a*b)", _product),
    Lemma("quotient-of-partial-sum", frozenset({"divide"}),
          "(sum_r a_r) / b = sum_r (a_r / b);  (s*a) / (t*b) = (s/t) * (a/b)", _quotient),
    Lemma("select-of-partial-sums", frozenset({"select"}),
          "select(p, k*sum_r a_r, k*sum_r b_r) = k*sum_r select(p, a_r, b_r)", _select_linear),
    Lemma("max-of-partial-max", frozenset({"maximum", "minimum"}),
          "max(max_r a_r, max_r b_r) = max_r max(a_r, b_r)", _monotone_max),
    Lemma("dot-general", frozenset({"dot_general"}),
          "dot(concat(a1,a2,1), concat(b1,b2,0)) = dot(a1,b1) + dot(a2,b2), and batch/free "
          "dims keep their tiling", _dot_general),
    Lemma("convolution", frozenset({"convolution"}),
          "conv(concat(a_r,f), concat(k_r,i)) = sum_r conv(a_r,k_r); batch and output "
          "features keep their split, feature or batch groups split with the output "
          "features; spatial dims whole", _convolution),
    Lemma("convolution-over-halos", frozenset({"convolution"}),
          "conv(x, k) padded (lo, hi) along a dim split over ranks = concat_r conv(x_r "
          "with lo rows of rank r-1 and hi of rank r+1, zeros at the ends, unpadded); "
          "with the window split alike (a kernel's gradient), sum_r of them",
          _convolution_over_halos, reads_halos=True),
    Lemma("transpose", frozenset({"transpose"}),
          "transpose(concat(a_r,k), p) = concat(transpose(a_r,p), p^-1(k))", _transpose),
    Lemma("reshape", frozenset({"reshape"}),
          "reshape(concat(a_r, major of group)) = concat(reshape(a_r), new major)", _reshape),
    Lemma("broadcast-in-dim", frozenset({"broadcast_in_dim"}),
          "broadcast(concat(a_r,k)) = concat(broadcast(a_r), map(k)); new dims tile freely",
          _broadcast_in_dim),
    Lemma("iota", frozenset({"iota"}), "iota(k) tiles freely along dims other than k", _iota),
    Lemma("reduce", frozenset({"reduce"}),
          "reduce_+(concat(a_r,k), k) = sum_r reduce_+(a_r, k); max/min alike", _reduce),
    Lemma("slice-untiled-dims", frozenset({"slice"}),
          "slice(concat(a_r,k)) = concat(slice(a_r),k) if dim k is whole", _slice),
    Lemma("reverse-untiled-dims", frozenset({"reverse"}),
          "reverse(concat(a_r,k), d) = concat(reverse(a_r,d),k) if dim d is whole", _reverse),
    Lemma("sort-along-untiled-dim", frozenset({"sort"}),
          "sort(concat(a_r,k), d) = concat(sort(a_r,d),k) if dim d is whole", _sort),
    Lemma("slice-of-one-tile", frozenset({"slice"}),
          "slice(concat(a_r,k), inside tile t) = slice(a_t) at the ranks holding tile t",
          _slice_one_tile),
    Lemma("concatenate-other-dim", frozenset({"concatenate"}),
          "concat(concat(a_r,j), concat(b_r,j), k) = concat(concat(a_r,b_r,k), j)",
          _concatenate),
    Lemma("dynamic-slice-untiled-dims", frozenset({"dynamic_slice"}),
          "dynamic_slice(concat(a_r,k), i) = concat(dynamic_slice(a_r, i), k) if dim k "
          "is whole", _dynamic_slice),
    Lemma("dynamic-update-slice-untiled-dims", frozenset({"dynamic_update_slice"}),
          "dus(concat(a_r,k), concat(u_r,k), i) = concat(dus(a_r,u_r,i), k) if u covers "
          "dim k", _dynamic_update_slice),
    Lemma("pad-untiled-dims", frozenset({"pad"}), "pad(concat(a_r,k)) = concat(pad(a_r),k) "
          "if dim k is not padded", _pad),
    Lemma("reduce-window-within-tiles", frozenset({"reduce_window"}),
          "reduce_window(concat(a_r,k)) = concat(reduce_window(a_r),k) if the windows "
          "along k stay inside tiles", _reduce_window),
    Lemma("select-and-scatter-within-tiles", frozenset({"select_and_scatter"}),
          "select_and_scatter(concat(a_r,k), concat(s_r,k)) = concat(select_and_scatter(a_r, "
          "s_r),k) if the windows along k stay inside tiles; linear in s if it adds",
          _select_and_scatter),
    Lemma("gather-split-rows-or-whole-slices", frozenset({"gather"}),
          "gather(a, concat(i_r,k)) = concat(gather(a, i_r),k'); gather(concat(a_r,j), i) = "
          "concat(gather(a_r, i),j') if slices take dim j whole", _gather),
    Lemma("gather-from-table-tiles", frozenset({"gather"}),
          "gather(concat_r(a_r,k), i) = sum_r tile_gather(a_r, i): each rank looks up "
          "the rows it holds, zeros for the others", _gather_table_tiles),
    Lemma("scatter-add-split-rows", frozenset({"scatter"}),
          "scatter_add(0, concat(i_r,k), concat(u_r,k')) = sum_r scatter_add(0, i_r, u_r); "
          "windows covering dim j whole keep its tiling", _scatter_add),
    Lemma("gather-scatter-over-tiled-batching-dims", frozenset({"gather", "scatter"}),
          "gather(concat(a_r,o), concat(i_r,j)) = concat(gather(a_r, i_r),j') for batching "
          "dims o, j tiled alike; scatter alike", _batched),
    Lemma("top-k-along-untiled-last-dim", frozenset({"chlo.top_k"}),
          "top_k(concat(a_r,j)) = concat(top_k(a_r),j) for j not the last dim", _top_k),
    Lemma("scatter-add-into-table-tiles", frozenset({"scatter"}),
          "scatter_add(concat_r(b_r,k), i, u) = concat_r(tile_scatter(b_r, i, u), k): each "
          "rank adds the rows it holds", _scatter_into_table_tiles),
    Lemma("pad-into-one-tile", frozenset({"pad"}),
          "pad(x, 0) = concat_r(pad(x_r, 0) into tile-sized room) if x_r is x at the ranks "
          "holding x's tile and 0 at the others", _pad_into_one_tile, reads_pins=True),
)
REPLICA_LEMMA = Lemma("identical-on-replicas", frozenset(), "f(x) = f(x) on whole replicas",
                      _replicas)


MODELLED_ELSEWHERE = frozenset({"constant", "while"})  # splats; loops.py


def is_modelled(name: str) -> bool:
  """Has this op more than the replica lemma (is it more than an opaque function)?"""
  return name in MODELLED_ELSEWHERE or any(name in l.ops for l in LEMMAS)


def lemmas_for(name: str) -> list[Lemma]:
  return [l for l in LEMMAS if name in l.ops] + [REPLICA_LEMMA]


def apply_lemmas(op: SeqOp, layouts: Sequence[Layout]) -> Iterator[Step]:
  """Every (local op, result layout) some lemma derives for these operand layouts.

  Pinned operands are lifted here, for every lemma alike: a local op computes
  the same at every rank, so what its operands are at the pinned ranks its
  result is there (layout.py), and zero wherever operands that force a zero
  result (``ZERO_PRESERVING``) are zero."""
  pins = merged_pins(*(l.at for l in layouts))
  if pins is None:
    return  # operands known at different ranks: nothing in common
  bare = [l.unpinned() for l in layouts]
  zeros = pins and _zeros_forced(op, layouts, pins)
  haloed = any(l.halo for l in layouts)
  for lemma in lemmas_for(op.name):
    if haloed and not lemma.reads_halos:
      continue
    for attrs, layout in lemma.rule(op, layouts if lemma.reads_pins else bare):
      if pins and not lemma.reads_pins:
        both = merged_pins(layout.at, pins)
        if both is None:
          continue
        layout = layout.with_(at=both, zero_elsewhere=zeros and both == pins)
      if not layout.is_valid():
        continue
      t = _local_type(op, layout)
      if t is not None:
        local_name = attrs.get(LOCAL_OP)
        if local_name is not None:
          attrs = {k: v for k, v in attrs.items() if k != LOCAL_OP}
        yield Step(attrs, t, layout, lemma.name, local_name)


# Operand groups that, all zero, make the op's result zero whatever the other
# operands are (read in real arithmetic, layout.py).  ``None``: all operands.
_UNARY_ZERO = ((0,),)
ZERO_PRESERVING: dict[str, Optional[tuple[tuple[int, ...], ...]]] = {
    **{name: _UNARY_ZERO for name in (
        "negate", "copy", "convert", "reshape", "transpose", "broadcast_in_dim", "slice",
        "reverse", "dynamic_slice", "abs", "sqrt", "sine", "tanh", "real", "imag")},
    "multiply": ((0,), (1,)), "dot_general": ((0,), (1,)), "divide": ((0,),),
    "add": ((0, 1),), "subtract": ((0, 1),), "select": ((1, 2),), "pad": ((0, 1),),
    "dynamic_update_slice": ((0, 1),), "concatenate": None,
    "reduce": None,  # with a sum, max or min reducer
    "maximum": ((0, 1),), "minimum": ((0, 1),),
}


def _zeros_forced(op: SeqOp, layouts: Sequence[Layout], pins) -> bool:
  """Is the result zero off ``pins``: do operands zero off exactly those ranks
  form a group that forces it?"""
  if op.name not in ZERO_PRESERVING:
    return False
  if op.name == "reduce" and op.attrs.get("gg.reduction") not in ("sum", "max", "min"):
    return False  # a reducer body of its own need not map zeros to zero
  groups = ZERO_PRESERVING[op.name] or (tuple(range(len(layouts))),)
  zero = [l.zero_elsewhere and l.at == pins for l in layouts]
  if op.name == "divide" and layouts[1].zero_elsewhere:
    return False  # 0 / 0
  return any(all(zero[i] for i in group) for group in groups)
