"""``logit_softcap`` / ``teacher_logit_softcap`` (``x -> cap * tanh(x / cap)`` on the raw logits,
before the scales and the temperature) in both frameworks against the float64 oracle.

Every kind x {jax XLA, torch path} x {float32, bfloat16} at the SPEC bounds, with the scales and
the temperature set (the order matters: cap first), whole and vocabulary-blocked rows, the
16-bit recompute for a non-unit upstream gradient, NaN / +-inf entries, the fused head,
``torch.compile(fullgraph=True)``, JAX vocab-parallel; the option checks (the same message in
both frameworks); the oracle itself against finite differences. Slow: interpreted Pallas and
Triton (and Triton's own ``tanh``), torch vocab-parallel (2 gloo ranks, torch and Triton).
The Triton cases run on ``torch_problem.TRITON_DEVICE`` (compiled on CUDA tensors where CUDA is
available, else interpreted on CPU tensors), inputs made on the host either way; the gloo ranks'
Triton row needs the interpreter and is skipped where CUDA is available.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, PartitionSpec as P
from parity_tests.support.head_cases import PLANS, block_budget, grad_output_for, make_inputs, reference, run_jax, run_torch
from parity_tests.support.torch_cases import TORCH_DTYPES, quiet

import jaxloss
import lossspec
import torchloss
from lossspec import linear as spec_linear

from parity_tests.support import ranks
from parity_tests.support.torch_problem import TRITON_DEVICE, device_for

KINDS = lossspec.ALL_KINDS
DTYPES = ("float32", "bfloat16")
# Strong caps on N(0, 2) logits: most entries are on the curved part of tanh.
STUDENT_CAP, TEACHER_CAP = 3.5, 5.0


def softcap_options(
    kind: str, student: Optional[float] = STUDENT_CAP, teacher: Optional[float] = TEACHER_CAP, smoothing: bool = False
) -> dict[str, Any]:
    """The caps of ``kind`` (the teacher's only where there is a teacher) with non-unit scales
    and temperature, so that applying the cap after them would show; cross-entropy with z-loss
    (and label smoothing, where no logit is ``-inf``: the true loss is ``+inf`` there)."""
    options: dict[str, Any] = {"logit_softcap": student, "logit_scale": 1.3}
    if kind != "cross_entropy":
        options["temperature"] = 1.5
    if kind in lossspec.DISTILL_KINDS:
        options.update(teacher_logit_softcap=teacher, teacher_logit_scale=0.8)
    if kind == "cross_entropy":
        options.update(label_smoothing=0.1 if smoothing else 0.0, z_loss=1e-3)
    if kind == "jensen_shannon":
        options["beta"] = 0.3
    return options


def _case(kind: str, scenario: str = "random", dtype: str = "float32", **kwargs: Any) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, dtype=dtype, **kwargs)


def _scaled(case: lossspec.Case, factor: float) -> lossspec.Case:
    """``case`` with its logits (and teacher logits) times a power of two (still exact)."""
    target = case.target if case.kind in ("cross_entropy", "entropy") else case.target * factor
    return dataclasses.replace(case, logits=case.logits * factor, target=target)


def _params(names: str, combos: list[tuple], fast: Any, indirect: tuple[str, ...] = ()) -> Any:
    """``pytest.mark.parametrize`` over ``combos``, those for which ``fast(*combo)`` is false marked
    slow: JAX compiles every case, so the fast lane keeps a cover (the torch path, and JAX for
    some kinds); CI runs them all."""
    params = [pytest.param(*c, marks=[] if fast(*c) else [pytest.mark.slow]) for c in combos]
    return pytest.mark.parametrize(names, params, indirect=list(indirect))


IMPLS = ("xla", "torch")
FAST_JAX_KINDS = ("cross_entropy", "jensen_shannon")


def _reference(case: lossspec.Case, grad_output: Any, options: dict[str, Any]) -> lossspec.Reference:
    ref_options = dict(options)
    if grad_output is not None:
        ref_options["grad_output"] = np.asarray(grad_output, np.float64)
    return case.reference(**ref_options)


# --------------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------------


def run_jax_loss(case: lossspec.Case, impl: str = "xla", grad_output: Any = None, **options: Any) -> tuple[np.ndarray, np.ndarray]:
    fn = getattr(jaxloss, case.kind)
    x = jnp.asarray(case.logits).astype(case.dtype)
    target = () if case.target is None else (jnp.asarray(case.target) if case.kind == "cross_entropy" else jnp.asarray(case.target).astype(case.dtype),)
    mask = None if case.loss_mask is None else jnp.asarray(case.loss_mask)
    loss, vjp = jax.vjp(lambda z: fn(z, *target, mask, impl=impl, **options), x)
    (grad,) = vjp(jnp.ones_like(loss) if grad_output is None else jnp.asarray(grad_output, jnp.float32))
    assert grad.dtype == x.dtype
    return np.asarray(loss, np.float64), np.asarray(grad.astype(jnp.float32), np.float64)


def run_torch_loss(case: lossspec.Case, impl: str = "torch", grad_output: Any = None, **options: Any) -> tuple[np.ndarray, np.ndarray]:
    """Inputs made on the host; impl="triton" runs on ``TRITON_DEVICE`` (compiled kernels on
    CUDA, else the interpreter on the CPU), the torch path on the CPU; results back on the host."""
    fn = getattr(torchloss, case.kind)
    device = device_for(impl)
    dtype = TORCH_DTYPES[case.dtype]
    x = torch.from_numpy(case.logits).to(dtype).to(device).requires_grad_(True)
    target = () if case.target is None else ((torch.from_numpy(case.target) if case.kind == "cross_entropy" else torch.from_numpy(case.target).to(dtype)).to(device),)
    mask = None if case.loss_mask is None else torch.from_numpy(np.array(case.loss_mask)).to(device)
    with quiet():
        loss = fn(x, *target, mask, impl=impl, **options)
        upstream = torch.ones_like(loss) if grad_output is None else torch.as_tensor(np.asarray(grad_output), dtype=loss.dtype).to(device)
        loss.backward(upstream.expand_as(loss))
    assert x.grad is not None and x.grad.dtype == dtype
    return loss.detach().cpu().double().numpy(), x.grad.cpu().double().numpy()


RUNNERS = {"xla": run_jax_loss, "torch": run_torch_loss, "pallas": run_jax_loss, "triton": run_torch_loss}


def check(case: lossspec.Case, impl: str, grad_output: Any = None, tuning: Optional[lossspec.Tuning] = None, **options: Any) -> None:
    loss, grad = RUNNERS[impl](case, impl, grad_output, tuning=tuning, **options)
    ref = _reference(case, grad_output, options)
    lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=f"{impl} {case.name} {options}")


# --------------------------------------------------------------------------------------------
# The oracle and the option checks (lossspec)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_gradient_is_the_derivative(kind: str) -> None:
    """The oracle's analytic gradient (chain rule through the cap) against central differences
    of its loss in float64, and the loss against the uncapped oracle on capped logits."""
    case = _case(kind, "float_weights", vocab=9, lead_shape=(4,), seed=2)
    options = softcap_options(kind, smoothing=True)
    loss, grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask, **options)
    x = case.logits.astype(np.float64)
    step = 1e-6
    numeric = np.zeros_like(x)
    for index in np.ndindex(*x.shape):
        delta = np.zeros_like(x)
        delta[index] = step
        up, _ = lossspec.oracle(kind, x + delta, case.target, case.loss_mask, **options)
        down, _ = lossspec.oracle(kind, x - delta, case.target, case.loss_mask, **options)
        numeric[index] = (up - down) / (2 * step)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    capped = STUDENT_CAP * np.tanh(x / STUDENT_CAP)
    target = case.target
    if kind in lossspec.DISTILL_KINDS:
        target = TEACHER_CAP * np.tanh(case.target.astype(np.float64) / TEACHER_CAP)
    plain = {k: v for k, v in options.items() if not k.endswith("softcap")}
    want, _ = lossspec.oracle(kind, capped, target, case.loss_mask, **plain)
    assert abs(loss - want) <= 1e-12 * max(1.0, abs(want))


@pytest.mark.parametrize("kind", KINDS)
def test_oracle_vocab_parallel_agrees(kind: str) -> None:
    case = _case(kind, "neg_inf", vocab=23, lead_shape=(5,))
    options = softcap_options(kind)
    loss, grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask, **options)
    loss_vp, grad_vp = lossspec.oracle_vocab_parallel(kind, case.logits, case.target, case.loss_mask, num_shards=3, **options)
    assert abs(loss - loss_vp) <= 1e-12 * max(1.0, abs(loss))
    np.testing.assert_allclose(grad_vp, grad, rtol=0, atol=1e-14)


BAD_CAPS = [
    (0.0, ValueError, "logit_softcap must be None or > 0, got 0.0"),
    (-2.0, ValueError, "logit_softcap must be None or > 0, got -2.0"),
    (float("inf"), ValueError, "logit_softcap must be finite, got inf"),
    (float("nan"), ValueError, "logit_softcap must be finite, got nan"),
    ("30", TypeError, "logit_softcap must be a Python number, got str"),
    (True, TypeError, "logit_softcap must be a Python number, got bool"),
    # outside the float32 range (an all-NaN gradient / a NaN loss before)
    (1e-300, ValueError, "logit_softcap must be a normal float32 number, magnitude in [1.1754944e-38, 3.4028235e+38] (it is used in float32); got 1e-300"),
    (1e300, ValueError, "logit_softcap must be a normal float32 number, magnitude in [1.1754944e-38, 3.4028235e+38] (it is used in float32); got 1e+300"),
]


@pytest.mark.parametrize("value,error,message", BAD_CAPS)
def test_bad_caps_same_error_everywhere(value: Any, error: type, message: str) -> None:
    """The same exception and message from lossspec, jaxloss, torchloss, their modules and heads,
    for the student's and the teacher's cap."""
    x = np.zeros((2, 5), np.float32)
    calls = {
        "lossspec": lambda **o: lossspec.make_config("forward_kl", **o),
        "jaxloss": lambda **o: jaxloss.forward_kl(jnp.asarray(x), jnp.asarray(x), **o),
        "torchloss": lambda **o: torchloss.forward_kl(torch.from_numpy(x), torch.from_numpy(x), **o),
        "torchloss.nn": lambda **o: torchloss.nn.ForwardKLLoss(**o),
        "jaxloss.head": lambda **o: jaxloss.linear_forward_kl(jnp.ones((2, 3)), jnp.ones((5, 3)), jnp.ones((2, 3)), jnp.ones((5, 3)), **o),
        "torchloss.head": lambda **o: torchloss.linear_forward_kl(torch.ones(2, 3), torch.ones(5, 3), torch.ones(2, 3), torch.ones(5, 3), **o),
    }
    for name, call in calls.items():
        for option in ("logit_softcap", "teacher_logit_softcap"):
            want = message.replace("logit_softcap", option, 1)
            with pytest.raises(error) as info:
                call(**{option: value})
            assert str(info.value) == want, (name, option)


def test_teacher_cap_only_with_a_teacher() -> None:
    x = np.zeros((2, 5), np.float32)
    for kind in ("cross_entropy", "entropy"):
        with pytest.raises(TypeError, match="unexpected keyword argument 'teacher_logit_softcap'"):
            getattr(jaxloss, kind)(jnp.asarray(x), *((jnp.zeros(2, jnp.int32),) if kind == "cross_entropy" else ()), teacher_logit_softcap=2.0)
        with pytest.raises(TypeError, match="unexpected keyword argument 'teacher_logit_softcap'"):
            getattr(torchloss, kind)(torch.from_numpy(x), *((torch.zeros(2, dtype=torch.long),) if kind == "cross_entropy" else ()), teacher_logit_softcap=2.0)
        with pytest.raises(TypeError, match="got unexpected option"):
            lossspec.make_config(kind, teacher_logit_softcap=2.0)
        with pytest.raises(ValueError, match="teacher_logit_softcap applies to the kinds with a teacher only"):
            lossspec.LossConfig(kind=kind, teacher_logit_softcap=2.0)
    assert lossspec.make_config("entropy", logit_softcap=np.float32(30.0)).logit_softcap == 30.0


def test_signatures_have_the_options() -> None:
    import inspect

    for kind in KINDS:
        for fn in (getattr(jaxloss, kind), getattr(torchloss, kind)):
            params = inspect.signature(fn).parameters
            assert params["logit_softcap"].default is None
            assert ("teacher_logit_softcap" in params) == (kind in lossspec.DISTILL_KINDS)
            assert "logit_softcap" in fn.__doc__


# --------------------------------------------------------------------------------------------
# jaxloss (XLA) and torchloss (torch path) against the oracle
# --------------------------------------------------------------------------------------------

SCENARIOS = ("random", "neg_inf", "confident", "float_weights")


@_params(
    "impl,kind,dtype",
    [(i, k, d) for i in IMPLS for k in KINDS for d in DTYPES],
    fast=lambda impl, kind, dtype: impl == "torch" or (kind in FAST_JAX_KINDS and dtype == "float32"),
)
def test_matches_oracle(impl: str, kind: str, dtype: str) -> None:
    for i, scenario in enumerate(SCENARIOS):
        norm = lossspec.NORMALIZATIONS[i % len(lossspec.NORMALIZATIONS)]
        options = softcap_options(kind, smoothing=scenario != "neg_inf")
        check(_case(kind, scenario, dtype, vocab=67, lead_shape=(3, 5)), impl, normalization=norm, **options)


@_params("impl,kind", [(i, k) for i in IMPLS for k in KINDS], fast=lambda impl, kind: impl == "torch")
def test_gemma_like_caps(impl: str, kind: str) -> None:
    """Gemma 2's final cap (30) on logits of N(0, 8) (entries up to ~30), huge logits (+-1e4:
    every entry saturated), the student cap alone and the teacher cap alone. (Logits far past
    the cap, N(0, 32), can miss the bound by up to ~1.3x: the capped values carry one fp32
    rounding, up to 1 ulp of the cap; docs/spec.md.)"""
    case = _scaled(_case(kind, "random", vocab=101, lead_shape=(12,), seed=4), 4.0)
    check(case, impl, logit_softcap=30.0)
    check(_case(kind, "huge", vocab=101, lead_shape=(12,)), impl, **softcap_options(kind, 30.0, 50.0, smoothing=True))
    if kind in lossspec.DISTILL_KINDS:
        check(case, impl, **softcap_options(kind, None, 30.0))
        check(case, impl, **softcap_options(kind, 30.0, None))


SATURATED_SEED = 7  # pre-fix: 4.9x the bound (reverse KL, both frameworks)


def saturated_cases(kind: str, vocab: int = 64, rows: int = 4) -> list[tuple[lossspec.Case, dict[str, Any]]]:
    """Logits far past the cap, where the slope ``1 - tanh(x / cap)^2`` is tiny and must keep its
    relative precision (``1 - (y / cap)^2`` from the capped ``y`` cancels in fp32: up to 17x the
    gradient bound on reverse KL): ``|x|`` log-uniform in ``[10, 1e4]`` of both signs at cap 2 and
    T = 3 against an uncapped N(0, 1e4) teacher; N(0, 300) logits at cap 30 with an N(0, 300)
    teacher capped at 30; N(0, 32) logits at Gemma's cap 30."""
    rng = np.random.default_rng([SATURATED_SEED, KINDS.index(kind), vocab])
    shape = (rows, vocab)
    out = []
    for student, teacher, cap, teacher_cap, temperature in (
        (rng.choice([-1.0, 1.0], shape) * 10 ** rng.uniform(1.0, 4.0, shape), rng.normal(0, 1e4, shape), 2.0, None, 3.0),
        (rng.normal(0, 300, shape), rng.normal(0, 300, shape), 30.0, 30.0, 1.0),
        (rng.normal(0, 32, shape), rng.normal(0, 32, shape), 30.0, None, 1.0),
    ):
        target: Optional[np.ndarray] = None
        options: dict[str, Any] = {"logit_softcap": cap}
        if kind == "cross_entropy":
            target = rng.integers(0, vocab, rows)
        else:
            options["temperature"] = temperature
        if kind in lossspec.DISTILL_KINDS:
            target = teacher.astype(np.float32)
            options["teacher_logit_softcap"] = teacher_cap
        out.append((lossspec.Case(kind, "saturated", "float32", student.astype(np.float32), target, None), options))
    return out


