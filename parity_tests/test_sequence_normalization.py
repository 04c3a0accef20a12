"""Per-sequence normalisation (``"sequence_mean"``, ``"sequence_sum"``) and ``segment_ids``
(lossspec.sequences) in the oracle, jaxloss and torchloss.

Packed rows hold documents of very different lengths (1 to 12 tokens), ids reused across rows
(a sequence is a ``(row, id)`` pair), non-contiguous and large ids, padding ids (< 0), an
all-masked document and an all-masked row. The oracle is checked against its token-level
formulas applied document by document (an independent statement of the rule); both frameworks
(XLA / torch paths here, Pallas / Triton slow) against the oracle at the SPEC bounds; the
counts; the causal shift at document boundaries; the micro-batch split (torch ``accumulate``)
and the JAX ``accumulate`` under ``shard_map`` over data replicas (8 host devices). The
sequence-parallel paths are in test_sequence_parallel.py.
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
import lossspec
import torchloss
from lossspec import KINDS, assert_close_to_oracle

from parity_tests.support.packed_problem import (
    BATCH,
    MASKED_DOCUMENT,
    MASKED_ROW,
    MODES,
    OPTIONS,
    PACKED_IDS,
    TIME,
    VOCAB,
    assert_tiny,
    packed_case,
    tiny_problem,
    tiny_reference,
)
from parity_tests.support.torch_problem import device_for


# --------------------------------------------------------------------------------------------
# The oracle: the rule stated a second way (document by document, with the token formulas)
# --------------------------------------------------------------------------------------------


def _documents(ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(row, positions)`` of every ``(row, id >= 0)`` sequence."""
    return [(row, np.flatnonzero(ids[row] == seq)) for row in range(ids.shape[0]) for seq in np.unique(ids[row]) if seq >= 0]


def _per_document_reference(kind: str, case: lossspec.Case, ids: np.ndarray, mode: str, **options: Any) -> tuple[float, np.ndarray]:
    """``sequence_mean`` as the mean over documents of their ``"valid_tokens"`` oracle losses
    (``sequence_sum``: of their ``"sum"`` losses), over the documents with a positive weight sum;
    gradients the same way."""
    token_mode = "valid_tokens" if mode == "sequence_mean" else "sum"
    loss, grad, count = 0.0, np.zeros(case.logits.shape), 0
    for row, positions in _documents(ids):
        target = case.target[row, positions]
        mask = case.loss_mask[row, positions]
        weight = lossspec.token_weights(lossspec.make_config(kind), target if kind == "cross_entropy" else None, mask, mask.shape)[1]
        if weight.sum() <= 0:
            continue
        doc_loss, doc_grad = lossspec.oracle(kind, case.logits[row, positions], target, mask, normalization=token_mode, **options)
        loss, count = loss + doc_loss, count + 1
        grad[row, positions] += doc_grad
    return loss / count, grad / count


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_oracle_is_the_mean_over_documents(kind: str, mode: str) -> None:
    for float_weights in (False, True):
        case, ids = packed_case(kind, float_weights=float_weights)
        loss, grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask, normalization=mode, segment_ids=ids, **OPTIONS[kind])
        ref_loss, ref_grad = _per_document_reference(kind, case, ids, mode, **OPTIONS[kind])
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-15)
        assert np.all(grad[ids < 0] == 0) and np.all(grad[MASKED_ROW] == 0)


def test_oracle_without_segment_ids_is_one_sequence_per_row() -> None:
    case, ids = packed_case("cross_entropy")
    case.target[ids < 0] = 0  # no padding here: these labels are read
    rows = np.zeros((BATCH, TIME), np.int64)  # id 0 in every row: one sequence per row
    for mode in MODES:
        plain = lossspec.oracle("cross_entropy", case.logits, case.target, case.loss_mask, normalization=mode)
        with_ids = lossspec.oracle("cross_entropy", case.logits, case.target, case.loss_mask, normalization=mode, segment_ids=rows)
        np.testing.assert_array_equal(plain[0], with_ids[0])
        np.testing.assert_array_equal(plain[1], with_ids[1])


