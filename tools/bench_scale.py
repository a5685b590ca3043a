"""Scale benchmark: verify Llama-3-shaped programs, lowering only, never executing.

    python -m tools.bench_scale                  # the default table (a few minutes)
    python -m tools.bench_scale --quick          # small sizes only
    python -m tools.bench_scale --json out.json

Per configuration it reports the ops of each module, load time (StableHLO text
to IR), verification time (canonicalization + relation inference) and the peak
Python heap of verification (tracemalloc; native MLIR memory is excluded, the
process peak RSS is reported beside it).  Three sweeps:

  * models: Llama-3 8B / 70B / 405B shapes (real hidden sizes, GQA, SwiGLU,
    RoPE), Megatron TP over 8 ranks (shard_map, explicit psums), unrolled layers;
  * layers: the 8B shape at 4..32 layers (time must be linear in layers);
  * partitions: the 8B shape at 8, 16, 32, 64 partitions (tp=8, dp up to 8):
    the per-device program is analysed once with symbolic ranks, so time
    should stay flat;
  * the alternative a user has today, for small sizes: run both programs on
    CPU with fake devices and compare outputs (``tools.zoo.numeric``).

Times are medians of ``--repeat`` runs measured in this one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
import tracemalloc

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=64").strip()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LLAMA3 = {  # d_model, heads, kv_heads, mlp_hidden, vocab, layers
    "8b": (4096, 32, 8, 14336, 128256, 32),
    "70b": (8192, 64, 8, 28672, 128256, 80),
    "405b": (16384, 128, 8, 53248, 128256, 126),
}


def _config(model: str, layers=None, seq=2048, batch=1):
  from tools.zoo.models import Config
  d, h, kv, ff, vocab, n = LLAMA3[model]
  return Config(vocab=vocab, d_model=d, heads=h, kv_heads=kv, seq=seq, batch=batch,
                layers=layers or n, mlp_hidden=ff)


def _strategy(dp: int, tp: int, sp: bool = False):
  """Megatron TP over "tp" (with ``sp``: sequence parallel on the same axis,
  Korthikanti et al.), the batch over "dp"."""
  from jax.sharding import PartitionSpec as P
  from tools.zoo import strategies as S
  if sp:
    assert dp == 1
    return S._Strategy(f"sp{tp}", (tp,), ("tp",), P(None, "tp"), S._sp_param_spec, S._sp_par)
  if dp == 1:
    return S._Strategy(f"tp{tp}", (tp,), ("tp",), P(), S._tp_param_spec, S._tp_par)
  return S._Strategy(f"dp{dp}_tp{tp}", (dp, tp), ("dp", "tp"), P("dp", None),
                     S._tp_param_spec, S._dp_tp_par, (("batch", dp),))


def _lower(cfg, dp, tp, grad=False, sp=False):
  import jax
  from graphguard_hlo.lowering import sequential_text
  from tools.zoo import strategies as S
  strat = _strategy(dp, tp, sp)
  if grad:  # a training step: loss and every gradient, inside shard_map
    case = S._shard_map_grad_case("llama3", strat, cfg)
  else:
    case = S._shard_map_case("llama3", strat, cfg, "ok", strat.par())
  seq_text = sequential_text(case.seq_fn, *case.seq_args)
  dist_text = jax.jit(case.dist_fn).lower(*case.dist_args).as_text(debug_info=True)
  return case, seq_text, dist_text


def measure(label: str, cfg, dp: int, tp: int, repeat: int, grad: bool = False,
            sp: bool = False) -> dict:
  from graphguard_hlo.loaders.stablehlo import load_stablehlo
  from graphguard_hlo.passes.inference import verify_programs
  from graphguard_hlo.pipeline import prepare_dist, prepare_seq
  t = time.perf_counter()
  case, seq_text, dist_text = _lower(cfg, dp, tp, grad, sp)
  lower_s = time.perf_counter() - t
  loads, verifies = [], []
  result = None

  def verify_once():
    seq, dist = load_stablehlo("seq", seq_text), load_stablehlo("dist", dist_text)
    t = time.perf_counter()
    program = prepare_dist(dist)
    out = verify_programs(prepare_seq(seq, program), program)
    return out, time.perf_counter() - t

  for _ in range(repeat):
    t = time.perf_counter()
    load_stablehlo("seq", seq_text), load_stablehlo("dist", dist_text)
    loads.append(time.perf_counter() - t)
    result, seconds = verify_once()
    verifies.append(seconds)
  # Memory in a run of its own: tracemalloc slows Python down several times.
  tracemalloc.start()
  verify_once()
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  peaks = [peak]
  return {"label": label, "layers": cfg.layers, "d_model": cfg.d_model, "partitions": dp * tp,
          "dp": dp, "tp": tp, "sp": sp, "grad": grad, "verdict": result.verdict,
          "seq_ops": result.stats["seq_ops"], "dist_ops": result.stats["dist_ops"],
          "lower_s": round(lower_s, 3), "load_s": round(statistics.median(loads), 3),
          "verify_s": round(statistics.median(verifies), 3),
          "peak_heap_mib": round(max(peaks) / 2**20, 1),
          "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def numeric_baseline(cfg, dp, tp, repeat: int) -> dict:
  """What a user does today: run both programs on CPU and compare the outputs."""
  from tools.zoo import numeric
  case, _, _ = _lower(cfg, dp, tp)
  numeric.outputs_match(case)  # compile once
  times = []
  for seed in range(repeat):
    t = time.perf_counter()
    numeric.outputs_match(case, seed=seed)
    times.append(time.perf_counter() - t)
  return {"label": f"numeric run, {cfg.layers} layers d={cfg.d_model}",
          "layers": cfg.layers, "d_model": cfg.d_model, "partitions": dp * tp,
          "run_compare_s": round(statistics.median(times), 3)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--repeat", type=int, default=3)
  p.add_argument("--quick", action="store_true", help="small sizes only")
  p.add_argument("--json", help="write the rows here")
  p.add_argument("--sweeps", default="models,layers,partitions,numeric",
                 help="which sweeps to run (comma-separated)")
  args = p.parse_args(argv)
  sweeps = set(args.sweeps.split(","))
  rows = []

  def run(label, cfg, dp=1, tp=8, grad=False, sp=False, sweep="models"):
    row = measure(label, cfg, dp, tp, args.repeat, grad, sp)
    row["sweep"] = sweep
    rows.append(row)
    print(f"{row['label']:<34} {row['verdict']:<10} seq {row['seq_ops']:>6} dist "
          f"{row['dist_ops']:>6}  load {row['load_s']:>6.2f}s  verify {row['verify_s']:>6.2f}s"
          f"  heap {row['peak_heap_mib']:>7.1f} MiB  rss {row['peak_rss_mib']:>7.0f} MiB",
          flush=True)

  models = ["8b"] if args.quick else ["8b", "70b", "405b"]
  if "models" not in sweeps:
    models = []
  for m in models:
    cfg = _config(m, layers=4 if args.quick else None)
    run(f"llama3-{m} tp=8, {cfg.layers} layers", cfg)
  for m in models:
    cfg = _config(m, layers=4 if args.quick else None)
    run(f"llama3-{m} tp=8 fwd+bwd, {cfg.layers} L", cfg, grad=True)
  for m in models:
    cfg = _config(m, layers=4 if args.quick else None)
    run(f"llama3-{m} tp=8 x sp fwd+bwd, {cfg.layers} L", cfg, grad=True, sp=True)
  for layers in ([2, 4] if args.quick else [4, 8, 16, 32]) if "layers" in sweeps else ():
    run(f"llama3-8b tp=8, {layers} layers", _config("8b", layers=layers), sweep="layers")
  # 32 layers: at 8 the times (~0.15 s) are within this machine's noise.
  part_layers = 4 if args.quick else 32
  for dp in ([1, 2] if args.quick else [1, 2, 4, 8]) if "partitions" in sweeps else ():
    run(f"llama3-8b dp={dp} x tp=8, {part_layers} layers",
        _config("8b", layers=part_layers, batch=dp), dp=dp, sweep="partitions")
  small = _config("8b", layers=2)
  small = dataclasses.replace(small, d_model=256, heads=8, kv_heads=8, mlp_hidden=512,
                              vocab=1024, seq=128)
  if "numeric" in sweeps:
    run("small (d=256) tp=8, 2 layers", small, sweep="numeric")
    base = numeric_baseline(small, 1, 8, args.repeat)
    rows.append(base)
    print(f"{base['label']:<34} run both programs and compare: {base['run_compare_s']:.2f}s")

  lay = [r for r in rows if r.get("sweep") == "layers"]
  part = [r for r in rows if r.get("sweep") == "partitions"]
  if len(lay) >= 2:
    per_layer = [r["verify_s"] / r["layers"] for r in lay]
    print("\nverify seconds per layer (8B shape): "
          + ", ".join(f"{r['layers']}L {v * 1000:.1f} ms" for r, v in zip(lay, per_layer)))
  if len(part) >= 2:
    ratio = part[-1]["verify_s"] / part[0]["verify_s"]
    print(f"verify time {part[-1]['partitions']} vs {part[0]['partitions']} partitions: "
          f"{ratio:.2f}x; " + ", ".join(f"{r['partitions']}: {r['verify_s']:.2f}s" for r in part))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
