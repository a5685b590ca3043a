"""Canonical forms for shape-only ops, applied to both programs alike.

XLA's partitioner spells the same broadcast differently from jax
(``reshape [16]->[1,16]; broadcast; reshape [1,16]->[16]; broadcast`` where
jax wrote ``broadcast [64]->[1,64]; broadcast [1,64]->[16,64]``).  Like MLIR's
canonicalizer, a few local patterns rewrite both graphs to one normal form
before anything is compared:

  reshape(x) to x's shape                 -> x        (also broadcast, convert, copy, slice)
  reduce_precision(x) to x's own format   -> x
  reshape that only inserts unit dims     -> broadcast_in_dim(x)
  reshape(reshape(x))                     -> reshape(x)
  reshape of a unit-dims-only broadcast   -> x, when the shape is x's
  broadcast(broadcast(x, d1), d2)         -> broadcast(x, d2 . d1)
  transpose(transpose(x, p1), p2)         -> transpose(x, p1 . p2), or x
  transpose(all_reduce(transpose(x)))     -> all_reduce(transpose(x)) as above
  broadcast stretching unit dims          -> broadcast(reshape-squeeze(x))
  iota of rank > 1 along k                -> broadcast(iota along k only)
  x + 0                                   -> x
  broadcast(x) + broadcast(scalar), ints  -> broadcast(x + broadcast(scalar))
  clamp(a, broadcast(x), b), units only   -> broadcast(clamp(a', x, b'))
  select(p, true, false)                  -> p
  select(p, a, b), p constant everywhere  -> a or b
  chlo.square(x)                          -> x * x
  select(scalar p, x, y), x not scalar    -> select(broadcast(p), x, y)
  transpose moving only unit dims         -> reshape
  transpose(all_to_all(x, k -> k), p)     -> reshape(transpose(all_to_all(x, k -> c), p))
  all_to_all(reshape(v), k -> c)          -> reshape(all_to_all(v, s -> c'))
  reduce over size-1 dims (identity init) -> reshape
  pad adding no room                      -> its operand
  reverse along size-1 dims only          -> its operand
  add of zero pads into adjacent slabs    -> pad(concat(..)) (slabs.py)
  x.at[i].set(u), i constant, x slabs     -> pad(concat(..)) (slabs.py)
  reshape(x)[i], the reshape splitting k  -> reshape(x[i*n:(i+1)*n]) (slabs.py)
     (i traced too: a dynamic_slice at clamp(i) * n)
  reshape(concat_k) merging k and k + 1   -> concat_k(reshapes) (slabs.py)
  gather of one window, constant start    -> reshape(slice) (slabs.py)
  slice(x.at[i].set(u)) missing row i     -> slice(x) (slabs.py)
  dot(transpose(x), y), free dims in order -> dot(x, y)            (rings only)
  dot(a, b), b first by its dims          -> transpose(dot(b, a))   (rings only)
  the online softmax, telescoped          (online_softmax.py; rings only)
  (p / l) @ v                             -> (p @ v) / l            (rings only)
  a softmax's backward, flash-style       (softmax_backward.py; rings only)
  optimization_barrier(x, y, ...)         -> x, y, ...  (jax.checkpoint's fence
                                             orders XLA's scheduling; on values
                                             it is the identity)

Each is an identity of the ops' semantics (tested in tests/test_canonicalize.py).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from graphguard_hlo import ir, reference
from graphguard_hlo.passes import online_softmax, slabs, softmax_backward
from graphguard_hlo.passes.terms import EFFECTS, scalar_of_broadcast
from graphguard_hlo.passes.unit_dims import only_unit_dims_change

Pattern = Callable[[ir.Module, ir.Graph, ir.Op], Optional[ir.Value]]


def _identity_shape_op(module, graph, op) -> Optional[ir.Value]:
  # (A sharding constraint only annotates: a model with them, lowered as the
  # sequential program, keeps them as ops.  jax pads a max pool's operand
  # for its gradient even when the padding is none.)
  if op.name == "pad" and not any(any(op.attrs[k]) for k in (
      "edge_padding_low", "edge_padding_high", "interior_padding")):
    return op.operands[0]
  if op.name == "reverse" and all(op.operands[0].type.shape[d] == 1
                                  for d in op.attrs["dimensions"]):
    return op.operands[0]  # (XLA folds a 1 x 1 kernel's flip in a gradient)
  if op.name in ("reshape", "broadcast_in_dim", "convert", "copy", "slice",
                 "sdy.sharding_constraint") and len(op.operands) == 1:
    x = op.operands[0]
    if x.type == op.results[0].type:
      if op.name != "broadcast_in_dim" or tuple(op.attrs["broadcast_dimensions"]) == tuple(
          range(x.type.rank)):
        return x
  return None


# (exponent, mantissa) bits of each float type: reduce_precision to these keeps
# every value (jax.checkpoint's policies mark a saved value with one).
_NATIVE_PRECISION = {"f32": (8, 23), "bf16": (8, 7), "f16": (5, 10), "f64": (11, 52)}


def _reduce_precision_to_own(module, graph, op) -> Optional[ir.Value]:
  if op.name == "reduce_precision" and len(op.operands) == 1 and \
      _NATIVE_PRECISION.get(op.operands[0].type.dtype) == (
          op.attrs.get("exponent_bits"), op.attrs.get("mantissa_bits")):
    return op.operands[0]
  return None


def _unit_insert_positions(src: tuple[int, ...], dst: tuple[int, ...]) -> Optional[tuple[int, ...]]:
  """Where src's dims land in dst if dst is src with unit dims inserted."""
  pos, j = [], 0
  for d in src:
    while j < len(dst) and dst[j] == 1 and d != 1:
      j += 1
    if j >= len(dst) or dst[j] != d:
      return None
    pos.append(j)
    j += 1
  if any(dst[k] != 1 for k in range(j, len(dst))):
    return None
  return tuple(pos)


def _reshape_inserting_units(module, graph, op) -> Optional[ir.Value]:
  if op.name != "reshape":
    return None
  x = op.operands[0]
  pos = _unit_insert_positions(x.shape, op.results[0].shape)
  if pos is None or len(op.results[0].shape) <= x.type.rank:
    return None
  return _emit(module, graph, op, "broadcast_in_dim", [x], {"broadcast_dimensions": pos})


