"""Mutation check: apply curated one-line bugs to the library and report which tests catch each.

    .venv/bin/python scripts/mutants.py                  # every mutant, report to docs/mutants.md
    .venv/bin/python scripts/mutants.py --only local_count,z_loss_grad

Each mutant replaces one exact line (it must occur exactly once: a mutant that no longer applies
is reported as such, never skipped silently), runs the tests named for it (pytest ``-x``, the
first failure is enough), and restores the file. A mutant is *caught* when the tests fail.
Not part of CI (it runs the suites once per mutant); its last report is committed as
``docs/mutants.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments (files, -k expressions)


TORCH_ORACLE = ("parity_tests/test_torchloss_oracle.py", "-m", "not slow")
JAX_ORACLE = ("parity_tests/test_jaxloss_oracle.py", "-m", "not slow")

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "z_loss_grad",
        "the z-loss term dropped from the cross-entropy gradient (shared algebra)",
        "lossspec/stats.py",
        "        return fin._replace(q_coef=1.0 + (2.0 * config.z_loss) * full_lse)",
        "        return fin._replace(q_coef=1.0 + 0.0 * full_lse)",
        TORCH_ORACLE,
    ),
    Mutant(
        "rescale_e_d_sign",
        "reverse KL's pivot moved with the wrong sign when blocks or shards combine",
        "lossspec/stats.py",
        "    shift = config.student_scale * dm - config.teacher_scale * (st.tau - tau_new)",
        "    shift = config.student_scale * dm + config.teacher_scale * (st.tau - tau_new)",
        ("parity_tests/test_torchloss_oracle.py", "-k", "vocab_blocks", "parity_tests/test_jaxloss_kernels.py"),
    ),
    Mutant(
        "local_count_torch",
        "torchloss.accumulate divides by the local count (no all_reduce over the replicas)",
        "torchloss/distributed.py",
        "            dist.all_reduce(denominator, op=dist.ReduceOp.SUM, group=group)",
        "            pass",
        ("parity_tests/test_distributed_torch.py",),
    ),
    Mutant(
        "local_count_jax",
        "jaxloss.global_denominator does not psum over the data axes",
        "jaxloss/distributed.py",
        "    return jax.lax.psum(count, axes) if axes else count",
        "    return count",
        ("parity_tests/test_distributed_jax.py",),
    ),
    Mutant(
        "ignored_denominator_torch",
        "torchloss ignores a Python-number denominator= (counts its own tokens)",
        "torchloss/api.py",
        "        return float(denominator)",
        "        return weight.sum()",
        ("parity_tests/test_torchloss_oracle.py", "parity_tests/test_torchloss_autograd.py", "-m", "not slow"),
    ),
    Mutant(
        "skipped_16bit_recompute_torch",
        "torchloss scales the rounded 16-bit gradient instead of recomputing it (two roundings)",
        "torchloss/api.py",
        "        ctx.recompute = need_grad and not inplace and logits.dtype in (torch.bfloat16, torch.float16)",
        "        ctx.recompute = False",
        ("parity_tests/test_torchloss_oracle.py", "parity_tests/test_torchloss_autograd.py", "-m", "not slow"),
    ),
    Mutant(
        "truncated_bf16_store_torch",
        "the torch path truncates the fp32 gradient to bf16 instead of rounding to nearest",
        "torchloss/_stats.py",
        "        out.copy_(g)  # the one rounding to the logits' dtype",
        "        out.copy_(g.view(torch.int32).bitwise_and_(-65536).view(g.dtype) if out.dtype == torch.bfloat16 else g)",
        ("parity_tests/test_rounding_16bit.py", "-k", "torch and nearest"),
    ),
    Mutant(
        "nan_row_hidden_torch",
        "the torch path leaves a NaN-loss row's gradient finite",
        "torchloss/_stats.py",
        '        _fill_rows(g, nan, float("nan"))',
        "        pass",
        ("parity_tests/test_torchloss_reliability.py",),
    ),
    Mutant(
        "label_smoothing_sign_oracle",
        "the oracle's label-smoothing term with a flipped sign",
        "lossspec/oracle.py",
        "                loss = loss - (eps / vocab) * d.sum(axis=-1)",
        "                loss = loss + (eps / vocab) * d.sum(axis=-1)",
        ("parity_tests/test_lossspec_oracle.py",),
    ),
    Mutant(
        "pallas_tail_mask",
        "the Pallas kernel's ragged vocabulary tail mask off by one",
        "jaxloss/_pallas.py",
        "        col_ok = (cols < n_cols)[None, :]",
        "        col_ok = (cols < n_cols - 1)[None, :]",
        ("parity_tests/test_jaxloss_kernels.py",),
    ),
    Mutant(
        "truncated_bf16_store_triton",
        "the Triton kernel truncates the fp32 gradient to bf16 instead of rounding to nearest",
        "torchloss/_triton_kernels.py",
        "        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16",
        "        bits = (bits >> 16) << 16",
        ("parity_tests/test_rounding_16bit.py", "-k", "triton"),
    ),
    Mutant(
        "mask_gradient_jax",
        "jaxloss differentiates the loss w.r.t. a float loss_mask again",
        "jaxloss/api.py",
        "        loss_mask = jax.lax.stop_gradient(loss_mask)",
        "        loss_mask = loss_mask",
        ("parity_tests/test_jaxloss_transforms.py", "-k", "no_gradient"),
    ),
    Mutant(
        "first_order_silent_torch",
        "a create_graph=True gradient silently treated as a constant again",
        "torchloss/api.py",
        "        if create_graph:\n            grad = _first_order_only(grad)",
        "        if False:\n            grad = _first_order_only(grad)",
        ("parity_tests/test_torchloss_reliability.py", "parity_tests/test_torchloss_autograd.py", "-m", "not slow"),
    ),
    Mutant(
        "rkl_nan_fix_skipped_torch",
        "the torch path's reverse KL skips the 0 * inf fix-up on every block (entries of probability 0)",
        "torchloss/_stats.py",
        '        clean = e_d.device.type == "cpu" and bool(torch.isfinite(e_d).all())',
        "        clean = True",
        ("parity_tests/test_torchloss_oracle.py", "-k", "reverse"),
    ),
    Mutant(
        "rkl_grad_mean_sign_torch",
        "the torch path's reverse KL gradient adds e mean_d to the cached products e D instead of subtracting it",
        "torchloss/_stats.py",
        "            g = torch.addcmul(e_times_d, e, (-fin.mean_d)[:, None], out=out if direct else e_times_d)",
        "            g = torch.addcmul(e_times_d, e, fin.mean_d[:, None], out=out if direct else e_times_d)",
        ("parity_tests/test_torchloss_oracle.py", "-k", "reverse"),
    ),
    Mutant(
        "causal_count_unshifted_torch",
        "torchloss.count_denominator(causal_shift=True) counts the unshifted labels (the 20/24 scaling)",
        "torchloss/api.py",
        "    labels, loss_mask = _scored_targets(causal_shift, labels, loss_mask, full_lead, device)",
        "    labels, loss_mask = _scored_targets(False, labels, loss_mask, full_lead, device)",
        ("parity_tests/test_causal_shift.py", "-m", "not slow"),
    ),
    Mutant(
        "hf_local_count",
        "torchloss.hf.for_causal_lm_loss ignores num_items_in_batch (a per-micro-batch mean)",
        "torchloss/hf.py",
        "        logits, targets, ignore_index=ignore_index, denominator=_denominator(num_items_in_batch, logits.device)",
        "        logits, targets, ignore_index=ignore_index, denominator=None",
        ("parity_tests/test_torchloss_hf.py", "-m", "not slow"),
    ),
    Mutant(
        "jsd_beta_swapped",
        "jensen_shannon's beta weights the student's KL term instead of the teacher's (shared algebra)",
        "lossspec/stats.py",
        "    loss = config.beta * kl_pm + (1.0 - config.beta) * kl_qm",
        "    loss = (1.0 - config.beta) * kl_pm + config.beta * kl_qm",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-m", "not slow"),
    ),
    Mutant(
        "jsd_mixture_beta_swapped",
        "the mixture M built as (1 - beta) p + beta q (shared per-entry formula)",
        "lossspec/stats.py",
        "    log_beta, log_rest = math.log(beta), math.log1p(-beta)",
        "    log_rest, log_beta = math.log(beta), math.log1p(-beta)",
        ("parity_tests/test_jaxloss_entropy_jsd.py",),
    ),
    Mutant(
        "jsd_grad_kl_dropped_jax",
        "the - KL(q || M) term dropped from jensen_shannon's gradient (jaxloss)",
        "jaxloss/_stats.py",
        "        gz = (1.0 - cfg.beta) * _pos_times(q, log_qm - fin.kl_qm[:, None])",
        "        gz = (1.0 - cfg.beta) * _pos_times(q, log_qm)",
        ("parity_tests/test_jaxloss_entropy_jsd.py",),
    ),
    Mutant(
        "jsd_grad_kl_dropped_oracle",
        "the - KL(q || M) term dropped from the oracle's jensen_shannon gradient",
        "lossspec/oracle.py",
        "                grad_z = (1.0 - beta) * _where_positive(q, log_q - log_m - kl_qm[:, None])",
        "                grad_z = (1.0 - beta) * _where_positive(q, log_q - log_m)",
        ("parity_tests/test_lossspec_entropy_jsd.py",),
    ),
    Mutant(
        "jsd_end_points_via_mixture",
        "beta = 0 / 1 computed through the mixture (log 0) instead of as the KL kinds",
        "lossspec/config.py",
        '        if self.kind == "jensen_shannon" and self.beta in (0.0, 1.0):',
        "        if False:",
        ("parity_tests/test_lossspec_entropy_jsd.py", "parity_tests/test_torchloss_entropy_jsd.py", "-k", "beta"),
    ),
    Mutant(
        "entropy_rescale_h",
        "entropy's moment h not moved to the new maximum when blocks combine (shared algebra)",
        "lossspec/stats.py",
        "        out = out._replace(h=r * (st.h + st.s * dm))",
        "        out = out._replace(h=r * st.h)",
        ("parity_tests/test_torchloss_entropy_jsd.py", "parity_tests/test_jaxloss_entropy_jsd.py", "-k", "block"),
    ),
    Mutant(
        "entropy_grad_mean_torch",
        "the - h / s term dropped from entropy's gradient (torch path)",
        "torchloss/_stats.py",
        "        d = u.sub_(fin.mean_h[:, None])",
        "        d = u",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-m", "not slow"),
    ),
    Mutant(
        "jsd_grad_kl_dropped_triton",
        "the - KL(q || M) term dropped from jensen_shannon's gradient (Triton kernel)",
        "torchloss/_triton_kernels.py",
        "                g = tl.where(q > 0, q * (log_qm - kl_qm), 0.0) * j_scale",
        "                g = tl.where(q > 0, q * log_qm, 0.0) * j_scale",
        ("parity_tests/test_torchloss_entropy_jsd.py", "-k", "triton_matches"),
    ),
    Mutant(
        "jsd_vp_no_psum_jax",
        "jensen_shannon's mixture sums not summed over the vocabulary shards (jaxloss vocab_parallel)",
        "jaxloss/_vocab_parallel.py",
        "    kl_qm, kl_pm = lax.psum(varying_like(sums, x), _axis(axes))",
        "    kl_qm, kl_pm = sums",
        ("parity_tests/test_jaxloss_entropy_jsd.py", "-k", "test_vocab_parallel_matches_oracle"),
    ),
    Mutant(
        "head_backward_slices_overlap_jax",
        "the fused head's last (moved-back) vocabulary slice adds its overlap with the previous one again (jaxloss)",
        "jaxloss/linear.py",
        "        g_slice = jnp.where(fresh, lax.dynamic_slice_in_dim(g, offset, slice_rows, 1), 0.0)",
        "        g_slice = lax.dynamic_slice_in_dim(g, offset, slice_rows, 1)",
        ("parity_tests/test_linear_head.py", "-k", "jax"),
    ),
    Mutant(
        "head_bf16_rows_shift_jax",
        "a bf16 weight slice widened to fp32 by a wrong shift of its bits (jaxloss head backward)",
        "jaxloss/linear.py",
        "    return lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, F32)",
        "    return lax.bitcast_convert_type(bits.astype(jnp.uint32) << 15, F32)",
        ("parity_tests/test_linear_head.py", "-k", "jax and bfloat16"),
    ),
    Mutant(
        "head_bf16_weight_copy_jax",
        "a bf16 weight slice upcast with a plain dynamic_slice (XLA CPU hoists it: a whole fp32 weight copy)",
        "jaxloss/linear.py",
        "    return lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, F32)",
        "    return lax.dynamic_slice_in_dim(x, start, rows, 0).astype(F32)",
        ("parity_tests/test_linear_head.py", "-k", "temporary_memory"),
    ),
    Mutant(
        "head_weight_rows_overwrite_torch",
        "the torch fused head writes dh per weight slice instead of adding (16-bit weights)",
        "torchloss/linear.py",
        "        first = False\n        if db is not None:",
        "        if db is not None:",
        ("parity_tests/test_linear_head.py", "-k", "torch"),
    ),
    Mutant(
        "head_weight_copy_torch",
        "the torch fused head upcasts a 16-bit weight whole (one fp32 copy) instead of by slices",
        "torchloss/linear.py",
        "        self.step = weight.shape[0] if (weight.dtype == acc and not as_is) else max(1, slice_rows)",
        "        self.step = weight.shape[0]",
        ("parity_tests/test_linear_head.py", "-k", "peak_memory"),
    ),
    Mutant(
        "head_plan_ignores_dtype",
        "the head's block budget counts fp32 logits for 16-bit inputs (twice 1/8 of their logits buffer)",
        "lossspec/linear.py",
        "        block_elements = min(int(rows * vocab * HEAD_MEMORY_FRACTION * logits_itemsize / block_itemsize) // live_blocks, HEAD_MAX_BLOCK_ELEMENTS)",
        "        block_elements = min(int(rows * vocab * HEAD_MEMORY_FRACTION) // live_blocks, HEAD_MAX_BLOCK_ELEMENTS)",
        ("parity_tests/test_linear_head.py", "-k", "memory"),
    ),
    Mutant(
        "softcap_slope_sign",
        "the soft cap's chain-rule factor 1 + (y/cap)^2 instead of 1 - (y/cap)^2 (shared by every backend)",
        "lossspec/stats.py",
        "    return 1.0 - ratio * ratio",
        "    return 1.0 + ratio * ratio",
        ("parity_tests/test_softcap.py", "-m", "not slow"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_torch",
        "the torch vocab-parallel head does not all-reduce the hidden state's gradient over the shards",
        "torchloss/linear.py",
        "            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shards.group)  # the stored gradient's",
        "            pass",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "torch"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_recompute_torch",
        "the torch vocab-parallel head's recompute backward does not all-reduce the hidden state's gradient",
        "torchloss/linear.py",
        "            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=shards.group)  # the recompute backward's",
        "            pass",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "torch"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_jax",
        "the JAX vocab-parallel head does not psum the hidden state's gradient over the shards",
        "jaxloss/linear.py",
        "        dh = lax.psum(dh, _vocab_parallel._axis(shards.axes))  # the stored gradient's",
        "        dh = dh",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "jax"),
    ),
    Mutant(
        "head_vp_dh_not_reduced_recompute_jax",
        "the JAX vocab-parallel head's recompute backward does not psum the hidden state's gradient",
        "jaxloss/linear.py",
        "        dh = lax.psum(dh, _vocab_parallel._axis(shards.axes))  # the recompute backward's",
        "        dh = dh",
        ("parity_tests/test_linear_head_vocab_parallel.py", "-k", "jax"),
    ),
    Mutant(
        "head_replicated_weight_grad_jax",
        "the JAX head's weight gradient not summed over data-parallel replicas inside shard_map",
        "jaxloss/linear.py",
        "    return lax.psum(grad, tuple(sorted(missing))) if missing else grad",
        "    return grad",
        ("parity_tests/test_linear_head_edge.py", "-k", "data_parallel"),
    ),
    Mutant(
        "head_bf16_split_rounds_torch",
        "torch's opt-in bf16 head matmuls take the backward's G as one bf16 term (G rounded)",
        "torchloss/linear.py",
        "    terms = split_bf16(a) if a.dtype == torch.float32 else [a]",
        "    terms = split_bf16(a, 1) if a.dtype == torch.float32 else [a]",
        ("parity_tests/test_linear_head_bf16_matmuls.py", "-k", "torch"),
    ),
    Mutant(
        "triton_matmul_split_two_terms",
        "the Triton bf16 matmul splits an fp32 operand (the head's G) into two bf16 terms, not three",
        "torchloss/_triton_matmul.py",
        "        for _ in tl.static_range(SPLIT - 1):",
        "        for _ in tl.static_range(SPLIT - 2):",
        ("parity_tests/test_linear_head_bf16_matmuls.py", "-k", "triton"),
    ),
    Mutant(
        "recompute_moved_back_slice_twice_jax",
        "JAX's recompute_logits backward adds the moved-back last vocabulary slice's shared columns to dh twice",
        "jaxloss/linear.py",
        "            g = jnp.where(col_ok, grad_block(cfg, fin, cc, z, t, hit=hit, vocab=vocab_total), 0.0)\n            dh_c, dw_j = _head_grads(cut(dh, r0, rows), dw_j, 0, g, hc, w_j, cols)",
        "            g = grad_block(cfg, fin, cc, z, t, hit=hit, vocab=vocab_total)\n            dh_c, dw_j = _head_grads(cut(dh, r0, rows), dw_j, 0, g, hc, w_j, cols)",
        ("parity_tests/test_linear_head_recompute.py", "-k", "jax and not blocked and not causal"),
    ),
    Mutant(
        "recompute_slice_gradient_not_reset_torch",
        "torch's recompute_logits backward carries one vocabulary slice's weight gradient into the next",
        "torchloss/linear.py",
        "            dw_j.zero_()\n",
        "",
        ("parity_tests/test_linear_head_recompute.py", "-k", "torch"),
    ),
    Mutant(
        "exp2_constant_rounded_torch",
        "torch's CPU exponentials take 1/ln 2 to 5 digits (exp2(1.4427 u)): a 3e-6 relative error in every exponent",
        "torchloss/_stats.py",
        "LOG2_E: float = 1.4426950408889634",
        "LOG2_E: float = 1.4427",
        TORCH_ORACLE,
    ),
    Mutant(
        "bad_rows_not_filled_torch",
        "the torch path finalises its rows once at the end but forgets the bad rows' gradient fill there",
        "torchloss/_torch.py",
        "        _stats.fill_bad_rows(grad, fin, coef)",
        "        pass",
        ("parity_tests/test_torchloss_reliability.py", "parity_tests/test_torchloss_oracle.py", "-m", "not slow"),
    ),
    Mutant(
        "row_stats_tile_misplaced_torch",
        "a tile writes its statistics one row off in the torch path's row table (the loss of row r is row r+1's)",
        "torchloss/_torch.py",
        "            torch.stack(values, out=self.table[:, rows])",
        "            torch.stack(values, out=self.table[:, rows.start + (rows.stop < self.table.shape[1]) : rows.stop + (rows.stop < self.table.shape[1])])",
        TORCH_ORACLE,
    ),
    Mutant(
        "gradient_not_advised_huge_torch",
        "the torch path allocates its fresh gradient without the huge-page hint (4 KiB page faults again)",
        "torchloss/_torch.py",
        "        grad = out if out is not None else _cpu.empty_output((rows, vocab), logits.dtype, device)",
        "        grad = out if out is not None else torch.empty((rows, vocab), dtype=logits.dtype, device=device)",
        ("parity_tests/test_torchloss_reliability.py", "-k", "huge"),
    ),
    Mutant(
        "nonfinite_wording_cli",
        "lossparity's NONFINITE lines say \"where the torch's is too\" again (an article before a backend's name)",
        "lossparity/matrix.py",
        '    return "the oracle\'s" if reference == "oracle" else f"{reference}\'s"',
        '    return f"the {reference}\'s"',
        ("parity_tests/test_parity_cli.py", "-k", "nan_that_the_oracle_shares"),
    ),
    Mutant(
        "worker_exit_no_freeze",
        "an xdist worker leaves its whole heap to pytest's last collection (past execnet's 5 s: a KeyboardInterrupt in _xla_gc_callback)",
        "parity_tests/conftest.py",
        "    gc.freeze()",
        "    pass",
        ("parity_tests/test_worker_exit.py",),
    ),
    Mutant(
        "gradient_mapping_shared_torch",
        "the torch path's gradient mapping is mmap's default MAP_SHARED (shmem: no huge pages, 2.5x slower faults)",
        "torchloss/_cpu.py",
        "    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # unmapped with the tensor",
        "    mapping = mmap.mmap(-1, nbytes)  # unmapped with the tensor",
        ("parity_tests/test_torchloss_reliability.py", "-k", "huge"),
    ),
    Mutant(
        "head_bf16_split_rounds_jax",
        "JAX's opt-in bf16 head backward takes G as one bf16 term (what XLA's GPU compiler made of the first split)",
        "jaxloss/linear.py",
        "        terms = split_bf16(g_slice)",
        "        terms = split_bf16(g_slice, 1)",
        ("parity_tests/test_linear_head_bf16_matmuls.py", "-k", "jax"),
    ),
    Mutant(
        "pallas_head_cap_sliced",
        "the Pallas head takes its soft cap as one element of a loaded vector (Pallas' Triton lowering has no slice)",
        "jaxloss/_pallas_linear.py",
        "    return plgpu.load(ops[\"caps\"].at[rows[0] * 0 + which])[:, None]",
        "    return plgpu.load(ops[\"caps\"].at[jnp.arange(2, dtype=jnp.int32)])[which]",
        ("parity_tests/test_linear_head_kernels.py", "-k", "lowers"),
    ),
    Mutant(
        "head_teacher_device_unchecked_jax",
        "the JAX head does not check the teacher's tensors' devices (torch does)",
        "jaxloss/linear.py",
        "        named += list(zip((\"teacher_hidden\", \"teacher_weight\", \"teacher_bias\"), teacher))",
        "        named += []",
        ("parity_tests/test_linear_head.py", "-k", "another_device"),
    ),
    Mutant(
        "head_module_recompute_unchecked",
        "the head modules do not check recompute_logits against impl at construction (the first call fails instead)",
        "lossspec/linear.py",
        "    check_recompute_logits(settings[\"recompute_logits\"], resolved, plain)",
        "    pass",
        ("parity_tests/test_linear_head.py", "-k", "modules_take_impl"),
    ),
    Mutant(
        "bf16_bits_hoisted_jax",
        "the JAX head slices a bf16 weight's bits without tying it to the loop (XLA hoists a copy of the whole weight's bits)",
        "jaxloss/linear.py",
        "    x, start = lax.optimization_barrier((x, start))",
        "    pass",
        ("parity_tests/test_linear_head_recompute.py", "-k", "temporary_memory"),
    ),
    Mutant(
        "recompute_rows_not_budgeted_torch",
        "torch's recompute_logits backward leaves a chunk's widened 16-bit hidden rows out of the plan's budget",
        "torchloss/linear.py",
        "    row_elements = 0 if as_is else sum(h.shape[1] for h in (hidden, None if teacher is None else teacher[0]) if h is not None and h.dtype != acc)",
        "    row_elements = 0",
        ("parity_tests/test_linear_head_recompute.py", "-k", "peak_memory or widened_rows"),
    ),
    Mutant(
        "recompute_dh_not_budgeted",
        "the recompute_logits backward leaves the fp32 dh of 16-bit hidden states out of the plan's budget (both frameworks)",
        "lossspec/linear.py",
        "    return max(budget - (rows * width if fp32_dh_apart else 0), budget // 2)",
        "    return budget",
        ("parity_tests/test_linear_head_recompute.py", "-k", "peak_memory or temporary_memory"),
    ),
)


def run(mutant: Mutant, timeout_s: int) -> dict:
    path = ROOT / mutant.path
    original = path.read_text()
    count = original.count(mutant.old)
    if count != 1:
        return {"name": mutant.name, "status": f"NOT APPLIED (the line occurs {count} times)", "seconds": 0.0, "failed": ""}
    path.write_text(original.replace(mutant.old, mutant.new))
    start = time.monotonic()
    try:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "2", "-p", "no:cacheprovider", *mutant.tests]
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
    parser.add_argument("--report", default=str(ROOT / "docs" / "mutants.md"))
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    rows = []
    for i, mutant in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {mutant.name}: {mutant.what} ...", flush=True)
        row = run(mutant, args.timeout)
        print(f"    {row['status']} in {row['seconds']:.0f} s {row['failed']}", flush=True)
        rows.append((mutant, row))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    clean = not subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        "# Mutation check",
        "",
        f"`scripts/mutants.py` applied {len(rows)} one-line bugs at commit `{commit}` (tree {'clean' if clean else 'with uncommitted changes'})"
        f" on {time.strftime('%Y-%m-%d')}; each ran the tests listed for it.",
        "",
        "| mutant | the bug | file | tests run | result | first failing test |",
        "|---|---|---|---|---|---|",
    ]
    for mutant, row in rows:
        tests = " ".join(t for t in mutant.tests if t.endswith(".py")).replace("parity_tests/", "")
        lines.append(f"| `{mutant.name}` | {mutant.what} | `{mutant.path}` | {tests} | {row['status']} | `{row['failed']}` |")
    caught = sum(row["status"].startswith("caught") for _, row in rows)
    lines += ["", f"{caught} of {len(rows)} caught."]
    Path(args.report).write_text("\n".join(lines) + "\n")
    print(f"{caught} of {len(rows)} caught; report: {args.report}")
    if caught != len(rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
