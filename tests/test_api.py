"""The Python API on JAX functions: proved, not proved, and the pytest helper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

import graphguard_hlo as gg
from graphguard_hlo.report import to_text

MESH = Mesh(np.array(jax.devices()[:4]), ("tp",))
ARGS = [jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 32), jnp.float32),
        jax.ShapeDtypeStruct((32, 16), jnp.float32)]
SPECS = (P(), P(None, "tp"), P("tp", None))


def mlp(x, w1, w2):
  return jnp.tanh(x @ w1) @ w2


def _tp(reduce):
  def body(x, w1, w2):
    return reduce(jnp.tanh(x @ w1) @ w2)
  return shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P(), check_vma=False)


def test_shard_map_is_proved_and_reads_well():
  result = gg.verify(mlp, _tp(lambda y: jax.lax.psum(y, "tp")), *ARGS, mesh=MESH,
                     in_specs=SPECS)
  assert result.refines
  assert repr(result) == "<refines: out0 = replica(out0@r)>"
  assert "refines" in result._repr_html_()


def test_gspmd_is_proved_from_specs():
  result = gg.verify(mlp, mlp, *ARGS, mesh=MESH, in_specs=SPECS, out_specs=P())
  assert result.refines, result


@pytest.mark.parametrize("out_spec, relation", [
    (P(None, "tp"), "concat[dim1:tp](out0@r)"), (P(), "replica(out0@r)")])
def test_gspmd_with_replicated_inputs_reads_the_partition_count_from_jax(out_spec, relation):
  """XLA's partitioned module records no sharding for these inputs, nor the
  partition count: it comes from the jitted function's own shardings (the
  output's layout is then the clean relation found)."""
  specs = (P(), P(), P())
  result = gg.verify(mlp, mlp, *ARGS, mesh=MESH, in_specs=specs, out_specs=out_spec)
  assert result.refines, result
  assert [o.relation for o in result.outputs] == [relation]


def test_sharding_constraints_in_the_sequential_program_only_annotate():
  """A model with sharding constraints, lowered unsharded as the sequential
  program, keeps them as ops: they are its operand."""
  from jax.sharding import NamedSharding

  def constrained(x, w1, w2):
    h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w1), NamedSharding(MESH, P(None, "tp")))
    return h @ w2
  result = gg.verify(constrained, constrained, *ARGS, mesh=MESH, in_specs=SPECS, out_specs=P())
  assert result.refines, result
  wrong = lambda x, w1, w2: constrained(x, w1, w2) * 2
  assert not gg.verify(constrained, wrong, *ARGS, mesh=MESH, in_specs=SPECS,
                       out_specs=P()).refines