@_params("impl,kind", [(i, k) for i in IMPLS for k in KINDS], fast=lambda impl, kind: impl == "torch" or kind == "reverse_kl")
def test_saturated_slope(impl: str, kind: str) -> None:
    """The gradient of logits far past the cap meets the SPEC section 6 bound (the slope is
    formed from the raw logits, without cancellation)."""
    for case, options in saturated_cases(kind):
        check(case, impl, **options)


@pytest.mark.parametrize("impl", ("pallas", "triton"))
@pytest.mark.parametrize("kind", ("cross_entropy", "reverse_kl", "entropy"))
def test_saturated_slope_kernels(impl: str, kind: str) -> None:
    """:func:`test_saturated_slope` on the interpreted kernels, rows over several blocks."""
    tuning = lossspec.Tuning(block_rows=2, vocab_block=16)  # Triton reads only vocab_block
    for case, options in saturated_cases(kind, vocab=40, rows=2):
        check(case, impl, tuning=tuning, **options)


@_params("impl,kind", [(i, k) for i in IMPLS for k in KINDS], fast=lambda impl, kind: impl == "torch")
def test_blocked_rows_and_16bit_upstream(impl: str, kind: str) -> None:
    """Rows longer than one vocabulary block (online statistics over capped blocks, the label's
    logit gathered raw and capped at the end), and the 16-bit recompute for a non-unit
    per-token upstream gradient. (The kernels keep their own blocks here.)"""
    tuning = {
        "xla": lossspec.Tuning(chunk_elements=64, single_block_vocab=16, vocab_block=16),
        "torch": lossspec.Tuning(vocab_block=24),
    }.get(impl)
    upstream = np.random.default_rng(0).uniform(0.5, 2.0, (3, 5)).astype(np.float32)
    for dtype in DTYPES:
        case = _case(kind, "neg_inf", dtype, vocab=101, lead_shape=(3, 5))
        check(case, impl, grad_output=upstream, normalization="none", tuning=tuning, **softcap_options(kind))
        check(case, impl, normalization="valid_tokens", tuning=tuning, **softcap_options(kind))


