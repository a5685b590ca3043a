"""HLO protos (``--xla_dump_hlo_as_proto``): printed by XLA as HLO text, then read by ``hlo_text``."""

from __future__ import annotations

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError
from graphguard_hlo.loaders.stablehlo import load_stablehlo


def looks_like_proto(data: bytes) -> bool:
  # HloProto and HloModuleProto both start with a length-delimited field 1.
  return len(data) > 2 and data[0] == 0x0A


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while i < len(data):
    byte = data[i]
    value |= (byte & 0x7F) << shift
    shift += 7
    i += 1
    if byte < 0x80:
      return value, i
  raise ValueError("truncated varint")


def unwrap_hlo_proto(data: bytes) -> bytes:
  """The HloModuleProto inside an HloProto dump, or ``data`` if it is one already.

  XLA's ``*.hlo.pb`` dumps are ``HloProto {hlo_module = 1; buffer_assignment = 3}``;
  an ``HloModuleProto`` starts with its string ``name = 1``.  Field 1 of an
  HloProto is itself a message starting with ``0x0A``, a name never does.
  """
  if not looks_like_proto(data):
    return data
  length, start = _read_varint(data, 1)
  inner = data[start:start + length]
  if start + length <= len(data) and inner[:1] == b"\x0a":
    return inner
  return data


def load_hlo_proto(path: str, data: bytes) -> ir.Module:
  """XLA prints the proto as HLO text, which ``hlo_text`` reads.

  Not XLA's HLO-to-StableHLO converter: it drops the device order of
  ``replica_groups=mesh[...] device_ids=([2,2,2]T(1,0,2))`` (a collective over
  the middle mesh axis comes out over the major one), and a verifier must
  read the groups the program really uses.
  """
  from jax._src.lib import xla_client
  from jaxlib._hlo import HloPrintOptions
  from graphguard_hlo.loaders.hlo_text import load_hlo_text
  options = HloPrintOptions()
  options.print_large_constants = True  # the proto holds every value: print them all
  options.print_metadata = True  # source lines (as_hlo_text drops its stack frames)
  try:
    module = xla_client.XlaComputation(unwrap_hlo_proto(data)).get_hlo_module()
    text = module.to_string(options)
  except Exception as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise InputError(path, f"not a valid HLO proto: {first}") from None
  loaded = load_hlo_text(path, text)
  loaded.format = "hlo_proto"
  # The outputs' sharding, which the text prints nowhere after partitioning
  # (the root has none): without it any clean output layout would do.
  out = module.spmd_output_sharding
  if out is not None and "mhlo.spmd_output_sharding" not in loaded.attrs:
    loaded.attrs["mhlo.spmd_output_sharding"] = str(xla_client.HloSharding.from_proto(out))
  return loaded


def load_hlo_proto_via_converter(path: str, data: bytes) -> ir.Module:
  """XLA's own converter (for comparisons in tests; see ``load_hlo_proto``)."""
  from jax._src.lib import xla_client
  try:
    bytecode = xla_client._xla.mlir.hlo_to_stablehlo(unwrap_hlo_proto(data))
  except Exception as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise InputError(path, f"not a valid HLO proto: {first}") from None
  return load_stablehlo(path, bytecode, "hlo_proto")
