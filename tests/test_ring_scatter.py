"""A ring's shares added up round the ring (``passes/ring_blocks.py``):
each rank multiplies its rows by the block of columns the ring brings and
sends the product on with that block, so every block's shares come home.
Proved when they do; a share sent the wrong way, dropped, or added at the
wrong step is reported at the dot whose shares never add up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax, shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from graphguard_hlo import api
from tests.numbers import random_inputs, run_placed
from tools.zoo.cases import mesh_of

N, S, T, D, E = 4, 8, 8, 3, 5
MESH = mesh_of((N,), ("cp",))
SPEC = P("cp")


def _seq(transposed=False, scale=1.0):
  def f(q, k, x):
    y = (q @ k.T).T @ x / np.float32(scale)   # [T, E]: a sum over the rows of q and x
    return y.T if transposed else y
  return f


def _ring(shift=1, grad_shift=1, steps=N, transposed=False, scale=1.0, add_before_send=True,
          first_twice=False):
  """Rank r holds rows r of q and x, and key block r; the keys go round the
  ring r -> r + ``shift``, each step's share ``(q k^T)^T x`` (rows r against the
  block in hand) is added to an accumulator that goes r -> r + ``grad_shift``."""
  def body(q, k, x):
    acc = jnp.zeros((E, T // N) if transposed else (T // N, E), jnp.float32)
    perm = [(i, (i + shift) % N) for i in range(N)]
    back = [(i, (i + grad_shift) % N) for i in range(N)]
    for t in range(steps):
      share = (q @ k.T).T @ x / np.float32(scale)
      share = share.T if transposed else share
      if first_twice and t == 0:
        acc = acc + share
      if add_before_send:
        acc = lax.ppermute(acc + share, "cp", back)
      else:
        acc = lax.ppermute(acc, "cp", back) + share
      k = lax.ppermute(k, "cp", perm)
    return acc
  out = P(None, "cp") if transposed else SPEC
  return jax.jit(shard_map(body, mesh=MESH, in_specs=(SPEC, SPEC, SPEC), out_specs=out))


def _args():
  return [jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(MESH, SPEC))
          for shape in ((S, D), (T, D), (S, E))]


def _values(seed=0):
  return random_inputs(_args(), seed)


def _run(dist):
  return run_placed(dist, _args(), _values())


@pytest.mark.parametrize("transposed,scale", [(False, 1.0), (True, 1.0), (True, 2.0)])
def test_shares_carried_round_the_ring_are_proved(transposed, scale):
  """Each share may be scaled and transposed before it is added (as an
  einsum's output order and a softmax's scale make the program do): the
  sequential program does the same after its dot."""
  dist = _ring(transposed=transposed, scale=scale)
  np.testing.assert_allclose(_run(dist), _seq(transposed, scale)(*_values()), rtol=1e-5)
  result = api.verify(_seq(transposed, scale), dist, *_args())
  assert result.refines, result


@pytest.mark.parametrize("bug,words", [
    (dict(grad_shift=-1), "send r -> r + 1 and r -> r + 3 (mod 4) (gradients sent the wrong "
                          "way round the ring?)"),
    (dict(steps=N - 1), "but never of blocks cp+{1} (a ring step missing?)"),
    (dict(add_before_send=False), "(a share dropped, added twice, or at another step?)"),
    (dict(first_twice=True), "(a share dropped, added twice, or at another step?)")])
def test_shares_that_never_come_home_are_reported_at_the_dot(bug, words):
  """The accumulator sent the other way from the keys; the last step's share
  never added; the share added after the send (each one a step late); the
  first step's share added twice."""
  dist = _ring(**bug)
  assert not np.allclose(_run(dist), _seq()(*_values()), rtol=1e-3)
  result = api.verify(_seq(), dist, *_args())
  assert not result.refines
  assert result.failure.op_name == "dot_general", result.failure
  line = next(i for i, text in enumerate(open(__file__), 1) if "y = (q @ k.T).T @ x" in text)
  assert result.failure.location.line == line, result.failure
  assert words in result.failure.diagnosis, result.failure.diagnosis
