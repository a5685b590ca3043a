"""The order relation inference tries its operands' relations in
(inference._tied_first): every combination once, and for a value read twice
(``x * x``) the combinations giving both reads the same relation first, so a
value with many relations still meets ``d * d`` before the cap."""

import itertools

from graphguard_hlo import ir
from graphguard_hlo.passes.inference import MAX_COMBINATIONS, _tied_first


def _values(*ids):
  return [ir.Value(i, ir.TensorType((2,), "f32")) for i in ids]


def test_distinct_operands_are_the_plain_product():
  choices = [["a", "b"], [1, 2, 3]]
  assert list(_tied_first(_values(1, 2), choices)) == list(itertools.product(*choices))


def test_a_value_read_twice_meets_itself_first_and_every_pair_once():
  rels = list(range(20))  # 400 pairs: past the cap
  x = _values(7)[0]
  got = list(_tied_first([x, x], [rels, rels]))
  assert sorted(got) == sorted(itertools.product(rels, rels))
  assert got[:20] == [(r, r) for r in rels]
  assert (19, 19) in got[:MAX_COMBINATIONS]


def test_a_value_read_twice_among_others():
  x, y = _values(1, 2)
  choices = [["p", "q"], ["u"], ["p", "q"]]
  got = list(_tied_first([x, y, x], choices))
  assert got[:2] == [("p", "u", "p"), ("q", "u", "q")]
  assert sorted(got) == sorted(itertools.product(*choices))
