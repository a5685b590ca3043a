"""One graph IR for every module format graphguard-hlo reads.

StableHLO (text or bytecode), XLA HLO text and HLO protos are all loaded into
these few classes, so the passes are written once.  Operation names are the
StableHLO names without the dialect prefix (``add``, ``dot_general``,
``all_reduce``); other dialects keep theirs (``sdy.manual_computation``).

Attributes are plain, hashable Python values so that ops can be hash-consed:

=====================  ======================================================
op                     canonical attributes
=====================  ======================================================
dot_general            lhs_batch, rhs_batch, lhs_contract, rhs_contract
                       (tuples of ints)
broadcast_in_dim       broadcast_dimensions
transpose              permutation
reduce                 dimensions; regions[0] is the reducer
reshape                (none: the result type carries the shape)
slice                  start_indices, limit_indices, strides
dynamic_slice          slice_sizes
dynamic_update_slice   (none)
concatenate            dimension
pad                    edge_padding_low, edge_padding_high, interior_padding
iota                   iota_dimension
constant               value (a read-only numpy array)
compare                comparison_direction ("EQ", "LT", ...)
convert                (none)
select, clamp, ...     (none)
all_reduce             replica_groups; regions[0] is the reducer
reduce_scatter         replica_groups, scatter_dimension; regions[0]
all_gather             replica_groups, all_gather_dimension
all_to_all             replica_groups, split_dimension, concat_dimension
collective_permute     source_target_pairs (tuple of (src, dst))
partition_id           (none)
while                  regions = [cond, body]
case                   regions = branches
call                   callee (function name)
custom_call            call_target_name
=====================  ======================================================

``replica_groups`` is always a tuple of tuples of global device ids: loaders
expand iota lists and ``mesh[...]`` axis groups into that one form.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Optional, Sequence

import numpy as np


class ConstantArray(np.ndarray):
  """A read-only array that hashes by content: a constant op's ``value`` (and
  the array attrs loaders read), so that equal constants hash-cons to one class."""

  def __new__(cls, arr):
    view = np.asarray(arr).view(cls)
    view.setflags(write=False)
    return view

  def __hash__(self):
    return hash((self.shape, str(self.dtype), self.tobytes()))

  def __eq__(self, other):  # type: ignore[override]
    return (isinstance(other, np.ndarray) and self.shape == other.shape
            and bool(np.array_equal(np.asarray(self), np.asarray(other))))


@dataclasses.dataclass(frozen=True)
class TensorType:
  shape: tuple[int, ...]
  dtype: str  # "f32", "bf16", "i32", "i1", ...; "token" for tokens

  @property
  def rank(self) -> int:
    return len(self.shape)

  def __str__(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class Location:
  """Where an op came from in the user's Python source."""
  file: Optional[str] = None
  line: Optional[int] = None
  column: Optional[int] = None
  op_name: Optional[str] = None  # e.g. "jit(mlp)/dot_general"

  def __str__(self) -> str:
    if self.file is None:
      return "<unknown>"
    if self.column is None:
      return f"{self.file}:{self.line}"
    return f"{self.file}:{self.line}:{self.column}"


UNKNOWN_LOCATION = Location()


class Value:
  """An SSA value: a block argument (``producer is None``) or an op result."""
  __slots__ = ("id", "type", "producer", "index", "name")

  def __init__(self, id: int, type: TensorType, producer: Optional["Op"] = None,
               index: int = 0, name: str = ""):
    self.id = id
    self.type = type
    self.producer = producer
    self.index = index
    self.name = name

  @property
  def shape(self) -> tuple[int, ...]:
    return self.type.shape

  def __repr__(self) -> str:
    return f"%{self.name or self.id}:{self.type}"


class Op:
  __slots__ = ("name", "operands", "results", "attrs", "regions", "location")

  def __init__(self, name: str, operands: list[Value], attrs: dict[str, Any],
               regions: list["Graph"], location: Location):
    self.name = name
    self.operands = operands
    self.results: list[Value] = []
    self.attrs = attrs
    self.regions = regions
    self.location = location

  @property
  def result(self) -> Value:
    assert len(self.results) == 1, self.name
    return self.results[0]

  def __repr__(self) -> str:
    outs = ", ".join(map(repr, self.results))
    ins = ", ".join(f"%{v.name or v.id}" for v in self.operands)
    return f"{outs} = {self.name}({ins})"


class Graph:
  """A function body or a region: parameters, ops in topological order, results."""

  def __init__(self, name: str = ""):
    self.name = name
    self.params: list[Value] = []
    self.ops: list[Op] = []
    self.results: list[Value] = []
    # Parameter and result annotations, keyed by position.
    self.param_attrs: list[dict[str, Any]] = []
    self.result_attrs: list[dict[str, Any]] = []
    self.param_locations: list[Location] = []

  def walk(self) -> Iterator[Op]:
    for op in self.ops:
      yield op
      for region in op.regions:
        yield from region.walk()


def dot_free_dims(attrs: dict[str, Any], lhs_rank: int, rhs_rank: int
                  ) -> tuple[list[int], list[int]]:
  """A dot_general's lhs and rhs dims that are neither batch nor contracting.

  Its result's dims are the batch dims, then the lhs's free dims, then the
  rhs's, each in operand order."""
  lhs = [i for i in range(lhs_rank) if i not in attrs["lhs_batch"] and i not in attrs["lhs_contract"]]
  rhs = [j for j in range(rhs_rank) if j not in attrs["rhs_batch"] and j not in attrs["rhs_contract"]]
  return lhs, rhs


ROTATION_SEP = "+"


def axis_base(name: str) -> str:
  """The mesh axis under a rotated axis name: ``cp+1`` -> ``cp``."""
  base, sep, shift = name.rpartition(ROTATION_SEP)
  return base if sep and shift.isdigit() else name


