"""Say in words why an op or an output got no relation.

The patterns are the usual distributed bugs: a partial sum used before any
all-reduce, a value scaled by the wrong count, a collective over the wrong
axes, a shard gathered along the wrong dim, shards permuted between ranks.
We look at the operands' relations and at what the per-device program does
with the related values nearby.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.ir import axis_base, axis_shift, rotated_axis
from graphguard_hlo.passes.collectives import COLLECTIVES
from graphguard_hlo.passes.layout import Layout, scales_equal
from graphguard_hlo.passes.online_softmax import infinite_max_words
from graphguard_hlo.passes.pieces import Pieces, partner_dim
from graphguard_hlo.passes.sharding import group_axes, stride_across_mesh
from graphguard_hlo.passes.terms import freeze
from graphguard_hlo.passes.transfer import integers_to_float, ring_shift
from graphguard_hlo.reference import conv_dims


def _dname(v: ir.Value) -> str:
  """Per-device values are named by their op, so they never read like sequential ones."""
  return f"%{v.producer.name}.{v.id}" if v.producer is not None else f"%{v.name or v.id}"


def _seq_name(inf, sid: int) -> str:
  """``%sid``, and when it is an argument, its number and name (JAX names
  them by their pytree path, ``params['wq']``)."""
  for i, p in enumerate(inf.seq.params):
    if p.id == sid:
      locations = inf.seq.param_locations
      name = locations[i].op_name if i < len(locations) else None
      return f"%{sid} (argument {i}{', ' + name if name else ''})"
  return f"%{sid}"


def _axes(axes) -> str:
  return ", ".join(f"'{a}'" for a in axes)


def _scale_words(scale: float, mesh: ir.Mesh) -> str:
  """The wrong factor, and the mesh axes whose size it is: all of them when
  several have that size (a layout's scale does not say which collective
  made it)."""
  inv = 1.0 / scale
  hint = ""
  for factor, words in ((scale, "divided by {n} = {axes} once too often: pmean where psum "
                                "belongs?"),
                        (inv, "summed over {n} = {axes} ranks without dividing: psum where "
                              "pmean belongs?")):
    named = [f"|{a}|" for a, n in mesh.axes if n > 1 and scales_equal(factor, float(n))]
    if named:
      hint = " (" + words.format(n=round(factor), axes=" or ".join(named)) + ")"
  return f"the distributed value is {inv:g} times the sequential one{hint}"


# How far back a wrong factor is followed to where it began.
_ORIGIN_DEPTH = 256
_REDUCTIONS = ("all_reduce", "reduce_scatter")


def _off_by_a_factor(rels: list, members: dict):
  """The relation that says how a value is off.  A value off by a factor
  relates, by a constant, to every per-device value computed from the same
  source (``x / 16`` to the sum before the division too); the one that tells
  is to the value computed last, nearest the op that reads it, and not a
  partial sum (whose scale is each rank's share).  ``members``: the
  per-device values of each class (``deg.members()``)."""
  scaled = [r for r in rels if not r.layout.is_clean()]
  return max(scaled, key=lambda r: (not r.layout.partial,
                                    max((d.id for d in members.get(r.cls, ())), default=-1)))


def _ancestors(v: ir.Value) -> set[int]:
  """The ids of ``v`` and every value it is computed from."""
  seen, todo = {v.id}, [v]
  while todo:
    p = todo.pop().producer
    for x in p.operands if p is not None else ():
      if x.id not in seen:
        seen.add(x.id)
        todo.append(x)
  return seen


def _cap_words(inf, values: Sequence[ir.Value], depth: int = 2) -> Optional[str]:
  """Say so when a value near the failure (``values`` and what they are
  computed from, ``depth`` ops up) reached the cap on relations per value:
  the relation this op needed may be one the cap dropped, and nothing else
  would point there."""
  seen, frontier = set(), list(values)
  for _ in range(depth + 1):
    for v in frontier:
      if v.id in inf.capped:
        return (f"%{v.id} reached the cap of {inf.max_relations} relations per value and "
                "later ones were dropped: the relation needed here may be one of them "
                "(raise the cap: --max-relations N, or max_relations=N in Python)")
    seen.update(v.id for v in frontier)
    frontier = [x for v in frontier if v.producer is not None
                for x in v.producer.operands if x.id not in seen]
  return None


def _constant_words(inf, op: ir.Op) -> Optional[str]:
  """An input-free value (positions, a mask) whose numbers no per-device value
  holds: the one holding its tiles at the most ranks, and where it does not."""
  if len(op.results) != 1 or not inf.constant_values.is_known(op.results[0]):
    return None
  near = inf.constant_values.nearest(op.results[0])
  if near is None:
    return (f"this {op.name} depends on no input, and no per-device value computed from "
            "constants alone holds its tiles under any tiling (or the inputs' chunk orders)")
  d, layout, right, wrong = near
  names = inf.mesh.axis_names

  def at(coords):
    if len(names) == 1:
      return f"{names[0]} = {', '.join(str(c) for (c,) in coords)}"
    return "; ".join(f"({', '.join(f'{a}={c}' for a, c in zip(names, coord))})"
                     for coord in coords)
  return (f"this {op.name} depends on no input; {_dname(d)} (computed from constants) holds "
          f"its tiles as {layout.describe('d', inf.mesh)} at {at(right)} but not at {at(wrong)} "
          "(a table with wrong entries, or one for another layout?)")


def _scale_origin_words(inf, v: ir.Value, start, members: dict) -> str:
  """'; it is off by a factor since the per-device %reduce_scatter.7 at
  zero.py:59, where the distributed value is 4 times the sequential %591
  (summed over 4 = |dp| ...)': a wrong factor fails where it first matters
  (a nonlinear op, an output), often far from the op that made it (a norm in
  the optimizer, for a gradient reduce-scattered without dividing).

  Walked back in the per-device program from the value the failing op
  reads, through values related to sequential ones only off by a factor
  (their partial sums included: a rank's share of a mean is such a value in
  a correct program too, until the reduction divides).  Where the walk
  passes a reduction whose result is off by exactly the size of its axes,
  that is the sum that was not divided (the last such, nearest the inputs:
  the first place the factor could have been removed); else the walk's end,
  the first value off by the factor."""
  by_class: dict = {}
  for sid, rels in inf.relations.items():
    for r in rels:
      if sid >= 0:
        by_class.setdefault(r.cls, []).append((sid, r))
  feeding = _ancestors(v)
  seq_ops = {r.id: op for op in inf.seq.walk() for r in op.results}

  def off(d: ir.Value):
    """(sequential id, relation) saying how ``d`` is off, or None if it
    relates to some sequential value exactly (or to none).  Of the values it
    relates to by a constant, one ``v`` is computed from and made by an op
    of ``d``'s kind (``x / 4`` is 4 times ``mean(x)`` and a quarter of
    ``sum(x)``: the mean's divide is what was meant)."""
    rels = by_class.get(inf.deg.of(d), [])
    if not rels or any(r.layout.is_clean() for _, r in rels):
      return None
    kind = d.producer.name if d.producer is not None else None
    ranked = [(not r.layout.partial, sid in feeding,
               getattr(seq_ops.get(sid), "name", None) == kind) for sid, r in rels]
    return rels[ranked.index(max(ranked))]

  here = next((d for d in reversed(members.get(start.cls, ())) if d.producer is not None), None)
  walked, undivided = [], None
  while here is not None and len(walked) < _ORIGIN_DEPTH and (found := off(here)):
    walked.append(here)
    p, r = here.producer, found[1]
    axes = p.attrs.get("gg.axes") or ()
    size = float(np.prod([inf.mesh.axis_size(a) for a in axes]))
    if p.name in _REDUCTIONS and axes and not r.layout.partial \
        and scales_equal(1.0 / r.layout.scale, size):
      undivided = here
    here = next((y for y in p.operands if y.producer is not None and off(y)), None)
  origin = undivided or (walked[-1] if len(walked) > 1 else None)
  if origin is None:
    return ""
  sid, r = off(origin)
  scale = _scale_words(r.layout.scale, inf.mesh)
  return (f"; it is off by a factor since the per-device {_dname(origin)} at "
          f"{origin.producer.location}, where "
          + scale.replace("the sequential one", f"the sequential {_seq_name(inf, sid)}", 1)
          + _autodiff_sum_words(origin.producer))


# jax's name for the sum autodiff makes of the cotangents of a value that
# shard_map's varying-axis check (check_vma) marks the same on every rank.
_AUTODIFF_SUM = re.compile(r"transpose\(.*\)/psum_invariant$")


def _autodiff_sum_words(op: ir.Op) -> str:
  """'; that all_reduce is jax's own ...': the sum that went undivided was
  written by no one, so the words say who made it.  Under shard_map with
  check_vma, the gradient of an input replicated over an axis is summed over
  it by autodiff; a loss averaged over each rank's own rows makes every
  rank's gradient its share times the axis size, and a pmean of the
  gradients after does not undo the sum (it averages equal values)."""
  if op.name != "all_reduce" or not _AUTODIFF_SUM.search(op.location.op_name or ""):
    return ""
  axes = _axes(op.attrs.get("gg.axes") or ())
  return (f"; that all_reduce is jax's own: under shard_map's check_vma, autodiff sums "
          f"over {axes} the gradient of an input replicated over {axes}, so each rank's "
          f"loss must be its share of the whole (average it with lax.pmean over {axes} "
          f"before differentiating, not the gradients after)")


def _axes_of_reordered_groups(op: ir.Op, mesh) -> Optional[tuple[str, ...]]:
  """The mesh axes a collective's replica groups would run over, were each
  group listed in the mesh's order (None if they would not either)."""
  groups = op.attrs.get("replica_groups")
  if not groups or op.name == "collective_permute":
    return None
  coord_of = {int(d): idx for idx, d in np.ndenumerate(mesh.devices())}
  if any(d not in coord_of for g in groups for d in g):
    return None
  in_mesh_order = tuple(tuple(sorted(g, key=coord_of.__getitem__)) for g in groups)
  return group_axes(in_mesh_order, mesh) if in_mesh_order != tuple(map(tuple, groups)) else None


def _collective_words(inf, cls: int, layout: Layout) -> Optional[str]:
  """What the per-device program does to a related value that breaks the relation."""
  for op in inf.users.get(cls, ()):
    if op.name not in COLLECTIVES:
      continue
    axes = op.attrs.get("gg.axes")
    name = op.name.replace("_", "-")
    loc = op.location
    if axes is None and op.attrs.get("gg.renaming") is None:
      groups = op.attrs.get("replica_groups") or op.attrs.get("source_target_pairs")
      if (reordered := _axes_of_reordered_groups(op, inf.mesh)) is not None:
        return (f"{name} at {loc} runs over {_axes(reordered)} but lists its ranks in "
                f"another order than the mesh's, {groups} (shards concatenated out of order)")
      if (stride := stride_across_mesh(groups, inf.mesh)) is not None:
        return (f"{name} at {loc} moves data between ranks {stride} apart, {groups}, "
                f"across the axes of {dict(inf.mesh.axes)}: no one mesh spells it. XLA "
                "writes such device lists to reshard between axes whose sizes have other "
                "prime factors (P('x', 'y') to P('y', 'x') on 2 x 3), which graphguard "
                "cannot follow; written by hand, it is likely wrong replica groups")
      return (f"{name} at {loc} uses replica groups {groups} that match no mesh axes "
              f"of {dict(inf.mesh.axes)} (wrong replica groups)")
    if op.name == "all_reduce" and layout.partial and set(axes) != set(layout.partial):
      return (f"{name} at {loc} reduces over {_axes(axes)} but the partial sum is over "
              f"{_axes(layout.partial)} (wrong replica groups / wrong axis)")
    if op.name == "all_gather":
      k = op.attrs.get("all_gather_dimension")
      split = [d for d, a in enumerate(layout.dims) if set(axes) & set(a)]
      have = layout.dims[k] if k is not None and k < layout.rank else ()
      if have and have[len(have) - len(axes):] != tuple(axes):
        return (f"{name} at {loc} gathers over {_axes(axes)} along dim {k}, but dim {k} "
                f"is split over {_axes(have)} (gathered over the wrong mesh axis)")
      if split and k not in split:
        return (f"{name} at {loc} concatenates shards along dim {k}, but the value is "
                f"split over {_axes(axes)} along dim {split[0]} (shard concatenated on the "
                f"wrong dim)")
    if op.name == "collective_permute" and inf.transfer.rank_tables.starts_at(op):
      continue  # a gather or reshard some ranks take no part in: said rank by rank
    if op.name == "collective_permute" and set(axes or ()) & layout.split_axes() \
        and not ring_shift(op, inf.mesh):
      pairs = op.attrs.get("source_target_pairs")
      return (f"{name} at {loc} moves shards split over {_axes(axes)} to other ranks "
              f"(pairs {list(pairs)}): shards are permuted between ranks")
  return None


def _operand_problems(inf, op: ir.Op) -> list[str]:
  problems = []
  for v in op.operands:
    rels = inf.relations.get(v.id, [])
    # A microbatched operand's pieces are what the per-device program reduces.
    split = inf.pieces.splits.get(v.id)
    pieces = [r for t in (split.terms if split else ()) for r in inf.relations.get(t.id, ())]
    if not rels and not pieces:
      continue
    collective = [w for r in rels + pieces for w in [_collective_words(inf, r.cls, r.layout)]
                  if w]
    if rels and all(r.layout.partial for r in rels) and not collective:
      r = rels[0]
      problems.append(f"operand %{v.id} is only known as a partial {r.layout.partial_kind} over "
                      f"{_axes(r.layout.partial)} that is never reduced before this "
                      f"{op.name} (missing all-reduce)")
    elif rels and all(not r.layout.is_clean() for r in rels) and \
        not _constant_applied_elsewhere(inf, v, rels):
      members = inf.deg.members()
      off = _off_by_a_factor(rels, members)
      problems.append(f"operand %{v.id}: {_scale_words(off.layout.scale, inf.mesh)}"
                      f"{_scale_origin_words(inf, v, off, members)}")
    problems.extend(collective)  # reduced, but wrongly: say how
  return problems


def _constant_applied_elsewhere(inf, v: ir.Value, rels: list, depth: int = 3) -> bool:
  """``v = s * c`` (or ``s / c``) relates to what ``s`` relates to, scaled by
  c, until the per-device program applies c too.  If that is all ``v``
  relates by, and the per-device program does apply c a few ops after a
  value ``s`` relates to (weight decay on a parameter's tile, say) but gets
  no value related to ``v``, the scale is no evidence of a wrong factor: the
  per-device product differs for another reason, said by the other words."""
  p = v.producer
  if p is None or p.name not in ("multiply", "divide") or len(p.operands) != 2 or \
      not all(r.how.startswith("scale-by-constant") for r in rels):
    return False
  constants = {inf.splats.get(x.id) for x in p.operands} - {None}
  if len(constants) != 1:
    return False
  (c,) = constants
  related = {r.cls for r in rels}
  frontier = set(related)
  for _ in range(depth):
    reached = set()
    for cls in frontier:
      for d_op in inf.users.get(cls, ()):
        if d_op.name == p.name and inf.deg.of(d_op.results[0]) not in related and any(
            (k := inf.deg.splat(inf.deg.of(x))) is not None and scales_equal(k, c)
            for x in d_op.operands):
          return True
        reached |= {inf.deg.of(r) for r in d_op.results}
    frontier = reached
  return False


def _related(inf, op: ir.Op) -> dict:
  """The per-device classes related to ``op``'s operands, with a relation each."""
  return {r.cls: r for v in op.operands for r in inf.relations.get(v.id, [])}


def _counterpart_words(inf, op: ir.Op) -> Optional[str]:
  """A per-device op of the same kind that reads values related to our operands."""
  related = _related(inf, op)
  seq_of = None  # per-device class -> a sequential value it relates to, when needed
  for d_op in _same_kind_nearby(inf, op, related):
    notes = []
    for dv in d_op.operands:
      c = inf.deg.of(dv)
      if c in related:
        lay = related[c].layout
        if lay.partial:  # (its scale is each rank's share: a pmean's 1/n, say)
          kind = "sum" if lay.partial_kind == "sum" else lay.partial_kind + "imum"
          notes.append(f"{_dname(dv)}, a partial {kind} over {_axes(lay.partial)} never "
                       "reduced (missing all-reduce)")
        elif not lay.is_clean():
          notes.append(f"{_dname(dv)}, where {_scale_words(lay.scale, inf.mesh)}")
      elif (other := _other_constant(inf, op, dv)) is not None:
        notes.append(other)
      elif dv.producer is not None and inf.deg.splat(c) is None:  # (constants match)
        if seq_of is None:
          seq_of = _seq_values_by_class(inf)
        notes.append(f"{_dname(dv)} (at {dv.producer.location}), which relates to no "
                     f"sequential value{_made_from_related(inf, dv, seq_of)}")
    if notes:
      return f"the per-device {op.name} at {d_op.location} reads " + "; ".join(notes)
  return None


def _other_constant(inf, op: ir.Op, dv: ir.Value) -> Optional[str]:
  """'%b, the constant 4 where the sequential op reads 1 (|dp| = 4 times ...)':
  the per-device op reads a splat and ``op`` another, as where autodiff of a
  psum under shard_map with ``check_vma=False`` seeds the cotangent with
  the axis size instead of ones."""
  mine = inf.deg.splat(inf.deg.of(dv))
  theirs = {inf.splats[v.id] for v in op.operands if v.id in inf.splats}
  if mine is None or len(theirs) != 1 or mine in theirs:
    return None
  (want,) = theirs
  words = f"{_dname(dv)}, the constant {mine:g} where the sequential {op.name} reads {want:g}"
  if want and np.isfinite(mine / want):
    named = [f"|{a}| = {n}" for a, n in inf.mesh.axes
             if n > 1 and scales_equal(mine / want, float(n))]
    if named:
      words += (f" ({' or '.join(named)} times: a cotangent summed over the ranks, as "
                "autodiff of a psum under shard_map with check_vma=False seeds it?)")
  return words


def _seq_values_by_class(inf) -> dict:
  """Per-device class -> (the first sequential value related to it, how);
  not the terms of sums and microbatch pieces (negative ids), which name no
  sequential value a reader could find."""
  seq_of: dict = {}
  for sid, rels in inf.relations.items():
    if sid < 0:
      continue
    for r in rels:
      seq_of.setdefault(r.cls, (sid, r))
  return seq_of


def _same_kind_nearby(inf, op: ir.Op, related: dict):
  """Per-device ops of ``op``'s kind that read values related to its operands,
  or values computed from them by one op (where a bug often sits)."""
  near = list(related)
  one_op_away = [inf.deg.of(r) for c in near for u in inf.users.get(c, ()) for r in u.results]
  seen = set()
  for c in near + one_op_away:
    for d_op in inf.users.get(c, ()):
      if d_op.name == op.name and id(d_op) not in seen:
        seen.add(id(d_op))
        yield d_op


def _made_from_related(inf, dv: ir.Value, seq_of: dict, depth: int = 4) -> str:
  """': it is a transpose (permutation [1, 2, 0]) of %x, which is the
  sequential %4 as ...': the nearest per-device value (a few ops back) that
  relates to some sequential one, and the ops from it to ``dv``.  Those ops
  are where to look.  Said only when the collective right before ``dv`` is
  not already explained by ``_collective_words``."""
  paths = [[dv.producer]]
  for _ in range(depth):
    grown = []
    for path in paths:
      for x in path[-1].operands:
        found = seq_of.get(inf.deg.of(x))
        if found is not None:
          if path[0].name in COLLECTIVES and len(path) == 1 and \
              not inf.transfer.rank_tables.starts_at(path[0]):
            return ""  # said by _collective_words, in the collective's own terms
          return _path_words(inf, path, x, *found) + _held_words(inf, path, x, *found, dv)
        if x.producer is not None and inf.deg.splat(inf.deg.of(x)) is None:
          grown.append(path + [x.producer])
    paths = grown[:16]
  return ""


def _path_words(inf, path: list, x: ir.Value, sid: int, r) -> str:
  mesh = inf.mesh
  source = f"{_dname(x)}, which is the sequential {_seq_name(inf, sid)} as " \
      f"{r.layout.describe('d', mesh)}"
  if len(path) == 1:
    p = path[0]
    shown = [f"{k} {_attr_text(a)}" for k, a in p.attrs.items()
             if not k.startswith(("gg.", "test."))] + [_offset_words(p, mesh)]
    shown = [w for w in shown if w]
    attrs = f" ({', '.join(shown)})" if shown else ""
    return f": it is a {p.name}{attrs} of {source}"
  steps = ", ".join(_step_words(p, mesh) for p in reversed(path))
  return f": it is computed from {source}, by {steps}"


_HELD_DEPTH = 8  # ops back from the value read, for what each rank holds


def _held_words(inf, path: list, x: ir.Value, sid: int, r, dv: ir.Value) -> str:
  """'; rank by rank it holds, on every rank: %1[0:8, 0:8] at [0:8, 0:8], ...':
  where ``dv`` is computed (a few ops back) through a permute some ranks
  receive nothing from or a zero pad (a gather or reshard written by hand or
  by XLA), or is a concat of a permuted value (a halo exchange), what each
  rank ends up holding of the sequential %sid that ``x``
  relates to (rank_tables.py): that is what the reader must check."""
  tables = inf.transfer.rank_tables
  seq_value = next((v for v in inf.seq.params if v.id == sid), None) or next(
      (v for op in inf.seq.walk() for v in op.results if v.id == sid), None)
  if seq_value is None or r.layout.local_shape(seq_value.shape, inf.mesh) != x.shape:
    return ""  # (x holds the tile with other unit dims: boxes would not line up)
  cone, frontier = {}, [dv]
  for _ in range(_HELD_DEPTH):
    ops = {id(v.producer): v.producer for v in frontier if v.producer is not None}
    cone.update(ops)
    frontier = list({y.id: y for op in ops.values() for y in op.operands}.values())
  # (or a concat of a permuted value: a halo exchange, cyclic or not)
  halo = dv.producer is not None and dv.producer.name == "concatenate" and any(
      p.name == "collective_permute" for p in cone.values())
  if not halo and not any(tables.starts_at(p) for p in path + list(cone.values())):
    return ""
  table = tables.table_of(dv, inf.deg.of(x), r.layout, x.shape, _HELD_DEPTH)
  if table is None or all(held is None for held in table):
    return ""
  return f"; rank by rank it holds, {tables.describe(table, dv.shape, f'%{sid}')}"


def _step_words(op: ir.Op, mesh: ir.Mesh) -> str:
  offsets = _offset_words(op, mesh)
  return f"{op.name} at {op.location}" + (f" ({offsets})" if offsets else "")


def _offset_words(op: ir.Op, mesh: ir.Mesh) -> str:
  """'starting at 8, 16, 24, 0 along dim 0 at dp = 0, 1, 2, 3: tile dp+1,
  another rank's tile?': where a dynamic slice or update that moves with the
  rank starts on each rank, read off the partition id ('' if it does not
  move).  A slice at the tile of another rank than its own is a classic
  shard-offset bug, and the offsets are what the reader has to check."""
  from graphguard_hlo.passes.rank_arith import moves_with_one_axis, tile_turn
  if op.name == "dynamic_slice":
    first, sizes = 1, tuple(op.attrs["slice_sizes"])
  elif op.name == "dynamic_update_slice":
    first, sizes = 2, op.operands[1].shape
  else:
    return ""
  for dim, start in enumerate(op.operands[first:]):
    found = moves_with_one_axis(start, mesh)
    if found is None:
      continue
    axis, values = found
    n = len(values)
    words = (f"starting at {', '.join(map(str, values))} along dim {dim} at {axis} = "
             f"{', '.join(map(str, range(n)))}")
    turn = tile_turn(values, sizes[dim])
    return words + (f": tile {rotated_axis(axis, turn, n)}, another rank's tile?"
                    if turn else "")
  return ""


def _mismatch_words(inf, op: ir.Op) -> Optional[str]:
  """A per-device op of the same kind reads values related to our operands,
  in the same places, but its result or attributes are not those any lemma
  asks for on them: say what differs (dims in another order, another slice)."""
  for d_op in _same_kind_nearby(inf, op, _related(inf, op)):
    words = _attr_words(inf, op, d_op)
    if words:
      return words
  return None


def _attr_words(inf, op: ir.Op, d_op: ir.Op) -> Optional[str]:
  if len(op.operands) != len(d_op.operands):
    return None
  layouts = []
  for v, dv in zip(op.operands, d_op.operands):
    c = inf.deg.of(dv)
    if v.id in inf.splats and inf.deg.splat(c) is not None:
      layouts.append(Layout.replicated(v.type.rank))
      continue
    mine = [r.layout for r in inf.relations.get(v.id, []) if r.cls == c]
    if not mine:
      return None  # not the related value in this place
    layouts.append(mine[0])
  got = d_op.results[0].type if d_op.results else None
  for step in inf.lemma_steps(op, layouts):
    head = f"the per-device {op.name} at {d_op.location} reads the related operands but"
    if got is not None and got.shape != step.result_type.shape:
      return (f"{head} gives {got} where {step.layout.describe('d', inf.mesh)} needs "
              f"{step.result_type} (dims laid out in another order?)")
    differ = sorted(k for k, want in step.attrs.items()
                    if not k.startswith("gg.") and freeze(d_op.attrs.get(k)) != freeze(want))
    if differ:
      shown = "; ".join(f"{k} {_attr_text(d_op.attrs.get(k))} where {_attr_text(step.attrs[k])} "
                        f"would give {step.layout.describe('d', inf.mesh)}" for k in differ)
      return f"{head} with {shown} (dims or indices in another order?)"
  return None


def _attr_text(value) -> str:
  if isinstance(value, (tuple, np.ndarray)):
    return str(np.asarray(value).tolist())
  return str(value)


def _pin_words(inf, op: ir.Op) -> Optional[str]:
  """Operands that are the sequential values only at ranks that never meet:
  one pipeline stage holds one, another stage the other (a microbatched
  operand: wherever its pieces are held)."""
  seen = _pinned_operands(inf, op)
  classes = set().union(*(_related_classes(inf, v) for v in op.operands))
  for axis, found in seen.items():
    for (v1, c1), (v2, c2) in zip(found, found[1:]):
      if c1 & c2:
        continue
      permutes = [d for d in inf.whole_dist.graph.walk() if d.name == "collective_permute"
                  and d.attrs.get("gg.axes") == (axis,)]
      # The permute that sent an operand's value, if one did; else the first.
      permute = next((d for d in permutes if inf.deg.holds(d.results[0])
                      and inf.deg.of(d.results[0]) in classes),
                     permutes[0] if permutes else None)
      hint = "" if permute is None else (
          f"; collective-permute at {permute.location} sends "
          f"{list(permute.attrs.get('gg.permutation') or ())} over {axis!r} "
          f"(activations or their cotangents passed to the wrong stage?)")
      where = lambda cs: ", ".join(f"{axis}={c}" for c in sorted(cs))
      return (f"operand %{v1.id} is the sequential value only at {where(c1)} and "
              f"%{v2.id} only at {where(c2)}: no rank holds both{hint}")
  return None


def held_at_different_ranks(inf, op: ir.Op) -> Optional[str]:
  """Words saying which two of ``op``'s operands are the sequential values
  only at ranks that never meet, if two are (``_pin_words``)."""
  return _pin_words(inf, op)


def _relations(inf, v: ir.Value) -> list:
  """``v``'s relations, and its pieces' if the program cut it; for a
  broadcast left for pieces to read (``inference.walk_ops``), its operand's."""
  operand = inf.deferred_broadcast_operand(v)
  if operand is not None:
    return _relations(inf, operand)
  split = inf.pieces.splits.get(v.id)
  return [r for t in ((v,) + (split.terms if split else ())) for r in inf.relations.get(t.id, ())]


def _related_classes(inf, v: ir.Value) -> set[int]:
  return {r.cls for r in _relations(inf, v)}


def _pinned_operands(inf, op: ir.Op) -> dict[str, list[tuple[ir.Value, set[int]]]]:
  """Per mesh axis, the operands every relation of which pins that axis, and
  the coordinates they are held at."""
  seen: dict[str, list[tuple[ir.Value, set[int]]]] = {}
  for v in op.operands:
    rels = _relations(inf, v)
    for axis in {a for r in rels for a, _ in r.layout.at}:
      # (a value pinned with zeros elsewhere is also a partial sum over the axis)
      coords = {dict(r.layout.at).get(axis) for r in rels if axis not in r.layout.partial}
      if None not in coords:  # every other relation of v pins this axis
        seen.setdefault(axis, []).append((v, coords))
  return seen


def _held_apart_words(inf, op: ir.Op) -> Optional[str]:
  """Operands all held at one stage that no per-device op reads together:
  the stage computed this op, if at all, on other values (a schedule running
  another layer or microbatch at that step).  Said only when nothing more
  specific is."""
  operands = list(dict.fromkeys(op.operands))
  if len(operands) < 2:
    return None
  for axis, found in _pinned_operands(inf, op).items():
    if len(found) != len(op.operands):
      continue
    common = set.intersection(*(c for _, c in found))
    if not common:
      continue
    related = [_related_classes(inf, v) for v in operands]
    for cls in related[0]:
      for user in inf.users.get(cls, ()):
        read = {inf.deg.of(x) for x in user.operands}
        if all(read & classes for classes in related):
          return None  # read together somewhere: not this
    where = ", ".join(f"{axis}={c}" for c in sorted(common))
    names = ", ".join(f"%{v.id}" for v in operands)
    return (f"operands {names} are each the sequential value at {where}, but no "
            f"per-device op reads them together: the program computes this {op.name} "
            f"there on other values, if at all (a stage running another layer's or "
            f"another microbatch's step?)")
  return None


def _ring_words(inf, op: ir.Op) -> Optional[str]:
  """A ring that writes a block at another block's place: the block in hand
  is tile r + j (after the ring's permutes) but is written at tile r + j'."""
  for v in op.operands:
    for r in inf.relations.get(v.id, []):
      if r.layout.is_plain() or r.layout.filled:
        continue
      for d_op in inf.transfer.ring_writes_by_class.get(r.cls, ()):
        if inf.deg.of(d_op.operands[1]) != r.cls:
          continue
        k, axis, j = inf.transfer.ring_writes[id(d_op)]
        held = ", ".join(r.layout.dims[k]) or "whole"
        written = rotated_axis(axis, j, inf.mesh.axis_size(axis))
        if r.layout.dims[k] == (written,):
          continue
        moved = d_op.operands[1].producer
        how = ""
        if moved is not None and moved.name == "collective_permute":
          ring = ring_shift(moved, inf.mesh)
          shift = None if ring is None else ring[1]
          n = inf.mesh.axis_size(axis)
          step = "" if shift is None else f", r -> r {'+' if shift <= n // 2 else '-'} " \
              f"{shift if shift <= n // 2 else n - shift}"
          how = (f" after the collective-permute at {moved.location} (pairs "
                 f"{list(moved.attrs.get('gg.permutation') or ())}{step})")
        return (f"a ring passes blocks of %{v.id} round {axis!r}: {_dname(d_op.operands[1])}"
                f"{how} holds tile {held} of dim {k}, but the dynamic-update-slice at "
                f"{d_op.location} writes it at tile {written}, so the buffer never holds "
                f"the whole of %{v.id} (ring turning the wrong way, or offsets off by a step?)")
  return None


def _share_words(inf, op: ir.Op) -> Optional[str]:
  """A dot whose per-device shares (each rank's rows against each block a
  ring brings, ``ring_blocks.py``) are all computed but
  never add up: a block's shares must travel round the ring with it."""
  for (whole, x), by_class in inf.ring_blocks.shares.get(op.results[0].id, {}).items():
    n = inf.mesh.axis_size(x)
    (k, _, _), *_ = next(iter(by_class.values()))
    shifts = sorted({s for d in inf.dist.graph.walk() if d.name == "collective_permute"
                     for found in [ring_shift(d, inf.mesh)] if found is not None
                     for axis, s in [found] if axis == x})
    turns = {j for ts in by_class.values() for _, j, _ in ts}
    missing = sorted(set(range(n)) - turns)
    blocks = lambda js: "{" + ",".join(map(str, sorted(js))) + "}"
    if missing:
      return (f"the per-device program computes each rank's share of this {op.name}'s "
              f"blocks {x}+{blocks(turns)} along dim {k} (its rows against the blocks a "
              f"ring brings round {x!r}) but never of blocks {x}+{blocks(missing)} (a ring "
              f"step missing?)")
    words = (f"the per-device program computes every rank's share of this {op.name}'s "
             f"blocks {x}+{{0..{n - 1}}} along dim {k} (its rows against each block a ring "
             f"brings round {x!r}), but never adds each block's shares together: they "
             f"must travel round the ring the way the block does")
    if len(shifts) > 1:
      sends = " and ".join(f"r -> r + {s}" for s in shifts)
      return (f"{words}; collective-permutes round {x!r} send {sends} (mod {n}) "
              f"(gradients sent the wrong way round the ring?)")
    return f"{words} (a share dropped, added twice, or at another step?)"
  return None


def _fold_words(inf, op: ir.Op) -> Optional[str]:
  """A reduction over a dim whose blocks a ring passes round, with some
  blocks never formed: the values a ring step combines disagree on which
  block is in hand."""
  if op.name not in ("reduce", "dot_general") or not inf.transfer.rings:
    return None
  dims = op.attrs["dimensions"] if op.name == "reduce" else op.attrs["lhs_contract"]
  v = op.operands[0]
  turns: dict[str, set[int]] = {}
  for r in inf.relations.get(v.id, []):
    names = [x for d in dims for x in r.layout.dims[d]]
    if len(names) == 1 and axis_base(names[0]) in inf.transfer.rings:
      turns.setdefault(axis_base(names[0]), set()).add(axis_shift(names[0]))
  # An online softmax left as it is, its running max maybe infinite, holds
  # its blocks in no form a fold reads: that is the cause to name first.
  infinite = infinite_max_words(inf.dist.module, inf.dist.graph) if turns else None
  if infinite is not None:
    infinite = (f"its online softmax is not telescoped, since its running max may be "
                f"infinite: {infinite}; where a row's blocks so far are all masked the device "
                f"computes exp(-inf + inf) = NaN (mask with a finite value, -1e9, or start "
                f"each rank on a block that keeps a key in every row)")
  for axis, found in turns.items():
    n = inf.mesh.axis_size(axis)
    missing = sorted(set(range(n)) - found)
    if not missing:
      words = (f"the per-device program holds every block {axis}+{{0..{n - 1}}} of %{v.id} "
               f"that a ring passes round {axis!r}, but no sum (or max) of this "
               f"{op.name}'s per-block results over exactly those blocks: ")
      if infinite is not None:
        return words + infinite
      return (f"{words}an online softmax must rescale what it has summed by exp(m - m_new) "
              f"whenever the running max grows (a rescale forgotten?)")
    if infinite is not None:
      return (f"the {op.name} over dims {list(dims)} of %{v.id} runs over blocks a ring "
              f"passes round {axis!r}, and the per-device program combines only blocks "
              f"{axis}+{{{','.join(map(str, sorted(found)))}}} of it: {infinite}")
    blocks = lambda js: "{" + ",".join(map(str, sorted(js))) + "}"
    permutes = [(d, shift) for d in inf.dist.graph.walk() if d.name == "collective_permute"
                for shift in [ring_shift(d, inf.mesh)] if shift is not None]
    round_axis = [(d, s) for d, (x, s) in permutes if x == axis]
    if round_axis:
      d, s = round_axis[0]
      ring = f"; the ring's collective-permute at {d.location} sends r -> r + {s} (mod {n})"
    elif permutes:
      d, (x, _) = permutes[0]
      ring = (f"; no collective-permute passes blocks round {axis!r}: the ring's at "
              f"{d.location} goes round {x!r} (wrong axis?)")
    else:
      ring = ""
    return (f"the {op.name} over dims {list(dims)} of %{v.id} runs over blocks a ring "
            f"passes round {axis!r}: the per-device program holds blocks {axis}+"
            f"{blocks(found)} of it but never {axis}+{blocks(missing)}: at those steps the "
            f"values it combines hold different blocks (keys vs. mask offsets: a ring "
            f"turning the wrong way, or offsets for another step?){ring}")
  return None


def _under_reshapes(v: ir.Value) -> Optional[ir.Op]:
  """The op producing v, seen through broadcasts, reshapes and converts."""
  op = v.producer
  while op is not None and op.name in ("broadcast_in_dim", "reshape", "convert"):
    op = op.operands[0].producer
  return op


def _microbatch_words(inf, op: ir.Op) -> Optional[str]:
  """A slice the sequential loop's split into microbatches made, with no
  per-device counterpart: no device runs that microbatch there."""
  words = getattr(inf.seq, "microbatch_slices", {}).get(id(op))
  if words is None:
    return None
  return (f"{words}; no per-device value holds these rows (a microbatch skipped, or fed at "
          f"another step?)")


# How far back from a failing op an iota is looked for, through the ops
# positions flow through on their way to RoPE's angles or a mask.
_IOTA_DEPTH = 6
_POSITION_CARRIERS = frozenset({"broadcast_in_dim", "reshape", "convert", "concatenate",
                                "slice", "transpose", "multiply", "divide", "add", "subtract",
                                "cosine", "sine", "compare", "and", "select"})


def _iotas_feeding(op: ir.Op) -> list[ir.Op]:
  """The sequential iotas a few position-carrying ops before ``op``."""
  if op.name == "iota":
    return [op]
  found, frontier, seen = [], [op], set()
  for _ in range(_IOTA_DEPTH):
    ahead = []
    for o in frontier:
      for v in o.operands:
        p = v.producer
        if p is None or id(p) in seen:
          continue
        seen.add(id(p))
        if p.name == "iota":
          found.append(p)
        elif p.name in _POSITION_CARRIERS:
          ahead.append(p)
    frontier = ahead
  return found


def _iota_words(inf, op: ir.Op) -> Optional[str]:
  """A sequential iota (positions, a mask's rows) whose per-device tiles are
  missing: if the devices run iotas of a tile's length, they count from 0.
  An integer iota converted to the sequential float one counts alike."""
  seq_iotas = _iotas_feeding(op)
  if not seq_iotas:
    return None
  offset = {id(v.producer) for add in inf.transfer.iota_adds for v in add.operands}
  unshifted = [d for d in inf.dist.graph.walk() if d.name == "iota" and id(d) not in offset]
  for seq_iota in seq_iotas:
    t = seq_iota.results[0].type
    n_seq = t.shape[seq_iota.attrs["iota_dimension"]]
    for d_op in unshifted:
      dtype = d_op.results[0].type.dtype
      if dtype != t.dtype and not integers_to_float(dtype, t.dtype):
        continue
      n = d_op.results[0].type.shape[d_op.attrs["iota_dimension"]]
      if n < n_seq and n_seq % n == 0:
        return (f"the sequential iota at {seq_iota.location} counts 0..{n_seq - 1}; the "
                f"per-device program counts 0..{n - 1} (iota at {d_op.location}) with no "
                f"rank offset, so every rank uses the first shard's values (positions, "
                f"ids or mask not offset per shard?)")
  return None


def _indexed_tile_words(inf, op: ir.Op) -> Optional[str]:
  """A gather (or scatter) whose operand every rank holds only a tile of
  along a dim the indices pick from: each rank looks up (or adds into) its
  tile as if it were the whole table."""
  if op.name not in ("gather", "scatter"):
    return None
  from graphguard_hlo.reference import dimension_numbers
  key, field = (("dimension_numbers", "start_index_map") if op.name == "gather" else
                ("scatter_dimension_numbers", "scatter_dims_to_operand_dims"))
  indexed = dimension_numbers(op.attrs.get(key, "")).get(field, ())
  for r in inf.whole_relations(op.operands[0]):
    split = [(d, r.layout.dims[d]) for d in indexed if d < r.layout.rank and r.layout.dims[d]]
    if split:
      d, axes = split[0]
      masked = _masked_lookup_words(inf, r.cls) if op.name == "gather" else None
      if masked:
        return (f"its indices pick along dim {d}, which each rank holds only a tile of "
                f"(split over {_axes(axes)}); the per-device program looks its tile up "
                f"masked, but not as a lookup in a table split by rows: {masked}")
      return (f"its indices pick along dim {d}, which each rank holds only a tile of "
              f"(split over {_axes(axes)}): every rank indexes its tile as if it were the "
              f"whole dim (missing all-gather?)")
  return None


def _halo_words(inf, op: ir.Op) -> Optional[str]:
  """A convolution over a dim split over ranks whose per-device operand holds
  each tile with its neighbours' rows, but not as many before as the
  sequential convolution pads there (or too few after for a tile's
  outputs): a halo exchange of the wrong size."""
  if op.name != "convolution" or not op.attrs.get("dimension_numbers"):
    return None
  (_, _, *spatial), (_, _, *window_dims), _ = conv_dims(op.attrs["dimension_numbers"])
  pads = np.array(op.attrs.get("padding") if op.attrs.get("padding") is not None
                  else np.zeros((len(spatial), 2), int)).reshape(len(spatial), 2)
  dilations = op.attrs.get("rhs_dilation") or (1,) * len(spatial)
  strides = op.attrs.get("window_strides") or (1,) * len(spatial)
  rows = lambda n: f"{n} row{'' if n == 1 else 's'}"
  for r in inf.relations.get(op.operands[0].id, ()):
    tile = r.layout.local_shape(op.operands[0].shape, inf.mesh)
    for d, lo, hi in r.layout.halo:
      if d not in spatial or tile is None:
        continue
      j = spatial.index(d)
      t = tile[d] - lo - hi
      window = (op.operands[1].shape[window_dims[j]] - 1) * dilations[j] + 1
      after = max(window - strides[j] - lo, 0)  # (rows after the tile its outputs read)
      head = (f"the per-device program holds each rank's tile of dim {d} with {rows(lo)} of "
              f"the rank before and {hi} of the rank after ({inf.value_name(r.cls)})")
      if lo != pads[j][0]:
        return (f"{head}, where this convolution pads {pads[j][0]} before "
                f"(a halo exchange of the wrong size?)")
      if t % strides[j] == 0 and hi < after:
        return f"{head}, where a tile's last output reads {after} after (a halo too small?)"
  return None


def _sliced_tile_words(inf, op: ir.Op) -> Optional[str]:
  """A slice across a dim every rank holds a tile of, where the per-device
  program runs the same slice on each rank's tile (its window the slice's
  over the rank count): the windows are not the slice's tiles (a fused q|k|v
  projection split over ranks as one value, each rank then taking a third of
  its columns as q)."""
  if op.name != "slice" or set(op.attrs["strides"]) != {1}:
    return None
  x = op.operands[0]
  start, limit = op.attrs["start_indices"], op.attrs["limit_indices"]
  for r in inf.whole_relations(x):
    l = r.layout
    cut = [d for d in range(l.rank) if l.dims[d] and (start[d], limit[d]) != (0, x.shape[d])]
    if not cut or not l.is_plain() or l.partial:
      continue
    d, axes = cut[0], l.dims[cut[0]]
    n = int(np.prod([inf.mesh.axis_size(a) for a in axes]))
    tile = x.shape[d] // n
    halo = next((u for s_op in inf.users.get(r.cls, ()) if s_op.name == "slice"
                 for u in inf.users.get(inf.deg.of(s_op.results[0]), ())
                 if u.name == "collective_permute"), None)
    if halo is not None:
      return (f"it takes [{start[d]}, {limit[d]}) along dim {d}, which each rank holds a "
              f"tile of (split over {_axes(axes)}); the per-device program moves parts of "
              f"the tiles between ranks (collective-permute at {halo.location}) to reshard "
              "it, which graphguard-hlo does not follow for a slice (a limitation, not a "
              "sign of a bug)")
    for d_op in inf.users.get(r.cls, ()):
      if d_op.name != "slice" or d_op.operands[0].shape[d] != tile:
        continue
      a, b = d_op.attrs["start_indices"][d], d_op.attrs["limit_indices"][d]
      if (a * n, b * n) != (start[d], limit[d]):
        continue  # not the sequential slice run on a tile (a halo XLA exchanges)
      windows = ", ".join(f"[{t * tile + a}, {t * tile + b})" for t in range(min(n, 4)))
      return (f"it takes [{start[d]}, {limit[d]}) along dim {d}, which each rank holds a tile "
              f"of (split over {_axes(axes)}, {tile} of {x.shape[d]}); the per-device slice "
              f"at {d_op.location} cuts [{a}, {b}) out of every rank's tile, that is "
              f"{windows}{', ...' if n > 4 else ''} of the whole, not this slice's tiles (a "
              "value that joins parts, such as a fused q|k|v projection, split over ranks "
              "as one? split each part instead)")
  return None


def _masked_lookup_words(inf, table_cls: int) -> Optional[str]:
  """Where a masked per-device lookup of this table tile (select(mask, 0,
  gather(tile, j))) departs from ``gg.tile_gather`` (tile_lookup.py)."""
  from graphguard_hlo.passes.tile_lookup import explain_tile_gather
  for g in inf.users.get(table_cls, ()):
    if g.name != "gather" or not g.results:
      continue
    for select in inf.users.get(inf.deg.of(g.results[0]), ()):
      words = explain_tile_gather(select, inf.deg, inf.arith, inf.mesh)
      if words:
        return words
  return None


def _order_words(chunks: Optional[tuple]) -> str:
  if chunks is None:
    return "in sequence order (contiguous shards)"
  n = len(chunks) // 2
  zigzag = tuple(c for r in range(n) for c in (r, 2 * n - 1 - r))
  return f"in the order {' '.join(map(str, chunks))}" + (" (zig-zag)" if chunks == zigzag else "")


def _chunk_order_words(inf, op: ir.Op) -> Optional[str]:
  """Two operands that meet along a dim holding its chunks in different
  orders (chunk_order.py): a zig-zag shard read with a contiguous one."""
  for k, v in enumerate(op.operands):
    for r in inf.known_relations(v):
      for d, chunks in r.layout.order:
        for j, w in enumerate(op.operands):
          p = None if j == k else partner_dim(op, k, d, j)
          if p is None or w.type.rank == 0 or w.id in inf.splats or \
              Pieces.constant_along(w, p):
            continue
          theirs = {dict(x.layout.order).get(p) for x in inf.known_relations(w)}
          if theirs and chunks not in theirs:
            other = sorted(theirs, key=lambda c: c is not None)[0]
            return (f"operand %{v.id} holds the chunks of dim {d} {_order_words(chunks)}, "
                    f"operand %{w.id} holds them {_order_words(other)}: each rank pairs "
                    f"rows of different positions (chunk order mismatch)")
  return None


# Ops that reorder elements along dims of their own: rows a rank does not
# hold cannot take part, so along a split dim each rank's result is its own.
_ALONG_DIMS = {"sort": lambda op: (op.attrs["dimension"],),
               "reverse": lambda op: tuple(op.attrs["dimensions"])}


def _along_split_dim_words(inf, op: ir.Op) -> Optional[str]:
  """A sort (or reverse) along a dim every relation of its operand splits:
  each rank sorts its own tile, not the whole."""
  dims_of = _ALONG_DIMS.get(op.name)
  rels = inf.whole_relations(op.operands[0]) if dims_of else []
  if not rels:
    return None
  dims = dims_of(op)
  split = [tuple(x for d in dims for x in r.layout.dims[d]) for r in rels]
  if not all(split):
    return None
  return (f"this {op.name} {op.name}s along dim {', '.join(map(str, dims))}, which its "
          f"operand holds split over {_axes(dict.fromkeys(a for s in split for a in s))}: each "
          f"rank would {op.name} only its own tile (gather the dim first, or {op.name} along "
          "another)")


def _random_counter_words(op: ir.Op) -> Optional[str]:
  """jax.random numbers each element of a draw by its position in the draw's
  shape (``iota_2x32_shape``) and hashes it with the key: a rank drawing a
  mask of its local shape numbers its elements from 0, so its bits are not
  its tile of the sequential draw's, whatever the key."""
  if "iota_2x32_shape" not in (op.location.op_name or "") or len(op.results) != 1:
    return None
  return (f"these are the element counters of a jax.random draw of shape "
          f"{tuple(op.results[0].type.shape)}, and no "
          "per-device value holds them: the per-device program draws for another shape (a "
          "rank drawing its own local-shaped mask gets other bits than its part of the "
          "sequential draw, whatever its key; draw the sequential shape and slice the rank's "
          "part, or let GSPMD partition the draw)")


# jax.random's jitted draws, as they appear in an op's name path.
_RANDOM_DRAWS = re.compile(r"jit\((_random_bits|_uniform|_normal|_bernoulli|_randint|"
                           r"_truncated_normal|_gumbel|_categorical|_choice|_permutation|"
                           r"_fold_in|_split|_exponential|_gamma|_beta|_dirichlet|_laplace|"
                           r"_logistic|_cauchy|_poisson|_rademacher)\)")


def _random_draw_words(op: ir.Op) -> Optional[str]:
  """An op inside a jax.random draw with no relation: the two programs hash
  other keys or counters (a key folded with the rank), or draw otherwise."""
  draws = _RANDOM_DRAWS.findall(op.location.op_name or "")
  if not draws:
    return None
  return (f"this {op.name} is part of a jax.random draw ({draws[0]}) that the per-device "
          "program does not make as the sequential one does: another key (one folded with the "
          "rank, or split otherwise), another shape or other parameters (each rank's part of "
          "a sequential draw needs the same key and the sequential shape: draw it whole and "
          "slice, or let GSPMD partition the draw)")


def _expanded_chlo_words(inf, op: ir.Op) -> str:
  """A chlo op the per-device program does not hold, and that the sequential
  one was not given XLA's expansion of (``chlo_expansion.py``: an op it does
  not list, or one XLA's converter refused alone)."""
  if not op.name.startswith("chlo.") or any(
      d.name == op.name for d in inf.whole_dist.graph.walk()):
    return ""
  return (f"; the per-device program has no {op.name}: XLA expands it into elementary ops, "
          "and graphguard-hlo could not give the sequential program the same expansion (a "
          "limitation, not a sign of a bug: shard_map programs keep it)")


def diagnose_op(inf, op: ir.Op, pin_words: Optional[str] = None):
  """``pin_words``: ``held_at_different_ranks``'s words, if the caller has them."""
  from graphguard_hlo.passes.inference import Failure
  inputs = [(f"%{v.id}: {v.type}", inf.describe(v)) for v in op.operands]
  problems = _operand_problems(inf, op)
  for words in (_ring_words(inf, op), _share_words(inf, op) or _fold_words(inf, op),
                pin_words or _pin_words(inf, op),
                _microbatch_words(inf, op), _iota_words(inf, op), _indexed_tile_words(inf, op),
                _along_split_dim_words(inf, op), _halo_words(inf, op),
                _sliced_tile_words(inf, op),
                _chunk_order_words(inf, op), _random_counter_words(op) or _constant_words(inf, op)):
    if words:
      problems.append(words)
  counterpart = _counterpart_words(inf, op)
  if counterpart and not any(counterpart in p for p in problems):
    problems.append(counterpart)
  # A dropped relation is a possible cause, said after any bug pattern found
  # (those hold whatever the cap), instead of the bare "no lemma" otherwise.
  capped = _cap_words(inf, op.operands)
  if not problems:
    problems.append(_random_draw_words(op) or _held_apart_words(inf, op)
                    or _mismatch_words(inf, op) or capped or
                    f"no op of the per-device program computes this {op.name} from values "
                    "related to its operands (no lemma gives a clean expression)"
                    + _expanded_chlo_words(inf, op))
  if capped and capped not in problems:
    problems.append(capped)
  seq_ctx, dist_ctx = _context(inf, op)
  return Failure(op.name, op.location, inputs, "; ".join(dict.fromkeys(problems)),
                 seq_context=seq_ctx, dist_context=dist_ctx)


def _context(inf, op: ir.Op, limit: int = 6) -> tuple[list[str], list[str]]:
  """The chain around a failing op in both programs, one line per op."""
  seq_lines = []
  for v in op.operands:
    p = v.producer
    if p is not None:
      seq_lines.append(f"%{v.id} = {p.name}({', '.join(f'%{x.id}' for x in p.operands)})"
                       f"  {p.location}")
  seq_lines.append(f"{', '.join(f'%{r.id}' for r in op.results)} = {op.name}("
                   f"{', '.join(f'%{v.id}' for v in op.operands)})  {op.location}  <- fails")
  dist_lines = []
  for v in op.operands:
    for r in inf.relations.get(v.id, []):
      for d_op in inf.users.get(r.cls, ()):
        line = (f"{_dname(d_op.results[0]) if d_op.results else d_op.name} = {d_op.name}("
                f"{', '.join(_dname(x) for x in d_op.operands)})  {d_op.location}")
        if line not in dist_lines:
          dist_lines.append(line)
  return seq_lines[-limit:], dist_lines[:limit]


def diagnose_output(inf, i: int, s: ir.Value, d: ir.Value, declared: Optional[Layout],
                    dist_outputs: Sequence[ir.Value] = ()):
  """Why sequential output i is not distributed output ``d``.  ``dist_outputs``:
  all of them, to tell outputs returned in another order."""
  from graphguard_hlo.passes.inference import Failure
  target = inf.deg.of(d)
  rels = inf.relations.get(s.id, [])
  mine = [r for r in rels if r.cls == target]
  problems = []
  for r in mine:
    if r.layout.partial:
      scaled = "" if r.layout.is_clean() else (
          f", and each rank's part is {1.0 / r.layout.scale:g} times its share")
      problems.append(f"output {i} is a partial {r.layout.partial_kind} over "
                      f"{_axes(r.layout.partial)} never reduced (missing all-reduce){scaled}")
    elif not r.layout.is_clean():
      problems.append(f"output {i}: {_scale_words(r.layout.scale, inf.mesh)}"
                      f"{_scale_origin_words(inf, s, r, inf.deg.members())}")
    elif declared is not None and r.layout != declared:
      reordered = r.layout.with_(order=()) == declared
      problems.append(f"output {i} is laid out as {r.layout.describe('out', inf.mesh)} but the "
                      f"distributed module declares {declared.describe('out', inf.mesh)}"
                      + (" (its rows' chunks are in another order: put back at the wrong "
                         "offsets?)" if reordered else ""))
  if not mine:
    elsewhere = [j for j, other in enumerate(dist_outputs) if j != i and any(
        r.cls == inf.deg.of(other) and r.layout.is_clean() and not r.layout.partial
        for r in rels)]
    if elsewhere:
      problems.append(f"sequential output {i} is what distributed output {elsewhere[0]} "
                      f"holds (outputs returned in another order?)")
    for r in rels:
      words = _collective_words(inf, r.cls, r.layout)
      if words:
        problems.append(words)
    problems.append(f"the distributed output {i} ({_dname(d)}"
                    + (f" from {d.producer.name} at {d.producer.location}" if d.producer else "")
                    + ") is not related to the sequential output")
  # An output is checked against one class only: with none of its
  # relations to it and its own relations cut, the cut is the likeliest cause.
  capped = _cap_words(inf, [s])
  if capped and not mine:
    problems.insert(0, capped)
  where = s.producer.location if s.producer else ir.UNKNOWN_LOCATION
  info = inf.seq.result_attrs[i].get("jax.result_info") if i < len(inf.seq.result_attrs) \
      else None  # JAX's pytree path of the output, "result[1]['wq']"
  named = f" ({info})" if info and info not in ("result", f"result[{i}]") else ""
  inputs = [(f"output {i}{named}: {s.type}", inf.describe(s))]
  return Failure("output", where, inputs, "; ".join(dict.fromkeys(problems)), output_index=i)