def test_oracle_counts_and_denominator() -> None:
    """S counts the (row, id) pairs with n_s > 0: 3 + 1 + 2 (document 0 masked) + 1 + 2 + 0
    (masked row) + 3 + 4 = 16 here; ``denominator=`` replaces S, not n_s."""
    case, ids = packed_case("cross_entropy")
    case.loss_mask = np.ones_like(case.loss_mask)
    case.loss_mask[MASKED_DOCUMENT] = 0
    case.loss_mask[MASKED_ROW] = 0
    case.target = np.where(ids < 0, 0, np.abs(case.target) % VOCAB)
    count = lossspec.count_denominator(case.target, case.loss_mask, normalization="sequence_mean", segment_ids=ids)
    assert count == 16.0
    assert lossspec.count_denominator(case.target, case.loss_mask, normalization="sequence_sum") == BATCH - 1
    # valid_tokens with segment ids: padding ids weigh 0.
    assert lossspec.count_denominator(None, case.loss_mask, segment_ids=ids) == case.loss_mask.sum() - 5
    base, base_grad = lossspec.oracle("cross_entropy", case.logits, case.target, case.loss_mask, normalization="sequence_mean", segment_ids=ids)
    scaled, scaled_grad = lossspec.oracle(
        "cross_entropy", case.logits, case.target, case.loss_mask, normalization="sequence_mean", segment_ids=ids, denominator=4.0
    )
    np.testing.assert_allclose(scaled, base * 16 / 4, rtol=1e-13)
    np.testing.assert_allclose(scaled_grad, base_grad * 4, rtol=1e-12)


def test_oracle_causal_shift_never_crosses_a_document_boundary() -> None:
    """Row ids [0, 0, 1, 1, 1, -1]: with the shift, position 1 (predicting the first token of
    document 1) and position 4 (predicting padding) are not scored; the scored ids are
    [0, -1, 1, 1, -1, -1]."""
    ids = np.array([[0, 0, 1, 1, 1, -1]])
    np.testing.assert_array_equal(lossspec.scored_segment_ids(ids, ids.shape, True), [[0, -1, 1, 1, -1, -1]])
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(1, 6, 9))
    labels = rng.integers(0, 9, (1, 6))
    for mode in ("valid_tokens",) + MODES:
        loss, grad = lossspec.oracle("cross_entropy", logits, labels, normalization=mode, causal_shift=True, segment_ids=ids)
        scored = np.any(grad != 0, axis=-1)[0]
        np.testing.assert_array_equal(scored, [True, False, True, True, False, False])
    # sequence_mean = mean(l_0, mean(l_2, l_3)) with l_t the CE of logits[t] against labels[t + 1].
    per_token, _ = lossspec.oracle("cross_entropy", logits[0, :-1], labels[0, 1:], normalization="none")
    loss, _ = lossspec.oracle("cross_entropy", logits, labels, normalization="sequence_mean", causal_shift=True, segment_ids=ids)
    np.testing.assert_allclose(loss, (per_token[0] + (per_token[2] + per_token[3]) / 2) / 2, rtol=1e-13)


def test_compact_segment_ids_keeps_the_sequences() -> None:
    ids = np.array([[2**40, 2**40, -5, 7, 7, 2**40 + 1]], dtype=np.int64)
    compact = lossspec.compact_segment_ids(ids)
    assert compact.dtype == np.int32
    np.testing.assert_array_equal(compact, [[1, 1, -1, 0, 0, 2]])


# --------------------------------------------------------------------------------------------
# Both frameworks against the oracle
# --------------------------------------------------------------------------------------------


