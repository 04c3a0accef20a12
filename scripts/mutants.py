"""Mutation check: apply curated one-line bugs to the library and report which tests catch each.

    .venv/bin/python scripts/mutants.py                  # every mutant, report to docs/mutants.md
    .venv/bin/python scripts/mutants.py --only local_count,z_loss_grad

    .venv/bin/python scripts/mutants.py --check          # only that every mutant still applies
    .venv/bin/python scripts/mutants.py --list           # the mutants: name, where, the bug
    .venv/bin/python scripts/mutants.py --only z_loss_grad --tests "parity_tests/test_contract_kinds.py -m 'not slow'"

Each mutant names where it lives, ``path::function`` (a dotted qualname for a method, ``<module>``
for module-level code), and one line of that function's body (compared without its leading
spaces, so re-indenting or moving the function within its file keeps the mutant). The line must
occur exactly once in that function: a mutant that no longer applies (the function moved to
another file, was renamed, or the line changed) fails ``--check`` and the run, loudly, with what
was looked for; the test suite runs ``--check`` (parity_tests/test_mutants_apply.py). A run
applies each mutant, runs the tests named for it (pytest ``-x``, the first failure is enough), and
restores the file. A mutant is *caught* when the tests fail. ``--tests`` runs other tests against
the chosen mutants instead (e.g. whether a new suite catches them); such a run writes no report
unless ``--report`` names one. The full run is not part of CI (it runs the suites once per
mutant); its last report is committed as ``docs/mutants.md``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    where: str  # "path::function" (qualname; "<module>" for module-level code)
    old: str  # one line of that function, as written (its leading spaces are not compared)
    new: str  # its replacement (indented like the line it replaces)
    tests: tuple[str, ...]  # pytest arguments (files, -k expressions)

    @property
    def path(self) -> str:
        return self.where.split("::", 1)[0]

    @property
    def function(self) -> str:
        return self.where.split("::", 1)[1] if "::" in self.where else "<module>"


TORCH_ORACLE = ("parity_tests/test_torchloss_oracle.py", "-m", "not slow")
JAX_ORACLE = ("parity_tests/test_jaxloss_oracle.py", "-m", "not slow")

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "z_loss_grad",
        "the z-loss term dropped from the cross-entropy gradient (shared algebra)",
        "lossspec/stats.py::finalize_gradient",
        "        return fin._replace(q_coef=1.0 + (2.0 * config.z_loss) * full_lse)",
        "        return fin._replace(q_coef=1.0 + 0.0 * full_lse)",
        TORCH_ORACLE,
    ),
    Mutant(
        "rescale_e_d_sign",
        "reverse KL's pivot moved with the wrong sign when blocks or shards combine",
        "lossspec/stats.py::rescale_e_d",
        "    shift = config.student_scale * dm - config.teacher_scale * (st.tau - tau_new)",
        "    shift = config.student_scale * dm + config.teacher_scale * (st.tau - tau_new)",
        ("parity_tests/test_torchloss_oracle.py", "-k", "vocab_blocks", "parity_tests/test_jaxloss_kernels.py"),
    ),
    Mutant(
        "local_count_torch",
        "torchloss.accumulate divides by the local count (no all_reduce over the replicas)",
        "torchloss/distributed.py::_accumulate",
        "            dist.all_reduce(denominator, op=dist.ReduceOp.SUM, group=group)",
        "            pass",
        ("parity_tests/test_distributed_torch.py",),
    ),
    Mutant(
        "local_count_jax",
        "jaxloss.global_denominator does not psum over the data axes",
        "jaxloss/distributed.py::global_denominator",
        "    return jax.lax.psum(count, axes) if axes else count",
        "    return count",
        ("parity_tests/test_distributed_jax.py",),
    ),
    Mutant(
        "ignored_denominator_torch",
        "torchloss ignores a Python-number denominator= (counts its own tokens)",
        "torchloss/_prepare.py::_denominator",
        "        return float(denominator)",
        "        return weight.sum()",
        ("parity_tests/test_torchloss_oracle.py", "parity_tests/test_torchloss_autograd.py", "-m", "not slow"),
    ),
    Mutant(
        "skipped_16bit_recompute_torch",
        "torchloss scales the rounded 16-bit gradient instead of recomputing it (two roundings)",
        "torchloss/_autodiff.py::MaskedLossFunction.forward",
        "        ctx.recompute = need_grad and not inplace and logits.dtype in (torch.bfloat16, torch.float16)",
        "        ctx.recompute = False",
        ("parity_tests/test_torchloss_oracle.py", "parity_tests/test_torchloss_autograd.py", "-m", "not slow"),
    ),
    Mutant(
        "truncated_bf16_store_torch",
        "the torch path truncates the fp32 gradient to bf16 instead of rounding to nearest",
        "torchloss/_block.py::block_grad",
        "        out.copy_(g)  # the one rounding to the logits' dtype",
        "        out.copy_(g.view(torch.int32).bitwise_and_(-65536).view(g.dtype) if out.dtype == torch.bfloat16 else g)",
        ("parity_tests/test_rounding_16bit.py", "-k", "torch and nearest"),
    ),
    Mutant(
        "nan_row_hidden_torch",
        "the torch path leaves a NaN-loss row's gradient finite",
        "torchloss/_block.py::fill_bad_rows",
        '        _fill_rows(g, nan, float("nan"))',
        "        pass",
        ("parity_tests/test_torchloss_reliability.py",),
    ),
    Mutant(
        "label_smoothing_sign_oracle",
        "the oracle's label-smoothing term with a flipped sign",
        "lossspec/oracle.py::per_token_oracle",
        "                loss = loss - (eps / vocab) * d.sum(axis=-1)",
        "                loss = loss + (eps / vocab) * d.sum(axis=-1)",
        ("parity_tests/test_lossspec_oracle.py",),
    ),
    Mutant(
        "pallas_tail_mask",
        "the Pallas kernel's ragged vocabulary tail mask off by one",
        "jaxloss/backends/pallas.py::_kernel.columns",
        "        col_ok = (cols < n_cols)[None]",
        "        col_ok = (cols < n_cols - 1)[None]",
        ("parity_tests/test_jaxloss_kernels.py",),
    ),
    Mutant(
        "pallas_reverse_pass_off_by_one",
        "the Pallas gradient pass, walked last block first, starts one block past the end: the first block is never written",
        "jaxloss/backends/pallas.py::_kernel.pass2.body",
        "            index, _, mask, x, t = load(num_blocks - 1 - j)",
        "            index, _, mask, x, t = load(num_blocks - j)",
        ("parity_tests/test_jaxloss_kernels.py", "-k", "pallas"),
    ),
    Mutant(
        "pallas_persistent_blocks_dropped",
        "the Pallas kernel's persistent programs (Tuning.programs) take floor(blocks / programs) blocks each: the remainder is never computed",
        "jaxloss/backends/pallas.py::_kernel",
        "    count = pl.cdiv(pl.cdiv(n_rows, block_rows) - first, step)",
        "    count = pl.cdiv(n_rows, block_rows) // step",
        ("parity_tests/test_jaxloss_kernels.py", "-k", "persistent"),
    ),
    Mutant(
        "truncated_bf16_store_triton",
        "the Triton kernel truncates the fp32 gradient to bf16 instead of rounding to nearest",
        "torchloss/backends/triton_kernels.py::_round_for_store",
        "        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16",
        "        bits = (bits >> 16) << 16",
        ("parity_tests/test_rounding_16bit.py", "-k", "triton"),
    ),
    Mutant(
        "compiled_bf16_store_truncates_triton",
        "compiled for a GPU, the Triton kernels' bf16 gradient store truncates (cvt.rz) instead of rounding to nearest even",
        "torchloss/backends/triton_kernels.py::_grad_block",
        "        tl.store(g_row + cols, g.to(g_row.dtype.element_ty))",
        '        tl.store(g_row + cols, g.to(g_row.dtype.element_ty, fp_downcast_rounding="rtz"))',
        ("parity_tests/test_torchloss_triton_aot.py", "-k", "hardware_round"),
    ),
    Mutant(
        "label_fixup_skipped_triton",
        "the Triton kernels' cross-entropy gradient without the one-hot term: the label's fix-up store after pass 2 skipped",
        "torchloss/backends/triton_kernels.py::_row_grad",
        "            tl.store(g_row + y, g_l.to(g_row.dtype.element_ty))",
        "            pass",
        ("parity_tests/test_torchloss_triton_kernels.py", "-k", "cross_entropy"),
    ),
    Mutant(
        "final_mean_d_not_kept_triton",
        "the Triton forward keeps reverse KL's mean_d as 0 for the 16-bit backward: regrad_ forms the gradient without it",
        "torchloss/backends/triton_kernels.py::_store_final",
        "            tl.store(fin + FIN_MEAN_D * stride_fin, mean_d)",
        "            tl.store(fin + FIN_MEAN_D * stride_fin, mean_d * 0.0)",
        ("parity_tests/test_torchloss_triton_kernels.py", "-k", "regrad"),
    ),
    Mutant(
        "regrad_skips_no_row_triton",
        "the Triton regrad_ rewrites the rows whose upstream gradient is exactly 1 too (the forward's buffer needed no rewrite)",
        "torchloss/backends/triton_kernels.py::_regrad_row",
        "    if (coef != 0) & (up != 1):",
        "    if coef != 0:",
        ("parity_tests/test_torchloss_triton_kernels.py", "-k", "regrad"),
    ),
    Mutant(
        "persistent_rows_stop_early_triton",
        "the Triton fused kernel's persistent programs (Tuning.programs) stop one row short: the last row's loss and gradient are never written",
        "torchloss/backends/triton_kernels.py::fused_kernel",
        "        for row in tl.range(tl.program_id(0), N, tl.num_programs(0)):",
        "        for row in tl.range(tl.program_id(0), N - 1, tl.num_programs(0)):",
        ("parity_tests/test_torchloss_triton_kernels.py", "-k", "pipelined"),
    ),
    Mutant(
        "reverse_grad_pass_off_by_a_block_triton",
        "the Triton gradient pass, walked last block first, starts one block too far: the first block is never written",
        "torchloss/backends/triton_kernels.py::_row_grad",
        "        top = tl.full((), 0, tl.int64) + full - BLOCK_V",
        "        top = tl.full((), 0, tl.int64) + full",
        ("parity_tests/test_torchloss_triton_kernels.py", "-k", "pipelined"),
    ),
    Mutant(
        "aot_row_loop_taken_for_a_pass",
        "the AOT report takes the persistent programs' row loop for a vocabulary pass (one pass holding both)",
        "scripts/triton_aot_report.py::vocabulary_passes",
        "    rest = [l for l in reading if l not in row_loops]",
        "    rest = reading",
        ("parity_tests/test_torchloss_aot_counting.py",),
    ),
    Mutant(
        "aot_async_copies_not_loads",
        "the AOT report does not count LDGSTS (a pipelined loop's asynchronous copies) as global loads",
        "scripts/triton_aot_report.py::<module>",
        '_GLOBAL_LOADS = ("LDG", "LDGSTS")',
        '_GLOBAL_LOADS = ("LDG",)',
        ("parity_tests/test_torchloss_aot_counting.py",),
    ),
    Mutant(
        "l2_model_forward_order_reuses",
        "the AOT report's L2 model credits pass 2 in pass 1's order with the reverse order's reuse (LRU evicts a row's oldest bytes first)",
        "scripts/triton_aot_report.py::l2_share",
        "    return fraction if reverse or fraction >= 1.0 else 0.0",
        "    return fraction",
        ("parity_tests/test_torchloss_aot_counting.py",),
    ),
    Mutant(
        "nan_scale_dropped_triton",
        "the Triton kernels' gradient pass no longer makes a bad row's scale NaN (its gradient may look plausible)",
        "torchloss/backends/triton_kernels.py::_row_grad",
        '    scale = tl.where(bad != 0, float("nan"), scale)',
        "    scale = scale",
        ("parity_tests/test_torchloss_triton_kernels.py", "parity_tests/test_torchloss_entropy_jsd.py", "-k", "nan or bad"),
    ),
    Mutant(
        "aot_loop_body_off_by_one",
        "the AOT report counts a loop body without its first instruction (warp-instructions per element too low)",
        "scripts/triton_aot_report.py::sass_loops",
        "        body = [opcode(i) for a, i in code if target <= a <= address]",
        "        body = [opcode(i) for a, i in code if target < a <= address]",
        ("parity_tests/test_torchloss_aot_counting.py",),
    ),
    Mutant(
        "mask_gradient_jax",
        "jaxloss differentiates the loss w.r.t. a float loss_mask again",
        "jaxloss/_prepare.py::_weights",
        "        loss_mask = jax.lax.stop_gradient(loss_mask)",
        "        loss_mask = loss_mask",
        ("parity_tests/test_jaxloss_transforms.py", "-k", "no_gradient"),
    ),
    Mutant(
        "first_order_silent_torch",
        "a create_graph=True gradient silently treated as a constant again",
        "torchloss/_autodiff.py::MaskedLossFunction.backward",
        "        if create_graph:\n            grad = first_order_only(grad, ctx.anchor)",
        "        if False:\n            grad = first_order_only(grad, ctx.anchor)",
        ("parity_tests/test_torchloss_reliability.py", "parity_tests/test_torchloss_autograd.py", "-m", "not slow"),
    ),
    Mutant(
        "rkl_nan_fix_skipped_torch",
        "the torch path's reverse KL skips the 0 * inf fix-up on every block (entries of probability 0)",
        "torchloss/_block.py::_block_stats",
        '        clean = e_d.device.type == "cpu" and bool(torch.isfinite(e_d).all())',
        "        clean = True",
        ("parity_tests/test_torchloss_oracle.py", "-k", "reverse"),
    ),
    Mutant(
        "rkl_grad_mean_sign_torch",
        "the torch path's reverse KL gradient adds e mean_d to the cached products e D instead of subtracting it",
        "torchloss/_block.py::block_grad",
        "            g = torch.addcmul(e_times_d, e, (-fin.mean_d)[:, None], out=out if direct else e_times_d)",
        "            g = torch.addcmul(e_times_d, e, fin.mean_d[:, None], out=out if direct else e_times_d)",
        ("parity_tests/test_torchloss_oracle.py", "-k", "reverse"),
    ),
    Mutant(
        "masked_row_infinite_factor_torch",
        "the torch path's masked rows with an infinite reverse-KL mean_d (teacher -inf) keep 0 * inf = NaN gradients",
        "torchloss/_block.py::fill_bad_rows",
        "            degenerate = degenerate | ~torch.isfinite(factor)",
        "            pass",
        ("parity_tests/test_torchloss_reliability.py", "-k", "masked_row_with_infinite"),
    ),
    Mutant(
        "positive_select_always_skipped_torch",
        "the torch path's whole-row jensen_shannon and entropy never run the select where(weight > 0, products, 0): entries of probability 0 keep 0 * inf = NaN",
        "torchloss/_block.py::_where_positive",
        '    if weight.device.type == "cpu" and weight.numel() and bool(torch.amin(weight) > 0):',
        "    if True:",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-k", "zero_probabilities or matrix"),
    ),
    Mutant(
        "positive_select_hides_nan_torch",
        "the torch path's select where(weight > 0, products, 0) is a nan_to_num: a row whose teacher is all -inf (NaN only through the mixture sums) gets a finite jensen_shannon loss",
        "torchloss/_block.py::_where_positive",
        "    return torch.where(weight > 0, products, torch.tensor(0.0, dtype=products.dtype), out=products)",
        "    return products.nan_to_num_(nan=0.0, posinf=float('inf'), neginf=float('-inf'))",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-k", "zero_probabilities or matrix"),
    ),
    Mutant(
        "jsd_inplace_bound_swapped_torch",
        "the torch path's in-place mixture pass bounds log q - log M by -log(beta) instead of -log(1 - beta)",
        "torchloss/_block.py::_mixture_terms_inplace",
        "    log_qm = torch.sub(diff, log_beta, out=spare).clamp_max_(-log_rest).sub_(soft)",
        "    log_qm = torch.sub(diff, log_beta, out=spare).clamp_max_(-log_beta).sub_(soft)",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-k", "zero_probabilities or options"),
    ),
    Mutant(
        "head_softcap_blocks_uncounted_torch",
        "the torch fused head plans its chunks without the soft cap's blocks (the capped block and its slope): with a cap it holds several times its 1/8 of the logits",
        "torchloss/head.py::_softcapped",
        "    return config.logit_softcap is not None or config.teacher_logit_softcap is not None",
        "    return False",
        ("parity_tests/test_linear_head.py", "-k", "soft_caps and cross_entropy"),
    ),
    Mutant(
        "head_softcap_blocks_uncounted_jax",
        "the JAX fused head plans its chunks without the soft cap's temporaries (the capped block and its slope): with a cap XLA holds more than its 1/8 of the logits",
        "jaxloss/head.py::_softcapped",
        "    return cfg.logit_softcap is not None or cfg.teacher_logit_softcap is not None",
        "    return False",
        ("parity_tests/test_linear_head.py", "-k", "jax_temporary_memory_with_soft_caps"),
    ),
    Mutant(
        "compiled_denominator_read_on_host_torch",
        "under torch.compile a Python-number denominator is value-checked on the host (np.asarray): one recompile per value",
        "torchloss/_prepare.py::prepare",
        "        denominator = torch.full((), denominator, dtype=torch.float64, device=device)",
        "        pass",
        ("parity_tests/test_torchloss_compile.py", "-k", "python_denominator"),
    ),
    Mutant(
        "denominator_twin_in_float32_only_torch",
        "the on-device denominator check reads the value only as float32 (a float64 1e-300 passes as 0: loss 0, not NaN)",
        "torchloss/_prepare.py::prepare",
        "            bad = bad | ~torch.isfinite(denom) | ~(given >= 0) | out_of_range",
        "            bad = bad | ~torch.isfinite(denom) | ~(given >= 0)",
        ("parity_tests/test_torchloss_compile.py", "-k", "python_denominator"),
    ),
    Mutant(
        "unsigned_ids_wrap_jax",
        "JAX casts unsigned segment_ids to its signed dtype whatever their range (uint32 ids from 2**31 on become padding)",
        "jaxloss/_prepare.py::_signed_ids",
        "    if jnp.iinfo(ids.dtype).max <= jnp.iinfo(signed).max:",
        "    if True:",
        ("parity_tests/test_sequence_normalization.py", "-k", "jax_extreme_ids and uint32"),
    ),
    Mutant(
        "unsigned_ids_wrap_torch",
        "torch casts uint64 segment_ids to int64 (ids from 2**63 on become padding)",
        "torchloss/_prepare.py::_signed_ids",
        '    if ids.dtype != getattr(torch, "uint64", None):',
        "    if True:",
        ("parity_tests/test_sequence_normalization.py", "-k", "torch_extreme_ids"),
    ),
    Mutant(
        "unsigned_ids_wrap_oracle",
        "the oracle casts uint64 segment_ids to int64 (ids from 2**63 on become padding)",
        "lossspec/sequences.py::signed_segment_ids",
        '    if ids.dtype.kind == "u" and ids.dtype.itemsize >= 8:',
        "    if False:",
        ("parity_tests/test_sequence_normalization.py", "-k", "oracle_counts_extreme_ids"),
    ),
    Mutant(
        "head_inputs_saved_unversioned_torch",
        "torch's recomputing head backward keeps the weight without its version counter (an in-place update gives a silently wrong dh)",
        "torchloss/head.py::_save_inputs",
        "    ctx.save_for_backward(hidden, weight, bias, labels, t_hidden, t_weight, t_bias, coef)",
        "    ctx.save_for_backward(hidden, weight.data, bias, labels, t_hidden, t_weight, t_bias, coef)",
        ("parity_tests/test_linear_head_recompute.py", "-k", "in_place"),
    ),
    Mutant(
        "second_order_unanchored_torch",
        "a create_graph=True gradient of the losses is not tied to the logits (autograd.grad(inputs=weight) skips the error: a silent zero Hessian)",
        "torchloss/api.py::_apply",
        "    anchor = second_order_anchor(x2d) if call.need_grad else None",
        "    anchor = None",
        ("parity_tests/test_torchloss_autograd.py", "-k", "second_derivative or gradgradcheck"),
    ),
    Mutant(
        "head_second_order_silent_torch",
        "the fused head's create_graph=True gradients are plain constants (second derivatives None / 0)",
        "torchloss/head.py::LinearHeadFunction.backward",
        "            grads = _autodiff.first_order_only(grads, ctx.anchor)",
        "            pass",
        ("parity_tests/test_torchloss_autograd.py", "-k", "fused_head_second"),
    ),
    Mutant(
        "head_second_order_unguarded_jax",
        "the JAX fused head lets 16-bit / Pallas inputs be differentiated twice (a silently wrong Hessian, a bare AssertionError)",
        "jaxloss/head.py::_first_order_inputs",
        "    return _xla.no_derivatives(lambda *arrays: arrays, message)(hidden, weight, bias)",
        "    return hidden, weight, bias",
        ("parity_tests/test_jaxloss_derivatives.py", "-k", "head_second_order_raises"),
    ),
    Mutant(
        "compiled_options_absent_cap_kept_nan_torch",
        "the compiled op's options tensor does not decode an absent soft cap (NaN) back to None",
        "torchloss/_ops.py::_config",
        "    values = [None if value != value else value for value in options.tolist()]  # NaN: None",
        "    values = options.tolist()",
        ("parity_tests/test_torchloss_compile.py", "-k", "option_changing or opcheck or python_denominator"),
    ),
    Mutant(
        "causal_count_unshifted_torch",
        "torchloss.count_denominator(causal_shift=True) counts the unshifted labels (the 20/24 scaling)",
        "torchloss/api.py::count_denominator",
        "    labels, loss_mask = scored_targets(causal_shift, labels, loss_mask, full_lead, device)",
        "    labels, loss_mask = scored_targets(False, labels, loss_mask, full_lead, device)",
        ("parity_tests/test_causal_shift.py", "-m", "not slow"),
    ),
    Mutant(
        "targetless_module_drops_sequence_parallel_jax",
        "jaxloss.nnx.EntropyLoss leaves out its sequence_parallel axis (each slice normalised as whole rows)",
        "jaxloss/modules.py::_TargetlessLoss.__call__",
        "            sequence_parallel=self.sequence_parallel,",
        "",
        ("parity_tests/test_sequence_parallel.py", "-k", "targetless_module"),
    ),
    Mutant(
        "targetless_module_drops_segment_ids_torch",
        "torchloss.nn.EntropyLoss leaves out segment_ids (packed documents normalised as one sequence)",
        "torchloss/modules.py::_TargetlessLoss.forward",
        "        return function(logits, loss_mask, denominator=denominator, segment_ids=segment_ids, **self.settings)",
        "        return function(logits, loss_mask, denominator=denominator, **self.settings)",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-k", "packed_documents"),
    ),
    Mutant(
        "sequence_mean_as_sum_torch",
        "torchloss's sequence_mean leaves out the 1 / n_s (each token weighs as in sequence_sum)",
        "torchloss/_prepare.py::_coefficients",
        "        weight = torch.where(weight > 0, weight / torch.where(n > 0, n, 1.0), 0.0)",
        "        weight = weight",
        ("parity_tests/test_contract_sequences.py", "-m", "not slow"),
    ),
    Mutant(
        "hf_local_count",
        "torchloss.hf.for_causal_lm_loss ignores num_items_in_batch (a per-micro-batch mean)",
        "torchloss/hf.py::for_causal_lm_loss",
        "        logits, targets, ignore_index=ignore_index, denominator=_denominator(num_items_in_batch, logits.device)",
        "        logits, targets, ignore_index=ignore_index, denominator=None",
        ("parity_tests/test_torchloss_hf.py", "-m", "not slow"),
    ),
    Mutant(
        "jsd_beta_swapped",
        "jensen_shannon's beta weights the student's KL term instead of the teacher's (shared algebra)",
        "lossspec/stats.py::finalize_mixture",
        "    loss = config.beta * kl_pm + (1.0 - config.beta) * kl_qm",
        "    loss = (1.0 - config.beta) * kl_pm + config.beta * kl_qm",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-m", "not slow"),
    ),
    Mutant(
        "jsd_mixture_beta_swapped",
        "the mixture M built as (1 - beta) p + beta q (shared per-entry formula)",
        "lossspec/stats.py::mixture_log_ratios",
        "    log_beta, log_rest = math.log(beta), math.log1p(-beta)",
        "    log_rest, log_beta = math.log(beta), math.log1p(-beta)",
        ("parity_tests/test_jaxloss_entropy_jsd.py",),
    ),
    Mutant(
        "jsd_grad_kl_dropped_jax",
        "the - KL(q || M) term dropped from jensen_shannon's gradient (jaxloss)",
        "jaxloss/_block.py::grad_block",
        "        gz = (1.0 - cfg.beta) * _pos_times(q, log_qm - fin.kl_qm[:, None])",
        "        gz = (1.0 - cfg.beta) * _pos_times(q, log_qm)",
        ("parity_tests/test_jaxloss_entropy_jsd.py",),
    ),
    Mutant(
        "jsd_grad_kl_dropped_oracle",
        "the - KL(q || M) term dropped from the oracle's jensen_shannon gradient",
        "lossspec/oracle.py::per_token_oracle",
        "                grad_z = (1.0 - beta) * _where_positive(q, log_q - log_m - kl_qm[:, None])",
        "                grad_z = (1.0 - beta) * _where_positive(q, log_q - log_m)",
        ("parity_tests/test_lossspec_entropy_jsd.py",),
    ),
    Mutant(
        "jsd_end_points_via_mixture",
        "beta = 0 / 1 computed through the mixture (log 0) instead of as the KL kinds",
        "lossspec/config.py::LossConfig.formula",
        '        if self.kind == "jensen_shannon" and self.beta in (0.0, 1.0):',
        "        if False:",
        ("parity_tests/test_lossspec_entropy_jsd.py", "parity_tests/test_torchloss_entropy_jsd.py", "-k", "beta"),
    ),
    Mutant(
        "entropy_rescale_h",
        "entropy's moment h not moved to the new maximum when blocks combine (shared algebra)",
        "lossspec/stats.py::rescale",
        "        out = out._replace(h=r * (st.h + st.s * dm))",
        "        out = out._replace(h=r * st.h)",
        ("parity_tests/test_torchloss_entropy_jsd.py", "parity_tests/test_jaxloss_entropy_jsd.py", "-k", "block"),
    ),
    Mutant(
        "entropy_grad_mean_torch",
        "the - h / s term dropped from entropy's gradient (torch path)",
        "torchloss/_block.py::block_grad",
        "        d = u.sub_(fin.mean_h[:, None])",
        "        d = u",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-m", "not slow"),
    ),
    Mutant(
        "stats_tail_skipped_triton",
        "the Triton statistics pass skips the peeled ragged tail (its columns never enter m, s, ...)",
        "torchloss/backends/triton_kernels.py::_row_stats",
        "        if full < V:",
        "        if False:",
        ("parity_tests/test_torchloss_triton_kernels.py", "-k", "scenarios or tail_alone"),
    ),
    Mutant(
        "weighted_shift_nan_triton",
        "the Triton pass 1's weighted moments (soft CE, forward KL, entropy) as plain products: 0 * -inf = NaN at an entry of probability 0",
        "torchloss/backends/triton_kernels.py::weighted_shift",
        "    return tl.minimum(w * v, 0.0)",
        "    return w * v",
        ("parity_tests/test_torchloss_triton_kernels.py", "parity_tests/test_torchloss_entropy_jsd.py", "-k", "neg_inf or triton_matches"),
    ),
    Mutant(
        "jsd_grad_kl_dropped_triton",
        "the - KL(q || M) term dropped from jensen_shannon's gradient (Triton kernel)",
        "torchloss/backends/triton_kernels.py::_grad_block",
        "            g = q * (tl.maximum(log_qm, LOWEST) - kl_qm) * j_scale",
        "            g = q * tl.maximum(log_qm, LOWEST) * j_scale",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-k", "triton_matches"),
    ),
    Mutant(
        "jsd_vp_no_psum_jax",
        "jensen_shannon's mixture sums not summed over the vocabulary shards (jaxloss vocab_parallel)",
        "jaxloss/backends/vocab_parallel.py::reduce_mixture",
        "    kl_qm, kl_pm = lax.psum(varying_like(sums, x), axis_arg(axes))",
        "    kl_qm, kl_pm = sums",
        ("parity_tests/test_jaxloss_entropy_jsd.py", "-k", "test_vocab_parallel_matches_oracle"),
    ),
    Mutant(
        "head_backward_slices_overlap_jax",
        "the fused head's last (moved-back) vocabulary slice adds its overlap with the previous one again (jaxloss)",
        "jaxloss/head.py::_head_grads.add",
        "        g_slice = jnp.where(fresh, lax.dynamic_slice_in_dim(g, offset, slice_rows, 1), 0.0)",
        "        g_slice = lax.dynamic_slice_in_dim(g, offset, slice_rows, 1)",
        ("parity_tests/test_linear_head.py", "-k", "jax"),
    ),
    Mutant(
        "head_bf16_rows_shift_jax",
        "a bf16 weight slice widened to fp32 by a wrong shift of its bits (jaxloss head backward)",
        "jaxloss/head.py::_rows_f32",
        "    return lax.bitcast_convert_type(_bf16_bits(x, start, rows).astype(jnp.uint32) << 16, F32)",
        "    return lax.bitcast_convert_type(_bf16_bits(x, start, rows).astype(jnp.uint32) << 15, F32)",
        ("parity_tests/test_linear_head.py", "-k", "jax and bfloat16"),
    ),
    Mutant(
        "head_bf16_weight_copy_jax",
        "a bf16 weight slice upcast with a plain dynamic_slice (XLA CPU hoists it: a whole fp32 weight copy)",
        "jaxloss/head.py::_rows_f32",
        "    return lax.bitcast_convert_type(_bf16_bits(x, start, rows).astype(jnp.uint32) << 16, F32)",
        "    return lax.dynamic_slice_in_dim(x, start, rows, 0).astype(F32)",
        ("parity_tests/test_linear_head.py", "-k", "temporary_memory"),
    ),
    Mutant(
        "head_weight_rows_overwrite_torch",
        "the torch fused head writes dh per weight slice instead of adding (16-bit weights)",
        "torchloss/head.py::_add_head_grads",
        "        first = False\n        if db is not None:",
        "        if db is not None:",
        ("parity_tests/test_linear_head.py", "-k", "torch"),
    ),
    Mutant(
        "head_weight_copy_torch",
        "the torch fused head upcasts a 16-bit weight whole (one fp32 copy) instead of by slices",
        "torchloss/head.py::WeightRows.__init__",
        "        self.step = weight.shape[0] if (weight.dtype == acc and not as_is) else max(1, slice_rows)",
        "        self.step = weight.shape[0]",
        ("parity_tests/test_linear_head.py", "-k", "peak_memory"),
    ),
    Mutant(
        "head_plan_ignores_dtype",
        "the head's block budget counts fp32 logits for 16-bit inputs (twice 1/8 of their logits buffer)",
        "lossspec/linear.py::head_plan",
        "        share = int(rows * vocab * HEAD_MEMORY_FRACTION * logits_itemsize / block_itemsize)",
        "        share = int(rows * vocab * HEAD_MEMORY_FRACTION)",
        ("parity_tests/test_linear_head.py", "-k", "memory"),
    ),
    Mutant(
        "head_whole_rows_undercounted_torch",
        "the torch jensen_shannon head plans whole rows with 2 live blocks (it holds about 4.5): over its 1/8 of the logits",
        "torchloss/_block.py::<module>",
        '_HEAD_LIVE_BLOCKS_WHOLE_ROWS = {"jensen_shannon": 6}',
        '_HEAD_LIVE_BLOCKS_WHOLE_ROWS = {"jensen_shannon": 2}',
        ("parity_tests/test_linear_head.py", "-k", "jensen_shannon_whole_rows_peak_memory"),
    ),
    Mutant(
        "head_plan_whole_rows_ignored",
        "the head plan ignores whole_row_live_blocks (torch's jensen_shannon head plans whole rows with 16 blocks again: 1.5x slower)",
        "lossspec/linear.py::head_plan",
        "        if whole_row_live_blocks is not None and vocab <= min(share // whole_row_live_blocks, HEAD_MAX_BLOCK_ELEMENTS):",
        "        if False:",
        ("parity_tests/test_linear_head.py", "-k", "whole_rows_plan"),
    ),
    Mutant(
        "softcap_slope_sign",
        "the soft cap's chain-rule factor 1 + tanh^2 instead of 1 - tanh^2 (shared by the JAX backends)",
        "lossspec/stats.py::softcap_slope",
        "    return 4.0 * e / ((1.0 + e) * (1.0 + e))",
        "    return 2.0 - 4.0 * e / ((1.0 + e) * (1.0 + e))",
        ("parity_tests/test_softcap.py", "-m", "not slow"),
    ),
    Mutant(
        "fp32_options_subnormal",
        "float options below the smallest normal float32 accepted (a subnormal cap: an all-NaN gradient)",
        "lossspec/config.py::check_fp32_normal",
        "    if (value != 0.0 or not zero_allowed) and not FP32_TINY <= abs(value) <= FP32_MAX:",
        "    if (value != 0.0 or not zero_allowed) and not abs(value) <= FP32_MAX:",
        ("parity_tests/test_lossspec_checks.py", "-k", "float32"),
    ),
    Mutant(
        "traced_bad_value_finite_grad_jax",
        "under jit a bad label / weight / denominator makes the loss NaN but leaves the gradient finite",
        "jaxloss/_prepare.py::prepare",
        "    coef = jnp.where(bad, jnp.nan, coef)",
        "    pass",
        ("parity_tests/test_jaxloss_errors.py", "-k", "nan_gradient"),
    ),
    Mutant(
        "unchecked_bad_value_finite_grad_torch",
        "torch without host checks (GPU, torch.compile): a bad value makes the loss NaN but leaves the gradient finite",
        "torchloss/_prepare.py::prepare",
        "        coef = torch.where(bad, float(\"nan\"), coef)",
        "        pass",
        ("parity_tests/test_torchloss_errors.py", "-m", "not slow", "-k", "nan_gradient"),
    ),
    Mutant(
        "integer_mask_accepted",
        "an integer loss_mask silently read as weights again (entropy(logits, labels) weights tokens by label id)",
        "lossspec/checks.py::check_loss_mask_dtype",
        "    if loss_mask.kind not in (BOOL_KIND, FLOAT_KIND):",
        "    if loss_mask.kind not in (BOOL_KIND, FLOAT_KIND, *INT_KINDS):",
        ("parity_tests/test_lossspec_checks.py", "-k", "validation_gaps"),
    ),
    Mutant(
        "uint64_labels_wrapped_torch",
        "torch reads uint64 labels' bits as int64 and lets a negative ignore_index match the wrapped values",
        "torchloss/_prepare.py::ignore_index_matches",
        "    return labels is None or labels.dtype != _UINT64 or lossspec.ignore_index_in_dtype(ignore_index, \"uint64\")",
        "    return True",
        ("parity_tests/test_torchloss_errors.py", "-m", "not slow", "-k", "validation_gaps"),
    ),
    Mutant(
        "denominator_type_unchecked",
        "a denominator= that is not a real number (a string, True, a list, a complex tensor) accepted again",
        "lossspec/checks.py::check_denominator_type",
        "    if isinstance(denominator, (bool, np.bool_)) or not isinstance(denominator, numbers.Real):",
        "    if False:",
        ("parity_tests/test_lossspec_checks.py", "-k", "validation_gaps"),
    ),
    Mutant(
        "softcap_slope_cancels",
        "the soft cap's slope formed as 1 - tanh^2 in fp32 (cancels near saturation; shared by the JAX backends)",
        "lossspec/stats.py::softcap_slope",
        "    return 4.0 * e / ((1.0 + e) * (1.0 + e))",
        "    return 1.0 - ((1.0 - e) / (1.0 + e)) ** 2",
        ("parity_tests/test_softcap.py", "-m", "not slow", "-k", "saturated_slope"),
    ),
    Mutant(
        "softcap_slope_cancels_torch",
        "the torch path's soft-cap slope formed as 1 - tanh^2 in fp32 (cancels near saturation)",
        "torchloss/_block.py::_softcap_tile",
        "        slope.div_(z.mul_(z))  # 4 e / ((1 + e) (1 + e))",
        "        slope.copy_(1.0 - w * w)",
        ("parity_tests/test_softcap.py", "-m", "not slow", "-k", "saturated_slope"),
    ),
    Mutant(
        "softcap_tiles_cap_infinities_torch",
        "the torch path's tiled soft cap skips the select that keeps +-inf and NaN entries (-inf becomes -cap)",
        "torchloss/_block.py::_softcap_tile",
        "    finite = bool(torch.amax(u) < math.inf)  # |x / cap| < inf everywhere: no NaN, no inf",
        "    finite = True",
        ("parity_tests/test_softcap.py", "-m", "not slow", "-k", "tiled_softcap"),
    ),
    Mutant(
        "softcap_tiles_unsigned_torch",
        "the torch path's tiled soft cap drops the sign of tanh's exponential branch (|x / cap| >= 0.55)",
        "torchloss/_block.py::_softcap_tile",
        "    w.div_(z).copysign_(u)  # big = (1 - e) / (1 + e), with the sign of u",
        "    w.div_(z)",
        ("parity_tests/test_softcap.py", "-m", "not slow", "-k", "matches_oracle"),
    ),
    Mutant(
        "softcap_tiles_last_column_tile_skipped_torch",
        "the torch path's tiled soft cap skips the last, shorter tile of a row split into tiles",
        "torchloss/_block.py::softcap_with_slope",
        "    tiles = [(r0, min(rows, r0 + tile_rows), c0, min(width, c0 + tile_cols)) for r0 in range(0, rows, tile_rows) for c0 in range(0, width, tile_cols)]",
        "    tiles = [(r0, min(rows, r0 + tile_rows), c0, min(width, c0 + tile_cols)) for r0 in range(0, rows, tile_rows) for c0 in range(0, width - tile_cols + 1, tile_cols)]",
        ("parity_tests/test_softcap.py", "-m", "not slow", "-k", "tiled_softcap"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_torch",
        "the torch vocab-parallel head does not all-reduce the hidden state's gradient over the shards",
        "torchloss/head.py::head_forward",
        "            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shards.group)  # the stored gradient's",
        "            pass",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "torch"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_recompute_torch",
        "the torch vocab-parallel head's recompute backward does not all-reduce the hidden state's gradient",
        "torchloss/head.py::head_backward",
        "            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shards.group)  # the recompute backward's",
        "            pass",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "torch"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_jax",
        "the JAX vocab-parallel head does not psum the hidden state's gradient over the shards",
        "jaxloss/head.py::head_forward",
        "        dh = lax.psum(dh, _vocab_parallel.axis_arg(shards.axes))  # the stored gradient's",
        "        dh = dh",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "jax"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_recompute_jax",
        "the JAX vocab-parallel head's recompute backward does not psum the hidden state's gradient",
        "jaxloss/head.py::head_backward",
        "        dh = lax.psum(dh, _vocab_parallel.axis_arg(shards.axes))  # the recompute backward's",
        "        dh = dh",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "jax"),
    ),
    Mutant(
        "head_replicated_weight_grad_jax",
        "the JAX head's weight gradient not summed over data-parallel replicas inside shard_map",
        "jaxloss/head.py::_as_primal_type",
        "    return lax.psum(grad, tuple(sorted(missing))) if missing else grad",
        "    return grad",
        ("parity_tests/test_linear_head_edge.py", "-k", "data_parallel"),
    ),
    Mutant(
        "head_bf16_split_rounds_torch",
        "torch's opt-in bf16 head matmuls take the backward's G as one bf16 term (G rounded)",
        "torchloss/head.py::mm_f32",
        "    terms = split_bf16(a, tuning.split_terms) if a.dtype == torch.float32 else [a]",
        "    terms = split_bf16(a, 1) if a.dtype == torch.float32 else [a]",
        ("parity_tests/test_linear_head_bf16_matmuls.py", "-k", "torch"),
    ),
    Mutant(
        "triton_matmul_split_two_terms",
        "the Triton bf16 matmul splits an fp32 operand (the head's G) into two bf16 terms, not three",
        "torchloss/backends/triton_matmul.py::_dot_terms",
        "        for _ in tl.static_range(SPLIT - 1):",
        "        for _ in tl.static_range(SPLIT - 2):",
        ("parity_tests/test_linear_head_bf16_matmuls.py", "-k", "triton"),
    ),
    Mutant(
        "recompute_moved_back_slice_twice_jax",
        "JAX's recompute_logits backward adds the moved-back last vocabulary slice's shared columns to dh twice",
        "jaxloss/head.py::head_backward.vocab_slice.token_chunk",
        "            g = jnp.where(col_ok, grad_block(cfg, fin, cc, z, t, hit=hit, vocab=vocab_total), 0.0)\n            dh_c, dw_j = _head_grads(cut(dh, r0, rows), dw_j, 0, g, hc, w_j, cols, tuning)",
        "            g = grad_block(cfg, fin, cc, z, t, hit=hit, vocab=vocab_total)\n            dh_c, dw_j = _head_grads(cut(dh, r0, rows), dw_j, 0, g, hc, w_j, cols, tuning)",
        ("parity_tests/test_linear_head_recompute.py", "-k", "jax and not blocked and not causal"),
    ),
    Mutant(
        "recompute_slice_gradient_not_reset_torch",
        "torch's recompute_logits backward carries one vocabulary slice's weight gradient into the next",
        "torchloss/head.py::head_backward",
        "            dw_j.zero_()\n",
        "",
        ("parity_tests/test_linear_head_recompute.py", "-k", "torch"),
    ),
    Mutant(
        "exp2_constant_rounded_torch",
        "torch's CPU exponentials take 1/ln 2 to 5 digits (exp2(1.4427 u)): a 3e-6 relative error in every exponent",
        "torchloss/_block.py::<module>",
        "LOG2_E: float = 1.4426950408889634",
        "LOG2_E: float = 1.4427",
        TORCH_ORACLE,
    ),
    Mutant(
        "bad_rows_not_filled_torch",
        "the torch path finalises its rows once at the end but forgets the bad rows' gradient fill there",
        "torchloss/backends/torch.py::forward",
        "        _block.fill_bad_rows(grad, fin, coef)",
        "        pass",
        ("parity_tests/test_torchloss_reliability.py", "parity_tests/test_torchloss_oracle.py", "-m", "not slow"),
    ),
    Mutant(
        "row_stats_tile_misplaced_torch",
        "a tile writes its statistics one row off in the torch path's row table (the loss of row r is row r+1's)",
        "torchloss/backends/torch.py::RowStats.put",
        "            torch.stack(values, out=self.table[:, rows])",
        "            torch.stack(values, out=self.table[:, rows.start + (rows.stop < self.table.shape[1]) : rows.stop + (rows.stop < self.table.shape[1])])",
        TORCH_ORACLE,
    ),
    Mutant(
        "lone_tile_on_calling_thread_torch",
        "a CPU call with one tile runs it on the calling thread again (each small op an OpenMP region: slow on a busy CPU)",
        "torchloss/backends/cpu_tiles.py::worker_count",
        "    if device.type != \"cpu\" or n_tiles < 1 or threads <= 1 or omp_set_num_threads() is None:",
        "    if device.type != \"cpu\" or n_tiles < 2 or threads <= 1 or omp_set_num_threads() is None:",
        ("parity_tests/test_torchloss_reliability.py", "-k", "single_threaded_workers"),
    ),
    Mutant(
        "nonfinite_wording_cli",
        "lossparity's NONFINITE lines say \"where the torch's is too\" again (an article before a backend's name)",
        "lossparity/matrix.py::reference_values",
        '    return "the oracle\'s" if reference == "oracle" else f"{reference}\'s"',
        '    return f"the {reference}\'s"',
        ("parity_tests/test_parity_cli.py", "-k", "nan_that_the_oracle_shares"),
    ),
    Mutant(
        "worker_exit_no_freeze",
        "an xdist worker leaves its whole heap to pytest's last collection (past execnet's 5 s: a KeyboardInterrupt in _xla_gc_callback)",
        "parity_tests/support/workers.py::pytest_sessionfinish",
        "    gc.freeze()",
        "    pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "xla_whole_rows_off",
        "plain fp32 cross-entropy on the XLA path goes back to 2**20-element row chunks (25-30% slower on a CPU)",
        "jaxloss/backends/xla.py::blocking",
        "    if whole and not blocked and tuning.chunk_elements is None:",
        "    if False:",
        ("parity_tests/test_jaxloss_kernels.py",),
    ),
    Mutant(
        "peak_extra_from_the_first_allocation",
        "the torch memory tests measure their peak from after the call's first allocation (one buffer less)",
        "parity_tests/support/head_cases.py::peak_extra",
        "    return max(event.typed[1].total_allocated for event in allocations) - (first.total_allocated - first.alloc_size)",
        "    return max(event.typed[1].total_allocated for event in allocations) - first.total_allocated",
        ("parity_tests/test_linear_head.py",),
    ),
    Mutant(
        "worker_start_no_freeze",
        "an xdist worker leaves its imports and collected tests to every full collection of the run",
        "parity_tests/support/workers.py::pytest_collection_finish",
        "    gc.freeze()",
        "    pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "jax_caches_kept_between_files",
        "the test processes keep every JAX executable for the whole run (a worker's memory grew to 6 GB)",
        "parity_tests/support/workers.py::pytest_runtest_teardown",
        "        jax.clear_caches()",
        "        pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "shared_executables_kept_between_files",
        "the test processes keep every shared JAX executable in memory for the whole run (JAX's own caches dropped)",
        "parity_tests/support/workers.py::pytest_runtest_teardown",
        "        jax_executables.clear()",
        "        pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "shared_executables_with_host_callbacks",
        "the test processes share executables that call back into Python (a program would call another's function)",
        "parity_tests/support/jax_executables.py::install.compile_or_reuse",
        "        if host_callbacks or pgle_profiler is not None:",
        "        if pgle_profiler is not None:",
        ("parity_tests/test_jax_executables_patch.py",),
    ),
    Mutant(
        "shared_executables_keyed_on_the_name",
        "the test processes share executables by the program's name, not its text (another constant runs the first program)",
        "parity_tests/support/jax_executables.py::install.compile_or_reuse",
        "            key = cache_key.get(computation, devices, compile_options, backend)",
        '            key = str(computation.operation.attributes["sym_name"])',
        ("parity_tests/test_jax_executables_patch.py",),
    ),
    Mutant(
        "worker_crash_without_traceback",
        "a crashed xdist worker leaves no fatal-error traceback for the end of the run (xdist says only that it crashed)",
        "parity_tests/support/workers.py::pytest_configure",
        "        faulthandler.enable(file=report, all_threads=True)",
        "        pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "worker_reports_left_behind",
        "every -n run leaves its folder of worker reports in the temporary directory",
        "parity_tests/support/workers.py::pytest_unconfigure",
        "        shutil.rmtree(folder, ignore_errors=True)",
        "        pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "crash_report_without_the_test",
        "a crash deep inside a library reports only its innermost frames, not which test ran",
        "parity_tests/support/workers.py::crashing_thread",
        '            lines += [f"  ... {in_tests[0] - max_frames} frames", frames[in_tests[0]]]',
        "            pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "head_bf16_split_rounds_jax",
        "JAX's opt-in bf16 head backward takes G as one bf16 term (what XLA's GPU compiler made of the first split)",
        "jaxloss/head.py::_head_grads.split",
        "        terms = split_bf16(g_slice, tuning.split_terms)",
        "        terms = split_bf16(g_slice, 1)",
        ("parity_tests/test_linear_head_bf16_matmuls.py", "-k", "jax"),
    ),
    Mutant(
        "head_tuning_dropped_jax",
        "jaxloss's fused head ignores tuning= (the plan gets the default HeadTuning)",
        "jaxloss/head.py::_linear_loss",
        "    plan = spec_linear.HeadPlan(backend.name, recompute, spec_linear.head_matmul_tuning(args[\"tuning\"], args[\"precision\"]), args[\"precision\"])",
        "    plan = spec_linear.HeadPlan(backend.name, recompute)",
        ("parity_tests/test_linear_head.py", "-k", "tuning and jax"),
    ),
    Mutant(
        "head_tuning_dropped_torch",
        "torchloss's fused head ignores tuning= (the plan gets the default HeadTuning)",
        "torchloss/head.py::_linear_loss",
        "        spec_linear.HeadPlan(backend.name, recompute, spec_linear.head_matmul_tuning(tuning, args[\"precision\"]), args[\"precision\"]), shards,",
        "        spec_linear.HeadPlan(backend.name, recompute), shards,",
        ("parity_tests/test_linear_head.py", "-k", "tuning and torch"),
    ),
    Mutant(
        "tensor_precision_ignored_jax",
        "jaxloss's fused head ignores precision='tensor' (the exact contract's matmuls: G never rounded to bf16)",
        "jaxloss/head.py::_linear_loss",
        "    plan = spec_linear.HeadPlan(backend.name, recompute, spec_linear.head_matmul_tuning(args[\"tuning\"], args[\"precision\"]), args[\"precision\"])",
        "    plan = spec_linear.HeadPlan(backend.name, recompute, args[\"tuning\"], args[\"precision\"])",
        ("parity_tests/test_linear_head_tensor.py", "-k", "reaches and jax"),
    ),
    Mutant(
        "tensor_precision_ignored_torch",
        "torchloss's fused head ignores precision='tensor' (the exact contract's matmuls: G never rounded to bf16)",
        "torchloss/head.py::_linear_loss",
        "        spec_linear.HeadPlan(backend.name, recompute, spec_linear.head_matmul_tuning(tuning, args[\"precision\"]), args[\"precision\"]), shards,",
        "        spec_linear.HeadPlan(backend.name, recompute, tuning, args[\"precision\"]), shards,",
        ("parity_tests/test_linear_head_tensor.py", "-k", "reaches and torch"),
    ),
    Mutant(
        "tensor_g_kept_in_fp32",
        "precision='tensor' multiplies G as three exact bf16 terms (the exact contract's products, at 3x the matmuls)",
        "lossspec/linear.py::head_matmul_tuning",
        "    return dataclasses.replace(tuning, bf16_matmul_devices=HEAD_TENSOR_DEVICES, split_terms=1)",
        "    return dataclasses.replace(tuning, bf16_matmul_devices=HEAD_TENSOR_DEVICES, split_terms=HEAD_SPLIT_TERMS)",
        ("parity_tests/test_linear_head_tensor.py", "-k", "drivers"),
    ),
    Mutant(
        "tensor_g_truncated_jax",
        "jaxloss's split_bf16 cuts its last term to bf16 (truncation) instead of rounding it to nearest even",
        "jaxloss/head.py::split_bf16",
        "    parts.append(rest.astype(jnp.bfloat16))",
        "    parts.append(lax.bitcast_convert_type(lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000), F32).astype(jnp.bfloat16))",
        ("parity_tests/test_linear_head_tensor.py", "-k", "drivers and jax"),
    ),
    Mutant(
        "tensor_parts_g_truncated_jax",
        "jaxloss's head in parts stores G cut to bf16 (truncation) instead of rounded to nearest even",
        "jaxloss/head.py::_chunk_whole_parts.part",
        "    return loss, g.astype(jnp.bfloat16), fin, jnp.sum(g, axis=0) if with_bias else None",
        "    return loss, lax.bitcast_convert_type(lax.bitcast_convert_type(g, jnp.uint32) & jnp.uint32(0xFFFF0000), F32).astype(jnp.bfloat16), fin, jnp.sum(g, axis=0) if with_bias else None",
        ("parity_tests/test_linear_head_tensor.py", "-k", "drivers"),
    ),
    Mutant(
        "tensor_parts_last_part_skipped_jax",
        "jaxloss's head in parts leaves each chunk's last part out (its loss and G stay 0)",
        "jaxloss/head.py::_chunk_whole_parts",
        "    return lax.fori_loop(1, parts, step, start)",
        "    return lax.fori_loop(1, parts - 1, step, start)",
        ("parity_tests/test_linear_head_tensor.py", "-k", "parts"),
    ),
    Mutant(
        "tensor_parts_bias_sum_of_last_part_jax",
        "jaxloss's head in parts keeps only the last part's column sums of G (the bias gradient)",
        "jaxloss/head.py::_chunk_whole_parts.step",
        "    return put(loss_buf, loss, at), put(g_buf, g, at), final, None if col_sum is None else col_sum + g_sum",
        "    return put(loss_buf, loss, at), put(g_buf, g, at), final, None if col_sum is None else g_sum",
        ("parity_tests/test_linear_head_tensor.py", "-k", "parts"),
    ),
    Mutant(
        "tensor_parts_over_budget_jax",
        "jaxloss's head in parts takes twice the parts its memory budget allows (G's bf16 chunk outgrows the 1/8)",
        "jaxloss/head.py::_whole_parts",
        "    parts = min(2 * live, n // half)",
        "    parts = min(4 * live, n // half)",
        ("parity_tests/test_linear_head_tensor.py", "-k", "memory"),
    ),
    Mutant(
        "tensor_logits_rounded_to_bf16_torch",
        "torchloss's bf16 head matmuls round the logits to bf16 (a bf16-output GEMM) before the loss",
        "torchloss/head.py::_logits",
        "        z = mm_f32(h, w.t(), out, tuning=tuning)",
        "        z = mm_f32(h, w.t(), out, tuning=tuning)\n        z.copy_(z.to(torch.bfloat16))",
        ("parity_tests/test_linear_head_tensor.py", "-k", "meets and torch"),
    ),
    Mutant(
        "tensor_grad_bound_doubled",
        "the tensor contract's gradient term is 2^-7 of the componentwise magnitude (docs/spec.md says 2^-8)",
        "lossspec/linear.py::<module>",
        "HEAD_TENSOR_GRAD_RTOL: float = 2.0**-8",
        "HEAD_TENSOR_GRAD_RTOL: float = 2.0**-7",
        ("parity_tests/test_linear_head_tensor.py", "-k", "lossspec"),
    ),
    Mutant(
        "tensor_g_left_to_the_triton_matmul",
        "torchloss's mm_f32 leaves the one-term rounding of G to the Triton matmul (the interpreter's cast truncates)",
        "torchloss/head.py::mm_f32",
        "        a = a.to(torch.bfloat16)",
        "        pass",
        ("parity_tests/test_linear_head_tensor.py", "-k", "triton_matmul"),
    ),
    Mutant(
        "head_recompute_plan_ignored_torch",
        "torch's recompute_logits backward ignores HeadTuning.recompute_plan (always its own plan)",
        "torchloss/head.py::head_backward",
        "    rows, cols = tuning.recompute_plan or spec_linear.head_plan_recompute(n, vocab, width, budget, blocks, 2 + (teacher is not None), row_elements)",
        "    rows, cols = spec_linear.head_plan_recompute(n, vocab, width, budget, blocks, 2 + (teacher is not None), row_elements)",
        ("parity_tests/test_linear_head.py", "-k", "tuning and torch"),
    ),
    Mutant(
        "head_teacher_device_unchecked_jax",
        "the JAX head does not check the teacher's tensors' devices (torch does)",
        "jaxloss/head.py::_linear_loss",
        "        named += list(zip((\"teacher_hidden\", \"teacher_weight\", \"teacher_bias\"), teacher))",
        "        named += []",
        ("parity_tests/test_linear_head.py", "-k", "another_device"),
    ),
    Mutant(
        "head_module_recompute_unchecked",
        "the head modules do not check recompute_logits at construction (the first call fails instead)",
        "lossspec/linear.py::head_module_settings",
        "    check_recompute_logits(settings[\"recompute_logits\"])",
        "    pass",
        ("parity_tests/test_linear_head.py", "-k", "modules_take_impl"),
    ),
    Mutant(
        "bf16_bits_hoisted_jax",
        "the JAX head slices a bf16 weight's bits without tying it to the loop (XLA hoists a copy of the whole weight's bits)",
        "jaxloss/head.py::_bf16_bits",
        "    x, start = lax.optimization_barrier((x, start))",
        "    pass",
        ("parity_tests/test_linear_head_recompute.py", "-k", "temporary_memory"),
    ),
    Mutant(
        "recompute_rows_not_budgeted_torch",
        "torch's recompute_logits backward leaves a chunk's widened 16-bit hidden rows out of the plan's budget",
        "torchloss/head.py::head_backward",
        "    row_elements = 0 if as_is else sum(h.shape[1] for h in (hidden, None if teacher is None else teacher[0]) if h is not None and h.dtype != acc)",
        "    row_elements = 0",
        ("parity_tests/test_linear_head_recompute.py", "-k", "peak_memory or widened_rows"),
    ),
    Mutant(
        "recompute_dh_not_budgeted",
        "the recompute_logits backward leaves the fp32 dh of 16-bit hidden states out of the plan's budget (both frameworks)",
        "lossspec/linear.py::head_recompute_budget",
        "    return max(budget - (rows * width if fp32_dh_apart else 0), budget // 2)",
        "    return budget",
        ("parity_tests/test_linear_head_recompute.py", "-k", "peak_memory or temporary_memory"),
    ),
    Mutant(
        "hf_zero_num_items_as_none",
        "for_causal_lm_loss takes num_items_in_batch=0 for None: the mean over the valid tokens instead of loss 0",
        "torchloss/hf.py::_denominator",
        "        return num_items_in_batch\n",
        "        return num_items_in_batch or None\n",
        ("parity_tests/test_torchloss_hf.py", "-k", "zero_num_items"),
    ),
    Mutant(
        "causal_tokens_count_negative_at_t0",
        "causal_shift's \"tokens\" count is prod(lead[:-1]) * (T - 1): -3 for an empty time axis (oracle and JAX)",
        "lossspec/causal.py::scored_positions",
        "    return math.prod(lead[:-1]) * max(lead[-1] - 1, 0)",
        "    return math.prod(lead[:-1]) * (lead[-1] - 1)",
        ("parity_tests/test_causal_shift.py", "-k", "no_scored_position"),
    ),
    Mutant(
        "compare_fails_at_the_bound",
        "a comparison exactly at its bound fails (SPEC: <= passes)",
        "lossspec/tolerances.py::Comparison.ok",
        "        return bool(self.error_units <= 1.0)",
        "        return bool(self.error_units < 1.0)",
        ("parity_tests/test_lossspec_checks.py", "-k", "compare_loss_exactly"),
    ),
    Mutant(
        "compare_infinities_sign_blind",
        "-inf matches +inf in every comparison (loss and gradient)",
        "lossspec/tolerances.py::worst_comparison",
        "    same_inf = np.isinf(actual) & (actual == reference)",
        "    same_inf = np.isinf(actual) & (np.abs(actual) == np.abs(reference))",
        ("parity_tests/test_lossspec_checks.py", "-k", "compare_loss_exactly"),
    ),
    Mutant(
        "padding_only_minus_one_oracle",
        "the oracle takes only segment id -1 for padding (-2, -3 ... count as documents)",
        "lossspec/oracle.py::token_weights",
        "        valid &= np.asarray(segment_ids) >= 0",
        "        valid &= np.asarray(segment_ids) != -1",
        ("parity_tests/test_sequence_normalization.py", "-m", "not slow", "-k", "oracle"),
    ),
    Mutant(
        "padding_only_minus_one_jax",
        "jaxloss takes only segment id -1 for padding (-2, -3 ... count as documents)",
        "jaxloss/_prepare.py::_weights",
        "        valid = valid & (segment_ids >= 0)",
        "        valid = valid & (segment_ids != -1)",
        ("parity_tests/test_sequence_normalization.py", "-m", "not slow", "-k", "jax"),
    ),
    Mutant(
        "padding_only_minus_one_torch",
        "torchloss takes only segment id -1 for padding (-2, -3 ... count as documents)",
        "torchloss/_prepare.py::weights_of",
        "        valid = valid & (segment_ids >= 0)",
        "        valid = valid & (segment_ids != -1)",
        ("parity_tests/test_sequence_normalization.py", "-m", "not slow", "-k", "torch"),
    ),
    Mutant(
        "z_loss_not_squared",
        "the z-loss term is lam * lse, not lam * lse**2 (shared algebra; the docs' examples print it)",
        "lossspec/stats.py::finalize",
        "            loss = loss + lam * full_lse * full_lse",
        "            loss = loss + lam * full_lse",
        ("parity_tests/test_readme_examples.py", "-k", "jaxloss.md-0 or torchloss.md-0"),
    ),
    Mutant(
        "case_reference_ignores_mask",
        "Case.reference drops the loss mask (the frameworks-free oracle still gives a positive loss)",
        "lossspec/generators.py::Case.reference",
        "        loss, grad = oracle(self.kind, self.logits, self.target, self.loss_mask, **options)",
        "        loss, grad = oracle(self.kind, self.logits, self.target, None, **options)",
        ("parity_tests/test_lossspec_oracle.py", "-k", "import_without"),
    ),
    Mutant(
        "lossparity_bool_safetensors_size",
        "lossparity takes JSON's true for a safetensors size (a traceback instead of a one-line error)",
        "lossparity/inputs.py::_safetensors_bytes",
        "    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):",
        "    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):",
        ("parity_tests/test_parity_cli.py", "-k", "bool_shape_safetensors"),
    ),
    Mutant(
        "lossparity_no_zip_bomb_cap",
        "lossparity inflates any .npz member however far it inflates (a 2 MB zip bomb to 1.9 GB)",
        "lossparity/inputs.py::_npz_members",
        "        if info.file_size > RATIO_FREE_BYTES + MAX_COMPRESSION_RATIO * info.compress_size:",
        "        if False:",
        ("parity_tests/test_parity_cli.py", "-k", "zip_bomb"),
    ),
    Mutant(
        "lossparity_report_through_link",
        "lossparity writes parity_report.json through a symbolic link planted in --out",
        "lossparity/cli.py::main",
        "        replace_file(json_path, json.dumps(json_safe(report), indent=1, allow_nan=False).encode())",
        "        json_path.write_bytes(json.dumps(json_safe(report), indent=1, allow_nan=False).encode())",
        ("parity_tests/test_parity_cli.py", "-k", "replace_links"),
    ),
    Mutant(
        "lossparity_negative_seed",
        "lossparity accepts --seed -1 (a NumPy traceback once the matrix is built)",
        "lossparity/cli.py::_seed",
        "    if not 0 <= seed <= MAX_SEED:",
        "    if seed > MAX_SEED:",
        ("parity_tests/test_parity_cli.py", "-k", "negative_seed"),
    ),
    Mutant(
        "mask_no_broadcast",
        "a loss_mask must have the exact leading shape again: [T] or [B, T, 1] refused (shared check)",
        "lossspec/checks.py::mask_broadcasts",
        "        return np.broadcast_shapes(squeezed, tuple(lead)) == tuple(lead)",
        "        return squeezed == tuple(lead)",
        ("parity_tests/test_broadcast_mask.py", "-k", "expanded_mask"),
    ),
    Mutant(
        "mask_not_expanded_jax",
        "jaxloss uses a broadcastable loss_mask as given, without expanding it to the leading shape",
        "jaxloss/_prepare.py::broadcast_mask",
        "    return jnp.broadcast_to(jnp.reshape(loss_mask, lossspec.squeezed_mask_shape(tuple(loss_mask.shape), lead)), lead)",
        "    return loss_mask",
        ("parity_tests/test_broadcast_mask.py",),
    ),
    Mutant(
        "mask_not_expanded_torch",
        "torchloss uses a broadcastable loss_mask as given, without expanding it to the leading shape",
        "torchloss/_prepare.py::broadcast_mask",
        "    return loss_mask.reshape(lossspec.squeezed_mask_shape(tuple(loss_mask.shape), lead)).expand(lead)",
        "    return loss_mask",
        ("parity_tests/test_broadcast_mask.py",),
    ),
    Mutant(
        "reduction_mean_hint",
        "the reduction='mean' hint names normalization='tokens' (the mean over every position, masked ones too)",
        "lossspec/checks.py::<module>",
        'REDUCTION_TO_NORMALIZATION = {"mean": "valid_tokens", "sum": "sum", "none": "none", "batchmean": "tokens"}',
        'REDUCTION_TO_NORMALIZATION = {"mean": "tokens", "sum": "sum", "none": "none", "batchmean": "tokens"}',
        ("parity_tests/test_lossspec_checks.py", "parity_tests/test_torchloss_errors.py", "-k", "reduction"),
    ),
    Mutant(
        "class_axis_hint_off",
        "labels of [B, V, T] logits (F.cross_entropy's layout) get no hint that the class axis goes last",
        "lossspec/checks.py::class_axis_hint",
        "    if len(logits_shape) >= 3 and shape == logits_shape[:1] + logits_shape[2:]:",
        "    if False:",
        ("parity_tests/test_lossspec_checks.py", "-k", "class_axis"),
    ),
    Mutant(
        "check_misses_local_normalisation",
        "accumulate(check=...) lets a loss called without denominator= (normalised per micro-batch) pass",
        "lossspec/accumulation.py::problems",
        '    for call in dict.fromkeys(c for c in losses if not c.denominator and c.normalization != "sum"):',
        "    for call in ():",
        ("parity_tests/test_accumulate_split.py", "-k", "check"),
    ),
    Mutant(
        "check_misses_causal_shift",
        "accumulate(check=...) lets a count without causal_shift pass beside a causal_shift=True loss",
        "lossspec/accumulation.py::problems",
        "        for call in dict.fromkeys(c for c in losses if c.causal_shift != count_shift and c.denominator):",
        "        for call in ():",
        ("parity_tests/test_accumulate_split.py", "-k", "check"),
    ),
    Mutant(
        "loss_calls_unrecorded",
        "the losses do not record their calls, so accumulate(check=...) sees none (and reports nothing checked)",
        "lossspec/checks.py::begin_call",
        "    accumulation.record(name, normalization, causal_shift, denominator)",
        "    pass",
        ("parity_tests/test_accumulate_split.py", "-k", "check"),
    ),
    Mutant(
        "written_out_default_changed",
        "a written-out public loss drifts from the kind table: torchloss.jensen_shannon's beta defaults to 0.25 (jaxloss keeps 0.5)",
        "torchloss/api.py::jensen_shannon",
        "    beta: float = 0.5,",
        "    beta: float = 0.25,",
        ("parity_tests/test_api_signatures.py",),
    ),
    Mutant(
        "lossparity_default_all_backends",
        "lossparity's default runs the interpreted kernels again (the main job takes minutes more)",
        "lossparity/cli.py::<module>",
        'DEFAULT_BACKENDS = ["jax-xla", "torch"]',
        'DEFAULT_BACKENDS = ["jax-xla", "jax-pallas", "torch", "torch-triton"]',
        ("parity_tests/test_parity_cli.py", "-k", "backends_all"),
    ),
    Mutant(
        "lossparity_progress_not_in_place",
        "lossparity's progress on a terminal prints a line per kind instead of rewriting one line in place",
        "lossparity/cli.py::Progress.__init__",
        '        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) and not quiet',
        "        self.tty = False",
        ("parity_tests/test_parity_cli.py", "-k", "terminal"),
    ),
    Mutant(
        "head_dh_missing_column_torch",
        "the torch fused head's dh misses vocabulary column 0 (whole-row chunks) (dh missing a term; "
        "caught under SPEC section 8's componentwise bound on all-positive inputs)",
        "torchloss/head.py::_add_head_grads",
        "                torch.mm(product, rows, out=dh)",
        "                torch.mm(product[:, 1:], rows[1:], out=dh)",
        ("parity_tests/test_linear_head.py", "-k", "torch and all_positive"),
    ),
    Mutant(
        "head_dh_rounded_g_jax",
        "the JAX fused head forms dh from the logits gradient G rounded to bf16 (the shortcut of heads that round G), "
        "caught under the componentwise bound",
        "jaxloss/head.py::_head_grads.widened",
        "        return _dot(g_slice, _rows_f32(w, at, slice_rows), (1, 0)), _dot(g_slice, h32, (0, 0))",
        "        return _dot(g_slice.astype(jnp.bfloat16).astype(F32), _rows_f32(w, at, slice_rows), (1, 0)), _dot(g_slice, h32, (0, 0))",
        ("parity_tests/test_linear_head.py", "-k", "jax and all_positive and reverse_kl"),
    ),
    Mutant(
        "head_jsd_mixture_swapped_jax",
        "the JAX fused head's jensen_shannon mixture sums of whole rows with student and teacher swapped",
        "jaxloss/head.py::_chunk_whole",
        "        fin = _with_mixture(cfg, fin, mixture_block(cfg, fin, z, t), z, shards)",
        "        fin = _with_mixture(cfg, fin, mixture_block(cfg, fin, t, z), z, shards)",
        ("parity_tests/test_linear_head.py", "-k", "jax and jensen_shannon and not blocked and not module"),
    ),
    Mutant(
        "head_jsd_mixture_overlap_jax",
        "the JAX fused head's blocked mixture pass counts the moved-back last block's overlap twice (no column mask)",
        "jaxloss/head.py::_chunk_blocked.pass_mix",
        "            kl_qm, kl_pm = mixture_block(cfg, fin, z, t, col_ok=col_ok)",
        "            kl_qm, kl_pm = mixture_block(cfg, fin, z, t)",
        ("parity_tests/test_linear_head.py", "-k", "jax and jensen_shannon and blocked"),
    ),
    Mutant(
        "head_jsd_mixture_term_torch",
        "the torch fused head's blocked mixture pass adds the student's term KL(q || M) where the teacher's belongs",
        "torchloss/head.py::_chunk_blocked",
        "            sums[1] += kl_pm",
        "            sums[1] += kl_qm",
        ("parity_tests/test_linear_head.py", "-k", "torch and jensen_shannon and blocked"),
    ),
    Mutant(
        "liger_timed_on_its_own_gradient",
        "an in-place contender (Liger's cross-entropy, inplace=True) is timed on its own last gradient: no fresh logits before the call",
        "benchmarks/_worker.py::_call",
        "    bench.prepare()",
        "    pass",
        ("parity_tests/test_benchmarks_smoke.py", "-k", "fresh or liger"),
    ),
    Mutant(
        "floor_reads_once",
        "the two-read-one-write floor counts one read of each valid row",
        "benchmarks/_registry.py::floor_bytes",
        "    reads = 2 * (2 if kind in DISTILL else 1)  # logits (and teacher) twice per valid row",
        "    reads = 1 * (2 if kind in DISTILL else 1)",
        ("parity_tests/test_benchmarks_smoke.py", "-k", "floor"),
    ),
    Mutant(
        "pallas_inplace_not_aliased",
        "jaxloss inplace=True: the Pallas gradient gets a buffer of its own (no input_output_aliases)",
        "jaxloss/backends/pallas.py::fused",
        "                     tuning=tuning, aliases={0: len(out_shapes) - 1} if inplace else None)",
        "                     tuning=tuning, aliases=None)",
        ("parity_tests/test_jaxloss_inplace.py", "-k", "aliases"),
    ),
    Mutant(
        "pallas_final_not_kept",
        "jaxloss: the Pallas forward keeps no final statistics: the 16-bit backward runs every pass again (same numbers, more reads)",
        "jaxloss/backends/pallas.py::<module>",
        "KEEPS_FINAL: bool = True",
        "KEEPS_FINAL: bool = False",
        ("parity_tests/test_jaxloss_upstream_16bit.py", "-k", "alone"),
    ),
    Mutant(
        "pallas_final_fields_misplaced",
        "jaxloss: the Pallas forward stores its final statistics one output off (the loss's slot first): the 16-bit backward reads the wrong statistics",
        "jaxloss/backends/pallas.py::_kernel",
        "            for name, out_ref in zip(fields, refs[4:-1]):  # keep_final: what the \"grad\" mode reads back",
        "            for name, out_ref in zip(fields, refs[3:-2]):  # keep_final: what the \"grad\" mode reads back",
        ("parity_tests/test_jaxloss_upstream_16bit.py",),
    ),
    Mutant(
        "pallas_shard_grad_empty_launch",
        "jaxloss: the Pallas gradient pass launches on an empty batch (the 16-bit backward of zero rows fails to trace)",
        "jaxloss/backends/pallas.py::shard_grad",
        "    if n == 0 or width == 0:  # no program to launch (the 16-bit backward of an empty batch traces this)",
        "    if False:",
        ("parity_tests/test_jaxloss_oracle.py", "-k", "pallas_matrix"),
    ),
    Mutant(
        "inplace_keeps_the_logits_jax",
        "jaxloss inplace=True keeps the logits for the backward (XLA then copies them before the aliased kernel)",
        "jaxloss/_autodiff.py::_weighted_loss_fwd",
        "    return jnp.where(coef != 0, coef * loss, 0.0), (grad, coef, target, None if spec.inplace else x, fin)",
        "    return jnp.where(coef != 0, coef * loss, 0.0), (grad, coef, target, x, fin)",
        ("parity_tests/test_jaxloss_inplace.py", "-k", "aliases"),
    ),
    Mutant(
        "counting_config_keeps_kind",
        "the counting config keeps the call's kind: every teacher kind compiles jaxloss's prepare anew",
        "lossspec/config.py::LossConfig.counting_config",
        "        return LossConfig(kind=kind, normalization=self.normalization, ignore_index=self.ignore_index, causal_shift=self.causal_shift)",
        "        return LossConfig(kind=self.kind, normalization=self.normalization, ignore_index=self.ignore_index, causal_shift=self.causal_shift)",
        ("parity_tests/test_jaxloss_transforms.py", "-k", "share_the_preparation"),
    ),
    Mutant(
        "counting_config_drops_causal_shift",
        "the counting config drops causal_shift: the coefficients weigh the unshifted mask",
        "lossspec/config.py::LossConfig.counting_config",
        "        return LossConfig(kind=kind, normalization=self.normalization, ignore_index=self.ignore_index, causal_shift=self.causal_shift)",
        "        return LossConfig(kind=kind, normalization=self.normalization, ignore_index=self.ignore_index)",
        ("parity_tests/test_jaxloss_transforms.py", "-k", "share_the_preparation"),
    ),
    Mutant(
        "pallas_exp_not_base2",
        "the Pallas kernels' pass 1 computes its exponentials with exp (libdevice's expf on a GPU, about 8 instructions) instead of exp2",
        "jaxloss/backends/pallas.py::_kernel.rows_block.pass1.body",
        "                blk, _, _ = block_stats(cfg, x, t, x_y=no_label, col_ok=col_ok, base2=True, selects=False, minnum=compiled,",
        "                blk, _, _ = block_stats(cfg, x, t, x_y=no_label, col_ok=col_ok, selects=False, minnum=compiled,",
        ("parity_tests/test_jaxloss_pallas_aot.py",),
    ),
    Mutant(
        "pallas_label_fixup_skipped",
        "the Pallas cross-entropy kernel never writes the label's entry again after pass 2: it keeps q without the one-hot term",
        "jaxloss/backends/pallas.py::_kernel.rows_block.pass2",
        "                label_fixup(fin, coef, grad_ref)",
        "                pass",
        ("parity_tests/test_jaxloss_kernels.py", "-k", "pallas"),
    ),
    Mutant(
        "pallas_label_fixup_without_barrier",
        "the compiled Pallas cross-entropy kernel stores the label's entry after pass 2 without a barrier: another thread's pass-2 store of the same entry may land last",
        "jaxloss/backends/pallas.py::_kernel.rows_block.label_fixup",
        "            if compiled:  # interpreted, the stores already run in program order (and it has no barrier)",
        "            if False:",
        ("parity_tests/test_jaxloss_pallas_aot.py",),
    ),
    Mutant(
        "pallas_label_logit_next_column",
        "the Pallas kernel reads the label's logit one column to the right",
        "jaxloss/backends/pallas.py::_kernel.rows_block",
        "            label_logit = plgpu.load(x_ref.at[rows, labels], mask=label_ok, other=0.0).astype(F32)",
        "            label_logit = plgpu.load(x_ref.at[rows, labels + 1], mask=label_ok, other=0.0).astype(F32)",
        ("parity_tests/test_jaxloss_kernels.py", "-k", "pallas"),
    ),
    Mutant(
        "exp2_shift_not_scaled",
        "exp_scaled's base-2 form subtracts the per-row shift (lse) unscaled, in base e units: q is off by a factor per row",
        "jaxloss/_block.py::exp_scaled",
        "    return jnp.exp2(scaled if shift is None else scaled - (shift * LOG2E)[:, None])",
        "    return jnp.exp2(scaled if shift is None else scaled - shift[:, None])",
        ("parity_tests/test_jaxloss_kernels.py", "-k", "pallas"),
    ),
    Mutant(
        "base2_numpy_exp_unscaled",
        "the namespace that gives lossspec's mixture terms exp2 drops log2(e): jensen_shannon's q and p in the Pallas kernels are 2**u, not e**u",
        "jaxloss/_block.py::_Base2Numpy.exp",
        "        return jnp.exp2(u * LOG2E)",
        "        return jnp.exp2(u)",
        ("parity_tests/test_jaxloss_entropy_jsd.py", "-k", "pallas"),
    ),
    Mutant(
        "pallas_softcap_warps_narrow",
        "the Pallas kernels with a soft cap launch with 4 warps (32 values per thread and tensor): jensen_shannon with both caps takes 166-234 registers (spilled before the per-lane sums)",
        "jaxloss/backends/pallas.py::_num_warps",
        "        return GPU_SOFTCAP_WARPS",
        "        return GPU_DEFAULTS.num_warps",
        ("parity_tests/test_jaxloss_pallas_aot.py",),
    ),
    Mutant(
        "pallas_pivot_read_in_the_first_block",
        "the Pallas kernel reads reverse KL's pivot teacher logit at the block-relative column in the row's first block (a wrong pivot is still exact algebra: only huge logits show the cancellation)",
        "jaxloss/backends/pallas.py::_kernel.rows_block.pivot_logit",
        "            col = j * block_vocab + first",
        "            col = first",
        ("parity_tests/test_jaxloss_oracle.py", "-k", "pallas and reverse"),
    ),

    Mutant(
        "pallas_grad_pass_selects",
        "the Pallas gradient pass selects per entry again (a bad row's NaN and the zero rows, after the bf16 conversion on sm_90: a SEL and two PRMT per entry)",
        "jaxloss/backends/pallas.py::_kernel.rows_block.pass2.body",
        "                grad = grad_block(cfg, fin, coef, x, t, vocab=vocab, base2=True, selects=False)",
        "                grad = grad_block(cfg, fin, coef, x, t, vocab=vocab, base2=True)",
        ("parity_tests/test_jaxloss_pallas_aot.py",),
    ),
    Mutant(
        "pallas_bad_row_scale_finite",
        "without selects, a bad row's (NaN / +inf logits) per-row scale stays finite: its gradient is not NaN everywhere",
        "jaxloss/_block.py::grad_block",
        "        scale = jnp.where(bad_rows(fin)[:, None], jnp.nan, scale)",
        "        pass",
        ("parity_tests/test_contract_kinds.py", "-k", "pallas and nan"),
    ),
    Mutant(
        "pallas_dead_rows_not_zeroed",
        "a Pallas program of several rows stores its masked rows' gradient as 0 * dl/dz (NaN where their stand-in statistics overflow) instead of 0",
        "jaxloss/backends/pallas.py::_kernel.rows_block.pass2.body",
        "                if block_rows > 1:",
        "                if block_rows > 8:",
        ("parity_tests/test_jaxloss_vocab_parallel.py", "-k", "garbage"),
    ),
    Mutant(
        "pos_times_clamp_dropped",
        "without selects, a weight times its own shift is taken unclamped: 0 * -inf is NaN at a -inf logit (entropy, forward KL)",
        "jaxloss/_block.py::_pos_times_clamped",
        "    return weight * jnp.maximum(value, -lossspec.FP32_MAX)",
        "    return weight * value",
        ("parity_tests/test_contract_kinds.py", "-k", "pallas"),
    ),
    Mutant(
        "base2_numpy_log1p_libdevice",
        "the Pallas kernels' jensen_shannon takes libdevice's log1pf again: a branch per entry in its mixture and gradient passes",
        "jaxloss/_block.py::_Base2Numpy.log1p",
        "        return jnp.log(1.0 + u)",
        "        return jnp.log1p(u)",
        ("parity_tests/test_jaxloss_pallas_aot.py",),
    ),
    Mutant(
        "mixture_logs_unclamped",
        "without selects, jensen_shannon's log q and log p are not clamped: where p = q = 0 the log-ratios are NaN and so are the unselected products",
        "lossspec/stats.py::mixture_terms",
        "        log_q, log_p = xp.maximum(log_q, -FP32_MAX), xp.maximum(log_p, -FP32_MAX)",
        "        pass",
        ("parity_tests/test_contract_kinds.py", "-k", "pallas"),
    ),

    Mutant(
        "pallas_one_lane_a_block",
        "the Pallas statistics passes read a block as one lane: every statistic is summed across the threads each block again (two barriers a sum)",
        "jaxloss/backends/pallas.py::_kernel.rows_block",
        "        vec = min(block_vocab, max(1, 16 // jnp.dtype(x_ref.dtype).itemsize))",
        "        vec = block_vocab",
        ("parity_tests/test_jaxloss_pallas_aot.py",),
    ),
    Mutant(
        "fold_running_sums_not_rescaled",
        "folding a block into the running statistics keeps the running sums relative to the old maxima when the maxima grow",
        "jaxloss/_block.py::fold",
        "    return stats.add(rescale(cfg, running, blk.m, blk.mt), blk)",
        "    return stats.add(running, blk)",
        ("parity_tests/test_jaxloss_kernels.py", "-k", "pallas"),
    ),
    Mutant(
        "pallas_weighted_shift_selected_on_gpu",
        "the compiled Pallas kernels take soft CE's and forward KL's weighted shift with a compare and a select per entry, not the NaN-dropping minimum",
        "jaxloss/backends/pallas.py::_kernel.rows_block.pass1.body",
        "                blk, _, _ = block_stats(cfg, x, t, x_y=no_label, col_ok=col_ok, base2=True, selects=False, minnum=compiled,",
        "                blk, _, _ = block_stats(cfg, x, t, x_y=no_label, col_ok=col_ok, base2=True, selects=False, minnum=False,",
        ("parity_tests/test_jaxloss_pallas_aot.py",),
    ),
)


def _function_lines(source: str, qualname: str) -> range | None:
    """The 0-based line range of the function ``qualname`` (dotted through classes and enclosing
    functions) in ``source``, or None; ``<module>``: the whole file."""
    if qualname == "<module>":
        return range(0, source.count("\n") + 1)
    parts = qualname.split(".")
    nodes: list[ast.AST] = [ast.parse(source)]
    for part in parts:
        found = [child for node in nodes for child in ast.walk(node)
                 if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part]
        if not found:
            return None
        nodes = found
    if len(nodes) != 1:
        return None
    return range(nodes[0].lineno - 1, nodes[0].end_lineno)


def _old_lines(mutant: Mutant) -> list[str]:
    """The mutant's old lines without their leading spaces (a trailing newline adds none)."""
    return [line.strip() for line in mutant.old.rstrip("\n").split("\n")]


