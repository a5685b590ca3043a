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


# -- meshes of 6 devices: XLA mixes cuts of 2 and 3 --------------------------------------------

X6 = jax.ShapeDtypeStruct((12, 12), jnp.float32)


@pytest.mark.parametrize("shape, in_spec, out_spec", [
    ((2, 3), P(("y", "x")), P()),
    ((2, 3), P(("y", "x")), P(None, ("y", "x"))),
    ((3, 2), P(("y", "x")), P("y")),
    ((2, 3), P("x", "y"), P("y", "x")),
])
def test_a_reshard_on_a_mesh_of_two_and_three_is_proved(shape, in_spec, out_spec):
  """Groups at strides the mesh's cuts cannot join (2 on 2 x 3) no longer
  make the program an input error: the mesh keeps the cuts that fit."""
  result = gg.verify(scaled_tanh, scaled_tanh, X6, mesh=_mesh(shape, ("x", "y")),
                     in_specs=(in_spec,), out_specs=out_spec, check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")


def test_a_permute_across_the_axes_of_a_two_by_three_mesh_is_named_not_refused_as_input():
  """P("x", "y") to P(("y", "x")) on 2 x 3: XLA's permute sends rank 1 to 3
  and 3 to 4, steps of 2 on a mesh cut at 3; not proved, and said so at it."""
  result = gg.verify(scaled_tanh, scaled_tanh, X6, mesh=_mesh((2, 3), ("x", "y")),
                     in_specs=(P("x", "y"),), out_specs=P(("y", "x")))
  assert not result.refines
  words = result.failure.diagnosis
  assert "collective-permute at" in words and "2 apart" in words, words
  assert "across the axes of {'x': 2, 'y': 3}: no one mesh spells it" in words, words


def _gathered_module(edit=None):
  """P(("y", "x")) gathered whole on 2 x 3: XLA lists the all-gather's ranks
  y-major, {0, 3, 1, 4, 2, 5}."""
  mesh = _mesh((2, 3), ("x", "y"))
  lowered = jax.jit(scaled_tanh, in_shardings=NamedSharding(mesh, P(("y", "x"))),
                    out_shardings=NamedSharding(mesh, P())).lower(X6)
  text = partitioned_hlo_text(lowered)
  return load_module_bytes("<gathered>.hlo.txt", (edit.apply(text) if edit else text).encode())


def test_an_all_gather_listing_a_two_by_three_mesh_in_its_own_order_is_refused():
  edit = partitioner_bugs.regroup("all-gather", 0, ((0, 1, 2, 3, 4, 5),))
  seq = lower_sequential(scaled_tanh, X6)
  assert verify_modules(seq, _gathered_module()).refines
  result = verify_modules(lower_sequential(scaled_tanh, X6), _gathered_module(edit))
  assert not result.refines
  # (an HLO dump names no mesh: a0 is x, a1 is y)
  assert "gathers over 'a0', 'a1' along dim 0, but dim 0 is split over 'a1', 'a0'" \
      in result.failure.diagnosis, result.failure.diagnosis
  x = np.random.default_rng(0).standard_normal(X6.shape).astype(np.float32)
  tiles = [x[2 * k:2 * k + 2] for k in (0, 2, 4, 1, 3, 5)]  # rank 3x + y holds rows 2(2y + x)
  outputs = []
  for module in (_gathered_module(), _gathered_module(edit)):
    inline_calls(module)
    outputs.append(Interpreter(6).run(module.main, [tiles])[module.main.results[0].id])
  np.testing.assert_allclose(outputs[0][0], np.tanh(x) * 2, rtol=1e-5)
  assert not np.allclose(outputs[1][0], np.tanh(x) * 2)
