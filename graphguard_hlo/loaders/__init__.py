"""Load any supported module file into the graph IR (see ``graphguard_hlo.ir``).

Formats, told apart by content first and extension second:
  * StableHLO MLIR text (``.mlir``) and bytecode (``.mlirbc``): parsed by jaxlib.mlir.
  * HLO protos (``.pb``, HloProto or HloModuleProto): printed as HLO text by
    XLA, then parsed as below (XLA's ``hlo_to_stablehlo`` drops the device order
    of mesh replica groups).
  * XLA HLO text dumps (``.txt``, ``.hlo``): jaxlib exposes no HLO text parser,
    so ``hlo_text.py`` is ours.
"""

from __future__ import annotations

import os

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError

MLIR_BYTECODE_MAGIC = b"ML\xefR"


def load_module(path: str) -> ir.Module:
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    raise InputError(path, "no such file") from None
  except IsADirectoryError:
    raise InputError(path, "is a directory, expected a module file") from None
  except OSError as e:
    raise InputError(path, f"cannot read: {e.strerror}") from None
  if not data.strip():
    raise InputError(path, "empty file")
  return load_module_bytes(path, data)


def load_module_bytes(path: str, data: bytes) -> ir.Module:
  from graphguard_hlo.loaders import hlo_proto, stablehlo
  ext = os.path.splitext(path)[1].lower()
  if data.startswith(MLIR_BYTECODE_MAGIC):
    return stablehlo.load_stablehlo(path, data, "stablehlo")
  text = _as_text(data)
  if text is None:
    if ext in (".pb", ".proto") or hlo_proto.looks_like_proto(data):
      return hlo_proto.load_hlo_proto(path, data)
    raise InputError(path, "binary file that is neither MLIR bytecode nor an HLO proto")
  head = text.lstrip()
  if head.startswith("HloModule"):
    from graphguard_hlo.loaders import hlo_text
    return hlo_text.load_hlo_text(path, text)
  if head.startswith(("module", "#loc", "func.func", "sdy.mesh", "//")) or ext == ".mlir":
    return stablehlo.load_stablehlo(path, text, "stablehlo")
  raise InputError(path, "unrecognized format: expected StableHLO (.mlir, .mlirbc), "
                   "HLO text (starts with 'HloModule') or an HLO proto (.pb)", line=1)


def _as_text(data: bytes) -> str | None:
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError:
    return None
  if "\x00" in text[:4096]:
    return None
  return text
