"""torchloss against the float64 oracle at the bounds of SPEC section 6.

The torch path runs the full matrix (kind x scenario x dtype x normalisation); the Triton kernels
(interpreted on the CPU, ~0.1 s a call) run every kind, scenario and dtype with the
normalisations rotated through, so every kind x dtype x normalisation combination is covered.
Triton calls run on ``torch_problem.TRITON_DEVICE`` (compiled kernels on CUDA tensors where CUDA
is available; support.torch_cases.device_for), inputs made on the host either way.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from parity_tests.support.torch_cases import DTYPES, IMPLS, FUNCTIONS, check, device_for, inputs, quiet, run

import lossspec
from torchloss import _block
from torchloss.backends import cpu_tiles as _cpu

KINDS = lossspec.KINDS
SCENARIOS = lossspec.SCENARIOS
NORMALIZATIONS = lossspec.NORMALIZATIONS


def _case(kind: str, scenario: str, dtype: str = "float32", **kwargs: object) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, dtype=dtype, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Matrices
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_matrix(kind: str, scenario: str, dtype: str, normalization: str) -> None:
    check(_case(kind, scenario, dtype, vocab=100), "torch", normalization=normalization)


TRITON_MATRIX = [
    (kind, scenario, dtype, NORMALIZATIONS[(i + j + k) % len(NORMALIZATIONS)])
    for (i, kind), (j, scenario), (k, dtype) in itertools.product(enumerate(KINDS), enumerate(SCENARIOS), enumerate(DTYPES))
]


def test_triton_matrix_covers_every_mode() -> None:
    covered = {(kind, dtype, norm) for kind, _, dtype, norm in TRITON_MATRIX}
    assert covered == set(itertools.product(KINDS, DTYPES, NORMALIZATIONS))


@pytest.mark.parametrize("kind,scenario,dtype,normalization", TRITON_MATRIX)
def test_triton_matrix(kind: str, scenario: str, dtype: str, normalization: str) -> None:
    check(_case(kind, scenario, dtype, vocab=100, lead_shape=(12,)), "triton", normalization=normalization)


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------

CE_OPTIONS = [
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"logit_scale": 0.7},
    {"logit_scale": 2.5},
    {"label_smoothing": 0.2, "z_loss": 1e-4, "logit_scale": 1.5},
]
DISTILL_OPTIONS = [
    {"temperature": 2.0},
    {"temperature": 0.5},
    {"logit_scale": 1.7},
    {"teacher_logit_scale": 0.6},
    {"temperature": 1.5, "logit_scale": 0.8, "teacher_logit_scale": 1.3},
]
OPTION_CASES = [(kind, opts) for kind in KINDS for opts in (CE_OPTIONS if kind == "cross_entropy" else DISTILL_OPTIONS)]
OPTION_SCENARIOS = ("random", "confident", "huge", "neg_inf", "float_weights")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", OPTION_SCENARIOS)
@pytest.mark.parametrize("kind,options", OPTION_CASES)
def test_torch_path_options(kind: str, options: dict, scenario: str, dtype: str) -> None:
    normalization = "none" if scenario in ("confident", "float_weights") else "valid_tokens"
    check(_case(kind, scenario, dtype, vocab=100), "torch", normalization=normalization, **options)


@pytest.mark.parametrize("scenario", ("random", "huge", "neg_inf"))
@pytest.mark.parametrize("kind,options", OPTION_CASES)
def test_triton_options(kind: str, options: dict, scenario: str) -> None:
    dtype = DTYPES[(OPTION_CASES.index((kind, options)) + len(scenario)) % len(DTYPES)]
    check(_case(kind, scenario, dtype, vocab=100, lead_shape=(10,)), "triton", **options)


def test_label_smoothing_with_neg_inf_logits_is_inf() -> None:
    """DESIGN.md: with label smoothing a -inf logit makes the true loss +inf, and that is what is
    returned; the gradient stays finite."""
    case = _case("cross_entropy", "neg_inf", vocab=100)
    for impl in IMPLS:
        loss, grad = run(case, impl, label_smoothing=0.1)
        assert loss == np.inf
        assert np.all(np.isfinite(grad))
        check(case, impl, label_smoothing=0.1)


@pytest.mark.parametrize("impl", IMPLS)
def test_ignore_index(impl: str) -> None:
    base = _case("cross_entropy", "random", vocab=100)
    labels = np.where(base.target == -100, 7, base.target)  # 7 is now the ignored label
    case = dataclasses.replace(base, target=labels)
    comparisons = check(case, impl, ignore_index=7)
    # The same labels with the default ignore_index count 7 as a class (a different loss).
    ref = case.reference()
    loss, _ = run(case, impl)
    assert comparisons[0].ok and lossspec.compare_loss(loss, ref.loss).ok


@pytest.mark.parametrize("normalization", ("valid_tokens", "tokens", "sum"))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_denominator(kind: str, impl: str, normalization: str) -> None:
    """denominator= overrides D of every reduced mode (DESIGN.md), as a number or a tensor."""
    case = _case(kind, "float_weights", "bfloat16" if impl == "torch" else "float32", vocab=100, lead_shape=(10,))
    for denominator in (37, 2.5, torch.tensor(37.0), torch.tensor([11.0], dtype=torch.float64)):
        check(case, impl, normalization=normalization, denominator=denominator)
    for zero in (0.0, torch.tensor(0.0)):  # D == 0: loss 0 and gradient 0, never NaN
        loss, grad = run(case, impl, normalization=normalization, denominator=zero)
        assert loss == 0.0 and np.all(grad == 0.0)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_upstream_gradient(impl: str, dtype: str, normalization: str) -> None:
    """An arbitrary non-1 upstream gradient: scalar for the reduced modes, per token for "none".

    SPEC section 6 holds for every dtype: 16-bit gradients are recomputed in the backward with
    ``coef * upstream`` and rounded once, never the rounded forward gradient rounded again.
    """
    kind = KINDS[(DTYPES.index(dtype) + NORMALIZATIONS.index(normalization)) % len(KINDS)]
    case = _case(kind, "random", dtype, vocab=100, lead_shape=(3, 4))
    rng = np.random.default_rng(7)
    upstream = rng.uniform(-3, 3, size=(3, 4)) if normalization == "none" else np.asarray(-0.37)
    check(case, impl, grad_output=upstream.astype(np.float32), normalization=normalization)


UPSTREAM_SCENARIOS = ("float_weights", "confident", "huge")


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_upstream_gradient_16bit(kind: str, impl: str, dtype: str) -> None:
    """16-bit logits with non-unit upstream gradients meet the SPEC bound directly (one ulp plus
    ``4e-6 * S``): scalars that are not powers of two, and per-token upstream gradients mixing
    arbitrary values with exact 1s (rows the Triton backward leaves alone), 0s and negatives, on
    confident rows and huge logits too, with options."""
    rng = np.random.default_rng(11)
    per_token = rng.uniform(-3, 3, size=(9,))
    per_token[[1, 4]] = 1.0
    per_token[6] = 0.0
    for scenario in UPSTREAM_SCENARIOS:
        case = _case(kind, scenario, dtype, vocab=70, lead_shape=(9,))
        for scalar in (0.37, -1.9, 1e-3):
            check(case, impl, grad_output=np.float32(scalar), **BLOCK_OPTIONS[kind])
        check(case, impl, grad_output=per_token.astype(np.float32), normalization="none", **BLOCK_OPTIONS[kind])


@pytest.mark.parametrize("impl", IMPLS)
def test_upstream_gradient_16bit_retain_graph(impl: str) -> None:
    """With retain_graph=True the 16-bit recomputation writes a copy: a second backward with
    another upstream gradient still meets the bound, and a unit one still gives the forward's
    gradient bit for bit."""
    case = _case("cross_entropy", "float_weights", "bfloat16", vocab=50, lead_shape=(6,))
    _, unit = run(case, impl)
    device = device_for(impl)
    logits, target, mask = inputs(case, device=device)
    with quiet():
        loss = FUNCTIONS["cross_entropy"](logits, target, mask, impl=impl)
        loss.backward(torch.tensor(0.37).to(device), retain_graph=True)
        first = logits.grad.cpu().double().numpy().copy()
        logits.grad = None
        loss.backward(torch.tensor(1.0).to(device), retain_graph=True)
        np.testing.assert_array_equal(logits.grad.cpu().double().numpy(), unit)
        logits.grad = None
        loss.backward(torch.tensor(0.37).to(device))
    np.testing.assert_array_equal(logits.grad.cpu().double().numpy(), first)
    ref = case.reference(grad_output=np.float64(np.float32(0.37)))
    lossspec.assert_close_to_oracle(loss.detach().cpu().double().numpy(), first, ref.loss, ref.grad, dtype="bfloat16", g0=ref.g0)


# --------------------------------------------------------------------------------------------
# Shapes, vocabulary blocks and tiles
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "lead_shape,vocab", [((2, 7), 100), ((2, 7), 257), ((3,), 1), ((1, 1, 5), 33)], ids=["2x7x100", "2x7x257", "V1", "1x1x5x33"]
)
def test_shapes(impl: str, lead_shape: tuple, vocab: int) -> None:
    for i, kind in enumerate(KINDS):
        normalization = NORMALIZATIONS[i]
        check(_case(kind, "random", vocab=vocab, lead_shape=lead_shape), impl, normalization=normalization)


@pytest.mark.parametrize("impl", IMPLS)
def test_single_token(impl: str) -> None:
    """Logits ``[V]`` with a scalar label: the loss of "none" has shape ()."""
    for kind in KINDS:
        case = _case(kind, "no_mask", vocab=50, lead_shape=(1,))
        case = dataclasses.replace(case, logits=case.logits[0], target=case.target[0])
        check(case, impl, normalization="none")
        check(case, impl)


def _padded_case(kind: str, dtype: str) -> lossspec.Case:
    """V = 257 whose last 70 entries are -inf (a padded vocabulary), so whole vocabulary blocks
    of a blocked row are -inf."""
    case = _case(kind, "random", dtype, vocab=257, lead_shape=(9,))
    logits = case.logits.copy()
    logits[:, 187:] = -np.inf
    target = case.target
    if kind == "cross_entropy":
        target = np.where((target >= 0) & (target < 257), target % 187, target)
    else:
        target = target.copy()
        target[:, 187:] = -np.inf
    return dataclasses.replace(case, logits=logits, target=target)


BLOCK_OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 1.3},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"teacher_logit_scale": 0.7},
    "reverse_kl": {"logit_scale": 0.9, "temperature": 1.2},
}


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_vocab_blocks(kind: str, dtype: str) -> None:
    """Rows longer than one vocabulary block: statistics combined block by block (the algebra of
    vocab-parallel), the gradient recomputed in a second pass; ragged last block; several row
    tiles with a ragged last tile."""
    tuning = lossspec.Tuning(vocab_block=64, cpu_tile_elements=4 * 64)
    options = BLOCK_OPTIONS[kind]
    for scenario in ("random", "huge", "neg_inf", "confident"):
        check(_case(kind, scenario, dtype, vocab=257, lead_shape=(9,)), "torch", tuning=tuning, **options)
    check(_padded_case(kind, dtype), "torch", normalization="none", tuning=tuning)
    if kind == "cross_entropy":
        check(_padded_case(kind, dtype), "torch", z_loss=1e-3, tuning=tuning)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_row_tiles(kind: str) -> None:
    # 3 rows of 100 a tile for every kind (kinds with 4 buffers take half tiles), ragged last tile
    tuning = lossspec.Tuning(cpu_tile_elements=300 if _block.buffers_needed(kind) < 4 else 600)
    upstream = np.random.default_rng(3).uniform(-3, 3, size=(3, 5)).astype(np.float32)
    for dtype in DTYPES:
        case = _case(kind, "float_weights", dtype, vocab=100, lead_shape=(3, 5))
        check(case, "torch", tuning=tuning, **BLOCK_OPTIONS[kind])
        # Per-token upstream gradients: scaled (fp32) or recomputed (16-bit) tile by tile too.
        check(case, "torch", normalization="none", grad_output=upstream, tuning=tuning, **BLOCK_OPTIONS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_torch_path_compact_tiles(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """16-bit logits on the CPU: tiles made of the runs of valid rows only (masked rows get zero
    gradients without being computed), several tiles, runs split across tiles, an all-masked
    tail, in place too."""
    tiles: list = []
    plan = _cpu.compact_tiles
    monkeypatch.setattr(_cpu, "compact_tiles", lambda *args: tiles.append(plan(*args)) or tiles[-1])
    tuning = lossspec.Tuning(cpu_tile_elements=400 if _block.buffers_needed(kind) < 4 else 800)  # 4 valid rows of 100 a tile
    for dtype in ("bfloat16", "float16"):
        for scenario in ("random", "heavy_mask", "float_weights", "all_masked"):
            case = _case(kind, scenario, dtype, vocab=100, lead_shape=(3, 7))
            check(case, "torch", tuning=tuning, **BLOCK_OPTIONS[kind])
            check(case, "torch", normalization="none", tuning=tuning)
    compact = [t for t in tiles if t is not None]  # None: too few masked rows, dense tiles
    assert len(compact) >= 8 and max(len(t) for t in compact) >= 3
    assert any(r0 < a for t in compact for r0, _, (runs, _, _) in t for a, _ in runs[:1])  # masked rows skipped


@pytest.mark.parametrize("kind", KINDS)
def test_triton_vocab_blocks(kind: str) -> None:
    """Several loop iterations over vocabulary blocks of 64 with a ragged tail (online softmax)."""
    tuning = lossspec.Tuning(vocab_block=64)
    options = BLOCK_OPTIONS[kind]
    check(_case(kind, "random", "bfloat16", vocab=257, lead_shape=(6,)), "triton", tuning=tuning, **options)
    check(_case(kind, "huge", "float32", vocab=257, lead_shape=(6,)), "triton", tuning=tuning, **options)
    check(_padded_case(kind, "float16"), "triton", normalization="none", tuning=tuning)


# --------------------------------------------------------------------------------------------
# NaN, +inf and D == 0
# --------------------------------------------------------------------------------------------


def _poisoned(kind: str) -> tuple[lossspec.Case, list[int], int]:
    """12 tokens: NaN in row 2, +inf in row 5 (and NaN in the teacher's row 7), row 9 masked
    and full of NaN / inf garbage."""
    case = _case(kind, "no_mask", vocab=100, lead_shape=(12,))
    logits = case.logits.copy()
    logits[2, 10] = np.nan
    logits[5, 20] = np.inf
    logits[9, :] = np.nan
    logits[9, 3] = np.inf
    target = case.target.copy()
    bad = [2, 5]
    if kind != "cross_entropy":
        target[7, 30] = np.nan
        bad.append(7)
    mask = np.ones(12, dtype=bool)
    mask[9] = False
    return dataclasses.replace(case, logits=logits, target=target, loss_mask=mask), bad, 9


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_rows(kind: str, impl: str) -> None:
    """NaN or +inf in a valid row gives a NaN loss (never a plausible number); a masked row of
    garbage leaks nothing; the other rows are unaffected."""
    case, bad, masked = _poisoned(kind)
    good = [i for i in range(12) if i not in bad]
    ref_tok = case.reference(normalization="none")
    loss, grad = run(case, impl, normalization="none")
    assert np.all(np.isnan(loss[bad]))
    lossspec.compare_loss(loss[good], ref_tok.loss[good]).check()
    lossspec.compare_grad(grad[good], ref_tok.grad[good], "float32", ref_tok.g0).check()
    assert loss[masked] == 0.0 and np.all(grad[masked] == 0.0)
    ref = case.reference()
    loss, grad = run(case, impl)
    assert np.isnan(loss) and np.isnan(ref.loss)
    lossspec.compare_grad(grad[good], ref.grad[good], "float32", ref.g0).check()
    assert np.all(grad[masked] == 0.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_everything_masked_gives_zero(kind: str, impl: str) -> None:
    """D == 0: loss 0 and gradient exactly 0, even with NaN / inf garbage in the masked rows."""
    case, _, _ = _poisoned(kind)
    case = dataclasses.replace(case, loss_mask=np.zeros(12, dtype=bool))
    for normalization in NORMALIZATIONS:
        loss, grad = run(case, impl, normalization=normalization)
        assert np.all(loss == 0.0) and np.all(grad == 0.0), normalization


@pytest.mark.parametrize("impl", IMPLS)
def test_loss_only_without_grad(impl: str) -> None:
    """Under no_grad (or logits without requires_grad) only the loss is computed: same value."""
    for kind in KINDS:
        case = _case(kind, "random", vocab=100)
        logits, target, mask = inputs(case, requires_grad=False, device=device_for(impl))
        with quiet():
            loss = FUNCTIONS[kind](logits, target, mask, impl=impl)
            with torch.no_grad():
                loss2 = FUNCTIONS[kind](logits.requires_grad_(), target, mask, impl=impl)
        assert not loss.requires_grad and not loss2.requires_grad
        lossspec.compare_loss(loss.cpu().numpy(), case.reference().loss).check()
        assert torch.equal(loss, loss2)
