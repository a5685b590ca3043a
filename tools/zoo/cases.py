"""(sequential, distributed) program pairs, correct and with seeded bugs.

Every program is written once as a plain sequential function over global
arrays.  Its distributed versions are:

  * ``shard_map``: a per-device function with hand-written collectives.  The
    local function usually reuses the sequential building blocks (they are
    written shape-generically) so that a seeded bug is the *only* difference
    between a correct and a buggy variant.
  * ``gspmd``: the sequential function itself, jitted with in/out shardings, so
    XLA's partitioner chooses the collectives.  There are no hand-written
    collectives to get wrong: a GSPMD bug is an edit of XLA's per-device
    module (``partitioner_bugs.py``), as a partitioner bug would make it.

``Case.bug_primitive`` names the jax primitive of the first sequential op (in
jaxpr order) whose value the buggy program no longer computes in any sharded
form (sliced, replicated or as an unreduced partial sum), or ``"output"`` when
every intermediate is right and only the returned value is off.  A static
checker that localises a refinement failure should point at that op.

Cases are built lazily (``all_cases()``), because meshes need the 8 fake CPU
devices that ``tests/conftest.py`` asks XLA for before jax starts.

Meshes are built with ``Mesh(devices, names)`` rather than ``jax.make_mesh``:
the latter defaults to Explicit axis types, under which GSPMD matmuls of
sharded operands need explicit ``out_sharding`` and fail to trace.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

F32 = jnp.float32
EPS = 1e-6
HEAD_DIM = 8


@dataclasses.dataclass
class Case:
  name: str                 # "<program>/<style>/<variant>", variant "ok" if correct
  seq_fn: Callable
  dist_fn: Callable
  seq_args: list            # jax.ShapeDtypeStruct, no sharding
  dist_args: list           # jax.ShapeDtypeStruct with a NamedSharding
  mesh: Mesh
  style: str                # "shard_map" | "gspmd"
  bug: Optional[str]
  bug_primitive: Optional[str]
  out_shardings: Any = None
  in_shardings: Any = None
  # Arguments drawn as magnitudes by the numeric checks (Adam's second
  # moments: a negative one is no state Adam can be in, and its sqrt is NaN).
  nonnegative_args: tuple[int, ...] = ()
  # GSPMD bugs: the edit made to XLA's per-device module
  # (``partitioner_bugs.py``); the partitioner writes the collectives, so no
  # bug of a GSPMD program is in its Python.
  dist_edit: Any = None
  # How closely the two programs' outputs agree on a run (bfloat16 ones
  # round their partial sums, summed in another order).
  tolerance: float = 1e-4
  # The inputs' relation where the shardings do not tell it all, in the
  # relation-file syntax (README): a data loader's zig-zag batches
  # (``orderK=``), given to the verifier as ``--relation`` would.
  relation: Optional[str] = None
  # GSPMD: the model under a schedule written for GSPMD (a pipeline, as
  # MaxText's), not the sequential function itself; its bugs are in its Python.
  scheduled: bool = False

  @property
  def program(self) -> str:
    return self.name.split("/")[0]

  def modules(self):
    """(sequential, distributed) modules as the verifier reads them."""
    from graphguard_hlo.lowering import lower_distributed, lower_sequential
    if self.dist_edit is not None:
      from tools.zoo.partitioner_bugs import load_partitioned
      return lower_sequential(self.seq_fn, *self.seq_args), load_partitioned(self)
    return (lower_sequential(self.seq_fn, *self.seq_args),
            lower_distributed(self.dist_fn, *self.dist_args, in_shardings=self.in_shardings,
                              out_shardings=self.out_shardings))

  def dist_inputs(self, inputs: Sequence) -> list:
    """Global ``inputs`` of the sequential program as the distributed one is
    given them: with the chunks of each dim ``relation`` orders reordered
    (what a data loader does), placed by ``dist_args``' shardings."""
    inputs = list(inputs)
    if self.relation is not None:
      from graphguard_hlo.passes.layout import reorder_chunks
      from graphguard_hlo.relation_file import parse_relation_file
      given = parse_relation_file(f"<{self.name}>", self.relation,
                                  [tuple(a.shape) for a in self.seq_args], axes=None)
      for i, layout in given.items():
        x = np.asarray(inputs[i])
        for dim, chunks in layout.order:
          x = reorder_chunks(x, dim, chunks)
        inputs[i] = x
    return [jax.device_put(x, a.sharding) for x, a in zip(inputs, self.dist_args)]

  def check_well_formed(self) -> None:
    """The invariants every zoo case keeps (AssertionError naming the case)."""
    assert self.style in ("shard_map", "gspmd"), self.name
    assert (self.bug is None) == (self.bug_primitive is None), self.name
    if self.style == "gspmd" and self.relation is None and not self.scheduled:
      # The sequential function itself, partitioned by XLA (or the same model
      # with its scanned layer under jax.checkpoint): bugs are XLA's edits.
      assert (self.bug is None) == (self.dist_edit is None), self.name
      assert self.dist_fn is self.seq_fn or "_remat" in self.name, self.name
    if self.style == "gspmd":  # (with a relation, or scheduled: the user's own program)
      assert self.in_shardings is not None and self.out_shardings is not None, self.name
    else:
      assert self.dist_edit is None, self.name
    for a in self.dist_args:
      assert a.sharding is not None and a.sharding.mesh is self.mesh, self.name
    for a in self.seq_args:
      assert a.sharding is None, self.name


