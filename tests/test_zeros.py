"""Where per-device values are zero (passes/zeros.py) and the transfer rule
that reads it: a relation pinned at stage s survives adding a value that is
zero at s (a pipeline's bubbles).  Proved, the near misses not, and the facts
held against numbers."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo.api import _abstract_args, verify
from graphguard_hlo.lowering import lower_distributed, lower_sequential
from graphguard_hlo.passes.zeros import EVERYWHERE, NOWHERE, Pattern, covers, intersect
from graphguard_hlo.relation_check import verify_and_check
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("pp",))
X = jnp.zeros((4, 8))


def _seq(x):
  return jnp.tanh(x) * 3


def _ring(n=4, shift=1):
  return [(i, (i + shift) % n) for i in range(n)]


def _staged(noise_zero_at=0, shift=1):
  """tanh(x) made at stage 0 and sent round the ring to stage ``shift``, plus
  noise sent round the ring from stages zero only at ``noise_zero_at`` (so at
  stage 1 after the send, in the correct program); scaled there and handed
  to everyone from stage 1."""
  def local(x):
    stage = lax.axis_index("pp")
    h = lax.ppermute(jnp.where(stage == 0, jnp.tanh(x), 0.0), "pp", _ring(shift=shift))
    noise = lax.ppermute(jnp.where(stage == noise_zero_at, 0.0, x * 5), "pp", _ring())
    y = (h + noise) * 3
    return lax.psum(jnp.where(stage == 1, y, 0.0), "pp")
  return shard_map(local, mesh=MESH, in_specs=P(), out_specs=P())


def _agree(dist) -> bool:
  return outputs_agree(_seq, dist, X)


def test_a_pinned_value_plus_zeros_there_is_that_value():
  assert _agree(_staged())
  result = verify(_seq, _staged(), X)
  assert result.refines, result


@pytest.mark.parametrize("bug", [dict(noise_zero_at=1), dict(shift=2)],
                         ids=["noise_not_zero_at_the_pin", "sent_to_another_stage"])
def test_noise_at_the_pin_is_not_proved(bug):
  assert not _agree(_staged(**bug))
  assert not verify(_seq, _staged(**bug), X).refines


def test_zero_facts_hold_numerically_and_the_checker_sees_a_false_one():
  seq = lower_sequential(_seq, X)
  dist = lower_distributed(_staged(), *_abstract_args((X,), MESH, (P(),)))
  result, check = verify_and_check(seq, dist)
  assert result.refines and check.ok and check.zeros_checked >= 3, check

  from graphguard_hlo.passes.inference import RelationInference
  from graphguard_hlo.pipeline import prepare_dist, prepare_seq
  from graphguard_hlo.relation_check import check_relations
  program = prepare_dist(lower_distributed(_staged(), *_abstract_args((X,), MESH, (P(),))))
  inference = RelationInference(prepare_seq(lower_sequential(_seq, X), program), program)
  assert inference.run().refines
  zeros = inference.transfer.zeros
  # Claim the noise is zero at stage 0 too (it is x * 5 there).
  noise = next(c for c in inference.deg.members() if zeros.of(c) == {Pattern({("pp", 0)})})
  zeros._facts[noise] = frozenset({Pattern({("pp", 0)}), Pattern({("pp", 2)})})
  assert not check_relations(inference).ok


def test_patterns():
  at = lambda **c: Pattern(c.items())
  assert intersect(frozenset({at(pp=1)}), frozenset({at(tp=0)})) == {at(pp=1, tp=0)}
  assert intersect(frozenset({at(pp=1)}), frozenset({at(pp=2)})) == NOWHERE
  assert intersect(EVERYWHERE, frozenset({at(pp=2)})) == {at(pp=2)}
  assert covers(frozenset({at(pp=1)}), (("pp", 1), ("tp", 3)))
  assert not covers(frozenset({at(pp=1, tp=0)}), (("pp", 1),))
  assert covers(EVERYWHERE, ())
  assert not covers(frozenset({at(pp=1)}), ())


def test_zero_over_zero_is_no_zero():
  # After a 4-stage pipeline, z is zero at the last stage, so z / z is NaN
  # there, not zero: h + z / z is not h where the masked psum reads it.
  def seq(x, w):
    for i in range(4):
      x = jnp.tanh(x @ w[i])
    return x

  def local(x, w):
    s, h = lax.axis_index("pp"), x
    for t in range(4):
      h = jnp.tanh(h @ w[0])
      if t < 3:
        h = lax.ppermute(h, "pp", [(i, (i + 1) % 4) for i in range(4)])
    z = jnp.where(s == 3, 0.0, h)
    return lax.psum(jnp.where(s == 3, h + z / z, 0.0), "pp")
  dist = shard_map(local, mesh=MESH, in_specs=(P(), P("pp")), out_specs=P())
  x, w = jnp.zeros((4, 8)), jnp.zeros((4, 8, 8))
  assert not outputs_agree(seq, dist, x, w)
  assert not verify(seq, dist, x, w).refines


# A loop over the noise: its zeros at stage 1 survive where every iteration
# keeps a zero carry zero (a stage's scanned backward on a bubble's zero
# cotangent), and not where an iteration adds something, or swaps the zero
# carry with one that is not zero.
_KEEPS_ZEROS = {
    "scaled_and_added": lambda c, d, x: (c * x + c, d),
    "nonlinear_but_zero_preserving": lambda c, d, x: (jnp.tanh(c) * x, d),
    "inner_loop": lambda c, d, x: (lax.fori_loop(0, 2, lambda j, e: e * x, c), d),
}
_LOSES_ZEROS = {
    "constant_added": lambda c, d, x: (c + 1.0, d),
    "input_added": lambda c, d, x: (c * x + x, d),
    "swapped_with_a_nonzero_carry": lambda c, d, x: (d, c),
}


def _staged_loop(body):
  """``_staged`` with the noise (zero at stage 1 after its send) and x * 5
  carried through three iterations of ``body(noise, other, x)``."""
  def local(x):
    stage = lax.axis_index("pp")
    h = lax.ppermute(jnp.where(stage == 0, jnp.tanh(x), 0.0), "pp", _ring())
    noise = lax.ppermute(jnp.where(stage == 0, 0.0, x * 5), "pp", _ring())
    other = jnp.where(stage >= 0, x * 5, 0.0)  # (varying over pp, as the noise)
    noise, _ = lax.fori_loop(0, 3, lambda i, cd: body(*cd, x), (noise, other))
    return lax.psum(jnp.where(stage == 1, (h + noise) * 3, 0.0), "pp")
  return shard_map(local, mesh=MESH, in_specs=P(), out_specs=P())


@pytest.mark.parametrize("name", sorted(_KEEPS_ZEROS))
def test_zeros_through_a_loop_that_keeps_them(name):
  dist = _staged_loop(_KEEPS_ZEROS[name])
  assert outputs_agree(_seq, dist, X + 0.5)
  seq_module = lower_sequential(_seq, X)
  result, check = verify_and_check(
      seq_module, lower_distributed(dist, *_abstract_args((X,), MESH, (P(),))))
  assert result.refines, result
  assert check.ok and check.zeros_checked >= 3, check


@pytest.mark.parametrize("name", sorted(_LOSES_ZEROS))
def test_zeros_through_a_loop_that_loses_them_are_not_assumed(name):
  dist = _staged_loop(_LOSES_ZEROS[name])
  assert not outputs_agree(_seq, dist, X + 0.5)
  assert not verify(_seq, dist, X).refines