def test_a_splat_update_of_another_shape_is_another_update():
  """Zeros written as a row sequentially and as a column on the devices: the
  two splats are equal up to unit dims, but a dynamic_update_slice reads its
  update's shape (an audit's counterexample to a splat matched up to unit
  dims for any op: only an elementwise op pairs its operands so)."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

  def seq(x):
    return jax.lax.dynamic_update_slice(x, jnp.zeros((1, 3), x.dtype), (0, 0))

  def body(x):
    return jax.lax.dynamic_update_slice(x, jnp.zeros((3, 1), x.dtype), (0, 0))
  dist = shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=False)
  x = jax.ShapeDtypeStruct((3, 3), jnp.float32)
  assert not gg.verify(seq, dist, x, mesh=mesh, in_specs=(P(),), out_specs=P()).refines
  assert gg.verify(seq, shard_map(seq, mesh=mesh, in_specs=(P(),), out_specs=P(),
                                  check_vma=False), x, mesh=mesh, in_specs=(P(),)).refines


def test_pmean_reported_with_location():
  result = gg.verify(mlp, _tp(lambda y: jax.lax.pmean(y, "tp")), *ARGS, mesh=MESH,
                     in_specs=SPECS)
  assert not result.refines
  assert "pmean where psum belongs" in result.failure.diagnosis
  assert repr(result).startswith("<not proved at output (")
  assert "test_api.py" in str(result.failure.location)


@pytest.mark.parametrize("gspmd", [False, True], ids=["shard_map", "gspmd"])
def test_an_input_one_program_never_reads_is_a_bug_not_an_input_error(gspmd):
  """jax.jit drops unread arguments unless told to keep them: a distributed
  program that forgets to add a bias had one parameter fewer and was refused
  as a mismatched pair.  Kept, the add that needs the bias is reported."""
  forgot = (lambda x, w1, w2, b: mlp(x, w1, w2)) if gspmd else shard_map(
      lambda x, w1, w2, b: jax.lax.psum(mlp(x, w1, w2), "tp"), mesh=MESH,
      in_specs=SPECS + (P(),), out_specs=P(), check_vma=False)
  args = ARGS + [jax.ShapeDtypeStruct((8, 16), jnp.float32)]
  kw = dict(mesh=MESH, in_specs=SPECS + (P(),), out_specs=P() if gspmd else None)
  result = gg.verify(lambda x, w1, w2, b: mlp(x, w1, w2) + b, forgot, *args, **kw)
  assert not result.refines
  assert result.failure.op_name == "add"
  assert gg.verify(lambda x, w1, w2, b: mlp(x, w1, w2), forgot, *args, **kw).refines


def test_a_jitted_shard_map_keeps_its_mesh_axes():
  """``jax.jit(shard_map(f))`` lowers to a call of the manual computation: read
  through the call, the report names the user's axis, not XLA's a0."""
  missing = jax.jit(_tp(lambda y: y))
  result = gg.verify(mlp, missing, *ARGS, mesh=MESH, in_specs=SPECS)
  assert not result.refines
  assert "sum[tp]" in str(result.failure.inputs) + result.failure.diagnosis, result.failure
  assert "a0" not in result.failure.diagnosis
  assert gg.verify(mlp, jax.jit(_tp(lambda y: jax.lax.psum(y, "tp"))), *ARGS, mesh=MESH,
                   in_specs=SPECS).refines


# Parameters as a model holds them: a pytree, its specs a prefix of it.
PARAMS = {"w1": ARGS[1], "w2": ARGS[2]}
TREE_SPECS = (P(), {"w1": P(None, "tp"), "w2": P("tp", None)})


def mlp_of_params(x, p):
  return mlp(x, p["w1"], p["w2"])


@pytest.mark.parametrize("reduce, refines", [(lambda y: jax.lax.psum(y, "tp"), True),
                                             (lambda y: y, False)])
def test_pytree_arguments_under_shard_map(reduce, refines):
  dist = shard_map(lambda x, p: reduce(mlp_of_params(x, p)), mesh=MESH, in_specs=TREE_SPECS,
                   out_specs=P(), check_vma=False)
  result = gg.verify(mlp_of_params, dist, ARGS[0], PARAMS, mesh=MESH, in_specs=TREE_SPECS)
  assert result.refines == refines, result
  if not refines:
    assert "(missing all-reduce)" in result.failure.diagnosis


@pytest.mark.parametrize("specs", [TREE_SPECS, (P(), P(None, "tp"))], ids=["leaves", "prefix"])
def test_pytree_arguments_under_gspmd(specs):
  """A spec per leaf, or one spec for a whole subtree (every leaf split
  alike), as shard_map reads in_specs."""
  result = gg.verify(mlp_of_params, mlp_of_params, ARGS[0], PARAMS, mesh=MESH, in_specs=specs,
                     out_specs=P())
  assert result.refines, result


def test_in_specs_not_a_prefix_of_the_arguments_is_a_clear_error():
  with pytest.raises(ValueError, match=r"in_specs\[1\] is not a prefix of argument 1's pytree"):
    gg.verify(mlp_of_params, mlp_of_params, ARGS[0], PARAMS, mesh=MESH,
              in_specs=(P(), {"w1": P()}), out_specs=P())
  with pytest.raises(ValueError, match="in_specs has 1 entries for 2 arguments"):
    gg.verify(mlp_of_params, mlp_of_params, ARGS[0], PARAMS, mesh=MESH, in_specs=(P(),))


@pytest.mark.parametrize("reduce_w1", [True, False])
def test_data_parallel_gradients_of_a_params_dict(reduce_w1):
  """A sum loss: its cotangent is ones, split by rows like the batch, and
  meets the activations in the weight gradient's matmul.  With w1's gradient
  never summed over the ranks, the failed output is named by its pytree path."""
  def loss(x, p):
    return jnp.sum(mlp_of_params(x, p))
  specs = (P("tp", None), {"w1": P(), "w2": P()})

  def step(x, p):  # data parallel over "tp": local gradients, then sums
    value, grads = jax.value_and_grad(loss, argnums=1)(x, p)
    total = lambda g: jax.lax.psum(g, "tp")
    return total(value), {"w1": total(grads["w1"]) if reduce_w1 else grads["w1"],
                          "w2": total(grads["w2"])}
  dist = shard_map(step, mesh=MESH, in_specs=specs, out_specs=(P(), {"w1": P(), "w2": P()}),
                   check_vma=False)
  result = gg.verify(jax.value_and_grad(loss, argnums=1), dist, ARGS[0], PARAMS, mesh=MESH,
                     in_specs=specs)
  assert result.refines == reduce_w1, result
  if not reduce_w1:
    assert result.failure.output_index == 1
    assert result.failure.inputs[0][0] == "output 1 (result[1]['w1']): f32[16,32]"
    assert "output 1 is a partial sum over 'tp' never reduced" in result.failure.diagnosis


def test_a_diagnosis_names_an_argument_by_its_pytree_path():
  """Each rank slices the next rank's columns of a replicated weight: the
  report names the weight as the user's pytree does."""
  specs = (P(), {"w1": P(), "w2": P("tp", None)})

  def body(x, p):
    start = (jax.lax.axis_index("tp") + 1) % 4 * 8
    w1 = jax.lax.dynamic_slice_in_dim(p["w1"], start, 8, axis=1)
    return jax.lax.psum(jnp.tanh(x @ w1) @ p["w2"], "tp")
  dist = shard_map(body, mesh=MESH, in_specs=specs, out_specs=P(), check_vma=False)
  result = gg.verify(mlp_of_params, dist, ARGS[0], PARAMS, mesh=MESH, in_specs=specs)
  assert not result.refines
  assert "tile tp+1, another rank's tile?) of %" in result.failure.diagnosis
  assert "which is the sequential %2 (argument 1, p['w1']) as replica(d@r)" in \
      result.failure.diagnosis, result.failure.diagnosis


