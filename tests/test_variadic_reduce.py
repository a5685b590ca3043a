"""Variadic reduces (jnp.argmax, argmin: values and indices reduced together).

The ``reduce`` lemma's variadic case: over dims no axis tiles, of operands
tiled alike, each rank reduces whole rows of its tile, so the results are
tiled like the rows, whatever the reducer.  Checked here as every lemma is
(``test_lemmas.py``), rank by rank on random meshes and layouts, with jax's
argmax reducer folded in order; and end to end: a batch's accuracy metric
under data parallelism, shard_map and GSPMD (whose partitioned module lists
the reducer's ops in another order than jax does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, strategies as st
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo import ir
from graphguard_hlo.passes.layout import Layout, assemble, shard
from graphguard_hlo.passes.lemmas import apply_lemmas
from graphguard_hlo.report import to_text
from tests.layout_draws import meshes
from tests.test_lemmas import SETTINGS, draw_layout, draw_shape, nearby, seq_op


def _argmax_step(acc, x):
  """jax's argmax reducer: the larger value (NaN wins), the lower index on ties."""
  (av, ai), (xv, xi) = acc, x
  take = (xv > av) | (xv != xv) & (av == av) | (xv == av) & (xi < ai)
  return np.where(take, xv, av), np.where(take, xi, ai)


def _variadic_reduce(values, indices, dims):
  """Fold the reducer over ``dims`` element by element, in row-major order."""
  kept = [d for d in range(values.ndim) if d not in dims]
  order = kept + list(dims)
  v = np.transpose(values, order).reshape([values.shape[d] for d in kept] + [-1])
  i = np.transpose(indices, order).reshape(v.shape)
  acc = (np.full(v.shape[:-1], -np.inf), np.zeros(v.shape[:-1], np.int64))
  for j in range(v.shape[-1]):
    acc = _argmax_step(acc, (v[..., j], i[..., j]))
  return acc


@st.composite
def variadic_cases(draw):
  mesh = draw(meshes())
  a = draw_layout(draw, mesh, draw(st.integers(1, 3)), partial=False,
                  scales=(1.0,) * 5 + (0.5,), rotations=draw(st.integers(0, 3)) == 0)
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  shape = draw_shape(draw, mesh, a)
  values = rng.integers(-2, 3, shape).astype(np.float64)  # ties, to test their order
  values[rng.random(shape) < 0.05] = np.nan
  indices = rng.integers(0, 5, shape)
  untiled = [d for d in range(len(shape)) if not a.dims[d]]
  tiled = [d for d in range(len(shape)) if a.dims[d] and mesh.size > 1]
  pool = untiled if untiled and draw(st.booleans()) else list(range(len(shape)))
  dims = set(draw(st.lists(st.sampled_from(pool), unique=True)))  # mostly untiled
  if tiled and draw(st.integers(0, 3)) == 0:
    dims.add(draw(st.sampled_from(tiled)))  # which the lemma must refuse
  dims = tuple(sorted(dims))
  out = [n for d, n in enumerate(shape) if d not in dims]
  b = a if draw(st.integers(0, 3)) else nearby(draw, mesh, a, 0.5)
  inits = [np.array(-np.inf), np.array(0)]
  op = seq_op("reduce", {"dimensions": dims, "gg.reduction": None},
              [values, indices] + inits, out, mesh)
  return mesh, op, [a, b, Layout.replicated(0), Layout.replicated(0)], values, indices, dims


def test_a_variadic_reduce_over_untiled_dims_is_the_reduce_of_the_tiles():
  hits = {"cases": 0, "reduce": 0}

  @SETTINGS
  @given(variadic_cases())
  def check(case):
    mesh, op, layouts, values, indices, dims = case
    hits["cases"] += 1
    if any(l.local_shape(np.shape(v), mesh) is None
           for l, v in zip(layouts, (values, indices))):
      return
    want = _variadic_reduce(values, indices, dims)
    rng = np.random.default_rng(0)
    local_v, local_i = (shard(l, mesh, v, rng) for l, v in zip(layouts, (values, indices)))
    for step in apply_lemmas(op, layouts):
      if step.lemma != "reduce":
        continue
      hits["reduce"] += 1
      got = {c: _variadic_reduce(local_v[c], local_i[c], dims) for c in local_v}
      for k in range(2):
        whole = assemble(step.layout, mesh, {c: r[k] for c, r in got.items()})
        np.testing.assert_array_equal(whole, want[k],
                                      err_msg=f"{layouts} {dims} -> {step.layout}")
  check()
  assert hits["reduce"] >= 0.2 * hits["cases"], hits


