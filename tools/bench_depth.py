"""Pipeline depth benchmark: verification time as a pipeline's stages hold
more layers, stages unrolled against stages scanning their layers.

    python -m tools.bench_depth --model llama3 --layers 8 16 32 --repeat 3

Each strategy of ``--pair`` (default ``pp`` and ``pp_scan``, names of
``tools/zoo/strategies.py``) is rebuilt with each number of layers on its 4
stages, forward and as a training step (``value_and_grad``).  Per program the
verdict and the median of ``--repeat`` verifications (canonicalization and
relation inference, lowering excluded), measured in this one process.  An
unrolled stage costs its layers; a scanned one is proved by one inductive
step per round (``passes/loop_split.py``), whatever its depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()


def with_layers(strategy, layers: int):
  """``strategy`` with ``layers`` layers in all (its override replaced)."""
  kept = tuple(kv for kv in strategy.cfg_overrides if kv[0] != "layers")
  return dataclasses.replace(strategy, cfg_overrides=kept + (("layers", layers),))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="llama3", choices=("gpt2", "llama3"))
  p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
  p.add_argument("--pair", nargs=2, default=["PP", "PP_SCAN"], metavar=("UNROLLED", "SCANNED"))
  p.add_argument("--repeat", type=int, default=3)
  args = p.parse_args(argv)
  import jax
  from tools.bench_zoo import median_verify_seconds
  from tools.zoo import strategies
  from tools.zoo.models import Config
  print(f"{'layers':>6s}  {'program':34s} {'verdict':10s} {'median':>8s}")
  for layers in args.layers:
    for name in args.pair:
      strategy = with_layers(getattr(strategies, name), layers)
      for kind, case in (
          ("fwd", strategies._shard_map_case(args.model, strategy, Config(), "ok",
                                             strategy.par())),
          ("fwd+bwd", strategies._shard_map_grad_case(args.model, strategy, Config()))):
        proved, seconds = median_verify_seconds(case, args.repeat)
        print(f"{layers:6d}  {strategy.name + ' ' + kind:34s} "
              f"{'proved' if proved else 'not proved':10s} {seconds:7.3f} s", flush=True)
        jax.clear_caches()


if __name__ == "__main__":
  main()