def _poisoned(kind: str) -> tuple[lossspec.Case, list[int]]:
    case = _case(kind, "no_mask", vocab=40, lead_shape=(8,))
    logits = case.logits.copy()
    logits[2, 10] = np.nan
    logits[5, 20] = np.inf  # a cap must not turn +inf into a plausible number
    logits[6, :] = np.nan  # masked below
    logits[7, 3] = -np.inf  # a banned entry stays banned under the cap
    target = None if case.target is None else case.target.copy()
    bad = [2, 5]
    if target is not None and kind != "cross_entropy":
        target[4, 3] = np.nan
        bad.append(4)
    mask = np.ones(8, bool)
    mask[6] = False
    return dataclasses.replace(case, logits=logits, target=target, loss_mask=mask), bad


@_params("impl,kind", [(i, k) for i in IMPLS for k in KINDS], fast=lambda impl, kind: impl == "torch" or kind == "reverse_kl")
def test_nan_and_inf_entries(impl: str, kind: str) -> None:
    case, bad = _poisoned(kind)
    options = dict(softcap_options(kind), normalization="none")
    loss, grad = RUNNERS[impl](case, impl, None, **options)
    ref = case.reference(**options)
    good = [i for i in range(8) if i not in bad and i != 6]
    assert np.all(np.isnan(loss[bad])) and np.all(np.isnan(grad[bad]))
    assert loss[6] == 0.0 and np.all(grad[6] == 0.0)
    assert grad[7, 3] == 0.0
    lossspec.compare_loss(loss[good], ref.loss[good]).check()
    lossspec.compare_grad(grad[good], ref.grad[good], "float32", ref.g0).check()


