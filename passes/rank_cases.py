"""Rows picked by a rank's coordinate, as cases (the per-device program only).

A hand-written pipeline schedule keeps each stage's inputs for its backward
pass in a buffer with a row per microbatch.  At step t, stage s writes row
``t - s`` and reads row ``t - 2(n - 1) + s``: a dynamic_update_slice and a
dynamic_slice whose row depends on the stage.  No layout says "row t - s at
stage s".  But a rank's coordinate takes only ``n`` values, so the op is a
select over them, each case at a constant row:

  dynamic_update_slice(x, u, i)  ->  select(i == v_1, dus(x, u, v_1), select(i == v_2, ..))
  dynamic_slice(x, i)            ->  select(i == v_1, slice(x at v_1), select(..))

(``v_j`` the values i takes on the ranks, the last case the default; each
case's row clamped as the op clamps it).  At constant rows the buffer's
canonical forms apply (``slabs.py``): a row written is a slab, a row read
back is what was written there, and the selects on a rank predicate pin each
case to its stage (``Transfer._select``).  This is an identity of the ops at
every rank, not an approximation.

Only where it helps and costs little, on one mesh axis: a write at a row that
is not a tile offset (``((r + j) mod n) * size`` is a layout: ``transfer.py``
reads it flat in the number of ranks, as rings and gathers written by hand
write), unless the write is kept only where a rank predicate says or goes
into a buffer some ranks wrote (a schedule's, whose rows may look like a
tile offset on two stages); a read at a row that is not a tile offset, or of
a buffer some ranks wrote (a select on a rank predicate within a few ops), or
of a parameter already split over the row's axis (an interleaved schedule's
chunk of a stack split over the stages by layer: on two stages its row looks
like a tile offset, but no layout tiles a second dim by that axis).  The
cases grow with the axis' size, which is a pipeline's stage count.  A row, or
a select's predicate, that every partition computes alike is that one value:
the op at a constant row, the select's branch.

GSPMD writes ``x.at[i].set(u)`` on a dim split over the ranks as a scatter of
one window at row ``i - offset(r)`` of each tile: the window lands on one
rank and XLA skips it on the others.  Split alike (``split_scatter``), each
case is the scatter at a constant row, or x itself where the window lands
nowhere (``slabs.scatter_of_one_window``): ``select(r_x == c, set, x)``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

from graphguard_hlo import ir
from graphguard_hlo.passes import slabs
from graphguard_hlo.passes.layout import Layout
from graphguard_hlo.passes.rank_arith import (broadcast_scalar, moves_with_one_axis,
                                              partition_id_table, tile_turn)
from graphguard_hlo.passes.terms import splat_value

# How far back through buffer ops a read looks for a select on a rank predicate.
_BUFFER_DEPTH = 4
_BUFFER_OPS = frozenset({"select", "dynamic_update_slice", "concatenate", "pad", "slice"})


class RankCases:
  """The per-device program's rank-indexed buffer ops and their cases."""

  def __init__(self, mesh: ir.Mesh, graph: ir.Graph,
               param_layouts: Sequence[Optional[Layout]] = ()):
    self.mesh = mesh
    self._memo: dict = {}
    # The mesh axes each parameter is already split over: a slice at a tile
    # offset of such an axis is no layout (transfer.py tiles a dim by an axis
    # the value does not use yet), so it is split into cases.
    self.param_axes: dict[int, set[str]] = {
        p.id: l.used_axes() | l.pinned_axes()
        for p, l in zip(graph.params, param_layouts) if p is not None and l is not None}
    self.partition_id = next((op.results[0] for op in graph.walk()
                              if op.name == "partition_id"), None)
    # The selects reading each value (of the program as it was before this pass).
    self.selects: dict[int, list[ir.Op]] = {}
    for op in graph.walk():
      if op.name == "select":
        for v in op.operands[1:]:
          self.selects.setdefault(v.id, []).append(op)

  # -- which index, on which ranks ------------------------------------------------
  def per_rank(self, index: ir.Value) -> Optional[tuple[str, list[int]]]:
    """(x, values at r_x = 0 .. |x| - 1) of a scalar that depends on the mesh
    coordinate r_x alone (evaluated on every partition, wrapping and
    clamping included)."""
    return moves_with_one_axis(index, self.mesh, self._memo)

  def same_on_every_rank(self, index: ir.Value) -> Optional[int]:
    """The value of a scalar computed from the partition id that every
    partition computes alike (a schedule's row at a step where all stages
    agree): a constant the program does not spell as one."""
    table = partition_id_table(index, self.mesh.size, self._memo)
    if table is None or len(set(table.tolist())) != 1:
      return None
    return int(table[0])

  def uniform_select(self, op: ir.Op) -> Optional[ir.Value]:
    """The branch a ``select`` takes on every partition alike, if its
    predicate is computed from the partition id and holds (or fails) on all
    of them: an indexed schedule's mask at a step where no stage (or every
    stage) runs a chunk.  Folded, the sum it feeds does not grow a new value
    per step that equals the old one everywhere."""
    if op.name != "select" or self.partition_id is None:
      return None
    pred = broadcast_scalar(op.operands[0])
    if math.prod(pred.shape) != 1:
      return None
    same = self.same_on_every_rank(pred)
    if same is None:
      return None
    return op.operands[1] if same else op.operands[2]

  @staticmethod
  def _tile_offset(values: list[int], size: int) -> bool:
    """``((r + j) mod n) * size``: a layout (plain or turned), not cases."""
    return tile_turn(values, size) is not None

  def _guarded(self, op: ir.Op) -> bool:
    """Is the write kept only where a rank predicate says (``where(valid,
    dus(..), buf)``): a schedule's, whatever its rows look like."""
    return any(self._rank_scalar(s.operands[0]) for s in self.selects.get(op.results[0].id, ()))

  def _reads_a_staged_buffer(self, v: ir.Value, depth: int = _BUFFER_DEPTH) -> bool:
    """Some ranks wrote ``v``'s rows: a select on a rank predicate within
    ``depth`` buffer ops."""
    op = v.producer
    if op is None or depth == 0 or op.name not in _BUFFER_OPS:
      return False
    if op.name == "select" and self._rank_scalar(op.operands[0]):
      return True
    return any(self._reads_a_staged_buffer(x, depth - 1) for x in op.operands
               if x.type.rank)

  def _rank_scalar(self, pred: ir.Value) -> bool:
    return math.prod(pred.shape) > 0 and self.per_rank(broadcast_scalar(pred)) is not None

  # -- the rewrite -----------------------------------------------------------------
  def _dynamic_index(self, op: ir.Op, first: int) -> Optional[tuple[int, ir.Value]]:
    """(dim, index) of the one start of a dynamic slice or update that is not
    a constant."""
    moving = [(d, v) for d, v in enumerate(op.operands[first:]) if splat_value(v) is None]
    return moving[0] if len(moving) == 1 else None

  def plan(self, op: ir.Op) -> Optional[tuple]:
    """(first start operand, sizes, dim, index, axis, values) if ``op`` is
    split into cases; None: left as it is."""
    if op.name == "dynamic_update_slice":
      first, sizes = 2, op.operands[1].shape
    elif op.name == "dynamic_slice":
      first, sizes = 1, tuple(op.attrs["slice_sizes"])
    else:
      return None
    found = self._dynamic_index(op, first) if self.partition_id is not None else None
    if found is None or math.prod(op.results[0].shape) == 0 or not self.mesh.axes:
      return None
    k, index = found
    ranks = self.per_rank(index)
    if ranks is None:
      same = self.same_on_every_rank(index)
      if same is None:
        return None
      axis, n = self.mesh.axes[0]
      return first, sizes, k, index, axis, [same] * n  # one case: the op at that row
    axis, values = ranks
    x = op.operands[0]
    if op.name == "dynamic_update_slice" and self._tile_offset(values, sizes[k]) \
        and not self._guarded(op) and not self._reads_a_staged_buffer(x):
      return None
    if op.name == "dynamic_slice" and self._tile_offset(values, sizes[k]) \
        and not self._reads_a_staged_buffer(x) and axis not in self.param_axes.get(x.id, ()):
      return None
    return first, sizes, k, index, axis, values

  def scatter_plan(self, op: ir.Op) -> Optional[tuple[str, list[Optional[int]]]]:
    """(axis, start at r_axis = 0, 1, .., None where the window lands nowhere)
    if ``op`` is a scatter of one window at a row computed from the partition
    id that some rank writes nowhere (GSPMD's ``x.at[i].set(u)`` on a dim split
    over x: row ``i - offset(r)`` of each tile); None: left as it is."""
    window = slabs.scatter_window(op) if self.partition_id is not None else None
    if window is None:
      return None
    x, index, _, k, sizes = window
    ranks = self.per_rank(index)
    if ranks is None:
      return None
    axis, values = ranks
    starts = [v if slabs.window_lands(v, k, sizes, x.shape) else None for v in values]
    return (axis, starts) if None in starts else None

  def split_scatter(self, module, graph, op, fresh, place) -> Optional[ir.Value]:
    """``op`` as a select over its row's values on the ranks: at each, the
    scatter at that constant row, or x where the window lands nowhere."""
    planned = self.scatter_plan(op)
    if planned is None:
      return None
    axis, starts = planned
    x, index, update = op.operands
    out_type = op.results[0].type

    def case(start: Optional[int]) -> ir.Value:
      if start is None:
        return x
      at = slabs.constant(module, fresh, place, start, index.type.dtype, op.location, index.shape)
      new = ir.Op("scatter", [x, at, update], dict(op.attrs), list(op.regions), op.location)
      new.results = [module.new_value(out_type, new, 0)]
      return place(new)

    return self._select_cases(module, fresh, place, axis, starts, case, out_type,
                              op.location)

  def split(self, module, graph, op, fresh, place, emit) -> Optional[ir.Value]:
    """``op`` as a select over its row's values on the ranks (None: left as it is)."""
    planned = self.plan(op)
    if planned is None:
      return None
    first, sizes, k, index, axis, values = planned
    x = op.operands[0]
    starts = [int(splat_value(v)) if d != k else 0 for d, v in enumerate(op.operands[first:])]
    out_type = op.results[0].type
    loc = op.location

    def case(value: int) -> ir.Value:
      at = [min(max(value if d == k else starts[d], 0), x.shape[d] - sizes[d])
            for d in range(x.type.rank)]
      if op.name == "dynamic_slice":
        return slabs._sliced(module, graph, fresh, place, x, at,
                             [a + sizes[d] for d, a in enumerate(at)], loc)
      consts = [slabs.constant(module, fresh, place, a, index.type.dtype, loc) for a in at]
      return place(fresh(module, "dynamic_update_slice", [x, op.operands[1], *consts], {},
                         out_type.shape, out_type.dtype, loc))

    return self._select_cases(module, fresh, place, axis, values, case, out_type, loc)

  def _select_cases(self, module, fresh, place, axis: str, values: list, case, out_type,
                    loc) -> ir.Value:
    """select(r_x in ranks_1, case(v_1), select(.., case(v_last))): ``values``
    the case at r_x = 0 .. |x| - 1, the last case (in sorted order, None
    last) the default, every other case's ranks excluded."""
    by_value: dict = {}
    for c, value in enumerate(values):
      by_value.setdefault(value, []).append(c)
    order = sorted(by_value, key=lambda v: (v is None, v))
    result = case(order[-1])
    if len(order) == 1:
      return result  # one row on every rank: no coordinate to compare
    coordinate = self._coordinate(module, fresh, place, axis, loc)
    for value in reversed(order[:-1]):
      holds = None
      for c in by_value[value]:
        eq = place(fresh(module, "compare", [coordinate, slabs.constant(
            module, fresh, place, c, coordinate.type.dtype, loc)],
            {"comparison_direction": "EQ"}, (), "pred", loc))
        holds = eq if holds is None else place(fresh(module, "or", [holds, eq], {}, (), "pred",
                                                     loc))
      spread = place(fresh(module, "broadcast_in_dim", [holds], {"broadcast_dimensions": ()},
                           out_type.shape, "pred", loc))
      result = place(fresh(module, "select", [spread, case(value), result], {}, out_type.shape,
                           out_type.dtype, loc))
    return result

  def _coordinate(self, module, fresh, place, axis: str, loc) -> ir.Value:
    """r_x from partition-id: (pid // stride) % |x|, iota device order."""
    stride = math.prod(n for a, n in self.mesh.axes[self.mesh.axis_names.index(axis) + 1:])
    pid = self.partition_id
    dtype = pid.type.dtype
    major = place(fresh(module, "divide", [pid, slabs.constant(module, fresh, place, stride,
                                                               dtype, loc)], {}, (), dtype, loc))
    return place(fresh(module, "remainder", [major, slabs.constant(
        module, fresh, place, self.mesh.axis_size(axis), dtype, loc)], {}, (), dtype, loc))


