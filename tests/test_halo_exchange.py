"""Convolutions over a dim split over ranks, with the neighbours' rows passed
by a halo exchange: a Mamba-style causal conv1d over a sequence split over
sp (each rank's last rows ppermuted to the next rank), and a 3 x 3 SAME
convolution of images split by rows (both neighbours), its gradients and an
SGD step, under shard_map and GSPMD (XLA exchanges the halos itself and
masks the rows beyond the ends).
Each proved with its relations held on numbers; a cyclic ppermute (rank 0
reads the last rank's rows where the sequence starts with zeros), one sent
the wrong way and a halo a row short are refused at the convolution, and jax
itself shows their outputs differ.  Below them, the pieces: a haloed
layout's numeric semantics and a rank table read back as one."""

import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo import ir
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.loaders import load_module_bytes
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.layout import Layout, assemble, shard
from graphguard_hlo.passes.rank_tables import Piece, RankTables
from graphguard_hlo.pipeline import verify_modules
from graphguard_hlo.report import to_text
from graphguard_hlo.xla_partition import partitioned_hlo_text

SP = Mesh(np.array(jax.devices()[:4]), ("sp",))
WIDTH = 4  # the causal kernel's
TOKENS = jax.ShapeDtypeStruct((2, 32, 8), jnp.float32)  # (batch, sequence, channels)
KERNEL = jax.ShapeDtypeStruct((WIDTH, 1, 8), jnp.float32)  # depthwise (width, 1, channels)
PROJ = jax.ShapeDtypeStruct((8, 8), jnp.float32)


def causal_conv(x, w, padding=(WIDTH - 1, 0)):
  return lax.conv_general_dilated(x, w, (1,), [padding], dimension_numbers=("NWC", "WIO", "NWC"),
                                  feature_group_count=x.shape[-1])


def mixer(x, w, proj):
  """A Mamba-like mixer's short convolution: conv1d, SiLU, a projection."""
  return jax.nn.silu(causal_conv(x, w)) @ proj


def sp_mixer(x, w, proj, pairs=None, halo=WIDTH - 1):
  """Each rank's tile with the previous rank's last ``halo`` rows before it
  (rank 0 receives nothing: zeros, the sequence's own padding)."""
  pairs = pairs or [(i, i + 1) for i in range(3)]
  before = lax.ppermute(x[:, -halo:], "sp", pairs)
  x = jnp.concatenate([before, x], axis=1)
  return jax.nn.silu(causal_conv(x, w, (WIDTH - 1 - halo, 0))) @ proj


def _sharded(fn):
  return shard_map(fn, mesh=SP, in_specs=(P(None, "sp"), P(), P()), out_specs=P(None, "sp"))