def test_no_cap_adds_no_work() -> None:
    """``None`` (the default) traces exactly the program of a call without the option; a cap
    adds operations (its tanh and slope)."""
    x = jnp.zeros((4, 16), jnp.float32)
    t = jnp.ones((4, 16), jnp.float32)
    for kind, target in (("cross_entropy", jnp.zeros((4,), jnp.int32)), ("forward_kl", t)):
        fn = getattr(jaxloss, kind)
        plain = str(jax.make_jaxpr(lambda z: fn(z, target, impl="xla"))(x))
        default = str(jax.make_jaxpr(lambda z: fn(z, target, impl="xla", logit_softcap=None))(x))
        capped = str(jax.make_jaxpr(lambda z: fn(z, target, impl="xla", logit_softcap=30.0))(x))
        assert default == plain
        assert capped.count(" exp ") > plain.count(" exp ")


@_params("kind", [("cross_entropy",), ("reverse_kl",), ("jensen_shannon",)], fast=lambda kind: kind == "jensen_shannon")
def test_torch_compile_fullgraph(kind: str) -> None:
    """The custom op carries both caps under ``torch.compile(fullgraph=True)``; a new cap value
    gives the new numbers."""
    case = _case(kind, "random", vocab=33, lead_shape=(6,))
    x = torch.from_numpy(case.logits).requires_grad_(True)
    target = torch.from_numpy(case.target)
    mask = torch.from_numpy(case.loss_mask)
    fn = getattr(torchloss, kind)
    compiled = torch.compile(lambda z, **o: fn(z, target, mask, **o), backend="eager", fullgraph=True)
    for cap in (STUDENT_CAP, 7.0):
        options = softcap_options(kind, cap)
        x.grad = None
        loss = compiled(x, **options)
        loss.backward()
        ref = case.reference(**options)
        lossspec.assert_close_to_oracle(loss.item(), x.grad.numpy(), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"compiled cap={cap}")


