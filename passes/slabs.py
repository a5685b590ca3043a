"""Sums of zero-padded slabs as concatenations (a canonical form for both programs).

The transpose of a static slice is a zero pad, so the gradient of a tensor
read in slices is a sum of pads.  A pipeline's per-device stack of layer
weights is read layer by layer at every step, and autodiff adds the pads in
the order the backward pass meets them, layers interleaved:
``pad_1(g61) + pad_0(g60) + pad_1(g51) + ...``.  The sequential stack's
gradient is ``pad_7(g7) + pad_6(g6) + ...``.  Neither names a stage's rows.
In real arithmetic both are concatenations of slabs, each the sum of what
was padded into it, in the order it was added:

  add(pad(x, slab a), pad(y, slab b)), a and b adjacent  -> pad(concat(x, y))
  add(pad(x, slab a), pad(y, slab a))                    -> pad(x + y)
  add(concat(.., x, ..), pad(y, x's slab))               -> concat(.., x + y, ..)

(a concatenation that covers the whole dim is not padded).

Only along one dim, with padding 0 and no interior padding; slabs that
overlap in part, or leave a gap, are left alone.  The per-device stack's
gradient becomes ``concat(sum_t g_t0, sum_t g_t1)`` and the sequential one
``concat(g0, .., g7)``: a stage's rows are one operand (``stages.py``), and a
tensor's microbatch gradients are the pieces ``pieces.py`` joins.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.collectives import overwrites
from graphguard_hlo.passes.terms import scalar_of_broadcast, splat_value
from graphguard_hlo.passes.unit_dims import only_unit_dims_change
from graphguard_hlo.reference import dimension_numbers

# (start, stop, value) along the slabs' dim, sorted by start.
Slab = tuple[int, int, ir.Value]


def _padded_dim(op: ir.Op) -> Optional[int]:
  """The one dim a zero pad pads, without interior padding (None otherwise)."""
  lo, hi, inner = (tuple(op.attrs[k]) for k in ("edge_padding_low", "edge_padding_high",
                                                 "interior_padding"))
  if any(inner) or min(lo + hi, default=0) < 0 or splat_value(op.operands[1]) != 0.0:
    return None
  dims = [d for d in range(len(lo)) if lo[d] or hi[d]]
  return dims[0] if len(dims) == 1 else None


def slabs_of(v: ir.Value) -> Optional[tuple[int, list[Slab], Optional[ir.Value]]]:
  """(dim, slabs, zero) for a zero pad or a concatenation; ``zero`` the pad's
  padding value (None for a concatenation)."""
  op = v.producer
  if op is None:
    return None
  if op.name == "concatenate":
    k = op.attrs["dimension"]
    out, at = [], 0
    for x in op.operands:
      out.append((at, at + x.shape[k], x))
      at += x.shape[k]
    return k, out, None
  if op.name != "pad":
    return None
  k = _padded_dim(op)
  if k is None:
    return None
  lo = op.attrs["edge_padding_low"][k]
  inner = slabs_of(op.operands[0])
  if inner is not None and inner[0] == k and inner[2] is None:  # pad(concat(..))
    return k, [(a + lo, b + lo, x) for a, b, x in inner[1]], op.operands[1]
  width = op.operands[0].shape[k]
  return k, [(lo, lo + width, op.operands[0])], op.operands[1]


def merged(a: list[Slab], b: list[Slab]) -> Optional[list[Slab]]:
  """The slabs of a + b: equal ranges added (a's first), disjoint ones kept;
  ``None`` if two overlap in part.  Adds are returned as (start, stop, (x, y))."""
  out: dict[tuple[int, int], object] = {}
  for start, stop, x in a:
    out[(start, stop)] = x
  for start, stop, y in b:
    if (start, stop) in out:
      out[(start, stop)] = (out[(start, stop)], y)
      continue
    if any(s < stop and start < e for s, e in out):
      return None
    out[(start, stop)] = y
  return [(s, e, x) for (s, e), x in sorted(out.items())]


def sum_of_slabs(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """``add`` of two zero pads or concatenations along one dim, as one
  concatenation (padded if it does not cover the dim): two stacks masked as
  a whole and added (``select_of_slabs``) become a stack of sums.  ``fresh``, ``place``
  and ``emit`` are the canonicalizer's op builders."""
  if op.name != "add" or len(op.operands) != 2:
    return None
  a, b = (slabs_of(v) for v in op.operands)
  if a is None or b is None or a[0] != b[0]:
    return None
  k = a[0]
  zero = a[2] if a[2] is not None else b[2]
  slabs = merged(a[1], b[1])  # (two concatenations: cut at the same rows)
  if slabs is None:
    return None  # overlapping in part
  return assemble(module, graph, op, k, slabs, zero, fresh, place, emit)


def _spread_scalar(module, fresh, place, v: ir.Value, shape, location) -> Optional[ir.Value]:
  """``v``, a scalar broadcast, broadcast to ``shape`` instead."""
  scalar = scalar_of_broadcast(v)
  if scalar is None:
    return None
  return place(fresh(module, "broadcast_in_dim", [scalar], {"broadcast_dimensions": ()},
                     list(shape), scalar.type.dtype, location))


def select_of_slabs(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """``select(p, concat_k(xs), 0)`` (either way round), p one flag for every
  element -> ``concat_k(select(p, x, 0) for x in xs)``: a stack's gradient
  masked as a whole (a schedule's step not running) is masked row by row, so
  a sum of masked stacks is a stack of sums (``sum_of_slabs``)."""
  if op.name != "select":
    return None
  pred, on_true, on_false = op.operands
  concat, zero = (on_true, on_false) if splat_value(on_false) == 0.0 else (on_false, on_true)
  if splat_value(zero) != 0.0 or concat.producer is None \
      or concat.producer.name != "concatenate" or splat_value(pred) is not None:
    return None
  k = concat.producer.attrs["dimension"]
  parts = []
  for x in concat.producer.operands:
    p, z = (_spread_scalar(module, fresh, place, v, x.shape, op.location) for v in (pred, zero))
    if p is None or z is None:
      return None
    pair = [x, z] if concat is on_true else [z, x]
    parts.append(place(fresh(module, "select", [p, *pair], {}, x.shape, x.type.dtype,
                             op.location)))
  return emit(module, graph, op, "concatenate", parts, {"dimension": k})


def assemble(module, graph, op, k: int, slabs: list, zero: ir.Value, fresh, place,
             emit) -> Optional[ir.Value]:
  """``op``'s result as the slabs along dim k (contiguous, sorted; a value or a
  pair to add), concatenated and zero-padded where they leave the dim."""
  if any(s1 != e0 for (_, e0, _), (s1, _, _) in zip(slabs, slabs[1:])):
    return None  # a gap between slabs
  values = []
  for start, stop, x in slabs:
    if isinstance(x, tuple):
      x = place(fresh(module, "add", list(x), {}, x[0].shape, x[0].type.dtype, op.location))
    values.append(x)
  shape, dtype = op.results[0].shape, op.results[0].type.dtype
  lo, hi = slabs[0][0], shape[k] - slabs[-1][1]
  if len(values) == 1:
    body = values[0]
  else:
    body_shape = list(shape)
    body_shape[k] = slabs[-1][1] - lo
    concat = fresh(module, "concatenate", values, {"dimension": k}, body_shape, dtype,
                   op.location)
    if not lo and not hi:
      return emit(module, graph, op, "concatenate", values, {"dimension": k})
    body = place(concat)
  if not lo and not hi:
    return body
  if zero is None:
    return None  # no zero to pad with (the slabs came from a concatenation)
  rank = len(shape)
  pads = {"edge_padding_low": tuple(lo if d == k else 0 for d in range(rank)),
          "edge_padding_high": tuple(hi if d == k else 0 for d in range(rank)),
          "interior_padding": (0,) * rank}
  return emit(module, graph, op, "pad", [body, zero], pads)


# -- buffers written at constant rows (``x.at[i].set(u)``), and batches reshaped ------

def _set_window(op: ir.Op) -> Optional[tuple[int, int, int, ir.Value, ir.Value]]:
  """(k, lo, hi, x, update) if ``op`` writes ``update`` into rows [lo, hi) of
  x's dim k and every element of the other dims, at a constant place:
  ``x.at[i].set(u)`` (a scatter of one window) or a dynamic_update_slice at
  constant starts (clamped into x, as the op does)."""
  if op.name == "dynamic_update_slice":
    x, update, *starts = op.operands
    at = [splat_value(v) for v in starts]
    if None in at:
      return None
    lows = [min(max(int(a), 0), n - u) for a, n, u in zip(at, x.shape, update.shape)]
    partial = [d for d in range(x.type.rank) if update.shape[d] != x.shape[d]]
    if len(partial) != 1:
      return None
    k = partial[0]
    return k, lows[k], lows[k] + update.shape[k], x, update
  window = _window_at_a_constant(op)
  if window is None or not overwrites(op.regions[0]):
    return None
  x, update, k, sizes, at = window
  if not window_lands(at, k, sizes, x.shape):
    return None  # (nothing written: scatter_of_one_window)
  partial = [d for d in range(x.type.rank) if sizes[d] != x.shape[d]]
  if len(partial) != 1:
    return None
  j = partial[0]
  lo = at if j == k else 0
  return j, lo, lo + sizes[j], x, update


def scatter_window(op: ir.Op) -> Optional[tuple[ir.Value, ir.Value, ir.Value, int, list[int]]]:
  """(x, index, update, k, sizes) if ``op`` is a scatter of one window into
  x that starts at ``index`` along dim k and at 0 along every other dim, of
  ``sizes``: the form of ``x.at[i].set(u)`` (and ``.add``), and of GSPMD's
  partitioned one, whose ``i`` is computed from the partition id."""
  if op.name != "scatter" or len(op.operands) != 3 or not op.regions:
    return None
  x, index, update = op.operands
  dn = dimension_numbers(op.attrs["scatter_dimension_numbers"])
  if dn.get("input_batching_dims") or dn.get("scatter_indices_batching_dims"):
    return None
  window_dims = tuple(dn.get("update_window_dims", ()))
  inserted = tuple(dn.get("inserted_window_dims", ()))
  to_operand = tuple(dn.get("scatter_dims_to_operand_dims", ()))
  rows = [n for d, n in enumerate(index.shape) if d != dn["index_vector_dim"]]
  rank = x.type.rank
  covered = [d for d in range(rank) if d not in inserted]
  if math.prod(rows) != 1 or len(to_operand) != 1 \
      or list(window_dims) != sorted(window_dims) or len(covered) != len(window_dims) \
      or any(update.shape[d] != 1 for d in range(update.type.rank) if d not in window_dims):
    return None
  sizes = [1] * rank
  for d, w in zip(covered, window_dims):
    sizes[d] = update.shape[w]
  return x, index, update, to_operand[0], sizes


def _window_at_a_constant(op: ir.Op) -> Optional[tuple[ir.Value, ir.Value, int, list[int], int]]:
  """(x, update, k, sizes, start) of a scatter of one window at a constant row."""
  window = scatter_window(op)
  at = None if window is None else splat_value(window[1])
  if at is None:
    return None
  x, _, update, k, sizes = window
  return x, update, k, sizes, int(at)


def window_lands(at: int, k: int, sizes, shape) -> bool:
  """Does a window of ``sizes`` starting at ``at`` along dim k (0 elsewhere)
  lie inside ``shape``?  XLA skips a scatter's window that does not."""
  return 0 <= at and at + sizes[k] <= shape[k]


def scatter_of_one_window(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """A scatter of one window at a constant place that writes nothing (the
  window is outside x: XLA skips it) -> x; that overwrites all of x -> the
  update reshaped to x.  GSPMD's ``x.at[i].set(u)`` on a dim split over the
  ranks is such a scatter at each rank (``rank_cases.py``): the one rank
  holding row i overwrites its tile of one row, the others keep theirs."""
  window = _window_at_a_constant(op)
  if window is None:
    return None
  x, update, k, sizes, at = window
  if not window_lands(at, k, sizes, x.shape):
    return x
  if tuple(sizes) != tuple(x.shape) or not overwrites(op.regions[0]):
    return None
  if update.type == x.type:
    return update
  return place(fresh(module, "reshape", [update], {}, x.shape, x.type.dtype, op.location))


def _window(module, fresh, place, op, update: ir.Value, x: ir.Value, k: int, lo: int,
            hi: int) -> ir.Value:
  """The update as the rows it writes (a scatter's update reshaped so)."""
  sizes = [hi - lo if d == k else n for d, n in enumerate(x.shape)]
  if tuple(update.shape) == tuple(sizes):
    return update
  return place(fresh(module, "reshape", [update], {}, sizes, update.type.dtype, op.location))


def set_rows(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """``x.at[i].set(u)`` with a constant i (or a dynamic_update_slice at
  constant starts), x zeros or slabs: the rows written as the slab they
  become (GPipe's outputs written into a buffer, microbatch by microbatch)."""
  written = _set_window(op)
  if written is None:
    return None
  k, lo, hi, x, update = written
  new = (lo, hi, _window(module, fresh, place, op, update, x, k, lo, hi))
  if splat_value(x) == 0.0:
    zero = scalar_of_broadcast(x)
    if zero is None:
      return None
    return assemble(module, graph, op, k, [new], zero, fresh, place, emit)
  found = slabs_of(x)
  if found is None or found[0] != k:
    return None
  kept = []
  for s0, e0, v in found[1]:
    if (s0, e0) == (lo, hi):
      continue  # overwritten
    if s0 < hi and lo < e0:
      return None  # overwritten in part
    kept.append((s0, e0, v))
  return assemble(module, graph, op, k, sorted(kept + [new], key=lambda t: t[0]), found[2],
                  fresh, place, emit)


def _split_dim(src, dst) -> Optional[int]:
  """k if ``dst`` is ``src`` with dim k split in two (major, minor)."""
  if len(dst) != len(src) + 1:
    return None
  for k in range(len(src)):
    if tuple(src[:k]) == tuple(dst[:k]) and tuple(src[k + 1:]) == tuple(dst[k + 2:]) \
        and dst[k] * dst[k + 1] == src[k]:
      return k
  return None


def _is_reshape(op: Optional[ir.Op]) -> bool:
  """A reshape, or a broadcast that only inserts unit dims (canonicalize.py's
  spelling of such a reshape)."""
  return op is not None and len(op.operands) == 1 and (
      op.name == "reshape" or only_unit_dims_change(op.name, op.attrs, op.operands[0].type,
                                                    op.results[0].type))


def _slice(module, fresh, x: ir.Value, starts, limits, location) -> ir.Op:
  """A fresh unit-stride slice of x from ``starts`` to ``limits``."""
  return fresh(module, "slice", [x], {"start_indices": tuple(starts),
                                      "limit_indices": tuple(limits),
                                      "strides": (1,) * x.type.rank},
               [b - a for a, b in zip(starts, limits)], x.type.dtype, location)


def _sliced(module, graph, fresh, place, x: ir.Value, starts, limits, location) -> ir.Value:
  """slice(x) in normal form, made once per canonicalization of ``graph``: a
  row read back through a buffer's history of writes reaches the same
  earlier slices by many paths (a select per step and per rank)."""
  memo = getattr(graph, "slices", None)
  key = (x.id, tuple(starts), tuple(limits))
  if memo is not None and key in memo:
    return memo[key]
  value = place(_slice(module, fresh, x, starts, limits, location))
  if memo is not None:
    memo[key] = value
  return value


def slice_of_split_reshape(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """slice(reshape(x)), the reshape splitting x's dim k into (m, n) and the
  slice taking rows [a, b) of the m only -> reshape(slice(x, rows [a*n, b*n)))
  (``x.reshape(m, n, ...)[i]``: a batch's microbatch i)."""
  if op.name != "slice" or not _is_reshape(op.operands[0].producer):
    return None
  r = op.operands[0]
  x = r.producer.operands[0]
  k = _split_dim(x.shape, r.shape)
  start, limit, strides = (tuple(op.attrs[a]) for a in ("start_indices", "limit_indices",
                                                        "strides"))
  if k is None or set(strides) != {1}:
    return None
  if any((start[d], limit[d]) != (0, r.shape[d]) for d in range(len(r.shape)) if d != k):
    return None
  n = r.shape[k + 1]
  rows = _slice(module, fresh, x, [start[k] * n if d == k else 0 for d in range(x.type.rank)],
                [limit[k] * n if d == k else m for d, m in enumerate(x.shape)], op.location)
  return emit(module, graph, op, "reshape", [place(rows)], {})


def _of_the_rank_alone(v: ir.Value, limit: int = 64) -> bool:
  """Is ``v`` computed from the partition id and constants only (a few ops)?"""
  seen, stack, rank = set(), [v], False
  while stack:
    u = stack.pop()
    if u.id in seen:
      continue
    seen.add(u.id)
    p = u.producer
    if p is None or p.regions or len(seen) > limit:
      return False
    rank |= p.name in ("partition_id", "replica_id")
    stack.extend(p.operands)
  return rank


def dynamic_slice_of_split_reshape(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """dynamic_slice(reshape(x), .., i, j, ..), the reshape splitting x's dim k
  into (m, n) and the window taking s of the m whole n
  -> reshape(dynamic_slice(x, .., clamp(0, i, m - s) * n, ..)): the same
  elements in the same order (``x.reshape(ranks, -1)[axis_index]``, each
  rank reading its own rows).  ``i`` is clamped first as the slice clamps
  it, so the product stays within x's dim, which must fit the index type.

  Only where ``i`` is computed from the rank alone: a pipeline's row of a
  stage's buffer at step t - s keeps its spelling, which ``rank_cases.py``
  reads."""
  if op.name != "dynamic_slice" or not _is_reshape(op.operands[0].producer):
    return None
  r, *starts = op.operands
  x = r.producer.operands[0]
  k = _split_dim(x.shape, r.shape)
  sizes = tuple(op.attrs["slice_sizes"])
  if k is None or sizes[k + 1] != r.shape[k + 1] or not _of_the_rank_alone(starts[k]):
    return None
  dtype = starts[k].type.dtype
  bounds = reference.type_bounds(dtype)
  if not reference.is_integer_type(dtype) or bounds is None or x.shape[k] > bounds[1]:
    return None
  m, n, s = r.shape[k], r.shape[k + 1], sizes[k]
  cut = lambda value: constant(module, fresh, place, value, dtype, op.location)
  row = place(fresh(module, "clamp", [cut(0), starts[k], cut(m - s)], {}, (), dtype,
                    op.location))
  start = place(fresh(module, "multiply", [row, cut(n)], {}, (), dtype, op.location))
  window = sizes[:k] + (s * n,) + sizes[k + 2:]
  rows = place(fresh(module, "dynamic_slice", [x, *starts[:k], start, *starts[k + 2:]],
                     {"slice_sizes": window}, window, x.type.dtype, op.location))
  return emit(module, graph, op, "reshape", [rows], {})


def reshape_of_concatenation(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """reshape(concat_k(xs)) merging dims k and k+1 -> concat_k of each x merged
  alike (the microbatches' outputs put back into one batch)."""
  if op.name != "reshape" or op.operands[0].producer is None \
      or op.operands[0].producer.name != "concatenate":
    return None
  c = op.operands[0]
  k = c.producer.attrs["dimension"]
  if _split_dim(op.results[0].shape, c.shape) != k:
    return None
  parts = []
  for x in c.producer.operands:
    shape = list(x.shape[:k]) + [x.shape[k] * x.shape[k + 1]] + list(x.shape[k + 2:])
    parts.append(place(fresh(module, "reshape", [x], {}, shape, x.type.dtype, op.location)))
  return emit(module, graph, op, "concatenate", parts, {"dimension": k})


def _gather_fields(op: ir.Op) -> Optional[tuple]:
  """(operand, index, dimension numbers, slice sizes, start index map) of a
  gather; None for any other op."""
  if op.name != "gather" or len(op.operands) != 2:
    return None
  x, index = op.operands
  dn = dimension_numbers(op.attrs["dimension_numbers"])
  return x, index, dn, tuple(op.attrs["slice_sizes"]), tuple(dn.get("start_index_map", ()))


def constant(module, fresh, place, value: int, dtype: str, location, shape=()) -> ir.Value:
  """A fresh constant of ``shape`` filled with ``value``, placed."""
  return place(fresh(module, "constant", [], {"value": reference.constant_array(
      np.full(shape, value), dtype)}, shape, dtype, location))


def gather_one_window(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """gather of one window at a constant start -> reshape(slice) (the
  transpose of ``x.at[i].set(u)`` reads the window's cotangent so)."""
  fields = _gather_fields(op)
  if fields is None:
    return None
  x, index, dn, sizes, start_map = fields
  collapsed = tuple(dn.get("collapsed_slice_dims", ()))
  at = splat_value(index)
  if dn.get("operand_batching_dims") or at is None or len(start_map) != 1 \
      or index.type.rank != 1 or dn["index_vector_dim"] != 0 \
      or tuple(dn.get("offset_dims", ())) != tuple(range(x.type.rank - len(collapsed))):
    return None
  k = start_map[0]
  start = min(max(int(at), 0), x.shape[k] - sizes[k])  # gather clamps the window in
  window = _slice(module, fresh, x, [start if d == k else 0 for d in range(x.type.rank)],
                  [start + sizes[k] if d == k else n for d, n in enumerate(sizes)], op.location)
  return emit(module, graph, op, "reshape", [place(window)], {})


def gather_of_one_window(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """gather of one window at a traced start -> reshape(dynamic_slice): the
  index holds one start vector (its other dims are unit dims), and each
  batching dim has one row.  A ``dynamic_slice`` vmapped over a dim split
  into one row per rank gathers so (each pipeline stage picking its repeat's
  weights, MaxText's ``vmap_parallel_gather``).  Both ops clamp the window
  into the operand alike, and every dim the window drops has size one, so the
  window's elements come in the same order.  (StableHLO's verifier asks
  for sorted offset dims and no start on a batching dim; HLO text is not
  verified so, and is checked here.)"""
  fields = _gather_fields(op)
  if fields is None:
    return None
  x, index, dn, sizes, start_map = fields
  batching = tuple(dn.get("operand_batching_dims", ()))
  dropped = tuple(dn.get("collapsed_slice_dims", ())) + batching
  vector_dim = dn["index_vector_dim"]
  vector = index.shape[vector_dim] if vector_dim < index.type.rank else 1
  offset_dims = tuple(dn.get("offset_dims", ()))
  if splat_value(index) is not None or vector != len(start_map) \
      or any(n != 1 for d, n in enumerate(index.shape) if d != vector_dim) \
      or any(sizes[d] != 1 for d in dropped) \
      or offset_dims != tuple(sorted(offset_dims)) or set(start_map) & set(batching) \
      or not reference.is_integer_type(index.type.dtype):
    return None  # (a constant start: gather_one_window)
  dtype = index.type.dtype
  starts = []
  for d in range(x.type.rank):
    if d not in start_map:
      starts.append(constant(module, fresh, place, 0, dtype, op.location))
      continue
    j = start_map.index(d)
    entry = index
    if vector_dim < index.type.rank:
      entry = place(_slice(module, fresh, index,
                           [j if e == vector_dim else 0 for e in range(index.type.rank)],
                           [j + 1 if e == vector_dim else 1 for e in range(index.type.rank)],
                           op.location))
    starts.append(place(fresh(module, "reshape", [entry], {}, (), dtype, op.location)))
  window = place(fresh(module, "dynamic_slice", [x, *starts], {"slice_sizes": sizes},
                       sizes, x.type.dtype, op.location))
  return emit(module, graph, op, "reshape", [window], {})


def slice_past_a_set(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """slice(x.at[i].set(u)) of rows the set does not touch -> slice(x) (the
  cotangent of a buffer, its rows read one by one as each is zeroed); of
  exactly the rows it wrote -> slice(u) (a stage's saved input read back)."""
  if op.name != "slice" or op.operands[0].producer is None \
      or op.operands[0].producer.name not in ("scatter", "dynamic_update_slice"):
    return None
  written = _set_window(op.operands[0].producer)
  if written is None:
    return None
  k, lo, hi, x, update = written
  start, limit = op.attrs["start_indices"], op.attrs["limit_indices"]
  if set(op.attrs.get("strides") or (1,)) != {1}:
    return None
  if (start[k], limit[k]) == (lo, hi):
    rows = _window(module, fresh, place, op, update, x, k, lo, hi)
    return _sliced(module, graph, fresh, place, rows,
                   [0 if d == k else a for d, a in enumerate(start)],
                   [hi - lo if d == k else b for d, b in enumerate(limit)], op.location)
  if start[k] < hi and lo < limit[k]:
    return None  # reads a row the set wrote, and others
  return _sliced(module, graph, fresh, place, x, start, limit, op.location)


def slice_of_slabs(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """slice(concat_k(xs)) (or of a zero pad) of rows inside one slab -> a
  slice of that slab; of rows only the padding holds -> zeros."""
  if op.name != "slice" or set(op.attrs.get("strides") or (1,)) != {1}:
    return None
  found = slabs_of(op.operands[0])
  if found is None:
    return None
  k, slabs, zero = found
  start, limit = op.attrs["start_indices"], op.attrs["limit_indices"]
  for a, b, x in slabs:
    if a <= start[k] and limit[k] <= b:
      return _sliced(module, graph, fresh, place, x,
                     [s - a if d == k else s for d, s in enumerate(start)],
                     [e - a if d == k else e for d, e in enumerate(limit)], op.location)
  if zero is not None and all(limit[k] <= a or b <= start[k] for a, b, _ in slabs):
    return emit(module, graph, op, "broadcast_in_dim", [zero], {"broadcast_dimensions": ()})
  return None


def slice_of_select(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """slice(select(p, a, b)), p one flag for every element -> select(p,
  slice(a), slice(b)): rows read from a buffer some ranks wrote (a pipeline
  stage's saved inputs) are read from each branch."""
  if op.name != "slice" or op.operands[0].producer is None \
      or op.operands[0].producer.name != "select":
    return None
  pred, a, b = op.operands[0].producer.operands
  shape = op.results[0].shape
  p = _spread_scalar(module, fresh, place, pred, shape, op.location)
  if p is None or splat_value(pred) is not None:
    return None
  if set(op.attrs.get("strides") or (1,)) != {1}:
    return None
  sliced = [_sliced(module, graph, fresh, place, v, op.attrs["start_indices"],
                    op.attrs["limit_indices"], op.location) for v in (a, b)]
  return emit(module, graph, op, "select", [p, *sliced], {})


def unit_reshape_of_select(module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
  """reshape(select(p, a, b)) dropping or inserting unit dims, p one flag for
  every element -> select(p, reshape(a), reshape(b)): a chunk's weights read
  at a row computed from the stage (rank_cases.py: a select over slices of
  the stack, per rank) squeezed to the layer's shape are the select of the
  squeezed rows, each the value the sequential rows relate to."""
  if op.name != "reshape" or op.operands[0].producer is None \
      or op.operands[0].producer.name != "select":
    return None
  if not only_unit_dims_change("reshape", {}, op.operands[0].type, op.results[0].type):
    return None
  pred, a, b = op.operands[0].producer.operands
  shape = op.results[0].shape
  if splat_value(pred) is not None or not _rows_of_a_parameter(op.operands[0]):
    return None
  p = _spread_scalar(module, fresh, place, pred, shape, op.location)  # (a flag: checked above)
  reshaped = [place(fresh(module, "reshape", [v], {}, list(shape), v.type.dtype, op.location))
              for v in (a, b)]
  return emit(module, graph, op, "select", [p, *reshaped], {})


def _rows_of_a_parameter(v: ir.Value, depth: int = 4) -> bool:
  """``v`` is a static slice of a parameter (or of one with unit dims added
  or dropped: GSPMD's stage dim of a stack vmapped over the stages), or a
  select on a flag between such slices: a parameter read at a row computed
  from the rank."""
  op = v.producer
  if op is None or depth == 0:
    return False
  if op.name == "slice":
    x = op.operands[0]
    while x.producer is not None and only_unit_dims_change(
        x.producer.name, x.producer.attrs, x.producer.operands[0].type, x.type):
      x = x.producer.operands[0]
    return x.producer is None
  return op.name == "select" and scalar_of_broadcast(op.operands[0]) is not None and all(
      _rows_of_a_parameter(x, depth - 1) for x in op.operands[1:])
