"""tools.gen_testdata dumps any (model, strategy, size, bug) as files that
gg-hlo-verify reads: a correct pair proves, a seeded bug does not."""

import os

import pytest

from graphguard_hlo import cli
from tools import gen_testdata


@pytest.mark.parametrize("name,dist_file,code", [
    ("llama3/dp_tp/shard_map/ok", "dist.mlir", 0),
    ("llama3/dp_tp/shard_map/wrong_replica_groups", "dist.mlir", 1),
    ("gpt2/tp_scan/gspmd/ok", "dist.hlo.pb", 0),
    ("llama3/dp_tp_grad/gspmd/ok", "dist.mlir", 0),  # sharded StableHLO: XLA partitions it
    ("llama3/pp_gpipe/gspmd/fed_to_stage_1", "dist.mlir", 1),
    ("llama3/dp_tp/gspmd/wrong_replica_groups", "dist.hlo.txt", 1),
])
def test_dumped_model_pair_verifies(tmp_path, capsys, name, dist_file, code):
  assert gen_testdata.main([name, "--out", str(tmp_path), "--layers", "1",
                            "--d-model", "64", "--heads", "8", "--kv-heads", "2"]) == 0
  folder = tmp_path / name.replace("/", "__")
  assert {"seq.mlir", dist_file} <= set(os.listdir(folder))
  assert "64" in (folder / "seq.mlir").read_text()  # the requested width
  assert cli.main([str(folder / "seq.mlir"), str(folder / dist_file), "--quiet"]) == code


def test_dumped_pair_with_a_relation_file(tmp_path):
  # A zig-zag batch from the data loader: the shardings cannot say it, the
  # dumped relation.txt does; without it the batch reads as contiguous shards.
  name = "llama3/cp_zigzag_loaded/shard_map/ok"
  assert gen_testdata.main([name, "--out", str(tmp_path), "--layers", "1"]) == 0
  folder = tmp_path / name.replace("/", "__")
  assert (folder / "relation.txt").read_text().startswith("0: dim1=cp order1=0,7,1,6,2,5,3,4")
  pair = [str(folder / "seq.mlir"), str(folder / "dist.mlir"), "--quiet"]
  assert cli.main(pair + ["--relation", str(folder / "relation.txt")]) == 0
  assert cli.main(pair) == 1
