"""``causal_shift=True`` (lossspec.causal) in the oracle, jaxloss and torchloss.

Labels and mask are given per input token; position t is scored against ``labels[..., t + 1]``
with weight ``loss_mask[..., t + 1]``, the last position of each row has weight 0, the teacher
is not shifted, ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)``. The oracle is checked against
its own unshifted formulas on sliced inputs (an independent statement of the rule); both
frameworks (XLA / torch paths; Pallas / Triton at a small shape, slow) against the oracle at
the SPEC bounds, the last position's gradient exactly 0, no logits-sized copy, counts and the
accumulation helpers with ``labels=input_ids``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss
import jaxloss.distributed
import lossspec
import torchloss
import torchloss.distributed
from jaxloss import nnx as jnn
from lossspec import KINDS, assert_close_to_oracle, make_case

from parity_tests.support.torch_problem import device_for

NORMALIZATIONS = ("valid_tokens", "tokens", "sum", "none")
SCENARIOS = ("random", "no_mask", "float_weights", "heavy_mask")
LEAD = (3, 6)  # [B, T]
VOCAB = 37
OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 1.3},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"temperature": 2.0, "teacher_logit_scale": 0.8},
    "reverse_kl": {"temperature": 0.8, "logit_scale": 1.2},
}


def _case(kind: str, scenario: str, dtype: str = "float32", lead: tuple[int, ...] = LEAD, vocab: int = VOCAB) -> lossspec.Case:
    return make_case(kind, scenario, lead_shape=lead, vocab=vocab, dtype=dtype)


def _reference(case: lossspec.Case, **options: Any) -> lossspec.Reference:
    return case.reference(causal_shift=True, **options)


def _jax_run(case: lossspec.Case, impl: str = "xla", jit: bool = False, **options: Any) -> tuple[np.ndarray, np.ndarray]:
    x = jnp.asarray(case.logits).astype(case.dtype)
    target = case.target if case.kind == "cross_entropy" else jnp.asarray(case.target).astype(case.dtype)
    mask = None if case.loss_mask is None else jnp.asarray(case.loss_mask)
    function = getattr(jaxloss, case.kind)

    def total(logits, target, mask):
        loss = function(logits, target, mask, impl=impl, causal_shift=True, **options)
        return jnp.sum(loss), loss

    grad_fn = jax.value_and_grad(total, has_aux=True)
    (_, loss), grad = (jax.jit(grad_fn) if jit else grad_fn)(x, jnp.asarray(target) if jit else target, mask)
    return np.asarray(loss, np.float64), np.asarray(grad.astype(jnp.float32), np.float64)


def _torch_run(case: lossspec.Case, impl: str = "torch", **options: Any) -> tuple[np.ndarray, np.ndarray]:
    """Inputs made on the host; impl="triton" runs on ``TRITON_DEVICE`` (compiled kernels on
    CUDA, else the interpreter on the CPU), the torch path on the CPU; results back on the host."""
    device = device_for(impl)
    dtype = getattr(torch, case.dtype)
    logits = torch.from_numpy(case.logits).to(dtype).to(device).requires_grad_(True)
    target = torch.from_numpy(np.array(case.target))
    if case.kind != "cross_entropy":
        target = target.to(dtype)
    target = target.to(device)
    mask = None if case.loss_mask is None else torch.from_numpy(np.array(case.loss_mask)).to(device)
    loss = getattr(torchloss, case.kind)(logits, target, mask, impl=impl, causal_shift=True, **options)
    loss.sum().backward()
    return loss.detach().cpu().double().numpy(), logits.grad.cpu().double().numpy()


def _check(run: Any, case: lossspec.Case, what: str, **options: Any) -> None:
    ref = _reference(case, **options)
    loss, grad = run(case, **options)
    assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=what)
    # The last position of every row is never scored: its gradient is exactly 0.
    assert np.all(grad[..., -1, :] == 0), f"{what}: gradient at the last position"
    if options.get("normalization") == "none":
        assert loss.shape == case.logits.shape[:-1] and np.all(loss[..., -1] == 0)


# --------------------------------------------------------------------------------------------
# The oracle: the rule, stated a second way
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_oracle_shift_is_the_unshifted_oracle_on_sliced_inputs(kind: str, normalization: str) -> None:
    """Shifted on [B, T] == unshifted on logits[:, :-1], labels[:, 1:], mask[:, 1:] (the teacher
    sliced like the logits); the last position contributes nothing."""
    for scenario in SCENARIOS:
        case = _case(kind, scenario)
        options = dict(OPTIONS[kind], normalization=normalization)
        loss, grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask, causal_shift=True, **options)
        target = case.target[:, 1:] if kind == "cross_entropy" else case.target[:, :-1]
        mask = None if case.loss_mask is None else case.loss_mask[:, 1:]
        ref_loss, ref_grad = lossspec.oracle(kind, case.logits[:, :-1], target, mask, **options)
        if normalization == "none":
            np.testing.assert_allclose(loss[:, :-1], ref_loss, rtol=1e-12, atol=1e-300)
            assert np.all(loss[:, -1] == 0)
        else:
            np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
        np.testing.assert_allclose(grad[:, :-1], ref_grad, rtol=1e-12, atol=1e-300)
        assert np.all(grad[:, -1] == 0)


def test_oracle_tokens_counts_scored_positions() -> None:
    case = _case("cross_entropy", "no_mask", lead=(2, 3, 5))
    labels = np.zeros((2, 3, 5), np.int64)
    summed, _ = lossspec.oracle("cross_entropy", case.logits, labels, normalization="sum", causal_shift=True)
    tokens, _ = lossspec.oracle("cross_entropy", case.logits, labels, normalization="tokens", causal_shift=True)
    assert lossspec.scored_positions((2, 3, 5), True) == 2 * 3 * 4
    np.testing.assert_allclose(tokens, summed / 24, rtol=1e-14)


# --------------------------------------------------------------------------------------------
# Both frameworks against the oracle
# --------------------------------------------------------------------------------------------


# JAX compiles per mask type: each (kind, normalisation) runs one scenario, rotated so that every
# kind and every normalisation meets every scenario; bf16 under jit (traced labels and mask).
JAX_MATRIX = [
    (kind, normalization, SCENARIOS[(i + j) % len(SCENARIOS)])
    for i, kind in enumerate(KINDS)
    for j, normalization in enumerate(NORMALIZATIONS)
]


@pytest.mark.parametrize("kind,normalization,scenario", JAX_MATRIX)
def test_jax_xla_matches_oracle(kind: str, normalization: str, scenario: str) -> None:
    _check(_jax_run, _case(kind, scenario), f"xla:{kind}/{scenario}", normalization=normalization, **OPTIONS[kind])
    if normalization == "valid_tokens":
        case = _case(kind, "random", dtype="bfloat16")
        _check(functools.partial(_jax_run, jit=True), case, f"xla-jit:{kind}/bf16", normalization=normalization, **OPTIONS[kind])


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_matches_oracle(kind: str, normalization: str) -> None:
    for scenario in SCENARIOS:
        _check(_torch_run, _case(kind, scenario), f"torch:{kind}/{scenario}", normalization=normalization, **OPTIONS[kind])
    _check(_torch_run, _case(kind, "random", dtype="bfloat16"), f"torch:{kind}/bf16", normalization=normalization, **OPTIONS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_denominator_and_several_leading_axes(kind: str) -> None:
    """``denominator=`` overrides D as without the shift; lead [2, 3, T] shifts the last axis."""
    case = _case(kind, "float_weights", lead=(2, 3, 5))
    for run, name in ((_jax_run, "xla"), (_torch_run, "torch")):
        _check(run, case, f"{name}:{kind}:D=7.5", denominator=7.5, **OPTIONS[kind])
        _check(run, case, f"{name}:{kind}:lead3", normalization="tokens", **OPTIONS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_pallas_matches_oracle(kind: str) -> None:
    for normalization in ("valid_tokens", "none"):
        _check(functools.partial(_jax_run, impl="pallas"), _case(kind, "random"), f"pallas:{kind}", normalization=normalization)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_oracle(kind: str) -> None:
    import warnings

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        for normalization in ("valid_tokens", "none"):
            _check(functools.partial(_torch_run, impl="triton"), _case(kind, "random"), f"triton:{kind}", normalization=normalization)


@pytest.mark.slow  # shard_map over 2 host devices: compiles per kind
def test_jax_vocab_parallel_matches_oracle() -> None:
    """The shift is on the time axis: it composes with a vocabulary split over 2 devices."""
    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    for kind in ("cross_entropy", "reverse_kl"):
        case = _case(kind, "random", vocab=36)
        ref = _reference(case, normalization="tokens")
        function = getattr(jaxloss, kind)

        def local(x, target, mask, function=function):
            return jax.value_and_grad(lambda x: function(x, target, mask, causal_shift=True, normalization="tokens", vocab_parallel="model"))(x)

        target_spec = P() if kind == "cross_entropy" else P(None, None, "model")
        sharded = shard_map(local, mesh=mesh, in_specs=(P(None, None, "model"), target_spec, P()), out_specs=(P(), P(None, None, "model")))
        loss, grad = jax.jit(sharded)(jnp.asarray(case.logits), jnp.asarray(case.target), jnp.asarray(case.loss_mask))
        assert_close_to_oracle(loss, np.asarray(grad), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"vp:{kind}")
        assert np.all(np.asarray(grad)[:, -1] == 0)


# --------------------------------------------------------------------------------------------
# No shifted copy of the logits
# --------------------------------------------------------------------------------------------


def test_torch_kernel_reads_the_callers_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path's kernel gets a view of the caller's logits buffer (same data_ptr, same
    shape [B*T, V]): nothing was sliced, padded or copied on the vocabulary side."""
    from torchloss.backends import torch as _torch

    seen: list[tuple[int, tuple[int, ...]]] = []
    forward = _torch.forward

    def spy(config, logits, *args, **kwargs):
        seen.append((logits.data_ptr(), tuple(logits.shape)))
        return forward(config, logits, *args, **kwargs)

    monkeypatch.setattr(_torch, "forward", spy)
    case = _case("cross_entropy", "random")
    logits = torch.from_numpy(case.logits).requires_grad_(True)
    torchloss.cross_entropy(logits, torch.from_numpy(case.target), torch.from_numpy(case.loss_mask), causal_shift=True, impl="torch").backward()
    teacher = torch.from_numpy(_case("forward_kl", "random").target)
    torchloss.forward_kl(logits, teacher, causal_shift=True, impl="torch").backward()
    assert seen == [(logits.data_ptr(), (LEAD[0] * LEAD[1], VOCAB))] * 2