def test_assert_refines_fails_with_the_report():
  gg.assert_refines(mlp, _tp(lambda y: jax.lax.psum(y, "tp")), *ARGS, mesh=MESH,
                    in_specs=SPECS)
  with pytest.raises(AssertionError, match="missing all-reduce|never reduced"):
    gg.assert_refines(lambda x, w1, w2: jnp.tanh(mlp(x, w1, w2)),
                      _tp(lambda y: jnp.tanh(y)), *ARGS, mesh=MESH, in_specs=SPECS)


def test_verify_files_with_relation_text():
  td = "testdata/tp_mlp__shard_map__ok"
  assert gg.verify_files(f"{td}/seq.mlir", f"{td}/dist.mlir",
                         relation="1: dim1=tp\n3: dim0=tp\n").refines


@pytest.mark.parametrize("axis", ["tp", "a0"])
def test_a_gspmd_relation_names_the_users_axis_or_xlas_atomic_one(axis):
  """XLA's per-device program is read over the user's mesh axes; a relation
  may still name XLA's atomic axis (what an HLO dump of it is read over)."""
  def verify(relation):
    return gg.verify(mlp, mlp, *ARGS, mesh=MESH, in_specs=SPECS, out_specs=P(),
                     relation=relation)
  result = verify(f"1: dim1={axis}\n2: dim0={axis}\n")
  assert result.refines and "mesh {'tp': 4}" in to_text(result, "seq", "dist")
  from graphguard_hlo.errors import InputError
  with pytest.raises(InputError, match=r"under concat\[dim0:tp\]\(d@r\) gives per-device"):
    verify(f"1: dim0={axis}\n")  # rows, where XLA splits columns
  with pytest.raises(InputError, match=r"unknown mesh axis 'a1' \(mesh axes: tp\)"):
    verify("1: dim1=a1\n")


MESH_3D = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))


def test_a_gspmd_output_is_held_to_its_declared_sharding():
  """A relation saying the rows are split over a where the program splits
  them over b: XLA's program then returns rows over a, which its declared
  output sharding (over b) must refuse (an audit's false proof: the output
  sharding was not read off XLA's module, so any clean layout was taken)."""
  def f(x, w):
    return jnp.tanh(x) @ w
  x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  def verify(relation):
    return gg.verify(f, f, x, x, mesh=MESH_3D, in_specs=(P("b"), P()), out_specs=P("b"),
                     relation=relation)
  assert verify("0: dim0=b\n").refines
  result = verify("0: dim0=a\n")
  assert not result.refines
  assert "laid out as concat[dim0:a](out@r) but the distributed module declares " \
      "concat[dim0:b](out@r)" in result.failure.diagnosis


