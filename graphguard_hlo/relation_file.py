"""The ``--relation FILE`` format: how each sequential parameter is laid out.

One line per parameter (blank lines and ``#`` comments are ignored)::

    # param: layout
    0: replicated
    1: dim1=tp
    2: dim0=dp,tp          # dim 0 split over dp (major) then tp
    3: dim0=tp partial=dp  # and summed over dp
    4: dim1=cp order1=0,7,1,6,2,5,3,4  # dim 1 cut in 8 chunks put in this
                                       # order, then split over cp (zig-zag)

``orderK=`` says the distributed program holds the sequential tensor with dim
K cut into as many equal chunks as listed and put in the listed order before
the rest of the layout splits it: load-balanced context parallelism whose
data loader hands rank r chunks r and 2n-1-r of the sequence.

Axis names are the distributed program's mesh axes (shard_map: yours;
XLA-partitioned modules: yours when the module records the mesh, else
``a0, a1, ...`` major to minor, as printed by ``gg-hlo-verify`` in its
summary).  An axis XLA cut finer may be named whole (``dim0=y``: its parts
major to minor) or by its parts, as Shardy names them (``y:(1)2`` is the
major half of a 4-rank ``y``).  Parameters not listed keep the layout
derived from DIST's shardings.
"""

from __future__ import annotations

import re
from typing import Optional

from graphguard_hlo.errors import InputError
from graphguard_hlo.passes.layout import Layout

_LINE = re.compile(r"^\s*(\d+)\s*:\s*(.*?)\s*$")
_NAME = r"[A-Za-z_]\w*(?::\(\d+\)\d+)?"  # an axis, or a sub-axis y:(1)2
_ITEM = re.compile(rf"(dim(\d+)|partial)=({_NAME}(?:,{_NAME})*)$")
_ORDER = re.compile(r"order(\d+)=(\d+(?:,\d+)*)$")


def parse_relation_file(path: str, text: str, shapes: list[tuple[int, ...]],
                        axes: Optional[list[str]],
                        aliases: Optional[dict[str, Optional[str]]] = None
                        ) -> dict[int, Layout]:
  """Parameter index -> its layout, for parameters of these sequential
  ``shapes`` over a mesh with these ``axes`` (None: any name, for a reader of
  the chunk orders alone).  ``aliases``: other names of axes (XLA's atomic
  ``a0`` of an axis the program's mesh names ``tp``), None for names refused
  (``DistProgram.axis_aliases``)."""
  out: dict[int, Layout] = {}
  # Lines end at "\n" (a "\r" before it is dropped by the strip below), as
  # editors number them; str.splitlines would also break at a lone "\r".
  for lineno, raw in enumerate(text.split("\n"), 1):
    line = raw.split("#", 1)[0]
    if not line.strip():
      continue
    m = _LINE.match(line)
    if not m:
      raise InputError(path, "expected '<parameter index>: <layout>'", lineno,
                       len(line) - len(line.lstrip()) + 1)
    index = int(m.group(1))
    if index >= len(shapes):
      raise InputError(path, f"parameter {index} does not exist (the module has "
                       f"{len(shapes)})", lineno, m.start(1) + 1)
    if index in out:
      raise InputError(path, f"parameter {index} is given twice", lineno, m.start(1) + 1)
    out[index] = _parse_layout(path, lineno, line, m.start(2), m.group(2), shapes[index], axes,
                               aliases or {})
  return out


