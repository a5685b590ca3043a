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

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tools.zoo.models import (PARTS, SEQUENTIAL, Config, Parallel, Parts, base_name,
                              is_stacked, param_specs, run_stack_in_order, scan_stack)

BUGS = ("stale_input", "cotangent_forward")


def _where(pred, a, b):
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _zeros(tree):
  return jax.tree.map(jnp.zeros_like, tree)


def _per_stage(stage, values, like):
  """What each stage computes with: ``values[s]`` at stage s, zeros where a
  stage has nothing to do (``values[s]`` None), one select per stage."""
  picked = _zeros(like)
  for s, value in enumerate(values):
    if value is not None:
      picked = _where(stage == s, value, picked)
  return picked


def _ring(n: int, shift: int) -> list[tuple[int, int]]:
  return [(i, (i + shift) % n) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class _Model:
  """What a schedule's step computes with: the parameters split into the
  layer stacks and the rest, and the model cut at the stages, on microbatches."""
  stack: dict
  rest: dict
  parts: Parts
  rows: Callable    # (x, m) -> microbatch m's rows of x
  layers: Callable  # (stack, x) -> x after one layer per row of the stack
  head: Callable    # (rest, y, m) -> microbatch m's share of the loss


def _model(model: str, cfg: Config, par: Parallel, names: list[str], microbatches: int,
           tokens, labels, params) -> _Model:
  p = dict(zip(names, params))
  parts = PARTS[model](cfg, par)
  tables = parts.tables(tokens)
  size = tokens.shape[0] // microbatches
  rows = lambda x, m: x[m * size:(m + 1) * size]

  def layers(stack, x):  # (a stage's rows of the layers: scanned as the whole model is)
    by_base = {base_name(k): w for k, w in stack.items()}
    run = scan_stack if cfg.scan_layers else run_stack_in_order
    return run(x, by_base, lambda h, w: parts.layer(h, w, tables))

  def head(rest, y, m):
    return parts.head(y, rows(labels, m), rest) / np.float32(microbatches)

  return _Model(stack={k: w for k, w in p.items() if is_stacked(k)},
                rest={k: w for k, w in p.items() if not is_stacked(k)},
                parts=parts, rows=rows, layers=layers, head=head)


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
    mod = _model(model, cfg, par, names, m_count, tokens, labels, params)
    stack, rest, parts, rows, layers, head = (
        mod.stack, mod.rest, mod.parts, mod.rows, mod.layers, mod.head)
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
      d_y_last = jnp.zeros_like(rows(h0, 0))
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
          ks = [t - 2 * (n - 1 - s) + late for s in range(n)]
          x_saved = _per_stage(stage, [saved[k] if 0 <= k < len(saved) else None for k in ks],
                               d_y)
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


# --------------------------------------------------------------------------
# Interleaved 1F1B (virtual stages).
# --------------------------------------------------------------------------

INTERLEAVED_BUGS = ("depth_first", "chunk_of_step", "backward_chunk_not_reversed")


def _breadth_first(k: int, n: int, v: int) -> tuple[int, int]:
  """(microbatch, chunk) of a stage's k-th unit in Megatron's order: n
  microbatches through chunk 0, the same n through chunk 1, ..., then the
  next n.  A chunk's input for microbatch m then left the last stage exactly
  one step before the first stage needs it, which is why the number of
  microbatches must be a multiple of the number of stages."""
  group, within = divmod(k, n * v)
  return group * n + within % n, within // n


def _depth_first(k: int, n: int, v: int) -> tuple[int, int]:
  """(microbatch, chunk) of the k-th unit, every chunk of a microbatch in
  turn: chunk 1 of microbatch 0 would start before chunk 0's output has come
  round the ring (the seeded bug ``depth_first``)."""
  return k // v, k % v


def interleaved_one_f_one_b_step(model: str, cfg: Config, axis: str, microbatches: int,
                                 bug: str | None = None, indexed: bool = False,
                                 par: Parallel = SEQUENTIAL) -> Callable:
  """``(tokens, labels, *params) -> (loss, grads)`` per device under the
  interleaved 1F1B schedule (Narayanan et al. 2021, Megatron-LM): the layers
  in ``v = cfg.virtual_stages`` chunks, the stacks ``[v, layers // v, ...]``
  split over ``axis`` by their second dim, so stage s holds row s of every
  chunk and a microbatch goes round the ring v times (the last stage sends
  chunk c's output to the first stage's chunk c + 1).

  In lockstep, ``n`` stages and ``M`` microbatches (a multiple of n), stage
  s runs at step t the forward of its unit ``t - s`` and the backward of its
  unit ``t - (v n - 1) - (n - 1 - s)``, units counted in ``_breadth_first``
  order (the backward's with the chunks reversed).  That is Megatron's
  warm-up (``2(n - 1 - s) + (v - 1) n`` forwards before the first backward),
  steady 1F1B and cool-down.  Which microbatch and chunk a stage runs depends
  on the stage, so its input, its saved input and its chunk's weights are
  each picked by a select per stage; ``indexed``: the saved inputs in a buffer
  with a row per unit and the chunk's weights read at a row, both rows
  computed from the stage (``k = t - stage``, ``(k // n) % v``, ...), as a
  program indexing by ``axis_index`` is written.  Seeded bugs:
  ``INTERLEAVED_BUGS``."""
  assert bug is None or bug in INTERLEAVED_BUGS, bug
  assert indexed or bug != "backward_chunk_not_reversed", bug
  assert not (indexed and bug == "chunk_of_step"), bug
  assert cfg.stacked_params and cfg.virtual_stages > 1, cfg
  names = [n for n, _ in param_specs(model, cfg)]
  v, m_count = cfg.virtual_stages, microbatches
  forward_order = _depth_first if bug == "depth_first" else _breadth_first

  def step(tokens, labels, *params):
    n = lax.axis_size(axis)
    assert m_count % n == 0, (m_count, n)
    stage = lax.axis_index(axis)
    mod = _model(model, cfg, par, names, m_count, tokens, labels, params)
    stack, rest, parts, rows, layers, head = (
        mod.stack, mod.rest, mod.parts, mod.rows, mod.layers, mod.head)
    units = m_count * v
    first_backward = v * n - 1
    forward_step = {forward_order(k, n, v): k for k in range(units)}  # + s: when s runs it

    def forward_unit(s, t):
      k = t - s
      return forward_order(k, n, v) if 0 <= k < units else None

    def backward_unit(s, t):
      j = t - first_backward - (n - 1 - s)
      if not 0 <= j < units:
        return None
      m, c = _breadth_first(j, n, v)
      return m, v - 1 - c

    def chunk(c):
      return {k: w[c] for k, w in stack.items()}

    def on(stages):
      return functools.reduce(jnp.logical_or, [stage == s for s in stages])

    def chunk_at(c):
      """The chunk's weights at a row computed from the stage."""
      return {k: lax.dynamic_index_in_dim(w, c, 0, keepdims=False) for k, w in stack.items()}

    def backward_of(j):
      """(chunk, forward unit) of the traced backward unit j."""
      group, within = j // (n * v), j % (n * v)
      c = within // n if bug == "backward_chunk_not_reversed" else v - 1 - within // n
      return c, group * n * v + c * n + within % n

    h0, embed_vjp = jax.vjp(lambda rest: parts.embed(tokens, rest), rest)
    # What the ring brought (nothing, at first): varying over the stages.
    forward = backward = lax.pcast(jnp.zeros_like(rows(h0, 0)), axis, to="varying")
    saved = []                       # the input of each step's forward
    stash = jnp.zeros((units,) + forward.shape, forward.dtype)  # (indexed) by unit
    loss = np.float32(0.0)
    d_rest, d_chunks, d_h0 = _zeros(rest), [_zeros(chunk(0)) for _ in range(v)], {}
    d_y_head = {}                    # the loss's cotangent at each microbatch's output
    on_last = stage == n - 1
    rest_here = lax.pcast(rest, axis, to="varying")   # see one_f_one_b_step
    for t in range(first_backward + units + n - 1):
      ahead = [forward_unit(s, t) for s in range(n)]
      if any(ahead):
        first = ahead[0]
        x = (jnp.where(stage == 0, rows(h0, first[0]), forward)
             if first is not None and first[1] == 0 else forward)
        saved.append(x)
        if indexed:
          k = t - stage
          stash = jnp.where((k >= 0) & (k < units),
                            lax.dynamic_update_index_in_dim(stash, x, k, 0), stash)
          weights = chunk_at(forward_order(k, n, v)[1])
        else:
          chunks = ([u and forward_order(t, n, v)[1] for u in ahead] if bug == "chunk_of_step"
                    else [u and u[1] for u in ahead])
          weights = _per_stage(stage, [u and chunk(c) for u, c in zip(ahead, chunks)], chunk(0))
        y = layers(weights, x)
        forward = lax.ppermute(y, axis, _ring(n, 1))
      else:
        saved.append(None)
      headed = ahead[n - 1]
      if headed is not None and headed[1] == v - 1:   # the last stage's loss
        l, head_vjp = jax.vjp(lambda rest, y: head(rest, y, headed[0]), rest_here, y)
        d_rest_t, d_y_head[headed[0]] = head_vjp(jnp.ones_like(l))
        loss = loss + jnp.where(on_last, l, 0.0)
        d_rest = jax.tree.map(jnp.add, d_rest, _where(on_last, d_rest_t, _zeros(rest)))
      behind = [backward_unit(s, t) for s in range(n)]
      if not any(behind):
        continue
      last = behind[n - 1]
      if last is not None and last[1] == v - 1:    # from the head, at this step or before
        d_y = jnp.where(on_last, d_y_head[last[0]], backward)
      else:
        d_y = backward
      if indexed:
        j = t - first_backward - (n - 1) + stage
        c_back, k_back = backward_of(j)
        x_saved = lax.dynamic_index_in_dim(stash, k_back, 0, keepdims=False)
        weights = chunk_at(c_back)
        running = [(j >= 0) & (j < units) & (c_back == c) for c in range(v)]
      else:
        x_saved = _per_stage(
            stage, [u and saved[forward_step[u] + s] for s, u in enumerate(behind)], d_y)
        weights = _per_stage(stage, [u and chunk(u[1]) for u in behind], chunk(0))
        running = [[s for s, u in enumerate(behind) if u is not None and u[1] == c]
                   for c in range(v)]
        running = [on(stages) if stages else None for stages in running]
      _, stage_vjp = jax.vjp(layers, weights, x_saved)
      d_weights, d_x = stage_vjp(d_y)
      for c in range(v):
        if running[c] is not None:
          d_chunks[c] = jax.tree.map(jnp.add, d_chunks[c],
                                     _where(running[c], d_weights, _zeros(d_weights)))
      if behind[0] is not None and behind[0][1] == 0:
        d_h0[behind[0][0]] = d_x     # stage 0's chunk 0: the embedding's cotangent
      backward = lax.ppermute(d_x, axis, _ring(n, -1))
    d_h0 = jnp.concatenate([d_h0[m] for m in range(m_count)], axis=0)
    (d_embed,) = embed_vjp(lax.psum(jnp.where(stage == 0, d_h0, 0.0), axis))
    d_rest = jax.tree.map(jnp.add, lax.psum(d_rest, axis), d_embed)
    d_stack = {k: jnp.stack([d[k] for d in d_chunks]) for k in stack}
    grads = {**d_rest, **d_stack}
    return lax.psum(loss, axis), tuple(grads[k] for k in names)

  return step
