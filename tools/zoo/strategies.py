"""Parallelisation strategies for the zoo's language models (``models.py``).

``model_cases()`` returns ``Case``s named ``<model>/<strategy>/<style>/<variant>``:

  * ``dp``: batch over "dp" (4 devices, batch 4), parameters replicated, the
    loss a ``pmean`` of the local means.
  * ``tp``: Megatron tensor parallelism over "tp" (4 devices): q (and for
    GPT-2 k, v) projections and the MLP's first matmul(s) column-parallel, the
    attention output projection and the MLP's last matmul row-parallel, each
    followed by a ``psum``.  Embeddings, norms and the output head are
    replicated.  Llama's kv heads (2) are fewer than the ranks (4), so
    ``wk``/``wv`` are replicated, every rank repeats the kv heads to one per q
    head exactly as the sequential program does, and slices out its own
    (``dynamic_slice`` at ``axis_index("tp") * heads_per_rank``).
  * ``sp``: sequence parallelism + TP on "tp" (Korthikanti et al.): tokens,
    labels and the residual stream sharded over the sequence; ``all_gather``
    of the normed activations before attention and the MLP, ``psum_scatter``
    over the sequence after the row-parallel matmuls.  GPT-2's ``wpe`` is
    sharded with the tokens; Llama's positions are computed for the local
    tokens (local iota + ``axis_index * shard_len``) and gathered.
  * ``dp_tp``: ``tp`` on "tp" of a 2x4 ("dp", "tp") mesh with the batch over
    "dp".
  * ``cp``: context parallelism on "cp" (4 devices) with all-gathered keys and
    values, as Llama 3 was trained: tokens, labels and every activation stay
    sharded over the sequence; each layer gathers k and v (after RoPE at the
    rank's own positions) and masks its queries at their offset
    (``iota + axis_index * shard_len``).  GPT-2's ``wpe`` goes with its tokens.
  * ``dp_tp_cp``: a 2x2x2 ("dp", "tp", "cp") mesh: the batch over "dp", the
    sequence over "cp", Megatron TP on "tp"; the loss a pmean over dp and cp.

  * ``cp_ring``: ``cp`` with k and v passed round a ring of ``ppermute``s
    into a buffer (each block written at its place) instead of all-gathered.
  * ``ring_attention``: ``cp`` with ring attention (Liu et al.): k/v blocks go
    round the ring and each step folds its block of scores into an online
    softmax (running max, denominator, output, rescaled by exp(m - m')).
    Both shard_map only (the ring is the hand-written part); ``cp_ring``
    also forward+backward (its gather transposes to a ring reduce-scatter).

  * ``cp_ulysses``: ``cp`` with DeepSpeed-Ulysses' attention: q, k, v
    all-to-all'd from a split by positions to a split by heads, attention of
    each rank's heads over the whole sequence, and back.  shard_map only.

  * ``cp_ring_fori``, ``ring_attention_fori``, ``ring_attention_vjp_fori``:
    the same with each ring's steps under ``lax.fori_loop``, as ring attention
    libraries write it.

  * ``dp_tp_ring_attention``: ``dp_tp_cp`` with ring attention round "cp".

  * ``cp_zigzag``: load-balanced ``cp`` (Megatron, Llama 3): every rank cuts
    its zig-zag chunks r and 2n-1-r out of the whole batch; ``cp_zigzag_ring``
    passes k/v round a ring instead of gathering them, and
    ``cp_zigzag_ring_attention`` (also ``_fori``) folds each block into an
    online softmax, its mask read off both blocks' positions;
    ``cp_zigzag_ring_attention_vjp`` (also ``_fori``) adds its backward written
    by hand, dk and dv carried round the ring with their blocks.

  * ``pp``: pipeline parallelism on "pp" (4 stages): 8 layers with stacked
    parameters split over the stages by layer, two per stage; the stages
    unrolled, each round every stage runs its layers and ``ppermute``s the
    result to the next; a masked ``psum`` hands the last stage's output to all.
    No microbatches, forward only, shard_map only.  (``pp_gpipe`` also exists
    under GSPMD, in MaxText's form: ``_gspmd_gpipe_stages``.)

Every correct strategy (but ``pp``) exists as ``shard_map`` (hand-written collectives) and
as ``gspmd`` (the sequential function jitted with in/out shardings), and
``<model>/<strategy>_grad/gspmd/ok`` is ``jax.value_and_grad`` of the loss with
respect to every parameter, returning ``(loss, (grad, ...))`` with each
gradient sharded like its parameter.  NB: that output is a tuple, which
``numeric.run_both`` (``np.asarray`` of the output) cannot hold; use
``run_both`` here, or ``model_cases(grad=False)``.

Seeded bugs; ``bug_primitive`` follows ``cases.py``: the jax primitive of the
first sequential op whose value the buggy program no longer computes in any
sharded form, or ``"output"``.  A GSPMD program's collectives are XLA's, so
its bugs are edits of XLA's per-device module (``partitioner_bugs.py``): an
all-reduce dropped or given another axis's replica groups, a table of tile
offsets rotated.

Token ids are int32.  ``numeric.random_inputs`` draws them as truncated
gaussians (mostly 0); ``model_inputs`` draws them uniformly from the
vocabulary, which is the better ground truth.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from tools.zoo import one_f_one_b, partitioner_bugs, training, zero
from tools.zoo.cases import Case, mesh_of
from tools.zoo.models import (MODELS, SEQUENTIAL, Config, Parallel, arg_shapes, base_name,
                              causal_attention, is_stacked, loss_fn, param_specs, repeat_kv,
                              run_stack_in_order, scan_stack, slots_per_group)


# --------------------------------------------------------------------------
# Hooks.
# --------------------------------------------------------------------------


def _psum(axis):
  return lambda x: lax.psum(x, axis)


def _identity(x):
  return x


def _pmean_of_mean(axis):
  return lambda nll: lax.pmean(jnp.mean(nll), axis)


def _psum_of_mean(axis):
  """The bug: sum of the local means is ``n`` times the global mean."""
  return lambda nll: lax.psum(jnp.mean(nll), axis)


def _slice_heads(axis):
  def local_heads(x, n_local):
    start = lax.axis_index(axis) * n_local
    # The start is never negative: skip jax's wrap-around select.
    return lax.dynamic_slice_in_dim(x, start, n_local, axis=2,
                                    allow_negative_indices=False)
  return local_heads


def _tile_kv(x, groups):
  """The bug: kv heads tiled (q head h reads kv head h % kv_heads), the
  ``torch.Tensor.repeat`` vs ``repeat_interleave`` mix-up."""
  return jnp.tile(x, (1, 1, groups, 1))


def _gather_seq(axis_name):
  def gather(x, axis=1):
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)
  return gather


def _scatter_seq(axis_name):
  return lambda x: lax.psum_scatter(x, axis_name, scatter_dimension=1,
                                    tiled=True)


def _sharded_positions(axis_name, with_offset=True):
  def positions(n):
    pos = jnp.arange(n, dtype=jnp.float32)
    if with_offset:
      pos = pos + (lax.axis_index(axis_name) * n).astype(jnp.float32)
    return pos
  return positions


def _offset_causal_mask(axis_name, with_offset=True):
  """The causal mask of this device's queries (rows ``r * sq ...``) against
  every key: without the offset each rank masks as if its queries came first."""
  def mask(sq, sk):
    rows = lax.broadcasted_iota(jnp.int32, (sq, sk), 0)
    if with_offset:
      rows = rows + lax.axis_index(axis_name) * sq
    return rows >= lax.broadcasted_iota(jnp.int32, (sq, sk), 1)
  return mask


def _ring_perm(n, shift=1):
  """ppermute pairs passing each rank's block (or stage output) to rank r + shift mod n."""
  return [(i, (i + shift) % n) for i in range(n)]


def _ring_gather_seq(axis_name, shift=1, fori=False):
  """Keys and values gathered round a ring of ``ppermute``s (the exchange of
  ring attention, which overlaps it with compute): each step writes the block
  in hand at its place, ``(r - t) mod n``, then passes it on to rank r + 1.
  ``shift=-1`` is the bug: blocks go to rank r - 1 while the offsets assume
  they came from it.  ``fori``: the steps under ``lax.fori_loop`` (every step
  passes its block on)."""
  def gather(x, axis=1):
    n = lax.axis_size(axis_name)
    r = lax.axis_index(axis_name)
    block = x.shape[axis]
    buf = jnp.zeros(x.shape[:axis] + (n * block,) + x.shape[axis + 1:], x.dtype)

    def step(t, carry, pass_on=True):
      x, buf = carry
      buf = lax.dynamic_update_slice_in_dim(buf, x, ((r - t) % n) * block, axis)
      return (lax.ppermute(x, axis_name, _ring_perm(n, shift)) if pass_on else x), buf

    if fori:
      return lax.fori_loop(0, n, step, _varying_like(x, (x, buf)))[1]
    carry = (x, buf)
    for t in range(n):
      carry = step(t, carry, pass_on=t < n - 1)
    return carry[1]
  return gather


def _block_mask(s, r, n, t):
  """Causal mask of rank r's queries against the key block it holds at ring
  step t, block (r - t) mod n."""
  rows = jnp.arange(s, dtype=jnp.int32) + r * s
  cols = jnp.arange(s, dtype=jnp.int32) + ((r - t) % n) * s
  return rows[:, None] >= cols[None, :]


def _block_scores(q, k, mask, mask_value=-1e9):
  """Scaled scores of this rank's queries against a key block, masked."""
  scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.float32(np.sqrt(q.shape[-1]))
  return jnp.where(mask, scores, np.float32(mask_value))


def _varying_like(x, carry):
  """``carry`` typed as varying over the mesh axes ``x`` varies over: a loop's
  carry keeps one type, and the accumulators become per-rank values."""
  axes = _varying_axes(x)
  return tuple(lax.pcast(c, axes, to="varying") if set(axes) - set(_varying_axes(c)) else c
               for c in carry)


def _varying_axes(x) -> tuple:
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)   # (jax 0.10; ``vma`` before)
  return tuple(mat.varying if mat is not None else aval.vma)


def _zigzag_block_mask(s, r, n, t):
  """Causal mask of rank r's zig-zag queries (its chunks r and 2n-1-r) against
  the key block it holds at ring step t, rank (r - t) mod n's chunks: by
  their positions, cut from the sequence's as the tokens were."""
  whole = jnp.arange(n * s, dtype=jnp.int32)
  return (_zigzag_chunks_of(whole, r, n, 0)[:, None]
          >= _zigzag_chunks_of(whole, (r - t) % n, n, 0)[None, :])


def _online_softmax_ring(q, k, v, axis_name, shift=1, rescale_output=True, ring_axis=None,
                         fori=False, block_mask=_block_mask, mask_value=-1e9,
                         passed_first=False):
  """Causal attention of this rank's queries round a ring of k/v blocks:
  (out [b, h, s, hd], row max m, denominator l).  ``fori``: the steps as a
  ``lax.fori_loop`` whose every step passes its block on (the last one brings
  each block home), as ring attention libraries write it; else a Python loop,
  the last step keeping its block.  ``block_mask(s, r, n, t)``: the mask of
  the block in hand at step t (contiguous shards, or zig-zag chunks).
  ``passed_first``: the blocks passed on once before the first step, so rank
  r starts on block r - 1 (rank 0 on the last, which it masks wholly)."""
  ring_axis = ring_axis or axis_name
  b, s, h, hd = q.shape
  n = lax.axis_size(axis_name)
  r = lax.axis_index(axis_name)
  perm = _ring_perm(n, shift)
  if passed_first:
    k, v = lax.ppermute(k, ring_axis, perm), lax.ppermute(v, ring_axis, perm)

  def step(t, carry, pass_on=True):
    k, v, m, l, o = carry
    held = t + 1 if passed_first else t  # the block's step count from home
    scores = _block_scores(q, k, block_mask(s, r, n, held), mask_value)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    rescale = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    l = rescale * l + jnp.sum(p, axis=-1)
    kept = rescale[..., None] * o if rescale_output else o
    o = kept + jnp.einsum("bhst,bthd->bhsd", p, v)
    if pass_on:
      k, v = lax.ppermute(k, ring_axis, perm), lax.ppermute(v, ring_axis, perm)
    return k, v, m_new, l, o

  carry = (k, v, jnp.full((b, h, s), -jnp.inf, jnp.float32),
           jnp.zeros((b, h, s), jnp.float32), jnp.zeros((b, h, s, hd), jnp.float32))
  if fori:
    carry = lax.fori_loop(0, n, step, _varying_like(q, carry))
  else:
    for t in range(n):
      carry = step(t, carry, pass_on=t < n - 1)
  _, _, m, l, o = carry
  return o / l[..., None], m, l


def _merge_heads(out):
  """[b, h, s, hd] -> [b, s, h * hd]."""
  b, h, s, hd = out.shape
  return out.transpose(0, 2, 1, 3).reshape(b, s, h * hd)


def _ring_attention(axis_name, shift=1, rescale_output=True, ring_axis=None, fori=False,
                    block_mask=_block_mask, mask_value=-1e9, passed_first=False):
  """Ring attention (Liu et al.) for causal attention: k/v blocks go round
  the ring; each step scores this rank's queries against the block in hand,
  masked at both blocks' offsets, and folds it into an online softmax (running
  row max m, denominator l, output o, rescaled by exp(m - m_new)).
  ``shift=-1`` is the bug: blocks go to rank r - 1 while the masks assume they
  came from it.  ``rescale_output=False``, the other: o is not rescaled when
  the running max grows (l is), so earlier blocks keep too large a weight.
  ``ring_axis`` (default ``axis_name``): the axis the blocks go round; another
  one is the wrong-axis bug.  ``fori``: the ring's steps under ``lax.fori_loop``.
  ``mask_value`` -inf with ``passed_first``: the bug of a NaN, rank 0's rows
  masked wholly at the first step (``exp(-inf + inf)``)."""
  def attend(q, k, v):
    out, _, _ = _online_softmax_ring(q, k, v, axis_name, shift, rescale_output, ring_axis,
                                     fori, block_mask, mask_value, passed_first)
    return _merge_heads(out)
  return attend


