"""The fused LM head (``linear_<kind>``) in both frameworks against the float64 head oracle.

Loss: SPEC section 6's loss bound; gradients of hidden, weight and bias: SPEC section 8's rule
(the section 6 bound with ``S = max |reference gradient of that tensor|``), 16-bit inputs with
their one ulp. Plans: ``whole`` rows (token chunks of the full vocabulary, a ragged last chunk)
and the vocabulary-blocked fallback (ragged row chunks and vocabulary blocks), forced by a tiny
block budget.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

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
from parity_tests.support.head_cases import (  # noqa: F401  (plan: the fixture)
    KINDS, LEAD, H, HT, V, PLANS, NORMS, OPTIONS, MEM_N, MEM_H, MEM_V, RUNNERS, cases, check, grad_output_for, make_inputs, options_for, peak_extra, plan, reference, run_jax, run_torch,
    target_args,
)

@pytest.mark.parametrize("plan", ["whole"], indirect=True)
@cases("framework,kind,norm,dtype", [list(RUNNERS), list(KINDS), list(NORMS), ["float32", "bfloat16"]],
       slow=lambda framework, kind, norm, dtype: framework == "jax" and (norm != "valid_tokens" or dtype != "float32"))
def test_head_matches_oracle(framework: str, kind: str, norm: str, dtype: str, plan: lossspec.HeadTuning) -> None:
    check(framework, kind, dtype, True, {**options_for(kind), **NORMS[norm]}, head_options={"tuning": plan})


@pytest.mark.parametrize("plan", ["blocked"], indirect=True)
@cases("framework,kind,dtype", [list(RUNNERS), list(KINDS), ["float32", "bfloat16"]],
       slow=lambda framework, kind, dtype: framework == "jax" and (kind != "cross_entropy" or dtype != "float32"))
def test_vocabulary_blocked_fallback(framework: str, kind: str, dtype: str, plan: lossspec.HeadTuning) -> None:
    assert spec_linear.head_plan(int(np.prod(LEAD)), V, *PLANS["blocked"]) == (5, 3)
    check(framework, kind, dtype, True, {**options_for(kind), **NORMS["valid_tokens"]}, head_options={"tuning": plan})


@cases("framework,kind,plan", [list(RUNNERS), list(KINDS), ["whole", "blocked"]], slow=lambda framework, kind, plan: framework == "jax" and plan == "blocked", indirect=("plan",))
def test_without_bias_per_token(framework: str, kind: str, plan: lossspec.HeadTuning) -> None:
    check(framework, kind, "float32", False, {**options_for(kind), **NORMS["none"]}, head_options={"tuning": plan})


@cases(
    "framework,kind,norm,plan",
    [list(RUNNERS), ["cross_entropy", "reverse_kl"], ["valid_tokens", "none"], ["whole", "blocked"]],
    slow=lambda framework, kind, norm, plan: framework == "jax" and (norm == "none" or plan == "blocked"),
    indirect=("plan",),
)
def test_causal_shift(framework: str, kind: str, norm: str, plan: lossspec.HeadTuning) -> None:
    check(framework, kind, "float32", True, {**options_for(kind), **NORMS[norm], "causal_shift": True}, head_options={"tuning": plan})


@cases("framework,beta", [list(RUNNERS), [0.0, 1.0]], slow=lambda framework, beta: framework == "jax")
def test_jensen_shannon_end_points(framework: str, beta: float) -> None:
    """``linear_jensen_shannon`` at ``beta = 0`` / ``1`` is forward / reverse KL, computed as
    those kinds (``LossConfig.formula``: no ``log 0`` of the mixture) against the oracle."""
    check(framework, "jensen_shannon", "float32", True, {**options_for("jensen_shannon"), "beta": beta})


@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
def test_jax_jit_of_grad(kind: str) -> None:
    """``jax.jit(jax.grad(...))`` of the head equals the oracle (the custom_vjp under jit)."""
    inputs = make_inputs(kind, "float32", seed=3)
    target = (inputs["labels"],) if kind == "cross_entropy" else (inputs["teacher_hidden"], inputs["teacher_weight"])
    fn = getattr(jaxloss, f"linear_{kind}")

    @jax.jit
    def step(hidden: Any, weight: Any, bias: Any, mask: Any) -> Any:
        return jax.value_and_grad(lambda h, w, b: fn(h, w, *target, mask, bias=b), argnums=(0, 1, 2))(hidden, weight, bias)

    loss, grads = step(inputs["hidden"], inputs["weight"], inputs["bias"], inputs["loss_mask"])
    ref_loss, ref = reference(kind, {**inputs, "teacher_bias": None}, True, {}, np.asarray(1.0))
    lossspec.compare_loss(np.asarray(loss), ref_loss).check()
    for name, grad in zip(("hidden", "weight", "bias"), grads):
        spec_linear.compare_head_grad(np.asarray(grad), ref[name], "float32", name, ref.magnitude[name]).check()


def test_teacher_gets_no_gradient() -> None:
    """The teacher's hidden states, weight and bias get no gradient (torch: ``None``; JAX: exact
    zeros), and the student's gradients are the oracle's, whose teacher is a constant."""
    inputs = make_inputs("reverse_kl", "float32", seed=4)
    teacher = (inputs["teacher_hidden"], inputs["teacher_weight"], inputs["teacher_bias"])
    ref_loss, ref = spec_linear.oracle_head("reverse_kl", inputs["hidden"], inputs["weight"], teacher)
    t = {k: torch.tensor(inputs[k], requires_grad=True) for k in ("teacher_hidden", "teacher_weight", "teacher_bias")}
    h, w = torch.tensor(inputs["hidden"], requires_grad=True), torch.tensor(inputs["weight"], requires_grad=True)
    loss = torchloss.linear_reverse_kl(h, w, t["teacher_hidden"], t["teacher_weight"], teacher_bias=t["teacher_bias"])
    loss.backward()
    assert all(p.grad is None for p in t.values())
    lossspec.compare_loss(float(loss.detach()), ref_loss, "torch loss").check()
    for name, grad in (("hidden", h.grad), ("weight", w.grad)):
        spec_linear.compare_head_grad(grad.double().numpy(), ref[name], "float32", f"torch grad {name}").check()

    def jax_loss(hidden: Any, weight: Any, th: Any, tw: Any, tb: Any) -> Any:
        return jaxloss.linear_reverse_kl(hidden, weight, th, tw, teacher_bias=tb)

    loss, grads = jax.value_and_grad(jax_loss, argnums=(0, 1, 2, 3, 4))(inputs["hidden"], inputs["weight"], *teacher)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in grads[2:])
    lossspec.compare_loss(float(loss), ref_loss, "jax loss").check()
    for name, grad in zip(("hidden", "weight"), grads[:2]):
        spec_linear.compare_head_grad(np.asarray(grad, np.float64), ref[name], "float32", f"jax grad {name}").check()


# --------------------------------------------------------------------------------------------
# Errors: the same type and message in both frameworks (lossspec.linear)
# --------------------------------------------------------------------------------------------

BAD_CALLS = {
    "transposed weight": (dict(weight=np.zeros((H, V), np.float32)), ValueError, "pass nn.Linear's weight"),
    "bias shape": (dict(bias=np.zeros((V + 1,), np.float32)), ValueError, "bias must have shape [V]"),
    "weight dtype": (dict(weight=np.zeros((V, H), np.float16)), TypeError, "weight must have the dtype of hidden"),
    "labels shape": (dict(labels=np.zeros((3, 5), np.int64)), ValueError, "labels must have the leading shape"),
    "weight rank": (dict(weight=np.zeros((V, H, 1), np.float32)), ValueError, "weight must be a floating-point array of shape [V, H]"),
    "integer hidden": (dict(hidden=np.zeros(LEAD + (H,), np.int32)), TypeError, "hidden must be a floating-point array"),
}


def _call(framework: str, kind: str, **changes: Any) -> None:
    inputs = {**make_inputs(kind, "float32"), **changes}
    if framework == "jax":
        conv = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
        module: Any = jaxloss
    else:
        conv = lambda a: None if a is None else torch.tensor(a)  # noqa: E731
        module = torchloss
    fn = getattr(module, f"linear_{kind}")
    if kind == "cross_entropy":
        fn(conv(inputs["hidden"]), conv(inputs["weight"]), conv(inputs["labels"]), bias=conv(inputs["bias"]))
    else:
        fn(conv(inputs["hidden"]), conv(inputs["weight"]), conv(inputs["teacher_hidden"]), conv(inputs["teacher_weight"]), bias=conv(inputs["bias"]), teacher_bias=conv(inputs["teacher_bias"]))


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_errors_are_the_same_in_both_frameworks(case: str) -> None:
    changes, error, text = BAD_CALLS[case]
    messages = []
    for framework in RUNNERS:
        with pytest.raises(error, match=None) as info:
            _call(framework, "cross_entropy", **changes)
        messages.append(str(info.value))
    assert text in messages[0]
    assert messages[0] == messages[1]


def test_teacher_vocabulary_mismatch_is_refused() -> None:
    messages = []
    for framework in RUNNERS:
        with pytest.raises(ValueError) as info:
            _call(framework, "forward_kl", teacher_weight=np.zeros((V + 2, HT), np.float32), teacher_bias=None)
        messages.append(str(info.value))
    assert "teacher_weight must have the vocabulary of weight" in messages[0] and messages[0] == messages[1]


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------

def test_peak_extra_measures_the_bytes_held_at_once() -> None:
    """The measurement of the torch memory tests: two 4 MiB buffers alive together, both freed, a
    buffer made before the call freed, one more 4 MiB buffer: 8 MiB above the start."""
    held = {"before": torch.empty(1 << 18)}  # 1 MiB, made before the call, freed inside it

    def fn() -> None:
        first, second = torch.ones(1 << 20), torch.ones(1 << 20)  # fp32: 4 MiB each, alive together
        del first, second
        held.clear()
        third = torch.ones(1 << 20)
        del third

    assert peak_extra(fn) == 8 << 20
    assert peak_extra(lambda: None) == 0


@pytest.mark.parametrize("dtype,width", [("float32", MEM_H), ("bfloat16", 128)])
def test_torch_peak_memory_is_an_eighth_of_the_logits(dtype: str, width: int) -> None:
    """Forward + backward of the fused head hold at most 1/8 of one logits buffer in the inputs'
    dtype plus the gradients (fp32, and the 16-bit ones returned) and a few per-token vectors
    (cross-entropy works in one [R, V] block; a bf16 weight is read in fp32 slices, never a
    whole fp32 copy: at H = 128 the copy alone is twice the allowance); the unfused loss holds
    more than the logits (the check can fail)."""
    rng = np.random.default_rng(5)
    torch_dtype = getattr(torch, dtype)
    hidden = torch.tensor(rng.standard_normal((MEM_N, width)), dtype=torch_dtype, requires_grad=True)
    weight = torch.tensor(0.5 * rng.standard_normal((MEM_V, width)), dtype=torch_dtype, requires_grad=True)
    labels = torch.tensor(rng.integers(0, MEM_V, MEM_N))
    itemsize = torch_dtype.itemsize
    logits_bytes = MEM_N * MEM_V * itemsize
    grads_bytes = (MEM_N * width + MEM_V * width + MEM_V) * (4 + (itemsize if itemsize < 4 else 0))
    vectors_bytes = 16 * MEM_N * 8  # per-token vectors (weights, coefficients, labels, row statistics)

    def fused() -> None:
        torchloss.linear_cross_entropy(hidden, weight, labels).backward()

    def unfused() -> None:
        torchloss.cross_entropy(hidden @ weight.T, labels).backward()

    fused()  # warm-up (lazy initialisation outside the measurement)
    peak = peak_extra(fused)
    assert peak <= logits_bytes / 8 + grads_bytes + vectors_bytes, (peak, logits_bytes)
    assert peak_extra(unfused) > logits_bytes  # the measurement sees the logits when they exist


@pytest.mark.slow  # ~100 profiled chunks; the fast lane keeps test_torch_peak_memory_is_an_eighth_of_the_logits
@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
def test_torch_peak_memory_with_soft_caps_is_an_eighth_of_the_logits(kind: str) -> None:
    """The same allowance with every soft cap of the kind set (fp32): the capped block and the
    cap's slope are blocks of their own, which the plan's live blocks must count
    (``torchloss._block.head_live_blocks``; without them cross-entropy held 10.7 times the
    allowance's 1/8, the teacher kinds 3.6). Two kinds (a student cap; both caps); every kind
    measured 0.79-0.87 of the 1/8 once (fp32, this shape)."""
    rng = np.random.default_rng(7)
    spec = lossspec.KIND_SPECS[kind]
    hidden = torch.tensor(rng.standard_normal((MEM_N, MEM_H)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(0.5 * rng.standard_normal((MEM_V, MEM_H)), dtype=torch.float32, requires_grad=True)
    if spec.has_labels:
        target = (torch.tensor(rng.integers(0, MEM_V, MEM_N)),)
    elif spec.has_teacher:
        target = (torch.tensor(rng.standard_normal((MEM_N, MEM_H)), dtype=torch.float32),
                  torch.tensor(0.5 * rng.standard_normal((MEM_V, MEM_H)), dtype=torch.float32))
    else:
        target = ()
    caps = {"logit_softcap": 20.0} | ({"teacher_logit_softcap": 25.0} if spec.has_teacher else {})
    logits_bytes = MEM_N * MEM_V * 4
    grads_bytes = (MEM_N * MEM_H + MEM_V * MEM_H + MEM_V) * 4
    vectors_bytes = 16 * MEM_N * 8

    def fused() -> None:
        getattr(torchloss, f"linear_{kind}")(hidden, weight, *target, **caps).backward()

    fused()
    peak = peak_extra(fused)
    assert peak <= logits_bytes / 8 + grads_bytes + vectors_bytes, (peak, logits_bytes)


def test_whole_rows_plan_with_their_own_live_blocks() -> None:
    """``whole_row_live_blocks`` (torch's jensen_shannon: 6 for whole rows, 16 for rows of
    several blocks) sizes whole-row chunks by its own count, and rows that do not fit it take the
    blocked plan of ``live_blocks``."""
    assert spec_linear.head_plan(1024, 4096, None, 64, 16) == (8, 4096)
    assert spec_linear.head_plan(1024, 4096, None, 64, 16, whole_row_live_blocks=6) == (21, 4096)
    # 40 x 4096: 1/8 is 20480 elements, 3413 a block at 6 (a row does not fit): blocked at 16
    assert spec_linear.head_plan(40, 4096, None, 64, 16, whole_row_live_blocks=6) == spec_linear.head_plan(40, 4096, None, 64, 16) == (40, 32)
    assert torchloss._block.head_live_blocks("jensen_shannon", False, whole_rows=True) == 6
    assert torchloss._block.head_live_blocks("jensen_shannon", True, whole_rows=True) == torchloss._block.head_live_blocks("jensen_shannon", True)


@pytest.mark.slow  # profiled chunks; the fast lane keeps test_torch_peak_memory_is_an_eighth_of_the_logits
@pytest.mark.parametrize("caps", [{}, {"logit_softcap": 20.0, "teacher_logit_softcap": 25.0}], ids=["plain", "capped"])
def test_torch_jensen_shannon_whole_rows_peak_memory(caps: dict[str, float]) -> None:
    """The torch jensen_shannon head plans whole rows with 6 live blocks (its mixture terms in
    place), not the 16 of rows of several blocks: forward + backward still within 1/8 of the
    logits plus the gradients and per-token vectors (fp32), with and without soft caps."""
    rng = np.random.default_rng(9)
    hidden = torch.tensor(rng.standard_normal((MEM_N, MEM_H)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(0.5 * rng.standard_normal((MEM_V, MEM_H)), dtype=torch.float32, requires_grad=True)
    teacher = (torch.tensor(rng.standard_normal((MEM_N, MEM_H)), dtype=torch.float32),
               torch.tensor(0.5 * rng.standard_normal((MEM_V, MEM_H)), dtype=torch.float32))
    assert torchloss.head._plan(lossspec.make_config("jensen_shannon", **caps), hidden, weight, spec_linear.DEFAULT_HEAD_TUNING, None)[1] == MEM_V
    logits_bytes = MEM_N * MEM_V * 4
    grads_bytes = (MEM_N * MEM_H + MEM_V * MEM_H + MEM_V) * 4
    vectors_bytes = 16 * MEM_N * 8

    def fused() -> None:
        torchloss.linear_jensen_shannon(hidden, weight, *teacher, **caps).backward()

    fused()
    peak = peak_extra(fused)
    assert peak <= logits_bytes / 8 + grads_bytes + vectors_bytes, (peak, logits_bytes)


@pytest.mark.parametrize("dtype,width", [("float32", MEM_H), ("float32", 128), ("bfloat16", 128)])
def test_jax_temporary_memory_is_an_eighth_of_the_logits(dtype: str, width: int) -> None:
    """XLA's own accounting of the compiled value-and-grad: temporaries at most 1/8 of one logits
    buffer in the inputs' dtype plus a few per-token vectors, and for 16-bit inputs the fp32
    gradients (the fp32 results are the outputs themselves, XLA writes them in place). Catches a
    second weight gradient (a dot's result before ``dW +=``) and an fp32 copy of a bf16 weight
    (the CPU compiler hoists the upcast of a bf16 slice); the unfused loss needs more than the
    logits (the check can fail)."""
    rng = np.random.default_rng(6)
    hidden = jnp.asarray(rng.standard_normal((MEM_N, width)), dtype)
    weight = jnp.asarray(0.5 * rng.standard_normal((MEM_V, width)), dtype)
    labels = jnp.asarray(rng.integers(0, MEM_V, MEM_N), jnp.int32)
    logits_bytes = MEM_N * MEM_V * jnp.dtype(dtype).itemsize
    fp32_grads_bytes = 0 if dtype == "float32" else (MEM_N * width + MEM_V * width) * 4
    vectors_bytes = 16 * MEM_N * 8  # per-token vectors (weights, coefficients, labels, row statistics)

    def temp_bytes(loss: Any) -> int:
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return int(step.lower(hidden, weight).compile().memory_analysis().temp_size_in_bytes)

    fused = temp_bytes(lambda h, w: jaxloss.linear_cross_entropy(h, w, labels))
    unfused = temp_bytes(lambda h, w: jaxloss.cross_entropy(h @ w.T, labels))
    assert fused <= logits_bytes / 8 + fp32_grads_bytes + vectors_bytes, (fused, logits_bytes)
    assert unfused > logits_bytes


@pytest.mark.parametrize("kind", KINDS)
def test_jax_temporary_memory_with_soft_caps_is_an_eighth_of_the_logits(kind: str) -> None:
    """The same allowance with every soft cap of the kind set (fp32): the capped block and the
    cap's slope are temporaries of their own, which the plan's live blocks must count
    (``jaxloss._block.head_live_blocks``; without them 1.11-1.42 of the allowance)."""
    rng = np.random.default_rng(6)
    spec = lossspec.KIND_SPECS[kind]
    hidden = jnp.asarray(rng.standard_normal((MEM_N, MEM_H)), jnp.float32)
    weight = jnp.asarray(0.5 * rng.standard_normal((MEM_V, MEM_H)), jnp.float32)
    if spec.has_labels:
        target = (jnp.asarray(rng.integers(0, MEM_V, MEM_N), jnp.int32),)
    elif spec.has_teacher:
        target = (jnp.asarray(rng.standard_normal((MEM_N, MEM_H)), jnp.float32), jnp.asarray(0.5 * rng.standard_normal((MEM_V, MEM_H)), jnp.float32))
    else:
        target = ()
    caps = {"logit_softcap": 20.0} | ({"teacher_logit_softcap": 25.0} if spec.has_teacher else {})
    fn = getattr(jaxloss, f"linear_{kind}")
    step = jax.jit(jax.value_and_grad(lambda h, w: fn(h, w, *target, **caps), argnums=(0, 1)))
    temp = int(step.lower(hidden, weight).compile().memory_analysis().temp_size_in_bytes)
    assert temp <= MEM_N * MEM_V * 4 / 8 + 16 * MEM_N * 8, (temp, MEM_N * MEM_V * 4)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


def test_torch_module_takes_an_nn_linear_head() -> None:
    """``torchloss.nn.LinearCrossEntropyLoss`` with an ``nn.Linear``: its weight and bias, the
    oracle's loss and gradients."""
    inputs = make_inputs("cross_entropy", "float32", seed=7)
    head = torch.nn.Linear(H, V)
    with torch.no_grad():
        head.weight.copy_(torch.tensor(inputs["weight"]))
        head.bias.copy_(torch.tensor(inputs["bias"]))
    loss_fn = torchloss.nn.LinearCrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(torch.tensor(inputs["hidden"]), head, torch.tensor(inputs["labels"]), loss_mask=torch.tensor(inputs["loss_mask"]))
    loss.backward()
    ref_loss, ref = reference("cross_entropy", inputs, True, {"label_smoothing": 0.1}, np.asarray(1.0))
    lossspec.compare_loss(loss.item(), ref_loss).check()
    spec_linear.compare_head_grad(head.weight.grad.numpy(), ref["weight"], "float32", "weight", ref.magnitude["weight"]).check()
    spec_linear.compare_head_grad(head.bias.grad.numpy(), ref["bias"], "float32", "bias", ref.magnitude["bias"]).check()
    with pytest.raises(TypeError, match="LinearCrossEntropyLoss"):
        torchloss.nn.LinearCrossEntropyLoss(temperature=2.0)


def test_nnx_module_takes_a_flax_linear_head() -> None:
    """``jaxloss.nnx.LinearForwardKLLoss`` with ``nnx.Linear`` student and teacher heads (kernel
    ``[H, V]``): the oracle's loss and kernel gradient (the transpose of the weight's)."""
    from flax import nnx

    inputs = make_inputs("forward_kl", "float32", seed=8)
    student = nnx.Linear(H, V, rngs=nnx.Rngs(0))
    teacher = nnx.Linear(HT, V, rngs=nnx.Rngs(1))
    student.kernel[...] = jnp.asarray(inputs["weight"].T)
    student.bias[...] = jnp.asarray(inputs["bias"])
    teacher.kernel[...] = jnp.asarray(inputs["teacher_weight"].T)
    teacher.bias[...] = jnp.asarray(inputs["teacher_bias"])
    loss_fn = jaxloss.nnx.LinearForwardKLLoss(temperature=1.5)

    def loss_of(model: Any) -> Any:
        return loss_fn(inputs["hidden"], model, inputs["teacher_hidden"], teacher, loss_mask=inputs["loss_mask"])

    loss, grads = nnx.value_and_grad(loss_of)(student)
    ref_loss, ref = reference("forward_kl", inputs, True, {"temperature": 1.5}, np.asarray(1.0))
    lossspec.compare_loss(np.asarray(loss), ref_loss).check()
    spec_linear.compare_head_grad(np.asarray(grads.kernel[...]).T, ref["weight"], "float32", "kernel", ref.magnitude["weight"]).check()
    spec_linear.compare_head_grad(np.asarray(grads.bias[...]), ref["bias"], "float32", "bias", ref.magnitude["bias"]).check()


@cases("framework,kind", [list(RUNNERS), list(KINDS)], slow=lambda framework, kind: framework == "jax")
def test_module_forms_match_oracle(framework: str, kind: str) -> None:
    """Every head kind's module form (``Linear<Kind>Loss`` of ``torchloss.nn`` / ``jaxloss.nnx``,
    the options at construction), called with the kind's targets (labels, the teacher's hidden
    states and weight, or none), the mask and biases as keywords: the oracle's loss and
    gradients of hidden, weight and bias."""
    inputs = make_inputs(kind, "float32", seed=12)
    options = options_for(kind)
    name = spec_linear.head_module_name(kind)
    grad_output = np.asarray(1.0, np.float32)
    ref_loss, ref = reference(kind, inputs, True, options, grad_output)
    if framework == "torch":
        params = {k: torch.tensor(inputs[k], requires_grad=True) for k in ("hidden", "weight", "bias")}
        target, extra = target_args(kind, inputs, torch.tensor, torch.tensor)
        loss = getattr(torchloss.nn, name)(**options)(params["hidden"], params["weight"], *target, loss_mask=torch.tensor(inputs["loss_mask"]),
                                                     bias=params["bias"], **extra)
        loss.backward()
        loss, grads = float(loss.detach()), {k: p.grad.double().numpy() for k, p in params.items()}
    else:
        target, extra = target_args(kind, inputs, jnp.asarray, jnp.asarray)
        module = getattr(jaxloss.nnx, name)(**options)

        def loss_of(p: dict[str, Any]) -> Any:
            return module(p["hidden"], p["weight"], *target, loss_mask=jnp.asarray(inputs["loss_mask"]), bias=p["bias"], **extra)

        loss, grads = jax.value_and_grad(loss_of)({k: jnp.asarray(inputs[k]) for k in ("hidden", "weight", "bias")})
        loss, grads = float(loss), {k: np.asarray(g, np.float64) for k, g in grads.items()}
    lossspec.compare_loss(loss, ref_loss, f"{framework} {name} loss").check()
    for k, grad in grads.items():
        spec_linear.compare_head_grad(grad, ref[k], "float32", f"{framework} {name} grad {k}", ref.magnitude[k]).check()


def test_arrays_on_another_device_are_refused() -> None:
    """Every head tensor on another device than ``hidden`` is refused before any work, with
    ``lossspec.linear.device_message`` in both frameworks (JAX: a second host device; torch: the
    meta device), the teacher's tensors included."""
    inputs = make_inputs("forward_kl", "float32", seed=9)
    names = ("weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias")
    first, second = jax.devices()[:2]
    for name in names:
        jax_args = {k: jax.device_put(jnp.asarray(inputs[k]), second if k == name else first) for k in ("hidden", *names)}
        with pytest.raises(ValueError, match=f"^{name} must be on the device of hidden"):
            jaxloss.linear_forward_kl(jax_args["hidden"], jax_args["weight"], jax_args["teacher_hidden"], jax_args["teacher_weight"],
                                      bias=jax_args["bias"], teacher_bias=jax_args["teacher_bias"])
        torch_args = {k: torch.tensor(inputs[k], device="meta" if k == name else "cpu") for k in ("hidden", *names)}
        with pytest.raises(ValueError, match=f"^{name} must be on the device of hidden"):
            torchloss.linear_forward_kl(torch_args["hidden"], torch_args["weight"], torch_args["teacher_hidden"], torch_args["teacher_weight"],
                                        bias=torch_args["bias"], teacher_bias=torch_args["teacher_bias"])


def test_both_frameworks_have_one_head_api() -> None:
    """Same function signatures (names, kinds, defaults), the same module call parameters and
    settings, and the head modules exported by both module namespaces."""
    import inspect

    for kind in KINDS:
        name = spec_linear.LINEAR_NAMES[kind]
        jax_sig, torch_sig = inspect.signature(getattr(jaxloss, name)), inspect.signature(getattr(torchloss, name))
        as_list = lambda sig: [(p.name, p.kind, p.default) for p in sig.parameters.values()]  # noqa: E731
        assert as_list(jax_sig) == as_list(torch_sig), name
        assert {"impl", "recompute_logits", "vocab_parallel", "segment_ids"} <= set(jax_sig.parameters)
        module_name = spec_linear.head_module_name(kind)
        assert module_name in jaxloss.nnx.__all__ and module_name in torchloss.nn.__all__
        jax_module, torch_module = getattr(jaxloss.nnx, module_name)(), getattr(torchloss.nn, module_name)()
        assert jax_module.settings == torch_module.settings, module_name
        assert {"impl", "recompute_logits", "vocab_parallel"} <= set(jax_module.settings)
        call_params = lambda f: [p.name for p in inspect.signature(f).parameters.values()]  # noqa: E731
        assert call_params(type(jax_module).__call__) == call_params(type(torch_module).forward), module_name
    assert sorted(jaxloss.nnx.__all__) == sorted(torchloss.nn.__all__)


def test_head_modules_take_impl() -> None:
    """``impl=`` at construction is checked with the functions' errors: the framework path
    (``"auto"`` and its own name) is the head's only one; an impl the framework lacks, and the
    retired head kernels (``"pallas"`` / ``"triton"``: lossspec's message), fail at construction
    and in the functions; ``recompute_logits`` must be a bool."""
    inputs = make_inputs("cross_entropy", "float32", seed=10)
    for package, module, kernel, plain, conv in ((jaxloss, jaxloss.nnx, "pallas", "xla", jnp.asarray), (torchloss, torchloss.nn, "triton", "torch", torch.tensor)):
        other = "triton" if kernel == "pallas" else "pallas"
        with pytest.raises(ValueError, match="impl must be one of"):
            module.LinearReverseKLLoss(impl=other)
        retired = re.escape(spec_linear.HEAD_KERNELS_RETIRED.format(impl=kernel, plain=plain))
        with pytest.raises(ValueError, match=retired):
            module.LinearCrossEntropyLoss(impl=kernel)
        with pytest.raises(ValueError, match=retired):
            module.LinearForwardKLLoss(impl=kernel, vocab_parallel="model" if module is jaxloss.nnx else object())
        with pytest.raises(ValueError, match=retired):
            package.linear_cross_entropy(conv(inputs["hidden"]), conv(inputs["weight"]), conv(inputs["labels"]), impl=kernel)
        with pytest.raises(TypeError, match="recompute_logits must be True or False"):
            module.LinearCrossEntropyLoss(recompute_logits="yes")
        assert module.LinearCrossEntropyLoss(recompute_logits=True).settings["impl"] == "auto"
        for impl in ("auto", plain):  # the same numbers: one path
            loss = package.linear_cross_entropy(conv(inputs["hidden"]), conv(inputs["weight"]), conv(inputs["labels"]), impl=impl)
            ref_loss, _ = spec_linear.oracle_head("cross_entropy", inputs["hidden"], inputs["weight"], inputs["labels"])
            lossspec.compare_loss(float(loss), ref_loss, f"{plain} impl={impl!r}").check()


# --------------------------------------------------------------------------------------------
# All-positive inputs: SPEC section 8's componentwise bound (dh = G W cancels)
# --------------------------------------------------------------------------------------------

from parity_tests.support.head_cases import positive_inputs  # noqa: E402  (kept with its tests)


@cases("framework,kind", [list(RUNNERS), list(KINDS)], slow=lambda framework, kind: framework == "jax" and kind != "reverse_kl")
def test_all_positive_inputs(framework: str, kind: str) -> None:
    """``torch.rand``-style hidden states and weights (Liger's fused-head tests, N=46, H=33,
    V=701): every gradient within section 8's bound, ``4e-6 max(S, |G||W|)`` per element."""
    check(framework, kind, "float32", True, {}, inputs=positive_inputs(kind))


def _positive_logits_grad(kind: str) -> tuple[dict[str, Any], np.ndarray, Any]:
    """The inputs, the float64 logits gradient ``G [N, V]`` and the head reference."""
    inputs = positive_inputs(kind)
    target = spec_linear.head_logits(inputs["teacher_hidden"], inputs["teacher_weight"], inputs["teacher_bias"])
    _, g = lossspec.oracle(kind, spec_linear.head_logits(inputs["hidden"], inputs["weight"]), target, inputs["loss_mask"])
    _, ref = reference(kind, {**inputs, "bias": None}, False, {}, np.asarray(1.0))
    return inputs, g.reshape(-1, g.shape[-1]), ref


def test_dh_bound_is_componentwise() -> None:
    """Why section 8 measures ``dh`` against ``|G||W|``: a logits gradient within section 6's
    bound (each entry off by half of it, ``2e-6 |G|``, all one way, as a row's normaliser
    errs) gives a ``dh`` that the old rule (``4e-6 max |dh|``) rejects on all-positive
    inputs, because ``dh`` cancels and its errors do not; the componentwise rule keeps it with
    margin, and still rejects ``dh`` missing one vocabulary column's term by orders of magnitude."""
    inputs, g, ref = _positive_logits_grad("reverse_kl")
    w = inputs["weight"].astype(np.float64)
    shape = np.shape(ref["hidden"])
    assert ref.magnitude["hidden"].max() > 5 * np.abs(ref["hidden"]).max()  # the cancellation
    perturbed = g + 0.5 * lossspec.GRAD_RTOL * np.abs(g)
    assert lossspec.compare_grad(perturbed, g, "float32", 0.0).error_units <= 0.501  # section 6 holds
    dh = (perturbed @ w).reshape(shape)
    old = spec_linear.compare_head_grad(dh, ref["hidden"], "float32", "dh")
    new = spec_linear.compare_head_grad(dh, ref["hidden"], "float32", "dh", ref.magnitude["hidden"])
    assert old.error_units > 2.0, old.message()
    assert new.error_units <= 0.501, new.message()
    missing = (g[:, 1:] @ w[1:]).reshape(shape)  # dh without vocabulary column 0
    assert spec_linear.compare_head_grad(missing, ref["hidden"], "float32", "dh", ref.magnitude["hidden"]).error_units > 100


def test_componentwise_bound_never_below_the_old_one() -> None:
    """``max(S, M)``: where the magnitude is below ``S`` (a peaked row) the old bound applies."""
    reference_grad = np.array([[1.0, -1e-3], [0.5, 0.0]])
    magnitude = np.array([[3.0, 1e-3], [0.5, 0.0]])
    error = np.array([[0.0, 3.9e-6], [0.0, 0.0]])  # 0.975 x 4e-6 S, far above 4e-6 M there
    assert spec_linear.compare_head_grad(reference_grad + error, reference_grad, "float32", magnitude=magnitude).ok
    error = np.array([[11.9e-6, 0.0], [0.0, 0.0]])  # within 4e-6 M = 12e-6 at the cancelling element
    assert spec_linear.compare_head_grad(reference_grad + error, reference_grad, "float32", magnitude=magnitude).ok
    assert not spec_linear.compare_head_grad(reference_grad + error, reference_grad, "float32").ok


# --------------------------------------------------------------------------------------------
# tuning= (lossspec.HeadTuning): it reaches the plan and the kernels; wrong types are refused
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", list(RUNNERS))
def test_tuning_reaches_the_plan(framework: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small ``block_elements`` / ``blocked_rows`` changes the head's ``(R, B)`` (recorded from
    :func:`lossspec.linear.head_plan`) and still matches the float64 oracle; ``recompute_plan``
    replaces the recompute backward's plan (:func:`~lossspec.linear.head_plan_recompute` is not
    asked). The values are used by no other test, so JAX traces anew."""
    plans: list[tuple[int, int]] = []
    asked: list[tuple[int, int]] = []
    real_plan, real_recompute = spec_linear.head_plan, spec_linear.head_plan_recompute

    def recording_plan(*args: Any, **kwargs: Any) -> tuple[int, int]:
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    def recording_recompute(*args: Any, **kwargs: Any) -> tuple[int, int]:
        asked.append(real_recompute(*args, **kwargs))
        return asked[-1]

    monkeypatch.setattr(spec_linear, "head_plan", recording_plan)
    monkeypatch.setattr(spec_linear, "head_plan_recompute", recording_recompute)
    n = int(np.prod(LEAD))
    # whatever a framework's live blocks (1 to 16), the default budget plans otherwise
    defaults = {real_plan(n, V, None, spec_linear.HEAD_BLOCKED_ROWS, live) for live in range(1, 17)}
    tuning = lossspec.HeadTuning(block_elements=17, blocked_rows=4)  # chunks of 4 rows, blocks of 17 // 4 = 4 columns
    options = {**options_for("cross_entropy"), **NORMS["valid_tokens"]}
    check(framework, "cross_entropy", "float32", True, options, head_options={"tuning": tuning})
    assert set(plans) == {(4, 4)} and (4, 4) not in defaults, (plans, defaults)
    plans.clear()
    check(framework, "cross_entropy", "float32", True, options, head_options={"recompute_logits": True, "tuning": tuning})
    assert set(plans) == {(4, 4)} and asked, (plans, asked)
    asked.clear()
    forced = dataclasses.replace(tuning, recompute_plan=(3, 7))
    check(framework, "cross_entropy", "float32", True, options, head_options={"recompute_logits": True, "tuning": forced})
    assert asked == [], asked


@pytest.mark.parametrize("framework", list(RUNNERS))
def test_tuning_of_the_wrong_type_is_a_type_error(framework: str) -> None:
    """``tuning=`` is ``None`` or a :class:`lossspec.HeadTuning` (lossspec's message), in the
    functions and the module constructors; the losses' :class:`lossspec.Tuning` is named as such."""
    inputs = make_inputs("cross_entropy", "float32", seed=10)
    if framework == "jax":
        package, modules, conv = jaxloss, jaxloss.nnx, jnp.asarray
    else:
        package, modules, conv = torchloss, torchloss.nn, torch.tensor
    args = (conv(inputs["hidden"]), conv(inputs["weight"]), conv(inputs["labels"]))
    for bad in (lossspec.Tuning(), (64, 5), {"block_elements": 15}):
        with pytest.raises(TypeError, match="tuning must be None or a lossspec.HeadTuning"):
            package.linear_cross_entropy(*args, tuning=bad)
        with pytest.raises(TypeError, match="tuning must be None or a lossspec.HeadTuning"):
            modules.LinearCrossEntropyLoss(tuning=bad)
    with pytest.raises(TypeError, match="lossspec.Tuning is the losses'"):
        package.linear_entropy(args[0], args[1], tuning=lossspec.Tuning())
    with pytest.raises(TypeError, match="tuning must be None or a lossspec.Tuning"):
        package.cross_entropy(conv(np.zeros((3, 5), np.float32)), conv(np.zeros(3, np.int64)), tuning=lossspec.HeadTuning())


def test_head_tuning_validates_its_fields() -> None:
    """``lossspec.HeadTuning`` checks its fields on construction (``TypeError`` / ``ValueError``
    naming the field), normalises lists to tuples and is hashable (JAX's static argument)."""
    cases = [
        (dict(block_elements=0), ValueError, "HeadTuning.block_elements must be >= 1"),
        (dict(blocked_rows=2.0), TypeError, "HeadTuning.blocked_rows must be None or an int"),
        (dict(block_elements=True), TypeError, "HeadTuning.block_elements must be None or an int"),
        (dict(recompute_plan=(5,)), TypeError, "HeadTuning.recompute_plan must be None or a pair"),
        (dict(recompute_plan=(5, 0)), ValueError, "HeadTuning.recompute_plan must be >= 1"),
        (dict(bf16_matmul_devices="cuda"), TypeError, "HeadTuning.bf16_matmul_devices must be a tuple of device type names"),
        (dict(triton_matmul_devices=(1,)), TypeError, "HeadTuning.triton_matmul_devices must be a tuple"),
        (dict(split_terms=None), TypeError, "HeadTuning.split_terms must be an int"),
        (dict(split_terms=0), ValueError, "HeadTuning.split_terms must be >= 1"),
        (dict(block_vocab=64), TypeError, "unexpected keyword argument 'block_vocab'"),  # the retired kernels' tiles
    ]
    for fields, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            lossspec.HeadTuning(**fields)
    tuning = lossspec.HeadTuning(recompute_plan=[5, 8], bf16_matmul_devices=["cpu", "cuda"])
    assert tuning.recompute_plan == (5, 8) and tuning.bf16_matmul_devices == ("cpu", "cuda")
    assert hash(tuning) == hash(lossspec.HeadTuning(recompute_plan=(5, 8), bf16_matmul_devices=("cpu", "cuda")))
    assert lossspec.DEFAULT_HEAD_TUNING == lossspec.HeadTuning()
    assert (lossspec.DEFAULT_HEAD_TUNING.split_terms, lossspec.DEFAULT_HEAD_TUNING.triton_matmul_devices) == (spec_linear.HEAD_SPLIT_TERMS, ("cuda",))
    assert lossspec.check_head_tuning(None) is lossspec.DEFAULT_HEAD_TUNING
