"""GPT-2 and Llama-3 under dp, tp, sp and dp x tp, layers unrolled and under
lax.scan, forward and forward+backward: proved, and seeded bugs
reported at their op.  GSPMD programs the engine cannot prove yet are listed
with the reason (the test fails when one starts being proved)."""

import pytest

from graphguard_hlo.pipeline import verify_modules
from tools.zoo import strategies

CASES = strategies.model_cases()

# Correct programs the engine cannot prove yet, with the reason (none today).
KNOWN_UNPROVED: dict[str, str] = {}


def _verify(case):
  return verify_modules(*case.modules())


@pytest.mark.parametrize("case", [c for c in CASES if c.bug is None], ids=lambda c: c.name)
def test_correct_model_is_proved(case):
  result = _verify(case)
  if case.name in KNOWN_UNPROVED:
    assert not result.refines, f"{case.name} is now proved: drop it from KNOWN_UNPROVED"
    pytest.xfail(KNOWN_UNPROVED[case.name])
  assert result.refines, result


@pytest.mark.parametrize("case", [c for c in CASES if c.bug is not None], ids=lambda c: c.name)
def test_seeded_model_bug_is_reported_at_its_op(case):
  result = _verify(case)
  assert not result.refines
  assert result.failure.op_name == case.bug_primitive, result.failure.diagnosis
  assert result.failure.location.file.endswith("tools/zoo/models.py")
