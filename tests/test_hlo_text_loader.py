"""The HLO text loader against the proto path, on dumps JAX writes during the test.

Each program is compiled once (CPU, 8 fake devices) with ``--xla_dump_to``, and the
``*.txt`` dump of a pass is loaded next to the ``*.hlo.pb`` of the same pass.  The two
IRs are compared op by op: names, operand wiring, result types, attributes,
locations (file, line, column, op name), regions, parameter and result annotations.

Known differences, all on the proto side or not in the text at all:
  * ``num_partitions``: XLA's converter drops it, so the proto path says 1 unless a
    mesh-form replica group creates a mesh; the text path reads the header.
  * ``mhlo.spmd_output_sharding``: kept in the proto, never printed in the text.
  * constants printed as ``{...}``: the text has no values (``ElidedConstant``)
    unless the dump was made with ``--xla_dump_large_constants``.
  * mesh-form replica groups with ``device_ids=(...)``: the converter drops the
    device order, so the proto path gets the groups wrong; the text path does not.
  * op results are named after the HLO instructions (display only).

As in the proto path, every computation is also a function of the module: ``call``
names its callee (``callee="@name"``) and has no region, while ``while``, ``case``,
``if``, reducers and comparators get the computation inlined as regions.
"""

from __future__ import annotations

import glob
import inspect
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax, shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError
from graphguard_hlo.loaders import hlo_proto, load_module
from graphguard_hlo.loaders.hlo_text import ElidedConstant, load_hlo_text

S = jax.ShapeDtypeStruct
F32 = jnp.float32


# --------------------------------------------------------------------------- programs

def _mlp(x, w1, w2):
  h = jnp.tanh(x @ w1)
  return h @ w2


def _sum_rows(x, w):
  return jnp.tanh(x @ w).sum(axis=0)


def _collectives(x, y):
  a = lax.psum(x, "tp")
  b = lax.all_gather(x, "tp", axis=0, tiled=True)
  c = lax.psum_scatter(y, "tp", scatter_dimension=0, tiled=True)
  d = lax.ppermute(x, "tp", perm=[(i, (i + 1) % 4) for i in range(4)])
  e = lax.all_to_all(y, "tp", 0, 1, tiled=True)
  return a, b, c, d, e


def _scan(x, ws):
  def step(c, w):
    c = jnp.tanh(c @ w)
    return c, c.sum()
  return lax.scan(step, x, ws)


def _cond(p, x):
  return lax.cond(p > 0, lambda v: jnp.sin(v) * 2, lambda v: v - 1.0, x)


def _reduces(x):
  return x.sum(axis=1), x.max(axis=0), jnp.argmax(x, axis=1)


def _constants(x, y):
  a = x * 2.5 + jnp.full((4, 4), 3.0)
  b = a + jnp.array([[1., 2., 3., 4.]] * 4)
  c = y * jnp.bfloat16(1.5) + jnp.array([1, 2, 3, 4], jnp.bfloat16)
  i = jnp.arange(4, dtype=jnp.int32) + jnp.array([7, -1, 0, 2**31 - 1], jnp.int32)
  m = jnp.array([True, False, True, True])
  return b, c, jnp.where(m, i, 0), jnp.broadcast_to(jnp.arange(8).reshape(2, 4), (3, 2, 4))


def _softmax(x):
  return jax.nn.softmax(x, axis=-1)


def _slices(x):
  return x[:, 1:5] * 2, jnp.roll(x, 1, axis=0)


def _line(fn, needle: str) -> int:
  """The source line of ``fn`` that contains ``needle``."""
  lines, first = inspect.getsourcelines(fn)
  return first + next(k for k, text in enumerate(lines) if needle in text)


# --------------------------------------------------------------------------- dumps

def _compile(out_dir: str, fn, args, large_constants: bool = False) -> str:
  opts = {"xla_dump_to": out_dir, "xla_dump_hlo_pass_re": "spmd-partitioning",
          "xla_dump_hlo_as_proto": True, "xla_dump_hlo_as_text": True}
  if large_constants:
    opts["xla_dump_large_constants"] = True
  fn.lower(*args).compile(compiler_options=opts)
  return out_dir


