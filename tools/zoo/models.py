"""Tiny GPT-2 and Llama-3 style language models as plain JAX functions.

Both models map ``(tokens, labels, *params)`` to a scalar cross-entropy loss
(mean over all tokens).  ``tokens`` and ``labels`` are int32 ``[batch, seq]``;
``params`` is a flat tuple of float32 arrays in the order of
``param_specs(model, cfg)``, so a lowered module has one parameter per array
and the sequential and distributed modules match parameters by position.
Layers are unrolled with a Python loop (no ``scan``/``while`` in the modules),
or with ``Config.scan_layers`` stacked and run under ``lax.scan``.

The forward functions are written once and are shape-generic: the batch,
sequence and head counts are read off the (possibly per-device) shapes of the
arguments, and every place a distributed program needs communication goes
through a hook of ``Parallel``.  With the default hooks (``SEQUENTIAL``) the
functions are the sequential programs; ``tools/zoo/strategies.py`` builds
per-device bodies for ``shard_map`` by swapping hooks, so a seeded bug is the
only difference between a correct and a buggy variant.

Token ids are looked up with a one-hot matmul by default
(``Config.embedding="take"`` uses ``jnp.take``, a gather, instead); labels
always go through ``one_hot``.  Either way out-of-range ids (the zoo's
``numeric.random_inputs`` draws ints as truncated gaussians, i.e. mostly 0 and
a few -1 / +1) give a defined result rather than NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
I32 = jnp.int32
EPS = 1e-5
MODELS = ("gpt2", "llama3")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  d_model: int = 32
  heads: int = 4
  kv_heads: int = 2         # llama3 only (grouped-query attention)
  seq: int = 16
  batch: int = 2
  layers: int = 2
  mlp_hidden: int = 64
  rope_base: float = 10000.0
  # Token lookup: "one_hot" (one_hot(tokens) @ table, a dot_general) or
  # "take" (jnp.take, a gather).
  embedding: str = "one_hot"
  # The cross entropy's pick of each label's log-probability: "one_hot" (a
  # one-hot product, summed) or "take" (``jnp.take_along_axis``, as optax's
  # softmax_cross_entropy_with_integer_labels: a gather with batching dims).
  label_pick: str = "one_hot"
  # Layers stacked ([layers, ...] parameters named ``layers.<base>``) and run
  # under ``lax.scan`` (a while loop in the modules) instead of unrolled.
  scan_layers: bool = False
  # Layers stacked as above, each reading its row of the stacks, run by
  # ``Parallel.run_stack`` (a pipeline runs its stage's rows); unrolled, or
  # with ``scan_layers`` under ``lax.scan`` (``scan_stack``).
  stacked_params: bool = False
  # > 1 (with ``stacked_params``): the stacks are held as ``[virtual_stages,
  # layers // virtual_stages, ...]`` and run chunk after chunk, row after row:
  # the layout of an interleaved pipeline's weights (MaxText's
  # ``num_pipeline_repeats``), where stage s holds row s of every chunk.
  virtual_stages: int = 1
  # llama3 only: > 0 replaces the SwiGLU MLP by a top-k Mixture-of-Experts
  # layer with this many SwiGLU experts (``moe_mlp``), each token routed to
  # ``top_k`` of them.
  experts: int = 0
  top_k: int = 2
  # How the router picks a token's experts: k rounds of arg-max masking
  # ("argmax"), or ``lax.top_k`` on the router logits ("top_k", Mixtral's).
  router: str = "argmax"
  # > 0: each expert takes at most this many tokens of each group (batch
  # row), first come first served; the rest are dropped (GShard capacity).
  capacity: int = 0
  # "bfloat16": mixed precision, the parameters (kept in float32) cast to
  # bfloat16 where the loss reads them, the loss returned in float32.
  compute_dtype: str = "float32"
  # The causal mask's fill.  -inf, as many hand-written attentions spell it,
  # is sound in an online softmax only where every row keeps a key from the
  # first block on (else exp(-inf + inf) = NaN).
  mask_value: float = -1e9

  def __post_init__(self):
    assert self.embedding in ("one_hot", "take"), self
    assert self.router in ("argmax", "top_k"), self
    assert self.label_pick in ("one_hot", "take"), self
    assert self.d_model % self.heads == 0, self
    assert self.heads % self.kv_heads == 0, self
    assert self.head_dim % 2 == 0, self
    assert self.virtual_stages == 1 or (self.stacked_params
                                        and self.layers % self.virtual_stages == 0), self

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads

  @property
  def kv_groups(self) -> int:
    """Query heads per kv head."""
    return self.heads // self.kv_heads


# --------------------------------------------------------------------------
# Communication hooks.  Identity everywhere = the sequential program.
# --------------------------------------------------------------------------


def _no_gather(x, axis=1):
  return x


def _no_reduce(x):
  return x


def _iota_positions(n):
  return jnp.arange(n, dtype=F32)


def repeat_kv(x, groups):
  """[b, s, kv, hd] -> [b, s, kv * groups, hd], q head h reading kv head
  h // groups (each kv head repeated ``groups`` times in a row)."""
  return jnp.repeat(x, groups, axis=2)


