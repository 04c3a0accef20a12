"""torchloss autograd and call semantics: gradcheck, determinism, in-place gradients, inputs left
alone, teacher gradients, retain_graph, torch.compile, modules and count_denominator."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from parity_tests.support.torch_cases import FUNCTIONS, IMPLS, device_for, inputs, quiet, run

import lossspec
import torchloss
from torchloss.backends import cpu_tiles as _cpu, torch as _torch

KINDS = lossspec.KINDS
OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 0.01, "logit_scale": 1.3},
    "soft_cross_entropy": {"temperature": 1.7, "logit_scale": 0.8, "teacher_logit_scale": 1.2},
    "forward_kl": {"temperature": 0.6, "teacher_logit_scale": 1.4},
    "reverse_kl": {"temperature": 1.3, "logit_scale": 0.9},
}


def _target(kind: str, rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "cross_entropy":
        labels = torch.randint(0, vocab, (rows,), generator=gen)
        labels[1] = -100
        return labels
    return torch.randn(rows, vocab, generator=gen, dtype=torch.float64).to(dtype) * 2


# --------------------------------------------------------------------------------------------
# gradcheck (float64, torch path)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocked", [False, True], ids=["whole-rows", "vocab-blocks"])
@pytest.mark.parametrize("normalization", lossspec.NORMALIZATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck(kind: str, normalization: str, blocked: bool) -> None:
    """The analytic gradient of the forward equals finite differences of the loss (float64 is
    computed in float64), for every kind and normalisation, with float weights and options; also
    through the blocked (two-pass, vocab-parallel algebra) path."""
    tuning = lossspec.Tuning(vocab_block=3, cpu_tile_elements=6) if blocked else None
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 7, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    target = _target(kind, 4, 7, torch.float64)
    weights = torch.tensor([1.0, 0.5, 0.0, 2.0], dtype=torch.float64)
    fn = FUNCTIONS[kind]

    def loss(x: torch.Tensor) -> torch.Tensor:
        return fn(x, target, weights, normalization=normalization, impl="torch", tuning=tuning, **OPTIONS[kind])

    assert loss(logits).dtype == torch.float64
    assert torch.autograd.gradcheck(loss, (logits,))


# --------------------------------------------------------------------------------------------
# Determinism, inputs, teacher, retain_graph
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl: str) -> None:
    """The same call on the same inputs is bit-identical, run after run."""
    for kind in KINDS:
        for dtype in ("float32", "bfloat16"):
            case = lossspec.make_case(kind, "float_weights", dtype=dtype, vocab=100, lead_shape=(2, 6))
            first = run(case, impl, **OPTIONS[kind])
            second = run(case, impl, **OPTIONS[kind])
            for a, b in zip(first, second):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_inputs_are_not_modified(impl: str) -> None:
    for kind in KINDS:
        case = lossspec.make_case(kind, "float_weights", dtype="bfloat16", vocab=100, lead_shape=(10,))
        logits, target, mask = inputs(case, device=device_for(impl))
        assert mask is not None
        before = [t.detach().clone() for t in (logits, target, mask)]
        with quiet():
            FUNCTIONS[kind](logits, target, mask, impl=impl, **OPTIONS[kind]).backward()
            FUNCTIONS[kind](logits, target, mask, impl=impl, normalization="none").sum().backward()
        for old, new in zip(before, (logits, target, mask)):
            assert torch.equal(old, new.detach())
        assert logits._version == 0 and target._version == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_teacher_gets_no_gradient(impl: str) -> None:
    device = device_for(impl)
    for kind in KINDS[1:]:
        logits = torch.randn(5, 11).to(device).requires_grad_()
        teacher = torch.randn(5, 11).to(device).requires_grad_()
        with quiet():
            FUNCTIONS[kind](logits, teacher, impl=impl).backward()
        assert logits.grad is not None and teacher.grad is None


def test_retain_graph_and_double_backward() -> None:
    """With retain_graph=True the backward can run again (a scaled copy is handed out); the
    backward itself is not differentiable, and says so when differentiated."""
    logits = torch.randn(6, 9, requires_grad=True)
    labels = torch.randint(0, 9, (6,))
    loss = torchloss.cross_entropy(logits, labels)
    loss.backward(retain_graph=True)
    first = logits.grad.clone()
    loss.backward()
    assert torch.equal(logits.grad, 2 * first)
    (grad,) = torch.autograd.grad(torchloss.cross_entropy(logits, labels), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):  # never a silent constant
        grad.sum().backward()


def _second_derivatives_raise(loss: torch.Tensor, params: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """For each parameter: its ``create_graph=True`` gradient, then that gradient differentiated
    again by every route (``torch.autograd.grad`` w.r.t. each parameter with
    ``allow_unused=True``, and ``.backward()``), each of which must raise the documented error.
    Returns the first-order gradients."""
    first = {}
    for name, param in params.items():
        (grad,) = torch.autograd.grad(loss, param, create_graph=True, retain_graph=True)
        first[name] = grad.detach().double().numpy()
        for other_name, other in params.items():
            with pytest.raises(RuntimeError, match="differentiable once"):  # once (None,): a zero Hessian
                torch.autograd.grad(grad.pow(2).sum(), other, allow_unused=True, retain_graph=True)
        with pytest.raises(RuntimeError, match="differentiable once"):
            grad.pow(2).sum().backward(retain_graph=True)
    return first


@pytest.mark.parametrize("normalization", ["valid_tokens", "none"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_route_to_a_second_derivative_raises(kind: str, dtype: str, normalization: str) -> None:
    """Logits from a linear layer: the ``create_graph`` gradient of the logits, of the hidden
    states and of the weight, differentiated again w.r.t. any of them (``autograd.grad`` with
    ``inputs=`` once returned ``None`` silently), raises "differentiable once"; the first-order
    gradient of the logits is still the oracle's."""
    case = lossspec.make_case(kind, "random", lead_shape=(6,), vocab=11, dtype=dtype)
    hidden, target, mask = inputs(case)
    weight = torch.eye(11, dtype=hidden.dtype).requires_grad_(True)
    logits = hidden @ weight.T  # exactly the case's logits (one non-zero product per entry)
    loss = FUNCTIONS[kind](logits, target, mask, impl="torch", normalization=normalization)
    total = loss.sum() if normalization == "none" else loss
    first = _second_derivatives_raise(total, {"logits": logits, "hidden": hidden, "weight": weight})
    ref_loss, ref_grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask, normalization=normalization)
    lossspec.assert_close_to_oracle(
        loss.detach().double().numpy(), first["logits"], ref_loss, ref_grad, dtype=dtype, g0=case.g0(normalization=normalization), what=kind
    )


