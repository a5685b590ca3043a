"""Identical unrolled layers derive their relation steps once: the lemma steps
and the transfer closure are memoized on keys that do not grow with depth."""

import pytest

from graphguard_hlo.passes.inference import RelationInference
from graphguard_hlo.pipeline import prepare_dist, prepare_seq
from tools.zoo import strategies
from tools.zoo.models import Config


def _inference(layers: int, name: str):
  case = strategies.get(name, Config(layers=layers))
  seq, dist = case.modules()
  inference = RelationInference(prepare_seq(seq), prepare_dist(dist))
  assert inference.run().refines
  return inference


@pytest.mark.parametrize("name", ["llama3/tp/shard_map/ok", "gpt2/sp_grad/shard_map/ok"])
def test_step_derivations_do_not_grow_with_depth(name):
  two, four = _inference(2, name), _inference(4, name)
  assert len(four.seq.ops) > 1.5 * len(two.seq.ops)
  assert len(four._step_memo) == len(two._step_memo)
