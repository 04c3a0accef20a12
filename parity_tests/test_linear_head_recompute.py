"""``recompute_logits=True``: the fused head's gradients formed in the backward, the vocabulary
the outer loop, against the float64 head oracle (the bounds of test_linear_head.py), and its
memory: no fp32 ``[V, H]`` weight-gradient accumulator for a 16-bit weight.

The backward runs as planned and with a forced small plan: several vocabulary slices (the last
moved back to end at ``V`` in JAX: its shared columns must not be written twice) and several
token chunks (the last moved back likewise), from the rows' statistics of either forward plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss
import lossspec
import torchloss
from lossspec import linear as spec_linear

from parity_tests.support.head_cases import HT, KINDS, NORMS, RUNNERS, options_for, peak_extra, cases, check, make_inputs, plan  # noqa: F401  (plan: the fixture)

H = 8


RECOMPUTE = {"recompute_logits": True}


@pytest.fixture(params=["planned", "small"])
def backward_plan(request: pytest.FixtureRequest) -> Optional[tuple[int, int]]:
    """The backward's ``(R, B)`` (``HeadTuning.recompute_plan``): as planned (``None``; at these
    tiny shapes, dominated by the ``[B, H]`` slices: one or all tokens per chunk), or 5 rows x 8
    columns in both frameworks (``N = 12``: chunks 5, 5 and a moved-back 2; ``V = 37``: four slices
    of 8 and a moved-back 5)."""
    return None if request.param == "planned" else (5, 8)


def recompute(forward: lossspec.HeadTuning, backward_plan: Optional[tuple[int, int]]) -> dict[str, Any]:
    """The head options of a ``recompute_logits`` call: the forward's block budget ``forward``
    (a ``tuning``) and the backward's ``(R, B)``."""
    return {**RECOMPUTE, "tuning": dataclasses.replace(forward, recompute_plan=backward_plan)}


def test_the_backward_plan_fits_its_budget() -> None:
    """``blocks R B + slices B H + R row_elements <= budget``; all tokens in one chunk while that leaves the
    slices at least HEAD_RECOMPUTE_MIN_COLUMNS wide, otherwise fewer tokens per chunk; a slice
    width that divides V when one at least half as wide exists."""
    for rows, vocab, width, budget, blocks, slices in ((12, 37, 8, 185, 1, 2), (12, 37, 8, 740, 5, 3), (4096, 32768, 1024, 8 << 20, 1, 2), (1 << 20, 32768, 4096, 1 << 24, 2, 3)):
        for row_elements in (0, width):
            r, b = spec_linear.head_plan_recompute(rows, vocab, width, budget, blocks, slices, row_elements)
            assert blocks * r * b + slices * b * width + r * row_elements <= budget, (r, b, row_elements)
    assert spec_linear.head_plan_recompute(4096, 32768, 1024, 8 << 20, 1, 2) == (4096, 1024)  # 1365 -> a divisor of V
    assert spec_linear.head_plan_recompute(4096, 128256, 1024, 8 << 20, 1, 2) == (4096, 1336)  # 128256 = 96 x 1336
    assert spec_linear.head_plan_recompute(4096, 50257, 1024, 8 << 20, 1, 2) == (4096, 1365)  # 29 x 1733: none near
    assert spec_linear.head_plan_recompute(1 << 20, 32768, 4096, 1 << 24, 2, 3) == (26215, 256)  # 40 chunks of <= 26624
    assert spec_linear.head_plan_recompute(4096, 32768, 1024, (8 << 20) - (4 << 20), 2, 3, 1024) == (1024, 512)  # JAX bf16: 1280 -> 4 x 1024
    # torch, bf16: the fp32 dh taken off the budget, the widened rows (H per row) counted in it,
    # the slices half of it (the rows are widened again per slice)
    r, b = spec_linear.head_plan_recompute(4096, 32768, 1024, (8 << 20) - (4 << 20), 1, 2, 1024)
    assert (r, b) == (1024, 1024) and r * b + 2 * b * 1024 + r * 1024 <= 4 << 20


@pytest.mark.parametrize("plan", ["whole"], indirect=True)
@cases("framework,kind,norm,dtype,backward_plan", [list(RUNNERS), list(KINDS), list(NORMS), ["float32", "bfloat16"], ["planned", "small"]],
       slow=lambda framework, kind, norm, dtype, backward_plan: framework == "jax" and (norm != "valid_tokens" or dtype != "float32" or backward_plan == "planned"),
       indirect=("backward_plan",))
def test_recompute_matches_oracle(framework: str, kind: str, norm: str, dtype: str, backward_plan: Optional[tuple[int, int]], plan: lossspec.HeadTuning) -> None:
    check(framework, kind, dtype, True, {**options_for(kind), **NORMS[norm]}, head_options=recompute(plan, backward_plan))


@pytest.mark.parametrize("plan", ["blocked"], indirect=True)
@cases("framework,kind,dtype,backward_plan", [list(RUNNERS), list(KINDS), ["float32", "bfloat16"], ["small"]],
       slow=lambda framework, kind, dtype, backward_plan: framework == "jax" and (kind != "cross_entropy" or dtype != "float32"),
       indirect=("backward_plan",))
