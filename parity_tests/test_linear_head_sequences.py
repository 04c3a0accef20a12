"""``segment_ids`` and the per-sequence normalisations (``"sequence_mean"``, ``"sequence_sum"``;
lossspec.sequences) on the fused head (``linear_<kind>``) in both frameworks, against the
float64 head oracle (:func:`lossspec.linear.oracle_head`, which applies lossspec.sequences):
packed rows (head_problem.py: several documents per row, padding ids, interleaved ids, an
all-masked row, float weights), with and without ``causal_shift`` (no scoring across a document
boundary), both plans (whole rows, the vocabulary-blocked fallback), ``denominator=``,
``count_denominator`` (``S``), micro-batches with the global ``S`` equal to the full batch
(by hand in both frameworks, and both ``accumulate`` helpers), and the module forms.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss
import jaxloss.nnx  # noqa: F401  (the module forms)
import lossspec
import torchloss
from lossspec import linear as spec_linear

from parity_tests.support.head_cases import block_budget
from parity_tests.support.head_problem import BATCH, KINDS, OPTIONS, make_problem, reference, target_args

VOCAB = 29
MODES = lossspec.SEQUENCE_NORMALIZATIONS
FRAMEWORKS = ("jax", "torch")
# (block_elements, blocked_rows): whole rows of 7 tokens, or chunks of 5 rows and vocabulary
# blocks of 4 columns (29 = 7 * 4 + 1).
PLANS = {"whole": (7 * VOCAB, 64), "blocked": (20, 5)}


@pytest.fixture
def plan(request: pytest.FixtureRequest) -> lossspec.HeadTuning:
    return block_budget(*PLANS[request.param])


def run(framework: str, kind: str, problem: dict[str, Any], rows: slice = slice(None), grad_output: Any = 1.0, **options: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """``(loss, {hidden, weight, bias})`` of ``linear_<kind>`` on the batch rows ``rows``, the
    upstream gradient ``grad_output``; ``segment_ids=True`` passes the problem's ids."""
    if options.pop("segment_ids", None) is not None:
        options["segment_ids"] = problem["segment_ids"][rows]
    if framework == "jax":
        conv: Any = lambda a: jnp.asarray(a)  # noqa: E731
    else:
        conv = lambda a: torch.tensor(a)  # noqa: E731
    if "segment_ids" in options:
        options["segment_ids"] = conv(options["segment_ids"])
    if isinstance(options.get("denominator"), np.ndarray):
        options["denominator"] = conv(options["denominator"])
    fn = getattr(jaxloss if framework == "jax" else torchloss, f"linear_{kind}")
    target, extra = target_args(kind, problem, conv, rows)
    mask = conv(problem["loss_mask"][rows])
    if framework == "jax":
        params = {"hidden": conv(problem["hidden"][rows]), "weight": conv(problem["weight"]), "bias": conv(problem["bias"])}
        loss, vjp = jax.vjp(lambda p: fn(p["hidden"], p["weight"], *target, mask, bias=p["bias"], **extra, **options), params)
        (grads,) = vjp(jnp.asarray(grad_output, jnp.float32))
        return np.asarray(loss, np.float64), {name: np.asarray(g, np.float64) for name, g in grads.items()}
    params = {name: conv(problem[name][rows] if name == "hidden" else problem[name]).requires_grad_(True) for name in ("hidden", "weight", "bias")}
    loss = fn(params["hidden"], params["weight"], *target, mask, bias=params["bias"], **extra, **options)
    loss.backward(torch.tensor(grad_output, dtype=loss.dtype))
    return loss.detach().double().numpy(), {name: p.grad.double().numpy() for name, p in params.items()}


def assert_matches(loss: Any, grads: dict[str, np.ndarray], ref_loss: Any, ref: dict[str, np.ndarray], what: str) -> None:
    lossspec.compare_loss(loss, ref_loss, f"{what} loss").check()
    for name in ("hidden", "weight", "bias"):
        spec_linear.compare_head_grad(grads[name], ref[name], "float32", f"{what} grad {name}", ref.magnitude[name]).check()


def _jax_cover(framework: str, *combo: Any, fast: tuple = ()) -> list[Any]:
    """Each JAX case compiles (seconds): the fast lane keeps the ``fast`` combinations (and every
    torch case), the slow tier the rest."""
    return [pytest.mark.slow] if framework == "jax" and combo not in fast else []


