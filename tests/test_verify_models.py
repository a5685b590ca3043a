"""GPT-2 and Llama-3 under dp, tp, sp, cp, dp x tp and dp x tp x cp, layers unrolled and under
lax.scan, forward and forward+backward: proved, and seeded bugs
reported at their op.  GSPMD programs the engine cannot prove yet are listed
with the reason (the test fails when one starts being proved)."""

import pytest

from graphguard_hlo.pipeline import verify_modules
from tools.zoo import strategies

CASES = strategies.model_cases()

# Correct programs the engine cannot prove yet, with the reason.
_RESIDUALS_DIFFER = (
    "jax's scan saves different residuals for the backward pass in the two programs: "
    "the sequential scan stacks a tp-split projection per layer, the per-device scan "
    "(with the cp all-gathers in its body) stacks layernorm's centred input instead, so "
    "one stacked residual has no per-device counterpart")
KNOWN_UNPROVED: dict[str, str] = {
    "gpt2/dp_tp_cp_scan_grad/shard_map/ok": _RESIDUALS_DIFFER,
    "llama3/dp_tp_cp_scan_grad/shard_map/ok": _RESIDUALS_DIFFER,
}


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
