"""The fused head with ``vocab_parallel`` (Megatron's column-parallel head: ``weight`` / ``bias``
sharded along ``V``, ``hidden`` replicated) against the float64 oracle of the whole head
(:func:`lossspec.linear.oracle_head`): the loss, the whole gradient of ``hidden`` and each
shard's slice of the weight and bias gradients.

JAX: ``shard_map`` over P = 4 of the 8 host devices (V = 28: shards of 7 columns; the blocked
plan's blocks of 3 columns do not divide them). torch: 2 gloo ranks in one subprocess launch
(torch_head_vp_worker.py: uneven shards 9 + 14, blocks of 4), slow. Cases: the head's kinds (lossspec.HEAD_KINDS) x
{whole rows, the vocabulary-blocked fallback} x {"valid_tokens" with a non-unit upstream
gradient, "none" with per-token upstream gradients}, and "sequence_mean" with segment_ids and
causal_shift; the problems hold masked tokens, ignored labels and an all-masked row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxloss
import jaxloss.nnx  # noqa: F401  (the module forms)
import lossspec
from lossspec import linear as spec_linear

try:
    from jax import shard_map
except ImportError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map

from parity_tests.support import ranks
from parity_tests.support import torch_head_vp_worker as torch_worker
from parity_tests.support.head_problem import KINDS, OPTIONS, make_problem, reference

HERE = Path(__file__).parent
SHARDS, VOCAB = 4, 28  # JAX: even shards of 7 columns
PLANS = {"whole": (5 * 7, 64), "blocked": (15, 5)}  # blocked: chunks of 5 rows, blocks of 3 columns
NORMS = {
    "valid_tokens": {},
    "none": {"normalization": "none"},
    "sequence_mean_shift": {"normalization": "sequence_mean", "causal_shift": True, "segment_ids": True},
    "module": {"module": True},
    "recompute": {"recompute_logits": True},
}
HEAD_ONLY = ("module", "recompute_logits", "tuning")  # how the head is called, not what the oracle computes
FAST = {("cross_entropy", "whole", "valid_tokens"), ("reverse_kl", "blocked", "none"), ("jensen_shannon", "blocked", "valid_tokens")}


def check_shards(
    kind: str, options: dict[str, Any], problem: dict[str, Any], shard_results: list[dict[str, np.ndarray]], bounds: list[tuple[int, int]], what: str,
    dtype: str = "float32",
) -> None:
    """Every shard's loss and ``hidden`` gradient are the whole head's; its weight and bias
    gradients the slices of the whole head's (SPEC sections 6 and 8 bounds)."""
    upstream = torch_worker.upstream(options)
    ref_loss, ref = reference(kind, problem, grad_output=upstream, **options)
    precision = options.get("precision", "exact")
    for (lo, hi), result in zip(bounds, shard_results):
        where = f"{what} shard [{lo}, {hi})"
        spec_linear.compare_head_loss(result["loss"], ref_loss, ref.loss_slack, f"{where} loss").check()
        spec_linear.compare_head_grad(result["hidden"], ref["hidden"], dtype, f"{where} grad hidden", ref.magnitude["hidden"], precision).check()
        assert result["weight"].shape == (hi - lo, ref["weight"].shape[1])
        if precision == "tensor":  # SPEC section 8's tensor bound, in the whole gradient's scale
            for name in ("weight", "bias"):
                scale = np.maximum(ref.magnitude[name][lo:hi], np.abs(ref[name]).max())
                spec_linear.compare_head_grad(result[name], ref[name][lo:hi], dtype, f"{where} grad {name}", scale, "tensor").check()
            continue
        # The bound's scale is the whole gradient's: a wrong shard shows against it just as well.
        lossspec.compare_grad(result["weight"], ref["weight"][lo:hi], dtype, float(np.abs(ref["weight"]).max()), f"{where} grad weight").check()
        lossspec.compare_grad(result["bias"], ref["bias"][lo:hi], dtype, float(np.abs(ref["bias"]).max()), f"{where} grad bias").check()


# --------------------------------------------------------------------------------------------
# JAX: shard_map over the vocabulary axis
# --------------------------------------------------------------------------------------------


