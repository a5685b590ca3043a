"""The per-device program as an e-graph, saturated with normalization rules.

Every op of the per-device program becomes an e-node (``terms.op_head``), so
"does the distributed program compute f(x, y)?" is one hash-cons lookup.  A
few declarative rules make that lookup robust to spelling: copies and no-op
reshapes are their operand, broadcasts of splats are splats, a select of one
value either way is that value, so is a max with -inf (min with +inf), a min
of a max is a clamp, and commutative ops match either operand order.  Constants are splats by value, so
a lemma that proposes ``add(x, splat 1.0)`` finds XLA's ``add(x, broadcast(constant 1))``.
"""

from __future__ import annotations

import math
from typing import Optional

from graphguard_hlo import ir
from graphguard_hlo.passes import terms
from graphguard_hlo.passes.egraph import ClassId, EGraph, ENode, Rule, saturate


def _same_type(eg: EGraph, b: dict, node: ENode) -> bool:
  return node.head[2] == _class_type(eg, b["?x"])


def _class_type(eg: EGraph, c: ClassId) -> Optional[ir.TensorType]:
  for n in eg.nodes(c):
    if isinstance(n.head, tuple) and len(n.head) >= 3 and isinstance(n.head[2], ir.TensorType):
      return n.head[2]
  return None


def _swap(eg: EGraph, b: dict, node: ENode) -> ENode:
  return ENode(node.head, (node.children[1], node.children[0]))


def _splat_broadcast(eg: EGraph, b: dict, node: ENode) -> Optional[ENode]:
  for n in eg.nodes(b["?x"]):
    if n.op == "splat":
      return ENode(terms.splat_head(n.head[1], node.head[2]))
  return None


def _splat_converted(eg: EGraph, b: dict, node: ENode) -> Optional[ENode]:
  """A converted splat holds its value as the convert casts it (0.5 in i32
  is 0), if the cast is the reference's."""
  for n in eg.nodes(b["?x"]):
    if n.op == "splat":
      value = terms.converted(n.head[1], node.head[2].dtype)
      return None if value is None else ENode(terms.splat_head(value, node.head[2]))
  return None


def _clamp(eg: EGraph, b: dict, node: ENode) -> ENode:
  return ENode(terms.op_head("clamp", {}, node.head[2]), (b["?lo"], b["?x"], b["?hi"]))


def _y_is(value: float):
  """A rule condition: ``?y`` is a splat of ``value``."""
  return lambda eg, b, node: _splat_of(eg, b["?y"]) == value


NORMALIZATION_RULES = [
    Rule("copy-is-identity", ("copy", "?x"), "?x"),
    Rule("reshape-to-same-shape", ("reshape", "?x"), "?x", when=_same_type),
    Rule("convert-to-same-type", ("convert", "?x"), "?x", when=_same_type),
    Rule("broadcast-to-same-shape", ("broadcast_in_dim", "?x"), "?x", when=_same_type),
    Rule("broadcast-of-splat", ("broadcast_in_dim", "?x"), _splat_broadcast),
    Rule("reshape-of-splat", ("reshape", "?x"), _splat_broadcast),
    # (jnp.cumsum's exclusive form concatenates a slice of zeros)
    Rule("slice-of-splat", ("slice", "?x"), _splat_broadcast),
    Rule("transpose-of-splat", ("transpose", "?x"), _splat_broadcast),
    Rule("reverse-of-splat", ("reverse", "?x"), _splat_broadcast),
    Rule("convert-of-splat", ("convert", "?x"), _splat_converted),
    # GSPMD keeps a replicated scatter base on partition 0 only:
    # select(pid != 0, 0, base), and the base is itself 0.
    Rule("select-of-equal-branches", ("select", "?p", "?x", "?x"), "?x"),
    # jnp.max(..., initial=-inf) maxes with -inf (exact: XLA's max propagates NaN).
    Rule("maximum-with-minus-inf", ("maximum", "?x", "?y"), "?x", when=_y_is(-math.inf)),
    Rule("minimum-with-plus-inf", ("minimum", "?x", "?y"), "?x", when=_y_is(math.inf)),
    # jnp.clip spells a clamp so (StableHLO defines clamp as exactly this).
    Rule("clamp-is-max-then-min", ("minimum", ("maximum", "?x", "?lo"), "?hi"), _clamp),
] + [Rule(f"{op}-commutes", (op, "?x", "?y"), _swap) for op in sorted(terms.COMMUTATIVE)]


def _splat_of(eg: EGraph, c: ClassId) -> Optional[float]:
  for n in eg.nodes(c):
    if n.op == "splat":
      return n.head[1]
  return None


def _fold_all_reduce(attrs: dict, value: float, mesh: Optional[ir.Mesh]) -> Optional[float]:
  """all_reduce of the same splat on every rank of a group of n: n * c for a
  sum (``lax.psum(1, axis)``, the axis size), c for max and min."""
  axes, kind = attrs.get("gg.axes"), attrs.get("gg.reduction")
  if mesh is None or axes is None:
    return None
  if kind in ("max", "min"):
    return value
  if kind == "sum":
    return value * math.prod(mesh.axis_size(a) for a in axes)
  return None