def locate(mutant: Mutant) -> tuple[str, int | str]:
    """``(file text, index of the first line to replace)``, or ``(text, reason)`` when the mutant
    no longer applies. ``old`` may span several consecutive lines."""
    path = ROOT / mutant.path
    if not path.exists():
        return "", f"{mutant.path} does not exist"
    source = path.read_text()
    span = _function_lines(source, mutant.function)
    if span is None:
        return source, f"no single function {mutant.function} in {mutant.path}"
    lines, old = source.split("\n"), _old_lines(mutant)
    hits = [i for i in span if i + len(old) <= span.stop and [line.strip() for line in lines[i:i + len(old)]] == old]
    if len(hits) != 1:
        return source, f"the line occurs {len(hits)} times in {mutant.where}: {mutant.old.strip()!r}"
    return source, hits[0]


def apply(mutant: Mutant, source: str, index: int) -> str:
    """``source`` with the old lines from ``index`` on replaced by ``mutant.new``, re-indented by
    the difference between the first old line's indentation in the file and in the mutant."""
    lines = source.split("\n")
    count = len(_old_lines(mutant))
    first_old = mutant.old.split("\n")[0]
    shift = (len(lines[index]) - len(lines[index].lstrip())) - (len(first_old) - len(first_old.lstrip()))
    new = mutant.new.rstrip("\n")
    new_lines = [] if not new else [(" " * shift + line if shift >= 0 else line[-shift:]) if line.strip() else line
                                    for line in new.split("\n")]
    return "\n".join(lines[:index] + new_lines + lines[index + count:])