def test_an_output_spec_left_none_is_xlas_choice():
  """``out_specs=(P("x"), None)``: the second output's sharding is XLA's to
  choose, as jax.jit reads a None leaf (an audit's crash: NamedSharding(mesh, None))."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))
  f = lambda a, b: (a @ b, a.sum(0))
  result = gg.verify(f, f, jax.ShapeDtypeStruct((8, 16), jnp.float32),
                     jax.ShapeDtypeStruct((16, 8), jnp.float32), mesh=mesh,
                     in_specs=(P("x", "y"), P("y")), out_specs=(P("x"), None))
  assert result.refines, to_text(result, "seq", "dist")


def test_an_axis_of_the_users_mesh_named_like_xlas_is_never_read_as_xlas():
  """The user's axis a0, which the program does not cut on its own (XLA
  joins it with y as its atomic a1), is refused, not read as XLA's a0 (x)."""
  from graphguard_hlo.errors import InputError
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("x", "a0", "y"))
  f = lambda v: jnp.tanh(v)
  v = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  with pytest.raises(InputError, match="mesh axis 'a0' is not one axis of the partitioned"):
    gg.verify(f, f, v, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"),
              relation="0: dim0=a0\n")


@pytest.mark.parametrize("pair, refines", [("tp_mlp__shard_map__ok", True),
                                           ("tp_mlp__shard_map__missing_allreduce", False)])
def test_verify_files_checks_relations_when_asked(pair, refines):
  """Not proved, nothing is withdrawn: the relations it earned still hold."""
  td = f"testdata/{pair}"
  result = gg.verify_files(f"{td}/seq.mlir", f"{td}/dist.mlir", check_relations=True, seed=3)
  assert result.refines == refines and result.relation_check.ok
  assert result.relation_check.checked > 0


def test_unsupported_ops_are_named_and_treated_as_opaque():
  """fft has no lemma: on replicas it is the same function, so this proves, and
  the report names it; on a tiled operand it cannot be related."""
  from graphguard_hlo.report import to_text
  def f(x, w1, w2):
    return jnp.abs(jnp.fft.rfft(mlp(x, w1, w2), axis=0))
  body = lambda x, w1, w2: jnp.abs(jnp.fft.rfft(jax.lax.psum(jnp.tanh(x @ w1) @ w2, "tp"),
                                                axis=0))
  result = gg.verify(f, shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P()), *ARGS,
                     mesh=MESH, in_specs=SPECS)
  assert result.refines
  assert "note: unsupported op treated as opaque" in to_text(result, "s", "d")
  assert any(o.startswith("fft at ") for o in result.stats["opaque_ops"])


def test_check_relations_holds_the_proofs_relations_against_numbers():
  result = gg.verify(mlp, _tp(lambda y: jax.lax.psum(y, "tp")), *ARGS, mesh=MESH,
                     in_specs=SPECS, check_relations=True)
  check = result.relation_check
  assert result.refines and check.ok and check.checked > 0, check
  assert gg.verify(mlp, mlp, *ARGS, mesh=MESH, in_specs=SPECS).relation_check is None


def test_check_relations_withdraws_a_proof_resting_on_a_wrong_lemma(monkeypatch):
  """A seeded wrong lemma: a dot contracting tiles taken for a replica (the
  partial sums' all-reduce taken for done).  The missing psum is then
  'proved'; with check_relations the proof is withdrawn."""
  from graphguard_hlo.passes import lemmas
  from graphguard_hlo.relation_check import ProofWithdrawn

  def reduced_for_free(op, layouts):
    for attrs, layout in lemmas._dot_general(op, layouts):
      yield attrs, layout.with_(partial=())
  wrong = lemmas.Lemma("seeded-wrong-dot", frozenset({"dot_general"}), "false", reduced_for_free)
  monkeypatch.setattr(lemmas, "LEMMAS", (wrong,) + lemmas.LEMMAS)
  missing_psum = _tp(lambda y: y)
  assert gg.verify(mlp, missing_psum, *ARGS, mesh=MESH, in_specs=SPECS).refines  # the seed
  with pytest.raises(ProofWithdrawn, match="the verdict 'refines' is withdrawn"):
    gg.verify(mlp, missing_psum, *ARGS, mesh=MESH, in_specs=SPECS, check_relations=True)
