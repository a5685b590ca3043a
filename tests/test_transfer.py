"""Every transfer rule is sound, checked numerically on random meshes and layouts.

A rule claims: if ``s ~ L of x`` and the per-device program computes
``y = g(x)`` (a collective, a rank-dependent dynamic-slice, a product with a
constant), then ``s ~ L' of y``.  Each test builds a tiny per-device program
by hand (one parameter, the op, and for dynamic-slice the ``partition_id``
arithmetic shard_map emits for ``axis_index``), asks ``Transfer.apply`` for
``L'``, then runs the program on a random sharding of a random ``s``
(collectives simulated over the mesh, everything else by
``reference.evaluate``) and assembles ``y`` with ``L'``: it must give ``s``
back.  Fixed cases at the end pin down what rules must refuse.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from graphguard_hlo import ir, reference
from tests.layout_draws import axis_slots, meshes, tiles
from graphguard_hlo.passes.dist_egraph import DistEGraph
from graphguard_hlo.passes.layout import Layout, assemble, shard, spread_extrema
from graphguard_hlo.passes.rank_arith import RankArithmetic
from graphguard_hlo.passes.transfer import Transfer

SCALES = (1.0, 0.5, 2.0, 0.25)
KINDS = ("sum", "max", "min")
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


# -- meshes, layouts, values (as in test_lemmas) -----------------------------------------

def draw_layout(draw, mesh: ir.Mesh, rank: int) -> Layout:
  """Each mesh axis tiles some dim, is partial, or is replicated; random order."""
  dims, part = axis_slots(draw, mesh, rank, "partial")
  return Layout(dims, tuple(part), draw(st.sampled_from(KINDS)), draw(st.sampled_from(SCALES)))


def draw_size(draw, n_tiles: int) -> int:
  return n_tiles * draw(st.integers(1, max(1, 8 // n_tiles)))


def draw_axes(draw, mesh: ir.Mesh, prefer) -> tuple[str, ...]:
  """A non-empty ordered set of axes, mostly from ``prefer``."""
  pool = list(prefer) if prefer and draw(st.integers(0, 4)) else list(mesh.axis_names)
  return tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool),
                             unique=True)))


# -- simulating the per-device program over the mesh ---------------------------------------

def ranks(mesh: ir.Mesh):
  return list(np.ndindex(*[n for _, n in mesh.axes]))


def group(mesh: ir.Mesh, coord, axes) -> tuple[list[tuple[int, ...]], int]:
  """The ranks that differ from ``coord`` only on ``axes``, in group order
  (``axes`` major to minor, as ``gg.axes`` lists them), and coord's index."""
  names = mesh.axis_names
  members = []
  for sub in itertools.product(*[range(mesh.axis_size(a)) for a in axes]):
    c = list(coord)
    for a, i in zip(axes, sub):
      c[names.index(a)] = i
    members.append(tuple(c))
  return members, members.index(tuple(coord))


def all_reduce(op, x, mesh):
  fn = reference.REDUCERS[op.attrs["gg.reduction"]]
  return {c: functools.reduce(fn, [x[m] for m in group(mesh, c, op.attrs["gg.axes"])[0]])
          for c in x}


def all_gather(op, x, mesh):
  k = op.attrs["all_gather_dimension"]
  return {c: np.concatenate([x[m] for m in group(mesh, c, op.attrs["gg.axes"])[0]], axis=k)
          for c in x}


def reduce_scatter(op, x, mesh):
  out = {}
  for c in x:
    members, me = group(mesh, c, op.attrs["gg.axes"])
    total = sum(x[m] for m in members)
    out[c] = np.split(total, len(members), axis=op.attrs["scatter_dimension"])[me]
  return out


def all_to_all(op, x, mesh):
  """Rank ``me`` gets piece ``me`` (along split_dimension) of every member's
  value and concatenates them in group order along concat_dimension."""
  i, j = op.attrs["split_dimension"], op.attrs["concat_dimension"]
  out = {}
  for c in x:
    members, me = group(mesh, c, op.attrs["gg.axes"])
    out[c] = np.concatenate([np.split(x[m], len(members), axis=i)[me] for m in members], axis=j)
  return out


def collective_permute(op, x, mesh):
  """Along one axis: coordinate ``dst`` gets ``src``'s value, others get zeros.
  Reads the raw pairs (with fixed points), not the canonical ``gg.permutation``;
  ``test.device_pairs`` instead: device ``dst`` gets device ``src``'s value."""
  if "test.device_pairs" in op.attrs:
    coord = {device_id(mesh, c): c for c in x}
    src_of = {dst: src for src, dst in op.attrs["test.device_pairs"]}
    return {c: x[coord[src_of[device_id(mesh, c)]]].copy() if device_id(mesh, c) in src_of
            else np.zeros_like(x[c]) for c in x}
  (axis,) = op.attrs["gg.axes"]
  k = mesh.axis_names.index(axis)
  src_of = {dst: src for src, dst in op.attrs["test.pairs"]}
  out = {}
  for c in x:
    if c[k] in src_of:
      out[c] = x[c[:k] + (src_of[c[k]],) + c[k + 1:]].copy()
    else:
      out[c] = np.zeros_like(x[c])
  return out


COLLECTIVES = {"all_reduce": all_reduce, "all_gather": all_gather,
               "reduce_scatter": reduce_scatter, "all_to_all": all_to_all,
               "collective_permute": collective_permute}


def device_id(mesh: ir.Mesh, coord) -> int:
  return int(mesh.devices()[tuple(coord)])


