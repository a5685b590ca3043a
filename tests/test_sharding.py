"""GSPMD sharding strings, mesh inference, replica groups and partition-id arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from graphguard_hlo import ir
from graphguard_hlo.lowering import lower_distributed
from graphguard_hlo.passes.dist_program import SOURCE_MESH, canonicalize_dist
from graphguard_hlo.relation_file import parse_relation_file
from graphguard_hlo.passes import sharding as shd
from graphguard_hlo.passes.layout import Layout
from graphguard_hlo.passes.rank_arith import RankArithmetic, rank_symbol


def _layouts(strings, ranks, n):
  parsed = [shd.parse_hlo_sharding(s) for s in strings]
  mesh = shd.infer_mesh(parsed, n)
  return mesh, [shd.layout_from_hlo_sharding(p, mesh, r) for p, r in zip(parsed, ranks)]


def test_one_axis():
  mesh, (a, b, c) = _layouts(["{devices=[1,4]<=[4]}", "{devices=[4,1]<=[4]}", "{replicated}"],
                             [2, 2, 1], 4)
  assert mesh.axes == (("a0", 4),)
  assert a == Layout(((), ("a0",))) and b == Layout((("a0",), ())) and c == Layout(((),))


def test_two_axes_with_partial_replication():
  # 2 x 4 mesh: dim 0 over the major axis, last tile dim replicated over the minor one.
  mesh, (a, b) = _layouts(["{devices=[2,1,4]<=[8] last_tile_dim_replicate}",
                           "{devices=[2,4]<=[8]}"], [2, 2], 8)
  assert mesh.axes == (("a0", 2), ("a1", 4))
  assert a == Layout((("a0",), ()))
  assert b == Layout((("a0",), ("a1",)))


def test_transposed_iota_list():
  # [4,2]T(1,0): tile dim 0 runs over the minor axis (stride 1), dim 1 over the major.
  mesh, (a,) = _layouts(["{devices=[2,4]<=[4,2]T(1,0)}"], [2], 8)
  assert mesh.axes == (("a0", 4), ("a1", 2))
  assert a == Layout((("a1",), ("a0",)))
  parsed = shd.parse_hlo_sharding("{devices=[2,4]<=[4,2]T(1,0)}")
  np.testing.assert_array_equal(parsed.device_array(), np.arange(8).reshape(4, 2).T)


def test_merged_axes_on_one_dim():
  mesh, (a, b) = _layouts(["{devices=[8,1]<=[8]}", "{devices=[2,4]<=[8]}"], [2, 2], 8)
  assert a == Layout((("a0", "a1"), ()))


def test_unreduced_is_partial():
  mesh, (a,) = _layouts(["{devices=[1,2,2]<=[4] last_tile_dims={unreduced}}"], [2], 4)
  assert a.partial and a.dims[1]


@pytest.mark.parametrize("bad", ["{devices=[2,2]0,2,1}", "{bogus}", "{devices=[2,2]<=[4] "
                                 "last_tile_dims={manual}}"])
def test_bad_sharding_strings(bad):
  with pytest.raises(shd.ShardingError):
    shd.parse_hlo_sharding(bad)


def test_replica_groups_to_axes():
  mesh = ir.Mesh((("dp", 2), ("tp", 4)))
  assert shd.group_axes([[0, 1, 2, 3], [4, 5, 6, 7]], mesh) == ("tp",)
  assert shd.group_axes([[0, 4], [1, 5], [2, 6], [3, 7]], mesh) == ("dp",)
  assert shd.group_axes([list(range(8))], mesh) == ("dp", "tp")
  # Groups that are not "all devices differing on some axes", or out of order.
  assert shd.group_axes([[0, 1], [2, 3], [4, 5], [6, 7]], mesh) is None
  assert shd.group_axes([[1, 0, 2, 3], [4, 5, 6, 7]], mesh) is None


def test_replica_groups_are_read_in_the_order_they_list_the_axes():
  """A group listing (z, x) row-major, z major, runs over ("z", "x"): a
  gather concatenates z-major (XLA's groups for a dim split ("z", "x"))."""
  mesh = ir.Mesh((("x", 2), ("y", 2), ("z", 2)))
  assert shd.group_axes([[0, 4, 1, 5], [2, 6, 3, 7]], mesh) == ("z", "x")
  assert shd.group_axes([[0, 1, 4, 5], [2, 3, 6, 7]], mesh) == ("x", "z")
  assert shd.group_axes([[0, 4, 2, 6, 1, 5, 3, 7]], mesh) == ("z", "y", "x")
  # Every device in exactly one group, once (an audit's false proof: a
  # sorted group naming a device twice passed, its sum counting it twice).
  mesh2 = ir.Mesh((("x", 2), ("y", 4)))
  assert shd.group_axes([[0, 1, 2, 3], [0, 1, 1, 3], [4, 5, 6, 7]], mesh2) is None
  assert shd.group_axes([[0, 0, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7]], mesh2) is None
  # Groups must agree on the order, and list their ranks in some order of axes.
  assert shd.group_axes([[0, 4, 1, 5], [2, 3, 6, 7]], mesh) is None
  assert shd.group_axes([[0, 5, 1, 4], [2, 7, 3, 6]], mesh) is None


def test_an_evenly_strided_group_cuts_the_mesh_where_it_ends():
  """Groups {0, 1}, {2, 3}, ... on a 2 x 4 mesh run over the minor half of
  the axis of 4: the mesh is cut at stride 2 too."""
  tiles = [shd.parse_hlo_sharding("{devices=[2,4]<=[8]}")]
  assert shd.infer_mesh(tiles, 8).axes == (("a0", 2), ("a1", 4))
  mesh = shd.infer_mesh(tiles, 8, [((0, 1), (2, 3), (4, 5), (6, 7))])
  assert mesh.axes == (("a0", 2), ("a1", 2), ("a2", 2))
  assert shd.group_axes(((0, 1), (2, 3), (4, 5), (6, 7)), mesh) == ("a2",)
  # A group naming a device twice cuts nothing new (and divides by no zero).
  assert shd.infer_mesh(tiles, 8, [((0, 0),)]).axes == (("a0", 2), ("a1", 4))
  # Unevenly strided groups add their steps only.
  assert shd.infer_mesh(tiles, 8, [((0, 1, 4, 5), (2, 3, 6, 7))]).axes == (
      ("a0", 2), ("a1", 4))


def test_groups_at_strides_no_mesh_joins_are_left_to_be_reported():
  """On 2 x 3 (cut at 3) XLA's reshards also step at 2: no one mesh has both
  cuts.  The shardings' cuts stand, the group's cut is dropped (its
  collective then reads on no axis and is reported where it is), and
  ``stride_across_mesh`` names the stride."""
  tiles = [shd.parse_hlo_sharding("{devices=[2,3]<=[6]}")]
  groups = ((0, 2, 4), (1, 3, 5))
  mesh = shd.infer_mesh(tiles, 6, [groups])
  assert mesh.axes == (("a0", 2), ("a1", 3))
  assert shd.group_axes(groups, mesh) is None
  assert shd.stride_across_mesh(groups, mesh) == 2
  assert shd.stride_across_mesh(((0, 1, 2), (3, 4, 5)), mesh) is None
  # Groups alone choose among themselves: the smaller cut first.
  assert shd.infer_mesh([], 6, [groups, ((0, 3), (1, 4), (2, 5))]).axes == (("a0", 3), ("a1", 2))
  # Shardings that no one mesh spells are still refused.
  with pytest.raises(shd.ShardingError, match="strides 2, 3"):
    shd.infer_mesh(tiles + [shd.parse_hlo_sharding("{devices=[3,2]<=[6]}")], 6)


def test_prime_strides_cut_every_axis_into_its_prime_factors():
  assert shd.prime_strides(ir.Mesh((("x", 2), ("y", 4)))) == {1, 2, 4}
  assert shd.prime_strides(ir.Mesh((("x", 12),))) == {1, 2, 4}
  assert shd.prime_strides(ir.Mesh((("x", 3), ("y", 2)))) == {1, 2}
  # A cycle of three halves is a renaming on the finest mesh, and nothing on 2 x 4.
  pairs = ((0, 0), (1, 4), (2, 1), (3, 5), (4, 2), (5, 6), (6, 3), (7, 7))
  assert not shd.permutes_read([pairs], ir.Mesh((("x", 2), ("y", 4))))
  assert shd.permutes_read([pairs], ir.Mesh((("a0", 2), ("a1", 2), ("a2", 2))))


def test_collective_permute_pairs():
  mesh = ir.Mesh((("dp", 2), ("tp", 4)))
  axis, perm = shd.axes_of_pairs([(0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7),
                                  (7, 4)], mesh)
  assert axis == "tp" and perm == {0: 1, 1: 2, 2: 3, 3: 0}
  assert shd.axes_of_pairs([(0, 5)], mesh) is None


def _scalar_module(mesh):
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  return m, g


def _op(m, g, name, operands, dtype="i32", **attrs):
  return m.add_op(g, name, operands, [ir.TensorType((), dtype)], attrs).result


def test_axis_index_arithmetic_is_symbolic():
  """shard_map's axis_index: partition_id / stride % size."""
  mesh = ir.Mesh((("dp", 2), ("tp", 4)))
  m, g = _scalar_module(mesh)
  pid = _op(m, g, "partition_id", [], "ui32")
  const = lambda v: _op(m, g, "constant", [], "ui32", value=np.array(v, np.uint32))
  dp_index = _op(m, g, "remainder", [_op(m, g, "divide", [pid, const(4)], "ui32"), const(2)],
                 "ui32")
  tp_index = _op(m, g, "remainder", [_op(m, g, "divide", [pid, const(1)], "ui32"), const(4)],
                 "ui32")
  arith = RankArithmetic(mesh)
  assert arith.value(dp_index) == rank_symbol("dp")
  assert arith.value(tp_index) == rank_symbol("tp")
  offset = _op(m, g, "multiply", [_op(m, g, "convert", [tp_index]),
                                  _op(m, g, "constant", [], value=np.array(8, np.int32))])
  assert sympy.simplify(arith.value(offset) - 8 * rank_symbol("tp")) == 0


def test_gspmd_offset_table_lookup():
  """GSPMD reads offsets from a constant table indexed by partition-id."""
  mesh = ir.Mesh((("a0", 4),))
  m, g = _scalar_module(mesh)
  table = m.add_op(g, "constant", [], [ir.TensorType((4,), "i32")],
                   {"value": np.array([0, 8, 16, 24], np.int32)}).result
  pid = _op(m, g, "partition_id", [], "ui32")
  looked = m.add_op(g, "dynamic_slice", [table, pid], [ir.TensorType((1,), "i32")],
                    {"slice_sizes": (1,)}).result
  assert RankArithmetic(mesh).value(looked) == 8 * rank_symbol("a0")
  # A table that is not affine in the index stays unknown (never guessed).
  table2 = m.add_op(g, "constant", [], [ir.TensorType((4,), "i32")],
                    {"value": np.array([0, 8, 24, 16], np.int32)}).result
  looked2 = m.add_op(g, "dynamic_slice", [table2, pid], [ir.TensorType((1,), "i32")],
                     {"slice_sizes": (1,)}).result
  assert RankArithmetic(mesh).value(looked2) is None


def test_an_offset_table_over_axes_in_another_order_is_read_as_their_sum():
  """XLA's offsets for rows split ("y", "x") on a 2 x 4 mesh (y major):
  rank 4 r_x + r_y starts at 2 (2 r_y + r_x), a table no one-digit form
  spells; read as a sum over the coordinates, checked at every partition."""
  mesh = ir.Mesh((("x", 2), ("y", 4)))
  m, g = _scalar_module(mesh)
  pid = _op(m, g, "partition_id", [], "ui32")
  assert RankArithmetic(mesh).value(_lookup(m, g, [0, 4, 8, 12, 2, 6, 10, 14], pid)) == \
      4 * rank_symbol("y") + 2 * rank_symbol("x")
  # One entry off: no sum of coordinates, unknown (never guessed).
  assert RankArithmetic(mesh).value(_lookup(m, g, [0, 4, 8, 12, 2, 6, 10, 15], pid)) is None


def test_collective_permute_with_fixed_points_is_a_full_permutation():
  mesh = ir.Mesh((("x", 4),))
  assert shd.axes_of_pairs([(0, 0), (1, 2), (2, 1), (3, 3)], mesh) == (
      "x", {0: 0, 1: 2, 2: 1, 3: 3})
  # A rank sending to two places is no permutation.
  assert shd.axes_of_pairs([(0, 1), (0, 2)], mesh) is None


@pytest.mark.parametrize("table,form", [
    ([0, 8, 16, 24], (0, 8, 1, None)),
    ([0, 0, 1, 1], (0, 1, 2, None)),   # the major half of 4 devices
    ([0, 1, 0, 1], (0, 1, 1, 2)),      # the minor digit
    ([5, 5, 5, 5], (5, 0, 1, None)),
    ([0, 8, 24, 16], None),
])
def test_offset_table_forms(table, form):
  from graphguard_hlo.passes.rank_arith import table_form
  assert table_form(np.array(table)) == form


def test_table_of_halves_refines_the_mesh_and_reads_as_an_axis():
  """GSPMD splitting 2 kv heads over 4 devices reads offsets from {0,0,1,1}[pid]."""
  from graphguard_hlo.passes.dist_program import _partition_id_strides
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  table = m.add_op(g, "constant", [], [ir.TensorType((4,), "ui32")],
                   {"value": np.array([0, 0, 1, 1], np.uint32)}).result
  pid = _op(m, g, "partition_id", [], "ui32")
  half = m.add_op(g, "dynamic_slice", [table, pid], [ir.TensorType((1,), "ui32")],
                  {"slice_sizes": (1,)}).result
  strides = _partition_id_strides(g, 4)
  assert strides == {2}
  mesh = shd.infer_mesh([], 4, extra_strides=strides)
  assert mesh.axes == (("a0", 2), ("a1", 2))
  assert RankArithmetic(mesh).value(half) == rank_symbol("a0")


def _lookup(m, g, values, index):
  table = m.add_op(g, "constant", [], [ir.TensorType((len(values),), "ui32")],
                   {"value": np.array(values, np.uint32)}).result
  return m.add_op(g, "dynamic_slice", [table, index], [ir.TensorType((1,), "ui32")],
                  {"slice_sizes": (1,)}).result


def test_nested_tables_refine_the_mesh_and_read_as_axes():
  """XLA on a 2x4 mesh, a kv head per pair of the 4: {0,8}[{0,0,1,1}[{0,1,2,3,0,1,2,3}[pid]]]."""
  from graphguard_hlo.passes.dist_program import _partition_id_strides
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  pid = _op(m, g, "partition_id", [], "ui32")
  offset = _lookup(m, g, [0, 8], _lookup(m, g, [0, 0, 1, 1], _lookup(m, g, [0, 1, 2, 3] * 2, pid)))
  strides = _partition_id_strides(g, 8)
  assert strides == {2, 4}
  mesh = shd.infer_mesh([], 8, extra_strides=strides)
  assert mesh.axes == (("a0", 2), ("a1", 2), ("a2", 2))
  assert RankArithmetic(mesh).value(offset) == 8 * rank_symbol("a1")
  # On the coarser 2x4 mesh the same offset cuts inside an axis: unknown, not guessed.
  assert RankArithmetic(ir.Mesh((("a0", 2), ("a1", 4)))).value(offset) is None


def test_partition_id_table_is_the_value_on_each_partition():
  from graphguard_hlo.passes.rank_arith import partition_id_table
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  pid = _op(m, g, "partition_id", [], "ui32")
  four = _op(m, g, "constant", [], "ui32", value=np.array(4, np.uint32))
  q = _op(m, g, "divide", [pid, four], "ui32")
  r = _op(m, g, "remainder", [pid, four], "ui32")
  both = _op(m, g, "add", [_op(m, g, "multiply", [r, four], "ui32"), q], "ui32")
  np.testing.assert_array_equal(partition_id_table(both, 8), [0, 4, 8, 12, 1, 5, 9, 13])
  # Anything read from a parameter is not a partition-id table.
  x = m.new_value(ir.TensorType((), "ui32"), name="x")
  assert partition_id_table(_op(m, g, "add", [pid, x], "ui32"), 8) is None


def test_a_permute_some_ranks_sit_out_is_no_axis_permutation():
  # A cycle along b among the a = 0 ranks only: the a = 1 ranks receive
  # nothing (zeros), which no permutation of b's coordinates gives.
  mesh = ir.Mesh((("a", 2), ("b", 4)))
  cycle = [(0, 1), (1, 2), (2, 3), (3, 0)]
  assert shd.axes_of_pairs(cycle, mesh) is None
  both = cycle + [(4 + s, 4 + d) for s, d in cycle]
  assert shd.axes_of_pairs(both, mesh) == ("b", {0: 1, 1: 2, 2: 3, 3: 0})


def test_a_one_element_iota_is_zero_on_every_partition_and_cuts_no_mesh_axis():
  """A schedule written for GSPMD numbers its stages by ``jnp.arange(n)``
  split one row per rank: XLA leaves a one-element iota beside the partition
  id.  Rank cases read it as 0 (stage s runs repeat ``(5 - s) // 4`` at step
  5: 1, 1, 0, 0); the mesh does not take that schedule's cut as an axis."""
  from graphguard_hlo.passes.dist_program import _partition_id_strides
  from graphguard_hlo.passes.rank_arith import partition_id_table
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  pid = _op(m, g, "partition_id", [], "i32")
  iota = m.add_op(g, "iota", [], [ir.TensorType((1,), "i32")], {"iota_dimension": 0}).result
  stage = m.add_op(g, "add", [iota, m.add_op(g, "broadcast_in_dim", [pid], [
      ir.TensorType((1,), "i32")], {"broadcast_dimensions": ()}).result],
      [ir.TensorType((1,), "i32")], {}).result
  step = m.add_op(g, "constant", [], [ir.TensorType((1,), "i32")],
                  {"value": np.array([5], np.int32)}).result
  four = m.add_op(g, "constant", [], [ir.TensorType((1,), "i32")],
                  {"value": np.array([4], np.int32)}).result
  lag = m.add_op(g, "subtract", [step, stage], [ir.TensorType((1,), "i32")], {}).result
  repeat = m.add_op(g, "divide", [lag, four], [ir.TensorType((1,), "i32")], {}).result
  np.testing.assert_array_equal(partition_id_table(repeat, 4), [1, 1, 0, 0])
  assert partition_id_table(repeat, 4, iota=False) is None
  assert _partition_id_strides(g, 4) == set()
  # The control: the same table spelled without the iota cuts the mesh at 2.
  m2 = ir.Module("<test>", "stablehlo")
  g2 = ir.Graph("main")
  pid2 = _op(m2, g2, "partition_id", [], "i32")
  five, four2 = (_op(m2, g2, "constant", [], "i32", value=np.array(v, np.int32)) for v in (5, 4))
  _op(m2, g2, "divide", [_op(m2, g2, "subtract", [five, pid2]), four2])
  assert _partition_id_strides(g2, 4) == {2}


def _mesh(*axes, device_ids=None):
  return ir.Mesh(tuple(axes), device_ids)


@pytest.mark.parametrize("atomic, source, expect", [
    # each atomic axis one of the source's: named after it
    ((("a0", 2), ("a1", 2)), (("dp", 2), ("tp", 2)), ("dp", "tp")),
    # a unit axis of the source cuts nothing
    ((("a0", 2), ("a1", 2)), (("dp", 2), ("x", 1), ("tp", 2)), ("dp", "tp")),
    # an axis joining two of the source's keeps its name
    ((("a0", 4),), (("dp", 2), ("tp", 2)), ("a0",)),
    # parts of an axis XLA cut finer are named as Shardy names sub-axes
    ((("a0", 2), ("a1", 2), ("a2", 2)), (("dp", 2), ("tp", 4)), ("dp", "tp:(1)2", "tp:(2)2")),
    ((("a0", 2), ("a1", 2), ("a2", 2)), (("y", 8),), ("y:(1)2", "y:(2)2", "y:(4)2")),
    ((("a0", 3), ("a1", 2), ("a2", 2)), (("x", 3), ("y", 4)), ("x", "y:(1)2", "y:(2)2")),
    ((("a0", 2), ("a1", 4)), (("y", 8),), ("y:(1)2", "y:(2)4")),
    # same sizes, other strides: tp=4 major where XLA cut dp=2 major; its
    # a0 is tp's major half, its a1 joins tp's minor half with dp
    ((("a0", 2), ("a1", 4)), (("tp", 4), ("dp", 2)), ("tp:(1)2", "a1")),
    # a name that would repeat: none renamed
    ((("a0", 2), ("a1", 4)), (("a1", 2), ("tp", 2), ("dp", 2)), ("a0", "a1")),
])
def test_atomic_axes_are_named_after_the_source_mesh(atomic, source, expect):
  assert shd.named_after(_mesh(*atomic), _mesh(*source)).axis_names == expect


def test_atomic_axes_keep_their_names_under_a_permuted_or_other_sized_source():
  atomic = _mesh(("a0", 2), ("a1", 2))
  assert shd.named_after(atomic, _mesh(("dp", 2), ("tp", 2), device_ids=(0, 2, 1, 3))) is atomic
  assert shd.named_after(atomic, _mesh(("dp", 2), ("tp", 4))) is atomic
  assert shd.named_after(atomic, None) is atomic


def test_a_users_axis_called_like_an_atomic_one_is_read_as_the_users():
  """The user's axes (a1, tp) where XLA cuts a0, a1 alike: a relation's a1
  is the user's a1 (XLA's a0), not XLA's a1, which is tp."""
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a1", "tp"))
  x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("a1", "tp")))
  module = lower_distributed(jnp.tanh, x, out_shardings=NamedSharding(mesh, P("a1", "tp")))
  assert module.attrs[SOURCE_MESH].axis_names == ("a1", "tp")
  program = canonicalize_dist(module)
  assert program.mesh.axis_names == ("a1", "tp")
  given = parse_relation_file("<r>", "0: dim0=a1\n", [(8, 8)], list(program.mesh.axis_names),
                              program.axis_aliases)
  assert given[0].dims == (("a1",), ())


