"""ZeRO stages 1 and 2 (Rajbhandari et al.): data parallelism with the
optimizer's state, and its update, sharded over the data-parallel ranks.

Every rank holds the whole parameters and computes the gradients of its own
batch.  Instead of all-reducing them, it reduce-scatters them (``psum_scatter``,
divided by the rank count: the mean), so each rank holds the mean gradient of
one tile of each parameter; it updates that tile of the parameter with that
tile of Adam's moments, which are all it keeps, and all-gathers the updated
tiles into the whole parameters again.  The global norm for gradient clipping
is rebuilt from the tiles (``training.clip_by_sharded_global_norm``).

A parameter is tiled along its first dim the rank count divides (``shard_dims``);
one with no such dim is updated whole on every rank, from the all-reduced mean.

The step runs under ``shard_map(..., check_vma=False)``: jax's varying-axes
types call an all-gather's result varying, so the whole parameters it returns
could not be declared replicated (``out_specs`` ``P()``) with the check on.
With it off, the gradients of the replicated parameters are each rank's own,
as the reduce-scatter wants them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np
import optax
from jax import lax


def shard_dims(shapes: Sequence[tuple], n: int) -> list[Optional[int]]:
  """The dim each parameter is tiled along over ``n`` ranks (None: kept whole)."""
  return [next((d for d, size in enumerate(s) if size % n == 0), None) for s in shapes]


def zero_step(local_value_and_grad: Callable, tx: optax.GradientTransformation,
              n_params: int, state_tree, dims: Sequence[Optional[int]], axis: str,
              divide: bool = True, tile_shift: int = 0) -> Callable:
  """Per device: ``(tokens, labels, *params, *state tiles) -> (loss, new params,
  new state tiles)``.  ``local_value_and_grad``: of this rank's mean loss, in
  every parameter.  Seeded bugs: ``divide=False`` sums the gradients where the
  mean belongs; ``tile_shift`` updates tile ``r + shift`` of each parameter
  with rank ``r``'s gradient and moments."""

  def step(tokens, labels, *args):
    params, leaves = tuple(args[:n_params]), args[n_params:]
    n = lax.axis_size(axis)
    loss, grads = local_value_and_grad(tokens, labels, *params)
    scale = np.float32(n if divide else 1)
    r = (lax.axis_index(axis) + tile_shift) % n

    def tile(x, d):
      size = x.shape[d] // n
      return lax.dynamic_slice_in_dim(x, r * size, size, d)

    grad_tiles = tuple(
        lax.pmean(g, axis) if d is None
        else lax.psum_scatter(g, axis, scatter_dimension=d, tiled=True) / scale
        for g, d in zip(grads, dims))
    param_tiles = tuple(p if d is None else tile(p, d) for p, d in zip(params, dims))
    updates, state = tx.update(grad_tiles, jax.tree.unflatten(state_tree, leaves),
                               param_tiles)
    new_tiles = optax.apply_updates(param_tiles, updates)
    new_params = tuple(t if d is None else lax.all_gather(t, axis, axis=d, tiled=True)
                       for t, d in zip(new_tiles, dims))
    return lax.pmean(loss, axis), new_params, tuple(jax.tree.leaves(state))

  return step
