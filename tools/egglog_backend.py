"""The per-device program as an ``egglog`` e-graph, for ``tools/bench_egraph.py``.

A faithful port of ``passes/dist_egraph.py`` (insertion + ``NORMALIZATION_RULES``)
to the ``egglog`` Python package, used only to measure it against our own e-graph.
Needs the optional extra ``bench`` (``pip install -e .[bench]``).

Encoding (one sort, ``Term``):

* An op of the per-device program is ``Term.opN(name, key, ty, child_1..child_N)``:
  its head ``(name, attrs key, result type, region fingerprint, result index)`` is
  split into the op name (a ``String``, so rules can match it as a literal), an
  ``i64`` id interned in Python for the rest of the identity (attrs key, regions,
  result index: never inspected by a rule, only compared), and the result type as a
  ``String`` (``"f32[8,128]"``).  egglog constructors have a fixed arity, so there
  is one constructor per arity used (0..3); a real port would need a ``Vec[Term]``
  or cons-list encoding for variadic ops (concatenate, tuple, custom_call, while).
* Parameters are ``Term.op0("param", index, ty)``; constants that are splats are
  ``Term.splat(value, ty)``, like ``terms.splat_head``.
* The "to the same type" side conditions need the type of the *operand's class*,
  which a head of the matched node does not carry.  We give every class its type as
  a separate function ``type_of(Term) -> String``, filled by one rule per
  constructor ("the type of a class is the result type of any node in it" = ours'
  ``_class_type``), and the identity rules test ``eq(type_of(x)).to(t)``.  (The
  alternative, matching the operand's constructor to read its type, needs one rule
  per identity op per operand arity; the function keeps one rule per identity op.)
  ``type_of`` has no merge function, so a class whose nodes disagree on the type
  would be an error in egglog, which is a free sanity check of the rules.
"""

from __future__ import annotations

from typing import Optional, Sequence

from egglog import (EGraph, Expr, String, StringLike, expr_parts, f64, f64Like, function, i64,
                    i64Like, eq, rewrite, rule, ruleset, set_)

COMMUTATIVE = ("add", "and", "maximum", "minimum", "multiply", "or", "xor")  # = terms.COMMUTATIVE


class Term(Expr):
  @classmethod
  def op0(cls, name: StringLike, key: i64Like, ty: StringLike) -> Term: ...

  @classmethod
  def op1(cls, name: StringLike, key: i64Like, ty: StringLike, a: Term) -> Term: ...

  @classmethod
  def op2(cls, name: StringLike, key: i64Like, ty: StringLike, a: Term, b: Term) -> Term: ...

  @classmethod
  def op3(cls, name: StringLike, key: i64Like, ty: StringLike, a: Term, b: Term,
          c: Term) -> Term: ...

  @classmethod
  def splat(cls, value: f64Like, ty: StringLike) -> Term: ...


_CONSTRUCTORS = (Term.op0, Term.op1, Term.op2, Term.op3, Term.splat)


@function
def type_of(t: Term) -> String: ...


# --- RULES BEGIN (counted by tools/bench_egraph.py) ---
@ruleset
def normalization(e: Term, x: Term, y: Term, z: Term, k: i64, t: String, t2: String, v: f64,
                  n: String):
  # The type of a class: the result type of any of its nodes.
  yield rule(eq(e).to(Term.op0(n, k, t))).then(set_(type_of(e)).to(t))
  yield rule(eq(e).to(Term.op1(n, k, t, x))).then(set_(type_of(e)).to(t))
  yield rule(eq(e).to(Term.op2(n, k, t, x, y))).then(set_(type_of(e)).to(t))
  yield rule(eq(e).to(Term.op3(n, k, t, x, y, z))).then(set_(type_of(e)).to(t))
  yield rule(eq(e).to(Term.splat(v, t))).then(set_(type_of(e)).to(t))
  # copy is its operand; reshape/convert/broadcast to the operand's own type are too;
  # of a splat they are the splat at the result type.
  yield rewrite(Term.op1("copy", k, t, x)).to(x)
  for op in ("reshape", "convert", "broadcast_in_dim"):
    yield rewrite(Term.op1(op, k, t, x)).to(x, eq(type_of(x)).to(t))
    yield rewrite(Term.op1(op, k, t, Term.splat(v, t2))).to(Term.splat(v, t))
  for op in COMMUTATIVE:
    yield rewrite(Term.op2(op, k, t, x, y)).to(Term.op2(op, k, t, y, x))
# --- RULES END ---


class EgglogDistEGraph:
  """Same interface as the bench's driver of ``passes.egraph``: insert, saturate, look up.

  A class handle is the ``egglog`` let-reference returned by ``EGraph.let`` (a named
  global of the e-graph, kept canonical by egglog's rebuild).
  """

  def __init__(self) -> None:
    self.egraph = EGraph()
    self._n = 0

  # -- building --------------------------------------------------------------------
  @staticmethod
  def term(name: str, key: int, ty: str, children: Sequence[Term]) -> Term:
    return _CONSTRUCTORS[len(children)](name, key, ty, *children)

  def add(self, term: Term) -> Term:
    self._n += 1
    return self.egraph.let(f"v{self._n}", term)

  def saturate(self) -> int:
    report = self.egraph.run(normalization.saturate())
    return len(report.iterations)

  # -- queries ---------------------------------------------------------------------
  def lookup(self, term: Term) -> Optional[object]:
    """The class of ``term`` if it is in the e-graph (a hash-cons lookup, nothing added):
    ``EGraph.lookup_function_value``.  Returns an opaque, hashable class id."""
    found = self.egraph.lookup_function_value(term)
    return None if found is None else expr_parts(found).expr.value

  def contains(self, term: Term) -> bool:
    """The same question as a query: ``EGraph.check_bool(term)``."""
    return self.egraph.check_bool(term)

  def sizes(self) -> tuple[int, int]:
    """(e-nodes, e-classes) of sort Term."""
    nodes = sum(size for fn, size in self.egraph.all_function_sizes() if fn in _CONSTRUCTORS)
    frozen = self.egraph.freeze()
    classes = sum(1 for tp, _ in frozen.decl.e_classes.values() if tp.ident.name == "Term")
    return nodes, classes
