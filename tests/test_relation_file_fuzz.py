"""Fuzz the relation-file parser: any text gives layouts or one InputError with a line."""

from hypothesis import given, settings, strategies as st

from graphguard_hlo.errors import InputError
from graphguard_hlo.relation_file import parse_relation_file

TOKENS = st.sampled_from(["0", "1", "7", ":", " ", "dim0=", "dim1=", "dim9=", "tp", "dp", ",",
                          "partial=", "replicated", "#", "\n", "=", "x", "\t", "é", "dim",
                          "order0=", "order1=", "order5=", "0,1", "1,0", "3,0,2,1"])
SHAPES = [(4, 6), (4, 4), (8,)]  # parameters 0, 1, 2


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(TOKENS, max_size=40).map("".join) | st.text(max_size=60))
def test_never_crashes(text):
  try:
    layouts = parse_relation_file("rel.txt", text, SHAPES, ["tp", "dp"])
  except InputError as e:
    line = e.one_line()
    assert "\n" not in line and line.startswith("rel.txt:")
    assert e.line is not None and 1 <= e.line <= text.count("\n") + 1
  else:
    for index, layout in layouts.items():
      assert layout.is_valid() and layout.rank == len(SHAPES[index])
      for dim, chunks in layout.order:  # a chunk order cuts its dim evenly
        assert SHAPES[index][dim] % len(chunks) == 0
