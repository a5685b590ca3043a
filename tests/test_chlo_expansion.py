"""chlo ops under GSPMD: the sequential program is given XLA's own expansion
(``graphguard_hlo/chlo_expansion.py``), which the partitioned program holds.

Each op alone on a split batch, and exact GELU in a TP MLP forward and
training step, proved with every relation held on numbers; a GELU of the
other kind refused; the expansion computes what jax does; and where no
expansion is made, the report says it is a limitation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo import chlo_expansion
from graphguard_hlo.interpret import Interpreter
from graphguard_hlo.lowering import lower_sequential
from graphguard_hlo.passes.inline import inline_calls
from graphguard_hlo.report import to_text

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
W1 = jax.ShapeDtypeStruct((16, 32), jnp.float32)
W2 = jax.ShapeDtypeStruct((32, 16), jnp.float32)
TP = (P(), P(None, "tp"), P("tp", None))
unit = jnp.tanh  # into (-1, 1), where asin, atanh, erf_inv are defined
FUNCTIONS = {
    "erf": jax.lax.erf, "erfc": jax.lax.erfc, "erf_inv": lambda x: jax.lax.erf_inv(unit(x)),
    "lgamma": lambda x: jax.lax.lgamma(jnp.abs(x) + 1),
    "digamma": lambda x: jax.lax.digamma(jnp.abs(x) + 1), "sinh": jnp.sinh, "cosh": jnp.cosh,
    "tan": jnp.tan, "asin": lambda x: jnp.arcsin(unit(x)), "acos": lambda x: jnp.arccos(unit(x)),
    "atan": jnp.arctan, "asinh": jnp.arcsinh, "acosh": lambda x: jnp.arccosh(jnp.abs(x) + 1),
    "atanh": lambda x: jnp.arctanh(unit(x)),
    "is_inf": lambda x: jnp.where(jnp.isinf(x), 0.0, x)}


def gelu_mlp(x, w1, w2):
  return jax.nn.gelu(x @ w1, approximate=False) @ w2


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_each_chlo_op_under_gspmd_is_proved(name):
  f = FUNCTIONS[name]
  result = gg.verify(f, f, X, mesh=MESH, in_specs=(P("tp"),), out_specs=P("tp"),
                     check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")


def test_exact_gelu_mlp_under_gspmd_is_proved_forward_and_backward():
  result = gg.verify(gelu_mlp, gelu_mlp, X, W1, W2, mesh=MESH, in_specs=TP, out_specs=P(),
                     check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")
  grad = jax.grad(lambda *a: gelu_mlp(*a).sum(), argnums=(1, 2))
  result = gg.verify(grad, grad, X, W1, W2, mesh=MESH, in_specs=TP,
                     out_specs=(P(None, "tp"), P("tp", None)), check_relations=True)
  assert result.refines, to_text(result, "seq", "dist")


def test_the_tanh_gelu_for_the_exact_one_is_refused():
  tanh_mlp = lambda x, w1, w2: jax.nn.gelu(x @ w1, approximate=True) @ w2
  result = gg.verify(gelu_mlp, tanh_mlp, X, W1, W2, mesh=MESH, in_specs=TP, out_specs=P())
  assert not result.refines


@pytest.mark.parametrize("name", ["erfc", "lgamma", "asin", "erf_inv"])
def test_the_expansion_computes_what_jax_does(name):
  f = FUNCTIONS[name]
  x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32) * 2
  m = lower_sequential(f, x)
  inline_calls(m)
  assert any(op.name.startswith("chlo.") for op in m.main.walk())
  assert chlo_expansion.expand_chlo(m) >= 1
  assert not any(op.name.startswith("chlo.") for op in m.main.walk())
  g = m.main
  got = Interpreter(1).run(g, [[x]])[g.results[0].id][0]
  # (the interpreter rounds in float64 where XLA rounds in float32)
  np.testing.assert_allclose(got, np.asarray(jax.jit(f)(x)), rtol=1e-4, atol=1e-5)


def test_shard_map_programs_keep_their_chlo_ops():
  """A StableHLO per-device program holds chlo.erfc itself: no expansion."""
  from jax import shard_map
  dist = shard_map(gelu_mlp, mesh=MESH, in_specs=TP, out_specs=P(), check_vma=False)
  psummed = shard_map(lambda *a: jax.lax.psum(gelu_mlp(*a), "tp"), mesh=MESH, in_specs=TP,
                      out_specs=P(), check_vma=False)
  assert gg.verify(gelu_mlp, psummed, X, W1, W2, mesh=MESH, in_specs=TP).refines
  assert not gg.verify(gelu_mlp, dist, X, W1, W2, mesh=MESH, in_specs=TP).refines


def test_without_an_expansion_the_report_says_it_is_a_limitation(monkeypatch):
  monkeypatch.setattr(chlo_expansion, "_EXPANDED", frozenset())
  result = gg.verify(gelu_mlp, gelu_mlp, X, W1, W2, mesh=MESH, in_specs=TP, out_specs=P())
  assert not result.refines and result.failure.op_name == "chlo.erfc"
  assert "could not give the sequential program the same expansion (a limitation" \
      in result.failure.diagnosis


def test_dumped_files_with_an_hlo_text_per_device_program_are_proved(tmp_path):
  """gg-hlo-verify on a StableHLO sequential file and XLA's partitioned HLO
  text dump: the text format came through XLA too."""
  from jax.sharding import NamedSharding
  from graphguard_hlo.lowering import abstract_value
  from graphguard_hlo.xla_partition import partitioned_hlo_text
  seq = tmp_path / "seq.mlir"
  seq.write_text(jax.jit(gelu_mlp).lower(X, W1, W2).as_text())
  args = [abstract_value(a, NamedSharding(MESH, s)) for a, s in zip((X, W1, W2), TP)]
  lowered = jax.jit(gelu_mlp, out_shardings=NamedSharding(MESH, P())).lower(*args)
  dist = tmp_path / "dist.hlo.txt"
  dist.write_text(partitioned_hlo_text(lowered))
  relation = "1: dim1=a0\n2: dim0=a0\n"  # (an HLO dump names no mesh axes)
  result = gg.verify_files(str(seq), str(dist), relation=relation)
  assert result.refines, to_text(result, "seq", "dist")
