"""Collective-permutes that permute mesh axes of one size (passes/sharding.py:
``axis_renaming_of_pairs``): XLA moves shards so between the axes of a
refined mesh (a weight resharded under FSDP x TP round three axes), and a
shard_map program can write one with ``ppermute``.  Rank r then holds what
the rank with r's coordinates permuted back held, so the relation holds with
its axes renamed: proved when the outputs are laid out so, refused when not."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import itertools

import jax.numpy as jnp
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo import ir
from graphguard_hlo.api import verify
from graphguard_hlo.passes.sharding import axis_renaming_of_pairs
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((2, 2, 2), ("x", "y", "z"))
AXES = ("x", "y", "z")
X = jnp.zeros((16, 4))


def _cycle_pairs():
  """Linear indices over (x, y, z): the receiver's y is the sender's x, its z
  the sender's y, its x the sender's z."""
  index = lambda x, y, z: x * 4 + y * 2 + z
  return [(index(x, y, z), index(z, x, y)) for x, y, z in itertools.product(range(2), repeat=3)]


def _cycled(out_axes):
  def local(x):
    return lax.ppermute(x * 2, AXES, _cycle_pairs())
  return shard_map(local, mesh=MESH, in_specs=P(AXES), out_specs=P(out_axes))


def test_a_cycle_of_three_axes_is_found_from_the_device_pairs():
  mesh = ir.Mesh((("x", 2), ("y", 2), ("z", 2)))
  assert axis_renaming_of_pairs(_cycle_pairs(), mesh) == (("x", "y"), ("y", "z"), ("z", "x"))
  broken = [(0, 0), (1, 2), (2, 1), (3, 3), (4, 4), (5, 6), (6, 5), (7, 7)]  # swaps y, z
  assert axis_renaming_of_pairs(broken, mesh) == (("y", "z"), ("z", "y"))
  one_off = [(s, (t + 1) % 8 if s == 0 else t) for s, t in _cycle_pairs()]
  assert axis_renaming_of_pairs(one_off, mesh) is None


def test_rows_permuted_round_three_axes_are_the_tiles_over_the_renamed_axes():
  """Tile (x, y, z) of the rows lands at the rank (z, x, y): the rows tiled
  over ("y", "z", "x"), major to minor."""
  dist = _cycled(("y", "z", "x"))
  assert outputs_agree(lambda x: x * 2, dist, X)
  assert verify(lambda x: x * 2, dist, X).refines


@pytest.mark.parametrize("out_axes", [("x", "y", "z"), ("z", "x", "y")])
def test_rows_permuted_round_three_axes_read_in_another_order_are_not_proved(out_axes):
  dist = _cycled(out_axes)
  assert not outputs_agree(lambda x: x * 2, dist, X)
  assert not verify(lambda x: x * 2, dist, X).refines


def test_renaming_keeps_every_other_part_of_the_relation():
  """Pins, zeros elsewhere, a partial sum's kind, the scale and a partly known
  buffer's tiles survive the renaming (positional construction once put the
  known tiles in the zeros-elsewhere field: a partly known buffer would have
  read as whole)."""
  from graphguard_hlo.passes.layout import Layout
  from graphguard_hlo.passes.transfer import _renamed
  pinned = Layout((("x",), ()), partial=("z",), partial_kind="max", scale=0.5,
                  at=(("y", 1),), zero_elsewhere=True)
  assert _renamed(pinned, {"x": "y", "y": "z", "z": "x"}) == Layout(
      (("y",), ()), partial=("x",), partial_kind="max", scale=0.5, at=(("z", 1),),
      zero_elsewhere=True)
  known = Layout(((), ("y",)), filled=(0, "x", (0, 1)))
  assert _renamed(known, {"x": "z", "z": "x"}) == Layout(((), ("y",)), filled=(0, "z", (0, 1)))
