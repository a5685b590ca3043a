"""Transfer rules: how the per-device program's own data movement changes a
relation, without any sequential op.

If ``s ~ L of d`` and the per-device program computes ``d' = g(d)`` for a
collective or a rank-dependent slice ``g``, then ``s ~ L' of d'``:

  all-reduce over X       sum[X](...) becomes a replica; a replica summed over
                          X becomes |X| times itself (scale 1/|X|)
  all-gather over X, k    concat over X along k is undone (X minor on dim k)
  reduce-scatter X, k     a partial sum over X becomes a tile along k
  all-to-all X, i -> j    the tile over X moves from dim j to dim i
  collective-permute      a replica stays a replica if every rank receives;
                          permuting axes of one size renames them;
                          a value pinned at coordinate c moves to perm(c);
                          a shift r -> r + s along x turns tiles over x by -s
                          (rotated axes, layout.py)
  dynamic-update-slice    a tile written at its own offset ((r_x + j) mod |x|)
     at a ring's offset   * size is known there (partly known, layout.py); a
                          buffer's known tiles and the one written add up
  select(r_x == c, a, 0)  a value pinned at x = c (or replicated over x)
                          becomes a partial sum over x, and is pinned at c
                          with zeros elsewhere; select(r_x in T, a, b)
                          pins a to the coordinates in T
  dynamic-slice at r*k    a replica becomes a tile (offsets proved by sympy)
  multiply/divide by c    the scale changes by 1/c or c
  a + b, b zero where     a's relation (zeros.py: where per-device values are
     a's holds            zero, e.g. a bubble's cotangent)

Each rule is tested numerically (``tests/test_transfer.py``).
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import sympy

from graphguard_hlo import ir
from graphguard_hlo.ir import axis_base, rotated_axis
from graphguard_hlo.reference import COMPARISONS, is_integer_type, type_bounds
from graphguard_hlo.passes.dist_egraph import DistEGraph, op_users
from graphguard_hlo.passes.layout import Layout
from graphguard_hlo.passes.rank_arith import (RankArithmetic, broadcast_scalar,
                                              partition_id_table, per_coordinate, rank_symbol)
from graphguard_hlo.passes.rank_tables import RankTables
from graphguard_hlo.passes.zeros import ZeroFacts, covers
from graphguard_hlo.passes.unit_dims import lower_lifted, only_unit_dims_change, unit_dim_lifts


def ring_shift(op: ir.Op, mesh: ir.Mesh) -> Optional[tuple[str, int]]:
  """(x, s) if the collective-permute sends every rank r to r + s along x."""
  axes, perm = op.attrs.get("gg.axes"), op.attrs.get("gg.permutation")
  if not axes or not perm or len(axes) != 1:
    return None
  n = mesh.axis_size(axes[0])
  shifts = {(dst - src) % n for src, dst in perm}
  return (axes[0], shifts.pop()) if len(shifts) == 1 and len(perm) == n else None


def ring_axes(graph: ir.Graph, mesh: ir.Mesh) -> frozenset:
  """The mesh axes some ring of collective-permutes passes tiles round."""
  return frozenset(found[0] for op in graph.walk() if op.name == "collective_permute"
                   for found in [ring_shift(op, mesh)] if found is not None)


def _renamed(l: Layout, names: dict[str, str]) -> Layout:
  """``l`` with mesh axes renamed (rotated ones keep their turn)."""
  def rename(a: str) -> str:
    base = axis_base(a)
    return a if base not in names else names[base] + a[len(base):]
  return l.with_(dims=tuple(tuple(rename(a) for a in axes) for axes in l.dims),
                 partial=tuple(rename(a) for a in l.partial),
                 at=tuple((rename(a), c) for a, c in l.at),
                 filled=l.filled and (l.filled[0], rename(l.filled[1]), l.filled[2]))


def integers_to_float(src: str, dst: str) -> bool:
  """Is ``dst`` a float type and ``src`` an integer one (not a boolean)?  A
  float iota is its integer index converted (StableHLO's iota), so an
  integer iota converted to ``dst`` counts as one of ``dst``."""
  return is_integer_type(src) and src not in ("pred", "i1") and dst.startswith(("f", "bf"))


def invertible_scale(c: Optional[float]) -> bool:
  """Is ``x * c`` undone by ``/ c`` (in real arithmetic, as every scale is)?
  Not for 0, nor for infinities and NaN (an erf_inv's ``x * inf`` at |x| = 1),
  nor where 1 / c overflows."""
  return c is not None and c != 0 and math.isfinite(c) and math.isfinite(1.0 / c)


def _flip_if_negative(l: Layout, c: float) -> Layout:
  """max_r(c * d_r) = c * min_r(d_r) when c < 0: the combine flips, too."""
  if c < 0 and l.partial_kind in ("max", "min"):
    return l.with_(partial_kind={"max": "min", "min": "max"}[l.partial_kind])
  return l


class Transfer:
  def __init__(self, deg: DistEGraph, arith: RankArithmetic, mesh: ir.Mesh, graph: ir.Graph):
    self.deg = deg
    self.arith = arith
    self.mesh = mesh
    self._tables: dict = {}  # partition_id_table's memo
    # Per-device `add(iota, offset)`: the candidates for tiles of a sequential iota.
    self.iota_adds = [
        op for op in graph.ops
        if op.name == "add" and any(v.producer is not None and v.producer.name == "iota"
                                    for v in op.operands)]
    self._rings: Optional[frozenset] = None
    self.graph = graph
    self._users = None
    self._ring_writes: Optional[tuple[dict, dict]] = None
    self._zeros: Optional[ZeroFacts] = None
    self._rank_tables: Optional[RankTables] = None

  @property
  def rank_tables(self) -> RankTables:
    """Rank-by-rank tables (rank_tables.py), made on first use."""
    if self._rank_tables is None:
      self._rank_tables = RankTables(self.deg, self.mesh, self.users, self._tables)
    return self._rank_tables

  @property
  def zeros(self) -> ZeroFacts:
    """Where each per-device value is known zero (zeros.py), read on first use."""
    if self._zeros is None:
      self._zeros = ZeroFacts(self.deg, self.mesh, self.graph, self.rank_predicate)
    return self._zeros

  @property
  def rings(self) -> frozenset:
    """The axes a ring turns round: those of ring permutes, and those of
    positions offset by a ring's ``((r + j) mod n) * size`` (a mask for the
    blocks in hand, even where a bug sends them round another axis).  Read on
    first use, like ``ring_writes``."""
    if self._rings is None:
      offsets = set()
      for op in self.iota_adds:
        iota_v, off_v = op.operands
        if iota_v.producer is None or iota_v.producer.name != "iota":
          iota_v, off_v = off_v, iota_v
        size = iota_v.shape[iota_v.producer.attrs["iota_dimension"]]
        turn = self.arith.rotated_tile(broadcast_scalar(off_v), size)
        if turn is not None and turn[1]:  # (turned: a plain r * size is no ring)
          offsets.add(turn[0])
      self._rings = ring_axes(self.graph, self.mesh) | frozenset(offsets)
    return self._rings

  # Per-device `dynamic_update_slice`s writing one tile at a ring's offset:
  # op -> (dim, axis, j), and by the classes of their buffer and update.  Read
  # on first use: a loop body's inference learns its invariant carries (the
  # offsets jax hoists out of the loop) after this object is made.
  @property
  def ring_writes(self) -> dict[int, tuple[int, str, int]]:
    return self._ring_write_index()[0]

  @property
  def ring_writes_by_class(self) -> dict[int, list[ir.Op]]:
    return self._ring_write_index()[1]

  def _ring_write_index(self) -> tuple[dict, dict]:
    if self._ring_writes is None:
      writes = {} if not self.rings else {
          id(op): w for op in self.graph.ops if op.name == "dynamic_update_slice"
          for w in [self._written_tile(op)] if w is not None}
      by_class: dict[int, list[ir.Op]] = {}
      for op in self.graph.ops:
        if id(op) in writes:
          for v in op.operands[:2]:
            by_class.setdefault(self.deg.of(v), []).append(op)
      self._ring_writes = writes, by_class
    return self._ring_writes

  # Rules that read dimension numbers of the per-device value: they need its
  # shape to be the tile's exactly, not merely equal up to unit dims.
  _DIMENSIONAL = {"all_gather", "reduce_scatter", "all_to_all", "dynamic_slice",
                  "dynamic_update_slice"}

  # Rules sound on rotated axes (they never read which tile a rank holds);
  # partly known layouts only grow through ``fill_union``.
  _READ_ROTATED = {"collective_permute", "dynamic_update_slice", "multiply", "divide"}

  def apply(self, op: ir.Op, cls: int, layout: Layout,
            tile_shape: Optional[tuple[int, ...]] = None) -> Iterator[tuple[int, Layout, str]]:
    """New relations for ``op``'s result, given ``S ~ layout of cls`` where S's
    tile has shape ``tile_shape`` (None: unknown)."""
    rule = getattr(self, f"_{op.name}", None)
    if (self.rank_tables.starts_at(op) or self.rank_tables.starts_before(op)) and \
        op.operands[0].shape == tile_shape and self.deg.of(op.operands[0]) == cls:
      # A reshard or gather some ranks take no part in (XLA's half permute,
      # a tree of ppermutes, a pad): followed rank by rank until it reads
      # as a layout again.
      for out, new in self.rank_tables.walk(op, cls, layout, tile_shape):
        if new.is_valid():
          yield out, new, "rank-by-rank"
    if rule is None or not op.results:
      return
    if not layout.is_plain() and (layout.filled or layout.halo
                                  or op.name not in self._READ_ROTATED):
      return
    related = op.operands[1] if op.name == "dynamic_update_slice" else op.operands[0]
    how = op.name.replace("_", "-")
    if op.name in self._DIMENSIONAL and tile_shape != related.shape:
      if op.name in self._LIFTABLE and tile_shape is not None:
        for new in self._lifted(op, cls, layout, tile_shape, related.shape, rule):
          yield self.deg.of(op.results[0]), new, how
      return
    for new in rule(op, cls, layout) or ():
      if new is not None and new.is_valid():
        yield self.deg.of(op.results[0]), new, how

  # Collectives keep the rank: run on a value that holds the tile with other
  # unit dims, they are read over that value's dims and the result read back.
  _LIFTABLE = {"all_gather", "reduce_scatter", "all_to_all"}

  def _lifted(self, op, cls, layout: Layout, tile, held, rule) -> Iterator[Layout]:
    """The rule on a value equal to the tile up to unit dims (unit_dims.py):
    the relation read over the value's dims, the result's read back over the
    tile's, kept only if the result again equals its tile up to unit dims."""
    result = op.results[0].shape
    whole = layout.whole_shape(tile, self.mesh)
    for where, lifted in unit_dim_lifts(layout, tile, held):
      for new in rule(op, cls, lifted) or ():
        if new is None or not new.is_valid():
          continue
        lowered = lower_lifted(new, where)
        if lowered is None or not lowered.is_valid():
          continue
        local = lowered.local_shape(whole, self.mesh)
        mapped = {j for j in where if j is not None}
        if local is None or any(result[j] != 1 for j in range(len(result)) if j not in mapped) \
            or any(local[i] != (1 if j is None else result[j]) for i, j in enumerate(where)):
          continue
        yield lowered

  # -- collectives -------------------------------------------------------------
  def _all_reduce(self, op, cls, l: Layout):
    axes, kind = op.attrs.get("gg.axes"), op.attrs.get("gg.reduction")
    if axes is None or kind is None or len(op.operands) != 1:
      return
    if set(axes) & l.pinned_axes():
      return  # the ranks the relation says nothing of join in
    partial = set(l.partial)
    scale = l.scale
    for a in axes:
      if a in partial:
        if kind != l.partial_kind:
          return
        partial.discard(a)
      elif a in l.split_axes():
        return  # summing different tiles: no clean relation
      elif kind == "sum":
        scale /= self.mesh.axis_size(a)  # n identical copies summed
      elif kind == "mul":
        return
    yield l.with_(partial=tuple(partial), scale=scale)

  def _all_gather(self, op, cls, l: Layout):
    axes, k = op.attrs.get("gg.axes"), op.attrs.get("all_gather_dimension")
    if not axes or k is None or set(axes) & (set(l.partial) | l.pinned_axes()):
      return
    have = l.dims[k]
    if have[len(have) - len(axes):] != tuple(axes):
      return
    dims = list(l.dims)
    dims[k] = have[:len(have) - len(axes)]
    yield l.with_(dims=tuple(dims))

  def _reduce_scatter(self, op, cls, l: Layout):
    axes, k = op.attrs.get("gg.axes"), op.attrs.get("scatter_dimension")
    if not axes or k is None or op.attrs.get("gg.reduction") != "sum" or \
        set(axes) & l.pinned_axes():
      return
    partial, scale = set(l.partial), l.scale
    for a in axes:
      if a in partial and l.partial_kind == "sum":
        partial.discard(a)
      elif a not in l.used_axes():
        scale /= self.mesh.axis_size(a)
      else:
        return
    dims = list(l.dims)
    dims[k] = dims[k] + tuple(axes)
    yield l.with_(dims=tuple(dims), partial=tuple(partial), scale=scale)

  def _all_to_all(self, op, cls, l: Layout):
    axes = op.attrs.get("gg.axes")
    i, j = op.attrs.get("split_dimension"), op.attrs.get("concat_dimension")
    if not axes or i is None or j is None or set(axes) & (set(l.partial) | l.pinned_axes()):
      return
    if i == j:
      return  # rank g gets piece g of every tile: strided, not a tile
    have = l.dims[j]
    if have[len(have) - len(axes):] != tuple(axes):
      return
    dims = list(l.dims)
    dims[j] = have[:len(have) - len(axes)]
    dims[i] = dims[i] + tuple(axes)
    yield l.with_(dims=tuple(dims))

  def _collective_permute(self, op, cls, l: Layout):
    axes, perm = op.attrs.get("gg.axes"), op.attrs.get("gg.permutation")
    renaming = op.attrs.get("gg.renaming")
    if renaming is not None:
      # Rank r holds what the rank with r's coordinates permuted back held:
      # the relation with its axes renamed.
      yield _renamed(l, dict(renaming))
      return
    if not axes or perm is None:
      return
    (axis,) = axes
    pins = dict(l.at)
    if axis in pins:
      moved = dict(perm).get(pins[axis])
      if moved is not None:  # the pinned rank's value now sits at its receiver
        yield l.with_(at=tuple({**pins, axis: moved}.items()))
      return
    n = self.mesh.axis_size(axis)
    receivers = {dst for _, dst in perm}
    if len(receivers) != n:
      return  # some rank receives zeros
    if axis in l.partial:
      return
    if axis not in l.split_axes():
      yield l
      return
    ring = ring_shift(op, self.mesh)
    if ring is None:
      return  # not a ring: the tiles land in no rank order
    s = ring[1]
    # Rank r now holds what r - s held: tile (r - s + j) for an axis turned by j.
    yield l.with_(dims=tuple(tuple(rotated_axis(a, -s, n) if axis_base(a) == axis else a
                                   for a in axes) for axes in l.dims))

  def _select(self, op, cls, l: Layout):
    """``select(p, a, b)`` with ``p`` a function of one mesh coordinate r_x:
    where p picks ``a``, the result is ``a``.  Pinned there (or replicated
    over x) ``a``'s relation holds there; picked at exactly one coordinate
    against zeros everywhere else, the result summed over x is ``a`` (the
    masked psum that ends a pipeline)."""
    pred, on_true, on_false = op.operands
    if self.deg.of(pred) == cls or self.deg.of(on_true) == self.deg.of(on_false):
      return
    picked = self.rank_predicate(pred)
    if picked is None:
      return
    axis, true_at = picked
    is_true = self.deg.of(on_true) == cls
    chosen = true_at if is_true else set(range(self.mesh.axis_size(axis))) - true_at
    other = on_false if is_true else on_true
    pins = dict(l.at)
    if axis in l.used_axes() or not chosen:
      return
    if axis in pins and pins[axis] not in chosen:
      return
    where = [pins[axis]] if axis in pins else sorted(chosen)
    if len(chosen) == self.mesh.axis_size(axis):
      yield l
    else:
      for c in where:  # (what b is at the other ranks, we do not know)
        yield l.with_(at=tuple({**pins, axis: c}.items()), zero_elsewhere=False)
    if len(chosen) != 1 or self.deg.splat(self.deg.of(other)) != 0.0:
      return
    rest = tuple((a, c) for a, c in l.at if a != axis)
    if not rest or l.zero_elsewhere:
      # Zero off r_x == c (and off the other pins, where a was zero): summed
      # over the pinned axes, a partial sum (``Layout.summed_over_pins``).
      yield l.with_(at=tuple({**pins, axis: where[0]}.items()), zero_elsewhere=True)
    elif not l.partial or l.partial_kind == "sum":
      yield l.with_(at=rest, partial=tuple(l.partial) + (axis,), partial_kind="sum")

  def rank_predicate(self, pred: ir.Value) -> Optional[tuple[str, set[int]]]:
    """(x, T) if ``pred`` is a splat of a predicate on the mesh coordinate r_x
    alone: ``compare(e1, e2)`` over rank arithmetic, or ``and`` / ``or`` /
    ``not`` of such predicates on the same axis (a schedule's "microbatch
    t - r in range" is two compares and-ed).  T: the r_x where it holds."""
    op = broadcast_scalar(pred).producer
    if op is None or math.prod(op.results[0].shape) != 1:
      return None
    found = None
    if op.name == "compare":
      found = self._rank_compare(op)
    elif op.name == "not":
      inner = self.rank_predicate(op.operands[0])
      found = inner and (inner[0], set(range(self.mesh.axis_size(inner[0]))) - inner[1])
    elif op.name in ("and", "or"):
      a, b = (self.rank_predicate(v) for v in op.operands)
      if a is not None and b is not None and a[0] == b[0]:
        found = a[0], (a[1] & b[1]) if op.name == "and" else (a[1] | b[1])
    return found or self._rank_predicate_by_table(op.results[0])

  def _rank_predicate_by_table(self, pred: ir.Value) -> Optional[tuple[str, set[int]]]:
    """The predicate evaluated on every partition, where rank arithmetic
    cannot say it symbolically (jnp's floor division and remainder: sympy
    keeps them only where they split at mesh digits), if it depends on one
    mesh coordinate."""
    table = partition_id_table(pred, self.mesh.size, self._tables)
    found = None if table is None else per_coordinate(table, self.mesh)
    return found and (found[0], {c for c, holds in enumerate(found[1]) if holds})

  def _rank_compare(self, op: ir.Op) -> Optional[tuple[str, set[int]]]:
    a, b = (self.arith.value(v) for v in op.operands)
    if a is None or b is None:
      return None
    free = (a - b).free_symbols
    if len(free) > 1:
      return None
    axis = next((name for name, _ in self.mesh.axes if rank_symbol(name) in free), None)
    if axis is None:
      return None
    holds = COMPARISONS.get(op.attrs.get("comparison_direction"))
    if holds is None:
      return None
    diff, sym = a - b, rank_symbol(axis)  # a op b  <=>  a - b op 0 on integers
    return axis, {c for c in range(self.mesh.axis_size(axis))
                  if bool(holds(int(diff.subs(sym, c)), 0))}

  # -- unit dims ---------------------------------------------------------------------
  def _reshape(self, op, cls, l: Layout):
    """A reshape or broadcast that only inserts or drops unit dims keeps every
    element in place: the value still equals the tile up to unit dims (see
    unit_dims.py)."""
    if only_unit_dims_change(op.name, op.attrs, op.operands[0].type, op.results[0].type):
      yield l

  _broadcast_in_dim = _reshape

  # -- rank-dependent slicing ------------------------------------------------------
  def _dynamic_slice(self, op, cls, l: Layout):
    operand, *offsets = op.operands
    if self.deg.of(operand) != cls:
      return
    sizes = op.attrs["slice_sizes"]
    dims = list(l.dims)
    used = set(l.used_axes()) | l.pinned_axes()
    for k, (off_v, size) in enumerate(zip(offsets, sizes)):
      if size == operand.shape[k]:
        continue
      expr = self.arith.value(off_v)
      if expr is None:
        return
      axes = self.tile_axes(expr, size, used)
      if axes is None or operand.shape[k] != size * math.prod(
          self.mesh.axis_size(a) for a in axes):
        return
      dims[k] = dims[k] + axes
      used |= set(axes)
    yield l.with_(dims=tuple(dims))

  def _dynamic_update_slice(self, op, cls, l: Layout):
    """Each rank writes its tile into zeros at offset ``r * size``: summed over
    those ranks the buffers are the whole dim (the transpose of a rank-dependent
    slice, as autodiff writes it).  The tiling over X becomes a partial sum.
    A tile written at its own place in any buffer is known there (a ring)."""
    base, update, *offsets = op.operands
    if self.deg.of(update) != cls or self.deg.of(base) == cls:
      return
    written = self.ring_writes.get(id(op))
    if written is not None:
      known = self._written_known(op, written, l)
      if known is not None:
        yield known
    if not l.is_plain():
      return
    if self.deg.splat(self.deg.of(base)) != 0.0:
      return
    if l.partial and l.partial_kind != "sum":
      return
    dims = list(l.dims)
    partial = list(l.partial)
    used = set(l.used_axes()) | l.pinned_axes()
    for k, (off_v, size, full) in enumerate(zip(offsets, update.shape, base.shape)):
      if size == full:
        continue
      expr = self.arith.value(off_v)
      if expr is None:
        return
      axes = self.tile_axes(expr, size, used - set(dims[k]))
      if axes is None or dims[k][len(dims[k]) - len(axes):] != axes or full != size * math.prod(
          self.mesh.axis_size(a) for a in axes):
        return
      dims[k] = dims[k][:len(dims[k]) - len(axes)]
      partial.extend(axes)
    yield l.with_(dims=tuple(dims), partial=tuple(partial), partial_kind="sum")

  # -- rings: tiles written where they belong -----------------------------------------
  def _written_tile(self, op: ir.Op) -> Optional[tuple[int, str, int]]:
    """(k, x, j) if the dynamic-update-slice ``op`` writes one tile along dim k
    only, at offset ``((r_x + j) mod |x|) * size``."""
    base, update, *offsets = op.operands
    return self._ring_tile(base.shape, update.shape, offsets)

  def _read_tile(self, op: ir.Op) -> Optional[tuple[int, str, int]]:
    """(k, x, j) if the dynamic-slice ``op`` reads one tile along dim k only,
    at a ring's offset (a ring reading what it sends)."""
    operand, *offsets = op.operands
    return self._ring_tile(operand.shape, op.attrs["slice_sizes"], offsets)

  def _ring_tile(self, whole, tile, offsets) -> Optional[tuple[int, str, int]]:
    """(k, x, j) if ``tile`` cuts ``whole`` along dim k only, into |x| tiles,
    at offset ``((r_x + j) mod |x|) * tile[k]``."""
    cut = [k for k, (n, full) in enumerate(zip(tile, whole)) if n != full]
    if len(cut) != 1:
      return None
    (k,) = cut
    found = self.arith.rotated_tile(offsets[k], tile[k])
    if found is None or whole[k] != tile[k] * self.mesh.axis_size(found[0]):
      return None
    return k, found[0], found[1]

  def ring_sums(self, cls: int, l: Layout) -> Iterator[tuple[int, Layout, str]]:
    """A partial sum over a ring axis x, reduce-scattered round the ring (the
    transpose of a ring gather): rank r takes tile r + j of its piece, passes
    it on, adds the tile the next rank took, ...  A per-device value there is
    ``sum over rho in R of G@(r + rho)[tile r + tau]`` (G the related value);
    with R every rank and tau = 0 it is tile r of the whole sum.

    Tracked through the per-device program from G (``ring_terms``):
    dynamic-slices at a ring's offsets start a term (tau = j, R = {0}) unless
    a zero write erased that tile of G first."""
    if l.partial_kind != "sum" or l.at or not l.is_plain():
      return
    for x in set(l.partial) & self.rings:
      erased = {cls: frozenset()}   # G with zeros written over some tiles
      starts: dict[int, set] = {}   # class -> {(k, tau, R)}
      work = [cls]                  # each class is queued once (out not in erased)
      while work:
        c = work.pop()
        for op in self.users.get(c, ()):
          out = self.deg.of(op.results[0]) if op.results else None
          if op.name == "dynamic_slice" and self.deg.of(op.operands[0]) == c:
            read = self._read_tile(op)
            if read is not None and read[1] == x and not l.dims[read[0]] \
                and read[2] not in erased[c]:
              starts.setdefault(out, set()).add((read[0], read[2], frozenset({0})))
          elif op.name == "dynamic_update_slice" and self.deg.of(op.operands[0]) == c:
            written = self.ring_writes.get(id(op))
            if written is not None and written[1] == x and \
                self.deg.splat(self.deg.of(op.operands[1])) == 0.0 and out not in erased:
              erased[out] = erased[c] | {written[2]}
              work.append(out)
      yield from self.ring_terms(starts, l, x)

  def ring_terms(self, starts: dict[int, set], l: Layout, x: str
                 ) -> Iterator[tuple[int, Layout, str]]:
    """Terms ``(k, tau, R)`` of a partial sum G over ring axis x (related by
    ``l``), from the classes ``starts`` holding them: a per-device value
    holding one is ``sum over rho in R of G@(r + rho)[tile r + tau along k]``.
    A ring permute r -> r + s turns (tau, R) by -s; an add of two terms at one
    tau and disjoint R unites them; with R every rank it is tile r + tau of
    the whole sum, the layout this yields."""
    n = self.mesh.axis_size(x)
    terms: dict[int, set] = {c: set(ts) for c, ts in starts.items()}
    work = [(c, t) for c, ts in starts.items() for t in ts]
    steps = 0
    while work and steps < 4096:
      steps += 1
      c, (k, tau, R) = work.pop()
      for op in self.users.get(c, ()):
        out = self.deg.of(op.results[0]) if op.results else None
        found = []
        ring = ring_shift(op, self.mesh) if op.name == "collective_permute" else None
        if ring is not None and ring[0] == x:
          s_ = ring[1]
          found.append((k, (tau - s_) % n, frozenset((p - s_) % n for p in R)))
        elif op.name == "add" and len(op.operands) == 2:
          a, b = (self.deg.of(v) for v in op.operands)
          other = b if a == c else a
          for k2, tau2, R2 in terms.get(other, ()):
            if (k2, tau2) == (k, tau) and not R & R2:
              found.append((k, tau, R | R2))
        for t in found:
          if t in terms.setdefault(out, set()):
            continue
          terms[out].add(t)
          work.append((out, t))
          k2, tau2, R2 = t
          if len(R2) == n:
            dims = list(l.dims)
            dims[k2] = (rotated_axis(x, tau2, n),)
            yield out, l.with_(dims=tuple(dims), partial=tuple(
                a for a in l.partial if a != x)), "ring-reduce-scatter"

  @property
  def users(self) -> dict[int, list[ir.Op]]:
    """The per-device ops reading each class (inference reads this one too)."""
    if self._users is None:
      self._users = op_users(self.graph, self.deg)
    return self._users

  def _written_known(self, op, written, l: Layout) -> Optional[Layout]:
    """The update tiled along dim k by exactly x turned by j, written at tile
    r_x + j: the buffer knows that tile."""
    k, axis, j = written
    n = self.mesh.axis_size(axis)
    if l.filled or l.dims[k] != (rotated_axis(axis, j, n),):
      return None
    dims = l.dims[:k] + ((),) + l.dims[k + 1:]
    return l.with_(dims=dims, filled=(k, axis, (j,)) if n > 1 else ())

  def fill_union(self, op: ir.Op, base_layout: Layout, update_layout: Layout
                 ) -> Optional[Layout]:
    """``dus(buffer, tile, ring offset)`` with the buffer partly known: it knows
    its old tiles and the one written (which overwrote only that tile)."""
    written = self.ring_writes.get(id(op))
    if written is None or not base_layout.filled:
      return None
    known = self._written_known(op, written, update_layout)
    if known is None or known.with_(filled=()) != base_layout.with_(filled=()):
      return None
    k, axis, shifts = base_layout.filled
    if known.filled[:2] != (k, axis):
      return None
    union = tuple(sorted(set(shifts) | set(known.filled[2])))
    whole = len(union) == self.mesh.axis_size(axis)
    return base_layout.with_(filled=() if whole else (k, axis, union))

  def _add(self, op, cls, l: Layout):
    """``a + b`` with b zero wherever a's relation holds (at its pins; at every
    rank if unpinned) is a there: a stage's cotangent plus the zeros another
    stage sent in a bubble.  Zero elsewhere only if b is zero everywhere."""
    a, b = op.operands
    if self.deg.of(a) == self.deg.of(b):
      return
    other = b if self.deg.of(a) == cls else a
    zeros = self.zeros.of(self.deg.of(other))
    if covers(zeros, l.at):
      yield l if covers(zeros, ()) else l.with_(zero_elsewhere=False)

  def _multiply(self, op, cls, l: Layout):
    c = self._splat_operand(op, cls)
    if invertible_scale(c):
      yield _flip_if_negative(l, c).scaled(1.0 / c)

  def _divide(self, op, cls, l: Layout):
    if self.deg.of(op.operands[0]) == cls:
      c = self._splat_operand(op, cls)
      if invertible_scale(c):
        yield _flip_if_negative(l, c).scaled(c)

  def _splat_operand(self, op, cls) -> Optional[float]:
    if len(op.operands) != 2 or not op.results[0].type.dtype.startswith(("f", "bf")):
      return None
    a, b = op.operands
    other = b if self.deg.of(a) == cls else a
    if self.deg.of(other) == cls:
      return None
    return self.deg.splat(self.deg.of(other))  # constants folded in the e-graph too

  # -- helpers -------------------------------------------------------------------
  def tile_axes(self, expr: sympy.Expr, size: int, used: set[str]) -> Optional[tuple[str, ...]]:
    """The axes X with ``expr == tile_index(X) * size``, major to minor, if any."""
    expr = sympy.expand(expr)
    if expr == 0:
      return None
    try:
      poly = sympy.Poly(expr, *self.arith.bounds)
    except sympy.PolynomialError:
      return None
    if poly.total_degree() != 1 or poly.coeff_monomial(1) != 0:
      return None
    coeffs = {}
    for name, n in self.mesh.axes:
      c = int(poly.coeff_monomial(rank_symbol(name)))
      if c:
        if n == 1:
          continue  # r is always 0 on a size-1 axis
        if name in used:
          return None
        coeffs[name] = c
    order = sorted(coeffs, key=lambda a: -coeffs[a])
    stride = size
    for a in reversed(order):
      if coeffs[a] != stride:
        return None
      stride *= self.mesh.axis_size(a)
    return tuple(order)

  def offset_iotas(self, seq_type: ir.TensorType, attrs: dict
                   ) -> Iterator[tuple[int, Layout]]:
    """Per-device ``iota(k) + r*n`` that tile the sequential ``iota(k)`` (positions)."""
    k = attrs["iota_dimension"]
    for op in self.iota_adds:
      iota_v, off_v = op.operands
      if iota_v.producer is None or iota_v.producer.name != "iota":
        iota_v, off_v = off_v, iota_v
      if iota_v.producer.attrs.get("iota_dimension") != k:
        continue
      tile = self._as_dtype(op.results[0], seq_type.dtype, seq_type.shape[k])
      if tile is None:
        continue
      local = op.results[0].type.shape
      if len(local) != len(seq_type.shape):
        continue
      scalar = broadcast_scalar(off_v)
      expr = self.arith.value(scalar)
      axes = None if expr is None else self.tile_axes(expr, local[k], set())
      if axes is None:
        # A ring's block offset, ((r_x + j) mod |x|) * n: tile x+j.
        turn = self.arith.rotated_tile(scalar, local[k])
        if turn is None:
          continue
        axes = (rotated_axis(turn[0], turn[1], self.mesh.axis_size(turn[0])),)
      dims: list[tuple[str, ...]] = [() for _ in local]
      dims[k] = axes
      if local[k] * math.prod(self.mesh.axis_size(a) for a in axes) != seq_type.shape[k]:
        continue
      if any(local[d] != seq_type.shape[d] for d in range(len(local)) if d != k):
        continue
      yield self.deg.of(tile), Layout(tuple(dims))

  def _as_dtype(self, v: ir.Value, dtype: str, length: int) -> Optional[ir.Value]:
    """``v``, or its convert to ``dtype`` when ``v`` holds integers and
    ``dtype`` is a float type: a float iota is its integer index converted
    (StableHLO's iota), so ``convert(iota + r*n)`` is its tile as the
    integer one is (``jnp.arange(n) + offset`` then ``astype``), provided
    the integers count to ``length - 1`` without wrapping (an int8 iota
    plus 120 wraps to -128; the float iota does not)."""
    if v.type.dtype == dtype:
      return v
    if not integers_to_float(v.type.dtype, dtype) or length - 1 > type_bounds(v.type.dtype)[1]:
      return None
    return next((u.results[0] for u in self.users.get(self.deg.of(v), ())
                 if u.name == "convert" and u.results[0].type.dtype == dtype), None)

