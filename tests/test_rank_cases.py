"""Buffers written and read at rows that depend on the rank (passes/rank_cases.py):
each stage writes row ``t - stage`` at step t, as a pipeline keeps its inputs
for the backward pass, and reads a row back.  Proved when the row read holds
the sequential value, with its relations checked numerically; refused when it
holds another step's, and near misses left to the layouts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import PartitionSpec as P

from graphguard_hlo.api import _abstract_args, verify
from graphguard_hlo.lowering import lower_distributed, lower_sequential
from graphguard_hlo.pipeline import prepare_dist
from graphguard_hlo.relation_check import verify_and_check
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MESH = mesh_of((4,), ("pp",))
X = jnp.zeros((4, 8))


def _seq(x):
  return (jnp.tanh(x) * 3)[3:4]


def _staged(read=lambda stage: 3 - stage, keep_at=2, guard=True, steps=4):
  """At step t, stage s writes row 3 of tanh(x) * 3, scaled by t + 1 - 3 = 1
  only at t = 3, into row t - s of a buffer (only where that row exists, if
  ``guard``); then reads row ``read(s)`` and hands stage ``keep_at``'s to
  everyone.  Row 3 - s at stage s was written at step 3."""
  def local(x):
    stage = lax.axis_index("pp")
    y = jnp.tanh(x) * 3
    buf = jnp.zeros((4, 8))
    for t in range(steps):
      f = t - stage
      new = lax.dynamic_update_index_in_dim(buf, y[3] * np.float32(t - 2), f, 0)
      buf = jnp.where((f >= 0) & (f < 4), new, buf) if guard else new
    row = lax.dynamic_index_in_dim(buf, read(stage), 0)
    return lax.psum(jnp.where(stage == keep_at, row, 0.0), "pp")
  return shard_map(local, mesh=MESH, in_specs=P(), out_specs=P())


@pytest.mark.parametrize("keep_at", range(4))
def test_a_row_written_at_step_minus_stage_is_read_back(keep_at):
  _proved_and_checked(_staged(keep_at=keep_at))


def test_a_row_read_past_the_end_is_clamped_like_the_op():
  """Stage 0 reads row 7 - 0: XLA clamps it to row 3, written at step 3."""
  _proved_and_checked(_staged(read=lambda stage: 7 - stage, keep_at=0))


def _proved_and_checked(dist, seq=_seq, x=X, mesh=MESH, spec=P()):
  """The outputs agree, the verdict is refines, and every relation it earned
  holds on the reference interpreter's numbers."""
  assert outputs_agree(seq, dist, x)
  result, check = verify_and_check(lower_sequential(seq, x), lower_distributed(
      dist, *_abstract_args((x,), mesh, (spec,))))
  assert result.refines and check.ok, (result, check)


@pytest.mark.parametrize("bug", [
    dict(read=lambda stage: 2 - stage),           # another step's row (t = 2: scaled by 0)
    dict(read=lambda stage: 3 - stage, keep_at=3, steps=3),  # row never written there
    dict(read=lambda stage: stage),               # at stage 2, row 2: written at step 4? never
    dict(read=lambda stage: 2 + stage, keep_at=0),  # row 2 at stage 0: step 2's, scaled by 0
], ids=["another_steps_row", "never_written", "row_at_the_stage", "row_next_to_a_clamped_one"])
def test_a_row_holding_another_value_is_not_proved(bug):
  dist = _staged(**bug)
  assert not outputs_agree(_seq, dist, X)
  assert not verify(_seq, dist, X).refines


@pytest.mark.parametrize("keep_at", range(4))
def test_unguarded_writes_clamp_and_wrap_like_the_ops(keep_at):
  """Without the guard, rows t - s < 0 wrap (jax) to rows later steps write
  again: row 3 - s is still step 3's at every stage."""
  dist = _staged(guard=False, keep_at=keep_at)
  assert outputs_agree(_seq, dist, X)
  assert verify(_seq, dist, X).refines


def test_a_write_at_a_tile_offset_stays_a_layout():
  """dus(zeros, x, r * size) is the transfer rules' tile (a partial sum once
  summed): no cases, so the number of ranks stays out of the program."""
  def local(x):
    stage = lax.axis_index("pp")
    buf = jnp.zeros((8, 8))
    return lax.psum(lax.dynamic_update_slice_in_dim(buf, x, stage * 2, 0), "pp")
  dist = shard_map(local, mesh=MESH, in_specs=P("pp"), out_specs=P())
  program = prepare_dist(lower_distributed(dist, *_abstract_args((jnp.zeros((8, 8)),), MESH,
                                                                   (P("pp"),))))
  assert any(op.name == "dynamic_update_slice" for op in program.graph.walk())
  assert not any(op.name == "select" and op.results[0].type.rank for op in program.graph.walk())
  x = jnp.zeros((8, 8))
  assert verify(lambda x: x, dist, x, mesh=MESH, in_specs=(P("pp"),)).refines