def axis_shift(name: str) -> int:
  """How far a rotated axis name turns its axis: ``cp+1`` -> 1, ``cp`` -> 0."""
  base, sep, shift = name.rpartition(ROTATION_SEP)
  return int(shift) if sep and shift.isdigit() else 0


def rotated_axis(axis: str, by: int, n: int) -> str:
  """``axis`` (plain or rotated) turned ``by`` more steps on an axis of n ranks."""
  j = (axis_shift(axis) + by) % n
  return axis_base(axis) if j == 0 else f"{axis_base(axis)}{ROTATION_SEP}{j}"


# A part of a user's mesh axis that XLA cut finer, named as Shardy names
# sub-axes: ``y:(2)2`` is the part of size 2 with 2 ranks' worth of ``y``
# more major than it (so ``y:(1)2`` is the major half of a 4-rank ``y``).
_SUB_AXIS = re.compile(r"(.+):\((\d+)\)(\d+)$")


def sub_axis_name(base: str, pre_size: int, size: int) -> str:
  return f"{base}:({pre_size}){size}"


def sub_axis(name: str) -> Optional[tuple[str, int, int]]:
  """(base axis, pre-size, size) of a sub-axis name, None for a plain axis."""
  m = _SUB_AXIS.match(axis_base(name))
  return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def merged_axis_names(axes: Sequence[str], mesh: Optional["Mesh"]) -> list[str]:
  """``axes`` with each run of sub-axes that spells a larger part of one axis
  (``y:(1)2, y:(2)2``) written as that part, or as the axis itself when the
  run is all of it on ``mesh``: ``y``."""
  runs: list[Any] = []  # plain names, and [base, pre-size, size] of merged runs
  for a in axes:
    part = sub_axis(a) if axis_shift(a) == 0 else None
    last = runs[-1] if runs else None
    if part and isinstance(last, list) and part[0] == last[0] and part[1] == last[1] * last[2]:
      last[2] *= part[2]
    else:
      runs.append(list(part) if part else a)
  return [r if isinstance(r, str) else _sub_axis_text(*r, mesh) for r in runs]


def _sub_axis_text(base: str, pre_size: int, size: int, mesh: Optional["Mesh"]) -> str:
  if mesh is not None and pre_size == 1:
    whole = 1
    for part in filter(None, map(sub_axis, mesh.axis_names)):
      whole *= part[2] if part[0] == base else 1
    if size == whole:
      return base
  return sub_axis_name(base, pre_size, size)


@dataclasses.dataclass
class Mesh:
  """A named device mesh: axes major to minor and the device id at each coordinate."""
  axes: tuple[tuple[str, int], ...]
  device_ids: Optional[tuple[int, ...]] = None  # None: iota

  @property
  def size(self) -> int:
    return int(np.prod([s for _, s in self.axes], dtype=np.int64))

  @property
  def axis_names(self) -> tuple[str, ...]:
    return tuple(n for n, _ in self.axes)

  def axis_size(self, name: str) -> int:
    """Size of a mesh axis; a rotated axis (``cp+1``, see passes/layout.py) has
    its base axis' size."""
    return dict(self.axes)[axis_base(name)]

  def devices(self) -> np.ndarray:
    ids = np.arange(self.size) if self.device_ids is None else np.array(self.device_ids)
    return ids.reshape([s for _, s in self.axes] or [1])


class Module:
  """A loaded module: its functions, entry point, meshes and partition count."""

  def __init__(self, path: str, fmt: str):
    self.path = path
    self.format = fmt  # "stablehlo" | "hlo_text" | "hlo_proto"
    self.name = ""
    self.functions: dict[str, Graph] = {}
    self.entry = "main"
    self.meshes: dict[str, Mesh] = {}
    self.num_partitions = 1
    self.attrs: dict[str, Any] = {}
    self._next_id = 0

  @property
  def main(self) -> Graph:
    return self.functions[self.entry]

  def new_value(self, type: TensorType, producer: Optional[Op] = None,
                index: int = 0, name: str = "") -> Value:
    self._next_id += 1
    return Value(self._next_id, type, producer, index, name)

  def add_op(self, graph: Graph, name: str, operands: list[Value],
             result_types: list[TensorType], attrs: Optional[dict] = None,
             regions: Optional[list[Graph]] = None,
             location: Location = UNKNOWN_LOCATION,
             result_names: Optional[list[str]] = None) -> Op:
    op = Op(name, list(operands), dict(attrs or {}), list(regions or []), location)
    for i, t in enumerate(result_types):
      name_i = result_names[i] if result_names else ""
      op.results.append(self.new_value(t, op, i, name_i))
    graph.ops.append(op)
    return op

  def summary(self) -> str:
    g = self.main
    n_ops = sum(1 for _ in g.walk())
    counts: dict[str, int] = {}
    for op in g.walk():
      counts[op.name] = counts.get(op.name, 0) + 1
    top = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
    return (f"{self.path}: {self.format}, {len(g.params)} parameters, "
            f"{len(g.results)} results, {n_ops} ops ({top}), "
            f"{self.num_partitions} partition(s)")


@dataclasses.dataclass(frozen=True)
class SdySharding:
  """A Shardy tensor sharding: mesh axes per dimension, major to minor."""
  mesh: str
  dims: tuple[tuple[str, ...], ...]
  replicated: tuple[str, ...] = ()
  unreduced: tuple[str, ...] = ()

  def __str__(self) -> str:
    dims = ", ".join("{" + ", ".join(f'"{a}"' for a in d) + "}" for d in self.dims)
    extra = f", unreduced={{{', '.join(self.unreduced)}}}" if self.unreduced else ""
    return f"<@{self.mesh}, [{dims}]{extra}>"