def _logits_sized_ops(jaxpr: Any, vocab: int) -> list[str]:
    """Every equation (sub-jaxprs included) with an output whose last axis is the vocabulary."""
    found = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            if shape and shape[-1] == vocab:
                found.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    found += _logits_sized_ops(getattr(inner, "jaxpr", inner), vocab)
    return found


@pytest.mark.parametrize("kind", ("cross_entropy", "forward_kl"))
def test_jax_shift_adds_no_logits_sized_op(kind: str) -> None:
    """The jaxpr of value_and_grad with the shift has exactly the vocabulary-sized operations it
    has without: only the [B, T] labels and mask are shifted."""
    case = _case(kind, "random")
    function = getattr(jaxloss, kind)

    def ops(shift: bool) -> list[str]:
        grad = jax.value_and_grad(lambda x: function(x, jnp.asarray(case.target), jnp.asarray(case.loss_mask), causal_shift=shift))
        return _logits_sized_ops(jax.make_jaxpr(grad)(jnp.asarray(case.logits)).jaxpr, VOCAB)

    without, with_shift = ops(False), ops(True)
    assert without and sorted(with_shift) == sorted(without)


# --------------------------------------------------------------------------------------------
# Counting, errors, modules
# --------------------------------------------------------------------------------------------


def test_count_denominator_counts_the_scored_positions() -> None:
    case = _case("cross_entropy", "float_weights", lead=(2, 3, 5))
    labels, mask = case.target, case.loss_mask
    for normalization in ("valid_tokens", "tokens"):
        for given in ((labels, mask), (labels, None), (None, mask)):
            ref = lossspec.count_denominator(*given, normalization=normalization, causal_shift=True)
            sliced = lossspec.count_denominator(*(None if a is None else a[..., 1:] for a in given), normalization=normalization)
            assert ref == sliced
            jax_count = jaxloss.count_denominator(*(None if a is None else jnp.asarray(a) for a in given), normalization=normalization, causal_shift=True)
            torch_count = torchloss.count_denominator(*(None if a is None else torch.from_numpy(a) for a in given), normalization=normalization, causal_shift=True)
            lossspec.compare_loss(float(jax_count), ref, "jax count").check()
            lossspec.compare_loss(float(torch_count), ref, "torch count").check()
    assert lossspec.count_denominator(labels, normalization="tokens", causal_shift=True) == 2 * 3 * 4
    # Weights of the first position are never read: with the shift they are not counted.
    assert lossspec.count_denominator(None, np.eye(1, 5, 0, dtype=np.float32), causal_shift=True) == 0.0