@pytest.mark.parametrize("read,keep_at", [(lambda s: 1 - s, 0), (lambda s: 1 - s, 1),
                                          (lambda s: s, 0)], ids=["1-s@0", "1-s@1", "s@0"])
def test_a_guarded_write_at_rows_like_a_tile_offset_is_split(read, keep_at):
  """On two stages, row t - s is (0, 1) at step 0 (jax wraps -1), ``r``, a
  gather's offset, and (1, 0) at step 1, ``(r + 1) mod 2``, a ring's.  Kept
  only where the row exists (a schedule's guard), each is split into cases
  all the same."""
  mesh = mesh_of((2,), ("pp",))

  def local(x):
    stage = lax.axis_index("pp")
    y = jnp.tanh(x) * 3
    buf = jnp.zeros((2, 8))
    for t in range(2):
      f = t - stage
      new = lax.dynamic_update_index_in_dim(buf, y[1:2], f, 0)
      buf = jnp.where((f >= 0) & (f < 2), new, buf)
    row = lax.dynamic_index_in_dim(buf, read(stage), 0)
    return lax.psum(jnp.where(stage == keep_at, row, 0.0), "pp")
  dist = shard_map(local, mesh=mesh, in_specs=P(), out_specs=P())
  seq = lambda x: (jnp.tanh(x) * 3)[1:2]
  x = jnp.zeros((2, 8))
  assert outputs_agree(seq, dist, x)
  assert verify(seq, dist, x).refines


# A stack of 2 chunks x 4 stages (an interleaved pipeline's weights, the
# stages' dim split over "pp"); at step t stage s runs chunk ((t - s) // 4) % 2.
CHUNKS = jnp.zeros((2, 4, 8))