# --------------------------------------------------------------------------
# Sequential building blocks.  Written shape-generically so the same code is
# the per-device body of the shard_map versions (with local shapes).
# --------------------------------------------------------------------------


def _mlp_partial(x, w1, b1, w2):
  """tanh(x @ w1 + b1) @ w2: an unreduced partial sum when w1 is column- and
  w2 row-sharded, the full product when they are not."""
  return jnp.tanh(x @ w1 + b1) @ w2


def mlp_seq(x, w1, b1, w2, b2):
  """The Megatron MLP block, y = tanh(x @ w1 + b1) @ w2 + b2."""
  return _mlp_partial(x, w1, b1, w2) + b2


def mlp2_seq(x, w1, w2, w3, w4):
  """Two bias-free MLP blocks with a gelu in between, so that a missing
  all-reduce after the first block feeds a nonlinearity."""
  z = jnp.tanh(x @ w1) @ w2
  return jnp.tanh(jax.nn.gelu(z) @ w3) @ w4


def _attention_partial(x, wq, wk, wv, wo):
  """Causal multi-head attention up to (excluding) the output bias.

  The head count is read off ``wq``'s width, so with column-sharded q/k/v
  weights each device runs its own heads and ``@ wo`` (row-sharded) yields a
  partial sum over heads."""
  s = x.shape[0]
  heads = wq.shape[1] // HEAD_DIM
  q = (x @ wq).reshape(s, heads, HEAD_DIM)
  k = (x @ wk).reshape(s, heads, HEAD_DIM)
  v = (x @ wv).reshape(s, heads, HEAD_DIM)
  scores = jnp.einsum("shd,thd->hst", q, k) / np.float32(np.sqrt(HEAD_DIM))
  causal = jnp.tril(jnp.ones((s, s), dtype=bool))
  scores = jnp.where(causal, scores, np.float32(-1e9))
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("hst,thd->shd", probs, v).reshape(s, heads * HEAD_DIM)
  return out @ wo


def attention_seq(x, wq, wk, wv, wo, bo):
  return _attention_partial(x, wq, wk, wv, wo) + bo


def _rmsnorm(h, scale):
  ms = jnp.mean(h * h, axis=-1, keepdims=True)
  return h * lax.rsqrt(ms + EPS) * scale