def rank_case_patterns(graph: ir.Graph, mesh: ir.Mesh,
                       param_layouts: Sequence[Optional[Layout]] = ()) -> tuple:
  """The pattern splitting ``graph``'s rank-indexed buffer ops into cases, or
  () if no op could be (most programs: nothing to pay).  ``param_layouts``:
  how the parameters are split (``DistProgram.param_layouts``)."""
  if mesh.device_ids is not None and tuple(mesh.device_ids) != tuple(range(mesh.size)):
    return ()  # (rank arithmetic reads partition ids in iota order only)
  ops = [op for op in graph.walk()
         if op.name in ("dynamic_update_slice", "dynamic_slice", "select", "scatter")]
  if not ops:
    return ()
  cases = RankCases(mesh, graph, param_layouts)
  if not any(cases.plan(op) or cases.uniform_select(op) or cases.scatter_plan(op)
             for op in ops):
    return ()  # (GSPMD's slices at tile offsets: no second canonicalization to pay for)
  return (functools.partial(_split, cases),)


def _split(cases: RankCases, module, graph, op):
  from graphguard_hlo.passes.canonicalize import _emit, _fresh, _simplified_and_placed
  if op.name == "select":
    return cases.uniform_select(op)
  if op.name == "scatter":
    return cases.split_scatter(module, graph, op, _fresh,
                               lambda new: _simplified_and_placed(module, graph, new))
  if op.name not in ("dynamic_update_slice", "dynamic_slice"):
    return None
  return cases.split(module, graph, op, _fresh,
                     lambda new: _simplified_and_placed(module, graph, new), _emit)