def _extreme_ids(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """PACKED_IDS at the top of ``dtype``'s range, and int64 ids with the same sequences.

    Each distinct non-negative id becomes ``max - rank``: uint32 ids from ``2**31`` on, uint64
    from ``2**63`` on, ids a signed cast of the same width would wrap to negative (padding).
    Signed dtypes keep padding (``min + rank``); unsigned ones have none: every distinct id,
    PACKED_IDS' padding ids included, is a document there."""
    info = np.iinfo(dtype)
    distinct = np.unique(PACKED_IDS)
    ranks = np.searchsorted(distinct, PACKED_IDS)
    if info.min < 0:
        negatives = int(np.sum(distinct < 0))
        values = [info.min + int(r) if r < negatives else info.max - (int(r) - negatives) for r in ranks.ravel()]
        same = PACKED_IDS
    else:
        values = [info.max - int(r) for r in ranks.ravel()]
        same = ranks  # no padding: every id is a document
    return np.array(values, dtype=dtype).reshape(PACKED_IDS.shape), same.astype(np.int64)


UNSIGNED_AND_SIGNED = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64")


@pytest.mark.parametrize("dtype", UNSIGNED_AND_SIGNED)
def test_oracle_counts_extreme_ids_by_value(dtype: str) -> None:
    """The oracle keeps the sequences of ids at the top of every integer dtype (uint64 from 2**63
    on once wrapped to padding in int64): the same counts as the small ids with the same sequences."""
    big, same = _extreme_ids(dtype)
    case, _ = packed_case("cross_entropy", float_weights=True)
    for mode in ("valid_tokens",) + MODES:
        for shift in (False, True):
            want = lossspec.count_denominator(case.target, case.loss_mask, normalization=mode, causal_shift=shift, segment_ids=same)
            got = lossspec.count_denominator(case.target, case.loss_mask, normalization=mode, causal_shift=shift, segment_ids=big)
            assert got == want, (dtype, mode, shift)
    assert lossspec.count_denominator(None, np.ones(big.shape), normalization="sequence_sum", segment_ids=big) == len(_documents(same))


@pytest.mark.parametrize("dtype", UNSIGNED_AND_SIGNED)
def test_torch_extreme_ids_match_oracle(dtype: str) -> None:
    """torch: ids at the top of every integer dtype, against the oracle of the same sequences as
    small ids, and the exact counts (uint64 from 2**63 on once became padding in int64)."""
    big, same = _extreme_ids(dtype)
    kind = "forward_kl"
    case, _ = packed_case(kind, float_weights=True)
    for mode in MODES:
        for shift in (False, True):
            ref = case.reference(segment_ids=same, normalization=mode, causal_shift=shift, **OPTIONS[kind])
            loss, grad = _torch_run(case, big, normalization=mode, causal_shift=shift, **OPTIONS[kind])
            assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=f"torch:{dtype}/{mode}/{shift}")
            counted = torchloss.count_denominator(
                None, torch.tensor(case.loss_mask), normalization=mode, causal_shift=shift, segment_ids=torch.from_numpy(big)
            )
            assert float(counted) == lossspec.count_denominator(None, case.loss_mask, normalization=mode, causal_shift=shift, segment_ids=same)


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=() if d == "uint32" else pytest.mark.slow) for d in UNSIGNED_AND_SIGNED])
def test_jax_extreme_ids_match_oracle(dtype: str) -> None:
    """JAX: ids at the top of every integer dtype as device arrays (uint32 from 2**31 on once
    became padding in int32), eagerly and under jit, against the oracle of the same sequences as
    small ids, and the exact counts; the 64-bit dtypes with x64 on. JAX compiles per dtype: the
    fast lane keeps uint32, the case once wrong."""
    big, same = _extreme_ids(dtype)
    kind = "forward_kl"
    case, _ = packed_case(kind, float_weights=True)
    mode = "sequence_mean"
    with jax.enable_x64(dtype.endswith("64")):
        ids = jnp.asarray(big)
        assert ids.dtype == big.dtype
        x, teacher, mask = jnp.asarray(case.logits, jnp.float32), jnp.asarray(case.target, jnp.float32), jnp.asarray(case.loss_mask)

        def total(logits: Any, ids: Any, shift: bool) -> Any:
            return jnp.sum(jaxloss.forward_kl(logits, teacher, mask, segment_ids=ids, normalization=mode, causal_shift=shift, **OPTIONS[kind]))

        for shift, run in ((False, jax.value_and_grad(total)), (True, jax.jit(jax.value_and_grad(total), static_argnums=2))):
            ref = case.reference(segment_ids=same, normalization=mode, causal_shift=shift, **OPTIONS[kind])
            loss, grad = run(x, ids, shift)
            assert_close_to_oracle(float(loss), np.asarray(grad, np.float64), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"jax:{dtype}/{shift}")
            count = jaxloss.count_denominator if not shift else jax.jit(functools.partial(jaxloss.count_denominator, causal_shift=True, normalization=mode))
            counted = count(None, mask, normalization=mode, segment_ids=ids) if not shift else count(None, mask, segment_ids=ids)
            want = lossspec.count_denominator(None, case.loss_mask, normalization=mode, causal_shift=shift, segment_ids=same)
            assert float(counted) == want, (dtype, shift)




