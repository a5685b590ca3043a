"""Sorts along a dim each rank holds whole: ``jnp.sort``, ``jnp.argsort``
(a sort of the values and an iota), ``jnp.median``, with jax's comparator
(NaNs and -0.0 made canonical, then a total-order compare), whose constants
XLA's CSE shares where jax writes one per use.  Proved under shard_map and
GSPMD with every relation held on numbers; a rank sorting only its own rows
along the split dim is reported with words that say so."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.report import to_text

MESH = Mesh(np.array(jax.devices()[:4]), ("dp",))
X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
SORTS = {
    "sort": lambda x: jnp.sort(x, axis=1),
    "descending": lambda x: jnp.sort(x, axis=1, descending=True),
    "argsort": lambda x: jnp.argsort(x, axis=1),
    "median": lambda x: jnp.median(x, axis=1),
}


@pytest.mark.parametrize("name", sorted(SORTS))
def test_the_interpreter_sorts_as_jax_does(name):
  """Ties, NaNs of both signs, -0.0 and infinities, through jax's own comparator region."""
  fn = SORTS[name]
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 4, size=(8, 16)).astype(np.float32)
  x[0, :4] = [np.nan, -np.nan, -0.0, 0.0]
  x[1, :3] = [np.inf, -np.inf, np.nan]
  module = lower_sequential(fn, X)
  inline_calls(module)
  graph = module.main
  env = Interpreter().run(graph, [[x]])
  np.testing.assert_array_equal(env[graph.results[0].id][0], np.asarray(jax.jit(fn)(x)))


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
@pytest.mark.parametrize("name", sorted(SORTS))
def test_a_sort_along_a_whole_dim_is_proved(name, style):
  fn = SORTS[name]
  if style == "shard_map":
    result = gg.verify(fn, shard_map(fn, mesh=MESH, in_specs=P("dp"), out_specs=P("dp")), X,
                       check_relations=True)
  else:
    result = gg.verify(fn, fn, X, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"),
                       check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")
  assert result.relation_check.checked > 0 and not result.relation_check.failures


def sort_rows(x):
  return jnp.sort(x, axis=0)


def test_each_rank_sorting_its_own_rows_of_the_split_dim_is_reported():
  result = gg.verify(sort_rows, shard_map(sort_rows, mesh=MESH, in_specs=P("dp"),
                                          out_specs=P("dp")), X)
  assert not result.refines and result.failure.op_name == "sort"
  assert result.failure.location.line == inspect.getsourcelines(sort_rows)[1] + 1
  assert ("this sort sorts along dim 0, which its operand holds split over 'dp': each rank "
          "would sort only its own tile") in result.failure.diagnosis


def test_gspmd_gathers_a_split_dim_before_sorting_it():
  result = gg.verify(sort_rows, sort_rows, X, mesh=MESH, in_specs=(P("dp"),),
                     out_specs=P("dp"), check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")
