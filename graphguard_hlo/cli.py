"""``gg-hlo-verify SEQ DIST``: prove DIST refines SEQ, or say where it does not.

Exit codes: 0 refinement proved; 1 not proved (with the failing op); 2 usage
or input error (one line: file, line, what is wrong); 3 with
``--check-relations``, a proof whose relations do not hold on numbers (a bug
in graphguard-hlo: the verdict is withdrawn).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from graphguard_hlo.errors import InputError

EXIT_REFINES, EXIT_NOT_PROVED, EXIT_INPUT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit 2, like every other input error
    self.exit(EXIT_INPUT_ERROR, f"gg-hlo-verify: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog="gg-hlo-verify", description=__doc__.split("\n")[0])
  p.add_argument("seq", metavar="SEQ", help="sequential module (.mlir, .mlirbc, HLO .txt, .pb)")
  p.add_argument("dist", metavar="DIST", help="distributed module: per-device SPMD module, "
                 "shard_map StableHLO, or sharded StableHLO")
  p.add_argument("--relation", metavar="FILE", help="input relation file (see README)")
  p.add_argument("--format", choices=("text", "json"), default="text")
  p.add_argument("--num-partitions", type=int, metavar="N",
                 help="partition count, when DIST does not record it")
  p.add_argument("--max-relations", type=int, metavar="N", default=None,
                 help="relations kept per sequential value (default: MAX_RELATIONS_PER_VALUE "
                 "in passes/inference.py); raise it when a report says the cap was reached")
  p.add_argument("--quiet", action="store_true", help="print only the verdict line")
  p.add_argument("--check-relations", action="store_true",
                 help="also run both programs on random inputs (every rank simulated on CPU) "
                 "and hold each relation the proof used against the numbers: a guard on the "
                 "verifier itself; costs a run of the per-device program per rank")
  p.add_argument("--seed", type=int, default=0, metavar="N",
                 help="random inputs' seed for --check-relations (default 0)")
  p.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML report: "
                 "the verdict and the sequential graph around the failure")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  try:
    return _run(args)
  except InputError as e:
    print(e.one_line(), file=sys.stderr)
    return EXIT_INPUT_ERROR
  except KeyboardInterrupt:
    return 130


def _run(args) -> int:
  from graphguard_hlo import report
  from graphguard_hlo.loaders import load_module
  from graphguard_hlo.passes.inference import MAX_RELATIONS_PER_VALUE, RelationInference
  from graphguard_hlo.progress import Progress
  from graphguard_hlo.pipeline import prepare_dist, prepare_seq
  from graphguard_hlo.relation_file import input_layouts

  if args.num_partitions is not None and args.num_partitions < 1:
    raise InputError(None, f"--num-partitions must be positive, got {args.num_partitions}")
  if args.max_relations is not None and args.max_relations < 1:
    raise InputError(None, f"--max-relations must be positive, got {args.max_relations}")
  seq = load_module(args.seq)
  dist = load_module(args.dist)
  if not args.quiet and args.format == "text":
    print(f"SEQ  {seq.summary()}")
    print(f"DIST {dist.summary()}")
  program = prepare_dist(dist, args.num_partitions)
  prepare_seq(seq, program)
  layouts = program.param_layouts
  if args.relation:
    try:
      with open(args.relation) as f:
        text = f.read()
    except OSError as e:
      raise InputError(args.relation, f"cannot read: {e.strerror}") from None
    layouts = input_layouts(args.relation, text, seq, program)
  inference = RelationInference(  # kept: the HTML report reads it
      seq, program, layouts, max_relations=args.max_relations or MAX_RELATIONS_PER_VALUE)
  progress = Progress(len(seq.main.ops), enabled=False if args.quiet else None)
  inference.on_progress = progress.update
  try:
    result = inference.run()
  finally:
    progress.close()
  if args.check_relations:
    from graphguard_hlo.relation_check import check_relations
    result.relation_check = check_relations(inference, args.seed)
  withdrawal = f"{args.dist}: proof withdrawn: its relations fail on numbers"
  if args.format == "json":
    print(report.to_json(result))
  elif args.quiet:
    print(withdrawal if result.withdrawn
          else report.to_text(result, args.seq, args.dist).splitlines()[0])
  else:
    print(report.to_text(result, args.seq, args.dist))
    if result.relation_check is not None:
      print(report.relation_check_text(result.relation_check))
    if result.withdrawn:
      print(withdrawal)
  if result.withdrawn:
    from graphguard_hlo.relation_check import ProofWithdrawn
    print(f"gg-hlo-verify: internal error: {ProofWithdrawn(result.relation_check)}",
          file=sys.stderr)
  if args.html:
    from graphguard_hlo import html_report
    html_report.write_html(args.html, result, seq.main, inference, args.seq, args.dist)
  if result.withdrawn:
    return EXIT_INTERNAL
  return EXIT_REFINES if result.refines else EXIT_NOT_PROVED


def run() -> None:
  sys.exit(main())


if __name__ == "__main__":
  run()