def _reshape_of_reshape(module, graph, op) -> Optional[ir.Value]:
  if op.name != "reshape":
    return None
  x = op.operands[0]
  if x.producer is None or x.producer.name != "reshape":
    return None
  return _emit(module, graph, op, "reshape", [x.producer.operands[0]], {})


def _reshape_of_unit_broadcast(module, graph, op) -> Optional[ir.Value]:
  """reshape(broadcast(y) that only added unit dims) back to y's shape is y."""
  if op.name != "reshape":
    return None
  x = op.operands[0]
  p = x.producer
  if p is None or p.name != "broadcast_in_dim":
    return None
  y = p.operands[0]
  if y.type != op.results[0].type:
    return None
  # Wherever the broadcast put the units: [1, 3] -> [1, 1, 3] by dims (0, 2) or (1, 2).
  if not only_unit_dims_change(p.name, p.attrs, y.type, x.type):
    return None
  return y


def _broadcast_of_broadcast(module, graph, op) -> Optional[ir.Value]:
  if op.name != "broadcast_in_dim":
    return None
  x = op.operands[0]
  p = x.producer
  if p is None or p.name != "broadcast_in_dim":
    return None
  outer = op.attrs["broadcast_dimensions"]
  inner = p.attrs["broadcast_dimensions"]
  return _emit(module, graph, op, "broadcast_in_dim", [p.operands[0]],
               {"broadcast_dimensions": tuple(outer[d] for d in inner)})


def _transpose_of_transpose(module, graph, op) -> Optional[ir.Value]:
  """Autodiff transposes a transposed head back (the tied output embedding)."""
  if op.name != "transpose":
    return None
  inner = op.operands[0].producer
  if inner is None or inner.name != "transpose":
    return None
  outer_perm, inner_perm = op.attrs["permutation"], inner.attrs["permutation"]
  perm = tuple(inner_perm[p] for p in outer_perm)
  x = inner.operands[0]
  if perm == tuple(range(len(perm))):
    return x
  return _emit(module, graph, op, "transpose", [x], {"permutation": perm})


def moves_only_unit_dims(perm, shape) -> bool:
  """Does a transpose by ``perm`` keep the order of the non-unit dims (move no element)?"""
  kept = [d for d in perm if shape[d] != 1]
  return kept == sorted(kept)


def _transpose_of_unit_dims(module, graph, op) -> Optional[ir.Value]:
  """A transpose that keeps the order of the non-unit dims moves no element."""
  if op.name != "transpose":
    return None
  x = op.operands[0]
  perm = op.attrs["permutation"]
  if not moves_only_unit_dims(perm, x.shape) or tuple(perm) == tuple(range(x.type.rank)):
    return None
  return _emit(module, graph, op, "reshape", [x], {})


def _transpose_through_all_reduce(module, graph, op) -> Optional[ir.Value]:
  """T2(all_reduce(T1(x))) -> all_reduce(T2.T1(x)): an all-reduce combines ranks
  elementwise, so it commutes with a permutation of the elements; jax's
  transposes around a psum then meet (and cancel) as they do sequentially."""
  if op.name != "transpose":
    return None
  ar = op.operands[0].producer
  if ar is None or ar.name != "all_reduce" or len(ar.operands) != 1:
    return None
  inner = ar.operands[0].producer
  if inner is None or inner.name != "transpose":
    return None
  moved = ir.Op("transpose", [ar.operands[0]], dict(op.attrs), [], op.location)
  moved.results = [module.new_value(op.results[0].type, moved, 0)]
  x = _simplified_and_placed(module, graph, moved)
  reduced = ir.Op("all_reduce", [x], dict(ar.attrs), list(ar.regions), ar.location)
  reduced.results = [module.new_value(op.results[0].type, reduced, 0)]
  graph.ops_to_place.append(reduced)  # type: ignore[attr-defined]
  graph.known_ops.add(id(reduced))  # type: ignore[attr-defined]
  return reduced.results[0]


def _broadcast_expanding_units(module, graph, op) -> Optional[ir.Value]:
  """broadcast(x) that stretches unit dims of x -> broadcast(squeeze(x)).

  A stretched unit dim may be mapped to any output dim, so jax and XLA spell
  it differently; squeezing it first leaves one spelling.
  """
  if op.name != "broadcast_in_dim":
    return None
  x = op.operands[0]
  dims = op.attrs["broadcast_dimensions"]
  out = op.results[0].shape
  stretched = [i for i, d in enumerate(dims) if x.shape[i] == 1 and out[d] != 1]
  if not stretched:
    return None
  keep = [i for i in range(x.type.rank) if i not in stretched]
  squeezed_type = ir.TensorType(tuple(x.shape[i] for i in keep), x.type.dtype)
  squeeze = ir.Op("reshape", [x], {}, [], op.location)
  squeeze.results = [module.new_value(squeezed_type, squeeze, 0)]
  inner = _simplified_and_placed(module, graph, squeeze)
  return _emit(module, graph, op, "broadcast_in_dim", [inner],
               {"broadcast_dimensions": tuple(dims[i] for i in keep)})


def _simplified_and_placed(module, graph, op: ir.Op) -> ir.Value:
  """A helper op's value in normal form, every fresh op it became placed (a
  fresh op a pattern returns is not in the graph until someone places it)."""
  while True:
    result = _simplify(module, graph, op)
    if result is None:
      graph.ops_to_place.append(op)  # type: ignore[attr-defined]
      graph.known_ops.add(id(op))  # type: ignore[attr-defined]
      return op.results[0]
    producer = result.producer
    if producer is None or producer is op or id(producer) in graph.known_ops:  # type: ignore[attr-defined]
      return result
    op = producer  # fresh: simplify and place it in turn


def _iota_as_broadcast(module, graph, op) -> Optional[ir.Value]:
  """iota(shape, k) of rank > 1 -> broadcast(iota([shape[k]]), (k,)): XLA's spelling."""
  if op.name != "iota" or op.results[0].type.rank < 2:
    return None
  t = op.results[0].type
  k = op.attrs["iota_dimension"]
  line = ir.Op("iota", [], {"iota_dimension": 0}, [], op.location)
  line.results = [module.new_value(ir.TensorType((t.shape[k],), t.dtype), line, 0)]
  graph.ops_to_place.append(line)  # type: ignore[attr-defined]
  return _emit(module, graph, op, "broadcast_in_dim", [line.results[0]],
               {"broadcast_dimensions": (k,)})


