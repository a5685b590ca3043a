"""One optimizer step as users write it: optax's ``clip_by_global_norm`` then
``adamw``, on top of ``value_and_grad`` of the loss.

The sequential step is plain optax.  Under ``shard_map`` the gradients are
tiles, so the global norm must be rebuilt: each rank sums the squares of what
it holds, the sums of the tensors split over some axes are psum'd over those
axes, and the replicated tensors' sums are added once.  Optax's own
``clip_by_global_norm`` inside shard_map norms only the local tiles (the
seeded bug ``norm_of_local_tiles``); psum'ing every sum over the split axes
counts each replicated tensor once per rank (``norm_counts_replicas``), the
mistake Megatron's ``clip_grad_norm`` guards against with its "not a tensor
parallel duplicate" filter.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

MAX_GRAD_NORM = np.float32(1.0)
LEARNING_RATE = np.float32(1e-3)
WEIGHT_DECAY = np.float32(1e-2)


def clip_by_sharded_global_norm(max_norm, split: Sequence[tuple[str, ...]],
                                count_replicas: bool = False) -> optax.GradientTransformation:
  """optax's ``clip_by_global_norm`` for gradients held as tiles: ``split[i]``
  names the mesh axes leaf ``i`` is split over (empty: replicated).  The clip
  itself is optax's, leaf by leaf, with the global norm."""

  def update_fn(updates, state, params=None):
    del params
    leaves, tree = jax.tree.flatten(updates)
    by_axes: dict[tuple[str, ...], jax.Array] = {}
    for leaf, axes in zip(leaves, split):
      axes = axes or (tuple(sorted({a for s in split for a in s})) if count_replicas else ())
      square_sum = jnp.sum(jnp.square(leaf))
      by_axes[axes] = by_axes[axes] + square_sum if axes in by_axes else square_sum
    total = sum(lax.psum(s, axes) if axes else s for axes, s in by_axes.items())
    g_norm = jnp.sqrt(total)
    trigger = jnp.squeeze(g_norm < max_norm)

    def clip(t):
      return lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

    return jax.tree.unflatten(tree, [clip(t) for t in leaves]), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def optimizer(clip: optax.GradientTransformation | None = None) -> optax.GradientTransformation:
  return optax.chain(clip or optax.clip_by_global_norm(MAX_GRAD_NORM),
                     optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY))


@dataclasses.dataclass(frozen=True)
class StateLeaves:
  """The optimizer state for some parameters, as flat arguments."""
  leaves: list          # shape structs
  tree: object          # to unflatten them
  owners: list          # each leaf's parameter index (None: a scalar, Adam's count)
  second_moments: list  # positions of Adam's ``nu`` leaves


def state_leaves(tx: optax.GradientTransformation, param_shapes) -> StateLeaves:
  shapes = tuple(jax.ShapeDtypeStruct(s, d) for s, d in param_shapes)
  paths, tree = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, shapes))
  owners, second = [], []
  for i, (path, _) in enumerate(paths):
    names = [getattr(k, "name", None) for k in path]
    # mu / nu are tuples like the params: the key after the name is the parameter.
    moment = next((j for j, n in enumerate(names) if n in ("mu", "nu")), None)
    owners.append(None if moment is None else path[moment + 1].idx)
    if moment is not None and names[moment] == "nu":
      second.append(i)
  return StateLeaves([leaf for _, leaf in paths], tree, owners, second)


def train_step(value_and_grad: Callable, tx: optax.GradientTransformation, n_params: int,
               state_tree) -> Callable:
  """``(tokens, labels, *params, *state leaves) -> (loss, new params, new state
  leaves)`` after one step of ``tx``."""

  def step(tokens, labels, *args):
    params, leaves = tuple(args[:n_params]), args[n_params:]
    loss, grads = value_and_grad(tokens, labels, *params)
    updates, new_state = tx.update(grads, jax.tree.unflatten(state_tree, leaves), params)
    return loss, optax.apply_updates(params, updates), tuple(jax.tree.leaves(new_state))

  return step