def fold_splats(eg: EGraph, mesh: Optional[ir.Mesh] = None) -> bool:
  """Elementwise ops whose operands are all splats are splats (constant
  folding); so are all-reduces of splats, given the mesh."""
  from graphguard_hlo.passes.lemmas import ELEMENTWISE
  changed = False
  for c in eg.classes():
    if _splat_of(eg, c) is not None:
      continue
    for n in list(eg.nodes(c)):
      if n.op == "all_reduce" and len(n.children) == 1:
        value = _splat_of(eg, n.children[0])
        folded = None if value is None else _fold_all_reduce(dict(n.head[1]), value, mesh)
        if folded is not None:
          eg.union(c, eg.add(ENode(terms.splat_head(folded, n.head[2]))))
          changed = True
          break
      if n.op not in ELEMENTWISE or not n.children:
        continue
      values = [_splat_of(eg, k) for k in n.children]
      if None in values:
        continue
      folded = terms.fold_scalar(n.op, dict(n.head[1]), values, n.head[2])
      if folded is not None:
        eg.union(c, eg.add(ENode(terms.splat_head(folded, n.head[2]))))
        changed = True
        break
  eg.rebuild()
  return changed


class DistEGraph:
  """The saturated e-graph of a per-device program, with value <-> class maps."""

  def __init__(self, graph: ir.Graph, mesh: Optional[ir.Mesh] = None,
               param_splats: Optional[dict[int, float]] = None):
    self.eg = EGraph()
    self.class_of: dict[int, ClassId] = {}
    self._values: dict[ClassId, list[ir.Value]] = {}
    param_splats = param_splats or {}
    for i, p in enumerate(graph.params):
      head = (terms.splat_head(param_splats[i], p.type) if i in param_splats
              else ("param", i, p.type))
      self._bind(p, self.eg.add(ENode(head)))
    for op in graph.ops:
      self._add_op(op)
    self._splat_types: Optional[dict] = None
    self.iterations = 0
    while True:  # normalize, fold constants, until neither finds anything new
      self.iterations += saturate(self.eg, NORMALIZATION_RULES)
      if not fold_splats(self.eg, mesh):
        break

  def _bind(self, v: ir.Value, c: ClassId) -> None:
    self.class_of[v.id] = c
    self._values.setdefault(c, []).append(v)

  def add_op(self, op: ir.Op) -> None:
    """An op written into the per-device program after the e-graph was built."""
    self._add_op(op)
    self._splat_types = None

  def _add_op(self, op: ir.Op) -> None:
    children = tuple(self.class_of[v.id] for v in op.operands if v.id in self.class_of)
    if len(children) != len(op.operands):  # free values of a region: opaque
      children = tuple(self.eg.add(ENode(("free", v.id))) if v.id not in self.class_of
                       else self.class_of[v.id] for v in op.operands)
    for k, r in enumerate(op.results):
      splat = terms.splat_value(r) if op.name == "constant" else None
      if splat is not None:
        c = self.eg.add(ENode(terms.splat_head(splat, r.type)))
      else:
        head = terms.op_head(op.name, op.attrs, r.type, tuple(op.regions), k)
        c = self.eg.add(ENode(head, children))
      self._bind(r, c)

  # -- queries -------------------------------------------------------------------
  def find(self, c: ClassId) -> ClassId:
    return self.eg.find(c)

  def holds(self, v: ir.Value) -> bool:
    """Is ``v`` a value of this e-graph's program (not of an enclosing one)?"""
    return v.id in self.class_of

  def of(self, v: ir.Value) -> ClassId:
    return self.eg.find(self.class_of[v.id])

  def lookup(self, head, children: tuple[ClassId, ...]) -> Optional[ClassId]:
    return self.eg.lookup(ENode(head, children))

  def class_type(self, c: ClassId) -> Optional[ir.TensorType]:
    return _class_type(self.eg, c)

  def splat(self, c: ClassId) -> Optional[float]:
    """The constant every element of class ``c`` holds, if it is a splat."""
    return _splat_of(self.eg, c)

  def splat_types(self, value: float, dtype: str) -> list[ir.TensorType]:
    """The types of the splats of ``value`` the e-graph holds."""
    if self._splat_types is None:
      self._splat_types = {}
      for c in self.eg.classes():
        for n in self.eg.nodes(c):
          if n.op == "splat":
            self._splat_types.setdefault((n.head[1], n.head[2].dtype), []).append(n.head[2])
    return self._splat_types.get((terms.canonical_float(value, dtype), dtype), [])

  def lookup_splat(self, value: float, type: ir.TensorType) -> Optional[ClassId]:
    return self.eg.lookup(ENode(terms.splat_head(value, type)))

  def members(self) -> dict[ClassId, list[ir.Value]]:
    """The per-device program's values grouped by e-class, lowest id first."""
    out: dict[ClassId, list[ir.Value]] = {}
    for cls, vals in self._values.items():
      out.setdefault(self.eg.find(cls), []).extend(vals)
    for vals in out.values():
      vals.sort(key=lambda v: v.id)
    return out

  def value(self, c: ClassId) -> Optional[ir.Value]:
    """A value of the per-device program in class ``c`` (for reports)."""
    vals = self.members().get(self.eg.find(c))
    return vals[0] if vals else None

  def users(self, c: ClassId):
    return self.eg.users(c)


def op_users(graph: ir.Graph, deg: DistEGraph) -> dict[ClassId, list[ir.Op]]:
  """For each e-class, the ops of the per-device program that read it."""
  users: dict[ClassId, list[ir.Op]] = {}
  for op in graph.ops:
    for v in op.operands:
      if v.id in deg.class_of:
        users.setdefault(deg.of(v), []).append(op)
  return users
