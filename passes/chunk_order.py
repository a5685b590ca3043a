"""Layouts whose chunks come in another order: zig-zag context parallelism.

Causal attention costs late queries more than early ones, so load-balanced
context parallelism (Llama 3; Megatron's ``get_batch_on_this_cp_rank``) cuts
the sequence into ``2n`` chunks and gives rank ``r`` chunks ``r`` and
``2n - 1 - r``.  No rank's tokens are then a tile of the sequence: they are
a tile of the sequence with its chunks reordered.  ``Layout.order`` names
that reordering ``P``: ``S ~ (L, order) of d`` says ``P(S) ~ L of d``.

Three facts carry such relations as far as plain ones go:

* The per-device program's data movement never looks at what the
  sequential tensor is: a transfer rule sound for every tensor is sound for
  ``P(S)``.  ``RelationInference._transferred`` applies transfers to the
  layout without its order and puts the order back on what they give.
* An op that treats the rows of the reordered dim independently commutes
  with ``P``: ``f(P(S)) = P(f(S))``.  So the lemmas read the layouts without
  their order, and the order moves to the dim those rows land in
  (``pieces.dim_map``, and a dynamic slice or update keeping the dim
  whole).  Every operand meeting that dim must be reordered alike or be
  constant along it (a broadcast, a splat); a sum or max over the dim does
  not see the order (``result_order``).
* The order is found where the per-device program builds it: a
  concatenate (or a select over ranks, ``rank_cases.py``'s form of a slice at
  a rank's own offset) of slices of one value held whole along the dim, at
  offsets computed from the rank (``ChunkSources``).  Run at every rank on
  the row numbers of that value, the slices name the chunks each rank holds.
  Chunks taken by index (reshaped into chunks, gathered at indices computed
  from the rank, reshaped back) are run on every element's own index
  instead: a gather could move other dims' elements too.

Loops carry ordered layouts like plain ones (``loops.py``), and try a splat
carry in each order found (``ChunkSources.reordered``).  A ring's buffer
fills and reduce-scatters are data movement too: they read layouts without
their order and keep it, and a buffer's tiles join only if all are in one
order.  Rows written back into place and summed (``write_backs.py``) read
the order to name each row.  Nothing else reads an ordered layout (slices,
gathers or cumulative sums along the dim, outputs): those ops are not
proved.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from graphguard_hlo import ir, reference
from graphguard_hlo.interpret import Interpreter, Unsupported, mesh_coords
from graphguard_hlo.passes.layout import Layout
from graphguard_hlo.passes.pieces import dim_map, partner_dim
from graphguard_hlo.passes.rank_arith import broadcast_scalar
from graphguard_hlo.passes.terms import splat_value

# Ops that only move rows of the value they read (its operands ``_DATA``);
# their other operands are indices or predicates, computed from the rank.
_DATA = {"concatenate": None, "dynamic_slice": (0,), "slice": (0,), "select": (1, 2),
         "copy": (0,)}
# ... and those that may also move elements of other dims (a dim viewed as
# chunks, chunks taken by index: Megatron's index_select), whose probe
# follows every element, not only rows.
_REGROUP = {"reshape": (0,), "gather": (0,)}
_MOVES = {**_DATA, **_REGROUP}
# Probes that follow every element copy the value's index (an int64, or a
# float64 where a fill splat meets it: exact either way) at every rank: at
# most this many, to bound their cost.
MAX_ELEMENTS_FOLLOWED = 1 << 22


def _row_map(op: ir.Op, k: int, d: int) -> Optional[tuple[Optional[int], bool]]:
  """``pieces.dim_map``, and a dynamic slice or update that keeps dim ``d``
  whole (a scan's saved activations, a layer's row of them read back)."""
  if op.name == "dynamic_slice" and k == 0:
    return (d, False) if op.attrs["slice_sizes"][d] == op.operands[0].shape[d] else None
  if op.name == "dynamic_update_slice" and k in (0, 1):
    return (d, False) if op.operands[1].shape[d] == op.operands[0].shape[d] else None
  return dim_map(op, k, d)


def _row_partner(op: ir.Op, k: int, d: int, j: int) -> Optional[int]:
  if op.name == "dynamic_update_slice":
    return d if {k, j} == {0, 1} else None
  return partner_dim(op, k, d, j)


def result_order(op: ir.Op, layouts, constant_along) -> Optional[tuple]:
  """The order of ``op``'s result when its operands have ``layouts`` (None
  for a splat), or None if ``op`` does not commute with their orders.

  ``constant_along(v, dim)``: is operand ``v`` the same along ``dim``?  Such
  an operand may meet a reordered dim without being reordered itself."""
  if len(op.results) != 1 or op.regions and op.name != "reduce":
    return None
  out = {}
  for k, layout in enumerate(layouts):
    for d, chunks in (layout.order if layout is not None else ()):
      mapped = _row_map(op, k, d)
      if mapped is None:
        return None
      e, summed = mapped
      for j, v in enumerate(op.operands):
        partner = None if j == k else _row_partner(op, k, d, j)
        if partner is None or v.type.rank == 0:
          continue
        theirs = dict(layouts[j].order if layouts[j] is not None else ())
        if theirs.get(partner) != chunks and not (
            layouts[j] is None or partner not in theirs and constant_along(v, partner)):
          return None
      if not summed:
        if out.get(e, chunks) != chunks:
          return None
        out[e] = chunks
  return tuple(sorted(out.items()))


class ChunkSources:
  """The per-device program's reorderings of one value's chunks."""

  def __init__(self, graph: ir.Graph, mesh: ir.Mesh, class_of, rings=frozenset()):
    self.mesh = mesh
    self.class_of = class_of
    self.rings = rings  # the axes rings of collective-permutes turn (transfer.py)
    self._chunks: dict[int, Optional[tuple]] = {}  # by root: _chunk_layout's
    # The outermost op of each nest: a concatenate of chunks, a select over
    # ranks of one (rank_cases.py writes a read at a rank's own row so), or
    # the reshape back of chunks taken by index.
    inner = {v.id for op in graph.ops if op.name in _DATA for v in op.operands}
    self._roots = [(moved, op) for op in graph.ops
                   if (op.name in ("concatenate", "select") and op.results[0].id not in inner
                       or _reshapes_taken_chunks(op))
                   and (moved := _moved_value(op)) is not None]

  def relations(self, cls: int, layout: Layout) -> list[tuple[int, Layout]]:
    """``(class, layout)`` of each reordering of chunks of ``cls``'s value,
    which relates to a sequential tensor by ``layout``."""
    out = []
    for (source, d, every_element), op in self._roots:
      if self.class_of(source) != cls:
        continue
      if id(op) not in self._chunks:
        self._chunks[id(op)] = _chunk_layout(op, source, d, every_element, self.mesh,
                                             self.rings)
      found = self._chunks[id(op)]
      if found is None or layout.dims[d] or layout.filled or d in dict(layout.order):
        continue
      axes, chunks = found
      if {ir.axis_base(a) for a in axes} & (set(layout.partial) | layout.pinned_axes()):
        continue  # (an axis tiling another dim too: the blocks (r, r + j) of a ring)
      dims = tuple(axes if i == d else a for i, a in enumerate(layout.dims))
      order = layout.order + (((d, chunks),) if chunks != tuple(range(len(chunks))) else ())
      new = layout.with_(dims=dims, order=order)
      if new.is_valid():
        out.append((self.class_of(op.results[0]), new))
    return out

  def reordered(self, layout: Layout, shape: tuple[int, ...]) -> list[Layout]:
    """``layout`` with a dim reordered as the program reorders chunks
    elsewhere, wherever it is tiled alike: more layouts of a splat, which is
    the same in any order (a scan's buffer of saved activations, zeros at
    first, later holding zig-zag rows)."""
    out = []
    for found in set(self._chunks.values()) - {None}:
      axes, chunks = found
      if chunks == tuple(range(len(chunks))):
        continue
      for e, tiled in enumerate(layout.dims):
        if tiled == axes and shape[e] % len(chunks) == 0 and e not in dict(layout.order):
          out.append(layout.with_(order=layout.order + ((e, chunks),)))
    return out


def _reshapes_taken_chunks(op: ir.Op) -> bool:
  """Is ``op`` a reshape of a gather's result (through its bounds mask)?"""
  p = op.operands[0].producer if op.name == "reshape" else None
  if p is not None and p.name == "select":
    taken = [v for v in p.operands[1:] if splat_value(v) is None]
    p = taken[0].producer if len(taken) == 1 else None
  return p is not None and p.name == "gather"


