"""GPT-2 and Llama-3 under dp, tp, sp, cp, pp, dp x tp, pp x tp and dp x tp x cp (and more,
``tools/zoo/strategies.py``), layers unrolled and under
lax.scan, forward and forward+backward: proved, and seeded bugs
reported at their op.  GSPMD programs the engine cannot prove yet are listed
with the reason (the test fails when one starts being proved)."""

import pytest

from tests.zoo_verdicts import verified
from tools.zoo import strategies

CASES = strategies.model_cases()

# Correct programs the engine cannot prove yet, with the reason.
KNOWN_UNPROVED: dict[str, str] = {}


def _verify(case):
  result, _ = verified(case)  # shared with test_relation_check.py
  return result


@pytest.mark.parametrize("case", [c for c in CASES if c.bug is None], ids=lambda c: c.name)
def test_correct_model_is_proved(case):
  result = _verify(case)
  if case.name in KNOWN_UNPROVED:
    assert not result.refines, f"{case.name} is now proved: drop it from KNOWN_UNPROVED"
    pytest.xfail(KNOWN_UNPROVED[case.name])
  assert result.refines, result


# What each seeded bug's diagnosis must say: the words that name the bug class.
_DIAGNOSES: dict[str, str] = {
    "gpt2/fsdp/shard_map/wrong_gather_dim": "shard concatenated on the wrong dim",
    "gpt2/fsdp_tp/shard_map/wrong_gather_dim": "shard concatenated on the wrong dim",
    "llama3/ep_tp/shard_map/experts_summed_over_tp":
        "4 times the sequential one (summed over 4 = |tp| ranks without dividing",
    "gpt2/fsdp_take/shard_map/table_not_gathered": "(missing all-gather?)",
    "llama3/fsdp_take/shard_map/table_not_gathered": "(missing all-gather?)",
    "llama3/sp/shard_map/rope_no_offset": "with no rank offset",
    "llama3/dp_sp/shard_map/rope_no_offset": "with no rank offset",
    "llama3/tp/shard_map/gqa_wrong_heads": "reads the related operands but gives",
    "gpt2/tp_vocab/shard_map/nll_max_not_reduced": "partial max over 'tp' that is never reduced",
    "llama3/tp_vocab/shard_map/vocab_ids_not_offset": "with no rank offset",
    "gpt2/tp_vocab_take/shard_map/vocab_ids_not_offset":
        "at rank tp=1, index 16 looks up local row 15, not its row 0",
    "gpt2/tp/shard_map/missing_allreduce": "(missing all-reduce)",
    "gpt2/tp_bf16/shard_map/missing_allreduce": "(missing all-reduce)",
    "llama3/tp/shard_map/missing_allreduce": "(missing all-reduce)",
    "gpt2/dp/shard_map/loss_wrong_scale": "psum where pmean belongs?",
    "llama3/dp/shard_map/loss_wrong_scale": "psum where pmean belongs?",
    "llama3/dp_tp/shard_map/wrong_replica_groups": "wrong replica groups",
    "llama3/cp/shard_map/mask_no_offset": "with no rank offset",
    "gpt2/dp_tp_cp/shard_map/kv_gathered_over_wrong_axis": "gathered over the wrong mesh axis",
    "llama3/dp_tp_cp/shard_map/kv_gathered_over_wrong_axis": "gathered over the wrong mesh axis",
    "llama3/ep/shard_map/dispatch_to_wrong_rank": "it is computed from %transpose",
    "llama3/ep_capacity/shard_map/slots_over_all_tokens": "it is a reshape of",
    "gpt2/pp/shard_map/wrong_permutation": "activations or their cotangents passed to the wrong stage?",
    "llama3/pp/shard_map/wrong_permutation": "activations or their cotangents passed to the wrong stage?",
    "llama3/pp_fori/shard_map/wrong_permutation":
        "activations or their cotangents passed to the wrong stage?",
    "gpt2/pp_scan/shard_map/wrong_permutation":
        "only at pp=1: no rank holds both; collective-permute at",
    "llama3/pp_tp_scan/shard_map/wrong_replica_groups":
        "reduces over 'pp', 'tp' but the partial sum is over 'tp' (wrong replica groups",
    "gpt2/dp_pp_tp_scan_grad/shard_map/double_counted_grad":
        "so summed over those ranks it is counted 2 times",
    "gpt2/tp/gspmd/missing_allreduce": "is only known as a partial sum over 'a0' that is "
                                        "never reduced",
    "llama3/dp_tp/gspmd/wrong_replica_groups":
        "reduces over 'a0' but the partial sum is over 'a1', 'a2' (wrong replica groups",
    "llama3/sp/gspmd/wrong_shard_offset": "starting at 8, 0 along dim 1 at a0 = 0, 1: tile "
                                          "a0+1, another rank's tile?",
    "llama3/cp/gspmd/wrong_shard_offset": "as concat[dim0:a0+1](d@r)",
    "llama3/cp_zigzag/shard_map/rope_positions_contiguous":
        "holds the chunks of dim 1 in the order 0 7 1 6 2 5 3 4 (zig-zag), operand %455 holds "
        "them in sequence order (contiguous shards)",
    "llama3/cp_zigzag/shard_map/mask_contiguous": "holds them in sequence order (contiguous "
                                                  "shards): each rank pairs rows of different "
                                                  "positions (chunk order mismatch)",
    "llama3/cp_zigzag_scan/shard_map/mask_contiguous": "holds them in sequence order "
                                                       "(contiguous shards)",
    "llama3/cp_zigzag/shard_map/labels_contiguous": "(zig-zag), operand %445 holds them in "
                                                    "sequence order",
    "llama3/cp_zigzag_take/shard_map/rope_positions_contiguous":
        "holds the chunks of dim 1 in the order 0 7 1 6 2 5 3 4 (zig-zag), operand %455 holds "
        "them in sequence order (contiguous shards)",
    "llama3/cp_zigzag_loaded/shard_map/rope_positions_contiguous":
        "holds the chunks of dim 1 in the order 0 7 1 6 2 5 3 4 (zig-zag), operand %455 holds "
        "them in sequence order (contiguous shards)",
    "llama3/cp_zigzag_loaded/shard_map/batch_contiguous":
        "operand %455 holds the chunks of dim 1 in the order 0 7 1 6 2 5 3 4 (zig-zag), "
        "operand %71 holds them in sequence order (contiguous shards)",
    "llama3/cp_zigzag_loaded/gspmd/rope_positions_contiguous":
        "operand %71 holds the chunks of dim 1 in the order 0 7 1 6 2 5 3 4 (zig-zag), "
        "operand %455 holds them in sequence order (contiguous shards)",
    "llama3/cp_zigzag_loaded/gspmd/mask_contiguous":
        "operand %106 holds the chunks of dim 2 in the order 0 7 1 6 2 5 3 4 (zig-zag), "
        "operand %386 holds them in sequence order (contiguous shards)",
    "gpt2/cp_zigzag_loaded/shard_map/batch_contiguous":
        "operand %489 holds the chunks of dim 1 in the order 0 7 1 6 2 5 3 4 (zig-zag), "
        "operand %40 holds them in sequence order (contiguous shards)",
    "gpt2/cp_zigzag/shard_map/positions_contiguous":
        "holds the chunks of dim 1 in the order 0 7 1 6 2 5 3 4 (zig-zag), operand %489 holds "
        "them in sequence order (contiguous shards)",
    "gpt2/cp_zigzag_vjp_grad/shard_map/write_back_contiguous":
        "output 2 is laid out as chunks[dim0: 0 7 1 6 2 5 3 4](replica(out@r)) but the "
        "distributed module declares replica(out@r) (its rows' chunks are in another order",
    "gpt2/cp_zigzag_take_vjp_grad/shard_map/write_back_contiguous":
        "output 2 is laid out as chunks[dim0: 0 7 1 6 2 5 3 4](replica(out@r)) but the "
        "distributed module declares replica(out@r) (its rows' chunks are in another order",
    "gpt2/cp_zigzag_vjp_grad/shard_map/write_back_averaged":
        "output 2: the distributed value is 0.25 times the sequential one (divided by 4 = |cp| "
        "once too often: pmean where psum belongs?)",
    "llama3/cp/gspmd/gather_out_of_order":
        "runs over 'a0' but lists its ranks in another order than the mesh's, ((3, 2, 1, 0),) "
        "(shards concatenated out of order)",
    "llama3/dp_tp_cp/gspmd/gather_wrong_axis":
        "gathers over 'a1' along dim 1, but dim 1 is split over 'a2' (gathered over the wrong "
        "mesh axis)",
    "gpt2/fsdp/gspmd/all_to_all_out_of_order": "lists its ranks in another order than the "
                                               "mesh's, ((1, 0, 3, 2),)",
    "gpt2/dp_take_grad/gspmd/grad_not_allreduced": "is a partial sum over 'a0' never reduced "
                                                   "(missing all-reduce)",
    "llama3/dp_tp_grad/gspmd/grad_not_allreduced": "is a partial sum over 'a0' never reduced "
                                                   "(missing all-reduce)",
    "llama3/pp_scan_grad/shard_map/double_counted_grad":
        "the distributed value is 4 times the sequential one (summed over 4 = |pp| ranks",
    "gpt2/pp_grad/shard_map/double_counted_grad": "4 times the sequential one",
    "gpt2/pp_tp/shard_map/wrong_replica_groups": "wrong replica groups",
    "llama3/pp_grad/shard_map/double_counted_grad": "4 times its share",
    "gpt2/pp_gpipe_grad/shard_map/double_counted_grad": "4 times the sequential one",
    "gpt2/pp_gpipe/gspmd/wrong_permutation":
        "activations or their cotangents passed to the wrong stage?",
    "llama3/pp_gpipe/gspmd/fed_to_stage_1": "only at pp=0: no rank holds both",
    "llama3/pp_tp_gpipe/gspmd/collected_from_stage_0":
        "but never on pieces 0, 1, 3 (a microbatch skipped, or taken twice?)",
    "llama3/pp_gpipe_fori/gspmd/wrong_permutation":
        "activations or their cotangents passed to the wrong stage?",
    "gpt2/pp_gpipe/gspmd/collected_from_stage_2":
        "but never on piece 3 (a microbatch skipped, or taken twice?)",
    "gpt2/pp_circular/gspmd/no_stage_lag":
        "at pp=1 on pieces 0, 1, 2 of the 4 its operand is cut into along dim 0, but never "
        "on piece 3",
    "llama3/pp_circular_fori/gspmd/no_stage_lag":
        "(a stage running another layer's or another microbatch's step?)",
    # The norm of layer 4 (repeat 1 at stage 0) meets the final norm's weight.
    "llama3/pp_circular/gspmd/collected_early":
        "which is the sequential %13 (argument 12, params[10]) as replica(d@r)",
    "gpt2/pp_circular_fori/gspmd/collected_early":
        "which is the sequential %21 (argument 20, params[18]) as replica(d@r)",
    "gpt2/pp_gpipe_buffered/shard_map/output_misplaced": "in the order 3, 0, 1, 2",
    "gpt2/pp_gpipe_fori/shard_map/output_misplaced": "in the order 3, 0, 1, 2",
    "gpt2/pp_1f1b_grad/shard_map/stale_input": "at pp=2 on pieces 1, 2, 3 of the 4 its operand "
                                                "is cut into along dim 0, but never on piece 0",
    "llama3/pp_1f1b_grad/shard_map/stale_input": "at pp=2 on pieces 1, 2, 3 of the 4 its "
                                                  "operand is cut into along dim 0, but never "
                                                  "on piece 0",
    "gpt2/pp_1f1b_buffered_grad/shard_map/stale_input": "but never on piece 0",
    "gpt2/pp_tp_1f1b_grad/shard_map/wrong_replica_groups":
        "reduces over 'pp', 'tp' but the partial sum is over 'tp' (wrong replica groups",
    "llama3/pp_1f1b_buffered_grad/shard_map/stale_input": "but never on piece 0",
    "gpt2/pp_1f1b_grad/shard_map/cotangent_forward":
        "sends [(0, 1), (1, 2), (2, 3), (3, 0)] over 'pp' (activations or their cotangents",
    "llama3/pp_1f1b_grad/shard_map/cotangent_forward":
        "sends [(0, 1), (1, 2), (2, 3), (3, 0)] over 'pp' (activations or their cotangents",
    "llama3/pp_gpipe_buffered/shard_map/output_misplaced": "in the order 3, 0, 1, 2",
    "llama3/pp_gpipe_fori/shard_map/output_misplaced": "in the order 3, 0, 1, 2",
    "gpt2/pp_gpipe_buffered/shard_map/wrong_permutation":
        "is the sequential value only at pp=3 and",
    "llama3/pp_gpipe_fori/shard_map/wrong_permutation":
        "is the sequential value only at pp=3 and",
    "gpt2/pp_gpipe_fori_grad/shard_map/double_counted_grad": "4 times the sequential one",
    "llama3/pp_gpipe_fori_grad/shard_map/double_counted_grad": "4 times its share",
    "gpt2/pp_interleaved_1f1b_grad/shard_map/depth_first":
        "on pieces 2, 3 of the 4 its operand is cut into along dim 0, but never on pieces 0, 1",
    "gpt2/pp_interleaved_1f1b_indexed_grad/shard_map/backward_chunk_not_reversed":
        "are each the sequential value at pp=3, but no per-device op reads them together",
    "gpt2/pp_interleaved_1f1b_grad/shard_map/chunk_of_step":
        "computes this dot_general at pp=1 on pieces 0, 1, 2 of the 4 its operand is cut into "
        "along dim 0, but never on piece 3",
    "gpt2/pp_tp_interleaved_1f1b_indexed_grad/shard_map/wrong_replica_groups":
        "reduces over 'pp', 'tp' but the partial sum is over 'tp' (wrong replica groups",
    "gpt2/dp_pp_tp_interleaved_1f1b_indexed_grad/shard_map/loss_summed_over_dp":
        "2 times the sequential one (summed over 2 = |dp| or |pp| or |tp| ranks without dividing",
    "gpt2/pp_tp_gpipe/shard_map/wrong_replica_groups": "reduces over 'pp', 'tp' but the partial "
                                                       "sum is over 'tp' (wrong replica groups",
    "llama3/pp_gpipe_grad/shard_map/double_counted_grad": "4 times its share",
    "gpt2/cp_ring/shard_map/wrong_permutation": "ring turning the wrong way",
    "gpt2/cp_ring_fori/shard_map/wrong_permutation": "ring turning the wrong way",
    "llama3/cp_ring/shard_map/wrong_permutation": "ring turning the wrong way",
    "gpt2/cp_zigzag_ring/shard_map/wrong_permutation": "ring turning the wrong way",
    "gpt2/cp_zigzag_ring_attention/shard_map/wrong_permutation":
        "holds blocks cp+{0,2} of it but never cp+{1,3}",
    "gpt2/cp_zigzag_ring_attention_fori/shard_map/wrong_permutation":
        "holds blocks cp+{0,2} of it but never cp+{1,3}",
    "llama3/cp_zigzag_ring_attention_vjp_grad/shard_map/grads_wrong_way":
        "collective-permutes round 'cp' send r -> r + 1 and r -> r + 3 (mod 4) (gradients "
        "sent the wrong way round the ring?)",
    "gpt2/cp_zigzag_ring_attention_vjp_grad/shard_map/lse_without_log":
        "which relates to no sequential value: it is a add of %maximum",
    "llama3/cp_zigzag_ring_attention/shard_map/mask_contiguous":
        "holds them in sequence order (contiguous shards): each rank pairs rows of different "
        "positions (chunk order mismatch)",
    "gpt2/ring_attention/shard_map/wrong_permutation": "a ring turning the wrong way",
    "llama3/ring_attention/shard_map/wrong_permutation": "a ring turning the wrong way",
    "llama3/ring_attention_fori/shard_map/wrong_permutation": "a ring turning the wrong way",
    "llama3/dp_tp_ring_attention/shard_map/ring_over_wrong_axis": "(wrong axis?)",
    "gpt2/ring_attention_inf_mask/shard_map/first_block_masked":
        "running max may be infinite: the scores may be infinite: the select at",
    "gpt2/dp_tp_ring_attention_fori/shard_map/ring_over_wrong_axis": "(wrong axis?)",
    "gpt2/ring_attention/shard_map/output_not_rescaled": "a rescale forgotten?",
    "llama3/ring_attention_vjp_grad/shard_map/grads_wrong_way":
        "collective-permutes round 'cp' send r -> r + 1 and r -> r + 3 (mod 4) (gradients "
        "sent the wrong way round the ring?)",
    "gpt2/ring_attention_vjp_grad/shard_map/lse_without_log":
        "which relates to no sequential value: it is a add of %maximum",
    "llama3/tp_scan/shard_map/missing_allreduce": "(missing all-reduce)",
    "llama3/tp_scan_remat_grad/shard_map/missing_allreduce": "(missing all-reduce)",
    "gpt2/tp_grad/shard_map/double_counted_grad": "so summed over those ranks it is counted "
                                                  "4 times",
    "gpt2/dp_grad/shard_map/grad_not_allreduced": "never reduced (missing all-reduce)",
    "llama3/dp_grad/shard_map/grad_not_allreduced": "never reduced (missing all-reduce)",
    "llama3/dp_tp_adamw/shard_map/norm_counts_replicas": "so summed over those ranks it "
                                                         "is counted 4 times",
    "gpt2/pp_adamw/shard_map/norm_counts_replicas": "so summed over those ranks it is "
                                                    "counted 4 times",
    "gpt2/dp_accum2/shard_map/not_divided": "2 times the sequential one",
    "gpt2/pp_gpipe/shard_map/microbatch_fed_late": "but never takes rows 3 (a microbatch "
                                                   "skipped?)",
    "gpt2/pp_gpipe_scan/shard_map/microbatch_fed_late":
        "rows 3:4 along dim 0 are microbatch 3 of 4 the sequential loop at",
    "gpt2/pp_gpipe_scan_grad/shard_map/double_counted_grad": "4 times the sequential one",
    "gpt2/pp_1f1b_buffered_scan_grad/shard_map/stale_input":
        "this loop runs on microbatch 0 of the 4 the sequential loop at",
    "llama3/pp_1f1b_scan_grad/shard_map/cotangent_forward":
        "activations or their cotangents passed to the wrong stage?",
    "gpt2/dp_pp_tp_1f1b_buffered_scan_grad/shard_map/stale_input":
        "this loop runs on microbatch 0 of each of 2 data-parallel tiles of the 4",
    "llama3/dp_pp_tp_1f1b_buffered_scan_grad/shard_map/loss_summed_over_dp":
        "2 times the sequential one (summed over 2 = |dp| or |pp| or |tp| ranks",
    "gpt2/pp_interleaved_1f1b_scan_grad/shard_map/depth_first":
        "this loop runs on microbatch 0 of the 4 the sequential loop at",
    "gpt2/pp_interleaved_1f1b_scan_grad/shard_map/chunk_of_step":
        "this loop runs on microbatch 3 of the 4 the sequential loop at",
    "gpt2/pp_interleaved_1f1b_indexed_scan_grad/shard_map/backward_chunk_not_reversed":
        "this loop runs on microbatch 0 of the 4 the sequential loop at",
    "llama3/dp_pp_tp_interleaved_1f1b_indexed_scan_grad/shard_map/loss_summed_over_dp":
        "2 times the sequential one (summed over 2 = |dp| or |pp| or |tp| ranks",
    "llama3/pp_tp_1f1b_scan_grad/shard_map/wrong_replica_groups":
        "reduces over 'pp', 'tp' but the partial sum is over 'tp' (wrong replica groups",
    "gpt2/pp_tp_1f1b_buffered_scan_grad/shard_map/stale_input":
        "this loop runs on microbatch 0 of the 4 the sequential loop at",
    "gpt2/pp_tp_gpipe_scan/shard_map/wrong_replica_groups":
        "reduces over 'pp', 'tp' but the partial sum is over 'tp' (wrong replica groups",
    "llama3/pp_tp_gpipe_scan_grad/shard_map/double_counted_grad":
        "so summed over those ranks it is counted 4 times",
    "llama3/pp_gpipe/shard_map/microbatch_fed_late": "but never takes rows 3 (a microbatch "
                                                     "skipped?)",
    "gpt2/cp_ulysses/shard_map/head_dim_split":
        "is only known as a partial sum over 'cp' that is never reduced before this select "
        "(missing all-reduce)",
    "llama3/cp_ulysses/shard_map/head_dim_split":
        "is only known as a partial sum over 'cp' that is never reduced before this select "
        "(missing all-reduce)",
    "gpt2/hsdp/shard_map/loss_over_shard_group":
        "output 0 is a partial sum over 'dp' never reduced (missing all-reduce)",
    "llama3/hsdp_grad/shard_map/loss_over_shard_group":
        "output 0 is a partial sum over 'dp' never reduced (missing all-reduce)",
    "llama3/hsdp_tp/shard_map/gathered_over_replicas":
        "gathers over 'dp' along dim 0, but dim 0 is split over 'fsdp' (gathered over the wrong "
        "mesh axis)",
    "llama3/hsdp_grad/gspmd/grad_summed_over_shard_group":
        "reduces over 'a1', 'a2' but the partial sum is over 'a0' (wrong replica groups",
    "gpt2/zero_adamw/shard_map/param_tile_of_next_rank":
        "starting at 16, 32, 48, 0 along dim 0 at dp = 0, 1, 2, 3: tile dp+1, another rank's "
        "tile?",
}

