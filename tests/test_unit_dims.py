"""Every squeezed variant of a local op computes the same elements as the op it
stands for (property-tested with the numpy reference)."""

import numpy as np
from hypothesis import given, settings, strategies as st

from graphguard_hlo import ir, reference
from graphguard_hlo.passes.unit_dims import squeeze, squeezed_variants

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)


@st.composite
def shapes_with_units(draw, min_rank=1, max_rank=4):
  rank = draw(st.integers(min_rank, max_rank))
  return tuple(draw(st.sampled_from([1, 1, 2, 3])) for _ in range(rank))


@st.composite
def device_spelling(draw, shape):
  """The same elements with unit dims dropped or added somewhere."""
  core = [d for d in shape if d != 1]
  out = []
  for d in core:
    out += [1] * draw(st.integers(0, 1)) + [d]
  out += [1] * draw(st.integers(0, 1))
  return tuple(out)


def _t(shape):
  return ir.TensorType(tuple(shape), "f64")


def _check(name, attrs, xs, result_shape, device_shapes):
  expected = reference.evaluate(name, attrs, xs, _t(result_shape))
  device_xs = [x.reshape(s) for x, s in zip(xs, device_shapes)]
  found = False
  for attrs2, rtype in squeezed_variants(name, attrs, [_t(x.shape) for x in xs],
                                         [_t(s) for s in device_shapes], _t(result_shape)):
    got = reference.evaluate(name, attrs2, device_xs, rtype)
    assert got.shape == rtype.shape
    np.testing.assert_allclose(got.reshape(-1), np.asarray(expected).reshape(-1))
    assert squeeze(rtype).shape == squeeze(_t(result_shape)).shape
    found = True
  return found


@SETTINGS
@given(st.data())
def test_elementwise_and_reshape(data):
  shape = data.draw(shapes_with_units())
  dev = data.draw(device_spelling(shape))
  rng = np.random.default_rng(0)
  x, y = rng.standard_normal(shape), rng.standard_normal(shape)
  _check("add", {}, [x, y], shape, [dev, dev])
  target = data.draw(device_spelling(shape))
  _check("reshape", {}, [x], target, [dev])


@SETTINGS
@given(st.data())
def test_broadcast(data):
  # The device holds the tile squeezed, or keeps a unit dim (one local head)
  # that lands on a unit dim of the result: [16,1,4] -> [2,16,1,4] where the
  # sequential tile is [16,4].
  shape = data.draw(shapes_with_units(max_rank=3))
  dev = data.draw(device_spelling(shape))
  extra = data.draw(st.integers(1, 2))
  out = list(shape) + [data.draw(st.sampled_from([1, 2, 3])) for _ in range(extra)]
  out += [1] * data.draw(st.integers(0, 2))
  attrs = {"broadcast_dimensions": tuple(range(len(shape)))}
  x = np.random.default_rng(1).standard_normal(shape)
  _check("broadcast_in_dim", attrs, [x], out, [dev])


@SETTINGS
@given(st.data())
def test_reduce(data):
  shape = data.draw(shapes_with_units(min_rank=2))
  dev = data.draw(device_spelling(shape))
  dims = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))))
  result = tuple(d for i, d in enumerate(shape) if i not in dims)
  x = np.random.default_rng(2).standard_normal(shape)
  attrs = {"dimensions": dims, "gg.reduction": "sum"}
  _check("reduce", attrs, [x, np.array(0.0)], result, [dev, ()])


@SETTINGS
@given(st.data())
def test_dot_general(data):
  b, m, k, n = (data.draw(st.sampled_from([1, 2, 3])) for _ in range(4))
  lhs, rhs = (b, m, k), (b, k, n)
  dl, dr = data.draw(device_spelling(lhs)), data.draw(device_spelling(rhs))
  attrs = {"lhs_batch": (0,), "rhs_batch": (0,), "lhs_contract": (2,), "rhs_contract": (1,)}
  rng = np.random.default_rng(3)
  x, y = rng.standard_normal(lhs), rng.standard_normal(rhs)
  _check("dot_general", attrs, [x, y], (b, m, n), [dl, dr])