class Program:
  """A hand-built per-device program: parameter ``x`` and the ops added to it."""

  def __init__(self, mesh: ir.Mesh, local_shape):
    self.mesh = mesh
    self.module = ir.Module("<test>", "stablehlo")
    self.graph = ir.Graph("per_device")
    self.param = self.module.new_value(ir.TensorType(tuple(local_shape), "f32"), name="x")
    self.graph.params = [self.param]

  def add(self, name: str, operands, shape, dtype: str = "f32", attrs=None) -> ir.Op:
    return self.module.add_op(self.graph, name, list(operands),
                              [ir.TensorType(tuple(shape), dtype)], attrs)

  def const(self, value, dtype: str) -> ir.Value:
    np_dtype = {"ui32": np.uint32, "i32": np.int32, "f32": np.float32}[dtype]
    return self.add("constant", [], (), dtype, {"value": np.array(value, dtype=np_dtype)}).result

  def axis_index(self, axis: str) -> ir.Value:
    """``axis_index`` as shard_map lowers it: (partition_id / stride) % size, as i32."""
    names = self.mesh.axis_names
    stride = math.prod(n for _, n in self.mesh.axes[names.index(axis) + 1:])
    pid = self.add("partition_id", [], (), "ui32").result
    q = self.add("divide", [pid, self.const(stride, "ui32")], (), "ui32").result
    r = self.add("remainder", [q, self.const(self.mesh.axis_size(axis), "ui32")], (),
                 "ui32").result
    return self.add("convert", [r], (), "i32").result

  def transfer(self, op: ir.Op, layout: Layout) -> list[Layout]:
    """What the rules say op's result relates by, given ``s ~ layout of x``."""
    self.graph.results = [op.result]
    deg = DistEGraph(self.graph)
    rules = Transfer(deg, RankArithmetic(self.mesh), self.mesh, self.graph)
    out = []
    # The per-device parameter is the tile itself here.
    for cls, new, _ in rules.apply(op, deg.of(self.param), layout, self.param.shape):
      assert cls == deg.of(op.result)
      out.append(new)
    return out

  def run(self, x_at: dict) -> dict[int, dict]:
    """Every value at every rank."""
    env = {self.param.id: x_at}
    for op in self.graph.ops:
      ins = [env[v.id] for v in op.operands]
      if op.name in COLLECTIVES:
        out = COLLECTIVES[op.name](op, ins[0], self.mesh)
      elif op.name == "partition_id":
        out = {c: np.array(device_id(self.mesh, c), np.uint32) for c in ranks(self.mesh)}
      else:
        out = {c: reference.evaluate(op.name, op.attrs, [x[c] for x in ins], op.result.type)
               for c in ranks(self.mesh)}
      env[op.result.id] = out
    return env


def check_rule(prog: Program, op: ir.Op, layout: Layout, value: np.ndarray, seed: int
               ) -> list[Layout]:
  """Every layout the rules give ``op``'s result must rebuild ``value`` from a
  run of the program on a random sharding of ``value`` by ``layout``."""
  mesh = prog.mesh
  news = prog.transfer(op, layout)
  if not news:
    return news
  rng = np.random.default_rng(seed)
  x_at = spread_extrema(layout, mesh, shard(layout, mesh, value, rng), rng)
  y_at = prog.run(x_at)[op.result.id]
  for new in news:
    what = f"{op.name} {op.attrs}: {layout} -> {new}, mesh {mesh.axes}, global {value.shape}"
    assert new.local_shape(value.shape, mesh) == op.result.type.shape, what
    try:
      got = assemble(new, mesh, y_at)
    except AssertionError as e:
      raise AssertionError(f"replicas disagree: {what}") from e
    np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-8, err_msg=what)
  return news


class Hits:
  """How many examples a rule yielded on: a generator that drifts away from
  what its rule accepts would otherwise test nothing."""

  def __init__(self):
    self.cases = self.yielded = 0

  def add(self, news) -> None:
    self.cases += 1
    self.yielded += bool(news)

  def check(self, share: float = 0.2) -> None:
    assert self.yielded >= share * self.cases, vars(self)


@st.composite
def setups(draw, min_rank: int = 1):
  """A mesh, a layout, a global shape it divides, random values and a seed."""
  mesh = draw(meshes())
  layout = draw_layout(draw, mesh, draw(st.integers(min_rank, 3)))
  shape = [draw_size(draw, tiles(mesh, axes)) for axes in layout.dims]
  seed = draw(st.integers(0, 2**32 - 1))
  return mesh, layout, shape, seed


def values(shape, seed) -> np.ndarray:
  return np.random.default_rng(seed + 1).standard_normal(shape)


def local(layout: Layout, shape, mesh) -> tuple[int, ...]:
  out = layout.local_shape(shape, mesh)
  assert out is not None
  return out


# -- collectives -------------------------------------------------------------------------

