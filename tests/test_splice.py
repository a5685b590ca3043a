"""``passes/splice.py``: ops replaced by other ops; every later reader, in
nested regions too, and the graph's results read the new values."""

from graphguard_hlo import ir
from graphguard_hlo.passes.splice import splice

F32 = ir.TensorType((), "f32")


def test_readers_everywhere_read_the_stand_in():
  m = ir.Module("<test>", "stablehlo")
  g = ir.Graph("main")
  x = m.new_value(F32)
  g.params = [x]
  a = m.add_op(g, "sine", [x], [F32]).result
  body = ir.Graph("body")
  inner = m.add_op(body, "negate", [a], [F32]).result  # a region capturing a
  body.results = [inner]
  holder = m.add_op(g, "case", [x], [F32], regions=[body]).result
  b = m.add_op(g, "add", [a, holder], [F32]).result
  g.results = [a, b]
  stand_in = []

  def rewrite(op):
    if op.name != "sine":
      return None
    new = ir.Op("cosine", [x], {}, [], op.location)
    new.results = [m.new_value(F32, new, 0)]
    stand_in.append(new.results[0])
    return [new], new.results
  assert splice(g, rewrite) == 1
  (c,) = stand_in
  assert [op.name for op in g.ops] == ["cosine", "case", "add"]
  assert g.results[0] is c and g.ops[2].operands[0] is c
  assert body.ops[0].operands[0] is c