def test_nn_and_nnx_modules() -> None:
    from jaxloss import nnx

    case = _case("forward_kl", "random", vocab=33, lead_shape=(6,))
    options = softcap_options("forward_kl")
    ref = case.reference(**options)
    torch_loss = torchloss.nn.ForwardKLLoss(**options)(torch.from_numpy(case.logits), torch.from_numpy(case.target), torch.from_numpy(case.loss_mask))
    jax_loss = nnx.ForwardKLLoss(**options)(jnp.asarray(case.logits), jnp.asarray(case.target), jnp.asarray(case.loss_mask))
    lossspec.compare_loss(torch_loss.item(), ref.loss).check()
    lossspec.compare_loss(float(jax_loss), ref.loss).check()


# --------------------------------------------------------------------------------------------
# The fused head
# --------------------------------------------------------------------------------------------


def _head_options(kind: str) -> dict[str, Any]:
    options = softcap_options(kind, 2.0, 2.5)  # the head's logits are small: strong caps
    options.pop("beta", None)
    return options


@pytest.fixture
def plan(request: pytest.FixtureRequest) -> lossspec.HeadTuning:
    return block_budget(*PLANS[request.param])


@_params(
    "framework,kind,dtype,plan",
    [(f, k, d, p) for f in ("jax", "torch") for k in lossspec.KINDS for d in DTYPES for p in ("whole", "blocked")],
    fast=lambda framework, kind, dtype, plan: framework == "torch" or (kind == "cross_entropy" and dtype == "float32" and plan == "whole"),
    indirect=("plan",),
)
def test_fused_head(framework: str, kind: str, dtype: str, plan: lossspec.HeadTuning) -> None:
    assert plan.block_elements in (budget for budget, _ in PLANS.values())  # the plan fixture's tuning
    inputs = make_inputs(kind, dtype, seed=5)
    options = _head_options(kind)
    grad_output = grad_output_for("valid_tokens")
    loss, grads = {"jax": run_jax, "torch": run_torch}[framework](kind, inputs, dtype, True, {**options, "tuning": plan}, grad_output)
    ref_loss, ref_grads = reference(kind, inputs, True, options, grad_output)
    lossspec.compare_loss(loss, ref_loss, f"{framework} {kind} loss").check()
    for name, grad in grads.items():
        spec_linear.compare_head_grad(grad, ref_grads[name], dtype, f"{framework} {kind} grad {name}", ref_grads.magnitude[name]).check()


def saturated_head_inputs(kind: str, lead: tuple[int, ...] = (2, 3), sizes: tuple[int, int, int] = (4, 3, 40)) -> dict[str, Any]:
    """Head inputs whose logits lie far past a cap of 2 (``|z|`` up to ~1e4; hidden states of
    +-1, integer weights of magnitude log-uniform in ``[2.5, 2500]``), the teacher's N(0, 5e3)
    rounded to integers: the fused head's twin of :func:`saturated_cases`. The logits are exact in
    float32 (sums of small integers), so only the cap and the statistics round."""
    hidden, t_hidden, vocab = sizes
    rng = np.random.default_rng([SATURATED_SEED, KINDS.index(kind)])
    sign = lambda shape: rng.choice(np.array([-1.0, 1.0], np.float32), shape)  # noqa: E731
    inputs: dict[str, Any] = {
        "hidden": sign(lead + (hidden,)),
        "weight": (sign((vocab, hidden)) * np.round(10 ** rng.uniform(0.4, 3.4, (vocab, hidden)))).astype(np.float32),
        "bias": np.zeros(vocab, np.float32),
        "loss_mask": np.ones(lead, np.float32),
    }
    if kind == "cross_entropy":
        inputs["labels"] = rng.integers(0, vocab, size=lead)
    else:
        inputs.update(teacher_hidden=sign(lead + (t_hidden,)), teacher_weight=np.round(rng.normal(0, 5e3, (vocab, t_hidden))).astype(np.float32),
                      teacher_bias=np.zeros(vocab, np.float32))
    return inputs


def _saturated_head_options(kind: str) -> dict[str, Any]:
    return {"logit_softcap": 2.0} if kind == "cross_entropy" else {"logit_softcap": 2.0, "temperature": 3.0}