@pytest.mark.parametrize("time", [0, 1])
def test_no_scored_position_counts_zero(time: int) -> None:
    """An empty time axis (T = 0) or rows of one token (T = 1): no position is scored, so every
    count is exactly 0 (``prod(lead[:-1]) * max(T - 1, 0)``, not ``3 * (0 - 1) = -3``) in the
    oracle and both frameworks, and every loss is 0 with a zero gradient of the logits' shape."""
    labels, mask = np.zeros((3, time), np.int64), np.ones((3, time), np.float32)
    assert lossspec.scored_positions((3, time), True) == 0
    for normalization in ("tokens", "valid_tokens"):
        for given in ((labels, mask), (labels, None), (None, mask)):
            counts = {
                "oracle": lossspec.count_denominator(*given, normalization=normalization, causal_shift=True),
                "jax": float(jaxloss.count_denominator(*(None if a is None else jnp.asarray(a) for a in given),
                                                       normalization=normalization, causal_shift=True)),
                "torch": float(torchloss.count_denominator(*(None if a is None else torch.from_numpy(a) for a in given),
                                                           normalization=normalization, causal_shift=True)),
            }
            assert counts == {"oracle": 0.0, "jax": 0.0, "torch": 0.0}, (normalization, given is None, counts)
    case = _case("cross_entropy", "no_mask", lead=(3, time))
    case = dataclasses.replace(case, target=labels)
    for normalization in NORMALIZATIONS:
        ref = _reference(case, normalization=normalization)
        assert np.all(ref.loss == 0) and np.shape(ref.loss) == (() if normalization != "none" else (3, time))
        assert ref.grad.shape == (3, time, VOCAB) and not ref.grad.any()
        for name, run in (("xla", _jax_run), ("torch", _torch_run)):
            loss, grad = run(case, normalization=normalization)
            assert np.array_equal(loss, ref.loss) and np.array_equal(grad, ref.grad), (name, normalization, loss)