def _moved_value(root: ir.Op) -> Optional[tuple[ir.Value, int, bool]]:
  """The one value ``root`` moves rows of, through slices, dynamic slices,
  selects and concatenates (or reshapes and gathers), the one dim they cut,
  and whether the probe must follow every element (reshapes and gathers
  could move other dims' elements too); None unless all of it is so and
  something in it depends on the rank."""
  sources, cut = set(), set()
  by_rank = regrouped = masked = False
  work = [root]
  # A concatenate's chunks are of its dim; a slice of another dim below them
  # (a ring's block of columns, its rows then cut in zig-zag chunks) is their
  # source, related by a relation of its own.
  dim = root.attrs["dimension"] if root.name == "concatenate" else None

  def read(v: ir.Value) -> None:
    p = v.producer
    if p is not None and p.name in _MOVES and len(p.results) == 1 and not (
        dim is not None and p.name in ("slice", "dynamic_slice") and dim not in _cut_dims(p)):
      work.append(p)
    else:
      sources.add(v)

  while work:
    op = work.pop()
    if op.name in _REGROUP:
      regrouped = True
      by_rank |= op.name == "gather"
    elif op.name in ("dynamic_slice", "slice"):
      if op.name == "slice" and any(s != 1 for s in op.attrs.get("strides") or ()):
        return None
      by_rank |= op.name == "dynamic_slice"
      cut |= _cut_dims(op)
    elif op.name == "concatenate":
      cut.add(op.attrs["dimension"])
    elif op.name == "select":
      by_rank = True
      if math.prod(broadcast_scalar(op.operands[0]).shape) != 1:
        # An elementwise predicate: only a gather's bounds mask, choosing
        # between taken elements and a fill the probe must never see.
        fills = [k for k in (1, 2) if splat_value(op.operands[k]) is not None]
        if len(fills) != 1:
          return None
        masked = True
        read(op.operands[3 - fills[0]])
        continue
    data = _MOVES[op.name]
    for k, v in enumerate(op.operands):
      if data is None or k in data:
        read(v)
  if len(sources) != 1 or not by_rank or masked and not regrouped:
    return None
  (source,) = sources
  if source.type.rank != root.results[0].type.rank:
    return None
  if regrouped:  # the dim whose size changed, the others whole
    cut = {i for i, (a, b) in enumerate(zip(source.shape, root.results[0].shape)) if a != b}
    if math.prod(source.shape) > MAX_ELEMENTS_FOLLOWED:
      return None
  if len(cut) != 1:
    return None
  return source, cut.pop(), regrouped


