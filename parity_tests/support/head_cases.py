"""The fused LM head's shared test cases (``linear_<kind>`` in both frameworks): seeded inputs,
the float64 head oracle, one runner per framework, the block-budget ``plan`` fixture (a
``tuning=lossspec.HeadTuning``), the checks
at SPEC section 8's bounds and the torch profiler's peak-memory reading. Not a test module: the
head suites (``test_linear_head*.py``, ``test_softcap.py``) import it."""

from __future__ import annotations

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

KINDS = tuple(lossspec.HEAD_KINDS)  # the fused head's kinds: every kind whose table row has head=True
LEAD, H, HT, V = (3, 4), 8, 6, 37
# (block_elements, blocked_rows): whole rows of 5 tokens (chunks 5, 5, 2), or the fallback with
# chunks of 5 rows and vocabulary blocks of 3 columns (37 = 12 * 3 + 1).
PLANS = {"whole": (5 * V, 64), "blocked": (15, 5)}
NORMS = {
    "valid_tokens": dict(normalization="valid_tokens"),
    "none": dict(normalization="none"),
    "denominator": dict(normalization="valid_tokens", denominator=7.5),
}
OPTIONS = {
    "cross_entropy": dict(label_smoothing=0.1, z_loss=1e-3, logit_scale=1.3),
    "distill": dict(temperature=1.5, teacher_logit_scale=0.8, logit_scale=1.1, beta=0.3),
}


def options_for(kind: str) -> dict[str, Any]:
    """The kind's test options: cross-entropy's with labels, else those of the "distill" set
    the kind takes (its table row's options: entropy has no teacher scale, only
    jensen_shannon a ``beta``)."""
    spec = lossspec.KIND_SPECS[kind]
    options = OPTIONS["cross_entropy" if spec.has_labels else "distill"]
    return {name: value for name, value in options.items() if name in spec.option_names}


def head_target(kind: str, inputs: dict[str, Any]) -> Any:
    """``oracle_head``'s target of ``kind``: the labels, the teacher's ``(hidden, weight, bias)``
    (``bias`` ``None`` where ``inputs`` has none), or ``None`` (no target)."""
    spec = lossspec.KIND_SPECS[kind]
    if spec.has_labels:
        return inputs["labels"]
    return (inputs["teacher_hidden"], inputs["teacher_weight"], inputs.get("teacher_bias")) if spec.has_teacher else None


def target_args(kind: str, inputs: dict[str, Any], convert: Any, labels: Any) -> tuple[tuple, dict[str, Any]]:
    """The head's positional target arguments and its ``teacher_bias`` keyword: ``(labels,)``
    (through ``labels``), the teacher's ``(hidden, weight)`` and bias (through ``convert``), or
    nothing (a kind without a target)."""
    spec = lossspec.KIND_SPECS[kind]
    if spec.has_labels:
        return (labels(inputs["labels"]),), {}
    if spec.has_teacher:
        return (convert(inputs["teacher_hidden"]), convert(inputs["teacher_weight"])), {"teacher_bias": convert(inputs["teacher_bias"])}
    return (), {}


def make_inputs(
    kind: str,
    dtype: str,
    seed: int = 0,
    lead: tuple[int, ...] = LEAD,
    sizes: tuple[int, int, int] = (H, HT, V),
    weight_scales: tuple[float, float] = (0.6, 0.6),
) -> dict[str, Any]:
    """Seeded float32 inputs, exactly representable in ``dtype``; labels with ignored tokens and
    float mask weights (0 included). ``sizes``: ``(H, Ht, V)``; ``weight_scales``: the student's
    and the teacher's weight scale."""
    hidden, t_hidden, vocab = sizes
    rng = np.random.default_rng(seed)
    r = lambda shape, scale: lossspec.round_to_dtype(scale * rng.standard_normal(shape), dtype)  # noqa: E731
    inputs: dict[str, Any] = {
        "hidden": r(lead + (hidden,), 1.0),
        "weight": r((vocab, hidden), weight_scales[0]),
        "bias": r((vocab,), 0.5),
        "loss_mask": rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), size=lead),
    }
    spec = lossspec.KIND_SPECS[kind]
    if spec.has_labels:
        labels = rng.integers(0, vocab, size=lead)
        labels.flat[1] = -100
        inputs["labels"] = labels
    elif spec.has_teacher:
        inputs.update(teacher_hidden=r(lead + (t_hidden,), 1.0), teacher_weight=r((vocab, t_hidden), weight_scales[1]),
                      teacher_bias=r((vocab,), 0.5))
    return inputs