# Where a bug's op is written: the model, or optax for the optimizer step's.
_OPTAX_SUM = "optax/tree_utils/_tree_math.py"
_SOURCE = {"llama3/dp_tp_adamw/shard_map/norm_counts_replicas": _OPTAX_SUM,
           "gpt2/pp_adamw/shard_map/norm_counts_replicas": _OPTAX_SUM,
           # (optax's add_decayed_weights: the first op meeting the wrong tile)
           "gpt2/zero_adamw/shard_map/param_tile_of_next_rank": "optax/transforms/_adding.py"}


def test_every_seeded_bug_has_its_diagnosis_words():
  assert set(_DIAGNOSES) == {c.name for c in CASES if c.bug is not None}


@pytest.mark.parametrize("case", [c for c in CASES if c.bug is not None], ids=lambda c: c.name)
def test_seeded_model_bug_is_reported_at_its_op(case):
  result = _verify(case)
  assert not result.refines
  assert result.failure.op_name == case.bug_primitive, result.failure.diagnosis
  assert result.failure.location.file.endswith(_SOURCE.get(case.name, "tools/zoo/models.py"))
  assert _DIAGNOSES[case.name] in result.failure.diagnosis


def test_a_scale_bug_the_outputs_hide_is_reported():
  """ZeRO's gradient tiles summed over the ranks, not averaged: 4 times too
  large.  Global-norm clipping divides the factor out whenever it clips (and
  Adam's update is unchanged by a common scale), so at these inputs every
  output matches; it is a bug all the same (below the clipping threshold the
  step differs), and the verifier reports it where the norm is taken, naming
  the reduce-scatter the factor comes from."""
  case = strategies._zero_case("gpt2", strategies.Config(), "shard_map", "grads_summed",
                               divide=False, bug="grad_not_divided", bug_primitive="sqrt")
  assert strategies.outputs_match(case) and strategies.outputs_match(case, seed=1)
  result = _verify(case)
  words = result.failure.diagnosis
  assert not result.refines and result.failure.op_name == "sqrt"
  assert "16 times the sequential one" in words
  # ... and traced back to the reduce-scatter that did not divide.
  assert "it is off by a factor since the per-device %reduce_scatter." in words, words
  assert "zoo/zero.py" in words and "4 times the sequential %" in words, words
  assert "(summed over 4 = |dp| ranks without dividing" in words
