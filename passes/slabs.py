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

from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.terms import splat_value

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
  concatenation (padded if it does not cover the dim).  ``fresh``, ``place``
  and ``emit`` are the canonicalizer's op builders."""
  if op.name != "add" or len(op.operands) != 2:
    return None
  a, b = (slabs_of(v) for v in op.operands)
  if a is None or b is None or a[0] != b[0]:
    return None
  k = a[0]
  zero = a[2] if a[2] is not None else b[2]
  if zero is None:
    return None  # two concatenations: elementwise already, nothing gained
  slabs = merged(a[1], b[1])
  if slabs is None or any(s1 != e0 for (_, e0, _), (s1, _, _) in zip(slabs, slabs[1:])):
    return None  # overlapping in part, or a gap between slabs
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
  rank = len(shape)
  pads = {"edge_padding_low": tuple(lo if d == k else 0 for d in range(rank)),
          "edge_padding_high": tuple(hi if d == k else 0 for d in range(rank)),
          "interior_padding": (0,) * rank}
  return emit(module, graph, op, "pad", [body, zero], pads)