@pytest.mark.parametrize("kind", KINDS)
def test_gradgradcheck_raises_instead_of_a_zero_hessian(kind: str) -> None:
    """``gradgradcheck`` once reported a Jacobian mismatch (autograd saw a zero Hessian); it now
    meets the documented error on its first second-order route."""
    case = lossspec.make_case(kind, "random", lead_shape=(4,), vocab=7, dtype="float32")
    target = torch.from_numpy(np.array(case.target))
    target = target if kind == "cross_entropy" else target.double()
    logits = torch.from_numpy(case.logits).double().requires_grad_(True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.gradgradcheck(lambda x: FUNCTIONS[kind](x, target, impl="torch"), (logits,))


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute_logits"])
@pytest.mark.parametrize("normalization", ["valid_tokens", "none"])
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_fused_head_second_derivatives_raise(kind: str, normalization: str, recompute: bool) -> None:
    """The fused head: the ``create_graph`` gradients of hidden, weight and bias, each
    differentiated again w.r.t. each of them (``once_differentiable`` let ``autograd.grad``
    return ``None``), raise "differentiable once", and so does ``gradgradcheck``; the first-order
    gradients are still the head oracle's."""
    from lossspec import linear as spec_linear

    rng = np.random.default_rng(5)
    h, w, b = rng.normal(size=(5, 3)), rng.normal(size=(7, 3)) * 0.7, rng.normal(size=7) * 0.5
    mask = np.array([1.0, 0.0, 2.0, 1.0, 0.5])
    if kind == "cross_entropy":
        target_np: tuple = (rng.integers(0, 7, 5),)
        target: tuple = (torch.from_numpy(target_np[0]),)
        oracle_target: object = target_np[0]
    else:
        target_np = (rng.normal(size=(5, 2)), rng.normal(size=(7, 2)))
        target = tuple(torch.from_numpy(a) for a in target_np)
        oracle_target = (*target_np, None)
    options = {"normalization": normalization, "recompute_logits": recompute}
    fn = getattr(torchloss, f"linear_{kind}")
    params = {name: torch.from_numpy(a).requires_grad_(True) for name, a in (("hidden", h), ("weight", w), ("bias", b))}
    loss = fn(params["hidden"], params["weight"], *target, torch.from_numpy(mask), bias=params["bias"], **options)
    loss = loss.sum() if normalization == "none" else loss
    first = _second_derivatives_raise(loss, params)
    upstream = np.ones(5) if normalization == "none" else None
    _, ref_grads = spec_linear.oracle_head(kind, h, w, oracle_target, mask, bias=b, normalization=normalization, grad_output=upstream)
    for name, grad in first.items():
        np.testing.assert_allclose(grad, ref_grads[name], rtol=1e-10, atol=1e-12, err_msg=name)
    for name in params:
        def head(x: torch.Tensor, name: str = name) -> torch.Tensor:
            args = {**{k: v.detach() for k, v in params.items()}, name: x}
            return fn(args["hidden"], args["weight"], *target, torch.from_numpy(mask), bias=args["bias"], **options)

        with pytest.raises(RuntimeError, match="differentiable once"):  # fast_mode: few numerical head calls first
            torch.autograd.gradgradcheck(head, (params[name].detach().clone().requires_grad_(True),), fast_mode=True)


@pytest.mark.parametrize("upstream", [1.0, 0.37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_hands_out_its_buffer(dtype: torch.dtype, upstream: float) -> None:
    """Without retain_graph the gradient computed in the forward becomes ``logits.grad`` itself:
    no second [N, V] buffer; backward scales it (fp32) or rewrites it (16-bit, non-unit
    upstream gradient) in place."""
    logits = torch.randn(8, 33, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 33, (8,))
    loss = torchloss.cross_entropy(logits, labels)
    stored = loss.grad_fn.grad  # the autograd Function's ctx holds the forward's gradient
    pointer = stored.data_ptr()
    del stored
    loss.backward(torch.tensor(upstream))
    assert logits.grad.data_ptr() == pointer


def test_function_classes() -> None:
    """One autograd Function per kind; its node names the kind."""
    x = torch.randn(3, 5, requires_grad=True)
    for kind, cls in torchloss._autodiff.FUNCTIONS.items():
        function = getattr(torchloss, kind)
        if kind == "entropy":  # no target
            loss = function(x)
        else:
            loss = function(x, torch.tensor([0, 1, 2]) if kind == "cross_entropy" else torch.randn(3, 5))
        assert cls.kind == kind and type(loss.grad_fn).__name__ == f"{cls.__name__}Backward"


# --------------------------------------------------------------------------------------------
# inplace=True
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("impl", IMPLS)
def test_inplace_gradient(impl: str, dtype: str) -> None:
    """inplace=True writes the gradient into the logits' buffer: same numbers, no new [N, V]."""
    for kind in KINDS:
        case = lossspec.make_case(kind, "float_weights", dtype=dtype, vocab=100, lead_shape=(2, 5))
        expected_loss, expected_grad = run(case, impl, **OPTIONS[kind])
        hidden, target, mask = inputs(case, device=device_for(impl))
        logits = hidden * 1.0  # the output of an operation, like an LM head
        with quiet():
            loss = FUNCTIONS[kind](logits, target, mask, impl=impl, inplace=True, **OPTIONS[kind])
        assert logits._version > 0  # autograd sees the write
        loss.backward(torch.tensor(1.0).to(loss.device))
        np.testing.assert_array_equal(loss.detach().cpu().numpy(), expected_loss)
        np.testing.assert_array_equal(hidden.grad.cpu().double().numpy(), expected_grad)
        # The buffer now holds the gradient (and was handed on as such).
        np.testing.assert_array_equal(logits.detach().cpu().double().numpy(), expected_grad)


def test_inplace_constraints() -> None:
    leaf = torch.randn(4, 10, requires_grad=True)
    labels = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="inplace=True writes the gradient into the logits' buffer"):
        torchloss.cross_entropy(leaf, labels, inplace=True)
    transposed = (torch.randn(10, 4, requires_grad=True) * 1.0).t()
    with pytest.raises(ValueError, match="inplace=True needs contiguous logits"):
        torchloss.cross_entropy(transposed, labels, inplace=True)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        torchloss.cross_entropy(leaf, labels, inplace=1)
    # Logits that another operation saved for its backward: autograd refuses, it never reads garbage.
    hidden = torch.randn(4, 10, requires_grad=True)
    logits = hidden * 1.0
    other = (logits * logits).sum()
    loss = torchloss.cross_entropy(logits, labels, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()
    # Without a gradient to compute nothing is written.
    frozen = torch.randn(4, 10)
    copy = frozen.clone()
    torchloss.cross_entropy(frozen, labels, inplace=True)
    with torch.no_grad():
        torchloss.cross_entropy(hidden * 1.0, labels, inplace=True)
    assert torch.equal(frozen, copy)


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


def test_torch_compile_wrapping_the_loss() -> None:
    """A compiled training step that calls the loss: the oracle's numbers, and the loss is part
    of the graph (the custom op of torchloss._ops; more in test_torchloss_compile.py)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 40, generator=gen, requires_grad=True)
    hidden = torch.randn(2, 6, 16, generator=gen)
    labels = torch.randint(0, 40, (2, 6), generator=gen)
    teacher = torch.randn(2, 6, 40, generator=gen)
    mask = torch.rand(2, 6, generator=gen) > 0.3

    def step(h: torch.Tensor) -> torch.Tensor:
        logits = torch.tanh(h @ weight) * 5.0
        ce = torchloss.cross_entropy(logits, labels, mask, label_smoothing=0.1)
        kl = torchloss.reverse_kl(logits, teacher, mask, temperature=2.0)
        per_token = torchloss.forward_kl(logits, teacher, normalization="none")
        return ce + kl + 0.1 * per_token.mean()

    # The reference: the float64 oracle on the step's fp32 logits, chained to the weight in float64.
    pre = (hidden.double() @ weight.detach().double())
    logits64 = (torch.tanh(pre.float()) * 5.0).double().numpy()
    m = mask.numpy()
    ce_ref, ce_grad = lossspec.oracle("cross_entropy", logits64, labels.numpy(), m, label_smoothing=0.1)
    kl_ref, kl_grad = lossspec.oracle("reverse_kl", logits64, teacher.double().numpy(), m, temperature=2.0)
    pt_ref, pt_grad = lossspec.oracle("forward_kl", logits64, teacher.double().numpy(), normalization="none", grad_output=np.full((2, 6), 0.1 / 12))
    ref_loss = ce_ref + kl_ref + 0.1 * pt_ref.mean()
    dlogits = ce_grad + kl_grad + pt_grad
    dpre = dlogits * 5.0 * (1.0 - np.tanh(pre.numpy()) ** 2)
    ref_grad = np.einsum("bth,btv->hv", hidden.double().numpy(), dpre)
    compiled = torch.compile(step, backend="aot_eager")
    for _ in range(2):  # the second call reuses the compiled graphs
        loss = compiled(hidden)
        (grad,) = torch.autograd.grad(loss, weight)
        lossspec.compare_loss(loss.item(), ref_loss, "compiled loss").check()
        # fp32 matmul/tanh around the loss: within 2e-5 of the largest weight gradient.
        np.testing.assert_allclose(grad.double().numpy(), ref_grad, rtol=0, atol=2e-5 * np.abs(ref_grad).max())
    # No graph break: fullgraph=True compiles the step with its three loss calls.
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(hidden)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    full = torch.compile(step, backend="aot_eager", fullgraph=True)(hidden)
    assert torch.equal(full, loss)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

MODULES = {
    "cross_entropy": torchloss.nn.CrossEntropyLoss,
    "soft_cross_entropy": torchloss.nn.SoftCrossEntropyLoss,
    "forward_kl": torchloss.nn.ForwardKLLoss,
    "reverse_kl": torchloss.nn.ReverseKLLoss,
}


@pytest.mark.parametrize("kind", KINDS)
def test_modules_match_the_functions(kind: str) -> None:
    case = lossspec.make_case(kind, "float_weights", vocab=50, lead_shape=(3, 4))
    module = MODULES[kind](normalization="tokens", impl="torch", **OPTIONS[kind])
    assert isinstance(module, torch.nn.Module) and not list(module.parameters())
    assert "normalization='tokens'" in repr(module)
    for denominator in (None, 20.0):
        logits, target, mask = inputs(case)
        loss = module(logits, target, mask, denominator=denominator)
        loss.backward()
        expected = run(case, "torch", normalization="tokens", denominator=denominator, **OPTIONS[kind])
        np.testing.assert_array_equal(loss.detach().numpy(), expected[0])
        np.testing.assert_array_equal(logits.grad.double().numpy(), expected[1])


def test_module_options_are_validated_at_construction() -> None:
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        torchloss.nn.CrossEntropyLoss(label_smoothing=2.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        torchloss.nn.ForwardKLLoss(temperature=0.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        torchloss.nn.ReverseKLLoss(impl="xla")
    with pytest.raises(ValueError, match="normalization must be one of"):
        torchloss.nn.SoftCrossEntropyLoss(normalization="mean")
    with pytest.raises(TypeError):
        torchloss.nn.CrossEntropyLoss(0.1)  # options are keyword-only


# --------------------------------------------------------------------------------------------
# count_denominator and micro-batches
# --------------------------------------------------------------------------------------------


def test_count_denominator_matches_lossspec() -> None:
    case = lossspec.make_case("cross_entropy", "float_weights", vocab=10, lead_shape=(4, 6))
    labels = torch.from_numpy(case.target)
    mask = torch.from_numpy(case.loss_mask)
    bool_mask = mask > 0
    for args in ((labels, None), (None, mask), (labels, mask), (labels, bool_mask), (None, bool_mask)):
        np_args = tuple(None if a is None else a.numpy() for a in args)
        for normalization in ("valid_tokens", "tokens"):
            count = torchloss.count_denominator(*args, normalization=normalization)
            assert count.dtype == torch.float32 and count.shape == ()
            expected = lossspec.count_denominator(*np_args, normalization=normalization)
            assert abs(float(count) - expected) <= 1e-6 * max(1.0, expected)
    assert float(torchloss.count_denominator(labels, ignore_index=int(labels[0, 0]))) < labels.numel()


@pytest.mark.parametrize("impl", IMPLS)
def test_micro_batches_with_a_global_denominator(impl: str) -> None:
    """Counting pass, then each micro-batch with denominator=D: the sum of the micro-batch losses
    and gradients is the full-batch loss and gradient (SPEC section 4), an empty micro-batch
    and an all-masked one included."""
    case = lossspec.make_case("cross_entropy", "random", vocab=30, lead_shape=(12,))
    device = device_for(impl)
    logits, labels, mask = inputs(case, device=device)
    assert mask is not None
    mask[8:10] = False
    host_mask = mask.cpu().numpy()
    full, _ = run(case, impl)
    ref = lossspec.oracle("cross_entropy", case.logits, case.target, host_mask)
    splits = [(0, 5), (5, 5), (5, 8), (8, 10), (10, 12)]
    denominator = sum(torchloss.count_denominator(labels[a:b], mask[a:b]) for a, b in splits)
    total = torch.zeros((), device=device)
    with quiet():
        for a, b in splits:
            total = total + torchloss.cross_entropy(logits[a:b], labels[a:b], mask[a:b], denominator=denominator, impl=impl)
    total.backward()
    assert logits.grad is not None
    g0 = lossspec.g0_for(host_mask, host_mask & (case.target != -100), float(denominator), 1.0, 1.0, "valid_tokens")
    lossspec.assert_close_to_oracle(total.detach().cpu().numpy(), logits.grad.cpu().numpy(), ref[0], ref[1], dtype="float32", g0=g0)
    full_ref, _ = lossspec.oracle("cross_entropy", case.logits, case.target, case.loss_mask)
    lossspec.compare_loss(float(full), full_ref, "one call on the whole batch").check()


# --------------------------------------------------------------------------------------------
# Dispatch and packaging
# --------------------------------------------------------------------------------------------


def test_auto_is_the_torch_path_on_cpu() -> None:
    assert torchloss.backends.resolve("auto", torch.zeros(1)).kernels() is _torch


def test_import_without_triton() -> None:
    """``import torchloss`` and the torch path work without triton; impl="triton" says what is
    missing."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # as if not installed
        import torch, torchloss
        x = torch.randn(3, 5, requires_grad=True)
        torchloss.cross_entropy(x, torch.tensor([0, 1, 2]), impl="torch").backward()
        try:
            torchloss.cross_entropy(x, torch.tensor([0, 1, 2]), impl="triton")
        except ImportError as err:
            print("ImportError:", err)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "impl='triton' needs the triton package" in out.stdout


def test_triton_interpreter_setup() -> None:
    """Without CUDA, ``import torchloss`` enables the Triton interpreter before triton is
    imported; if triton was imported first without it, impl="triton" on CPU tensors says how to
    fix it instead of failing inside the interpreter."""
    script = textwrap.dedent(
        """
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        if sys.argv[1] == "late":
            import triton.language  # noqa: F401  (imported before torchloss, without the interpreter)
        import torch, torchloss
        x = torch.randn(3, 40, requires_grad=True)
        try:
            torchloss.cross_entropy(x, torch.tensor([0, 1, 2]), impl="triton").backward()
            print("ran", os.environ.get("TRITON_INTERPRET"), x.grad.shape)
        except RuntimeError as err:
            print("RuntimeError:", err)
        """
    )
    if torch.cuda.is_available():  # pragma: no cover - the GPU machines compile the kernels
        pytest.skip("CUDA machines compile the kernels")
    early = subprocess.run([sys.executable, "-c", script, "early"], capture_output=True, text=True, timeout=120)
    assert early.returncode == 0, early.stderr
    assert early.stdout.startswith("ran 1 torch.Size([3, 40])"), early.stdout
    late = subprocess.run([sys.executable, "-c", script, "late"], capture_output=True, text=True, timeout=120)
    assert late.returncode == 0, late.stderr
    assert "needs the Triton interpreter, enabled before triton is first imported" in late.stdout, late.stdout


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_scale_rows_matches_a_single_rounding(dtype: torch.dtype) -> None:
    """The tiled per-row scaling of the backward ("none") is bit-identical to ``grad.mul_(factor)``
    (multiply in fp32, round once), on the worker threads too."""
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(37, 29, generator=gen).to(dtype)
    factor = torch.randn(37, 1, generator=gen)
    expected = grad.clone().mul_(factor)
    assert torch.equal(_cpu.scale_rows_(grad, factor, lossspec.Tuning(cpu_tile_elements=64)), expected)


def test_reverse_kl_pivot_on_ties_matches_the_oracle() -> None:
    """Reverse KL's pivot on ties of the student's maximum (the first tying column,
    lossspec.stats), also split over vocabulary blocks: the oracle's numbers."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 50, generator=gen, dtype=torch.float64).float()
    t = torch.randn(4, 50, generator=gen, dtype=torch.float64).float()
    x[1, [3, 17, 40]] = 9.0  # a tie inside one row
    t[1, [3, 17, 40]] = torch.tensor([1.0, 5.0, -2.0])
    x[2, [0, 49]] = 7.0  # a tie at both ends (two blocks of 25 below)
    x[3, :] = 1.5  # every column ties
    ref_loss, ref_grad = lossspec.oracle("reverse_kl", x.numpy(), t.numpy())
    g0 = 1.0 / 4
    for block in (50, 25):
        xx = x.clone().requires_grad_(True)
        loss = torchloss.reverse_kl(xx, t, impl="torch", tuning=lossspec.Tuning(vocab_block=block))
        loss.backward()
        lossspec.assert_close_to_oracle(loss.item(), xx.grad.numpy(), ref_loss, ref_grad, dtype="float32", g0=g0)
