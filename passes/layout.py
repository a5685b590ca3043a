"""Layouts: how a sequential tensor is rebuilt from one distributed value.

A ``Layout`` is the relation type of the paper, in a form that stays flat in the
number of ranks.  For a sequential tensor ``S`` and a value ``d`` of the
per-device program (``d@r`` is its value at rank ``r``, a mesh coordinate),
``S ~ Layout(dims, partial, scale) of d`` means, for EVERY rank ``r``::

    tile(S, r) == scale * SUM over r' agreeing with r off the partial axes of d@r'

where ``tile(S, r)`` is the block of ``S`` whose index along dimension ``i`` is
the mixed-radix number formed by ``r``'s coordinates on the axes ``dims[i]``
(major to minor).  Mesh axes that appear in neither ``dims`` nor ``partial`` are
replicated: ``d@r`` itself (each summand, not only the sum) is the same along
them.  That stronger reading is what ``shard`` builds and what every rule
keeps; an all-reduce max over a replicated axis of a partial sum relies on it.  The clean expression this stands for is concat-over-ranks (``dims``),
sum-over-ranks (``partial``) and pick-one-replica (the rest); ``scale`` other
than 1 is never clean, it is kept only to say *how* an output is wrong.

``at`` pins mesh coordinates, ``(("pp", 2),)``: the relation holds only at the
ranks with those coordinates and says nothing of the others (a pipeline
stage's activations are the sequential ones on that stage's ranks only).  An
axis in ``at`` is in neither ``dims`` nor ``partial``.  A local op of pinned
operands is pinned alike; a collective-permute moves the pin; a select on
``r_pp == 2`` against zeros makes it a partial sum over "pp" (the value at
stage 2, zeros elsewhere, summed by the all-reduce that follows).

``zero_elsewhere`` strengthens a pin: the value is exactly zero at every rank
the pins do not speak of.  That is what the masked psum's transpose hands a
pipeline's backward pass (the cotangent at the last stage, zeros elsewhere); an
op whose result is zero when some operands are (a product, a matmul, a sum of
two such values) keeps it, and it lets a stage's gradient be padded into its
own tile of a stack (``lemmas.py``).  It reads the per-device program in real
arithmetic: ``0 * x`` is 0 for the values the other stages compute, which are
finite.  Summed over its pinned axes it is the partial-sum layout above.

``order = ((k, chunks), ...)`` says dim ``k`` of ``S`` is cut into
``len(chunks)`` equal chunks put in the order ``chunks`` *before* the rest
of the layout reads it: the relation is of ``reorder(S)``, not of ``S``.
Zig-zag context parallelism gives rank ``r`` of ``n`` chunks ``r`` and
``2n - 1 - r``: ``chunks = (0, 7, 1, 6, 2, 5, 3, 4)`` tiled over the ranks
(``chunk_order.py`` finds such layouts and carries them).  Ordered layouts
are *not plain*, and lemmas read them only through ``chunk_order.py``.

A ring of collective-permutes turns tiles: after ``t`` steps of ``r -> r + 1``
along "cp" rank ``r`` holds tile ``r - t``.  A *rotated axis* names that,
``cp+3`` (on 4 ranks): its coordinate at rank ``r`` is ``(r_cp + 3) mod 4``.
It may tile a dim like any axis; it is never partial or pinned, and no other
form of its base axis may tile the same dim.  An axis (turned or not) may tile
several dims: the blocks ``(r, r + j)`` on a ring's ``j``-th diagonal.

``filled = (k, x, shifts)`` says a dim is only partly known: dim ``k`` is held
whole, but only its tiles ``(r_x + j) mod |x|`` for ``j`` in ``shifts`` (in
tiles of ``|x|``) are the sequential ones; the rest is anything.  That is what
a ring writing the tiles it receives into a buffer has after some steps; with
every shift it is the plain layout.  Rotated, diagonal and filled layouts are
*not plain*: collectives, loops and outputs never read them (only the ring
rules of ``transfer.py`` do); lemmas read all but the filled ones.

``halo = ((k, lo, hi), ...)`` says each rank holds its tile of dim ``k``
extended by ``lo`` elements before and ``hi`` after: its neighbours' edge
rows, zeros beyond the ends of ``S`` (the zero padding a convolution reads).
That is what a halo exchange builds for a convolution over a dim split over
ranks (a ppermute of each tile's last rows to the next rank, concatenated
before its own); ``rank_tables.py`` reads it off the ops.  A halo is at most
a tile wide, on a dim tiled by unrotated axes, pins, partly known tiles and
reordered chunks aside.  Haloed layouts are not plain; lemmas read them only
where they say so (``Lemma.reads_halos``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Optional

import numpy as np

from graphguard_hlo.ir import Mesh, axis_base, axis_shift, merged_axis_names, sub_axis

Axes = tuple[str, ...]
SCALE_RTOL = 1e-5  # float constants: 1/sqrt(d) in f32 vs an exact rational


def scales_equal(a: float, b: float) -> bool:
  return math.isclose(a, b, rel_tol=SCALE_RTOL, abs_tol=0.0)


@dataclasses.dataclass(frozen=True)
class Layout:
  dims: tuple[Axes, ...]
  partial: Axes = ()          # sorted axes summed over
  partial_kind: str = "sum"   # "sum" | "max" | "min": how partial axes combine
  scale: float = 1.0
  at: tuple[tuple[str, int], ...] = ()  # sorted (axis, coordinate) pins
  zero_elsewhere: bool = False  # with pins: zeros at every other rank
  filled: tuple = ()          # () or (dim, axis, sorted shifts): tiles known
  order: tuple = ()           # sorted (dim, chunks): dims reordered before tiling
  halo: tuple = ()            # sorted (dim, lo, hi): tiles extended by neighbours' rows

  @staticmethod
  def replicated(rank: int) -> "Layout":
    return Layout(tuple(() for _ in range(rank)))

  def __post_init__(self):
    object.__setattr__(self, "partial", tuple(sorted(self.partial)))
    if len(self.at) > 1 or not isinstance(self.at, tuple):
      object.__setattr__(self, "at", tuple(sorted(self.at)))
    if not self.partial:
      object.__setattr__(self, "partial_kind", "sum")
    if len(self.order) > 1:
      object.__setattr__(self, "order", tuple(sorted(self.order)))
    if len(self.halo) > 1:
      object.__setattr__(self, "halo", tuple(sorted(self.halo)))

  # -- queries ---------------------------------------------------------------
  @property
  def rank(self) -> int:
    return len(self.dims)

  def split_axes(self) -> set[str]:
    """The mesh axes tiling some dim (rotated ones by their base)."""
    return {axis_base(a) for d in self.dims for a in d}

  def used_axes(self) -> set[str]:
    return self.split_axes() | set(self.partial)

  def pinned_axes(self) -> set[str]:
    return {a for a, _ in self.at}

  def holds_at(self, coord: dict[str, int]) -> bool:
    """Does the relation speak of the rank at these mesh coordinates?"""
    return all(coord[a] == c for a, c in self.at)

  def is_valid(self) -> bool:
    if self.zero_elsewhere and not self.at:
      return False
    tiling = [a for d in self.dims for a in d]
    others = list(self.partial) + [a for a, _ in self.at]
    if any(axis_base(a) != a for a in others):
      return False  # rotations only tile
    if self.filled:
      k, axis, _ = self.filled
      if self.dims[k] or axis_base(axis) != axis:
        return False
      others.append(axis)  # the tiles it speaks of are along this axis
    if any(len({axis_base(a) for a in d}) != len(d) for d in self.dims):
      return False
    if len({k for k, _ in self.order}) != len(self.order) or any(
        not 0 <= k < self.rank or sorted(chunks) != list(range(len(chunks)))
        for k, chunks in self.order):
      return False
    if self.halo and not self._halo_is_valid():
      return False
    # An axis may tile several dims, as is or turned (the diagonal blocks a
    # ring visits); partial and pinned axes are used nowhere else.
    bases = {axis_base(a) for a in tiling}
    return len(others) == len(set(others)) and not bases & set(others)

  def _halo_is_valid(self) -> bool:
    if self.at or self.filled or self.order:
      return False
    dims = [k for k, _, _ in self.halo]
    return len(set(dims)) == len(dims) and all(
        0 <= k < self.rank and self.dims[k] and all(axis_base(a) == a for a in self.dims[k])
        and lo >= 0 and hi >= 0 and lo + hi > 0 for k, lo, hi in self.halo)

  def is_plain(self) -> bool:
    """Each axis tiles one dim, unturned, and every dim is known: a concat
    over ranks, what collectives, loops and outputs read."""
    if self.filled or self.order or self.halo:
      return False
    tiling = [a for d in self.dims for a in d]
    return len(tiling) == len(set(tiling)) and all(axis_base(a) == a for a in tiling)

  def is_clean(self) -> bool:
    return scales_equal(self.scale, 1.0)

  def is_full_replica(self) -> bool:
    return not self.split_axes() and not self.partial and not self.at

  def local_shape(self, global_shape: Iterable[int], mesh: Mesh) -> Optional[tuple[int, ...]]:
    out = []
    for size, axes in zip(global_shape, self.dims):
      n = math.prod(mesh.axis_size(a) for a in axes)
      if size % n:
        return None
      out.append(size // n)
    for k, lo, hi in self.halo:
      if max(lo, hi) > out[k]:
        return None  # (rows from beyond the next rank)
      out[k] += lo + hi
    return tuple(out)

  def whole_shape(self, tile: Iterable[int], mesh: Mesh) -> tuple[int, ...]:
    """The sequential shape whose tile is ``tile`` (``local_shape``'s inverse)."""
    tile = list(tile)
    for k, lo, hi in self.halo:
      tile[k] -= lo + hi
    return tuple(n * math.prod(mesh.axis_size(a) for a in axes)
                 for n, axes in zip(tile, self.dims))

  def with_(self, **kw) -> "Layout":
    return dataclasses.replace(self, **kw)

  def scaled(self, factor: float) -> "Layout":
    return self.with_(scale=self.scale * factor)

  def unpinned(self) -> "Layout":
    """The relation as it reads at the pinned ranks, pins dropped."""
    return self.with_(at=(), zero_elsewhere=False) if self.at else self

  def summed_over_pins(self) -> Optional["Layout"]:
    """Zeros off the pinned ranks: summed over the pinned axes, only the pinned
    rank counts, so the value is a partial sum over them (None if it is a
    max or min already)."""
    if not self.zero_elsewhere or (self.partial and self.partial_kind != "sum"):
      return None
    return self.with_(at=(), zero_elsewhere=False, partial_kind="sum",
                      partial=tuple(self.partial) + tuple(a for a, _ in self.at))

  # -- text -----------------------------------------------------------------
  def describe(self, value_name: str, mesh: Optional[Mesh] = None) -> str:
    """The clean expression, e.g. ``sum[tp](concat[dim1:dp](%3@r))``; parts of
    one axis named apart (sub-axes of ``mesh``) are joined where they spell it."""
    expr = f"{value_name}@r"
    if self.partial:
      expr = f"{self.partial_kind}[{','.join(_partial_names(self.partial, mesh))}]({expr})"
    split = [f"dim{i}:{','.join(merged_axis_names(axes, mesh))}"
             for i, axes in enumerate(self.dims) if axes]
    if split:
      expr = f"concat[{' '.join(split)}]({expr})"
    if not split and not self.partial:
      expr = f"replica({expr})"
    if self.at:
      zeros = "; 0 elsewhere" if self.zero_elsewhere else ""
      expr = f"at[{','.join(f'{a}={c}' for a, c in self.at)}{zeros}]({expr})"
    if self.filled:
      k, axis, shifts = self.filled
      expr = f"known[dim{k}: tiles {axis}+{{{','.join(map(str, shifts))}}}]({expr})"
    for k, chunks in self.order:
      expr = f"chunks[dim{k}: {' '.join(map(str, chunks))}]({expr})"
    for k, lo, hi in self.halo:
      expr = f"halo[dim{k}: {lo} before, {hi} after]({expr})"
    if not self.is_clean():
      expr = f"{self.scale:g} * {expr}"
    return expr

  def __str__(self) -> str:
    return self.describe("d")


def _partial_names(axes: Axes, mesh: Optional[Mesh]) -> list[str]:
  """The axes a partial value is summed over (a set), sub-axes of one axis
  put major to minor beside the first of them so that runs merge."""
  def key(a: str):
    part = sub_axis(a)
    base = part[0] if part else a
    first = next(i for i, b in enumerate(axes) if (sub_axis(b) or (b,))[0] == base)
    return first, part[1] if part else 0
  return merged_axis_names(sorted(axes, key=key), mesh)


def merged_pins(*pin_sets) -> Optional[tuple[tuple[str, int], ...]]:
  """The ranks all the relations with these pins speak of, as pins; None if
  they pin one axis to two coordinates (no rank holds both)."""
  pins: dict[str, int] = {}
  for pin_set in pin_sets:
    for a, c in pin_set:
      if pins.setdefault(a, c) != c:
        return None
  return tuple(sorted(pins.items()))


# -- numeric semantics, for tests and cross-checks ------------------------------

def tilings_with_local_shape(global_shape: tuple[int, ...], local_shape: tuple[int, ...],
                             mesh: Mesh, limit: int = 16) -> list[Layout]:
  """Every plain tiling (no partial sums) that cuts ``global_shape`` into
  ``local_shape`` tiles, at most ``limit``: the layouts a splat may have."""
  if len(global_shape) != len(local_shape):
    return []
  axes = [a for a, n in mesh.axes if n > 1]
  per_dim = []
  for g, l in zip(global_shape, local_shape):
    if l == 0 or g % l:
      return []
    ratio = g // l
    per_dim.append([combo for k in range(len(axes) + 1)
                    for combo in itertools.permutations(axes, k)
                    if math.prod(mesh.axis_size(a) for a in combo) == ratio])
  out = []
  for dims in itertools.product(*per_dim):
    flat = [a for d in dims for a in d]
    if len(flat) == len(set(flat)):
      out.append(Layout(tuple(dims)))
      if len(out) >= limit:
        break
  return out


def reorder_chunks(x: np.ndarray, dim: int, chunks: tuple[int, ...]) -> np.ndarray:
  """``x`` with its dim ``dim`` cut into ``len(chunks)`` chunks, put in the
  order ``chunks`` (the ``order`` of a layout)."""
  pieces = np.split(np.asarray(x), len(chunks), axis=dim)
  return np.concatenate([pieces[c] for c in chunks], axis=dim)


def restore_chunk_order(x: np.ndarray, dim: int, chunks: tuple[int, ...]) -> np.ndarray:
  """``reorder_chunks``' inverse."""
  inverse = tuple(int(i) for i in np.argsort(chunks))
  return reorder_chunks(x, dim, inverse)


def tile_coordinate(axis: str, r: dict[str, int], mesh: Mesh) -> int:
  """Rank ``r``'s coordinate on a (possibly rotated) axis."""
  return (r[axis_base(axis)] + axis_shift(axis)) % mesh.axis_size(axis)


def tile_index(axes: Axes, r: dict[str, int], mesh: Mesh) -> int:
  """The mixed-radix tile number ``axes`` give rank ``r`` (major to minor)."""
  idx = 0
  for a in axes:
    idx = idx * mesh.axis_size(a) + tile_coordinate(a, r, mesh)
  return idx


def tile_slices(layout: Layout, mesh: Mesh, shape: tuple[int, ...], r: dict[str, int]
                ) -> tuple[slice, ...]:
  """Where rank ``r``'s tile lies in a (reordered) tensor of ``shape``."""
  index = []
  for size, axes in zip(shape, layout.dims):
    n = math.prod(mesh.axis_size(a) for a in axes)
    i = tile_index(axes, r, mesh)
    index.append(slice(i * (size // n), (i + 1) * (size // n)))
  return tuple(index)


def known_tiles(layout: Layout, r: dict[str, int], mesh: Mesh) -> Optional[tuple[int, set[int], int]]:
  """For a partly known layout: (dim, the tile numbers rank r knows, tiles in the dim)."""
  if not layout.filled:
    return None
  k, axis, shifts = layout.filled
  n = mesh.axis_size(axis)
  return k, {(r[axis] + j) % n for j in shifts}, n


def assemble(layout: Layout, mesh: Mesh, local_at: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
  """The sequential tensor a layout says the per-rank values ``local_at`` stand for.

  ``local_at`` maps every mesh coordinate (a tuple, one entry per mesh axis) to
  that rank's value.  Checks the replicated and partial claims along the way
  and raises ``AssertionError`` if the ranks disagree.  Of a partly known
  layout (``filled``) only the known tiles are rebuilt; the rest is NaN.
  A haloed layout's halo rows are checked against the neighbours' tiles.
  """
  if layout.halo:
    return assemble(layout.with_(halo=()), mesh, _without_halos(layout, mesh, local_at))
  names = mesh.axis_names
  sizes = dict(mesh.axes)
  tiles: dict[tuple[int, ...], np.ndarray] = {}
  for coord in np.ndindex(*[s for _, s in mesh.axes]):
    r = dict(zip(names, coord))
    if not layout.holds_at(r):
      if layout.zero_elsewhere:
        np.testing.assert_array_equal(local_at[coord], 0.0, err_msg=f"not zero at {r}")
      continue  # the relation says nothing else of this rank
    total = None
    for pcoord in np.ndindex(*[sizes[a] for a in layout.partial]):
      rr = dict(r, **dict(zip(layout.partial, pcoord)))
      v = np.asarray(local_at[tuple(rr[n] for n in names)], dtype=np.float64)
      if total is None:
        total = v
      elif layout.partial_kind == "sum":
        total = total + v
      elif layout.partial_kind == "max":
        total = np.maximum(total, v)
      else:
        total = np.minimum(total, v)
    total = layout.scale * total
    known = known_tiles(layout, r, mesh)
    if known is not None:
      k, which, n = known
      pieces = np.split(total, n, axis=k)
      total = np.concatenate([p if j in which else np.full_like(p, np.nan)
                              for j, p in enumerate(pieces)], axis=k)
    key = tuple(tile_index(axes, r, mesh) for axes in layout.dims)
    if key in tiles:
      both = ~np.isnan(tiles[key]) & ~np.isnan(total)
      np.testing.assert_allclose(tiles[key][both], total[both], rtol=1e-6, atol=1e-6)
      tiles[key] = np.where(np.isnan(tiles[key]), total, tiles[key])
    else:
      tiles[key] = total
  counts = [math.prod(mesh.axis_size(a) for a in axes) for axes in layout.dims]
  blocks = np.empty(counts, dtype=object)
  for key, tile in tiles.items():
    blocks[key] = tile
  if layout.rank and len(tiles) < blocks.size:
    # An axis tiling two dims (a ring's diagonal blocks) leaves the other
    # blocks unknown.
    unknown = np.full(next(iter(tiles.values())).shape, np.nan)
    for key in np.ndindex(*counts):
      if blocks[key] is None:
        blocks[key] = unknown
  whole = np.block(blocks.tolist()) if layout.rank else blocks[()]
  for k, chunks in layout.order:
    whole = restore_chunk_order(whole, k, chunks)
  return whole


def shard(layout: Layout, mesh: Mesh, value: np.ndarray, rng: np.random.Generator | None = None
          ) -> dict[tuple[int, ...], np.ndarray]:
  """Per-rank values that ``assemble`` turns back into ``value`` (random partial
  splits; random where a partly known layout knows nothing)."""
  if layout.halo:
    return _with_halos(layout, mesh, shard(layout.with_(halo=()), mesh, value, rng))
  names = mesh.axis_names
  sizes = dict(mesh.axes)
  out = {}
  rng = rng or np.random.default_rng(0)
  for k, chunks in layout.order:
    value = reorder_chunks(value, k, chunks)
  n_partial = math.prod(sizes[a] for a in layout.partial)
  # One random split of value/scale into n_partial summands, shared by all ranks
  # that hold the same tile.
  pieces: dict[tuple, list[np.ndarray]] = {}
  for coord in np.ndindex(*[s for _, s in mesh.axes]):
    r = dict(zip(names, coord))
    index = tile_slices(layout, mesh, value.shape, r)
    tile = np.asarray(value, dtype=np.float64)[tuple(index)] / layout.scale
    if not layout.holds_at(r):
      # unrelated: anything (zeros if the layout says so)
      out[coord] = np.zeros(tile.shape) if layout.zero_elsewhere else rng.standard_normal(tile.shape)
      continue
    key = tuple((s.start, s.stop) for s in index)
    if key not in pieces:
      if layout.partial and layout.partial_kind == "sum":
        parts = [rng.standard_normal(tile.shape) for _ in range(n_partial - 1)]
        parts.append(tile - sum(parts) if parts else tile)
      else:
        parts = [tile] * n_partial
      pieces[key] = parts
    pidx = 0
    for a in layout.partial:
      pidx = pidx * sizes[a] + r[a]
    held = pieces[key][pidx]
    known = known_tiles(layout, r, mesh)
    if known is not None:
      k, which, n = known
      held = np.concatenate([p if j in which else rng.standard_normal(p.shape)
                             for j, p in enumerate(np.split(held, n, axis=k))], axis=k)
    out[coord] = held
  return out


def _neighbour(layout: Layout, mesh: Mesh, coord: tuple[int, ...], k: int, step: int
               ) -> Optional[tuple[int, ...]]:
  """The rank holding the tile ``step`` after ``coord``'s along dim ``k``
  (its other coordinates alike); None beyond the ends."""
  r = dict(zip(mesh.axis_names, coord))
  axes = layout.dims[k]
  t = tile_index(axes, r, mesh) + step
  if not 0 <= t < math.prod(mesh.axis_size(a) for a in axes):
    return None
  for a in reversed(axes):
    r[a], t = t % mesh.axis_size(a), t // mesh.axis_size(a)
  return tuple(r[a] for a in mesh.axis_names)


def _edge(local_at: dict, coord, k: int, start: int, size: int, like: np.ndarray) -> np.ndarray:
  """``size`` elements of ``coord``'s value along dim ``k`` from ``start``
  (from the end if negative); zeros beyond the ends (``coord`` None)."""
  shape = list(np.shape(like))
  shape[k] = size
  if coord is None:
    return np.zeros(shape)
  v = np.asarray(local_at[coord], dtype=np.float64)
  n = v.shape[k]
  lo = start % n if size else 0
  return np.take(v, range(lo, lo + size), axis=k)


def _with_halos(layout: Layout, mesh: Mesh, local_at: dict) -> dict:
  """Each rank's value extended along each haloed dim by its neighbours'
  edge rows (zeros beyond the ends), one dim after another, so corners come
  from the diagonal neighbours as a two-phase exchange brings them."""
  for k, lo, hi in layout.halo:
    extended = {}
    for coord, v in local_at.items():
      before = _edge(local_at, _neighbour(layout, mesh, coord, k, -1), k, -lo, lo, v)
      after = _edge(local_at, _neighbour(layout, mesh, coord, k, 1), k, 0, hi, v)
      extended[coord] = np.concatenate([before, np.asarray(v, dtype=np.float64), after], axis=k)
    local_at = extended
  return local_at


def _without_halos(layout: Layout, mesh: Mesh, local_at: dict) -> dict:
  """``_with_halos``' inverse, raising ``AssertionError`` where a rank's halo
  is not its neighbours' rows (or zeros beyond the ends)."""
  for k, lo, hi in reversed(layout.halo):
    inner = {c: np.take(np.asarray(v, dtype=np.float64), range(lo, v.shape[k] - hi), axis=k)
             for c, v in local_at.items()}
    for coord, v in local_at.items():
      v = np.asarray(v, dtype=np.float64)
      before = _edge(inner, _neighbour(layout, mesh, coord, k, -1), k, -lo, lo, inner[coord])
      after = _edge(inner, _neighbour(layout, mesh, coord, k, 1), k, 0, hi, inner[coord])
      np.testing.assert_allclose(np.take(v, range(lo), axis=k), before, rtol=1e-6, atol=1e-6,
                                 err_msg=f"halo before the tile of dim {k} at {coord}")
      np.testing.assert_allclose(np.take(v, range(v.shape[k] - hi, v.shape[k]), axis=k), after,
                                 rtol=1e-6, atol=1e-6,
                                 err_msg=f"halo after the tile of dim {k} at {coord}")
    local_at = inner
  return local_at


def spread_extrema(layout: Layout, mesh: Mesh, local_at: dict, rng) -> dict:
  """For max/min partial layouts make the partial pieces differ.

  ``shard`` gives every partial piece the whole tile, which any lemma would get
  right; here one random piece per element keeps the value and the others are
  strictly smaller (max) or larger (min), so the combine really matters.
  """
  if not layout.partial or layout.partial_kind == "sum":
    return local_at
  sizes = dict(mesh.axes)
  n_pieces = math.prod(sizes[a] for a in layout.partial)
  sign = -1.0 if layout.partial_kind == "max" else 1.0
  owner: dict = {}  # tile -> which piece holds the true value, per element
  noise: dict = {}  # (tile, piece) -> how far the other pieces are off
  out = {}
  for coord, v in local_at.items():
    r = dict(zip(mesh.axis_names, coord))
    if layout.zero_elsewhere and not layout.holds_at(r):
      out[coord] = v  # zeros, as the layout says
      continue
    tile = tuple(tile_coordinate(a, r, mesh) for axes in layout.dims for a in axes)
    piece = 0
    for a in layout.partial:
      piece = piece * sizes[a] + r[a]
    v = np.asarray(v, dtype=np.float64)
    if tile not in owner:
      owner[tile] = rng.integers(0, n_pieces, v.shape)
    if (tile, piece) not in noise:
      noise[tile, piece] = rng.uniform(0.1, 1.0, v.shape)
    out[coord] = np.where(owner[tile] == piece, v, v + sign * noise[tile, piece])
  return out
