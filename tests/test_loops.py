"""lax.scan over stacked layers: proved by one inductive step; bugs inside the
loop body are reported at their op."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
LAYERS = 3
ARGS = [jax.ShapeDtypeStruct((8, 16), jnp.float32),
        jax.ShapeDtypeStruct((LAYERS, 16, 32), jnp.float32),
        jax.ShapeDtypeStruct((LAYERS, 32, 16), jnp.float32)]
SPECS = (P(), P(None, None, "tp"), P(None, "tp", None))


def seq(x, w1, w2):
  def layer(h, w):
    a, b = w
    return h + jnp.tanh(h @ a) @ b, None
  return jax.lax.scan(layer, x, (w1, w2))[0]


def _dist(reduce, steps=LAYERS):
  def body(x, w1, w2):
    def layer(h, w):
      a, b = w
      return h + reduce(jnp.tanh(h @ a) @ b), None
    return jax.lax.scan(layer, x, (w1[:steps], w2[:steps]))[0] if steps != LAYERS else \
        jax.lax.scan(layer, x, (w1, w2))[0]
  return shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P(), check_vma=False)


def _verify(dist):
  return gg.verify(seq, dist, *ARGS, mesh=MESH, in_specs=SPECS)


def test_scan_is_proved_by_induction():
  result = _verify(_dist(lambda y: jax.lax.psum(y, "tp")))
  assert result.refines, result


def test_scan_under_gspmd_is_proved():
  result = gg.verify(seq, seq, *ARGS, mesh=MESH, in_specs=SPECS, out_specs=P())
  assert result.refines, result


def test_missing_psum_inside_the_body_is_reported_there():
  result = _verify(_dist(lambda y: y))
  assert not result.refines
  assert result.failure.op_name == "add"
  assert "missing all-reduce" in result.failure.diagnosis
  assert "test_loops.py" in str(result.failure.location)


def test_wrong_scale_inside_the_body_breaks_the_invariant():
  result = _verify(_dist(lambda y: jax.lax.pmean(y, "tp")))
  assert not result.refines
  assert "pmean where psum belongs" in result.failure.diagnosis


def test_different_trip_count_is_not_proved():
  def body(x, w1, w2):
    def layer(h, w):
      a, b = w
      return h + jax.lax.psum(jnp.tanh(h @ a) @ b, "tp"), None
    return jax.lax.scan(layer, x, (w1[:2], w2[:2]))[0]
  dist = shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P())
  assert not _verify(dist).refines


# Many zero-initialized accumulators (a training step's stacked gradients):
# each sequential one may start as any per-device zero carry under any tiling
# that fits, 5 carries x 6 orders of two of three axes here.  Every one of
# these candidates is assumed for the body; the 24 a value otherwise keeps
# would leave out the last accumulator's true one.
MESH_3D = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))
ACCUMULATORS = 5
STACKED = [jax.ShapeDtypeStruct((LAYERS, ACCUMULATORS, 8, 8), jnp.float32)]
ACC_SPEC = P(None, None, None, ("b", "c"))


def _accumulate(into=lambda i: i, last_scale=1.0):
  def run(xs):
    def step(accs, x):
      out = [acc + x[into(i)] for i, acc in enumerate(accs)]
      out[-1] = accs[-1] + last_scale * x[into(ACCUMULATORS - 1)]
      return tuple(out), None
    zeros = tuple(jnp.zeros_like(xs[0, 0]) for _ in range(ACCUMULATORS))
    return jax.lax.scan(step, zeros, xs)[0]
  return run


def _verify_accumulators(dist_run):
  dist = shard_map(dist_run, mesh=MESH_3D, in_specs=(ACC_SPEC,),
                   out_specs=tuple(P(None, ("b", "c")) for _ in range(ACCUMULATORS)))
  return gg.verify(_accumulate(), dist, *STACKED, mesh=MESH_3D, in_specs=(ACC_SPEC,))


def test_every_candidate_of_many_zero_carries_is_assumed():
  result = _verify_accumulators(_accumulate())
  assert result.refines, result


def test_the_last_accumulator_scaled_is_reported_in_the_loop():
  result = _verify_accumulators(_accumulate(last_scale=2.0))
  assert not result.refines
  assert result.failure.op_name == "add" and "test_loops.py" in str(result.failure.location)
  assert "does not keep its relation" in result.failure.diagnosis


def test_accumulators_added_into_each_other_are_reported_at_the_outputs():
  # The loop is proved (carry i holds sequential carry i + 1); the outputs
  # then come back in the wrong order.
  result = _verify_accumulators(_accumulate(into=lambda i: (i + 1) % ACCUMULATORS))
  assert not result.refines
  assert result.failure.op_name == "output" and result.failure.output_index == 0
  assert "sequential output 0 is what distributed output 4 holds (outputs returned in " \
         "another order?)" in result.failure.diagnosis, result.failure.diagnosis


def test_each_loop_region_builds_its_per_device_egraph_once(monkeypatch):
  """Houdini's rounds relate the same bodies under fewer assumptions: the
  per-device e-graph, which holds no assumption, is built once per region
  (and once for the whole program), however many rounds run."""
  from graphguard_hlo.passes import dist_egraph, loops
  built, rounds = [], []
  real_init, real_region = dist_egraph.DistEGraph.__init__, loops._region_inference

  def counting_init(self, graph, *a, **k):
    built.append(id(graph))
    real_init(self, graph, *a, **k)

  def counting_region(inf, seq_loop, dist_loop, region, matches):
    rounds.append(region)
    return real_region(inf, seq_loop, dist_loop, region, matches)

  monkeypatch.setattr(dist_egraph.DistEGraph, "__init__", counting_init)
  monkeypatch.setattr(loops, "_region_inference", counting_region)
  # Many zero accumulators: the candidates no iteration keeps are pruned in
  # a first round, the rest confirmed in a second.
  result = _verify_accumulators(_accumulate())
  assert result.refines, result
  assert rounds.count(1) >= 2  # the body, related in more than one round
  assert len(built) == len(set(built)) == 3  # main, the loop's body and condition


def test_a_float_counter_is_no_trip_count():
  """A float counter 0, 1, ... while < 1.5 runs twice: read as one trip, the
  counter would be 0 in the body, and adding it a no-op."""
  def loop(with_counter):
    def run(x):
      step = lambda c: (c[0] + 1.0, jnp.tanh(c[1] + c[0] if with_counter else c[1]))
      return jax.lax.while_loop(lambda c: c[0] < 1.5, step, (jnp.float32(0), x))[1]
    return run
  dist = shard_map(loop(False), mesh=MESH, in_specs=(P("tp"),), out_specs=P("tp"))
  x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
  assert not np.allclose(jax.jit(dist)(x), loop(True)(x))
  assert not gg.verify(loop(True), dist, jnp.zeros((8, 16))).refines


@pytest.mark.parametrize("bound, proved", [(4, True), (4.5, False)])
def test_a_ring_loop_under_a_float_bound_is_not_unrolled(bound, proved):
  # 4 steps round a ring of 4 are the identity; a float bound of 4.5 runs 5.
  perm = [(i, (i + 1) % 4) for i in range(4)]

  def local(x):
    counter = jnp.zeros((), jnp.int32 if isinstance(bound, int) else jnp.float32)
    return jax.lax.while_loop(lambda c: c[0] < bound, lambda c: (
        c[0] + 1, jax.lax.ppermute(c[1], "tp", perm)), (counter, x))[1]
  dist = shard_map(local, mesh=MESH, in_specs=(P("tp"),), out_specs=P("tp"))
  x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
  assert np.allclose(jax.jit(dist)(x), x) == proved
  assert gg.verify(lambda x: x, dist, jnp.zeros((8, 16))).refines == proved


# A loop that runs once returns its counter as 1 on every rank.  Started at
# zero on every rank beside a carry pinned to stage 0, the counter is also a
# candidate "at stage 0, zeros elsewhere" (a stage's gradients), which the
# iteration must not keep: summed over the stages it is |pp|, not 1.
PP = Mesh(np.array(jax.devices()[:4]), ("pp",))


def _counted(x):
  return jax.lax.while_loop(lambda s: s[0] < 1, lambda s: (s[0] + 1, s[1] * 2.0),
                            (jnp.int32(0), x))


def _counted_seq(x):
  i, x = _counted(x)
  return x, i


@pytest.mark.parametrize("count", ["replicated", "summed"])
def test_a_counter_of_one_is_not_zero_elsewhere(count):
  def per_device(x):
    i, x = _counted(jnp.where(jax.lax.axis_index("pp") == 0, x, 0.0))
    return jax.lax.psum(x, "pp"), (i if count == "replicated" else jax.lax.psum(i, "pp"))
  dist = shard_map(per_device, mesh=PP, in_specs=P(), out_specs=(P(), P()))
  x = np.ones((4,), np.float32)
  agree = int(jax.jit(dist)(x)[1]) == int(_counted_seq(x)[1])
  assert agree == (count == "replicated")
  result = gg.verify(_counted_seq, dist, jax.ShapeDtypeStruct((4,), jnp.float32))
  assert result.refines == agree, result
  if not agree:
    assert result.failure.op_name == "output" and "4 times" in result.failure.diagnosis


def _stacked(h, ws, order=lambda ws: ws):
  """A scan returning each layer's output stacked (its ys)."""
  return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.tanh(h @ w)), h, order(ws))[1]


@pytest.mark.parametrize("order", ["in_order", "reversed"])
def test_a_scan_returning_its_stacked_outputs_per_rank_tile(order):
  """The loops' normal form drops a stack carry nobody reads; the ops that
  wrote it used to stay in the body, reading a parameter no longer there
  (a KeyError building the per-device e-graph)."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))
  reverse = (lambda ws: ws) if order == "in_order" else (lambda ws: ws[::-1])
  dist = shard_map(lambda h, ws: _stacked(h, ws, reverse), mesh=mesh,
                   in_specs=(P("dp"), P()), out_specs=P(None, "dp"))
  rng = np.random.default_rng(0)
  h, ws = rng.standard_normal((8, 8), np.float32), rng.standard_normal((3, 8, 8), np.float32)
  agree = np.allclose(jax.jit(dist)(h, ws), _stacked(h, ws), rtol=1e-4, atol=1e-5)
  assert agree == (order == "in_order")
  result = gg.verify(_stacked, dist, jax.ShapeDtypeStruct((8, 8), jnp.float32),
                     jax.ShapeDtypeStruct((3, 8, 8), jnp.float32))
  assert result.refines == agree, result