def test_errors_are_the_same_everywhere() -> None:
    logits, labels = np.zeros((5,), np.float32), np.zeros((), np.int64)
    calls = {
        "oracle": lambda: lossspec.oracle("cross_entropy", logits, labels, causal_shift=True),
        "jax": lambda: jaxloss.cross_entropy(logits, labels, causal_shift=True),
        "torch": lambda: torchloss.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels), causal_shift=True),
    }
    messages = set()
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"causal_shift=True needs a time axis: logits of shape \[\.\.\., T, V\]") as err:
            call()
        messages.add(str(err.value))
    assert len(messages) == 1
    counts = [
        lambda: lossspec.count_denominator(labels, causal_shift=True),
        lambda: jaxloss.count_denominator(labels, causal_shift=True),
        lambda: torchloss.count_denominator(torch.from_numpy(labels), causal_shift=True),
    ]
    assert len({str(pytest.raises(ValueError, count).value) for count in counts}) == 1
    for call in (
        lambda: lossspec.oracle("forward_kl", np.zeros((2, 5), np.float32), np.zeros((2, 5), np.float32), causal_shift=1),
        lambda: jaxloss.forward_kl(np.zeros((2, 5), np.float32), np.zeros((2, 5), np.float32), causal_shift="yes"),
        lambda: torchloss.nn.ReverseKLLoss(causal_shift=None),
        lambda: jnn.ForwardKLLoss(causal_shift=0),
    ):
        with pytest.raises(TypeError, match="causal_shift must be a bool"):
            call()


