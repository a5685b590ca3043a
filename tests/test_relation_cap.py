"""The cap on relations per value: a report says when a value near the failure
reached it, and raising it (``max_relations``, ``--max-relations``) keeps
the relation the cap dropped; under the cap a report never mentions it.

The program: a replicated 16x16x16 input the per-device program slices in
``n_views`` ways (each returned under its own out_spec, so each is a relation
of the input), then once more as [a, b, c] tiles for a product with a sharded
weight.  Past 24 views the input's relations are cut and some view is left
unrelated."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

from graphguard_hlo import cli
from graphguard_hlo.loaders import load_module
from graphguard_hlo.loaders.stablehlo import load_stablehlo
from graphguard_hlo.passes.diagnose import diagnose_op
from graphguard_hlo.passes.inference import MAX_RELATIONS_PER_VALUE, RelationInference
from graphguard_hlo.pipeline import prepare_dist, prepare_seq
from graphguard_hlo.relation_check import check_relations

N = 16
PAIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testdata",
                    "tp_mlp__shard_map__missing_allreduce")
TILED = P("a", "b", "c")


def _mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))


def _views(n_views: int) -> list:
  """The first ``n_views`` partition specs of a rank-3 array over axes a, b, c
  (each axis on one dim or none, in every order), other than TILED."""
  specs = []
  for dim_of_axis in itertools.product(range(4), repeat=3):  # 3: the axis is unused
    dims = [[ax for ax, d in zip("abc", dim_of_axis) if d == k] for k in range(3)]
    for orders in itertools.product(*[itertools.permutations(d) for d in dims]):
      spec = P(*[o if len(o) > 1 else (o[0] if o else None) for o in orders])
      if spec != TILED and any(orders):
        specs.append(spec)
  assert len(specs) >= n_views
  return specs[:n_views]


def _tile(x, spec):
  """This rank's tile of replicated ``x`` under ``spec``."""
  starts, sizes = [], []
  for d in range(3):
    entry = spec[d] if d < len(spec) else None
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
    index, count = 0, 1
    for ax in axes:
      index, count = index * 2 + jax.lax.axis_index(ax), count * 2
    sizes.append(N // count)
    starts.append(index * (N // count))
  return jax.lax.dynamic_slice(x, starts, sizes)


def _texts(n_views: int, weight_tile=TILED) -> tuple[str, str]:
  """The (seq, dist) StableHLO texts; ``weight_tile``: the spec the product
  slices the input by (TILED is right, anything else a seeded bug)."""
  views = _views(n_views)

  def seq(x, w):
    return (x * w,) + tuple(x + 0 for _ in views)

  def per_device(x, w):
    return (_tile(x, weight_tile) * w,) + tuple(_tile(x, s) + 0 for s in views)

  dist = shard_map(per_device, mesh=_mesh(), in_specs=(P(), TILED),
                   out_specs=(TILED,) + tuple(views), check_vma=False)
  x = jax.ShapeDtypeStruct((N, N, N), jnp.float32)
  return (jax.jit(seq).lower(x, x).as_text(debug_info=True),
          jax.jit(dist).lower(x, x).as_text(debug_info=True))


def _infer(n_views: int, weight_tile=TILED, **kw):
  seq, dist = (load_stablehlo(name, text) for name, text in
               zip(("<seq>", "<dist>"), _texts(n_views, weight_tile)))
  program = prepare_dist(dist)
  inference = RelationInference(prepare_seq(seq, program), program, **kw)
  return inference, inference.run()


def test_a_value_past_the_cap_is_named_in_the_report():
  inference, result = _infer(MAX_RELATIONS_PER_VALUE + 2)
  assert not result.refines
  assert inference.capped
  assert f"reached the cap of {MAX_RELATIONS_PER_VALUE} relations" in result.failure.diagnosis
  assert "--max-relations" in result.failure.diagnosis


def test_raising_the_cap_proves_it_and_every_relation_holds():
  inference, result = _infer(MAX_RELATIONS_PER_VALUE + 2, max_relations=64)
  assert result.refines, result.failure
  assert not inference.capped
  check = check_relations(inference, seed=0)
  assert check.ok and check.checked > MAX_RELATIONS_PER_VALUE, check


def test_under_the_cap_proved_and_never_mentioned():
  inference, result = _infer(4)
  assert result.refines and not inference.capped


def test_a_bug_under_the_cap_is_reported_without_the_cap():
  # The product slices the input as [b, a, c] tiles: a different tile than the weight's.
  inference, result = _infer(4, weight_tile=P("b", "a", "c"))
  assert not result.refines and not inference.capped
  assert result.failure.op_name == "multiply"
  assert "cap" not in result.failure.diagnosis


def _failing_op(inference, result):
  return next(o for o in inference.seq.ops if o.location == result.failure.location
              and o.name == result.failure.op_name)


def test_a_capped_value_near_an_op_is_said_after_the_bug_words():
  # The cap is a possible cause, never said in place of a bug pattern found:
  # mark the operands of the missing all-reduce's add capped, diagnose again.
  program = prepare_dist(load_module(os.path.join(PAIR, "dist.mlir")))
  inference = RelationInference(prepare_seq(load_module(os.path.join(PAIR, "seq.mlir")),
                                            program), program)
  result = inference.run()
  op = _failing_op(inference, result)
  bug_words = diagnose_op(inference, op).diagnosis
  assert "missing all-reduce" in bug_words and "cap" not in bug_words
  inference.capped = {op.operands[0].id}
  words = diagnose_op(inference, op).diagnosis
  assert words.startswith(bug_words + "; %")
  assert words.endswith("(raise the cap: --max-relations N, or max_relations=N in Python)")


def test_a_capped_value_is_said_instead_of_no_lemma():
  inference, result = _infer(4, weight_tile=P("b", "a", "c"))
  op = _failing_op(inference, result)
  assert "no lemma gives a clean expression" in result.failure.diagnosis
  x = op.operands[0]
  while x.producer is not None:  # the input itself, up to two ops above the product
    x = x.producer.operands[0]
  inference.capped = {x.id}
  assert diagnose_op(inference, op).diagnosis.startswith(f"%{x.id} reached the cap of ")
  inference.capped = {-1}
  assert "cap" not in diagnose_op(inference, op).diagnosis


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
  """The past-the-cap pair as StableHLO files, for the CLI."""
  out = tmp_path_factory.mktemp("cap")
  paths = []
  for name, text in zip(("seq.mlir", "dist.mlir"), _texts(MAX_RELATIONS_PER_VALUE + 2)):
    (out / name).write_text(text)
    paths.append(str(out / name))
  return paths


def test_cli_cap_flag(dumped, capsys):
  assert cli.main([*dumped, "--quiet"]) == cli.EXIT_NOT_PROVED
  assert cli.main([*dumped, "--format", "json"]) == cli.EXIT_NOT_PROVED
  assert "--max-relations" in capsys.readouterr().out
  assert cli.main([*dumped, "--quiet", "--max-relations", "64"]) == cli.EXIT_REFINES


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_cli_bad_cap_is_one_line_exit_2(dumped, capsys, bad):
  try:
    code = cli.main([*dumped, "--max-relations", bad])
  except SystemExit as e:  # argparse's own checks (not a number) exit from the parser
    code = e.code
  assert code == cli.EXIT_INPUT_ERROR
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "--max-relations" in err


def test_python_api_cap(dumped):
  import graphguard_hlo as gg
  assert not gg.verify_files(*dumped).refines
  assert gg.verify_files(*dumped, max_relations=64).refines
  with pytest.raises(ValueError, match="max_relations must be positive"):
    gg.verify_files(*dumped, max_relations=0)
