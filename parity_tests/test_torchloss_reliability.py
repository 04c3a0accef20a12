"""torchloss defects found in review, each pinned by a test that failed before the rebuild:
accuracy on confident rows at large vocabularies, NaN gradient rows for NaN losses, no
process-wide thread settings, in-place on a view of a leaf, second order and torch.func, the
float-mask rule."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from parity_tests.support.torch_cases import FUNCTIONS, TORCH_DTYPES, inputs

import lossspec
import torchloss
from torchloss.backends import cpu_tiles as _cpu

KINDS = lossspec.KINDS


def _confident_rows(kind: str, vocab: int, margins: tuple[float, ...], seed: int = 0) -> lossspec.Case:
    """Rows whose top probability is 0.997-0.99995 (margin over log V): where PyTorch's fused
    CPU softmax, with its fast exponential, is off by up to ~1e-5."""
    rng = np.random.default_rng(seed)
    rows = len(margins)
    logits = rng.normal(0.0, 2.0, size=(rows, vocab)).astype(np.float32)
    teacher = rng.normal(0.0, 2.0, size=(rows, vocab)).astype(np.float32)
    labels = rng.integers(0, vocab, size=rows)
    for i, margin in enumerate(margins):
        logits[i, labels[i]] = np.log(vocab) + margin
        teacher[i, (labels[i] + 1) % vocab] = np.log(vocab) + margin  # the teacher confident elsewhere
    target = labels.astype(np.int64) if kind == "cross_entropy" else teacher
    return lossspec.Case(kind, "random", "float32", logits.astype(np.float64), target, None)


@pytest.mark.parametrize("kind", KINDS)
def test_confident_rows_at_a_large_vocabulary_meet_the_bound(kind: str) -> None:
    case = _confident_rows(kind, 32768, (6.0, 8.0, 10.0, 12.0))
    ref_loss, ref_grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask)
    logits, target, mask = inputs(case)
    loss = FUNCTIONS[kind](logits, target, mask, impl="torch")
    loss.backward()
    lossspec.assert_close_to_oracle(
        loss.item(), logits.grad.double().numpy(), ref_loss, ref_grad, dtype="float32", g0=case.g0(), what=kind
    )


def _bad_row_inputs(kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=gen).to(dtype)
    t = torch.randn(6, 40, generator=gen).to(dtype)
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    t[2, 9] = float("nan")
    x[3, 5] = float("nan")  # masked: zeros
    mask = torch.tensor([True, True, True, False, True, True])
    target = torch.randint(0, 40, (6,), generator=gen) if kind == "cross_entropy" else t
    return x, target, mask


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_loss_gives_a_nan_gradient_row(kind: str, dtype: torch.dtype) -> None:
    """A valid row with NaN / +inf logits (or a NaN teacher) has a NaN loss and a NaN gradient
    row, so ``clip_grad_norm_(error_if_nonfinite=True)`` fires; masked bad rows are zeros."""
    x, target, mask = _bad_row_inputs(kind, dtype)
    x.requires_grad_(True)
    loss = FUNCTIONS[kind](x, target, mask, impl="torch", normalization="none")
    loss.sum().backward()
    bad = [0, 1] + ([2] if kind != "cross_entropy" else [])
    grad = x.grad.float()
    for row in bad:
        assert torch.isnan(loss[row]), (kind, row)
        assert torch.isnan(grad[row]).all(), (kind, row, grad[row])
    assert torch.equal(grad[3], torch.zeros(40)) and loss[3].item() == 0.0
    assert torch.isfinite(grad[4:]).all() and torch.isfinite(loss[4:]).all()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_([x], 1.0, error_if_nonfinite=True)


DISTILL_KINDS = tuple(k for k in KINDS if k not in ("cross_entropy", "entropy"))


def _masked_infinite_rows(pattern: str, masked_rows: int, dtype: str) -> lossspec.Case:
    """16 finite rows, the first ``masked_rows`` of them masked and holding ``-inf``: in the
    teacher at one entry, in the teacher at the student's argmax (reverse KL's pivot), or in both
    student and teacher. 1 masked row is 6.25% (dense tiles), 4 are 25% (16-bit: compact tiles,
    ``_cpu.COMPACT_MIN_MASKED``)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 2.0, size=(16, 40))
    teacher = rng.normal(0.0, 2.0, size=(16, 40))
    logits = lossspec.round_to_dtype(logits, dtype)
    teacher = lossspec.round_to_dtype(teacher, dtype)
    for row in range(masked_rows):
        if pattern == "teacher_entry":
            teacher[row, 2 + row] = -np.inf
        elif pattern == "teacher_at_argmax":
            teacher[row, int(np.argmax(logits[row]))] = -np.inf
        else:
            logits[row, 5] = -np.inf
            teacher[row, [5, 9]] = -np.inf
    mask = np.ones(16, dtype=bool)
    mask[:masked_rows] = False
    return lossspec.Case("reverse_kl", pattern, dtype, logits, teacher, mask)


