"""GSPMD's seeded bugs (tools/zoo/partitioner_bugs.py): each edit changes the
one collective or table of tile offsets it names, and the interpreter's run of XLA's per-device module,
the ground truth for those bugs, agrees with jax's run of the unedited one."""

import dataclasses

import jax
import numpy as np
import pytest

from tools.zoo import partitioner_bugs, strategies

# Two all-reduces as XLA prints them: replica groups listed, and as a mesh.
_TEXT = """ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %all-reduce = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(f)/dot_general" source_file="m.py" source_line=3}
  %all-reduce.1 = f32[4]{0} all-reduce(%all-reduce), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  ROOT %copy = f32[4]{0} copy(%all-reduce.1)
}"""


def _changed(before: str, after: str) -> list[tuple[str, str]]:
  return [(a, b) for a, b in zip(before.split("\n"), after.split("\n")) if a != b]


def test_drop_makes_that_all_reduce_a_copy_keeping_its_source_line():
  (old, new), = _changed(_TEXT, partitioner_bugs.drop_all_reduce(0).apply(_TEXT))
  assert old.startswith("  %all-reduce = ")
  assert new == ('  %all-reduce = f32[4]{0} copy(%p), metadata={op_name="jit(f)/dot_general" '
                 'source_file="m.py" source_line=3}')
  (old, new), = _changed(_TEXT, partitioner_bugs.drop_all_reduce(-1).apply(_TEXT))
  assert new == "  %all-reduce.1 = f32[4]{0} copy(%all-reduce)"


@pytest.mark.parametrize("nth", [0, 1])
def test_regroup_replaces_the_groups_in_either_spelling(nth):
  edit = partitioner_bugs.regroup("all-reduce", nth, ((0, 4), (1, 5), (2, 6), (3, 7)))
  (old, new), = _changed(_TEXT, edit.apply(_TEXT))
  assert old.startswith(f"  %all-reduce{'.1' if nth else ''} = ")
  assert "replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true" in new
  assert new.replace("{{0,4},{1,5},{2,6},{3,7}}", "G") == old.replace(
      "{{0,1,2,3},{4,5,6,7}}" if nth == 0 else "mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", "G")


def test_regroup_replaces_a_mesh_whose_device_ids_are_a_transposed_iota():
  line = ("  %all-to-all = f32[2,4,4]{2,1,0} all-to-all(%r), channel_id=1, "
          "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1)) "
          "{'axis_0':(2)2}, dimensions={0}")
  (old, new), = _changed(line, partitioner_bugs.regroup("all-to-all", 0, ((0, 2),)).apply(line))
  assert new == ("  %all-to-all = f32[2,4,4]{2,1,0} all-to-all(%r), channel_id=1, "
                 "replica_groups={{0,2}}, dimensions={0}")


_GATHERS = """  %p = f32[4]{0} parameter(0)
  %all-gather = f32[8]{0} all-gather(%p), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true
  %all-reduce = f32[8]{0} all-reduce(%all-gather), channel_id=2, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %all-gather.1 = f32[16]{0} all-gather(%p), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, use_global_device_ids=true"""


@pytest.mark.parametrize("nth, line", [(0, 1), (1, 3), (-1, 3)])
def test_regroup_finds_collectives_of_its_kind_in_the_iota_spelling(nth, line):
  groups = ((0, 2), (1, 3), (4, 6), (5, 7))
  edited = partitioner_bugs.regroup("all-gather", nth, groups).apply(_GATHERS)
  (old, new), = _changed(_GATHERS, edited)
  assert old == _GATHERS.split("\n")[line]
  assert "replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}" in new
  assert "<=" not in new


def test_regroup_of_a_kind_the_module_lacks_is_an_error():
  with pytest.raises(ValueError, match="has 0 all-to-alls; no all-to-all 0"):
    partitioner_bugs.regroup("all-to-all", 0, ((1, 0),)).apply(_GATHERS)


_TABLES = """  %c0 = s32[4]{0} constant({0, 1, 0, 1}), metadata={op_name="jit(f)/iota"}
  %c1 = s32[4]{0} constant({0, 16, 32, 48}), metadata={op_name="jit(f)/dot_general"}
  %c2 = s32[3]{0} constant({2, 1, 0})
  %c3 = s32[2]{0} constant({0, 8})"""


def test_rotate_moves_each_rank_to_the_next_ranks_offset():
  (old, new), = _changed(_TABLES, partitioner_bugs.rotate_rank_table(0).apply(_TABLES))
  assert new == '  %c1 = s32[4]{0} constant({16, 32, 48, 0}), metadata={op_name="jit(f)/dot_general"}'
  (old, new), = _changed(_TABLES, partitioner_bugs.rotate_rank_table(-1).apply(_TABLES))
  assert new == "  %c3 = s32[2]{0} constant({8, 0})"


@pytest.mark.parametrize("edit", [partitioner_bugs.drop_all_reduce(2),
                                  partitioner_bugs.regroup("all-reduce", -3, ((0, 1),))])
def test_an_all_reduce_the_module_lacks_is_an_error(edit):
  with pytest.raises(ValueError, match="no all-reduce"):
    edit.apply(_TEXT)


def test_a_table_the_module_lacks_is_an_error():
  # (neither {0, 1, 0, 1} nor {2, 1, 0} is a table of tile offsets)
  with pytest.raises(ValueError, match="has 2 rank tables; no rank table 2"):
    partitioner_bugs.rotate_rank_table(2).apply(_TABLES)


@pytest.mark.parametrize("name", ["gpt2/tp/gspmd/ok", "llama3/dp_tp_grad/gspmd/ok"])
def test_interpreted_per_device_module_agrees_with_jax(name):
  case = strategies.get(name)
  inputs = strategies.model_inputs(case, seed=0)
  _, jax_out = strategies.run_both(case, inputs)
  interpreted = partitioner_bugs.run_partitioned(case, inputs)
  assert jax.tree.structure(interpreted) == jax.tree.structure(jax_out)
  for got, want in zip(jax.tree.leaves(interpreted), jax.tree.leaves(jax_out)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_replicas_that_disagree_give_no_output():
  # Each rank's loss after dropping the first all-reduce is its own partial
  # computation: the replicated output has no one value.
  case = dataclasses.replace(strategies.get("gpt2/tp/gspmd/ok"),
                             dist_edit=partitioner_bugs.drop_all_reduce(0))
  loss = partitioner_bugs.run_partitioned(case, strategies.model_inputs(case, seed=0))
  assert np.isnan(loss)
