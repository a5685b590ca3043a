"""XLA HLO text dumps (``--xla_dump_to``) into the graph IR, without XLA's help.

jaxlib exposes no HLO text parser, so this file has its own: a tokenizer, a
recursive-descent parser for modules, computations, instructions, shapes and
literals, and small parsers for the attribute values the IR needs.

The importer then does what XLA's HLO-to-StableHLO converter does for the proto
path (``hlo_proto.py``), so that a ``*.txt`` dump and the ``*.hlo.pb`` of the same
pass give the same IR: StableHLO op names, tuples flattened into multi-result ops
(``get-tuple-element`` of a ``tuple`` folds away), every computation a function and
the ones an op applies also inlined as that op's regions, locations from the
stack-frame tables, and attributes converted the way ``stablehlo.py`` converts them.
Known differences from the proto path are listed in ``tests/test_hlo_text_loader.py``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from typing import Any, Callable, Optional

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError
from graphguard_hlo.loaders.gather_spec import gather_violation
from graphguard_hlo.loaders.stablehlo import _canonicalize
from graphguard_hlo.reference import is_integer_type

# --------------------------------------------------------------------------- tokens

# One alternative per token kind; order matters (hex before dims before numbers,
# numbers before names).  Comments and whitespace are skipped by the lexer.
_TOKEN_RE = re.compile(r"""
   (?P<ws>[ \t\r\f\v\n]+)
  |(?P<comment>/\*.*?\*/|//[^\n]*)
  |(?P<str>"(?:[^"\\\n]|\\.)*")
  |(?P<sstr>'(?:[^'\\\n]|\\.)*')
  |(?P<hex>0x[0-9a-fA-F]+(?![\w.]))
  |(?P<dims>-?\d+(?:_-?\d+)+(?:x-?\d+(?:_-?\d+)*)*(?![\w.])|\d+(?:x\d+)+(?![\w.]))
  |(?P<num>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\.\d+(?:[eE][-+]?\d+)?|\d+)(?![\w.])
          |-(?:inf|nan)(?:\(0x[0-9a-fA-F]+\))?(?![\w.])|nan\(0x[0-9a-fA-F]+\))
  |(?P<name>%?[A-Za-z_$][\w.$]*(?:-(?!>)[\w.$]+)*|%[\w.$]+(?:-(?!>)[\w.$]+)*)
  |(?P<word>[\w.$]+)
  |(?P<punct>->|<=|\.\.\.|[{}()\[\],=:<>*?@#!|+\-/])
""", re.X | re.S)

_EOF = "eof"


class _Tok:
  __slots__ = ("kind", "text", "start", "end", "line", "col")

  def __init__(self, kind: str, text: str, start: int, end: int, line: int, col: int):
    self.kind = kind
    self.text = text
    self.start = start
    self.end = end
    self.line = line
    self.col = col

  def __repr__(self) -> str:
    return f"{self.kind}:{self.text!r}@{self.line}:{self.col}"

  def describe(self) -> str:
    if self.kind == _EOF:
      return "end of file"
    return repr(self.text if len(self.text) <= 40 else self.text[:37] + "...")


def _tokenize(path: str, text: str) -> list[_Tok]:
  """Every token of ``text`` with its line and column (1-based)."""
  line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
  toks: list[_Tok] = []
  pos, n = 0, len(text)
  match = _TOKEN_RE.match
  while pos < n:
    m = match(text, pos)
    if m is None:
      line = bisect.bisect_right(line_starts, pos)
      col = pos - line_starts[line - 1] + 1
      ch = text[pos]
      what = ("unterminated string" if ch in "\"'" else
              f"unexpected character {ch!r}")
      raise InputError(path, what, line=line, column=col)
    kind = m.lastgroup
    end = m.end()
    if kind not in ("ws", "comment"):
      line = bisect.bisect_right(line_starts, pos)
      toks.append(_Tok(kind, m.group(), pos, end, line, pos - line_starts[line - 1] + 1))
    pos = end
  last_line = len(line_starts) if not text.endswith("\n") else len(line_starts) - 1
  toks.append(_Tok(_EOF, "", n, n, max(last_line, 1), 1))
  return toks


def _unescape(s: str) -> str:
  """A C-escaped string body (what absl::CEscape writes) back to text."""
  if "\\" not in s:
    return s
  out = bytearray()
  i, n = 0, len(s)
  simple = {"n": 10, "t": 9, "r": 13, "\\": 92, '"': 34, "'": 39, "a": 7, "b": 8,
            "f": 12, "v": 11, "?": 63}
  while i < n:
    c = s[i]
    if c != "\\" or i + 1 == n:
      out += c.encode("utf-8")
      i += 1
      continue
    d = s[i + 1]
    if d in simple:
      out.append(simple[d])
      i += 2
    elif d in "01234567":
      j = i + 1
      while j < n and j < i + 4 and s[j] in "01234567":
        j += 1
      out.append(int(s[i + 1:j], 8) & 0xFF)
      i = j
    elif d == "x":
      j = i + 2
      while j < n and s[j] in "0123456789abcdefABCDEF":
        j += 1
      out.append(int(s[i + 2:j] or "0", 16) & 0xFF)
      i = j
    else:
      out += d.encode("utf-8")
      i += 2
  return out.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- syntax tree

# HLO element type -> the IR's dtype spelling (what stablehlo.py gets from MLIR).
_DTYPES = {
    "pred": "pred", "s2": "i2", "s4": "i4", "s8": "i8", "s16": "i16", "s32": "i32",
    "s64": "i64", "u2": "ui2", "u4": "ui4", "u8": "ui8", "u16": "ui16", "u32": "ui32",
    "u64": "ui64", "f16": "f16", "bf16": "bf16", "f32": "f32", "f64": "f64",
    "c64": "complex<f32>", "c128": "complex<f64>", "f8e5m2": "f8E5M2",
    "f8e4m3fn": "f8E4M3FN", "f8e4m3b11fnuz": "f8E4M3B11FNUZ", "f8e5m2fnuz": "f8E5M2FNUZ",
    "f8e4m3fnuz": "f8E4M3FNUZ", "f8e4m3": "f8E4M3", "f8e3m4": "f8E3M4",
    "f4e2m1fn": "f4E2M1FN", "f8e8m0fnu": "f8E8M0FNU", "token": "token",
}


@dataclasses.dataclass
class _Shape:
  dtype: str                      # HLO element type, "tuple" or "token"
  dims: tuple[int, ...] = ()
  layout: Optional[tuple[int, ...]] = None   # minor_to_major, None if not printed
  layout_extra: bool = False      # tiles, memory space, ... after ':' in the layout
  elements: tuple["_Shape", ...] = ()
  text: str = ""                  # as printed

  @property
  def is_tuple(self) -> bool:
    return self.dtype == "tuple"

  def leaves(self) -> list["_Shape"]:
    if not self.is_tuple:
      return [self]
    return [leaf for e in self.elements for leaf in e.leaves()]

  def ir_type(self) -> ir.TensorType:
    if self.is_tuple:
      return ir.TensorType((), "tuple")
    return ir.TensorType(self.dims, _DTYPES[self.dtype])

  def has_custom_layout(self) -> bool:
    if self.is_tuple:
      return any(e.has_custom_layout() for e in self.elements)
    if self.dtype == "token" or not self.layout:
      return False
    return self.layout_extra or self.layout != tuple(range(len(self.dims) - 1, -1, -1))

  def layout_attr(self) -> Any:
    """XLA's GetLayoutAttribute: minor-to-major index arrays (tuples of them)."""
    if self.is_tuple:
      return tuple(e.layout_attr() for e in self.elements)
    m2m = self.layout if self.layout is not None else tuple(range(len(self.dims) - 1, -1, -1))
    return ir.ConstantArray(np.array(m2m, dtype=np.int64))

  def same_as(self, other: "_Shape") -> bool:
    if self.is_tuple or other.is_tuple:
      return (self.is_tuple and other.is_tuple and len(self.elements) == len(other.elements)
              and all(a.same_as(b) for a, b in zip(self.elements, other.elements)))
    return self.dtype == other.dtype and self.dims == other.dims

  def __str__(self) -> str:
    if self.is_tuple:
      return "(" + ", ".join(map(str, self.elements)) + ")"
    return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass
class _Span:
  """An attribute value: tokens [lo, hi) and their text."""
  lo: int
  hi: int
  text: str
  line: int
  col: int


@dataclasses.dataclass
class _Instr:
  name: str
  shape: _Shape
  opcode: str
  operands: list[str]
  operand_toks: list[_Tok]
  attrs: dict[str, _Span]
  line: int
  col: int
  is_root: bool = False
  literal: Optional[_Span] = None     # constant(...)
  param_number: int = -1              # parameter(N)
  control_predecessors: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Computation:
  name: str
  instrs: list[_Instr]
  is_entry: bool
  line: int
  col: int
  root: Optional[_Instr] = None
  by_name: dict[str, _Instr] = dataclasses.field(default_factory=dict)
  params: list[_Instr] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _HloModule:
  name: str
  attrs: dict[str, _Span]
  computations: list[_Computation]
  tables: dict[str, dict[int, Any]]


# --------------------------------------------------------------------------- parser

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


class _Parser:
  """Recursive descent over the token list; ``lo``/``hi`` bound a sub-parse."""

  def __init__(self, path: str, text: str, toks: list[_Tok], lo: int = 0,
               hi: Optional[int] = None):
    self.path = path
    self.text = text
    self.toks = toks
    self.i = lo
    self.hi = len(toks) - 1 if hi is None else hi  # index of the (virtual) EOF
    self._eof = toks[-1] if hi is None else _Tok(
        _EOF, "", toks[hi - 1].end, toks[hi - 1].end, toks[hi - 1].line,
        toks[hi - 1].col + len(toks[hi - 1].text))

  # -- cursor
  def peek(self, k: int = 0) -> _Tok:
    j = self.i + k
    return self.toks[j] if j < self.hi else self._eof

  def next(self) -> _Tok:
    t = self.peek()
    if self.i < self.hi:
      self.i += 1
    return t

  def at(self, text: str, k: int = 0) -> bool:
    t = self.peek(k)
    return t.text == text and t.kind in ("punct", "name", "word")

  def accept(self, text: str) -> bool:
    if self.at(text):
      self.i += 1
      return True
    return False

  def error(self, msg: str, tok: Optional[_Tok] = None) -> InputError:
    t = tok or self.peek()
    if t.kind == _EOF and self.hi == len(self.toks) - 1:
      msg = f"unexpected end of file: {msg} (is the file truncated?)"
    return InputError(self.path, msg, line=t.line, column=t.col)

  def expect(self, text: str, what: str = "") -> _Tok:
    t = self.peek()
    if not self.at(text):
      raise self.error(f"expected {text!r}{' ' + what if what else ''}, found {t.describe()}")
    return self.next()

  def expect_name(self, what: str) -> str:
    t = self.peek()
    if t.kind != "name":
      raise self.error(f"expected {what}, found {t.describe()}")
    self.next()
    return t.text[1:] if t.text.startswith("%") else t.text

  def expect_int(self, what: str) -> int:
    t = self.peek()
    if t.kind != "num" or not re.fullmatch(r"[-+]?\d+", t.text):
      raise self.error(f"expected an integer {what}, found {t.describe()}")
    self.next()
    v = int(t.text)
    if not -2**63 <= v < 2**63:
      raise self.error(f"integer {t.text} {what} does not fit in 64 bits", t)
    return v

  def done(self) -> bool:
    return self.i >= self.hi

  def expect_done(self, what: str) -> None:
    if not self.done():
      raise self.error(f"unexpected {self.peek().describe()} in {what}")

  # -- module
  def module(self) -> _HloModule:
    if not self.at("HloModule"):
      raise self.error(f"expected 'HloModule' at the start of an HLO text dump, "
                       f"found {self.peek().describe()}")
    self.next()
    name = self.expect_name("the module name after 'HloModule'")
    attrs = self.attributes()
    tables: dict[str, dict[int, Any]] = {t: {} for t in _TABLES}
    comps: list[_Computation] = []
    while self.peek().kind != _EOF:
      t = self.peek()
      if t.kind == "name" and t.text in _TABLES and not self.at("(", 1) and not self.at("{", 1):
        self.next()
        self.table(t.text, tables[t.text])
        continue
      comps.append(self.computation())
    if not comps:
      raise self.error("the module has no computations")
    return _HloModule(name, attrs, comps, tables)

  def table(self, kind: str, out: dict[int, Any]) -> None:
    """``FileNames``/``FunctionNames``: ``N "text"``; the others ``N {k=v ...}``."""
    while self.peek().kind == "num":
      t = self.next()
      key = int(t.text) if t.text.isdigit() else None
      if key is None:
        raise self.error(f"expected an entry number in {kind}", t)
      if kind in ("FileNames", "FunctionNames"):
        s = self.peek()
        if s.kind != "str":
          raise self.error(f"expected a quoted name after {key} in {kind}, found {s.describe()}")
        self.next()
        out[key] = _unescape(s.text[1:-1])
      else:
        self.expect("{", f"after {key} in {kind}")
        fields: dict[str, int] = {}
        while not self.accept("}"):
          k = self.expect_name(f"a field name in {kind}")
          self.expect("=")
          fields[k] = self.expect_int(f"for {k} in {kind}")
          self.accept(",")
        out[key] = fields

  def attributes(self) -> dict[str, _Span]:
    """``, name=value`` pairs that follow a header or an instruction."""
    attrs: dict[str, _Span] = {}
    while self.at(","):
      self.next()
      key_tok = self.peek()
      key = self.expect_name("an attribute name after ','")
      self.expect("=", f"after attribute {key}")
      attrs[key] = self.value(key_tok)
    return attrs

  def value(self, key_tok: _Tok) -> _Span:
    """Tokens up to the next top-level ',' (or the end of the line)."""
    lo = self.i
    depth = 0
    last_line = key_tok.line
    opening = []
    while True:
      t = self.peek()
      if t.kind == _EOF:
        if depth:
          raise self.error(f"{opening[-1].text!r} opened at line {opening[-1].line} is never "
                           f"closed in attribute {key_tok.text}", t)
        break
      if depth == 0 and (t.text == "," and t.kind == "punct" or t.line != last_line
                         or t.text == "}" and t.kind == "punct"):
        break
      if t.kind == "punct":
        if t.text in "([{":
          depth += 1
          opening.append(t)
        elif t.text in ")]}":
          if not opening:
            raise self.error(f"unbalanced {t.text!r} in attribute {key_tok.text}", t)
          depth -= 1
          opening.pop()
      last_line = t.line
      self.next()
    if self.i == lo:
      raise self.error(f"attribute {key_tok.text} has no value")
    first, last = self.toks[lo], self.toks[self.i - 1]
    return _Span(lo, self.i, self.text[first.start:last.end], first.line, first.col)

  # -- computations and instructions
  def computation(self) -> _Computation:
    is_entry = self.accept("ENTRY")
    start = self.peek()
    name = self.expect_name("a computation name (or 'ENTRY')")
    if self.at("("):   # the signature is informative only: the parameters say it all
      self.skip_balanced()
      self.expect("->", f"after the parameters of computation {name}")
      self.shape()
    self.expect("{", f"to open computation {name}")
    instrs: list[_Instr] = []
    while not self.at("}"):
      if self.peek().kind == _EOF:
        raise self.error(f"computation {name} (line {start.line}) is not closed with '}}'")
      instrs.append(self.instruction())
    self.next()
    if self.at(",") and self.at("execution_thread", 1):
      self.next()
      self.next()
      self.expect("=")
      self.next()
    comp = _Computation(name, instrs, is_entry, start.line, start.col)
    for ins in instrs:
      if ins.name in comp.by_name:
        raise InputError(self.path, f"instruction %{ins.name} is defined twice in computation "
                         f"{name}", line=ins.line, column=ins.col)
      comp.by_name[ins.name] = ins
      if ins.is_root:
        if comp.root is not None:
          raise InputError(self.path, f"computation {name} has two ROOT instructions",
                           line=ins.line, column=ins.col)
        comp.root = ins
    if not instrs:
      raise InputError(self.path, f"computation {name} is empty", line=start.line,
                       column=start.col)
    if comp.root is None:
      comp.root = instrs[-1]
    params = sorted((i for i in instrs if i.opcode == "parameter"), key=lambda i: i.param_number)
    for k, p in enumerate(params):
      if p.param_number != k:
        raise InputError(self.path, f"computation {name}: parameter({p.param_number}) of "
                         f"%{p.name} leaves a gap or repeats a number", line=p.line, column=p.col)
    comp.params = params
    return comp

  def skip_balanced(self) -> None:
    open_tok = self.next()
    depth = 1
    while depth:
      t = self.next()
      if t.kind == _EOF:
        raise self.error(f"{open_tok.text!r} opened at line {open_tok.line} is never closed", t)
      if t.kind == "punct" and t.text in "([{":
        depth += 1
      elif t.kind == "punct" and t.text in ")]}":
        depth -= 1

  def instruction(self) -> _Instr:
    is_root = self.accept("ROOT")
    start = self.peek()
    name = self.expect_name("an instruction name")
    self.expect("=", f"after instruction name %{name}")
    shape = self.shape()
    op_tok = self.peek()
    if op_tok.kind != "name":
      raise self.error(f"expected an opcode for %{name}, found {op_tok.describe()}")
    self.next()
    opcode = op_tok.text
    self.expect("(", f"after opcode {opcode}")
    ins = _Instr(name, shape, opcode, [], [], {}, start.line, start.col, is_root)
    if opcode == "constant":
      lo = self.i
      depth = 1
      while True:
        t = self.peek()
        if t.kind == _EOF:
          raise self.error(f"the literal of constant %{name} is not closed with ')'")
        if t.kind == "punct" and t.text in "([{":
          depth += 1
        elif t.kind == "punct" and t.text in ")]}":
          depth -= 1
          if depth == 0:
            break
        self.next()
      if self.i == lo:
        raise self.error(f"constant %{name} has no literal")
      first, last = self.toks[lo], self.toks[self.i - 1]
      ins.literal = _Span(lo, self.i, self.text[first.start:last.end], first.line, first.col)
      self.next()
    elif opcode == "parameter":
      ins.param_number = self.expect_int("parameter number")
      if ins.param_number < 0:
        raise self.error(f"negative parameter number for %{name}", start)
      self.expect(")", f"after the parameter number of %{name}")
    else:
      if not self.accept(")"):
        while True:
          if self.at("(") or (self.peek().kind == "name" and self.at("[", 1)):
            self.shape()   # old-style "f32[4] %x" operands
          t = self.peek()
          ins.operands.append(self.expect_name(f"an operand of %{name}"))
          ins.operand_toks.append(t)
          if self.accept(")"):
            break
          self.expect(",", f"between operands of %{name}")
    ins.attrs = self.attributes()
    cp = ins.attrs.pop("control-predecessors", None)
    if cp is not None:
      sub = self.sub(cp)
      ins.control_predecessors = [n for n, _ in sub.name_list()]
    return ins

  def sub(self, span: _Span) -> "_Parser":
    return _Parser(self.path, self.text, self.toks, span.lo, span.hi)

  # -- shapes
  def shape(self) -> _Shape:
    start = self.peek()
    if self.accept("("):
      elems: list[_Shape] = []
      if not self.accept(")"):
        while True:
          elems.append(self.shape())
          if self.accept(")"):
            break
          self.expect(",", "between tuple elements")
      end = self.toks[self.i - 1]
      return _Shape("tuple", elements=tuple(elems), text=self.text[start.start:end.end])
    t = self.peek()
    if t.kind != "name" or t.text not in _DTYPES:
      raise self.error(f"expected a shape such as f32[8,16], found {t.describe()}")
    self.next()
    dtype = t.text
    dims: list[int] = []
    if self.accept("["):
      while not self.accept("]"):
        d = self.peek()
        if d.text in ("<=", "?"):
          raise self.error("dynamic shapes are not supported (bounded or unknown dimension)")
        dims.append(self.expect_int("dimension"))
        if dims[-1] < 0:
          raise self.error("negative dimension", d)
        if not self.at("]"):
          self.expect(",", "between dimensions")
    elif dtype != "token":
      raise self.error(f"expected '[' after element type {dtype}")
    layout: Optional[tuple[int, ...]] = None
    extra = False
    nxt = self.peek(1)
    if self.at("{") and (nxt.kind == "num" or nxt.text in (":", "}")):
      self.next()
      m2m: list[int] = []
      while self.peek().kind == "num":
        m2m.append(self.expect_int("layout dimension"))
        self.accept(",")
      layout = tuple(m2m)
      if self.at(":"):
        extra = True
        depth = 1
        while depth:
          u = self.next()
          if u.kind == _EOF:
            raise self.error("unclosed layout", u)
          if u.kind == "punct" and u.text in "([{":
            depth += 1
          elif u.kind == "punct" and u.text in ")]}":
            depth -= 1
      else:
        self.expect("}", "to close the layout")
      if sorted(layout) != list(range(len(dims))) and layout:
        raise self.error(f"layout {{{','.join(map(str, layout))}}} is not a permutation "
                         f"of the {len(dims)} dimensions", t)
    end = self.toks[self.i - 1]
    return _Shape(dtype, tuple(dims), layout, extra, (), self.text[t.start:end.end])

  # -- small attribute values
  def int_list(self) -> tuple[int, ...]:
    """``{1,0}`` or ``{}``."""
    self.expect("{")
    out: list[int] = []
    while not self.accept("}"):
      out.append(self.expect_int("in the list"))
      if not self.at("}"):
        self.expect(",", "in the list")
    return tuple(out)

  def name_list(self) -> list[tuple[str, _Tok]]:
    """``{%a, %b}``."""
    self.expect("{")
    out = []
    while not self.accept("}"):
      t = self.peek()
      out.append((self.expect_name("a computation or instruction name"), t))
      if not self.at("}"):
        self.expect(",", "in the list")
    return out

  def nested_int_lists(self) -> list[list[int]]:
    """``{{0,1},{2,3}}``."""
    self.expect("{")
    out: list[list[int]] = []
    while not self.accept("}"):
      out.append(list(self.int_list()))
      if not self.at("}"):
        self.expect(",", "between groups")
    return out

  def dict_braces(self) -> dict[str, Any]:
    """``{k=v k2="s" ...}`` (metadata, window, result_accuracy) as strings."""
    self.expect("{")
    out: dict[str, Any] = {}
    while not self.accept("}"):
      k = self.peek()
      if k.kind not in ("name", "word", "str"):
        raise self.error(f"expected a field name, found {k.describe()}")
      self.next()
      key = _unescape(k.text[1:-1]) if k.kind == "str" else k.text
      self.expect("=", f"after {key}")
      v = self.peek()
      if v.kind == _EOF:
        raise self.error(f"missing value for {key}")
      if v.kind == "punct" and v.text == "{":
        self.skip_balanced()
        out[key] = self.text[v.start:self.toks[self.i - 1].end]
      else:
        self.next()
        out[key] = _unescape(v.text[1:-1]) if v.kind == "str" else v.text
      self.accept(",")
    return out


# --------------------------------------------------------------------------- literals

_INT_DTYPES = {"s2": np.int8, "s4": np.int8, "s8": np.int8, "s16": np.int16, "s32": np.int32,
               "s64": np.int64, "u2": np.uint8, "u4": np.uint8, "u8": np.uint8,
               "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}
# Element types stablehlo.py reads into numpy with their own dtype when not a splat;
# the others (bf16, f8, 4-bit ints) come out as float64 through its text fallback.
_NATIVE = {"pred": np.bool_, "s8": np.int8, "s16": np.int16, "s32": np.int32, "s64": np.int64,
           "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
           "f16": np.float16, "f32": np.float32, "f64": np.float64,
           "c64": np.complex64, "c128": np.complex128}
# ml_dtypes' names of the element types numpy has no buffer format for, by HLO
# name (MLIR's names are the same in capitals: f8E4M3FN).
ML_DTYPE_NAMES = {"bf16": "bfloat16", "f8e5m2": "float8_e5m2", "f8e4m3fn": "float8_e4m3fn",
                  "f8e4m3b11fnuz": "float8_e4m3b11fnuz", "f8e5m2fnuz": "float8_e5m2fnuz",
                  "f8e4m3fnuz": "float8_e4m3fnuz", "f8e4m3": "float8_e4m3",
                  "f8e3m4": "float8_e3m4", "f4e2m1fn": "float4_e2m1fn",
                  "f8e8m0fnu": "float8_e8m0fnu"}


class ElidedConstant:
  """The value of a constant the dump printed as ``{...}``.

  XLA elides large literals unless dumped with ``--xla_dump_large_constants``.  Each
  elided constant is equal only to itself, so hash-consing never merges two of them,
  and reading it as an array is an InputError that says how to get the values.
  """
  __slots__ = ("name", "shape", "dtype", "path", "line")

  def __init__(self, name: str, shape: tuple[int, ...], dtype: str, path: Optional[str] = None,
               line: Optional[int] = None):
    self.name = name
    self.shape = shape
    self.dtype = dtype
    self.path = path
    self.line = line

  def __array__(self, dtype=None, copy=None):
    raise InputError(self.path, f"the value of constant %{self.name} "
                     f"({self.dtype}[{','.join(map(str, self.shape))}]) is elided as {{...}} in "
                     "this dump; dump again with XLA_FLAGS=--xla_dump_large_constants",
                     line=self.line)

  def __repr__(self) -> str:
    return f"ElidedConstant(%{self.name}: {self.dtype}[{','.join(map(str, self.shape))}])"


def _storage_dtype(hlo: str):
  if hlo in _NATIVE:
    return _NATIVE[hlo]
  if hlo in _INT_DTYPES:
    return _INT_DTYPES[hlo]
  try:
    import ml_dtypes
    return getattr(ml_dtypes, ML_DTYPE_NAMES[hlo])
  except (ImportError, KeyError, AttributeError):
    return np.float64


def _scalar(tok: _Tok, hlo: str, p: _Parser) -> Any:
  """One printed literal element as a Python value of the element type."""
  text = tok.text
  if hlo == "pred":
    if text in ("true", "1"):
      return True
    if text in ("false", "0"):
      return False
    raise p.error(f"expected true or false in a pred constant, found {tok.describe()}", tok)
  if hlo in _INT_DTYPES:
    if tok.kind != "num" or not re.fullmatch(r"[-+]?\d+", text):
      raise p.error(f"expected an integer in an {hlo} constant, found {tok.describe()}", tok)
    return int(text)
  low = text.lower()
  if tok.kind == "num" or low in ("inf", "nan") or low.startswith("nan("):
    payload = re.fullmatch(r"([-+]?)nan\(0x([0-9a-f]+)\)", low)
    if payload:
      return _nan_with_payload(hlo, payload.group(1) == "-", int(payload.group(2), 16), tok, p)
    if "nan" in low:
      return -math.nan if low.startswith("-") else math.nan
    try:
      return float(text)
    except ValueError:
      pass
  raise p.error(f"expected a number in an {hlo} constant, found {tok.describe()}", tok)


def _nan_with_payload(hlo: str, negative: bool, payload: int, tok: _Tok, p: _Parser):
  """``nan(0x...)``: the NaN whose significand is ``payload``, bit for bit (a
  canonical NaN in its place would make two different constants one)."""
  store = _storage_dtype(hlo)
  if hlo not in ("f16", "bf16", "f32", "f64"):
    raise p.error(f"NaN payloads of {hlo} constants are not read", tok)
  width = np.dtype(store).itemsize * 8
  mantissa = {"f16": 10, "bf16": 7, "f32": 23, "f64": 52}[hlo]
  if not 0 < payload < (1 << mantissa):
    raise p.error(f"{tok.text} is not a NaN of {hlo}", tok)
  exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
  bits = (int(negative) << (width - 1)) | exponent | payload
  return np.array([bits], f"u{width // 8}").view(store)[0]


def _parse_literal(p: _Parser, shape: _Shape, name: str) -> Any:
  """The ``constant(...)`` literal: a read-only array, or ElidedConstant for ``{...}``."""
  if shape.is_tuple or shape.dtype == "token":
    raise p.error(f"constant %{name}: tuple and token constants are not supported")
  hlo = shape.dtype
  complex_ = hlo in ("c64", "c128")
  flat: list[Any] = []
  elided = False

  def element():
    if complex_:
      p.expect("(", "to start a complex number")
      re_ = _scalar(p.next(), "f64", p)
      p.expect(",", "in a complex number")
      im = _scalar(p.next(), "f64", p)
      p.expect(")", "to end a complex number")
      return complex(re_, im)
    t = p.next()
    if t.kind == _EOF:
      raise p.error(f"constant %{name} ends early", t)
    return _scalar(t, hlo, p)

  def nested():
    nonlocal elided
    if p.accept("{"):
      if p.accept("..."):
        elided = True
        p.expect("}", "after '...'")
        return
      while not p.accept("}"):
        nested()
        if not p.at("}"):
          p.expect(",", f"between elements of constant %{name}")
      return
    flat.append(element())

  nested()
  p.expect_done(f"the literal of constant %{name}")
  if elided:
    first = p.toks[p.hi - 1] if p.hi else None
    return ElidedConstant(name, shape.dims, _DTYPES[hlo], p.path, first.line if first else None)
  count = 1
  for d in shape.dims:
    count *= d
  if len(flat) != count:
    raise p.error(f"constant %{name} has {len(flat)} element(s) but its shape "
                  f"{shape} holds {count}", p.toks[p.hi - 1] if p.hi else None)
  if hlo in _INT_DTYPES:
    bits = {"s2": 2, "s4": 4, "u2": 2, "u4": 4}.get(hlo)
    info = np.iinfo(_INT_DTYPES[hlo])
    lo, hi = (info.min, info.max) if bits is None else (
        (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if hlo[0] == "s" else (0, (1 << bits) - 1))
    bad = next((v for v in flat if not lo <= v <= hi), None)
    if bad is not None:
      raise p.error(f"constant %{name}: {bad} does not fit in {hlo}", p.toks[p.hi - 1])
  return _constant_value(flat, shape)


def _constant_value(flat: list[Any], shape: _Shape) -> ir.ConstantArray:
  """The array stablehlo.py would build from the same DenseElementsAttr."""
  hlo = shape.dtype
  store = _storage_dtype(hlo)
  try:
    arr = np.array(flat, dtype=store).reshape(shape.dims)
  except (OverflowError, ValueError):
    arr = np.array(flat, dtype=object).reshape(shape.dims)
  raw = arr.reshape(-1)
  if raw.size == 0:
    splat = False
  elif raw.dtype == object:
    splat = all(x == raw[0] for x in raw)
  else:
    b = raw.tobytes()
    splat = b == b[:raw.itemsize] * raw.size
  if raw.size > 0 and splat:
    # MLIR hands a splat back as one Python scalar, so np.full picks the dtype.
    first = flat[0]
    if hlo == "pred":
      scalar: Any = bool(first)
    elif hlo in _INT_DTYPES:
      scalar = int(first)
    elif hlo in ("c64", "c128"):
      scalar = complex(first)
    else:
      scalar = float(arr.reshape(-1)[0])
    return ir.ConstantArray(np.full(shape.dims, scalar))
  if hlo in _NATIVE:
    return ir.ConstantArray(arr.astype(_NATIVE[hlo]))
  return ir.ConstantArray(arr.astype(np.float64))


# --------------------------------------------------------------------------- attributes

def _dims_token(tok: _Tok, p: _Parser, parts: int) -> list[list[int]]:
  """``3x3`` (parts=1) or ``0_0x1_1`` (parts=2 or 3) into per-dimension int lists."""
  if tok.kind not in ("num", "dims", "hex"):
    raise p.error(f"expected dimensions like 1x2 or 0_0x1_1, found {tok.describe()}", tok)
  out = []
  for d in tok.text.split("x"):
    nums = [int(v) for v in re.findall(r"-?\d+", d)]
    if not nums or len(nums) > max(parts, 1) or (parts > 1 and len(nums) < 2):
      raise p.error(f"malformed dimensions {tok.text!r}", tok)
    out.append(nums)
  return out


_MAX_DEVICES = 1 << 24


def _device_count(p: _Parser, dims: list[int]) -> int:
  total = 1
  for d in dims:
    if d < 0:
      raise p.error("negative size in a device list")
    total *= d
  if total > _MAX_DEVICES:
    raise p.error(f"a device list of {total} devices is too large")
  return total


def _iota_groups(p: _Parser) -> np.ndarray:
  """``[G,S]<=[dims]T(perm)`` as a G x S device array."""
  p.expect("[")
  shape: list[int] = []
  while not p.accept("]"):
    shape.append(p.expect_int("in an iota list"))
    p.accept(",")
  p.expect("<=")
  p.expect("[")
  reshape: list[int] = []
  while not p.accept("]"):
    reshape.append(p.expect_int("in an iota list"))
    p.accept(",")
  perm = list(range(len(reshape)))
  if p.accept("T"):
    p.expect("(")
    perm = []
    while not p.accept(")"):
      perm.append(p.expect_int("in a transpose"))
      p.accept(",")
  total = _device_count(p, reshape)
  if sorted(perm) != list(range(len(reshape))) or int(np.prod(shape, dtype=np.int64)) != total:
    raise p.error("inconsistent iota device list")
  return np.arange(total).reshape(reshape).transpose(perm).reshape(shape)


def _device_list(p: _Parser) -> np.ndarray:
  """A mesh's device order: ``[2,4]T(1,0)``, ``[8]<=[2,4]T(1,0)`` or ``0,2,1,3``."""
  if p.at("["):
    p.next()
    dims: list[int] = []
    while not p.accept("]"):
      dims.append(p.expect_int("in a device list"))
      p.accept(",")
    total = _device_count(p, dims)
    reshape = dims
    if p.accept("<="):
      p.expect("[")
      reshape = []
      while not p.accept("]"):
        reshape.append(p.expect_int("in a device list"))
        p.accept(",")
    perm = list(range(len(reshape)))
    if p.accept("T"):
      p.expect("(")
      perm = []
      while not p.accept(")"):
        perm.append(p.expect_int("in a transpose"))
        p.accept(",")
    if sorted(perm) != list(range(len(reshape))) or int(np.prod(reshape, dtype=np.int64)) != total:
      raise p.error("inconsistent device list")
    return np.arange(total).reshape(reshape).transpose(perm).reshape(-1)
  close = "}" if p.accept("{") else None
  ids: list[int] = []
  while p.peek().kind == "num":
    ids.append(p.expect_int("device id"))
    p.accept(",")
  if close:
    p.expect(close)
  return np.array(ids, dtype=np.int64)


def _mesh_groups(p: _Parser, module: ir.Module, meshes: dict,
                 rest: Optional[_Parser] = None) -> np.ndarray:
  """``mesh['a'=2,'b'=4] {'b'}`` (also ``@mesh<"a"=2>``) expanded to device groups.

  A mesh with its own device order prints as ``mesh[...], device_ids=(...) {...}``;
  the attribute splitter then hands the part after the comma over as ``rest``.
  """
  p.next()  # mesh / @mesh
  close = "]" if p.accept("[") else (p.expect("<") and ">")
  axes: list[tuple[str, int]] = []
  while not p.accept(close):
    t = p.next()
    if t.kind not in ("sstr", "str", "name"):
      raise p.error(f"expected a mesh axis name, found {t.describe()}", t)
    axes.append((t.text[1:-1] if t.kind in ("sstr", "str") else t.text, 0))
    p.expect("=", "after a mesh axis name")
    axes[-1] = (axes[-1][0], p.expect_int("mesh axis size"))
    p.accept(",")
  if rest is not None:
    p.expect_done("the mesh")
    p = rest
  sizes = [s for _, s in axes]
  if not sizes or any(n <= 0 for n in sizes):
    raise p.error("a mesh needs axes of size 1 or more")
  total = _device_count(p, sizes)
  devices = np.arange(total)
  explicit = None
  if p.at("(") or p.at("device_ids"):
    if p.accept("device_ids"):
      p.expect("=")
    inner_close = ")" if p.accept("(") else None
    devices = _device_list(p)
    if inner_close:
      p.expect(")")
    if len(devices) != total:
      raise p.error(f"mesh device list has {len(devices)} devices for a mesh of {total}")
    if sorted(devices.tolist()) != list(range(total)):
      raise p.error("mesh device list is not a permutation of the devices")
    explicit = tuple(int(d) for d in devices)
    if explicit == tuple(range(total)):
      explicit = None
  devices = devices.reshape(sizes or [1])
  key = (tuple(axes), explicit)
  if key not in meshes:
    name = "mesh" if not meshes else f"mesh_{len(meshes)}"
    meshes[key] = name
    module.meshes[name] = ir.Mesh(tuple(axes), explicit)
  # The grouped axes; a sub-axis "a:(pre)size" splits axis a into pre x size x rest.
  p.expect("{", "before the grouped mesh axes")
  names = [a for a, _ in axes]
  picks: dict[int, list[tuple[int, int]]] = {}
  order: list[tuple[int, int, int]] = []
  while not p.accept("}"):
    t = p.next()
    if t.kind not in ("sstr", "str", "name"):
      raise p.error(f"expected a mesh axis name, found {t.describe()}", t)
    a = t.text[1:-1] if t.kind in ("sstr", "str") else t.text
    if a not in names:
      raise p.error(f"mesh has no axis {a!r}", t)
    ax = names.index(a)
    pre, size = 1, sizes[ax]
    if p.accept(":"):
      p.expect("(")
      pre = p.expect_int("sub-axis pre-size")
      p.expect(")")
      size = p.expect_int("sub-axis size")
      if pre <= 0 or size <= 0 or sizes[ax] % (pre * size):
        raise p.error(f"sub-axis {a}:({pre}){size} does not divide axis size {sizes[ax]}", t)
    picks.setdefault(ax, []).append((pre, size))
    order.append((ax, pre, size))
    p.accept(",")
  # Reshape every axis into its pieces, then move the grouped pieces last in the
  # order the axes were written (major to minor), as XLA's expansion does.
  new_shape: list[int] = []
  piece_index: dict[tuple[int, int, int], int] = {}
  for ax, full in enumerate(sizes):
    cuts = sorted(picks.get(ax, []))
    prefix = 1
    for pre, size in cuts:
      if pre != prefix:
        new_shape.append(pre // prefix)
        prefix = pre
      piece_index[(ax, pre, size)] = len(new_shape)
      new_shape.append(size)
      prefix *= size
    if prefix != full or not cuts:
      new_shape.append(full // prefix)
      if not cuts:
        piece_index[(ax, 1, full)] = len(new_shape) - 1
  # XLA groups the pieces in mesh-axis order (major to minor), whatever the order
  # they are written in.
  grouped = [piece_index[(ax, pre, size)] for ax in range(len(sizes))
             for a2, pre, size in order if a2 == ax]
  rest = [i for i in range(len(new_shape)) if i not in grouped]
  group_size = int(np.prod([new_shape[i] for i in grouped], dtype=np.int64)) if grouped else 1
  return devices.reshape(new_shape).transpose(rest + grouped).reshape(-1, group_size)


def _replica_groups(p: _Parser, module: ir.Module, meshes: dict,
                    rest: Optional[_Parser] = None) -> Any:
  """Any printed replica-group form as an array (rows = groups, -1 pads)."""
  if p.at("mesh") or p.at("@"):
    if p.at("@"):
      p.next()
    out = _mesh_groups(p, module, meshes, rest)
    p = rest or p
  elif p.at("["):
    out = _iota_groups(p)
  else:
    groups = p.nested_int_lists()
    if not groups:
      return np.zeros((0, 0), dtype=np.int64)
    width = max(len(g) for g in groups)
    out = np.array([g + [-1] * (width - len(g)) for g in groups], dtype=np.int64)
  p.expect_done("replica_groups")
  return out


def _frontend_attrs(p: _Parser) -> dict[str, str]:
  p.expect("{")
  out: dict[str, str] = {}
  while not p.accept("}"):
    k = p.next()
    if k.kind not in ("name", "word", "str"):
      raise p.error(f"expected a frontend attribute name, found {k.describe()}", k)
    key = _unescape(k.text[1:-1]) if k.kind == "str" else k.text
    p.expect("=", f"after frontend attribute {key}")
    v = p.peek()
    if p.at("{"):   # values that look like dictionaries are printed unquoted
      p.skip_balanced()
      out[key] = p.text[v.start:p.toks[p.i - 1].end]
      p.accept(",")
      continue
    p.next()
    if v.kind != "str":
      raise p.error(f"expected a quoted value for frontend attribute {key}, found "
                    f"{v.describe()}", v)
    out[key] = _unescape(v.text[1:-1])
    p.accept(",")
  return out


def _sharding_leaves(p: _Parser, span: _Span, n: int) -> list[str]:
  """A printed sharding split per tuple leaf (a non-tuple sharding repeats)."""
  toks = p.toks
  if span.hi - span.lo >= 2 and toks[span.lo].text == "{" and toks[span.lo + 1].text == "{":
    out = []
    depth = 0
    start = None
    for j in range(span.lo + 1, span.hi - 1):
      t = toks[j]
      if t.kind == "punct" and t.text in "([{":
        if depth == 0:
          start = t.start
        depth += 1
      elif t.kind == "punct" and t.text in ")]}":
        depth -= 1
        if depth == 0 and start is not None:
          out.append(p.text[start:t.end])
    if len(out) != n:
      raise InputError(p.path, f"tuple sharding has {len(out)} element(s) for {n} leaves",
                       line=span.line, column=span.col)
    return out
  return [span.text] * n


def _mlir_value(p: _Parser) -> Any:
  """A small MLIR attribute (typed-FFI backend_config) as stablehlo.py converts it."""
  t = p.peek()
  if p.at("{"):
    p.next()
    out: dict[str, Any] = {}
    while not p.accept("}"):
      k = p.next()
      if k.kind not in ("name", "word", "str"):
        raise p.error(f"expected a key, found {k.describe()}", k)
      key = _unescape(k.text[1:-1]) if k.kind == "str" else k.text
      out[key] = _mlir_value(p) if p.accept("=") else True
      p.accept(",")
    return out
  if p.at("["):
    p.next()
    items = []
    while not p.accept("]"):
      items.append(_mlir_value(p))
      p.accept(",")
    return tuple(items)
  if p.at("array"):
    p.next()
    p.expect("<")
    elem = p.next().text
    vals: list[Any] = []
    if p.accept(":"):
      while not p.at(">"):
        v = p.next()
        vals.append(v.text == "true" if elem == "i1" else
                    float(v.text) if elem.startswith(("f", "bf")) else int(v.text))
        p.accept(",")
    p.expect(">")
    return tuple(vals)
  p.next()
  if t.kind == "str":
    return _unescape(t.text[1:-1])
  if t.text in ("true", "false"):
    return t.text == "true"
  if t.kind == "num":
    is_int = re.fullmatch(r"[-+]?\d+", t.text) is not None
    ty = None
    if p.accept(":"):
      ty = p.next().text
    if is_int and not (ty or "").startswith(("f", "bf")):
      return int(t.text)
    return float(t.text)
  raise p.error(f"unsupported attribute value {t.describe()}", t)


# --------------------------------------------------------------------------- importer

# HLO opcodes that become one StableHLO (or MHLO) op with no attributes of their own.
_SIMPLE = {
    "abs": "abs", "and": "and", "atan2": "atan2", "bitcast-convert": "bitcast_convert",
    "count-leading-zeros": "count_leading_zeros", "ceil": "ceil", "clamp": "clamp",
    "complex": "complex", "divide": "divide", "floor": "floor", "is-finite": "is_finite",
    "imag": "imag", "maximum": "maximum", "minimum": "minimum", "multiply": "multiply",
    "negate": "negate", "not": "not", "or": "or", "partition-id": "partition_id",
    "popcnt": "popcnt", "power": "power", "real": "real", "remainder": "remainder",
    "replica-id": "replica_id", "reshape": "reshape",
    "round-nearest-afz": "round_nearest_afz", "round-nearest-even": "round_nearest_even",
    "select": "select", "shift-left": "shift_left",
    "shift-right-arithmetic": "shift_right_arithmetic",
    "shift-right-logical": "shift_right_logical", "sign": "sign", "subtract": "subtract",
    "xor": "xor",
    "acos": "mhlo.acos", "asin": "mhlo.asin", "acosh": "mhlo.acosh", "asinh": "mhlo.asinh",
    "atanh": "mhlo.atanh", "add-dependency": "mhlo.add_dependency", "cosh": "mhlo.cosh",
    "copy": "mhlo.copy", "erf": "mhlo.erf", "sinh": "mhlo.sinh",
    "stochastic-convert": "mhlo.stochastic_convert",
    "cbrt": "cbrt", "cosine": "cosine", "exponential": "exponential",
    "exponential-minus-one": "exponential_minus_one", "log": "log",
    "log-plus-one": "log_plus_one", "logistic": "logistic", "rsqrt": "rsqrt", "sine": "sine",
    "sqrt": "sqrt", "tan": "tan", "tanh": "tanh",
}
_BINARY_SAME_SHAPE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "power",
                      "remainder", "and", "or", "xor", "atan2", "shift-left",
                      "shift-right-arithmetic", "shift-right-logical", "compare", "complex"}
_UNARY_SAME_SHAPE = {"abs", "negate", "exponential", "log", "tanh", "sqrt", "rsqrt", "sine",
                     "cosine", "tan", "logistic", "floor", "ceil", "sign", "not",
                     "convert", "cbrt", "exponential-minus-one", "log-plus-one", "erf",
                     "is-finite", "round-nearest-afz", "round-nearest-even", "popcnt",
                     "count-leading-zeros", "real", "imag", "reduce-precision"}
_MANY = 1 << 30
# Operand counts of the opcodes the importer handles (the others are not checked).
_ARITY = {
    "dot": (2, 2), "transpose": (1, 1), "broadcast": (1, 1), "slice": (1, 1), "pad": (2, 2),
    "iota": (0, 0), "partition-id": (0, 0), "replica-id": (0, 0), "constant": (0, 0),
    "dynamic-slice": (2, _MANY), "dynamic-update-slice": (3, _MANY), "concatenate": (1, _MANY),
    "reverse": (1, 1), "clamp": (3, 3), "gather": (2, 2), "scatter": (3, _MANY),
    "reduce": (2, _MANY), "reduce-window": (2, _MANY), "select-and-scatter": (3, 3),
    "sort": (1, _MANY), "topk": (1, 1), "all-reduce": (1, _MANY), "all-gather": (1, _MANY),
    "reduce-scatter": (1, _MANY), "all-to-all": (1, _MANY), "collective-permute": (1, 1),
    "collective-broadcast": (1, 1), "while": (1, 1), "conditional": (1, _MANY),
    "opt-barrier": (1, 1), "rng-bit-generator": (1, 1), "bitcast": (1, 1),
    "get-dimension-size": (1, 1), "set-dimension-size": (2, 2), "cholesky": (1, 1),
    "convolution": (2, 2), "reduce-precision": (1, 1), "copy": (1, 1),
    "triangular-solve": (2, 2), "fft": (1, 1), "map": (1, _MANY),
    "batch-norm-training": (3, 3), "batch-norm-inference": (5, 5), "batch-norm-grad": (5, 5),
}
_ARRAY_OPERANDS = {"dot", "transpose", "broadcast", "slice", "pad", "dynamic-slice",
                   "dynamic-update-slice", "concatenate", "reverse", "clamp", "select", "gather",
                   "scatter", "reduce", "reduce-window", "select-and-scatter", "sort", "topk",
                   "all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                   "convolution", "bitcast", "reshape", "cholesky", "rng-bit-generator"}
_ONE_DIM = {"all-gather", "reduce-scatter", "concatenate", "get-dimension-size",
            "set-dimension-size"}
_KNOWN_ATTRS = {"metadata", "sharding", "frontend_attributes", "origin", "backend_config",
                "statistics_viz", "control-predecessors"}


def _plain(name: str) -> str:
  """The name stablehlo.py gives an MLIR op: without the dialects it drops."""
  return name.removeprefix("stablehlo.").removeprefix("func.").removeprefix("mhlo.")


def _sanitize(name: str) -> str:
  return name.replace("-", "_")


def _symbol_ref(name: str) -> str:
  if re.fullmatch(r"[A-Za-z_][\w$.]*", name):
    return "@" + name
  return '@"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Importer:
  def __init__(self, path: str, text: str, toks: list[_Tok], hlo: _HloModule):
    self.path = path
    self.text = text
    self.toks = toks
    self.hlo = hlo
    self.m = ir.Module(path, "hlo_text")
    self.comps: dict[str, _Computation] = {}
    self.func_names: dict[str, str] = {}
    self.meshes: dict = {}
    self.tuple_shapes: dict[int, _Shape] = {}  # id of a tuple-typed IR value -> its shape
    self._active: list[str] = []

  # -- helpers
  def parser(self, span: _Span) -> _Parser:
    return _Parser(self.path, self.text, self.toks, span.lo, span.hi)

  def err(self, msg: str, line: int, col: Optional[int] = None) -> InputError:
    return InputError(self.path, msg, line=line, column=col)

  def attr_ints(self, ins: _Instr, key: str, default: Optional[tuple] = None) -> tuple[int, ...]:
    span = ins.attrs.get(key)
    if span is None:
      if default is None:
        raise self.err(f"%{ins.name} ({ins.opcode}) needs attribute {key}", ins.line, ins.col)
      return default
    p = self.parser(span)
    out = p.int_list()
    p.expect_done(key)
    return out

  def attr_int(self, ins: _Instr, key: str, default: Optional[int] = None) -> int:
    span = ins.attrs.get(key)
    if span is None:
      if default is None:
        raise self.err(f"%{ins.name} ({ins.opcode}) needs attribute {key}", ins.line, ins.col)
      return default
    p = self.parser(span)
    out = p.expect_int(key)
    p.expect_done(key)
    return out

  def attr_bool(self, ins: _Instr, key: str) -> bool:
    span = ins.attrs.get(key)
    if span is None:
      return False
    if span.text not in ("true", "false"):
      raise self.err(f"attribute {key} of %{ins.name} must be true or false", span.line,
                     span.col)
    return span.text == "true"

  def attr_word(self, ins: _Instr, key: str, default: Optional[str] = None) -> str:
    span = ins.attrs.get(key)
    if span is None:
      if default is None:
        raise self.err(f"%{ins.name} ({ins.opcode}) needs attribute {key}", ins.line, ins.col)
      return default
    return _unescape(span.text[1:-1]) if span.text.startswith('"') else span.text

  def callee(self, ins: _Instr, key: str) -> _Computation:
    span = ins.attrs.get(key)
    if span is None:
      raise self.err(f"%{ins.name} ({ins.opcode}) needs attribute {key}", ins.line, ins.col)
    p = self.parser(span)
    t = p.peek()
    name = p.expect_name(f"a computation name for {key}")
    p.expect_done(key)
    return self.lookup(name, t)

  def callees(self, ins: _Instr, key: str) -> list[_Computation]:
    span = ins.attrs.get(key)
    if span is None:
      return []
    p = self.parser(span)
    out = [self.lookup(n, t) for n, t in p.name_list()]
    p.expect_done(key)
    return out

  def lookup(self, name: str, tok: _Tok) -> _Computation:
    comp = self.comps.get(name)
    if comp is None:
      raise self.err(f"computation %{name} is not defined", tok.line, tok.col)
    return comp

  # -- module
  def run(self) -> ir.Module:
    hlo, m = self.hlo, self.m
    for c in hlo.computations:
      if c.name in self.comps:
        raise self.err(f"computation {c.name} is defined twice", c.line, c.col)
      self.comps[c.name] = c
    entries = [c for c in hlo.computations if c.is_entry]
    if len(entries) > 1:
      raise self.err("more than one ENTRY computation", entries[1].line, entries[1].col)
    entry = entries[0] if entries else hlo.computations[-1]
    m.name = hlo.name
    m.attrs.update(self.module_attrs())
    taken = {"main"}
    for c in hlo.computations:
      if c is entry:
        self.func_names[c.name] = "main"
        continue
      name = _sanitize(c.name)
      k = 0
      while name in taken:
        name = f"{_sanitize(c.name)}_{k}"
        k += 1
      taken.add(name)
      self.func_names[c.name] = name
    for c in hlo.computations:
      g = self.import_func(c)
      m.functions[g.name] = g
    m.entry = "main"
    if entry.name.endswith("_spmd"):
      self.spmd_attrs(entry)
    if m.meshes and m.num_partitions == 1:
      m.num_partitions = max(mesh.size for mesh in m.meshes.values())
    return m

  def module_attrs(self) -> dict[str, Any]:
    a = self.hlo.attrs
    out: dict[str, Any] = {"mhlo.cross_program_prefetches": (), "mhlo.is_dynamic": False,
                           "mhlo.use_auto_spmd_partitioning": False, "sym_name": self.hlo.name,
                           "mhlo.input_output_alias": ()}
    if "num_partitions" in a:
      self.m.num_partitions = max(1, self._header_int("num_partitions"))
    if "is_dynamic" in a:
      out["mhlo.is_dynamic"] = a["is_dynamic"].text == "true"
    if "frontend_attributes" in a:
      fa = _frontend_attrs(self.parser(a["frontend_attributes"]))
      if fa:
        out["mhlo.frontend_attributes"] = fa
    if "input_output_alias" in a:
      out["mhlo.input_output_alias"] = self.io_alias(a["input_output_alias"])
    if "entry_computation_layout" in a:
      params, result = self.entry_layout(a["entry_computation_layout"])
      if any(s.has_custom_layout() for s in params):
        layouts = tuple(leaf.layout_attr() for s in params for leaf in s.leaves())
        out["mhlo.xla_entry_computation_parameter_layouts"] = layouts
        out["mhlo.xla_entry_computation_parameter_tiles"] = tuple(() for _ in layouts)
      if result is not None and result.has_custom_layout():
        layouts = tuple(leaf.layout_attr() for leaf in result.leaves())
        out["mhlo.xla_entry_computation_result_layout"] = layouts
        out["mhlo.xla_entry_computation_result_tiles"] = tuple(() for _ in layouts)
    return out

  def _header_int(self, key: str) -> int:
    p = self.parser(self.hlo.attrs[key])
    v = p.expect_int(key)
    p.expect_done(key)
    return v

  def io_alias(self, span: _Span) -> tuple:
    """``{ {0}: (0, {}, may-alias), ... }`` as the converter's list of dicts."""
    p = self.parser(span)
    p.expect("{")
    out = []
    while not p.accept("}"):
      output_index = p.int_list()
      p.expect(":")
      p.expect("(")
      number = p.expect_int("parameter number")
      p.expect(",")
      param_index = p.int_list()
      kind = "may_alias"
      if p.accept(","):
        k = p.next().text
        kind = {"may-alias": "may_alias", "must-alias": "must_alias"}.get(k, "undefined_alias")
      p.expect(")")
      p.accept(",")
      out.append({"alias": {"kind": kind, "parameter_index": param_index,
                            "parameter_number": number},
                  "output_index": output_index})
    return tuple(out)

  def entry_layout(self, span: _Span) -> tuple[list[_Shape], Optional[_Shape]]:
    """``{(params)->result}``: the entry computation's shapes with their layouts."""
    p = self.parser(span)
    p.expect("{")
    p.expect("(")
    params: list[_Shape] = []
    while not p.accept(")"):
      params.append(p.shape())
      p.accept(",")
    result = p.shape() if p.accept("->") else None
    return params, result

  def spmd_attrs(self, entry: _Computation) -> None:
    """Partitioned modules: the parameter (and root, if annotated) shardings."""
    shards = []
    for prm in entry.params:
      n = len(prm.shape.leaves())
      span = prm.attrs.get("sharding")
      shards += (_sharding_leaves(self.parser(span), span, n) if span is not None
                 else ["{replicated}"] * n)
    self.m.attrs["mhlo.spmd_parameters_shardings"] = tuple(shards)
    root_sharding = entry.root.attrs.get("sharding") if entry.root else None
    if root_sharding is not None:
      self.m.attrs["mhlo.spmd_output_sharding"] = root_sharding.text

  # -- locations
  def location(self, ins: _Instr) -> ir.Location:
    """XLA's GenerateInstructionLocation, as stablehlo.parse_location reads it back."""
    md: dict[str, Any] = {}
    span = ins.attrs.get("metadata")
    if span is not None:
      p = self.parser(span)
      md = p.dict_braces()
      p.expect_done("metadata")
    op_name = md.get("op_name", "")
    if not op_name:
      return ir.Location(op_name=ins.name)
    frame_id = _as_int(md.get("stack_frame_id", "0"))
    if frame_id:
      frame = self.frame(frame_id)
      if frame is not None:
        file, line, col = frame
        if file:
          return ir.Location(file, line, col, op_name)
        return ir.Location(op_name=op_name)
    source = md.get("source_file", "")
    if not source:
      return ir.Location(op_name=op_name)
    # A fused name+file location: parse_location finds the file but no name in it.
    return ir.Location(source, _as_int(md.get("source_line", "0")), 0, None)

  def frame(self, frame_id: int) -> Optional[tuple[str, int, int]]:
    t = self.hlo.tables
    f = t["StackFrames"].get(frame_id)
    if f is None:
      return None
    loc = t["FileLocations"].get(f.get("file_location_id", 0))
    if loc is None:
      return None
    file = t["FileNames"].get(loc.get("file_name_id", 0), "")
    func = t["FunctionNames"].get(loc.get("function_name_id", 0), "")
    if not file and not func and not loc.get("line", 0):
      return None
    return file, loc.get("line", 0), loc.get("column", 0)

  # -- computations
  def import_func(self, comp: _Computation) -> ir.Graph:
    g = ir.Graph(self.func_names[comp.name])
    args: list[ir.Value] = []
    for prm in comp.params:
      leaves = prm.shape.leaves()
      loc = self.location(prm)
      shard_span = prm.attrs.get("sharding")
      shards = (_sharding_leaves(self.parser(shard_span), shard_span, len(leaves))
                if shard_span is not None else None)
      fa = (_frontend_attrs(self.parser(prm.attrs["frontend_attributes"]))
            if "frontend_attributes" in prm.attrs else {})
      if fa and len(leaves) > 1:
        raise self.err(f"tuple parameter %{prm.name} cannot have frontend attributes",
                       prm.line, prm.col)
      replicated = self.param_replication(prm, len(leaves))
      for k, leaf in enumerate(leaves):
        v = self.m.new_value(leaf.ir_type(), name=f"arg{len(g.params)}")
        g.params.append(v)
        attrs: dict[str, Any] = {}
        if shards is not None:
          attrs["mhlo.sharding"] = shards[k]
        if fa:
          attrs["mhlo.frontend_attributes"] = fa
        if replicated[k]:
          attrs["mhlo.parameter_replication"] = (True,)
        g.param_attrs.append(attrs)
        g.param_locations.append(loc)
        args.append(v)
    for k, prm in enumerate(comp.params):
      if "origin" in prm.attrs and k < len(g.param_attrs):
        g.param_attrs[k]["mhlo.original_value"] = prm.attrs["origin"].text
    root = self.import_body(comp, g, args)
    g.results = self.flatten(g, root)
    root_ins = comp.root
    assert root_ins is not None
    span = root_ins.attrs.get("sharding")
    if span is not None and root_ins.shape.dtype != "token":
      shards = _sharding_leaves(self.parser(span), span, len(g.results))
      g.result_attrs = [{"mhlo.sharding": s} for s in shards]
    elif span is not None:
      g.result_attrs = [{"mhlo.sharding": span.text}]
    else:
      g.result_attrs = [{} for _ in g.results]
    self.cleanup(g)
    return g

  def param_replication(self, prm: _Instr, n: int) -> list[bool]:
    span = prm.attrs.get("parameter_replication")
    if span is None:
      return [False] * n
    p = self.parser(span)
    p.expect("{")
    vals = []
    while not p.accept("}"):
      vals.append(p.next().text == "true")
      p.accept(",")
    return (vals + [False] * n)[:n] if len(vals) != 1 or n == 1 else vals * n

  def import_region(self, comp: _Computation, name: str,
                    bind: Optional[list[ir.Value]] = None) -> ir.Graph:
    """A computation inlined as an op's region; ``bind`` replaces its parameters."""
    name = _plain(name)
    g = ir.Graph(name)
    args: list[ir.Value] = []
    for prm in comp.params:
      for leaf in prm.shape.leaves():
        if bind is None:
          v = self.m.new_value(leaf.ir_type(), name=f"{name}.arg{len(g.params)}")
          g.params.append(v)
          g.param_attrs.append({})
          g.param_locations.append(ir.UNKNOWN_LOCATION)
        else:
          if len(args) >= len(bind):
            raise self.err(f"computation {comp.name} takes more operands than it is given",
                           comp.line, comp.col)
          v = bind[len(args)]
        args.append(v)
    if bind is not None and len(args) != len(bind):
      raise self.err(f"computation {comp.name} takes {len(args)} value(s) but is given "
                     f"{len(bind)}", comp.line, comp.col)
    root = self.import_body(comp, g, args)
    g.results = self.flatten(g, root)
    self.cleanup(g)
    return g

  def import_body(self, comp: _Computation, g: ir.Graph, args: list[ir.Value]) -> ir.Value:
    if comp.name in self._active:
      raise self.err(f"computation {comp.name} calls itself", comp.line, comp.col)
    self._active.append(comp.name)
    try:
      values: dict[str, ir.Value] = {}
      k = 0
      for prm in comp.params:   # tuple parameters are rebuilt from their leaves
        n = len(prm.shape.leaves())
        values[prm.name] = self.rebuild_tuple(g, prm.shape, args[k:k + n])
        k += n
      for ins in self.post_order(comp):
        if ins.opcode == "parameter":
          continue
        operands = [values[o] for o in ins.operands]
        values[ins.name] = self.instruction(g, ins, operands)
      assert comp.root is not None
      return values[comp.root.name]
    finally:
      self._active.pop()

  def rebuild_tuple(self, g: ir.Graph, shape: _Shape, leaves: list[ir.Value]) -> ir.Value:
    if not shape.is_tuple:
      return leaves[0]
    parts, k = [], 0
    for e in shape.elements:
      n = len(e.leaves())
      parts.append(self.rebuild_tuple(g, e, leaves[k:k + n]))
      k += n
    return self.make_tuple(g, parts, shape, ir.UNKNOWN_LOCATION, {})

  def post_order(self, comp: _Computation) -> list[_Instr]:
    """HloComputation::MakeInstructionPostOrder over the printed instruction order."""
    by_name = comp.by_name
    for ins in comp.instrs:
      for name, tok in zip(ins.operands, ins.operand_toks):
        if name not in by_name:
          raise self.err(f"operand %{name} of %{ins.name} is not defined in computation "
                         f"{comp.name}", tok.line, tok.col)
      for name in ins.control_predecessors:
        if name not in by_name:
          raise self.err(f"control predecessor %{name} of %{ins.name} is not defined",
                         ins.line, ins.col)
    users: dict[str, int] = {}
    for ins in comp.instrs:
      for name in set(ins.operands):
        users[name] = users.get(name, 0) + 1
    state: dict[str, int] = {}   # 1 visiting, 2 visited
    order: list[_Instr] = []
    for start in comp.instrs:
      if users.get(start.name) or state.get(start.name) == 2:
        continue
      stack = [start]
      while stack:
        cur = stack[-1]
        st = state.get(cur.name, 0)
        if st:
          stack.pop()
          if st == 1:
            state[cur.name] = 2
            order.append(cur)
          continue
        state[cur.name] = 1
        pushes = [by_name[o] for o in reversed(cur.operands)]
        pushes += [by_name[o] for o in cur.control_predecessors]
        for nxt in pushes:
          s = state.get(nxt.name, 0)
          if s == 1 and nxt.name in (cur.operands + cur.control_predecessors):
            raise self.err(f"%{cur.name} depends on itself through %{nxt.name} (a cycle)",
                           cur.line, cur.col)
          if s != 2:
            stack.append(nxt)
    if len(order) != len(comp.instrs):
      left = next(i for i in comp.instrs if state.get(i.name) != 2)
      raise self.err(f"%{left.name} is part of a cycle of operands", left.line, left.col)
    return order

  # -- tuples, the way XLA's importer builds and folds them
  def make_tuple(self, g: ir.Graph, parts: list[ir.Value], shape: _Shape,
                 loc: ir.Location, attrs: dict) -> ir.Value:
    op = self.m.add_op(g, "tuple", parts, [ir.TensorType((), "tuple")], attrs, [], loc)
    self.tuple_shapes[op.result.id] = shape
    return op.result

  def tuple_from_results(self, g: ir.Graph, results: list[ir.Value], shape: _Shape,
                         loc: ir.Location) -> ir.Value:
    """CreateTupleFromOpResults: nested tuple ops over a multi-result op's results."""
    if not shape.is_tuple:
      return results[0]
    it = iter(results)

    def build(s: _Shape) -> ir.Value:
      if not s.is_tuple:
        return next(it)
      return self.make_tuple(g, [build(e) for e in s.elements], s, loc, {})

    return build(shape)

  def shape_of(self, v: ir.Value) -> Optional[_Shape]:
    return self.tuple_shapes.get(v.id)

  def gte(self, g: ir.Graph, v: ir.Value, index: int, attrs: dict,
          shape: Optional[_Shape] = None) -> ir.Value:
    prod = v.producer
    if prod is not None and prod.name == "tuple":
      return prod.operands[index]
    tshape = self.shape_of(v)
    assert tshape is not None
    elem = tshape.elements[index]
    attrs = dict(attrs)
    attrs["index"] = index
    loc = prod.location if prod is not None else ir.UNKNOWN_LOCATION
    op = self.m.add_op(g, "get_tuple_element", [v], [elem.ir_type()], attrs, [], loc)
    if elem.is_tuple:
      self.tuple_shapes[op.result.id] = elem
    return op.result

  def flatten(self, g: ir.Graph, v: ir.Value) -> list[ir.Value]:
    if v.type.dtype != "tuple":
      return [v]
    shape = self.shape_of(v)
    if shape is None:
      return [v]
    out: list[ir.Value] = []
    for k in range(len(shape.elements)):
      out += self.flatten(g, self.gte(g, v, k, {}))
    return out

  def cleanup(self, g: ir.Graph) -> None:
    """Drop tuple ops nothing uses any more (XLA's CleanUpTupleOps)."""
    while True:
      used: set[int] = {v.id for v in g.results}

      def mark(graph: ir.Graph) -> None:
        for op in graph.ops:
          for v in op.operands:
            used.add(v.id)
          for r in op.regions:
            mark(r)
          for r in op.regions:
            for v in r.results:
              used.add(v.id)

      mark(g)
      keep = [op for op in g.ops if op.name != "tuple" or op.result.id in used]
      if len(keep) == len(g.ops):
        return
      g.ops = keep

  # -- instructions
  def base_attrs(self, ins: _Instr) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "sharding" in ins.attrs:
      out["mhlo.sharding"] = ins.attrs["sharding"].text
    if "origin" in ins.attrs:
      out["mhlo.original_value"] = ins.attrs["origin"].text
    if "frontend_attributes" in ins.attrs:
      fa = _frontend_attrs(self.parser(ins.attrs["frontend_attributes"]))
      if fa:
        out["mhlo.frontend_attributes"] = fa
    return out

  def layout_attrs(self, ins: _Instr, attrs: dict) -> None:
    """ImportInstructionWithLayout: xla_shape for tuples/tokens and custom layouts."""
    custom = ins.shape.has_custom_layout()
    if ins.shape.is_tuple or ins.shape.dtype == "token" or custom:
      attrs["xla_shape"] = ins.shape.text
    if custom:
      attrs["result_layout"] = ins.shape.layout_attr()

  def emit(self, g: ir.Graph, name: str, ins: _Instr, operands: list[ir.Value],
           attrs: dict, regions: Optional[list[ir.Graph]] = None,
           result_shapes: Optional[list[_Shape]] = None, loc: Optional[ir.Location] = None,
           canonical: bool = True) -> ir.Op:
    """The op for ``ins``: attributes canonicalized as stablehlo.py does, the
    instruction's location, results named after it (``name#k`` when several)."""
    shapes = result_shapes if result_shapes is not None else [ins.shape]
    if len(shapes) == 1 and shapes[0] is ins.shape:
      self.layout_attrs(ins, attrs)   # the op stands for the instruction itself
    if canonical:   # as stablehlo.py does for every op it reads
      name, attrs = _canonicalize(_plain(name), attrs, operands, self.m)
    names = ([ins.name] if len(shapes) == 1 else [f"{ins.name}#{k}" for k in range(len(shapes))])
    op = self.m.add_op(g, name, operands, [s.ir_type() for s in shapes], attrs, regions or [],
                       loc or self.location(ins), names)
    for r, s in zip(op.results, shapes):
      if s.is_tuple:
        self.tuple_shapes[r.id] = s
    return op

  def check(self, ins: _Instr, operands: list[ir.Value]) -> None:
    """Cheap consistency checks, so a broken dump fails here and not in a pass."""
    op = ins.opcode
    shp = ins.shape

    def fail(msg: str):
      raise self.err(f"%{ins.name} ({op}): {msg}", ins.line, ins.col)

    def arity(*ns: int):
      if len(operands) not in ns:
        fail(f"expects {' or '.join(map(str, ns))} operand(s), got {len(operands)}")

    def dims(v: ir.Value) -> tuple[int, ...]:
      return v.type.shape

    if op in _BINARY_SAME_SHAPE:
      arity(2)
      if any(v.type.dtype == "tuple" for v in operands):
        fail("operands must be arrays, not tuples")
      if dims(operands[0]) != dims(operands[1]) or dims(operands[0]) != shp.dims:
        fail(f"operand shapes {operands[0].type} and {operands[1].type} do not match the "
             f"result {shp}")
      if op == "compare" and shp.dtype != "pred":
        fail("compare must produce pred")
    elif op in _UNARY_SAME_SHAPE:
      arity(1)
      if operands[0].type.dtype == "tuple" or dims(operands[0]) != shp.dims:
        fail(f"operand shape {operands[0].type} does not match the result {shp}")
    elif op == "select":
      arity(3)
      if dims(operands[1]) != shp.dims or dims(operands[2]) != shp.dims:
        fail(f"operand shapes do not match the result {shp}")
    elif op == "reshape":
      arity(1)
      if int(np.prod(dims(operands[0]), dtype=np.int64)) != int(np.prod(shp.dims, dtype=np.int64)):
        fail(f"cannot reshape {operands[0].type} into {shp}: element counts differ")
    elif op == "get-tuple-element":
      arity(1)
      tshape = self.shape_of(operands[0])
      if tshape is None:
        fail("operand is not a tuple")
      idx = self.attr_int(ins, "index")
      if not 0 <= idx < len(tshape.elements):
        fail(f"index {idx} is out of range for a {len(tshape.elements)}-tuple")
      if not tshape.elements[idx].same_as(shp):
        fail(f"element {idx} has shape {tshape.elements[idx]}, not {shp}")
    elif op in _ARITY:
      lo, hi = _ARITY[op]
      if not lo <= len(operands) <= hi:
        fail(f"expects {lo if lo == hi else f'{lo} to {hi}'} operand(s), got {len(operands)}")
    if op in _ARRAY_OPERANDS and any(v.type.dtype == "tuple" for v in operands):
      fail("operands must be arrays, not tuples")
    if op in _ONE_DIM:
      if len(self.attr_ints(ins, "dimensions")) != 1:
        fail("needs exactly one dimension in dimensions={...}")
    if op == "transpose":
      perm = self.attr_ints(ins, "dimensions")
      src = dims(operands[0])
      if sorted(perm) != list(range(len(src))) or tuple(src[d] for d in perm) != shp.dims:
        fail(f"dimensions={{{','.join(map(str, perm))}}} does not transpose {operands[0].type} "
             f"into {shp}")
    if op == "broadcast":
      bd = self.attr_ints(ins, "dimensions")
      src = dims(operands[0])
      if len(bd) != len(src) or any(not 0 <= d < len(shp.dims)
                                    or (src[k] != shp.dims[d] and src[k] != 1)
                                    for k, d in enumerate(bd)):
        fail(f"dimensions={{{','.join(map(str, bd))}}} does not broadcast {operands[0].type} "
             f"into {shp}")
    if op == "gather":
      problem = gather_violation(
          dims(operands[0]), dims(operands[1]), shp.dims,
          *(self.attr_ints(ins, k, ()) for k in (
              "offset_dims", "collapsed_slice_dims", "operand_batching_dims",
              "start_indices_batching_dims", "start_index_map")),
          self.attr_int(ins, "index_vector_dim", 0), self.attr_ints(ins, "slice_sizes"))
      if problem is None and operands[0].type.dtype != shp.ir_type().dtype:  # (C23)
        problem = f"the result's element type {shp.dtype} is not the operand's"
      index_type = operands[1].type.dtype
      if problem is None and (not is_integer_type(index_type) or index_type == "pred"):
        problem = f"start indices must be integers, not {index_type}"  # (I2)
      if problem is not None:
        fail(problem)
    if op == "dot":
      lc = self.attr_ints(ins, "lhs_contracting_dims", ())
      rc = self.attr_ints(ins, "rhs_contracting_dims", ())
      lhs, rhs = dims(operands[0]), dims(operands[1])
      if len(lc) != len(rc) or any(not 0 <= a < len(lhs) or not 0 <= b < len(rhs)
                                   or lhs[a] != rhs[b] for a, b in zip(lc, rc)):
        fail(f"contracting dimensions do not match between {operands[0].type} and "
             f"{operands[1].type}")

  def instruction(self, g: ir.Graph, ins: _Instr, operands: list[ir.Value]) -> ir.Value:
    self.check(ins, operands)
    op = ins.opcode
    handler = _HANDLERS.get(op)
    if handler is not None:
      return handler(self, g, ins, operands)
    if op in _SIMPLE:
      attrs = self.base_attrs(ins)
      if op in ("cbrt", "cosine", "exponential", "exponential-minus-one", "log",
                "log-plus-one", "logistic", "rsqrt", "sine", "sqrt", "tan", "tanh") \
          and "result_accuracy" in ins.attrs:
        attrs["result_accuracy"] = self.result_accuracy(ins)
      self.layout_attrs(ins, attrs)
      return self.emit(g, _SIMPLE[op], ins, operands, attrs).result
    return self.opaque(g, ins, operands)

  def opaque(self, g: ir.Graph, ins: _Instr, operands: list[ir.Value]) -> ir.Value:
    """An op this importer does not know: kept under its HLO name with raw attributes."""
    attrs = self.base_attrs(ins)
    for k, span in ins.attrs.items():
      if k not in _KNOWN_ATTRS:
        one_string = span.hi - span.lo == 1 and self.toks[span.lo].kind == "str"
        attrs[k] = _unescape(span.text[1:-1]) if one_string else span.text
    if "backend_config" in ins.attrs:
      attrs["backend_config"] = self.raw_backend_config(ins)
    self.layout_attrs(ins, attrs)
    return self.emit(g, ins.opcode, ins, operands, attrs, canonical=False).result

  def result_accuracy(self, ins: _Instr) -> str:
    p = self.parser(ins.attrs["result_accuracy"])
    d = p.dict_braces()
    if "mode" in d and d["mode"] not in ("DEFAULT", "default"):
      return f"#stablehlo.result_accuracy<mode = #stablehlo.result_accuracy_mode<{d['mode'].upper()}>>"
    parts = []
    tol = d.get("tolerance")
    if isinstance(tol, str) and tol.startswith("{"):
      sub = re.findall(r"(\w+)=([-+\w.]+)", tol)
      vals = dict(sub)
      if float(vals.get("atol", 0)):
        parts.append(f"atol = {float(vals['atol']):.6e}")
      if float(vals.get("rtol", 0)):
        parts.append(f"rtol = {float(vals['rtol']):.6e}")
      if int(vals.get("ulps", 0)):
        parts.append(f"ulps = {int(vals['ulps'])}")
    parts.append("mode = #stablehlo.result_accuracy_mode<TOLERANCE>")
    return f"#stablehlo.result_accuracy<{', '.join(parts)}>"

  def raw_backend_config(self, ins: _Instr) -> str:
    span = ins.attrs.get("backend_config")
    if span is None:
      return ""
    if span.text.startswith('"') and span.hi - span.lo == 1:
      return _unescape(span.text[1:-1])
    return span.text

  def replica_groups(self, ins: _Instr) -> Any:
    span = ins.attrs.get("replica_groups")
    if span is None:
      return ()
    rest = ins.attrs.get("device_ids")
    return _replica_groups(self.parser(span), self.m, self.meshes,
                           self.parser(rest) if rest is not None else None)

  def collective_attrs(self, ins: _Instr, attrs: dict) -> None:
    attrs["replica_groups"] = self.replica_groups(ins)
    if "channel_id" in ins.attrs:
      attrs["channel_handle"] = self.attr_int(ins, "channel_id")
    if self.attr_bool(ins, "use_global_device_ids"):
      attrs["use_global_device_ids"] = True


def _as_int(v: Any) -> int:
  try:
    return int(v)
  except (TypeError, ValueError):
    return 0


# --------------------------------------------------------------------------- op handlers

_Handler = Callable[[_Importer, ir.Graph, _Instr, list[ir.Value]], ir.Value]
_HANDLERS: dict[str, _Handler] = {}


def _handles(*opcodes: str):
  def register(fn: _Handler) -> _Handler:
    for o in opcodes:
      _HANDLERS[o] = fn
    return fn
  return register


@_handles("constant")
def _constant(im: _Importer, g, ins, operands):
  assert ins.literal is not None
  value = _parse_literal(im.parser(ins.literal), ins.shape, ins.name)
  attrs = {"value": value}
  attrs.update(im.base_attrs(ins))
  im.layout_attrs(ins, attrs)
  return im.emit(g, "constant", ins, [], attrs).result


@_handles("iota")
def _iota(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["iota_dimension"] = im.attr_int(ins, "iota_dimension")
  if not 0 <= attrs["iota_dimension"] < max(len(ins.shape.dims), 1):
    raise im.err(f"%{ins.name}: iota_dimension is out of range for {ins.shape}", ins.line)
  im.layout_attrs(ins, attrs)
  return im.emit(g, "iota", ins, [], attrs).result


@_handles("broadcast")
def _broadcast(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["broadcast_dimensions"] = im.attr_ints(ins, "dimensions")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "broadcast_in_dim", ins, operands, attrs).result


@_handles("transpose")
def _transpose(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["permutation"] = im.attr_ints(ins, "dimensions")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "transpose", ins, operands, attrs).result


_PRECISIONS = {"default": "DEFAULT", "high": "HIGH", "highest": "HIGHEST"}


def _precision_config(im: _Importer, ins: _Instr, n: int) -> tuple:
  span = ins.attrs.get("operand_precision")
  if span is None:
    return tuple("#stablehlo<precision DEFAULT>" for _ in range(n))
  p = im.parser(span)
  p.expect("{")
  out = []
  while not p.accept("}"):
    t = p.next()
    out.append(f"#stablehlo<precision {_PRECISIONS.get(t.text.lower(), t.text.upper())}>")
    p.accept(",")
  return tuple(out)


@_handles("dot")
def _dot(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["precision_config"] = _precision_config(im, ins, 2)
  lb = im.attr_ints(ins, "lhs_batch_dims", ())
  rb = im.attr_ints(ins, "rhs_batch_dims", ())
  lc = im.attr_ints(ins, "lhs_contracting_dims", ())
  rc = im.attr_ints(ins, "rhs_contracting_dims", ())
  lhs_rank, rhs_rank = operands[0].type.rank, operands[1].type.rank
  default = (lhs_rank <= 2 and rhs_rank <= 2 and not lb and not rb
             and lc == ((0,) if lhs_rank == 1 else (1,)) and rc == (0,))
  im.layout_attrs(ins, attrs)
  if default:
    return im.emit(g, "dot", ins, operands, attrs).result
  attrs["dot_dimension_numbers"] = {"lhs_batch": lb, "rhs_batch": rb, "lhs_contract": lc,
                                    "rhs_contract": rc}
  return im.emit(g, "dot_general", ins, operands, attrs).result


@_handles("add")
def _add(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  im.layout_attrs(ins, attrs)
  return im.emit(g, "or" if ins.shape.dtype == "pred" else "add", ins, operands, attrs).result


@_handles("convert")
def _convert(im, g, ins, operands):
  if ins.shape.dtype != "pred":
    attrs = im.base_attrs(ins)
    im.layout_attrs(ins, attrs)
    return im.emit(g, "convert", ins, operands, attrs).result
  # Convert to pred is "!= 0": a zero constant and a compare, as XLA's importer does.
  src = operands[0]
  loc = im.location(ins)
  zero = {"pred": False}.get(src.type.dtype, 0.0 if src.type.dtype.startswith(("f", "bf"))
                             else 0j if src.type.dtype.startswith("complex") else 0)
  value = np.broadcast_to(np.asarray(zero), src.shape)   # no copy: the shape may be huge
  c = im.m.add_op(g, "constant", [], [src.type], {"value": ir.ConstantArray(value)}, [], loc)
  attrs = {"comparison_direction": "NE"}
  im.layout_attrs(ins, attrs)
  return im.emit(g, "compare", ins, [src, c.result], attrs, loc=loc).result


@_handles("compare")
def _compare(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["comparison_direction"] = im.attr_word(ins, "direction")
  if attrs["comparison_direction"] not in ("EQ", "NE", "GE", "GT", "LE", "LT"):
    raise im.err(f"%{ins.name}: unknown comparison direction "
                 f"{attrs['comparison_direction']!r}", ins.line)
  if "type" in ins.attrs:
    dtype = operands[0].type.dtype
    default = ("FLOAT" if dtype.startswith(("f", "bf", "complex")) else
               "UNSIGNED" if dtype.startswith("ui") or dtype == "pred" else "SIGNED")
    ctype = im.attr_word(ins, "type")
    if ctype != default:
      attrs["compare_type"] = f"#stablehlo<comparison_type {ctype}>"
  im.layout_attrs(ins, attrs)
  return im.emit(g, "compare", ins, operands, attrs).result


@_handles("after-all")
def _after_all(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  im.layout_attrs(ins, attrs)
  return im.emit(g, "create_token" if not operands else "after_all", ins, operands, attrs).result


@_handles("tuple")
def _tuple(im, g, ins, operands):
  if len(operands) != len(ins.shape.elements) and ins.shape.is_tuple:
    raise im.err(f"%{ins.name}: tuple of {len(operands)} operand(s) has shape {ins.shape}",
                 ins.line)
  attrs = im.base_attrs(ins)
  im.layout_attrs(ins, attrs)
  return im.make_tuple(g, operands, ins.shape, im.location(ins), attrs)


@_handles("get-tuple-element")
def _get_tuple_element(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  im.layout_attrs(ins, attrs)
  return im.gte(g, operands[0], im.attr_int(ins, "index"), attrs)


@_handles("slice")
def _slice(im, g, ins, operands):
  span = ins.attrs.get("slice")
  if span is None:
    raise im.err(f"%{ins.name} (slice) needs attribute slice", ins.line)
  p = im.parser(span)
  p.expect("{")
  starts, limits, strides = [], [], []
  while not p.accept("}"):
    p.expect("[")
    starts.append(p.expect_int("slice start"))
    p.expect(":")
    limits.append(p.expect_int("slice limit"))
    strides.append(p.expect_int("slice stride") if p.accept(":") else 1)
    p.expect("]")
    p.accept(",")
  src = operands[0].type.shape
  if len(starts) != len(src):
    raise im.err(f"%{ins.name}: slice has {len(starts)} ranges for rank-{len(src)} operand",
                 span.line, span.col)
  for k, (a, b, s) in enumerate(zip(starts, limits, strides)):
    if not (0 <= a <= b <= src[k]) or s <= 0 or -(-(b - a) // s) != ins.shape.dims[k]:
      raise im.err(f"%{ins.name}: slice [{a}:{b}:{s}] of dimension {k} (size {src[k]}) does "
                   f"not give {ins.shape}", span.line, span.col)
  attrs = im.base_attrs(ins)
  attrs.update({"start_indices": tuple(starts), "limit_indices": tuple(limits),
                "strides": tuple(strides)})
  im.layout_attrs(ins, attrs)
  return im.emit(g, "slice", ins, operands, attrs).result


@_handles("dynamic-slice")
def _dynamic_slice(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["slice_sizes"] = im.attr_ints(ins, "dynamic_slice_sizes")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "dynamic_slice", ins, operands, attrs).result


@_handles("dynamic-update-slice")
def _dynamic_update_slice(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  im.layout_attrs(ins, attrs)
  return im.emit(g, "dynamic_update_slice", ins, operands, attrs).result


@_handles("concatenate")
def _concatenate(im, g, ins, operands):
  dims = im.attr_ints(ins, "dimensions")
  if len(dims) != 1:
    raise im.err(f"%{ins.name}: concatenate needs one dimension", ins.line)
  attrs = im.base_attrs(ins)
  attrs["dimension"] = dims[0]
  im.layout_attrs(ins, attrs)
  return im.emit(g, "concatenate", ins, operands, attrs).result


@_handles("reverse")
def _reverse(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["dimensions"] = im.attr_ints(ins, "dimensions")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "reverse", ins, operands, attrs).result


@_handles("pad")
def _pad(im, g, ins, operands):
  span = ins.attrs.get("padding")
  if span is None:
    raise im.err(f"%{ins.name} (pad) needs attribute padding", ins.line)
  p = im.parser(span)
  per_dim = _dims_token(p.next(), p, 3)
  p.expect_done("padding")
  if len(per_dim) != operands[0].type.rank:
    raise im.err(f"%{ins.name}: padding has {len(per_dim)} dimension(s) for a rank-"
                 f"{operands[0].type.rank} operand", span.line, span.col)
  attrs = im.base_attrs(ins)
  attrs.update({"edge_padding_low": tuple(d[0] for d in per_dim),
                "edge_padding_high": tuple(d[1] for d in per_dim),
                "interior_padding": tuple(d[2] if len(d) > 2 else 0 for d in per_dim)})
  im.layout_attrs(ins, attrs)
  return im.emit(g, "pad", ins, operands, attrs).result


@_handles("reduce-precision")
def _reduce_precision(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["exponent_bits"] = im.attr_int(ins, "exponent_bits")
  attrs["mantissa_bits"] = im.attr_int(ins, "mantissa_bits")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "reduce_precision", ins, operands, attrs).result


@_handles("get-dimension-size", "set-dimension-size")
def _dimension_size(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["dimension"] = im.attr_ints(ins, "dimensions")[0]
  im.layout_attrs(ins, attrs)
  name = ins.opcode.replace("-", "_")
  return im.emit(g, name, ins, operands, attrs).result


@_handles("cholesky")
def _cholesky(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["lower"] = im.attr_bool(ins, "lower")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "cholesky", ins, operands, attrs).result


@_handles("triangular-solve")
def _triangular_solve(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs.update({"left_side": im.attr_bool(ins, "left_side"), "lower": im.attr_bool(ins, "lower"),
                "unit_diagonal": im.attr_bool(ins, "unit_diagonal"),
                "transpose_a": f"#stablehlo<transpose "
                               f"{im.attr_word(ins, 'transpose_a', 'NO_TRANSPOSE')}>"})
  return im.emit(g, "triangular_solve", ins, operands, attrs).result


@_handles("fft")
def _fft(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["fft_type"] = f"#stablehlo<fft_type {im.attr_word(ins, 'fft_type', 'FFT')}>"
  attrs["fft_length"] = im.attr_ints(ins, "fft_length")
  return im.emit(g, "fft", ins, operands, attrs).result


@_handles("map")
def _map(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["dimensions"] = im.attr_ints(ins, "dimensions")
  region = im.import_region(im.callee(ins, "to_apply"), "map.r0")
  return im.emit(g, "map", ins, operands, attrs, [region]).result


@_handles("batch-norm-training", "batch-norm-inference", "batch-norm-grad")
def _batch_norm(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  span = ins.attrs.get("epsilon")
  if span is None:
    raise im.err(f"%{ins.name} ({ins.opcode}) needs attribute epsilon", ins.line)
  p = im.parser(span)
  eps = _scalar(p.next(), "f32", p)
  p.expect_done("epsilon")
  attrs["epsilon"] = float(np.float32(eps))    # an f32 attribute, read back as a double
  attrs["feature_index"] = im.attr_int(ins, "feature_index")
  name = ins.opcode.replace("-", "_")
  op = im.emit(g, name, ins, operands, attrs, None, _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


@_handles("bitcast")
def _bitcast(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  im.layout_attrs(ins, attrs)
  attrs["result_layout"] = ins.shape.layout_attr()
  src = im.shape_of(operands[0])
  attrs["source_layout"] = (src.layout_attr() if src is not None else
                            ir.ConstantArray(np.arange(operands[0].type.rank - 1, -1, -1, dtype=np.int64)))
  return im.emit(g, "mhlo.bitcast", ins, operands, attrs).result


def _collective_result_shapes(ins: _Instr) -> list[_Shape]:
  return list(ins.shape.elements) if ins.shape.is_tuple else [ins.shape]


def _wrap(im: _Importer, g: ir.Graph, ins: _Instr, op: ir.Op) -> ir.Value:
  if ins.shape.is_tuple:
    return im.tuple_from_results(g, op.results, ins.shape, op.location)
  return op.result


@_handles("all-reduce")
def _all_reduce(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  im.collective_attrs(ins, attrs)
  region = im.import_region(im.callee(ins, "to_apply"), "all_reduce.r0")
  op = im.emit(g, "all_reduce", ins, operands, attrs, [region], _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


@_handles("reduce-scatter")
def _reduce_scatter(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["scatter_dimension"] = im.attr_ints(ins, "dimensions")[0]
  im.collective_attrs(ins, attrs)
  region = im.import_region(im.callee(ins, "to_apply"), "reduce_scatter.r0")
  return im.emit(g, "reduce_scatter", ins, operands, attrs, [region]).result


@_handles("all-gather")
def _all_gather(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["all_gather_dim"] = im.attr_ints(ins, "dimensions")[0]
  im.collective_attrs(ins, attrs)
  op = im.emit(g, "all_gather", ins, operands, attrs, None, _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


@_handles("all-to-all")
def _all_to_all(im, g, ins, operands):
  groups = im.replica_groups(ins)
  if ins.shape.is_tuple or "dimensions" not in ins.attrs:
    attrs: dict[str, Any] = {"replica_groups": ir.ConstantArray(np.asarray(groups, dtype=np.int64))}
    if "channel_id" in ins.attrs:
      attrs["channel_handle"] = (f"#mhlo.channel_handle<handle = "
                                 f"{im.attr_int(ins, 'channel_id')}, type = 0>")
    op = im.emit(g, "mhlo.all_to_all", ins, operands, attrs, None,
                 _collective_result_shapes(ins))
    return _wrap(im, g, ins, op)
  dims = im.attr_ints(ins, "dimensions")
  if len(dims) != 1 or not 0 <= dims[0] < operands[0].type.rank:
    raise im.err(f"%{ins.name}: all-to-all needs one split dimension of its operand", ins.line)
  dim = dims[0]
  attrs = {"split_dimension": dim, "concat_dimension": dim, "replica_groups": groups,
           "split_count": len(groups[0]) if len(groups) else 0}
  if "channel_id" in ins.attrs:
    attrs["channel_handle"] = im.attr_int(ins, "channel_id")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "all_to_all", ins, operands, attrs).result


@_handles("collective-permute")
def _collective_permute(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  span = ins.attrs.get("source_target_pairs")
  pairs = im.parser(span).nested_int_lists() if span is not None else []
  if any(len(pr) != 2 for pr in pairs):
    raise im.err(f"%{ins.name}: source_target_pairs must be pairs", span.line if span else
                 ins.line)
  attrs["source_target_pairs"] = ir.ConstantArray(np.array(pairs, dtype=np.int64).reshape(-1, 2))
  if "channel_id" in ins.attrs:
    attrs["channel_handle"] = im.attr_int(ins, "channel_id")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "collective_permute", ins, operands, attrs).result


@_handles("collective-broadcast")
def _collective_broadcast(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["replica_groups"] = ir.ConstantArray(np.asarray(im.replica_groups(ins), dtype=np.int64))
  if "channel_id" in ins.attrs:
    attrs["channel_handle"] = im.attr_int(ins, "channel_id")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "collective_broadcast", ins, operands, attrs).result


@_handles("reduce")
def _reduce(im, g, ins, operands):
  n = len(operands) // 2
  if len(operands) % 2 or not n:
    raise im.err(f"%{ins.name}: reduce needs inputs and as many init values", ins.line)
  dims = im.attr_ints(ins, "dimensions")
  src = operands[0].type.shape
  if any(not 0 <= d < len(src) for d in dims):
    raise im.err(f"%{ins.name}: dimensions={{{','.join(map(str, dims))}}} out of range for "
                 f"{operands[0].type}", ins.line)
  region = im.import_region(im.callee(ins, "to_apply"), "reduce.r0")
  # XLA puts the instruction's attributes on the reduce, or on the tuple that wraps a
  # variadic one (canonicalize keeps only the dimensions anyway).
  attrs = {} if ins.shape.is_tuple else im.base_attrs(ins)
  attrs["dimensions"] = dims
  op = im.emit(g, "reduce", ins, operands, attrs, [region], _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


def _window(im: _Importer, ins: _Instr, rank: int) -> dict[str, list]:
  out = {"size": [1] * rank, "stride": [1] * rank, "pad": [[0, 0]] * rank,
         "lhs_dilate": [1] * rank, "rhs_dilate": [1] * rank, "rhs_reversal": [0] * rank}
  span = ins.attrs.get("window")
  if span is None:
    return out
  p = im.parser(span)
  p.expect("{")
  while not p.accept("}"):
    key = p.next().text
    p.expect("=", f"after window field {key}")
    tok = p.next()
    vals = _dims_token(tok, p, 2 if key == "pad" else 1)
    if len(vals) != rank:
      raise p.error(f"window {key} has {len(vals)} dimension(s), expected {rank}", tok)
    out[key] = vals if key == "pad" else [v[0] for v in vals]
  return out


def _padding(pads: list) -> ir.ConstantArray:
  arr = np.array(pads, dtype=np.int64).reshape(-1, 2)
  if arr.size and (arr == arr.reshape(-1)[0]).all():
    return ir.ConstantArray(np.full(arr.shape, int(arr.reshape(-1)[0])))
  return ir.ConstantArray(arr)


@_handles("reduce-window")
def _reduce_window(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  rank = operands[0].type.rank
  w = _window(im, ins, rank)
  attrs.update({"window_dimensions": tuple(w["size"]), "window_strides": tuple(w["stride"]),
                "base_dilations": tuple(w["lhs_dilate"]),
                "window_dilations": tuple(w["rhs_dilate"]), "padding": _padding(w["pad"])})
  region = im.import_region(im.callee(ins, "to_apply"), "reduce_window.r0")
  im.layout_attrs(ins, attrs)
  op = im.emit(g, "reduce_window", ins, operands, attrs, [region],
               _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


@_handles("select-and-scatter")
def _select_and_scatter(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  rank = operands[0].type.rank
  w = _window(im, ins, rank)
  attrs.update({"window_strides": tuple(w["stride"]), "window_dimensions": tuple(w["size"]),
                "padding": _padding(w["pad"])})
  regions = [im.import_region(im.callee(ins, "select"), "select_and_scatter.r0"),
             im.import_region(im.callee(ins, "scatter"), "select_and_scatter.r1")]
  im.layout_attrs(ins, attrs)
  return im.emit(g, "select_and_scatter", ins, operands, attrs, regions).result


@_handles("sort")
def _sort(im, g, ins, operands):
  dims = im.attr_ints(ins, "dimensions")
  attrs = im.base_attrs(ins)
  attrs.update({"dimension": dims[0] if dims else 0, "is_stable": im.attr_bool(ins, "is_stable")})
  region = im.import_region(im.callee(ins, "to_apply"), "sort.r0")
  op = im.emit(g, "sort", ins, operands, attrs, [region], _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


@_handles("topk")
def _topk(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["k"] = im.attr_int(ins, "k")
  # The k largest is jax's lax.top_k (StableHLO spells it chlo.top_k); the
  # k smallest has no StableHLO name of its own.
  name = "chlo.top_k"
  if not im.attr_bool(ins, "largest"):
    name, attrs["largest"] = "mhlo.topk", False
  op = im.emit(g, name, ins, operands, attrs, None, _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


def _dim_numbers(kind: str, fields: list[tuple[str, Any]]) -> str:
  parts = []
  for k, v in fields:
    if isinstance(v, tuple):
      if v:
        parts.append(f"{k} = [{', '.join(map(str, v))}]")
    elif v:
      parts.append(f"{k} = {v}")
  return f"#stablehlo.{kind}<{', '.join(parts)}>"


@_handles("gather")
def _gather(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["dimension_numbers"] = _dim_numbers("gather", [
      ("offset_dims", im.attr_ints(ins, "offset_dims", ())),
      ("collapsed_slice_dims", im.attr_ints(ins, "collapsed_slice_dims", ())),
      ("operand_batching_dims", im.attr_ints(ins, "operand_batching_dims", ())),
      ("start_indices_batching_dims", im.attr_ints(ins, "start_indices_batching_dims", ())),
      ("start_index_map", im.attr_ints(ins, "start_index_map", ())),
      ("index_vector_dim", im.attr_int(ins, "index_vector_dim", 0))])
  attrs["slice_sizes"] = im.attr_ints(ins, "slice_sizes")
  attrs["indices_are_sorted"] = im.attr_bool(ins, "indices_are_sorted")
  im.layout_attrs(ins, attrs)
  return im.emit(g, "gather", ins, operands, attrs).result


@_handles("scatter")
def _scatter(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["scatter_dimension_numbers"] = _dim_numbers("scatter", [
      ("update_window_dims", im.attr_ints(ins, "update_window_dims", ())),
      ("inserted_window_dims", im.attr_ints(ins, "inserted_window_dims", ())),
      ("input_batching_dims", im.attr_ints(ins, "input_batching_dims", ())),
      ("scatter_indices_batching_dims", im.attr_ints(ins, "scatter_indices_batching_dims", ())),
      ("scatter_dims_to_operand_dims", im.attr_ints(ins, "scatter_dims_to_operand_dims", ())),
      ("index_vector_dim", im.attr_int(ins, "index_vector_dim", 0))])
  attrs["indices_are_sorted"] = im.attr_bool(ins, "indices_are_sorted")
  attrs["unique_indices"] = im.attr_bool(ins, "unique_indices")
  region = im.import_region(im.callee(ins, "to_apply"), "scatter.r0")
  op = im.emit(g, "scatter", ins, operands, attrs, [region], _collective_result_shapes(ins))
  return _wrap(im, g, ins, op)


def _conv_labels(labels: str) -> str:
  lhs_rhs, _, out = labels.partition("->")
  lhs, _, rhs = lhs_rhs.partition("_")
  fmt = lambda s: "[" + ", ".join(s) + "]"
  return f"#stablehlo.conv<{fmt(lhs)}x{fmt(rhs)}->{fmt(out)}>"


@_handles("convolution")
def _convolution(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  labels = im.attr_word(ins, "dim_labels")
  if not re.fullmatch(r"[bf\d]+_[io\d]+->[bf\d]+", labels):
    raise im.err(f"%{ins.name}: malformed dim_labels {labels!r}", ins.line)
  spatial = sum(ch.isdigit() for ch in labels.partition("_")[0])
  w = _window(im, ins, spatial)
  attrs.update({"window_strides": tuple(w["stride"]), "padding": _padding(w["pad"]),
                "lhs_dilation": tuple(w["lhs_dilate"]), "rhs_dilation": tuple(w["rhs_dilate"]),
                "window_reversal": tuple(bool(r) for r in w["rhs_reversal"]),
                "dimension_numbers": _conv_labels(labels),
                "feature_group_count": im.attr_int(ins, "feature_group_count", 1),
                "batch_group_count": im.attr_int(ins, "batch_group_count", 1),
                "precision_config": _precision_config(im, ins, 2)})
  im.layout_attrs(ins, attrs)
  return im.emit(g, "convolution", ins, operands, attrs).result


_RNG = {"rng_default": "DEFAULT", "rng_three_fry": "THREE_FRY", "rng_philox": "PHILOX"}


@_handles("rng-bit-generator")
def _rng_bit_generator(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  attrs["rng_algorithm"] = (f"#stablehlo<rng_algorithm "
                            f"{_RNG.get(im.attr_word(ins, 'algorithm', 'rng_default'), 'DEFAULT')}>")
  if ins.shape.is_tuple:
    shapes = list(ins.shape.elements)
    op = im.emit(g, "rng_bit_generator", ins, operands, attrs, None, shapes)
    return _wrap(im, g, ins, op)
  state = _Shape(_hlo_dtype(operands[0].type.dtype), operands[0].type.shape)
  if "mhlo.sharding" in attrs:
    attrs["mhlo.sharding"] = "{{replicated}, " + attrs["mhlo.sharding"] + "}"
  op = im.emit(g, "rng_bit_generator", ins, operands, attrs, None, [state, ins.shape])
  return op.results[1]


def _hlo_dtype(ir_dtype: str) -> str:
  for k, v in _DTYPES.items():
    if v == ir_dtype:
      return k
  return ir_dtype


@_handles("opt-barrier")
def _opt_barrier(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  flat = im.flatten(g, operands[0])
  shapes = ins.shape.leaves()
  op = im.emit(g, "optimization_barrier", ins, flat, attrs, None, shapes)
  return _wrap(im, g, ins, op)


@_handles("while")
def _while(im, g, ins, operands):
  if len(operands) != 1:
    raise im.err(f"%{ins.name}: while takes one operand", ins.line)
  attrs = im.base_attrs(ins)
  flat = im.flatten(g, operands[0])
  cond_comp = im.callee(ins, "condition")
  if sum(len(p.shape.leaves()) for p in cond_comp.params) != len(flat):
    raise im.err(f"%{ins.name}: the while condition {cond_comp.name} does not take the "
                 f"loop state {ins.shape}", ins.line)
  cond = im.import_region(cond_comp, "while.r0")
  body = im.import_region(im.callee(ins, "body"), "while.r1")
  op = im.emit(g, "while", ins, flat, attrs, [cond, body], ins.shape.leaves())
  return _wrap(im, g, ins, op)


@_handles("conditional")
def _conditional(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  if "branch_computations" in ins.attrs:
    branches = im.callees(ins, "branch_computations")
  else:
    branches = [im.callee(ins, "true_computation"), im.callee(ins, "false_computation")]
  if len(operands) != len(branches) + 1:
    raise im.err(f"%{ins.name}: conditional with {len(branches)} branches needs "
                 f"{len(branches) + 1} operands, got {len(operands)}", ins.line)
  index = im.flatten(g, operands[0])
  flat_args = [im.flatten(g, v) for v in operands[1:]]
  is_if = operands[0].type.dtype == "pred"
  name = "if" if is_if else "case"
  regions = [im.import_region(b, f"{name}.r{k}", bind=flat_args[k])
             for k, b in enumerate(branches)]
  op = im.emit(g, name, ins, index, attrs, regions, ins.shape.leaves())
  return _wrap(im, g, ins, op)


@_handles("call")
def _call(im, g, ins, operands):
  comp = im.callee(ins, "to_apply")
  attrs = im.base_attrs(ins)
  if im.attr_bool(ins, "is_composite"):
    return _composite(im, g, ins, operands, comp, attrs)
  raw = im.raw_backend_config(ins)
  if raw:
    fa = dict(attrs.get("mhlo.frontend_attributes", {}))
    fa["backend_config"] = raw
    attrs["mhlo.frontend_attributes"] = fa
  attrs["callee"] = _symbol_ref(im.func_names[comp.name])
  flat = [v for o in operands for v in im.flatten(g, o)]
  want = sum(len(p.shape.leaves()) for p in comp.params)
  if len(flat) != want:
    raise im.err(f"%{ins.name}: call passes {len(flat)} value(s) to {comp.name}, which takes "
                 f"{want}", ins.line)
  op = im.emit(g, "call", ins, flat, attrs, None, ins.shape.leaves())
  return _wrap(im, g, ins, op)


def _composite(im: _Importer, g: ir.Graph, ins: _Instr, operands: list[ir.Value],
               comp: _Computation, attrs: dict) -> ir.Value:
  """``call(...), is_composite=true``: a stablehlo.composite named by its frontend attributes."""
  fa = dict(attrs.pop("mhlo.frontend_attributes", {}))
  missing = [k for k in ("composite.name", "composite.attributes", "composite.version")
             if k not in fa]
  if missing:
    raise im.err(f"%{ins.name}: a composite call needs frontend attribute {missing[0]}",
                 ins.line)
  span = ins.attrs["frontend_attributes"]
  composite_attrs: Any = fa.pop("composite.attributes")
  sub = _Parser(im.path, composite_attrs, _tokenize(im.path, composite_attrs))
  try:
    composite_attrs = _mlir_value(sub)
  except InputError:
    raise im.err(f"%{ins.name}: cannot read composite.attributes", span.line) from None
  out = {"name": fa.pop("composite.name"), "composite_attributes": composite_attrs,
         "decomposition": _symbol_ref(comp.name),
         "version": _as_int(fa.pop("composite.version"))}
  if fa:
    out["mhlo.frontend_attributes"] = fa
  out.update(attrs)
  return im.emit(g, "composite", ins, operands, out).result


@_handles("fusion")
def _fusion(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  kind = im.attr_word(ins, "kind", "kLoop")
  attrs["fusion_kind"] = f"#mhlo<fusion_kind {kind}>"
  attrs["output_operand_aliasing"] = _output_operand_aliases(im, ins)
  flat = [v for o in operands for v in im.flatten(g, o)]
  region = im.import_region(im.callee(ins, "calls"), "mhlo.fusion.r0")
  op = im.emit(g, "mhlo.fusion", ins, flat, attrs, [region], ins.shape.leaves())
  return _wrap(im, g, ins, op)


def _output_operand_aliases(im: _Importer, ins: _Instr) -> tuple:
  span = ins.attrs.get("output_to_operand_aliasing")
  if span is None:
    return ()
  p = im.parser(span)
  p.expect("{")
  out = []
  while not p.accept("}"):
    oidx = p.int_list()
    p.expect(":")
    p.expect("(")
    operand = p.expect_int("operand index")
    p.expect(",")
    pidx = p.int_list()
    p.expect(")")
    p.accept(",")
    out.append("#stablehlo.output_operand_alias<output_tuple_indices = "
               f"[{', '.join(map(str, oidx))}], operand_index = {operand}, "
               f"operand_tuple_indices = [{', '.join(map(str, pidx))}]>")
  return tuple(out)


_API_VERSIONS = {"API_VERSION_UNSPECIFIED": 0, "API_VERSION_ORIGINAL": 1,
                 "API_VERSION_STATUS_RETURNING": 2, "API_VERSION_STATUS_RETURNING_UNIFIED": 3,
                 "API_VERSION_TYPED_FFI": 4}


@_handles("custom-call")
def _custom_call(im, g, ins, operands):
  attrs = im.base_attrs(ins)
  called = im.callees(ins, "called_computations")
  if called:
    attrs["called_computations"] = tuple(_symbol_ref(im.func_names[c.name]) for c in called)
  if "operand_layout_constraints" in ins.attrs:
    p = im.parser(ins.attrs["operand_layout_constraints"])
    p.expect("{")
    shapes = []
    while not p.accept("}"):
      shapes.append(p.shape())
      p.accept(",")
    attrs["operand_layouts"] = tuple(s.layout_attr() for s in shapes)
    res = ins.shape.elements if ins.shape.is_tuple else (ins.shape,)
    attrs["result_layouts"] = tuple(s.layout_attr() for s in res)
  attrs["call_target_name"] = im.attr_word(ins, "custom_call_target")
  attrs["has_side_effect"] = im.attr_bool(ins, "custom_call_has_side_effect")
  api = _API_VERSIONS.get(im.attr_word(ins, "api_version", "API_VERSION_ORIGINAL"), 1)
  raw = im.raw_backend_config(ins)
  if api == 4:
    if raw:
      try:
        p = im.parser(ins.attrs["backend_config"])
        attrs["backend_config"] = _mlir_value(p)
        p.expect_done("backend_config")
      except InputError:
        attrs["backend_config"] = raw
    else:
      attrs["backend_config"] = {}
  else:
    attrs["backend_config"] = raw
  if "literal" in ins.attrs:
    span = ins.attrs["literal"]
    attrs["mhlo.literal"] = _parse_literal(im.parser(span), ins.shape, ins.name)
  schedule = ins.attrs.get("schedule")
  target = attrs["call_target_name"]
  aliases = () if target in ("Pin", "Unpin") else _output_operand_aliases(im, ins)
  if schedule is not None and schedule.text != "SCHEDULE_NONE":
    attrs["custom_call_schedule"] = (f"#mhlo<custom_call_schedule "
                                     f"{schedule.text.replace('SCHEDULE_', '')}>")
    attrs["api_version"] = api
    if target not in ("Pin", "Unpin"):
      attrs["output_operand_aliases"] = aliases
    im.layout_attrs(ins, attrs)
    return im.emit(g, "mhlo.custom_call", ins, operands, attrs).result
  attrs["api_version"] = api
  if target not in ("Pin", "Unpin"):
    attrs["output_operand_aliases"] = aliases
  im.layout_attrs(ins, attrs)
  return im.emit(g, "custom_call", ins, operands, attrs).result


# --------------------------------------------------------------------------- entry point

def load_hlo_text(path: str, text: str) -> ir.Module:
  """Parse an HLO text dump into the graph IR; every problem is an InputError."""
  if "\x00" in text:
    raise InputError(path, "binary data in an HLO text file")
  try:
    toks = _tokenize(path, text)
    hlo = _Parser(path, text, toks).module()
    return _Importer(path, text, toks, hlo).run()
  except InputError:
    raise
  except RecursionError:
    raise InputError(path, "nesting too deep (shapes, literals or computations)") from None
  except (ValueError, KeyError, IndexError, TypeError, AssertionError, OverflowError,
          ZeroDivisionError, AttributeError) as e:
    # A malformed dump we did not check for explicitly: still one clear line.
    raise InputError(path, f"malformed HLO ({type(e).__name__}: {e})") from None
