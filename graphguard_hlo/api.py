"""The Python front door: verify JAX functions or module files, in code and in tests.

    import graphguard_hlo as gg
    result = gg.verify(mlp, mlp_tp, x, w1, w2, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp")))
    result            # reads as a report in a REPL or notebook
    gg.assert_refines(mlp, mlp_tp, x, w1, w2, mesh=mesh, in_specs=...)   # in your own CI

Arguments may be arrays or ``jax.ShapeDtypeStruct``s: only shapes, dtypes and
shardings are used, nothing is run or allocated.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from graphguard_hlo.passes.inference import Result


def _abstract_args(args: Sequence[Any], mesh, in_specs) -> list:
  """Abstract distributed arguments: each leaf of each pytree argument with
  its own sharding, or, given ``in_specs`` (one per argument, each a prefix
  of its argument's pytree, as ``shard_map`` reads them), that spec's."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec
  from graphguard_hlo.lowering import abstract_args, abstract_value

  if in_specs is None:
    return abstract_args(args, keep_sharding=True)
  if mesh is None:
    raise ValueError("in_specs needs mesh=")
  if len(in_specs) != len(args):
    raise ValueError(f"in_specs has {len(in_specs)} entries for {len(args)} arguments")
  out = []
  for i, (spec, a) in enumerate(zip(in_specs, args)):
    def under(spec, subtree):
      sharding = NamedSharding(mesh, PartitionSpec() if spec is None else spec)
      return jax.tree.map(lambda x: abstract_value(x, sharding), subtree)
    try:
      out.append(jax.tree.map(under, spec, a, is_leaf=lambda s: s is None or isinstance(
          s, PartitionSpec)))
    except ValueError as e:
      raise ValueError(f"in_specs[{i}] is not a prefix of argument {i}'s pytree: {e}") from None
  return out


def verify(seq_fn: Callable, dist_fn: Callable, *example_args, mesh=None, in_specs=None,
           out_specs=None, relation: Optional[str] = None,
           max_relations: Optional[int] = None, check_relations: bool = False,
           seed: int = 0) -> Result:
  """Prove ``dist_fn`` (a shard_map, or any jittable function whose arguments carry
  shardings) refines ``seq_fn`` on arguments shaped like ``example_args``.

  ``in_specs``/``out_specs``: PartitionSpecs over ``mesh`` for the distributed
  arguments/results (alternatively give arguments with ``.sharding``).
  ``relation``: explicit input layouts in the relation-file syntax (README).
  ``max_relations``: relations kept per sequential value, when a report says
  the default cap was reached.
  ``check_relations``: also run both programs on random inputs (``seed``),
  every rank simulated on CPU, and hold each relation the proof earned against
  the numbers (``result.relation_check``); a proof whose relations fail raises
  ``relation_check.ProofWithdrawn`` (a verifier bug).
  """
  from graphguard_hlo.lowering import lower_distributed, lower_sequential
  from graphguard_hlo.pipeline import prepare_dist, prepare_seq
  from graphguard_hlo.relation_file import relation_layouts
  dist_args = _abstract_args(example_args, mesh, in_specs)
  out_shardings = None
  if out_specs is not None:
    from jax.sharding import NamedSharding
    import jax
    # (a None leaf: XLA chooses, as jax.jit reads it)
    out_shardings = jax.tree.map(lambda s: None if s is None else NamedSharding(mesh, s),
                                 out_specs,
                                 is_leaf=lambda s: s is None or type(s).__name__ == "PartitionSpec")
  seq = lower_sequential(seq_fn, *example_args, name=_name(seq_fn))
  dist = lower_distributed(dist_fn, *dist_args, out_shardings=out_shardings,
                           name=_name(dist_fn))
  program = prepare_dist(dist)
  prepare_seq(seq, program)
  return _verified(seq, program, relation_layouts(relation, seq, program), max_relations,
                   check_relations, seed)


def verify_files(seq_path: str, dist_path: str, relation: Optional[str] = None,
                 num_partitions: Optional[int] = None,
                 max_relations: Optional[int] = None, check_relations: bool = False,
                 seed: int = 0) -> Result:
  """Like ``gg-hlo-verify SEQ DIST``; ``relation`` is relation-file text;
  ``check_relations`` and ``seed`` as in ``verify``."""
  from graphguard_hlo.loaders import load_module
  from graphguard_hlo.pipeline import prepare_dist, prepare_seq
  from graphguard_hlo.relation_file import relation_layouts
  program = prepare_dist(load_module(dist_path), num_partitions)
  seq = prepare_seq(load_module(seq_path), program)
  return _verified(seq, program, relation_layouts(relation, seq, program), max_relations,
                   check_relations, seed)


def _verified(seq, program, layouts, max_relations, check_relations: bool, seed: int) -> Result:
  """The verdict on prepared programs, with the relation check if asked for."""
  from graphguard_hlo.passes.inference import RelationInference
  inference = RelationInference(seq, program, layouts, **_cap(max_relations))
  if not check_relations:
    return inference.run()
  from graphguard_hlo.relation_check import checked
  return checked(inference, seed)


def _cap(max_relations: Optional[int]) -> dict:
  """``verify_programs``' keyword for a cap the caller chose, if any."""
  if max_relations is None:
    return {}
  if max_relations < 1:
    raise ValueError(f"max_relations must be positive, got {max_relations}")
  return {"max_relations": max_relations}


def assert_refines(seq_fn: Callable, dist_fn: Callable, *example_args, **kw) -> Result:
  """``verify`` for tests: fails with the localized report when not proved."""
  __tracebackhide__ = True  # pytest shows the report, not this frame
  result = verify(seq_fn, dist_fn, *example_args, **kw)
  if not result.refines:
    from graphguard_hlo.report import to_text
    raise AssertionError("distributed program not proved to refine the sequential one\n"
                         + to_text(result, _name(seq_fn), _name(dist_fn)))
  return result


def _name(fn) -> str:
  return f"<{getattr(fn, '__name__', type(fn).__name__)}>"