def run(mutant: Mutant, timeout_s: int, tests: tuple[str, ...] | None = None) -> dict:
    """Apply ``mutant``, run its tests (or ``tests``), restore the file."""
    path = ROOT / mutant.path
    original, where = locate(mutant)
    if isinstance(where, str):
        return {"name": mutant.name, "status": f"NOT APPLIED ({where})", "seconds": 0.0, "failed": ""}
    path.write_text(apply(mutant, original, where))
    start = time.monotonic()
    try:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "2", "-p", "no:cacheprovider", *(tests or mutant.tests)]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        failed = [line.split(" ", 1)[1].split(" - ")[0] for line in result.stdout.splitlines() if line.startswith("FAILED ")]
        if result.returncode in (4, 5):  # usage error / no test collected: nothing was checked
            status = f"NOT RUN (pytest exit {result.returncode})"
        else:
            status = "caught" if result.returncode != 0 else "MISSED"
            if result.returncode != 0 and not failed:
                status = f"caught (pytest exit {result.returncode})"
    except subprocess.TimeoutExpired:
        status, failed = f"TIMEOUT after {timeout_s} s", []
    finally:
        path.write_text(original)
    return {"name": mutant.name, "status": status, "seconds": time.monotonic() - start, "failed": failed[0] if failed else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma list of mutant names")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
    parser.add_argument("--report", default=None, help="the report's path (default: docs/mutants.md; none with --tests)")
    parser.add_argument("--check", action="store_true", help="only check that every mutant applies (runs no test)")
    parser.add_argument("--list", action="store_true", help="list the mutants (name, where, the bug) and exit")
    parser.add_argument("--tests", default="", help="pytest arguments (one string, shell-split) run instead of each mutant's own tests")
    args = parser.parse_args()
    # A kill (SIGTERM) unwinds like Ctrl-C, so run()'s finally restores the mutated file.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    names = [m.name for m in MUTANTS]
    duplicated = sorted({name for name in names if names.count(name) > 1})
    unknown = [name for name in args.only.split(",") if name and name not in names]
    if duplicated or unknown:
        sys.exit(f"mutant names duplicated: {duplicated}; unknown in --only: {unknown}")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.name}  {m.where}  {m.what}")
        return
    tests = tuple(shlex.split(args.tests)) or None
    report = args.report or (None if tests else str(ROOT / "docs" / "mutants.md"))
    if args.check:
        broken = [(m.name, where) for m in chosen for _, where in [locate(m)] if isinstance(where, str)]
        for name, reason in broken:
            print(f"NOT APPLIED: {name}: {reason}")
        print(f"{len(chosen) - len(broken)} of {len(chosen)} mutants apply")
        sys.exit(1 if broken else 0)
    rows = []
    for i, mutant in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {mutant.name}: {mutant.what} ...", flush=True)
        row = run(mutant, args.timeout, tests)
        print(f"    {row['status']} in {row['seconds']:.0f} s {row['failed']}", flush=True)
        rows.append((mutant, row))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    clean = not subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        "# Mutation check",
        "",
        f"`scripts/mutants.py` applied {len(rows)} one-line bugs at commit `{commit}` (tree {'clean' if clean else 'with uncommitted changes'})"
        f" on {time.strftime('%Y-%m-%d')}; " + (f"each ran `{args.tests}`." if tests else "each ran the tests listed for it."),
        "",
        "| mutant | the bug | where | tests run | result | first failing test |",
        "|---|---|---|---|---|---|",
    ]
    for mutant, row in rows:
        files = " ".join(t for t in (tests or mutant.tests) if t.endswith(".py")).replace("parity_tests/", "")
        lines.append(f"| `{mutant.name}` | {mutant.what} | `{mutant.where}` | {files} | {row['status']} | `{row['failed']}` |")
    caught = sum(row["status"].startswith("caught") for _, row in rows)
    lines += ["", f"{caught} of {len(rows)} caught."]
    if report:
        Path(report).write_text("\n".join(lines) + "\n")
    print(f"{caught} of {len(rows)} caught" + (f"; report: {report}" if report else ""))
    if caught != len(rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