def _add_zero(module, graph, op) -> Optional[ir.Value]:
  """x + 0 -> x (jax adds a zero offset to the causal mask's iota; XLA folds it)."""
  if op.name != "add" or len(op.operands) != 2:
    return None
  from graphguard_hlo.passes.terms import splat_value
  for x, zero in (op.operands, op.operands[::-1]):
    if splat_value(zero) == 0.0 and x.type == op.results[0].type:
      return x
  return None


# Integer types whose every value a float64 holds exactly (splat_value's type).
_EXACT_IN_FLOAT = {"i8": 8, "i16": 16, "i32": 32, "ui8": 8, "ui16": 16, "ui32": 32}


def _bitwise_identity(module, graph, op) -> Optional[ir.Value]:
  """and(x, all ones) -> x, or(x, 0) -> x, xor(x, 0) -> x, for integers.
  ``jax.random.key(seed)`` masks a 32-bit seed with 0xFFFFFFFF; XLA drops it."""
  if op.name not in ("and", "or", "xor") or len(op.operands) != 2:
    return None
  out = op.results[0].type
  bits = _EXACT_IN_FLOAT.get(out.dtype)
  if bits is None:
    return None
  from graphguard_hlo.passes.terms import splat_value
  identity = 0 if op.name != "and" else (-1 if out.dtype.startswith("i") else 2 ** bits - 1)
  for x, c in (op.operands, op.operands[::-1]):
    if c.type == out and x.type == out and splat_value(c) == identity:
      return x
  return None


def _dot_operand_order(module, graph, op) -> Optional[ir.Value]:
  """dot(a, b) -> transpose(dot(b, a)) when b comes first by (batch dims,
  contracting dims, rank): one order for the same product, whichever way
  jnp.einsum wrote it (``bhst,bthd->bshd`` is dot(v, p), ``->bhsd`` dot(p, v))."""
  if op.name != "dot_general" or len(op.operands) != 2:
    return None
  at = op.attrs
  a, b = op.operands
  key = lambda v, batch, contract: (tuple(batch), tuple(contract), v.type.rank)
  if key(b, at["rhs_batch"], at["rhs_contract"]) >= key(a, at["lhs_batch"], at["lhs_contract"]):
    return None
  n_batch = len(at["lhs_batch"])
  a_free, b_free = map(len, ir.dot_free_dims(at, a.type.rank, b.type.rank))
  swapped_attrs = {**at, "lhs_batch": at["rhs_batch"], "rhs_batch": at["lhs_batch"],
                   "lhs_contract": at["rhs_contract"], "rhs_contract": at["lhs_contract"]}
  out = op.results[0]
  # the swapped result: batch, b's free dims, a's free dims
  perm = tuple(range(n_batch)) + tuple(n_batch + b_free + i for i in range(a_free)) + tuple(
      n_batch + j for j in range(b_free))
  swapped_shape = [out.shape[k] for k in range(n_batch)] + [
      out.shape[n_batch + a_free + j] for j in range(b_free)] + [
      out.shape[n_batch + i] for i in range(a_free)]
  swapped = _fresh(module, "dot_general", [b, a], swapped_attrs, swapped_shape,
                   out.type.dtype, op.location)
  return _emit(module, graph, op, "transpose", [_simplified_and_placed(module, graph, swapped)],
               {"permutation": perm})


def _as_transpose(op: ir.Op) -> Optional[tuple[int, ...]]:
  """The permutation a transpose applies, or a reshape that only moves unit
  dims (a transpose of them, which ``_transpose_of_unit_dims`` spells as a
  reshape: where a device holds one head, [b, s, 1, d] -> [b, 1, s, d])."""
  if op.name == "transpose":
    return tuple(op.attrs["permutation"])
  if op.name != "reshape" or len(op.operands) != 1:
    return None
  src, dst = op.operands[0].shape, op.results[0].shape
  if len(src) != len(dst) or [n for n in src if n != 1] != [n for n in dst if n != 1]:
    return None
  units = iter(i for i, n in enumerate(src) if n == 1)
  others = iter(i for i, n in enumerate(src) if n != 1)
  return tuple(next(units) if n == 1 else next(others) for n in dst)


def _dot_of_transpose(module, graph, op) -> Optional[ir.Value]:
  """dot(transpose(x, p), y) -> dot(x, y), its dims renamed through p, when p
  keeps x's free dims in order (so the result's dims stay where they were);
  also through a reshape that only moves unit dims (``_as_transpose``).

  Autodiff of ``einsum("bhst,bthd->bshd", p, v)`` reads the output's
  cotangent transposed to [b, h, d, s]; a hand-written backward contracts
  the same cotangent laid out [b, h, s, d].  Only the dims' names differ."""
  if op.name != "dot_general" or len(op.operands) != 2:
    return None
  at = op.attrs
  for side, prefix in ((0, "lhs"), (1, "rhs")):
    t = op.operands[side].producer
    perm = None if t is None else _as_transpose(t)
    if perm is None:
      continue
    batch, contract = at[f"{prefix}_batch"], at[f"{prefix}_contract"]
    free = [perm[i] for i in range(len(perm)) if i not in batch and i not in contract]
    if free != sorted(free):
      continue
    operands = list(op.operands)
    operands[side] = t.operands[0]
    attrs = {**at, f"{prefix}_batch": tuple(perm[i] for i in batch),
             f"{prefix}_contract": tuple(perm[i] for i in contract)}
    return _emit(module, graph, op, "dot_general", operands, attrs)
  return None