def rmsnorm_seq(x, pos, scale):
  """RMSNorm of x plus a positional embedding.  The embedding makes the result
  depend on *which* rows a device holds, so a permutation of shards shows up
  in the values, not just in their placement."""
  return _rmsnorm(x + pos, scale)


def layernorm_seq(x, scale, bias):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centred = x - mean
  var = jnp.mean(centred * centred, axis=-1, keepdims=True)
  return centred * lax.rsqrt(var + EPS) * scale + bias


def _rope(x, pos):
  """Rotary embedding of x [seq, hidden] at float positions pos [seq]."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=F32) / half))
  angle = pos[:, None] * inv_freq[None, :]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[:, :half], x[:, half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def rope_seq(x):
  return _rope(x, jnp.arange(x.shape[0], dtype=F32))


def mse_seq(x, w, y):
  return jnp.mean((x @ w - y) ** 2)


# --------------------------------------------------------------------------
# Per-device bodies for shard_map.  Each factory takes the knob a bug turns.
# --------------------------------------------------------------------------


def _identity(v):
  return v


def _psum(axis):
  return lambda v: lax.psum(v, axis)


def _pmean(axis):
  return lambda v: lax.pmean(v, axis)


def _tp_mlp_local(reduce):
  """Megatron MLP: partial product, all-reduce, then the (replicated) b2."""
  def local(x, w1, b1, w2, b2):
    return reduce(_mlp_partial(x, w1, b1, w2)) + b2
  return local


def _tp_mlp2_local(first_reduce):
  def local(x, w1, w2, w3, w4):
    z = first_reduce(jnp.tanh(x @ w1) @ w2)
    return lax.psum(jnp.tanh(jax.nn.gelu(z) @ w3) @ w4, "tp")
  return local


def _tp_attention_local(reduce):
  def local(x, wq, wk, wv, wo, bo):
    return reduce(_attention_partial(x, wq, wk, wv, wo)) + bo
  return local


def _swap_neighbours(axis, n):
  """ppermute that exchanges the shards of ranks (0,1), (2,3), ..."""
  perm = [(i, i ^ 1) for i in range(n)]
  return lambda v: lax.ppermute(v, axis, perm)


def _sp_rmsnorm_local(prepare):
  def local(x, pos, scale):
    return _rmsnorm(prepare(x) + pos, scale)
  return local


def _sp_layernorm_local(x, scale, bias):
  """A per-token norm needs no communication when tokens are sharded."""
  return layernorm_seq(x, scale, bias)


def _sp_rope_local(with_offset):
  def local(x):
    n = x.shape[0]
    pos = jnp.arange(n, dtype=F32)
    if with_offset:
      pos = pos + (lax.axis_index("sp") * n).astype(F32)
    return _rope(x, pos)
  return local


def _dp_loss_local_mean(combine):
  """Local mean over this device's batch shard, then a cross-replica combine."""
  def local(x, w, y):
    return combine(mse_seq(x, w, y))
  return local


def _dp_loss_local_sum(x, w, y):
  """Local sum, psum, divide by the *global* element count."""
  global_count = x.shape[0] * lax.axis_size("dp") * y.shape[1]
  return lax.psum(jnp.sum((x @ w - y) ** 2), "dp") / global_count


def _dp_loss_psum_count(x, w, y):
  """Local sum over global count, the count a runtime psum of the local one
  (an all-reduce of a constant on the devices, as autodiff's transposes make)."""
  count = lax.psum(lax.pcast(np.float32(x.shape[0] * y.shape[1]), "dp", to="varying"), "dp")
  return lax.psum(jnp.sum((x @ w - y) ** 2), "dp") / count


def _dp_tp_mlp_local(reduce_axes):
  def local(x, w1, b1, w2, b2):
    return lax.psum(_mlp_partial(x, w1, b1, w2), reduce_axes) + b2
  return local