SEQUENCE_FAST = (("cross_entropy", "sequence_mean", True), ("reverse_kl", "sequence_sum", False))


@pytest.mark.parametrize("plan", ["whole"], indirect=True)
@pytest.mark.parametrize(
    "framework,kind,mode,causal_shift",
    [
        pytest.param(framework, kind, mode, shift, marks=_jax_cover(framework, kind, mode, shift, fast=SEQUENCE_FAST))
        for framework in FRAMEWORKS
        for kind in KINDS
        for mode in MODES
        for shift in (False, True)
    ],
)
def test_sequence_modes_match_oracle(framework: str, kind: str, mode: str, causal_shift: bool, plan: lossspec.HeadTuning) -> None:
    problem = make_problem(kind, VOCAB, seed=1)
    options = dict(OPTIONS[kind], normalization=mode, causal_shift=causal_shift, segment_ids=True)
    loss, grads = run(framework, kind, problem, grad_output=1.75, tuning=plan, **options)
    ref_loss, ref = reference(kind, problem, grad_output=1.75, **options)
    assert_matches(loss, grads, ref_loss, ref, f"{framework} {kind} {mode} shift={causal_shift}")


@pytest.mark.parametrize("plan", ["blocked"], indirect=True)
@pytest.mark.parametrize(
    "framework,kind",
    [pytest.param(f, k, marks=_jax_cover(f, k, fast=(("reverse_kl",),))) for f in FRAMEWORKS for k in ("cross_entropy", "reverse_kl")],
)
def test_sequence_mean_on_the_blocked_fallback(framework: str, kind: str, plan: lossspec.HeadTuning) -> None:
    problem = make_problem(kind, VOCAB, seed=2)
    options = dict(OPTIONS[kind], normalization="sequence_mean", causal_shift=True, segment_ids=True)
    loss, grads = run(framework, kind, problem, tuning=plan, **options)
    ref_loss, ref = reference(kind, problem, **options)
    assert_matches(loss, grads, ref_loss, ref, f"{framework} {kind} blocked")


@pytest.mark.parametrize(
    "framework,normalization",
    [pytest.param(f, n, marks=_jax_cover(f, n, fast=(("none",),))) for f in FRAMEWORKS for n in ("valid_tokens", "none", "sequence_sum")],
)
def test_segment_ids_pad_tokens_in_every_mode(framework: str, normalization: str) -> None:
    """An id < 0 is padding (weight 0) in the token modes too; ``"none"`` with a per-token
    upstream gradient; ``denominator=`` overrides ``S``."""
    problem = make_problem("forward_kl", VOCAB, seed=3)
    upstream = np.linspace(0.5, 2.0, problem["loss_mask"].size).reshape(problem["loss_mask"].shape).astype(np.float32) if normalization == "none" else 1.0
    options: dict[str, Any] = dict(OPTIONS["forward_kl"], normalization=normalization, segment_ids=True)
    if normalization == "sequence_sum":
        options["denominator"] = 2.5
    loss, grads = run(framework, "forward_kl", problem, grad_output=upstream, **options)
    ref_loss, ref = reference("forward_kl", problem, grad_output=upstream, **options)
    assert_matches(loss, grads, ref_loss, ref, f"{framework} {normalization}")
    assert not np.any(grads["hidden"][2, 4:]), "padding tokens (id -1) have no gradient"


@pytest.mark.parametrize(
    "mode,causal_shift",
    [pytest.param(mode, shift, marks=[] if (mode, shift) == ("sequence_mean", True) else [pytest.mark.slow]) for mode in MODES for shift in (False, True)],
)
def test_count_denominator_is_the_heads_S(mode: str, causal_shift: bool) -> None:
    """``count_denominator`` (the unfused losses' own) counts the head's sequences: the float64
    count, and with it as ``denominator=`` the head gives its own-count loss."""
    problem = make_problem("cross_entropy", VOCAB, seed=4)
    args = (problem["labels"], problem["loss_mask"])
    ref = lossspec.count_denominator(*args, normalization=mode, causal_shift=causal_shift, segment_ids=problem["segment_ids"])
    assert ref > 0
    counts = {
        "jax": jaxloss.count_denominator(*map(jnp.asarray, args), normalization=mode, causal_shift=causal_shift, segment_ids=jnp.asarray(problem["segment_ids"])),
        "torch": torchloss.count_denominator(*map(torch.tensor, args), normalization=mode, causal_shift=causal_shift, segment_ids=torch.tensor(problem["segment_ids"])),
    }
    for framework, count in counts.items():
        assert float(count) == ref, framework
        options = dict(OPTIONS["cross_entropy"], normalization=mode, causal_shift=causal_shift, segment_ids=True)
        loss, _ = run(framework, "cross_entropy", problem, denominator=np.asarray(float(count), np.float32), **options)
        own, _ = run(framework, "cross_entropy", problem, **options)
        assert float(loss) == pytest.approx(float(own), rel=1e-6)


