"""Run a sequential and a distributed function on the same random inputs."""

import jax
import numpy as np


def outputs_agree(seq, dist, *like, seed: int = 0) -> bool:
  """Do ``seq`` and ``dist`` give the same outputs on random float inputs
  shaped like ``like``?  (A seeded bug must make them differ.)"""
  rng = np.random.default_rng(seed)
  args = [rng.standard_normal(a.shape).astype(np.float32) for a in like]
  got, want = jax.jit(dist)(*args), jax.jit(seq)(*args)
  return all(np.allclose(a, b, rtol=1e-5, atol=1e-6)
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def random_inputs(like, seed: int = 0) -> list:
  """Standard normal float32 arrays shaped like ``like``."""
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(a.shape).astype(np.float32) for a in like]


def run_placed(fn, like, values) -> np.ndarray:
  """``fn`` on ``values`` placed with the shardings of ``like``."""
  args = [jax.device_put(v, a.sharding) for v, a in zip(values, like)]
  return np.asarray(fn(*args))
