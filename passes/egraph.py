"""A small e-graph: union-find over e-classes, a hash-cons of e-nodes, congruence
closure on rebuild, and e-matching of declarative rewrite rules.

Kept deliberately small (see the README's design section for the measurement
against the ``egglog`` package): the graphs it holds are one per-device program
plus the handful of terms each lemma application proposes, and the rules are
a few normalizations.  Heads are arbitrary hashable values, so an op's
attributes and result type are part of its identity, as in MLIR's CSE.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterator, Optional, Sequence, Union

ClassId = int


@dataclasses.dataclass(frozen=True)
class ENode:
  head: Hashable              # e.g. ("add", attrs, type); first item is the op name
  children: tuple[ClassId, ...] = ()
  _hash: int = dataclasses.field(init=False, repr=False, compare=False)

  @property
  def op(self) -> str:
    return self.head[0] if isinstance(self.head, tuple) else str(self.head)

  def __post_init__(self) -> None:
    # Heads hold whole region fingerprints (a loop's body), and the hash-cons
    # and user sets hash a node many times: hash it once.
    object.__setattr__(self, "_hash", hash((self.head, self.children)))

  def __hash__(self) -> int:
    return self._hash


class EGraph:
  def __init__(self) -> None:
    self._parent: list[ClassId] = []
    self._hashcons: dict[ENode, ClassId] = {}
    self._nodes: dict[ClassId, set[ENode]] = {}
    self._users: dict[ClassId, set[ENode]] = {}
    self._pending: list[ClassId] = []

  # -- union-find ----------------------------------------------------------------
  def find(self, c: ClassId) -> ClassId:
    root = c
    while self._parent[root] != root:
      root = self._parent[root]
    while self._parent[c] != root:  # path compression
      self._parent[c], c = root, self._parent[c]
    return root

  def canonical(self, node: ENode) -> ENode:
    children = tuple(self.find(c) for c in node.children)
    # The same node when nothing changed, keeping its hash.
    return node if children == node.children else ENode(node.head, children)

  # -- building ------------------------------------------------------------------
  def add(self, node: ENode) -> ClassId:
    node = self.canonical(node)
    found = self._hashcons.get(node)
    if found is not None:
      return self.find(found)
    c = len(self._parent)
    self._parent.append(c)
    self._hashcons[node] = c
    self._nodes[c] = {node}
    self._users[c] = set()
    for child in node.children:
      self._users[child].add(node)
    return c

  def lookup(self, node: ENode) -> Optional[ClassId]:
    found = self._hashcons.get(self.canonical(node))
    return None if found is None else self.find(found)

  def union(self, a: ClassId, b: ClassId) -> ClassId:
    a, b = self.find(a), self.find(b)
    if a == b:
      return a
    if len(self._nodes[a]) < len(self._nodes[b]):
      a, b = b, a
    self._parent[b] = a
    self._nodes[a] |= self._nodes.pop(b)
    self._users[a] |= self._users.pop(b)
    self._pending.append(a)
    return a

  def rebuild(self) -> None:
    """Restore the congruence invariant: equal children make equal parents."""
    while self._pending:
      todo, self._pending = self._pending, []
      for c in {self.find(x) for x in todo}:
        seen: dict[ENode, ClassId] = {}
        for user in list(self._users.get(c, ())):
          owner = self._hashcons.pop(user, None)
          canon = self.canonical(user)
          if owner is None:
            continue
          if canon != user:
            # Every child's user set must hold the node as the hashcons keys
            # it, or a later repair through another child misses the entry.
            for k in set(canon.children):
              users = self._users.get(self.find(k))
              if users is not None:
                users.discard(user)
                users.add(canon)
          owner = self.find(owner)
          if canon in self._hashcons:
            self.union(owner, self._hashcons[canon])
          self._hashcons[canon] = self.find(owner)
          if canon in seen:
            self.union(seen[canon], owner)
          seen[canon] = self.find(owner)
        self._users[self.find(c)] = {self.canonical(u) for u in self._users.get(self.find(c), ())}
    for c in list(self._nodes):
      if self.find(c) == c:
        self._nodes[c] = {self.canonical(n) for n in self._nodes[c]}

  # -- queries ---------------------------------------------------------------------
  def nodes(self, c: ClassId) -> set[ENode]:
    return self._nodes[self.find(c)]

  def users(self, c: ClassId) -> Iterator[tuple[ENode, ClassId]]:
    """E-nodes that take class ``c`` as a child, with the class each lives in."""
    for node in list(self._users.get(self.find(c), ())):
      owner = self._hashcons.get(self.canonical(node))
      if owner is not None:
        yield self.canonical(node), self.find(owner)

  def classes(self) -> list[ClassId]:
    return [c for c in self._nodes if self.find(c) == c]

  def __len__(self) -> int:
    return len(self._hashcons)


# -- declarative rewrite rules -------------------------------------------------------

Pattern = Union[str, tuple]  # "?x" binds a class; ("op", p1, p2, ...) matches an op name


@dataclasses.dataclass(frozen=True)
class Rule:
  """``lhs => rhs`` when ``when(egraph, bindings, matched_node)`` holds.

  ``rhs`` is a pattern variable (the matched class equals that class) or a
  function building the equal e-node from the bindings.
  """
  name: str
  lhs: Pattern
  rhs: Union[str, Callable[["EGraph", dict, ENode], Optional[ENode]]]
  when: Callable[["EGraph", dict, ENode], bool] = lambda eg, b, n: True


def ematch(eg: EGraph, pattern: Pattern, c: ClassId) -> Iterator[tuple[dict, ENode]]:
  """All ways ``pattern`` matches class ``c``: (bindings, the root e-node)."""
  if isinstance(pattern, str):
    yield {pattern: eg.find(c)}, None  # type: ignore[misc]
    return
  op, *subs = pattern
  for node in list(eg.nodes(c)):
    if node.op != op or len(node.children) != len(subs):
      continue
    for b in _match_children(eg, subs, node.children, {}):
      yield b, node


def _match_children(eg, subs, children, bindings) -> Iterator[dict]:
  if not subs:
    yield bindings
    return
  for b, _ in ematch(eg, subs[0], children[0]):
    merged = dict(bindings)
    ok = True
    for k, v in b.items():
      if k in merged and eg.find(merged[k]) != eg.find(v):
        ok = False
        break
      merged[k] = v
    if ok:
      yield from _match_children(eg, subs[1:], children[1:], merged)


def saturate(eg: EGraph, rules: Sequence[Rule], max_iterations: int = 8,
             max_nodes: int = 2_000_000) -> int:
  """Apply ``rules`` until nothing changes (or a bound is hit).  Returns iterations."""
  # Rules indexed by the operator at their root: a node is only tried against
  # the rules that could match it.
  by_op: dict[str, list[Rule]] = {}
  for rule in rules:
    if isinstance(rule.lhs, str):
      raise ValueError(f"rule {rule.name}: a bare variable matches everything")
    by_op.setdefault(rule.lhs[0], []).append(rule)
  for iteration in range(1, max_iterations + 1):
    matches = []
    for c in eg.classes():
      for node in list(eg.nodes(c)):
        for rule in by_op.get(node.op, ()):
          subs = rule.lhs[1:]
          if len(node.children) != len(subs):
            continue
          for bindings in _match_children(eg, subs, node.children, {}):
            if rule.when(eg, bindings, node):
              matches.append((rule, bindings, node, c))
    changed = False
    for rule, bindings, node, c in matches:
      if isinstance(rule.rhs, str):
        target = bindings[rule.rhs]
      else:
        built = rule.rhs(eg, bindings, node)
        if built is None:
          continue
        target = eg.add(built)
      if eg.find(target) != eg.find(c):
        eg.union(target, c)
        changed = True
    eg.rebuild()
    if not changed or len(eg) > max_nodes:
      return iteration
  return max_iterations