@pytest.fixture(scope="session")
def dumps(tmp_path_factory):
  """Every program compiled once; name -> its dump directory."""
  root = tmp_path_factory.mktemp("hlo_dumps")
  devs = jax.devices()
  assert len(devs) >= 8, "tests/conftest.py should give the CPU backend 8 devices"
  tp = Mesh(np.array(devs[:4]), ("tp",))
  grid = Mesh(np.array(devs[:8]).reshape(2, 4), ("dp", "tp"))
  ns = lambda mesh, *spec: NamedSharding(mesh, P(*spec))
  out: dict[str, str] = {}

  def add(name, fn, *args, **kw):
    out[name] = _compile(str(root / name), fn, args, **kw)

  add("mlp", jax.jit(_mlp, in_shardings=(ns(tp), ns(tp, None, "tp"), ns(tp, "tp", None))),
      S((8, 16), F32), S((16, 32), F32), S((32, 16), F32))
  # dp x tp: an all-reduce over dp (mesh form), over tp with the mesh's own device
  # order (mesh form with device_ids) and over tp as an iota list.
  add("grid_dp", jax.jit(_sum_rows, in_shardings=(ns(grid, "dp", None), ns(grid, None, "tp"))),
      S((8, 16), F32), S((16, 32), F32))
  add("grid_tp", jax.jit(_sum_rows, in_shardings=(ns(grid, None, "tp"), ns(grid, "tp", None))),
      S((8, 16), F32), S((16, 32), F32))
  add("grid_iota", jax.jit(_sum_rows, in_shardings=(ns(grid, None, "dp"), ns(grid, "dp", "tp"))),
      S((8, 16), F32), S((16, 32), F32))
  sm = shard_map(_collectives, mesh=grid, in_specs=(P("dp", "tp"), P(None, "tp")),
                 out_specs=(P("dp", None), P("dp"), P("tp"), P("dp", "tp"), P(None, "tp")),
                 check_vma=False)
  add("shard_map", jax.jit(sm), S((8, 16), F32, sharding=ns(grid, "dp", "tp")),
      S((16, 16), F32, sharding=ns(grid, None, "tp")))
  add("scan", jax.jit(_scan), S((4, 8), F32), S((3, 8, 8), F32))
  add("cond", jax.jit(_cond), S((), jnp.int32), S((4,), F32))
  add("reduce", jax.jit(_reduces), S((4, 8), F32))
  add("constants", jax.jit(_constants), S((4, 4), F32), S((4,), jnp.bfloat16),
      large_constants=True)
  add("constants_elided", jax.jit(_constants), S((4, 4), F32), S((4,), jnp.bfloat16))
  add("softmax", jax.jit(_softmax, in_shardings=ns(tp, "tp", None)), S((8, 16), F32))
  add("slices", jax.jit(_slices, in_shardings=ns(tp, "tp", None), out_shardings=ns(tp, None, "tp")),
      S((8, 16), F32))
  return out


def _dump_file(directory: str, pattern: str) -> str:
  hits = sorted(glob.glob(os.path.join(directory, f"*{pattern}*.txt")))
  assert hits, f"no *{pattern}*.txt in {directory}: {os.listdir(directory)}"
  return hits[0]


def _load_pair(directory: str, pattern: str) -> tuple[ir.Module, ir.Module]:
  txt = _dump_file(directory, pattern)
  pb = txt[:-len(".txt")] + ".hlo.pb"
  with open(txt) as f:
    text_mod = load_hlo_text(txt, f.read())
  with open(pb, "rb") as f:
    proto_mod = hlo_proto.load_hlo_proto_via_converter(pb, f.read())
  return text_mod, proto_mod


BEFORE = "before_optimizations"
AFTER_SPMD = "after_spmd-partitioning"
BEFORE_SPMD = "before_spmd-partitioning"


# --------------------------------------------------------------------------- comparison

def _same(a, b) -> bool:
  if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
            and str(a.dtype) == str(b.dtype)
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  return type(a) is type(b) and a == b


def _loc(loc: ir.Location) -> tuple:
  return (loc.file, loc.line, loc.column, loc.op_name)


def _differences(text_mod: ir.Module, proto_mod: ir.Module, skip_attr=None) -> list[str]:
  """Everything that differs between two modules, op by op, as readable lines."""
  out: list[str] = []
  if set(text_mod.functions) != set(proto_mod.functions):
    out.append(f"functions {sorted(text_mod.functions)} != {sorted(proto_mod.functions)}")
  if text_mod.entry != proto_mod.entry:
    out.append(f"entry {text_mod.entry} != {proto_mod.entry}")
  attrs_t = {k: v for k, v in text_mod.attrs.items() if k != "mhlo.spmd_output_sharding"}
  attrs_p = {k: v for k, v in proto_mod.attrs.items() if k != "mhlo.spmd_output_sharding"}
  if not _same(attrs_t, attrs_p):
    out.append(f"module attrs {attrs_t} != {attrs_p}")

  def graph(gt: ir.Graph, gp: ir.Graph, path: str, kt: dict, kp: dict) -> None:
    if [v.type for v in gt.params] != [v.type for v in gp.params]:
      out.append(f"{path}: params {gt.params} != {gp.params}")
      return
    for i, (vt, vp) in enumerate(zip(gt.params, gp.params)):
      kt[vt.id] = kp[vp.id] = (path, "arg", i)
    if not _same(gt.param_attrs, gp.param_attrs):
      out.append(f"{path}: param attrs {gt.param_attrs} != {gp.param_attrs}")
    if [_loc(x) for x in gt.param_locations] != [_loc(x) for x in gp.param_locations]:
      out.append(f"{path}: param locations {gt.param_locations} != {gp.param_locations}")
    if [o.name for o in gt.ops] != [o.name for o in gp.ops]:
      out.append(f"{path}: ops {[o.name for o in gt.ops]} != {[o.name for o in gp.ops]}")
      return
    for k, (ot, op) in enumerate(zip(gt.ops, gp.ops)):
      where = f"{path} op {k} {ot.name} ({ot.results[0].name if ot.results else ''})"
      wt = [kt.get(v.id, "?") for v in ot.operands]
      wp = [kp.get(v.id, "?") for v in op.operands]
      if wt != wp:
        out.append(f"{where}: operands {wt} != {wp}")
      if [r.type for r in ot.results] != [r.type for r in op.results]:
        out.append(f"{where}: types {[r.type for r in ot.results]} != "
                   f"{[r.type for r in op.results]}")
      at = {a: v for a, v in ot.attrs.items() if not (skip_attr and skip_attr(ot, a, v))}
      ap = {a: v for a, v in op.attrs.items() if not (skip_attr and skip_attr(op, a, v))}
      if not _same(at, ap):
        out.append(f"{where}: attrs {at} != {ap}")
      if _loc(ot.location) != _loc(op.location):
        out.append(f"{where}: location {ot.location!r} != {op.location!r}")
      if [r.name for r in ot.regions] != [r.name for r in op.regions]:
        out.append(f"{where}: regions {[r.name for r in ot.regions]} != "
                   f"{[r.name for r in op.regions]}")
      for r, (rt, rp) in enumerate(zip(ot.regions, op.regions)):
        graph(rt, rp, f"{where}.r{r}", kt, kp)
      for i, (vt, vp) in enumerate(zip(ot.results, op.results)):
        kt[vt.id] = kp[vp.id] = (path, k, i)
    rt = [kt.get(v.id, "?") for v in gt.results]
    rp = [kp.get(v.id, "?") for v in gp.results]
    if rt != rp:
      out.append(f"{path}: results {rt} != {rp}")
    if not _same(gt.result_attrs, gp.result_attrs):
      out.append(f"{path}: result attrs {gt.result_attrs} != {gp.result_attrs}")

  for name in sorted(set(text_mod.functions) & set(proto_mod.functions)):
    graph(text_mod.functions[name], proto_mod.functions[name], name, {}, {})
  return out