@SETTINGS
@given(st.data())
def test_transpose(data):
  """The device's unit dims stay in place, its other dims move as the
  sequential tile's do."""
  shape = data.draw(shapes_with_units(max_rank=3))
  dev = data.draw(device_spelling(shape))
  perm = tuple(data.draw(st.permutations(range(len(shape)))))
  x = np.random.default_rng(8).standard_normal(shape)
  assert _check("transpose", {"permutation": perm}, [x], [shape[p] for p in perm], [dev])


def test_a_transposed_tile_keeps_the_results_unit_dims_where_it_can():
  """XLA's transpose in jax.nn.dot_product_attention's backward, heads split
  over 4 ranks: the sequential tile [1, 2, 8, 1, 8] (a unit dim moved by a
  reshape), the device's [2, 8, 1, 1, 8] never reshaped.  The first variant
  gives the tile's own result shape, as the device's transpose does."""
  (attrs, rtype), *_ = squeezed_variants(
      "transpose", {"permutation": (1, 3, 4, 0, 2)}, [_t((1, 2, 8, 1, 8))],
      [_t((2, 8, 1, 1, 8))], _t((2, 1, 8, 1, 8)))
  assert attrs["permutation"] == (0, 2, 4, 3, 1) and rtype.shape == (2, 1, 8, 1, 8)


@SETTINGS
@given(st.data())
def test_unit_dims_in_order_moves_no_element(data):
  """Every order of a transpose's size-1 dims is one op (``terms.op_head``
  spells them alike)."""
  from graphguard_hlo.passes.terms import unit_dims_in_order
  shape = data.draw(shapes_with_units(max_rank=5))
  perm = tuple(data.draw(st.permutations(range(len(shape)))))
  x = np.random.default_rng(3).standard_normal(shape)
  result_shape = tuple(shape[p] for p in perm)
  normal = unit_dims_in_order(perm, result_shape)
  assert sorted(normal) == list(range(len(shape)))
  np.testing.assert_array_equal(np.transpose(x, normal), np.transpose(x, perm))
  assert unit_dims_in_order(normal, result_shape) == normal


def test_transposes_differing_only_in_unit_dims_are_one_e_node():
  from graphguard_hlo.passes.terms import op_head
  result = _t((2, 1, 8, 1, 8))
  assert op_head("transpose", {"permutation": (0, 3, 4, 2, 1)}, result) == \
      op_head("transpose", {"permutation": (0, 2, 4, 3, 1)}, result)
  assert op_head("transpose", {"permutation": (0, 2, 4, 3, 1)}, result) != \
      op_head("transpose", {"permutation": (1, 2, 4, 3, 0)}, _t((8, 1, 8, 1, 2)))


# -- ops under vmap over a dim held one row per device (GSPMD's pipeline stages) ----

@st.composite
def vmapped_spelling(draw, shape):
  """The device's value of a stage: k unit dims in front of the tile, which
  may itself be spelled with other unit dims (a row of a stage's stack)."""
  return (1,) * draw(st.integers(1, 2)) + draw(device_spelling(shape))


def _vmapped(data, shapes):
  """One k for every operand: vmap batches all of a stage's values alike."""
  k = data.draw(st.integers(1, 2))
  return [(1,) * k + s for s in shapes]