def test_bad_label_error_names_the_given_position() -> None:
    logits = np.zeros((2, 4, 5), np.float32)
    labels = np.zeros((2, 4), np.int64)
    labels[1, 2] = 9  # scored at position (1, 1)
    labels[0, 0] = 99  # never a target: position 0 is not read
    for call in (
        lambda: lossspec.oracle("cross_entropy", logits, labels, causal_shift=True),
        lambda: jaxloss.cross_entropy(logits, labels, causal_shift=True),
        lambda: torchloss.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels), causal_shift=True),
    ):
        with pytest.raises(ValueError, match=r"got 9 at position \(1, 2\)"):
            call()


@pytest.mark.parametrize("kind", KINDS)
def test_modules_pass_causal_shift(kind: str) -> None:
    case = _case(kind, "random")
    ref = _reference(case, **OPTIONS[kind])
    jax_module = getattr(jnn, lossspec.KIND_SPECS[kind].module)(causal_shift=True, **OPTIONS[kind])
    loss, grad = jax.value_and_grad(lambda x: jax_module(x, jnp.asarray(case.target), jnp.asarray(case.loss_mask)))(jnp.asarray(case.logits))
    assert_close_to_oracle(loss, np.asarray(grad), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what="nnx")
    torch_module = getattr(torchloss.nn, lossspec.KIND_SPECS[kind].module)(causal_shift=True, **OPTIONS[kind])
    logits = torch.from_numpy(case.logits).requires_grad_(True)
    loss = torch_module(logits, torch.from_numpy(case.target), torch.from_numpy(case.loss_mask))
    loss.backward()
    assert_close_to_oracle(float(loss.detach()), logits.grad.numpy(), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what="nn")
    assert "causal_shift=True" in repr(torch_module)


# --------------------------------------------------------------------------------------------
# The accumulation helpers with labels = input_ids (the 20 / 24 scaling bug)
# --------------------------------------------------------------------------------------------

ROWS, TIME, VOCAB_LM, HIDDEN = 4, 6, 13, 5  # 4 x 5 = 20 scored positions of 4 x 6 = 24


def _lm_problem(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB_LM, (ROWS, TIME))
    return ids, rng.normal(0, 1, (VOCAB_LM, HIDDEN)).astype(np.float32), rng.normal(0, 0.5, (HIDDEN, VOCAB_LM)).astype(np.float32)


def _lm_oracle(ids: np.ndarray, emb: np.ndarray, head: np.ndarray, normalization: str) -> tuple[float, dict[str, np.ndarray]]:
    hidden = emb.astype(np.float64)[ids]
    loss, grad_logits = lossspec.oracle("cross_entropy", hidden @ head, ids, normalization=normalization, causal_shift=True)
    grad_emb = np.zeros(emb.shape)
    np.add.at(grad_emb, ids, grad_logits @ head.astype(np.float64).T)
    return loss, {"emb": grad_emb, "head": np.einsum("bth,btv->hv", hidden, grad_logits)}


