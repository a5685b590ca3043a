"""The ring fold (``RingBlocks.fold_classes``): a reduction over every block
a ring visits is the per-device program's adds (or maxima) of the per-block
results, in any order, each block once."""

import types

import numpy as np
from hypothesis import given, strategies as st

from graphguard_hlo.passes.dist_egraph import DistEGraph, op_users
from graphguard_hlo.passes.ring_blocks import RingBlocks
from tests.test_online_softmax import SETTINGS, Builder, _t


@SETTINGS
@given(st.integers(2, 5), st.sampled_from(["add", "maximum"]), st.data())
def test_ring_fold_finds_exactly_the_combinations_of_every_block(n, combiner, data):
  """``RingBlocks.fold_classes`` on a per-device program that combines n
  block results in a random tree (with identity splats mixed in): it finds
  the root; with one block left out nothing, with one counted twice at most a
  subtree that has each once; what it finds computes the whole fold."""
  how = data.draw(st.sampled_from(["all", "missing", "twice"]))
  b = Builder([_t(3)] * n)
  blocks = list(b.g.params)
  identity = 0.0 if combiner == "add" else -np.inf
  pool = list(data.draw(st.permutations(blocks)))
  if how == "missing":
    pool.pop()
  elif how == "twice":
    pool.append(pool[0])
  while len(pool) > 1:
    i, j = sorted(data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=2, max_size=2,
                                     unique=True)))
    y, x = pool.pop(j), pool.pop(i)
    if data.draw(st.booleans()):
      x = b.op(combiner, [x, b.splat(identity, (3,))], _t(3))
    pool.append(b.op(combiner, [x, y] if data.draw(st.booleans()) else [y, x], _t(3)))
  b.g.results = pool
  deg = DistEGraph(b.g)
  fake = types.SimpleNamespace(deg=deg, users=op_users(b.g, deg))
  by_turn = {j: deg.of(v) for j, v in enumerate(blocks)}
  found = RingBlocks(fake).fold_classes(by_turn, combiner)
  if how == "all":
    assert found == deg.of(pool[0])
  elif how == "missing":
    assert found is None
  else:  # a block counted twice at the root: only a subtree may cover each once
    assert found != deg.of(pool[0])
  if found is not None:  # and what it found is the combination of every block
    xs = [np.random.default_rng(k).standard_normal(3) for k in range(n)]
    env = b.values(xs)  # (the blocks are the graph's parameters)
    value = next(v.id for v in deg.members()[found] if v.id in env)
    want = np.sum(xs, axis=0) if combiner == "add" else np.max(xs, axis=0)
    np.testing.assert_allclose(env[value], want)
