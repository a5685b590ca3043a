"""Every relation the inference earns holds on numbers (a guard against false
proofs), for every zoo program, correct or buggy; the program those relations
were held on computes, rank by rank, what the distributed program as written
does; the checker itself catches wrong relations; its interpreter agrees with
jax."""

import jax
import numpy as np
import pytest

from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.passes.inference import Relation, RelationInference
from graphguard_hlo.pipeline import prepare_dist, prepare_seq
from graphguard_hlo.relation_check import RTOL, RTOL_BF16, check_relations, close
from tests.zoo_verdicts import verified
from tools.zoo import cases, numeric, strategies

ALL = list(cases.all_cases()) + strategies.model_cases()


def test_names_do_not_clash():
  # zoo_verdicts keeps one outcome per name, shared by three test files.
  names = [c.name for c in ALL]
  assert len(names) == len(set(names))


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_every_inferred_relation_holds_numerically(case):
  result, check = verified(case)
  assert check.ok, check.failures[:5]
  assert check.checked > 0 and check.unknown == 0, check
  if result.refines:  # the outputs' relations are among those checked
    assert check.checked >= len(result.outputs)


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_the_prepared_program_computes_what_the_written_one_does(case):
  """Relations are held on the per-device program *after* preparation
  (inlining, canonicalization, unrolled rings, rank cases).  A preparation
  that changed what it computes would go unseen there, and could even mend a
  seeded bug into a proof.  So: the distributed program as written (XLA's
  run of the JAX function; a partitioner bug's edited module on the
  interpreter), on the same inputs, gives every output on every rank as the
  prepared program did, and was given the inputs the checker laid out."""
  _, check = verified(case)
  assert not check.skipped
  want_inputs, want_outputs = numeric.run_per_device(case, check.seq_inputs)
  problems = []
  assert len(want_inputs) == len(check.dist_inputs)
  for k, (want, got) in enumerate(zip(want_inputs, check.dist_inputs)):
    problems += _rank_differences(f"input {k}", want, got, RTOL_BF16)
  assert len(want_outputs) == len(check.dist_outputs)
  for k, (want, got) in enumerate(zip(want_outputs, check.dist_outputs)):
    assert got is not None, f"output {k}: the interpreter could not compute it"
    problems += _rank_differences(f"output {k}", want, got, check.rtol)
  assert not problems, problems[:5]


def _rank_differences(what, want, got, rtol):
  """Ranks whose values of ``what`` differ (up to unit dims, which the
  prepared program may add or drop)."""
  assert len(want) == len(got)
  squeezed = lambda x: tuple(n for n in np.shape(x) if n != 1)
  return [f"{what} at rank {r}" for r, (w, g) in enumerate(zip(want, got))
          if squeezed(w) != squeezed(g) or not close(np.reshape(g, np.shape(w)), w, rtol)]


def _inference(name, zoo=cases):
  seq, dist = zoo.get(name).modules()
  program = prepare_dist(dist)
  inference = RelationInference(prepare_seq(seq, program), program)
  assert inference.run().refines
  return inference


def _mutate_first(inference, pick, change):
  for rels in inference.relations.values():
    for i, r in enumerate(rels):
      if pick(r.layout):
        rels[i] = Relation(r.cls, change(r.layout), r.how)
        return
  raise AssertionError("no relation to mutate")


@pytest.mark.parametrize("pick,change", [
    (lambda l: l.partial, lambda l: l.with_(partial=())),                 # forget a sum
    (lambda l: l.split_axes(), lambda l: l.with_(dims=((),) * l.rank)),    # tile as replica
    (lambda l: l.rank and not l.partial, lambda l: l.scaled(2.0)),         # wrong scale
], ids=["dropped_partial", "tile_as_replica", "scaled"])
def test_checker_catches_a_wrong_relation(pick, change):
  inference = _inference("tp_mlp/shard_map/ok")
  assert check_relations(inference).ok
  _mutate_first(inference, pick, change)
  assert not check_relations(inference).ok


def test_checker_holds_bfloat16_programs_to_their_precision_and_still_catches():
  """A mixed-precision program is held to bfloat16's tolerance, which a
  wrong relation (a scale of 2, a sum forgotten) still far exceeds."""
  for pick, change in [(lambda l: l.partial, lambda l: l.with_(partial=())),
                       (lambda l: l.rank and not l.partial, lambda l: l.scaled(2.0))]:
    inference = _inference("gpt2/dp_tp_bf16/shard_map/ok", strategies)
    check = check_relations(inference)
    assert check.ok and check.rtol == RTOL_BF16 > RTOL
    _mutate_first(inference, pick, change)
    assert not check_relations(inference).ok


def test_interpreter_agrees_with_jax():
  case = strategies.get("llama3/tp/shard_map/ok")
  seq, dist = case.modules()
  prepare_seq(seq)
  program = prepare_dist(dist)
  inputs = strategies.model_inputs(case)
  want = np.asarray(jax.jit(case.seq_fn)(*inputs))
  g = seq.main
  got = Interpreter(1).run(g, [[np.asarray(x)] for x in inputs])[g.results[0].id][0]
  np.testing.assert_allclose(got, want, rtol=1e-4)
  # The per-device program on 4 ranks, parameters replicated or split as specs say.
  specs = strategies._in_specs("llama3", strategies._STRATEGIES["tp"], strategies.Config())
  local = []
  for x, spec in zip(inputs, specs):
    ranks = []
    for r in range(4):
      y = np.asarray(x)
      for dim, axis in enumerate(spec):
        if axis == "tp":
          y = np.split(y, 4, axis=dim)[r]
      ranks.append(y)
    local.append(ranks)
  out = Interpreter(4).run(program.graph, local)[program.graph.results[0].id]
  for r in range(4):
    np.testing.assert_allclose(out[r], want, rtol=1e-4)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint32])
def test_interpreter_wraps_integers_as_xla_does(dtype):
  """A lowered program's integer constants are held at their own type, so
  arithmetic near the top of the type wraps in the interpreter as in XLA
  (the relation check would otherwise compute a position or an offset that
  the devices never see)."""
  from graphguard_hlo.lowering import lower_sequential
  top = np.iinfo(dtype).max

  def fn(i):
    return (i + dtype(3)) * dtype(5)
  i = np.array([top - 1, top // 2, 7], dtype)
  g = lower_sequential(fn, i).main
  got = Interpreter(1).run(g, [[i]])[g.results[0].id][0]
  np.testing.assert_array_equal(got, np.asarray(jax.jit(fn)(i)))


@pytest.mark.parametrize("dtype, numpy_type", [("i32", np.int32), ("ui8", np.uint8),
                                               ("ui64", np.uint64), ("i1", np.bool_)])
def test_random_inputs_are_drawn_in_their_own_type(dtype, numpy_type):
  """An int64 array meeting a u64 constant cannot even be or-ed in numpy (an
  audit's crash under jax_enable_x64), and an i32 held in int64 never wraps."""
  from graphguard_hlo import ir
  from graphguard_hlo.relation_check import random_value
  x = random_value(ir.TensorType((3, 4), dtype), np.random.default_rng(0))
  assert x.dtype == numpy_type and x.shape == (3, 4)