def assert_same_ir(text_mod: ir.Module, proto_mod: ir.Module, skip_attr=None) -> None:
  diffs = _differences(text_mod, proto_mod, skip_attr)
  assert not diffs, "text and proto paths differ:\n  " + "\n  ".join(d[:600] for d in diffs[:12])


def _ops(mod: ir.Module, name: str) -> list[ir.Op]:
  return [op for op in mod.main.walk() if op.name == name]


def _all_ops(mod: ir.Module) -> list[ir.Op]:
  return [op for g in mod.functions.values() for op in g.walk()]


# --------------------------------------------------------------------------- same IR

@pytest.mark.parametrize("case,pattern", [
    ("mlp", BEFORE), ("mlp", BEFORE_SPMD), ("mlp", AFTER_SPMD),
    ("grid_dp", BEFORE), ("grid_dp", AFTER_SPMD), ("grid_iota", AFTER_SPMD),
    ("shard_map", BEFORE), ("shard_map", BEFORE_SPMD), ("shard_map", AFTER_SPMD),
    ("scan", BEFORE), ("cond", BEFORE), ("reduce", BEFORE), ("constants", BEFORE),
    ("softmax", BEFORE), ("softmax", AFTER_SPMD),
    ("slices", BEFORE), ("slices", BEFORE_SPMD), ("slices", AFTER_SPMD),
])
def test_text_and_proto_give_the_same_ir(dumps, case, pattern):
  text_mod, proto_mod = _load_pair(dumps[case], pattern)
  assert text_mod.format == "hlo_text"
  assert_same_ir(text_mod, proto_mod)


def test_mlp(dumps):
  text_mod, proto_mod = _load_pair(dumps["mlp"], AFTER_SPMD)
  main = text_mod.main
  assert text_mod.entry == "main" and text_mod.num_partitions == 4
  assert [a["mhlo.sharding"] for a in main.param_attrs] == [
      "{replicated}", "{devices=[1,4]<=[4]}", "{devices=[4,1]<=[4]}"]
  assert text_mod.attrs["mhlo.spmd_parameters_shardings"] == tuple(
      a["mhlo.sharding"] for a in main.param_attrs)
  assert [op.name for op in main.ops] == ["dot_general", "tanh", "dot_general", "all_reduce"]
  dot = main.ops[0]
  assert dot.attrs == {"lhs_batch": (), "rhs_batch": (), "lhs_contract": (1,),
                       "rhs_contract": (0,)}
  assert [p.type.shape for p in main.params] == [(8, 16), (16, 8), (8, 16)]
  ar = main.ops[3]
  # mesh['axis_0'=1,'axis_1'=4] {'axis_1'}: one group of all four devices.
  assert ar.attrs["replica_groups"] == ((0, 1, 2, 3),)
  assert ar.attrs["use_global_device_ids"] is True and ar.attrs["channel_handle"] == 1
  assert [o.name for o in ar.regions[0].ops] == ["add"] and len(ar.regions[0].params) == 2
  assert text_mod.meshes == proto_mod.meshes
  # The ROOT all-reduce has no sharding: the output sharding is not in the text.
  assert "mhlo.spmd_output_sharding" in proto_mod.attrs
  assert "mhlo.spmd_output_sharding" not in text_mod.attrs


def test_locations_are_the_users_source_lines(dumps):
  text_mod, _ = _load_pair(dumps["mlp"], BEFORE)
  here = os.path.basename(__file__)
  line_h, line_out = _line(_mlp, "jnp.tanh(x @ w1)"), _line(_mlp, "return h @ w2")
  dot1, tanh, dot2 = text_mod.main.ops
  for op, line in ((dot1, line_h), (tanh, line_h), (dot2, line_out)):
    assert os.path.basename(op.location.file) == here, op.location
    assert op.location.line == line, (op, op.location)
    assert op.location.op_name.startswith("jit(_mlp)/")
  assert dot1.location.column != tanh.location.column   # x @ w1 sits inside tanh(...)
  assert [loc.op_name for loc in text_mod.main.param_locations] == ["x", "w1", "w2"]
  assert all(loc.file is None for loc in text_mod.main.param_locations)


