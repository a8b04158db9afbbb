"""Mutation check of the test suite (not run in CI): deliberate bugs, and which tests catch them.

Each mutation replaces one exact snippet of library code (it must occur exactly once; the
script stops with the file and snippet otherwise, so re-target the list when code moves).
The repository at ``--ref`` (default ``HEAD``) is exported to a temporary folder; per mutation
the snippet is replaced there and each of the mutation's test targets runs as
``python -m pytest -x -q <target>`` with the copy as working directory and ``PYTHONPATH``, so
the copy is what gets imported. A baseline run of every target on the unmutated copy comes
first (a target that already fails cannot catch anything).

A mutation counts as caught when a target whose reference is independent of the code under
test (HF transformers, a numpy brute force, a jaxpr walk) fails. The result table is written
between the markers of ``docs/testing.md``.

    python tools/mutations.py                 # all mutations, write docs/testing.md
    python tools/mutations.py --only sink_dropped window_off_by_one --no-docs
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "testing.md"
START, END = "<!-- mutations:start -->", "<!-- mutations:end -->"

TYPED_OVER = (
    "tests/test_conformance_transforms.py::test_kernels_run_on_a_mesh_the_batch_is_typed_over"
)
# Test targets and the reference each one checks against ("" = our own code: not independent).
INDEPENDENT = {
    "tests/test_v4_parity.py": "HF transformers",
    "tests/test_v32.py::test_matches_hf": "HF transformers",
    "tests/test_v32.py::test_every_path_matches_hf": "HF transformers",
    "tests/test_v32.py::test_attention_in_head_groups_matches_hf": "HF transformers",
    "tests/test_decode_hf.py": "HF transformers (DynamicCache)",
    "tests/test_decode.py::test_matches_hf_cached_path": "HF transformers (DynamicCache)",
    "tests/test_topk_reference.py": "numpy brute force",
    "tests/test_loss.py::test_layer_loss_matches_hf_probabilities": "HF attention probabilities",
    "tests/test_loss_v32.py::test_loss_matches_hf_probabilities": "HF attention probabilities",
    "tests/test_memory_guard.py": "jaxpr walk (array sizes)",
    "tests/test_deepseek_reference.py": "DeepSeek's inference code (fixtures)",
    "tests/test_numerics.py::test_matches_deepseeks_quantised_inference": (
        "DeepSeek's quantised inference code (fixtures)"
    ),
    "tests/test_numerics.py::test_matches_deepseeks_quantised_inference_on_fp8_checkpoints": (
        "DeepSeek's quantised inference code on FP8 checkpoints (fixtures)"
    ),
    "tests/test_numerics.py::test_v4_scores_round_under_jit": "numpy bf16 arithmetic",
    "tests/test_formats.py": "numpy reference of the formats",
    "tests/test_v41_loss.py": "numpy KL formula (float64)",
    "tests/test_v41_reference.py": "DeepSeek's V4.1 inference code (fixtures)",
    "tests/test_v41_layers.py::test_consumer_within_a_partial_last_candidate_block": (
        "numpy brute force"
    ),
    "tests/test_v41_layers.py::test_capacity_at_its_boundary": "numpy brute force",
    # --- issue 43: the conformance suites and the value tests ---
    "tests/test_conformance_scorer.py": "numpy formula of the scores (float64, bf16 model)",
    "tests/test_conformance_selection.py": "numpy brute force",
    "tests/test_conformance_loss.py": "numpy KL formula (float64)",
    "tests/test_x64.py": (
        "the kernels' jaxpr dtypes, the caches' dtypes, the documented choices, numpy scores"
    ),
    "tests/test_streaming.py::test_selections_and_losses_take_float64_inputs": (
        "numpy brute force and KL formula (float64)"
    ),
    "tests/test_conformance_attention.py": "numpy softmax attention (float64)",
    "tests/test_conformance_numerics.py": "numpy models of DeepSeek's arithmetic",
    "tests/test_v41_layers.py::test_extend_stack_hook_sees_the_caches_so_far": (
        "the documented contract (stand-in layers)"
    ),
    "tests/test_v41_layers.py::test_stale_index_keys_by_value": "the stale-key rule written out",
    "tests/test_v41_layers.py::test_candidate_geometry_by_values": "numpy brute force",
    "tests/test_scorer.py::test_layer_selection_through_execution": (
        "a negating scorer (the picks must change)"
    ),
    "tests/test_mosaic_selection.py::test_row_chunks_are_balanced_and_cover_every_row_once": (
        "each row's own index (exhaustive, every row)"
    ),
    "tests/test_mosaic_attention.py::test_the_automatic_rows_chunk": (
        "the rule's values written out"
    ),
    "tests/test_rope.py": "numpy complex rotation (float64)",
    "tests/test_mosaic_attention.py::test_nonfinite_rows_reach_only_their_readers": (
        "the contract: finite gradients, a poisoned query's cotangent read by none"
    ),
    # --- issue 57: the randomised sweep and the direct tests ---
    "tests/test_mosaic_attention.py::test_randomised_sweep_against_numpy": (
        "numpy softmax attention (float64; jnp autodiff of the formula)"
    ),
    "tests/test_mosaic_selection.py::test_randomised_sweep_against_brute_force": (
        "numpy brute force over numpy scores (bf16 einsum model)"
    ),
    "tests/test_released_formats.py": "numpy FP8 GEMM loop; the releases' scale formats",
    "tests/test_conformance_transforms.py::test_kernels_run_per_device_under_jit_sharding": (
        "the same layer's loss and gradients with no mesh"
    ),
    "tests/test_conformance_transforms.py::test_kernels_run_on_a_one_device_mesh": (
        "the same layer's output and selection with no mesh"
    ),
    TYPED_OVER: "the same layer's output and selection with no mesh",
    "tests/test_v32.py::test_split_attention_inside_a_users_shard_map": (
        "the same layer's loss and gradients in one call with no mesh"
    ),
    "tests/test_mosaic_attention.py::test_resident_rows_are_offered_for_gathered_sets_only": (
        "the rule's choices written out"
    ),
    "tests/test_mosaic_attention.py::test_automatic_choices_fit_vmem_at_released_sizes": (
        "the choices written out, each kernel's VMEM estimate against the limit"
    ),
    "tests/test_benchmarks.py::test_hardware_flops_are_the_kernels_dense_work": (
        "a hand count of the pairs at a tiny shape"
    ),
    "tests/test_mosaic_attention.py::test_tile_skipping_with_local_picks": (
        "numpy softmax attention (float64; jnp autodiff of the formula)"
    ),
}


def reference(target: str) -> str | None:
    """The independent reference of a target (a node id inherits its file's, a parametrised
    one its function's), else None."""
    return (
        INDEPENDENT.get(target)
        or INDEPENDENT.get(target.split("[")[0])
        or INDEPENDENT.get(target.split("::")[0])
    )


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One deliberate bug: ``snippet`` in ``file`` becomes ``replacement``; ``targets`` are
    the pytest targets (files or node ids) expected to catch it."""

    name: str
    description: str
    file: str
    snippet: str
    replacement: str
    targets: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "visible_tiles_unmasked",
        "Mosaic attention: a DenseKeys' picks read as tiles without the visibility mask",
        "csa_eqx/_attention/mosaic_reads.py",
        "        if self.visible:\n            counts = counts * step.visible(s.ints[-1].at[t])\n",
        "",
        ("tests/test_conformance_attention.py::test_outputs_and_lse",),
    ),
    Mutation(
        "unseen_pick_poisons",
        "Mosaic attention: a non-finite entry poisons the queries that picked it unseen",
        "csa_eqx/_attention/mosaic_plan.py",
        "functools.partial(picks_poison, self.tables[t].bad, picked.picks, picked)",
        "functools.partial(picks_poison, self.tables[t].bad, picked.picks)",
        ("tests/test_conformance_attention.py::test_nonfinite_rows_reach_only_their_readers",),
    ),
    Mutation(
        "parts_drop_shared_grad",
        "V3.2 attention split into parts (head groups, query chunks): the parts' gradients of "
        "the shared arrays (the latent keys; query chunks: kv_b_proj too) dropped",
        "csa_eqx/_layers/v32.py",
        "lambda d, p: d + p.astype(jnp.float32), d_shared, d_part",
        "lambda d, p: d + 0 * p.astype(jnp.float32), d_shared, d_part",
        ("tests/test_v32.py::test_attention_in_head_groups_matches_hf",),
    ),
    Mutation(
        "sink_dropped",
        "attention sink left out of the softmax denominator",
        "csa_eqx/_attention/xla.py",
        "        denom = denom + jnp.exp(sink - peak)\n",
        "        denom = denom\n",
        ("tests/test_v4_parity.py::test_matches_hf", "tests/test_decode_hf.py"),
    ),
    Mutation(
        "window_off_by_one",
        "banded sliding window one token too wide",
        "csa_eqx/_attention/xla.py",
        "mask = (token >= -before) & (lag >= 0) & (lag < window)",
        "mask = (token >= -before) & (lag >= 0) & (lag <= window)",
        ("tests/test_v4_parity.py::test_matches_hf",),
    ),
    Mutation(
        "decode_window_short",
        "decode reads one window key fewer (the oldest cached ring row)",
        "csa_eqx/_attention/xla.py",
        "mask = (token >= -before)",
        "mask = (token >= 1 - before)",
        ("tests/test_decode_hf.py",),
    ),
    Mutation(
        "tie_rule_flipped",
        "exact top-k breaks ties toward the higher index",
        "csa_eqx/_topk.py",
        "(jnp.cumsum(tied, -1, dtype=jnp.int32) <= room[..., None])",
        "(jnp.flip(jnp.cumsum(jnp.flip(tied, -1), -1, dtype=jnp.int32), -1) <= room[..., None])",
        ("tests/test_topk_reference.py",),
    ),
    Mutation(
        "rope_derotation_sign",
        "V4 output de-rotated at +t instead of -t",
        "csa_eqx/_layers/block.py",
        "o = self.rope.interleaved(o, -positions[..., None])",
        "o = self.rope.interleaved(o, positions[..., None])",
        ("tests/test_v4_parity.py::test_matches_hf", "tests/test_decode_hf.py"),
    ),
    Mutation(
        "no_segment_restart",
        "compression windows aligned to the row, not to each segment's start",
        "csa_eqx/_layout.py",
        "    pos = segment_positions(segment_ids)\n    # slot j holds",
        "    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))\n    # slot j holds",
        ("tests/test_v4_parity.py::test_packed_documents_match_hf_alone",),
    ),
    Mutation(
        "kl_denominator_entries_only",
        "KL target normalised per head over the candidates only (window and sink left out)",
        "csa_eqx/_loss/kl.py",
        "    log_p = jnp.where(candidates[:, :, None, :], logits - lse[..., None], -jnp.inf)\n",
        "    log_p = jnp.where(candidates[:, :, None, :], logits, -jnp.inf)\n"
        "    norm = jax.nn.logsumexp(log_p, axis=-1, keepdims=True)\n"
        "    log_p = log_p - jnp.where(jnp.isfinite(norm), norm, 0.0)\n",
        ("tests/test_loss.py::test_layer_loss_matches_hf_probabilities",),
    ),
    Mutation(
        "v41_warmup_loss_ignores_candidates",
        "V4.1 consumer's mask (dense selection, dense-stage KL) over every visible entry, not "
        "only its candidates",
        "csa_eqx/_selection/candidates.py",
        "        return visible & candidate_mask("
        "self.candidates, self.block_size, visible.shape[-1])",
        "        return visible",
        ("tests/test_v41_loss.py",),
    ),
    Mutation(
        "v41_tile_filter_widened",
        "V4.1 consumer's key tiles see their visible entries or the candidates (union, not both)",
        "csa_eqx/_selection/candidates.py",
        "        return self.base.tile(start, width) & jnp.take_along_axis(",
        "        return self.base.tile(start, width) | jnp.take_along_axis(",
        ("tests/test_v41_layers.py::test_consumer_within_a_partial_last_candidate_block",),
    ),
    Mutation(
        "v41_filter_never_bites",
        "the automatic choices drop every V4.1 pre-filter (the rule that it bites always false)",
        "csa_eqx/_selection/auto.py",
        "    return -(-entries // visibility.block_size) > visibility.candidates.shape[-1]\n",
        "    return False\n",
        ("tests/test_v41_reference.py", "tests/test_v41_layers.py::test_capacity_at_its_boundary"),
    ),
    Mutation(
        "v41_consumer_ignores_candidates",
        "a V4.1 index source after the candidate source picks from every visible entry",
        "csa_eqx/_indexer/base.py",
        "        seen = self.candidates.visibility(visibility, state)\n",
        "        seen = visibility\n",
        ("tests/test_v41_reference.py",),
    ),
    Mutation(
        "v41_candidates_not_pinned",
        "V4.1 candidate filter without the block of the query's newest visible entry pinned",
        "csa_eqx/_selection/candidates.py",
        "    best = jnp.where(pinned, jnp.inf, best)\n",
        "    best = jnp.where(pinned, best, best)\n",
        ("tests/test_v41_reference.py",),
    ),
    Mutation(
        "selection_never_streams",
        "the automatic choices never stream the indexer top-k or loss (dense [B, S, T] scores)",
        "csa_eqx/_selection/auto.py",
        "    return batch * seq * entries * max(heads, 1) > tiles.elements\n",
        "    return False\n",
        ("tests/test_memory_guard.py::test_fwd_bwd_never_forms_bst",),
    ),
    Mutation(
        "native_v32_yarn_by_key",
        "a native V3.2 config gets YaRN only when it names original_seq_len (the old rule)",
        "csa_eqx/hf/_config.py",
        '    on = _int(args, "max_seq_len", source) > _int(args, "original_seq_len", source)\n',
        '    on = "original_seq_len" in d\n',
        ("tests/test_deepseek_reference.py",),
    ),
    Mutation(
        "v4_indexer_queries_unscaled",
        "V4 indexer queries rotated without YaRN",
        "csa_eqx/_indexer/heads.py",
        "        self.rope = Rope(c.rope_dim, c.compress_rope_theta, c.rope_scaling)",
        "        self.rope = Rope(c.rope_dim, c.compress_rope_theta)",
        (
            "tests/test_v4_parity.py::test_yarn_with_fewer_picks_than_entries_matches_hf",
            "tests/test_deepseek_reference.py",
        ),
    ),
    Mutation(
        "yarn_beta_ignored",
        "YaRN's band computed with the default beta_fast / beta_slow",
        "csa_eqx/_rope.py",
        "low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)",
        "low, high = correction_dim(32.0), correction_dim(1.0)",
        ("tests/test_v4_parity.py::test_yarn_frequencies_match_hf_at_released_sizes",),
    ),
    Mutation(
        "v4_head_weights_rescaled",
        "V4 indexer head weights without the H^-1/2 factor (selections unchanged)",
        "csa_eqx/_indexer/heads.py",
        "numerics.linear(x, self.weights_proj).astype(jnp.float32) * self.heads**-0.5",
        "numerics.linear(x, self.weights_proj).astype(jnp.float32)",
        ("tests/test_v4_parity.py::test_indexer_scores_match_hf",),
    ),
    Mutation(
        "numerics_no_hadamard",
        "DeepSeekInference quantises the indexer without the Hadamard rotation",
        "csa_eqx/_numerics/deepseek.py",
        "        rotated = hadamard(v) if formats.hadamard else v\n",
        "        rotated = v.astype(jnp.float32)\n",
        ("tests/test_numerics.py::test_matches_deepseeks_quantised_inference",),
    ),
    Mutation(
        "numerics_kv_not_rounded",
        "DeepSeekInference leaves V4's KV unrounded (V4-Pro's FP8 round trip dropped)",
        "csa_eqx/_numerics/deepseek.py",
        "        return jnp.concatenate([round_to(nope, kv.dtype), rope], axis=-1)",
        "        return kv",
        ("tests/test_numerics.py::test_matches_deepseeks_quantised_inference",),
    ),
    Mutation(
        "numerics_fp8_weights_dequantised",
        "DeepSeekInference holds an FP8 checkpoint's projections dequantised (bf16 products)",
        "csa_eqx/_numerics/deepseek.py",
        "        return weight  # DeepSeek's linear quantises",
        "        return weight.dequantize(dtype)  # DeepSeek's linear quantises",
        ("tests/test_numerics.py::test_matches_deepseeks_quantised_inference_on_fp8_checkpoints",),
    ),
    Mutation(
        "scores_rounded_by_astype",
        "V4's bf16 score roundings as astype pairs (XLA drops them under jit)",
        "csa_eqx/_scorer/base.py",
        "    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)",
        "    return x.astype(dtype).astype(x.dtype)",
        ("tests/test_numerics.py::test_v4_scores_round_under_jit",),
    ),
    Mutation(
        "pow2_scale_floored",
        "power-of-two scales floor the exponent (scale below amax / max: values saturate)",
        "csa_eqx/_numerics/formats.py",
        "    up = ((bits & 0x7FFFFF) != 0).astype(jnp.int32)",
        "    up = jnp.zeros_like(exponent)",
        ("tests/test_formats.py",),
    ),
    # --- issue 43: the audit's list, and the bugs test docstrings name --------------------------
    Mutation(
        "triton_scorer_grad_ignores_score_dtype",
        "the Triton scorer's backward differentiates the float32 scores, not the bf16 ones asked",
        "csa_eqx/_scorer/triton.py",
        "    kw = dict(head_chunk=head_chunk, score_dtype=score_dtype)\n    _, vjp = jax.vjp(",
        "    kw = dict(head_chunk=head_chunk, score_dtype=None)\n    _, vjp = jax.vjp(",
        ("tests/test_conformance_scorer.py::test_bf16_gradients",),
    ),
    Mutation(
        "triton_head_weights_unrounded",
        "the Triton kernels' bf16 scores skip the rounding of the head weights DeepSeek does",
        "csa_eqx/_triton.py",
        "term = rounded * w.astype(score_dtype).astype(jnp.float32)",
        "term = rounded * w",
        (
            "tests/test_conformance_scorer.py::test_bf16_scores",
            "tests/test_conformance_selection.py::test_bf16_scores_pick_as_bf16_rounds",
        ),
    ),
    Mutation(
        "xla_head_weights_unrounded",
        "the reference scorer's bf16 scores skip the rounding of the head weights",
        "csa_eqx/_scorer/base.py",
        "_rounded(w.astype(acc), score_dtype)[:, :, :, None]",
        "w.astype(acc)[:, :, :, None]",
        ("tests/test_conformance_scorer.py::test_bf16_scores",),
    ),
    Mutation(
        "fp8_scales_in_turn",
        "the FP8 GEMM applies the activation's and the weight's scales one after the other",
        "csa_eqx/_numerics/fp8_linear.py",
        "return acc + part * (a_scale[:, None] * w_scale[None, :]), None",
        "return acc + (part * a_scale[:, None]) * w_scale[None, :], None",
        (
            "tests/test_conformance_numerics.py::test_fp8_gemm_applies_the_product_of_its_two_scales",
        ),
    ),
    Mutation(
        "fp8_linear_ignores_scale_fmt",
        "DeepSeekInference's FP8 projections quantise activations with power-of-two scales always",
        "csa_eqx/_numerics/deepseek.py",
        "return fp8_linear(x, weight, self._pow2)",
        "return fp8_linear(x, weight, True)",
        ("tests/test_conformance_numerics.py::test_projections",),
    ),
    Mutation(
        "kv_ignores_scale_fmt",
        "DeepSeekInference's KV round trip uses power-of-two scales always",
        "csa_eqx/_numerics/deepseek.py",
        "nope = fp8_e4m3_round_trip(nope, formats.kv_block, self._pow2, cast_to=through)",
        "nope = fp8_e4m3_round_trip(nope, formats.kv_block, True, cast_to=through)",
        ("tests/test_conformance_numerics.py::test_kv_round_trip",),
    ),
    Mutation(
        "block_quotient_by_reciprocal",
        "block quotients x / scale (amax and E4M3 scales) by a multiplication by 1 / scale",
        "csa_eqx/_numerics/formats.py",
        "else exact_divide(xb, scale)",
        "else xb * (1.0 / scale)",
        ("tests/test_formats.py::test_quotients_beside_midpoints_are_the_exact_ones",),
    ),
    Mutation(
        "e4m3_scale_by_reciprocal",
        "V4.1's E4M3 block scale amax / 6 by a multiplication by fl(1 / 6)",
        "csa_eqx/_numerics/formats.py",
        "scaled = jnp.minimum(exact_divide(amax, fmt_max), FP8_E4M3_MAX)",
        "scaled = jnp.minimum(amax * np.float32(1.0 / fmt_max), FP8_E4M3_MAX)",
        ("tests/test_formats.py::test_e4m3_scales_beside_their_midpoints_are_exact_quotients",),
    ),
    Mutation(
        "v41_filter_bites_floor",
        "the automatic choices count a partial last candidate block out (floor(T / bc) blocks)",
        "csa_eqx/_selection/auto.py",
        "    return -(-entries // visibility.block_size) > visibility.candidates.shape[-1]\n",
        "    return entries // visibility.block_size > visibility.candidates.shape[-1]\n",
        (
            "tests/test_conformance_selection.py::test_auto_selection_chooses_by_size_and_filter",
            "tests/test_conformance_loss.py::test_auto_loss_chooses_by_size_and_filter",
        ),
    ),
    Mutation(
        "extend_stack_hook_sees_old_caches",
        "extend_stack's hook gets the caches as they were before the chunk",
        "csa_eqx/_stack.py",
        "before(i, x, new, shared)",
        "before(i, x, caches, shared)",
        ("tests/test_v41_layers.py::test_extend_stack_hook_sees_the_caches_so_far",),
    ),
    Mutation(
        "stale_keys_padded_in_front",
        "the stale-key emulation pads a shorter cache's keys at the front",
        "csa_eqx/_stack.py",
        "keys = jnp.pad(keys, [(0, 0), (0, max(slots - keys.shape[1], 0)), (0, 0)])",
        "keys = jnp.pad(keys, [(0, 0), (max(slots - keys.shape[1], 0), 0), (0, 0)])",
        ("tests/test_v41_layers.py::test_stale_index_keys_by_value",),
    ),
    Mutation(
        "candidate_tile_offset_dropped",
        "a V4.1 consumer's key tile maps its slots to blocks as if it started at a block",
        "csa_eqx/_selection/candidates.py",
        "block = (start - first * bc + jnp.arange(width, dtype=jnp.int32)) // bc",
        "block = jnp.arange(width, dtype=jnp.int32) // bc",
        ("tests/test_v41_layers.py::test_candidate_geometry_by_values",),
    ),
    Mutation(
        "problem_queries_drop_score_dtype",
        "a problem rebuilt over its projected queries forgets its score dtype (sharded paths)",
        "csa_eqx/_selection/base.py",
        "return self._replace(project=_identity, rows=(q, weights))",
        "return self._replace(project=_identity, rows=(q, weights), score_dtype=None)",
        ("tests/test_conformance_selection.py::test_bf16_scores_pick_as_bf16_rounds",),
    ),
    Mutation(
        "execution_scorer_ignored",
        "the layers' selection problems score with the reference scorer, not Execution.scorer",
        "csa_eqx/_indexer/base.py",
        "SelectionProblem(project, rows, keys, visibility, chunk, score_dtype, scorer, tiles)",
        "SelectionProblem(project, rows, keys, visibility, chunk, score_dtype, tiles=tiles)",
        ("tests/test_scorer.py::test_layer_selection_through_execution",),
    ),
    Mutation(
        "streaming_scores_past_the_scorer",
        "the streaming selection scores its tiles with the reference scorer, not the problem's",
        "csa_eqx/_selection/streaming.py",
        "scores = problem.scores(qx, wx, take(keys, j * kb, kb))",
        'scores = problem._replace(scorer=problem._field_defaults["scorer"]).scores('
        "qx, wx, take(keys, j * kb, kb))",
        ("tests/test_conformance_selection.py::test_scores_through_the_problems_scorer",),
    ),
    Mutation(
        "fused_selection_differentiated",
        "the fused indexers' inputs are not stop_gradient-ed (the kernels get differentiated)",
        "csa_eqx/_selection/row_chunks.py",
        "    rows, consts, keys = jax.lax.stop_gradient((rows, consts, keys))\n"
        "    keys, layout = padded_keys(keys, visibility.layout, key_block)",
        "    keys, layout = padded_keys(keys, visibility.layout, key_block)",
        ("tests/test_conformance_selection.py::test_picks_carry_no_gradient",),
    ),
    Mutation(
        "shared_rows_reselected",
        "the pulled-back last row chunk selects again the rows the chunk before it selected",
        "csa_eqx/_selection/row_chunks.py",
        "index = jnp.where(new, seen.query_index, -1)",
        "index = seen.query_index",
        ("tests/test_mosaic_selection.py::test_row_chunks_are_balanced_and_cover_every_row_once",),
    ),
    Mutation(
        "shared_rows_lost",
        "the pulled-back last row chunk runs last, so its skipped rows overwrite the picks",
        "csa_eqx/_selection/row_chunks.py",
        "c = jax.lax.rem(i + n - 1, n)",
        "c = i",
        ("tests/test_mosaic_selection.py::test_row_chunks_are_balanced_and_cover_every_row_once",),
    ),
    Mutation(
        "xla_logits_unrounded",
        "the reference scorer's bf16 scores skip the rounding of each head's logit",
        "csa_eqx/_scorer/base.py",
        "rounded = jax.nn.relu(_rounded(logits, score_dtype))",
        "rounded = jax.nn.relu(logits)",
        ("tests/test_conformance_scorer.py::test_bf16_scores",),
    ),
    Mutation(
        "loss_rounds_scores",
        "the dense indexer loss rounds its scores to the problem's score dtype",
        "csa_eqx/_loss/dense.py",
        "scores = problem.scorer.scores(*problem.project(*rows), keys, head_chunk=head_chunk)",
        "scores = problem.scorer.scores(\n"
        "            *problem.project(*rows), keys, head_chunk=head_chunk, "
        "score_dtype=problem.score_dtype\n        )",
        ("tests/test_conformance_loss.py::test_head_chunks_and_bf16_problems_keep_float32_scores",),
    ),
    Mutation(
        "deepseek_probabilities_unrounded",
        "DeepSeekInference's attention keeps float32 probabilities (no bf16 rounding)",
        "csa_eqx/_numerics/deepseek.py",
        "        return round_to(p, jnp.bfloat16), denominator",
        "        return p, denominator",
        ("tests/test_conformance_attention.py::test_deepseek_rounded_softmax",),
    ),
    Mutation(
        "nonfinite_rows_not_flagged",
        "the reference attention zeroes non-finite key rows without poisoning their readers",
        "csa_eqx/_attention/xla.py",
        "        poisoned |= jnp.any(mask & (bad if per_query else bad[:, None, :]), axis=-1)\n",
        "",
        ("tests/test_conformance_attention.py::test_nonfinite_rows_reach_only_their_readers",),
    ),
    Mutation(
        "deepseek_linear_weight_unrounded",
        "DeepSeekInference's bf16 projections multiply by the float32 weight (no bf16 rounding)",
        "csa_eqx/_numerics/deepseek.py",
        'y = jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype), preferred_element_type=acc)',
        'y = jnp.einsum("...i,oi->...o", x, weight, preferred_element_type=acc)',
        ("tests/test_conformance_numerics.py::test_projections",),
    ),
    Mutation(
        "compressor_ratio_boundary",
        "DeepSeekInference keeps V4.1's ratio-2 compressor in bf16 too (<= for <)",
        "csa_eqx/_numerics/deepseek.py",
        "and ratio < formats.compressor_float32_ratio:",
        "and ratio <= formats.compressor_float32_ratio:",
        ("tests/test_conformance_numerics.py::test_what_the_layers_ask",),
    ),
    Mutation(
        "mosaic_head_weights_unrounded",
        "the Mosaic fused indexer's bf16 scores skip the rounding of the head weights",
        "csa_eqx/_selection/mosaic_topk.py",
        "    w = _round_mantissa(weights.astype(jnp.float32) * dim**-0.5, bits)\n",
        "    w = weights.astype(jnp.float32) * dim**-0.5\n",
        ("tests/test_conformance_selection.py::test_bf16_scores_pick_as_bf16_rounds",),
    ),
    Mutation(
        "mosaic_band_rows_not_flagged",
        "the Mosaic attention zeroes a non-finite window row without poisoning its readers",
        "csa_eqx/_attention/mosaic_plan.py",
        "        self.poisons(len(self.tables) - 1, window_bad)\n",
        "",
        ("tests/test_conformance_attention.py::test_nonfinite_rows_reach_only_their_readers",),
    ),
    Mutation(
        "round_to_by_astype",
        "round_to as a plain cast (XLA drops a rounding upcast into a reduction under jit)",
        "csa_eqx/_ops.py",
        "        x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, "
        "mantissa_bits=info.nmant)\n",
        "",
        ("tests/test_formats.py::test_round_to_rounds_under_jit",),
    ),
    Mutation(
        "rows_mask_ignored",
        "Mosaic attention, rows: a chunk's -1 indices read (row 0) instead of masked",
        "csa_eqx/_attention/mosaic_reads.py",
        "return jnp.where(s.ints[-1][pl.ds(n, 1), :] >= 0, 1.0, 0.0)",
        "return jnp.where(s.ints[-1][pl.ds(n, 1), :] >= -1, 1.0, 0.0)",
        # (its numpy-checked band+picks/rows case went into the sweep, issue 57)
        (
            "tests/test_mosaic_attention.py::test_randomised_sweep_against_numpy"
            "[band+picks/bf16-wide-own-values/rows]",
        ),
    ),
    Mutation(
        "rows_chunk_not_whole_128s",
        "the automatic rows chunk split evenly but not rounded up to whole 128s",
        "csa_eqx/_attention/mosaic_plan.py",
        "return round_up(-(-width // n), LANES)",
        "return -(-width // n)",
        ("tests/test_mosaic_attention.py::test_the_automatic_rows_chunk",),
    ),
    Mutation(
        "rope_tail_added",
        "partial RoPE: the rotated channels added to the input's instead of replacing them",
        "csa_eqx/_rope.py",
        "return jnp.concatenate([x[..., : d - r], tail], axis=-1)",
        "return jnp.concatenate([x[..., : d - r], tail + x[..., d - r :]], axis=-1)",
        ("tests/test_rope.py", "tests/test_v4_parity.py::test_matches_hf"),
    ),
    Mutation(
        "poisoned_output_kept",
        "Mosaic attention: a poisoned query's output written as computed, not NaN",
        "csa_eqx/_attention/mosaic_forward.py",
        "out = jnp.where(live, acc / norm[:, 0:1], jnp.nan)",
        "out = acc / norm[:, 0:1]",
        ("tests/test_conformance_attention.py::test_nonfinite_rows_reach_only_their_readers",),
    ),
    Mutation(
        "poisoned_query_read",
        "Mosaic attention: a poisoned (maybe non-finite) query passed to the kernels as it is",
        "csa_eqx/_attention/mosaic.py",
        "return _query_words(jnp.where(finite, q, 0), static, static.config.key_blocks)",
        "return _query_words(q, static, static.config.key_blocks)",
        ("tests/test_mosaic_attention.py::test_nonfinite_rows_reach_only_their_readers",),
    ),
    Mutation(
        "poisoned_cotangent_read",
        "Mosaic attention: a poisoned query's output cotangent reaches the backward kernel",
        "csa_eqx/_attention/mosaic.py",
        "    g_out = jnp.where(ints.live[:, :, None, None], g_out, 0)\n",
        "",
        ("tests/test_mosaic_attention.py::test_nonfinite_rows_reach_only_their_readers",),
    ),
]


# --- issue 57: what the hand-picked inputs never reached (each caught by the sweep's values) --
_SWEEP = "tests/test_mosaic_attention.py::test_randomised_sweep_against_numpy"
_TILES_HBM = f"{_SWEEP}[band+picks/tiles/hbm/two-head-blocks]"
MUTATIONS += [
    Mutation(
        "tile_count_off_by_one",
        "Mosaic attention: a block's tile count rounds its largest pick up, not past it (a "
        "pick on a tile boundary, row 0 alone, is never read)",
        "csa_eqx/_attention/mosaic_layout.py",
        "counts = (jnp.max(idx.reshape(b, nq, qb * width), axis=-1) + tile) // tile",
        "counts = (jnp.max(idx.reshape(b, nq, qb * width), axis=-1) + tile - 1) // tile",
        (_TILES_HBM,),
    ),
    Mutation(
        "dense_tile_count_open_end",
        "Mosaic attention: dense entries' tile count leaves out an entry closing exactly at "
        "the block's last query",
        "csa_eqx/_attention/mosaic_plan.py",
        "closed = (end[:, None, :] >= 0) & (end[:, None, :] <= top[:, :, None])",
        "closed = (end[:, None, :] >= 0) & (end[:, None, :] < top[:, :, None])",
        (f"{_SWEEP}[band+picks+dense/tiles/resident]",),
    ),
    Mutation(
        "repeated_picks_once_in_backward",
        "Mosaic attention: the backward weighs a row picked twice once (the forward twice)",
        "csa_eqx/_attention/mosaic_backward.py",
        "p = jnp.where(w > 0, w * jnp.exp(s - lse), 0.0)",
        "p = jnp.where(w > 0, jnp.exp(s - lse), 0.0)",
        (_TILES_HBM,),
    ),
    Mutation(
        "hbm_band_slab_zeroed_per_head_block",
        "Mosaic attention, gradients in HBM: the band's slab zeroed by every head block, not "
        "summed over them (only the last head block's gradient kept)",
        "csa_eqx/_attention/mosaic_backward.py",
        "                @pl.when(j == 0)\n                def _(out=into):\n",
        "                @pl.when(j >= 0)\n                def _(out=into):\n",
        (_TILES_HBM,),
    ),
    Mutation(
        "packed_feature_block_offset",
        "Mosaic attention, bf16: feature block f of a packed row read from word-row f, not "
        "f // 2 (keys and values wider than 128)",
        "csa_eqx/_attention/mosaic_reads.py",
        "start = offset + first + (f // 2 if table.packed else f)",
        "start = offset + first + f",
        (f"{_SWEEP}[band+picks/bf16-wide-own-values/rows]",),
    ),
    Mutation(
        "indexer_weight_rounded_before_scale",
        "Mosaic indexer, bf16 scores: the head weight rounded before d^-1/2 multiplies it, "
        "not after (the same where d^-1/2 is a power of two)",
        "csa_eqx/_selection/mosaic_topk.py",
        "w = _round_mantissa(weights.astype(jnp.float32) * dim**-0.5, bits)",
        "w = _round_mantissa(weights.astype(jnp.float32), bits) * dim**-0.5",
        ("tests/test_mosaic_selection.py::test_randomised_sweep_against_brute_force",),
    ),
    Mutation(
        "fp8_tile_rows_as_columns",
        "FP8 GEMM: the weight scales repeated over the tile's columns, not its rows (the same "
        "for square tiles)",
        "csa_eqx/_numerics/fp8_linear.py",
        "jnp.repeat(weight.scale.astype(jnp.float32), rows, axis=0)[:out].T",
        "jnp.repeat(weight.scale.astype(jnp.float32), cols, axis=0)[:out].T",
        ("tests/test_released_formats.py::test_fp8_product_with_non_square_tiles",),
    ),
    Mutation(
        "v41_scale_fmt_ignored",
        "V4.1 loaders: the release's ue8m0 whatever quantization_config.scale_fmt says (the "
        "behaviour before issue 57)",
        "csa_eqx/hf/_v41.py",
        'return quant.get("scale_fmt")',
        'return "ue8m0"',
        (
            "tests/test_released_formats.py::test_v41_scale_format_of_each_layout",
            "tests/test_v41_reference.py::test_flash_config_scale_format_read_from_each_spelling",
        ),
    ),
    Mutation(
        "nonfinite_values_unflagged",
        "every attention kernel: a non-finite value row not flagged (only the keys checked), "
        "so it is neither zeroed for the other queries nor poisons its readers",
        "csa_eqx/_attention/reads.py",
        "return bad if values is None else bad | ~jnp.all(jnp.isfinite(values), axis=-1)",
        "return bad",
        ("tests/test_conformance_attention.py::test_nonfinite_values_reach_only_their_readers",),
    ),
    Mutation(
        "batch_axes_read_as_one",
        "the kernels under jit sharding: a spec entry naming several axes (a batch over "
        '("data", "fsdp")) read as one axis name before the per-device shard_map',
        "csa_eqx/_mesh.py",
        "names = entry if isinstance(entry, tuple) else (entry,)",
        "names = (entry,)",
        ("tests/test_conformance_transforms.py::test_kernels_run_per_device_under_jit_sharding",),
    ),
    Mutation(
        "size_one_axis_left_typed",
        "the kernels under jit sharding: an Explicit mesh axis of size 1 that shards the batch "
        "skipped, so the kernels run with their inputs still typed sharded",
        "csa_eqx/_mesh.py",
        "if t == AxisType.Explicit or (t != AxisType.Manual and mesh.shape[a] > 1)",
        "if t != AxisType.Manual and mesh.shape[a] > 1",
        ("tests/test_conformance_transforms.py::test_kernels_run_on_a_one_device_mesh",),
    ),
    Mutation(
        "resident_rows_for_masked_picks",
        "the attention's cost model offers rows copied from a resident table for a DenseKeys' "
        "masked picks too",
        "csa_eqx/_attention/mosaic_plan.py",
        "if resident_rows and picked is None and kernel.resident is not False:",
        "if resident_rows and kernel.resident is not False:",
        ("tests/test_mosaic_attention.py::test_resident_rows_are_offered_for_gathered_sets_only",),
    ),
    Mutation(
        "resident_rows_kept_past_vmem",
        "rows copied from resident tables kept where they do not fit VMEM (the leanest "
        "configuration taken instead of planning again)",
        "csa_eqx/_attention/mosaic_plan.py",
        "    if sizes.resident:\n        return None\n",
        "",
        ("tests/test_mosaic_attention.py::test_automatic_choices_fit_vmem_at_released_sizes",),
    ),
    Mutation(
        "resident_rows_vmem_gradients_only",
        "rows copied from resident tables only with their gradients in VMEM (V3.2 planned again "
        "as tiles instead of its forward's rows with the backward's tiles)",
        "csa_eqx/_attention/mosaic_plan.py",
        "[kernel.gradients]\n    slabs = ",
        "[kernel.gradients]\n    grads = [False] if sizes.resident else grads\n    slabs = ",
        ("tests/test_mosaic_attention.py::test_automatic_choices_fit_vmem_at_released_sizes",),
    ),
    Mutation(
        "hardware_backward_as_forward",
        "the hardware FLOPs count the backward over the forward's configuration (a rows "
        "forward's tiles backward counted as rows)",
        "benchmarks/flops.py",
        "    config, backward = configs\n",
        "    config, backward = configs[0], configs[0]\n",
        ("tests/test_benchmarks.py::test_hardware_flops_are_the_kernels_dense_work",),
    ),
    Mutation(
        "kernels_traced_in_x64",
        "a kernel's body traced in 64-bit mode when jax_enable_x64 is on (its loop carries "
        "and lax.rem turn 64-bit)",
        "csa_eqx/_dispatch.py",
        "        with jax.enable_x64(False):\n            return build(mode, varying)(*args)",
        "        if True:\n            return build(mode, varying)(*args)",
        ("tests/test_x64.py",),
    ),
    Mutation(
        "gathered_count_64_bit",
        "the gathered indexer loss counts its queries in the default integer (64-bit under "
        "jax_enable_x64)",
        "csa_eqx/_loss/kl.py",
        "carry[1] + jnp.sum(has, dtype=jnp.int32),",
        "carry[1] + jnp.sum(has),",
        ("tests/test_streaming.py::test_selections_and_losses_take_float64_inputs",),
    ),
    Mutation(
        "decode_entry_count_64_bit",
        "a decode chunk counts its closing windows in the default integer (the cache's entry "
        "count 64-bit under jax_enable_x64)",
        "csa_eqx/_decode/chunks.py",
        "jnp.sum(closes, 1, dtype=jnp.int32)",
        "jnp.sum(closes, 1)",
        ("tests/test_x64.py",),
    ),
    Mutation(
        "float64_attention_takes_kernels",
        "the automatic attention takes the Mosaic kernel on a TPU for float64 queries",
        "csa_eqx/_attention/auto.py",
        "        if dtype is not None and not kernel_dtypes(dtype):",
        "        if False:",
        ("tests/test_x64.py",),
    ),
    # --- issue 54: V3.2's rows backward at 16k under the raised VMEM limit ---
    Mutation(
        "raised_vmem_limit_not_tried",
        "rows copied from a resident table never try their VMEM gradients under the raised limit",
        "csa_eqx/_attention/mosaic_plan.py",
        "    if sizes.resident and kernel.vmem_limit_bytes is None and False in grads:",
        "    if False:",
        ("tests/test_mosaic_attention.py::test_automatic_choices_fit_vmem_at_released_sizes",),
    ),
    # --- issue 54, item 4: tile skipping ---
    Mutation(
        "picked_tile_bit_off_by_one",
        "Mosaic attention, tile skipping: a pick marks the next tile's bit (a block visits a "
        "tile it did not pick and skips one it did)",
        "csa_eqx/_attention/mosaic_layout.py",
        "bit = jnp.left_shift(np.int32(1), jnp.bitwise_and(t, 31))",
        "bit = jnp.left_shift(np.int32(1), jnp.bitwise_and(t + 1, 31))",
        ("tests/test_mosaic_attention.py::test_tile_skipping_with_local_picks",),
    ),
    Mutation(
        "visit_list_ignored",
        "Mosaic attention, tile skipping: a step visits tiles 0 .. count - 1, not its visit list's",
        "csa_eqx/_attention/mosaic_reads.py",
        "return s.ints[1][0, n] if self.skip else n",
        "return n",
        ("tests/test_mosaic_attention.py::test_tile_skipping_with_local_picks",),
    ),
    Mutation(
        "resident_rows_batch_row_ignored",
        "Mosaic attention, rows from a resident table: every batch row's steps read the first "
        "row's word-rows",
        "csa_eqx/_attention/mosaic_steps.py",
        "lambda b, i, j, *_: (0, b * n_q + i)",
        "lambda b, i, j, *_: (0, i)",
        ("tests/test_mosaic_attention.py::test_randomised_sweep_against_numpy",),
    ),
    Mutation(
        "explicit_axes_not_manual",
        "the kernels under jit sharding: the per-device shard_map manual over the batch's axes "
        "only, so a batch replicated over an Explicit axis of size 1 reaches the kernels typed "
        "over it",
        "csa_eqx/_mesh.py",
        "manual = set(chosen) | {a for a in axes if is_explicit(mesh, a) and mesh.shape[a] == 1}",
        "manual = set(chosen)",
        (TYPED_OVER,),
    ),
    Mutation(
        "parts_carry_invariant",
        "V3.2 attention split into parts inside a user's check_vma shard_map: the backward's "
        "float32 carry of the shared gradients built invariant",
        "csa_eqx/_layers/v32.py",
        "d_shared = varying_like(zeros, split, shared, grads)",
        "d_shared = zeros",
        ("tests/test_v32.py::test_split_attention_inside_a_users_shard_map",),
    ),
    Mutation(
        "kernel_outputs_left_meshless",
        "the kernels under Explicit mesh axes with a replicated batch: the kernel's outputs, "
        "called as it is, left without the mesh the arrays they meet carry",
        "csa_eqx/_mesh.py",
        "            out = jax.tree.map(lambda o: jax.reshard(o, P()), out)",
        "            out = out",
        (TYPED_OVER,),
    ),
    Mutation(
        "inputs_mesh_not_entered",
        "a layer jitted without jax.set_mesh on arrays typed over a jax.make_mesh mesh: the "
        "inputs' mesh not entered, so buffers built from constants lack it",
        "csa_eqx/_layers/base.py",
        "            with typed_mesh(inputs, self):",
        "            with typed_mesh():",
        (TYPED_OVER,),
    ),
]


def export(ref: str, dest: Path) -> None:
    """The tracked files of ``ref`` (a git revision) into ``dest``."""
    archive = dest.parent / "export.tar"
    subprocess.run(["git", "archive", "-o", str(archive), ref], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()


def apply(copy: Path, m: Mutation) -> str:
    """Replace the snippet in the copy; returns the original text (to restore)."""
    path = copy / m.file
    text = path.read_text()
    count = text.count(m.snippet)
    if count != 1:
        raise SystemExit(
            f"mutation {m.name!r}: snippet found {count} times in {m.file} (expected once); "
            f"re-target it:\n{m.snippet}"
        )
    path.write_text(text.replace(m.snippet, m.replacement))
    return text


def run_target(copy: Path, target: str, timeout: int) -> tuple[str, float]:
    """``"passed"``, ``"failed: <first failing test>"``, or ``"error: ..."``; and seconds."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(copy)}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider", target]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error: timed out after {timeout} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    if r.returncode == 0:
        return "passed", seconds
    failed = re.findall(r"^FAILED (\S+)", r.stdout, flags=re.M)
    if failed:
        return f"failed: {failed[0].split('::', 1)[-1]}", seconds
    return f"error: exit {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]}", seconds


