"""The CLI contract: exit 0 proved, 1 not proved, 2 input error on one line."""

import json
import os
import subprocess
import sys

import pytest

from graphguard_hlo import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TD = os.path.join(REPO, "testdata")


def _pair(name, dist="dist.mlir"):
  return os.path.join(TD, name, "seq.mlir"), os.path.join(TD, name, dist)


def _run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.parametrize("dist", ["dist.hlo.pb", "dist.hlo.txt", "dist.mlir"])
def test_gspmd_pair_refines(capsys, dist):
  """XLA's per-device module as a proto or as text, or the sharded StableHLO
  jax lowers (partitioned here by XLA)."""
  seq, d = _pair("tp_mlp__gspmd__ok", dist)
  if dist.endswith(".txt"):
    pytest.importorskip("graphguard_hlo.loaders.hlo_text")
  code, out, _ = _run(capsys, seq, d)
  assert code == 0, out
  assert "refines" in out
  # Only the text dump leaves the output's sharding unsaid, and the report says so.
  assert ("note: DIST declares no sharding for output(s) 0" in out) == dist.endswith(".txt")


def _output_alone_split(tmp_path):
  """An MLP with replicated inputs and its output split over "tp": the
  sequential module written to ``tmp_path``, and the jitted one lowered."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
  mlp = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2
  shapes = [(8, 16), (16, 32), (32, 16)]
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  sharded = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P()))
             for s in shapes]
  (tmp_path / "seq.mlir").write_text(jax.jit(mlp).lower(*args).as_text())
  return str(tmp_path / "seq.mlir"), jax.jit(mlp, out_shardings=NamedSharding(
      mesh, P(None, "tp"))).lower(*sharded)


def test_a_sharded_stablehlo_file_whose_output_alone_is_split(tmp_path, capsys):
  """XLA's partitioned proto does not record the partition count; the
  sharded file's header does."""
  seq, lowered = _output_alone_split(tmp_path)
  (tmp_path / "dist.mlir").write_text(lowered.as_text())
  code, out, _ = _run(capsys, seq, str(tmp_path / "dist.mlir"), "--format", "json")
  assert code == 0, out
  assert json.loads(out)["outputs"] == [{"index": 0, "relation": "concat[dim1:tp](out0@r)"}]


def test_a_partitioned_proto_that_tells_no_mesh_is_not_a_crash(tmp_path, capsys):
  """The same program dumped by XLA as a proto: no partition count, no
  sharded input, no collective; a program on one device as far as the file
  says (every rank's column offset read from a table of one row)."""
  import glob
  from graphguard_hlo.xla_partition import DUMP_OPTIONS
  seq, lowered = _output_alone_split(tmp_path)
  lowered.compile(compiler_options=dict(DUMP_OPTIONS, xla_dump_to=str(tmp_path / "dump")))
  [proto] = glob.glob(str(tmp_path / "dump" / "*after_spmd-partitioning*.pb"))[-1:]
  code, out, err = _run(capsys, seq, proto)
  assert code in (0, 1) and "Traceback" not in out + err, (code, out, err)


def test_shard_map_pair_refines_json(capsys):
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--format", "json")
  assert code == 0
  doc = json.loads(out)
  assert doc["verdict"] == "refines" and doc["failure"] is None
  assert doc["outputs"] == [{"index": 0, "relation": "replica(out0@r)"}]


def test_missing_allreduce_reported_json(capsys):
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__missing_allreduce"), "--format", "json")
  assert code == 1
  doc = json.loads(out)
  assert doc["verdict"] == "not_proved"
  f = doc["failure"]
  assert f["op"] == "add" and f["location"].startswith("tools/zoo/cases.py:")
  assert "missing all-reduce" in f["diagnosis"]
  assert any("sum[tp]" in r for i in f["inputs"] for r in i["relations"])


def test_text_report_is_compiler_style(capsys):
  code, out, _ = _run(capsys, *_pair("sp_allgather_mlp__shard_map__wrong_gather_dim"))
  assert code == 1
  assert "tools/zoo/cases.py:" in out and ": error: 'dot_general'" in out


def test_relation_file_overrides_input_layout(tmp_path, capsys):
  # Claim w1 is replicated although each rank holds a column block: the
  # shapes no longer fit, an input error naming the parameter.
  rel = tmp_path / "rel.txt"
  rel.write_text("# wrong on purpose\n1: replicated\n")
  code, _, err = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--relation", str(rel))
  assert code == 2 and "parameter 1" in err


def test_relation_file_chunk_order_is_read(tmp_path, capsys):
  # The input's rows in another order than the per-device program reads
  # them: parsed, then not proved (the MLP mixes no rows, but the output's
  # relation keeps the order, and the declared one has none).
  rel = tmp_path / "rel.txt"
  rel.write_text("0: order0=1,0\n")
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--relation", str(rel))
  assert code == 1, out
  assert "chunks[dim0: 1 0]" in out


def test_relation_file_that_matches_is_accepted(tmp_path, capsys):
  rel = tmp_path / "rel.txt"
  rel.write_text("0: replicated\n1: dim1=tp\n2: dim0=tp\n3: dim0=tp  # row-parallel\n")
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--relation", str(rel))
  assert code == 0, out