def test_mesh_replica_groups_over_one_axis(dumps):
  # dp x tp = [[0,1,2,3],[4,5,6,7]]; summing rows sharded over dp all-reduces over dp.
  text_mod, _ = _load_pair(dumps["grid_dp"], AFTER_SPMD)
  (ar,) = _ops(text_mod, "all_reduce")
  assert ar.attrs["replica_groups"] == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert text_mod.num_partitions == 8
  # The iota form [4,2]<=[2,4]T(1,0) of the same groups.
  text_mod, _ = _load_pair(dumps["grid_iota"], AFTER_SPMD)
  (ar,) = _ops(text_mod, "all_reduce")
  assert ar.attrs["replica_groups"] == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_mesh_with_device_order(dumps):
  """``mesh[...], device_ids=([2,4]T(1,0)) {'axis_1'}``: groups follow the device order.

  XLA's converter drops the device order, so the proto path reads other groups;
  everything else must still be the same.
  """
  text_mod, proto_mod = _load_pair(dumps["grid_tp"], AFTER_SPMD)
  (ar,) = _ops(text_mod, "all_reduce")
  assert ar.attrs["replica_groups"] == ((0, 1, 2, 3), (4, 5, 6, 7))  # the tp rows
  with open(_dump_file(dumps["grid_tp"], AFTER_SPMD)) as f:
    if "device_ids=" in f.read():
      (mesh,) = text_mod.meshes.values()
      assert mesh.device_ids == (0, 4, 1, 5, 2, 6, 3, 7)
  assert_same_ir(text_mod, proto_mod, skip_attr=lambda op, a, v: a == "replica_groups")


def test_shard_map_collectives(dumps):
  text_mod, _ = _load_pair(dumps["shard_map"], AFTER_SPMD)
  body = next(g for name, g in text_mod.functions.items() if "manual_computation" in name)
  by_name = {op.name: op for op in body.ops}
  tp_rows = ((0, 1, 2, 3), (4, 5, 6, 7))
  assert by_name["all_reduce"].attrs["replica_groups"] == tp_rows
  assert by_name["all_gather"].attrs["all_gather_dimension"] == 0
  assert by_name["reduce_scatter"].attrs["scatter_dimension"] == 0
  assert len(by_name["reduce_scatter"].regions) == 1
  assert by_name["collective_permute"].attrs["source_target_pairs"] == (
      (0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4))
  a2a = by_name["all_to_all"].attrs
  assert (a2a["split_dimension"], a2a["concat_dimension"], a2a["split_count"]) == (0, 0, 4)
  # main calls the body by name; the body is a function of its own.
  (call,) = _ops(text_mod, "call")
  assert call.attrs["callee"] == "@" + body.name
  assert len(call.results) == 5 and not call.regions


def test_scan_is_a_while_over_flattened_state(dumps):
  text_mod, _ = _load_pair(dumps["scan"], BEFORE)
  (loop,) = [op for op in text_mod.main.ops if op.name == "while"]
  assert len(loop.operands) == len(loop.results) == 4
  cond, body = loop.regions
  assert (cond.name, body.name) == ("while.r0", "while.r1")
  assert len(cond.params) == len(body.params) == 4 and len(body.results) == 4
  assert [r.type for r in cond.results] == [ir.TensorType((), "pred")]
  assert not any(op.name in ("tuple", "get_tuple_element") for op in _all_ops(text_mod))
  assert len(text_mod.main.results) == 2


def test_cond_is_a_case(dumps):
  text_mod, _ = _load_pair(dumps["cond"], BEFORE)
  (case,) = _ops(text_mod, "case")
  assert [r.name for r in case.regions] == ["case.r0", "case.r1"]
  assert all(not r.params for r in case.regions)   # branches read the operand directly
  assert case.operands[0].type == ir.TensorType((), "i32")
  x = text_mod.main.params[1]
  assert x in case.regions[1].ops[0].operands        # sine(x)


def test_reduce(dumps):
  text_mod, _ = _load_pair(dumps["reduce"], BEFORE)
  sums = [op for op in text_mod.main.ops if op.name == "reduce"]
  assert [op.attrs["dimensions"] for op in sums] == [(1,), (0,)]
  assert [op.regions[0].ops[0].name for op in sums] == ["add", "maximum"]
  argmax = text_mod.functions[next(n for n in text_mod.functions if n.startswith("argmax"))]
  (variadic,) = [op for op in argmax.ops if op.name == "reduce"]
  assert len(variadic.operands) == 4 and len(variadic.results) == 2
  assert len(variadic.regions[0].params) == 4


def test_constants(dumps):
  text_mod, _ = _load_pair(dumps["constants"], BEFORE)
  values = [op.attrs["value"] for op in text_mod.main.ops if op.name == "constant"]
  assert all(isinstance(v, np.ndarray) and not v.flags.writeable for v in values)
  assert all(hash(v) == hash(v.copy().view(type(v))) for v in values)
  scalar = next(v for v in values if v.shape == () and float(v) == 2.5)
  assert scalar.dtype == np.float64          # splats come back as one Python scalar
  table = next(v for v in values if v.shape == (4, 4))
  assert table.dtype == np.float32 and table.tolist() == [[1., 2., 3., 4.]] * 4
  ints = next(v for v in values if v.shape == (4,) and v.dtype == np.int32)
  assert ints.tolist() == [7, -1, 0, 2**31 - 1]
  bf16 = next(v for v in values if v.shape == (4,) and v.dtype == np.float64)
  assert bf16.tolist() == [1.0, 2.0, 3.0, 4.0]
  pred = next(v for v in values if v.dtype == np.bool_)
  assert pred.tolist() == [True, False, True, True]
  iotas = _ops(text_mod, "iota")
  assert iotas and all(op.attrs == {"iota_dimension": 0} for op in iotas)