@SETTINGS
@given(st.data())
def test_vmapped_broadcast_transpose_reduce_and_pad(data):
  shape = data.draw(shapes_with_units(max_rank=3))
  x = np.random.default_rng(4).standard_normal(shape)
  rank = len(shape)
  out = list(shape) + [data.draw(st.sampled_from([1, 2]))]
  broadcast = {"broadcast_dimensions": tuple(range(rank))}
  # Whatever the spelling behind the batch dims, every variant is right ...
  _check("broadcast_in_dim", broadcast, [x], out, [data.draw(vmapped_spelling(shape))])
  # ... and the tile itself behind them has its batched variant.
  [vdev] = _vmapped(data, [shape])
  assert _check("broadcast_in_dim", broadcast, [x], out, [vdev])
  perm = tuple(data.draw(st.permutations(range(rank))))
  assert _check("transpose", {"permutation": perm}, [x], [shape[p] for p in perm], [vdev])
  dims = tuple(sorted(data.draw(st.sets(st.integers(0, rank - 1), min_size=1))))
  assert _check("reduce", {"dimensions": dims, "gg.reduction": "sum"}, [x, np.array(0.0)],
                [n for i, n in enumerate(shape) if i not in dims], [vdev, ()])
  lo, hi, inner = ([data.draw(st.integers(0, 1)) for _ in range(rank)] for _ in range(3))
  padded = [n + a + b + (n - 1) * c for n, a, b, c in zip(shape, lo, hi, inner)]
  attrs = {"edge_padding_low": tuple(lo), "edge_padding_high": tuple(hi),
           "interior_padding": tuple(inner)}
  assert _check("pad", attrs, [x, np.array(0.5)], padded, [vdev, ()])


@SETTINGS
@given(st.data())
def test_vmapped_slice_of_a_stage_row(data):
  """A layer's row of the stage's stack: [1, layers, d] on the device, where
  the sequential slice reads the tile [layers, d]."""
  shape = data.draw(shapes_with_units(max_rank=3))
  x = np.random.default_rng(5).standard_normal(shape)
  starts = [data.draw(st.integers(0, n - 1)) for n in shape]
  limits = [data.draw(st.integers(a + 1, n)) for a, n in zip(starts, shape)]
  strides = [data.draw(st.integers(1, 2)) for _ in shape]
  attrs = {"start_indices": tuple(starts), "limit_indices": tuple(limits),
           "strides": tuple(strides)}
  result = [-(-(b - a) // s) for a, b, s in zip(starts, limits, strides)]
  _check("slice", attrs, [x], result, [data.draw(vmapped_spelling(shape))])
  assert _check("slice", attrs, [x], result, _vmapped(data, [shape]))


@SETTINGS
@given(st.data())
def test_vmapped_concatenate_select_and_dot(data):
  shape = data.draw(shapes_with_units(min_rank=1, max_rank=3))
  rng = np.random.default_rng(6)
  x, y = rng.standard_normal(shape), rng.standard_normal(shape)
  k = data.draw(st.integers(0, len(shape) - 1))
  out = list(shape)
  out[k] *= 2
  assert _check("concatenate", {"dimension": k}, [x, y], out, _vmapped(data, [shape, shape]))
  flag = rng.standard_normal(shape) > 0
  assert _check("select", {}, [flag, x, y], shape, _vmapped(data, [shape] * 3))
  m, c, n = (data.draw(st.sampled_from([1, 2, 3])) for _ in range(3))
  attrs = {"lhs_batch": (), "rhs_batch": (), "lhs_contract": (1,), "rhs_contract": (1,)}
  a, b = rng.standard_normal((m, c)), rng.standard_normal((n, c))
  assert _check("dot_general", attrs, [a, b], (m, n), _vmapped(data, [(m, c), (n, c)]))


def test_a_broadcast_of_an_unbatched_operand_to_a_batched_result():
  """vmap's select broadcasts an unbatched causal mask to the stage's scores:
  [t, t] -> [1, h, t, t] where the sequential broadcast gives [h, t, t]."""
  x = np.random.default_rng(7).standard_normal((3, 3))
  assert _check("broadcast_in_dim", {"broadcast_dimensions": (1, 2)}, [x], (2, 3, 3), [(3, 3)])
  found = [r.shape for _, r in squeezed_variants(
      "broadcast_in_dim", {"broadcast_dimensions": (1, 2)}, [_t((3, 3))], [_t((3, 3))],
      _t((2, 3, 3)))]
  assert (1, 2, 3, 3) in found, found


def test_operands_batched_unalike_have_no_vmapped_variant():
  """One operand with a leading unit dim, the other without: no batching
  spells that (a variant would pair different elements)."""
  variants = list(squeezed_variants("add", {}, [_t((2, 3))] * 2, [_t((1, 2, 3)), _t((2, 3))],
                                    _t((2, 3))))
  assert variants == [], variants