def _cut_dims(op: ir.Op) -> set[int]:
  """The dims a slice or dynamic slice does not keep whole."""
  operand = op.operands[0].shape
  if op.name == "dynamic_slice":
    return {i for i, (n, s) in enumerate(zip(op.attrs["slice_sizes"], operand)) if n != s}
  return {i for i, n in enumerate(operand)
          if (op.attrs["start_indices"][i], op.attrs["limit_indices"][i]) != (0, n)}


def rank_cone(root: ir.Op, source: Optional[ir.Value] = None) -> Optional[list[ir.Op]]:
  """The ops ``root`` is computed by from ``source`` (if any), the rank and
  constants, in order (indices and predicates included); None if any reads
  another input of the program."""
  order, done = [], set()

  def visit(op: ir.Op) -> bool:
    if id(op) in done:
      return True
    if op.regions:
      return False
    done.add(id(op))
    for v in op.operands:
      if source is not None and v.id == source.id:
        continue
      if v.producer is None or not visit(v.producer):
        return False
    order.append(op)
    return True

  return order if visit(root) else None


def _chunk_layout(root: ir.Op, source: ir.Value, d: int, every_element: bool, mesh: ir.Mesh,
                  rings=frozenset()) -> Optional[tuple[tuple[str, ...], tuple]]:
  """The axes tiling dim ``d`` of ``root``'s result and the chunk order, read
  off its rows at every rank; None if they are not a layout of reordered
  chunks.  ``every_element``: the ops may move other dims' elements too, so
  each element holds its own index, and every element must land at its own
  place off dim ``d``.

  Along the axis of a ring (``rings``), in the form ``rotated_chunk_tilings``
  picks, the form of the ring's blocks; elsewhere plainly.  Not in both:
  each form multiplies the relations of every value computed from it (a
  mask's broadcast holds each in every tiling of its new dim), and
  MAX_RELATIONS_PER_VALUE would cut the one a reader needs."""
  ops = rank_cone(root, source)
  if ops is None:
    return None
  shape = source.type.shape
  if every_element:  # 1 + the element's flat index (int64: data movement keeps it exact)
    rows = np.arange(1, math.prod(shape) + 1, dtype=np.int64).reshape(shape)
  else:
    # Every element holds its row number (a view: the value is never copied).
    rows = np.broadcast_to(np.arange(shape[d], dtype=np.int64).reshape(
        [-1 if i == d else 1 for i in range(len(shape))]), shape)
  try:
    coords = mesh_coords(mesh)
  except Unsupported:
    return None
  env = {source.id: [rows] * len(coords)}
  Interpreter(len(coords)).run_ops(ops, env)
  held = env.get(root.results[0].id)
  if held is None or not _probe_is_faithful(ops, env, source):
    return None
  at = {}
  for coord, tile in zip(coords, held):
    tile = np.asarray(tile)
    if every_element:
      if not np.isfinite(tile).all() or ((tile < 1) | (tile > math.prod(shape))).any():
        return None  # a fill, not an element of the value
      index = np.unravel_index(tile.astype(np.int64) - 1, shape)
      place = np.indices(tile.shape)
      if any((index[i] != place[i]).any() for i in range(len(shape)) if i != d):
        return None  # an element off its place along another dim
      tile = index[d]
    line = np.moveaxis(tile, d, 0).reshape(tile.shape[d], -1)
    if (line != line[:, :1]).any():
      return None  # not rows (every other index the same)
    at[coord] = tuple(int(x) for x in line[:, 0])
  plain = chunk_tiling(at, mesh, shape[d])
  if plain is None or not set(plain[0]) & set(rings):
    return plain
  return min([plain, *rotated_chunk_tilings(at, mesh, shape[d], plain[0])],
             key=lambda found: found[1])


