"""Input-free values related by their numbers (passes/constant_values.py):
positions and a causal mask the per-device program reads from zig-zag tables
(numpy constants each rank cuts its rows from) against the sequential iota and
mask, on a batch the relation file says is in zig-zag chunks.  A table one
entry off, or in another order than the batch, is not proved."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo.lowering import lower_distributed, lower_sequential
from graphguard_hlo.passes.layout import reorder_chunks
from graphguard_hlo.relation_check import verify_and_check
from tools.zoo.cases import mesh_of

N = 16
ZIGZAG = (0, 7, 1, 6, 2, 5, 3, 4)
ORDERED = ",".join(map(str, ZIGZAG))


def _mesh():
  return mesh_of((4,), ("cp",))


def _zigzag(values: np.ndarray) -> np.ndarray:
  return reorder_chunks(values, 0, ZIGZAG)


def _positions_seq(x):
  return jnp.sum(x * jnp.arange(N, dtype=jnp.float32))


def _positions_dist(table: np.ndarray):
  def local(x):
    rows = lax.dynamic_slice_in_dim(jnp.asarray(table), lax.axis_index("cp") * 4, 4)
    return lax.psum(jnp.sum(x * rows), "cp")
  return shard_map(local, mesh=_mesh(), in_specs=P("cp"), out_specs=P())


def _mask_seq(x):
  rows = jnp.arange(N)
  return jnp.sum(jnp.where(rows[:, None] >= rows[None, :], x, 0.0))


def _mask_dist(order=ZIGZAG):
  rows = reorder_chunks(np.arange(N), 0, order)
  table = rows[:, None] >= rows[None, :]

  def local(x):
    mine = lax.dynamic_slice_in_dim(jnp.asarray(table), lax.axis_index("cp") * 4, 4)
    return lax.psum(jnp.sum(jnp.where(mine, x, 0.0)), "cp")
  return shard_map(local, mesh=_mesh(), in_specs=P("cp"), out_specs=P())


def _verify(seq_fn, dist_fn, shape, relation):
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  xd = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(_mesh(), P("cp")))
  result, check = verify_and_check(lower_sequential(seq_fn, x), lower_distributed(dist_fn, xd),
                                   relation=relation)
  assert check.ok, check.failures[:3]
  return result


def _run(seq_fn, dist_fn, shape, dims):
  """Both programs on one input, the distributed one given it reordered on ``dims``."""
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  held = x
  for d in dims:
    held = reorder_chunks(held, d, ZIGZAG)
  return float(jax.jit(seq_fn)(x)), float(jax.jit(dist_fn)(held))


def test_zigzag_positions_table_is_proved():
  dist = _positions_dist(_zigzag(np.arange(N, dtype=np.float32)))
  assert _verify(_positions_seq, dist, (N,), f"0: dim0=cp order0={ORDERED}\n").refines
  seq_out, dist_out = _run(_positions_seq, dist, (N,), [0])
  assert np.isclose(seq_out, dist_out, rtol=1e-5)


@pytest.mark.parametrize("table,op,words", [
    # Positions 2 and 3 swapped: rank 1's rows (chunks 1 and 6) are wrong.
    (_zigzag(np.array([0, 1, 3, 2] + list(range(4, N)), dtype=np.float32)), "iota",
     "holds its tiles as chunks[dim0: 0 7 1 6 2 5 3 4](concat[dim0:cp](d@r)) at cp = 0, 2, 3 "
     "but not at cp = 1 (a table with wrong entries"),
    # In sequence order while the batch is zig-zag: related, but not as the batch is.
    (np.arange(N, dtype=np.float32), "multiply", "chunk order mismatch"),
], ids=["one_entry_off", "sequence_order"])
def test_a_table_that_is_not_the_batchs_order_is_not_proved(table, op, words):
  dist = _positions_dist(table)
  result = _verify(_positions_seq, dist, (N,), f"0: dim0=cp order0={ORDERED}\n")
  assert not result.refines
  assert result.failure.op_name == op and words in result.failure.diagnosis
  seq_out, dist_out = _run(_positions_seq, dist, (N,), [0])
  assert not np.isclose(seq_out, dist_out, rtol=1e-3)


def test_zigzag_mask_table_on_both_dims_is_proved():
  # The sequential mask is iotas compared: they have no counterpart (the
  # per-device program has only the folded table), so they wait for the
  # compare, which relates by its numbers.
  relation = f"0: dim0=cp order0={ORDERED} order1={ORDERED}\n"
  assert _verify(_mask_seq, _mask_dist(), (N, N), relation).refines
  seq_out, dist_out = _run(_mask_seq, _mask_dist(), (N, N), [0, 1])
  assert np.isclose(seq_out, dist_out, rtol=1e-5)


def test_a_mask_table_in_another_order_is_reported_at_the_select():
  relation = f"0: dim0=cp order0={ORDERED} order1={ORDERED}\n"
  contiguous = tuple(range(8))
  result = _verify(_mask_seq, _mask_dist(contiguous), (N, N), relation)
  assert not result.refines and result.failure.op_name == "select"
  assert "chunk order mismatch" in result.failure.diagnosis
  seq_out, dist_out = _run(_mask_seq, _mask_dist(contiguous), (N, N), [0, 1])
  assert not np.isclose(seq_out, dist_out, rtol=1e-3)


def test_an_iota_read_with_the_inputs_is_reported_at_the_iota():
  # Deferred while nothing but the tables reads it; a reader computed from
  # the inputs needs it related, and the report names the iota.
  def seq(x):
    return jnp.sum(x * jnp.arange(N, dtype=jnp.float32) * 2.0)

  def local(x):
    return lax.psum(jnp.sum(x * jnp.arange(4, dtype=jnp.float32) * 2.0), "cp")
  dist = shard_map(local, mesh=_mesh(), in_specs=P("cp"), out_specs=P())
  result = _verify(seq, dist, (N,), None)
  assert not result.refines
  assert "no rank offset" in result.failure.diagnosis


# False proofs an audit found before values were trusted only where the
# interpreter computes them as XLA does (``constant_values._exact``): each is a
# sequential formula against a numpy table the interpreter computes alike but
# XLA does not.  All must be left not proved, and their outputs differ.
_IOTA = np.arange(N, dtype=np.float32)
_SQUARES_NEGATIVE_ZERO = _IOTA ** 2
_SQUARES_NEGATIVE_ZERO[0] = -0.0
with np.errstate(all="ignore"):
  _AUDIT_CASES = {
      # numpy wraps a float to int32 out of range, XLA saturates
      "convert_saturates": (
          lambda: ((jnp.arange(N, dtype=jnp.float32) * 1e9).astype(jnp.int32)
                   // (1 << 24)).astype(jnp.float32),
          ((_IOTA * np.float32(1e9)).astype(np.int32) // (1 << 24)).astype(np.float32), None),
      # numpy wraps a negative float to uint32, XLA gives 0
      "convert_negative_to_unsigned": (
          lambda: ((jnp.arange(N, dtype=jnp.float32) - 8.0).astype(jnp.uint32) % 7
                   ).astype(jnp.float32),
          ((_IOTA - 8).astype(np.uint32) % 7).astype(np.float32), None),
      # numpy's tanh and XLA's differ in the last bit at some positions
      "tanh_last_bits": (
          lambda: (jnp.tanh(jnp.arange(N, dtype=jnp.float32))
                   == jnp.asarray(np.tanh(_IOTA))).astype(jnp.float32),
          np.ones(N, np.float32), None),
      # bfloat16 sums rounded by XLA after every op, not by the interpreter
      "bfloat16_rounding": (
          lambda: ((jnp.arange(N, dtype=jnp.bfloat16) + jnp.bfloat16(256))
                   - jnp.bfloat16(256)).astype(jnp.float32),
          _IOTA, None),
      # f32 products with scalar constants, not float64 ones
      "float32_products": (
          lambda: (((jnp.arange(N, dtype=jnp.float32) * 0.1) * 10.0)
                   == jnp.arange(N, dtype=jnp.float32)).astype(jnp.float32),
          np.eye(1, N, 0, dtype=np.float32)[0], None),
      # -0.0 is not 0.0: 1 / -0.0 is -inf
      "negative_zero": (
          lambda: jnp.arange(N, dtype=jnp.float32) * jnp.arange(N, dtype=jnp.float32),
          _SQUARES_NEGATIVE_ZERO, lambda v: jnp.sign(1.0 / v)),
  }


@pytest.mark.parametrize("name", sorted(_AUDIT_CASES))
def test_a_table_the_interpreter_alone_agrees_with_is_not_proved(name):
  formula, table, then = _AUDIT_CASES[name]
  then = then or (lambda v: v)

  def seq(x):
    return jnp.sum(x * then(formula()))

  def local(x):
    rows = lax.dynamic_slice_in_dim(jnp.asarray(table), lax.axis_index("cp") * 4, 4)
    return lax.psum(jnp.sum(x * then(rows)), "cp")
  dist = shard_map(local, mesh=_mesh(), in_specs=P("cp"), out_specs=P())
  assert not _verify(seq, dist, (N,), None).refines
  seq_out, dist_out = _run(seq, dist, (N,), [])
  assert not np.isclose(seq_out, dist_out, rtol=1e-3)


def test_values_are_compared_bit_for_bit_in_their_type():
  from graphguard_hlo.passes.constant_values import _same_bits
  assert _same_bits(np.float32([1.0, 0.0]), np.float32([1.0, 0.0]))
  assert not _same_bits(np.float32([0.0]), np.float32([-0.0]))
  assert not _same_bits(np.int64([2 ** 53 + 1]), np.int64([2 ** 53]))  # equal as float64
  assert not _same_bits(np.int32([1]), np.float32([1.0]))


def _table_case(seq, table_rows):
  """``seq`` against a per-device program reading its rows of a table and
  summing ``x`` where they hold (or times them): not proved, outputs differ."""
  dist = shard_map(lambda x: lax.psum(jnp.sum(table_rows(x)), "cp"), mesh=_mesh(),
                   in_specs=P("cp"), out_specs=P())
  assert not _verify(seq, dist, (N,), None).refines
  seq_out, dist_out = _run(seq, dist, (N,), [])
  assert not np.isclose(seq_out, dist_out, rtol=1e-3)


def _rows(table):
  return lax.dynamic_slice_in_dim(jnp.asarray(table), lax.axis_index("cp") * 4, 4)


def test_a_totalorder_compare_is_not_read_as_numpy_compares():
  # TOTALORDER tells -0.0 from 0.0, numpy does not; the compare reads the
  # partition's rows, so XLA runs it rather than folding it.
  a = np.arange(N, dtype=np.float32) * 7 % 16
  a[0] = -0.0
  b = a.copy()
  b[0], b[3] = 0.0, 100.0
  seq_mask = np.ones(N, bool)
  seq_mask[3] = False
  _table_case(lambda x: jnp.sum(jnp.where(jnp.asarray(seq_mask), x, 0.0)),
              lambda x: jnp.where(lax.eq_to_p.bind(_rows(a), _rows(b)), x, 0.0))


def test_a_slice_at_a_narrow_unsigned_start_is_not_trusted():
  # XLA folds dynamic_slice(arange(300), u8 200) to start 0 and runs it at 200.
  def seq(x):
    return jnp.sum(x * lax.dynamic_slice(jnp.arange(300, dtype=jnp.float32),
                                         (jnp.asarray(np.uint8(200)),), (N,)))
  _table_case(seq, lambda x: x * _rows(np.arange(200, 200 + N, dtype=np.float32)))


def test_an_int4_quotient_is_not_trusted():
  # The interpreter holds int4 in float64, where 7 / 2 is 3.5.
  import ml_dtypes
  a = (np.arange(N) % 8).astype(ml_dtypes.int4)
  b = np.full(N, 2, ml_dtypes.int4)
  b[0] = 3
  c = np.asarray((np.arange(N) % 8 // np.asarray(b, np.int64)).astype(ml_dtypes.int4))
  float_quotients = (np.asarray(a, np.float64) / np.asarray(b, np.float64)) == np.asarray(c, np.float64)

  def seq(x):
    return jnp.sum(jnp.where(lax.div(jnp.asarray(a), jnp.asarray(b)) == jnp.asarray(c), x, 0.0))
  _table_case(seq, lambda x: jnp.where(_rows(float_quotients), x, 0.0))


@pytest.mark.parametrize("index", [np.uint32(2 ** 32 - 1), np.uint16(2 ** 15 + 1)])
def test_a_slice_at_an_unsigned_start_with_its_top_bit_set_is_not_trusted(index):
  # XLA folds such a start as negative (offset 0) and runs it clamped to the end.
  table = np.arange(2 * N, dtype=np.float32)

  def seq(x):
    return jnp.sum(x * lax.dynamic_slice(jnp.asarray(table), (jnp.asarray(index),), (N,)))
  _table_case(seq, lambda x: x * _rows(table[N:]))
