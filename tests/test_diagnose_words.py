"""The words diagnose.py puts on a wrong scale (the factor, and every mesh
axis whose size it is: a layout's scale does not say which collective made
it, so naming one of several same-size axes would point at the wrong one),
on a slice taken at another rank's tile (the offsets on each rank), and on
what each rank holds where a value is followed rank by rank."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo import ir
from graphguard_hlo.api import verify
from graphguard_hlo.passes.diagnose import _scale_words
from tests.numbers import outputs_agree
from tools.zoo.cases import mesh_of


def test_a_factor_of_one_axis_size_names_that_axis():
  words = _scale_words(0.5, ir.Mesh((("dp", 2), ("tp", 4))))
  assert words == ("the distributed value is 2 times the sequential one (summed over 2 = |dp| "
                   "ranks without dividing: psum where pmean belongs?)")


def test_a_factor_several_axes_share_names_them_all():
  words = _scale_words(0.5, ir.Mesh((("dp", 2), ("pp", 2), ("tp", 2))))
  assert "summed over 2 = |dp| or |pp| or |tp| ranks without dividing" in words


def test_a_division_too_many_is_named_as_one():
  words = _scale_words(4.0, ir.Mesh((("dp", 2), ("tp", 4))))
  assert words == ("the distributed value is 0.25 times the sequential one (divided by 4 = |tp| "
                   "once too often: pmean where psum belongs?)")


def test_a_factor_no_axis_has_gets_no_guess():
  words = _scale_words(1 / 3, ir.Mesh((("dp", 2), ("tp", 4))))
  assert words == "the distributed value is 3 times the sequential one"


def _tile_times_weight(turn):
  """x tiled over "dp" times rank r's tile ``r + turn`` of a replicated w (the
  sequential x * w when ``turn`` is 0: ZeRO's parameter tile, say)."""
  def local(x, w):
    n = lax.axis_size("dp")
    rows = x.shape[0]
    start = ((lax.axis_index("dp") + turn) % n) * rows
    return x * lax.dynamic_slice_in_dim(w, start, rows, 0)
  return shard_map(local, mesh=mesh_of((4,), ("dp",)), in_specs=(P("dp"), P()),
                   out_specs=P("dp"))


def test_a_slice_at_another_ranks_tile_is_named_with_its_offsets():
  x, w = jnp.arange(32.0).reshape(16, 2), jnp.arange(32.0).reshape(16, 2) + 1
  seq = lambda x, w: x * w
  assert outputs_agree(seq, _tile_times_weight(0), x, w)
  assert verify(seq, _tile_times_weight(0), x, w).refines
  result = verify(seq, _tile_times_weight(1), x, w)
  assert not result.refines and result.failure.op_name == "multiply"
  assert ("it is a dynamic_slice (slice_sizes [4, 2], starting at 4, 8, 12, 0 along dim 0 at "
          "dp = 0, 1, 2, 3: tile dp+1, another rank's tile?) of") in result.failure.diagnosis


def _decayed_tile(turn):
  """x tiled over "dp" plus 0.01 times rank r's tile ``r + turn`` of a
  replicated w (weight decay on ZeRO's parameter tile; right when ``turn`` is 0)."""
  def local(x, w):
    rows = x.shape[0]
    start = ((lax.axis_index("dp") + turn) % lax.axis_size("dp")) * rows
    return jnp.tanh(x + 0.01 * lax.dynamic_slice_in_dim(w, start, rows, 0))
  return shard_map(local, mesh=mesh_of((4,), ("dp",)), in_specs=(P("dp"), P()),
                   out_specs=P("dp"))


def test_a_constant_the_per_device_program_applies_is_no_wrong_factor():
  """0.01 * w relates to the replica w by a factor of 0.01 until the
  per-device program multiplies too; it does, on the wrong tile.  The words
  name the tile, not a factor of 100."""
  x, w = jnp.arange(32.0).reshape(16, 2) / 40, jnp.arange(32.0).reshape(16, 2)
  seq = lambda x, w: jnp.tanh(x + 0.01 * w)
  assert verify(seq, _decayed_tile(0), x, w).refines
  result = verify(seq, _decayed_tile(1), x, w)
  words = result.failure.diagnosis
  assert not result.refines and result.failure.op_name == "add", words
  assert "times the sequential one" not in words, words
  assert "tile dp+1, another rank's tile?" in words, words


def _scaled_mean(rows_counted):
  """tanh(3 * the mean of x's rows), x's rows over "dp": the local sums
  psum'd and divided by ``rows_counted`` (16 is right; 4, a rank's own rows,
  is the wrong count)."""
  def local(x):
    mean = lax.psum(jnp.sum(x, axis=0), "dp") / rows_counted
    return jnp.tanh(mean * 3)
  return shard_map(local, mesh=mesh_of((4,), ("dp",)), in_specs=P("dp"), out_specs=P())