def integer_arithmetic(op: ir.Op) -> bool:
  """Does ``op`` compute integers from integers?  The reference interpreter
  computes those as XLA does; float ops it may not (a transcendental off by
  an ulp, a float-to-int convert wrapping where XLA saturates), and an
  offset or predicate computed from them could differ."""
  return all(reference.is_integer_type(v.type.dtype) for v in (*op.operands, *op.results))


def _probe_is_faithful(ops: list[ir.Op], env: dict, source: ir.Value) -> bool:
  """Did the probe compute what the program computes at every rank?

  * Every op reading ``source``'s elements moves them (``_MOVES``), and only
    as data: an offset, index or predicate computed from them would have
    been computed from the probe's ids instead.
  * Every other op is integer arithmetic, or a float splat (a fill).
  * Every bounds mask (a select between moved elements and a fill splat)
    picks the elements at every rank: a fill picked would read as whatever
    element its value names, were it an id.
  * Every gather declaring its indices sorted has them so (XLA may rely on
    it)."""
  moved, splats = {source.id}, set()
  for op in ops:
    if not any(v.id in moved for v in op.operands):
      float_splat = op.name == "constant" or op.name in ("broadcast_in_dim", "reshape") and \
          op.operands[0].id in splats
      if float_splat and not integer_arithmetic(op):
        splats.update(v.id for v in op.results)
      elif not integer_arithmetic(op):
        return False
      continue
    data = _MOVES.get(op.name, ())
    if any(v.id in moved and not (data is None or k in data) for k, v in enumerate(op.operands)):
      return False
    moved.update(v.id for v in op.results)
    if op.name == "gather" and op.attrs.get("indices_are_sorted") and not all(
        reference.indices_sorted(i, reference.dimension_numbers(op.attrs["dimension_numbers"])[
            "index_vector_dim"]) for i in env[op.operands[1].id]):
      return False
    fills = [k for k in (1, 2) if splat_value(op.operands[k]) is not None] \
        if op.name == "select" else []
    if fills and any((np.asarray(p).astype(bool) == (fills[0] == 1)).any()
                     for p in env[op.operands[0].id]):
      return False
  return True


