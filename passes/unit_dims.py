"""Local ops on tiles with size-1 dims, as the per-device program spells them.

A tile with one row per device (local batch 1, one local head) has unit dims
that jax and XLA squeeze, keep or re-insert differently on the device
(``reshape [1,16,1] -> [16]`` where the sequential program, locally, has
``-> [1,16]``; ``reduce [1,16,32] over dim 1 -> [1,32]`` where it has ``over
dims 0,1 -> [32]``).  So a relation may name a per-device value whose shape
equals the tile's *up to unit dims*: the same elements in the same order, the
tile up to a unit-dim reshape.

``squeezed_variants`` spells a lemma's local op on such values: the same op
on operands with other unit dims, its dimension attributes renumbered, its
result with or without unit dims.  Every variant computes the same elements,
so a hash-cons hit is as good as for the proposed op.

``jax.vmap`` over a dim each device holds one row of (GSPMD's pipeline,
its stages' layers vmapped over the stage dim) puts that unit dim in front of
every value of the stage, and batches each op over it: a dot gains a batch
dim, a broadcast a leading dim.  Those are variants too (``_vmapped_variants``,
jax's batching rules for a batch dim in front).
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

from graphguard_hlo import ir
from graphguard_hlo.passes.lemmas import ELEMENTWISE


def squeeze(t: ir.TensorType) -> ir.TensorType:
  return ir.TensorType(tuple(d for d in t.shape if d != 1), t.dtype)


def only_unit_dims_change(name: str, attrs: dict, operand_type: ir.TensorType,
                          result_type: ir.TensorType) -> bool:
  """A reshape, or a broadcast that stretches nothing and keeps dim order, that
  only inserts or drops unit dims: every element stays in place."""
  if name not in ("reshape", "broadcast_in_dim") or \
      squeeze(operand_type).shape != squeeze(result_type).shape:
    return False
  dims = list(attrs.get("broadcast_dimensions", ()))
  return name == "reshape" or dims == sorted(dims)


def _remap(t: ir.TensorType, c: ir.TensorType) -> dict[int, int]:
  """t's non-unit dims to the same (k-th non-unit) dims of c."""
  tn = [i for i, d in enumerate(t.shape) if d != 1]
  cn = [j for j, d in enumerate(c.shape) if d != 1]
  return dict(zip(tn, cn))


def _same_up_to_units(t: ir.TensorType, c: Optional[ir.TensorType]) -> bool:
  return c is not None and squeeze(t).shape == squeeze(c).shape


def squeezed_variants(name: str, attrs: dict, operand_types: list[ir.TensorType],
                      child_types: list[Optional[ir.TensorType]], result_type: ir.TensorType
                      ) -> Iterator[tuple[dict, ir.TensorType]]:
  """(attrs, result type) of equivalent local ops on values equal up to unit dims."""
  yield from _unit_variants(name, attrs, operand_types, child_types, result_type)
  yield from _vmapped_variants(name, attrs, operand_types, child_types, result_type)


def _unit_variants(name: str, attrs: dict, operand_types: list[ir.TensorType],
                   child_types: list[Optional[ir.TensorType]], result_type: ir.TensorType
                   ) -> Iterator[tuple[dict, ir.TensorType]]:
  if not all(_same_up_to_units(t, c) for t, c in zip(operand_types, child_types)):
    return
  results = [result_type] + ([squeeze(result_type)] if squeeze(result_type) != result_type
                             else [])
  if name == "reshape":
    for r in results:
      yield attrs, r
  elif name in ELEMENTWISE:
    if len(set(child_types)) == 1:
      c = child_types[0]
      yield attrs, ir.TensorType(c.shape, result_type.dtype)
  elif name == "broadcast_in_dim":
    t, c = operand_types[0], child_types[0]
    m = _remap(t, c)
    inverse = {j: i for i, j in m.items()}
    mapped = {j: attrs["broadcast_dimensions"][i] for j, i in inverse.items()}
    for dims in _unit_dim_targets(c, mapped, result_type):
      yield {"broadcast_dimensions": dims}, result_type
    if squeeze(c) != c:
      return  # (its squeezed result would need a choice too)
    dims = tuple(mapped[j] for j in range(c.rank))
    if squeeze(result_type) != result_type:
      pos = _remap(result_type, squeeze(result_type))
      if all(d in pos for d in dims):
        yield {"broadcast_dimensions": tuple(pos[d] for d in dims)}, squeeze(result_type)
  elif name == "reduce" and len(operand_types) == 2:
    t, c = operand_types[0], child_types[0]
    m = _remap(t, c)
    dims = tuple(sorted(m[d] for d in attrs["dimensions"] if d in m))
    units = tuple(j for j, s in enumerate(c.shape) if s == 1)
    # Reducing unit dims too only drops them from the result.
    with_units = tuple(sorted(set(dims) | set(units)))
    for variant in [dims] + ([with_units] if with_units != dims else []):
      shape = tuple(s for j, s in enumerate(c.shape) if j not in variant)
      yield {**attrs, "dimensions": variant}, ir.TensorType(shape, result_type.dtype)
  elif name == "dot_general":
    yield from _dot(attrs, operand_types, child_types, result_type)
  elif name == "transpose":
    yield from _transpose(attrs, operand_types[0], child_types[0], result_type)


