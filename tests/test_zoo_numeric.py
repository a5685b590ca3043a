"""The zoo's ground truth: correct cases agree numerically, bugs do not."""

import jax
import pytest

from tools.zoo import cases, numeric

CORRECT = cases.correct_cases()
BUGS = cases.bug_cases()
ALL = cases.all_cases()


def _ids(case):
  return case.name


def test_names_unique_and_get_roundtrips():
  names = [c.name for c in ALL]
  assert len(names) == len(set(names))
  for name in names:
    assert cases.get(name).name == name
  with pytest.raises(KeyError):
    cases.get("no/such/case")


def test_bug_metadata_is_consistent():
  for c in ALL:
    c.check_well_formed()


def test_required_bugs_present():
  bugs = {c.bug for c in BUGS}
  assert {"missing_allreduce", "psum_not_pmean", "pmean_not_psum",
          "wrong_gather_dim", "wrong_replica_groups",
          "swapped_shards"} <= bugs


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_lowers(case):
  jax.jit(case.dist_fn).lower(*case.dist_args)
  jax.jit(case.seq_fn).lower(*case.seq_args)


@pytest.mark.parametrize("case", CORRECT, ids=_ids)
def test_correct_case_matches(case):
  seq_out, dist_out = numeric.run_both(case)
  assert seq_out.shape == dist_out.shape
  assert numeric.outputs_match(case), abs(seq_out - dist_out).max()


@pytest.mark.parametrize("case", BUGS, ids=_ids)
def test_bug_changes_result(case):
  assert not numeric.outputs_match(case)
