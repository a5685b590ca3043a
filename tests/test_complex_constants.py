"""Complex constants (RoPE written with complex rotations, as Llama's reference
does) load: reading a complex elements attribute through the MLIR bindings
aborts the process, so the loader reads its text."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from graphguard_hlo.loaders.stablehlo import load_stablehlo
from graphguard_hlo.lowering import sequential_text

ROTATIONS = (np.arange(8) + 1j * np.arange(8)[::-1]).astype(np.complex64)


def _rotate(x):
  return jnp.real(jnp.asarray(ROTATIONS) * x)


def test_complex_constants_are_read():
  text = sequential_text(_rotate, jax.ShapeDtypeStruct((8,), jnp.float32))
  values = [np.asarray(op.attrs["value"]) for op in load_stablehlo("<seq>", text).main.ops
            if op.name == "constant"]
  assert any(v.shape == (8,) and np.array_equal(v, ROTATIONS) for v in values)
  splat = sequential_text(lambda x: jnp.real(jnp.full((8,), 1 - 2j, jnp.complex64) * x),
                          jax.ShapeDtypeStruct((8,), jnp.float32))
  values = [np.asarray(op.attrs["value"]) for op in load_stablehlo("<seq>", splat).main.ops
            if op.name == "constant"]
  assert any(v.size == 1 and complex(v.ravel()[0]) == 1 - 2j for v in values)


_VERIFY = """
import jax, jax.numpy as jnp, numpy as np
from jax import shard_map
from jax.sharding import PartitionSpec as P
import graphguard_hlo as gg
from tests.test_complex_constants import ROTATIONS, _rotate
from tools.zoo.cases import mesh_of
mesh = mesh_of((4,), ("x",))
rotations = ROTATIONS if {same} else np.conj(ROTATIONS)
dist = shard_map(lambda x: jnp.real(jnp.asarray(rotations) * jax.lax.all_gather(x, "x", tiled=True)),
                 mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False)
result = gg.verify(_rotate, dist, jnp.zeros(8), mesh=mesh, in_specs=(P("x"),))
print("verdict", result.refines)
"""


@pytest.mark.parametrize("same", [True, False])
def test_a_program_with_complex_constants_is_verified(same):
  # The per-device body closes over the rotations (passed in whole); with
  # their conjugates it computes another function.  In a child process: a
  # regression aborts it, not the test session.
  proc = subprocess.run([sys.executable, "-c", _VERIFY.format(same=same)], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert f"verdict {same}" in proc.stdout