@pytest.mark.parametrize("axes, text", [
    (("y:(1)2", "y:(2)2", "x"), "y,x"),  # all of y: named so
    (("y:(2)2", "y:(1)2"), "y:(2)2,y:(1)2"),  # minor half first: no run
    (("x", "y:(2)2"), "x,y:(2)2"),
    (("y:(1)2+1", "y:(2)2"), "y:(1)2+1,y:(2)2"),  # a rotated part is its own
])
def test_parts_of_an_axis_print_as_the_axis_where_they_run_major_to_minor(axes, text):
  mesh = _mesh(("x", 2), ("y:(1)2", 2), ("y:(2)2", 2))
  assert ",".join(ir.merged_axis_names(axes, mesh)) == text


def test_a_run_that_is_part_of_an_axis_prints_as_that_part():
  mesh = _mesh(("y:(1)2", 2), ("y:(2)2", 2), ("y:(4)2", 2))
  assert ir.merged_axis_names(("y:(2)2", "y:(4)2"), mesh) == ["y:(2)4"]
  assert ir.merged_axis_names(("y:(1)2", "y:(2)2"), mesh) == ["y:(1)4"]
  assert ir.merged_axis_names(("y:(1)2", "y:(2)2", "y:(4)2"), mesh) == ["y"]
  # a partial sum is over a set of axes: its parts merge in any order
  assert Layout(((),), partial=("y:(4)2", "x", "y:(1)2", "y:(2)2")).describe("d", mesh) \
      == "sum[x,y](d@r)"