def test_a_wrong_factor_is_traced_back_to_where_it_began():
  x = jnp.arange(32.0).reshape(16, 2) / 40
  seq = lambda x: jnp.tanh(jnp.mean(x, axis=0) * 3)
  assert verify(seq, _scaled_mean(16), x).refines
  result = verify(seq, _scaled_mean(4), x)
  words = result.failure.diagnosis
  assert not result.refines and result.failure.op_name == "tanh", words
  # Reported at the tanh, where the factor matters, and traced to the mean's
  # divide, where it began (the multiply by 3 in between keeps it).
  assert "the distributed value is 4 times the sequential one" in words
  assert "it is off by a factor since the per-device %divide." in words, words
  assert "the distributed value is 4 times the sequential %" in words
  assert "(summed over 4 = |dp| ranks without dividing" in words


def test_an_uneven_sharding_is_not_proved_and_each_ranks_columns_are_shown():
  """30 columns over 4 ranks: XLA pads w to 32 and each rank slices 8, the
  last one 6 real columns and 2 zeros.  A layout's tiles are equal, so this
  is not proved (never "refines" on a guess); the report says, rank by rank,
  which columns each holds."""
  mesh = mesh_of((4,), ("tp",))

  def f(x, w):
    h = jnp.tanh(x @ w)
    h = lax.with_sharding_constraint(h, NamedSharding(mesh, P(None, "tp")))
    return h @ w.T
  replicated = NamedSharding(mesh, P())
  x = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=replicated)
  w = jax.ShapeDtypeStruct((8, 30), jnp.float32, sharding=replicated)
  result = verify(f, jax.jit(f, out_shardings=replicated), x, w)
  words = result.failure.diagnosis
  assert not result.refines, words
  assert "rank by rank it holds, at tp = 0: %2[0:8, 0:8] at [0:8, 0:8]" in words, words
  assert "at tp = 3: %2[0:8, 24:30] at [0:8, 0:6], zeros elsewhere" in words, words


def _tensor_parallel_grad(check_vma):
  """Megatron's MLP, its summed output's gradient taken inside shard_map."""
  mesh = mesh_of((4,), ("tp",))
  specs = (P(), P(None, "tp"), P("tp", None))

  def loss(x, w1, w2):
    return (jnp.tanh(x @ w1) @ w2).sum()

  def local(x, w1, w2):
    return lax.psum((jnp.tanh(x @ w1) @ w2).sum(), "tp")
  dist = shard_map(jax.grad(local, argnums=(1, 2)), mesh=mesh, in_specs=specs,
                   out_specs=(P(None, "tp"), P("tp", None)), check_vma=check_vma)
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 16), (16, 32), (32, 16))]
  return verify(jax.grad(loss, argnums=(1, 2)), dist, *args, mesh=mesh, in_specs=specs)


def test_a_psum_transposed_without_check_vma_is_named_by_its_constant():
  """Without ``check_vma`` the psum's transpose is a psum: the cotangent is
  seeded with 4 where the sequential program's is 1 (JAX's shard_map docs'
  own warning).  The report names the constant and the axis."""
  assert _tensor_parallel_grad(check_vma=True).refines
  result = _tensor_parallel_grad(check_vma=False)
  assert not result.refines
  assert result.failure.op_name == "dot_general"
  assert "the constant 4 where the sequential dot_general reads 1 (|tp| = 4 times" \
      in result.failure.diagnosis, result.failure.diagnosis


def _data_parallel_grad(loss_of):
  """The gradient of a weight replicated over dp, images split over dp,
  under shard_map's check_vma (jax's default)."""
  w, x = jnp.ones((16, 8)) / 16, jnp.arange(128.0).reshape(8, 16) / 128
  loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
  dist = shard_map(lambda w, x: jax.grad(loss_of(loss))(w, x), mesh=mesh_of((4,), ("dp",)),
                   in_specs=(P(), P("dp")), out_specs=P())
  return verify(jax.grad(loss), dist, w, x)


def test_a_sum_autodiff_made_under_check_vma_is_named_as_jaxs():
  """A loss averaged over each rank's own rows, its gradient then pmean'd:
  jax's autodiff has already summed the replicated weight's gradient over
  dp, so it is 4 times the whole.  The sum no one wrote is named as jax's,
  with the fix; a loss pmean'd before differentiating is proved."""
  assert _data_parallel_grad(lambda loss: lambda w, x: lax.pmean(loss(w, x), "dp")).refines
  result = _data_parallel_grad(lambda loss: loss)
  words = result.failure.diagnosis
  assert not result.refines
  assert "the distributed value is 4 times the sequential one" in words, words
  assert ("that all_reduce is jax's own: under shard_map's check_vma, autodiff sums over "
          "'dp' the gradient of an input replicated over 'dp'") in words, words
  assert "average it with lax.pmean over 'dp' before differentiating" in words