def test_recompute_after_the_vocabulary_blocked_forward(
    framework: str, kind: str, dtype: str, backward_plan: Optional[tuple[int, int]], plan: lossspec.HeadTuning
) -> None:
    check(framework, kind, dtype, True, {**options_for(kind), **NORMS["valid_tokens"]}, head_options=recompute(plan, backward_plan))


@cases("framework,kind,norm,backward_plan", [list(RUNNERS), ["cross_entropy", "reverse_kl"], ["valid_tokens", "none"], ["small"]],
       slow=lambda framework, kind, norm, backward_plan: framework == "jax", indirect=("backward_plan",))
def test_recompute_without_bias_causal_shift(framework: str, kind: str, norm: str, backward_plan: Optional[tuple[int, int]]) -> None:
    head_options = recompute(lossspec.HeadTuning(), backward_plan)
    check(framework, kind, "float32", False, {**options_for(kind), **NORMS[norm], "causal_shift": True}, head_options=head_options)


def test_recompute_with_a_nan_row_gives_a_nan_gradient_row() -> None:
    """A NaN hidden state makes that token's loss NaN: its hidden-gradient row is NaN, every
    other row finite, in both frameworks (NaN is never hidden by the backward's recompute)."""
    inputs = make_inputs("cross_entropy", "float32")
    inputs["hidden"][0, 0, 3] = np.nan
    inputs["loss_mask"][0, 0] = 1.0
    grad_output = np.asarray(1.0, np.float32)
    for framework, run in RUNNERS.items():
        _, grads = run("cross_entropy", inputs, "float32", True, {"recompute_logits": True}, grad_output)
        rows = grads["hidden"].reshape(-1, grads["hidden"].shape[-1])
        assert np.isnan(rows[0]).all() and np.isfinite(rows[1:]).all(), framework
        assert np.isnan(grads["weight"]).any(), framework


@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
@pytest.mark.parametrize("mode", ["recompute_logits", "none"])
def test_torch_weight_updated_in_place_before_the_backward_raises(kind: str, mode: str) -> None:
    """A backward that recomputes the head (``recompute_logits=True``, or ``"none"``) reads the
    inputs as the forward saw them: an in-place update of the weight (an optimizer step) between
    forward and backward raises autograd's in-place error (it once gave a wrong hidden gradient,
    max error 1.42, silently); the teacher's weight likewise. Without the update the gradients
    are the oracle's. JAX arrays are immutable: nothing can change under a JAX backward."""
    inputs = make_inputs(kind, "float32")
    options = {**options_for(kind), **(RECOMPUTE if mode == "recompute_logits" else NORMS["none"])}
    grad_output = np.ones(np.shape(inputs["loss_mask"]), np.float32) if mode == "none" else np.asarray(1.0, np.float32)
    targets = ["weight"] + ([] if kind == "cross_entropy" else ["teacher_weight"])
    for changed in [None] + targets:
        hidden = torch.tensor(inputs["hidden"], requires_grad=True)
        weight = torch.tensor(inputs["weight"], requires_grad=True)
        target: tuple = (torch.tensor(inputs["labels"]),) if kind == "cross_entropy" else (torch.tensor(inputs["teacher_hidden"]), torch.tensor(inputs["teacher_weight"]))
        loss = getattr(torchloss, f"linear_{kind}")(hidden, weight, *target, torch.tensor(inputs["loss_mask"]), **options)
        if changed is None:
            loss.backward(torch.tensor(grad_output))
            ref_loss, ref_grads = spec_linear.oracle_head(
                kind, inputs["hidden"], inputs["weight"], inputs["labels"] if kind == "cross_entropy" else (inputs["teacher_hidden"], inputs["teacher_weight"], None),
                inputs["loss_mask"], grad_output=grad_output, **{k: v for k, v in options.items() if k != "recompute_logits"},
            )
            spec_linear.compare_head_grad(hidden.grad.double().numpy(), ref_grads["hidden"], "float32", "dh").check()
            spec_linear.compare_head_grad(weight.grad.double().numpy(), ref_grads["weight"], "float32", "dw").check()
            continue
        with torch.no_grad():
            (weight if changed == "weight" else target[1]).mul_(0.5)  # an optimizer step, in place
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward(torch.tensor(grad_output))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_recompute_logits_must_be_a_bool(framework: str) -> None:
    """``recompute_logits`` is ``True`` or ``False`` (a ``TypeError`` otherwise, the same in both
    frameworks); with the retired head kernels' impl the call is refused before it (lossspec's
    ``HEAD_KERNELS_RETIRED``)."""
    inputs = make_inputs("cross_entropy", "float32")
    framework_fn = jaxloss.linear_cross_entropy if framework == "jax" else torchloss.linear_cross_entropy
    as_array = jnp.asarray if framework == "jax" else torch.tensor
    kernels = "pallas" if framework == "jax" else "triton"
    args = (as_array(inputs["hidden"]), as_array(inputs["weight"]), as_array(inputs["labels"]))
    with pytest.raises(ValueError, match=f"impl='{kernels}': the fused head has no {kernels} kernels any more"):
        framework_fn(*args, impl=kernels, recompute_logits=True)
    with pytest.raises(TypeError, match="recompute_logits must be True or False"):
        framework_fn(*args, recompute_logits="yes")