def test_elided_constants(dumps):
  text_mod, proto_mod = _load_pair(dumps["constants_elided"], BEFORE)
  elided = [op for op in text_mod.main.ops
            if op.name == "constant" and isinstance(op.attrs["value"], ElidedConstant)]
  assert len(elided) == 1 and elided[0].results[0].type.shape == (4, 4)
  value = elided[0].attrs["value"]
  assert value == value and value != ElidedConstant(value.name, value.shape, value.dtype)
  with pytest.raises(InputError, match="xla_dump_large_constants"):
    np.asarray(value)
  # Everything else is as in the proto.
  assert_same_ir(text_mod, proto_mod,
                 skip_attr=lambda op, a, v: op.name == "constant" and op.results[0].type.rank == 2)


def test_partition_id_arithmetic(dumps):
  # GSPMD's halo exchange for a resharded slice indexes tables by partition-id.
  text_mod, _ = _load_pair(dumps["slices"], AFTER_SPMD)
  (pid,) = _ops(text_mod, "partition_id")
  assert pid.results[0].type == ir.TensorType((), "ui32")
  users = [op for op in text_mod.main.ops if pid.results[0] in op.operands]
  assert users and users[0].name == "dynamic_slice" and users[0].attrs == {"slice_sizes": (1,)}
  assert users[0].operands[0].producer.name == "constant"
  assert _ops(text_mod, "collective_permute") and _ops(text_mod, "all_to_all")


def test_softmax(dumps):
  text_mod, _ = _load_pair(dumps["softmax"], AFTER_SPMD)
  names = [op.name for op in text_mod.main.ops]
  for want in ("reduce", "maximum", "subtract", "exponential", "divide", "broadcast_in_dim"):
    assert want in names
  bcast = next(op for op in text_mod.main.ops if op.name == "broadcast_in_dim"
               and op.operands[0].type.rank == 1)
  assert bcast.attrs == {"broadcast_dimensions": (0,)}


def test_load_module_dispatches_text(dumps):
  path = _dump_file(dumps["mlp"], BEFORE)
  mod = load_module(path)
  assert mod.format == "hlo_text" and [op.name for op in mod.main.ops][1] == "tanh"


# --------------------------------------------------------------------------- handwritten HLO

_HANDWRITTEN = """\
HloModule m, num_partitions=4

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT add = f32[] add(x, y)
}

ENTRY main {
  p = f32[8] parameter(0), sharding={devices=[4]<=[4]}
  c = f32[8] constant({1, 2, 3, 4, 5, 6, 7, 8})
  s = f32[8] add(p, c)
  t = (f32[8], f32[8]) tuple(s, p)
  g = f32[8] get-tuple-element(t), index=1
  a = f32[8] all-reduce(g), replica_groups={{0,1},{2,3}}, to_apply=add
  b = f32[8] all-reduce(a), replica_groups=[2,2]<=[4], to_apply=add
  d = f32[8] all-reduce(b), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=add
  e = f32[8] all-reduce(d), replica_groups=mesh['x'=2,'y'=2] {'x'}, to_apply=add
  f = f32[8] all-reduce(e), replica_groups=mesh['x'=4] {'x':(1)2}, to_apply=add
  h = f32[8] all-reduce(f), replica_groups=mesh['x'=4] {'x':(2)2}, to_apply=add
  ROOT r = f32[8] frobnicate(h, s), knob={1,2}, label="hi"
}
"""


def test_handwritten_hlo():
  mod = load_hlo_text("m.hlo", _HANDWRITTEN)
  assert mod.num_partitions == 4 and set(mod.functions) == {"main", "add"}
  groups = [op.attrs["replica_groups"] for op in _ops(mod, "all_reduce")]
  # Explicit, iota, transposed iota, mesh axis, and the major / minor halves of an
  # axis of 4 (sub-axes "x":(1)2 and "x":(2)2).
  assert groups == [((0, 1), (2, 3)), ((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 2), (1, 3)),
                    ((0, 2), (1, 3)), ((0, 1), (2, 3))]
  (first,) = [op for op in mod.main.ops if op.name == "all_reduce"][:1]
  assert first.operands == [mod.main.params[0]]        # get-tuple-element of a tuple folds
  assert not _ops(mod, "tuple") and not _ops(mod, "get_tuple_element")
  (opaque,) = _ops(mod, "frobnicate")                  # unknown ops are kept, opaque
  assert opaque.attrs == {"knob": "{1,2}", "label": "hi"}
  assert mod.main.param_attrs == [{"mhlo.sharding": "{devices=[4]<=[4]}"}]


def test_instruction_order_need_not_be_topological():
  text = ("HloModule m\n\nENTRY e {\n  ROOT r = f32[2] add(a, b)\n  b = f32[2] negate(a)\n"
          "  a = f32[2] parameter(0)\n}\n")
  mod = load_hlo_text("m.hlo", text)
  assert [op.name for op in mod.main.ops] == ["negate", "add"]


# --------------------------------------------------------------------------- via XlaComputation