def _ring_attention_vjp(axis_name, grad_shift=1, lse_log=True, fori=False,
                        block_mask=_block_mask):
  """Ring attention with its backward pass written by hand, as ring attention
  libraries do (a ``custom_vjp``; the blockwise backward of Liu et al., flash
  attention's recurrence): the forward is ``_ring_attention``'s and saves each
  row's log-sum-exp ``lse = m + log l``; the backward goes round the ring
  again, recomputes each block's probabilities ``p = exp(s - lse)`` and
  carries the keys' and values' gradients round with their blocks:

      D = rowsum(dout * out);  dv += p^T dout;  ds = p * (dout v^T - D)
      dq += ds k;  dk += ds^T q     (ds masked and scaled like the scores)

  n steps and n exchanges, so each block's gradient comes home.

  ``grad_shift=-1`` is a bug: dk and dv go round the ring the other way from
  their blocks, so each rank's sum mixes other blocks' gradients.
  ``lse_log=False``, another: ``lse = m + l`` (the log forgotten), so the
  recomputed probabilities are not the forward's.  ``fori``: both rings'
  steps under ``lax.fori_loop``.  ``block_mask``: as ``_online_softmax_ring``'s."""
  def forward(q, k, v):
    out, m, l = _online_softmax_ring(q, k, v, axis_name, fori=fori, block_mask=block_mask)
    return _merge_heads(out), (q, k, v, out, m + (jnp.log(l) if lse_log else l))

  def backward(res, dout):
    q, k, v, out, lse = res
    b, s, h, hd = q.shape
    n = lax.axis_size(axis_name)
    r = lax.axis_index(axis_name)
    scale = np.float32(np.sqrt(hd))
    perm = _ring_perm(n)
    dout = dout.reshape(b, s, h, hd).transpose(0, 2, 1, 3)          # [b, h, s, hd]
    d = jnp.sum(dout * out, axis=-1)                                 # [b, h, s]

    def step(t, carry):
      k, v, dq, dk, dv = carry
      mask = block_mask(s, r, n, t)
      p = jnp.exp(_block_scores(q, k, mask) - lse[..., None])
      dv = dv + jnp.einsum("bhst,bhsd->bthd", p, dout)
      dp = jnp.einsum("bhsd,bthd->bhst", dout, v)
      ds = jnp.where(mask, p * (dp - d[..., None]), 0.0) / scale
      dq = dq + jnp.einsum("bhst,bthd->bshd", ds, k)
      dk = dk + jnp.einsum("bhst,bshd->bthd", ds, q)
      k, v = (lax.ppermute(x, axis_name, perm) for x in (k, v))
      dk, dv = (lax.ppermute(x, axis_name, _ring_perm(n, grad_shift)) for x in (dk, dv))
      return k, v, dq, dk, dv

    carry = (k, v, jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    if fori:
      carry = lax.fori_loop(0, n, step, _varying_like(q, carry))
    else:
      for t in range(n):
        carry = step(t, carry)
    return carry[2:]

  attend = jax.custom_vjp(lambda q, k, v: forward(q, k, v)[0])
  attend.defvjp(forward, backward)
  return attend


def _ring_attention_par(shift=1, rescale_output=True, fori=False, **masking):
  """``cp`` with ring attention instead of gathered k/v (``masking``:
  ``mask_value``, ``passed_first``, as ``_ring_attention`` takes them)."""
  return dataclasses.replace(_cp_par(), attend=_ring_attention("cp", shift, rescale_output,
                                                               fori=fori, **masking))


def _ring_attention_vjp_par(**bug):
  """``cp`` with ring attention and its hand-written ring backward."""
  return dataclasses.replace(_cp_par(), attend=_ring_attention_vjp("cp", **bug))


def _dp_tp_ring_attention_vjp_par(fori=False):
  """``dp_tp_cp`` with ring attention round "cp" and its hand-written backward."""
  return dataclasses.replace(_dp_tp_cp_par(), attend=_ring_attention_vjp("cp", fori=fori))


def _dp_tp_ring_attention_par(ring_axis="cp", fori=False):
  """``dp_tp_cp`` with ring attention round "cp" (each rank's tp heads)."""
  return dataclasses.replace(_dp_tp_cp_par(),
                             attend=_ring_attention("cp", ring_axis=ring_axis, fori=fori))


def _ulysses_attention(axis, split_dim=2):
  """DeepSpeed-Ulysses: q, k, v [b, s/n, h, hd] all-to-all'd over ``axis``
  to [b, s, h/n, hd] (each rank every position of its heads), causal
  attention of those heads, its output all-to-all'd back to [b, s/n, h * hd].
  ``split_dim``: the dim the exchange splits, the heads (3, the head dim, is
  the seeded bug: each rank's scores a partial sum over the head dim)."""
  def attend(q, k, v):
    to_heads = lambda x: lax.all_to_all(x, axis, split_dim, 1, tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    b, s = q.shape[:2]
    o = causal_attention(q, k, v).reshape(q.shape)
    o = lax.all_to_all(o, axis, 1, split_dim, tiled=True)
    return o.reshape(b, s // lax.axis_size(axis), -1)
  return attend


def _ulysses_par(split_dim=2):
  """``cp`` with Ulysses' all-to-alls round the attention instead of gathered k/v."""
  return dataclasses.replace(_cp_par(), attend=_ulysses_attention("cp", split_dim))


def _ring_par(shift=1, fori=False):
  """``cp`` with keys and values passed round a ring instead of all-gathered."""
  return dataclasses.replace(_cp_par(), gather_kv=_ring_gather_seq("cp", shift, fori))


def _cp_par(base=None, loss_axes=("cp",), gather_axis="cp", with_offset=True):
  """Context parallelism on "cp" with all-gathered keys and values (as Llama 3
  was trained): activations stay sharded over the sequence; attention gathers
  k and v (after RoPE, which each rank applies at its own positions) and masks
  its queries at their offset.  ``base``: hooks of other axes (TP) to keep."""
  return dataclasses.replace(
      base or Parallel(), gather_kv=_gather_seq(gather_axis),
      causal_mask=_offset_causal_mask("cp", with_offset),
      positions=_sharded_positions("cp"),
      combine_loss=_pmean_of_mean(loss_axes if len(loss_axes) > 1 else loss_axes[0]))


def _zigzag_chunks(x, axis_name, dim=1):
  """Rank r's chunks r and 2n-1-r of the 2n chunks of ``x``'s ``dim``
  (load-balanced context parallelism: Megatron's ``get_batch_on_this_cp_rank``,
  Llama 3's context parallelism): every rank then has early and late
  queries, so causal attention costs each rank alike."""
  return _zigzag_chunks_of(x, lax.axis_index(axis_name), lax.axis_size(axis_name), dim)


def _zigzag_chunks_of(x, r, n, dim):
  """Chunks r and 2n-1-r of the 2n chunks of ``x``'s ``dim``."""
  size = x.shape[dim] // (2 * n)
  early = lax.dynamic_slice_in_dim(x, r * size, size, dim, allow_negative_indices=False)
  late = lax.dynamic_slice_in_dim(x, (2 * n - 1 - r) * size, size, dim,
                                  allow_negative_indices=False)
  return jnp.concatenate([early, late], dim)


def _zigzag_chunks_by_index(x, axis_name, dim=1):
  """``_zigzag_chunks`` as Megatron's ``get_batch_on_this_cp_rank`` writes it:
  the dim viewed as ``2n`` chunks, the rank's two taken by index (a gather
  at indices computed from the rank)."""
  n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
  shape = x.shape
  chunks = x.reshape(shape[:dim] + (2 * n, shape[dim] // (2 * n)) + shape[dim + 1:])
  mine = jnp.take(chunks, jnp.stack([r, 2 * n - 1 - r]), axis=dim)
  return mine.reshape(shape[:dim] + (-1,) + shape[dim + 1:])


def _zigzag_rows_by_hand(axis_name, write_back="zigzag", reduce=lax.psum, by_index=False):
  """``_zigzag_chunks`` of a replicated table along dim 0 with a hand-written
  backward (as Megatron writes its index gathers): the rows' gradient written
  back into place in zeros and summed over the ranks.  ``by_index``: the
  chunks taken by index and added back at the same indices (``index_add``).
  The bugs: written back at a contiguous shard's rows
  (``write_back="contiguous"``), or averaged over the ranks
  (``reduce=lax.pmean``)."""
  @jax.custom_vjp
  def rows(table):
    return (_zigzag_chunks_by_index if by_index else _zigzag_chunks)(table, axis_name, 0)

  def forward(table):
    return rows(table), jnp.zeros_like(table)

  def backward(zeros, g):
    n, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    size = g.shape[0] // 2
    if by_index:
      mine = jnp.stack([2 * r, 2 * r + 1] if write_back == "contiguous" else [r, 2 * n - 1 - r])
      chunks = zeros.reshape((2 * n, size) + zeros.shape[1:])
      whole = chunks.at[mine].add(g.reshape((2, size) + g.shape[1:])).reshape(zeros.shape)
    elif write_back == "contiguous":
      whole = lax.dynamic_update_slice_in_dim(zeros, g, r * 2 * size, 0)
    else:
      whole = lax.dynamic_update_slice_in_dim(zeros, g[:size], r * size, 0)
      whole = lax.dynamic_update_slice_in_dim(whole, g[size:], (2 * n - 1 - r) * size, 0)
    return (reduce(whole, axis_name),)

  rows.defvjp(forward, backward)
  return rows


def _zigzag_positions(axis_name, cut=_zigzag_chunks):
  """The positions of this rank's zig-zag chunks (RoPE's angles)."""
  def positions(n):
    whole = jnp.arange(n * lax.axis_size(axis_name), dtype=jnp.float32)
    return cut(whole, axis_name, 0)
  return positions


def _zigzag_causal_mask(axis_name, cut=_zigzag_chunks):
  """The causal mask of this rank's queries against every key, both in
  zig-zag order (the keys are gathered so): by their positions."""
  def mask(sq, sk):
    rows = cut(jnp.arange(sk, dtype=jnp.int32), axis_name, 0)
    cols = lax.all_gather(rows, axis_name, tiled=True)
    return rows[:, None] >= cols[None, :]
  return mask


def _cp_zigzag_par(base=None, loss_axes=("cp",), positions=None, mask=None, labels=True,
                   position_rows=None, cut=_zigzag_chunks):
  """``cp`` load-balanced: every rank is given the whole batch and keeps its
  zig-zag chunks of tokens and labels (``cut``: by slices, or by index);
  positions, mask and GPT-2's learned positions (``position_rows``) follow
  them.  The bugs: ``positions``, ``mask`` or ``position_rows`` for
  contiguous shards, labels not reordered (``labels=False``: the rank's
  contiguous shard)."""
  def local_batch(tokens, labels_):
    mine = cut(labels_, "cp") if labels else lax.dynamic_slice_in_dim(
        labels_, lax.axis_index("cp") * (labels_.shape[1] // 4), labels_.shape[1] // 4, 1)
    return cut(tokens, "cp"), mine
  return dataclasses.replace(
      _cp_par(base, loss_axes), local_batch=local_batch,
      position_rows=position_rows or (lambda wpe: cut(wpe, "cp", 0)),
      positions=positions or _zigzag_positions("cp", cut),
      causal_mask=mask or _zigzag_causal_mask("cp", cut))


def _zigzag_ring_par(shift=1):
  """``cp_zigzag`` with keys and values passed round a ring instead of
  all-gathered (Megatron's context parallelism: load-balanced chunks, a ring
  of k/v blocks); each block lands at its rank's place, in zig-zag order."""
  return dataclasses.replace(_cp_zigzag_par(), gather_kv=_ring_gather_seq("cp", shift))


def _zigzag_ring_attention_par(shift=1, fori=False, block_mask=_zigzag_block_mask):
  """``cp_zigzag`` with ring attention (Megatron's and Llama 3's context
  parallelism): load-balanced chunks, k/v blocks round the ring, each step's
  block masked by its chunks' positions and folded into the online softmax.
  The bugs: the ring turning the wrong way (``shift=-1``), the blocks masked
  as contiguous shards (``block_mask=_block_mask``)."""
  return dataclasses.replace(_cp_zigzag_par(), attend=_ring_attention(
      "cp", shift, fori=fori, block_mask=block_mask))


def _zigzag_ring_attention_vjp_par(**bug):
  """``cp_zigzag_ring_attention`` with its hand-written ring backward."""
  return dataclasses.replace(_cp_zigzag_par(), attend=_ring_attention_vjp(
      "cp", block_mask=_zigzag_block_mask, **bug))


def _dp_tp_cp_par():
  return _cp_par(_tp_par(), loss_axes=("dp", "cp"))


def _dp_par(combine=_pmean_of_mean):
  return Parallel(combine_loss=combine("dp"))


def _tp_par(reduce_attn=_psum, repeat=repeat_kv, combine=None):
  return Parallel(reduce_attn=reduce_attn("tp"), reduce_mlp=_psum("tp"),
                  repeat_kv=repeat, local_heads=_slice_heads("tp"),
                  **({"combine_loss": combine} if combine else {}))


def _sp_par(with_offset=True):
  return Parallel(gather_seq=_gather_seq("tp"),
                  reduce_attn=_scatter_seq("tp"), reduce_mlp=_scatter_seq("tp"),
                  positions=_sharded_positions("tp", with_offset),
                  local_heads=_slice_heads("tp"),
                  combine_loss=_pmean_of_mean("tp"))


def _dp_sp_par(with_offset=True):
  """``sp`` on each half of the batch: the loss averaged over both axes."""
  return dataclasses.replace(_sp_par(with_offset), combine_loss=_pmean_of_mean(("dp", "tp")))


def _vocab_offset_iota(n, axis, with_offset=True):
  """This rank's vocabulary ids: rows ``r * n ...`` of a table split by rows."""
  ids = jnp.arange(n, dtype=jnp.int32)
  return ids + lax.axis_index(axis) * n if with_offset else ids


def _vocab_parallel_embed(axis, with_offset=True):
  """Megatron's vocab-parallel embedding: each rank looks the tokens up in its
  own rows of the table, zero for a token another rank holds, and the psum
  adds the one row that matched.  As a one-hot matmul, or (``cfg.embedding ==
  "take"``) as Megatron's masked ``take``: tokens are clipped to the table
  first, as the sequential ``take(mode="clip")`` clips them.  The bug
  ``with_offset=False`` masks right but looks the token id up in the rank's
  rows unshifted (``table_r[id]``, clipped, instead of ``table_r[id - r*n]``)."""
  def embed_tokens(tokens, table, cfg):
    n = table.shape[0]
    if cfg.embedding != "take":
      onehot = (tokens[..., None] == _vocab_offset_iota(n, axis)).astype(jnp.float32)
      return lax.psum(onehot @ table, axis)
    ids = jnp.clip(tokens, 0, n * lax.axis_size(axis) - 1)
    lo = lax.axis_index(axis) * n
    mine = (ids >= lo) & (ids < lo + n)
    local = jnp.where(mine, ids - lo if with_offset else ids, 0)
    rows = jnp.take(table, local, axis=0, mode="clip")
    return lax.psum(jnp.where(mine[..., None], rows, 0.0), axis)
  return embed_tokens


def _vocab_parallel_nll(axis, reduce_max=True, with_offset=True):
  """Megatron's vocab-parallel cross entropy on logits split by vocabulary:
  log_softmax's row max by pmax and its sum of exps by psum, the label's
  log-probability picked on the rank that holds it and psum'd.  The bugs:
  ``reduce_max=False`` shifts each rank's logits by its own max;
  ``with_offset=False`` matches labels against every rank's ids as if they
  were the first rank's."""
  def nll(logits, labels, cfg):
    m = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))
    if reduce_max:
      m = lax.pmax(m, axis)
    shifted = logits - m
    logp = shifted - jnp.log(lax.psum(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True), axis))
    ids = _vocab_offset_iota(logits.shape[-1], axis, with_offset)
    onehot = (labels[..., None] == ids).astype(jnp.float32)
    return -lax.psum(jnp.sum(onehot * logp, axis=-1), axis)
  return nll


def _tp_vocab_par(**nll_bug):
  """Megatron TP with the embedding, output head and loss split by vocabulary."""
  return dataclasses.replace(_tp_par(), embed_tokens=_vocab_parallel_embed("tp"),
                             token_nll=_vocab_parallel_nll("tp", **nll_bug))


def _dp_tp_par():
  return _tp_par(combine=_pmean_of_mean("dp"))


def _dp_tp_vocab_par():
  """``dp_tp`` with the vocabulary split over "tp" as ``tp_vocab``'s."""
  return dataclasses.replace(_tp_vocab_par(), combine_loss=_pmean_of_mean("dp"))


def _no_reduce(axis):
  return _identity


def _to_expert_owners(axis):
  """[E, b_local, s, d] (all experts, my tokens) -> [E_local, b, s, d] (my
  experts, everyone's tokens)."""
  return lambda x: lax.all_to_all(x, axis, split_axis=0, concat_axis=1, tiled=True)


def _to_token_owners(axis):
  return lambda y: lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)


def _to_next_rank_experts(axis):
  """The bug: the expert blocks are rotated by one rank before the exchange,
  so every rank's tokens reach the experts of the rank after their owner."""
  def dispatch(x):
    x = jnp.roll(x, -(x.shape[0] // lax.axis_size(axis)), axis=0)
    return lax.all_to_all(x, axis, split_axis=0, concat_axis=1, tiled=True)
  return dispatch


def _slots_over_all_my_tokens(chosen):
  """The bug: an expert's queue counted over all of this rank's tokens as one
  group, so later rows find the experts fuller than they are."""
  b, s, e = chosen.shape
  return slots_per_group(chosen.reshape(1, b * s, e)).reshape(b, s, e)


def _ep_par(dispatch=_to_expert_owners, **hooks):
  """Expert parallel on "ep": tokens (batch rows) and experts both split over
  it, attention replicated, expert tokens exchanged by all-to-alls."""
  return Parallel(**{"combine_loss": _pmean_of_mean("ep"), "to_experts": dispatch("ep"),
                     "from_experts": _to_token_owners("ep"), **hooks})


def _scan_stage(h, stacked, layer):
  """A stage's layers under ``lax.scan`` over its rows of the stacks, the
  activations typed as varying like the stage's weights."""
  return scan_stack(_varying_like(next(iter(stacked.values())), (h,))[0], stacked, layer)


def _pipeline_stages(axis, shift=1, fori=False, scan=False):
  """Pipeline parallelism on ``axis`` (no microbatches): stage s holds rows
  s*m .. s*m+m-1 of the layer stacks.  Every stage runs its layers on what it
  holds, then passes the result to stage s + ``shift``; after |axis| rounds
  the last stage holds the output, which a masked psum hands to everyone.
  ``shift=-1`` is the seeded bug: activations flow to the previous stage.
  ``fori``: the rounds under ``lax.fori_loop``, each one passing its result
  on, so the output comes round to stage 0.  ``scan``: each stage's layers
  under ``lax.scan`` over its rows (the sequential model scans all of them)."""
  run_layers = _scan_stage if scan else run_stack_in_order

  def run(h, stacked, layer):
    n = lax.axis_size(axis)
    stage = lax.axis_index(axis)
    if fori:
      h = lax.fori_loop(0, n, lambda t, h: lax.ppermute(
          run_layers(h, stacked, layer), axis, _ring_perm(n, shift)),
          _varying_like(next(iter(stacked.values())), (h,))[0])
      return lax.psum(jnp.where(stage == 0, h, 0.0), axis)
    for t in range(n):
      h = run_layers(h, stacked, layer)
      if t < n - 1:
        h = lax.ppermute(h, axis, _ring_perm(n, shift))
    return lax.psum(jnp.where(stage == n - 1, h, 0.0), axis)
  return run


def _gpipe_stages(axis, microbatches, shift=1, inject_late=0, buffered=False, misplaced=0,
                  scan=False):
  """GPipe over ``axis``: each rank's batch in ``microbatches`` slices; at
  step t stage 0 takes microbatch t, every stage runs its layers on what it
  holds and passes it on, and the last stage finishes microbatch t - (n - 1).
  Its outputs, concatenated, are handed to everyone by a masked psum.
  ``inject_late``: the seeded bug, stage 0 taking microbatch t - 1 at step t
  (the first one twice, the last never).  ``buffered``: the microbatches read
  from the batch reshaped to [microbatches, rows, ...] and the outputs written
  into a zero buffer by ``.at[m].set``, as the JAX pipelining examples do;
  ``misplaced``: the seeded bug, microbatch m's output written at row
  m + misplaced (mod the count).  ``scan``: each stage's layers under
  ``lax.scan`` over its rows, one loop per step on one microbatch."""
  run_layers = _scan_stage if scan else run_stack_in_order

  def run(h, stacked, layer):
    n = lax.axis_size(axis)
    stage = lax.axis_index(axis)
    size = h.shape[0] // microbatches
    if buffered:
      batches = h.reshape((microbatches, size) + h.shape[1:])
      pieces = [batches[m] for m in range(microbatches)]
      outputs = jnp.zeros_like(batches)
    else:
      pieces = [h[m * size:(m + 1) * size] for m in range(microbatches)]
    state = jnp.zeros_like(pieces[0])
    outs = []
    for t in range(microbatches + n - 1):
      if t < microbatches:
        state = jnp.where(stage == 0, pieces[max(t - inject_late, 0)], state)
      state = run_layers(state, stacked, layer)
      if t >= n - 1 and buffered:
        outputs = outputs.at[(t - (n - 1) + misplaced) % microbatches].set(state)
      elif t >= n - 1:
        outs.append(state)
      if t < microbatches + n - 2:
        state = lax.ppermute(state, axis, _ring_perm(n, shift))
    out = outputs.reshape(h.shape) if buffered else jnp.concatenate(outs, axis=0)
    return lax.psum(jnp.where(stage == n - 1, out, 0.0), axis)
  return run


def _gpipe_fori_stages(axis, microbatches, misplaced=0, shift=1):
  """GPipe's buffered schedule with its M + n - 1 steps under
  ``lax.fori_loop``, as JAX's pipelining examples write it: at step t stage 0
  takes microbatch t while t < M, every stage runs its layers and passes its
  output on, and the last stage writes microbatch t - (n - 1) once t >= n - 1.
  ``misplaced``: the seeded bug, microbatch m's output written at row
  m + misplaced (mod the count); ``shift=-1``, the seeded bug: every stage's
  output sent to the stage before it."""
  def run(h, stacked, layer):
    n = lax.axis_size(axis)
    stage = lax.axis_index(axis)
    batches = h.reshape((microbatches, h.shape[0] // microbatches) + h.shape[1:])

    def step(t, carry):
      state, outputs = carry
      fresh = lax.dynamic_index_in_dim(batches, jnp.minimum(t, microbatches - 1), 0,
                                       keepdims=False)
      state = jnp.where((stage == 0) & (t < microbatches), fresh, state)
      state = run_stack_in_order(state, stacked, layer)
      done = t - (n - 1)
      row = (jnp.maximum(done, 0) + misplaced) % microbatches
      written = lax.dynamic_update_index_in_dim(outputs, state, row, 0)
      outputs = jnp.where(done >= 0, written, outputs)
      return lax.ppermute(state, axis, _ring_perm(n, shift)), outputs

    carry = _varying_like(next(iter(stacked.values())),
                          (jnp.zeros_like(batches[0]), jnp.zeros_like(batches)))
    _, outputs = lax.fori_loop(0, microbatches + n - 1, step, carry)
    return lax.psum(jnp.where(stage == n - 1, outputs.reshape(h.shape), 0.0), axis)
  return run


def _gspmd_gpipe_stages(mesh, axis, microbatches, shift=1, injected_row=0, collected_row=-1,
                        fori=False):
  """GPipe under GSPMD, as MaxText and praxis write it: no shard_map, the
  stacks viewed as [stages, layers per stage, ...] split over ``axis`` by
  stage, and a state of one microbatch per stage, [stages, rows, ...], split
  alike.  At step t microbatch t is set into stage 0's row, every stage's
  layers run vmapped over the stage dim, the last stage's row is written to
  the outputs once t >= n - 1, and the state is rolled one stage on
  (``jnp.roll``: XLA's collective-permute).  Seeded bugs: ``shift=-1`` rolls
  it back a stage; ``injected_row`` sets the microbatch into another stage's
  row; ``collected_row`` collects the outputs from another stage's.
  ``fori``: the steps under ``lax.fori_loop``, the microbatch read and the
  output written at rows computed from the step (MaxText's loop)."""
  split = lambda x: lax.with_sharding_constraint(x, NamedSharding(mesh, P(axis)))

  def run(h, stacked, layer):
    n = mesh.shape[axis]
    stages = {k: split(w.reshape((n, w.shape[0] // n) + w.shape[1:]))
              for k, w in stacked.items()}
    size = h.shape[0] // microbatches
    batches = h.reshape((microbatches, size) + h.shape[1:])
    state = split(jnp.zeros((n, size) + h.shape[1:], h.dtype))
    outputs = jnp.zeros_like(batches)
    run_stage = jax.vmap(lambda ws, x: run_stack_in_order(x, ws, layer))
    if fori:
      def step(t, carry):
        state, outputs = carry
        fresh = lax.dynamic_index_in_dim(batches, jnp.minimum(t, microbatches - 1), 0,
                                         keepdims=False)
        state = jnp.where(t < microbatches, state.at[injected_row].set(fresh), state)
        state = split(run_stage(stages, state))
        done = t - (n - 1)
        written = lax.dynamic_update_index_in_dim(outputs, state[collected_row],
                                                  jnp.maximum(done, 0), 0)
        outputs = jnp.where(done >= 0, written, outputs)
        return split(jnp.roll(state, shift, axis=0)), outputs
      _, outputs = lax.fori_loop(0, microbatches + n - 1, step, (state, outputs))
      return outputs.reshape(h.shape)
    for t in range(microbatches + n - 1):
      if t < microbatches:
        state = state.at[injected_row].set(batches[t])
      state = split(run_stage(stages, state))
      if t >= n - 1:
        outputs = outputs.at[t - (n - 1)].set(state[collected_row])
      state = split(jnp.roll(state, shift, axis=0))
    return outputs.reshape(h.shape)
  return run


def _gspmd_circular_stages(mesh, axis, microbatches, fori=False, stage_offset=True,
                           collected_repeat=-1):
  """MaxText's circular pipeline (``num_pipeline_repeats``) under GSPMD: the
  stacks held as ``[repeats, layers, ...]`` (``Config.virtual_stages``), their
  layers split over ``axis``, so stage s holds layer s of every repeat.  A
  state of one microbatch per stage, ``[stages, rows, ...]``, split alike.  At
  step t stage s runs microbatch ``(t - s) mod m`` through its layer of repeat
  ``(t - s) // m`` (``m`` microbatches, as many as stages: what the last stage
  gives comes round to stage 0 just when it starts that microbatch's next
  repeat).  Each stage picks its repeat's weights by a ``dynamic_slice``
  vmapped over the stage dim (MaxText's ``vmap_parallel_gather``); the
  microbatches are set into stage 0's row in the first repeat, the last
  stage's row written out in the last, the state rolled a stage on.
  ``fori``: the steps under ``lax.fori_loop`` (MaxText's loop).  Seeded bugs:
  ``stage_offset=False`` picks repeat ``t // m`` at every stage (the stage's
  lag forgotten); ``collected_repeat`` collects the outputs another repeat."""
  split = lambda x: lax.with_sharding_constraint(x, NamedSharding(mesh, P(axis)))

  def run(h, stacked, layer):
    n = mesh.shape[axis]
    repeats = next(iter(stacked.values())).shape[0]
    assert microbatches == n, "no circular storage: as many microbatches as stages"
    # [repeats, n * per stage, ...] -> [n, repeats, per stage, ...]
    stages = {k: split(jnp.moveaxis(w.reshape((repeats, n, w.shape[1] // n) + w.shape[2:]), 1, 0))
              for k, w in stacked.items()}
    size = h.shape[0] // microbatches
    batches = h.reshape((microbatches, size) + h.shape[1:])
    state = split(jnp.zeros((n, size) + h.shape[1:], h.dtype))
    outputs = jnp.zeros_like(batches)
    lag = jnp.arange(n) if stage_offset else jnp.zeros(n, jnp.int32)
    collected = (repeats + collected_repeat) % repeats

    def run_stage(ws, x, repeat):
      chunk = {k: lax.dynamic_index_in_dim(w, repeat, 0, keepdims=False) for k, w in ws.items()}
      return run_stack_in_order(x, chunk, layer)
    run_stages = jax.vmap(run_stage)

    def step(t, state, outputs, inject, collect):
      state = inject(state)
      repeat_ids = split(jnp.clip((t - lag) // microbatches, 0, repeats - 1))
      state = split(run_stages(stages, state, repeat_ids))
      outputs = collect(outputs, state[-1], t - (n - 1) - collected * microbatches)
      return split(jnp.roll(state, 1, axis=0)), outputs

    steps = repeats * microbatches + n - 1
    if fori:
      def inject(t):
        fresh = lax.dynamic_index_in_dim(batches, jnp.minimum(t, microbatches - 1), 0,
                                         keepdims=False)
        return lambda state: jnp.where(t < microbatches, state.at[0].set(fresh), state)

      def collect(outputs, last, done):
        written = lax.dynamic_update_index_in_dim(
            outputs, last, jnp.clip(done, 0, microbatches - 1), 0)
        return jnp.where((done >= 0) & (done < microbatches), written, outputs)
      _, outputs = lax.fori_loop(
          0, steps, lambda t, c: step(t, *c, inject(t), collect), (state, outputs))
      return outputs.reshape(h.shape)
    for t in range(steps):
      inject = (lambda state, t=t: state.at[0].set(batches[t])) if t < microbatches \
          else (lambda state: state)
      collect = lambda outputs, last, done: (outputs.at[done].set(last)
                                             if 0 <= done < microbatches else outputs)
      state, outputs = step(t, state, outputs, inject, collect)
    return outputs.reshape(h.shape)
  return run


def _pp_par(shift=1, fori=False, scan=False):
  return Parallel(run_stack=_pipeline_stages("pp", shift, fori, scan))


# --------------------------------------------------------------------------
# Shardings.
# --------------------------------------------------------------------------

# Megatron TP: column-parallel (output features over tp) and row-parallel
# (input features over tp) weights; everything not listed is replicated.
_TP_SPECS = {
    "gpt2": {"wq": P(None, "tp"), "bq": P("tp"), "wk": P(None, "tp"),
             "bk": P("tp"), "wv": P(None, "tp"), "bv": P("tp"),
             "wo": P("tp", None), "w_fc": P(None, "tp"), "b_fc": P("tp"),
             "w_proj": P("tp", None)},
    # wk / wv replicated: 2 kv heads cannot be split over 4 ranks.
    "llama3": {"wq": P(None, "tp"), "wo": P("tp", None),
               "w_gate": P(None, "tp"), "w_up": P(None, "tp"),
               "w_down": P("tp", None)},
}


def _no_param_specs(model, name):
  return P()


def _ep_param_spec(model, name):
  """Experts' weights split over "ep" by expert; everything else replicated."""
  if base_name(name) in ("w_gate", "w_up", "w_down"):
    return P("ep", None, None)
  return P()


def _tp_param_spec(model, name):
  return _TP_SPECS[model].get(base_name(name), P())


# The vocabulary dim of the embedding table and the output head over "tp".
_VOCAB_SPECS = {"wte": P("tp", None), "emb": P("tp", None), "head": P(None, "tp")}


def _tp_vocab_param_spec(model, name):
  return _VOCAB_SPECS.get(name) or _tp_param_spec(model, name)


def _sp_param_spec(model, name):
  if model == "gpt2" and name == "wpe":
    return P("tp", None)
  return _tp_param_spec(model, name)


def _cp_param_spec(model, name):
  """GPT-2's learned positions go with their tokens; the rest is replicated."""
  return P("cp", None) if (model, name) == ("gpt2", "wpe") else P()


def _dp_tp_cp_param_spec(model, name):
  return _cp_param_spec(model, name) if name == "wpe" else _tp_param_spec(model, name)


@dataclasses.dataclass(frozen=True)
class _Strategy:
  name: str
  mesh_shape: tuple
  axis_names: tuple
  token_spec: P
  param_spec: Callable[[str, str], P]
  par: Callable[[], Parallel]           # the correct per-device hooks
  cfg_overrides: tuple = ()
  layer_axis: Optional[str] = None      # the axis splitting stacked layers
  relation: Optional[str] = None        # the inputs' relation file, if not the specs'
  weight_axis: Optional[str] = None     # the axis FSDP shards and gathers weights over

  @property
  def weight_shards(self) -> int:
    """How many shards ``weight_axis`` cuts a weight into."""
    return self.mesh_shape[self.axis_names.index(self.weight_axis)]


_STRATEGIES = {s.name: s for s in [
    _Strategy("dp", (4,), ("dp",), P("dp", None), _no_param_specs, _dp_par,
              (("batch", 4),)),
    _Strategy("tp", (4,), ("tp",), P(), _tp_param_spec, _tp_par),
    _Strategy("tp_vocab", (4,), ("tp",), P(), _tp_vocab_param_spec, _tp_vocab_par),
    _Strategy("sp", (4,), ("tp",), P(None, "tp"), _sp_param_spec, _sp_par),
    _Strategy("dp_tp", (2, 4), ("dp", "tp"), P("dp", None), _tp_param_spec,
              _dp_tp_par),
    _Strategy("cp", (4,), ("cp",), P(None, "cp"), _cp_param_spec, _cp_par),
    _Strategy("dp_tp_cp", (2, 2, 2), ("dp", "tp", "cp"), P("dp", "cp"),
              _dp_tp_cp_param_spec, _dp_tp_cp_par),
]}

# dp x tp x sp: Korthikanti's sequence parallelism with Megatron TP on "tp",
# the batch over "dp" (2 x 4): tokens split over both.
DP_SP = _Strategy("dp_sp", (2, 4), ("dp", "tp"), P("dp", "tp"), _sp_param_spec, _dp_sp_par)


def _fori(strategy: _Strategy) -> _Strategy:
  """``strategy`` with its loop of steps (a ring's, or a pipeline's schedule)
  under ``lax.fori_loop``: its hooks' factory called with ``fori=True``."""
  return dataclasses.replace(strategy, name=f"{strategy.name}_fori",
                             par=functools.partial(strategy.par, fori=True))


# Pipeline parallelism: 8 layers on 4 stages, two per stage.
PP = _Strategy("pp", (4,), ("pp",), P(), _no_param_specs, _pp_par,
               (("stacked_params", True), ("layers", 8)), layer_axis="pp")

# GPipe: the same stages with each batch in 4 microbatches.
GPIPE = _Strategy("pp_gpipe", (4,), ("pp",), P(), _no_param_specs,
                  lambda: Parallel(run_stack=_gpipe_stages("pp", 4)),
                  (("stacked_params", True), ("layers", 8), ("batch", 4)), layer_axis="pp")


# GPipe written with buffers: the batch reshaped into microbatches, the
# outputs set into a zero buffer row by row.
GPIPE_BUFFERED = dataclasses.replace(
    GPIPE, name="pp_gpipe_buffered",
    par=lambda: Parallel(run_stack=_gpipe_stages("pp", 4, buffered=True)))

# GPipe's buffered schedule under lax.fori_loop.
GPIPE_FORI = dataclasses.replace(
    GPIPE, name="pp_gpipe_fori",
    par=lambda: Parallel(run_stack=_gpipe_fori_stages("pp", 4)))

# GPipe with Megatron TP inside each stage: 2 stages x 4 tp ranks, 4 microbatches.
PP_TP_GPIPE = _Strategy("pp_tp_gpipe", (2, 4), ("pp", "tp"), P(), _tp_param_spec,
                        lambda: dataclasses.replace(_tp_par(), run_stack=_gpipe_stages("pp", 4)),
                        (("stacked_params", True), ("layers", 4), ("batch", 4)),
                        layer_axis="pp")


def _staged(par: Parallel, scan: bool = False) -> Parallel:
  """``par``'s hooks inside each stage of a pipeline over "pp" (``scan``: each
  stage's layers under ``lax.scan``)."""
  return dataclasses.replace(par, run_stack=_pipeline_stages("pp", scan=scan))


# Pipeline stages with Megatron TP inside each: 2 stages x 4 tp ranks, the
# stacked weights split over "pp" by layer and over "tp" like TP's.
def _pp_tp_par(reduce_attn=_psum, scan=False):
  return _staged(_tp_par(reduce_attn), scan)


PP_FORI = _fori(PP)

PP_TP = _Strategy("pp_tp", (2, 4), ("pp", "tp"), P(), _tp_param_spec, _pp_tp_par,
                  (("stacked_params", True), ("layers", 4)), layer_axis="pp")

# 3D: batch over "dp", stages over "pp", Megatron TP over "tp" (2 x 2 x 2).
DP_PP_TP = _Strategy("dp_pp_tp", (2, 2, 2), ("dp", "pp", "tp"), P("dp", None), _tp_param_spec,
                     lambda: _staged(_dp_tp_par()), (("stacked_params", True), ("layers", 4)),
                     layer_axis="pp")


def _stages_scanned(strategy: _Strategy, par: Callable[[], Parallel]) -> _Strategy:
  """``strategy`` with each stage scanning its layers (hooks ``par``), the
  sequential model all of them."""
  return dataclasses.replace(strategy, name=f"{strategy.name}_scan", par=par,
                             cfg_overrides=strategy.cfg_overrides + (("scan_layers", True),))


PP_SCAN = _stages_scanned(PP, functools.partial(_pp_par, scan=True))
# GPipe with each stage scanning its layers: per step, one loop per stage on
# one microbatch (the sequential scan, split by stage and microbatch:
# loop_split.py, microbatch_loops.py).
GPIPE_SCAN = _stages_scanned(GPIPE, lambda: Parallel(run_stack=_gpipe_stages("pp", 4,
                                                                           scan=True)))

PP_TP_SCAN = _stages_scanned(PP_TP, functools.partial(_pp_tp_par, scan=True))
# GPipe with TP inside each stage, each stage scanning its layers: the
# sequential scan split by stage and microbatch, each piece's partner holding
# the stage's weights tiled by "tp".
PP_TP_GPIPE_SCAN = _stages_scanned(PP_TP_GPIPE, lambda: dataclasses.replace(
    _tp_par(), run_stack=_gpipe_stages("pp", 4, scan=True)))
DP_PP_TP_SCAN = _stages_scanned(DP_PP_TP, lambda: _staged(_dp_tp_par(), scan=True))

# dp x tp with the vocabulary split over "tp" (its programs look tokens up by jnp.take).
DP_TP_VOCAB = _Strategy("dp_tp_vocab", (2, 4), ("dp", "tp"), P("dp", None),
                        _tp_vocab_param_spec, _dp_tp_vocab_par)

# Context parallelism with keys and values passed round a ring of ppermutes
# (shard_map only: the ring is the hand-written part; under GSPMD it is ``cp``).
# Load-balanced (zig-zag) context parallelism: the batch, and GPT-2's learned
# positions, given whole to every rank, which cuts its chunks out of them.
CP_ZIGZAG = _Strategy("cp_zigzag", (4,), ("cp",), P(), lambda model, name: P(), _cp_zigzag_par)
# The same with the learned positions' cut and its backward written by hand.
CP_ZIGZAG_VJP = dataclasses.replace(CP_ZIGZAG, name="cp_zigzag_vjp", par=lambda: _cp_zigzag_par(
    position_rows=_zigzag_rows_by_hand("cp")))
CP_RING = _Strategy("cp_ring", (4,), ("cp",), P(None, "cp"), _cp_param_spec, _ring_par)
# DeepSpeed-Ulysses: the sequence split over "cp" everywhere but attention,
# which all-to-alls to a split by heads and back.  shard_map only.
CP_ULYSSES = _Strategy("cp_ulysses", (4,), ("cp",), P(None, "cp"), _cp_param_spec,
                       _ulysses_par)
CP_ZIGZAG_RING = dataclasses.replace(CP_ZIGZAG, name="cp_zigzag_ring", par=_zigzag_ring_par)
CP_ZIGZAG_RING_ATTENTION = dataclasses.replace(CP_ZIGZAG, name="cp_zigzag_ring_attention",
                                               par=_zigzag_ring_attention_par)
CP_ZIGZAG_RING_ATTENTION_VJP = dataclasses.replace(
    CP_ZIGZAG, name="cp_zigzag_ring_attention_vjp", par=_zigzag_ring_attention_vjp_par)
CP_ZIGZAG_RING_ATTENTION_VJP_FORI = _fori(CP_ZIGZAG_RING_ATTENTION_VJP)
CP_ZIGZAG_RING_ATTENTION_FORI = _fori(CP_ZIGZAG_RING_ATTENTION)
# The batch as a data loader hands it (Llama 3's, or Megatron's with the cut
# done on the host): tokens and labels split over "cp" in zig-zag order, which
# the shardings cannot say and the relation file does; each rank cuts only its
# positions, mask and GPT-2's position rows.
_ZIGZAG_CHUNKS = ",".join(str(c) for r in range(4) for c in (r, 7 - r))
_ZIGZAG_BATCH = f"0: dim1=cp order1={_ZIGZAG_CHUNKS}\n1: dim1=cp order1={_ZIGZAG_CHUNKS}\n"


def _zigzag_loaded_par(attend=None, **bug):
  """``cp_zigzag`` on a batch already in zig-zag chunks (``attend``: ring
  attention's, or attention over the gathered keys)."""
  par = _cp_zigzag_par(**bug)
  return dataclasses.replace(par, local_batch=lambda tokens, labels: (tokens, labels),
                             attend=attend or par.attend)


CP_ZIGZAG_LOADED = _Strategy("cp_zigzag_loaded", (4,), ("cp",), P(None, "cp"),
                             lambda model, name: P(), _zigzag_loaded_par,
                             relation=_ZIGZAG_BATCH)
CP_ZIGZAG_LOADED_RING_ATTENTION = dataclasses.replace(
    CP_ZIGZAG_LOADED, name="cp_zigzag_loaded_ring_attention",
    par=lambda: _zigzag_loaded_par(attend=_ring_attention("cp", 1, block_mask=_zigzag_block_mask)))


def _zigzag_numbers(n: int) -> np.ndarray:
  """0..n-1 in the zig-zag order of the batch (as a numpy constant: XLA folds
  what is computed from it into a table each partition cuts its rows from)."""
  return np.concatenate([np.split(np.arange(n), 8)[c] for c in
                         (int(c) for c in _ZIGZAG_CHUNKS.split(","))])


def _zigzag_tables_par(positions: bool = True, mask: bool = True) -> Parallel:
  """Zig-zag context parallelism under GSPMD, as MaxText writes it: the model
  is given the loader's zig-zag batch whole and reads its positions and causal
  mask from tables in the same order.  The bugs: either left in sequence
  order (``positions=False``, ``mask=False``)."""
  def zigzag_positions(n):
    return jnp.asarray(_zigzag_numbers(n), jnp.float32)

  def zigzag_mask(sq, sk):
    rows = _zigzag_numbers(sk)
    return jnp.asarray(rows[:, None] >= rows[None, :])
  return dataclasses.replace(SEQUENTIAL, **({"positions": zigzag_positions} if positions else {}),
                             **({"causal_mask": zigzag_mask} if mask else {}))


# The chunks taken by index, as Megatron writes it.
CP_ZIGZAG_TAKE = dataclasses.replace(CP_ZIGZAG, name="cp_zigzag_take", par=functools.partial(
    _cp_zigzag_par, cut=_zigzag_chunks_by_index))
# ... with GPT-2's learned positions' backward written by hand (an index_add).
CP_ZIGZAG_TAKE_VJP = dataclasses.replace(CP_ZIGZAG_TAKE, name="cp_zigzag_take_vjp", par=lambda: (
    _cp_zigzag_par(cut=_zigzag_chunks_by_index,
                   position_rows=_zigzag_rows_by_hand("cp", by_index=True))))
RING_ATTENTION = _Strategy("ring_attention", (4,), ("cp",), P(None, "cp"), _cp_param_spec,
                           _ring_attention_par)
# Ring attention masked with -inf, as many hand-written attentions are: sound
# since each rank starts on its own block, whose diagonal every row keeps.
RING_ATTENTION_INF_MASK = dataclasses.replace(
    RING_ATTENTION, name="ring_attention_inf_mask",
    par=functools.partial(_ring_attention_par, mask_value=-np.inf),
    cfg_overrides=RING_ATTENTION.cfg_overrides + (("mask_value", -np.inf),))
RING_ATTENTION_VJP = _Strategy("ring_attention_vjp", (4,), ("cp",), P(None, "cp"),
                               _cp_param_spec, _ring_attention_vjp_par)
# The same with each ring's steps under lax.fori_loop (passes/ring_loops.py).
CP_RING_FORI = _fori(CP_RING)
RING_ATTENTION_FORI = _fori(RING_ATTENTION)
RING_ATTENTION_VJP_FORI = _fori(RING_ATTENTION_VJP)
DP_TP_RING_ATTENTION = _Strategy("dp_tp_ring_attention", (2, 2, 2), ("dp", "tp", "cp"),
                                 P("dp", "cp"), _dp_tp_cp_param_spec, _dp_tp_ring_attention_par)
DP_TP_RING_ATTENTION_VJP = dataclasses.replace(DP_TP_RING_ATTENTION,
                                               name="dp_tp_ring_attention_vjp",
                                               par=_dp_tp_ring_attention_vjp_par)
DP_TP_RING_ATTENTION_FORI = _fori(DP_TP_RING_ATTENTION)
DP_TP_RING_ATTENTION_VJP_FORI = _fori(DP_TP_RING_ATTENTION_VJP)

# Expert parallelism: llama3 only (its MLP is the MoE layer), 4 experts.
EP = _Strategy("ep", (4,), ("ep",), P("ep", None), _ep_param_spec, _ep_par,
               (("batch", 4), ("experts", 4)))

def _ep_tp_param_spec(model, name):
  """The experts' weights split over "ep" by expert, the attention's over "tp"
  as Megatron's."""
  if base_name(name) in ("w_gate", "w_up", "w_down"):
    return _ep_param_spec(model, name)
  return _tp_param_spec(model, name)


def _ep_tp_par(**hooks):
  return _ep_par(local_heads=_slice_heads("tp"), reduce_attn=_psum("tp"), **hooks)


def _experts_summed_over(axis):
  """The bug: the experts' outputs all-reduced over ``axis`` on their way back,
  as after a row-parallel matmul; each rank there computed the same whole
  output, so the sum is |axis| times it."""
  back = _to_token_owners("ep")
  return lambda y: lax.psum(back(y), axis)


# 2D: experts over "ep" (2 per rank, the batch split alike), the attention
# over "tp" (2 x 4); the experts' MLPs run whole on every "tp" rank.
EP_TP = _Strategy("ep_tp", (2, 4), ("ep", "tp"), P("ep", None), _ep_tp_param_spec, _ep_tp_par,
                  (("batch", 4), ("experts", 4)))
# ... with each expert taking at most 6 of a group's 16 tokens (some dropped),
# 2 groups (batch rows) per rank.
EP_CAPACITY = dataclasses.replace(EP, name="ep_capacity",
                                  cfg_overrides=(("batch", 8), ("experts", 4), ("capacity", 6)))


# ... with the router's experts picked by lax.top_k.
EP_TOP_K = dataclasses.replace(EP, name="ep_top_k",
                               cfg_overrides=EP.cfg_overrides + (("router", "top_k"),))


@dataclasses.dataclass(frozen=True)
class _Bug:
  model: str
  strategy: str
  bug: str
  bug_primitive: str
  par: Callable[[], Parallel]
  # A missing all-reduce leaves the output varying over "tp" where out_specs
  # says replicated; the vma checker would reject it, so its author turned
  # the checker off.
  check_vma: bool = True


def _bugs() -> list[_Bug]:
  return [
      # Vocab-parallel cross entropy with each rank's logits shifted by its own
      # row max (the pmax forgotten): the max's broadcast reads a partial max.
      _Bug("gpt2", "tp_vocab", "nll_max_not_reduced", "broadcast_in_dim",
           lambda: _tp_vocab_par(reduce_max=False)),
      # ... with every rank matching the labels against ids 0..V/4-1: the one-hot
      # compare of labels with the vocabulary ids is the first op no rank holds.
      _Bug("llama3", "tp_vocab", "vocab_ids_not_offset", "compare",
           lambda: _tp_vocab_par(with_offset=False)),
      # Every rank uses positions 0..n-1: the sequential position iota (the
      # first op of the rotary tables) is the first value the devices hold
      # wrong slices of (all but rank 0).
      _Bug("llama3", "sp", "rope_no_offset", "iota",
           lambda: _sp_par(with_offset=False)),
      # Sequentially jnp.repeat is broadcast_in_dim [b,s,kv,groups,hd] then a
      # reshape; the buggy ranks tile instead ([b,s,groups,kv,hd]), so that
      # broadcast_in_dim is the first value no rank holds.  (k itself, and
      # its RoPE, are right and replicated.)
      _Bug("llama3", "tp", "gqa_wrong_heads", "broadcast_in_dim",
           lambda: _tp_par(repeat=_tile_kv)),
      # The partial sum out of ``attn @ wo`` feeds an add unreduced: the
      # output bias add in GPT-2, the residual add in Llama.
      _Bug("gpt2", "tp", "missing_allreduce", "add",
           lambda: _tp_par(reduce_attn=_no_reduce), check_vma=False),
      _Bug("llama3", "tp", "missing_allreduce", "add",
           lambda: _tp_par(reduce_attn=_no_reduce), check_vma=False),
      # psum of the local means = dp * the global mean.  Every intermediate
      # (the nll, the local sums as partials of the global sum) is right; only
      # the mean's division, whose result *is* the output, is off (as
      # ``dp_loss/shard_map/psum_not_pmean`` in cases.py).
      _Bug("gpt2", "dp", "loss_wrong_scale", "output",
           lambda: _dp_par(combine=_psum_of_mean)),
      # The attention output's psum runs over ("dp", "tp") instead of "tp":
      # replica groups spanning the data-parallel ranks add other batch rows
      # in.  The residual add reading it is the first op left without a value.
      _Bug("llama3", "dp_tp", "wrong_replica_groups", "add",
           lambda: _tp_par(reduce_attn=lambda _: _psum(("dp", "tp")),
                           combine=_pmean_of_mean("dp"))),
      _Bug("llama3", "dp", "loss_wrong_scale", "output",
           lambda: _dp_par(combine=_psum_of_mean)),
      # Context parallelism with every rank masking as if its queries came
      # first: the sequential mask's row iota, broadcast over the keys, is the
      # first value no rank holds its tile of (rank 0's is right).
      _Bug("llama3", "cp", "mask_no_offset", "broadcast_in_dim",
           lambda: _cp_par(with_offset=False)),
      # Keys and values gathered over "tp" instead of "cp" on the 2x2x2 mesh:
      # shape-correct (|tp| = |cp|), but each rank attends to its own sequence
      # shard twice.  GPT-2's scores (q . k) are the first op left without a
      # value; in Llama the reshape of jnp.repeat comes before (its broadcast
      # still relates: a new dim may be tiled over any axis).
      _Bug("gpt2", "dp_tp_cp", "kv_gathered_over_wrong_axis", "dot_general",
           lambda: _cp_par(_tp_par(), loss_axes=("dp", "cp"), gather_axis="tp")),
      _Bug("llama3", "dp_tp_cp", "kv_gathered_over_wrong_axis", "reshape",
           lambda: _cp_par(_tp_par(), loss_axes=("dp", "cp"), gather_axis="tp")),
  ]


# --------------------------------------------------------------------------
# Case construction.
# --------------------------------------------------------------------------


_mesh = mesh_of  # one cached mesh per shape, shared with cases.py


def _cfg(strategy: _Strategy, base: Config) -> Config:
  return dataclasses.replace(base, **dict(strategy.cfg_overrides))


def _param_spec(model: str, strategy: _Strategy, name: str, cfg: Config) -> P:
  """A stack's rows (with virtual stages: each chunk's rows) over the layer axis."""
  spec = strategy.param_spec(model, name)
  if not is_stacked(name):
    return spec
  chunks = (None,) if cfg.virtual_stages > 1 else ()
  return P(*chunks, strategy.layer_axis, *spec)


def _in_specs(model: str, strategy: _Strategy, cfg: Config) -> tuple:
  return ((strategy.token_spec, strategy.token_spec)
          + tuple(_param_spec(model, strategy, n, cfg) for n, _ in param_specs(model, cfg)))


@functools.cache
def _seq_fn(model: str, cfg: Config) -> Callable:
  """One sequential function per (model, sizes), shared by its cases, so jit
  traces and compiles it once (and GSPMD cases differ only in shardings)."""
  return loss_fn(model, cfg)


def _seq_args(model, cfg):
  return [jax.ShapeDtypeStruct(s, d) for s, d in arg_shapes(model, cfg)]


def _dist_args(model, cfg, mesh, specs):
  return [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
          for (s, d), spec in zip(arg_shapes(model, cfg), specs)]


def _ident(*parts):
  return "_".join(parts)


def _shard_map_case(model, strategy, cfg, variant, par, bug=None,
                    bug_primitive=None, check_vma=True) -> Case:
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _in_specs(model, strategy, cfg)
  local = loss_fn(model, cfg, par, name=_ident(model, strategy.name, variant))
  dist_fn = shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(),
                      check_vma=check_vma)
  return Case(name=f"{model}/{strategy.name}/shard_map/{variant}",
              seq_fn=_seq_fn(model, cfg), dist_fn=dist_fn,
              seq_args=_seq_args(model, cfg),
              dist_args=_dist_args(model, cfg, mesh, specs), mesh=mesh,
              style="shard_map", bug=bug, bug_primitive=bug_primitive,
              relation=strategy.relation)


def _gspmd_case(model, strategy, cfg) -> Case:
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _specs(model, strategy, cfg)
  seq_fn = _seq_fn(model, cfg)
  return Case(name=f"{model}/{strategy.name}/gspmd/ok", seq_fn=seq_fn,
              dist_fn=seq_fn, seq_args=_seq_args(model, cfg),
              dist_args=_dist_args(model, cfg, mesh, specs), mesh=mesh,
              style="gspmd", bug=None, bug_primitive=None,
              out_shardings=NamedSharding(mesh, P()),
              in_shardings=tuple(NamedSharding(mesh, s) for s in specs))


def _gspmd_zigzag_case(model, cfg, grad: bool = False, variant: str = "ok", bug=None,
                       bug_primitive=None, **tables) -> Case:
  """Zig-zag context parallelism under GSPMD: the batch split over the 4 ranks
  of "cp" as the loader orders it (the case's relation, in XLA's atomic axis
  name), the model reading positions and mask from zig-zag tables
  (``_zigzag_tables_par``); ``grad``: its training step."""
  strategy = CP_ZIGZAG_LOADED
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _in_specs(model, strategy, cfg)
  name = f"{strategy.name}_grad" if grad else strategy.name
  seq_fn = _seq_fn(model, cfg)
  dist_fn = loss_fn(model, cfg, _zigzag_tables_par(**tables), name=_ident(model, name, variant))
  shard = lambda spec: NamedSharding(mesh, spec)
  out_shardings = shard(P())
  if grad:
    n_params = len(param_specs(model, cfg))
    seq_fn = _named(_loss_and_grads(seq_fn, n_params), _ident(model, name, "seq"))
    dist_fn = _named(_loss_and_grads(dist_fn, n_params), _ident(model, name, variant))
    out_shardings = (shard(P()), tuple(shard(spec) for spec in specs[2:]))
  return Case(name=f"{model}/{name}/gspmd/{variant}", seq_fn=seq_fn, dist_fn=dist_fn,
              seq_args=_seq_args(model, cfg), dist_args=_dist_args(model, cfg, mesh, specs),
              mesh=mesh, style="gspmd", bug=bug, bug_primitive=bug_primitive,
              out_shardings=out_shardings, in_shardings=tuple(shard(spec) for spec in specs),
              relation=_ZIGZAG_BATCH.replace("=cp ", "=a0 "))


def _gspmd_gpipe_case(model, cfg, variant: str = "ok", bug=None, bug_primitive=None,
                      fori: bool = False, tp: bool = False, circular: bool = False,
                      **seeded) -> Case:
  """GPipe under GSPMD (``_gspmd_gpipe_stages``): GPipe's 4 stages and 4
  microbatches, its stacks split over "pp" by layer (``fori``: its steps
  under ``lax.fori_loop``; ``tp``: 2 stages, each weight also split over
  "tp" as Megatron's, XLA deciding the rest; ``circular``: MaxText's circular
  pipeline, ``_gspmd_circular_stages``, the 8 layers as 2 repeats of one
  layer per stage); ``seeded``: the bug's hooks."""
  strategy = (PP_TP_GPIPE if tp else GPIPE_FORI if fori else GPIPE)
  if circular:
    strategy = dataclasses.replace(strategy, name=strategy.name.replace("gpipe", "circular"),
                                   cfg_overrides=tuple(dict(strategy.cfg_overrides,
                                                            virtual_stages=2).items()))
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _in_specs(model, strategy, cfg)
  if circular:
    par = Parallel(run_chunks=_gspmd_circular_stages(mesh, "pp", 4, fori=fori, **seeded))
  else:
    par = Parallel(run_stack=_gspmd_gpipe_stages(mesh, "pp", 4, fori=fori, **seeded))
  dist_fn = loss_fn(model, cfg, par, name=_ident(model, strategy.name, "gspmd", variant))
  shard = lambda spec: NamedSharding(mesh, spec)
  return Case(name=f"{model}/{strategy.name}/gspmd/{variant}", seq_fn=_seq_fn(model, cfg),
              dist_fn=dist_fn, seq_args=_seq_args(model, cfg),
              dist_args=_dist_args(model, cfg, mesh, specs), mesh=mesh, style="gspmd", bug=bug,
              bug_primitive=bug_primitive, out_shardings=shard(P()),
              in_shardings=tuple(shard(spec) for spec in specs), scheduled=True)


def _partitioner_bug(model, strategy: _Strategy, cfg, grad: bool, variant: str, edit,
                     bug: str, bug_primitive: str) -> Case:
  """``strategy``'s GSPMD program (its training step with ``grad``) with XLA's
  per-device module edited by ``edit`` (``partitioner_bugs.py``)."""
  case = (_grad_case if grad else _gspmd_case)(model, strategy, cfg)
  return dataclasses.replace(case, name=case.name.replace("/ok", f"/{variant}"), bug=bug,
                             bug_primitive=bug_primitive, dist_edit=edit)


def _loss_and_grads(fn, n_params: int) -> Callable:
  """``value_and_grad`` of ``fn(tokens, labels, *params)`` in every parameter."""
  return jax.value_and_grad(fn, argnums=tuple(range(2, 2 + n_params)))


def _named(fn, name: str) -> Callable:
  """``fn`` as a plain function called ``name`` (the lowered module's name)."""
  def named(*args):
    return fn(*args)
  named.__name__ = named.__qualname__ = name
  return named


def _grad_case(model, strategy, cfg, remat: Optional[str] = None) -> Case:
  """GSPMD's training step: the sequential loss and gradients, jitted with
  shardings.  ``remat``: the per-device program's scanned layer runs under
  ``jax.checkpoint`` with this policy (``models.REMAT_POLICIES``)."""
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _specs(model, strategy, cfg)
  n_params = len(param_specs(model, cfg))
  seq_fn = _named(_loss_and_grads(_seq_fn(model, cfg), n_params),
                  _ident(model, strategy.name, "grad"))
  dist_fn, name = seq_fn, strategy.name
  if remat is not None:
    name = _remat_name(name, remat)
    dist_fn = _named(_loss_and_grads(loss_fn(model, cfg, dataclasses.replace(
        SEQUENTIAL, remat=remat)), n_params), _ident(model, name, "grad"))
  shard = lambda s: NamedSharding(mesh, s)
  return Case(name=f"{model}/{name}_grad/gspmd/ok", seq_fn=seq_fn,
              dist_fn=dist_fn, seq_args=_seq_args(model, cfg),
              dist_args=_dist_args(model, cfg, mesh, specs), mesh=mesh,
              style="gspmd", bug=None, bug_primitive=None,
              out_shardings=(shard(P()), tuple(shard(s) for s in specs[2:])),
              in_shardings=tuple(shard(s) for s in specs))


# FSDP / ZeRO-3: every parameter whose leading dim divides is sharded on it
# over "dp" and all-gathered just before use; the batch is split over "dp" too.
FSDP = _Strategy("fsdp", (4,), ("dp",), P("dp", None), _no_param_specs, _dp_par,
                 (("batch", 4),), weight_axis="dp")


def _hsdp_par(loss_axes=("dp", "fsdp")):
  """The loss averaged over ``loss_axes`` (both, or the seeded bug's one)."""
  return Parallel(combine_loss=_pmean_of_mean(loss_axes))


# HSDP, hybrid sharded data parallel (PyTorch FSDP's HYBRID_SHARD; MaxText's
# data and fsdp axes): the batch split over both axes of a 2 x 4 mesh, each
# weight sharded over "fsdp" only, as FSDP's over "dp".  A weight is gathered
# within its group of four, and its gradient summed over the group and over
# the two replicas of each shard.
HSDP = _Strategy("hsdp", (2, 4), ("dp", "fsdp"), P(("dp", "fsdp"), None), _no_param_specs,
                 _hsdp_par, (("batch", 8),), weight_axis="fsdp")


def _fsdp_spec(shape, strategy: _Strategy = FSDP) -> P:
  """Split on the leading dim over the strategy's weight axis, if it divides."""
  n = strategy.weight_shards
  return P(strategy.weight_axis, *([None] * (len(shape) - 1))) \
      if shape and shape[0] % n == 0 else P(*([None] * len(shape)))


def _fsdp_specs(model, cfg, strategy: _Strategy = FSDP) -> tuple:
  """Tokens as the strategy splits them; every weight on its own leading dim
  (a layer stack's rows whole) over the weight axis, where its size divides."""
  return (strategy.token_spec, strategy.token_spec) + tuple(
      P(None, *_fsdp_spec(s[1:], strategy)) if is_stacked(n) else _fsdp_spec(s, strategy)
      for n, s in param_specs(model, cfg))


# FSDP x TP (MaxText's fsdp and tensor axes): Megatron's specs over "tp", and
# each weight also split over "dp" on the first dim TP leaves whole that |dp|
# divides (a stack's layer dim kept whole).  XLA gathers the weights where
# they are used and reduce-scatters their gradients; shard_map does by hand.
FSDP_TP = _Strategy("fsdp_tp", (2, 4), ("dp", "tp"), P("dp", None), _tp_param_spec, _dp_tp_par,
                    weight_axis="dp")


def _hsdp_tp_par():
  """Megatron TP, the loss averaged over both data axes."""
  return _tp_par(combine=_pmean_of_mean(("dp", "fsdp")))


# HSDP x TP (MaxText's data, fsdp and tensor axes; 2 x 2 x 2): the batch over
# "dp" x "fsdp", Megatron's specs over "tp", each weight also split over
# "fsdp" as FSDP x TP's over "dp".
HSDP_TP = _Strategy("hsdp_tp", (2, 2, 2), ("dp", "fsdp", "tp"), P(("dp", "fsdp"), None),
                    _tp_param_spec, _hsdp_tp_par, (("batch", 4),), weight_axis="fsdp")


def _fsdp_tp_specs(model, cfg, strategy: _Strategy = FSDP_TP) -> tuple:
  axis = strategy.weight_axis
  n = strategy.weight_shards
  specs = []
  for name, shape in param_specs(model, cfg):
    lead = 1 if is_stacked(name) else 0
    layer = list(_tp_param_spec(model, name))
    layer += [None] * (len(shape) - lead - len(layer))
    free = next((d for d, a in enumerate(layer) if a is None and shape[lead + d] % n == 0),
                None)
    if free is not None:
      layer[free] = axis
    specs.append(P(*[None] * lead, *layer))
  return (strategy.token_spec, strategy.token_spec) + tuple(specs)


def _fsdp_tp_case(model, cfg, variant="ok", wrong_dim=False, bug=None, bug_primitive=None,
                  grad=False, strategy=FSDP_TP, gather_axis=None) -> Case:
  """shard_map FSDP x TP (or HSDP x TP): each weight all-gathered over the
  weight axis along the dim its spec splits over it (``wrong_dim``: along the
  next dim, a seeded bug, made shape-correct by a reshape; ``gather_axis``:
  over this axis instead, another, with the checker off), then Megatron TP
  over "tp" as ``dp_tp``.  ``grad``: value_and_grad of the step inside
  shard_map (the gathers transpose to reduce-scatters)."""
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _fsdp_tp_specs(model, cfg, strategy)
  label = _ident(model, strategy.name, "grad" if grad else variant)
  local = loss_fn(model, cfg, strategy.par(), name=label)
  axis = strategy.weight_axis
  n = strategy.weight_shards

  def gather(p, spec):
    if axis not in spec:
      return p
    d = list(spec).index(axis)
    if not wrong_dim or d + 1 == p.ndim:
      return lax.all_gather(p, gather_axis or axis, axis=d, tiled=True)
    shape = p.shape[:d] + (p.shape[d] * n,) + p.shape[d + 1:]
    return lax.all_gather(p, axis, axis=d + 1, tiled=True).reshape(shape)

  def body(tokens, labels, *params):
    return local(tokens, labels, *[gather(p, spec) for p, spec in zip(params, specs[2:])])
  body.__name__ = body.__qualname__ = label
  return _gathering_case(model, cfg, strategy.name + ("_grad" if grad else ""), mesh, specs,
                         body, grad, variant, bug, bug_primitive, gather_axis is None)


def _specs(model, strategy, cfg) -> tuple:
  with_tp = {FSDP_TP.name: FSDP_TP, HSDP_TP.name: HSDP_TP}.get(strategy.name)
  if with_tp is not None:
    return _fsdp_tp_specs(model, cfg, with_tp)
  # FSDP or HSDP itself, or a variant of either (scanned, with AdamW, ...)
  gathering = {FSDP.name: FSDP, HSDP.name: HSDP}.get(strategy.name.split("_")[0])
  if gathering is not None:
    return _fsdp_specs(model, cfg, gathering)
  return _in_specs(model, strategy, cfg)


def _fsdp_case(model, cfg, variant="ok", gather_dim=0, bug=None, bug_primitive=None,
               scan=False, grad=False, take=False, ungathered=(), strategy=FSDP,
               par: Optional[Parallel] = None, check_vma=True) -> Case:
  """shard_map FSDP: gather each sharded weight (along ``gather_dim``: 0 is right;
  1 is the seeded bug, made shape-correct by a reshape) and run the dp loss.
  ``take``: tokens embedded by ``jnp.take``; the weights named in ``ungathered``
  are used as each rank holds them (the seeded bug: a lookup in a quarter of
  the table).

  ``scan``: layers stacked under ``lax.scan``, each layer's weights sharded on
  their own leading dim and gathered inside the scanned layer (ZeRO-3 proper);
  the rest gathered up front.  ``grad``: value_and_grad of the step inside
  shard_map; the gathers transpose to reduce-scatters, so every gradient comes
  out sharded like its parameter.

  ``strategy``: FSDP, or HSDP (weights gathered over "fsdp", the batch split
  over both axes).  ``par``: other per-device hooks than the strategy's (a
  seeded bug; ``check_vma=False`` lets its loss vary where it should not)."""
  cfg = _cfg(strategy, dataclasses.replace(cfg, scan_layers=scan,
                                          embedding="take" if take else cfg.embedding))
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  axis = strategy.weight_axis
  names = [n for n, _ in param_specs(model, cfg)]
  shapes = [s for _, s in param_specs(model, cfg)]
  specs = _fsdp_specs(model, cfg, strategy)
  layer_shapes = {base_name(n): s[1:] for n, s in zip(names, shapes) if is_stacked(n)}
  name = strategy.name + ("_take" if take else "")
  kind = ("scan_" if scan else "") + ("grad" if grad else "")
  label = _ident(model, name, kind or variant)

  def gather(p, shape, param=None):
    if _fsdp_spec(shape, strategy)[0] is None or param in ungathered:
      return p
    if gather_dim == 0 or len(shape) < 2:
      return lax.all_gather(p, axis, axis=0, tiled=True)
    return lax.all_gather(p, axis, axis=1, tiled=True).reshape(shape)

  par = par or strategy.par()
  if scan:
    par = dataclasses.replace(par, layer_weight=lambda n, w: gather(w, layer_shapes[n]))
  local = loss_fn(model, cfg, par, name=label)

  def body(tokens, labels, *params):
    return local(tokens, labels, *[p if is_stacked(n) else gather(p, s, n)
                                   for p, n, s in zip(params, names, shapes)])
  body.__name__ = body.__qualname__ = label
  return _gathering_case(model, cfg, name + ("_scan" if scan else "") + ("_grad" if grad else ""),
                         mesh, specs, body, grad, variant, bug, bug_primitive, check_vma)


def _gathering_case(model, cfg, strategy: str, mesh, specs, body, grad, variant, bug,
                    bug_primitive, check_vma=True) -> Case:
  """A shard_map case of ``body`` (per device, gathering the weights it holds
  split; its name is the lowered module's): the loss, or with ``grad``
  value_and_grad in every parameter, the gradients laid out like their
  parameters.  The sequential step is named after it, with "_seq"."""
  n_params = len(specs) - 2
  seq_fn, out_specs = _seq_fn(model, cfg), P()
  if grad:
    seq_fn = _named(_loss_and_grads(seq_fn, n_params), body.__name__ + "_seq")
    body = _loss_and_grads(body, n_params)
    out_specs = (P(), tuple(specs[2:]))
  dist_fn = shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=check_vma)
  return Case(name=f"{model}/{strategy}/shard_map/{variant}", seq_fn=seq_fn,
              dist_fn=dist_fn, seq_args=_seq_args(model, cfg),
              dist_args=_dist_args(model, cfg, mesh, specs), mesh=mesh,
              style="shard_map", bug=bug, bug_primitive=bug_primitive)


def _shard_map_grad_case(model, strategy, cfg, variant="ok", check_vma=True, bug=None,
                         bug_primitive=None, sgd_step=False, kind=None,
                         local_step=None) -> Case:
  """A training step's forward and backward inside shard_map: value_and_grad of
  the local loss.  With the varying-axes checker on, jax's transpose of psum
  sums the gradients of replicated parameters; with it off (``check_vma=False``,
  the old semantics) every rank's psum transposes to another psum and those
  gradients come out |tp| times too large: the classic double-counted gradient.

  ``sgd_step``: return ``(loss, params - lr * grads)`` instead, one optimizer
  step with each new parameter sharded like the old one.  ``local_step``: the
  per-device step made of the local value_and_grad (gradient accumulation),
  named ``kind``."""
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _in_specs(model, strategy, cfg)
  n_params = len(param_specs(model, cfg))
  vg_seq = _loss_and_grads(_seq_fn(model, cfg), n_params)
  local = loss_fn(model, cfg, strategy.par(), name=_ident(model, strategy.name, "grad"))
  vg_local = _loss_and_grads(local, n_params)

  if sgd_step:
    vg_seq, vg_local = _sgd(vg_seq), _sgd(vg_local)
  if local_step is not None:
    vg_local = local_step(vg_local)
  kind = kind or ("sgd" if sgd_step else "grad")
  seq_fn = _named(vg_seq, _ident(model, strategy.name, f"{kind}_seq"))
  dist_fn = shard_map(vg_local, mesh=mesh, in_specs=specs, out_specs=(P(), tuple(specs[2:])),
                      check_vma=check_vma)
  return Case(name=f"{model}/{strategy.name}_{kind}/shard_map/{variant}", seq_fn=seq_fn,
              dist_fn=dist_fn, seq_args=_seq_args(model, cfg),
              dist_args=_dist_args(model, cfg, mesh, specs), mesh=mesh,
              style="shard_map", bug=bug, bug_primitive=bug_primitive,
              relation=strategy.relation)


# Outputs of bfloat16 programs agree to about two digits: each rounds its sums,
# the per-device one partial sums added in another order.
BF16_TOLERANCE = 3e-2


def _mixed_precision(strategy: _Strategy) -> _Strategy:
  """``strategy`` with the model run in bfloat16 (``Config.compute_dtype``):
  the float32 parameters cast where the loss reads them, so both programs
  convert, and the per-device one sums bfloat16 partial sums."""
  return dataclasses.replace(strategy, name=f"{strategy.name}_bf16",
                             cfg_overrides=strategy.cfg_overrides +
                             (("compute_dtype", "bfloat16"),))


def _looked_up(strategy: _Strategy) -> _Strategy:
  """``strategy`` with tokens embedded by ``jnp.take`` (a gather; its gradient a
  scatter-add) instead of a one-hot matmul."""
  return dataclasses.replace(strategy, name=f"{strategy.name}_take",
                             cfg_overrides=strategy.cfg_overrides + (("embedding", "take"),))


def _optax_labels(strategy: _Strategy) -> _Strategy:
  """``strategy`` (a ``*_take`` one) with the cross entropy's labels picked by
  ``jnp.take_along_axis`` (``Config.label_pick``)."""
  return dataclasses.replace(strategy, name=strategy.name.replace("_take", "_optax"),
                             cfg_overrides=strategy.cfg_overrides + (("label_pick", "take"),))


def _scanned(strategy: _Strategy) -> _Strategy:
  return dataclasses.replace(strategy, name=f"{strategy.name}_scan",
                             cfg_overrides=strategy.cfg_overrides + (("scan_layers", True),))


def _remat_name(name: str, policy: str) -> str:
  """``tp_scan`` under remat: ``tp_scan_remat`` (nothing saved) or ``tp_scan_remat_dots``."""
  return name + ("_remat" if policy == "nothing" else f"_remat_{policy}")


def _remat(scanned: _Strategy, policy: str, par: Optional[Callable[[], Parallel]] = None
           ) -> _Strategy:
  """A scanned strategy whose per-device layer runs under ``jax.checkpoint``
  with ``policy`` (``models.REMAT_POLICIES``); the sequential program keeps
  its activations.  ``par``: the per-device hooks (default: the strategy's)."""
  hooks = par or scanned.par
  return dataclasses.replace(scanned, name=_remat_name(scanned.name, policy),
                             par=lambda: dataclasses.replace(hooks(), remat=policy))


SGD_LEARNING_RATE = np.float32(0.1)


def _sgd(value_and_grad):
  """(tokens, labels, *params) -> (loss, new params) after one SGD step."""
  def step(tokens, labels, *params):
    loss, grads = value_and_grad(tokens, labels, *params)
    return loss, tuple(p - SGD_LEARNING_RATE * g for p, g in zip(params, grads))
  return step


def _split_axes(spec: P) -> tuple[str, ...]:
  """The mesh axes a PartitionSpec splits its tensor over."""
  return tuple(a for entry in spec if entry is not None
               for a in (entry if isinstance(entry, tuple) else (entry,)))


def _adamw_args(model, strategy, cfg, mesh, specs, state, state_specs):
  """What every AdamW training step shares: the sequential step (plain optax),
  its arguments, the per-device arguments (parameters as ``specs``, the
  optimizer's state leaves as ``state_specs``) and the arguments drawn as
  magnitudes (Adam's second moments)."""
  n_params = len(specs) - 2
  seq_fn = _named(training.train_step(_loss_and_grads(_seq_fn(model, cfg), n_params),
                                      training.optimizer(), n_params, state.tree),
                  _ident(model, strategy.name, "adamw_seq"))
  seq_args = _seq_args(model, cfg) + [jax.ShapeDtypeStruct(l.shape, l.dtype)
                                      for l in state.leaves]
  dist_args = _dist_args(model, cfg, mesh, specs) + [
      jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=NamedSharding(mesh, s))
      for l, s in zip(state.leaves, state_specs)]
  nonnegative = tuple(2 + n_params + i for i in state.second_moments)
  return seq_fn, seq_args, dist_args, nonnegative


def _jitted_step_case(name, seq_fn, seq_args, dist_args, mesh, in_specs, out_specs,
                      nonnegative) -> Case:
  """The sequential training step itself, jitted with ``in_specs`` and
  ``out_specs`` as shardings: XLA partitions it."""
  shard = lambda s: NamedSharding(mesh, s)
  return Case(name=name, seq_fn=seq_fn, dist_fn=seq_fn, seq_args=seq_args,
              dist_args=dist_args, mesh=mesh, style="gspmd", bug=None, bug_primitive=None,
              out_shardings=jax.tree.map(shard, out_specs),
              in_shardings=tuple(shard(s) for s in in_specs), nonnegative_args=nonnegative)


def _adamw_case(model, strategy, cfg, style, variant="ok", clip=None, bug=None,
                bug_primitive=None, check_vma=True) -> Case:
  """One training step as users run it (``training.py``): value_and_grad, optax's
  ``clip_by_global_norm``, ``adamw``; returns the loss, the new parameters and
  the new optimizer state (Adam's moments sharded like their parameters).
  ``clip(split axes per parameter)``: the shard_map program's clipping
  transformation (default: the global norm rebuilt from the tiles)."""
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _specs(model, strategy, cfg)
  state = training.state_leaves(training.optimizer(), arg_shapes(model, cfg)[2:])
  state_specs = tuple(P() if i is None else specs[2 + i] for i in state.owners)
  seq_fn, seq_args, dist_args, nonnegative = _adamw_args(model, strategy, cfg, mesh, specs,
                                                         state, state_specs)
  n_params, state_tree = len(specs) - 2, state.tree
  out_specs = (P(), tuple(specs[2:]), state_specs)
  name = f"{model}/{strategy.name}_adamw/{style}/{variant}"
  if style == "gspmd":
    return _jitted_step_case(name, seq_fn, seq_args, dist_args, mesh, specs + state_specs,
                             out_specs, nonnegative)
  split = [_split_axes(s) for s in specs[2:]]
  tx_dist = training.optimizer((clip or training.clip_by_sharded_global_norm)(
      training.MAX_GRAD_NORM, split))
  local = loss_fn(model, cfg, strategy.par(), name=_ident(model, strategy.name, "adamw"))
  dist_fn = shard_map(training.train_step(_loss_and_grads(local, n_params), tx_dist, n_params,
                                          state_tree),
                      mesh=mesh, in_specs=specs + state_specs, out_specs=out_specs,
                      check_vma=check_vma)
  return Case(name=name, seq_fn=seq_fn, dist_fn=dist_fn, seq_args=seq_args,
              dist_args=dist_args, mesh=mesh, style="shard_map", bug=bug,
              bug_primitive=bug_primitive, nonnegative_args=nonnegative)


# ZeRO stages 1 and 2 (zero.py): data parallel on 4 ranks, parameters whole on
# every rank, Adam's moments tiled over "dp" along each parameter's first dim
# that 4 divides.
ZERO = dataclasses.replace(_STRATEGIES["dp"], name="zero")


def _zero_case(model, cfg, style, variant="ok", bug=None, bug_primitive=None,
               **step_bug) -> Case:
  """One AdamW step under ZeRO: the sequential step is ``_adamw_case``'s; the
  per-device one reduce-scatters the gradients, updates its tiles and
  all-gathers them (shard_map), or is that step jitted with the moments
  sharded over "dp" and everything else replicated (GSPMD: XLA decides).
  ``step_bug``: ``zero.zero_step``'s seeded bugs."""
  cfg = _cfg(ZERO, cfg)
  mesh = _mesh(ZERO.mesh_shape, ZERO.axis_names)
  specs = _specs(model, ZERO, cfg)
  shapes = [s for s, _ in arg_shapes(model, cfg)[2:]]
  dims = zero.shard_dims(shapes, mesh.shape["dp"])
  tiled = [P() if d is None else P(*([None] * d), "dp") for d in dims]
  state = training.state_leaves(training.optimizer(), arg_shapes(model, cfg)[2:])
  state_specs = tuple(P() if i is None else tiled[i] for i in state.owners)
  seq_fn, seq_args, dist_args, nonnegative = _adamw_args(model, ZERO, cfg, mesh, specs,
                                                         state, state_specs)
  out_specs = (P(), tuple(specs[2:]), state_specs)
  name = f"{model}/zero_adamw/{style}/{variant}"
  if style == "gspmd":
    return _jitted_step_case(name, seq_fn, seq_args, dist_args, mesh, specs + state_specs,
                             out_specs, nonnegative)
  tx = training.optimizer(training.clip_by_sharded_global_norm(
      training.MAX_GRAD_NORM, [() if d is None else ("dp",) for d in dims]))
  local = loss_fn(model, cfg, _dp_par(combine=lambda axis: jnp.mean),
                  name=_ident(model, "zero_adamw"))
  step = zero.zero_step(_loss_and_grads(local, len(shapes)), tx, len(shapes), state.tree,
                        dims, "dp", **step_bug)
  dist_fn = shard_map(step, mesh=mesh, in_specs=specs + state_specs, out_specs=out_specs,
                      check_vma=False)  # (zero.py: an all-gather's result types as varying)
  return Case(name=name, seq_fn=seq_fn, dist_fn=dist_fn, seq_args=seq_args,
              dist_args=dist_args, mesh=mesh, style="shard_map", bug=bug,
              bug_primitive=bug_primitive, nonnegative_args=nonnegative)


def _accumulated(value_and_grad, microbatches: int, divide: bool = True):
  """Gradient accumulation: each rank's batch in ``microbatches`` slices, the
  losses and gradients of each added up and divided by their number
  (``divide=False``: the seeded bug, every gradient that many times too large)."""
  def step(tokens, labels, *params):
    n = tokens.shape[0] // microbatches
    loss, grads = 0.0, None
    for m in range(microbatches):
      rows = slice(m * n, (m + 1) * n)
      l, g = value_and_grad(tokens[rows], labels[rows], *params)
      loss = loss + l
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    scale = np.float32(microbatches if divide else 1)
    return loss / np.float32(microbatches), jax.tree.map(lambda g: g / scale, grads)
  return step


# The meshes hand-written schedules run on: their strategy (mesh, specs, sizes)
# and the hooks inside each stage.  "pp": GPipe's 4 stages; "pp_tp": 2 stages
# with Megatron TP inside (PP_TP_GPIPE's); "dp_pp_tp": those on each half of
# the batch (2 x 2 x 2, 4 microbatches per dp rank), the loss averaged over dp.
def _schedule_mesh(mesh: str) -> tuple[_Strategy, Callable[[], Parallel]]:
  if mesh == "pp":
    return GPIPE, lambda: SEQUENTIAL
  if mesh == "pp_tp":
    return PP_TP_GPIPE, _tp_par
  assert mesh == "dp_pp_tp", mesh
  return _with_batch(DP_PP_TP, 8), _dp_tp_par


def _one_f_one_b_case(model, cfg, variant="ok", bug=None, bug_primitive=None,
                      buffered=False, mesh="pp", par=None, scan=False) -> Case:
  """A training step under the 1F1B schedule (``one_f_one_b.py``) on the
  stages of ``_schedule_mesh(mesh)``.  ``par``: the stages' hooks, if not the
  mesh's (a seeded bug inside the stages).  ``scan``: each stage scans its
  layers, the sequential model all of them."""
  base, base_par = _schedule_mesh(mesh)
  if scan:
    base = _stages_scanned(base, base_par)
  name = f"{mesh}_1f1b" + ("_buffered" if buffered else "") + ("_scan" if scan else "")
  schedule_bug = variant if variant in one_f_one_b.BUGS else None
  return _schedule_case(
      model, dataclasses.replace(base, name=name), cfg, variant, bug, bug_primitive,
      lambda cfg: one_f_one_b.one_f_one_b_step(
          model, cfg, "pp", 4, bug=schedule_bug, buffered=buffered, par=par or base_par()))


def _interleaved_case(model, cfg, variant="ok", bug=None, bug_primitive=None,
                      indexed=False, mesh="pp", par=None, scan=False) -> Case:
  """A training step under the interleaved 1F1B schedule
  (``one_f_one_b.interleaved_one_f_one_b_step``) on the stages of
  ``_schedule_mesh(mesh)``, the layers as 2 virtual stages (chunks) of one
  layer per stage: GPipe's 8 layers on 4 stages, the stacks held as
  ``[2, 4, ...]`` with their second dim split over "pp" (on 2 stages, 4
  layers as ``[2, 2, ...]``).  ``indexed``: saved inputs and chunk weights
  read at rows computed from the stage.  ``par``: the stages' hooks, if not
  the mesh's.  ``scan``: each chunk scans its layers, the sequential model
  all of them."""
  base, base_par = _schedule_mesh(mesh)
  if scan:
    base = _stages_scanned(base, base_par)
  name = f"{mesh}_interleaved_1f1b" + ("_indexed" if indexed else "") + ("_scan" if scan else "")
  strategy = dataclasses.replace(base, name=name, cfg_overrides=tuple(
      dict(base.cfg_overrides, virtual_stages=2).items()))
  schedule_bug = variant if variant in one_f_one_b.INTERLEAVED_BUGS else None
  return _schedule_case(
      model, strategy, cfg, variant, bug, bug_primitive,
      lambda cfg: one_f_one_b.interleaved_one_f_one_b_step(
          model, cfg, "pp", 4, bug=schedule_bug, indexed=indexed, par=par or base_par()))


def _schedule_case(model, strategy, cfg, variant, bug, bug_primitive, make_step) -> Case:
  """A training step written by hand (``make_step(cfg)``: per device,
  ``(tokens, labels, *params) -> (loss, grads)``) inside shard_map; the
  sequential step is ``value_and_grad`` of the plain model on the whole batch."""
  cfg = _cfg(strategy, cfg)
  mesh = _mesh(strategy.mesh_shape, strategy.axis_names)
  specs = _in_specs(model, strategy, cfg)
  n_params = len(param_specs(model, cfg))
  seq_fn = _named(_loss_and_grads(_seq_fn(model, cfg), n_params),
                  _ident(model, strategy.name, "grad_seq"))
  dist_fn = shard_map(_named(make_step(cfg), _ident(model, strategy.name, "grad")), mesh=mesh,
                      in_specs=specs, out_specs=(P(), tuple(specs[2:])))
  return Case(name=f"{model}/{strategy.name}_grad/shard_map/{variant}", seq_fn=seq_fn,
              dist_fn=dist_fn, seq_args=_seq_args(model, cfg),
              dist_args=_dist_args(model, cfg, mesh, specs), mesh=mesh,
              style="shard_map", bug=bug, bug_primitive=bug_primitive)


def _with_batch(strategy: _Strategy, batch: int) -> _Strategy:
  return dataclasses.replace(strategy, cfg_overrides=tuple(
      dict(strategy.cfg_overrides, batch=batch).items()))


def _accumulation_case(model, strategy, cfg, microbatches=2, variant="ok", divide=True,
                       bug=None, bug_primitive=None) -> Case:
  """A training step with gradient accumulation inside shard_map: the
  sequential step is ``value_and_grad`` on the whole batch."""
  return _shard_map_grad_case(model, strategy, cfg, variant, bug=bug,
                              bug_primitive=bug_primitive, kind=f"accum{microbatches}",
                              local_step=lambda vg: _accumulated(vg, microbatches, divide))


@functools.cache
def _in_both_styles(model, strategy: _Strategy, cfg, grad: bool) -> list[Case]:
  """``strategy``'s correct programs: shard_map and GSPMD forward, and with
  ``grad`` their training steps."""
  cases = [_shard_map_case(model, strategy, cfg, "ok", strategy.par()),
           _gspmd_case(model, strategy, cfg)]
  if grad:
    cases += [_shard_map_grad_case(model, strategy, cfg), _grad_case(model, strategy, cfg)]
  return cases


def _build(cfg: Config, grad: bool) -> tuple[Case, ...]:
  built = []
  for model in MODELS:
    for strategy in _STRATEGIES.values():
      built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
  for model in MODELS:
    for scan, grad in itertools.product((False, True), (False, True) if grad else (False,)):
      built.append(_fsdp_case(model, cfg, scan=scan, grad=grad))
    # GSPMD: the sequential function with the FSDP shardings; XLA decides.
    built.append(_gspmd_case(model, FSDP, cfg))
    if grad:
      built.append(_grad_case(model, FSDP, cfg))
  # FSDP x TP.  shard_map: weights all-gathered over "dp" by hand, Megatron
  # inside; the bug, a weight gathered along the wrong dim (GPT-2's embedding
  # table, read by the one-hot matmul).  GSPMD: XLA moves some weights' shards
  # round the axes of its refined 2 x 2 x 2 mesh by collective-permutes
  # (sharding.py's renaming).
  for model in MODELS:
    built.append(_fsdp_tp_case(model, cfg))
    built.append(_gspmd_case(model, FSDP_TP, cfg))
    if grad:
      built.append(_fsdp_tp_case(model, cfg, grad=True))
      built.append(_grad_case(model, FSDP_TP, cfg))
  built.append(_fsdp_tp_case("gpt2", cfg, "wrong_gather_dim", wrong_dim=True,
                             bug="wrong_gather_dim", bug_primitive="dot_general"))
  # The first matmul reading a weight gathered along the wrong dim (its rows
  # come out interleaved): GPT-2's one-hot embedding lookup.
  built.append(_fsdp_case("gpt2", cfg, "wrong_gather_dim", gather_dim=1,
                          bug="wrong_gather_dim", bug_primitive="dot_general"))
  # HSDP: shard_map (weights gathered over "fsdp" by hand) and GSPMD.  The
  # seeded bug, the loss averaged over the shard group only ("fsdp"): each
  # replica reports the loss of its half of the batch.
  # With scanned layers (shard_map: each layer's weights gathered inside the
  # scanned layer), and x TP on 2 x 2 x 2.
  for model in MODELS:
    for strategy in (HSDP, _scanned(HSDP), HSDP_TP):
      scan = strategy.name.endswith("_scan")
      for grad_step in (False, True) if grad else (False,):
        built.append(_fsdp_tp_case(model, cfg, grad=grad_step, strategy=strategy)
                     if strategy is HSDP_TP else
                     _fsdp_case(model, cfg, scan=scan, grad=grad_step, strategy=HSDP))
        built.append((_grad_case if grad_step else _gspmd_case)(model, strategy, cfg))
  for model, grad_step in (("gpt2", False), ("llama3", grad)):
    built.append(_fsdp_case(model, cfg, "loss_over_shard_group", strategy=HSDP,
                            par=_hsdp_par(loss_axes="fsdp"), check_vma=False, grad=grad_step,
                            bug="wrong_replica_groups", bug_primitive="output"))
  # HSDP x TP with the weights gathered over "dp" (the replicas) instead of
  # "fsdp": each rank gets two copies of its own shard.
  built.append(_fsdp_tp_case("llama3", cfg, "gathered_over_replicas", strategy=HSDP_TP,
                             gather_axis="dp", bug="wrong_axis", bug_primitive="dot_general"))
  for b in _bugs():
    built.append(_shard_map_case(b.model, _STRATEGIES[b.strategy], cfg, b.bug,
                                 b.par(), b.bug, b.bug_primitive, b.check_vma))
  # dp x tp x sp, both styles, forward and backward; the bug, RoPE positions
  # not offset per sequence shard (the offset now from a 2D partition id).
  for model in MODELS:
    built.extend(_in_both_styles(model, DP_SP, cfg, grad))
  built.append(_shard_map_case("llama3", DP_SP, cfg, "rope_no_offset",
                               _dp_sp_par(with_offset=False), "rope_no_offset", "iota"))
  for model in MODELS:
    for strategy in _STRATEGIES.values():
      built.append(_gspmd_case(model, strategy, cfg))
  # Mixture of experts under expert parallelism, and the wrong-rank dispatch.
  built.append(_shard_map_case("llama3", EP, cfg, "ok", EP.par()))
  built.append(_gspmd_case("llama3", EP, cfg))
  built.append(_shard_map_case("llama3", EP, cfg, "dispatch_to_wrong_rank",
                               _ep_par(_to_next_rank_experts), "dispatch_to_wrong_rank",
                               "dot_general"))
  # ... with Megatron TP for the attention (2 x 4), and the experts' outputs
  # summed over "tp" (a TP all-reduce where the MoE computed whole outputs):
  # reported at the residual add, 4 times the sequential value.
  built.extend(_in_both_styles("llama3", EP_TP, cfg, grad))
  built.append(_shard_map_case("llama3", EP_TP, cfg, "experts_summed_over_tp",
                               _ep_tp_par(from_experts=_experts_summed_over("tp")),
                               "replicas_summed", "add"))
  # With a capacity (tokens beyond it dropped), and the queue counted over
  # all of a rank's tokens instead of per group: the cumsum is the first
  # value no rank holds.
  built.append(_shard_map_case("llama3", EP_CAPACITY, cfg, "ok", EP_CAPACITY.par()))
  built.append(_gspmd_case("llama3", EP_CAPACITY, cfg))
  built.append(_shard_map_case("llama3", EP_CAPACITY, cfg, "slots_over_all_tokens",
                               _ep_par(expert_slots=_slots_over_all_my_tokens),
                               "slots_over_all_tokens", "reduce_window"))
  if grad:
    built.append(_shard_map_grad_case("llama3", EP_CAPACITY, cfg))
    built.append(_grad_case("llama3", EP_CAPACITY, cfg))
  # The router's experts picked by lax.top_k (Mixtral's router) instead of
  # arg-max rounds: forward and backward, both styles.
  built.extend(_in_both_styles("llama3", EP_TOP_K, cfg, grad))
  ep_scan = _scanned(EP)
  built.append(_shard_map_case("llama3", ep_scan, cfg, "ok", ep_scan.par()))
  built.append(_gspmd_case("llama3", ep_scan, cfg))
  if grad:
    built.append(_shard_map_grad_case("llama3", EP, cfg))
    built.append(_grad_case("llama3", EP, cfg))
    built.append(_shard_map_grad_case("llama3", ep_scan, cfg))
  # Pipeline parallelism, and activations sent to the wrong stage: the first
  # op of layer 2 (stage 1's first) meets its weights at stage 1 and its
  # input at stage 3: layernorm's / rmsnorm's first op reading both.
  for model in MODELS:
    built.append(_shard_map_case(model, PP, cfg, "ok", PP.par()))
  built.append(_shard_map_case("gpt2", PP, cfg, "wrong_permutation", _pp_par(shift=-1),
                               "wrong_permutation", "multiply"))
  built.append(_shard_map_case("llama3", PP, cfg, "wrong_permutation", _pp_par(shift=-1),
                               "wrong_permutation", "multiply"))
  # The rounds under lax.fori_loop (unrolled, ring_loops.py); and each stage
  # scanning its layers, the sequential model all 8 under one scan
  # (loop_split.py cuts it into the stages' loops, each proved by induction).
  for strategy in (PP_FORI, PP_SCAN):
    for model in MODELS:
      built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
      if grad:
        built.append(_shard_map_grad_case(model, strategy, cfg))
  # Bugs: activations flowing to the previous stage (met inside stage 1's
  # loop when it scans); trained with the checker off, the scanned stages'
  # cotangent 4 times too large where the backward loop writes a weight's
  # gradient row.
  built.append(_shard_map_case("llama3", PP_FORI, cfg, "wrong_permutation",
                               _pp_par(shift=-1, fori=True), "wrong_permutation", "multiply"))
  built.append(_shard_map_case("gpt2", PP_SCAN, cfg, "wrong_permutation",
                               _pp_par(shift=-1, scan=True), "wrong_permutation", "multiply"))
  if grad:
    built.append(_shard_map_grad_case("llama3", PP_SCAN, cfg, "double_counted_grad",
                                      check_vma=False, bug="double_counted_grad",
                                      bug_primitive="dynamic_update_slice"))
  # Forward+backward through the stages: the masked psum transposes to the
  # cotangent at the last stage and zeros elsewhere, each stage's gradient is
  # padded into its rows of the stacks; and one SGD step on top.
  if grad:
    for model in MODELS:
      built.append(_shard_map_grad_case(model, PP, cfg))
    built.append(_shard_map_grad_case("gpt2", PP, cfg, sgd_step=True))
    # Without the varying-axes checker the masked psum transposes to another
    # psum: every stage's cotangent is |pp| times too large.  GPT-2 meets it
    # where the tied embedding's two gradients are added; Llama-3 (untied) at
    # the embedding's gradient, also never summed over the stages.
    built.append(_shard_map_grad_case("gpt2", PP, cfg, "double_counted_grad", check_vma=False,
                                      bug="double_counted_grad", bug_primitive="add"))
    built.append(_shard_map_grad_case("llama3", PP, cfg, "double_counted_grad",
                                      check_vma=False, bug="double_counted_grad",
                                      bug_primitive="output"))
  # GPipe: 4 microbatches through the 4 stages (7 steps); the bug feeds
  # stage 0 microbatch t - 1 at step t, so the last is never cut from the
  # batch and the first op of stage 0 (layernorm's mean, rmsnorm's square)
  # cannot be put together from the pieces.
  # Backward: the bubbles' cotangents are zeros (zeros.py), each stage's rows
  # of a stacked gradient are its own (stages.py); and without the
  # varying-axes checker, every stage's cotangent |pp| times too large, met
  # where pp_grad's is.
  gpipe_bug_ops = (("gpt2", "reduce", "add"), ("llama3", "multiply", "output"))

  def trained_and_double_counted(model, strategy, doubled_at):
    return (_shard_map_grad_case(model, strategy, cfg),
            _shard_map_grad_case(model, strategy, cfg, "double_counted_grad",
                                 check_vma=False, bug="double_counted_grad",
                                 bug_primitive=doubled_at))

  for model, first_op, doubled_at in gpipe_bug_ops:
    built.append(_shard_map_case(model, GPIPE, cfg, "ok", GPIPE.par()))
    built.append(_shard_map_case(model, GPIPE, cfg, "microbatch_fed_late",
                                 Parallel(run_stack=_gpipe_stages("pp", 4, inject_late=1)),
                                 "microbatch_skipped", first_op))
    if grad:
      built.extend(trained_and_double_counted(model, GPIPE, doubled_at))
  # Each stage scanning its layers: each microbatch's loop proved by one
  # inductive step, and in training its transpose too (each layer's weight
  # gradient the sum of the microbatches', microbatch_loops.py; a bubble's
  # zero cotangent zero after the stage's loop, zeros.py); stage 0 fed the
  # microbatch of the step before; the cotangents |pp| times too large, met
  # where the backward loop writes a weight's gradient row.
  for model, first_op, _ in gpipe_bug_ops:
    built.append(_shard_map_case(model, GPIPE_SCAN, cfg, "ok", GPIPE_SCAN.par()))
    if grad:
      built.append(_shard_map_grad_case(model, GPIPE_SCAN, cfg))
  if grad:
    built.append(_shard_map_grad_case("gpt2", GPIPE_SCAN, cfg, "double_counted_grad",
                                      check_vma=False, bug="double_counted_grad",
                                      bug_primitive="dynamic_update_slice"))
  built.append(_shard_map_case("gpt2", GPIPE_SCAN, cfg, "microbatch_fed_late",
                               Parallel(run_stack=_gpipe_stages("pp", 4, inject_late=1,
                                                                scan=True)),
                               "microbatch_skipped", "slice"))
  # GPipe as the JAX pipelining examples write it: the batch reshaped into
  # microbatches, the outputs set into a buffer row by row (slabs.py); the
  # bug writes microbatch m's output at row m + 1, reported at the first op
  # reading the pipeline's output with the order the rows were put in.
  for model, first_op, doubled_at in gpipe_bug_ops:
    built.append(_shard_map_case(model, GPIPE_BUFFERED, cfg, "ok", GPIPE_BUFFERED.par()))
    if grad:
      built.append(_shard_map_grad_case(model, GPIPE_BUFFERED, cfg))
    built.append(_shard_map_case(
        model, GPIPE_BUFFERED, cfg, "output_misplaced",
        Parallel(run_stack=_gpipe_stages("pp", 4, buffered=True, misplaced=1)),
        "output_misplaced", first_op))
    # The same schedule's M + S - 1 = 7 steps under lax.fori_loop (unrolled,
    # ring_loops.py).  Its backward reads each step's mask (stage == 0) &
    # (t < M) at the transposed loop's counter, constants once unrolled.
    built.append(_shard_map_case(model, GPIPE_FORI, cfg, "ok", GPIPE_FORI.par()))
    built.append(_shard_map_case(
        model, GPIPE_FORI, cfg, "output_misplaced",
        Parallel(run_stack=_gpipe_fori_stages("pp", 4, misplaced=1)),
        "output_misplaced", first_op))
    if grad:
      built.extend(trained_and_double_counted(model, GPIPE_FORI, doubled_at))
  # GPipe under GSPMD, as MaxText and praxis write it (no shard_map; forward
  # only): each stage's layers vmapped over the stage dim of a state split
  # over "pp", the state rolled a stage on at every step (rank_cases.py,
  # unit_dims.py's vmapped variants).  Bugs: the state rolled back, reported
  # where stage 0's output meets stage 1's norm weight; the microbatches fed
  # to stage 1, where they meet stage 0's; the outputs collected from stage
  # 2, where the final norm reads microbatch 3, which was never written.
  # Its steps under lax.fori_loop too (MaxText's loop; unrolled, ring_loops.py).
  for model in MODELS:
    built.append(_gspmd_gpipe_case(model, cfg))
    built.append(_gspmd_gpipe_case(model, cfg, fori=True))
  built.append(_gspmd_gpipe_case("llama3", cfg, "wrong_permutation", "wrong_permutation",
                                 "multiply", fori=True, shift=-1))
  # ... with Megatron's TP specs inside the 2 stages (pp x tp, 2 x 4): the
  # stage's matmuls partitioned by XLA.  Bug: the outputs collected from stage
  # 0, reported at the final norm's square, which meets 1 microbatch of 4.
  for model in MODELS:
    built.append(_gspmd_gpipe_case(model, cfg, tp=True))
  built.append(_gspmd_gpipe_case("llama3", cfg, "collected_from_stage_0", "wrong_stage",
                                 "multiply", tp=True, collected_row=0))
  built.append(_gspmd_gpipe_case("gpt2", cfg, "wrong_permutation", "wrong_permutation",
                                 "multiply", shift=-1))
  built.append(_gspmd_gpipe_case("llama3", cfg, "fed_to_stage_1", "wrong_stage", "multiply",
                                 injected_row=1))
  built.append(_gspmd_gpipe_case("gpt2", cfg, "collected_from_stage_2", "wrong_stage",
                                 "reduce", collected_row=-2))
  # MaxText's circular pipeline under GSPMD: the 8 layers as 2 repeats of one
  # layer per stage, a microbatch round the 4 stages twice; each stage picks
  # its repeat's weights by a dynamic_slice vmapped over the stages (XLA: a
  # gather at a row computed from the partition id).  Bugs: the repeat picked
  # by the step alone, not the stage's lag (stage 1 runs microbatch 3 through
  # layer 5's weights), reported at layer 1's norm multiply, on pieces 0-2 of
  # 4; the outputs collected after the first repeat, reported where layer 4's
  # norm meets the final norm's weight instead.
  for model in MODELS:
    built.append(_gspmd_gpipe_case(model, cfg, circular=True))
    built.append(_gspmd_gpipe_case(model, cfg, circular=True, fori=True))
  built.append(_gspmd_gpipe_case("gpt2", cfg, "no_stage_lag", "wrong_stage", "multiply",
                                 circular=True, stage_offset=False))
  built.append(_gspmd_gpipe_case("llama3", cfg, "no_stage_lag", "wrong_stage", "multiply",
                                 circular=True, fori=True, stage_offset=False))
  built.append(_gspmd_gpipe_case("llama3", cfg, "collected_early", "wrong_stage", "multiply",
                                 circular=True, collected_repeat=0))
  built.append(_gspmd_gpipe_case("gpt2", cfg, "collected_early", "wrong_stage", "multiply",
                                 circular=True, fori=True, collected_repeat=0))
  # Every stage's output sent to the stage before it, both ways of writing
  # the schedule: reported where stage 0's output, held at stage 3, meets
  # stage 1's norm weight, held at stage 1.
  built.append(_shard_map_case(
      "gpt2", GPIPE_BUFFERED, cfg, "wrong_permutation",
      Parallel(run_stack=_gpipe_stages("pp", 4, shift=-1, buffered=True)),
      "wrong_permutation", "multiply"))
  built.append(_shard_map_case(
      "llama3", GPIPE_FORI, cfg, "wrong_permutation",
      Parallel(run_stack=_gpipe_fori_stages("pp", 4, shift=-1)), "wrong_permutation",
      "multiply"))
  # 1F1B: each microbatch's backward as soon as its loss is known, written by
  # hand with a vjp per stage and step (one_f_one_b.py).  Bugs: a stage
  # recomputing from the input it saved one step late (the backward of the
  # first microbatch never computed: reported at the first op of its
  # backward), and the cotangents sent forward round the ring (a stage's
  # cotangent and its saved activations held at different stages).  Buffered:
  # the saved inputs in a buffer by microbatch, written at row t - stage and
  # read at row t - 2(n - 1) + stage (rank_cases.py); the stale bug reads the
  # next row.
  if grad:
    for model in MODELS:
      built.append(_one_f_one_b_case(model, cfg))
      built.append(_one_f_one_b_case(model, cfg, "stale_input", "stale_activation", "divide"))
      built.append(_one_f_one_b_case(model, cfg, "cotangent_forward", "wrong_permutation",
                                     "dot_general"))
      built.append(_one_f_one_b_case(model, cfg, buffered=True))
      built.append(_one_f_one_b_case(model, cfg, "stale_input", "stale_activation", "divide",
                                     buffered=True))
      # ... with Megatron TP inside each of 2 stages (2 x 4), both ways of saving.
      built.append(_one_f_one_b_case(model, cfg, mesh="pp_tp"))
      built.append(_one_f_one_b_case(model, cfg, mesh="pp_tp", buffered=True))
      # ... each stage scanning its layers, both ways of saving: a stage's
      # forward runs once plainly and once under its vjp (unsaved_loops.py),
      # each on one microbatch (microbatch_loops.py).
      built.append(_one_f_one_b_case(model, cfg, scan=True))
      built.append(_one_f_one_b_case(model, cfg, buffered=True, scan=True))
    built.append(_one_f_one_b_case("gpt2", cfg, "stale_input", "stale_activation", "while",
                                   buffered=True, scan=True))
    built.append(_one_f_one_b_case("llama3", cfg, "cotangent_forward", "wrong_permutation",
                                   "dot_general", scan=True))
    built.append(_one_f_one_b_case("gpt2", cfg, "wrong_replica_groups", "wrong_replica_groups",
                                   "add", mesh="pp_tp",
                                   par=_tp_par(lambda axis: _psum(("pp", axis)))))
    # ... with TP inside each of 2 stages scanning their layers, both ways of
    # saving; the wrong replica groups met inside stage 0's forward loop, a
    # stale saved input at microbatch 0's loop.
    for model in MODELS:
      built.append(_one_f_one_b_case(model, cfg, mesh="pp_tp", scan=True))
      built.append(_one_f_one_b_case(model, cfg, mesh="pp_tp", buffered=True, scan=True))
    built.append(_one_f_one_b_case("llama3", cfg, "wrong_replica_groups", "wrong_replica_groups",
                                   "add", mesh="pp_tp", scan=True,
                                   par=_tp_par(lambda axis: _psum(("pp", axis)))))
    built.append(_one_f_one_b_case("gpt2", cfg, "stale_input", "stale_activation", "while",
                                   mesh="pp_tp", buffered=True, scan=True))
    # Interleaved 1F1B: 2 virtual stages (chunks) of one layer on each of 4
    # stages.  Bugs: the units taken depth first (chunk 1 of a microbatch
    # starts before chunk 0's output has come round the ring: stage 0 drops
    # microbatches 0 and 1 there, reported at the first op of chunk 1), and a
    # stage's chunk taken from the step instead of its own unit (stage 1 runs
    # microbatch 3 through layer 5's weights: its backward recomputes layer 1
    # right, up to the output projection, which it has no need to recompute:
    # reported there).
    # Indexed: the saved inputs in a buffer by unit and the chunk's weights
    # read at rows computed from the stage with floor division and remainder
    # (rank_cases.py).  Bug: the backward's chunk not reversed (Megatron's
    # get_model_chunk_id without forward=False): the last stage never applies
    # the head's cotangent to the last layer, reported at that layer's first
    # weight-gradient matmul.
    for model in MODELS:
      built.append(_interleaved_case(model, cfg))
      built.append(_interleaved_case(model, cfg, indexed=True))
    built.append(_interleaved_case("gpt2", cfg, "depth_first", "microbatch_skipped", "reduce"))
    built.append(_interleaved_case("gpt2", cfg, "chunk_of_step", "wrong_model_chunk",
                                   "dot_general"))
    built.append(_interleaved_case("gpt2", cfg, "backward_chunk_not_reversed",
                                   "wrong_model_chunk", "dot_general", indexed=True))
    # ... with Megatron TP inside each of 2 stages (2 x 4: 2 chunks of one
    # layer per stage), both ways of picking.  On two stages the indexed
    # chunk rows look like tile offsets of "pp", which the stack is already
    # split over: still cases (rank_cases.py).  Bug: the attention's partial
    # sums reduced over ("pp", "tp"), adding the other stage's unit.
    for model in MODELS:
      built.append(_interleaved_case(model, cfg, mesh="pp_tp"))
      built.append(_interleaved_case(model, cfg, mesh="pp_tp", indexed=True))
    built.append(_interleaved_case("gpt2", cfg, "wrong_replica_groups", "wrong_replica_groups",
                                   "add", mesh="pp_tp", indexed=True,
                                   par=_tp_par(lambda axis: _psum(("pp", axis)))))
    # ... each chunk scanning its layer, on 4 stages and with TP inside on 2:
    # every chunk's loop runs once (its counter 1 after it on every rank,
    # never zero elsewhere: inference.relates).  The bugs above are met at
    # the sequential loop of the microbatch the schedule skips, or (indexed)
    # whose cotangent the last stage never takes.  Indexed, a stage's chunk
    # row squeezed to the layer's shape is a select of squeezed rows
    # (slabs.unit_reshape_of_select): the sequential loop's rows relate to those.
    for model in MODELS:
      built.append(_interleaved_case(model, cfg, scan=True))
      built.append(_interleaved_case(model, cfg, indexed=True, scan=True))
    built.append(_interleaved_case("gpt2", cfg, mesh="pp_tp", scan=True))
    built.append(_interleaved_case("gpt2", cfg, mesh="pp_tp", indexed=True, scan=True))
    built.append(_interleaved_case("gpt2", cfg, "depth_first", "microbatch_skipped", "while",
                                   scan=True))
    built.append(_interleaved_case("gpt2", cfg, "chunk_of_step", "wrong_model_chunk", "while",
                                   scan=True))
    built.append(_interleaved_case("gpt2", cfg, "backward_chunk_not_reversed",
                                   "wrong_model_chunk", "while", indexed=True, scan=True))
    # 3D: those schedules (their buffered and indexed forms) on each half of
    # the batch, dp x pp x tp.  Bug: each dp rank's loss summed over "dp", not
    # averaged (psum where pmean belongs).
    for model in MODELS:
      built.append(_one_f_one_b_case(model, cfg, mesh="dp_pp_tp", buffered=True))
      built.append(_interleaved_case(model, cfg, mesh="dp_pp_tp", indexed=True))
    built.append(_interleaved_case("gpt2", cfg, "loss_summed_over_dp", "loss_wrong_scale",
                                   "output", mesh="dp_pp_tp", indexed=True,
                                   par=_tp_par(combine=_psum_of_mean("dp"))))
    # ... 1F1B with scanned stages (and the interleaved schedule, indexed,
    # with scanned chunks): a dp rank's microbatch m is every tile's block m,
    # cut and put back tile by tile (microbatch_loops.py).  The stale saved
    # input is met at microbatch 0's loop; the loss summed over "dp" where
    # the backward loop writes a weight's gradient row.
    for model in MODELS:
      built.append(_one_f_one_b_case(model, cfg, mesh="dp_pp_tp", buffered=True, scan=True))
    built.append(_one_f_one_b_case("gpt2", cfg, mesh="dp_pp_tp", scan=True))
    built.append(_interleaved_case("gpt2", cfg, mesh="dp_pp_tp", indexed=True, scan=True))
    built.append(_one_f_one_b_case("gpt2", cfg, "stale_input", "stale_activation", "while",
                                   mesh="dp_pp_tp", buffered=True, scan=True))
    built.append(_one_f_one_b_case("llama3", cfg, "loss_summed_over_dp", "loss_wrong_scale",
                                   "dynamic_update_slice", mesh="dp_pp_tp", buffered=True,
                                   scan=True, par=_tp_par(combine=_psum_of_mean("dp"))))
    built.append(_interleaved_case("llama3", cfg, "loss_summed_over_dp", "loss_wrong_scale",
                                   "dynamic_update_slice", mesh="dp_pp_tp", indexed=True,
                                   scan=True, par=_tp_par(combine=_psum_of_mean("dp"))))
  # GPipe with Megatron TP inside each of 2 stages, forward and backward, and
  # with each stage scanning its layers (each microbatch's piece of the
  # sequential loop has for partner a loop holding the stage's weights tiled
  # by "tp", microbatch_loops.py).  The attention's partial sums reduced over
  # ("pp", "tp") add another stage's microbatch: reported at the residual add
  # (scanned: inside stage 0's loop), in the all-reduce's words.  Trained with
  # the checker off, the scanned stages' cotangent is doubled where the
  # backward loop's residual add meets it.
  for strategy, scan in ((PP_TP_GPIPE, False), (PP_TP_GPIPE_SCAN, True)):
    for model in MODELS:
      built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
      if grad:
        built.append(_shard_map_grad_case(model, strategy, cfg))
    built.append(_shard_map_case(
        "gpt2", strategy, cfg, "wrong_replica_groups",
        dataclasses.replace(_tp_par(lambda axis: _psum(("pp", axis))),
                            run_stack=_gpipe_stages("pp", 4, scan=scan)),
        "wrong_replica_groups", "add"))
  if grad:
    built.append(_shard_map_grad_case("llama3", PP_TP_GPIPE_SCAN, cfg, "double_counted_grad",
                                      check_vma=False, bug="double_counted_grad",
                                      bug_primitive="add"))
  # Stages with tensor parallelism inside (2 x 4), and on the 2x2x2 mesh with
  # the batch over "dp" too: forward and backward.
  for model, strategy in itertools.product(MODELS, (PP_TP, DP_PP_TP)):
    built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
    if grad:
      built.append(_shard_map_grad_case(model, strategy, cfg))
  # Attention's partial sums reduced over ("pp", "tp"): every stage adds the
  # other stage's, so the residual add after it reads nothing related.
  built.append(_shard_map_case("gpt2", PP_TP, cfg, "wrong_replica_groups",
                               _pp_tp_par(lambda axis: _psum(("pp", axis))),
                               "wrong_replica_groups", "add"))
  # ... each stage scanning its layers (loop_split.py): forward and trained
  # on 2 x 4 and on 2x2x2, and the wrong replica groups met inside stage 0's
  # loop.  Trained with the checker off, every psum over "tp" transposes to
  # another: the cotangent is doubled where the backward loop's residual add
  # meets it.
  for model, strategy in itertools.product(MODELS, (PP_TP_SCAN, DP_PP_TP_SCAN)):
    built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
    if grad:
      built.append(_shard_map_grad_case(model, strategy, cfg))
  if grad:
    built.append(_shard_map_grad_case("gpt2", DP_PP_TP_SCAN, cfg, "double_counted_grad",
                                      check_vma=False, bug="double_counted_grad",
                                      bug_primitive="add"))
  built.append(_shard_map_case("llama3", PP_TP_SCAN, cfg, "wrong_replica_groups",
                               _pp_tp_par(lambda axis: _psum(("pp", axis)), scan=True),
                               "wrong_replica_groups", "add"))
  # Keys and values round a ring, and the ring turning the wrong way: blocks
  # land at other blocks' places; the first op reading the gathered keys is
  # the scores' dot_general (Llama: the kv heads' repeat, a broadcast_in_dim).
  # Forward+backward: the ring gather transposes to a ring reduce-scatter.
  # Zig-zag context parallelism and its bugs: RoPE at the positions of
  # contiguous shards (met at RoPE's multiply), the mask of contiguous shards
  # (at the select applying it to zig-zag scores), labels left contiguous
  # (where their one-hot meets the log-probabilities).
  # GPT-2's learned positions are cut into the rank's chunks; their gradient
  # is written back into place and summed (autodiff's or by hand), and the
  # bugs: the table's contiguous shard cut (met where it is added to the
  # zig-zag tokens), the hand-written gradient put back at a contiguous
  # shard's rows or averaged over the ranks (met at the output).
  zigzag_scan = _scanned(CP_ZIGZAG)
  for model, strategy in [(m, s) for m in MODELS for s in (CP_ZIGZAG, zigzag_scan)] + [
      ("gpt2", CP_ZIGZAG_VJP)]:
    built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
    if grad:
      built.append(_shard_map_grad_case(model, strategy, cfg))
  # Taken by index (the gather's transpose, or GPT-2's hand-written backward,
  # scatter-adds the position table's rows back), and the bug: added back at
  # a contiguous shard's chunks.
  for model, strategy in [(m, CP_ZIGZAG_TAKE) for m in MODELS] + [("gpt2", CP_ZIGZAG_TAKE_VJP)]:
    built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
    if grad:
      built.append(_shard_map_grad_case(model, strategy, cfg))
  if grad:
    strategy = dataclasses.replace(CP_ZIGZAG_TAKE_VJP, par=functools.partial(
        _cp_zigzag_par, cut=_zigzag_chunks_by_index,
        position_rows=_zigzag_rows_by_hand("cp", "contiguous", by_index=True)))
    built.append(_shard_map_grad_case("gpt2", strategy, cfg, "write_back_contiguous",
                                      bug="wrong_shard_offset", bug_primitive="output"))
  built.append(_shard_map_case("llama3", CP_ZIGZAG_TAKE, cfg, "rope_positions_contiguous",
                               _cp_zigzag_par(positions=_sharded_positions("cp"),
                                              cut=_zigzag_chunks_by_index),
                               "wrong_shard_offset", "multiply"))
  built.append(_shard_map_case("gpt2", CP_ZIGZAG, cfg, "positions_contiguous", _cp_zigzag_par(
      position_rows=lambda wpe: lax.dynamic_slice_in_dim(
          wpe, lax.axis_index("cp") * (wpe.shape[0] // 4), wpe.shape[0] // 4, 0)),
      "wrong_shard_offset", "add"))
  if grad:
    for variant, bug, hand_written in (
        ("write_back_contiguous", "wrong_shard_offset", _zigzag_rows_by_hand("cp", "contiguous")),
        ("write_back_averaged", "grad_wrong_scale", _zigzag_rows_by_hand("cp", reduce=lax.pmean))):
      strategy = dataclasses.replace(CP_ZIGZAG_VJP, par=functools.partial(
          _cp_zigzag_par, position_rows=hand_written))
      built.append(_shard_map_grad_case("gpt2", strategy, cfg, variant, bug=bug,
                                        bug_primitive="output"))
  built.append(_shard_map_case("llama3", zigzag_scan, cfg, "mask_contiguous",
                               _cp_zigzag_par(mask=_offset_causal_mask("cp")),
                               "mask_no_offset", "select"))
  built.append(_shard_map_case("llama3", CP_ZIGZAG, cfg, "rope_positions_contiguous",
                               _cp_zigzag_par(positions=_sharded_positions("cp")),
                               "wrong_shard_offset", "multiply"))
  built.append(_shard_map_case("llama3", CP_ZIGZAG, cfg, "mask_contiguous",
                               _cp_zigzag_par(mask=_offset_causal_mask("cp")),
                               "mask_no_offset", "select"))
  built.append(_shard_map_case("llama3", CP_ZIGZAG, cfg, "labels_contiguous",
                               _cp_zigzag_par(labels=False), "wrong_shard_offset", "multiply"))
  # The batch handed over in zig-zag chunks by the data loader (the relation
  # says so), with keys all-gathered or round a ring.  The bugs: RoPE's
  # positions for contiguous shards; the loader handing contiguous shards to
  # the zig-zag model (the relation without the order: met where the first
  # position-dependent value meets the tokens).
  for model in MODELS:
    for strategy in (CP_ZIGZAG_LOADED, CP_ZIGZAG_LOADED_RING_ATTENTION):
      built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
    if grad:
      built.append(_shard_map_grad_case(model, CP_ZIGZAG_LOADED, cfg))
  built.append(_shard_map_case("llama3", CP_ZIGZAG_LOADED, cfg, "rope_positions_contiguous",
                               _zigzag_loaded_par(positions=_sharded_positions("cp")),
                               "wrong_shard_offset", "multiply"))
  contiguous_batch = dataclasses.replace(CP_ZIGZAG_LOADED, relation=None)
  built.append(_shard_map_case("llama3", contiguous_batch, cfg, "batch_contiguous",
                               contiguous_batch.par(), "wrong_shard_offset", "multiply"))
  built.append(_shard_map_case("gpt2", contiguous_batch, cfg, "batch_contiguous",
                               contiguous_batch.par(), "wrong_shard_offset", "add"))
  # ... and under GSPMD (MaxText's form): the zig-zag batch split over "cp",
  # positions and mask read from zig-zag tables, which XLA folds into
  # constants every partition cuts its rows from (related to the sequential
  # iota and mask by their numbers, passes/constant_values.py).  Llama-3 only:
  # GPT-2's learned positions would be a reorder of a parameter, which XLA
  # lowers to collective-permutes of its pieces (not proved).  The bugs: the
  # positions or the mask left in sequence order.
  built.append(_gspmd_zigzag_case("llama3", cfg))
  if grad:
    built.append(_gspmd_zigzag_case("llama3", cfg, grad=True))
  built.append(_gspmd_zigzag_case("llama3", cfg, variant="rope_positions_contiguous",
                                  bug="wrong_shard_offset", bug_primitive="multiply",
                                  positions=False))
  built.append(_gspmd_zigzag_case("llama3", cfg, variant="mask_contiguous",
                                  bug="mask_no_offset", bug_primitive="select", mask=False))
  # Zig-zag chunks with the ring: each block written at its rank's place, the
  # ring's reduce-scatter backward; the ring turning the wrong way.
  for model in MODELS:
    built.append(_shard_map_case(model, CP_ZIGZAG_RING, cfg, "ok", CP_ZIGZAG_RING.par()))
    if grad:
      built.append(_shard_map_grad_case(model, CP_ZIGZAG_RING, cfg))
  built.append(_shard_map_case("gpt2", CP_ZIGZAG_RING, cfg, "wrong_permutation",
                               _zigzag_ring_par(shift=-1), "wrong_permutation", "dot_general"))
  # Zig-zag chunks with ring attention: each step's block masked by both
  # blocks' positions, folded into the online softmax; alone, under
  # lax.fori_loop, and with the layers under lax.scan.  The bugs: the ring
  # turning the wrong way (the masks name the blocks of r - t, the keys came
  # from r + t: only the steps where the two agree, t = 0 and 2, are formed),
  # and the blocks masked as contiguous shards.
  for model in MODELS:
    for strategy in (CP_ZIGZAG_RING_ATTENTION, CP_ZIGZAG_RING_ATTENTION_FORI,
                     _scanned(CP_ZIGZAG_RING_ATTENTION)):
      built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
  built.append(_shard_map_case("gpt2", CP_ZIGZAG_RING_ATTENTION, cfg, "wrong_permutation",
                               _zigzag_ring_attention_par(shift=-1), "wrong_permutation",
                               "reduce"))
  built.append(_shard_map_case("gpt2", CP_ZIGZAG_RING_ATTENTION_FORI, cfg, "wrong_permutation",
                               _zigzag_ring_attention_par(shift=-1, fori=True),
                               "wrong_permutation", "reduce"))
  built.append(_shard_map_case("llama3", CP_ZIGZAG_RING_ATTENTION, cfg, "mask_contiguous",
                               _zigzag_ring_attention_par(block_mask=_block_mask),
                               "mask_no_offset", "select"))
  # ... and its backward written by hand (custom_vjp), as Megatron's and ring
  # attention libraries' context parallelism: dk and dv carried round the ring
  # with their blocks, alone, under lax.fori_loop and with scanned layers.  The
  # bugs: dk/dv sent the other way round, the saved log-sum-exp missing its log.
  if grad:
    for model in MODELS:
      for strategy in (CP_ZIGZAG_RING_ATTENTION_VJP, CP_ZIGZAG_RING_ATTENTION_VJP_FORI,
                       _scanned(CP_ZIGZAG_RING_ATTENTION_VJP)):
        built.append(_shard_map_grad_case(model, strategy, cfg))
    for model, variant, flags, bug, primitive in (
        ("llama3", "grads_wrong_way", dict(grad_shift=-1), "wrong_permutation", "dot_general"),
        ("gpt2", "lse_without_log", dict(lse_log=False), "wrong_normalizer",
         "broadcast_in_dim")):
      strategy = dataclasses.replace(CP_ZIGZAG_RING_ATTENTION_VJP, par=functools.partial(
          _zigzag_ring_attention_vjp_par, **flags))
      built.append(_shard_map_grad_case(model, strategy, cfg, variant, bug=bug,
                                        bug_primitive=primitive))
  ring_scan = _scanned(CP_RING)
  for model in MODELS:
    built.append(_shard_map_case(model, CP_RING, cfg, "ok", CP_RING.par()))
    built.append(_shard_map_case(model, ring_scan, cfg, "ok", ring_scan.par()))
    if grad:
      built.append(_shard_map_grad_case(model, CP_RING, cfg))
      built.append(_shard_map_grad_case(model, ring_scan, cfg))
  # Ulysses, forward and backward; the seeded bug, the all-to-all splitting
  # the head dim instead of the heads (wrong axis).
  for model in MODELS:
    built.append(_shard_map_case(model, CP_ULYSSES, cfg, "ok", CP_ULYSSES.par()))
    if grad:
      built.append(_shard_map_grad_case(model, CP_ULYSSES, cfg))
  for model in MODELS:
    built.append(_shard_map_case(model, CP_ULYSSES, cfg, "head_dim_split",
                                 _ulysses_par(split_dim=3), "wrong_axis", "select"))
  built.append(_shard_map_case("gpt2", CP_RING, cfg, "wrong_permutation", _ring_par(shift=-1),
                               "wrong_permutation", "dot_general"))
  # The same under lax.fori_loop (ring_loops.py); its transpose, a ring
  # reduce-scatter, is a reversed loop at the same line, unrolled with it.
  for model in MODELS:
    built.append(_shard_map_case(model, CP_RING_FORI, cfg, "ok", CP_RING_FORI.par()))
    if grad:
      built.append(_shard_map_grad_case(model, CP_RING_FORI, cfg))
  built.append(_shard_map_case("gpt2", CP_RING_FORI, cfg, "wrong_permutation",
                               _ring_par(shift=-1, fori=True), "wrong_permutation",
                               "dot_general"))
  built.append(_shard_map_case("llama3", CP_RING, cfg, "wrong_permutation",
                               _ring_par(shift=-1), "wrong_permutation", "broadcast_in_dim"))
  # Ring attention (online softmax round the ring), and the ring turning the
  # wrong way: the masks assume blocks came from rank r - 1, the keys came
  # from r + 1; only the blocks where the two agree (t = 0, 2) are formed, so
  # the first op needing every block, the softmax's row max, gets nothing.
  ring_attention_scan = _scanned(RING_ATTENTION)
  for model in MODELS:
    built.append(_shard_map_case(model, RING_ATTENTION, cfg, "ok", RING_ATTENTION.par()))
    built.append(_shard_map_case(model, ring_attention_scan, cfg, "ok",
                                 ring_attention_scan.par()))
    built.append(_shard_map_case(model, RING_ATTENTION, cfg, "wrong_permutation",
                                 _ring_attention_par(shift=-1), "wrong_permutation", "reduce"))
  # Masked with -inf: proved, each row keeping its diagonal at the first step
  # (finite_rows.py); and the blocks passed on once before the first step, so
  # rank 0 starts on a block it masks wholly and computes NaN.
  for model in MODELS:
    built.append(_shard_map_case(model, RING_ATTENTION_INF_MASK, cfg, "ok",
                                 RING_ATTENTION_INF_MASK.par()))
  built.append(_shard_map_case("gpt2", RING_ATTENTION_INF_MASK, cfg, "first_block_masked",
                               RING_ATTENTION_INF_MASK.par(passed_first=True),
                               "first_block_masked", "reduce"))
  # The same with the ring's steps under lax.fori_loop (unrolled, ring_loops.py):
  # alone and with the layers under lax.scan; and turning the wrong way.
  for model in MODELS:
    for strategy in (RING_ATTENTION_FORI, _scanned(RING_ATTENTION_FORI)):
      built.append(_shard_map_case(model, strategy, cfg, "ok", strategy.par()))
  built.append(_shard_map_case("llama3", RING_ATTENTION_FORI, cfg, "wrong_permutation",
                               _ring_attention_par(shift=-1, fori=True), "wrong_permutation",
                               "reduce"))
  # On the 2x2x2 mesh with TP heads and batch over dp; the ring round "tp"
  # instead of "cp" passes other heads' keys: only block cp+0 is ever formed.
  ring_3d_scan = _scanned(DP_TP_RING_ATTENTION)
  for model in MODELS:
    built.append(_shard_map_case(model, DP_TP_RING_ATTENTION, cfg, "ok",
                                 DP_TP_RING_ATTENTION.par()))
    built.append(_shard_map_case(model, ring_3d_scan, cfg, "ok", ring_3d_scan.par()))
  # Ring attention's backward written by hand (custom_vjp), as libraries do:
  # on its own, with the layers under lax.scan, and on the 2x2x2 mesh; dk and
  # dv sent round the ring the other way from their blocks; and the saved
  # log-sum-exp missing its log.
  if grad:
    for model in MODELS:
      for strategy in (RING_ATTENTION_VJP, _scanned(RING_ATTENTION_VJP),
                       DP_TP_RING_ATTENTION_VJP, RING_ATTENTION_VJP_FORI,
                       _scanned(RING_ATTENTION_VJP_FORI)):
        built.append(_shard_map_grad_case(model, strategy, cfg))
    for model, variant, flags, bug, primitive in (
        ("llama3", "grads_wrong_way", dict(grad_shift=-1), "wrong_permutation", "dot_general"),
        ("gpt2", "lse_without_log", dict(lse_log=False), "wrong_normalizer",
         "broadcast_in_dim")):
      strategy = dataclasses.replace(
          RING_ATTENTION_VJP, par=functools.partial(_ring_attention_vjp_par, **flags))
      built.append(_shard_map_grad_case(model, strategy, cfg, variant, bug=bug,
                                        bug_primitive=primitive))
  built.append(_shard_map_case("llama3", DP_TP_RING_ATTENTION, cfg, "ring_over_wrong_axis",
                               _dp_tp_ring_attention_par(ring_axis="tp"),
                               "ring_over_wrong_axis", "reduce"))
  # Both rings under lax.fori_loop on the 2x2x2 mesh, and the ring round "tp".
  for model in MODELS:
    built.append(_shard_map_case(model, DP_TP_RING_ATTENTION_FORI, cfg, "ok",
                                 DP_TP_RING_ATTENTION_FORI.par()))
    if grad:
      built.append(_shard_map_grad_case(model, DP_TP_RING_ATTENTION_VJP_FORI, cfg))
  built.append(_shard_map_case("gpt2", DP_TP_RING_ATTENTION_FORI, cfg, "ring_over_wrong_axis",
                               _dp_tp_ring_attention_par(ring_axis="tp", fori=True),
                               "ring_over_wrong_axis", "reduce"))
  # The output not rescaled when the running max grows: the row max and the
  # denominator are right, the first op reading the output's sum is the
  # probabilities' matmul with v.
  built.append(_shard_map_case("gpt2", RING_ATTENTION, cfg, "output_not_rescaled",
                               _ring_attention_par(rescale_output=False),
                               "output_not_rescaled", "dot_general"))
  # Embeddings looked up by a gather (jnp.take), its gradient a scatter-add:
  # forward and backward under dp and dp x tp x cp, shard_map and GSPMD; the
  # training step (forward+backward) under the other strategies.
  for model in MODELS:
    for strategy in (_looked_up(_STRATEGIES["dp"]), _looked_up(_STRATEGIES["dp_tp_cp"])):
      built.extend(_in_both_styles(model, strategy, cfg, grad))
    if grad:
      for strategy in map(_looked_up, (_STRATEGIES["tp"], _STRATEGIES["sp"])):
        built.append(_shard_map_grad_case(model, strategy, cfg))
        built.append(_grad_case(model, strategy, cfg))
      for strategy in map(_looked_up, (PP, CP_RING)):
        built.append(_shard_map_grad_case(model, strategy, cfg))
      built.append(_fsdp_case(model, cfg, take=True, grad=True))
      built.append(_grad_case(model, _looked_up(FSDP), cfg))
  if grad:
    built.append(_shard_map_grad_case("llama3", _looked_up(EP), cfg))
    built.append(_grad_case("llama3", _looked_up(EP), cfg))
  # Megatron's vocab-parallel embedding as a masked take (shard_map), and XLA's
  # partitioning of the take from a table split by rows (GSPMD): forward and
  # backward (the gradient a scatter-add into each rank's rows).  The bug: the
  # ids looked up unshifted in each rank's rows, so the lookup is the first op
  # no rank completes.
  vocab_take = _looked_up(_STRATEGIES["tp_vocab"])
  dp_vocab_take = _looked_up(DP_TP_VOCAB)
  for model in MODELS:
    # ... and with the batch over "dp" too (2 x 4): each rank scatter-adds
    # its own tokens' rows, summed over "dp" by the gradient's all-reduce.
    built.extend(_in_both_styles(model, dp_vocab_take, cfg, grad))
    built.extend(_in_both_styles(model, vocab_take, cfg, grad))
  built.append(_shard_map_case("gpt2", vocab_take, cfg, "vocab_ids_not_offset",
                               dataclasses.replace(vocab_take.par(), embed_tokens=(
                                   _vocab_parallel_embed("tp", with_offset=False))),
                               "vocab_ids_not_offset", "gather"))
  # The labels' log-probabilities picked by jnp.take_along_axis, as optax's
  # integer-label cross entropy does (a gather with batching dims, NaN for a
  # label out of range; its gradient a scatter): under dp, and with the
  # vocabulary split over "tp", as XLA partitions them (GSPMD).
  for model in MODELS:
    for strategy in map(_optax_labels, (_looked_up(_STRATEGIES["dp"]), vocab_take)):
      built.append(_gspmd_case(model, strategy, cfg))
      if grad:
        built.append(_grad_case(model, strategy, cfg))
  # ZeRO-3 with the embedding table left as each rank holds it (not
  # all-gathered): the lookup reads a quarter of the table as if it were all.
  for model, table in (("gpt2", "wte"), ("llama3", "emb")):
    built.append(_fsdp_case(model, cfg, "table_not_gathered", take=True, ungathered=(table,),
                            bug="missing_allgather", bug_primitive="gather"))
  # Layers stacked under lax.scan: proved by one inductive step of the loop.
  for model in MODELS:
    for strategy in _STRATEGIES.values():
      scan = _scanned(strategy)
      built.append(_shard_map_case(model, scan, cfg, "ok", scan.par()))
      if grad:
        built.append(_shard_map_grad_case(model, scan, cfg))
      built.append(_gspmd_case(model, scan, cfg))
    built.append(_gspmd_case(model, _scanned(DP_SP), cfg))
  # Mixed precision (bfloat16 compute, float32 parameters and loss): dp x tp
  # in both styles, dp x tp x cp trained, the layers under lax.scan; and the
  # missing all-reduce under it.
  for model in MODELS:
    cases = list(_in_both_styles(model, _mixed_precision(_STRATEGIES["dp_tp"]), cfg, grad))
    if grad:
      cases.append(_shard_map_grad_case(model, _mixed_precision(_STRATEGIES["dp_tp_cp"]), cfg))
      cases.append(_shard_map_grad_case(
          model, _mixed_precision(_scanned(_STRATEGIES["tp"])), cfg))
    built += [dataclasses.replace(c, tolerance=BF16_TOLERANCE) for c in cases]
  built.append(dataclasses.replace(
      _shard_map_case("gpt2", _mixed_precision(_STRATEGIES["tp"]), cfg, "missing_allreduce",
                      _tp_par(reduce_attn=_no_reduce), "missing_allreduce", "add",
                      check_vma=False), tolerance=BF16_TOLERANCE))
  # The missing all-reduce inside the scanned layer: reported in the body.
  scan_tp = _scanned(_STRATEGIES["tp"])
  built.append(_shard_map_case("llama3", scan_tp, cfg, "missing_allreduce",
                               _tp_par(reduce_attn=_no_reduce), "missing_allreduce", "add",
                               check_vma=False))
  # The scanned layer under jax.checkpoint in the per-device program only: its
  # backward recomputes the layer from the saved input, the sequential one
  # reads saved activations (passes/remat.py brings both to one form).
  if grad:
    for model in MODELS:
      for strategy, policy in ((_STRATEGIES["tp"], "nothing"), (_STRATEGIES["tp"], "dots"),
                               (_STRATEGIES["dp_tp_cp"], "nothing")):
        built.append(_shard_map_grad_case(model, _remat(_scanned(strategy), policy), cfg))
    built.append(_shard_map_grad_case(
        "llama3", _remat(scan_tp, "nothing", lambda: _tp_par(reduce_attn=_no_reduce)), cfg,
        "missing_allreduce", check_vma=False, bug="missing_allreduce", bug_primitive="add"))
    # GSPMD's training step with scanned layers, with and without remat (XLA
    # partitions the checkpointed program; its saved stacks differ again).
    for model in MODELS:
      # (dp x tp's stacked gradients start as many zero buffers: each one's
      # candidate invariants outnumber what a value otherwise keeps; loops.py)
      for strategy in (_STRATEGIES["dp"], _STRATEGIES["tp"], _STRATEGIES["tp_vocab"],
                       _STRATEGIES["sp"], _STRATEGIES["cp"], _STRATEGIES["dp_tp"],
                       _STRATEGIES["dp_tp_cp"], DP_SP):
        built.append(_grad_case(model, _scanned(strategy), cfg))
      built.append(_grad_case(model, _scanned(_STRATEGIES["tp"]), cfg, remat="nothing"))
  if grad:
    for model in MODELS:
      for strategy in _STRATEGIES.values():
        built.append(_grad_case(model, strategy, cfg))
      for strategy in _STRATEGIES.values():
        built.append(_shard_map_grad_case(model, strategy, cfg))
      built.append(_shard_map_grad_case(model, _STRATEGIES["dp_tp"], cfg, sgd_step=True))
    # Under TP every psum transposes to another psum: the residual stream's
    # gradient comes back from the layer |tp| times too large and unreduced,
    # and the layernorm backward adds it to the (right) skip gradient.
    built.append(_shard_map_grad_case("gpt2", _STRATEGIES["tp"], cfg, "double_counted_grad",
                                      check_vma=False, bug="double_counted_grad",
                                      bug_primitive="add"))
    # Under DP nothing sums the replicated parameters' gradients over "dp":
    # the classic forgotten gradient all-reduce (each rank keeps its local
    # batch's part, |dp| times too large since the loss is pmean'd).
    for model in MODELS:
      built.append(_shard_map_grad_case(model, _STRATEGIES["dp"], cfg, "grad_not_allreduced",
                                        check_vma=False, bug="grad_not_allreduced",
                                        bug_primitive="output"))
    # One training step as users run it: optax's clip_by_global_norm, then
    # adamw.  Under shard_map the global norm is rebuilt from the tiles
    # (training.py), in another order than optax's sum over the parameters.
    for model in MODELS:
      built.append(_adamw_case(model, _STRATEGIES["dp_tp"], cfg, "shard_map"))
      built.append(_adamw_case(model, _STRATEGIES["dp_tp"], cfg, "gspmd"))
      built.append(_adamw_case(model, PP, cfg, "shard_map"))
      built.append(_adamw_case(model, GPIPE, cfg, "shard_map"))
      built.append(_adamw_case(model, FSDP, cfg, "gspmd"))
    built.append(_adamw_case("llama3", EP, cfg, "gspmd"))
    # ZeRO stages 1 and 2 (zero.py): the gradients reduce-scattered, each
    # rank's tile of the parameters updated with its tile of Adam's moments,
    # the tiles all-gathered.  The bug: each rank updates the next rank's tile.
    for model in MODELS:
      built.append(_zero_case(model, cfg, "shard_map"))
      built.append(_zero_case(model, cfg, "gspmd"))
    built.append(_zero_case("gpt2", cfg, "shard_map", "param_tile_of_next_rank", tile_shift=1,
                            bug="wrong_shard_offset", bug_primitive="add"))
    # Gradient accumulation: each rank's batch in microbatches (slices), the
    # losses and gradients added up and divided by their number; the bug
    # forgets the division (every gradient that many times too large).
    for model in MODELS:
      for strategy, microbatches in ((_STRATEGIES["dp"], 2), (_STRATEGIES["dp_tp"], 4)):
        built.append(_accumulation_case(model, _with_batch(strategy, 8), cfg, microbatches))
    built.append(_accumulation_case("gpt2", _with_batch(_STRATEGIES["dp"], 8), cfg, 2,
                                    "not_divided", divide=False, bug="grad_not_divided",
                                    bug_primitive="output"))
    # Every tensor's squares psum'd over the split axes, the replicated
    # tensors' too: each is counted once per rank.  The add that first meets
    # a split tensor's squares is the first sum no rank forms.
    for model, strategy in (("llama3", _STRATEGIES["dp_tp"]), ("gpt2", PP)):
      built.append(_adamw_case(model, strategy, cfg, "shard_map", "norm_counts_replicas",
                               clip=functools.partial(training.clip_by_sharded_global_norm,
                                                      count_replicas=True),
                               bug="norm_counts_replicas", bug_primitive="add"))
  # GSPMD: XLA's per-device module with one instruction edited, as a
  # partitioner bug would leave it.  The attention's partial sums kept per
  # rank, or summed over "dp"'s replica groups instead of "tp"'s: each met at
  # the residual add.  The last gradient's all-reduce over "dp" dropped: every
  # intermediate is right, that output is a partial sum.
  # And a table of tile offsets, indexed by partition id, rotated: each rank
  # slices the next rank's tile of a weight (sp), or offsets its positions by
  # the next rank's (cp: RoPE's angles, the first op reading them).
  built.append(_partitioner_bug("llama3", _STRATEGIES["sp"], cfg, False, "wrong_shard_offset",
                                partitioner_bugs.rotate_rank_table(0), "wrong_shard_offset",
                                "dot_general"))
  built.append(_partitioner_bug("llama3", _STRATEGIES["cp"], cfg, False, "wrong_shard_offset",
                                partitioner_bugs.rotate_rank_table(0), "wrong_shard_offset",
                                "multiply"))
  dp_groups = ((0, 4), (1, 5), (2, 6), (3, 7))  # "dp" of the 2 x 4 mesh
  built.append(_partitioner_bug("gpt2", _STRATEGIES["tp"], cfg, False, "missing_allreduce",
                                partitioner_bugs.drop_all_reduce(0), "missing_allreduce",
                                "add"))
  built.append(_partitioner_bug("llama3", _STRATEGIES["dp_tp"], cfg, False,
                                "wrong_replica_groups",
                                partitioner_bugs.regroup("all-reduce", 0, dp_groups),
                                "wrong_replica_groups", "add"))
  # An all-gather's groups replaced: its own ranks in reverse order (keys
  # concatenated out of order), or the devices of another axis of the same
  # size ("tp" for "cp" on 2 x 2 x 2); an all-to-all's ranks swapped in
  # pairs (XLA's reshard of FSDP's position table).  Each is met where the
  # collective's result is first read.
  built.append(_partitioner_bug("llama3", _STRATEGIES["cp"], cfg, False, "gather_out_of_order",
                                partitioner_bugs.regroup("all-gather", 0, ((3, 2, 1, 0),)),
                                "wrong_permutation", "dot_general"))
  tp_groups = ((0, 2), (1, 3), (4, 6), (5, 7))  # "tp" of the 2 x 2 x 2 mesh
  built.append(_partitioner_bug("llama3", _STRATEGIES["dp_tp_cp"], cfg, False,
                                "gather_wrong_axis",
                                partitioner_bugs.regroup("all-gather", 0, tp_groups),
                                "wrong_axis", "dot_general"))
  built.append(_partitioner_bug("gpt2", FSDP, cfg, False, "all_to_all_out_of_order",
                                partitioner_bugs.regroup("all-to-all", 0, ((1, 0, 3, 2),)),
                                "wrong_permutation", "broadcast_in_dim"))
  if grad:
    # HSDP's gradient all-reduce over the replicas of a shard run over the
    # shard group instead: the two groups mixed up.
    fsdp_groups = ((0, 1, 2, 3), (4, 5, 6, 7))  # "fsdp" of the 2 x 4 mesh
    built.append(_partitioner_bug("llama3", HSDP, cfg, True, "grad_summed_over_shard_group",
                                  partitioner_bugs.regroup("all-reduce", -1, fsdp_groups),
                                  "wrong_replica_groups", "transpose"))
    for model, strategy in (("gpt2", _looked_up(_STRATEGIES["dp"])),
                            ("llama3", _STRATEGIES["dp_tp"])):
      built.append(_partitioner_bug(model, strategy, cfg, True, "grad_not_allreduced",
                                    partitioner_bugs.drop_all_reduce(-1),
                                    "grad_not_allreduced", "output"))
  return tuple(built)


def model_cases(cfg: Optional[Config] = None, grad: bool = True) -> list[Case]:
  """All model cases (built lazily: meshes need the 8 fake CPU devices)."""
  return list(_build(cfg or Config(), grad))


def get(name: str, cfg: Optional[Config] = None) -> Case:
  for c in model_cases(cfg):
    if c.name == name:
      return c
  raise KeyError(f"no model case {name!r}; known: "
                 f"{[c.name for c in model_cases(cfg)]}")


# --------------------------------------------------------------------------
# Numeric ground truth with sensible token ids.
# --------------------------------------------------------------------------


def model_inputs(case: Case, seed: int = 0) -> list[np.ndarray]:
  """Global inputs: token ids and labels uniform over the vocabulary (read
  off the first parameter, the embedding table), parameters N(0, 0.5^2) as
  ``numeric.random_inputs`` (magnitudes for ``case.nonnegative_args``)."""
  rng = np.random.default_rng(seed)
  vocab = case.seq_args[2].shape[0]
  out = []
  for i, a in enumerate(case.seq_args):
    if jnp.issubdtype(a.dtype, jnp.integer):
      out.append(rng.integers(0, vocab, a.shape).astype(a.dtype))
    else:
      x = (0.5 * rng.standard_normal(a.shape)).astype(a.dtype)
      out.append(np.abs(x) if i in case.nonnegative_args else x)
  return out


def run_both(case: Case, inputs=None, seed: int = 0):
  """(sequential, distributed) outputs as pytrees of numpy arrays."""
  if inputs is None:
    inputs = model_inputs(case, seed)
  seq_out = jax.jit(case.seq_fn)(*inputs)
  dist_inputs = case.dist_inputs(inputs)
  if case.dist_edit is not None:  # a GSPMD bug: XLA's module edited, run by the interpreter
    from tools.zoo.partitioner_bugs import run_partitioned
    return jax.tree.map(np.asarray, seq_out), run_partitioned(case, inputs)
  if case.style == "gspmd":
    dist = jax.jit(case.dist_fn, in_shardings=case.in_shardings,
                   out_shardings=case.out_shardings)
  else:
    dist = jax.jit(case.dist_fn)
  dist_out = dist(*dist_inputs)
  to_np = lambda t: jax.tree.map(np.asarray, t)
  return to_np(seq_out), to_np(dist_out)


def outputs_match(case: Case, inputs=None, seed: int = 0, rtol: Optional[float] = None,
                  atol: Optional[float] = None) -> bool:
  """Do both programs give the same outputs, within the case's tolerance
  (bfloat16 programs sum their partial sums in another order, rounded)?"""
  rtol = case.tolerance if rtol is None else rtol
  atol = case.tolerance if atol is None else atol
  seq_out, dist_out = run_both(case, inputs, seed)
  seq_leaves, seq_tree = jax.tree.flatten(seq_out)
  dist_leaves, dist_tree = jax.tree.flatten(dist_out)
  return (seq_tree == dist_tree
          and all(s.shape == d.shape and np.allclose(s, d, rtol=rtol, atol=atol)
                  for s, d in zip(seq_leaves, dist_leaves)))