def _offset_before_broadcast(module, graph, op) -> Optional[ir.Value]:
  """broadcast(x, d) + broadcast(c) -> broadcast(x + broadcast(c), d), c a scalar.

  A device's token positions are ``iota + r * n``; jax adds the offset after
  broadcasting the iota to the mask's shape, the sequential program has no
  offset at all.  Adding it first leaves the positions as one value, the tile
  of the sequential iota (``Transfer.offset_iotas``).  Integer index
  arithmetic only: floats keep the order they were written in."""
  if (op.name != "add" or len(op.operands) != 2
      or not reference.is_integer_type(op.results[0].type.dtype)):
    return None
  for b, c in (op.operands, op.operands[::-1]):
    bp, cp = b.producer, c.producer
    if bp is None or cp is None or bp.name != "broadcast_in_dim" or \
        cp.name != "broadcast_in_dim" or cp.operands[0].type.rank != 0 or \
        bp.operands[0].type.rank == 0:
      continue
    x = bp.operands[0]
    spread = _fresh(module, "broadcast_in_dim", [cp.operands[0]], {"broadcast_dimensions": ()},
                    x.shape, x.type.dtype, op.location)
    offset = _simplified_and_placed(module, graph, spread)
    added = _fresh(module, "add", [x, offset], {}, x.shape, x.type.dtype, op.location)
    moved = _simplified_and_placed(module, graph, added)
    return _emit(module, graph, op, "broadcast_in_dim", [moved], dict(bp.attrs))
  return None


def _clamp_before_unit_broadcast(module, graph, op) -> Optional[ir.Value]:
  """clamp(broadcast(a), broadcast(x, d), broadcast(b)) -> broadcast(clamp(a', x, b'), d)
  for one-element a, b and a broadcast d that only inserts unit dims.

  jax clamps a gather's indices after adding the index vector's unit dim (the
  gradient of ``take(..., mode="clip")``); a hand-written ``jnp.clip`` clamps
  the ids before.  Clamping first leaves one clamp of the ids in both."""
  if op.name != "clamp" or len(op.operands) != 3:
    return None
  lo, x, hi = (v.producer for v in op.operands)
  if x is None or x.name != "broadcast_in_dim" or \
      x.operands[0].type.rank == 0 or \
      math.prod(x.operands[0].shape) != math.prod(op.results[0].shape) or \
      any(b is None or b.name != "broadcast_in_dim" or math.prod(b.operands[0].shape) != 1
          for b in (lo, hi)):
    return None
  inner = x.operands[0]
  bounds = []
  for b in (lo, hi):
    scalar = b.operands[0]
    if scalar.type.rank:
      scalar = _simplified_and_placed(module, graph, _fresh(
          module, "reshape", [scalar], {}, (), scalar.type.dtype, op.location))
    bounds.append(_simplified_and_placed(module, graph, _fresh(
        module, "broadcast_in_dim", [scalar], {"broadcast_dimensions": ()}, inner.shape,
        inner.type.dtype, op.location)))
  clamped = _simplified_and_placed(module, graph, _fresh(
      module, "clamp", [bounds[0], inner, bounds[1]], {}, inner.shape, inner.type.dtype,
      op.location))
  return _emit(module, graph, op, "broadcast_in_dim", [clamped], dict(x.attrs))


def _select_of_true_false(module, graph, op) -> Optional[ir.Value]:
  """select(p, true, false) -> p: ``jnp.tril(ones)`` is the mask itself."""
  if op.name != "select" or op.results[0].type.dtype not in ("i1", "pred"):
    return None
  from graphguard_hlo.passes.terms import splat_value
  p, t, f = op.operands
  if p.type == op.results[0].type and splat_value(t) == 1.0 and splat_value(f) == 0.0:
    return p
  return None


def _nested_select_sharing_a_branch(module, graph, op) -> Optional[ir.Value]:
  """select(p, a, select(q, a, b)) -> select(p or q, a, b), and the three
  other ways a nested select on a flag shares a branch with its parent.  A
  buffer row read back through each step's writes is a select per step and
  per rank case (rank_cases.py), nearly all keeping the row as it was; one
  select per step is what its relations need to pass (they are capped per
  value)."""
  if op.name != "select":
    return None
  p, a, b = op.operands
  outer = scalar_of_broadcast(p)
  if outer is None:
    return None
  for inner_side, kept in ((b, a), (a, b)):
    inner = inner_side.producer
    if inner is None or inner.name != "select" or scalar_of_broadcast(inner.operands[0]) is None:
      continue
    q, c, d = inner.operands
    flag = scalar_of_broadcast(q)
    if kept is c or kept is d:
      other = d if kept is c else c
      if inner_side is b:  # select(p, a, select(q, ..)): a where p, or where q picks a
        q_picks_kept = flag if kept is c else _logical(module, graph, "not", [flag], op.location)
        combined = _logical(module, graph, "or", [outer, q_picks_kept], op.location)
        branches = [kept, other]
      else:  # select(p, select(q, ..), b): b where not p, or where q picks b
        q_picks_other = flag if other is c else _logical(module, graph, "not", [flag], op.location)
        combined = _logical(module, graph, "and", [outer, q_picks_other], op.location)
        branches = [other, kept]
      spread = _fresh(module, "broadcast_in_dim", [combined], {"broadcast_dimensions": ()},
                      op.results[0].shape, combined.type.dtype, op.location)
      return _emit(module, graph, op, "select",
                   [_simplified_and_placed(module, graph, spread), *branches], {})
  return None


def _logical(module, graph, name: str, operands, location) -> ir.Value:
  new = _fresh(module, name, operands, {}, (), operands[0].type.dtype, location)
  return _simplified_and_placed(module, graph, new)


_CONSTANT_FOLDABLE = {"constant", "broadcast_in_dim", "reshape", "convert", "compare", "and",
                      "or", "not", "reduce"}


def _constant_value(v: ir.Value, depth: int = 8, foldable=_CONSTANT_FOLDABLE):
  """``v``'s value if it is computed from constants alone by a few shape,
  compare and logic ops (jax's in-bounds checks of a constant index), the ops
  in ``foldable``; else None."""
  import numpy as np
  from graphguard_hlo.passes.collectives import reducer_kind
  op = v.producer
  if op is None or op.name not in foldable or depth == 0 or len(op.results) != 1:
    return None
  if op.name == "constant":
    value = op.attrs.get("value")
    return value if isinstance(value, np.ndarray) else None
  args = [_constant_value(x, depth - 1, foldable) for x in op.operands]
  if any(a is None for a in args):
    return None
  attrs = dict(op.attrs)
  if op.name == "reduce":
    if not op.regions or reducer_kind(op.regions[0]) is None:
      return None
    attrs["gg.reduction"] = reducer_kind(op.regions[0])
  try:
    return np.asarray(reference.evaluate(op.name, attrs, args, op.results[0].type))
  except (NotImplementedError, KeyError, ValueError, TypeError):
    return None