# StableHLO snippets for what JAX programs rarely emit.  XLA turns each into an HLO
# module, printed in the short form (no '%', no signatures, no metadata) and
# serialized as a proto, and both must load into the same IR.
_STABLEHLO = {
    "if": """
func.func @main(%p: tensor<i1>, %x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = "stablehlo.if"(%p) ({
    %1 = stablehlo.sine %x : tensor<4xf32>
    stablehlo.return %1 : tensor<4xf32>
  }, {
    %2 = stablehlo.cosine %x : tensor<4xf32>
    stablehlo.return %2 : tensor<4xf32>
  }) : (tensor<i1>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}""",
    "while": """
func.func @main(%x: tensor<4xf32>, %n: tensor<i32>) -> tensor<4xf32> {
  %0:2 = stablehlo.while(%a = %x, %b = %n) : tensor<4xf32>, tensor<i32>
   cond {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %p = stablehlo.compare GT, %b, %c : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  } do {
    %one = stablehlo.constant dense<1> : tensor<i32>
    %m = stablehlo.subtract %b, %one : tensor<i32>
    %y = stablehlo.sine %a : tensor<4xf32>
    stablehlo.return %y, %m : tensor<4xf32>, tensor<i32>
  }
  return %0#0 : tensor<4xf32>
}""",
    "pred_convert_and_add": """
func.func @main(%x: tensor<4xf32>, %y: tensor<4xi1>) -> (tensor<4xi1>, tensor<4xi1>, tensor<4xi1>) {
  %0 = stablehlo.convert %x : (tensor<4xf32>) -> tensor<4xi1>
  %1 = stablehlo.add %y, %y : tensor<4xi1>
  %2 = stablehlo.compare LT, %x, %x, TOTALORDER : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xi1>
  return %0, %1, %2 : tensor<4xi1>, tensor<4xi1>, tensor<4xi1>
}""",
    "tokens_and_tuples": """
func.func @main(%x: tensor<4xf32>, %t: !stablehlo.token) -> (tensor<4xf32>, tensor<i32>, !stablehlo.token) {
  %0 = stablehlo.after_all %t, %t : !stablehlo.token
  %1 = stablehlo.tuple %x, %x : tuple<tensor<4xf32>, tensor<4xf32>>
  %2 = stablehlo.custom_call @bar(%1, %0) {backend_config = "cfg", has_side_effect = true} : (tuple<tensor<4xf32>, tensor<4xf32>>, !stablehlo.token) -> tuple<tensor<4xf32>, tensor<i32>>
  %3 = stablehlo.get_tuple_element %2[0] : (tuple<tensor<4xf32>, tensor<i32>>) -> tensor<4xf32>
  %4 = stablehlo.get_tuple_element %2[1] : (tuple<tensor<4xf32>, tensor<i32>>) -> tensor<i32>
  %5, %6 = stablehlo.optimization_barrier %3, %4 : tensor<4xf32>, tensor<i32>
  return %5, %6, %0 : tensor<4xf32>, tensor<i32>, !stablehlo.token
}""",
    "linear_algebra": """
func.func @main(%x: tensor<4x4xf32>, %i: tensor<4xi32>, %s: tensor<2xui64>) -> (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4xi32>, tensor<4x4xf32>, tensor<4x4xf32>, tensor<4xui32>) {
  %0 = stablehlo.reduce_precision %x, format = e5m10 : tensor<4x4xf32>
  %1 = "stablehlo.triangular_solve"(%x, %x) {left_side = true, lower = true, unit_diagonal = false, transpose_a = #stablehlo<transpose NO_TRANSPOSE>} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %2 = stablehlo.clamp %i, %i, %i : tensor<4xi32>
  %3 = stablehlo.cholesky %x, lower = true : tensor<4x4xf32>
  %4 = stablehlo.logistic %x : tensor<4x4xf32>
  %5, %6 = stablehlo.rng_bit_generator %s, algorithm = THREE_FRY : (tensor<2xui64>) -> (tensor<2xui64>, tensor<4xui32>)
  return %0, %1, %2, %3, %4, %6 : tensor<4x4xf32>, tensor<4x4xf32>, tensor<4xi32>, tensor<4x4xf32>, tensor<4x4xf32>, tensor<4xui32>
}""",
    "map_and_select_and_scatter": """
func.func @main(%x: tensor<4x4xf32>, %s: tensor<2x2xf32>, %z: tensor<f32>) -> (tensor<4x4xf32>, tensor<4x4xf32>) {
  %0 = "stablehlo.map"(%x, %x) ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %r = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %r : tensor<f32>
  }) {dimensions = array<i64: 0, 1>} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %1 = "stablehlo.select_and_scatter"(%x, %s, %z) ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %c = stablehlo.compare GE, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
    stablehlo.return %c : tensor<i1>
  }, {
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %r = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %r : tensor<f32>
  }) {window_dimensions = array<i64: 2, 2>, window_strides = array<i64: 2, 2>} : (tensor<4x4xf32>, tensor<2x2xf32>, tensor<f32>) -> tensor<4x4xf32>
  return %0, %1 : tensor<4x4xf32>, tensor<4x4xf32>
}""",
    "fft_and_batch_norm": """
func.func @main(%x: tensor<4x8xcomplex<f32>>, %y: tensor<2x3x4xf32>, %s: tensor<4xf32>) -> (tensor<4x8xcomplex<f32>>, tensor<2x3x4xf32>, tensor<4xf32>, tensor<4xf32>) {
  %0 = stablehlo.fft %x, type = FFT, length = [8] : (tensor<4x8xcomplex<f32>>) -> tensor<4x8xcomplex<f32>>
  %1, %2, %3 = "stablehlo.batch_norm_training"(%y, %s, %s) {epsilon = 1.0e-03 : f32, feature_index = 2 : i64} : (tensor<2x3x4xf32>, tensor<4xf32>, tensor<4xf32>) -> (tensor<2x3x4xf32>, tensor<4xf32>, tensor<4xf32>)
  return %0, %1, %2, %3 : tensor<4x8xcomplex<f32>>, tensor<2x3x4xf32>, tensor<4xf32>, tensor<4xf32>
}""",
    "variadic_collectives": """
func.func @main(%x: tensor<4xf32>, %y: tensor<2xf32>) -> (tensor<4xf32>, tensor<2xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) {
  %0:2 = "stablehlo.all_reduce"(%x, %y) ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>):
    %r = stablehlo.add %a, %b : tensor<f32>
    stablehlo.return %r : tensor<f32>
  }) {replica_groups = dense<> : tensor<0x0xi64>} : (tensor<4xf32>, tensor<2xf32>) -> (tensor<4xf32>, tensor<2xf32>)
  %1:2 = "stablehlo.all_to_all"(%x, %x) {split_dimension = 0 : i64, concat_dimension = 0 : i64, split_count = 2 : i64, replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<4xf32>, tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>)
  %2 = "stablehlo.collective_broadcast"(%x) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>} : (tensor<4xf32>) -> tensor<4xf32>
  return %0#0, %0#1, %1#0, %1#1, %2 : tensor<4xf32>, tensor<2xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>
}""",
    "composite_and_sort": """
func.func @main(%x: tensor<4xf32>, %y: tensor<4xi32>) -> (tensor<4xf32>, tensor<4xf32>, tensor<4xi32>) {
  %0 = stablehlo.composite "my.op" %x {composite_attributes = {alpha = 2.0 : f32, n = 3 : i64, s = "x"}, decomposition = @my_op_impl, version = 1 : i32} : (tensor<4xf32>) -> tensor<4xf32>
  %1:2 = "stablehlo.sort"(%x, %y) ({
  ^bb0(%a: tensor<f32>, %b: tensor<f32>, %c: tensor<i32>, %d: tensor<i32>):
    %p = stablehlo.compare LT, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
  }) {dimension = 0 : i64, is_stable = true} : (tensor<4xf32>, tensor<4xi32>) -> (tensor<4xf32>, tensor<4xi32>)
  return %0, %1#0, %1#1 : tensor<4xf32>, tensor<4xf32>, tensor<4xi32>
}
func.func private @my_op_impl(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.sine %x : tensor<4xf32>
  return %0 : tensor<4xf32>
}""",
    "constants": """
func.func @main() -> (tensor<3xf16>, tensor<2xui64>, tensor<2xi4>, tensor<2x2xbf16>, tensor<3xf32>) {
  %0 = stablehlo.constant dense<[1.5, -0.0, 65504.0]> : tensor<3xf16>
  %1 = stablehlo.constant dense<[18446744073709551615, 0]> : tensor<2xui64>
  %2 = stablehlo.constant dense<[-8, 7]> : tensor<2xi4>
  %3 = stablehlo.constant dense<[[1.0, 2.5], [-3.0, 0.5]]> : tensor<2x2xbf16>
  %4 = stablehlo.constant dense<[0x7F800000, 0xFF800000, 1.0e-30]> : tensor<3xf32>
  return %0, %1, %2, %3, %4 : tensor<3xf16>, tensor<2xui64>, tensor<2xi4>, tensor<2x2xbf16>, tensor<3xf32>
}""",
}