@_params("framework,kind", [(f, k) for f in ("jax", "torch") for k in lossspec.KINDS], fast=lambda framework, kind: framework == "torch" or kind == "reverse_kl")
def test_saturated_slope_fused_head(framework: str, kind: str) -> None:
    """The fused head (XLA / torch paths) on logits far past the cap: hidden, weight and bias
    gradients at the SPEC section 8 bound."""
    inputs = saturated_head_inputs(kind)
    options = _saturated_head_options(kind)
    grad_output = grad_output_for("valid_tokens")
    loss, grads = {"jax": run_jax, "torch": run_torch}[framework](kind, inputs, "float32", True, options, grad_output)
    ref_loss, ref_grads = reference(kind, inputs, True, options, grad_output)
    lossspec.compare_loss(loss, ref_loss, f"{framework} {kind} loss").check()
    for name, grad in grads.items():
        spec_linear.compare_head_grad(grad, ref_grads[name], "float32", f"{framework} {kind} grad {name}").check()


# --------------------------------------------------------------------------------------------
# JAX vocab-parallel (shard_map over host devices)
# --------------------------------------------------------------------------------------------

VP_LEAD = (4, 6)


def _jax_vp(case: lossspec.Case, shards: int, impl: str, norm: str, options: dict[str, Any], upstream: np.ndarray,
            tuning: Optional[lossspec.Tuning] = None) -> tuple[np.ndarray, np.ndarray]:
    kind = case.kind
    fn = getattr(jaxloss, kind)
    logits = jnp.asarray(case.logits).astype(case.dtype)
    if kind == "cross_entropy":
        target = jnp.asarray(case.target)
        t_spec = P()
    else:
        target = jnp.zeros(VP_LEAD + (case.logits.shape[-1],), case.dtype) if case.target is None else jnp.asarray(case.target).astype(case.dtype)
        t_spec = P(None, None, "model")
    mask = jnp.asarray(case.loss_mask)

    def body(x, t, m, up):
        def objective(x):
            args = () if kind == "entropy" else (t,)
            loss = fn(x, *args, m, normalization=norm, vocab_parallel="model", impl=impl, tuning=tuning, **options)
            return (jnp.sum(loss * up) if norm == "none" else loss * up[0, 0]), loss

        (_, loss), grad = jax.value_and_grad(objective, has_aux=True)(x)
        return loss, grad

    mesh = Mesh(np.array(jax.devices()[:shards]), ("model",))
    spec = P(None, None, "model")
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(spec, t_spec, P(), P()), out_specs=(P(), spec), check_vma=impl != "pallas")
    loss, grad = jax.jit(sharded)(logits, target, mask, jnp.asarray(upstream))
    return np.asarray(loss, np.float64), np.asarray(jnp.asarray(grad, jnp.float32), np.float64)


def _check_jax_vp(kind: str, impl: str, dtype: str, norm: str, tuning: Optional[lossspec.Tuning] = None) -> None:
    case = _case(kind, "neg_inf", dtype, vocab=100, lead_shape=VP_LEAD, seed=7)
    upstream = np.random.default_rng(3).uniform(0.5, 2.0, VP_LEAD).astype(np.float32)
    options = softcap_options(kind)
    loss, grad = _jax_vp(case, 2, impl, norm, options, upstream, tuning)
    grad_output = upstream if norm == "none" else upstream[0, 0]
    ref = _reference(case, grad_output, dict(options, normalization=norm))
    lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=dtype, g0=ref.g0, what=f"jax vp {impl} {case.name} {norm}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_jax_vocab_parallel(kind: str) -> None:
    _check_jax_vp(kind, "xla", "float32", "valid_tokens")
    _check_jax_vp(kind, "xla", "bfloat16", "none")


@pytest.mark.slow
def test_jax_vocab_parallel_saturated() -> None:
    """:func:`saturated_cases` (reverse KL) split over 2 vocabulary shards (the shard gradient's
    slope)."""
    rows = int(np.prod(VP_LEAD))
    for case, options in saturated_cases("reverse_kl", vocab=64, rows=rows):
        case = dataclasses.replace(case, logits=case.logits.reshape(VP_LEAD + (64,)), target=case.target.reshape(VP_LEAD + (64,)),
                                   loss_mask=np.ones(VP_LEAD, bool))
        upstream = np.ones(VP_LEAD, np.float32)
        loss, grad = _jax_vp(case, 2, "xla", "valid_tokens", options, upstream)
        ref = _reference(case, upstream[0, 0], dict(options, normalization="valid_tokens"))
        lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"jax vp saturated {options}")


# --------------------------------------------------------------------------------------------
# Interpreted kernels (slow by name): Pallas, Triton, Triton's tanh
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_pallas_matches_oracle(kind: str) -> None:
    tuning = lossspec.Tuning(block_rows=2, vocab_block=32)
    upstream = np.linspace(0.5, 2.0, 5).astype(np.float32)
    for dtype in DTYPES:
        case = _case(kind, "neg_inf", dtype, vocab=75, lead_shape=(5,))
        check(case, "pallas", normalization="valid_tokens", tuning=tuning, **softcap_options(kind))
        check(case, "pallas", grad_output=upstream, normalization="none", tuning=tuning, **softcap_options(kind))
    _check_jax_vp(kind, "pallas", "float32", "valid_tokens", tuning)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_oracle(kind: str) -> None:
    tuning = lossspec.Tuning(vocab_block=32)  # several blocks and a ragged tail
    upstream = np.linspace(0.5, 2.0, 6).astype(np.float32)  # the 16-bit regrad kernel
    for dtype in DTYPES:
        case = _case(kind, "neg_inf", dtype, vocab=75, lead_shape=(6,))
        check(case, "triton", normalization="valid_tokens", tuning=tuning, **softcap_options(kind))
        check(case, "triton", grad_output=upstream, normalization="none", tuning=tuning, **softcap_options(kind))
    check(_scaled(_case(kind, "random", vocab=75, lead_shape=(6,)), 4.0), "triton", logit_softcap=30.0, tuning=tuning)
    case, bad = _poisoned(kind)
    loss, grad = run_torch_loss(case, "triton", None, normalization="none", tuning=tuning, **softcap_options(kind))
    assert np.all(np.isnan(loss[bad])) and np.all(np.isnan(grad[bad])) and np.all(grad[6] == 0.0) and grad[7, 3] == 0.0


