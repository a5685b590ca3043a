"""Conditionals (``lax.cond``, ``lax.switch``, ``optax.apply_if_finite``) read
as selects of their branches (``passes/conditionals.py``): the rewrite keeps
every value, and training steps that skip an update on non-finite gradients
are proved, or reported where the ranks' decision departs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax, shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.conditionals import select_conditionals
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.report import to_text


def _rewritten(fn, *args):
  """fn lowered, its conditionals rewritten: (how many, what the rewritten
  graph computes on ``args``, the op names left)."""
  m = lower_sequential(fn, *args)
  inline_calls(m)
  g = m.main
  count = select_conditionals(m)
  env = Interpreter(1).run(g, [[np.asarray(a)] for a in args])
  return count, [np.asarray(env[v.id][0]) for v in g.results], {op.name for op in g.walk()}


def _switch(x, i):
  return lax.switch(i, [lambda v: (v * 2, v.sum()), lambda v: (v + 1, v.max()),
                        lambda v: (jnp.tanh(v), v.min())], x)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(-3, 5), st.integers(0, 2**16))
def test_a_switch_reads_as_selects_index_in_range_or_not(i, seed):
  """Out of range, a case runs its last branch (jax clamps first; the
  StableHLO rule is kept by the chain too)."""
  x = np.random.default_rng(seed).standard_normal((3, 4)).astype(np.float32)
  count, got, names = _rewritten(_switch, x, np.int32(i))
  assert count == 1 and not names & {"case", "if"}
  want = jax.jit(_switch)(x, np.int32(i))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("flag", [True, False])
def test_nested_conds_capturing_outer_values_read_as_selects(flag):
  def fn(x, p):
    y = jnp.sin(x)
    return lax.cond(p, lambda: lax.cond(x.sum() > 0, lambda: y * 2, lambda: y - x),
                    lambda: jnp.cos(y))
  x = np.linspace(-1, 2, 6, dtype=np.float32)
  count, got, names = _rewritten(fn, x, np.bool_(flag))
  assert count == 2 and not names & {"case", "if"}
  np.testing.assert_allclose(got[0], np.asarray(jax.jit(fn)(x, np.bool_(flag))), rtol=1e-6)


MESH = Mesh(np.array(jax.devices()[:4]), ("dp",))
PARAMS = {"w1": jax.ShapeDtypeStruct((16, 32), jnp.float32),
          "w2": jax.ShapeDtypeStruct((32, 16), jnp.float32)}
X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
SPECS = (P(), P("dp"), P("dp"))


def test_a_branch_with_a_collective_stays_a_conditional():
  """Taken on some ranks only, a psum in a branch is not the psum of all ranks."""
  def body(x, p):
    return lax.cond(p, lambda: lax.psum(x, "dp"), lambda: x)
  dist = shard_map(body, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"),
                   check_vma=False)
  from graphguard_hlo.lowering import lower_distributed, abstract_value
  from jax.sharding import NamedSharding
  m = lower_distributed(dist, abstract_value(jax.ShapeDtypeStruct((8, 4), jnp.float32),
                                             NamedSharding(MESH, P("dp"))),
                        jax.ShapeDtypeStruct((), jnp.bool_))
  inline_calls(m)
  assert select_conditionals(m) == 0
  assert any(op.name in ("case", "if") for op in m.main.walk())


def loss(p, x, y):
  return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)


def _all_finite(g):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(t)) for t in jax.tree.leaves(g)]))


def guarded_step(p, x, y):
  """SGD that keeps the weights when a gradient is not finite."""
  g = jax.grad(loss)(p, x, y)
  return lax.cond(_all_finite(g), lambda: jax.tree.map(lambda a, b: a - 0.1 * b, p, g),
                  lambda: p)


def _data_parallel(decide_on_local=False, swapped=False):
  def body(p, x, y):
    local = jax.grad(loss)(p, x, y)
    g = jax.tree.map(lambda t: lax.pmean(t, "dp"), local)
    update, keep = (lambda: jax.tree.map(lambda a, b: a - 0.1 * b, p, g)), (lambda: p)
    if swapped:
      update, keep = keep, update
    return lax.cond(_all_finite(local if decide_on_local else g), update, keep)
  return shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P(), check_vma=False)


def test_a_step_skipped_on_nonfinite_gradients_is_proved_under_shard_map():
  result = gg.verify(guarded_step, _data_parallel(), PARAMS, X, X, mesh=MESH, in_specs=SPECS)
  assert result.refines, to_text(result, "seq", "dist")


def test_a_step_skipped_on_nonfinite_gradients_is_proved_under_gspmd():
  result = gg.verify(guarded_step, guarded_step, PARAMS, X, X, mesh=MESH, in_specs=SPECS,
                     out_specs=P())
  assert result.refines, to_text(result, "seq", "dist")


def test_deciding_on_each_ranks_own_gradients_is_reported():
  """Each rank tests its own unreduced gradient: ranks may decide apart."""
  result = gg.verify(guarded_step, _data_parallel(decide_on_local=True), PARAMS, X, X,
                     mesh=MESH, in_specs=SPECS)
  assert not result.refines
  f = result.failure
  assert f.op_name == "is_finite", to_text(result, "seq", "dist")
  assert "partial sum over 'dp'" in f.diagnosis and "missing all-reduce" in f.diagnosis


def test_swapped_branches_are_reported_at_the_select():
  result = gg.verify(guarded_step, _data_parallel(swapped=True), PARAMS, X, X, mesh=MESH,
                     in_specs=SPECS)
  assert not result.refines
  assert result.failure.op_name == "select", to_text(result, "seq", "dist")


def test_optax_apply_if_finite_under_gspmd_is_proved():
  tx = optax.apply_if_finite(optax.sgd(0.1), 3)
  state = jax.eval_shape(tx.init, PARAMS)

  def step(p, s, x, y):
    updates, s = tx.update(jax.grad(loss)(p, x, y), s, p)
    return optax.apply_updates(p, updates), s
  result = gg.verify(step, step, PARAMS, state, X, X, mesh=MESH,
                     in_specs=(P(), P(), P("dp"), P("dp")), out_specs=(P(), P()))
  assert result.refines, to_text(result, "seq", "dist")


def test_a_conditional_left_opaque_is_not_matched_by_its_index_alone():
  """Its branch holds a custom call (cholesky), so it stays a conditional;
  its branches read sin(x) sequentially and cos(x) on the devices (an
  audit's false proof, through captured values' ids)."""
  def program(f):
    def run(x, p):
      v = f(x)
      return lax.cond(p, lambda: jnp.linalg.cholesky(v @ v.T + 10 * jnp.eye(4)), lambda: v)
    return run
  x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
  flag = jax.ShapeDtypeStruct((), jnp.bool_)
  for wrong in (jnp.cos, lambda v: jnp.sin(jnp.sin(v))):
    dist = shard_map(program(wrong), mesh=MESH, in_specs=(P(), P()), out_specs=P(),
                     check_vma=False)
    assert not gg.verify(program(jnp.sin), dist, x, flag, mesh=MESH,
                         in_specs=(P(), P())).refines


def test_hlo_async_collectives_in_a_branch_keep_it_a_conditional():
  """HLO's async halves and ragged all-to-all keep their HLO names when loaded."""
  from graphguard_hlo.passes.conditionals import _not_a_value
  for name in ("all-reduce-start", "all-gather-done", "collective-permute-start",
               "ragged-all-to-all", "all_reduce", "custom_call", "send", "rng"):
    assert _not_a_value(name), name
  for name in ("add", "exponential", "dot_general", "select", "dynamic_slice", "while"):
    assert not _not_a_value(name), name