@pytest.mark.parametrize("name", sorted(_STABLEHLO))
def test_xla_computations(name):
  try:
    from jax._src.lib import xla_client
    to_hlo = xla_client._xla.mlir.mlir_module_to_xla_computation
  except (ImportError, AttributeError):
    pytest.skip("this jaxlib cannot turn StableHLO into an XlaComputation")
  comp = to_hlo(_STABLEHLO[name], use_tuple_args=False, return_tuple=False)
  text = comp.as_hlo_text()
  text_mod = load_hlo_text(f"{name}.txt", text)
  proto_mod = hlo_proto.load_hlo_proto_via_converter(
      f"{name}.pb", comp.as_serialized_hlo_module_proto())
  assert_same_ir(text_mod, proto_mod)


# --------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def mlp_text(dumps):
  with open(_dump_file(dumps["mlp"], AFTER_SPMD)) as f:
    return f.read()


def _error(text: str) -> InputError:
  with pytest.raises(InputError) as info:
    load_hlo_text("bad.txt", text)
  err = info.value
  assert "\n" not in str(err) and str(err).startswith("bad.txt:")
  return err


def _line_of(text: str, needle: str) -> int:
  return text[:text.index(needle)].count("\n") + 1


def test_truncated_file(mlp_text):
  cut = mlp_text.index("tanh(%dot)") + 4
  err = _error(mlp_text[:cut])
  assert err.line == _line_of(mlp_text, "tanh(%dot)") and "end of file" in err.message
  unclosed = mlp_text.rstrip().rstrip("}")
  err = _error(unclosed)
  assert "not closed" in err.message and err.line == unclosed.rstrip().count("\n") + 1


def test_garbage_line(mlp_text):
  text = mlp_text.replace("  %tanh.2 =", "  this is ~ not HLO\n  %tanh.2 =", 1)
  err = _error(text)
  assert err.line == _line_of(text, "this is ~") and err.column is not None