@pytest.mark.parametrize(
    "framework,kind,mode,causal_shift",
    [
        pytest.param(framework, kind, mode, shift, marks=[pytest.mark.slow] if framework == "jax" and (kind, mode, shift) != ("cross_entropy", "sequence_mean", True) else [])
        for framework in FRAMEWORKS
        for kind in ("cross_entropy", "soft_cross_entropy")
        for mode in MODES
        for shift in (False, True)
    ],
)
def test_microbatches_with_the_global_count_equal_the_full_batch(framework: str, kind: str, mode: str, causal_shift: bool) -> None:
    """Rows split 2 + 1 + 1; ``S`` summed from each micro-batch's ``count_denominator`` and passed
    as ``denominator=``: the summed losses and gradients are the full batch's (float64 oracle)."""
    problem = make_problem(kind, VOCAB, seed=5)
    splits = [slice(0, 2), slice(2, 3), slice(3, BATCH)]
    module: Any = jaxloss if framework == "jax" else torchloss
    conv: Any = jnp.asarray if framework == "jax" else torch.tensor
    mask, ids = problem["loss_mask"], problem["segment_ids"]
    labels: Optional[np.ndarray] = problem.get("labels")
    total = sum(
        float(module.count_denominator(None if labels is None else conv(labels[rows]), conv(mask[rows]), normalization=mode, causal_shift=causal_shift, segment_ids=conv(ids[rows])))
        for rows in splits
    )
    options = dict(OPTIONS[kind], normalization=mode, causal_shift=causal_shift, segment_ids=True)
    loss, grads = 0.0, {"hidden": np.zeros(problem["hidden"].shape), "weight": 0.0, "bias": 0.0}
    for rows in splits:
        part, part_grads = run(framework, kind, problem, rows, denominator=np.asarray(total, np.float32), **options)
        loss += float(part)
        grads["hidden"][rows] = part_grads["hidden"]
        grads["weight"] = grads["weight"] + part_grads["weight"]
        grads["bias"] = grads["bias"] + part_grads["bias"]
    ref_loss, ref = reference(kind, problem, **options)
    assert_matches(loss, grads, ref_loss, ref, f"{framework} {kind} {mode} micro-batched")


def test_torch_accumulate_with_the_head_equals_the_full_batch() -> None:
    """``torchloss.distributed.accumulate`` (K = 3, uneven) around ``linear_cross_entropy`` with
    ``segment_ids`` and ``"sequence_mean"``: the head's parameter gradients of the full batch."""
    from torchloss.distributed import accumulate

    problem = make_problem("cross_entropy", VOCAB, seed=6)
    options = dict(OPTIONS["cross_entropy"], causal_shift=True)
    head = torch.nn.Linear(problem["hidden"].shape[-1], VOCAB)
    with torch.no_grad():
        head.weight.copy_(torch.tensor(problem["weight"]))
        head.bias.copy_(torch.tensor(problem["bias"]))
    batch = {key: torch.tensor(problem[key]) for key in ("hidden", "labels", "loss_mask", "segment_ids")}

    def loss_fn(model: torch.nn.Module, mb: dict[str, torch.Tensor], denominator: Any) -> torch.Tensor:
        return torchloss.linear_cross_entropy(
            mb["hidden"], model.weight, mb["labels"], mb["loss_mask"], bias=model.bias, normalization="sequence_mean",
            denominator=denominator, segment_ids=mb["segment_ids"], **options,
        )

    loss = accumulate(loss_fn, head, batch, num_microbatches=3, normalization="sequence_mean", causal_shift=True)
    ref_loss, ref = reference("cross_entropy", problem, normalization="sequence_mean", segment_ids=True, **options)
    lossspec.compare_loss(float(loss), ref_loss).check()
    spec_linear.compare_head_grad(head.weight.grad.numpy(), ref["weight"], "float32", "weight", ref.magnitude["weight"]).check()
    spec_linear.compare_head_grad(head.bias.grad.numpy(), ref["bias"], "float32", "bias", ref.magnitude["bias"]).check()