def _sp_allgather_mlp_local(gather):
  """Korthikanti sequence parallelism: gather the sequence before the
  column-parallel matmul, reduce-scatter it after the row-parallel one."""
  def local(x, w1, b1, w2, b2):
    partial = _mlp_partial(gather(x), w1, b1, w2)
    return lax.psum_scatter(partial, "tp", scatter_dimension=0, tiled=True) + b2
  return local


def _gather_seq(x):
  return lax.all_gather(x, "tp", axis=0, tiled=True)


def heads_seq(x, wq):
  """Project and split into heads, heads major: [heads, seq, head_dim]."""
  s = x.shape[0]
  return jnp.tanh(jnp.transpose((x @ wq).reshape(s, 4, -1), (1, 0, 2)))


def _tp_heads_local(permutation):
  """Each rank projects its heads; ``permutation`` (1, 2, 0) is the bug: head
  dims and positions swapped, the same shape when head_dim == seq."""
  def local(x, wq):
    s = x.shape[0]
    return jnp.tanh(jnp.transpose((x @ wq).reshape(s, 1, -1), permutation))
  return local


def cumsum_seq(x, w):
  """Running sums along the features (a capacity count's cumsum, say)."""
  return jnp.cumsum(x @ w, axis=1)


def _dp_cumsum_local(axis):
  """Rows over dp, so the features are each rank's own; ``axis`` 0 is the
  bug: a running sum down this rank's rows only, as if they were all."""
  return lambda x, w: jnp.cumsum(x @ w, axis=axis)


def embedding_seq(ids, table):
  """An embedding lookup (ids arrive as floats; jnp.take, a gather) and a tanh."""
  return jnp.tanh(jnp.take(table, ids.astype(jnp.int32), axis=0, mode="clip"))


def _fsdp_embedding_local(gather_table=True):
  """Ids over dp, the table's rows too (ZeRO-3): all-gather the table, then
  look up.  ``gather_table=False`` is the bug: each rank looks its ids up in
  its own quarter of the table (clip mode clamps them into it)."""
  def local(ids, table):
    if gather_table:
      table = lax.all_gather(table, "dp", axis=0, tiled=True)
    return embedding_seq(ids, table)
  return local


def _vocab_parallel_embedding_local(first=0):
  """The table's rows over tp (Megatron's vocab-parallel embedding): each rank
  looks the ids up in its own rows, masked to zero where another rank holds
  them, and the psum adds the one row.  The ids are clipped to the table
  first, as ``take(mode="clip")`` clips them.  ``first=1`` is the bug: the
  mask starts a row late (``ids > lo``), so no rank gives its first row."""
  def local(ids, table):
    n = table.shape[0]
    ids = jnp.clip(ids.astype(jnp.int32), 0, n * lax.axis_size("tp") - 1)
    lo = lax.axis_index("tp") * n
    mine = (ids >= lo + first) & (ids < lo + n)
    rows = jnp.take(table, jnp.where(mine, ids - lo, 0), axis=0, mode="clip")
    return jnp.tanh(lax.psum(jnp.where(mine[..., None], rows, 0.0), "tp"))
  return local


def rows_seq(x, w):
  return jnp.tanh(x @ w)


def _tree_gather_local(second_sender=2):
  """An all-gather written by hand: rows over dp gathered to rank 0 by a
  binomial tree of ppermutes (ranks 1 and 3 send to 0 and 2, then 2 sends its
  two tiles to 0; the other ranks receive zeros), then broadcast by a masked
  psum.  ``second_sender`` 3 is the bug: rank 0 gets rank 3's one tile where
  rank 2's two belong."""
  def local(x, w):
    pairs = lax.ppermute(x, "dp", [(1, 0), (3, 2)])
    buf = jnp.concatenate([x, pairs])
    buf = jnp.concatenate([buf, lax.ppermute(buf, "dp", [(second_sender, 0)])])
    whole = lax.psum(jnp.where(lax.axis_index("dp") == 0, buf, 0.0), "dp")
    return jnp.tanh(whole @ w)
  return local


