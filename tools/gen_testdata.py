"""Dump zoo cases as module files for ``gg-hlo-verify`` (and regenerate testdata/).

    python -m tools.gen_testdata                    # the pairs committed in testdata/
    python -m tools.gen_testdata --out DIR CASE...  # any zoo case, e.g. tp_mlp/gspmd/ok
    python -m tools.gen_testdata --out DIR llama3/sp_grad/shard_map/ok --layers 32 \
        --d-model 4096 --heads 32 --kv-heads 8 --mlp-hidden 14336 --seq 2048 --vocab 128256
                                                    # any (model, strategy, size, bug)
    python -m tools.gen_testdata --list             # every case name

Per case, in ``DIR/<case name with / as __>/``:
  seq.mlir              the sequential program, StableHLO with source locations
  dist.mlir             shard_map cases: StableHLO with the manual computation
  dist.mlir             GSPMD cases: StableHLO with the shardings, as
                        ``jax.jit(f).lower(...).as_text()`` writes it
                        (gg-hlo-verify partitions it with XLA)
  dist.hlo.txt/.hlo.pb  GSPMD cases: XLA's per-device module right after
                        spmd-partitioning, as HLO text and as an HLO proto
                        (a GSPMD bug: the edited HLO text alone)
  relation.txt          cases whose inputs' relation the shardings do not tell
                        (a zig-zag batch): pass it with ``--relation``
Absolute paths of this checkout are written repo-relative, so the files are
the same on every machine.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTDATA_CASES = (
    "tp_mlp/shard_map/ok", "tp_mlp/shard_map/missing_allreduce", "tp_mlp/gspmd/ok",
    "dp_loss/shard_map/psum_not_pmean", "sp_allgather_mlp/shard_map/wrong_gather_dim",
)


def _relative(text: str) -> str:
  return text.replace(REPO + os.sep, "")


def dump_case(case, outdir: str) -> list[str]:
  import jax
  from graphguard_hlo.lowering import sequential_text
  os.makedirs(outdir, exist_ok=True)
  written = []
  seq_path = os.path.join(outdir, "seq.mlir")
  with open(seq_path, "w") as f:
    f.write(_relative(sequential_text(case.seq_fn, *case.seq_args)))
  written.append(seq_path)
  if case.relation is not None:  # the inputs' relation the shardings do not tell
    rel_path = os.path.join(outdir, "relation.txt")
    with open(rel_path, "w") as f:
      f.write(case.relation)
    written.append(rel_path)
  kw = {}
  if case.in_shardings is not None:
    kw["in_shardings"] = case.in_shardings
  if case.out_shardings is not None:
    kw["out_shardings"] = case.out_shardings
  if case.dist_edit is not None:  # a GSPMD bug: XLA's module as edited (partitioner_bugs.py)
    from tools.zoo.partitioner_bugs import partitioned_text
    path = os.path.join(outdir, "dist.hlo.txt")
    with open(path, "w") as f:
      f.write(_relative(partitioned_text(case)))
    return written + [path]
  lowered = jax.jit(case.dist_fn, **kw).lower(*case.dist_args)
  path = os.path.join(outdir, "dist.mlir")  # GSPMD: sharded, gg-hlo-verify partitions it
  with open(path, "w") as f:
    f.write(_relative(lowered.as_text(debug_info=True)))
  written.append(path)
  if case.style == "shard_map":
    return written
  with tempfile.TemporaryDirectory() as tmp:
    lowered.compile(compiler_options={
        "xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning",
        "xla_dump_hlo_as_proto": True, "xla_dump_hlo_as_text": True,
        "xla_dump_large_constants": True})
    for ext, name in ((".txt", "dist.hlo.txt"), (".pb", "dist.hlo.pb")):
      src = sorted(glob.glob(os.path.join(tmp, f"*after_spmd-partitioning*{ext}")))[-1]
      dst = os.path.join(outdir, name)
      if ext == ".txt":
        with open(src) as f, open(dst, "w") as g:
          g.write(_relative(f.read()))
      else:
        shutil.copy(src, dst)
      written.append(dst)
  return written


# Model sizes: flag -> Config field (tools/zoo/models.py).
SIZE_FLAGS = ("layers", "d_model", "heads", "kv_heads", "mlp_hidden", "seq", "batch",
              "vocab", "experts")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("cases", nargs="*", help="case names (default: testdata's); see --list")
  p.add_argument("--out", default=os.path.join(REPO, "testdata"))
  p.add_argument("--list", action="store_true", help="list every case name")
  for field in SIZE_FLAGS:
    p.add_argument(f"--{field.replace('_', '-')}", type=int, dest=field,
                   help=f"model cases: Config.{field}")
  args = p.parse_args(argv)
  sys.path.insert(0, REPO)
  import dataclasses
  from tools.zoo import cases, strategies
  from tools.zoo.models import Config
  sizes = {f: getattr(args, f) for f in SIZE_FLAGS if getattr(args, f) is not None}
  cfg = dataclasses.replace(Config(), **sizes)
  if args.list:
    for c in list(cases.all_cases()) + strategies.model_cases(cfg):
      print(c.name)
    return 0
  for name in args.cases or TESTDATA_CASES:
    try:
      case = cases.get(name)
    except KeyError:
      case = strategies.get(name, cfg)
    for path in dump_case(case, os.path.join(args.out, name.replace("/", "__"))):
      print(os.path.relpath(path))
  return 0


if __name__ == "__main__":
  sys.exit(main())