def test_tiled_reduced_dims_or_operands_tiled_apart_yield_nothing():
  mesh = ir.Mesh((("x", 2),))
  x = np.zeros((4, 6))
  rows, cols = Layout(((("x",)), ())), Layout(((), ("x",)))

  def yields(layouts, dims):
    op = seq_op("reduce", {"dimensions": dims, "gg.reduction": None},
                [x, x, np.array(0.0), np.array(0.0)], [4], mesh)
    return [s for s in apply_lemmas(op, layouts) if s.lemma == "reduce"]
  inits = [Layout.replicated(0)] * 2
  assert yields([rows, rows] + inits, (1,))
  assert not yields([cols, cols] + inits, (1,))  # each rank has half of each row
  assert not yields([rows, cols] + inits, (1,))  # values and indices from other elements
  assert not yields([rows, Layout(((), ()))] + inits, (1,))


# -- end to end: an accuracy metric under data parallelism ---------------------------------

MESH = Mesh(np.array(jax.devices()[:4]), ("dp",))
W = jax.ShapeDtypeStruct((16, 64), jnp.float32)
X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
LABELS = jax.ShapeDtypeStruct((8,), jnp.int32)
SPECS = (P(), P("dp"), P("dp"))


def metrics(w, x, labels):
  logits = x @ w
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, (jnp.argmax(logits, -1) == labels).mean()


def _data_parallel(argmax_axis=-1):
  def body(w, x, labels):
    logits = x @ w
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    hit = jnp.argmax(logits, argmax_axis) == labels
    return jax.lax.pmean(loss, "dp"), jax.lax.pmean(hit.mean(), "dp")
  return shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=(P(), P()), check_vma=False)


def test_accuracy_under_shard_map_is_proved():
  result = gg.verify(metrics, _data_parallel(), W, X, LABELS, mesh=MESH, in_specs=SPECS)
  assert result.refines, to_text(result, "seq", "dist")


def test_accuracy_under_gspmd_is_proved():
  result = gg.verify(metrics, metrics, W, X, LABELS, mesh=MESH, in_specs=SPECS,
                     out_specs=(P(), P()))
  assert result.refines, to_text(result, "seq", "dist")


def test_argmin_where_argmax_belongs_is_reported_at_the_reduce():
  def wrong(w, x, labels):
    loss, _ = metrics(w, x, labels)
    return loss, (jnp.argmin(x @ w, -1) == labels).mean()
  dist = shard_map(lambda *a: jax.tree.map(lambda t: jax.lax.pmean(t, "dp"), wrong(*a)),
                   mesh=MESH, in_specs=SPECS, out_specs=(P(), P()), check_vma=False)
  result = gg.verify(metrics, dist, W, X, LABELS, mesh=MESH, in_specs=SPECS)
  assert not result.refines
  assert result.failure.op_name == "reduce", to_text(result, "seq", "dist")


# -- jnp.select: an argmax over the stacked conditions ---------------------------------------

def piecewise(x):
  return jnp.select([x < -1, x > 1], [x * 2, x * 3], x)


def test_jnp_select_under_gspmd_is_proved():
  """jnp.select stacks its conditions (after a splat of false, which takes the
  rows' tiling) and picks the first true one by an argmax over booleans, whose
  reducer XLA simplifies (no NaN test for booleans): both read alike."""
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  result = gg.verify(piecewise, piecewise, x, mesh=MESH, in_specs=(P("dp"),),
                     out_specs=P("dp"))
  assert result.refines, to_text(result, "seq", "dist")


def test_jnp_select_with_its_cases_swapped_is_reported():
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  swapped = lambda x: jnp.select([x > 1, x < -1], [x * 2, x * 3], x)
  result = gg.verify(piecewise, swapped, x, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
  assert not result.refines
