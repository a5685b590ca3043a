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
