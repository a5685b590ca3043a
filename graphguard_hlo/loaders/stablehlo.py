"""Loads StableHLO (MLIR text or bytecode) into the graph IR with jaxlib.mlir."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError

# Ops whose only job is to end a region: their operands are the region's results.
_TERMINATORS = {"func.return", "stablehlo.return", "sdy.return", "mhlo.return"}

_LOC_FILE_LINE = re.compile(r'"([^"]+)":(\d+):(\d+)')
_LOC_NAME = re.compile(r'loc\("((?:[^"\\]|\\.)*)"[\(\)]')


def mlir_context():
  """An MLIR context with every dialect JAX emits (stablehlo, sdy, mhlo, func)."""
  from jax._src.interpreters import mlir as jax_mlir  # heavy: import on use
  return jax_mlir.make_ir_context()


def parse_location(loc_text: str) -> ir.Location:
  """The innermost user file:line of an MLIR location and its op name, if any."""
  m = _LOC_FILE_LINE.search(loc_text)
  names = [n for n in _LOC_NAME.findall(loc_text) if not _LOC_FILE_LINE.match(f'"{n}"')]
  op_name = names[0] if names else None
  if m is None:
    return ir.Location(op_name=op_name)
  return ir.Location(m.group(1), int(m.group(2)), int(m.group(3)), op_name)


def load_stablehlo(path: str, data: bytes | str, fmt: str = "stablehlo") -> ir.Module:
  from jaxlib.mlir import ir as mlir_ir
  ctx = mlir_context()
  with ctx, mlir_ir.Location.unknown():
    try:
      mod = mlir_ir.Module.parse(data)
    except mlir_ir.MLIRError as e:
      raise _mlir_error(path, e) from None
    except Exception as e:  # bindings raise ValueError for bytecode garbage
      raise InputError(path, f"not a valid StableHLO module: {str(e).splitlines()[0]}") from None
    try:
      return _Importer(path, fmt).run(mod)
    except InputError as e:
      if e.path is None:  # raised deep in type conversion: name the file
        raise InputError(path, e.message, e.line, e.column) from None
      raise


def _mlir_error(path: str, e: Exception) -> InputError:
  diags = getattr(e, "error_diagnostics", None) or []
  for d in diags:
    m = re.search(r":(\d+):(\d+)", str(d.location))
    if m:
      return InputError(path, d.message, int(m.group(1)), int(m.group(2)))
  first = str(e).strip().splitlines()
  return InputError(path, f"cannot parse MLIR: {first[-1] if first else e}")


class _Importer:
  def __init__(self, path: str, fmt: str):
    self.module = ir.Module(path, fmt)
    self.values: dict[Any, ir.Value] = {}

  def run(self, mod) -> ir.Module:
    m = self.module
    top = mod.operation
    m.attrs.update(_attr_map(top.attributes))
    m.name = str(m.attrs.get("sym_name", "")).strip('"')
    m.num_partitions = int(m.attrs.get("mhlo.num_partitions", 1) or 1)
    funcs = []
    for op in mod.body.operations:
      name = op.operation.name
      if name == "sdy.mesh":
        self._import_mesh(op)
      elif name == "func.func":
        funcs.append(op)
    if not funcs:
      raise InputError(m.path, "module has no func.func: not a StableHLO program")
    for f in funcs:
      g = self._import_func(f)
      m.functions[g.name] = g
    if "main" not in m.functions:
      publics = [f for f in funcs if "sym_visibility" not in f.attributes
                 or str(f.attributes["sym_visibility"]).strip('"') == "public"]
      m.entry = _sym_name(publics[0] if publics else funcs[0])
    if m.meshes and m.num_partitions == 1:
      m.num_partitions = max(mesh.size for mesh in m.meshes.values())
    return m

  def _import_mesh(self, op) -> None:
    from jaxlib.mlir.dialects import sdy
    attrs = op.operation.attributes
    mesh = sdy.MeshAttr(attrs["mesh"])
    axes = tuple((a.name, int(a.size)) for a in (sdy.MeshAxisAttr(x) for x in mesh.axes))
    ids = tuple(int(i) for i in mesh.device_ids) or None
    self.module.meshes[_sym_name(op)] = ir.Mesh(axes, ids)

  def _import_func(self, f) -> ir.Graph:
    g = ir.Graph(_sym_name(f))
    block = f.regions[0].blocks[0]
    arg_attrs = f.attributes["arg_attrs"] if "arg_attrs" in f.attributes else None
    res_attrs = f.attributes["res_attrs"] if "res_attrs" in f.attributes else None
    for i, arg in enumerate(block.arguments):
      v = self.module.new_value(_tensor_type(arg.type), name=f"arg{i}")
      self.values[arg] = v
      g.params.append(v)
      g.param_attrs.append(_dict_attr(arg_attrs[i]) if arg_attrs is not None else {})
      g.param_locations.append(parse_location(str(arg.location)))
    self._import_block(block, g)
    n_res = len(g.results)
    for i in range(n_res):
      g.result_attrs.append(_dict_attr(res_attrs[i]) if res_attrs is not None else {})
    return g

  def _import_region(self, region, name: str) -> ir.Graph:
    g = ir.Graph(name)
    if not region.blocks:
      return g
    block = region.blocks[0]
    for i, arg in enumerate(block.arguments):
      v = self.module.new_value(_tensor_type(arg.type), name=f"{name}.arg{i}")
      self.values[arg] = v
      g.params.append(v)
      g.param_attrs.append({})
      g.param_locations.append(ir.UNKNOWN_LOCATION)
    self._import_block(block, g)
    return g

  def _import_block(self, block, g: ir.Graph) -> None:
    for mop in block.operations:
      op = mop.operation
      full = op.name
      operands = [self.values[v] for v in op.operands]
      if full in _TERMINATORS:
        g.results = operands
        continue
      # mhlo ops left by XLA's converter (mhlo.copy, ...) go by their plain names.
      name = full.removeprefix("stablehlo.").removeprefix("func.").removeprefix("mhlo.")
      if name == "constant" and "complex<" in str(op.results[0].type):
        # Reading a complex elements attribute aborts the process inside the
        # bindings (a C++ exception no Python handler sees): read its text.
        shape = _tensor_type(op.results[0].type).shape
        attrs = {"value": ir.ConstantArray(_complex_value(str(op), shape))}
      else:
        attrs = _attr_map(op.attributes)
      regions = [self._import_region(r, f"{name}.r{i}") for i, r in enumerate(op.regions)]
      name, attrs = _canonicalize(name, attrs, operands, self.module)
      res_types = [_tensor_type(r.type) for r in op.results]
      new = self.module.add_op(g, name, operands, res_types, attrs, regions,
                               parse_location(str(op.location)))
      for r, v in zip(op.results, new.results):
        self.values[r] = v


def _attr_map(attributes) -> dict[str, Any]:
  named = [attributes[i] for i in range(len(attributes))]
  return {a.name: _convert_attr(a.attr, a.name) for a in named}


def _sym_name(op) -> str:
  return str(op.operation.attributes["sym_name"]).strip('"')


def _dict_attr(d) -> dict[str, Any]:
  from jaxlib.mlir import ir as mlir_ir
  d = mlir_ir.DictAttr(d)
  return {d[i].name: _convert_attr(d[i].attr, d[i].name) for i in range(len(d))}


_DTYPE_RE = re.compile(r"^(?:tensor<(?:(?:\d+|\?)x)*)?([a-z]+\d*(?:E\d+M\d+\w*)?)>?$")


def _tensor_type(t) -> ir.TensorType:
  from jaxlib.mlir import ir as mlir_ir
  if isinstance(t, mlir_ir.RankedTensorType):
    rt = mlir_ir.RankedTensorType(t)
    shape = tuple(int(d) for d in rt.shape)
    if any(d < 0 for d in shape):
      raise InputError(None, f"dynamic shape {t} is not supported")
    return ir.TensorType(shape, _dtype_name(rt.element_type))
  text = str(t)
  if "token" in text:
    return ir.TensorType((), "token")
  if text.startswith("tuple"):
    return ir.TensorType((), "tuple")
  return ir.TensorType((), text)


def _dtype_name(et) -> str:
  s = str(et)
  return {"i1": "pred", "index": "i64"}.get(s, s)


def _convert_attr(attr, name: str = "") -> Any:
  """An MLIR attribute as a plain hashable Python value (or its text)."""
  from jaxlib.mlir import ir as mlir_ir
  from jaxlib.mlir.dialects import sdy, stablehlo
  if isinstance(attr, mlir_ir.BoolAttr):
    return bool(mlir_ir.BoolAttr(attr).value)
  if isinstance(attr, mlir_ir.IntegerAttr):
    return int(mlir_ir.IntegerAttr(attr).value)
  if isinstance(attr, mlir_ir.FloatAttr):
    return float(mlir_ir.FloatAttr(attr).value)
  if isinstance(attr, mlir_ir.StringAttr):
    return mlir_ir.StringAttr(attr).value
  if isinstance(attr, mlir_ir.UnitAttr):
    return True
  if isinstance(attr, mlir_ir.DenseI64ArrayAttr):
    return tuple(int(x) for x in mlir_ir.DenseI64ArrayAttr(attr))
  if isinstance(attr, mlir_ir.DenseBoolArrayAttr):
    return tuple(bool(x) for x in mlir_ir.DenseBoolArrayAttr(attr))
  if isinstance(attr, mlir_ir.DenseElementsAttr):
    return _dense_value(attr)
  if isinstance(attr, mlir_ir.ArrayAttr):
    return tuple(_convert_attr(a) for a in mlir_ir.ArrayAttr(attr))
  if isinstance(attr, mlir_ir.DictAttr):
    return _dict_attr(attr)
  if sdy.TensorShardingAttr.isinstance(attr):
    return _sdy_sharding(attr)
  if sdy.TensorShardingPerValueAttr.isinstance(attr):
    return tuple(_sdy_sharding(s) for s in sdy.TensorShardingPerValueAttr(attr).shardings)
  if stablehlo.DotDimensionNumbers.isinstance(attr):
    d = stablehlo.DotDimensionNumbers(attr)
    return {"lhs_batch": tuple(d.lhs_batching_dimensions),
            "rhs_batch": tuple(d.rhs_batching_dimensions),
            "lhs_contract": tuple(d.lhs_contracting_dimensions),
            "rhs_contract": tuple(d.rhs_contracting_dimensions)}
  if stablehlo.ComparisonDirectionAttr.isinstance(attr):
    return str(stablehlo.ComparisonDirectionAttr(attr).value)
  if stablehlo.ReplicaGroupMeshAxesAttr.isinstance(attr):
    r = stablehlo.ReplicaGroupMeshAxesAttr(attr)
    return ("mesh_axes", str(r.mesh).lstrip("@"),
            tuple(stablehlo.AxisRefAttr(a).name for a in r.axes))
  text = str(attr)
  m = re.match(r"#stablehlo\.channel_handle<handle = (\d+), type = (\d+)>", text)
  if m:
    return int(m.group(1))
  if text.startswith("#sdy<manual_axes"):
    return tuple(re.findall(r'"([^"]+)"', text))
  return text


def _dense_value(attr) -> np.ndarray:
  from jaxlib.mlir import ir as mlir_ir
  dense = mlir_ir.DenseElementsAttr(attr)
  shape = tuple(int(d) for d in mlir_ir.ShapedType(dense.type).shape)
  try:
    if dense.is_splat:
      v = dense.get_splat_value()
      scalar = _convert_attr(v)
      arr = np.full(shape, scalar)
    else:
      arr = np.array(dense)
      if arr.shape != shape:
        arr = arr.reshape(shape)
  except Exception:
    # bf16 and other types numpy has no buffer format for: read the text.
    element = str(mlir_ir.ShapedType(dense.type).element_type)
    arr = _dense_from_text(str(attr), shape, element)
  return ir.ConstantArray(arr)


_TOKEN = re.compile(r"0x[0-9A-Fa-f]+|[-+]?(?:inf|nan)|[-+]?\d+\.?\d*(?:[eE][-+]?\d+)?|true|false")


def _dense_from_text(text: str, shape: tuple[int, ...], element: str) -> np.ndarray:
  """A ``dense<...>`` constant's elements from its printed form, as float64
  (integers for integer types): decimals, ``0x`` bit patterns of one element
  (MLIR prints a bfloat16 -inf as 0xFF80), or one ``"0x..."`` blob of every
  element's bytes (large constants).  Anything else is an input error, never
  a guess: a misread constant would relate to the wrong numbers."""
  start = text.find("dense<") + len("dense<")
  body = text[start:text.find(">", start)]
  from graphguard_hlo.loaders.hlo_text import ML_DTYPE_NAMES  # (it imports this module)
  storage = None
  if element.lower() in ML_DTYPE_NAMES:
    import ml_dtypes
    storage = np.dtype(getattr(ml_dtypes, ML_DTYPE_NAMES[element.lower()]))
  count = int(np.prod(shape))

  def unreadable():
    return InputError(None, f"cannot read the {element} constant {body[:60]}")
  if body.startswith('"0x'):
    if storage is None:
      raise unreadable()
    raw = bytes.fromhex(body.strip('"')[2:])
    if len(raw) not in (storage.itemsize, storage.itemsize * count):
      raise unreadable()
    values = np.frombuffer(raw, storage).astype(np.float64)
  else:
    values = []
    for tok in _TOKEN.findall(body):
      if tok.startswith("0x"):
        if storage is None:
          raise unreadable()
        bits = np.array([int(tok, 16)], f"u{storage.itemsize}")
        values.append(float(bits.view(storage)[0]))
      else:
        values.append(1.0 if tok == "true" else 0.0 if tok == "false" else float(tok))
    values = np.array(values)
    if storage is not None:  # decimals are printed to 6 digits: round to the type
      values = values.astype(storage).astype(np.float64)
  if values.size == 1:
    return np.full(shape, values[0])
  if values.size != count:
    raise unreadable()
  return values.reshape(shape)


def _complex_value(text: str, shape: tuple[int, ...]) -> np.ndarray:
  """A complex constant's elements: the ``(re, im)`` pairs of its printed
  ``dense<...>`` (hex-encoded elements are not read)."""
  number = r"\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|nan))\s*"
  body = text[text.find("dense<"):].split(">")[0]
  pairs = re.findall(rf"\({number},{number}\)", body)
  try:
    values = np.array([complex(float(re_), float(im)) for re_, im in pairs])
    return np.full(shape, values[0]) if len(values) == 1 else values.reshape(shape)
  except (ValueError, IndexError):
    raise InputError(None, f"cannot read the complex constant {body[:60]}") from None


def _sdy_sharding(attr) -> ir.SdySharding:
  from jaxlib.mlir.dialects import sdy
  s = sdy.TensorShardingAttr(attr)
  dims = tuple(tuple(sdy.AxisRefAttr(a).name for a in sdy.DimensionShardingAttr(d).axes)
               for d in s.dimension_shardings)
  mesh = str(s.mesh_or_ref).strip('"').lstrip("@")
  return ir.SdySharding(mesh, dims,
                        tuple(sdy.AxisRefAttr(a).name for a in s.replicated_axes),
                        tuple(sdy.AxisRefAttr(a).name for a in s.unreduced_axes))


def _canonicalize(name: str, attrs: dict, operands: list[ir.Value],
                  module: ir.Module) -> tuple[str, dict]:
  """Rename StableHLO attributes to the IR's canonical ones (see ir.py)."""
  if name == "dot_general":
    return name, dict(attrs.pop("dot_dimension_numbers"))
  if name == "dot":
    lhs, rhs = operands
    return "dot_general", {"lhs_batch": (), "rhs_batch": (),
                           "lhs_contract": (lhs.type.rank - 1,), "rhs_contract": (0,)}
  if name == "broadcast_in_dim":
    return name, {"broadcast_dimensions": attrs["broadcast_dimensions"]}
  if name == "transpose":
    return name, {"permutation": attrs["permutation"]}
  if name in ("reduce", "reduce_scatter", "all_reduce", "all_gather", "all_to_all",
              "collective_permute"):
    out = {}
    for key, value in attrs.items():
      if key == "replica_groups":
        out[key] = _replica_groups(value, module)
      elif key in ("dimensions", "scatter_dimension", "all_gather_dim", "split_dimension",
                   "concat_dimension", "source_target_pairs", "use_global_device_ids",
                   "channel_handle", "split_count"):
        out[{"all_gather_dim": "all_gather_dimension"}.get(key, key)] = (
            _int_tuple(value) if key == "source_target_pairs" else value)
    return name, out
  if name == "comparison_direction":
    return name, attrs
  return name, attrs


def _int_tuple(value):
  arr = np.asarray(value)
  return tuple(tuple(int(x) for x in row) for row in arr.reshape(-1, 2))


def _replica_groups(value, module: ir.Module) -> tuple[tuple[int, ...], ...]:
  if isinstance(value, tuple) and value and value[0] == "mesh_axes":
    _, mesh_name, axes = value
    mesh = module.meshes[mesh_name]
    devices = mesh.devices()
    names = mesh.axis_names
    keep = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in keep]
    grouped = devices.transpose(rest + keep).reshape(-1, int(np.prod(
        [devices.shape[i] for i in keep], dtype=np.int64)))
    return tuple(tuple(int(d) for d in row) for row in grouped)
  arr = np.asarray(value)
  if arr.ndim != 2:
    arr = arr.reshape(1, -1)
  return tuple(tuple(int(d) for d in row if d >= 0) for row in arr)
