"""Conditionals as selects: ``lax.cond``, ``lax.switch`` and the optimizers
built on them (``optax.apply_if_finite``, ``optax.MultiSteps``) in one flat graph.

A ``case`` runs one of its branches; run all of them and pick one result with
``select``, and the values are the same whenever the branches only compute
values::

  case(i, {b_0}, .., {b_n-1})  ->  select(i == 0, b_0, select(i == 1, b_1, .. b_n-1))
  if(p, {t}, {f})              ->  select(p, t, f)

(an index out of range runs the last branch, as the chain picks it).  Relation
inference then goes through the branches' ops and the selects as through any
others: no rule of its own for regions that capture values.

Only branches without effects or collectives are rewritten.  A collective in a
branch taken on some ranks only is not the collective of all ranks that the
select form would run; such a conditional stays, opaque.
"""

from __future__ import annotations

import numpy as np

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.canonicalize import _fresh
from graphguard_hlo.passes.collectives import COLLECTIVES
from graphguard_hlo.passes.splice import splice
from graphguard_hlo.passes.terms import EFFECTS

_CONDITIONALS = ("case", "if")
_NOT_VALUES = EFFECTS | set(COLLECTIVES) | {"collective_broadcast"}


def select_conditionals(module: ir.Module) -> int:
  """Rewrite every pure conditional of ``module`` in place; returns how many."""
  return sum(splice(g, lambda op: _as_selects(module, op)) for g in module.functions.values())


def _only_values(op: ir.Op) -> bool:
  """Do ``op``'s branches compute values only (and capture nothing by parameter)?"""
  return all(not r.params and not any(_not_a_value(o.name) for o in r.walk())
             for r in op.regions)


def _not_a_value(name: str) -> bool:
  """A collective, an effect, or one of HLO's async halves (``all-reduce-start``,
  ``collective-permute-done``, ``ragged-all-to-all``, kept under HLO names)."""
  return name in _NOT_VALUES or any(w in name for w in (
      "start", "done", "all-", "all_", "collective", "ragged", "send", "recv", "custom"))


def _as_selects(module: ir.Module, op: ir.Op):
  """``op``'s branches inlined and a select chain per result (``splice``'s
  stand-in), if it is a conditional whose branches compute values only."""
  if op.name not in _CONDITIONALS or not op.regions or not _only_values(op):
    return None
  ops = [o for region in op.regions for o in region.ops]
  picks = _picks(module, op, ops)
  values = []
  for j, r in enumerate(op.results):
    branch_results = [b.results[j] for b in op.regions]
    value = branch_results[-1]
    for pick, chosen in reversed(list(zip(picks, branch_results))):
      value = _op(module, ops, "select", [pick, chosen, value], {}, r.type, op.location)
    values.append(value)
  return ops, values


def _picks(module: ir.Module, op: ir.Op, ops: list[ir.Op]) -> list[ir.Value]:
  """The predicates choosing branch 0, 1, .. n-2 (the last takes the rest)."""
  index = op.operands[0]
  if op.name == "if":
    return [index]
  pred = ir.TensorType((), "pred")
  picks = []
  for k in range(len(op.regions) - 1):
    at = _op(module, ops, "constant", [], {"value": reference.constant_array(
        np.array(k), index.type.dtype)}, index.type, op.location)
    picks.append(_op(module, ops, "compare", [index, at], {"comparison_direction": "EQ"},
                     pred, op.location))
  return picks


def _op(module: ir.Module, ops: list[ir.Op], name: str, operands, attrs,
        result_type: ir.TensorType, location: ir.Location) -> ir.Value:
  """A new op appended to ``ops``: its one result."""
  new = _fresh(module, name, operands, attrs, result_type.shape, result_type.dtype, location)
  ops.append(new)
  return new.results[0]