# Leading unit dims a broadcast's result may gain under vmap (nested vmaps: 2).
_MAX_BATCH_DIMS = 2


def _vmapped_variants(name: str, attrs: dict, operand_types, child_types, result_type
                      ) -> Iterator[tuple[dict, ir.TensorType]]:
  """The op batched over k leading unit dims of every operand but a scalar:
  ``jax.vmap`` over a dim split to one row per device (GSPMD's pipeline
  stages) keeps that unit dim in front of every value of a stage, where the
  sequential op has none.  What is behind the k dims may itself be the tile
  up to unit dims (a stage's row of a stack): the op's variants on it,
  batched."""
  if not all(c is not None for c in child_types):
    return
  if name == "broadcast_in_dim":
    # An unbatched operand broadcast to a batched result (a causal mask that
    # selects among a stage's scores): the batch dims only in the result.
    variants = [(attrs, result_type)] * (child_types[0] == operand_types[0]) + list(
        _unit_variants(name, attrs, operand_types, child_types, result_type))
    for k in range(1, _MAX_BATCH_DIMS + 1):
      for a, r in variants:
        yield ({"broadcast_dimensions": tuple(d + k for d in a["broadcast_dimensions"])},
               ir.TensorType((1,) * k + tuple(r.shape), r.dtype))
  batched = [c for t, c in zip(operand_types, child_types) if t.rank]
  if not batched:
    return
  most = min(next((j for j, n in enumerate(c.shape) if n != 1), c.rank) for c in batched)
  for k in range(1, most + 1):
    inner = [ir.TensorType(c.shape[k:], c.dtype) if t.rank else c
             for t, c in zip(operand_types, child_types)]
    variants = list(_unit_variants(name, attrs, operand_types, inner, result_type))
    if list(inner) == list(operand_types):
      variants.insert(0, (attrs, result_type))
    for a, r in variants:
      new = _batched(name, a, k)
      if new is not None:
        yield new, ir.TensorType((1,) * k + tuple(r.shape), r.dtype)


def _batched(name: str, attrs: dict, k: int) -> Optional[dict]:
  """``attrs`` of the op batched over k new leading dims (jax's batching
  rules, for a batch dim in front); None for an op not batched here."""
  front, shift = tuple(range(k)), lambda dims: tuple(d + k for d in dims)
  if name in ELEMENTWISE or name in ("reshape", "select", "compare", "convert", "clamp"):
    return attrs
  if name == "broadcast_in_dim":
    return {**attrs, "broadcast_dimensions": front + shift(attrs["broadcast_dimensions"])}
  if name == "transpose":
    return {**attrs, "permutation": front + shift(attrs["permutation"])}
  if name == "concatenate":
    return {**attrs, "dimension": attrs["dimension"] + k}
  if name == "reduce":
    return {**attrs, "dimensions": shift(attrs["dimensions"])}
  if name == "slice":
    strides = attrs.get("strides") or (1,) * len(attrs["start_indices"])
    return {**attrs, "start_indices": (0,) * k + tuple(attrs["start_indices"]),
            "limit_indices": (1,) * k + tuple(attrs["limit_indices"]),
            "strides": (1,) * k + tuple(strides)}
  if name == "pad":
    return {**attrs, **{key: (0,) * k + tuple(attrs[key]) for key in
                        ("edge_padding_low", "edge_padding_high", "interior_padding")}}
  if name == "dot_general":
    return {**attrs, "lhs_batch": front + shift(attrs["lhs_batch"]),
            "rhs_batch": front + shift(attrs["rhs_batch"]),
            "lhs_contract": shift(attrs["lhs_contract"]),
            "rhs_contract": shift(attrs["rhs_contract"])}
  return None


def _unit_dim_targets(c: ir.TensorType, mapped: dict[int, int], result_type: ir.TensorType
                      ) -> Iterator[tuple[int, ...]]:
  """broadcast_dimensions for operand ``c``: its non-unit dims go where
  ``mapped`` says; each unit dim to a unit dim of the result, in increasing
  order (the device's canonical broadcasts stretch no unit dims, and jax and
  XLA keep broadcast dims increasing)."""
  units = [j for j in range(c.rank) if j not in mapped]
  if not units:
    yield tuple(mapped[j] for j in range(c.rank))
    return
  free = [d for d, n in enumerate(result_type.shape) if n == 1 and d not in mapped.values()]
  for targets in itertools.combinations(free, len(units)):
    full = dict(mapped)
    full.update(zip(units, targets))
    dims = tuple(full[j] for j in range(c.rank))
    if list(dims) == sorted(dims):
      yield dims