@pytest.mark.slow
def test_jax_accumulate_with_the_head_equals_the_full_batch() -> None:
    """``jaxloss.distributed.accumulate`` (K = 2) around ``linear_soft_cross_entropy`` with
    ``segment_ids`` and ``"sequence_sum"``: the head's parameter gradients of the full batch."""
    from jaxloss.distributed import accumulate

    problem = make_problem("soft_cross_entropy", VOCAB, seed=9)
    options = dict(OPTIONS["soft_cross_entropy"], causal_shift=True)
    params = {"weight": jnp.asarray(problem["weight"]), "bias": jnp.asarray(problem["bias"])}
    batch = {key: jnp.asarray(problem[key]) for key in ("hidden", "teacher_hidden", "loss_mask", "segment_ids")}
    teacher = (jnp.asarray(problem["teacher_weight"]), jnp.asarray(problem["teacher_bias"]))

    def loss_fn(p: Any, mb: dict[str, Any], denominator: Any) -> Any:
        return jaxloss.linear_soft_cross_entropy(
            mb["hidden"], p["weight"], mb["teacher_hidden"], teacher[0], mb["loss_mask"], bias=p["bias"], teacher_bias=teacher[1],
            normalization="sequence_sum", denominator=denominator, segment_ids=mb["segment_ids"], **options,
        )

    loss, grads = accumulate(loss_fn, params, batch, num_microbatches=2, normalization="sequence_sum", labels_key=None, causal_shift=True)
    ref_loss, ref = reference("soft_cross_entropy", problem, normalization="sequence_sum", segment_ids=True, **options)
    lossspec.compare_loss(float(loss), ref_loss).check()
    spec_linear.compare_head_grad(np.asarray(grads["weight"]), ref["weight"], "float32", "weight", ref.magnitude["weight"]).check()
    spec_linear.compare_head_grad(np.asarray(grads["bias"]), ref["bias"], "float32", "bias", ref.magnitude["bias"]).check()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_modules_take_segment_ids(framework: str) -> None:
    problem = make_problem("reverse_kl", VOCAB, seed=7)
    options = dict(OPTIONS["reverse_kl"], normalization="sequence_mean")
    ref_loss, ref = reference("reverse_kl", problem, segment_ids=True, **options)
    if framework == "jax":
        loss_fn: Any = jaxloss.nnx.LinearReverseKLLoss(**options)
        conv: Any = jnp.asarray
    else:
        loss_fn = torchloss.nn.LinearReverseKLLoss(**options)
        conv = torch.tensor
    args = [conv(problem[key]) for key in ("hidden", "weight", "teacher_hidden", "teacher_weight")]
    loss = loss_fn(*args, loss_mask=conv(problem["loss_mask"]), bias=conv(problem["bias"]), teacher_bias=conv(problem["teacher_bias"]), segment_ids=conv(problem["segment_ids"]))
    lossspec.compare_loss(float(loss), ref_loss).check()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_segment_ids_errors_are_the_unfused_ones(framework: str) -> None:
    """A wrong shape or dtype of ``segment_ids`` raises the unfused losses' error (lossspec)."""
    problem = make_problem("cross_entropy", VOCAB, seed=8)
    module: Any = jaxloss if framework == "jax" else torchloss
    conv: Any = jnp.asarray if framework == "jax" else torch.tensor
    args = [conv(problem[key]) for key in ("hidden", "weight", "labels")]
    with pytest.raises(ValueError, match="segment_ids"):
        module.linear_cross_entropy(*args, segment_ids=conv(problem["segment_ids"][:, :3]))
    with pytest.raises(TypeError, match="segment_ids"):
        module.linear_cross_entropy(*args, segment_ids=conv(problem["segment_ids"].astype(np.float32)))