def _select_of_constant_predicate(module, graph, op) -> Optional[ir.Value]:
  """select(p, a, b) with p the same constant everywhere -> a or b (jax's
  transpose of ``x.at[i].set(u)`` checks a constant i is in bounds)."""
  if op.name != "select" or op.operands[1].type != op.results[0].type:
    return None
  import numpy as np
  p = _constant_value(op.operands[0])
  if p is None or p.size == 0 or not (np.all(p) or not np.any(p)):
    return None
  return op.operands[1] if np.all(p) else op.operands[2]


def _square_as_product(module, graph, op) -> Optional[ir.Value]:
  """chlo.square(x) -> x * x: ``jnp.square`` lowers to chlo's op, which XLA
  expands to a multiply (optax's global norm squares every gradient)."""
  if op.name != "chlo.square":
    return None
  x = op.operands[0]
  return _emit(module, graph, op, "multiply", [x, x], {})


def _select_of_scalar_predicate(module, graph, op) -> Optional[ir.Value]:
  """select(p, x, y) with a scalar p and tensors x, y -> select(broadcast(p), x, y):
  StableHLO allows the scalar (optax's clip selects every gradient on one
  flag), HLO does not, and XLA broadcasts it."""
  if op.name != "select" or op.operands[0].type.rank != 0 or op.results[0].type.rank == 0:
    return None
  p = op.operands[0]
  spread = _fresh(module, "broadcast_in_dim", [p], {"broadcast_dimensions": ()},
                  op.results[0].shape, p.type.dtype, op.location)
  return _emit(module, graph, op, "select",
               [_simplified_and_placed(module, graph, spread), *op.operands[1:]], {})


def _a2a_group_size(op: ir.Op) -> Optional[int]:
  n = op.attrs.get("split_count")
  if not n:
    groups = op.attrs.get("replica_groups")
    n = len(groups[0]) if groups is not None and len(groups) and len(groups[0]) else None
  return int(n) if n else None


def _fresh(module, name: str, operands, attrs: dict, shape, dtype: str, location) -> ir.Op:
  op = ir.Op(name, list(operands), attrs, [], location)
  op.results = [module.new_value(ir.TensorType(tuple(shape), dtype), op, 0)]
  return op


def _all_to_all_rank_dim_moved(module, graph, op) -> Optional[ir.Value]:
  """transpose(all_to_all(x, split k, concat k), p), one piece per rank along k
  -> reshape(transpose(all_to_all(x, split k, concat c), p)), c = p[p.index(k)+1].

  XLA's all-to-all splits and concatenates along one dim (HLO has no other
  kind): y_g[k = r] is rank r's piece g, and the transpose after it puts r
  right before dim c, where a reshape merges them.  Concatenating along c
  instead (r major in c, k left with size 1) lays the elements out in the
  same row-major order, so the reshape gives the same tensor; this is the
  split != concat form the transfer rules read."""
  if op.name != "transpose":
    return None
  a2a = op.operands[0].producer
  if a2a is None or a2a.name != "all_to_all" or len(a2a.operands) != 1 or \
      len(a2a.results) != 1:
    return None
  k = a2a.attrs.get("split_dimension")
  n = _a2a_group_size(a2a)
  x = a2a.operands[0]
  if k is None or a2a.attrs.get("concat_dimension") != k or not n or x.shape[k] != n:
    return None
  perm = list(op.attrs["permutation"])
  q = perm.index(k)
  if q + 1 >= len(perm):
    return None
  c = perm[q + 1]
  shape = list(x.shape)
  shape[k], shape[c] = 1, shape[c] * n
  moved = _fresh(module, "all_to_all", [x], {**a2a.attrs, "concat_dimension": c}, shape,
                 x.type.dtype, a2a.location)
  z = _simplified_and_placed(module, graph, moved)
  tz = _fresh(module, "transpose", [z], {"permutation": tuple(perm)},
              [z.shape[d] for d in perm], x.type.dtype, op.location)
  return _emit(module, graph, op, "reshape", [_simplified_and_placed(module, graph, tz)], {})


def _all_to_all_of_split_reshape(module, graph, op) -> Optional[ir.Value]:
  """all_to_all(reshape(v), split k, concat c) -> reshape(all_to_all(v, s, c')),
  when the reshape splits v's dim s into dims k.. of x with k the major one,
  and c is v's dim c' unchanged: piece g along k is one contiguous block of
  dim s, so splitting s itself moves the same elements in the same order."""
  if op.name != "all_to_all" or len(op.operands) != 1 or len(op.results) != 1:
    return None
  k, c = op.attrs.get("split_dimension"), op.attrs.get("concat_dimension")
  n = _a2a_group_size(op)
  rs = op.operands[0].producer
  if k is None or c is None or k == c or not n or rs is None or rs.name != "reshape":
    return None
  from graphguard_hlo.passes.lemmas import reshape_groups
  v, x = rs.operands[0], op.operands[0]
  groups = reshape_groups(v.shape, x.shape)
  if groups is None:
    return None
  split = next(((gi, gj) for gi, gj in groups if k in gj), None)
  concat = next(((gi, gj) for gi, gj in groups if c in gj), None)
  if split is None or concat is None or split is concat:
    return None
  # Unit dims ride along in either group; they hold one index and move nothing.
  big = lambda dims, shape: [d for d in dims if shape[d] != 1]
  s_dims, k_dims = big(split[0], v.shape), big(split[1], x.shape)
  if len(concat[0]) == len(concat[1]) == 1:
    c_dims, c_group = list(concat[0]), list(concat[1])  # one dim, kept (unit or not)
  else:
    c_dims, c_group = big(concat[0], v.shape), big(concat[1], x.shape)
  if len(s_dims) != 1 or not k_dims or k_dims[0] != k or len(c_dims) != 1 or \
      c_group != [c] or v.shape[s_dims[0]] % n:
    return None
  s_dim, c_dim = s_dims[0], c_dims[0]
  shape = list(v.shape)
  shape[s_dim], shape[c_dim] = shape[s_dim] // n, shape[c_dim] * n
  inner = _fresh(module, "all_to_all", [v],
                 {**op.attrs, "split_dimension": s_dim, "concat_dimension": c_dim},
                 shape, v.type.dtype, op.location)
  return _emit(module, graph, op, "reshape", [_simplified_and_placed(module, graph, inner)], {})