@pytest.mark.parametrize("masked_rows", (1, 4), ids=("dense", "compact"))
@pytest.mark.parametrize("pattern", ("teacher_entry", "teacher_at_argmax", "student_and_teacher"))
@pytest.mark.parametrize("dtype", ("float64", "float32", "bfloat16", "float16"))
@pytest.mark.parametrize("kind", DISTILL_KINDS)
def test_a_masked_row_with_infinite_entries_has_a_zero_gradient(kind: str, dtype: str, pattern: str, masked_rows: int) -> None:
    """A masked row's gradient is exactly 0 whatever it holds: the reverse-KL path once left
    ``0 * inf = NaN`` in a masked row whose teacher had ``-inf`` where the student has
    probability (its ``mean_d`` infinite) while the loss was finite; 16-bit logits escaped only
    through compact tiles (>= 12.5% of rows masked)."""
    case = _masked_infinite_rows(pattern, masked_rows, dtype)
    case = lossspec.Case(kind, case.name, dtype, case.logits, case.target, case.loss_mask)
    torch_dtype = TORCH_DTYPES[dtype]
    logits = torch.from_numpy(case.logits).to(torch_dtype).requires_grad_(True)
    teacher = torch.from_numpy(case.target).to(torch_dtype)
    loss = FUNCTIONS[kind](logits, teacher, torch.from_numpy(case.loss_mask), impl="torch")
    loss.backward()
    grad = logits.grad.double().numpy()
    assert np.array_equal(grad[:masked_rows], np.zeros((masked_rows, 40))), grad[:masked_rows]
    ref_loss, ref_grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask)
    lossspec.assert_close_to_oracle(
        loss.item(), grad, ref_loss, ref_grad, dtype="float32" if dtype == "float64" else dtype, g0=case.g0(), what=kind
    )


def _new_thread_num_threads() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_the_worker_pool_changes_no_process_wide_setting() -> None:
    """The CPU workers run single-threaded ops without ``torch.set_num_threads(1)``, which would
    set the count of every thread created afterwards; one bounded pool, whatever the caller's
    thread count."""
    before = torch.get_num_threads()
    x = torch.randn(64, 8192, requires_grad=True)
    labels = torch.randint(0, 8192, (64,))
    tuning = lossspec.Tuning(cpu_tile_elements=8192 * 4)  # several tiles: the pool is used
    try:
        for threads in (2, 8, 32):
            torch.set_num_threads(threads)
            torchloss.cross_entropy(x, labels, impl="torch", tuning=tuning).backward()
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert _cpu.worker_count(torch.device("cpu"), 100) > 1 or _cpu.MAX_WORKERS == 1  # the pool is in use
    assert _new_thread_num_threads() == before
    pool_threads = [t for t in threading.enumerate() if t.name.startswith("torchloss")]
    assert len(pool_threads) <= _cpu.MAX_WORKERS


def test_inplace_on_a_view_of_a_leaf_raises() -> None:
    weight = torch.nn.Parameter(torch.randn(4 * 10))
    labels = torch.randint(0, 10, (4,))
    kept = weight.detach().clone()
    with pytest.raises(ValueError, match="view of a leaf tensor"):
        torchloss.cross_entropy(weight.view(4, 10), labels, inplace=True)
    assert torch.equal(weight.detach(), kept)
    with pytest.raises(ValueError, match="a leaf tensor"):
        torchloss.cross_entropy(weight.view(4, 10).detach().requires_grad_(True), labels, inplace=True)


@pytest.mark.parametrize("kind", KINDS)
def test_double_backward_raises_a_clear_error(kind: str) -> None:
    case = lossspec.make_case(kind, "random", lead_shape=(5,), vocab=30)
    logits, target, mask = inputs(case)
    loss = FUNCTIONS[kind](logits, target, mask, impl="torch")
    (grad,) = torch.autograd.grad(loss, logits, create_graph=True)
    ref_loss, ref_grad = lossspec.oracle(kind, case.logits, case.target, case.loss_mask)
    np.testing.assert_allclose(grad.detach().double().numpy(), ref_grad, atol=1e-6)  # first order still right
    with pytest.raises(RuntimeError, match="differentiable once"):
        grad.square().sum().backward()


def test_torch_func_transforms_raise_a_clear_error() -> None:
    x = torch.randn(3, 7)
    labels = torch.randint(0, 7, (3,))
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.grad(lambda z: torchloss.cross_entropy(z, labels))(x)
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.vmap(lambda z: torchloss.cross_entropy(z, labels))(x[None])


@pytest.mark.parametrize("kind", KINDS)
def test_a_float_mask_gets_no_gradient(kind: str) -> None:
    """The documented rule, the same in jaxloss: the mask is data, no gradient flows to it."""
    case = lossspec.make_case(kind, "float_weights", lead_shape=(6,), vocab=20)
    logits, target, mask = inputs(case)
    mask = mask.to(torch.float32).requires_grad_(True)
    loss = FUNCTIONS[kind](logits, target, mask, impl="torch")
    loss.backward()
    assert mask.grad is None and logits.grad is not None