@pytest.mark.parametrize("text,line,needle", [
    ("1 dim1=tp\n", 1, "expected '<parameter index>: <layout>'"),
    ("\n1: dim1=zz\n", 2, "unknown mesh axis 'zz'"),
    ("1: dim7=tp\n", 1, "dim7 out of range"),
    ("9: replicated\n", 1, "parameter 9 does not exist"),
    ("1: dim0=tp dim1=tp\n", 1, "used twice"),
    ("0: order1=0,2\n", 1, "order1 must list the chunks 0..n-1 once each"),
    ("0: order1=0\n", 1, "order1 must list the chunks 0..n-1 once each"),
    ("0: order3=1,0\n", 1, "order3 out of range"),
    ("0: order1=1,0 order1=0,1\n", 1, "order1 is given twice"),
    ("0: order0=0,1,2,3,4,5,6\n", 1, "does not cut into 7 equal chunks"),
    ("0: order1=a,b\n", 1, "cannot read 'order1=a,b'"),
])
def test_bad_relation_file(tmp_path, capsys, text, line, needle):
  rel = tmp_path / "rel.txt"
  rel.write_text(text)
  code, out, err = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--relation", str(rel))
  assert code == 2
  assert err.count("\n") == 1 and f"rel.txt:{line}:" in err and needle in err


def _bad(tmp_path, name, content):
  p = tmp_path / name
  p.write_bytes(content if isinstance(content, bytes) else content.encode())
  return str(p)


@pytest.mark.parametrize("name,content,needle", [
    ("empty.mlir", "", "empty file"),
    ("garbage.mlir", "module { this is not mlir }", "error"),
    ("truncated.mlir", None, "error"),
    ("notes.txt", "hello world\n", "unrecognized format"),
    ("bin.pb", b"\x0a\x05hello\xff\xfe", "not a valid HLO proto"),
])
def test_bad_module_is_one_line_exit_2(tmp_path, capsys, name, content, needle):
  seq, _ = _pair("tp_mlp__shard_map__ok")
  if content is None:
    with open(seq) as f:
      text = f.read()
    content = text[: len(text) // 2]
  bad = _bad(tmp_path, name, content)
  code, out, err = _run(capsys, seq, bad)
  assert code == 2
  assert err.count("\n") == 1 and name in err and needle in err
  assert "Traceback" not in err


def test_missing_file_and_directory(tmp_path, capsys):
  seq, _ = _pair("tp_mlp__shard_map__ok")
  code, _, err = _run(capsys, seq, str(tmp_path / "nope.mlir"))
  assert code == 2 and "no such file" in err
  code, _, err = _run(capsys, seq, str(tmp_path))
  assert code == 2 and "is a directory" in err


def test_mismatched_parameter_counts(capsys):
  seq, _ = _pair("dp_loss__shard_map__psum_not_pmean")
  _, dist = _pair("tp_mlp__shard_map__ok")
  code, _, err = _run(capsys, seq, dist)
  assert code == 2 and "parameters" in err


def test_usage_error_exit_2():
  proc = subprocess.run([sys.executable, "-m", "graphguard_hlo.cli", "only-one-arg"],
                        capture_output=True, text=True)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_check_relations_holds_on_a_proved_pair(capsys):
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--check-relations")
  assert code == 0, out
  assert "relation check: " in out and "all hold" in out
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--check-relations",
                      "--format", "json")
  check = json.loads(out)["relation_check"]
  assert code == 0 and check["ok"] and check["checked"] > 0 and not check["failures"]


def _false_add(op, layouts):
  """A wrong lemma, seeded: (sum_r a_r) + b = a_r + b on every rank, for a
  replicated b (a missing all-reduce taken for none needed)."""
  a, b = layouts
  if a.partial and not b.partial and a.dims == b.dims:
    yield op.attrs, a.with_(partial=())


def test_check_relations_withdraws_a_proof_resting_on_a_wrong_lemma(capsys, monkeypatch):
  """With the wrong lemma the missing all-reduce is 'proved' (the output a
  replica); the relations fail on numbers, so the verdict is withdrawn:
  exit 3, one line on stderr naming the first relation that fails."""
  from graphguard_hlo.passes import lemmas
  wrong = lemmas.Lemma("seeded-wrong-add", frozenset({"add"}), "false", _false_add)
  monkeypatch.setattr(lemmas, "LEMMAS", (wrong,) + lemmas.LEMMAS)
  pair = _pair("tp_mlp__shard_map__missing_allreduce")
  code, out, _ = _run(capsys, *pair)
  assert code == 0 and "output 0 = replica" in out, out  # the seed works: a false proof
  code, out, err = _run(capsys, *pair, "--check-relations")
  assert code == cli.EXIT_INTERNAL, out
  assert "FAIL" in out and out.strip().endswith("proof withdrawn: its relations fail on numbers")
  assert "withdrawn" in err and len(err.strip().splitlines()) == 1, err
  code, out, _ = _run(capsys, *pair, "--check-relations", "--quiet")
  assert code == cli.EXIT_INTERNAL and out.strip().endswith("proof withdrawn: its relations "
                                                            "fail on numbers"), out
  code, out, _ = _run(capsys, *pair, "--check-relations", "--format", "json")
  doc = json.loads(out)
  assert code == cli.EXIT_INTERNAL and doc["verdict"] == "withdrawn"
  assert doc["relation_check"]["failures"]


def test_a_relation_check_that_cannot_run_leaves_the_verdict(capsys, monkeypatch):
  """A mesh the interpreter cannot simulate (devices out of iota order) checks
  nothing: said, and the proof stands (exit 0); ``RelationCheck.ok`` is false,
  so the test suite's checks still fail on it."""
  from graphguard_hlo import relation_check
  from graphguard_hlo.interpret import Unsupported

  def refuse(mesh):
    raise Unsupported("non-iota device order")
  monkeypatch.setattr(relation_check, "mesh_coords", refuse)
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--check-relations")
  assert code == 0 and "relation check: skipped (cannot simulate the mesh: non-iota" in out, out
  code, out, _ = _run(capsys, *_pair("tp_mlp__shard_map__ok"), "--check-relations",
                      "--format", "json")
  doc = json.loads(out)
  assert code == 0 and doc["verdict"] == "refines" and not doc["relation_check"]["ok"]