def test_shared_tanh_is_accurate() -> None:
    """``lossspec.stats.tanh`` (the soft cap's) on NumPy, XLA and torch fp32 within 2 ulps of
    the float64 value (XLA's own f32 tanh: 4.4)."""
    u = np.linspace(-12, 12, 400001).astype(np.float32)
    want = np.tanh(u.astype(np.float64))
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    got = {
        "numpy": lossspec.stats.tanh(np, u),
        "jax": np.asarray(jax.jit(lambda v: lossspec.stats.tanh(jnp, v))(u)),
        "torch": lossspec.stats.tanh(torch, torch.from_numpy(u)).numpy(),
    }
    for name, values in got.items():
        assert values.dtype == np.float32
        assert float(np.max(np.abs(values.astype(np.float64) - want) / spacing)) <= 2.0, name


def _tiled_cap_inputs() -> np.ndarray:
    """fp32 rows for the torch path's tiled soft cap: both sides of the series / exponential
    switch at ``|x / cap| = 0.55`` (and the values next to it), saturation, +-0, subnormals,
    values whose ``x / cap`` overflows, +-inf and NaN (a row of each, so tiles with and without
    them), in a 40 x 1000 block."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((40, 1000)) * rng.choice([0.3, 3.0, 30.0, 300.0], size=(40, 1))).astype(np.float32)
    edge = np.float32(0.55 * STUDENT_CAP)
    x[0, :6] = [edge, -edge, np.nextafter(edge, np.float32(0)), np.nextafter(edge, np.float32(9)), 0.0, -0.0]
    x[1, :4] = [1e-40, -1e-40, 3e38, -3e38]
    x[2, ::7], x[3, ::11], x[4, 5] = np.inf, -np.inf, np.nan
    return x


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("where", ["new", "in place", "strided"])
def test_torch_tiled_softcap_matches_float64(dtype: str, where: str) -> None:
    """The torch path's soft cap on the CPU (``torchloss._block.softcap_with_slope``: lossspec's
    operations tile by tile, in scratch; blocks of 3 rows, whose tiles are parts of rows) against float64: the capped
    values within 3 fp32 ulps of ``cap tanh(x / cap)`` plus the propagated rounding of
    ``x / cap``, the slope within 8 ulps plus that of ``u``; +-inf and NaN entries kept, the
    slope 0 at +-inf; bit for bit the shared formulation (``lossspec.stats``) on the whole block,
    written into a new block, over the raw block itself, or from a strided column slice."""
    from torchloss import _block

    cap = STUDENT_CAP
    base = torch.from_numpy(_tiled_cap_inputs()).to(getattr(torch, dtype))
    raw = base[:, 3:-2] if where == "strided" else base.clone()
    x = raw.to(torch.float32).numpy().astype(np.float64)
    shared = lossspec.stats.softcap(torch, raw.to(torch.float32), cap)
    e = torch.exp(-2.0 * torch.abs(raw.to(torch.float32) / cap))
    shared_slope = 4.0 * e / ((1.0 + e) * (1.0 + e))
    in_place = where == "in place" and dtype == "float32"
    parts = []
    for r0 in range(0, raw.shape[0], 3):  # blocks of 3 rows: each row in several tiles, the last shorter
        block = raw[r0 : r0 + 3]
        parts.append(_block.softcap_with_slope(block, cap, torch.float32, out=block if in_place else None))
        assert parts[-1][0].dtype == parts[-1][1].dtype == torch.float32
        assert (parts[-1][0].data_ptr() == block.data_ptr()) == in_place
    capped, slope = torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])
    got, got_slope = capped.numpy().astype(np.float64), slope.numpy().astype(np.float64)
    finite = np.isfinite(x)
    with np.errstate(over="ignore", invalid="ignore"):
        u = x / cap
        want = cap * np.tanh(u)
        want_slope = 1.0 / np.cosh(u) ** 2
    ulp = lambda v: np.spacing(np.abs(v[finite]).astype(np.float32)).astype(np.float64)  # noqa: E731
    moved = np.abs(u[finite]) * 2.0**-24  # the rounding of x / cap
    assert np.all(np.abs(got - want)[finite] <= 3 * ulp(want) + cap * want_slope[finite] * moved)
    assert np.all(np.abs(got_slope - want_slope)[finite] <= 8 * ulp(want_slope) + 4 * want_slope[finite] * moved)
    assert np.array_equal(got[~finite], x[~finite], equal_nan=True)  # +-inf and NaN unchanged
    assert np.all(got_slope[np.isinf(x)] == 0.0) and np.all(np.isnan(got_slope[np.isnan(x)]))
    for ours, theirs in ((capped.numpy(), shared.numpy()), (slope.numpy(), shared_slope.numpy())):
        nan = np.isnan(theirs)
        assert np.array_equal(np.isnan(ours), nan) and np.array_equal(ours[~nan].view(np.int32), theirs[~nan].view(np.int32))


def test_triton_tanh_is_accurate() -> None:
    """The kernels' ``tanh`` (series below the limit, exp-based above) within 2 fp32 ulps of the
    float64 value, and its series coefficients those of tanh."""
    import triton
    import triton.language as tl

    global _kernels
    from torchloss.backends import triton as _triton  # noqa: F401  (sets the interpreter up first)
    from torchloss.backends import triton_kernels as _kernels  # a global: the jitted function reads it

    assert lossspec.stats.tanh_series(4) == (1.0, -1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0)

    @triton.jit
    def tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        tl.store(y_ptr + offs, _kernels._tanh(tl.load(x_ptr + offs, mask=inside, other=0.0)), mask=inside)

    u = np.concatenate([np.linspace(-12, 12, 200001), np.geomspace(1e-20, 1.0, 2001), [0.0, 0.55, -0.55]]).astype(np.float32)
    x = torch.from_numpy(u).to(TRITON_DEVICE)  # compiled on CUDA, else interpreted on the CPU
    y = torch.empty_like(x)
    with np.errstate(all="ignore"):
        tanh_kernel[(triton.cdiv(u.size, 4096),)](x, y, u.size, BLOCK=4096)
    want = np.tanh(u.astype(np.float64))
    ulps = np.abs(y.cpu().numpy().astype(np.float64) - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert float(ulps.max()) <= 2.0


# --------------------------------------------------------------------------------------------
# torch vocab-parallel: 2 gloo ranks, uneven shards, torch and Triton (slow; Triton without CUDA)
# --------------------------------------------------------------------------------------------

TVP_LEAD, TVP_VOCAB, TVP_SHARDS = (3, 6), 37, (15, 22)
TVP_CONFIGS = (("neg_inf", "valid_tokens", "torch"), ("random", "none", "torch"), ("neg_inf", "none", "triton"))
# The gloo ranks hold CPU tensors, so their Triton row needs the Triton interpreter, which is on
# only where CUDA is unavailable: with CUDA the ranks leave it out and its test is skipped.
TVP_TRITON = TRITON_DEVICE.type == "cpu"
TVP_TRITON_SKIP = (
    "CUDA is available: the gloo ranks' CPU tensors would need the Triton interpreter (off with CUDA); "
    "the compiled kernels' vocab-parallel passes are checked by test_torchloss_triton_vocab_parallel.py"
)


def _tvp_case(kind: str, scenario: str) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, lead_shape=TVP_LEAD, vocab=TVP_VOCAB, seed=5)


def _tvp_worker(out_dir: str) -> None:
    import torch.distributed as dist

    rank, _ = ranks.init_gloo()
    bounds = np.cumsum((0,) + TVP_SHARDS)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    results: dict[str, np.ndarray] = {}
    for kind in KINDS:
        for scenario, norm, impl in TVP_CONFIGS:
            if impl == "triton" and not TVP_TRITON:
                continue
            case = _tvp_case(kind, scenario)
            logits = torch.tensor(case.logits[..., lo:hi]).requires_grad_(True)
            if case.target is None:
                target: tuple = ()
            elif kind == "cross_entropy":
                target = (torch.tensor(case.target),)
            else:
                target = (torch.tensor(case.target[..., lo:hi]),)
            mask = None if case.loss_mask is None else torch.tensor(case.loss_mask)
            with quiet():
                loss = getattr(torchloss, kind)(logits, *target, mask, normalization=norm, vocab_parallel=dist.group.WORLD, impl=impl, **softcap_options(kind))
                loss.sum().backward()
            key = f"{kind}/{scenario}/{norm}/{impl}"
            results[key + "/loss"] = loss.detach().double().numpy()
            results[key + "/grad"] = logits.grad.double().numpy()
    np.savez(os.path.join(out_dir, f"r{rank}.npz"), **results)
    ranks.finish(rank)


@pytest.fixture(scope="module")
def tvp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    return ranks.launch_once("softcap_vp", Path(__file__), lambda out_dir: [str(out_dir)], len(TVP_SHARDS), tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TVP_TRITON, reason=TVP_TRITON_SKIP))])
@pytest.mark.parametrize("kind", KINDS)
def test_torch_vocab_parallel(tvp_results: list[dict[str, np.ndarray]], kind: str, impl: str) -> None:
    configs = [config for config in TVP_CONFIGS if config[2] == impl]
    assert configs
    for scenario, norm, _ in configs:
        case = _tvp_case(kind, scenario)
        ref = case.reference(normalization=norm, **softcap_options(kind))
        key = f"{kind}/{scenario}/{norm}/{impl}"
        assert np.array_equal(tvp_results[0][key + "/loss"], tvp_results[1][key + "/loss"])
        grad = np.concatenate([r[key + "/grad"] for r in tvp_results], axis=-1)
        lossspec.assert_close_to_oracle(tvp_results[0][key + "/loss"], grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=key)


if __name__ == "__main__":
    _tvp_worker(sys.argv[1])