def _all_heads(x, n_local):
  return x


def lower_triangle(sq, sk):
  """The causal mask bool[sq, sk]: query i sees keys 0..i."""
  return jnp.tril(jnp.ones((sq, sk), dtype=bool))


def _identity(x):
  return x


def slots_per_group(chosen):
  """chosen [b, s, E] -> each choice's slot in its expert's queue, counted in
  token order within each group (batch row); -1 where not chosen."""
  return jnp.cumsum(chosen, axis=1) * chosen - 1.0


@dataclasses.dataclass(frozen=True)
class Parallel:
  # (x, axis) -> x gathered along the sequence axis: before attention / MLP.
  gather_seq: Callable = _no_gather
  # Partial sums out of the row-parallel matmuls -> reduced (or scattered).
  reduce_attn: Callable = _no_reduce
  reduce_mlp: Callable = _no_reduce
  # n -> f32[n], the positions of this device's n tokens (llama3 RoPE).
  positions: Callable = _iota_positions
  # (kv [b, s, kv, hd], groups) -> [b, s, heads, hd]
  repeat_kv: Callable = repeat_kv
  # ([b, s, heads, hd], n_local) -> this device's n_local heads.
  local_heads: Callable = _all_heads
  # Context parallelism: (k or v [b, s_local, h, hd], axis) -> the whole
  # sequence's keys / values; (sq, sk) -> the causal mask of this device's
  # queries against all keys.
  gather_kv: Callable = _no_gather
  causal_mask: Callable = lower_triangle
  # Ring attention: (q, k, v) -> causal attention of this device's queries,
  # computed round a ring of k/v blocks instead of over gathered k/v (None:
  # ``causal_attention`` of gathered k/v).
  attend: Optional[Callable] = None
  # per-token nll [b, s] -> scalar loss
  combine_loss: Callable = jnp.mean
  # (tokens, labels) as the device is given them -> the ones it runs on:
  # load-balanced context parallelism picks its chunks of the sequence.
  local_batch: Callable = lambda tokens, labels: (tokens, labels)
  # GPT-2's learned positions as held -> the rows of this device's tokens
  # (load-balanced context parallelism cuts its chunks out of the whole table).
  position_rows: Callable = lambda wpe: wpe
  # (tokens, table as held, cfg) -> embeddings; (logits as held, labels, cfg)
  # -> per-token nll: vocab-parallel versions split the table's rows and the
  # logits' columns (Megatron).
  embed_tokens: Callable = lambda tokens, table, cfg: embed(tokens, table, cfg)
  token_nll: Callable = lambda logits, labels, cfg: cross_entropy(logits, labels, cfg.label_pick)
  # MoE: tokens [experts, b, s, d] held by token owners -> by expert owners,
  # and the experts' outputs back (all-to-alls under expert parallelism).
  to_experts: Callable = _identity
  from_experts: Callable = _identity
  # MoE with a capacity: chosen [b, s, E] -> each choice's slot in its
  # expert's queue (-1: not chosen), counted per group (batch row).
  expert_slots: Callable = slots_per_group
  # (h, {base: stacked [n, ...]}, layer) -> h after layers 0..n-1 of the
  # stacks (``Config.stacked_params``); a pipeline runs its stage's rows.
  run_stack: Optional[Callable] = None  # None: run_stack_in_order
  # With virtual stages: (h, {base: stacked [chunks, n, ...]}, layer) -> h
  # after every chunk's layers, all chunks at once (a circular pipeline sends
  # each microbatch round the stages once per chunk); None: chunk by chunk.
  run_chunks: Optional[Callable] = None
  # (base name, a layer's weight as held) -> the weight the layer computes
  # with: FSDP all-gathers its shard here, inside the layer (and the scan).
  layer_weight: Callable = lambda name, w: w
  # Under ``Config.scan_layers``: the scanned layer wrapped in ``jax.checkpoint``
  # (remat) with this policy, a name in ``REMAT_POLICIES``; None: no remat.
  remat: Optional[str] = None