@pytest.mark.parametrize("weights", ([3e38, 3e38, 1.0], [1e-40, 1.0, 0.0]))
def test_overflowing_or_subnormal_weights_raise(weights: list[float]) -> None:
    x = torch.randn(3, 5)
    labels = torch.tensor([0, 1, 2])
    mask = torch.tensor(weights, dtype=torch.float32)
    with pytest.raises(ValueError, match="loss_mask"):
        torchloss.cross_entropy(x, labels, mask)
    with pytest.raises(ValueError, match="loss_mask"):
        torchloss.count_denominator(labels, mask)


def test_large_unsigned_labels_are_out_of_range_not_ignored() -> None:
    x = torch.randn(2, 5)
    labels = torch.tensor([2**32 - 100, 1], dtype=torch.uint32)
    with pytest.raises(ValueError, match="labels"):
        torchloss.cross_entropy(x, labels)
    # ignore_index far outside the labels' range matches nothing, with no overflow.
    ref, _ = lossspec.oracle("cross_entropy", x.numpy(), np.array([3, 1]), ignore_index=2**40)
    got = torchloss.cross_entropy(x, torch.tensor([3, 1]), ignore_index=2**40)
    assert abs(got.item() - ref) <= 4e-6 * max(1.0, abs(ref))


@pytest.mark.parametrize("weights", ([3e38, 3e38, 1.0], [1e-40, 1.0, 0.0], [1.0, -1.0, 1.0]))
def test_unchecked_path_gives_nan_for_bad_weights(monkeypatch: pytest.MonkeyPatch, weights: list[float]) -> None:
    """Where values cannot be read for free (CUDA tensors, compiled code), the same rules make
    the loss and the count NaN (the twin of lossspec.check_weights)."""

    monkeypatch.setattr(torchloss._prepare, "host_readable", lambda *tensors: False)
    x = torch.randn(3, 5)
    labels = torch.tensor([0, 1, 2])
    mask = torch.tensor(weights, dtype=torch.float32)
    assert torch.isnan(torchloss.cross_entropy(x, labels, mask))
    assert torch.isnan(torchloss.count_denominator(labels, mask))
    assert torch.isnan(torchloss.cross_entropy(x, labels, denominator=torch.tensor(1e-40)))


@pytest.mark.parametrize("width", [700, 1024, 1300])
def test_first_max_is_numpy_max_and_argmax(width: int) -> None:
    """The blocked first-maximum of the reverse-KL pivot: the same values and first columns as
    ``np.max``/``np.argmax`` (first occurrence) on ties inside a block, across blocks, in the
    partial last block, on all -inf rows and on NaN rows."""
    from torchloss._block import FIRST_MAX_BLOCK, first_max

    rng = np.random.default_rng(width)
    x = rng.standard_normal((9, width)).astype(np.float32)
    x[0, [5, 9]] = 7.0  # tie inside the first block
    x[1, [FIRST_MAX_BLOCK - 1, FIRST_MAX_BLOCK]] = 7.0  # tie across a block boundary
    x[2, [3, width - 1]] = 7.0  # tie with the last column (the partial block when there is one)
    x[3, width - 2] = 9.0  # maximum in the last block alone
    x[4] = -np.inf
    x[5, [4, 600]] = np.nan  # NaN: its first column
    x[6, [650, 20]] = [np.inf, np.inf]
    x[7, 2 * FIRST_MAX_BLOCK] = 5.0
    x[7, [2 * FIRST_MAX_BLOCK + 1, 10]] = 5.0
    top, column = first_max(torch.from_numpy(x))
    np.testing.assert_array_equal(top.numpy(), np.max(x, axis=1))
    np.testing.assert_array_equal(column.numpy(), np.argmax(x, axis=1))


@pytest.mark.skipif(_cpu.omp_set_num_threads() is None, reason="needs torch's OpenMP runtime (the CPU worker pool)")
@pytest.mark.parametrize("tiles", (1, 3))
def test_cpu_tiles_run_on_single_threaded_workers(tiles: int) -> None:
    """Every CPU tile, a lone one too, runs on a pool worker whose ATen ops are single-threaded
    while the caller runs torch with several threads: on the calling thread each of a tile's
    small ops would be an OpenMP parallel region whose barrier waits for a descheduled thread on
    a busy CPU. A caller that runs torch single-threaded keeps its tiles on its own thread."""
    before = torch.get_num_threads()
    seen: list[tuple[str, int]] = []

    def run(part: Any) -> None:
        for _ in part:
            seen.append((threading.current_thread().name, torch.get_num_threads()))

    try:
        torch.set_num_threads(2)
        _cpu.map_tiles(run, list(range(tiles)), torch.device("cpu"))
        assert len(seen) == tiles
        assert all(name.startswith("torchloss") and threads == 1 for name, threads in seen), seen
        seen.clear()
        torch.set_num_threads(1)
        _cpu.map_tiles(run, list(range(tiles)), torch.device("cpu"))
        assert seen == [(threading.current_thread().name, 1)] * tiles
    finally:
        torch.set_num_threads(before)
