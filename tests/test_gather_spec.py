"""The HLO text loader's gather check (``loaders/gather_spec.py``) agrees
with StableHLO's own verifier, and refuses a bad gather with one line."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from graphguard_hlo.errors import InputError
from graphguard_hlo.loaders.gather_spec import _result_shape, gather_violation
from graphguard_hlo.loaders.hlo_text import load_hlo_text
from graphguard_hlo.loaders.stablehlo import mlir_context

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _some(draw, n: int, size: int) -> list[int]:
  """Up to ``size`` dims up to ``n`` (one past the last): mostly sorted and
  distinct, as a valid gather's are, sometimes not."""
  dims = draw(st.lists(st.integers(0, n), max_size=size))
  return sorted(set(dims)) if n and draw(st.integers(0, 4)) else dims


@st.composite
def gathers(draw):
  """Shapes and dimension numbers near a valid gather: the operand's dims
  dealt to offset, collapsed and batching dims, then perhaps disturbed."""
  rank = draw(st.integers(1, 3))
  operand = [draw(st.integers(1, 3)) for _ in range(rank)]
  roles = [draw(st.sampled_from("occb")) for _ in range(rank)]
  collapsed = [d for d, r in enumerate(roles) if r == "c"]
  batching = [d for d, r in enumerate(roles) if r == "b"]
  batch_rank = draw(st.integers(len(batching), len(batching) + 1))
  index_vector_dim = draw(st.integers(0, batch_rank))
  start_map = draw(st.permutations(range(rank)))[:draw(st.integers(0, rank))]
  starts = len(start_map)
  indices = [draw(st.integers(1, 3)) for _ in range(batch_rank)]
  batch_dims = [d for d in range(batch_rank + 1) if d != index_vector_dim]
  idx_batching = draw(st.permutations(batch_dims))[:len(batching)]
  shape = list(indices)
  shape.insert(index_vector_dim, starts)
  for a, b in zip(batching, idx_batching):
    shape[b] = operand[a]
  slice_sizes = [1 if d in collapsed or d in batching else draw(st.integers(0, operand[d]))
                 for d in range(rank)]
  offsets = rank - len(collapsed) - len(batching)
  result_rank = batch_rank + offsets
  offset_dims = sorted(draw(st.permutations(range(result_rank)))[:offsets])
  fields = dict(offset_dims=offset_dims, collapsed_slice_dims=collapsed,
                operand_batching_dims=batching, start_indices_batching_dims=idx_batching,
                start_index_map=start_map, index_vector_dim=index_vector_dim,
                slice_sizes=slice_sizes)
  # Disturb one field (or none): what a hand-edited dump might hold.  A
  # reversed list keeps every other constraint: only its order is wrong.
  lists = ["offset_dims", "collapsed_slice_dims", "operand_batching_dims",
           "start_indices_batching_dims", "start_index_map"]
  key = draw(st.sampled_from([None, None, "index_vector_dim", "slice_sizes"] + lists
                             + [f"reversed {k}" for k in lists]))
  if key is not None and key.startswith("reversed "):
    fields[key[9:]] = fields[key[9:]][::-1]
  elif key == "index_vector_dim":
    fields[key] = draw(st.integers(0, len(shape)))
  elif key == "slice_sizes":
    fields[key] = [draw(st.integers(0, 3)) for _ in range(draw(st.integers(rank - 1, rank)))]
  elif key is not None:
    fields[key] = _some(draw, rank if key != "start_indices_batching_dims" else len(shape),
                        rank)
  result = _result_shape(operand, shape, fields["offset_dims"], fields["collapsed_slice_dims"],
                         fields["operand_batching_dims"], fields["index_vector_dim"],
                         fields["slice_sizes"]) if _countable(operand, shape, fields) else None
  if result is None or draw(st.integers(0, 5)) == 0:
    result = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 4)))]
  return operand, shape, list(result), fields


def _countable(operand, indices, f) -> bool:
  """Can (C22)'s result shape be computed at all from these fields?"""
  return len(f["slice_sizes"]) == len(operand) and \
      len(f["offset_dims"]) + len(f["collapsed_slice_dims"]) + \
      len(f["operand_batching_dims"]) == len(operand) and \
      0 <= f["index_vector_dim"] <= len(indices) and \
      all(0 <= d < len(operand) for d in f["collapsed_slice_dims"] + f["operand_batching_dims"])