def _chunk(t, stage):
  return ((t - stage) // 4) % 2


def _chunk_read(t: int, keep_at: int):
  """Stage s reads its row of chunk ``_chunk(t, s)`` at that row (a
  dynamic_slice of a parameter, not of a buffer), and stage ``keep_at``'s is
  handed to everyone."""
  def local(w):
    stage = lax.axis_index("pp")
    row = lax.dynamic_index_in_dim(w, _chunk(t, stage), 0, keepdims=False)[0]
    return lax.psum(jnp.where(stage == keep_at, jnp.tanh(row) * 3, 0.0), "pp")
  return shard_map(local, mesh=MESH, in_specs=P(None, "pp"), out_specs=P())


@pytest.mark.parametrize("t", [6, 3], ids=["rows_differ_by_stage", "same_row_everywhere"])
@pytest.mark.parametrize("keep_at", range(4))
def test_a_weight_read_at_a_row_computed_from_the_stage(t, keep_at):
  """At t = 6 the rows are 1, 1, 1, 0 (no tile offset: cases); at t = 3 every
  stage reads row 0, a constant the program spells with the partition id."""
  seq = lambda w: jnp.tanh(w[_chunk(t, keep_at), keep_at]) * 3
  _proved_and_checked(_chunk_read(t, keep_at), seq, CHUNKS, spec=P(None, "pp"))


@pytest.mark.parametrize("keep_at", range(4))
def test_a_weight_read_at_the_other_chunks_row_is_not_proved(keep_at):
  seq = lambda w: jnp.tanh(w[1 - _chunk(6, keep_at), keep_at]) * 3
  dist = _chunk_read(6, keep_at)
  assert not outputs_agree(seq, dist, CHUNKS)
  assert not verify(seq, dist, CHUNKS).refines


# On two stages a chunk's row computed from the stage can be a tile offset
# (``r`` or ``(r + 1) mod 2``); the stack is already split over "pp" by its
# stages' dim, so no layout tiles the chunks' dim by "pp" too: cases.
TWO_STAGES = mesh_of((2,), ("pp",))
TWO_CHUNKS = jnp.zeros((2, 2, 8))


def _chunk_read_on_two_stages(row, keep_at: int):
  def local(w):
    stage = lax.axis_index("pp")
    picked = lax.dynamic_index_in_dim(w, row(stage), 0, keepdims=False)[0]
    return lax.psum(jnp.where(stage == keep_at, jnp.tanh(picked) * 3, 0.0), "pp")
  return shard_map(local, mesh=TWO_STAGES, in_specs=P(None, "pp"), out_specs=P())


@pytest.mark.parametrize("keep_at", range(2))
@pytest.mark.parametrize("row", [lambda s: s, lambda s: (s + 1) % 2, lambda s: (1 - s) // 1],
                         ids=["r", "r+1_mod_2", "1-r"])
def test_a_weight_read_at_a_tile_offset_of_its_own_axis_is_split(row, keep_at):
  seq = lambda w: jnp.tanh(w[row(keep_at), keep_at]) * 3
  _proved_and_checked(_chunk_read_on_two_stages(row, keep_at), seq, TWO_CHUNKS, TWO_STAGES,
                      P(None, "pp"))


@pytest.mark.parametrize("keep_at", range(2))
def test_a_weight_read_at_the_other_chunk_on_two_stages_is_not_proved(keep_at):
  seq = lambda w: jnp.tanh(w[1 - keep_at, keep_at]) * 3
  dist = _chunk_read_on_two_stages(lambda s: s, keep_at)
  assert not outputs_agree(seq, dist, TWO_CHUNKS)
  assert not verify(seq, dist, TWO_CHUNKS).refines


def test_a_replicated_weight_read_at_a_tile_offset_stays_a_layout():
  """Each rank's rows of a replicated parameter, at ``r * size``: a layout
  (flat in the number of ranks), not cases."""
  def local(w):
    return lax.dynamic_slice_in_dim(w, lax.axis_index("pp") * 2, 2, 0) * 3
  dist = shard_map(local, mesh=MESH, in_specs=P(), out_specs=P("pp"))
  w = jnp.zeros((8, 8))
  program = prepare_dist(lower_distributed(dist, *_abstract_args((w,), MESH, (P(),))))
  assert any(op.name == "dynamic_slice" for op in program.graph.walk())
  assert not any(op.name == "select" for op in program.graph.walk())
  assert verify(lambda w: w * 3, dist, w, mesh=MESH, in_specs=(P(),)).refines


# The same chunk read, each stage scanning its row as a loop of one layer, the
# stages chained by ppermute: at step 4 + i stage i runs layer i of chunk 1,
# the other stages rows of chunk 0 (a select per rank on the chunk's row).
# The sequential scan over chunk 1's 4 layers is split into one loop per
# stage (loop_split.py), each reading a row of ``w[1]``: its relation is to
# the squeezed row, so the squeeze is pushed into the select's branches
# (slabs.unit_reshape_of_select).
def _layer(h, row):
  return jnp.tanh(h * row + 1.0), None


def _scanned_chunk(chunk):
  def local(w, x):
    stage = lax.axis_index("pp")
    h = lax.pcast(x, ("pp",), to="varying")
    for i in range(4):
      row = lax.dynamic_index_in_dim(w, chunk(4 + i, stage), 0, keepdims=False)
      out, _ = lax.scan(_layer, h, row)
      h = lax.ppermute(out, "pp", [(j, (j + 1) % 4) for j in range(4)])
    return lax.psum(jnp.where(stage == 0, h, 0.0), "pp")
  return shard_map(local, mesh=MESH, in_specs=(P(None, "pp"), P()), out_specs=P())


def _scanned_chunk_seq(w, x):
  return lax.scan(_layer, x, w[1])[0]


def test_a_chunk_read_at_a_row_computed_from_the_stage_feeds_each_stages_loop():
  dist, x = _scanned_chunk(_chunk), jnp.zeros((8,))
  assert outputs_agree(_scanned_chunk_seq, dist, CHUNKS, x)
  result, check = verify_and_check(lower_sequential(_scanned_chunk_seq, CHUNKS, x),
                                   lower_distributed(dist, *_abstract_args(
                                       (CHUNKS, x), MESH, (P(None, "pp"), P()))))
  assert result.refines and check.ok, (result, check)


def test_a_stage_looping_over_the_other_chunks_row_is_not_proved():
  dist, x = _scanned_chunk(lambda t, stage: 1 - _chunk(t, stage)), jnp.zeros((8,))
  assert not outputs_agree(_scanned_chunk_seq, dist, CHUNKS, x)
  result = verify(_scanned_chunk_seq, dist, CHUNKS, x, mesh=MESH,
                  in_specs=(P(None, "pp"), P()))
  assert not result.refines
  assert result.failure.op_name == "while", result.failure
