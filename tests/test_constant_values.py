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