def _jax_run(case: lossspec.Case, ids: Any, impl: str = "xla", jit: bool = False, **options: Any) -> tuple[np.ndarray, np.ndarray]:
    x = jnp.asarray(case.logits).astype(case.dtype)
    target = case.target if case.kind == "cross_entropy" else jnp.asarray(case.target).astype(case.dtype)
    function = getattr(jaxloss, case.kind)

    def total(logits, target, mask, ids):
        loss = function(logits, target, mask, impl=impl, segment_ids=ids, **options)
        return jnp.sum(loss), loss

    grad_fn = jax.value_and_grad(total, has_aux=True)
    if jit:
        grad_fn = jax.jit(grad_fn)
        target, ids = jnp.asarray(target), None if ids is None else jnp.asarray(ids)
    (_, loss), grad = grad_fn(x, target, jnp.asarray(case.loss_mask), ids)
    return np.asarray(loss, np.float64), np.asarray(grad.astype(jnp.float32), np.float64)


def _torch_run(case: lossspec.Case, ids: Any, impl: str = "torch", **options: Any) -> tuple[np.ndarray, np.ndarray]:
    """Inputs made on the host; impl="triton" runs on ``TRITON_DEVICE`` (compiled kernels on
    CUDA, else the interpreter on the CPU), the torch path on the CPU; results back on the host."""
    device = device_for(impl)
    dtype = getattr(torch, case.dtype)
    logits = torch.from_numpy(case.logits).to(dtype).to(device).requires_grad_(True)
    target = torch.from_numpy(np.array(case.target))
    if case.kind != "cross_entropy":
        target = target.to(dtype)
    mask = torch.from_numpy(np.array(case.loss_mask)).to(device)
    segment_ids = None if ids is None else torch.from_numpy(ids).to(device)
    loss = getattr(torchloss, case.kind)(logits, target.to(device), mask, impl=impl, segment_ids=segment_ids, **options)
    loss.sum().backward()
    return loss.detach().cpu().double().numpy(), logits.grad.cpu().double().numpy()


def _rows_case(case: lossspec.Case, ids: np.ndarray) -> lossspec.Case:
    """``case`` for a call without ``segment_ids`` (one sequence per row): the padding positions'
    garbage labels replaced by valid ones (they are read there)."""
    if case.kind != "cross_entropy":
        return case
    return dataclasses.replace(case, target=np.where(ids < 0, 0, case.target))


def _check(run: Any, case: lossspec.Case, ids: Any, what: str, **options: Any) -> None:
    ref = case.reference(segment_ids=ids, **options)
    loss, grad = run(case, ids, **options)
    assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=what)
    if ids is not None:  # padding ids: weight 0, gradient exactly 0
        assert np.all(grad[ids < 0] == 0), f"{what}: gradient at padding"


