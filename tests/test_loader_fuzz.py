"""Fuzz the StableHLO and proto loaders with truncated and mutated modules:
they load or raise one InputError, never crash, never hang."""

import os

import pytest
from hypothesis import given, settings, strategies as st

from graphguard_hlo.errors import InputError
from graphguard_hlo.loaders import load_module_bytes

TD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testdata")
SOURCES = {
    "dist.mlir": open(os.path.join(TD, "tp_mlp__shard_map__ok", "dist.mlir"), "rb").read(),
    "dist.hlo.pb": open(os.path.join(TD, "tp_mlp__gspmd__ok", "dist.hlo.pb"), "rb").read(),
}


def _load(name, data):
  try:
    load_module_bytes(name, data)
  except InputError as e:
    assert "\n" not in e.one_line() and e.one_line().startswith(name)


@pytest.mark.parametrize("name", sorted(SOURCES))
@settings(max_examples=60, deadline=None, derandomize=True)
@given(cut=st.floats(0, 1), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)),
                                            max_size=4))
def test_truncated_or_mutated_modules(name, cut, flips):
  data = bytearray(SOURCES[name][: max(1, int(len(SOURCES[name]) * cut))])
  for where, byte in flips:
    data[min(int(where * len(data)), len(data) - 1)] = byte
  _load(name, bytes(data))


def test_dynamic_shapes_are_an_input_error():
  text = ("func.func @main(%arg0: tensor<?x4xf32>) -> tensor<?x4xf32> {\n"
          "  return %arg0 : tensor<?x4xf32>\n}\n")
  with pytest.raises(InputError, match="dyn.mlir: error: dynamic shape"):
    load_module_bytes("dyn.mlir", text.encode())

