"""A training step under the 1F1B pipeline schedule, written by hand inside shard_map.

GPipe runs every microbatch forward, then every one backward; jax's autodiff
of the forward schedule writes that backward.  1F1B (PipeDream-Flush,
Megatron's default) starts a microbatch's backward as soon as its loss is
known, so a stage holds at most ``n - s`` microbatches' activations instead
of all of them.  Autodiff cannot write that interleaving: the step calls
``jax.vjp`` per stage and per microbatch, and carries the cotangents round
the ring itself.

In lockstep, ``n`` stages over mesh axis ``axis`` and ``M`` microbatches, at
step t stage s runs

* the forward of microbatch ``t - s`` (stage 0 takes it from the embedded
  batch; the last stage computes its loss and the head's gradient at once);
* the backward of microbatch ``t - 2(n - 1) + s``: the vjp of its layers at
  the input it saved ``2(n - 1 - s)`` steps earlier, applied to the
  cotangent the next stage sent (the last stage: the head's).

The embedding runs on every stage (it is cheap and replicated); its gradient
is taken once stage 0 has the cotangents of every microbatch.  The head's
and the layers' gradients are summed over the microbatches each stage saw.

Seeded bugs: ``stale_input`` (stage s recomputes from the input it saved one
step late: the next microbatch's), ``cotangent_forward`` (the cotangents
sent on round the forward ring, r -> r + 1, instead of back).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tools.zoo.models import (PARTS, SEQUENTIAL, Config, Parallel, base_name, is_stacked,
                              param_specs, run_stack_in_order)

BUGS = ("stale_input", "cotangent_forward")


def _where(pred, a, b):
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _zeros(tree):
  return jax.tree.map(jnp.zeros_like, tree)


def _ring(n: int, shift: int) -> list[tuple[int, int]]:
  return [(i, (i + shift) % n) for i in range(n)]


def one_f_one_b_step(model: str, cfg: Config, axis: str, microbatches: int,
                     bug: str | None = None, buffered: bool = False,
                     par: Parallel = SEQUENTIAL) -> Callable:
  """``(tokens, labels, *params) -> (loss, grads)`` per device: the stacked
  layers split over ``axis`` by rows (``cfg.stacked_params``), everything else
  replicated.  A stage keeps its inputs for the backward in a list of steps,
  picking the one its schedule needs with a select per stage; ``buffered``:
  in a buffer with a row per microbatch, written and read at rows that depend
  on the stage (``dynamic_update_slice`` / ``dynamic_slice``).  ``par``: the
  hooks inside each stage (Megatron TP over another mesh axis)."""
  assert bug is None or bug in BUGS, bug
  names = [n for n, _ in param_specs(model, cfg)]
  m_count = microbatches

  def step(tokens, labels, *params):
    n = lax.axis_size(axis)
    stage = lax.axis_index(axis)
    p = dict(zip(names, params))
    stack = {k: v for k, v in p.items() if is_stacked(k)}
    rest = {k: v for k, v in p.items() if not is_stacked(k)}
    parts = PARTS[model](cfg, par)
    tables = parts.tables(tokens)
    size = tokens.shape[0] // m_count
    rows = lambda x, m: x[m * size:(m + 1) * size]

    def layers(stack, x):
      by_base = {base_name(k): v for k, v in stack.items()}
      return run_stack_in_order(x, by_base, lambda h, w: parts.layer(h, w, tables))

    def head(rest, y, m):
      return parts.head(y, rows(labels, m), rest) / np.float32(m_count)

    h0, embed_vjp = jax.vjp(lambda rest: parts.embed(tokens, rest), rest)
    forward = backward = jnp.zeros_like(rows(h0, 0))
    saved = []                       # the input of each step's forward
    stash = jnp.zeros((m_count,) + forward.shape, forward.dtype)  # (buffered) by microbatch
    loss = np.float32(0.0)
    d_rest, d_stack, d_h0 = _zeros(rest), _zeros(stack), []
    on_last = stage == n - 1
    # The head's gradient is the last stage's alone: differentiated at a value
    # varying over the stages (at the replicated one, jax's vjp would psum it).
    rest_here = lax.pcast(rest, axis, to="varying")
    late = 1 if bug == "stale_input" else 0
    for t in range(m_count + 2 * (n - 1)):
      if t < m_count + n - 1:          # the forward of microbatch t - stage
        x = jnp.where(stage == 0, rows(h0, t), forward) if t < m_count else forward
        saved.append(x)
        f = t - stage
        stash = jnp.where((f >= 0) & (f < m_count),
                          lax.dynamic_update_index_in_dim(stash, x, f, 0), stash)
        y = layers(stack, x)
        if t < m_count + n - 2:
          forward = lax.ppermute(y, axis, _ring(n, 1))
      d_y_last = jnp.zeros_like(h0[:size])
      if 0 <= t - (n - 1) < m_count:   # the last stage's loss for microbatch t - (n - 1)
        l, head_vjp = jax.vjp(lambda rest, y: head(rest, y, t - (n - 1)), rest_here, y)
        d_rest_t, d_y_last = head_vjp(jnp.ones_like(l))
        loss = loss + jnp.where(on_last, l, 0.0)
        d_rest = jax.tree.map(jnp.add, d_rest, _where(on_last, d_rest_t, _zeros(rest)))
      if t >= n - 1:                   # the backward of microbatch t - 2(n - 1) + stage
        d_y = jnp.where(on_last, d_y_last, backward)
        b = t - 2 * (n - 1) + stage
        if buffered:
          x_saved = lax.dynamic_index_in_dim(stash, b + late, 0, keepdims=False)
        else:
          x_saved = jnp.zeros_like(d_y)
          for s in range(n):
            k = t - 2 * (n - 1 - s) + late
            if 0 <= k < len(saved):
              x_saved = jnp.where(stage == s, saved[k], x_saved)
        _, stage_vjp = jax.vjp(layers, stack, x_saved)
        d_stack_t, d_x = stage_vjp(d_y)
        running = (b >= 0) & (b < m_count)
        d_stack = jax.tree.map(jnp.add, d_stack, _where(running, d_stack_t, _zeros(stack)))
        if 0 <= t - 2 * (n - 1) < m_count:
          d_h0.append(d_x)             # stage 0's: microbatch t - 2(n - 1)
        if t < m_count + 2 * (n - 1) - 1:
          backward = lax.ppermute(d_x, axis, _ring(n, 1 if bug == "cotangent_forward" else -1))
    d_h0 = lax.psum(jnp.where(stage == 0, jnp.concatenate(d_h0, axis=0), 0.0), axis)
    (d_embed,) = embed_vjp(d_h0)
    d_rest = jax.tree.map(jnp.add, lax.psum(d_rest, axis), d_embed)
    grads = {**d_rest, **d_stack}
    return lax.psum(loss, axis), tuple(grads[k] for k in names)

  return step