# JAX compiles per mode, shift and mask type: each kind runs one mode eagerly and the other under
# jit with the shift, rotated so that every kind meets both modes (torch below runs them all).
@pytest.mark.parametrize("kind", KINDS)
def test_jax_xla_matches_oracle(kind: str) -> None:
    index = KINDS.index(kind)
    eager, jitted = MODES[index % 2], MODES[(index + 1) % 2]
    case, ids = packed_case(kind, float_weights=(index % 2 == 1))
    _check(_jax_run, case, ids, f"xla:{kind}/{eager}", normalization=eager, **OPTIONS[kind])
    _check(functools.partial(_jax_run, jit=True), case, ids, f"xla-jit:{kind}/{jitted}/shift", normalization=jitted, causal_shift=True, **OPTIONS[kind])
    if index == 0:
        _check(_jax_run, _rows_case(case, ids), None, f"xla:{kind}/{eager}/rows", normalization=eager, **OPTIONS[kind])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_matches_oracle(kind: str, mode: str) -> None:
    for float_weights in (False, True):
        case, ids = packed_case(kind, float_weights=float_weights)
        _check(_torch_run, case, ids, f"torch:{kind}/{mode}", normalization=mode, **OPTIONS[kind])
        _check(_torch_run, case, ids, f"torch:{kind}/{mode}/shift", normalization=mode, causal_shift=True, **OPTIONS[kind])
    _check(_torch_run, _rows_case(case, ids), None, f"torch:{kind}/{mode}/rows", normalization=mode, **OPTIONS[kind])
    bf16, ids = packed_case(kind, dtype="bfloat16", seed=1)
    _check(_torch_run, bf16, ids, f"torch:{kind}/{mode}/bf16", normalization=mode, **OPTIONS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_segment_ids_in_token_modes_and_denominator(kind: str) -> None:
    """Padding ids weigh 0 in every mode (and the shift never crosses a boundary); ``denominator=``
    replaces S; ``denominator=0`` gives loss 0 and gradient 0."""
    case, ids = packed_case(kind, float_weights=True, seed=2)
    token_modes = ("valid_tokens", "tokens", "sum", "none")
    # torch runs every token mode; JAX (compiles per mode) one per kind, rotated.
    for run, name, norms in ((_jax_run, "xla", token_modes[KINDS.index(kind) :][:1]), (_torch_run, "torch", token_modes)):
        for norm in norms:
            _check(run, case, ids, f"{name}:{kind}/{norm}", normalization=norm, causal_shift=(norm != "tokens"), **OPTIONS[kind])
        _check(run, case, ids, f"{name}:{kind}/D=5.5", normalization="sequence_mean", denominator=5.5, **OPTIONS[kind])
        loss, grad = run(case, ids, normalization="sequence_sum", denominator=0.0)
        assert loss == 0 and np.all(grad == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_pallas_matches_oracle(kind: str) -> None:
    case, ids = packed_case(kind, lead=(4, TIME))
    for mode in MODES:
        _check(functools.partial(_jax_run, impl="pallas"), case, ids, f"pallas:{kind}/{mode}", normalization=mode, causal_shift=True)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_oracle(kind: str) -> None:
    import warnings

    case, ids = packed_case(kind, lead=(4, TIME))
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        for mode in MODES:
            _check(functools.partial(_torch_run, impl="triton"), case, ids, f"triton:{kind}/{mode}", normalization=mode, causal_shift=True)


def test_modules_take_segment_ids() -> None:
    from jaxloss import nnx as jnn

    case, ids = packed_case("forward_kl")
    ref = case.reference(segment_ids=ids, normalization="sequence_mean", causal_shift=True, temperature=2.0)
    torch_module = torchloss.nn.ForwardKLLoss(normalization="sequence_mean", causal_shift=True, temperature=2.0)
    jax_module = jnn.ForwardKLLoss(normalization="sequence_mean", causal_shift=True, temperature=2.0)
    t = torch_module(torch.tensor(case.logits), torch.tensor(case.target), torch.tensor(case.loss_mask), segment_ids=torch.tensor(ids))
    j = jax_module(jnp.asarray(case.logits), jnp.asarray(case.target), jnp.asarray(case.loss_mask), segment_ids=jnp.asarray(ids))
    lossspec.compare_loss(float(t), ref.loss, "torch module").check()
    lossspec.compare_loss(float(j), ref.loss, "jax module").check()


# --------------------------------------------------------------------------------------------
# Counts, checks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalization", ["valid_tokens", "tokens"] + list(MODES))
def test_count_denominator_matches_oracle(normalization: str) -> None:
    case, ids = packed_case("cross_entropy", float_weights=True)
    for shift in (False, True):
        for segment_ids in (ids, None):
            ref = lossspec.count_denominator(case.target, case.loss_mask, normalization=normalization, causal_shift=shift, segment_ids=segment_ids)
            t = torchloss.count_denominator(
                torch.tensor(case.target), torch.tensor(case.loss_mask), normalization=normalization, causal_shift=shift,
                segment_ids=None if segment_ids is None else torch.tensor(segment_ids),
            )
            j = jaxloss.count_denominator(case.target, case.loss_mask, normalization=normalization, causal_shift=shift, segment_ids=segment_ids)
            np.testing.assert_allclose([float(t), float(j)], ref, rtol=1e-6, err_msg=f"{normalization} shift={shift}")


BAD_CALLS = [
    ({"segment_ids": np.zeros((BATCH, TIME - 1), np.int64)}, ValueError, "segment_ids must have the shape of the labels"),
    ({"segment_ids": np.zeros((BATCH, TIME), np.float32)}, TypeError, "segment_ids must be an integer array"),
    ({"normalization": "sequence_mean", "denominator": -1.0}, ValueError, "denominator must be a finite number >= 0"),
    ({"normalization": "per_sequence"}, ValueError, "normalization must be one of"),
]


@pytest.mark.parametrize("options,error,message", BAD_CALLS)
def test_bad_inputs_raise_the_same_error_everywhere(options: dict, error: type, message: str) -> None:
    case, _ = packed_case("cross_entropy")
    torch_options = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    for call in (
        lambda: lossspec.oracle("cross_entropy", case.logits, case.target, case.loss_mask, **options),
        lambda: jaxloss.cross_entropy(case.logits, case.target, case.loss_mask, **options),
        lambda: torchloss.cross_entropy(torch.tensor(case.logits), torch.tensor(case.target), torch.tensor(case.loss_mask), **torch_options),
    ):
        with pytest.raises(error, match=message):
            call()


def test_sequence_modes_need_a_time_axis_and_counts_need_the_batch() -> None:
    logits = np.zeros(5, np.float32)
    message = "needs a time axis"
    with pytest.raises(ValueError, match=message):
        lossspec.oracle("cross_entropy", logits, np.asarray(1), normalization="sequence_mean")
    with pytest.raises(ValueError, match=message):
        jaxloss.cross_entropy(logits, np.asarray(1), normalization="sequence_sum")
    with pytest.raises(ValueError, match=message):
        torchloss.cross_entropy(torch.tensor(logits), torch.tensor(1), normalization="sequence_sum")
    for count in (lossspec.count_denominator, jaxloss.count_denominator):
        with pytest.raises(ValueError, match="only counts normalization"):
            count(np.zeros((2, 3), np.int64), normalization="sum")
        with pytest.raises(ValueError, match="segment_ids must have the shape"):
            count(np.zeros((2, 3), np.int64), normalization="sequence_mean", segment_ids=np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="segment_ids must have the shape"):
        torchloss.count_denominator(torch.zeros(2, 3, dtype=torch.int64), normalization="sequence_mean", segment_ids=torch.zeros(2, 2, dtype=torch.int64))


# --------------------------------------------------------------------------------------------
# Micro-batches (torch) and micro-batches x replicas (JAX shard_map), the tiny model
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_accumulate_equals_full_batch(kind: str, mode: str) -> None:
    """K = 1, 3 (uneven: 3 / 3 / 2 rows) and 8 micro-batches (one row each, the masked row
    alone) with the default count of the dict batch (labels, loss_mask, segment_ids)."""
    from torchloss.distributed import accumulate

    params, batch = tiny_problem(kind)
    shift = mode == "sequence_mean"
    ref_loss, ref_grads = tiny_reference(kind, mode, params, batch, causal_shift=shift)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Parameter(torch.tensor(params["emb"]))
            self.head = torch.nn.Parameter(torch.tensor(params["head"]))

    def loss_fn(model, mb, denominator):
        logits = model.emb[mb["tokens"]] @ model.head
        target = mb["labels"] if kind == "cross_entropy" else mb["teacher"]
        return getattr(torchloss, kind)(logits, target, mb["loss_mask"], segment_ids=mb["segment_ids"], normalization=mode,
                                        denominator=denominator, causal_shift=shift, **OPTIONS[kind])

    tensors = {key: torch.tensor(value) for key, value in batch.items()}
    for k in (1, 3, 8):
        model = Tiny()
        loss = accumulate(loss_fn, model, tensors, num_microbatches=k, normalization=mode, causal_shift=shift)
        assert_tiny(loss, {"emb": model.emb.grad, "head": model.head.grad}, ref_loss, ref_grads, f"torch K={k}")


@pytest.mark.slow  # shard_map over 2 and 4 host devices: compiles per kind and mode
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_jax_accumulate_under_shard_map_equals_full_batch(kind: str, mode: str) -> None:
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxloss.distributed import accumulate

    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map

    params, batch = tiny_problem(kind)
    shift = mode == "sequence_sum"
    ref_loss, ref_grads = tiny_reference(kind, mode, params, batch, causal_shift=shift)
    params = {key: jnp.asarray(value) for key, value in params.items()}
    batch = {key: jnp.asarray(value) for key, value in batch.items()}

    def loss_fn(p, mb, denominator):
        logits = p["emb"][mb["tokens"]] @ p["head"]
        target = mb["labels"] if kind == "cross_entropy" else mb["teacher"]
        return getattr(jaxloss, kind)(logits, target, mb["loss_mask"], segment_ids=mb["segment_ids"], normalization=mode,
                                      denominator=denominator, causal_shift=shift, **OPTIONS[kind])

    step = jax.jit(functools.partial(accumulate, loss_fn, num_microbatches=3, normalization=mode, causal_shift=shift))
    assert_tiny(*step(params, batch), ref_loss, ref_grads, "K=3")
    for replicas, k in ((2, 2), (4, 1), (8, 1)):
        mesh = Mesh(np.array(jax.devices()[:replicas]), ("data",))

        def replicated(p, b, k=k):
            return accumulate(loss_fn, p, b, num_microbatches=k, normalization=mode, causal_shift=shift, data_axes="data")

        sharded = shard_map(replicated, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
        assert_tiny(*jax.jit(sharded)(params, batch), ref_loss, ref_grads, f"D={replicas} K={k}")


def test_jax_accumulate_two_replicas_fast() -> None:
    """The fast-lane twin of the shard_map suite: one kind, 2 replicas x 2 micro-batches."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxloss.distributed import accumulate

    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map

    kind, mode = "cross_entropy", "sequence_mean"
    params, batch = tiny_problem(kind, seed=3)
    ref_loss, ref_grads = tiny_reference(kind, mode, params, batch, causal_shift=True)
    params = {key: jnp.asarray(value) for key, value in params.items()}
    batch = {key: jnp.asarray(value) for key, value in batch.items()}

    def loss_fn(p, mb, denominator):
        logits = p["emb"][mb["tokens"]] @ p["head"]
        return jaxloss.cross_entropy(logits, mb["labels"], mb["loss_mask"], segment_ids=mb["segment_ids"], normalization=mode,
                                     denominator=denominator, causal_shift=True, **OPTIONS[kind])

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sharded = shard_map(
        lambda p, b: accumulate(loss_fn, p, b, num_microbatches=2, normalization=mode, causal_shift=True, data_axes="data"),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
    )
    assert_tiny(*jax.jit(sharded)(params, batch), ref_loss, ref_grads, "D=2 K=2")


@pytest.mark.slow  # torch.compile: tens of seconds
def test_torch_compile_fullgraph() -> None:
    """The sequence coefficients (sort, scatter-add) trace into one graph: same numbers as eager
    and as the oracle."""
    case, ids = packed_case("cross_entropy", float_weights=True)
    logits = torch.tensor(case.logits).requires_grad_(True)
    args = (torch.tensor(case.target), torch.tensor(case.loss_mask), torch.tensor(ids))

    def loss_fn(x, labels, mask, seg):
        return torchloss.cross_entropy(x, labels, mask, segment_ids=seg, normalization="sequence_mean", causal_shift=True)

    compiled = torch.compile(loss_fn, fullgraph=True)(logits, *args)
    compiled.backward()
    ref = case.reference(segment_ids=ids, normalization="sequence_mean", causal_shift=True)
    assert_close_to_oracle(compiled.detach().double().numpy(), logits.grad.double().numpy(), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what="compiled")