SEQUENTIAL = Parallel()

# jax.checkpoint policies by name: save nothing but the layer's input (full
# remat), or the matmuls' outputs too (recompute only the cheap elementwise ops).
REMAT_POLICIES = {"nothing": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


# --------------------------------------------------------------------------
# Parameters.
# --------------------------------------------------------------------------


def _layer_params(model: str, cfg: Config) -> list[tuple[str, tuple]]:
  """(base name, shape) of one layer's parameters."""
  d, f, hd = cfg.d_model, cfg.mlp_hidden, cfg.head_dim
  if model == "gpt2":
    return [("ln1_g", (d,)), ("ln1_b", (d,)),
            ("wq", (d, d)), ("bq", (d,)), ("wk", (d, d)), ("bk", (d,)),
            ("wv", (d, d)), ("bv", (d,)), ("wo", (d, d)), ("bo", (d,)),
            ("ln2_g", (d,)), ("ln2_b", (d,)),
            ("w_fc", (d, f)), ("b_fc", (f,)), ("w_proj", (f, d)), ("b_proj", (d,))]
  attn = [("attn_norm", (d,)),
          ("wq", (d, cfg.heads * hd)), ("wk", (d, cfg.kv_heads * hd)),
          ("wv", (d, cfg.kv_heads * hd)), ("wo", (cfg.heads * hd, d)),
          ("mlp_norm", (d,))]
  if cfg.experts:
    e = cfg.experts
    return attn + [("w_router", (d, e)), ("w_gate", (e, d, f)), ("w_up", (e, d, f)),
                   ("w_down", (e, f, d))]
  return attn + [("w_gate", (d, f)), ("w_up", (d, f)), ("w_down", (f, d))]


def param_specs(model: str, cfg: Config) -> list[tuple[str, tuple]]:
  """(name, global shape) of every parameter, in argument order.  Per-layer
  names are ``l{i}.{base}``, or with ``cfg.scan_layers`` one stacked
  ``layers.{base}`` of shape ``[layers, ...]``; ``base_name`` strips the prefix."""
  d, v = cfg.d_model, cfg.vocab
  if model not in MODELS:
    raise ValueError(f"unknown model {model!r}; known: {MODELS}")
  if cfg.scan_layers or cfg.stacked_params:
    rows = ((cfg.layers,) if cfg.virtual_stages == 1
            else (cfg.virtual_stages, cfg.layers // cfg.virtual_stages))
    layers = [(f"layers.{n}", (*rows, *s)) for n, s in _layer_params(model, cfg)]
  else:
    layers = [(f"l{i}.{n}", s) for i in range(cfg.layers)
              for n, s in _layer_params(model, cfg)]
  if model == "gpt2":
    return [("wte", (v, d)), ("wpe", (cfg.seq, d))] + layers + [
        ("lnf_g", (d,)), ("lnf_b", (d,))]
  return [("emb", (v, d))] + layers + [("final_norm", (d,)), ("head", (d, v))]


def is_stacked(name: str) -> bool:
  return name.startswith("layers.")


def base_name(name: str) -> str:
  return name.split(".", 1)[1] if "." in name else name


def _unpack(model: str, cfg: Config, params) -> dict:
  names = [n for n, _ in param_specs(model, cfg)]
  assert len(params) == len(names), (model, len(params), len(names))
  return dict(zip(names, params))


def run_stack_in_order(h, stacked: dict, layer: Callable):
  """h after one layer per row of the stacks, in order."""
  for i in range(next(iter(stacked.values())).shape[0]):
    h = layer(h, lambda n, i=i: stacked[n][i])
  return h


def scan_stack(h, stacked: dict, layer: Callable):
  """h after one layer per row of the stacks, under ``lax.scan``."""
  return lax.scan(lambda h, ws: (layer(h, lambda n: ws[n]), None), h, stacked)[0]


def _run_layers(h, p: dict, cfg: Config, layer: Callable, par: Parallel):
  """h after every layer; ``layer(h, w)`` reads its weights as ``w(base)``."""
  stacked = {base_name(k): v for k, v in p.items() if is_stacked(k)}
  gathering = lambda read: (lambda n: par.layer_weight(n, read(n)))
  if cfg.stacked_params:
    if cfg.virtual_stages > 1 and par.run_chunks is not None:
      return par.run_chunks(h, stacked, lambda h, w: layer(h, gathering(w)))
    run = par.run_stack or (scan_stack if cfg.scan_layers else run_stack_in_order)
    chunks = ([stacked] if cfg.virtual_stages == 1 else
              [{n: w[c] for n, w in stacked.items()} for c in range(cfg.virtual_stages)])
    for chunk in chunks:
      h = run(h, chunk, lambda h, w: layer(h, gathering(w)))
    return h
  if not cfg.scan_layers:
    for i in range(cfg.layers):
      h = layer(h, gathering(lambda n, i=i: p[f"l{i}.{n}"]))
    return h

  def body(h, ws):
    return layer(h, gathering(lambda n: ws[n])), None

  if par.remat is not None:
    body = jax.checkpoint(body, policy=REMAT_POLICIES[par.remat])
  return lax.scan(body, h, stacked)[0]


# --------------------------------------------------------------------------
# Building blocks (shape-generic).
# --------------------------------------------------------------------------


def embed(tokens, table, cfg: Config):
  if cfg.embedding == "take":
    return jnp.take(table, tokens, axis=0, mode="clip")
  return jax.nn.one_hot(tokens, table.shape[0], dtype=F32) @ table


def layernorm(x, g, b):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  c = x - mean
  var = jnp.mean(c * c, axis=-1, keepdims=True)
  return c * lax.rsqrt(var + EPS) * g + b


def rmsnorm(x, g):
  ms = jnp.mean(x * x, axis=-1, keepdims=True)
  return x * lax.rsqrt(ms + EPS) * g


def causal_attention(q, k, v, mask=lower_triangle, mask_value=-1e9):
  """q [b, sq, h, hd], k, v [b, sk, h, hd] -> [b, sq, h * hd]; heads are
  independent, so a device holding some heads of q, k, v computes those
  heads' outputs, and one holding some queries (and every key) those
  queries' outputs, with ``mask(sq, sk)`` saying which keys each sees."""
  b, s, h, hd = q.shape
  scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.float32(np.sqrt(hd))
  causal = mask(s, k.shape[1])
  scores = jnp.where(causal, scores, np.float32(mask_value))
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, h * hd)


def cross_entropy(logits, labels, pick: str = "one_hot"):
  """Per-token negative log-likelihood [b, s]; ``pick`` as ``Config.label_pick``."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  if pick == "take":
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=F32)
  return -jnp.sum(onehot * logp, axis=-1)


def rope_tables(pos, head_dim, base):
  half = head_dim // 2
  inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=F32) / half))
  angle = pos[:, None] * inv_freq[None, :]
  return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x, cos, sin):
  """Rotate-half RoPE of x [b, s, h, hd] with tables [s, hd / 2]."""
  half = x.shape[-1] // 2
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


@dataclasses.dataclass(frozen=True)
class Parts:
  """A model cut where a pipeline cuts it: ``embed(tokens, p) -> h`` and
  ``head(h, labels, p) -> loss`` read the parameters by name (``p``, a dict);
  ``layer(h, w, tables)`` reads its weights as ``w(base)`` and the tables
  ``tables(tokens)`` built once for every layer (Llama's rotary tables)."""
  embed: Callable
  tables: Callable
  layer: Callable
  head: Callable


def _loss_of_parts(parts: Parts, model: str, tokens, labels, params, cfg: Config,
                   par: Parallel):
  p = _unpack(model, cfg, params)
  h = parts.embed(tokens, p)
  tables = parts.tables(tokens)
  h = _run_layers(h, p, cfg, lambda h, w: parts.layer(h, w, tables), par)
  return parts.head(h, labels, p)


# --------------------------------------------------------------------------
# GPT-2.
# --------------------------------------------------------------------------


def gpt2_parts(cfg: Config, par: Parallel = SEQUENTIAL) -> Parts:
  hd = cfg.head_dim

  def embed_in(tokens, p):
    # Token embedding plus learned positions (wpe holds this device's rows:
    # all of them, or its sequence shard).
    return par.embed_tokens(tokens, p["wte"], cfg) + par.position_rows(p["wpe"])[None]

  def layer(h, w, tables):
    a = par.gather_seq(layernorm(h, w("ln1_g"), w("ln1_b")))
    b, s, _ = a.shape
    q = (a @ w("wq") + w("bq")).reshape(b, s, -1, hd)
    k = (a @ w("wk") + w("bk")).reshape(b, s, -1, hd)
    v = (a @ w("wv") + w("bv")).reshape(b, s, -1, hd)
    if par.attend is not None:
      attn = par.attend(q, k, v) @ w("wo")
    else:
      k, v = par.gather_kv(k), par.gather_kv(v)
      attn = causal_attention(q, k, v, par.causal_mask, cfg.mask_value) @ w("wo")
    h = h + (par.reduce_attn(attn) + w("bo"))
    m = par.gather_seq(layernorm(h, w("ln2_g"), w("ln2_b")))
    mlp = jax.nn.gelu(m @ w("w_fc") + w("b_fc"), approximate=True) @ w("w_proj")
    return h + (par.reduce_mlp(mlp) + w("b_proj"))

  def head_out(h, labels, p):
    h = layernorm(h, p["lnf_g"], p["lnf_b"])
    logits = h @ p["wte"].T                         # tied output head
    return par.combine_loss(par.token_nll(logits, labels, cfg))

  return Parts(embed_in, lambda tokens: None, layer, head_out)


def gpt2_loss(tokens, labels, params, cfg: Config, par: Parallel = SEQUENTIAL):
  return _loss_of_parts(gpt2_parts(cfg, par), "gpt2", tokens, labels, params, cfg, par)


# --------------------------------------------------------------------------
# Llama 3.
# --------------------------------------------------------------------------


def _gqa_attention(a, wq, wk, wv, cos, sin, cfg: Config, par: Parallel):
  b, s, _ = a.shape
  hd = cfg.head_dim
  q = (a @ wq).reshape(b, s, -1, hd)
  k = (a @ wk).reshape(b, s, -1, hd)
  v = (a @ wv).reshape(b, s, -1, hd)
  q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
  n_q = q.shape[2]
  if par.attend is not None:  # this rank's heads of k and v picked before they go round
    return par.attend(q, par.local_heads(par.repeat_kv(k, cfg.kv_groups), n_q),
                      par.local_heads(par.repeat_kv(v, cfg.kv_groups), n_q))
  k, v = par.gather_kv(k), par.gather_kv(v)
  k = par.local_heads(par.repeat_kv(k, cfg.kv_groups), n_q)
  v = par.local_heads(par.repeat_kv(v, cfg.kv_groups), n_q)
  return causal_attention(q, k, v, par.causal_mask, cfg.mask_value)


def llama3_parts(cfg: Config, par: Parallel = SEQUENTIAL) -> Parts:
  def embed_in(tokens, p):
    return par.embed_tokens(tokens, p["emb"], cfg)

  def tables(tokens):
    # Positions of this device's tokens, gathered like the activations: the
    # rotary tables are built for the full sequence attention runs over.
    pos = par.gather_seq(par.positions(tokens.shape[1]), 0)
    return rope_tables(pos, cfg.head_dim, cfg.rope_base)

  def layer(h, w, tables):
    cos, sin = tables
    a = par.gather_seq(rmsnorm(h, w("attn_norm")))
    attn = _gqa_attention(a, w("wq"), w("wk"), w("wv"), cos, sin, cfg, par)
    h = h + par.reduce_attn(attn @ w("wo"))
    m = par.gather_seq(rmsnorm(h, w("mlp_norm")))
    if cfg.experts:
      return h + moe_mlp(m, w, par, cfg.top_k, cfg.capacity, cfg.router)
    mlp = (jax.nn.silu(m @ w("w_gate")) * (m @ w("w_up"))) @ w("w_down")
    return h + par.reduce_mlp(mlp)

  def head_out(h, labels, p):
    h = rmsnorm(h, p["final_norm"])
    logits = h @ p["head"]                          # untied output head
    return par.combine_loss(par.token_nll(logits, labels, cfg))

  return Parts(embed_in, tables, layer, head_out)


def llama3_loss(tokens, labels, params, cfg: Config, par: Parallel = SEQUENTIAL):
  return _loss_of_parts(llama3_parts(cfg, par), "llama3", tokens, labels, params, cfg, par)


def moe_mlp(m, w, par: Parallel, top_k: int, capacity: int = 0, router: str = "argmax"):
  """Top-k Mixture of SwiGLU experts (Mixtral-style gates: the router's
  softmax over the chosen experts), GShard-style with each batch row a group
  and room for every token at every expert (nothing dropped): tokens are
  dispatched to an [experts, b, s, d] tensor by a k-hot mask, each expert runs
  on its slice, and each token sums its experts' outputs weighted by their
  gates.  The k experts are picked by k rounds of arg-max masking, or by
  ``lax.top_k`` (``router="top_k"``, ties to the lower expert; the gates a
  softmax over the k values, so the gradient goes through top_k).  Under
  expert parallelism the dispatched tensor is all-to-all'd from token owners
  to expert owners and back.  With a ``capacity``, each expert's slots in a
  group are handed out in token order (a cumulative sum of the choices) and
  tokens beyond it are dropped: the dispatched tensor is [experts, b,
  capacity, d]."""
  logits = m @ w("w_router")                                     # [b, s, E]
  if router == "top_k":  # Mixtral: a softmax over the k largest logits
    top, picked = lax.top_k(logits, top_k)                       # [b, s, k]
    onehot = jax.nn.one_hot(picked, logits.shape[-1], dtype=F32)  # [b, s, k, E]
    chosen = jnp.sum(onehot, axis=-2)
    gates = jnp.einsum("bsk,bske->bse", jax.nn.softmax(top, axis=-1), onehot)
  else:
    chosen = jnp.zeros_like(logits)
    left = logits
    for _ in range(top_k):
      pick = left == jnp.max(left, axis=-1, keepdims=True)
      chosen = chosen + pick.astype(F32)
      left = jnp.where(pick, -jnp.inf, left)
    gates = jnp.where(chosen > 0, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)),
                      0.0)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  if capacity:
    slot = par.expert_slots(chosen)                                # [b, s, E]
    dispatch = (slot[..., None] == jnp.arange(capacity, dtype=F32)).astype(F32)  # [b, s, E, C]
    x = par.to_experts(jnp.einsum("bsec,bsd->ebcd", dispatch, m))
    y = par.from_experts(_swiglu_experts(x, w))
    return jnp.einsum("ebcd,bsec,bse->bsd", y, dispatch, gates)
  x = par.to_experts(jnp.einsum("bse,bsd->ebsd", chosen, m))
  y = par.from_experts(_swiglu_experts(x, w))
  return jnp.einsum("ebsd,bse->bsd", y, gates)


def _swiglu_experts(x, w):
  """Expert e's SwiGLU MLP on its tokens: x [E, b, n, d] -> [E, b, n, d]."""
  hidden = jax.nn.silu(jnp.einsum("ebnd,edf->ebnf", x, w("w_gate"))) * jnp.einsum(
      "ebnd,edf->ebnf", x, w("w_up"))
  return jnp.einsum("ebnf,efd->ebnd", hidden, w("w_down"))


LOSSES = {"gpt2": gpt2_loss, "llama3": llama3_loss}
PARTS = {"gpt2": gpt2_parts, "llama3": llama3_parts}


def loss_fn(model: str, cfg: Config, par: Parallel = SEQUENTIAL,
            name: str | None = None) -> Callable:
  """``fn(tokens, labels, *params) -> scalar loss`` (named for the lowered
  module)."""
  loss = LOSSES[model]

  def fn(tokens, labels, *params):
    tokens, labels = par.local_batch(tokens, labels)
    if cfg.compute_dtype != "float32":
      params = tuple(p.astype(cfg.compute_dtype) for p in params)
    return loss(tokens, labels, params, cfg, par).astype(F32)

  fn.__name__ = fn.__qualname__ = name or f"{model}_loss"
  return fn


def arg_shapes(model: str, cfg: Config) -> list[tuple[tuple, object]]:
  """(shape, dtype) of every argument of ``loss_fn``: tokens, labels, params."""
  tok = ((cfg.batch, cfg.seq), I32)
  return [tok, tok] + [(s, F32) for _, s in param_specs(model, cfg)]