def driver_reference(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any]) -> tuple[np.ndarray, ...]:
    """The float64 oracle of the heads' drivers (``head_forward``: per-token losses, gradients of
    ``sum_i coef_i l_i``): ``(l [N], G [N, V], h [N, H], W [V, H])``, ``h`` the flattened hidden."""
    h = inputs["hidden"].reshape(-1, inputs["hidden"].shape[-1]).astype(np.float64)
    w = inputs["weight"].astype(np.float64)
    z = spec_linear.head_logits(h, w, inputs["bias"])
    spec = lossspec.KIND_SPECS[kind]
    target = None
    if spec.has_labels:
        target = inputs["labels"].reshape(-1)
    elif spec.has_teacher:
        t_hidden = inputs["teacher_hidden"]
        target = spec_linear.head_logits(t_hidden.reshape(-1, t_hidden.shape[-1]), inputs["teacher_weight"], inputs["teacher_bias"])
    per_token, g = lossspec.oracle(kind, z, target, coef, normalization="none", **options)
    return per_token, g, h, w


def grad_output_for(normalization: str, lead: tuple[int, ...] = LEAD) -> np.ndarray:
    """A non-unit upstream gradient: a scalar, or one value per token for ``"none"``."""
    if normalization == "none":
        return np.linspace(0.5, 2.0, int(np.prod(lead))).reshape(lead).astype(np.float32)
    return np.asarray(1.75, np.float32)


def reference(kind: str, inputs: dict[str, Any], with_bias: bool, options: dict[str, Any], grad_output: np.ndarray) -> tuple:
    return spec_linear.oracle_head(
        kind, inputs["hidden"], inputs["weight"], head_target(kind, inputs), inputs["loss_mask"], bias=inputs["bias"] if with_bias else None, grad_output=grad_output, **options
    )


def run_jax(kind: str, inputs: dict[str, Any], dtype: str, with_bias: bool, options: dict[str, Any], grad_output: np.ndarray) -> tuple:
    """``(loss, {name: grad})`` from ``jaxloss.linear_<kind>`` through ``jax.vjp``."""
    jdt = jnp.dtype(dtype)
    params = {"hidden": jnp.asarray(inputs["hidden"], jdt), "weight": jnp.asarray(inputs["weight"], jdt)}
    if with_bias:
        params["bias"] = jnp.asarray(inputs["bias"], jdt)
    fn = getattr(jaxloss, f"linear_{kind}")
    target, extra = target_args(kind, inputs, lambda a: jnp.asarray(a, jdt), lambda y: jnp.asarray(y, jnp.int32))

    def loss_of(p: dict[str, Any]) -> Any:
        return fn(p["hidden"], p["weight"], *target, jnp.asarray(inputs["loss_mask"]), bias=p.get("bias"), **extra, **options)

    loss, vjp = jax.vjp(loss_of, params)
    (grads,) = vjp(jnp.asarray(grad_output, jnp.float32))
    assert all(grads[name].dtype == jdt for name in grads)
    return np.asarray(loss, np.float64), {name: np.asarray(g.astype(jnp.float32), np.float64) for name, g in grads.items()}


def run_torch(kind: str, inputs: dict[str, Any], dtype: str, with_bias: bool, options: dict[str, Any], grad_output: np.ndarray,
              device: torch.device = torch.device("cpu")) -> tuple:
    """``(loss, {name: grad})`` from ``torchloss.linear_<kind>`` through ``backward``, the tensors on
    ``device`` (inputs made on the host, results back on it)."""
    tdt = getattr(torch, dtype)
    as_t = lambda a: torch.tensor(np.asarray(a, np.float32)).to(tdt).to(device)  # noqa: E731  (exact)
    params = {"hidden": as_t(inputs["hidden"]), "weight": as_t(inputs["weight"])}
    if with_bias:
        params["bias"] = as_t(inputs["bias"])
    for p in params.values():
        p.requires_grad_(True)
    fn = getattr(torchloss, f"linear_{kind}")
    target, extra = target_args(kind, inputs, as_t, lambda y: torch.tensor(y).to(device))
    loss = fn(params["hidden"], params["weight"], *target, torch.tensor(inputs["loss_mask"]).to(device), bias=params.get("bias"), **extra,
              **options)
    loss.backward(torch.tensor(grad_output).to(device))
    assert all(p.grad.dtype == tdt for p in params.values())
    return loss.detach().cpu().double().numpy(), {name: p.grad.cpu().float().double().numpy() for name, p in params.items()}


RUNNERS = {"jax": run_jax, "torch": run_torch}


def cases(names: str, axes: list[list[Any]], slow: Any, indirect: tuple[str, ...] = ()) -> Any:
    """``pytest.mark.parametrize`` over the product of ``axes``, the combinations for which
    ``slow(*combo)`` holds marked slow (JAX compiles each: the fast lane keeps a cover of them)."""
    import itertools

    params = [pytest.param(*combo, marks=[pytest.mark.slow] if slow(*combo) else []) for combo in itertools.product(*axes)]
    return pytest.mark.parametrize(names, params, indirect=list(indirect))