def _dot(attrs, operand_types, child_types, result_type):
  lt, rt = operand_types
  lc, rc = child_types
  lm, rm = _remap(lt, lc), _remap(rt, rc)
  new = {"lhs_batch": [], "rhs_batch": [], "lhs_contract": [], "rhs_contract": []}
  for side_l, side_r in (("lhs_batch", "rhs_batch"), ("lhs_contract", "rhs_contract")):
    for i, j in zip(attrs[side_l], attrs[side_r]):
      if i in lm and j in rm:
        new[side_l].append(lm[i])
        new[side_r].append(rm[j])
      elif (i in lm) != (j in rm):
        return
  # Unit dims of the device's operands that pair with nothing stay free dims.
  out = {k: tuple(v) for k, v in new.items()}
  lfree = [j for j in range(lc.rank) if j not in out["lhs_batch"] + out["lhs_contract"]]
  rfree = [j for j in range(rc.rank) if j not in out["rhs_batch"] + out["rhs_contract"]]
  shape = (tuple(lc.shape[j] for j in out["lhs_batch"]) + tuple(lc.shape[j] for j in lfree)
           + tuple(rc.shape[j] for j in rfree))
  if squeeze(ir.TensorType(shape, "f32")).shape != squeeze(result_type).shape:
    return
  yield out, ir.TensorType(shape, result_type.dtype)


def _transpose(attrs, t: ir.TensorType, c: ir.TensorType, result_type):
  """The transpose moving ``c``'s non-unit dims as ``attrs`` moves ``t``'s:
  first with ``c``'s unit dims where the result has its own (XLA's transpose
  of a tile whose heads dim is 1 on each rank), then with them kept in place
  (a stage's unit dim in front, where the sequential tile has a microbatch's
  unit dim elsewhere)."""
  m = _remap(t, c)
  moved = [m[d] for d in attrs["permutation"] if d in m]
  units = [j for j in range(c.rank) if c.shape[j] == 1]
  if result_type.rank == c.rank and result_type.shape.count(1) == len(units):
    unit_it, moved_it = iter(units), iter(moved)
    perm = tuple(next(unit_it) if n == 1 else next(moved_it) for n in result_type.shape)
    if tuple(c.shape[j] for j in perm) == result_type.shape:
      yield {**attrs, "permutation": perm}, result_type
  moved_it = iter(moved)
  perm = tuple(j if c.shape[j] == 1 else next(moved_it) for j in range(c.rank))
  yield {**attrs, "permutation": perm}, ir.TensorType(tuple(c.shape[j] for j in perm),
                                                      result_type.dtype)


def unit_dim_lifts(layout, tile: tuple[int, ...], held: tuple[int, ...]
                   ) -> Iterator[tuple[tuple[Optional[int], ...], object]]:
  """Ways to read a relation to a value ``held`` (the tile up to unit dims) as
  one over ``held``'s own dims: (where each tile dim sits in ``held``, None for
  a dropped unit dim no axis splits; the layout over ``held``'s dims).

  Order-preserving only: the tile's non-unit dims go to equal dims of
  ``held``, its split unit dims (one index per rank) to unit dims of
  ``held``, in the same order, and every non-unit dim of ``held`` is taken.
  The sequential tensor read this way only gains or loses unit dims."""
  significant = [i for i in range(len(tile)) if tile[i] != 1 or layout.dims[i]]

  def place(k: int, start: int):
    if k == len(significant):
      if all(held[j] == 1 for j in range(start, len(held))):
        yield {}
      return
    i = significant[k]
    for j in range(start, len(held)):
      if held[j] == tile[i]:
        for rest in place(k + 1, j + 1):
          yield {i: j, **rest}
      if held[j] != 1:
        return  # a non-unit dim of ``held`` nobody takes

  for where in place(0, 0):
    dims = [()] * len(held)
    for i, j in where.items():
      dims[j] = layout.dims[i]
    yield tuple(where.get(i) for i in range(len(tile))), layout.with_(dims=tuple(dims))


def lower_lifted(layout, where: tuple[Optional[int], ...]):
  """A layout over ``held``'s dims back over the tile's dims; None if it
  splits a dim the tile does not have."""
  mapped = {j for j in where if j is not None}
  if any(axes for j, axes in enumerate(layout.dims) if j not in mapped):
    return None
  return layout.with_(dims=tuple(() if j is None else layout.dims[j] for j in where))
