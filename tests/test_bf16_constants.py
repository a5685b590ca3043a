"""bfloat16 constants (numpy has no buffer format for them) are read from their
printed form exactly: -inf and NaN printed as bit patterns (0xFF80), and large
constants printed as one hex blob.  Scraping digits out of that text read
-inf as 80 and two blobs differing in the letters A-F as the same table, so
different tables were proved equal."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo.loaders.stablehlo import load_stablehlo
from graphguard_hlo.lowering import lower_distributed, lower_sequential, sequential_text
from graphguard_hlo.relation_check import verify_and_check
from tools.zoo.cases import mesh_of

BF16 = ml_dtypes.bfloat16


def _with_special_values(n: int) -> np.ndarray:
  table = (np.arange(n) / 3).astype(BF16)
  table[1], table[2], table[3] = -np.inf, np.inf, np.nan
  return table


def _letters(n: int, letter: int) -> np.ndarray:
  """A table whose hex digits are mostly the letter ``letter`` (0xA or 0xB)."""
  digits = np.arange(n) % 9 + 1
  return ((letter * 0x1100) | (digits << 4) | letter).astype(np.uint16).view(BF16)


@pytest.mark.parametrize("table", [_with_special_values(16), _with_special_values(128),
                                   _letters(128, 0xA)], ids=["elements", "blob", "letters"])
def test_bf16_constant_is_read_exactly(table):
  text = sequential_text(lambda x: x * jnp.asarray(table).astype(jnp.float32),
                         jax.ShapeDtypeStruct(table.shape, jnp.float32))
  (value,) = [np.asarray(op.attrs["value"]) for op in load_stablehlo("<seq>", text).main.ops
              if op.name == "constant" and op.results[0].type.dtype == "bf16"]
  np.testing.assert_array_equal(value, np.asarray(table, np.float64))


@pytest.mark.parametrize("same", [True, False])
def test_bf16_tables_are_proved_equal_only_when_equal(same):
  n = 128
  seq_table = _letters(n, 0xA)
  dist_table = seq_table.copy()
  if not same:
    dist_table[5] = _letters(n, 0xB)[5]
  mesh = mesh_of((4,), ("cp",))

  def seq(x):
    return jnp.sum(x * jnp.asarray(seq_table).astype(jnp.float32))

  def local(x):
    rows = lax.dynamic_slice_in_dim(jnp.asarray(dist_table), lax.axis_index("cp") * (n // 4),
                                    n // 4)
    return lax.psum(jnp.sum(x * rows.astype(jnp.float32)), "cp")
  dist = shard_map(local, mesh=mesh, in_specs=P("cp"), out_specs=P())
  x = jax.ShapeDtypeStruct((n,), jnp.float32)
  xd = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=NamedSharding(mesh, P("cp")))
  result, check = verify_and_check(lower_sequential(seq, x), lower_distributed(dist, xd))
  assert check.ok and result.refines == same
  ones = np.ones(n, np.float32)
  assert (float(jax.jit(seq)(ones)) == float(jax.jit(dist)(ones))) == same
