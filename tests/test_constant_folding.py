"""Constants computed from constants fold, on both sides, so backward passes'
cotangent scalars ((1/4)/16 on the devices, 1/64 sequentially) meet."""

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.passes.dist_program import DistProgram
from graphguard_hlo.passes.inference import verify_programs
from graphguard_hlo.passes.layout import Layout

MESH = ir.Mesh((("dp", 4),))


def _const(m, g, v, shape=()):
  c = m.add_op(g, "constant", [], [ir.TensorType((), "f32")],
               {"value": np.array(v, np.float32)}).result
  if shape:
    c = m.add_op(g, "broadcast_in_dim", [c], [ir.TensorType(shape, "f32")],
                 {"broadcast_dimensions": ()}).result
  return c


def _program(shape, scale_ops):
  m = ir.Module("<t>", "stablehlo")
  g = ir.Graph("main")
  x = m.new_value(ir.TensorType(shape, "f32"), name="x")
  g.params, g.param_attrs, g.param_locations = [x], [{}], [ir.UNKNOWN_LOCATION]
  y = x
  for name, a, b in scale_ops:
    k = m.add_op(g, name, [_const(m, g, a), _const(m, g, b)], [ir.TensorType((), "f32")]).result
    kb = m.add_op(g, "broadcast_in_dim", [k], [ir.TensorType(shape, "f32")],
                  {"broadcast_dimensions": ()}).result
    y = m.add_op(g, "multiply", [y, kb], [ir.TensorType(shape, "f32")]).result
  g.results = [y]
  m.functions["main"] = g
  return m, g


def test_folded_scalars_meet():
  seq, _ = _program((8, 4), [("divide", 1.0, 64.0)])
  dist, dg = _program((2, 4), [("divide", 1.0, 4.0), ("divide", 1.0, 16.0)])
  layout = Layout((("dp",), ()))
  prog = DistProgram(dist, dg, MESH, [layout], [layout], "shard_map")
  assert verify_programs(seq, prog).refines


def test_a_different_constant_is_caught():
  seq, _ = _program((8, 4), [("divide", 1.0, 64.0)])
  dist, dg = _program((2, 4), [("divide", 1.0, 4.0), ("divide", 1.0, 4.0)])
  layout = Layout((("dp",), ()))
  prog = DistProgram(dist, dg, MESH, [layout], [layout], "shard_map")
  result = verify_programs(seq, prog)
  assert not result.refines
  assert "4 times" in result.failure.diagnosis or "0.25 times" in result.failure.diagnosis