def _assert_lm(loss: Any, grads: dict[str, Any], ref: tuple[float, dict[str, np.ndarray]], what: str) -> None:
    lossspec.compare_loss(float(loss), ref[0], f"{what} loss").check()
    for name, value in grads.items():
        lossspec.compare_grad(np.asarray(value, np.float64), ref[1][name], "float32", 0.0, f"{what} grad[{name}]").check()


@pytest.mark.slow  # two accumulate scans per normalisation: JAX compiles
@pytest.mark.parametrize("normalization", ("valid_tokens", "tokens"))
def test_jax_accumulate_with_labels_equal_input_ids(normalization: str) -> None:
    ids, emb, head = _lm_problem()
    params = {"emb": jnp.asarray(emb), "head": jnp.asarray(head)}
    batch = {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(ids)}

    def loss_fn(params, microbatch, denominator):
        logits = params["emb"][microbatch["input_ids"]] @ params["head"]
        return jaxloss.cross_entropy(logits, microbatch["labels"], causal_shift=True, normalization=normalization, denominator=denominator)

    ref = _lm_oracle(ids, emb, head, normalization)
    step = jax.jit(lambda p, b: jaxloss.distributed.accumulate(loss_fn, p, b, num_microbatches=3, normalization=normalization, causal_shift=True))
    _assert_lm(*step(params, batch), ref, "jax K=3")
    # Without causal_shift the default count sees 24 positions for 20 scored ones.
    loss, _ = jaxloss.distributed.accumulate(loss_fn, params, batch, num_microbatches=2, normalization=normalization)
    assert abs(float(loss) - ref[0]) > 1e-3 * abs(ref[0])
    assert float(jaxloss.distributed.global_denominator(batch["labels"], normalization="tokens", causal_shift=True)) == 20


@pytest.mark.parametrize("normalization", ("valid_tokens", "tokens"))
def test_torch_accumulate_with_labels_equal_input_ids(normalization: str) -> None:
    ids, emb, head = _lm_problem()
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB_LM, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB_LM, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(emb))
        model[1].weight.copy_(torch.from_numpy(head.T))
    batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(ids)}

    def loss_fn(model, microbatch, denominator):
        logits = model(microbatch["input_ids"])
        return torchloss.cross_entropy(logits, microbatch["labels"], causal_shift=True, normalization=normalization, denominator=denominator)

    ref = _lm_oracle(ids, emb, head, normalization)
    for k in (2, 3):
        model.zero_grad()
        loss = torchloss.distributed.accumulate(loss_fn, model, batch, num_microbatches=k, normalization=normalization, causal_shift=True)
        _assert_lm(loss, {"emb": model[0].weight.grad, "head": model[1].weight.grad.T}, ref, f"torch K={k}")
    model.zero_grad()
    loss = torchloss.distributed.accumulate(loss_fn, model, batch, num_microbatches=2, normalization=normalization)
    assert abs(float(loss) - ref[0]) > 1e-3 * abs(ref[0])
    assert float(torchloss.distributed.global_denominator(batch["labels"], normalization="tokens", causal_shift=True)) == 20


def test_accumulate_shift_needs_batch_and_time_axes() -> None:
    ids = np.arange(6)
    with pytest.raises(ValueError, match=r"needs labels/loss_mask of shape \[B, \.\.\., T\]"):
        jaxloss.distributed.accumulate(lambda p, b, d: 0.0, {}, {"labels": jnp.asarray(ids)}, num_microbatches=2, causal_shift=True)
    with pytest.raises(ValueError, match=r"needs labels/loss_mask of shape \[B, \.\.\., T\]"):
        torchloss.distributed.accumulate(lambda m, b, d: None, torch.nn.Linear(1, 1), {"labels": torch.from_numpy(ids)}, num_microbatches=2, causal_shift=True)