def run_jax(kind: str, options: dict[str, Any], problem: dict[str, Any], dtype: str = "float32", check_vma: bool = True) -> list[dict[str, np.ndarray]]:
    """The loss and gradients of each of the SHARDS replicas (``jax.vjp`` inside ``shard_map``,
    with ``check_vma``), the floating-point inputs in ``dtype``."""
    options = dict(options)
    floats = ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias")
    problem = {key: jnp.asarray(value, dtype) if key in floats else value for key, value in problem.items()}
    ids = jnp.asarray(problem["segment_ids"]) if options.pop("segment_ids", False) else None
    module = options.pop("module", False)
    upstream = jnp.asarray(torch_worker.upstream(options))
    mesh = Mesh(np.array(jax.devices()[:SHARDS]), ("vocab",))
    fn = getattr(jaxloss, f"linear_{kind}")
    ce, distill = lossspec.KIND_SPECS[kind].has_labels, lossspec.KIND_SPECS[kind].has_teacher
    teacher = (problem["teacher_hidden"], problem["teacher_weight"], problem["teacher_bias"]) if distill else ()
    target = problem["labels"] if ce else None

    def per_replica(hidden: Any, weight: Any, bias: Any, mask: Any, target: Any, *teacher: Any) -> Any:
        def loss_of(h: Any, w: Any, b: Any) -> Any:
            if module:  # the NNX module, vocab_parallel given at construction
                return jaxloss.nnx.LinearCrossEntropyLoss(vocab_parallel="vocab", **options)(h, w, target, loss_mask=mask, bias=b)
            if ce:
                return fn(h, w, target, mask, bias=b, segment_ids=ids, vocab_parallel="vocab", **options)
            if not distill:
                return fn(h, w, mask, bias=b, segment_ids=ids, vocab_parallel="vocab", **options)
            t_hidden, t_weight, t_bias = teacher
            return fn(h, w, t_hidden, t_weight, mask, bias=b, teacher_bias=t_bias, segment_ids=ids, vocab_parallel="vocab", **options)

        loss, vjp = jax.vjp(loss_of, hidden, weight, bias)
        grads = vjp(upstream)
        # Stack per replica: the test reads each replica's own loss and hidden gradient.
        return loss[None], grads[0][None], grads[1], grads[2]

    teacher_specs = (P(), P("vocab"), P("vocab")) if distill else ()
    step = shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(P(), P("vocab"), P("vocab"), P(), P()) + teacher_specs,
        out_specs=(P("vocab"), P("vocab"), P("vocab"), P("vocab")),
        check_vma=check_vma,
    )
    target_arg = jnp.asarray(target) if ce else jnp.zeros(())
    loss, dh, dw, db = jax.jit(step)(problem["hidden"], problem["weight"], problem["bias"], problem["loss_mask"], target_arg, *teacher)
    width = VOCAB // SHARDS
    return [
        {"loss": np.asarray(loss[k], np.float64), "hidden": np.asarray(dh[k].astype(jnp.float32), np.float64),
         "weight": np.asarray(dw[k * width : (k + 1) * width].astype(jnp.float32), np.float64),
         "bias": np.asarray(db[k * width : (k + 1) * width].astype(jnp.float32), np.float64)}
        for k in range(SHARDS)
    ]


@pytest.mark.parametrize(
    "kind,plan,norm",
    [pytest.param(k, p, n, marks=[] if (k, p, n) in FAST else [pytest.mark.slow]) for k in KINDS for p in PLANS for n in NORMS
     if not (n == "sequence_mean_shift" and p == "blocked") and not (n == "module" and (k, p) != ("cross_entropy", "blocked"))],
)
def test_jax_vocab_parallel_head_matches_oracle(kind: str, plan: str, norm: str) -> None:
    problem = make_problem(kind, VOCAB, seed=12)
    block_elements, blocked_rows = PLANS[plan]
    options = dict(OPTIONS[kind], **NORMS[norm], tuning=lossspec.HeadTuning(block_elements=block_elements, blocked_rows=blocked_rows))
    width = VOCAB // SHARDS
    results = run_jax(kind, options, problem)
    options = {name: value for name, value in options.items() if name not in HEAD_ONLY}
    check_shards(kind, options, problem, results, [(k * width, (k + 1) * width) for k in range(SHARDS)], f"jax {kind} {plan} {norm}")


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["valid_tokens", "recompute"])
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_jax_vocab_parallel_head_without_vma_checks(kind: str, norm: str) -> None:
    """``shard_map(check_vma=False)``: no varying-axes types tell the backward that ``hidden`` is
    replicated, so its gradient is whole only through the head's own ``psum`` of ``dh`` (the
    stored-gradient backward's, or the recompute backward's: with ``check_vma=True`` JAX sums
    a replicated input's cotangent itself, so only this test sees either psum missing)."""
    problem = make_problem(kind, VOCAB, seed=13)
    options = dict(OPTIONS[kind], **NORMS[norm])
    width = VOCAB // SHARDS
    results = run_jax(kind, options, problem, check_vma=False)
    options = {name: value for name, value in options.items() if name not in HEAD_ONLY}
    check_shards(kind, options, problem, results, [(k * width, (k + 1) * width) for k in range(SHARDS)], f"jax {kind} {norm} check_vma=False")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_jax_vocab_parallel_head_in_bfloat16(kind: str) -> None:
    """bfloat16 hidden states and head: the fp32 shard gradients (dh summed in fp32) rounded once."""
    problem = make_problem(kind, VOCAB, seed=13, dtype="bfloat16")
    options = dict(OPTIONS[kind])
    width = VOCAB // SHARDS
    results = run_jax(kind, options, problem, "bfloat16")
    check_shards(kind, options, problem, results, [(k * width, (k + 1) * width) for k in range(SHARDS)], f"jax bf16 {kind}", "bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cross_entropy", "jensen_shannon"])