def test_all_reduce():
  hits = Hits()

  @SETTINGS
  @given(setups(min_rank=0), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    reducible = [a for a in mesh.axis_names if a not in layout.split_axes()]
    axes = draw_axes(data.draw, mesh, reducible)
    kind = data.draw(st.sampled_from([layout.partial_kind] * 2 + list(KINDS)))
    lshape = local(layout, shape, mesh)
    prog = Program(mesh, lshape)
    op = prog.add("all_reduce", [prog.param], lshape,
                  attrs={"gg.axes": axes, "gg.reduction": kind})
    hits.add(check_rule(prog, op, layout, values(shape, seed), seed))

  check()
  hits.check()


def test_all_gather():
  hits = Hits()

  @SETTINGS
  @given(setups(), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    k = data.draw(st.integers(0, len(shape) - 1))
    have = layout.dims[k]
    how = data.draw(st.sampled_from(["suffix"] * 3 + ["part", "any"]))
    if have and how == "suffix":
      axes = have[data.draw(st.integers(0, len(have) - 1)):]  # minor axes: gatherable
    elif have and how == "part":
      start = data.draw(st.integers(0, len(have) - 1))
      axes = have[start:data.draw(st.integers(start + 1, len(have)))]
    else:
      axes = draw_axes(data.draw, mesh, ())
    lshape = list(local(layout, shape, mesh))
    prog = Program(mesh, lshape)
    lshape[k] *= tiles(mesh, axes)
    op = prog.add("all_gather", [prog.param], lshape,
                  attrs={"gg.axes": axes, "all_gather_dimension": k})
    hits.add(check_rule(prog, op, layout, values(shape, seed), seed))

  check()
  hits.check()


def test_reduce_scatter():
  hits = Hits()

  @SETTINGS
  @given(setups(), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    summable = [a for a in mesh.axis_names if a not in layout.used_axes()
                or (a in layout.partial and layout.partial_kind == "sum")]
    axes = draw_axes(data.draw, mesh, summable)
    k = data.draw(st.integers(0, len(shape) - 1))
    n = tiles(mesh, axes)
    shape[k] = tiles(mesh, layout.dims[k]) * n * data.draw(st.integers(1, 2))
    lshape = list(local(layout, shape, mesh))
    prog = Program(mesh, lshape)
    lshape[k] //= n
    op = prog.add("reduce_scatter", [prog.param], lshape,
                  attrs={"gg.axes": axes, "scatter_dimension": k, "gg.reduction": "sum"})
    hits.add(check_rule(prog, op, layout, values(shape, seed), seed))

  check()
  hits.check()


def test_all_to_all():
  hits = Hits()

  @SETTINGS
  @given(setups(min_rank=2), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    rank = len(shape)
    tiled = [d for d, axes in enumerate(layout.dims) if axes]
    j = data.draw(st.sampled_from(tiled if tiled else range(rank)))
    i = data.draw(st.sampled_from([d for d in range(rank) if d != j] * 3 + [j]))
    have = layout.dims[j]
    if have and data.draw(st.integers(0, 4)):
      axes = have[data.draw(st.integers(0, len(have) - 1)):]
    else:
      axes = draw_axes(data.draw, mesh, ())
    n = tiles(mesh, axes)
    if i != j:
      shape[i] = tiles(mesh, layout.dims[i]) * n * data.draw(st.integers(1, 2))
    elif (shape[j] // tiles(mesh, have)) % n:
      shape[j] = tiles(mesh, have) * n * data.draw(st.integers(1, 2))
    lshape = list(local(layout, shape, mesh))
    prog = Program(mesh, lshape)
    lshape[i] //= n
    lshape[j] *= n
    op = prog.add("all_to_all", [prog.param], lshape,
                  attrs={"gg.axes": axes, "split_dimension": i, "concat_dimension": j})
    hits.add(check_rule(prog, op, layout, values(shape, seed), seed))

  check()
  hits.check()


def _off_axis(layout: Layout, axis: str) -> Layout:
  """``layout`` with ``axis`` neither tiling a dim nor partial."""
  return Layout(tuple(tuple(a for a in axes if a != axis) for axes in layout.dims),
                tuple(a for a in layout.partial if a != axis), layout.partial_kind,
                layout.scale, layout.at)


def draw_axis_and_layout(data, mesh: ir.Mesh, layout: Layout, pin) -> tuple[str, Layout]:
  """A mesh axis and ``layout`` off it, pinned to one of its coordinates
  (``pin`` True), never, or as drawn (``pin`` None); pinned, sometimes zero
  at the other coordinates."""
  axis = data.draw(st.sampled_from(list(mesh.axis_names)))
  layout = _off_axis(layout, axis)
  if pin or (pin is None and data.draw(st.booleans())):
    layout = layout.with_(at=((axis, data.draw(st.integers(0, mesh.axis_size(axis) - 1))),),
                          zero_elsewhere=data.draw(st.booleans()))
  return axis, layout


def permute_attrs(axis: str, pairs) -> dict:
  """Canonical attrs, as ``collectives.canonicalize_collectives`` writes them
  (``sharding.axes_of_pairs`` drops pairs that stay in place); the raw pairs
  go along for the simulator."""
  moving = tuple(sorted((s, d) for s, d in pairs if s != d))
  return {"gg.axes": (axis,), "gg.permutation": moving, "test.pairs": tuple(pairs)}


def test_collective_permute():
  hits = Hits()

  @SETTINGS
  @given(setups(min_rank=0), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    big = [a for a, n in mesh.axes if n > 1]
    axis = data.draw(st.sampled_from(big or list(mesh.axis_names)))
    if data.draw(st.integers(0, 3)):  # mostly permute along an axis x is replicated on
      layout = _off_axis(layout, axis)
    n = mesh.axis_size(axis)
    how = data.draw(st.sampled_from(["shift", "shift", "shift", "any", "some"]))
    if how == "shift":  # what ppermute rings do
      shift = data.draw(st.integers(1, max(1, n - 1)))
      pairs = [(s, (s + shift) % n) for s in range(n)]
    else:
      pairs = list(enumerate(data.draw(st.permutations(range(n)))))
      if how == "some":  # some coordinates receive nothing
        pairs = pairs[:data.draw(st.integers(0, n))]
    lshape = local(layout, shape, mesh)
    prog = Program(mesh, lshape)
    op = prog.add("collective_permute", [prog.param], lshape, attrs=permute_attrs(axis, pairs))
    hits.add(check_rule(prog, op, layout, values(shape, seed), seed))

  check()
  hits.check()


def test_collective_permute_permuting_axes_renames_them():
  """A permute sending each rank to the one whose y coordinate is its x
  coordinate, for a permutation of axes of one size (XLA, moving a kv head's
  shards between two axes of a refined mesh, or a weight's round three): the
  relation holds with the axes renamed; ``sharding.axis_renaming_of_pairs``
  finds the permutation from the device pairs."""
  from graphguard_hlo.passes.sharding import axis_renaming_of_pairs
  hits = Hits()

  @SETTINGS
  @given(setups(min_rank=0), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    sizes = dict(mesh.axes)
    alike = [a for a in mesh.axis_names if sizes[a] > 1 and sum(
        sizes[b] == sizes[a] for b in mesh.axis_names) > 1]
    if not alike:
      return  # (no two axes alike to permute: not a case)
    image = data.draw(st.permutations(alike).filter(
        lambda p: list(p) != alike and all(sizes[a] == sizes[b] for a, b in zip(alike, p))))
    to = dict(zip(alike, image))
    pairs = []
    for c in ranks(mesh):
      t = list(c)
      for a, b in to.items():
        t[mesh.axis_names.index(b)] = c[mesh.axis_names.index(a)]
      pairs.append((device_id(mesh, c), device_id(mesh, t)))
    renaming = tuple((a, b) for a, b in to.items() if a != b)
    assert axis_renaming_of_pairs(pairs, mesh) == renaming
    lshape = local(layout, shape, mesh)
    prog = Program(mesh, lshape)
    op = prog.add("collective_permute", [prog.param], lshape,
                  attrs={"gg.axes": None, "gg.permutation": None, "gg.renaming": renaming,
                         "test.device_pairs": tuple(pairs)})
    hits.add(check_rule(prog, op, layout, values(shape, seed), seed))

  check()
  assert hits.cases >= 20, vars(hits)
  hits.check(0.9)


def test_collective_permute_moves_a_pinned_value():
  """A value pinned at coordinate c (a pipeline stage's activations) is
  pinned at its receiver after the permute, and nowhere if c sends nothing."""
  hits = Hits()

  @SETTINGS
  @given(setups(min_rank=0), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    axis, layout = draw_axis_and_layout(data, mesh, layout, pin=True)
    n = mesh.axis_size(axis)
    pairs = list(enumerate(data.draw(st.permutations(range(n)))))
    if data.draw(st.booleans()):
      pairs = pairs[:data.draw(st.integers(0, n))]  # a pipeline's open end
    lshape = local(layout, shape, mesh)
    prog = Program(mesh, lshape)
    op = prog.add("collective_permute", [prog.param], lshape, attrs=permute_attrs(axis, pairs))
    news = check_rule(prog, op, layout, values(shape, seed), seed)
    moved = dict(pairs).get(layout.at[0][1])
    assert [l.at for l in news] == ([] if moved is None else [((axis, moved),)]) or (
        moved == layout.at[0][1] and not news)  # a fixed point is dropped from the perm
    hits.add(news)

  check()
  hits.check()


@pytest.mark.parametrize("other", [0.0, 3.0])
def test_select_on_a_mesh_coordinate(other):
  """select(r_x <op> c, x, k) and select(r_x <op> c, k, x): x's relation holds
  where it is picked (pinned there); picked at one coordinate against zeros
  (k = 0) it is a partial sum over x, and pinned there with zeros elsewhere
  (if x was zero off its other pins).  k = 3 gives neither."""
  hits = Hits()

  @SETTINGS
  @given(setups(min_rank=0), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    axis, layout = draw_axis_and_layout(data, mesh, layout, pin=None)
    others = [a for a, n in mesh.axes if n > 1 and a != axis and a not in layout.used_axes()]
    if others and not layout.at and data.draw(st.integers(0, 2)):  # pinned on another axis
      b = data.draw(st.sampled_from(others))
      layout = layout.with_(at=((b, data.draw(st.integers(0, mesh.axis_size(b) - 1))),),
                            zero_elsewhere=data.draw(st.booleans()))
    n = mesh.axis_size(axis)
    lshape = local(layout, shape, mesh)
    prog = Program(mesh, lshape)
    c = prog.const(data.draw(st.integers(0, n - 1)), "i32")
    direction = data.draw(st.sampled_from(["EQ", "EQ", "NE", "LT", "GE"]))
    pred = prog.add("compare", [prog.axis_index(axis), c], (), "pred",
                    attrs={"comparison_direction": direction}).result
    mask = prog.add("broadcast_in_dim", [pred], lshape, "pred",
                    attrs={"broadcast_dimensions": ()}).result
    k = prog.add("broadcast_in_dim", [prog.const(other, "f32")], lshape,
                 attrs={"broadcast_dimensions": ()}).result
    picks_x = data.draw(st.booleans())
    operands = [mask, prog.param, k] if picks_x else [mask, k, prog.param]
    op = prog.add("select", operands, lshape)
    news = check_rule(prog, op, layout, values(shape, seed), seed)
    if other != 0.0:
      assert all(set(l.partial) == set(layout.partial) for l in news)
      assert all(not l.zero_elsewhere or layout.zero_elsewhere for l in news)
    zeros["yielded"] += any(l.zero_elsewhere for l in news)
    hits.add(news)

  zeros = {"yielded": 0}
  check()
  hits.check(0.3)
  assert other != 0.0 or zeros["yielded"] >= 10, zeros


@pytest.mark.parametrize("zeros", [False, True])
def test_select_keeps_zeros_only_where_known(zeros):
  """select(r_x == 1, a, 0) with a pinned at y = 0: zero off (x=1, y=0) only if
  a was zero off y = 0 (at x=1, y=1 it is a's junk otherwise)."""
  mesh = ir.Mesh((("x", 2), ("y", 2)))
  layout = Layout(((),), at=(("y", 0),), zero_elsewhere=zeros)
  prog = Program(mesh, (3,))
  pred = prog.add("compare", [prog.axis_index("x"), prog.const(1, "i32")], (), "pred",
                  attrs={"comparison_direction": "EQ"}).result
  mask = prog.add("broadcast_in_dim", [pred], (3,), "pred",
                  attrs={"broadcast_dimensions": ()}).result
  k = prog.add("broadcast_in_dim", [prog.const(0.0, "f32")], (3,),
               attrs={"broadcast_dimensions": ()}).result
  op = prog.add("select", [mask, prog.param, k], (3,))
  news = check_rule(prog, op, layout, values((3,), 0), 0)
  assert [l.at for l in news if l.zero_elsewhere] == ([(("x", 1), ("y", 0))] if zeros else [])


# -- rank-dependent dynamic-slice ----------------------------------------------------------

def slice_at_axis_index(prog: Program, sliced: list[tuple[str, ...]], sizes, bad=None) -> ir.Op:
  """dynamic_slice(x, offsets) with offset_k = tile_index(sliced[k]) * sizes[k]
  (``bad``: a wrong multiplier for dim ``bad``)."""
  offsets = []
  for k, axes in enumerate(sliced):
    if not axes:
      offsets.append(prog.const(0, "i32"))
      continue
    total = None
    for pos, a in enumerate(axes):
      coef = sizes[k] * tiles(prog.mesh, axes[pos + 1:]) + (1 if bad == k else 0)
      term = prog.add("multiply", [prog.axis_index(a), prog.const(coef, "i32")], (), "i32").result
      total = term if total is None else prog.add("add", [total, term], (), "i32").result
    offsets.append(total)
  return prog.add("dynamic_slice", [prog.param] + offsets, sizes,
                  attrs={"slice_sizes": tuple(sizes)})


def test_dynamic_slice_at_axis_index():
  """A replica (or any layout) sliced at r_axis * size becomes a tile over axis;
  with well-formed offsets over unused axes the rule must find exactly that."""
  hits = Hits()

  @SETTINGS
  @given(setups(), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    unused = [a for a, n in mesh.axes if a not in layout.used_axes() and n > 1]
    sliced: list[tuple[str, ...]] = [() for _ in shape]
    for a in data.draw(st.permutations(unused)):
      slot = data.draw(st.sampled_from(list(range(len(shape))) + [None]))
      if slot is not None:
        sliced[slot] += (a,)
    well_formed = data.draw(st.integers(0, 5)) > 0
    if not well_formed:  # an axis the value already uses, or size 1
      k = data.draw(st.integers(0, len(shape) - 1))
      sliced[k] += (data.draw(st.sampled_from(mesh.axis_names)),)
      if len(set(sliced[k])) < len(sliced[k]):
        sliced[k] = sliced[k][:-1]
    for k, axes in enumerate(sliced):
      shape[k] = tiles(mesh, layout.dims[k]) * tiles(mesh, axes) * data.draw(st.integers(1, 2))
    lshape = local(layout, shape, mesh)
    sizes = [n // tiles(mesh, axes) for n, axes in zip(lshape, sliced)]
    bad = None
    if well_formed and any(sliced) and data.draw(st.integers(0, 4)) == 0:
      bad, well_formed = data.draw(st.sampled_from([k for k, a in enumerate(sliced) if a])), False
    prog = Program(mesh, lshape)
    op = slice_at_axis_index(prog, sliced, sizes, bad)
    news = check_rule(prog, op, layout, values(shape, seed), seed)
    if well_formed:
      expect = layout.with_(dims=tuple(d + s for d, s in zip(layout.dims, sliced)))
      assert news == [expect], (news, expect)
    hits.add(news)

  check()
  hits.check()


def test_dynamic_update_slice_into_zeros_is_a_partial_sum():
  """Autodiff's transpose of a rank-dependent slice: each rank writes its tile
  into zeros at r * size; summed over those ranks the buffers rebuild the dim."""
  hits = Hits()

  @SETTINGS
  @given(setups(), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    split = [k for k, axes in enumerate(layout.dims) if axes]
    if not split or (layout.partial and layout.partial_kind != "sum"):
      hits.add([])
      return
    k = data.draw(st.sampled_from(split))
    n_x = data.draw(st.integers(1, len(layout.dims[k])))
    x_axes = layout.dims[k][-n_x:]
    lshape = local(layout, shape, mesh)
    buffer = list(lshape)
    buffer[k] *= tiles(mesh, x_axes)
    bad = data.draw(st.integers(0, 4)) == 0
    prog = Program(mesh, lshape)
    zero = prog.add("broadcast_in_dim", [prog.const(0.0, "f32")], buffer,
                    attrs={"broadcast_dimensions": ()}).result
    sliced = [x_axes if d == k else () for d in range(len(shape))]
    offsets = slice_at_axis_index(prog, sliced, lshape, k if bad else None).operands[1:]
    op = prog.add("dynamic_update_slice", [zero, prog.param] + list(offsets), buffer)
    news = check_rule(prog, op, layout, values(shape, seed), seed)
    if tiles(mesh, x_axes) == 1:  # the update covers the buffer: it is the tile
      assert news == [layout], news
    elif not bad:
      dims = list(layout.dims)
      dims[k] = dims[k][:-n_x]
      expect = layout.with_(dims=tuple(dims), partial=layout.partial + x_axes,
                            partial_kind="sum")
      # (one axis written at its own tile is also a ring's write: known there)
      assert expect in news and len(news) <= 2, (news, expect)
    hits.add(news)

  check()
  hits.check()


# -- rings: collective-permutes and tiles written where they belong ---------------------------

def draw_ring_axis(data, mesh: ir.Mesh):
  """A mesh axis of two or more ranks for a ring to pass tiles round, or None."""
  big = [a for a, n in mesh.axes if n > 1]
  return data.draw(st.sampled_from(big)) if big else None


def ring_offset(prog: Program, axis: str, j: int, size: int) -> ir.Value:
  """``((r_axis + j) mod |axis|) * size`` as jnp's ``%`` lowers it (remainder,
  then a select fixing the sign)."""
  n = prog.mesh.axis_size(axis)
  r = prog.axis_index(axis)
  moved = prog.add("add", [r, prog.const(j - n, "i32")], (), "i32").result  # may be < 0
  rem = prog.add("remainder", [moved, prog.const(n, "i32")], (), "i32").result
  zero = prog.const(0, "i32")
  nonzero = prog.add("compare", [rem, zero], (), "i1", {"comparison_direction": "NE"}).result
  negative = prog.add("compare", [rem, zero], (), "i1", {"comparison_direction": "LT"}).result
  fix = prog.add("and", [nonzero, negative], (), "i1").result
  wrapped = prog.add("add", [rem, prog.const(n, "i32")], (), "i32").result
  index = prog.add("select", [fix, wrapped, rem], (), "i32").result
  return prog.add("multiply", [index, prog.const(size, "i32")], (), "i32").result


def propagate(prog: Program, layout: Layout) -> dict[int, list[Layout]]:
  """Every relation the transfer rules (and buffer unions) give each value,
  from ``s ~ layout of x``, in program order."""
  deg = DistEGraph(prog.graph)
  rules = Transfer(deg, RankArithmetic(prog.mesh), prog.mesh, prog.graph)
  known: dict[int, list[Layout]] = {prog.param.id: [layout]}
  for op in prog.graph.ops:
    out = known.setdefault(op.result.id, [])
    for v in op.operands:
      for l in known.get(v.id, []):
        out += [new for cls, new, _ in rules.apply(op, deg.of(v), l, v.shape)
                if deg.find(cls) == deg.of(op.result) and new not in out]
    if op.name == "dynamic_update_slice":
      base, update = op.operands[:2]
      for b, u in itertools.product(known.get(base.id, []), known.get(update.id, [])):
        union = rules.fill_union(op, b, u)
        if union is not None and union not in out:
          out.append(union)
  return known


def test_ring_of_permutes_fills_a_buffer():
  """A ring passes tiles round an axis and writes each at its offset: every
  relation the rules give (rotated tiles, partly known buffers) holds on a
  run, and with the right offsets the buffer is the whole dim after |x|
  steps; with a wrong offset it is not."""
  hits = Hits()

  @SETTINGS
  @given(setups(), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    axis = draw_ring_axis(data, mesh)
    if axis is None:
      hits.add([])
      return
    layout = _off_axis(layout, axis)
    k = data.draw(st.integers(0, len(shape) - 1))
    layout = layout.with_(dims=tuple(axes + (axis,) if d == k else axes
                                     for d, axes in enumerate(layout.dims)))
    if layout.partial and layout.partial_kind != "sum":
      layout = layout.with_(partial_kind="sum")
    n = mesh.axis_size(axis)
    shape[k] = tiles(mesh, layout.dims[k]) * data.draw(st.integers(1, 2))
    lshape = local(layout, shape, mesh)
    shift = data.draw(st.sampled_from([1, n - 1]))
    bad_step = data.draw(st.sampled_from([None, None] + list(range(n))))
    prog = Program(mesh, lshape)
    whole = list(lshape)
    whole[k] *= n
    buf = prog.add("broadcast_in_dim", [prog.const(3.0, "f32")], whole,
                   attrs={"broadcast_dimensions": ()}).result  # anything: not zeros
    cur = prog.param
    for t in range(n):
      j = (-t * shift + (1 if t == bad_step else 0)) % n  # cur holds tile r - t*shift
      offsets = [ring_offset(prog, axis, j, lshape[k]) if d == k else prog.const(0, "i32")
                 for d in range(len(shape))]
      buf = prog.add("dynamic_update_slice", [buf, cur] + offsets, whole).result
      if t < n - 1:
        pairs = [(i, (i + shift) % n) for i in range(n)]
        cur = prog.add("collective_permute", [cur], lshape,
                       attrs=permute_attrs(axis, pairs)).result
    prog.graph.results = [buf]
    known = propagate(prog, layout)
    value = values(shape, seed)
    rng = np.random.default_rng(seed)
    env = prog.run(spread_extrema(layout, mesh, shard(layout, mesh, value, rng), rng))
    for vid, layouts in known.items():
      for l in layouts:
        got = assemble(l, mesh, env[vid])
        seen = ~np.isnan(got)
        np.testing.assert_allclose(got[seen], value[seen], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{l} of value {vid}")
    expect = layout.with_(dims=tuple(() if d == k and axes == (axis,) else axes
                                     for d, axes in enumerate(layout.dims)))
    finished = expect in known[buf.id]
    if layout.dims[k] == (axis,):
      assert finished == (bad_step is None), (known[buf.id], expect, bad_step)
    hits.add([expect] if finished else [])

  check()
  hits.check(0.2)


def test_ring_reduce_scatter_sums_the_pieces():
  """The transpose of a ring gather, as autodiff writes it: each step reads
  tile r + j of the (partial) buffer at a ring offset, zeroes it, and adds
  what came round the ring (passed r -> r - 1).  After |x| steps rank r holds
  tile r of the whole sum; every relation the rule gives holds on a run, and
  a wrong offset or direction gives no whole tile."""
  hits = Hits()

  @SETTINGS
  @given(setups(), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    axis = draw_ring_axis(data, mesh)
    if axis is None:
      hits.add([])
      return
    n = mesh.axis_size(axis)
    layout = _off_axis(layout, axis)
    layout = layout.with_(partial=tuple(sorted(layout.partial + (axis,))), partial_kind="sum",
                          scale=1.0)
    k = data.draw(st.integers(0, len(shape) - 1))
    layout = layout.with_(dims=tuple(() if d == k else axes
                                     for d, axes in enumerate(layout.dims)))
    shape[k] = n * data.draw(st.integers(1, 2))
    lshape = local(layout, shape, mesh)
    tile = list(lshape)
    tile[k] //= n
    bad = data.draw(st.sampled_from(["none", "none", "offset", "direction"]))
    if bad == "direction" and n == 2:
      bad = "none"  # r + 1 is r - 1 on two ranks
    back = 1 if bad == "direction" else n - 1  # r -> r - 1, as the transpose sends
    prog = Program(mesh, lshape)
    zeros = prog.add("broadcast_in_dim", [prog.const(0.0, "f32")], tile,
                     attrs={"broadcast_dimensions": ()}).result
    buf, acc = prog.param, None
    for t in reversed(range(n)):  # the transpose runs the ring backwards
      j = (-t + (1 if bad == "offset" and t == 1 else 0)) % n
      offsets = [ring_offset(prog, axis, j, tile[k]) if d == k else prog.const(0, "i32")
                 for d in range(len(shape))]
      piece = prog.add("dynamic_slice", [buf] + offsets, tile,
                       attrs={"slice_sizes": tuple(tile)}).result
      buf = prog.add("dynamic_update_slice", [buf, zeros] + offsets, lshape).result
      if acc is not None:
        pairs = [(i, (i + back) % n) for i in range(n)]
        moved = prog.add("collective_permute", [acc], tile, attrs=permute_attrs(axis, pairs))
        piece = prog.add("add", [moved.result, piece], tile).result
      acc = piece
    prog.graph.results = [acc]
    deg = DistEGraph(prog.graph)
    rules = Transfer(deg, RankArithmetic(mesh), mesh, prog.graph)
    news = list(rules.ring_sums(deg.of(prog.param), layout))
    value = values(shape, seed)
    rng = np.random.default_rng(seed)
    env = prog.run(shard(layout, mesh, value, rng))
    by_class = {deg.of(v): v for op in prog.graph.ops for v in op.results}
    for cls, new, _ in news:
      got = assemble(new, mesh, env[by_class[cls].id])
      np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6, err_msg=str(new))
    whole = [new for cls, new, _ in news if cls == deg.of(acc) and new.dims[k] == (axis,)]
    assert bool(whole) == (bad == "none"), (bad, news)
    hits.add(whole)

  check()
  hits.check(0.3)


# -- products with constants ----------------------------------------------------------------

def times_constant(prog: Program, c: float, form: str) -> ir.Op:
  """``x * c``, ``c * x``, ``x / c`` or ``c / x`` with ``c`` a broadcast scalar."""
  shape = prog.param.type.shape
  splat = prog.add("broadcast_in_dim", [prog.const(c, "f32")], shape,
                   attrs={"broadcast_dimensions": ()}).result
  x = prog.param
  name, operands = {"x*c": ("multiply", [x, splat]), "c*x": ("multiply", [splat, x]),
                    "x/c": ("divide", [x, splat]), "c/x": ("divide", [splat, x])}[form]
  return prog.add(name, operands, shape)


def test_multiply_and_divide_by_constant():
  hits = Hits()

  @SETTINGS
  @given(setups(min_rank=0), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    form = data.draw(st.sampled_from(["x*c", "c*x", "x/c", "c/x"]))
    cs = [2.0, 0.5, -1.0, -3.0, 0.25, 10.0, 0.1] + ([0.0] if "*" in form else [])
    c = data.draw(st.sampled_from(cs))
    prog = Program(mesh, local(layout, shape, mesh))
    op = times_constant(prog, c, form)
    news = check_rule(prog, op, layout, values(shape, seed), seed)
    assert not (news and (form == "c/x" or c == 0.0)), news
    hits.add(news)

  check()
  hits.check()


# -- what rules must refuse ---------------------------------------------------------------

MESH = ir.Mesh((("x", 2), ("y", 2)))


def test_all_reduce_over_a_split_axis_yields_nothing():
  """Summing different tiles is no relation at all."""
  prog = Program(MESH, (2, 4))
  op = prog.add("all_reduce", [prog.param], (2, 4), attrs={"gg.axes": ("x",), "gg.reduction": "sum"})
  assert prog.transfer(op, Layout((("x",), ()))) == []


def test_all_reduce_max_of_partial_sum_yields_nothing():
  prog = Program(MESH, (2, 4))
  op = prog.add("all_reduce", [prog.param], (2, 4), attrs={"gg.axes": ("x",), "gg.reduction": "max"})
  assert prog.transfer(op, Layout(((), ()), ("x",))) == []


def test_all_gather_of_an_unsplit_dim_yields_nothing():
  prog = Program(MESH, (2, 4))
  op = prog.add("all_gather", [prog.param], (2, 8),
                attrs={"gg.axes": ("x",), "all_gather_dimension": 1})
  assert prog.transfer(op, Layout((("x",), ()))) == []
  assert prog.transfer(op, Layout(((), ()))) == []


def test_all_gather_of_the_major_axis_only_yields_nothing():
  """dim 0 is split x-major, y-minor: gathering over x alone leaves y tiles
  interleaved, not a coarser tiling."""
  prog = Program(MESH, (2, 4))
  op = prog.add("all_gather", [prog.param], (4, 4),
                attrs={"gg.axes": ("x",), "all_gather_dimension": 0})
  assert prog.transfer(op, Layout((("x", "y"), ()))) == []


def test_all_to_all_within_one_dim_yields_nothing():
  """Split and concat on dim 0 over x: rank 0 gets [s0, s2] of [s0, s1, s2, s3],
  a strided pick, not a tile."""
  prog = Program(ir.Mesh((("x", 2),)), (2,))
  op = prog.add("all_to_all", [prog.param], (2,),
                attrs={"gg.axes": ("x",), "split_dimension": 0, "concat_dimension": 0})
  assert prog.transfer(op, Layout((("x",),))) == []


def test_collective_permute_on_a_split_axis_turns_tiles_only_on_a_ring():
  mesh = ir.Mesh((("x", 4),))
  prog = Program(mesh, (2, 4))
  swap = prog.add("collective_permute", [prog.param], (2, 4),
                  attrs=permute_attrs("x", [(0, 1), (1, 0), (2, 3), (3, 2)]))
  assert prog.transfer(swap, Layout((("x",), ()))) == []
  assert prog.transfer(swap, Layout(((), ()), ("x",))) == []
  ring = prog.add("collective_permute", [prog.param], (2, 4),
                  attrs=permute_attrs("x", [(i, (i + 1) % 4) for i in range(4)]))
  # rank r receives r - 1's tile: x turned by -1 = +3
  assert prog.transfer(ring, Layout((("x",), ()))) == [Layout((("x+3",), ()))]
  assert prog.transfer(ring, Layout((("x+3",), ()))) == [Layout((("x+2",), ()))]
  assert prog.transfer(ring, Layout(((), ()), ("x",))) == []


def test_collective_permute_of_a_replica_is_a_replica():
  prog = Program(MESH, (2, 4))
  op = prog.add("collective_permute", [prog.param], (2, 4),
                attrs=permute_attrs("x", [(0, 1), (1, 0)]))
  assert prog.transfer(op, Layout((("y",), ()))) == [Layout((("y",), ()))]


def test_dynamic_slice_with_a_wrong_stride_yields_nothing():
  prog = Program(MESH, (8, 4))
  op = slice_at_axis_index(prog, [("x",), ()], [4, 4], bad=0)
  assert prog.transfer(op, Layout(((), ()))) == []


def test_dynamic_slice_over_a_used_axis_yields_nothing():
  prog = Program(MESH, (8, 4))
  op = slice_at_axis_index(prog, [("x",), ()], [4, 4])
  assert prog.transfer(op, Layout(((), ()), ("x",))) == []
  assert prog.transfer(op, Layout(((), ("x",)))) == []


def test_dynamic_slice_at_axis_index_tiles_a_replica():
  prog = Program(MESH, (8, 4))
  op = slice_at_axis_index(prog, [("x", "y"), ()], [2, 4])
  assert prog.transfer(op, Layout(((), ()))) == [Layout((("x", "y"), ()))]
  check_rule(prog, op, Layout(((), ())), values((8, 4), 0), 0)


def test_constant_divided_by_value_yields_nothing():
  prog = Program(MESH, (2, 4))
  assert prog.transfer(times_constant(prog, 2.0, "c/x"), Layout(((), ()))) == []


@pytest.mark.parametrize("c", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("form", ["x*c", "x/c"])
def test_a_scale_that_cannot_be_undone_yields_nothing(c, form):
  """x * inf (an erf_inv's value at |x| = 1) is not x scaled: divided by inf it
  is NaN or 0, not x (a relation check caught s ~ 0 * (x * inf))."""
  prog = Program(MESH, (2, 4))
  assert prog.transfer(times_constant(prog, c, form), Layout(((), ()))) == []


@pytest.mark.parametrize("kind", ["max", "min"])
def test_negative_constant_turns_partial_max_into_min(kind):
  """-1 * max_r(d_r) = min_r(-d_r): the combine flips, it is not just a scale."""
  prog = Program(MESH, (2, 4))
  op = times_constant(prog, -1.0, "x*c")
  layout = Layout(((), ()), ("x",), kind)
  check_rule(prog, op, layout, values((2, 4), 0), 0)


def test_dimensional_rules_need_the_exact_tile_shape():
  """A per-device value equal to the tile only up to unit dims ([1,8] for a
  [8,1] tile) numbers its dims differently: all-gather's dimension would
  point elsewhere, so no relation may be read off it."""
  prog = Program(MESH, (1, 8))
  op = prog.add("all_gather", [prog.param], (2, 8),
                attrs={"gg.axes": ("x",), "all_gather_dimension": 0})
  deg = DistEGraph(prog.graph)
  rules = Transfer(deg, RankArithmetic(MESH), MESH, prog.graph)
  layout = Layout((("x",), ()))
  assert list(rules.apply(op, deg.of(prog.param), layout, (1, 8)))
  assert not list(rules.apply(op, deg.of(prog.param), layout, (8, 1)))
  assert not list(rules.apply(op, deg.of(prog.param), layout, None))


def test_unit_dim_reshape_keeps_the_relation():
  prog = Program(MESH, (1, 8))
  op = prog.add("reshape", [prog.param], (8,))
  assert prog.transfer(op, Layout((("x",), ()))) == [Layout((("x",), ()))]
  op2 = prog.add("reshape", [prog.param], (2, 4))
  assert prog.transfer(op2, Layout((("x",), ()))) == []


# -- collectives on a tile held with other unit dims ---------------------------------------

@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_collective_on_a_tile_held_with_other_unit_dims(kind):
  """XLA runs collectives on the tile with unit dims inserted or dropped (a
  broadcast [4,32] -> [1,4,32] before an all-to-all).  The rules read the
  relation over the held value's dims and the result's back over the tile's;
  every layout they give must rebuild the sequential value from the results
  reshaped to their tiles."""
  hits = Hits()

  @settings(SETTINGS, max_examples=400)
  @given(setups(), st.data())
  def check(setup, data):
    mesh, layout, shape, seed = setup
    tile = local(layout, shape, mesh)
    held: list[int] = []
    pos = {}  # tile dim -> where the held value keeps it
    for d, n in enumerate(tile):
      held += [1] * data.draw(st.integers(0, 1))
      if n != 1 or data.draw(st.booleans()):
        pos[d] = len(held)
        held.append(n)
    held += [1] * data.draw(st.integers(0, 1))
    if not held or tuple(held) == tuple(tile):
      return
    prog = Program(mesh, held)
    axes = draw_axes(data.draw, mesh, sorted(layout.used_axes()))
    n = tiles(mesh, axes)
    out = list(held)
    if kind == "all_gather":
      k = data.draw(st.integers(0, len(held) - 1))
      out[k] *= n
      attrs = {"gg.axes": axes, "all_gather_dimension": k}
    elif kind == "reduce_scatter":
      k = data.draw(st.integers(0, len(held) - 1))
      if held[k] % n:
        return
      out[k] //= n
      attrs = {"gg.axes": axes, "scatter_dimension": k, "gg.reduction": "sum"}
    else:
      i, j = (data.draw(st.integers(0, len(held) - 1)) for _ in range(2))
      tiled = [d for d in pos if layout.dims[d]]
      if tiled and data.draw(st.integers(0, 3)):  # mostly: exchange a tiled dim's minor axes
        d = data.draw(st.sampled_from(tiled))
        axes = layout.dims[d][data.draw(st.integers(0, len(layout.dims[d]) - 1)):]
        n, j = tiles(mesh, axes), pos[d]
        into = [e for e in range(len(held)) if e != j and held[e] % n == 0]
        if into:  # (a dim the pieces can come from)
          i = data.draw(st.sampled_from(into))
      if i == j or held[i] % n:
        return
      out[i] //= n
      out[j] *= n
      attrs = {"gg.axes": axes, "split_dimension": i, "concat_dimension": j}
    op = prog.add(kind, [prog.param], out, attrs=attrs)
    prog.graph.results = [op.result]
    deg = DistEGraph(prog.graph)
    rules = Transfer(deg, RankArithmetic(mesh), mesh, prog.graph)
    news = [new for _, new, _ in rules.apply(op, deg.of(prog.param), layout, tuple(tile))]
    hits.add(news)
    if not news:
      return
    value = values(shape, seed)
    rng = np.random.default_rng(seed)
    x_at = spread_extrema(layout, mesh, shard(layout, mesh, value, rng), rng)
    y_at = prog.run({c: x.reshape(held) for c, x in x_at.items()})[op.result.id]
    for new in news:
      new_tile = new.local_shape(value.shape, mesh)
      what = f"{kind} {attrs} on {held} holding {tile}: {layout} -> {new}, mesh {mesh.axes}"
      assert [d for d in new_tile if d != 1] == [d for d in out if d != 1], what
      got = assemble(new, mesh, {c: y.reshape(new_tile) for c, y in y_at.items()})
      np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-8, err_msg=what)

  check()
  hits.check(0.05)
