"""Inlining func.calls: nested calls, values returned straight from a nested
call, and calls inside loop bodies all leave one graph with every operand
defined."""

import numpy as np

from graphguard_hlo import reference
from graphguard_hlo.loaders.stablehlo import load_stablehlo
from graphguard_hlo.passes.inline import inline_calls

# outer returns inner's result unchanged: the value the call made must be
# replaced by the inlined one even though it is the callee's return value.
# main comes first, as jax emits it: outer is cloned before it is inlined.
NESTED = """
func.func public @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0:2 = func.call @outer(%x) : (tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>)
  %1 = stablehlo.multiply %0#0, %0#1 : tensor<4xf32>
  return %1 : tensor<4xf32>
}
func.func private @inner(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.exponential %x : tensor<4xf32>
  return %0 : tensor<4xf32>
}
func.func private @outer(%x: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
  %0 = func.call @inner(%x) : (tensor<4xf32>) -> tensor<4xf32>
  %1 = stablehlo.add %0, %x : tensor<4xf32>
  return %0, %1 : tensor<4xf32>, tensor<4xf32>
}
"""


def _undefined_operands(graph, defined=frozenset()):
  defined = set(defined) | {p.id for p in graph.params}
  bad = []
  for op in graph.ops:
    bad += [v for v in op.operands if v.id not in defined]
    for region in op.regions:
      bad += _undefined_operands(region, defined)
    defined |= {r.id for r in op.results}
  bad += [v for v in graph.results if v.id not in defined]
  return bad


def test_value_returned_from_a_nested_call_is_defined():
  m = load_stablehlo("nested.mlir", NESTED)
  inline_calls(m)
  g = m.main
  assert not _undefined_operands(g)
  assert "call" not in {op.name for op in g.walk()}
  x = np.linspace(-1, 1, 4)
  env = {g.params[0].id: x}
  for op in g.ops:
    ins = [env[v.id] for v in op.operands]
    env[op.results[0].id] = reference.evaluate(op.name, op.attrs, ins, op.results[0].type)
  np.testing.assert_allclose(env[g.results[0].id], np.exp(x) * (np.exp(x) + x), rtol=1e-6)
