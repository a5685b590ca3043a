"""GSPMD outputs resharded to another order of mesh axes (``P("x", "y")``
in, ``P("y", "x")`` or ``P(("y", "x"))`` out).  XLA moves parts of axes: an
all-to-all over the minor half of ``y``, groups listed in the order a dim is
split (``z`` major, ``x`` minor), a collective-permute cycling three halves.
The mesh is cut as finely as those need, groups are read in the order they
list their ranks, and each reshard is proved with its relations held on
numbers; the same module with its all-to-all run over another half of ``y``
is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.loaders import load_module_bytes
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.pipeline import verify_modules
from graphguard_hlo.report import to_text
from graphguard_hlo.xla_partition import partitioned_hlo_text
from tools.zoo import partitioner_bugs

X = jax.ShapeDtypeStruct((16, 16), jnp.float32)


def scaled_tanh(a):
  return jnp.tanh(a) * 2


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


XY, XYZ = ((2, 4), ("x", "y")), ((2, 2, 2), ("x", "y", "z"))


@pytest.mark.parametrize("mesh, in_spec, out_spec", [
    (XY, P("x", "y"), P("y", "x")),
    (XY, P("x", "y"), P(("y", "x"))),
    (XY, P(("y", "x")), P("x", "y")),
    (((4, 2), ("x", "y")), P(("y", "x")), P(None, ("x", "y"))),
    (XYZ, P("y", ("z", "x")), P(("x", "y", "z"))),
    (XYZ, P("x", ("z", "y")), P(("z", "y", "x"))),
    # From whole rows, each rank slices its tile at an offset table no one
    # axis spells: 2 (2 r_y + r_x).
    (XY, P(None, None), P(("y", "x"), None)),
    (XYZ, P("x", None), P("x", ("z", "y"))),
])
def test_an_output_resharded_to_another_axis_order_is_proved(mesh, in_spec, out_spec):
  result = gg.verify(scaled_tanh, scaled_tanh, X, mesh=_mesh(*mesh), in_specs=(in_spec,),
                     out_specs=out_spec, check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")
  assert not result.relation_check.failures


def test_an_output_split_over_two_axes_names_them_apart():
  """Axes named ``y`` and ``x`` print as ``y,x``: an ``x`` between them would
  read as a third axis (``yxx``)."""
  result = gg.verify(scaled_tanh, scaled_tanh, X, mesh=_mesh(*XY), in_specs=(P("x", "y"),),
                     out_specs=P(("y", "x")))
  assert [o.relation for o in result.outputs] == ["concat[dim0:y,x](out0@r)"]


@pytest.mark.parametrize("relation, refines", [
    ("0: dim0=x dim1=y", True),  # y, which XLA cut in halves, names both
    ("0: dim0=x dim1=y:(1)2,y:(2)2", True),
    ("0: dim0=x dim1=y:(2)2,y:(1)2", False),  # the halves swapped
])
def test_a_relation_file_names_an_axis_xla_cut_whole_or_by_its_parts(relation, refines):
  result = gg.verify(scaled_tanh, scaled_tanh, X, mesh=_mesh(*XY), in_specs=(P("x", "y"),),
                     out_specs=P(("y", "x")), relation=relation)
  assert result.refines == refines, to_text(result, "seq", "dist")


def _resharded_module(edit=None):
  mesh = _mesh(*XY)
  lowered = jax.jit(scaled_tanh, in_shardings=NamedSharding(mesh, P("x", "y")),
                    out_shardings=NamedSharding(mesh, P("y", "x"))).lower(X)
  text = partitioned_hlo_text(lowered)
  assert "all-to-all" in text
  return load_module_bytes("<resharded>.hlo.txt", (edit.apply(text) if edit else text).encode())


def _per_rank_outputs(module):
  """The module run by the reference interpreter on each rank's tile of one
  input split P("x", "y") (rank 4x + y holds rows 8x.., columns 4y..)."""
  x = np.random.default_rng(0).standard_normal(X.shape).astype(np.float32)
  tiles = [x[8 * (k // 4):8 * (k // 4) + 8, 4 * (k % 4):4 * (k % 4) + 4] for k in range(8)]
  inline_calls(module)
  return Interpreter(8).run(module.main, [tiles])[module.main.results[0].id]


def test_the_all_to_all_over_another_half_of_an_axis_is_refused():
  """XLA's all-to-all runs over y's minor half, ranks {0, 1}, {2, 3}, ...;
  over its major half, {0, 2}, {1, 3}, ..., the rows land on other ranks."""
  assert verify_modules(lower_sequential(scaled_tanh, X), _resharded_module()).refines
  edit = partitioner_bugs.regroup("all-to-all", 0, ((0, 2), (1, 3), (4, 6), (5, 7)))
  result = verify_modules(lower_sequential(scaled_tanh, X), _resharded_module(edit))
  assert not result.refines
  assert "output 0 is not rebuilt by a clean expression" in to_text(result, "seq", "dist")
  right, wrong = _per_rank_outputs(_resharded_module()), _per_rank_outputs(
      _resharded_module(edit))
  assert any(not np.allclose(a, b) for a, b in zip(right, wrong))
