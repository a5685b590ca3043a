"""microbatch_loops: a sequential loop over a batch split into one loop per
microbatch, where the body keeps rows apart -- and not where it mixes them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.canonicalize import canonicalize_module
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.microbatch_loops import split_microbatch_loops

B, MICRO, D, LAYERS = 4, 1, 8, 3


def _layers(mix):
  """A scan over layers whose step is ``mix(h, w)``; one source line, so the
  loops of every batch size share a location."""
  def run(h, ws):
    return lax.scan(lambda h, w: (mix(h, w), None), h, ws)[0]
  return run


KEEPS_ROWS = {
    "mlp": lambda h, w: jnp.tanh(h @ w) + h,
    "layernorm": lambda h, w: (h - h.mean(-1, keepdims=True)) @ w,
    "bias_and_scale": lambda h, w: h * w[0] + w[1],
    "attention_over_features": lambda h, w: jax.nn.softmax(
        (h[:, :, None] * h[:, None, :]), axis=-1).sum(-1) @ w,
}
MIXES_ROWS = {
    "batch_mean": lambda h, w: (h - h.mean(0, keepdims=True)) @ w,
    "rows_against_rows": lambda h, w: (h @ h.T) @ h @ w,
    "roll_over_batch": lambda h, w: jnp.roll(h, 1, axis=0) @ w,
    "cumsum_over_batch": lambda h, w: jnp.cumsum(h, axis=0) @ w,
    "first_row_added": lambda h, w: (h + h[0]) @ w,
    "reversed_batch": lambda h, w: h[::-1] @ w,
    "summed_by_a_matmul": lambda h, w: h + (h.T @ jnp.ones((h.shape[0], 1), h.dtype)).T @ w,
    "gathered_rows": lambda h, w: jnp.take(h, jnp.arange(h.shape[0])[::-1], axis=0) @ w,
}


def _per_microbatch(f, batch_dim):
  """``f`` run on each microbatch in turn, as a pipeline's steps run it."""
  def run(h, ws):
    cut = lambda m: lax.slice_in_dim(h, m * MICRO, (m + 1) * MICRO, axis=batch_dim)
    return jnp.concatenate([f(cut(m), ws) for m in range(B // MICRO)], axis=batch_dim)
  return run


def _modules(mix, batch_dim=0, microbatched=True):
  f = _layers(mix) if batch_dim == 0 else _layers(lambda h, w: mix(h.T, w).T)
  shape = lambda n: (n, D) if batch_dim == 0 else (D, n)
  ws = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
  seq = lower_sequential(f, jax.ShapeDtypeStruct(shape(B), jnp.float32), ws)
  dist = lower_sequential(_per_microbatch(f, batch_dim), jax.ShapeDtypeStruct(shape(B), jnp.float32),
                          ws) if microbatched else \
      lower_sequential(f, jax.ShapeDtypeStruct(shape(MICRO), jnp.float32), ws)
  return (f,) + _prepared(seq, dist)


def _prepared(*modules):
  """The modules as prepare_seq has them before the split."""
  for m in modules:
    inline_calls(m)
    canonicalize_module(m)
  return modules


def _run(module, *args):
  return _run_all(module, *args)[0]


@pytest.mark.parametrize("name", sorted(KEEPS_ROWS))
@pytest.mark.parametrize("batch_dim", [0, 1])
def test_a_loop_keeping_rows_apart_is_split_and_computes_the_same(name, batch_dim):
  f, seq, dist = _modules(KEEPS_ROWS[name], batch_dim)
  rng = np.random.default_rng(0)
  h = rng.standard_normal((B, D) if batch_dim == 0 else (D, B)).astype(np.float32)
  ws = rng.standard_normal((LAYERS, D, D)).astype(np.float32) / 3
  assert split_microbatch_loops(seq, dist.main) == 1
  loops = [op for op in seq.main.ops if op.name == "while"]
  assert len(loops) == B // MICRO
  assert all(op.operands[-1].shape[batch_dim] == MICRO for op in loops)
  np.testing.assert_allclose(_run(seq, h, ws), np.asarray(jax.jit(f)(h, ws)), rtol=1e-4,
                             atol=1e-5)


@pytest.mark.parametrize("name", sorted(MIXES_ROWS))
def test_a_loop_mixing_rows_is_not_split(name):
  _, seq, dist = _modules(MIXES_ROWS[name])
  assert split_microbatch_loops(seq, dist.main) == 0


def test_one_loop_on_a_tile_is_not_split():
  """A data-parallel rank runs the loop once, on its tile: that is a tiling
  (loops.py proves it as one), not a loop per microbatch."""
  _, seq, dist = _modules(KEEPS_ROWS["mlp"], microbatched=False)
  assert split_microbatch_loops(seq, dist.main) == 0


def _layers_elsewhere(mix):
  def run(h, ws):  # _layers' loop at another source line
    return lax.scan(lambda h, w: (mix(h, w), None), h, ws)[0]
  return run


def test_a_loop_whose_microbatched_partner_is_elsewhere_is_not_split():
  """The per-device loop on microbatches must be the same loop (its source
  line): another one of the right shapes is no reason to split."""
  _, seq, _ = _modules(KEEPS_ROWS["mlp"])
  elsewhere = lower_sequential(_per_microbatch(_layers_elsewhere(KEEPS_ROWS["mlp"]), 0),
                               jax.ShapeDtypeStruct((B, D), jnp.float32),
                               jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32))
  inline_calls(elsewhere)
  assert split_microbatch_loops(seq, elsewhere.main) == 0


def test_a_branch_reading_the_batch_itself_is_not_split():
  """lax.cond's branches read h without it being the cond's operand (an
  audit's case: the split cut h under a branch mixing its rows)."""
  mix = lambda h, w: jnp.tanh(h @ lax.cond(w[0, 0] > -100.0,
                                           lambda: (h.T @ h)[:D, :D] / 4, lambda: w))
  _, seq, dist = _modules(mix)
  assert split_microbatch_loops(seq, dist.main) == 0


@pytest.mark.parametrize("seq_rows, dist_rows", [(B, 0), (0, MICRO)])
def test_empty_batches_are_not_split(seq_rows, dist_rows):
  """An empty microbatch divided by zero, an empty batch made zero pieces
  (an audit's crashes)."""
  f = _layers(KEEPS_ROWS["mlp"])
  ws = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
  seq = lower_sequential(f, jax.ShapeDtypeStruct((seq_rows, D), jnp.float32), ws)
  dist = lower_sequential(lambda h, ws: [f(h, ws) for _ in range(B)][0],
                          jax.ShapeDtypeStruct((dist_rows, D), jnp.float32), ws)
  assert split_microbatch_loops(seq, dist.main) == 0



# Tensor parallelism inside a stage: each microbatch's loop holds the weights'
# last dim tiled ``TILED`` ways, so its carries differ from the sequential
# ones by the tiling as well as by the microbatch.  Each mix works at any
# width of the weights.
TILED = 4
TILED_KEEPS_ROWS = lambda h, w: jnp.tanh(h @ w) @ w.T + h
TILED_MIXES_ROWS = lambda h, w: (h - h.mean(0, keepdims=True)) @ w @ w.T


def _tiled_modules(mix, batch, micro):
  f = _layers(mix)

  def per_microbatch(h, ws):
    return jnp.concatenate([f(h[m * micro:(m + 1) * micro], ws)
                            for m in range(batch // micro)])
  h = jax.ShapeDtypeStruct((batch, D), jnp.float32)
  seq = lower_sequential(f, h, jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32))
  dist = lower_sequential(per_microbatch, h,
                          jax.ShapeDtypeStruct((LAYERS, D, D // TILED), jnp.float32))
  return (f,) + _prepared(seq, dist)


# (batch, microbatch): the batch's extents before the tiled weights' (4 -> 1
# against 8 -> 2) and after them (16 -> 4), tried in turn.
@pytest.mark.parametrize("batch, micro", [(B, MICRO), (16, 4)])
def test_a_loop_whose_partner_also_tiles_the_weights_is_split_by_the_batch(batch, micro):
  f, seq, dist = _tiled_modules(TILED_KEEPS_ROWS, batch, micro)
  assert split_microbatch_loops(seq, dist.main) == 1
  loops = [op for op in seq.main.ops if op.name == "while"]
  assert len(loops) == batch // micro
  for loop in loops:  # the batch cut, the weights whole: loops.py proves the tiling
    assert {v.shape for v in loop.operands} >= {(micro, D), (LAYERS, D, D)}
  rng = np.random.default_rng(0)
  h = rng.standard_normal((batch, D)).astype(np.float32)
  ws = (rng.standard_normal((LAYERS, D, D)) / 3).astype(np.float32)
  np.testing.assert_allclose(_run(seq, h, ws), np.asarray(jax.jit(f)(h, ws)), rtol=1e-4,
                             atol=1e-5)


def test_a_loop_mixing_rows_is_not_split_beside_tiled_weights():
  _, seq, dist = _tiled_modules(TILED_MIXES_ROWS, B, MICRO)
  assert split_microbatch_loops(seq, dist.main) == 0


def test_a_carry_cut_twice_from_the_batch_extent_is_not_split():
  """Carries [B, B] against [1, 1]: which dim is the batch is not known."""
  f = _layers(lambda h, w: jnp.tanh(h) * w[0, 0])
  ws = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
  seq = lower_sequential(f, jax.ShapeDtypeStruct((B, B), jnp.float32), ws)
  dist = lower_sequential(lambda h, ws: jnp.stack([f(h[m:m + 1, m:m + 1], ws)
                                                   for m in range(B)]),
                          jax.ShapeDtypeStruct((B, B), jnp.float32), ws)
  _prepared(seq, dist)
  assert split_microbatch_loops(seq, dist.main) == 0

# A carry summing over the rows (a weight's gradient, dW += h^T dy): the
# pieces' carries, each from zero, add up to the sequential one -- where it
# starts at zero and only sums, scaled by what every piece shares, reach it.
SUMS_ROWS = {
    "gradient_like": lambda h, acc, w: (jnp.tanh(h @ w), acc + h.T @ jnp.tanh(h @ w)),
    "scaled_and_transposed": lambda h, acc, w: (h @ w, acc - (w * 2.0) @ (h.T @ h).T),
    "row_sums": lambda h, acc, w: (h @ w, acc + jnp.sum(h, axis=0)[:, None] * w),
    "last_sum_kept": lambda h, acc, w: (h @ w, h.T @ h),
}
SUMS_WRONGLY = {
    "squared_sum": lambda h, acc, w: (h @ w, acc + (h.T @ h) * (h.T @ h)),
    "sum_plus_a_weight": lambda h, acc, w: (h @ w, acc + h.T @ h + w),
    "max_over_rows": lambda h, acc, w: (h @ w, acc + jnp.max(h, axis=0)[:, None] * w),
    "sum_fed_back_to_rows": lambda h, acc, w: (h @ w + acc[0], acc + h.T @ h),
    "sum_as_a_divisor": lambda h, acc, w: (h @ w, acc + w / (h.T @ h)),
    "max_from_zero_over_rows": lambda h, acc, w: (
        h @ w, acc + lax.reduce(h, 0.0, lax.max, (0,))[:, None] * w),
    "sum_scaling_rows": lambda h, acc, w: (h @ w, acc + h.T @ (h * acc[0, 0])),
    # (acc, acc2): a row of a sum written into acc, which then restarts at ones
    "sum_carry_reset_to_ones": lambda h, acc, w: (h @ w, (
        jnp.ones_like(acc[0]),
        acc[1] + lax.dynamic_update_slice(acc[0], jnp.sum(h, axis=0)[None], (0, 0)))),
}
_TWO_ACCUMULATORS = {"sum_carry_reset_to_ones"}


def _accumulating(step, start):
  def run(h, ws):  # one source line: every batch size's loop shares it
    return lax.scan(lambda c, w: (step(*c, w), None), (h, start(h.dtype)), ws)[0]
  return run


def _zeros(dtype):
  return jnp.zeros((D, D), dtype)


def _accumulating_modules(step, start=_zeros, dtype=jnp.float32):
  f = _accumulating(step, start)

  def per_microbatch(h, ws):
    outs = [f(h[m * MICRO:(m + 1) * MICRO], ws) for m in range(B // MICRO)]
    return jnp.concatenate([o[0] for o in outs]), jax.tree.map(lambda *a: sum(a),
                                                               *[o[1] for o in outs])
  args = (jax.ShapeDtypeStruct((B, D), dtype), jax.ShapeDtypeStruct((LAYERS, D, D), dtype))
  return (f,) + _prepared(lower_sequential(f, *args), lower_sequential(per_microbatch, *args))


def _run_all(module, *args):
  env = Interpreter(1).run(module.main, [[a] for a in args])
  return [np.asarray(env[r.id][0]) for r in module.main.results]


def _inputs():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((B, D)).astype(np.float32),
          (rng.standard_normal((LAYERS, D, D)) / 3).astype(np.float32))


@pytest.mark.parametrize("name", sorted(SUMS_ROWS))
def test_a_carry_summing_over_rows_is_the_sum_of_the_pieces(name):
  f, seq, dist = _accumulating_modules(SUMS_ROWS[name])
  assert split_microbatch_loops(seq, dist.main) == 1
  assert sum(op.name == "while" for op in seq.main.ops) == B // MICRO
  h, ws = _inputs()
  for got, want in zip(_run_all(seq, h, ws), jax.jit(f)(h, ws)):
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(SUMS_WRONGLY))
def test_a_carry_using_a_sum_over_rows_otherwise_is_not_split(name):
  start = (lambda t: (_zeros(t), _zeros(t))) if name in _TWO_ACCUMULATORS else _zeros
  _, seq, dist = _accumulating_modules(SUMS_WRONGLY[name], start)
  assert split_microbatch_loops(seq, dist.main) == 0


@pytest.mark.parametrize("step, dtype", [
    (lambda h, acc, w: (h @ w, acc + lax.div(h.T @ h, jnp.int32(3))), jnp.int32),
    (lambda h, acc, w: (h @ w, acc + (h.T @ h).astype(jnp.float16).astype(jnp.float32)),
     jnp.float32)], ids=["integer_quotient", "narrowed_to_f16"])
def test_a_sum_rounded_or_narrowed_per_piece_is_not_split(step, dtype):
  """An audit's false proofs: integer division rounds each piece's quotient,
  and one piece's sum may overflow f16 where the whole batch's does not."""
  _, seq, dist = _accumulating_modules(step, dtype=dtype)
  assert split_microbatch_loops(seq, dist.main) == 0


def test_a_sum_carried_from_a_nonzero_start_is_not_split():
  """Each piece would add the start once: B / b times in all."""
  _, seq, dist = _accumulating_modules(SUMS_ROWS["gradient_like"],
                                         start=lambda t: jnp.ones((D, D), t))
  assert split_microbatch_loops(seq, dist.main) == 0


def test_a_scanned_training_step_is_split_forward_and_backward():
  """jax.grad of the scan: the forward loop saves rows, its transpose reads
  them back and sums each layer's weight gradient over the rows.  Both are
  split; the backward pieces read the forward pieces' saved rows directly."""
  f = _layers(KEEPS_ROWS["mlp"])
  loss = lambda h, ws: jnp.sum(f(h, ws) ** 2)
  seq_fn = jax.grad(loss, argnums=(0, 1))

  def dist_fn(h, ws):
    grads = [jax.grad(loss, argnums=(0, 1))(h[m * MICRO:(m + 1) * MICRO], ws)
             for m in range(B // MICRO)]
    return jnp.concatenate([g[0] for g in grads]), sum(g[1] for g in grads)
  args = (jax.ShapeDtypeStruct((B, D), jnp.float32),
          jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32))
  seq, dist = _prepared(lower_sequential(seq_fn, *args), lower_sequential(dist_fn, *args))
  assert split_microbatch_loops(seq, dist.main) == 2
  loops = [op for op in seq.main.ops if op.name == "while"]
  assert len(loops) == 2 * (B // MICRO)
  backward = [op for op in loops if len(op.operands) == len(loops[-1].operands)][-B // MICRO:]
  produced = {id(r) for op in loops for r in op.results}
  assert all(any(id(v) in produced for v in op.operands) for op in backward)
  h, ws = _inputs()
  for got, want in zip(_run_all(seq, h, ws), jax.jit(seq_fn)(h, ws)):
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-4)


# Data parallelism beside the microbatches: each of DP ranks runs its own
# tile's microbatches, so piece m is microbatch m of every tile (rows m and
# TILE + m for one row a microbatch), cut and put back tile by tile.
DP, TILE = 2, 4
DP_MESH = jax.sharding.Mesh(np.array(jax.devices()[:DP]), ("dp",))


def _twice(h, ws):  # two loops at their own lines, a row-wise op between them
  h = lax.scan(lambda h, w: (jnp.tanh(h @ w) + h, None), h, ws)[0] * 2.0 + 1.0
  return lax.scan(lambda h, w: (jnp.sin(h @ w), None), h, ws)[0]


def _loss(h, ws):
  return jnp.sum(_twice(h, ws) ** 2)


def _dp_microbatched(f, order=lambda ms: ms):
  """``f`` per microbatch of each rank's tile (in ``order``), the rows put
  back and, for a loss, summed over the ranks."""
  def per_device(h, ws):
    outs = [f(h[m * MICRO:(m + 1) * MICRO], ws) for m in order(list(range(TILE // MICRO)))]
    if outs[0].ndim == 0:
      return jax.lax.psum(sum(outs), "dp")
    return jnp.concatenate(outs)
  out = jax.sharding.PartitionSpec() if f is _loss else jax.sharding.PartitionSpec("dp")
  return jax.shard_map(per_device, mesh=DP_MESH, in_specs=(
      jax.sharding.PartitionSpec("dp"), jax.sharding.PartitionSpec()), out_specs=out)


_DP_ARGS = (jax.ShapeDtypeStruct((DP * TILE, D), jnp.float32),
            jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32))


def test_a_batch_tiled_over_data_parallel_ranks_is_cut_into_their_microbatches():
  from graphguard_hlo.lowering import lower_distributed
  from graphguard_hlo.pipeline import prepare_dist
  program = prepare_dist(lower_distributed(_dp_microbatched(_twice), *_DP_ARGS))
  seq, = _prepared(lower_sequential(_twice, *_DP_ARGS))
  assert split_microbatch_loops(seq, program.graph) == 0  # tiles unknown: not a microbatch
  assert split_microbatch_loops(seq, program.graph, program.param_layouts, program.mesh) == 2
  loops = [op for op in seq.main.ops if op.name == "while"]
  assert len(loops) == 2 * TILE // MICRO
  first = next(v for v in loops[1].operands if v.shape == (DP * MICRO, D)).producer
  assert first.name == "concatenate" and [  # microbatch 1 of each tile
      op.producer.attrs["start_indices"][0] for op in first.operands] == [1, TILE + 1]
  rng = np.random.default_rng(0)
  h = rng.standard_normal((DP * TILE, D)).astype(np.float32)
  ws = (rng.standard_normal((LAYERS, D, D)) / 3).astype(np.float32)
  np.testing.assert_allclose(_run(seq, h, ws), np.asarray(jax.jit(_twice)(h, ws)), rtol=1e-4,
                             atol=1e-5)


@pytest.mark.parametrize("f", [_twice, _loss])
@pytest.mark.parametrize("order", ["in_order", "reversed"])
def test_data_parallel_microbatches_are_proved_in_order_only(f, order):
  import graphguard_hlo as gg
  dist = _dp_microbatched(f, (lambda ms: ms) if order == "in_order" else (lambda ms: ms[::-1]))
  rng = np.random.default_rng(1)
  h = rng.standard_normal((DP * TILE, D)).astype(np.float32)
  ws = (rng.standard_normal((LAYERS, D, D)) / 3).astype(np.float32)
  agree = np.allclose(jax.jit(dist)(h, ws), jax.jit(f)(h, ws), rtol=1e-4, atol=1e-5)
  assert agree == (order == "in_order" or f is _loss)  # a sum of rows in any order
  result = gg.verify(f, dist, *_DP_ARGS)
  assert result.refines == agree, result


def _saving(h, ws):  # the scan's stack of each layer's rows: a zero buffer cut along dim 1
  return lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.tanh(h @ w)), h, ws)[1]


def test_data_parallel_microbatches_fill_a_zero_buffer_each():
  import graphguard_hlo as gg

  def per_device(h, ws):
    return jnp.concatenate([_saving(h[m * MICRO:(m + 1) * MICRO], ws)
                            for m in range(TILE // MICRO)], axis=1)
  spec = jax.sharding.PartitionSpec
  dist = jax.shard_map(per_device, mesh=DP_MESH, in_specs=(spec("dp"), spec()),
                       out_specs=spec(None, "dp"))
  result = gg.verify(_saving, dist, *_DP_ARGS)
  assert result.refines, result


def test_a_carry_concatenated_from_uneven_blocks_is_not_read_as_pieces():
  """An audit's false proof: a batch carry put together from blocks of two
  sizes, X's 1-row blocks and Q's 3-row ones, was taken as X's pieces (every
  operand m of a tile's blocks a block of X) though its rows are X0, Q0:3,
  X1, Q3:6."""
  import graphguard_hlo as gg
  spec = jax.sharding.PartitionSpec

  def loop(h, z, ws):
    return lax.scan(lambda c, w: ((jnp.tanh(c[0] @ w) + c[1], jnp.sin(c[1])), None),
                    (h, z), ws)[0][0]

  def seq(x, q, z, ws):
    return loop(jnp.concatenate([x[0:1], q[0:3], x[1:2], q[3:6]]), z, ws)

  def per_device(x, q, z, ws):
    return jnp.concatenate([loop(x, z[0:2], ws), loop(q[1:3], z[2:4], ws)])
  dist = jax.shard_map(per_device, mesh=DP_MESH, in_specs=(spec("dp"),) * 3 + (spec(),),
                       out_specs=spec("dp"), check_vma=False)
  rng = np.random.default_rng(3)
  args = [rng.standard_normal(s).astype(np.float32) for s in ((4, 4), (6, 4), (8, 4))]
  args.append((rng.standard_normal((2, 4, 4)) / 2).astype(np.float32))
  assert not np.allclose(jax.jit(dist)(*args), jax.jit(seq)(*args))
  assert not gg.verify(seq, dist, *args).refines