_IDENTITY = {"sum": 0.0, "max": -float("inf"), "min": float("inf"), "mul": 1.0}
_BOOL_IDENTITY = {"max": 0.0, "min": 1.0}  # or, and (XLA's any over an index vector)


def _reduce_over_unit_dims(module, graph, op) -> Optional[ir.Value]:
  """reduce(x, init) over size-1 dims only, init the reducer's identity -> reshape(x).

  Autodiff sums over broadcast dims; where a dim has one element per device
  (one local head) jax and XLA spell that sum, or no sum, differently.
  """
  if op.name != "reduce" or len(op.operands) != 2 or not op.regions:
    return None
  from graphguard_hlo.passes.collectives import reducer_kind
  from graphguard_hlo.passes.terms import splat_value
  x, init = op.operands
  dims = op.attrs["dimensions"]
  if any(x.shape[d] != 1 for d in dims):
    return None
  kind = reducer_kind(op.regions[0])
  value = splat_value(init)
  identity = _BOOL_IDENTITY.get(kind) if x.type.dtype in ("pred", "i1") else _IDENTITY.get(kind)
  if value is None or value != identity:
    return None
  if x.type == op.results[0].type:
    return x
  return _emit(module, graph, op, "reshape", [x], {})


# slabs.py's rules by the op they rewrite (one lookup per op, not one call per rule).
_SLAB_RULES = {"add": (slabs.sum_of_slabs,),
               "scatter": (slabs.set_rows, slabs.scatter_of_one_window),
               "dynamic_update_slice": (slabs.set_rows,),
               "slice": (slabs.slice_of_split_reshape, slabs.slice_past_a_set,
                         slabs.slice_of_slabs, slabs.slice_of_select),
               "reshape": (slabs.reshape_of_concatenation, slabs.unit_reshape_of_select),
               "gather": (slabs.gather_one_window, slabs.gather_of_one_window),
               "dynamic_slice": (slabs.dynamic_slice_of_split_reshape,),
               "select": (slabs.select_of_slabs,)}


def _slab_forms(module, graph, op) -> Optional[ir.Value]:
  for rule in _SLAB_RULES.get(op.name, ()):
    found = rule(module, graph, op, _fresh,
                 lambda new: _simplified_and_placed(module, graph, new), _emit)
    if found is not None:
      return found
  return None


PATTERNS: tuple[Pattern, ...] = (
    _identity_shape_op, _reduce_precision_to_own, _reshape_inserting_units, _reshape_of_reshape,
    _reshape_of_unit_broadcast, _broadcast_of_broadcast, _transpose_of_transpose,
    _transpose_of_unit_dims,
    _transpose_through_all_reduce,
    _broadcast_expanding_units,
    _iota_as_broadcast, _add_zero, _bitwise_identity, _offset_before_broadcast,
    _clamp_before_unit_broadcast,
    _select_of_true_false, _square_as_product, _select_of_scalar_predicate,
    _select_of_constant_predicate, _nested_select_sharing_a_branch,
    _all_to_all_rank_dim_moved, _all_to_all_of_split_reshape, _reduce_over_unit_dims,
    _slab_forms)

def _dynamic_slice_at_constants(module, graph, op) -> Optional[ir.Value]:
  """dynamic_slice(x, c_0, ..., c_k), constant starts -> slice(x), the starts
  clamped as dynamic_slice clamps them.  An unrolled ring loop (ring_loops.py)
  reads what jax stacked per step at each step's now constant index."""
  if op.name != "dynamic_slice":
    return None
  from graphguard_hlo.passes.terms import splat_value
  starts = [splat_value(v) for v in op.operands[1:]]
  x = op.operands[0]
  sizes = op.attrs["slice_sizes"]
  if any(s is None for s in starts) or len(starts) != x.type.rank:
    return None
  lo = tuple(min(max(int(s), 0), n - k) for s, n, k in zip(starts, x.shape, sizes))
  return _emit(module, graph, op, "slice", [x], {
      "start_indices": lo, "limit_indices": tuple(a + k for a, k in zip(lo, sizes)),
      "strides": (1,) * len(lo)})


def _one_element_of_iota(module, graph, op) -> Optional[ir.Value]:
  """slice(iota) of one element -> that element, a constant (the iota may be
  broadcast or reshaped first).  A scan over ``jnp.arange(n)`` reads its step
  from an iota; unrolled (ring_loops.py), at each step's constant index."""
  if op.name != "slice" or math.prod(op.results[0].shape) != 1:
    return None
  import numpy as np
  whole = _iota_value(op.operands[0])
  if whole is None:
    return None
  try:
    arr = np.asarray(reference.evaluate("slice", op.attrs, [whole], op.results[0].type))
  except (NotImplementedError, KeyError, ValueError, TypeError):
    return None
  return _emit(module, graph, op, "constant", [], {"value": ir.ConstantArray(arr)})


_IOTA_CONE = {"iota", "broadcast_in_dim", "reshape", "convert"}


def _iota_value(v: ir.Value):
  """``v``'s value if it is an iota, broadcast, reshaped or converted; else None."""
  return _constant_value(v, depth=4, foldable=_IOTA_CONE)


def _permute_of_zeros(module, graph, op) -> Optional[ir.Value]:
  """collective_permute(0) -> 0: whichever rank sends, and a rank no one
  sends to receives zeros.  An unrolled ring loop's transpose sends its
  zero-initialized cotangent on at the first step."""
  if op.name != "collective_permute" or len(op.operands) != 1:
    return None
  from graphguard_hlo.passes.terms import splat_value
  x = op.operands[0]
  if splat_value(x) != 0.0 or x.type != op.results[0].type:
    return None
  return x


