"""Our e-graph (``passes/egraph.py``) against the ``egglog`` package, on the job the
verifier gives an e-graph.

    python -m tools.bench_egraph [--layers 8 32 128] [--repeat 5] [--json OUT]
                                 [--max-egglog-layers N]

The workload, identical for both engines (see the README's design section):

1. build: insert a synthetic per-device program of L transformer-like layers
   (34 values per layer: dot_general, add of a broadcast splat, tanh, copy,
   reshape/convert to the same type, exponential, reduce, divide, multiply,
   all_reduce, rsqrt, maximum, compare, select, converts) as one e-node per op,
   spelled as ``passes/dist_egraph.py`` spells them: head = ``terms.op_head``
   (name, attrs key, result type, regions, result index), constants as
   ``terms.splat_head``, parameters as ``("param", i, type)``;
2. saturate with the normalization rules (ours: ``dist_egraph.NORMALIZATION_RULES``
   itself; egglog: their port in ``tools/egglog_backend.py``);
3. 20*L lookups of terms that are in the saturated graph (as-is, commuted operands,
   operands spelled through copies/no-op reshapes and converts, splats at a
   broadcast type) and 20*L of terms that are not (non-commutative operands
   swapped, other attributes, other result type, wrong operand, absent splat),
   as relation inference does after saturation (``inference._lookup_local``).

Times are the median of ``--repeat`` runs (``time.perf_counter``), each on a fresh
e-graph; heads are computed once, outside the timings (both engines get the same
precomputed heads).  The answers of both engines are compared lookup by lookup:
found / not found, and for found terms the class, named by the first program value
in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Hashable, Optional

from graphguard_hlo import ir
from graphguard_hlo.passes import dist_egraph, terms
from graphguard_hlo.passes.egraph import EGraph, ENode, saturate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDENTITY_IF_SAME_TYPE = ("reshape", "convert", "broadcast_in_dim")


# -- the synthetic per-device program ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SynOp:
  """One value of the program (or one looked-up term): an op with one result."""
  name: str                       # "param", "splat", or a StableHLO op name
  type: ir.TensorType
  operands: tuple[int, ...] = ()  # indices of earlier values
  attrs: tuple = ()               # items of the op's attribute dict
  regions: tuple = ()             # region fingerprints (as terms.region_fingerprint gives)
  value: Any = None               # the splat's value / the parameter's index

  def our_head(self) -> Hashable:
    if self.name == "param":
      return ("param", self.value, self.type)
    if self.name == "splat":
      return terms.splat_head(float(self.value), self.type)
    return terms.op_head(self.name, dict(self.attrs), self.type, self.regions, 0)

  def with_(self, **kw) -> "SynOp":
    return dataclasses.replace(self, **kw)


def _t(dtype: str, *shape: int) -> ir.TensorType:
  return ir.TensorType(tuple(shape), dtype)


F32, F32_ROW = _t("f32"), _t("f32", 8)
X, H, PRED, BF16 = _t("f32", 8, 64), _t("f32", 8, 128), _t("i1", 8, 64), _t("bf16", 8, 64)
W1, W2 = _t("f32", 64, 128), _t("f32", 128, 64)
ADD_REDUCER = (("reducer", "sum", (F32, F32)),)
DOT = (("lhs_batch", ()), ("rhs_batch", ()), ("lhs_contract", (1,)), ("rhs_contract", (0,)),
       ("precision_config", ("DEFAULT", "DEFAULT")))
GROUPS = (("replica_groups", ((0, 1, 2, 3), (4, 5, 6, 7))), ("channel_handle", 1))


def synthetic_program(layers: int) -> list[SynOp]:
  ops: list[SynOp] = []
  n_params = 0

  def emit(name, type, *operands, attrs=(), regions=(), value=None) -> int:
    ops.append(SynOp(name, type, tuple(operands), tuple(attrs), tuple(regions), value))
    return len(ops) - 1

  def param(type) -> int:
    nonlocal n_params
    n_params += 1
    return emit("param", type, value=n_params - 1)

  def bcast(x, type, dims) -> int:
    return emit("broadcast_in_dim", type, x, attrs=(("broadcast_dimensions", dims),))

  x = param(X)
  for _ in range(layers):
    w1, w2 = param(W1), param(W2)
    h = emit("dot_general", H, x, w1, attrs=DOT)
    half = emit("splat", F32, value=0.5)                 # constant 0.5 (a splat by value)
    h2 = emit("add", H, h, bcast(half, H, ()))
    t = emit("tanh", H, h2)
    cp = emit("copy", H, t)
    r = emit("reshape", H, cp)                           # to the same shape: identity
    cv = emit("convert", H, r)                           # to the same type: identity
    e = emit("exponential", H, cv)
    zero = emit("splat", F32, value=0.0)
    s = emit("reduce", F32_ROW, e, zero, attrs=(("dimensions", (1,)),), regions=ADD_REDUCER)
    d = emit("divide", H, e, bcast(s, H, (0,)))
    m = emit("multiply", H, t, d)
    o = emit("dot_general", X, m, w2, attrs=DOT)
    ar = emit("all_reduce", X, o, attrs=GROUPS, regions=ADD_REDUCER)
    res = emit("add", X, x, ar)
    sq = emit("multiply", X, res, res)
    ms = emit("reduce", F32_ROW, sq, zero, attrs=(("dimensions", (1,)),), regions=ADD_REDUCER)
    eps = emit("splat", F32, value=1e-5)
    v = emit("add", X, bcast(ms, X, (0,)), bcast(eps, X, ()))
    rs = emit("rsqrt", X, v)
    n = emit("multiply", X, rs, res)
    zeros = bcast(zero, X, ())
    mx = emit("maximum", X, n, zeros)
    bc = bcast(mx, X, (0, 1))                            # to the same shape: identity
    cmp = emit("compare", PRED, bc, zeros, attrs=(("comparison_direction", "GT"),))
    sel = emit("select", X, cmp, bc, n)
    lo = emit("convert", BF16, sel)
    x = emit("convert", X, lo)
  return ops


def _is_identity(prog: list[SynOp], i: int) -> bool:
  op = prog[i]
  return op.name == "copy" or (op.name in IDENTITY_IF_SAME_TYPE and len(op.operands) == 1
                               and prog[op.operands[0]].type == op.type)


def _spelled_through(prog: list[SynOp], i: int) -> int:
  while _is_identity(prog, i):
    i = prog[i].operands[0]
  return i


def lookups(prog: list[SynOp], layers: int, seed: int = 0) -> list[tuple[str, bool, SynOp]]:
  """20*L terms in the saturated graph and 20*L not in it: (kind, expected, term)."""
  present: dict[str, list[SynOp]] = {k: [] for k in
                                     ("as-is", "commuted", "through-identity", "splat")}
  absent: dict[str, list[SynOp]] = {k: [] for k in
                                    ("swapped", "other-attrs", "other-type", "wrong-operand",
                                     "absent-splat")}
  params = [i for i, op in enumerate(prog) if op.name == "param"]
  for i, op in enumerate(prog):
    if op.name in ("param", "splat"):
      continue
    present["as-is"].append(op)
    a = op.operands
    if op.name in terms.COMMUTATIVE and len(a) == 2 and a[0] != a[1]:
      present["commuted"].append(op.with_(operands=(a[1], a[0])))
    through = tuple(_spelled_through(prog, j) for j in a)
    if through != a:
      present["through-identity"].append(op.with_(operands=through))
    if op.name == "broadcast_in_dim" and prog[a[0]].name == "splat":
      present["splat"].append(prog[a[0]].with_(type=op.type))
      absent["absent-splat"].append(prog[a[0]].with_(type=op.type, value=0.25))
    if op.name not in terms.COMMUTATIVE and len(a) == 2 and a[0] != a[1]:
      absent["swapped"].append(op.with_(operands=(a[1], a[0])))
    if op.attrs:
      absent["other-attrs"].append(op.with_(attrs=op.attrs + (("gg.bench_variant", 1),)))
    if op.type.dtype == "f32" and not _is_identity(prog, i):
      absent["other-type"].append(op.with_(type=_t("f16", *op.type.shape)))
    if len(a) == 1 and op.name not in ("copy",) + IDENTITY_IF_SAME_TYPE:
      absent["wrong-operand"].append(op.with_(operands=(params[-1 - i % len(params)],)))
  rng = random.Random(seed)
  out = []
  for expected, pools in ((True, present), (False, absent)):
    kinds = sorted(k for k, pool in pools.items() if pool)
    for _ in range(20 * layers):
      kind = rng.choice(kinds)
      out.append((kind, expected, rng.choice(pools[kind])))
  rng.shuffle(out)
  return out


# -- the two engines ---------------------------------------------------------------------

class OursEngine:
  name = "ours"
  api = {"build": "EGraph.add(ENode(head, children))",
         "saturate": "egraph.saturate(eg, dist_egraph.NORMALIZATION_RULES)",
         "lookup": "EGraph.lookup(ENode(head, children)) -> class id | None"}

  def prepare(self, prog: list[SynOp], queries: list[tuple[str, bool, SynOp]]):
    return ([(op.our_head(), op.operands) for op in prog],
            [(q.our_head(), q.operands) for _, _, q in queries])

  def build(self, prepared):
    ops, _ = prepared
    eg = EGraph()
    cls: list[int] = []
    for head, operands in ops:
      cls.append(eg.add(ENode(head, tuple(cls[i] for i in operands))))
    t_built = time.perf_counter()
    iterations = saturate(eg, dist_egraph.NORMALIZATION_RULES)
    return (eg, cls), t_built, iterations

  def lookup_all(self, state, prepared) -> list:
    eg, cls = state
    return [eg.lookup(ENode(head, tuple(cls[i] for i in operands)))
            for head, operands in prepared[1]]

  def class_values(self, state, prepared) -> list:
    eg, cls = state
    return [eg.find(c) for c in cls]

  def sizes(self, state) -> tuple[int, int]:
    eg, _ = state
    return len(eg), len(eg.classes())


class EgglogEngine:
  name = "egglog"
  api = {"build": "EGraph.let(name, Term.opN(op, key, type, *child_refs)) per op",
         "saturate": "EGraph.run(normalization.saturate())",
         "lookup": "EGraph.lookup_function_value(Term.opN(...)) -> class value | None",
         "lookup (query)": "EGraph.check_bool(Term.opN(...)) -> bool",
         "sizes": "EGraph.all_function_sizes() (nodes), EGraph.freeze() (classes)"}

  def __init__(self) -> None:
    from tools import egglog_backend
    self.be = egglog_backend

  def prepare(self, prog: list[SynOp], queries: list[tuple[str, bool, SynOp]]):
    keys: dict[Hashable, int] = {}

    def spec(op: SynOp):
      if op.name == "splat":
        return ("splat", float(op.value), str(op.type), ())
      if op.name == "param":
        return ("param", op.value, str(op.type), ())
      head = op.our_head()   # (name, attrs key, type, regions, result index)
      key = keys.setdefault((head[1], head[3], head[4]), len(keys))
      return (op.name, key, str(op.type), op.operands)

    return [spec(op) for op in prog], [spec(q) for _, _, q in queries]

  def _term(self, spec, refs):
    name, key, ty, operands = spec
    if name == "splat":
      return self.be.Term.splat(key, ty)
    return self.be.EgglogDistEGraph.term(name, key, ty, [refs[i] for i in operands])

  def build(self, prepared):
    ops, _ = prepared
    g = self.be.EgglogDistEGraph()
    refs: list = []
    for spec in ops:
      refs.append(g.add(self._term(spec, refs)))
    t_built = time.perf_counter()
    iterations = g.saturate()
    return (g, refs), t_built, iterations

  def lookup_all(self, state, prepared) -> list:
    g, refs = state
    return [g.lookup(self._term(spec, refs)) for spec in prepared[1]]

  def contains_all(self, state, prepared) -> list[bool]:
    g, refs = state
    return [g.contains(self._term(spec, refs)) for spec in prepared[1]]

  def class_values(self, state, prepared) -> list:
    g, refs = state
    return [g.lookup(self._term(spec, refs)) for spec in prepared[0]]

  # Not a supported API: the same lookup straight on the Rust bindings
  # (``EGraph._egraph.lookup_function(table, [values])``), with every literal and
  # every program value's class converted to a ``bindings.Value`` beforehand.  Only
  # to show how much of the lookup time is egglog's Python layer.
  def raw_prepare(self, state, prepared, values):
    from egglog import bindings
    g, refs = state
    raw = g.egraph._egraph
    T = self.be.Term
    table = {k: g.egraph._callable_to_egg(fn)[1] for k, fn in
             ((0, T.op0), (1, T.op1), (2, T.op2), (3, T.op3), ("splat", T.splat))}
    lits: dict = {}

    def lit(x):
      if (type(x), x) not in lits:
        l = (bindings.String(x) if isinstance(x, str) else
             bindings.Float(x) if isinstance(x, float) else bindings.Int(x))
        lits[(type(x), x)] = raw.eval_expr(bindings.Lit(bindings.RustSpan("", 0, 0), l))[1]
      return lits[(type(x), x)]

    queries = []
    for name, key, ty, operands in prepared[1]:
      if name == "splat":
        queries.append((table["splat"], [lit(key), lit(ty)], ()))
      else:
        queries.append((table[len(operands)], [lit(name), lit(key), lit(ty)], operands))
    return raw, values, queries

  def raw_lookup_all(self, raw_state) -> list:
    raw, values, queries = raw_state
    return [raw.lookup_function(fn, lits + [values[i] for i in operands])
            for fn, lits, operands in queries]

  def sizes(self, state) -> tuple[int, int]:
    g, _ = state
    return g.sizes()


# -- measuring ---------------------------------------------------------------------------

def _median_ms(xs: list[float]) -> float:
  return round(1000 * statistics.median(xs), 3)


def measure(engine, prog, queries, repeat: int) -> dict:
  prepared = engine.prepare(prog, queries)
  build, sat, look = [], [], []
  for _ in range(repeat):
    t0 = time.perf_counter()
    state, t_built, iterations = engine.build(prepared)
    t1 = time.perf_counter()
    found = engine.lookup_all(state, prepared)
    t2 = time.perf_counter()
    build.append(t1 - t0)
    sat.append(t1 - t_built)
    look.append(t2 - t1)
  # Untimed: name each class by the first program value in it, to compare answers.
  values = engine.class_values(state, prepared)
  names: dict = {}
  for i, c in enumerate(values):
    names.setdefault(c, i)

  def named(found_classes):
    return [None if f is None else names.get(f, "class-without-program-value")
            for f in found_classes]

  nodes, classes = engine.sizes(state)
  row = {"engine": engine.name, "layers": None, "values": len(prog), "lookups": len(queries),
         "build_saturate_ms": _median_ms(build), "saturate_ms": _median_ms(sat),
         "iterations": iterations, "lookups_ms": _median_ms(look),
         "us_per_lookup": round(1e6 * statistics.median(look) / len(queries), 2),
         "nodes": nodes, "classes": classes, "answers": named(found)}
  if hasattr(engine, "contains_all"):
    # The query API is far slower: one pass, on the last run's e-graph.
    t3 = time.perf_counter()
    row["check_bool_found"] = engine.contains_all(state, prepared)
    row["check_bool_ms_1run"] = round(1000 * (time.perf_counter() - t3), 3)
    # The private-bindings floor: lookups are read-only, so `repeat` passes on one graph.
    raw_state, raw = engine.raw_prepare(state, prepared, values), []
    for _ in range(repeat):
      t4 = time.perf_counter()
      found_raw = engine.raw_lookup_all(raw_state)
      raw.append(time.perf_counter() - t4)
    row["raw_bindings_lookup_ms"] = _median_ms(raw)
    row["raw_bindings_answers"] = named(found_raw)
  return row


def _rule_lines(path: str, start: str, end: str) -> int:
  """Non-blank, non-comment source lines from the line containing ``start`` through
  the line containing ``end``."""
  with open(path) as f:
    lines = f.read().splitlines()
  i = next(k for k, l in enumerate(lines) if start in l)
  j = next(k for k, l in enumerate(lines) if k > i and end in l)
  return sum(1 for l in lines[i:j + 1] if l.strip() and not l.strip().startswith("#"))


def clarity() -> dict:
  ours = os.path.join(REPO, "passes", "dist_egraph.py")
  egg = os.path.join(REPO, "tools", "egglog_backend.py")
  return {
      "ours_rule_lines": _rule_lines(ours, "def _same_type", "for op in sorted(terms.COMMUTATIVE)]"),
      "ours_rule_lines_declarative": _rule_lines(ours, "NORMALIZATION_RULES = [",
                                                 "for op in sorted(terms.COMMUTATIVE)]"),
      "egglog_rule_lines": _rule_lines(egg, "RULES BEGIN", "RULES END") - 0,
      "egglog_sort_lines": _rule_lines(egg, "class Term(Expr):", "def type_of"),
  }


def main(argv: Optional[list[str]] = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layers", type=int, nargs="+", default=[8, 32, 128])
  ap.add_argument("--repeat", type=int, default=5)
  ap.add_argument("--json", metavar="OUT")
  ap.add_argument("--max-egglog-layers", type=int, default=None,
                  help="skip egglog above this many layers (default: no cap)")
  args = ap.parse_args(argv)

  engines: list = [OursEngine()]
  egglog_version = None
  try:
    import importlib.metadata
    engines.append(EgglogEngine())
    egglog_version = importlib.metadata.version("egglog")
  except ImportError as e:
    print(f"egglog not importable ({e}); install the extra: pip install -e .[bench]",
          file=sys.stderr)

  load_before = os.getloadavg()
  rows, agreement, skipped = [], [], []
  for layers in args.layers:
    prog = synthetic_program(layers)
    queries = lookups(prog, layers)
    by_engine = {}
    for engine in engines:
      if (engine.name == "egglog" and args.max_egglog_layers is not None
          and layers > args.max_egglog_layers):
        skipped.append(layers)
        continue
      row = measure(engine, prog, queries, args.repeat)
      row["layers"] = layers
      by_engine[engine.name] = row
      rows.append(row)
      print(f"  measured {engine.name} L={layers}", file=sys.stderr, flush=True)
    expected = [exp for _, exp, _ in queries]
    ours = by_engine["ours"]["answers"]
    entry = {"layers": layers,
             "ours_unexpected": sum((a is not None) != e for a, e in zip(ours, expected))}
    if "egglog" in by_engine:
      egg = by_engine["egglog"]
      entry["found_agree"] = sum((a is None) == (b is None)
                                 for a, b in zip(ours, egg["answers"]))
      entry["class_agree"] = sum(a == b for a, b in zip(ours, egg["answers"]))
      entry["check_bool_agree"] = sum((a is not None) == b
                                      for a, b in zip(ours, egg["check_bool_found"]))
      entry["raw_bindings_agree"] = sum(a == b for a, b in zip(ours, egg["raw_bindings_answers"]))
      entry["lookups"] = len(queries)
      entry["all_agree"] = (entry["class_agree"] == entry["check_bool_agree"]
                            == entry["raw_bindings_agree"] == len(queries))
    agreement.append(entry)

  _print_table(rows, agreement, skipped, args)
  clar = clarity() if len(engines) > 1 else {}
  if clar:
    print(f"\nrule definitions (non-blank, non-comment lines): ours {clar['ours_rule_lines']} "
          f"({clar['ours_rule_lines_declarative']} in the NORMALIZATION_RULES list, the rest "
          f"Python helpers for side conditions/right-hand sides); egglog "
          f"{clar['egglog_rule_lines']} (+ {clar['egglog_sort_lines']} for the Term sort "
          "and type_of)")
  if args.json:
    kinds: dict[str, int] = {}
    for kind, exp, _ in lookups(synthetic_program(args.layers[0]), args.layers[0]):
      kinds[f"{'present' if exp else 'absent'}:{kind}"] = kinds.get(
          f"{'present' if exp else 'absent'}:{kind}", 0) + 1
    out = {"python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "loadavg_before_after": [load_before, os.getloadavg()],
           "egglog_version": egglog_version, "repeat": args.repeat,
           "egglog_skipped_layers": skipped,
           "api": {e.name: e.api for e in engines}, "clarity": clar,
           "lookup_kinds_at_first_L": kinds,
           "results": [{k: v for k, v in r.items()
                        if k not in ("answers", "check_bool_found", "raw_bindings_answers")}
                       for r in rows],
           "agreement": agreement}
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
    print(f"wrote {args.json}")
  bad = [a for a in agreement if a.get("all_agree") is False or a["ours_unexpected"]]
  return 1 if bad else 0


def _print_table(rows, agreement, skipped, args) -> None:
  head = ("engine", "L", "values", "build+sat ms", "(sat ms)", "iters", "lookups",
          "lookup ms", "us/lookup", "check_bool ms (1 run)", "raw ms*", "nodes", "classes")
  table = [head]
  for r in rows:
    table.append((r["engine"], r["layers"], r["values"], r["build_saturate_ms"],
                  r["saturate_ms"], r["iterations"], r["lookups"], r["lookups_ms"],
                  r["us_per_lookup"], r.get("check_bool_ms_1run", "-"),
                  r.get("raw_bindings_lookup_ms", "-"), r["nodes"], r["classes"]))
  widths = [max(len(str(row[k])) for row in table) for k in range(len(head))]
  print(f"\nmedian of {args.repeat} runs (time.perf_counter); lookups = 20*L present + "
        "20*L absent")
  for k, row in enumerate(table):
    print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    if k == 0:
      print("  ".join("-" * w for w in widths))
  if any("raw_bindings_lookup_ms" in r for r in rows):
    print("* raw: the same egglog lookups on the private Rust bindings "
          "(EGraph._egraph.lookup_function), literals and classes pre-converted: a floor, "
          "not a supported API")
  if skipped:
    print(f"egglog skipped for L in {skipped} (--max-egglog-layers {args.max_egglog_layers})")
  for a in agreement:
    if "found_agree" in a:
      print(f"L={a['layers']}: answers agree on {a['class_agree']}/{a['lookups']} lookups "
            f"(found/not found {a['found_agree']}/{a['lookups']}, check_bool "
            f"{a['check_bool_agree']}/{a['lookups']}, raw* {a['raw_bindings_agree']}/"
            f"{a['lookups']}); ours vs expected: "
            f"{a['ours_unexpected']} unexpected")
    else:
      print(f"L={a['layers']}: ours vs expected: {a['ours_unexpected']} unexpected")


if __name__ == "__main__":
  sys.exit(main())