def chunk_tiling(at: dict[tuple[int, ...], tuple[int, ...]], mesh: ir.Mesh, n: int
                 ) -> Optional[tuple[tuple[str, ...], tuple]]:
  """The axes tiling a dim of ``n`` rows and the order of its chunks, when
  the rank at mesh coordinates ``c`` holds the rows ``at[c]``; None unless
  the ranks' rows are the tiles of a reordering of chunks."""
  coords = list(at)
  names = mesh.axis_names
  axes = tuple(a for i, a in enumerate(names)
               if any(at[c] != at[c[:i] + (0,) + c[i + 1:]] for c in coords))
  chunks = _chunks_tiled_by(at, mesh, n, axes)
  return None if chunks is None else (axes, chunks)


def rotated_chunk_tilings(at: dict[tuple[int, ...], tuple[int, ...]], mesh: ir.Mesh, n: int,
                          axes: tuple[str, ...]) -> list[tuple[tuple[str, ...], tuple]]:
  """``chunk_tiling``'s rows read with one of ``axes`` rotated (``cp+j``,
  ``layout.py``): one relation, named another way.  At ring step t rank r
  holds the keys of rank r - t, zig-zag chunks of them.  Read plainly their
  order is the zig-zag order turned by t blocks, a different order at every
  step; read with ``cp`` rotated, the order whose chunks come first (the
  least) is the zig-zag order itself, and the rotation names the ring's step:
  the form a ring's collective-permutes give the keys, and the one
  ``ring_blocks.py`` folds the steps in."""
  out = []
  for i, a in enumerate(axes):
    for j in range(1, mesh.axis_size(a)):
      turned = axes[:i] + (ir.rotated_axis(a, j, mesh.axis_size(a)),) + axes[i + 1:]
      chunks = _chunks_tiled_by(at, mesh, n, turned)
      if chunks is not None:
        out.append((turned, chunks))
  return out


def _chunks_tiled_by(at: dict[tuple[int, ...], tuple[int, ...]], mesh: ir.Mesh, n: int,
                     axes: tuple[str, ...]) -> Optional[tuple]:
  """The order of the chunks of a dim of ``n`` rows that ``axes`` (plain or
  rotated) tile, when the rank at coordinates ``c`` holds the rows
  ``at[c]``; None unless each tile is one set of rows and they cover the dim."""
  names = mesh.axis_names
  picked = [(names.index(ir.axis_base(a)), ir.axis_shift(a), mesh.axis_size(a)) for a in axes]
  tiles = {}
  for c, rows in at.items():
    key = tuple((c[i] + shift) % size for i, shift, size in picked)
    if tiles.setdefault(key, rows) != rows:
      return None  # depends on more than the axes
  held_rows = [r for key in sorted(tiles) for r in tiles[key]]
  if sorted(held_rows) != list(range(n)):
    return None
  size = _chunk_size(held_rows, len(next(iter(at.values()))))
  return tuple(held_rows[i] // size for i in range(0, len(held_rows), size))


def _chunk_size(rows: list[int], tile: int) -> int:
  """The largest chunk (dividing a tile) whose every run of ``rows`` is an
  aligned range."""
  for size in sorted((n for n in range(1, tile + 1) if tile % n == 0), reverse=True):
    if all(rows[i] % size == 0 and rows[i:i + size] == list(range(rows[i], rows[i] + size))
           for i in range(0, len(rows), size)):
      return size
  return 1
