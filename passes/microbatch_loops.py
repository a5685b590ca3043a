"""Split a sequential loop over a batch into the loops a pipeline's microbatches run.

GPipe whose stages scan their layers runs, at each step, every stage's loop
on one microbatch; the sequential program scans the layers over the whole
batch (once per stage's rows, after ``loop_split.py``).  No per-device loop
carries the whole batch, so ``loops.py`` finds no partner to prove the
sequential loop against.  Where the body treats the batch's rows
independently, running it on each microbatch and concatenating the results
changes no value::

    h = while(h[B, ...], W)    ->  h_m = while(h[m*b : m*b + b, ...], W),  m < B / b
                                   h = concat(h_0, .., h_{B/b - 1})

Each piece then has a partner (the per-device loop of the step that runs
that microbatch), proved by one inductive step as before.

Only where every op of the body carries the batch dim through whole and never
combines two rows (``_BatchDims``): elementwise ops, broadcasts, reshapes and
transposes that keep the dim whole, dots and reductions that neither contract
nor reduce it, slices that take all of it.  Values that do not depend on the
batch (weights, the counter) never read a value that does; a value the same
along the batch (a broadcast bias) meeting one that is not is cut alike.

The loop autodiff writes for such a scan (its transpose) also sums each
layer's weight gradient over the rows (``dW = h^T dy``): a carry starting at
zero whose body adds to it only sums over the batch's rows and values linear
in such sums (``_ADDITIVE``), scaled by values the same in every piece
(``_SCALED``), is the sum of the pieces' carries::

    dW = while(.., 0)          ->  dW = dW_0 + .. + dW_{B/b - 1}

Other carries are the same in every piece: the first piece's stand for them.
Sequential program only; the split is chosen by the per-device loops at the
same source line whose carries are the batch's microbatches, at least one
such loop a microbatch (a data-parallel rank runs one loop on its tile: its
relation is a tiling, proved as it is).  Their other carries may differ
otherwise: with tensor parallelism inside a stage, each microbatch's loop
holds the stage's weights tiled.  The batch is then the extent some carries
are cut from and to that the body keeps apart (``_microbatch_cuts`` lists
each candidate, ``_BatchDims`` accepts or refuses it), and the pieces keep
the weights whole for ``loops.py`` to prove the tiling.

With the batch tiled over data-parallel ranks too, each rank runs its own
tile's microbatches: fewer loops than the batch has blocks.  Piece m is then
block m of every tile, its rows of each tile concatenated, and the results
are put back tile by tile (``_batch_tiles`` reads the ranks off the
parameters' layouts; ``pieces.py`` reads the reassembly as a split tiled over
them).  Any partition of the rows serves the rewrite itself: a wrong count
costs the proof, not its soundness.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.passes.canonicalize import _fresh
from graphguard_hlo.passes.layout import Layout
from graphguard_hlo.passes.lemmas import ELEMENTWISE
from graphguard_hlo.passes.loop_edits import clone_region, replace_uses, rows, splat_at
from graphguard_hlo.passes.pieces import block_source
from graphguard_hlo.passes.terms import is_zero, splat_value, sums_from_zero

_SAME_ALONG_THE_BATCH = ("broadcast_in_dim", "iota", "constant")


def split_microbatch_loops(module: ir.Module, dist: ir.Graph,
                           param_layouts: Sequence[Optional[Layout]] = (),
                           mesh: Optional[ir.Mesh] = None) -> int:
  """Split each loop of ``module``'s main the per-device program runs on
  microbatches (a loop at the same source line whose carries are the
  sequential ones with the batch cut along one dim); the number of loops split.
  ``param_layouts``, ``mesh``: how the per-device program's parameters tile
  the sequential ones (a batch tiled over data-parallel ranks is cut into
  each rank's microbatches, ``_batch_tiles``)."""
  partners: dict[str, list[ir.Op]] = {}
  for op in dist.walk():
    if op.name == "while":
      partners.setdefault(str(op.location), []).append(op)
  graph, split = module.main, 0
  for loop in [op for op in graph.ops if op.name == "while"]:
    here = partners.get(str(loop.location), [])
    cuts = [_microbatch_cuts(loop, partner) for partner in here]
    for cut in dict.fromkeys(c for found in cuts for c in found):
      dims, pieces = cut
      dims = dict(dims)
      tiles = _batch_tiles(graph, loop, dims, param_layouts, mesh)
      if pieces % tiles or pieces // tiles < 2 or \
          sum(1 for found in cuts if cut in found) < pieces // tiles:
        continue  # one loop on a rank's tile (data parallel), not one per microbatch
      zeros = {j for j, v in enumerate(loop.operands)
               if j not in dims and v.type.dtype not in ("pred", "i1") and is_zero(v)}
      batch = _BatchDims.of(loop.regions[1], dims, zeros)
      if batch is None or _condition_reads(loop.regions[0], set(dims) | batch.summed_carries):
        continue
      _split(module, graph, loop, dims, pieces // tiles, tiles, batch)
      split += 1
      break
  return split


def _microbatch_cuts(loop: ir.Op, partner: ir.Op) -> list[tuple[tuple[tuple[int, int], ...], int]]:
  """Each way ``partner``'s carries may be ``loop``'s with the batch cut:
  ``(((carry, dim), ...), pieces)``, one for each extent a dim of some carry
  is cut from and to.  The batch is the one extent every batch value has
  (``_BatchDims.of`` tells which candidate it is); other carries may differ
  otherwise, tiled by tensor parallelism inside the stage, which is
  ``loops.py``'s to prove.  A carry cut twice from and to the batch's
  extents (batch and heads alike in size) names no dim: not a candidate."""
  if len(loop.operands) != len(partner.operands):
    return []
  differs: list[dict[int, tuple[int, int]]] = []
  for s, d in zip(loop.operands, partner.operands):
    if s.type.dtype != d.type.dtype or s.type.rank != d.type.rank:
      return []
    differ = {k: (a, b) for k, (a, b) in enumerate(zip(s.shape, d.shape)) if a != b}
    if any(b == 0 or a % b for a, b in differ.values()):
      return []
    differs.append(differ)
  cuts = []
  for whole, part in sorted({pair for differ in differs for pair in differ.values()}):
    dims = []
    for j, differ in enumerate(differs):
      at = [k for k, pair in differ.items() if pair == (whole, part)]
      if len(at) > 1:
        break
      dims.extend((j, k) for k in at)
    else:
      if whole // part >= 2:
        cuts.append((tuple(dims), whole // part))
  return cuts


def _batch_tiles(graph: ir.Graph, loop: ir.Op, dims: dict[int, int],
                 layouts: Sequence[Optional[Layout]], mesh: Optional[ir.Mesh]) -> int:
  """Over how many ranks the batch the loop runs on is tiled: the parameters
  its batch carries are computed from, where one tiles a dim of the batch's
  extent (tokens, labels over "dp").  Each such rank runs its own
  microbatches, so piece m is microbatch m of every tile.  1 if none, or if
  they disagree.  Through another loop's result only to that carry's
  initial value: the loop's weights (a stack of as many layers as rows,
  tiled over stages) say nothing of the batch."""
  if mesh is None or not layouts:
    return 1
  j, d = next(iter(dims.items()))
  extent, sizes = loop.operands[j].shape[d], dict(mesh.axes)
  index = {p.id: i for i, p in enumerate(graph.params)}
  found, seen, stack = set(), set(), [loop.operands[j] for j in dims]
  while stack:
    v = stack.pop()
    if v.id in seen:
      continue
    seen.add(v.id)
    if v.id in index:
      layout = layouts[index[v.id]] if index[v.id] < len(layouts) else None
      for k, axes in enumerate(layout.dims if layout is not None else ()):
        if axes and v.shape[k] == extent:
          found.add(math.prod(sizes.get(a, 0) for a in axes))
    elif v.producer is not None and v.producer.name == "while":
      stack.append(v.producer.operands[v.index])
    elif v.producer is not None:
      stack.extend(v.producer.operands)
  return found.pop() if len(found) == 1 and min(found) > 0 else 1


def _condition_reads(cond: ir.Graph, carries: set[int]) -> bool:
  read = {v.id for op in cond.walk() for v in op.operands} | {v.id for v in cond.results}
  return any(cond.params[j].id in read for j in carries)


# Ops linear in their operands at these positions (None: all), the rest read
# as the same in every piece: each such operand a sum over the pieces or zero
# makes the result one.  ``dynamic_update_slice`` writes a summed row into a
# summed buffer (the scan's stacked weight gradients); ``pad`` pads with zero.
_ADDITIVE: dict[str, Optional[tuple[int, ...]]] = {
    "add": None, "subtract": None, "negate": None, "concatenate": None,
    "reshape": (0,), "transpose": (0,), "broadcast_in_dim": (0,), "slice": (0,),
    "reverse": (0,), "copy": (0,), "dynamic_slice": (0,), "pad": (0,),
    "dynamic_update_slice": (0, 1), "select": (1, 2), "reduce": (0,),
}
# Ops linear in one operand at these positions, the other a factor the same in
# every piece (a weight, a scale): exactly one of them is a sum.
_SCALED: dict[str, tuple[int, ...]] = {"multiply": (0, 1), "dot_general": (0, 1),
                                       "divide": (0,)}


def _linear_in_sums(op: ir.Op, summed: list[bool]) -> bool:
  """Is ``op``'s result a sum over the pieces when its ``summed`` operands
  are (the others the same in every piece)?"""
  name = op.name
  if name == "convert":  # a float's precision, not its value, in real arithmetic; but
    # a narrower type may overflow on one piece's sum where the whole's is finite
    to = op.results[0].type.dtype
    return _is_float(op.operands[0]) and to in (op.operands[0].type.dtype, "f32", "f64")
  if name == "divide" and not _is_float(op.results[0]):
    return False  # integer division rounds each piece's quotient: (a + b) / 3 != a / 3 + b / 3
  if name in _SCALED:
    return sum(summed[k] for k in _SCALED[name]) == 1 and \
        not any(s for k, s in enumerate(summed) if k not in _SCALED[name])
  if name not in _ADDITIVE:
    return False
  linear = _ADDITIVE[name]
  linear = range(len(op.operands)) if linear is None else linear
  if name == "pad" and not is_zero(op.operands[1]):
    return False
  if name == "reduce" and not sums_from_zero(op):
    return False
  return all(summed[k] or is_zero(op.operands[k]) for k in linear) and \
      not any(s for k, s in enumerate(summed) if k not in linear)


def _is_float(v: ir.Value) -> bool:
  return v.type.dtype.startswith(("f", "bf"))  # f16, f32, bf16, f8E4M3FN, ...


class _BatchDims:
  """Where the batch dim is in each value of a loop body, if every op
  carries it through whole and never combines rows, and which values are
  sums over the rows (see the module doc)."""

  def __init__(self, extent: int):
    self.extent = extent                     # the batch's size, in every value
    self.dim: dict[int, int] = {}           # value id -> its batch dim
    self.summed: set[int] = set()           # value ids: sums over the pieces
    self.summed_carries: set[int] = set()   # carries that are, starting at zero
    self.zero_carries: dict[int, int] = {}  # param id -> carry, starting at zero
    self.wanted: set[int] = set()           # zero carries an op would add a sum to
    self.cut_operands: list[tuple[int, int, int]] = []  # (op index, operand, dim)

  @classmethod
  def of(cls, body: ir.Graph, dims: dict[int, int],
         zeros: set[int]) -> Optional["_BatchDims"]:
    """``zeros``: the carries that start at zero, which may carry sums."""
    extents = {body.params[j].shape[d] for j, d in dims.items()}
    if len(extents) != 1:
      return None
    extent, summed = extents.pop(), set()
    while True:  # grown by the zero carries that take a sum
      found = cls(extent)
      found.dim = {body.params[j].id: d for j, d in dims.items()}
      found.summed = {body.params[j].id for j in summed}
      found.zero_carries = {body.params[j].id: j for j in zeros - summed}
      through = all(found._through(at, op) for at, op in enumerate(body.ops))
      more = found.wanted if not through else \
          {j for j, r in enumerate(body.results) if j not in dims and r.id in found.summed}
      if not more - summed:
        break
      if not more <= zeros:
        return None  # a sum carried from a nonzero start counts it once a piece
      summed |= more
    if not through:
      return None
    for j, r in enumerate(body.results):
      if j in summed:
        ok = r.id in found.summed or is_zero(r)
      else:
        ok = found.dim.get(r.id) == dims.get(j) and r.id not in found.summed
      if not ok:
        return None  # a batch carry comes back cut elsewhere, or a weight reads the batch
    found.summed_carries = summed
    return found

  def _through(self, at: int, op: ir.Op) -> bool:
    if any(v.id in self.dim or v.id in self.summed
           for region in op.regions for v in _reads(region)):
      return False  # a region reading a batch value itself (a cond's branch capturing h)
    ins = [self.dim.get(v.id) for v in op.operands]
    sums = [v.id in self.summed for v in op.operands]
    if any(sums):  # a sum over the rows meeting one row would count it once a piece
      if any(d is not None for d in ins):
        return False
      if _linear_in_sums(op, sums):
        return self._sum(op)
      for k, v in enumerate(op.operands):  # a zero-start buffer a sum is written into
        if v.id in self.zero_carries and \
            _linear_in_sums(op, [s or i == k for i, s in enumerate(sums)]):
          self.wanted.add(self.zero_carries[v.id])
      return False
    if all(d is None for d in ins):
      return True  # reads no batch value
    if self._sums_rows(op, ins):
      return self._sum(op)
    if op.regions and op.name != "reduce":
      return False
    out = self._result_dim(at, op, ins)
    result = op.results[0]
    if out is None or out >= result.type.rank or result.shape[out] != self.extent:
      return False  # (a rule's answer checked against the shapes)
    self.dim[op.results[0].id] = out
    return len(op.results) == 1

  def _sum(self, op: ir.Op) -> bool:
    self.summed.add(op.results[0].id)
    return len(op.results) == 1

  @staticmethod
  def _sums_rows(op: ir.Op, ins: list) -> bool:
    """Does ``op`` sum over the batch's rows: a dot contracting the batch
    dims of both operands with each other, or a sum reducing it?"""
    if op.name == "dot_general":
      at, (lhs, rhs) = op.attrs, ins
      lc, rc = list(at["lhs_contract"]), list(at["rhs_contract"])
      return lhs in lc and rhs in rc and lc.index(lhs) == rc.index(rhs)
    if op.name == "reduce" and len(op.operands) == 2 and ins[1] is None:
      return ins[0] in op.attrs["dimensions"] and sums_from_zero(op)
    return False

  def _result_dim(self, at: int, op: ir.Op, ins: list) -> Optional[int]:
    name, result = op.name, op.results[0]
    if name in ELEMENTWISE and name != "bitcast_convert":
      d = {x for x in ins if x is not None}
      if len(d) != 1:
        return None
      (d,) = d
      for k, (v, x) in enumerate(zip(op.operands, ins)):
        if x is None and v.type.rank:  # a full-shaped operand the same along the batch
          if v.shape != result.shape or not _same_along(v, d):
            return None
          self.cut_operands.append((at, k, d))
      return d
    (d, *rest), operands = ins, op.operands
    if name == "broadcast_in_dim":
      return op.attrs["broadcast_dimensions"][d]
    if name == "transpose":
      return list(op.attrs["permutation"]).index(d)
    if name == "reshape":
      return _kept_dim(operands[0].shape, result.shape, d)
    if name == "slice":
      whole = (op.attrs["start_indices"][d], op.attrs["limit_indices"][d],
               op.attrs["strides"][d]) == (0, operands[0].shape[d], 1)
      return d if whole and not any(x is not None for x in rest) else None
    if name == "dynamic_slice":
      whole = op.attrs["slice_sizes"][d] == operands[0].shape[d] and \
          splat_value(operands[1 + d]) == 0.0
      return d if whole and not any(x is not None for x in rest) else None
    if name == "dynamic_update_slice":  # a row of saved activations written whole
      x, update = operands[:2]
      whole = ins[1] == d and update.shape[d] == x.shape[d] and \
          splat_value(operands[2 + d]) == 0.0
      return d if whole and not any(x is not None for x in ins[2:]) else None
    if name == "concatenate":
      return d if op.attrs["dimension"] != d and all(x == d for x in ins) else None
    if name == "reverse":
      return d if d not in op.attrs["dimensions"] else None
    if name == "reduce" and len(operands) == 2 and ins[1] is None:
      reduced = op.attrs["dimensions"]
      return None if d in reduced else d - sum(1 for r in reduced if r < d)
    if name == "dot_general":
      return _dot_dim(op, ins)
    return None


def _reads(region: ir.Graph):
  """Every value ``region`` reads: its ops' operands and its (and nested
  regions') results, which may be values from outside it."""
  yield from region.results
  for op in region.walk():
    yield from op.operands
    for inner in op.regions:
      yield from inner.results


def _same_along(v: ir.Value, d: int) -> bool:
  """Is ``v`` the same at every index of dim ``d`` (so cut like its reader)?"""
  op = v.producer
  if op is None or op.name not in _SAME_ALONG_THE_BATCH:
    return False
  if op.name == "constant":
    return splat_value(v) is not None
  if op.name == "iota":
    return op.attrs["iota_dimension"] != d
  dims = op.attrs["broadcast_dimensions"]
  return d not in dims or op.operands[0].shape[dims.index(d)] == 1


def _kept_dim(src: tuple, dst: tuple, d: int) -> Optional[int]:
  """The dim of ``dst`` that is dim ``d`` of ``src`` whole (the same extent,
  with as many elements before it), if a reshape keeps it."""
  before = 1
  for n in src[:d]:
    before *= n
  at = 1
  for k, n in enumerate(dst):
    if at == before and n == src[d]:
      return k
    at *= n
  return None


def _dot_dim(op: ir.Op, ins: list) -> Optional[int]:
  """The result dim of a dot's batch dim: a free dim of one operand (the
  other, weights, reads no batch), or a batch dim of both at one position."""
  at = op.attrs
  lhs, rhs = ins
  free = ir.dot_free_dims(at, *(v.type.rank for v in op.operands))
  n_batch = len(at["lhs_batch"])
  if lhs is not None and rhs is not None:
    if lhs in at["lhs_batch"] and rhs in at["rhs_batch"] and \
        list(at["lhs_batch"]).index(lhs) == list(at["rhs_batch"]).index(rhs):
      return list(at["lhs_batch"]).index(lhs)
    return None
  if lhs is not None:
    return n_batch + free[0].index(lhs) if lhs in free[0] else None
  return n_batch + len(free[0]) + free[1].index(rhs) if rhs in free[1] else None


def _cut_type(t: ir.TensorType, d: int, pieces: int) -> ir.TensorType:
  shape = list(t.shape)
  shape[d] //= pieces
  return ir.TensorType(tuple(shape), t.dtype)


def _piece_body(module: ir.Module, body: ir.Graph, batch: _BatchDims,
                pieces: int) -> ir.Graph:
  """``body`` on one microbatch: each batch value's type cut along its
  batch dim, slices of it taking the cut extent, and the values the same
  along the batch that meet them made again at the cut shape."""
  out = clone_region(module, body, {})
  originals = list(body.params) + [r for op in body.ops for r in op.results]
  copies = list(out.params) + [r for op in out.ops for r in op.results]
  for v, c in zip(originals, copies):
    d = batch.dim.get(v.id)
    if d is not None:
      c.type = _cut_type(v.type, d, pieces)
  for op, new in zip(body.ops, out.ops):
    d = batch.dim.get(op.results[0].id) if op.results else None
    if d is None:
      continue
    if op.name == "slice":
      limits = list(new.attrs["limit_indices"])
      limits[d] //= pieces
      new.attrs["limit_indices"] = tuple(limits)
    elif op.name == "dynamic_slice":
      sizes = list(new.attrs["slice_sizes"])
      sizes[d] //= pieces
      new.attrs["slice_sizes"] = tuple(sizes)
  readers = list(out.ops)
  for at, k, d in sorted(batch.cut_operands, reverse=True):
    reader = readers[at]
    same = reader.operands[k]
    made = _fresh(module, same.producer.name, list(same.producer.operands),
                  dict(same.producer.attrs), _cut_type(same.type, d, pieces).shape,
                  same.type.dtype, same.producer.location)
    if same.producer.name == "constant":  # a splat, held at its new shape
      value = np.asarray(same.producer.attrs["value"])
      made.attrs["value"] = ir.ConstantArray(
          np.full(made.results[0].shape, value.ravel()[0], dtype=value.dtype))
    out.ops.insert(out.ops.index(reader), made)
    reader.operands[k] = made.results[0]
  return out


def _piece_of_concatenation(whole: ir.Value, d: int, pieces: int, tiles: int,
                             m: int) -> Optional[ir.Value]:
  """Piece ``m`` of ``whole`` cut along ``d`` (``_split``'s pieces, each
  ``tiles`` blocks), if ``whole`` is put together from such pieces: their
  concatenation, or with ``tiles`` > 1 each tile's blocks of every piece in
  turn (rather than a slice of that)."""
  op = whole.producer
  if op is None or op.name != "concatenate" or op.attrs["dimension"] != d or \
      len(op.operands) != pieces * tiles:
    return None
  if any(v.shape[d] * pieces * tiles != whole.shape[d] for v in op.operands):
    return None  # blocks of one size only: else operand m is not piece m's rows
  blocks = [op.operands[r * pieces + m] for r in range(tiles)]
  if tiles == 1:
    return blocks[0]
  sources = {block_source(v, d, r, tiles) for r, v in enumerate(blocks)}
  if len(sources) != 1 or None in sources:
    return None
  return sources.pop()


def _split(module: ir.Module, graph: ir.Graph, loop: ir.Op, dims: dict[int, int],
           pieces: int, tiles: int, batch: _BatchDims) -> None:
  """``loop`` replaced by ``pieces`` loops, one a microbatch; the slices
  cutting them and the loops are named in ``graph.microbatch_slices`` and
  ``graph.microbatch_pieces`` (for a report).  With the batch tiled over
  ``tiles`` data-parallel ranks, piece m is microbatch m of every tile: its
  rows of each tile, concatenated, and the results are put back tile by
  tile."""
  if not hasattr(graph, "microbatch_slices"):
    graph.microbatch_slices = {}  # type: ignore[attr-defined]
    graph.microbatch_pieces = {}  # type: ignore[attr-defined]
  at = graph.ops.index(loop)
  new_ops: list[ir.Op] = []
  cond, body = loop.regions
  firsts, cut_results = None, {j: [] for j in dims}
  piece_results: list[list[ir.Value]] = []
  of_tiles = f" of each of {tiles} data-parallel tiles" if tiles > 1 else ""
  for m in range(pieces):
    operands = list(loop.operands)
    for j, d in dims.items():
      whole = loop.operands[j]
      piece = _piece_of_concatenation(whole, d, pieces, tiles, m)
      if piece is not None:  # a loop split before feeds this one (the forward, its transpose)
        operands[j] = piece
        continue
      size, tile = whole.shape[d] // (pieces * tiles), whole.shape[d] // tiles
      splat = splat_at(module, whole, _cut_type(whole.type, d, pieces).shape,
                       loop.location) if tiles > 1 else None
      if splat is not None:  # every piece the same splat: made at its shape
        new_ops.append(splat)
        operands[j] = splat.results[0]
        continue
      blocks = []
      for r in range(tiles):
        lo = r * tile + m * size
        new_ops.append(rows(module, whole, d, lo, lo + size, loop.location))
        blocks.append(new_ops[-1].results[0])
        graph.microbatch_slices[id(new_ops[-1])] = (  # type: ignore[attr-defined]
            f"rows {lo}:{lo + size} along dim {d} are microbatch {m} of {pieces}{of_tiles} the "
            f"sequential loop at {loop.location} runs on, split as the per-device program "
            f"runs that loop (microbatch_loops.py)")
      if tiles > 1:
        new_ops.append(_fresh(module, "concatenate", blocks, {"dimension": d},
                              _cut_type(whole.type, d, pieces).shape, whole.type.dtype,
                              loop.location))
      operands[j] = new_ops[-1].results[0]
    piece_cond = clone_region(module, cond, {})
    for j, d in dims.items():
      piece_cond.params[j].type = operands[j].type
    piece = ir.Op("while", operands, dict(loop.attrs),
                  [piece_cond, _piece_body(module, body, batch, pieces)], loop.location)
    piece.results = [module.new_value(v.type, piece, r) for r, v in enumerate(operands)]
    new_ops.append(piece)
    graph.microbatch_pieces[id(piece)] = (  # type: ignore[attr-defined]
        f"microbatch {m}{of_tiles} of the {pieces} the sequential loop at {loop.location} "
        f"runs on (microbatch_loops.py)")
    firsts = firsts or piece.results
    piece_results.append(piece.results)
    for j in dims:
      cut_results[j].append(piece.results[j])
  results = list(firsts)
  for j, d in dims.items():
    whole, blocks = loop.results[j], cut_results[j]
    if tiles > 1:  # each tile's block of every piece in turn
      size = whole.shape[d] // (pieces * tiles)
      blocks = []
      for r in range(tiles):
        for res in cut_results[j]:
          new_ops.append(rows(module, res, d, r * size, (r + 1) * size, loop.location))
          blocks.append(new_ops[-1].results[0])
    new_ops.append(_fresh(module, "concatenate", blocks, {"dimension": d},
                          whole.shape, whole.type.dtype, loop.location))
    results[j] = new_ops[-1].results[0]
  for j in sorted(batch.summed_carries):
    total = piece_results[0][j]
    for later in piece_results[1:]:
      new_ops.append(_fresh(module, "add", [total, later[j]], {}, total.shape,
                            total.type.dtype, loop.location))
      total = new_ops[-1].results[0]
    results[j] = total
  graph.ops[at:at + 1] = new_ops
  replace_uses(graph, {r.id: c for r, c in zip(loop.results, results)})