@pytest.fixture
def plan(request: pytest.FixtureRequest) -> lossspec.HeadTuning:
    """The ``tuning=`` of ``PLANS[request.param]``'s block budget (both frameworks)."""
    return block_budget(*PLANS[request.param])


def block_budget(block_elements: int, blocked_rows: int, **fields: Any) -> lossspec.HeadTuning:
    """The fused head's ``tuning=`` with this block budget (``lossspec.linear.head_plan``'s
    inputs) and the other ``fields`` of :class:`lossspec.HeadTuning`."""
    return lossspec.HeadTuning(block_elements=block_elements, blocked_rows=blocked_rows, **fields)


def check(
    framework: str, kind: str, dtype: str, with_bias: bool, options: dict[str, Any], inputs: Optional[dict[str, Any]] = None,
    head_options: Optional[dict[str, Any]] = None,
) -> None:
    """The head against the oracle; ``head_options`` (e.g. ``recompute_logits``) go to the head
    only: they change how, not what, it computes."""
    inputs = inputs if inputs is not None else make_inputs(kind, dtype)
    grad_output = grad_output_for(options.get("normalization", "valid_tokens"), np.shape(inputs["loss_mask"]))
    loss, grads = RUNNERS[framework](kind, inputs, dtype, with_bias, {**options, **(head_options or {})}, grad_output)
    ref_loss, ref_grads = reference(kind, inputs, with_bias, options, grad_output)
    lossspec.compare_loss(loss, ref_loss, f"{framework} {kind} loss").check()
    assert set(grads) == ({"hidden", "weight", "bias"} if with_bias else {"hidden", "weight"})
    for name, grad in grads.items():
        spec_linear.compare_head_grad(grad, ref_grads[name], dtype, f"{framework} {kind} grad {name}", ref_grads.magnitude[name]).check()



MEM_N, MEM_H, MEM_V = 1024, 16, 4096  # one [N, V] fp32 logits buffer: 16 MiB


def peak_extra(fn: Any) -> int:
    """Peak CPU memory torch's allocator held while ``fn`` ran, above what it held at the start:
    the profiler's allocation events (``profile_memory=True``), each with the allocator's total
    after it (``total_allocated``). The same bytes as the profiler's memory timeline
    (``export_memory_timeline``, which categorises every tensor from the ops' stacks and shapes:
    5.85 s against 0.26 s for one fused-head step, the same peak to the byte)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.typed[0].name == "Allocation" and event.typed[1].device.type == "cpu":  # an allocation or a free
            allocations.append(event)
        pending.extend(event.children)
    if not allocations:
        return 0
    allocations.sort(key=lambda event: event.start_time_ns)
    first = allocations[0].typed[1]
    return max(event.typed[1].total_allocated for event in allocations) - (first.total_allocated - first.alloc_size)


# All-positive inputs (``torch.rand``-style hidden states and weights, as in Liger's fused-head
# tests): the rows of the logits gradient G sum to (about) 0 while every column of W has mean
# 0.5, so dh = G W cancels to about 1/6 of its terms (SPEC section 8, componentwise bound).
POSITIVE_SIZES = (33, 67, 701)  # (H, Ht, V): Liger's test_fused_linear_jsd student / teacher widths


def positive_inputs(kind: str, seed: int = 5, lead: tuple[int, ...] = (2, 23), sizes: tuple[int, int, int] = POSITIVE_SIZES) -> dict[str, Any]:
    """Seeded float32 inputs uniform in ``[0, 1)`` (bias 0, like a biasless ``nn.Linear``);
    ``loss_mask`` 1 with a few tokens masked; cross-entropy labels uniform with label 2 ignored
    (Liger's ``ignore_index=2`` case: every label 2 is set to ``-100``)."""
    hidden, t_hidden, vocab = sizes
    rng = np.random.default_rng(seed)
    uniform = lambda *shape: rng.random(shape).astype(np.float32)  # noqa: E731  (exact in fp32)
    mask = np.ones(lead, np.float32)
    mask.flat[rng.integers(0, mask.size, max(1, mask.size // 6))] = 0.0
    inputs: dict[str, Any] = {"hidden": uniform(*lead, hidden), "weight": uniform(vocab, hidden), "bias": np.zeros(vocab, np.float32), "loss_mask": mask}
    spec = lossspec.KIND_SPECS[kind]
    if spec.has_labels:
        labels = rng.integers(0, 4, size=lead)  # many 2s to ignore, then spread over the vocabulary
        labels = np.where(labels == 2, -100, rng.integers(0, vocab, size=lead))
        inputs["labels"] = labels
    elif spec.has_teacher:
        inputs.update(teacher_hidden=uniform(*lead, t_hidden), teacher_weight=uniform(vocab, t_hidden), teacher_bias=np.zeros(vocab, np.float32))
    return inputs
