"""Canonicalize sharding annotations into Layouts over one named mesh.

Two sources:
  * Shardy: ``#sdy.sharding<@mesh, [{"tp"}, {}]>`` names mesh axes directly.
  * GSPMD strings on per-device modules: ``{devices=[1,4]<=[4]}``,
    ``{devices=[2,1,2]<=[4] last_tile_dim_replicate}``, ``{replicated}``.  These
    tile dimensions by *device lists*, not named axes, so we first infer a mesh
    of "atomic" axes whose mixed-radix digits spell every device list used in
    the module (``infer_mesh``), then read each sharding off that mesh.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Iterable, Optional, Sequence

import numpy as np

from graphguard_hlo.ir import Mesh, SdySharding, sub_axis_name
from graphguard_hlo.passes.layout import Layout


class ShardingError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class HloSharding:
  """A parsed GSPMD sharding string."""
  kind: str                                  # "replicated" | "tiled" | "maximal" | "manual"
  tile_dims: tuple[int, ...] = ()            # includes the trailing replicate dim, if any
  reshape_dims: tuple[int, ...] = ()         # iota form: devices = iota(reshape).T(perm)
  perm: tuple[int, ...] = ()
  explicit: Optional[tuple[int, ...]] = None  # explicit device list
  replicate_last: bool = False
  unreduced_last: bool = False               # last_tile_dims={..., unreduced} (partial sums)

  def device_array(self) -> np.ndarray:
    n = math.prod(self.tile_dims)
    if self.explicit is not None:
      return np.array(self.explicit).reshape(self.tile_dims)
    dims = self.reshape_dims or (n,)
    perm = self.perm or tuple(range(len(dims)))
    return np.arange(n).reshape(dims).transpose(perm).reshape(self.tile_dims)

  @property
  def data_rank(self) -> int:
    extra = int(self.replicate_last) + int(self.unreduced_last)
    return len(self.tile_dims) - extra


_TILED = re.compile(
    r"devices=\[([\d,]+)\]"
    r"(?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))"
    r"(.*)$")


def parse_hlo_sharding(text: str) -> HloSharding | list[HloSharding]:
  """Parse ``{...}``; tuple shardings ``{{...}, {...}}`` give a list."""
  s = re.sub(r"/\*.*?\*/", "", text).strip()  # XLA numbers long tuples: /*index=5*/
  if s.startswith("{{") or (s.startswith("{") and s[1:].lstrip().startswith("{")):
    inner = s[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
      if ch == "{":
        depth += 1
      elif ch == "}":
        depth -= 1
      elif ch == "," and depth == 0:
        parts.append(inner[start:i])
        start = i + 1
    parts.append(inner[start:])
    return [parse_hlo_sharding(p) for p in parts if p.strip()]  # type: ignore[misc]
  body = (s[1:-1] if s.startswith("{") and s.endswith("}") else s).strip()
  if body in ("replicated", ""):
    return HloSharding("replicated")
  if body.startswith("maximal"):
    return HloSharding("maximal")
  if body.startswith("manual"):
    return HloSharding("manual")
  m = _TILED.match(body)
  if not m:
    raise ShardingError(f"unrecognized sharding {text!r}")
  tile = tuple(int(x) for x in m.group(1).split(","))
  reshape = tuple(int(x) for x in m.group(2).split(",")) if m.group(2) else ()
  perm = tuple(int(x) for x in m.group(3).split(",")) if m.group(3) else ()
  explicit = tuple(int(x) for x in m.group(4).split(",")) if m.group(4) else None
  rest = m.group(5)
  replicate_last = "last_tile_dim_replicate" in rest
  unreduced = False
  lt = re.search(r"last_tile_dims=\{([^}]*)\}", rest)
  if lt:
    kinds = [k.strip() for k in lt.group(1).split(",")]
    replicate_last = "replicated" in kinds
    unreduced = "unreduced" in kinds
    if "manual" in kinds:
      raise ShardingError(f"partially manual sharding {text!r} is not supported")
    if len(kinds) > 1 and not (replicate_last and unreduced and len(kinds) == 2):
      raise ShardingError(f"sharding {text!r}: last_tile_dims {kinds} not supported")
  if explicit is not None and len(explicit) != math.prod(tile):
    raise ShardingError(f"sharding {text!r}: {len(explicit)} devices for {math.prod(tile)} tiles")
  return HloSharding("tiled", tile, reshape, perm, explicit, replicate_last, unreduced)


# -- meshes ------------------------------------------------------------------------

def _digits(sh: HloSharding) -> list[list[tuple[int, int]]]:
  """For each tile dim, its mixed-radix digits (size, stride) in device-id space."""
  n = math.prod(sh.tile_dims)
  if sh.explicit is not None:
    if tuple(sh.explicit) != tuple(range(n)):
      raise ShardingError("explicit non-iota device lists are not supported")
    reshape, perm = (n,), (0,)
  else:
    reshape = sh.reshape_dims or (n,)
    perm = sh.perm or tuple(range(len(reshape)))
  strides = [math.prod(reshape[i + 1:]) for i in range(len(reshape))]
  digits = [(reshape[p], strides[p]) for p in perm if reshape[p] > 1]
  out: list[list[tuple[int, int]]] = []
  for t in sh.tile_dims:
    mine: list[tuple[int, int]] = []
    need = t
    while need > 1:
      if not digits:
        raise ShardingError("tile dims do not match the device list")
      size, stride = digits[0]
      if size <= need:
        if need % size:
          raise ShardingError("tile dims do not divide the device list")
        mine.append((size, stride))
        digits.pop(0)
        need //= size
      else:
        if size % need:
          raise ShardingError("tile dims do not divide the device list")
        mine.append((need, stride * (size // need)))
        digits[0] = (size // need, stride)
        need = 1
    out.append(mine)
  return out


def infer_mesh(shardings: Iterable[HloSharding], num_devices: int,
               extra_groups: Iterable[Sequence[Sequence[int]]] = (),
               extra_strides: Iterable[int] = ()) -> Mesh:
  """The coarsest mesh of atomic axes whose digits spell every sharding's tiles.

  Axes are named ``a0, a1, ...`` major to minor, device id = mixed radix of
  the coordinates (iota device order).  Replica groups and partition-id
  arithmetic add their strides too, each where it fits the chain of cuts:
  on a 2 x 3 mesh XLA reshards with groups at strides 2 and 3 at once, which
  no one mesh spells; the collectives the mesh cannot read are then reported
  where they are, rather than the program refused as input.
  """
  cuts = {1, num_devices}
  for sh in shardings:
    if sh.kind != "tiled":
      continue
    for dim_digits in _digits(sh):
      for size, stride in dim_digits:
        cuts.update((stride, stride * size))
  if (broken := _chain_break(cuts, num_devices)) is not None:
    raise ShardingError("shardings cannot be spelled on one mesh (strides %d, %d)" % broken)
  for cut in sorted(_group_cuts(extra_groups, num_devices) | set(extra_strides)):
    if _is_chain(cuts | {cut}, num_devices):
      cuts.add(cut)
  ordered = sorted(c for c in cuts if num_devices % c == 0)
  axes = []
  for lo, hi in zip(ordered, ordered[1:]):
    axes.append(hi // lo)
  axes.reverse()  # major to minor
  return Mesh(tuple((f"a{i}", s) for i, s in enumerate(axes)))


def _group_cuts(groups_lists: Iterable[Sequence[Sequence[int]]], num_devices: int) -> set[int]:
  """The strides replica groups step at, and where an evenly strided group
  ends (one axis, or an axis' minor part)."""
  cuts = set()
  for groups in groups_lists:
    for g in groups:
      steps = {abs(b - a) for a, b in zip(g, g[1:])}
      cuts.update(step for step in steps if step and num_devices % step == 0)
      if len(steps) == 1 and (step := steps.pop()) and num_devices % (step * len(g)) == 0:
        cuts.add(step * len(g))
  return cuts


def stride_across_mesh(lists: Sequence[Sequence[int]], mesh: Mesh) -> Optional[int]:
  """A stride these replica groups (or permute pairs) step at that no mesh
  with ``mesh``'s cuts could have as a cut (2 on a 2 x 3 mesh: it would need
  3 = 1.5 x 2); None if there is none or the mesh is not in iota order."""
  if mesh.device_ids is not None:
    return None
  cuts = {1} | {c for _, size, stride in _strided(mesh) for c in (stride, stride * size)}
  return next((c for c in sorted(_group_cuts([lists], mesh.size))
               if not _is_chain(cuts | {c}, mesh.size)), None)


def _chain_break(cuts: set[int], num_devices: int) -> Optional[tuple[int, int]]:
  """Two neighbouring cuts (of those dividing the devices) the smaller of
  which does not divide the larger: no one mesh has both; None if none."""
  ordered = sorted(c for c in cuts if num_devices % c == 0)
  return next(((lo, hi) for lo, hi in zip(ordered, ordered[1:]) if hi % lo), None)


def _is_chain(cuts: set[int], num_devices: int) -> bool:
  return _chain_break(cuts, num_devices) is None


def prime_strides(mesh: Mesh) -> set[int]:
  """The strides of ``mesh`` with every axis cut into prime factors, smaller
  ones minor (``a1`` of 4 at stride 1 -> strides 1, 2): the finest mesh the
  same devices spell, on which XLA's moves between parts of axes (an
  axis' halves swapped with another axis) are moves between axes."""
  out = set()
  for _, size, stride in _strided(mesh):
    p = 2
    while size > 1:
      while size % p == 0:
        out.add(stride)
        stride, size = stride * p, size // p
      p += 1
  return out


def permutes_read(pairs: Sequence[Sequence[tuple[int, int]]], mesh: Mesh) -> bool:
  """Can every collective-permute's pairs be read on ``mesh`` (as a shift or
  permutation of one axis, or as a renaming of axes)?"""
  return all(axes_of_pairs(p, mesh) is not None or axis_renaming_of_pairs(p, mesh) is not None
             for p in pairs)


def named_after(mesh: Mesh, source: Optional[Mesh]) -> Mesh:
  """``mesh``'s atomic axes (``infer_mesh``) renamed after the axes of the
  mesh the program was written over, each that is one of them: the same size
  and the same stride in partition-id order (an iota ``source``: jax numbers
  partitions by their place in the mesh).  An atomic axis inside one source
  axis, which XLA cut finer, is named as Shardy names that sub-axis
  (``y:(1)2``, y's major half); one joining several keeps its ``aN`` name; so
  do all when a name would repeat."""
  if source is None or source.device_ids not in (None, tuple(range(source.size))) \
      or source.size != mesh.size:
    return mesh
  places = [(name, size, stride) for name, size, stride in _strided(source) if size > 1]

  def name_of(atomic: str, size: int, stride: int) -> str:
    for name, whole, start in places:
      if (size, stride) == (whole, start):
        return name
      if stride % start == 0 and (whole * start) % (size * stride) == 0:
        return sub_axis_name(name, whole * start // (size * stride), size)
    return atomic

  renamed = tuple((name_of(*axis), axis[1]) for axis in _strided(mesh))
  names = [n for n, _ in renamed]
  return Mesh(renamed) if len(set(names)) == len(names) else mesh


def _strided(mesh: Mesh) -> list[tuple[str, int, int]]:
  """(name, size, stride in device-id order) of each axis, major to minor."""
  out, stride = [], 1
  for name, size in reversed(mesh.axes):
    out.append((name, size, stride))
    stride *= size
  return out[::-1]


def _axis_strides(mesh: Mesh) -> dict[int, str]:
  """Stride in device-id space of each axis (iota meshes only)."""
  out = {}
  stride = 1
  for name, size in reversed(mesh.axes):
    out[stride] = name
    stride *= size
  return out


def layout_from_hlo_sharding(sh: HloSharding, mesh: Mesh, rank: int) -> Layout:
  if sh.kind == "replicated":
    return Layout.replicated(rank)
  if sh.kind != "tiled":
    raise ShardingError(f"{sh.kind} sharding is not supported")
  if sh.data_rank != rank:
    raise ShardingError(f"sharding has {sh.data_rank} tiled dims for a rank-{rank} tensor")
  by_stride = _axis_strides(mesh)
  sizes = dict(mesh.axes)
  dims: list[tuple[str, ...]] = []
  partial: list[str] = []
  for i, dim_digits in enumerate(_digits(sh)):
    axes: list[str] = []
    for size, stride in dim_digits:
      # A digit may span several atomic axes: walk them major to minor.
      covered = []
      s, remaining = stride, size
      while remaining > 1:
        name = by_stride.get(s)
        if name is None:
          raise ShardingError("sharding does not align with the inferred mesh")
        covered.append(name)
        remaining //= sizes[name]
        s *= sizes[name]
      axes.extend(reversed(covered))
    if i < sh.data_rank:
      dims.append(tuple(axes))
    elif sh.unreduced_last and (i == len(sh.tile_dims) - 1):
      partial.extend(axes)
  return Layout(tuple(dims), tuple(partial))


def layout_from_sdy(sh: SdySharding, rank: int) -> Layout:
  if len(sh.dims) != rank:
    raise ShardingError(f"sharding {sh} has {len(sh.dims)} dims for a rank-{rank} tensor")
  return Layout(tuple(tuple(d) for d in sh.dims), tuple(sh.unreduced))


def group_axes(groups: Sequence[Sequence[int]], mesh: Mesh) -> Optional[tuple[str, ...]]:
  """The mesh axes a collective's replica groups run over, major to minor in
  the order the groups list their ranks: a gather or all-to-all concatenates
  shards in that order, so (z, x) is a tiling of z major, x minor, whatever
  the mesh's order (XLA lists its groups so for a dim split ``("z", "x")``).

  ``None`` when the groups are not exactly "all devices that differ only on
  these axes", or when a group lists them in no axis order (which would
  concatenate shards out of order).
  """
  devices = mesh.devices()
  coord_of = {int(d): idx for idx, d in np.ndenumerate(devices)}
  names = mesh.axis_names
  axes_seen: Optional[tuple[str, ...]] = None
  covered, listed = set(), 0
  for g in groups:
    if any(d not in coord_of for d in g):
      return None
    coords = np.array([coord_of[d] for d in g]).reshape(len(g), -1)
    varying = tuple(n for i, n in enumerate(names) if len(set(coords[:, i])) > 1)
    if len(g) != math.prod(mesh.axis_size(a) for a in varying):
      return None
    order = _listing_order(coords, varying, names)
    if order is None or (axes_seen is not None and order != axes_seen):
      return None
    axes_seen = order
    covered.update(g)
    listed += len(g)
  if len(covered) != mesh.size or listed != mesh.size:  # (a device in two groups, or twice)
    return None
  return axes_seen or ()


def _listing_order(coords: np.ndarray, varying: tuple[str, ...], names: tuple[str, ...]
                   ) -> Optional[tuple[str, ...]]:
  """The order of ``varying`` axes in which a group's ranks (their mesh
  coordinates, one row each) are listed row-major; the mesh's order first."""
  for order in itertools.permutations(varying):
    idx = [names.index(a) for a in order]
    listed = sorted(range(len(coords)), key=lambda k: tuple(coords[k, i] for i in idx))
    if listed == list(range(len(coords))):
      return order
  return None


def axis_renaming_of_pairs(pairs: Sequence[tuple[int, int]], mesh: Mesh
                           ) -> Optional[tuple[tuple[str, str], ...]]:
  """The renaming ((x, y), ...) if the collective-permute sends every rank to
  the rank whose y coordinate is the sender's x coordinate, for a permutation
  of mesh axes of one size, not the identity: rank r then holds what the rank
  with r's coordinates permuted back held.  XLA moves shards so between the
  axes of a refined mesh: a kv head's shards between two (pairs (1, 2), (2, 1)
  on a 2x2 mesh, a swap), a weight resharded under FSDP x TP round three (a
  cycle on 2x2x2)."""
  devices = mesh.devices()
  coord_of = {int(d): idx for idx, d in np.ndenumerate(devices)}
  sent = dict(pairs)
  if len(sent) != len(pairs) or set(sent) != set(coord_of) or set(sent.values()) != set(coord_of):
    return None
  names = mesh.axis_names
  moving = [i for i, (_, n) in enumerate(mesh.axes) if n > 1]
  for image in itertools.permutations(moving):
    to = dict(zip(moving, image))  # axis i's coordinate goes to axis to[i]
    if all(i == j for i, j in to.items()) or any(
        mesh.axes[i][1] != mesh.axes[j][1] for i, j in to.items()):
      continue

    def receiver(c):
      t = list(c)
      for i, j in to.items():
        t[j] = c[i]
      return int(devices[tuple(t)])
    if all(sent[d] == receiver(c) for d, c in coord_of.items()):
      return tuple((names[i], names[j]) for i, j in to.items() if i != j)
  return None


def axes_of_pairs(pairs: Sequence[tuple[int, int]], mesh: Mesh
                  ) -> Optional[tuple[str, dict[int, int]]]:
  """A collective-permute as a permutation of one axis' coordinates, if it is one."""
  devices = mesh.devices()
  coord_of = {int(d): idx for idx, d in np.ndenumerate(devices)}
  names = mesh.axis_names
  axis = None
  perm: dict[int, int] = {}
  fixed: list[tuple] = []
  for src, dst in pairs:
    a, b = coord_of.get(src), coord_of.get(dst)
    if a is None or b is None:
      return None
    diff = [i for i in range(len(names)) if a[i] != b[i]]
    if len(diff) > 1:
      return None
    if not diff:  # a rank keeping its own value: a fixed point of the permutation
      fixed.append(a)
      continue
    if diff:
      if axis is None:
        axis = diff[0]
      elif axis != diff[0]:
        return None
      if perm.get(a[axis], b[axis]) != b[axis]:
        return None
      perm[a[axis]] = b[axis]
  if axis is None:
    return None
  for a in fixed:
    if perm.get(a[axis], a[axis]) != a[axis]:
      return None
    perm[a[axis]] = a[axis]
  # Applied along the axis at every coordinate of the others: a rank left out
  # receives zeros, which no permutation of the axis gives.
  given = {(int(s), int(d)) for s, d in pairs}
  expected = {(int(d), int(devices[c[:axis] + (perm[c[axis]],) + c[axis + 1:]]))
              for c, d in np.ndenumerate(devices) if c[axis] in perm}
  if given != expected:
    return None
  return names[axis], perm
