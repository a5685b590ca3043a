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
    ("llama3/dp_tp/gspmd/wrong_replica_groups", "dist.hlo.txt", 1),
])
def test_dumped_model_pair_verifies(tmp_path, capsys, name, dist_file, code):
  assert gen_testdata.main([name, "--out", str(tmp_path), "--layers", "1",
                            "--d-model", "64", "--heads", "8", "--kv-heads", "2"]) == 0
  folder = tmp_path / name.replace("/", "__")
  assert {"seq.mlir", dist_file} <= set(os.listdir(folder))
  assert "64" in (folder / "seq.mlir").read_text()  # the requested width
  assert cli.main([str(folder / "seq.mlir"), str(folder / dist_file), "--quiet"]) == code