def _gather_hidden_then_reshape(x):
  """The bug: gather along hidden, then reshape to the shape the seq gather
  would have produced.  Types check; rows come out interleaved by device."""
  s, h = x.shape
  n = lax.axis_size("tp")
  return lax.all_gather(x, "tp", axis=1, tiled=True).reshape(s * n, h)


# --------------------------------------------------------------------------
# Programs: the sequential function plus its global shapes and shardings.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Program:
  name: str
  seq_fn: Callable
  shapes: tuple
  in_specs: tuple
  out_spec: P
  mesh_shape: tuple
  axis_names: tuple


_PROGRAMS = {p.name: p for p in [
    _Program("tp_mlp", mlp_seq,
             ((16, 32), (32, 64), (64,), (64, 32), (32,)),
             (P(), P(None, "tp"), P("tp"), P("tp", None), P()),
             P(), (4,), ("tp",)),
    _Program("tp_mlp2", mlp2_seq,
             ((16, 32), (32, 64), (64, 32), (32, 64), (64, 32)),
             (P(), P(None, "tp"), P("tp", None), P(None, "tp"), P("tp", None)),
             P(), (4,), ("tp",)),
    _Program("tp_attention", attention_seq,
             ((16, 32), (32, 32), (32, 32), (32, 32), (32, 32), (32,)),
             (P(), P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp", None),
              P()),
             P(), (4,), ("tp",)),
    _Program("sp_rmsnorm", rmsnorm_seq,
             ((32, 16), (32, 16), (16,)),
             (P("sp", None), P("sp", None), P()),
             P("sp", None), (4,), ("sp",)),
    _Program("sp_layernorm", layernorm_seq,
             ((32, 16), (16,), (16,)),
             (P("sp", None), P(), P()),
             P("sp", None), (4,), ("sp",)),
    _Program("sp_rope", rope_seq,
             ((32, 16),),
             (P("sp", None),),
             P("sp", None), (4,), ("sp",)),
    _Program("dp_loss", mse_seq,
             ((32, 16), (16, 8), (32, 8)),
             (P("dp", None), P(), P("dp", None)),
             P(), (4,), ("dp",)),
    _Program("dp_tp_mlp", mlp_seq,
             ((16, 32), (32, 64), (64,), (64, 32), (32,)),
             (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
             P("dp", None), (2, 4), ("dp", "tp")),
    _Program("tp_heads", heads_seq,
             ((8, 32), (32, 32)),
             (P(), P(None, "tp")),
             P("tp"), (4,), ("tp",)),
    _Program("dp_cumsum", cumsum_seq,
             ((16, 8), (8, 8)),
             (P("dp", None), P()),
             P("dp", None), (4,), ("dp",)),
    _Program("fsdp_embedding", embedding_seq,
             ((16,), (8, 4)),
             (P("dp"), P("dp", None)),
             P("dp", None), (4,), ("dp",)),
    _Program("vocab_parallel_embedding", embedding_seq,
             ((16,), (8, 4)),
             (P(), P("tp", None)),
             P(), (4,), ("tp",)),
    _Program("dp_tree_gather", rows_seq,
             ((16, 8), (8, 8)),
             (P("dp", None), P()),
             P(), (4,), ("dp",)),
    _Program("sp_allgather_mlp", mlp_seq,
             ((32, 32), (32, 64), (64,), (64, 32), (32,)),
             (P("tp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
             P("tp", None), (4,), ("tp",)),
]}


@dataclasses.dataclass(frozen=True)
class _Variant:
  """One shard_map body of a program; ``bug`` None means correct."""
  program: str
  local_fn: Callable
  variant: str = "ok"
  bug: Optional[str] = None
  bug_primitive: Optional[str] = None
  # The vma checker rejects a body whose output varies over an axis that
  # out_specs says is replicated; a missing all-reduce does exactly that, so
  # those bugs switch it off (as their authors would have had to).
  check_vma: bool = True


def _variants() -> list[_Variant]:
  V = _Variant
  return [
      V("tp_mlp", _tp_mlp_local(_psum("tp"))),
      V("tp_mlp", _tp_mlp_local(_identity), "missing_allreduce",
        "missing_allreduce", "add", check_vma=False),
      V("tp_mlp", _tp_mlp_local(_pmean("tp")), "pmean_not_psum",
        "pmean_not_psum", "add"),
      V("tp_mlp2", _tp_mlp2_local(_psum("tp"))),
      # gelu's first primitive is integer_pow (x ** 3), applied to a partial sum.
      V("tp_mlp2", _tp_mlp2_local(_identity), "missing_allreduce",
        "missing_allreduce", "integer_pow"),
      V("tp_attention", _tp_attention_local(_psum("tp"))),
      V("tp_attention", _tp_attention_local(_identity), "missing_allreduce",
        "missing_allreduce", "add", check_vma=False),
      V("sp_rmsnorm", _sp_rmsnorm_local(_identity)),
      V("sp_rmsnorm", _sp_rmsnorm_local(_swap_neighbours("sp", 4)),
        "swapped_shards", "swapped_shards", "add"),
      V("sp_layernorm", _sp_layernorm_local),
      V("sp_rope", _sp_rope_local(with_offset=True)),
      # Every device uses positions 0..n-1: the sequential position iota is
      # the first value no device holds its slice of (except device 0).
      V("sp_rope", _sp_rope_local(with_offset=False), "rope_no_offset",
        "rope_no_offset", "iota"),
      V("dp_loss", _dp_loss_local_mean(_pmean("dp"))),
      V("dp_loss", _dp_loss_local_sum, "ok_psum_then_divide"),
      V("dp_loss", _dp_loss_psum_count, "ok_psum_count"),
      # Sum of local means = n * global mean.  Every earlier value (x @ w, the
      # residual, its square, the local sums as partials) is right; only the
      # mean's division, the last sequential op, whose result *is* the output,
      # is off by n.  A per-op checker may equally blame that "div".
      V("dp_loss", _dp_loss_local_mean(_psum("dp")), "psum_not_pmean",
        "psum_not_pmean", "output"),
      V("dp_tp_mlp", _dp_tp_mlp_local("tp")),
      V("dp_tp_mlp", _dp_tp_mlp_local("dp"), "wrong_replica_groups",
        "wrong_replica_groups", "add", check_vma=False),
      V("dp_tp_mlp", _dp_tp_mlp_local(("dp", "tp")),
        "wrong_replica_groups_both", "wrong_replica_groups", "add"),
      V("tp_heads", _tp_heads_local((1, 0, 2))),
      # The local transpose only moves a unit dim in the right program, so the
      # sequential transpose relates to its operand either way; the first
      # value no rank holds is the tanh of it.
      V("tp_heads", _tp_heads_local((1, 2, 0)), "wrong_transpose", "wrong_transpose",
        "tanh"),
      V("dp_cumsum", _dp_cumsum_local(1)),
      V("dp_cumsum", _dp_cumsum_local(0), "cumsum_wrong_axis", "wrong_axis",
        "reduce_window"),
      V("fsdp_embedding", _fsdp_embedding_local()),
      # The lookup reads a quarter of the table as if it were all of it.
      V("fsdp_embedding", _fsdp_embedding_local(gather_table=False), "table_not_gathered",
        "missing_allgather", "gather"),
      V("vocab_parallel_embedding", _vocab_parallel_embedding_local()),
      # No rank looks up the first of its rows (id 0 among them).
      V("vocab_parallel_embedding", _vocab_parallel_embedding_local(first=1),
        "first_row_masked", "tile_mask_off_by_one", "gather"),
      V("dp_tree_gather", _tree_gather_local()),
      # Rank 0 holds rows 0:8 and 12:16, zeros where rows 8:12 belong.
      V("dp_tree_gather", _tree_gather_local(second_sender=3), "wrong_tree_sender",
        "wrong_permutation", "dot_general"),
      V("sp_allgather_mlp", _sp_allgather_mlp_local(_gather_seq)),
      # Rows reach x @ w1 permuted, so the first matmul is already wrong.
      V("sp_allgather_mlp", _sp_allgather_mlp_local(_gather_hidden_then_reshape),
        "wrong_gather_dim", "wrong_gather_dim", "dot_general"),
  ]


# Programs whose GSPMD version is omitted, with the reason.  (Empty: every
# program here is a plain function of sharded inputs, which is all GSPMD needs.)
NO_GSPMD: dict[str, str] = {}


# --------------------------------------------------------------------------
# Case construction.
# --------------------------------------------------------------------------


@functools.cache
def mesh_of(shape: tuple, names: tuple) -> Mesh:
  """A mesh over the first devices (Auto axes: jax.make_mesh defaults to Explicit)."""
  n = int(np.prod(shape))
  devices = jax.devices()
  if len(devices) < n:
    raise RuntimeError(
        f"need {n} devices, have {len(devices)}: set XLA_FLAGS="
        "--xla_force_host_platform_device_count=8 before importing jax")
  return Mesh(np.array(devices[:n]).reshape(shape), names)


def _args(prog: _Program, mesh: Mesh | None) -> list:
  if mesh is None:
    return [jax.ShapeDtypeStruct(s, F32) for s in prog.shapes]
  return [jax.ShapeDtypeStruct(s, F32, sharding=NamedSharding(mesh, spec))
          for s, spec in zip(prog.shapes, prog.in_specs)]


def _named(fn: Callable, name: str) -> Callable:
  """A copy of fn called ``name``: jit names the lowered module after the
  function, and ``jit_tp_mlp_missing_allreduce`` beats a dozen ``jit_local``."""
  @functools.wraps(fn)
  def named(*args):
    return fn(*args)
  named.__name__ = named.__qualname__ = name
  return named


def _shard_map_case(v: _Variant) -> Case:
  prog = _PROGRAMS[v.program]
  mesh = mesh_of(prog.mesh_shape, prog.axis_names)
  local_fn = _named(v.local_fn, f"{prog.name}_{v.variant}")
  dist_fn = shard_map(local_fn, mesh=mesh, in_specs=prog.in_specs,
                      out_specs=prog.out_spec, check_vma=v.check_vma)
  return Case(name=f"{prog.name}/shard_map/{v.variant}", seq_fn=prog.seq_fn,
              dist_fn=dist_fn, seq_args=_args(prog, None),
              dist_args=_args(prog, mesh), mesh=mesh, style="shard_map",
              bug=v.bug, bug_primitive=v.bug_primitive)


def _gspmd_case(prog: _Program) -> Case:
  mesh = mesh_of(prog.mesh_shape, prog.axis_names)
  in_shardings = tuple(NamedSharding(mesh, s) for s in prog.in_specs)
  return Case(name=f"{prog.name}/gspmd/ok", seq_fn=prog.seq_fn,
              dist_fn=prog.seq_fn, seq_args=_args(prog, None),
              dist_args=_args(prog, mesh), mesh=mesh, style="gspmd",
              bug=None, bug_primitive=None,
              out_shardings=NamedSharding(mesh, prog.out_spec),
              in_shardings=in_shardings)


@functools.cache
def _build() -> tuple[Case, ...]:
  built = [_shard_map_case(v) for v in _variants()]
  built += [_gspmd_case(p) for name, p in _PROGRAMS.items()
            if name not in NO_GSPMD]
  return tuple(built)


def all_cases() -> list[Case]:
  return list(_build())


def correct_cases() -> list[Case]:
  return [c for c in _build() if c.bug is None]


def bug_cases() -> list[Case]:
  return [c for c in _build() if c.bug is not None]


def get(name: str) -> Case:
  for c in _build():
    if c.name == name:
      return c
  raise KeyError(f"no zoo case {name!r}; known: {[c.name for c in _build()]}")