def _reduction_of_zeros(module, graph, op) -> Optional[ir.Value]:
  """all_reduce(0) -> 0 for a sum, max or min.  An unrolled loop's transpose
  psums a cotangent that a step's constant mask has made zero."""
  if op.name != "all_reduce" or len(op.operands) != 1 or not op.regions:
    return None
  from graphguard_hlo.passes.collectives import reducer_kind
  from graphguard_hlo.passes.terms import splat_value
  x = op.operands[0]
  if (reducer_kind(op.regions[0]) not in ("sum", "max", "min") or splat_value(x) != 0.0
      or x.type != op.results[0].type):
    return None
  return x


_SCALAR_ARITHMETIC = {"constant", "add", "subtract", "multiply", "minimum", "maximum", "negate",
                      "divide", "remainder", "compare", "and", "or", "not", "convert", "select",
                      "reshape"}  # (a scan's step read from its xs: a one-element row)


def _scalar_of_constants(module, graph, op) -> Optional[ir.Value]:
  """An integer or boolean scalar computed from constants -> that constant.
  An unrolled loop's step count is a constant, and what the loop computed
  from its counter (``t - (n - 1)``, ``t < M``, the reversed counter of a
  transposed loop) becomes one too."""
  if (op.name == "constant" or len(op.results) != 1 or op.results[0].type.rank != 0
      or op.results[0].type.dtype not in _INTEGER_DTYPES):
    return None
  value = _constant_value(op.results[0], depth=2, foldable=_SCALAR_ARITHMETIC)
  if value is None:
    return None
  return _emit(module, graph, op, "constant", [],
               {"value": reference.constant_array(value, op.results[0].type.dtype)})


_INTEGER_DTYPES = {"i1", "pred", "i8", "i16", "i32", "i64", "ui8", "ui16", "ui32", "ui64"}


def _logic_with_constant(module, graph, op) -> Optional[ir.Value]:
  """and(p, true) -> p, and(p, false) -> false, or(p, false) -> p,
  or(p, true) -> true, for booleans.  A step's mask ``(stage == 0) & (t < M)``
  with t a constant is the stage test or nothing."""
  if op.name not in ("and", "or") or len(op.operands) != 2:
    return None
  out = op.results[0].type
  if out.dtype not in ("i1", "pred"):
    return None
  from graphguard_hlo.passes.terms import splat_value
  absorbing = 0.0 if op.name == "and" else 1.0
  for x, c in (op.operands, op.operands[::-1]):
    value = splat_value(c)
    if value is None or c.type != out:
      continue
    if value == absorbing:
      return c
    if x.type == out:
      return x
  return None


def _reshape_of_broadcast_units(module, graph, op) -> Optional[ir.Value]:
  """reshape(broadcast_in_dim(y)) that only drops or adds unit dims -> one
  broadcast_in_dim(y), when y's dims all land on dims the reshape keeps.
  A step's slice of what an unrolled ring loop stacked (ring_loops.py) is
  its broadcast with the stacking dim's unit in front."""
  if op.name != "reshape":
    return None
  p = op.operands[0].producer
  if p is None or p.name != "broadcast_in_dim":
    return None
  src, dst = p.results[0].shape, op.results[0].shape
  if [n for n in src if n != 1] != [n for n in dst if n != 1]:
    return None
  kept_src = [i for i, n in enumerate(src) if n != 1]
  kept_dst = [i for i, n in enumerate(dst) if n != 1]
  where = dict(zip(kept_src, kept_dst))
  dims = p.attrs["broadcast_dimensions"]
  if any(d not in where for d in dims):
    return None
  return _emit(module, graph, op, "broadcast_in_dim", [p.operands[0]],
               {"broadcast_dimensions": tuple(where[d] for d in dims)})


# Where the per-device program passes blocks round a ring (ring attention):
# the online softmax telescoped, the sequential softmax dividing after its
# matmul to meet it, and one operand order for a product (the two programs'
# einsums spell p @ v differently).  Only there: elsewhere both programs
# already agree, and a rewrite that fires in one but not the other (on a
# dot whose local dims are units, a GSPMD partial sum's division) would part
# what matched.
RING_PATTERNS: tuple[Pattern, ...] = (
    _dot_of_transpose, _dot_operand_order,  # before divide_after_dot: it rewrites the dot in order
    online_softmax.online_rescale, online_softmax.divide_after_dot,
    softmax_backward.lse_as_division, softmax_backward.division_vjp_as_flash)

# Where a ring loop was unrolled (ring_loops.py): each step reads what jax
# stacked per step at its constant index, and these bring that to the Python
# loop's spelling.  Only there: a reshape of a broadcast fires where a device
# holds one head (unit dims) and the sequential program holds many, and would
# part a pipeline's matched softmax.
UNROLLED_RING_PATTERNS: tuple[Pattern, ...] = (
    _dynamic_slice_at_constants, _one_element_of_iota, _reshape_of_broadcast_units,
    _permute_of_zeros, _scalar_of_constants, _logic_with_constant, _reduction_of_zeros)


def _self_comparison(module, graph, op) -> Optional[ir.Value]:
  """compare(x, x) of integers or booleans -> its constant answer.  XLA drops
  the NaN test ``x != x`` from an argmax's reducer over booleans (jnp.select's
  conditions); jax keeps it.  (Not for floats: NaN != NaN.)"""
  if op.name != "compare" or len(op.operands) != 2 or op.operands[0] is not op.operands[1] \
      or not reference.is_integer_type(op.operands[0].type.dtype):
    return None
  import numpy as np
  holds = op.attrs.get("comparison_direction") in ("EQ", "LE", "GE")
  return _emit(module, graph, op, "constant", [], {"value": reference.constant_array(
      np.full(op.results[0].shape, holds), op.results[0].type.dtype)})


# Inside a reducer's body (an argmax's), where XLA simplifies what jax wrote.
REDUCER_PATTERNS: tuple[Pattern, ...] = (_self_comparison, _logic_with_constant)
_REDUCERS = ("reduce", "reduce_window", "scatter")


def _emit(module, graph, op, name, operands, attrs) -> ir.Value:
  """A new op (not yet placed in the graph) standing for ``op``'s result."""
  new = ir.Op(name, operands, attrs, [], op.location)
  new.results = [module.new_value(op.results[0].type, new, 0)]
  return new.results[0]