# --------------------------------------------------------------------------------------------
# Memory: no fp32 [V, H] accumulator
# --------------------------------------------------------------------------------------------

MEM_N, MEM_H, MEM_V = 1024, 128, 4096  # one bf16 [N, V] logits buffer: 8 MiB; the bf16 weight gradient 1 MiB


@pytest.mark.slow  # profiled: two heads' forward + backward
def test_torch_recompute_peak_memory_has_no_fp32_weight_gradient() -> None:
    """bf16: forward + backward hold at most 1/8 of the bf16 logits buffer (the backward's fp32
    ``dh`` and widened hidden rows inside it), the bf16 gradients returned and per-token
    vectors; an fp32 ``[V, H]`` weight gradient (2 MiB) does not fit that. The default path
    holds it (the check can fail); so did this path while ``dh`` and the widened rows were
    outside the plan's budget (3.18 MB against 2.49 MB)."""
    rng = np.random.default_rng(5)
    hidden = torch.tensor(rng.standard_normal((MEM_N, MEM_H)), dtype=torch.bfloat16, requires_grad=True)
    weight = torch.tensor(0.5 * rng.standard_normal((MEM_V, MEM_H)), dtype=torch.bfloat16, requires_grad=True)
    labels = torch.tensor(rng.integers(0, MEM_V, MEM_N))
    allowance = MEM_N * MEM_V * 2 / 8 + (MEM_N + MEM_V) * MEM_H * 2 + 16 * MEM_N * 8

    def step(recompute: bool) -> None:
        torchloss.linear_cross_entropy(hidden, weight, labels, recompute_logits=recompute).backward()
        hidden.grad = weight.grad = None

    step(True)  # warm-up (lazy initialisation outside the measurement)
    peak = peak_extra(lambda: step(True))
    assert peak <= allowance, (peak, allowance)
    assert peak_extra(lambda: step(False)) > allowance


def test_jax_recompute_temporary_memory_has_no_fp32_weight_gradient() -> None:
    """bf16, XLA's accounting of the compiled value-and-grad: temporaries at most 1/8 of the
    bf16 logits buffer (the backward's fp32 ``dh`` and widened rows inside it) and per-token
    vectors; the default path's fp32 weight-gradient accumulator (2 MiB) does not fit that (the
    check can fail), nor did the copy of the whole bf16 weight's bits that XLA hoisted out of
    the backward's loop before ``jaxloss.head._bf16_bits`` kept it inside (2.58 MiB), nor
    the fp32 ``dh`` outside the plan's budget (1.42 MiB; the allowance is 1.13 MiB)."""
    rng = np.random.default_rng(6)
    hidden = jnp.asarray(rng.standard_normal((MEM_N, MEM_H)), jnp.bfloat16)
    weight = jnp.asarray(0.5 * rng.standard_normal((MEM_V, MEM_H)), jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, MEM_V, MEM_N), jnp.int32)
    allowance = MEM_N * MEM_V * 2 / 8 + 16 * MEM_N * 8

    def temp_bytes(recompute: bool) -> int:
        step = jax.jit(jax.value_and_grad(lambda h, w: jaxloss.linear_cross_entropy(h, w, labels, recompute_logits=recompute), argnums=(0, 1)))
        return int(step.lower(hidden, weight).compile().memory_analysis().temp_size_in_bytes)

    assert temp_bytes(True) <= allowance, (temp_bytes(True), allowance)
    assert temp_bytes(False) > allowance


def test_torch_recompute_plan_counts_widened_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backward asks its plan to count each chunk's rows widened to fp32 (``H`` per
    row, plus ``Ht`` with a 16-bit teacher) for 16-bit hidden states, and nothing for fp32 ones
    (their rows are read as they are). At the memory test's small shape the rows are too few to
    show in the peak, so the request itself is checked."""
    requests: list[int] = []
    real = spec_linear.head_plan_recompute

    def recording(*args: Any) -> tuple[int, int]:
        requests.append(args[6] if len(args) > 6 else 0)
        return real(*args)

    monkeypatch.setattr(spec_linear, "head_plan_recompute", recording)
    for kind, dtype, expected in (("cross_entropy", "bfloat16", H), ("cross_entropy", "float32", 0), ("forward_kl", "bfloat16", H + HT)):
        inputs = make_inputs(kind, dtype, seed=11)
        conv = lambda a: torch.tensor(a).to(getattr(torch, dtype))  # noqa: E731  (exact)
        hidden = conv(inputs["hidden"]).requires_grad_(True)
        target = (torch.tensor(inputs["labels"]),) if kind == "cross_entropy" else (conv(inputs["teacher_hidden"]), conv(inputs["teacher_weight"]))
        getattr(torchloss, f"linear_{kind}")(hidden, conv(inputs["weight"]), *target, recompute_logits=True).backward()
        assert requests[-1] == expected, (kind, dtype, requests)