def _stablehlo_accepts(operand, indices, result, f) -> bool:
  """StableHLO's verifier on the same gather."""
  from jaxlib.mlir import ir as mlir_ir
  t = lambda shape, e: f"tensor<{'x'.join(map(str, shape))}{'x' if shape else ''}{e}>"
  ints = lambda xs: f"[{', '.join(map(str, xs))}]"
  i64s = lambda xs: f"array<i64: {', '.join(map(str, xs))}>" if xs else "array<i64>"
  text = f"""func.func @main(%x: {t(operand, 'f32')}, %i: {t(indices, 'i32')}) -> {t(result, 'f32')} {{
  %g = "stablehlo.gather"(%x, %i) {{dimension_numbers = #stablehlo.gather<
      offset_dims = {ints(f['offset_dims'])}, collapsed_slice_dims = {ints(f['collapsed_slice_dims'])},
      operand_batching_dims = {ints(f['operand_batching_dims'])},
      start_indices_batching_dims = {ints(f['start_indices_batching_dims'])},
      start_index_map = {ints(f['start_index_map'])}, index_vector_dim = {f['index_vector_dim']}>,
    slice_sizes = {i64s(f['slice_sizes'])}}}
    : ({t(operand, 'f32')}, {t(indices, 'i32')}) -> {t(result, 'f32')}
  return %g : {t(result, 'f32')}
}}"""
  with mlir_context(), mlir_ir.Location.unknown():
    try:
      mlir_ir.Module.parse(text)
      return True
    except mlir_ir.MLIRError:
      return False


@SETTINGS
@given(gathers())
def test_the_check_agrees_with_stablehlo_verifier(case):
  operand, indices, result, f = case
  ours = gather_violation(operand, indices, result, f["offset_dims"], f["collapsed_slice_dims"],
                          f["operand_batching_dims"], f["start_indices_batching_dims"],
                          f["start_index_map"], f["index_vector_dim"], f["slice_sizes"])
  assert (ours is None) == _stablehlo_accepts(operand, indices, result, f), (case, ours)


def test_the_draws_reach_both_verdicts():
  """The property above would pass vacuously were every draw valid, or none."""
  seen = set()

  @SETTINGS
  @given(gathers())
  def record(case):
    operand, indices, result, f = case
    seen.add(_stablehlo_accepts(operand, indices, result, f))
  record()
  assert seen == {True, False}


_GOOD = """HloModule m

ENTRY main {
  x = f32[4,3] parameter(0)
  i = s32[2,1] parameter(1)
  ROOT g = f32[2,3] gather(x, i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,3}
}
"""


@pytest.mark.parametrize("old, new, words", [
    ("offset_dims={1}", "offset_dims={0}", "the result must have shape [3, 2], not [2, 3]"),
    ("slice_sizes={1,3}", "slice_sizes={1,4}", "slice_sizes [1, 4] exceed the operand's shape"),
    ("start_index_map={0}", "start_index_map={0,1}", "start_index_map has 2 entries for 1"),
    ("f32[2,3] gather", "f32[3,2] gather", "the result must have shape [2, 3], not [3, 2]"),
    ("f32[2,3] gather", "s32[2,3] gather", "the result's element type s32 is not the operand's"),
    ("s32[2,1] parameter(1)", "f32[2,1] parameter(1)", "start indices must be integers, not f32"),
    ("s32[2,1] parameter(1)", "pred[2,1] parameter(1)", "start indices must be integers"),
])
def test_a_bad_gather_is_one_line_naming_its_line(old, new, words):
  with pytest.raises(InputError) as e:
    load_hlo_text("bad.hlo", _GOOD.replace(old, new))
  message = str(e.value)
  assert message.startswith("bad.hlo:6:") and "%g (gather): " in message, message
  assert words in message and "\n" not in message, message


def test_a_good_gather_loads():
  assert load_hlo_text("good.hlo", _GOOD).main.ops[-1].name == "gather"
