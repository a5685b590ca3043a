"""End to end on the zoo: every correct program is proved, every seeded bug is
reported at its op.  Both directions, so neither verdict can be hard-wired."""

import pytest

from tests.zoo_verdicts import verified
from tools.zoo import cases

# jax primitives that StableHLO spells differently.
_STABLEHLO_NAME = {"integer_pow": "multiply", "exp": "exponential"}

# Correct programs the engine cannot prove yet, with the reason.  Kept honest:
# the test below fails if one of them starts being proved (remove it here).
KNOWN_UNPROVED: dict[str, str] = {}


def _verify(case):
  result, _ = verified(case)  # shared with test_relation_check.py
  return result


@pytest.mark.parametrize("case", cases.correct_cases(), ids=lambda c: c.name)
def test_correct_program_is_proved(case):
  result = _verify(case)
  if case.name in KNOWN_UNPROVED:
    assert not result.refines, f"{case.name} is now proved: drop it from KNOWN_UNPROVED"
    pytest.xfail(KNOWN_UNPROVED[case.name])
  assert result.refines, result.failure and result.failure.diagnosis
  assert result.failure is None
  assert len(result.outputs) >= 1


@pytest.mark.parametrize("case", cases.bug_cases(), ids=lambda c: c.name)
def test_seeded_bug_is_reported_at_its_op(case):
  result = _verify(case)
  assert not result.refines
  failure = result.failure
  expected = _STABLEHLO_NAME.get(case.bug_primitive, case.bug_primitive)
  assert failure.op_name == expected, failure.diagnosis
  assert failure.location.file and failure.location.line, "every report names file:line"
  assert failure.diagnosis


_DIAGNOSES = {
    "tp_mlp/shard_map/missing_allreduce": "missing all-reduce",
    "tp_mlp/shard_map/pmean_not_psum": "pmean where psum belongs",
    "dp_loss/shard_map/psum_not_pmean": "psum where pmean belongs",
    "dp_tp_mlp/shard_map/wrong_replica_groups": "wrong replica groups",
    "sp_allgather_mlp/shard_map/wrong_gather_dim": "wrong dim",
    # Rank 0 got rank 3's one tile (rows 12:16) where rank 2's two belong.
    "dp_tree_gather/shard_map/wrong_tree_sender":
        "rank by rank it holds, on every rank: %1[0:8, 0:8] at [0:8, 0:8], "
        "%1[12:16, 0:8] at [8:12, 0:8], zeros elsewhere",
    "sp_rmsnorm/shard_map/swapped_shards": "permuted between ranks",
    "tp_heads/shard_map/wrong_transpose": "it is a transpose (permutation [1, 2, 0])",
    "dp_cumsum/shard_map/cumsum_wrong_axis": "window_dimensions [4, 1] where [1, 8]",
}


@pytest.mark.parametrize("name", sorted(_DIAGNOSES))
def test_diagnosis_names_the_bug_class(name):
  result = _verify(cases.get(name))
  assert _DIAGNOSES[name] in result.failure.diagnosis