def test_jax_vocab_parallel_head_tensor_precision(kind: str) -> None:
    """``precision="tensor"`` on shards (bf16): the contract's bounds (SPEC section 8) against the
    whole head's oracle, in the blocked plan."""
    problem = make_problem(kind, VOCAB, seed=14, dtype="bfloat16")
    block_elements, blocked_rows = PLANS["blocked"]
    options = dict(OPTIONS[kind], precision="tensor", tuning=lossspec.HeadTuning(block_elements=block_elements, blocked_rows=blocked_rows))
    width = VOCAB // SHARDS
    results = run_jax(kind, options, problem, "bfloat16")
    options = {name: value for name, value in options.items() if name not in HEAD_ONLY}
    check_shards(kind, options, problem, results, [(k * width, (k + 1) * width) for k in range(SHARDS)], f"jax tensor {kind}", "bfloat16")


def test_jax_vocab_parallel_outside_shard_map_is_refused() -> None:
    problem = make_problem("cross_entropy", VOCAB)
    with pytest.raises(ValueError, match="not a bound axis"):
        jaxloss.linear_cross_entropy(problem["hidden"], problem["weight"], problem["labels"], vocab_parallel="vocab")
    with pytest.raises(TypeError, match="vocab_parallel must be a mesh axis name"):
        jaxloss.linear_cross_entropy(problem["hidden"], problem["weight"], problem["labels"], vocab_parallel=3)


@pytest.mark.parametrize("shards", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_jax_vocab_parallel_head_memory_is_an_eighth_of_the_local_logits(shards: int) -> None:
    """XLA's accounting of one replica's compiled value-and-grad (``shard_map``): temporaries at
    most 1/8 of the shard's fp32 logits ``[N, V_local]`` plus the fp32 gradients of ``hidden`` and
    the weight shard, whatever the number of shards (the global ``V``); the unfused
    vocab-parallel loss holds more than the shard's logits (the check can fail)."""
    n, width, vocab_local = 1024, 16, 4096
    mesh = Mesh(np.array(jax.devices()[:shards]), ("vocab",))
    hidden = jnp.zeros((n, width), jnp.float32)
    weight = jnp.zeros((vocab_local * shards, width), jnp.float32)
    labels = jnp.zeros((n,), jnp.int32)

    def temp_bytes(loss: Any) -> int:
        def step(h: Any, w: Any, y: Any) -> Any:
            return jax.value_and_grad(lambda h, w: loss(h, w, y), argnums=(0, 1))(h, w)

        mapped = shard_map(step, mesh=mesh, in_specs=(P(), P("vocab"), P()), out_specs=(P(), (P(), P("vocab"))))
        return int(jax.jit(mapped).lower(hidden, weight, labels).compile().memory_analysis().temp_size_in_bytes)

    logits_bytes = n * vocab_local * 4
    grads_bytes = (n * width + vocab_local * width) * 4
    fused = temp_bytes(lambda h, w, y: jaxloss.linear_cross_entropy(h, w, y, vocab_parallel="vocab"))
    assert fused <= logits_bytes / 8 + 2 * grads_bytes, (fused, logits_bytes)
    unfused = temp_bytes(lambda h, w, y: jaxloss.cross_entropy(h @ w.T, y, vocab_parallel="vocab"))
    assert unfused > logits_bytes, unfused


# --------------------------------------------------------------------------------------------
# torch: 2 gloo ranks, one launch
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    return ranks.launch_once("head_vp_ranks", HERE / "support" / "torch_head_vp_worker.py", lambda out_dir: [str(out_dir)], torch_worker.WORLD, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(torch_worker.CASES))
def test_torch_vocab_parallel_head_matches_oracle(torch_ranks: list[dict[str, np.ndarray]], case: str) -> None:
    kind, _, options = torch_worker.CASES[case]
    options = {name: value for name, value in options.items() if name not in HEAD_ONLY}
    dtype = torch_worker.dtype_of(options)
    problem = make_problem(kind, torch_worker.VOCAB, seed=11, dtype=dtype)
    bounds = list(zip(torch_worker.BOUNDS[:-1], torch_worker.BOUNDS[1:]))
    results = [{key: rank_result[f"{case}/{key}"].astype(np.float64) for key in ("loss", "hidden", "weight", "bias")} for rank_result in torch_ranks]
    check_shards(kind, options, problem, results, bounds, f"torch {case}", dtype)
    # The loss and the hidden gradient are the same bits on both ranks (one all-reduce each).
    assert np.array_equal(results[0]["loss"], results[1]["loss"]) and np.array_equal(results[0]["hidden"], results[1]["hidden"])


def test_torch_vocab_parallel_needs_a_process_group() -> None:
    import torch

    import torchloss

    problem = make_problem("cross_entropy", VOCAB)
    with pytest.raises(TypeError, match="vocab_parallel must be a torch.distributed ProcessGroup"):
        torchloss.linear_cross_entropy(*(torch.tensor(problem[k]) for k in ("hidden", "weight", "labels")), vocab_parallel="vocab")
