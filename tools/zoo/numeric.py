"""Run both sides of a zoo case on the same concrete inputs.

This is the ground truth the static checker is measured against: a correct
case must agree numerically, and a seeded bug must visibly disagree (otherwise
it is no bug at all, just a different but equivalent program).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np

from tools.zoo.cases import Case


def random_inputs(case: Case, seed: int = 0) -> list[np.ndarray]:
  """Global inputs drawn from N(0, 0.5^2): small enough that tanh, softmax
  and the norms stay out of saturation, where bugs could hide."""
  rng = np.random.default_rng(seed)
  drawn = [(0.5 * rng.standard_normal(a.shape)).astype(a.dtype) for a in case.seq_args]
  return [np.abs(x) if i in case.nonnegative_args else x for i, x in enumerate(drawn)]


def _jit_dist(case: Case):
  if case.style == "gspmd":
    return jax.jit(case.dist_fn, in_shardings=case.in_shardings,
                   out_shardings=case.out_shardings)
  return jax.jit(case.dist_fn)


def run_both(case: Case, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(sequential output, distributed output) as numpy arrays of global shape."""
  inputs = random_inputs(case, seed)
  seq_out = jax.jit(case.seq_fn)(*inputs)
  if case.dist_edit is not None:  # a GSPMD bug: XLA's module edited, run by the interpreter
    from tools.zoo.partitioner_bugs import run_partitioned
    return np.asarray(seq_out), np.asarray(run_partitioned(case, inputs))
  dist_out = _jit_dist(case)(*case.dist_inputs(inputs))
  return np.asarray(seq_out), np.asarray(dist_out)


def outputs_match(case: Case, seed: int = 0, rtol: Optional[float] = None,
                  atol: Optional[float] = None) -> bool:
  rtol = case.tolerance if rtol is None else rtol
  atol = case.tolerance if atol is None else atol
  seq_out, dist_out = run_both(case, seed)
  return (seq_out.shape == dist_out.shape
          and bool(np.allclose(seq_out, dist_out, rtol=rtol, atol=atol)))


def run_per_device(case: Case, inputs: Sequence) -> tuple[list[list], list[list]]:
  """The distributed program as written, run on the sequential program's
  global ``inputs``: (each input's shards, each output's values), listed by
  partition.  XLA compiles and runs it; a GSPMD bug's edited module is run by
  the reference interpreter, as ``run_both`` does."""
  inputs = [np.asarray(x).astype(a.dtype) for x, a in zip(inputs, case.seq_args)]
  if case.dist_edit is not None:
    from tools.zoo.partitioner_bugs import run_partitioned_per_rank
    return run_partitioned_per_rank(case, case.dist_inputs(inputs))
  # Partition k runs on the mesh's k-th device: the device assignment jit
  # takes from the shardings' mesh, and the rank shard_map's axis_index reads.
  partition = {d: k for k, d in enumerate(case.mesh.devices.flat)}
  args = case.dist_inputs(inputs)
  outs = jax.tree.leaves(_jit_dist(case)(*args))
  return [_by_partition(a, partition) for a in args], [_by_partition(o, partition) for o in outs]


def _by_partition(array: jax.Array, partition: dict) -> list[np.ndarray]:
  shards = sorted(array.addressable_shards, key=lambda s: partition[s.device])
  assert [partition[s.device] for s in shards] == list(range(len(partition))), \
      "an array not on every device of the mesh"
  return [np.asarray(s.data) for s in shards]
