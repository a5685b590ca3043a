"""nonfinite.py: the infinities a program writes between its scores' matmul
and their max, on small functions lowered by jax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.passes.nonfinite import Nonfinite

X = jax.ShapeDtypeStruct((4, 4), jnp.float32)
MIN = float(np.finfo(np.float32).min)


def _mask(s):
  return jnp.arange(4)[:, None] >= jnp.arange(4)[None, :]


CASES = {  # f(s, y) -> words in the reason, or None for finite
    "minus_inf_fill": (lambda s, y: jnp.where(_mask(s), s, -jnp.inf), "-inf"),
    "finite_fill": (lambda s, y: jnp.where(_mask(s), s, -1e9), None),
    "one_finfo_min": (lambda s, y: jnp.where(_mask(s), s, MIN), None),
    "two_finfo_min": (lambda s, y: jnp.where(_mask(s), s, MIN) + jnp.where(_mask(s), 0.0, MIN),
                      "overflow"),
    "scaled_fill": (lambda s, y: jnp.where(_mask(s), s, -1e30) * np.float32(1e30), "overflow"),
    "minimum_of_inf": (lambda s, y: jnp.minimum(s, jnp.where(_mask(s), jnp.inf, -jnp.inf)),
                       "inf"),
    "log_of_mask": (lambda s, y: s + jnp.log(y), "log"),
    "divided_by_input": (lambda s, y: s / y, "may be zero"),
    "divided_by_constant": (lambda s, y: s / np.float32(2.0), None),
    "soft_capped": (lambda s, y: np.float32(30.0) * jnp.tanh(s / np.float32(30.0)), None),
    "table_with_inf": (lambda s, y: s + jnp.asarray(np.where(np.tri(4) > 0, 0.0, -np.inf),
                                                    jnp.float32), "-inf"),
    "unknown_op": (lambda s, y: jnp.sort(s, axis=-1), "not known"),
    "scores_of_inputs": (lambda s, y: s @ y, None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reasons(name):
  f, words = CASES[name]
  module = lower_sequential(f, X, X)
  inline_calls(module)  # (jnp.where is a call of a private function)
  why = Nonfinite().why(module.main.results[0])
  if words is None:
    assert why is None, why
  else:
    assert why is not None and words in why, why
