"""GPipe under GSPMD, as MaxText and praxis write it (no shard_map): a state of
one microbatch per stage, split over "pp" by its stage dim; at each step the
next microbatch set into stage 0's row, every stage's layer run under
``jax.vmap`` over the stage dim, the last stage's row written out, and the
state rolled one stage on.  XLA partitions the set into a scatter at a row
computed from the partition id (rank_cases.py splits it per rank,
slabs.scatter_of_one_window folds each case), the vmapped layer into ops with
a leading unit dim (unit_dims.py's vmapped variants), and the roll into
collective-permutes.  Proved with its relations checked on numbers; each
seeded bug refused at its op."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo.api import _abstract_args
from graphguard_hlo.lowering import lower_distributed, lower_sequential
from graphguard_hlo.pipeline import prepare_dist
from graphguard_hlo.relation_check import verify_and_check
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of

MICROBATCHES, ROWS, D = 4, 2, 8


def _layer(w, x):
  return jnp.tanh(x @ w) + 0.5  # (a splat added to each stage's rows: its unit dim too)


def _seq(stages):
  def seq(ws, x):
    x = x * 0.5
    for s in range(stages):
      x = _layer(ws[s], x)
    return x
  return seq


def _pipeline(mesh, shift=1, injected_row=0, collected_row=-1, fori=False, scan=False):
  """``fori``: the steps under ``lax.fori_loop`` (MaxText's loop), the state
  carried under its sharding constraint, a copy of the roll's permute; the
  loop is unrolled (ring_loops.py).  ``scan``: under ``lax.scan`` over the
  step numbers instead, each step reading its number from a row of them."""
  stages = mesh.shape["pp"]
  split = lambda v: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P("pp")))

  def pipe(ws, x):
    batches = x.reshape(MICROBATCHES, ROWS, D)
    state = split(jnp.zeros((stages, ROWS, D)))
    outputs = jnp.zeros_like(batches)
    if fori or scan:
      def step(t, carry):
        state, outputs = carry
        fresh = jax.lax.dynamic_index_in_dim(batches, jnp.minimum(t, MICROBATCHES - 1), 0,
                                             keepdims=False)
        state = jnp.where(t < MICROBATCHES, state.at[injected_row].set(fresh * 0.5), state)
        state = split(jax.vmap(_layer)(ws, state))
        done = t - (stages - 1)
        written = jax.lax.dynamic_update_index_in_dim(outputs, state[collected_row],
                                                      jnp.maximum(done, 0), 0)
        outputs = jnp.where(done >= 0, written, outputs)
        return split(jnp.roll(state, shift, axis=0)), outputs
      steps = MICROBATCHES + stages - 1
      if scan:
        (_, outputs), _ = jax.lax.scan(lambda carry, t: (step(t, carry), None),
                                       (state, outputs), jnp.arange(steps))
      else:
        _, outputs = jax.lax.fori_loop(0, steps, step, (state, outputs))
      return outputs.reshape(x.shape)
    for t in range(MICROBATCHES + stages - 1):
      if t < MICROBATCHES:  # (halved here: the device holds a splat 0.5 of a microbatch's
        # shape, and the layer's 0.5 is added to the stage's tile, one unit dim more)
        state = state.at[injected_row].set(batches[t] * 0.5)
      state = split(jax.vmap(_layer)(ws, state))
      if t >= stages - 1:
        outputs = outputs.at[t - stages + 1].set(state[collected_row])
      state = split(jnp.roll(state, shift, axis=0))
    return outputs.reshape(x.shape)
  return jax.jit(pipe)


def _args(stages):
  rng = np.random.default_rng(stages)
  return (jnp.asarray(rng.standard_normal((stages, D, D)) / 3, jnp.float32),
          jnp.asarray(rng.standard_normal((MICROBATCHES * ROWS, D)), jnp.float32))


def _lowered(stages, **bug):
  mesh = mesh_of((stages,), ("pp",))
  return lower_distributed(_pipeline(mesh, **bug),
                           *_abstract_args(_args(stages), mesh, (P("pp"), P())),
                           out_shardings=NamedSharding(mesh, P()))


def _verified(stages, **bug):
  args = _args(stages)
  return args, verify_and_check(lower_sequential(_seq(stages), *args), _lowered(stages, **bug))


@pytest.mark.parametrize("stages, loop", [(2, {}), (4, {}), (4, {"fori": True}),
                                          (4, {"scan": True})], ids=str)
def test_gspmd_gpipe_is_proved_and_its_relations_hold(stages, loop):
  mesh = mesh_of((stages,), ("pp",))
  args, (result, check) = _verified(stages, **loop)
  assert outputs_agree(_seq(stages), _pipeline(mesh, **loop), *args)
  assert result.refines and check.ok, (result, check)


def _set_row(mesh, row, constrained=True):
  def f(x):
    state = jnp.zeros((mesh.shape["pp"], D))
    if constrained:
      state = jax.lax.with_sharding_constraint(state, NamedSharding(mesh, P("pp")))
    return jnp.tanh(state.at[row].set(x * 2))
  return f


@pytest.mark.parametrize("row, dist_row", [(0, 0), (2, 2), (3, 3), (2, 3), (1, 0)])
def test_a_row_set_into_a_state_split_by_rows(row, dist_row):
  """``state.at[row].set(u)`` alone, the state split over "pp" one row per
  rank: XLA's scatter lands on rank ``row``, a select per rank here; proved
  where the sequential program sets the same row, refused at its pad where
  it sets another."""
  mesh = mesh_of((4,), ("pp",))
  x = jnp.zeros((D,))
  dist = lower_distributed(jax.jit(_set_row(mesh, dist_row)), *_abstract_args((x,), mesh, (P(),)),
                           out_shardings=NamedSharding(mesh, P("pp")))
  result, check = verify_and_check(lower_sequential(_set_row(mesh, row, False), x), dist)
  assert check.ok and result.refines == (row == dist_row), result
  if row != dist_row:
    assert result.failure.op_name == "pad"


def test_a_sequential_model_vmapped_over_the_microbatches():
  """The sequential model written per microbatch and vmapped over them: its
  pieces are one microbatch row, a unit dim where the device's stage has its
  own (unit_dims.py's transpose keeping the device's unit dim in place)."""
  mesh = mesh_of((4,), ("pp",))

  def seq(ws, xs):
    return jax.vmap(lambda x: _seq(4)(ws, x))(xs)
  pipe = _pipeline(mesh)  # (given the microbatches as they are: [4, rows, d])
  ws, x = _args(4)
  xs = x.reshape(MICROBATCHES, ROWS, D)
  assert outputs_agree(seq, pipe, ws, xs)
  dist = lower_distributed(pipe, *_abstract_args((ws, xs), mesh, (P("pp"), P())),
                           out_shardings=NamedSharding(mesh, P()))
  result, check = verify_and_check(lower_sequential(seq, ws, xs), dist)
  assert result.refines and check.ok, (result, check)


def test_the_microbatch_set_into_stage_zero_is_split_per_rank():
  """XLA writes ``state.at[0].set(m)`` as a scatter at row ``0 - stage`` of
  each one-row tile; after prepare_dist no scatter is left."""
  dist = _lowered(4)
  assert any(op.name == "scatter" for op in dist.main.walk())
  program = prepare_dist(dist)
  assert not any(op.name == "scatter" for op in program.graph.walk())


@pytest.mark.parametrize("loop", [{}, {"fori": True}], ids=str)
def test_the_prepared_program_computes_what_xlas_does(loop):
  """Every rank's outputs of XLA's partitioned module and of the program the
  verifier reads (its scatters split per rank, its loop unrolled) agree on
  random inputs: the rewrites are identities, checked apart from any proof."""
  from graphguard_hlo.interpret import Interpreter
  ws, x = (np.asarray(a) for a in _args(4))
  inputs = [[ws[r:r + 1] for r in range(4)], [x] * 4]
  raw, program = _lowered(4, **loop), prepare_dist(_lowered(4, **loop))
  want = Interpreter(4).run(raw.main, inputs)
  got = Interpreter(4).run(program.graph, inputs)
  for a, b in zip(raw.main.results, program.graph.results):
    for r in range(4):
      np.testing.assert_allclose(got[b.id][r], want[a.id][r], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bug, at", [
    (dict(shift=-1), "dot_general"),           # activations rolled back a stage
    (dict(injected_row=1), "dot_general"),     # microbatches fed to stage 1
    (dict(collected_row=-2), "output"),        # outputs taken from stage 2
    (dict(shift=-1, fori=True), "dot_general"),
], ids=["rolled_back", "fed_to_stage_1", "collected_from_stage_2", "rolled_back_fori"])
def test_a_seeded_gspmd_pipeline_bug_is_reported(bug, at):
  mesh = mesh_of((4,), ("pp",))
  args, (result, check) = _verified(4, **bug)
  assert not outputs_agree(_seq(4), _pipeline(mesh, **bug), *args)
  assert not result.refines and check.ok
  failure = result.failure
  assert (failure.output_index is not None) if at == "output" else failure.op_name == at, failure
