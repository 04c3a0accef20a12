"""torch.compile(fullgraph=True) of code that calls the torchloss losses.

Compiled calls go through the custom ops of ``torchloss._ops`` (eager calls through the autograd
Functions); both run the same backend code. Checked here: the four losses compiled with
``fullgraph=True`` against the float64 oracle (SPEC section 6 bounds) and bit for bit against
eager, for fp32 and bf16 logits, ``"valid_tokens"``, ``"none"`` and a ``denominator=`` tensor,
with a non-unit upstream gradient (the 16-bit backward recomputes); a Linear head trained for a
few steps by a compiled step equals the eager run; ``torch._dynamo.explain`` finds no graph
break; compile and backward print no warning; ``inplace=True`` / ``vocab_parallel=`` are one
documented graph break. The fast lane runs one case of each path with the ``aot_eager`` backend
(Dynamo and AOTAutograd, the same graphs without Inductor's code generation); the other cases and
every ``inductor`` run are slow.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo.testing
import torch._inductor.config

import lossspec
import torchloss

from parity_tests.support.torch_problem import TRITON_DEVICE

KINDS = lossspec.KINDS
OPTIONS: dict[str, dict[str, Any]] = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"temperature": 2.0, "teacher_logit_scale": 0.8},
    "reverse_kl": {"temperature": 0.8, "logit_scale": 1.2},
}
LEAD, VOCAB = (3, 8), 40
# "denominator": valid_tokens with denominator=<0-d tensor>; "none": per-token upstream gradients.
MODES = ("valid_tokens", "none", "denominator")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("aot_eager", "inductor")


def _grid(fast: set[tuple[str, ...]], *axes: tuple[str, ...]) -> list[Any]:
    """Every combination of ``axes``; those not in ``fast`` are marked slow (compiling costs
    seconds per graph: the fast lane keeps one of each path, Inductor's runs are all slow)."""
    combos: list[tuple[str, ...]] = [()]
    for axis in axes:
        combos = [c + (v,) for c in combos for v in axis]
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow) for c in combos]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch (Dynamo caches per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def _nothing_printed(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail if the block emits a Python warning, a log record of level WARNING or above, or
    anything on stdout/stderr (file-descriptor level, so C++ warnings count too).
    DeprecationWarnings are left out, as Python and this suite's settings do: the first
    Inductor compile of a process issues torch's own (``torch.jit.script_method``)."""
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
    out, err = capfd.readouterr()
    assert not [str(w.message) for w in caught], "warnings were issued"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], "warnings were logged"
    assert out == "" and err == "", f"printed: {out!r} {err!r}"


def _weights(rng: np.random.Generator, mask: np.ndarray) -> np.ndarray:
    """Float weights k/8 (k in 1..15) on the valid tokens: their fp32 sums are exact in any
    order, so a compiler's reduction order cannot change D."""
    return np.where(mask, rng.integers(1, 16, mask.shape) / 8.0, 0.0).astype(np.float32)


def _problem(mode: str, dtype: str) -> dict[str, Any]:
    """Inputs of all four kinds (logits exactly representable in ``dtype``), the upstream
    gradient of each loss (0.75, or per token for ``"none"``) and the denominator."""
    rng = np.random.default_rng(7)
    cases = {kind: lossspec.make_case(kind, "random", lead_shape=LEAD, vocab=VOCAB, dtype=dtype, seed=3) for kind in KINDS}
    weights = _weights(rng, cases["cross_entropy"].loss_mask)
    upstream = rng.uniform(0.25, 2.0, LEAD).astype(np.float32) if mode == "none" else np.float32(0.75)
    return {"cases": cases, "weights": weights, "upstream": upstream, "denominator": 11.5 if mode == "denominator" else None}


def _losses(mode: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The function under test: the four losses of four logits tensors."""
    normalization = "none" if mode == "none" else "valid_tokens"

    def losses(xs: list[torch.Tensor], targets: list[torch.Tensor], weights: torch.Tensor, denominator: Any) -> tuple[torch.Tensor, ...]:
        return tuple(
            getattr(torchloss, kind)(x, t, weights, normalization=normalization, denominator=denominator, **OPTIONS[kind])
            for kind, x, t in zip(KINDS, xs, targets)
        )

    return losses


def _run(fn: Callable[..., tuple[torch.Tensor, ...]], problem: dict[str, Any], dtype: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses and logits gradients of ``fn`` for ``problem`` (backward with its upstream gradient)."""
    cases = problem["cases"]
    xs = [torch.tensor(cases[k].logits).to(DTYPES[dtype]).requires_grad_() for k in KINDS]
    targets = [torch.tensor(cases[k].target) if k == "cross_entropy" else torch.tensor(cases[k].target).to(DTYPES[dtype]) for k in KINDS]
    denominator = None if problem["denominator"] is None else torch.tensor(problem["denominator"])
    losses = fn(xs, targets, torch.tensor(problem["weights"]), denominator)
    upstream = torch.tensor(problem["upstream"])
    torch.autograd.backward(losses, [upstream.expand_as(loss) for loss in losses])
    return [loss.detach() for loss in losses], [x.grad for x in xs]


@pytest.mark.parametrize(
    ("mode", "dtype", "backend"),
    _grid({("none", "bfloat16", "aot_eager")}, MODES, tuple(DTYPES), BACKENDS),
)
def test_compiled_losses_match_oracle_and_eager(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, mode: str, dtype: str, backend: str) -> None:
    """fullgraph=True: each loss and its logits gradient within SPEC section 6 of the float64
    oracle and bit for bit the eager numbers, with a non-unit upstream gradient; nothing printed
    while compiling and running backward."""
    problem = _problem(mode, dtype)
    compiled = torch.compile(_losses(mode), backend=backend, fullgraph=True)
    with _nothing_printed(capfd, caplog):
        losses, grads = _run(compiled, problem, dtype)
    eager_losses, eager_grads = _run(_losses(mode), problem, dtype)
    normalization = "none" if mode == "none" else "valid_tokens"
    for i, kind in enumerate(KINDS):
        case = problem["cases"][kind]
        options = dict(OPTIONS[kind], normalization=normalization, grad_output=problem["upstream"])
        if problem["denominator"] is not None:
            options["denominator"] = problem["denominator"]
        ref_loss, ref_grad = lossspec.oracle(kind, case.logits, case.target, problem["weights"], **options)
        case.loss_mask = problem["weights"]  # G0 from the weights used
        lossspec.assert_close_to_oracle(losses[i].double().numpy(), grads[i].double().numpy(), ref_loss, ref_grad, dtype=dtype, g0=case.g0(**options), what=f"compiled {kind}")
        assert torch.equal(losses[i], eager_losses[i]), f"{kind}: compiled loss != eager loss"
        assert grads[i].dtype == DTYPES[dtype] and torch.equal(grads[i], eager_grads[i]), f"{kind}: compiled gradient != eager gradient"


@pytest.mark.slow
def test_explain_finds_no_graph_break() -> None:
    """``torch._dynamo.explain``: the four losses (and every option path: float weights, a
    denominator tensor, a Python denominator, "none", a ``torchloss.nn`` module, ``causal_shift``
    with ``count_denominator``) are one graph."""
    problem = _problem("denominator", "float32")
    cases = problem["cases"]
    xs = [torch.tensor(cases[k].logits).requires_grad_() for k in KINDS]
    targets = [torch.tensor(cases[k].target) for k in KINDS]
    weights = torch.tensor(problem["weights"])

    def everything(xs: list[torch.Tensor], targets: list[torch.Tensor], weights: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        total = sum(_losses("denominator")(xs, targets, weights, denominator))
        total = total + sum(_losses("valid_tokens")(xs, targets, weights > 0, 4.0))
        counted = torchloss.count_denominator(targets[0], weights, causal_shift=True)  # traced, not a break
        total = total + torchloss.cross_entropy(xs[0], targets[0], weights, causal_shift=True, denominator=counted)
        total = total + torchloss.nn.ReverseKLLoss(temperature=1.3)(xs[3], targets[3], weights)
        return total + sum(loss.sum() for loss in _losses("none")(xs, targets, weights, None))

    explanation = torch._dynamo.explain(everything)(xs, targets, weights, torch.tensor(11.5))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# --------------------------------------------------------------------------------------------
# A small model: a compiled training step against the eager one
# --------------------------------------------------------------------------------------------

HIDDEN = 16


def _head_problem() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(LEAD, generator=gen) > 0.25
    return {
        "hidden": torch.randn(*LEAD, HIDDEN, generator=gen),
        "labels": torch.where(mask, torch.randint(0, VOCAB, LEAD, generator=gen), -100),
        "teacher": torch.randn(*LEAD, VOCAB, generator=gen) * 2,
        "weights": torch.tensor(_weights(np.random.default_rng(5), mask.numpy())),
    }


def _head_loss(head: torch.nn.Linear, batch: dict[str, torch.Tensor], logits_dtype: torch.dtype) -> torch.Tensor:
    """A Linear head and the four losses (the objective of one training step)."""
    logits = head(batch["hidden"]).to(logits_dtype)
    ce = torchloss.cross_entropy(logits, batch["labels"], label_smoothing=0.1)
    soft = torchloss.soft_cross_entropy(logits, batch["teacher"].to(logits_dtype), batch["weights"], temperature=1.5)
    fkl = torchloss.forward_kl(logits, batch["teacher"].to(logits_dtype), batch["weights"], normalization="none")
    rkl = torchloss.reverse_kl(logits, batch["teacher"].to(logits_dtype), batch["weights"], denominator=torch.tensor(9.0))
    return ce + 0.5 * soft + 0.01 * fkl.sum() + 2.0 * rkl


def _train(step: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor], logits_dtype: torch.dtype, steps: int) -> tuple[list[float], torch.nn.Linear, torch.Tensor]:
    """``steps`` SGD-with-momentum steps from a fixed start; the losses, the trained head and
    the first step's weight gradient."""
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9)
    losses, first_grad = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = step(head, batch, logits_dtype)
        loss.backward()
        first_grad = head.weight.grad.clone() if first_grad is None else first_grad
        optimizer.step()
        losses.append(loss.item())
    return losses, head, first_grad


def _head_oracle(head: torch.nn.Linear, batch: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[float, np.ndarray]:
    """The float64 loss of :func:`_head_loss` on the step's own (rounded) logits, and the weight
    gradient chained through the head in float64."""
    x, teacher, w = logits.double().numpy(), batch["teacher"].to(logits.dtype).double().numpy(), batch["weights"].numpy()
    parts = [
        (1.0, lossspec.oracle("cross_entropy", x, batch["labels"].numpy(), None, label_smoothing=0.1)),
        (0.5, lossspec.oracle("soft_cross_entropy", x, teacher, w, temperature=1.5)),
        (0.01, lossspec.oracle("forward_kl", x, teacher, w, normalization="none")),
        (2.0, lossspec.oracle("reverse_kl", x, teacher, w, denominator=9.0)),
    ]
    loss = sum(scale * np.sum(value) for scale, (value, _) in parts)
    dlogits = sum(scale * grad for scale, (_, grad) in parts)
    dweight = np.einsum("btv,bth->vh", dlogits, batch["hidden"].double().numpy())
    return float(loss), dweight


@pytest.mark.parametrize(("dtype", "backend"), _grid({("bfloat16", "aot_eager")}, tuple(DTYPES), BACKENDS))
def test_compiled_training_steps_equal_eager(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, dtype: str, backend: str) -> None:
    """A Linear head (no bias) trained for 3 steps by a compiled (fullgraph=True) forward: the
    parameters and gradients equal the eager run's bit for bit, and so do the losses with
    ``aot_eager`` (Inductor generates its own code for the rest of the step: the per-token
    losses' ``.sum()`` may round differently, and its bf16 arithmetic, here autograd's sum of
    the four losses' bf16 gradients, rounds like eager only with ``emulate_precision_casts``);
    the first step's loss and weight gradient are within the float64 oracle's bounds; no graph
    break, nothing printed."""
    batch = _head_problem()
    logits_dtype = DTYPES[dtype]
    explanation = torch._dynamo.explain(_head_loss)(torch.nn.Linear(HIDDEN, VOCAB, bias=False), batch, logits_dtype)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_head_loss, backend=backend, fullgraph=True)
    with _nothing_printed(capfd, caplog), torch._inductor.config.patch(emulate_precision_casts=True):
        losses, head, first_grad = _train(compiled, batch, logits_dtype, 3)
    eager_losses, eager_head, eager_grad = _train(_head_loss, batch, logits_dtype, 3)
    if backend == "aot_eager":
        assert losses == eager_losses
    else:
        np.testing.assert_allclose(losses, eager_losses, rtol=1e-6)
    assert torch.equal(first_grad, eager_grad)
    assert torch.equal(head.weight, eager_head.weight)
    # Against the oracle: the first step, from the same start, on its own rounded logits.
    torch.manual_seed(0)
    start = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        logits = start(batch["hidden"]).to(logits_dtype)
    ref_loss, ref_grad = _head_oracle(start, batch, logits)
    lossspec.compare_loss(losses[0], ref_loss, "first loss").check()
    # The fp32 product with the hidden states adds ~1e-7 relative; the logits' own bound dominates.
    bound = (2 * lossspec.GRAD_RTOL if dtype == "float32" else 2e-2) * np.abs(ref_grad).max()
    np.testing.assert_allclose(first_grad.double().numpy(), ref_grad, rtol=0, atol=bound)


# --------------------------------------------------------------------------------------------
# Inference, the ops themselves, and what stays eager
# --------------------------------------------------------------------------------------------


def test_compiled_inference_computes_no_gradient() -> None:
    """Under no_grad the compiled loss is the eager loss and no gradient buffer is made."""
    case = lossspec.make_case("forward_kl", "random", lead_shape=LEAD, vocab=VOCAB, seed=4)
    x, t, m = torch.tensor(case.logits), torch.tensor(case.target), torch.tensor(case.loss_mask)
    fn = torch.compile(lambda x, t, m: torchloss.forward_kl(x, t, m, temperature=2.0), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        loss = fn(x, t, m)
    ref, _ = lossspec.oracle("forward_kl", case.logits, case.target, case.loss_mask, temperature=2.0)
    lossspec.compare_loss(loss.item(), ref).check()
    assert torch.equal(loss, torchloss.forward_kl(x, t, m, temperature=2.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_ops_pass_opcheck(dtype: str) -> None:
    """``torch.library.opcheck``: schema, fake (meta) shapes and dtypes, autograd registration
    and AOT dispatch of ``torchloss::masked_loss`` and ``torchloss::masked_loss_regrad_``."""
    from torchloss import _ops

    case = lossspec.make_case("cross_entropy", "random", lead_shape=(6,), vocab=VOCAB, dtype=dtype, seed=2)
    x = torch.tensor(case.logits).to(DTYPES[dtype]).requires_grad_()
    labels = torch.tensor(np.where(case.loss_mask & (case.target >= 0) & (case.target < VOCAB), case.target, 0))
    coef = torch.tensor(case.loss_mask.astype(np.float32)) / 4.0
    config = _ops.config_args(lossspec.make_config("cross_entropy", normalization="sum", z_loss=1e-3))
    for need_grad in (True, False):
        torch.library.opcheck(torch.ops.torchloss.masked_loss.default, (x, labels, coef, *config, "torch", need_grad))
    grad = torch.zeros(x.shape, dtype=x.dtype)
    args = (x.detach(), labels, coef, torch.tensor([0.5]), grad, torch.empty((0, x.shape[0])), *config, "torch")
    torch.library.opcheck(torch.ops.torchloss.masked_loss_regrad_.default, args)


def test_inplace_and_vocab_parallel_are_one_documented_graph_break() -> None:
    """Under torch.compile, inplace=True and vocab_parallel= run eagerly behind one graph break
    whose reason says so (fullgraph=True refuses them with it); the numbers are the eager ones."""
    batch = _head_problem()
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB)

    def inplace_step(hidden: torch.Tensor) -> torch.Tensor:
        return torchloss.cross_entropy(head(hidden), batch["labels"], inplace=True) * 0.5

    explanation = torch._dynamo.explain(inplace_step)(batch["hidden"])
    assert explanation.graph_break_count == 1
    assert "inplace=True" in explanation.break_reasons[0].reason
    torch._dynamo.reset()
    loss = torch.compile(inplace_step, backend="aot_eager")(batch["hidden"])
    loss.backward()
    grad, head.weight.grad = head.weight.grad, None
    eager = inplace_step(batch["hidden"])
    eager.backward()
    assert torch.equal(loss, eager) and torch.equal(grad, head.weight.grad)
    group = object()  # never reached: the call is refused before the group is checked

    def vocab_parallel_step(hidden: torch.Tensor) -> torch.Tensor:
        return torchloss.cross_entropy(head(hidden), batch["labels"], vocab_parallel=group)

    for step in (inplace_step, vocab_parallel_step):
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="runs eagerly under torch.compile"):
            torch.compile(step, backend="aot_eager", fullgraph=True)(batch["hidden"])


@pytest.mark.slow
def test_changing_values_under_compile() -> None:
    """A denominator that changes every step, as a 0-d tensor, is runtime data: one compiled
    graph serves every value, with the oracle's numbers; as a Python float it is traced
    symbolically after the first change (fullgraph=True still works, the eager numbers). An
    option that changes (here the temperature) is retraced as a symbolic float, which the option
    checks trace too: fullgraph=True works, with the eager and the oracle's numbers."""
    case = lossspec.make_case("forward_kl", "random", lead_shape=LEAD, vocab=VOCAB, seed=6)
    x, teacher, mask = torch.tensor(case.logits), torch.tensor(case.target), torch.tensor(case.loss_mask)

    def loss(x: torch.Tensor, denominator: Any, temperature: float = 1.0) -> torch.Tensor:
        return torchloss.forward_kl(x, teacher, mask, denominator=denominator, temperature=temperature)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    for value in (5.0, 7.5, 30.0):
        ref, _ = lossspec.oracle("forward_kl", case.logits, case.target, case.loss_mask, denominator=value)
        lossspec.compare_loss(compiled(x, torch.tensor(value)).item(), ref).check()
    assert counter.frame_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for value in (5.0, 7.5, 30.0):
        assert torch.equal(compiled(x, value), loss(x, value))
    torch._dynamo.reset()
    relaxed = torch.compile(loss, backend="aot_eager")
    for temperature in (1.0, 2.0):
        assert torch.equal(relaxed(x, None, temperature), loss(x, None, temperature))
    torch._dynamo.reset()
    strict = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for temperature in (1.0, 2.0, 3.0):  # a changing option compiles too (a symbolic float)
        ref, _ = lossspec.oracle("forward_kl", case.logits, case.target, case.loss_mask, temperature=temperature)
        got = strict(x, None, temperature)
        assert torch.equal(got, loss(x, None, temperature))
        lossspec.compare_loss(got.item(), ref).check()


@pytest.mark.slow
def test_a_python_denominator_changing_every_call_compiles_once() -> None:
    """A Python-number denominator that changes every call (a token count) once recompiled per
    value: the value check read it on the host (``np.asarray``), specialising the graph to it,
    so that the 9th value raised ``FailOnRecompileLimitHit`` under ``fullgraph=True`` (without
    it the calls fell back to eager). Now Dynamo's first (static) graph and one symbolic retrace
    serve 20 values, with the oracle's loss and gradient; under tracing a bad value is caught on
    the device (NaN loss), while the eager call still raises (docs/DESIGN.md, value checks)."""
    case = lossspec.make_case("reverse_kl", "random", lead_shape=LEAD, vocab=VOCAB, seed=8)
    teacher, mask = torch.tensor(case.target), torch.tensor(case.loss_mask)

    def loss(x: torch.Tensor, denominator: float) -> torch.Tensor:
        return torchloss.reverse_kl(x, teacher, mask, denominator=denominator, temperature=0.8)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    for step in range(20):
        value = 3.0 + 1.25 * step
        x = torch.tensor(case.logits, requires_grad=True)
        got = compiled(x, value)
        got.backward()
        ref = case.reference(denominator=value, temperature=0.8)
        lossspec.assert_close_to_oracle(got.item(), x.grad.double().numpy(), ref.loss, ref.grad, dtype="float32", g0=ref.g0)
    assert counter.frame_count == 2, counter.frame_count  # the static first call, then one symbolic graph
    x = torch.tensor(case.logits)
    for bad in (-1.0, 1e-40, 1e-300, 1e39, float("inf"), float("nan")):
        assert torch.isnan(compiled(x, bad)), bad
        with pytest.raises(ValueError, match="denominator must be"):
            loss(x, bad)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_option_changing_every_call_compiles_once(dtype: str) -> None:
    """An option that changes every call (a temperature or soft-cap schedule) once recompiled per
    value: the custom op took the options as float arguments, which a graph specialises (the 9th
    value raised ``FailOnRecompileLimitHit`` under ``fullgraph=True``). They now travel as a
    tensor's values: the static first graph and one symbolic retrace serve 20 values, with the
    oracle's loss and gradient (bf16: the backward's recompute reads the options too)."""
    case = lossspec.make_case("reverse_kl", "random", lead_shape=LEAD, vocab=VOCAB, dtype=dtype, seed=9)
    teacher, mask = torch.tensor(case.target).to(DTYPES[dtype]), torch.tensor(case.loss_mask)

    def loss(x: torch.Tensor, temperature: float, cap: float) -> torch.Tensor:
        return torchloss.reverse_kl(x, teacher, mask, temperature=temperature, logit_softcap=cap)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    for step in range(20):
        temperature, cap = 0.5 + 0.125 * step, 30.0 - step
        x = torch.tensor(case.logits).to(DTYPES[dtype]).requires_grad_(True)
        got = compiled(x, temperature, cap)
        got.backward(torch.tensor(0.75))
        ref = case.reference(temperature=temperature, logit_softcap=cap, grad_output=0.75)
        lossspec.assert_close_to_oracle(got.item(), x.grad.double().numpy(), ref.loss, ref.grad, dtype=dtype, g0=ref.g0)
    assert counter.frame_count == 2, counter.frame_count  # the static first call, then one symbolic graph


def test_argument_errors_under_compile() -> None:
    """A shape error is raised while tracing with the eager message: the ValueError itself, or
    under fullgraph=True Dynamo's Unsupported carrying it."""
    x, labels = torch.randn(8, VOCAB), torch.randint(0, VOCAB, (7,))
    message = r"labels must have the leading shape of logits \[8\]"
    with pytest.raises(ValueError, match=message):
        torch.compile(lambda x, y: torchloss.cross_entropy(x, y), backend="aot_eager")(x, labels)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=message):
        torch.compile(lambda x, y: torchloss.cross_entropy(x, y), backend="aot_eager", fullgraph=True)(x, labels)


def test_compiled_triton_impl_matches_eager() -> None:
    """impl="triton" through the custom op: bf16 logits and a non-unit upstream gradient (the
    regrad kernel), bit for bit the eager numbers. On ``TRITON_DEVICE``: compiled kernels on CUDA
    tensors where CUDA is available, else interpreted on CPU tensors (inputs made on the host)."""
    case = lossspec.make_case("reverse_kl", "random", lead_shape=(6,), vocab=VOCAB, dtype="bfloat16", seed=8)
    teacher = torch.tensor(case.target).to(torch.bfloat16).to(TRITON_DEVICE)
    mask = torch.tensor(case.loss_mask).to(TRITON_DEVICE)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return 0.75 * torchloss.reverse_kl(x, teacher, mask, temperature=1.5, impl="triton")

    results = []
    for fn in (torch.compile(loss, backend="aot_eager", fullgraph=True), loss):
        x = torch.tensor(case.logits).to(torch.bfloat16).to(TRITON_DEVICE).requires_grad_()
        value = fn(x)
        value.backward()
        results.append((value.detach().cpu(), x.grad.cpu()))
    ref, ref_grad = lossspec.oracle("reverse_kl", case.logits, case.target, case.loss_mask, temperature=1.5, grad_output=0.75)
    lossspec.assert_close_to_oracle(results[0][0].item() / 0.75, results[0][1].double().numpy(), ref, ref_grad, dtype="bfloat16", g0=case.g0(temperature=1.5, grad_output=0.75))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("normalization", ["tokens", "valid_tokens", "none"])
def test_causal_shift_compiles_with_the_oracle_numbers(normalization: str) -> None:
    """``causal_shift=True`` under ``fullgraph=True`` (its shifted count included: the
    ``"tokens"`` count is plain Python, traced): the oracle's loss and gradient within the
    bounds, bit for bit the eager ones, the last position's gradient exactly 0."""
    case = lossspec.make_case("cross_entropy", "random", lead_shape=LEAD, vocab=VOCAB, seed=11)
    options = {"causal_shift": True, "label_smoothing": 0.1, "normalization": normalization}
    labels, mask = torch.tensor(case.target), torch.tensor(case.loss_mask)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return torchloss.cross_entropy(x, labels, mask, **options).sum()

    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        x = torch.tensor(case.logits).requires_grad_()
        value = fn(x)
        value.backward()
        results.append((value.detach(), x.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert torch.equal(compiled, eager) and torch.equal(compiled_grad, eager_grad)
    upstream = np.ones(LEAD, np.float32) if normalization == "none" else None
    ref_loss, ref_grad = lossspec.oracle("cross_entropy", case.logits, case.target, case.loss_mask, grad_output=upstream, **options)
    lossspec.compare_loss(compiled.item(), float(np.sum(ref_loss))).check()
    lossspec.compare_grad(compiled_grad.numpy(), ref_grad, "float32", case.g0(**options)).check()
    assert torch.all(compiled_grad[..., -1, :] == 0)