def test_a_causal_conv1d_over_a_sequence_split_over_sp_is_proved():
  result = gg.verify(mixer, _sharded(sp_mixer), TOKENS, KERNEL, PROJ, check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")
  assert not result.relation_check.failures


BUGS = {
    "cyclic": dict(pairs=[(i, (i + 1) % 4) for i in range(4)]),  # rank 0 reads rank 3's rows
    "backwards": dict(pairs=[(i + 1, i) for i in range(3)]),       # the next rank's rows
    "a row short": dict(halo=WIDTH - 2),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_wrong_halo_is_refused_at_the_convolution(bug):
  dist = _sharded(lambda x, w, p: sp_mixer(x, w, p, **BUGS[bug]))
  result = gg.verify(mixer, dist, TOKENS, KERNEL, PROJ)
  assert not result.refines and result.failure.op_name == "convolution"
  assert result.failure.location.line == inspect.getsourcelines(causal_conv)[1] + 1
  rng = np.random.default_rng(0)
  args = [rng.standard_normal(a.shape).astype(np.float32) for a in (TOKENS, KERNEL, PROJ)]
  assert not np.allclose(jax.jit(dist)(*args), mixer(*args), atol=1e-4)


@pytest.mark.parametrize("dtype, proved", [(jnp.int16, True), (jnp.int8, False)])
def test_a_mask_on_row_numbers_is_read_in_its_own_type(dtype, proved):
  """The haloed tile masked by its rows' numbers in the sequence, 10 g >= 0:
  every row in int16; in int8 10 g wraps from row 13 on and those rows are
  zeroed (an audit's false proof: the mask was read through the convert)."""
  def masked(x, w, p):
    before = lax.ppermute(x[:, -(WIDTH - 1):], "sp", [(i, i + 1) for i in range(3)])
    x = jnp.concatenate([before, x], axis=1)
    g = lax.axis_index("sp") * 8 - (WIDTH - 1) + jnp.arange(8 + WIDTH - 1)
    x = jnp.where(((g * 10).astype(dtype) >= 0)[None, :, None], x, 0.0)
    return jax.nn.silu(causal_conv(x, w, (0, 0))) @ p
  result = gg.verify(mixer, _sharded(masked), TOKENS, KERNEL, PROJ)
  assert result.refines == proved, to_text(result, "seq", "dist")
  rng = np.random.default_rng(0)
  args = [rng.standard_normal(a.shape).astype(np.float32) for a in (TOKENS, KERNEL, PROJ)]
  assert np.allclose(jax.jit(_sharded(masked))(*args), mixer(*args), atol=1e-4) == proved


def test_a_halo_a_row_short_is_named():
  dist = _sharded(lambda x, w, p: sp_mixer(x, w, p, **BUGS["a row short"]))
  words = gg.verify(mixer, dist, TOKENS, KERNEL, PROJ).failure.diagnosis
  assert "holds each rank's tile of dim 1 with 2 rows of the rank before and 0 of the rank " \
      "after (%concatenate." in words and "where this convolution pads 3 before (a halo " \
      "exchange of the wrong size?)" in words, words


def test_the_cyclic_halo_is_shown_rank_by_rank():
  """The words say what rank 0 holds: the sequence's last rows before its
  first, where the sequential convolution reads zeros."""
  dist = _sharded(lambda x, w, p: sp_mixer(x, w, p, **BUGS["cyclic"]))
  words = gg.verify(mixer, dist, TOKENS, KERNEL, PROJ).failure.diagnosis
  assert "rank by rank it holds, at sp = 0: %1[0:2, 29:32, 0:8] at [0:2, 0:3, 0:8]" in words


IMAGES = jax.ShapeDtypeStruct((2, 3, 16, 16), jnp.float32)
FILTERS = jax.ShapeDtypeStruct((8, 3, 3, 3), jnp.float32)


def conv_relu(x, k):
  return jax.nn.relu(lax.conv_general_dilated(x, k, (1, 1), "SAME"))


def rows_conv_relu(x, k):
  """Rows split over dp: a row from each neighbour, zeros at the ends."""
  above = lax.ppermute(x[:, :, -1:], "dp", [(i, i + 1) for i in range(3)])
  below = lax.ppermute(x[:, :, :1], "dp", [(i + 1, i) for i in range(3)])
  x = jnp.concatenate([above, x, below], axis=2)
  return jax.nn.relu(lax.conv_general_dilated(x, k, (1, 1), ((0, 0), (1, 1))))


ROWS = P(None, None, "dp")


def test_rows_from_above_only_are_refused_and_named():
  """The row below each tile never exchanged: the tile's last output reads it."""
  def above_only(x, k):
    above = lax.ppermute(x[:, :, -1:], "dp", [(i, i + 1) for i in range(3)])
    x = jnp.concatenate([above, x], axis=2)
    return jax.nn.relu(lax.conv_general_dilated(x, k, (1, 1), ((0, 1), (1, 1))))
  mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
  dist = shard_map(above_only, mesh=mesh, in_specs=(ROWS, P()), out_specs=ROWS)
  result = gg.verify(conv_relu, dist, IMAGES, FILTERS)
  assert not result.refines and result.failure.op_name == "convolution"
  assert "with 1 row of the rank before and 0 of the rank after" in result.failure.diagnosis
  assert "a tile's last output reads 1 after (a halo too small?)" in result.failure.diagnosis


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_a_same_convolution_of_images_split_by_rows_is_proved(style):
  mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
  if style == "shard_map":
    dist = shard_map(rows_conv_relu, mesh=mesh, in_specs=(ROWS, P()), out_specs=ROWS)
    result = gg.verify(conv_relu, dist, IMAGES, FILTERS, check_relations=True)
  else:
    result = gg.verify(conv_relu, conv_relu, IMAGES, FILTERS, mesh=mesh, in_specs=(ROWS, P()),
                       out_specs=ROWS, check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")


@pytest.mark.parametrize("fn, out", [
    # rows and columns split: XLA exchanges rows, then columns of the haloed rows
    (conv_relu, P(None, None, "x", "y")),
    # strided: XLA passes one row, the last padding row no window reads
    (lambda x, k: lax.conv_general_dilated(x, k, (2, 2), ((1, 1), (1, 1))), P(None, None, "x", "y")),
    # the input's gradient: a convolution of the output's, over halos too
    (lambda x, k: jax.grad(lambda x: jnp.sum(conv_relu(x, k) ** 2))(x), P(None, None, "x", "y")),
    # the kernel's: the images convolved with the output's gradient, split alike; summed
    (lambda x, k: jax.grad(lambda k: jnp.sum(conv_relu(x, k) ** 2))(k), P()),
])
def test_gspmd_convolutions_over_split_rows_and_columns_are_proved(fn, out):
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
  result = gg.verify(fn, fn, IMAGES, FILTERS, mesh=mesh, in_specs=(P(None, None, "x", "y"), P()),
                     out_specs=out, check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")


def sgd_step(k, x):
  return k - 0.1 * jax.grad(lambda k: jnp.mean(conv_relu(x, k) ** 2))(k)


def rows_sgd_step(k, x):
  """The loss averaged over dp before differentiating (jax's check_vma sums
  the replicated kernel's cotangent over dp itself)."""
  loss = lambda k: lax.pmean(jnp.mean(rows_conv_relu(x, k) ** 2), "dp")
  return k - 0.1 * jax.grad(loss)(k)


@pytest.mark.parametrize("style", ["shard_map", "gspmd"])
def test_an_sgd_step_of_a_convolution_over_split_rows_is_proved(style):
  """The kernel's gradient over halos: the autodiff of the exchange sends
  the halo rows' cotangents back, and the kernel's is a partial sum."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
  dist = shard_map(rows_sgd_step, mesh=mesh, in_specs=(P(), ROWS), out_specs=P()) \
      if style == "shard_map" else sgd_step
  kw = {} if style == "shard_map" else dict(mesh=mesh, in_specs=(P(), ROWS), out_specs=P())
  result = gg.verify(sgd_step, dist, FILTERS, IMAGES, check_relations=True, **kw)
  assert result.refines, to_text(result, "seq", "dist")


def _partitioned_rows_conv(edit=lambda text: text):
  mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
  lowered = jax.jit(conv_relu, in_shardings=(NamedSharding(mesh, ROWS), NamedSharding(mesh, P())),
                    out_shardings=NamedSharding(mesh, ROWS)).lower(IMAGES, FILTERS)
  text = partitioned_hlo_text(lowered)
  return load_module_bytes("<rows>.hlo.txt", edit(text).encode())


def test_gspmd_halo_rows_sent_the_wrong_way_are_refused():
  """XLA's module edited so the row above comes from the rank below."""
  above = "source_target_pairs={{0,1},{1,2},{2,3}}"

  def backwards(text):
    assert text.count(above) == 1
    return text.replace(above, "source_target_pairs={{1,0},{2,1},{3,2}}")

  seq = lower_sequential(conv_relu, IMAGES, FILTERS)
  assert verify_modules(seq, _partitioned_rows_conv()).refines
  result = verify_modules(lower_sequential(conv_relu, IMAGES, FILTERS),
                          _partitioned_rows_conv(backwards))
  assert not result.refines and result.failure.op_name == "convolution"
  rng = np.random.default_rng(0)
  x, k = rng.standard_normal(IMAGES.shape), rng.standard_normal(FILTERS.shape)
  want = np.asarray(conv_relu(x, k))
  for edit, agrees in ((lambda t: t, True), (backwards, False)):
    module = _partitioned_rows_conv(edit)
    inline_calls(module)
    tiles = [x[:, :, 4 * r:4 * r + 4] for r in range(4)]
    outs = Interpreter(4).run(module.main, [tiles, [k] * 4])[module.main.results[0].id]
    got = np.concatenate(outs, axis=2)
    assert np.allclose(got, want, atol=1e-4) == agrees


# -- the pieces -------------------------------------------------------------------------------

MESH = ir.Mesh((("x", 2), ("y", 3)))


def test_a_haloed_layout_holds_its_neighbours_rows_and_zeros_beyond_the_ends():
  layout = Layout((("y",), ("x",)), halo=((0, 1, 2), (1, 2, 0)))
  assert layout.is_valid() and not layout.is_plain()
  assert layout.local_shape((6, 8), MESH) == (5, 6)
  assert layout.whole_shape((5, 6), MESH) == (6, 8)
  value = np.arange(48.0).reshape(6, 8)
  local = shard(layout, MESH, value)
  # rank (x=0, y=1): rows 2..3 with row 1 before and rows 4, 5 after;
  # columns 0..3 with two zero columns before (the ends).
  np.testing.assert_array_equal(local[(0, 1)], np.pad(value[1:6, 0:4], ((0, 0), (2, 0))))
  np.testing.assert_array_equal(assemble(layout, MESH, local), value)
  local[(1, 1)] = local[(1, 1)].copy()
  local[(1, 1)][0, 0] += 1.0  # a halo row that is not the neighbour's
  with pytest.raises(AssertionError, match="halo before the tile of dim 1"):
    assemble(layout, MESH, local)


def test_a_haloed_partial_sum_sums_each_partial_piece_with_its_neighbours():
  layout = Layout((("y",), ()), partial=("x",), halo=((0, 1, 1),))
  value = np.random.default_rng(0).standard_normal((6, 4))
  np.testing.assert_allclose(
      assemble(layout, MESH, shard(layout, MESH, value, np.random.default_rng(1))), value)


@pytest.mark.parametrize("halo", [((0, 3, 0),), ((0, 0, 0),), ((1, 1, 0),)])
def test_halos_wider_than_a_tile_empty_or_on_an_untiled_dim_are_invalid(halo):
  layout = Layout((("y",), ()), halo=halo)
  assert not layout.is_valid() or layout.local_shape((6, 4), MESH) is None


def _tables(mesh):
  return RankTables(None, mesh, {}, {})


def _window(t, n, lo, hi, r, rest=(0, 4)):
  """What rank r holds of a (n, 4) S as its tile of t rows with lo before
  and hi after, cut at S's ends."""
  start = r * t - lo
  box = ((max(0, -start), min(t + lo + hi, n - start)), rest)
  return (Piece(box, (start, 0)),)


def test_a_table_of_tiles_with_their_neighbours_rows_reads_as_a_halo():
  mesh = ir.Mesh((("sp", 4),))
  table = [_window(4, 16, 1, 2, r) for r in range(4)]
  assert _tables(mesh)._as_halo_layout(table, (7, 4), (16, 4)) == Layout(
      (("sp",), ()), halo=((0, 1, 2),))


def test_a_table_whose_first_rank_holds_rows_before_the_start_is_no_halo():
  """A cyclic exchange: rank 0 holds the last rows where zeros belong."""
  mesh = ir.Mesh((("sp", 4),))
  table = [_window(4, 16, 1, 0, r) for r in range(4)]
  table[0] = (Piece(((0, 1), (0, 4)), (15, 0)), Piece(((1, 5), (0, 4)), (-1, 0)))
  assert _tables(mesh)._as_halo_layout(table, (5, 4), (16, 4)) is None
  # and rows from the wrong neighbour
  table = [_window(4, 16, 1, 0, r) for r in range(4)]
  table[2] = (Piece(((0, 5), (0, 4)), (8, 0)),)
  assert _tables(mesh)._as_halo_layout(table, (5, 4), (16, 4)) is None
  # and a halo row left zero inside the sequence (a permute some rank skips)
  table = [_window(4, 16, 1, 0, r) for r in range(4)]
  table[2] = (Piece(((1, 5), (0, 4)), (7, 0)),)
  assert _tables(mesh)._as_halo_layout(table, (5, 4), (16, 4)) is None


def test_a_mask_selecting_between_two_held_values_is_not_read_as_zeros():
  """Only ``select(mask, a, 0)`` keeps a's pieces in the run and zeros off
  it; with another value there (a pool's -inf padding, rows of S) the
  rows off the run are not zeros."""
  mesh = ir.Mesh((("sp", 2),))
  a = [_window(4, 8, 1, 0, r) for r in range(2)]
  b = [(Piece(((0, 5), (0, 4)), (0, 0)),)] * 2
  assert _tables(mesh)._masked_rows(None, a, b) is None


def test_a_mask_keeping_one_run_of_rows_cuts_the_pieces_to_it():
  """XLA's mask keeps the rows inside the sequence; a mask with a hole in
  the run is not read (the hole's rows would be taken as kept)."""
  mesh = ir.Mesh((("sp", 2),))
  tables = _tables(mesh)
  a = [(Piece(((0, 5), (0, 4)), (4 * r - 1, 0)),) for r in range(2)]
  zeros = [()] * 2
  pred = types.SimpleNamespace(shape=(5, 4))
  tables._row_mask = lambda v, k: np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]) if k == 0 else None
  assert tables._masked_rows(pred, a, zeros) == [(Piece(((1, 5), (0, 4)), (-1, 0)),),
                                                 (Piece(((0, 4), (0, 4)), (3, 0)),)]
  tables._row_mask = lambda v, k: np.array([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]) if k == 0 else None
  assert tables._masked_rows(pred, a, zeros) is None