def _simplify(module: ir.Module, graph: ir.Graph, op: ir.Op) -> Optional[ir.Value]:
  for pattern in graph.patterns:  # type: ignore[attr-defined]
    result = pattern(module, graph, op)
    if result is not None:
      return result
  return None


def canonicalize_graph(module: ir.Module, graph: ir.Graph, rings: bool = False,
                       extra: tuple = ()) -> int:
  """Rewrite ``graph`` in place to the normal form (with ``rings``, also
  ``RING_PATTERNS``; and the ``extra`` patterns); returns the rewrite count."""
  replace: dict[int, ir.Value] = {}
  out: list[ir.Op] = []
  original = {id(op) for op in graph.ops}
  rewrites = 0
  graph.ops_to_place = []  # type: ignore[attr-defined]
  graph.known_ops = set(original)  # type: ignore[attr-defined]
  graph.patterns = PATTERNS + (RING_PATTERNS if rings else ()) + extra  # type: ignore[attr-defined]
  graph.slices = {}  # type: ignore[attr-defined]  # (slabs._sliced)
  for op in graph.ops:
    op.operands = [replace.get(v.id, v) for v in op.operands]
    if op.name == "optimization_barrier":
      replace.update((r.id, x) for r, x in zip(op.results, op.operands))
      rewrites += 1
      continue
    inner = extra + (REDUCER_PATTERNS if op.name in _REDUCERS else ())
    for region in op.regions:
      rewrites += canonicalize_graph(module, region, rings, inner)
    current = op
    final = None
    while len(current.results) == 1:
      result = _simplify(module, graph, current)
      if result is None:
        break
      rewrites += 1
      out.extend(graph.ops_to_place)  # type: ignore[attr-defined]
      graph.known_ops.update(id(o) for o in graph.ops_to_place)  # type: ignore[attr-defined]
      graph.ops_to_place = []  # type: ignore[attr-defined]
      if result.producer is not None and result.producer is not current \
          and id(result.producer) not in graph.known_ops:  # type: ignore[attr-defined]
        current = result.producer  # a fresh op: simplify it in turn
        continue
      final = result
      break
    if final is None:
      out.append(current)
      graph.known_ops.add(id(current))  # type: ignore[attr-defined]
      final = current.results[0] if len(current.results) == 1 else None
    if final is not None and final is not op.results[0]:
      replace[op.results[0].id] = final
  del graph.ops_to_place, graph.known_ops, graph.patterns, graph.slices  # type: ignore[attr-defined]
  graph.results = [replace.get(v.id, v) for v in graph.results]
  graph.ops = _without_dead_ops(out, graph.results)
  return rewrites


# Ops kept though nobody reads them: the effects but rng ops, whose draws are
# opaque to both programs, so a dead one is dead.
_SIDE_EFFECTS = EFFECTS - {"rng", "rng_bit_generator"}


def _without_dead_ops(ops: list[ir.Op], results: list[ir.Value]) -> list[ir.Op]:
  """Drop ops whose results nobody reads (what rewrites left behind)."""
  used = {v.id for v in results}
  kept = []
  for op in reversed(ops):
    if op.name in _SIDE_EFFECTS or any(r.id in used for r in op.results):
      kept.append(op)
      used.update(v.id for v in op.operands)
      for region in op.regions:  # values captured by nested bodies stay alive
        used.update(v.id for inner in region.walk() for v in inner.operands)
  kept.reverse()
  return kept


def canonical_local_op(name: str, attrs: dict, operand_types: list[ir.TensorType],
                       result_type: ir.TensorType) -> Optional[tuple[str, dict]]:
  """The normal form of one op given only its operand types (for lemma-made ops).

  ``None`` means the op is the identity on its first operand.
  """
  if name == "reduce" and len(operand_types) == 2 and all(
      operand_types[0].shape[d] == 1 for d in attrs["dimensions"]):
    # Over local unit dims only (the caller has checked the init is the
    # identity): the per-device program was canonicalized to a reshape.
    name, attrs, operand_types = "reshape", {}, operand_types[:1]
  if name == "transpose" and len(operand_types) == 1 and moves_only_unit_dims(
      attrs["permutation"], operand_types[0].shape):
    name, attrs = "reshape", {}  # as _transpose_of_unit_dims spells it in the graphs
  if name == "slice" and len(operand_types) == 1 and operand_types[0] == result_type:
    return None  # every element, in place (a stage's one layer of its stack)
  if name == "pad" and not any(any(attrs[k]) for k in (
      "edge_padding_low", "edge_padding_high", "interior_padding")):
    return None  # no room added: a row set into its rank's one-row tile
  if name in ("reshape", "broadcast_in_dim", "convert", "copy") and len(operand_types) == 1:
    src = operand_types[0]
    if src == result_type and (name != "broadcast_in_dim" or tuple(
        attrs["broadcast_dimensions"]) == tuple(range(src.rank))):
      return None
    if name == "reshape" and result_type.rank > src.rank:
      pos = _unit_insert_positions(src.shape, result_type.shape)
      if pos is not None:
        return "broadcast_in_dim", {"broadcast_dimensions": pos}
  return name, attrs


def drop_dead_ops(g: ir.Graph) -> None:
  """Dead ops out of ``g`` and the bodies nested in it (shard_map's body holds
  the loops a rewrite left unused)."""
  g.ops = _without_dead_ops(g.ops, g.results)
  for op in g.ops:
    for region in op.regions:
      drop_dead_ops(region)


def canonicalize_module(module: ir.Module, rings: bool = False, extra: tuple = ()) -> int:
  from graphguard_hlo.passes.loop_copies import forward_stacked_copies
  from graphguard_hlo.passes.loop_constants import sink_constant_carries
  from graphguard_hlo.passes.remat import rematerialize_saved_rows
  rewrites = 0
  for g in module.functions.values():
    rewrites += canonicalize_graph(module, g, rings, extra)
    if forward_stacked_copies(module, g):
      rewrites += 1
      drop_dead_ops(g)
    # Loop normal forms; the ops they copy meet the ops around them (a
    # recomputed row's unit dims, a sunk mask), so the patterns run again.
    loops = sink_constant_carries(module, g) + rematerialize_saved_rows(module, g)
    if loops:
      rewrites += loops + canonicalize_graph(module, g, rings, extra)
      drop_dead_ops(g)
  return rewrites