def _parse_layout(path, lineno, line, col0, spec, shape, axes, aliases) -> Layout:
  rank = len(shape)
  dims: list[tuple[str, ...]] = [() for _ in range(rank)]
  partial: tuple[str, ...] = ()
  order: dict[int, tuple[int, ...]] = {}
  if spec == "replicated":
    return Layout(tuple(dims))
  if not spec:
    raise InputError(path, "missing layout after ':'", lineno, col0 + 1)
  col = col0
  for item in spec.split():
    col = line.index(item, col)
    m = _ORDER.match(item)
    if m:
      d, chunks = int(m.group(1)), tuple(int(c) for c in m.group(2).split(","))
      order[d] = _chunk_order(path, lineno, col, d, chunks, shape, order)
      col += len(item)
      continue
    m = _ITEM.match(item)
    if not m:
      raise InputError(path, f"cannot read {item!r}: expected dimK=AXIS[,AXIS], "
                       "partial=AXIS[,AXIS], orderK=CHUNK,CHUNK[,...] or replicated",
                       lineno, col + 1)
    names = tuple(b for a in m.group(3).split(",")
                  for b in _axis(path, lineno, col, a, axes, aliases))
    unknown = [a for a in names if axes is not None and a not in axes]
    if unknown:
      raise InputError(path, f"unknown mesh axis {unknown[0]!r} (mesh axes: "
                       f"{', '.join(axes) or 'none'})", lineno, col + 1)
    if m.group(2) is not None:
      d = int(m.group(2))
      if d >= rank:
        raise InputError(path, f"dim{d} out of range for a rank-{rank} parameter",
                         lineno, col + 1)
      dims[d] = names
    else:
      partial = names
    col += len(item)
  layout = Layout(tuple(dims), partial)
  if not layout.is_valid() or not layout.is_plain():  # (plain: no axis tiles two dims)
    raise InputError(path, "an axis is used twice in one layout", lineno, col0 + 1)
  return layout.with_(order=tuple(order.items())) if order else layout


def _axis(path, lineno, col, name: str, axes, aliases) -> tuple[str, ...]:
  """The mesh axes a relation's ``name`` means, major to minor: one of the
  mesh's own, or through an alias (a user's axis XLA cut finer means its
  parts); an axis of the user's mesh the program does not hold is refused
  (it must not fall through to XLA's name alike)."""
  if name in aliases and aliases[name] is None:
    raise InputError(path, f"mesh axis {name!r} is not one axis of the partitioned program "
                     "(XLA joined it with another, or it has size 1; its axes: "
                     f"{', '.join(axes or ())}, as the report names them)", lineno, col + 1)
  if axes is None or name in axes:
    return (name,)
  return aliases.get(name) or (name,)


def _chunk_order(path, lineno, col, d, chunks, shape, seen) -> tuple[int, ...]:
  """``orderD=chunks`` checked against the parameter's ``shape``."""
  where = (lineno, col + 1)
  if d >= len(shape):
    raise InputError(path, f"order{d} out of range for a rank-{len(shape)} parameter", *where)
  if d in seen:
    raise InputError(path, f"order{d} is given twice", *where)
  if sorted(chunks) != list(range(len(chunks))) or len(chunks) < 2:
    raise InputError(path, f"order{d} must list the chunks 0..n-1 once each (n >= 2), "
                     f"got {','.join(map(str, chunks))}", *where)
  if shape[d] % len(chunks):
    raise InputError(path, f"order{d}: dim {d} of size {shape[d]} does not cut into "
                     f"{len(chunks)} equal chunks", *where)
  return chunks


def merge_layouts(derived: list[Optional[Layout]], given: dict[int, Layout]) -> list[Optional[Layout]]:
  return [given.get(i, l) for i, l in enumerate(derived)]


def input_layouts(path: str, text: str, seq, program) -> list[Optional[Layout]]:
  """DIST's derived parameter layouts with the file's lines applied on top."""
  given = parse_relation_file(path, text, [tuple(p.type.shape) for p in seq.main.params],
                              list(program.mesh.axis_names), program.axis_aliases)
  return merge_layouts(program.param_layouts, given)


def relation_layouts(relation: Optional[str], seq, program) -> Optional[list[Optional[Layout]]]:
  """``input_layouts`` of relation-file text given in code (no file), or None
  without one: the Python API's ``relation=``, and the zoo's."""
  if relation is None:
    return None
  return input_layouts("<relation>", relation, seq, program)
