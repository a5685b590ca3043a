"""Zoo benchmark: verification time of the model zoo's programs, one engine
against another.

    python -m tools.bench_zoo --match scan_grad --json new.json
    python -m tools.bench_zoo --match scan_grad --tree ../old --json old.json
    python -m tools.bench_zoo --compare old.json new.json
    python -m tools.bench_zoo --match _fori --twin pp_gpipe_fori=pp_gpipe_buffered \
        --twin _fori=

Per program (``tools/zoo/strategies.py``, names containing every ``--match``
string) it reports the verdict and the median of ``--repeat`` verifications
(canonicalization + relation inference, lowering excluded), measured in this
one process.  ``--tree`` verifies with the engine of another checkout (its
``graphguard_hlo`` and ``passes/``) the programs of this one, so two commits
are timed on the same programs; the editable install maps
``graphguard_hlo.passes`` to its own tree whatever ``sys.path`` says, so
that mapping is dropped first.  ``--compare`` prints each program's ratio and
their median.  ``--twin OLD=NEW`` times each program against its twin in the
same engine and sitting: the program named with the first OLD that occurs
replaced by NEW (a ``lax.fori_loop`` ring against its Python loop).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _use_engine_of(tree: str) -> None:
  """Import ``graphguard_hlo`` and its passes from ``tree`` from now on."""
  tree = os.path.abspath(tree)
  sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
  sys.path.insert(0, tree)
  import graphguard_hlo
  spec = importlib.util.spec_from_file_location(
      "graphguard_hlo.passes", os.path.join(tree, "passes", "__init__.py"),
      submodule_search_locations=[os.path.join(tree, "passes")])
  passes = importlib.util.module_from_spec(spec)
  sys.modules["graphguard_hlo.passes"] = passes
  spec.loader.exec_module(passes)
  graphguard_hlo.passes = passes
  assert graphguard_hlo.__file__.startswith(tree), graphguard_hlo.__file__


def median_verify_seconds(case, repeat: int) -> tuple[bool, float]:
  """(proved, median seconds) of ``repeat`` verifications of ``case``:
  canonicalization and relation inference, lowering excluded."""
  from graphguard_hlo.pipeline import verify_modules
  times = []
  for _ in range(repeat):
    seq, dist = case.modules()
    start = time.perf_counter()
    # (only a zoo case with a relation passes one: older engines have no such keyword)
    result = verify_modules(seq, dist, **({"relation": case.relation}
                                          if getattr(case, "relation", None) else {}))
    times.append(time.perf_counter() - start)
  return bool(result.refines), statistics.median(times)


def _time(matches: list[str], repeat: int, twins: list[str] = ()
          ) -> dict[str, tuple[bool, float]]:
  sys.path.append(REPO)  # this checkout's zoo (after --tree's engine)
  from tools.zoo import strategies
  cases = {c.name: c for c in strategies.model_cases()}
  names = sorted(name for name in cases if all(m in name for m in matches))
  out = {}

  def timed(name: str) -> tuple[bool, float]:
    return median_verify_seconds(cases[name], repeat)

  ratios = []
  for name in names:
    out[name] = timed(name)
    print(f"{name:60s} {'proved' if out[name][0] else 'not proved':10s} "
          f"{out[name][1]:7.3f} s", flush=True)
    twin = twin_of(name, twins, cases)
    if twin is not None:
      proved, seconds = out[twin] = timed(twin)
      ratios.append(out[name][1] / seconds)
      print(f"  twin {twin:54s} {'proved' if proved else 'not proved':10s} "
            f"{seconds:7.3f} s  x{ratios[-1]:5.2f}", flush=True)
  if ratios:
    print(f"{len(ratios)} programs against their twins: median ratio "
          f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
  return out


def twin_of(name: str, rules: list[str], known) -> str | None:
  """``name`` with the first rule's OLD that occurs in it replaced by NEW
  (rules ``OLD=NEW``), if that names a known program."""
  for rule in rules:
    old, _, new = rule.partition("=")
    if old and old in name:
      twin = name.replace(old, new, 1)
      return twin if twin in known and twin != name else None
  return None


def _compare(before_path: str, after_path: str) -> None:
  with open(before_path) as f:
    before = json.load(f)
  with open(after_path) as f:
    after = json.load(f)
  ratios = []
  for name in sorted(set(before) & set(after)):
    (was, t0), (now, t1) = before[name], after[name]
    ratios.append(t1 / t0)
    verdict = "" if was == now else f"  ({'proved' if now else 'not proved'} now)"
    print(f"{name:60s} {t0:7.3f} s -> {t1:7.3f} s  x{t1 / t0:5.2f}{verdict}")
  if ratios:
    print(f"{len(ratios)} programs: median ratio {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--match", action="append", default=[],
                 help="only programs whose name contains this (repeatable)")
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument("--tree", help="verify with the engine of this checkout")
  p.add_argument("--json", help="write {program: [proved, median seconds]} here")
  p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  p.add_argument("--twin", action="append", default=[], metavar="OLD=NEW",
                 help="also time each program's twin, named with OLD replaced by NEW")
  args = p.parse_args(argv)
  if args.compare:
    _compare(*args.compare)
    return
  if args.tree:
    _use_engine_of(args.tree)
  out = _time(args.match, args.repeat, args.twin)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