def test_undefined_operand(mlp_text):
  text = mlp_text.replace("tanh(%dot)", "tanh(%nowhere)")
  err = _error(text)
  assert err.line == _line_of(text, "%nowhere")
  assert "%nowhere" in err.message and "not defined" in err.message


def test_shape_mismatch(mlp_text):
  text = mlp_text.replace("%tanh.2 = f32[8,8]{1,0}", "%tanh.2 = f32[8,9]{1,0}")
  err = _error(text)
  assert err.line == _line_of(text, "%tanh.2 =") and "f32[8,9]" in err.message


@pytest.mark.parametrize("old,new,needle", [
    ("to_apply=%add.clone", "to_apply=%nope", "%nope is not defined"),
    ("f32[8,16]{1,0} parameter(0)", "q32[8,16]{1,0} parameter(0)", "expected a shape"),
    ('op_name="w1"', 'op_name="w1', "unterminated string"),
    ("lhs_contracting_dims={1}", "lhs_contracting_dims={0}", "contracting dimensions"),
    ("%tanh.2 = f32", "%dot = f32", "defined twice"),
    ("tanh(%dot)", "tanh(%dot.1)", "cycle"),
])
def test_other_mistakes(mlp_text, old, new, needle):
  assert old in mlp_text
  err = _error(mlp_text.replace(old, new, 1))
  assert needle in err.message and err.line is not None


def test_unknown_opcode_is_opaque(mlp_text):
  mod = load_hlo_text("x.txt", mlp_text.replace("tanh(%dot)", "frobnicate(%dot)"))
  assert [op.name for op in mod.main.ops] == ["dot_general", "frobnicate", "dot_general",
                                              "all_reduce"]


def test_not_an_hlo_module():
  assert "HloModule" in _error("ENTRY %e { ROOT %c = f32[] constant(1) }").message
  assert "end of file" in _error("").message


try:
  import hypothesis
  from hypothesis import strategies as st
except ImportError:   # the fuzz test needs it; the others do not
  hypothesis = None

_SNIPPETS = ["{", "}", "(", ")", "[", "]", ",", "=", "%", '"', "'", "\n", "ROOT ", "tuple",
             "get-tuple-element", "{...}", "-1", "99999999999999999999999", "/*", "<=", "->",
             "f32[", "(f32[], s32[])", "mesh['a'=2]", "x", "0", "T(1,0)"]


def _fuzz_once(dumps, data):
  name = data.draw(st.sampled_from(["mlp", "scan", "shard_map", "grid_tp"]), label="dump")
  pattern = BEFORE if name == "scan" else AFTER_SPMD
  with open(_dump_file(dumps[name], pattern)) as f:
    text = f.read()
  for _ in range(data.draw(st.integers(1, 3), label="edits")):
    at = data.draw(st.integers(0, len(text)), label="at")
    kind = data.draw(st.sampled_from(["cut", "drop", "insert", "digit", "swap"]), label="kind")
    if kind == "cut":
      text = text[:at]
    elif kind == "drop":
      text = text[:at] + text[at + data.draw(st.integers(1, 30), label="n"):]
    elif kind == "insert":
      text = text[:at] + data.draw(st.sampled_from(_SNIPPETS), label="s") + text[at:]
    elif kind == "digit":
      digits = [k for k, ch in enumerate(text) if ch.isdigit()]
      if digits:
        k = data.draw(st.sampled_from(digits), label="d")
        text = text[:k] + data.draw(st.sampled_from("0123456789"), label="v") + text[k + 1:]
    else:
      lines = text.split("\n")
      a = data.draw(st.integers(0, len(lines) - 1), label="a")
      b = data.draw(st.integers(0, len(lines) - 1), label="b")
      lines[a], lines[b] = lines[b], lines[a]
      text = "\n".join(lines)
  try:
    load_hlo_text("fuzz.txt", text)
  except InputError as e:
    assert "\n" not in str(e)


if hypothesis is not None:
  @hypothesis.settings(max_examples=150, deadline=None, database=None,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(data=st.data())
  def test_fuzzed_dumps_give_input_errors_only(dumps, data):
    """Truncated and mutated dumps load or raise InputError, nothing else."""
    _fuzz_once(dumps, data)
else:
  def test_fuzzed_dumps_give_input_errors_only():
    pytest.skip("hypothesis is not installed")


@pytest.mark.parametrize("dtype,literal,bits", [
    ("f32", "nan(0x400001)", 0x7FC00001), ("f32", "-nan(0x1)", 0xFF800001),
    ("f32", "nan", 0x7FC00000), ("f16", "nan(0x201)", 0x7E01), ("f64", "nan(0x8000000000001)",
                                                                 0x7FF8000000000001)])
def test_nan_payloads_are_read_bit_for_bit(dtype, literal, bits):
  # A NaN read as the canonical one would make two different constants one.
  text = (f"HloModule m\n\nENTRY e {{\n  c = {dtype}[2] constant({{0, {literal}}})\n"
          f"  ROOT r = {dtype}[2] negate(c)\n}}\n")
  (value,) = [np.asarray(op.attrs["value"]) for op in load_hlo_text("x.txt", text).main.ops
              if op.name == "constant"]
  width = value.dtype.itemsize
  assert value.view(f"u{width}")[1] == bits


def test_nan_payload_of_an_f8_constant_is_an_error():
  err = _error("HloModule m\n\nENTRY e {\n  ROOT c = f8e5m2[2] constant({0, nan(0x1)})\n}\n")
  assert "NaN payloads of f8e5m2 constants are not read" in err.message
