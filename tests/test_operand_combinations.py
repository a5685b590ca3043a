"""The order relation inference tries its operands' relations in
(inference._tied_first, _operand_combinations_to_try): every combination once; for a value
read twice (``x * x``) the combinations giving both reads the same relation
first, so a value with many relations still meets ``d * d`` before the cap;
and past the cap, those laying operands of one rank out alike as well."""

import itertools

from graphguard_hlo import ir
from graphguard_hlo.passes.inference import (MAX_COMBINATIONS, _operand_combinations_to_try,
                                              _tied_first)
from graphguard_hlo.passes.layout import Layout


def _values(*ids, shape=(2,)):
  return [ir.Value(i, ir.TensorType(shape, "f32")) for i in ids]


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


def _tiled(dim, axis):
  dims = [(), (), ()]
  dims[dim] = (axis,)
  return Layout(tuple(dims))


def test_under_the_cap_every_combination_in_the_same_order():
  a, b = _tiled(0, "x"), _tiled(1, "x")
  choices = [[("r1", a), ("r2", b)], [("u", b)]]
  values = _values(1, 2, shape=(2, 2, 2))
  assert list(_operand_combinations_to_try(values, choices)) == \
      list(_tied_first(values, choices))


def test_past_the_cap_operands_laid_out_alike_are_tried_too():
  # An accumulator assumed under 150 layouts, the one its update shares last;
  # an index (rank 0) with two relations; a splat (no layout) that adopts any.
  layouts = [_tiled(d, f"a{k}") for k in range(50) for d in range(3)]
  shared = layouts[-1]
  carry = [(f"c{k}", l) for k, l in enumerate(layouts)]
  update = [("u0", layouts[0]), ("u1", shared)]
  index = [("i0", Layout(())), ("i1", Layout(()))]
  splat = [("splat", None)]
  acc, upd = _values(1, 2, shape=(2, 2, 2))
  idx, = _values(3, shape=())
  zero, = _values(4, shape=(2, 2, 2))
  choices = [carry, update, index, splat]
  got = list(_operand_combinations_to_try([acc, upd, idx, zero], choices))
  product = list(itertools.product(*choices))
  # what the cap alone tried, in its order; then only the pairs laid out alike
  assert got[:MAX_COMBINATIONS] == product[:MAX_COMBINATIONS]
  assert got[MAX_COMBINATIONS:] == [(carry[-1], update[1], i, splat[0]) for i in index]
  assert product.index(got[-1]) >= MAX_COMBINATIONS


def test_the_combinations_laid_out_alike_are_capped_too():
  # 300 relations of one layout on each side: 90,000 alike pairs.
  layout = _tiled(0, "x")
  rels = [[(f"r{k}", layout) for k in range(300)], [(f"s{k}", layout) for k in range(300)]]
  got = list(_operand_combinations_to_try(_values(1, 2, shape=(2, 2, 2)), rels))
  assert len(got) == len(set(got)) == 2 * MAX_COMBINATIONS