def machine() -> str:
    import jax

    return (
        f"{platform.node()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, JAX {jax.__version__}"
    )


def markdown(rows: list[dict], command: str, ref: str, commit: str) -> str:
    lines = [
        f"Command: `{command}` on `{ref}` ({commit}), "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: {machine()}.",
        "",
        "| Mutation | Where | Target | Reference | Result | Caught |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        for i, (target, result) in enumerate(row["results"]):
            first = i == 0
            lines.append(
                "| "
                + " | ".join(
                    [
                        f"`{row['name']}`: {row['description']}" if first else "",
                        f"`{row['file']}`" if first else "",
                        f"`{target}`",
                        reference(target) or "own code",
                        result.replace("|", "\\|"),
                        ("**yes**" if row["caught"] else "**NO**") if first else "",
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


def write_docs(table: str) -> None:
    text = DOCS.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOCS} lacks the markers {START} / {END}")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOCS.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ref", default="HEAD", help="git revision to mutate (default HEAD)")
    p.add_argument("--only", nargs="*", help="names of the mutations to run (default: all)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    p.add_argument("--no-docs", action="store_true", help=f"do not write {DOCS.name}")
    args = p.parse_args()
    names = {m.name for m in MUTATIONS}
    unknown = set(args.only or ()) - names
    if unknown:
        raise SystemExit(f"--only: unknown mutations {sorted(unknown)} (known: {sorted(names)})")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    for m in chosen:
        unknown = [t for t in m.targets if reference(t) is None]
        if unknown:
            raise SystemExit(f"mutation {m.name!r}: targets {unknown} are not in INDEPENDENT")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", args.ref], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()

    with tempfile.TemporaryDirectory(prefix="csa_eqx_mutations_") as tmp:
        copy = Path(tmp) / "repo"
        export(args.ref, copy)
        for m in chosen:  # every snippet must be found before anything runs
            (copy / m.file).write_text(apply(copy, m))
        if not args.no_baseline:
            for target in sorted({t for m in chosen for t in m.targets}):
                result, seconds = run_target(copy, target, args.timeout)
                print(f"baseline {target}: {result} ({seconds:.0f} s)", flush=True)
                if result != "passed":
                    raise SystemExit(f"baseline run of {target} does not pass: {result}")
        rows = []
        for m in chosen:
            original = apply(copy, m)
            results = []
            for target in m.targets:
                result, seconds = run_target(copy, target, args.timeout)
                print(f"{m.name} {target}: {result} ({seconds:.0f} s)", flush=True)
                results.append((target, result))
            (copy / m.file).write_text(original)
            caught = any(r.startswith("failed") for _, r in results)
            rows.append(dict(dataclasses.asdict(m), results=results, caught=caught))
        shutil.rmtree(copy)

    command = "python tools/mutations.py" + "".join(f" {a}" for a in sys.argv[1:])
    table = markdown(rows, command, args.ref, commit)
    print(table)
    if not args.no_docs:
        write_docs(table)
    missed = [r["name"] for r in rows if not r["caught"]]
    if missed:
        raise SystemExit(f"not caught by an independent test: {missed}")


if __name__ == "__main__":
    main()
