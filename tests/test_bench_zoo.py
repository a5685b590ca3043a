"""The benchmarks' helpers: runs compared, twins, depths (timing is a benchmark, not a test)."""

import json

from tools import bench_zoo


def test_compare_gives_each_ratio_their_median_and_verdict_changes(tmp_path, capsys):
  before, after = tmp_path / "before.json", tmp_path / "after.json"
  before.write_text(json.dumps({"a": [True, 2.0], "b": [False, 1.0], "c": [True, 4.0],
                                "gone": [True, 1.0]}))
  after.write_text(json.dumps({"a": [True, 1.0], "b": [True, 1.5], "c": [True, 1.0],
                               "new": [True, 1.0]}))
  bench_zoo.main(["--compare", str(before), str(after)])
  out = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in out[:3]] == ["a", "b", "c"]
  assert "x 0.50" in out[0] and "x 1.50  (proved now)" in out[1] and "x 0.25" in out[2]
  assert out[3] == "3 programs: median ratio 0.50 (min 0.25, max 1.50)"


def test_a_twin_is_named_by_the_first_rule_that_applies():
  known = {"gpt2/cp_ring/shard_map/ok", "gpt2/pp_gpipe_buffered/shard_map/ok"}
  rules = ["pp_gpipe_fori=pp_gpipe_buffered", "_fori="]
  assert bench_zoo.twin_of("gpt2/cp_ring_fori/shard_map/ok", rules, known) == \
      "gpt2/cp_ring/shard_map/ok"
  assert bench_zoo.twin_of("gpt2/pp_gpipe_fori/shard_map/ok", rules, known) == \
      "gpt2/pp_gpipe_buffered/shard_map/ok"
  assert bench_zoo.twin_of("gpt2/pp_fori/shard_map/ok", rules, known) is None  # no such twin
  assert bench_zoo.twin_of("gpt2/cp_ring/shard_map/ok", rules, known) is None  # no rule applies


def test_the_depth_benchmark_replaces_a_strategys_layer_count():
  from tools import bench_depth
  from tools.zoo.strategies import PP_SCAN
  deeper = bench_depth.with_layers(PP_SCAN, 32)
  assert dict(deeper.cfg_overrides)["layers"] == 32
  assert [k for k, _ in deeper.cfg_overrides].count("layers") == 1
  assert dict(deeper.cfg_overrides)["scan_layers"] and deeper.name == PP_SCAN.name
