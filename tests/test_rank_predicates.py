"""Predicates on one mesh coordinate (Transfer.rank_predicate): a compare of
rank arithmetic, or and / or / not of such compares on one axis, pick the
ranks a select takes a value from.  A schedule's "microbatch t - stage is in
range" is two compares and-ed; what rank arithmetic cannot say symbolically
(jnp's floor division) is evaluated on every partition.  Masked psums picking one stage are proved;
masks picking two stages, or none, are not."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo.api import verify
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("pp",))
X = jnp.zeros((4, 8))


def _seq(x):
  return jnp.tanh(x) * 3


def _masked(mask):
  """tanh(x) * 3 computed by every stage, kept where ``mask(stage)`` holds and
  summed over the stages."""
  def local(x):
    stage = lax.axis_index("pp")
    return lax.psum(jnp.where(mask(stage), jnp.tanh(x) * 3, 0.0), "pp")
  return shard_map(local, mesh=MESH, in_specs=P(), out_specs=P())


ONE_STAGE = {
    "and": lambda r: (r >= 2) & (r < 3),
    "or_out_of_range": lambda r: (r == 2) | (r == 7),
    "not": lambda r: ~(r != 2),
    "and_of_offsets": lambda r: (5 - 2 * 2 + r >= 2) & (5 - 2 * 2 + r < 3),
    # An interleaved schedule's "chunk of unit t - stage is 1", t = 6:
    # jnp's floor division and remainder, evaluated on every partition.
    "floor_div_and_mod": lambda r: (((6 - r) // 4) % 2 == 1) & ((6 - r) % 4 == 0),
}
NOT_ONE_STAGE = {
    "and_of_two_stages": lambda r: (r >= 2) & (r < 4),
    "or_of_two_stages": lambda r: (r == 2) | (r == 0),
    "not_of_one": lambda r: ~(r == 2),
    "and_of_none": lambda r: (r >= 3) & (r < 2),
    "floor_div_of_three_stages": lambda r: ((6 - r) // 4) % 2 == 1,
}


@pytest.mark.parametrize("name", ONE_STAGE)
def test_a_mask_picking_one_stage_is_proved(name):
  dist = _masked(ONE_STAGE[name])
  assert outputs_agree(_seq, dist, X)
  result = verify(_seq, dist, X)
  assert result.refines, result


@pytest.mark.parametrize("name", NOT_ONE_STAGE)
def test_a_mask_picking_other_stages_is_not_proved(name):
  dist = _masked(NOT_ONE_STAGE[name])
  assert not outputs_agree(_seq, dist, X)
  assert not verify(_seq, dist, X).refines
