"""The fused LM head's kernels (``impl="pallas"``: :mod:`jaxloss.backends.pallas_head`, ``impl="triton"``:
:mod:`torchloss.backends.triton_head`) against the float64 head oracle.

Shapes are small (on CPU machines the kernels run interpreted: Pallas interpret mode, the Triton
interpreter) but chosen so that with the interpreter's 16 x 16 x 16 tiles every axis takes several
blocks and a ragged tail: N = 36 tokens (3 token blocks), V = 37 (3 vocabulary blocks), H = 40 (3
slices of the hidden axis), the teacher's Ht = 20. Where CUDA is available the Triton kernels are
compiled and take CUDA tensors (``torch_problem.TRITON_DEVICE``; inputs are still made on the
host), and ``_triton_linear.GPU_BLOCKS``' larger tiles still split every axis with a ragged
tail. Masked rows: mask weights 0 and an ignored label. Bounds:
SPEC section 6 for the loss, section 8 (``lossspec.linear.compare_head_grad``) for the gradients
of hidden, weight and bias. The whole file is in the slow tier (interpreted kernels).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import export

import jaxloss
import lossspec
from jaxloss.backends import pallas_head as _pallas_linear
from jaxloss._block import KernelConfig
from lossspec import linear as spec_linear
from torchloss.backends import triton_head as _triton_linear

from parity_tests.support.torch_problem import TRITON_DEVICE
from parity_tests.support.head_cases import head_target, options_for

pytestmark = pytest.mark.slow

from parity_tests.support.head_kernels import H, HT, IMPLS, KINDS, LEAD, V, grad_output_for, make_inputs, run  # noqa: F401


def check(impl: str, kind: str, dtype: str, with_bias: bool, options: dict[str, Any], seed: int = 0, tuning: Any = None) -> None:
    """The kernels against the oracle; ``tuning`` (a ``lossspec.HeadTuning``) goes to the head only."""
    inputs = make_inputs(kind, dtype, seed)
    loss, grads = run(impl, kind, inputs, dtype, with_bias, options if tuning is None else {**options, "tuning": tuning})
    ref_loss, ref = spec_linear.oracle_head(kind, inputs["hidden"], inputs["weight"], head_target(kind, inputs), inputs["loss_mask"],
                                            bias=inputs["bias"] if with_bias else None, grad_output=grad_output_for(options), **options)
    lossspec.compare_loss(loss, ref_loss, f"{impl} {kind} loss").check()
    assert set(grads) == ({"hidden", "weight", "bias"} if with_bias else {"hidden", "weight"})
    for name, grad in grads.items():
        spec_linear.compare_head_grad(grad, ref[name], dtype, f"{impl} {kind} grad {name}", ref.magnitude[name]).check()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_match_oracle(impl: str, kind: str, dtype: str) -> None:
    """Every kind with its options and a bias, a scalar upstream gradient, fp32 and bf16."""
    check(impl, kind, dtype, True, options_for(kind))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_take_their_tiles_from_tuning(impl: str) -> None:
    """``tuning=lossspec.HeadTuning(block_rows=, block_vocab=, block_hidden=, num_warps=)``: other
    tiles than the interpreted defaults (16 x 16 x 16, 1 warp): vocabulary blocks of 32 columns
    (a ragged last one), 2 warps; the same numbers against the oracle."""
    tuning = lossspec.HeadTuning(block_rows=16, block_vocab=32, block_hidden=16, num_warps=2)
    check(impl, "jensen_shannon", "float32", True, options_for("jensen_shannon"), seed=2, tuning=tuning)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_without_bias_per_token(impl: str, kind: str) -> None:
    """No bias, ``normalization="none"`` (a per-token upstream gradient: the backward reruns the
    kernels with ``coef * upstream``)."""
    check(impl, kind, "float32", False, {**options_for(kind), "normalization": "none"}, seed=1)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_plain_cross_entropy_denominator_causal_shift(impl: str) -> None:
    """Cross-entropy without smoothing / z-loss (the constexpr branches off), a denominator and
    the causal shift."""
    check(impl, "cross_entropy", "float32", True, {"denominator": 9.0, "causal_shift": True}, seed=2)


# Packed documents in the rows of LEAD = (4, 9): ids >= 0 are sequences (a row holds one, two or
# three), -1 is padding; one sequence (row 3, id 2) is a single token, which the causal shift
# leaves unscored.
SEGMENT_IDS = np.array([
    [0, 0, 0, 0, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0, 0, -1, -1],
    [3, 3, 5, 5, 5, 7, 7, 7, 7],
    [0, 0, 0, 1, 1, 1, 1, 2, -1],
], dtype=np.int32)


@pytest.mark.parametrize("normalization", ["sequence_mean", "sequence_sum"])
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_per_sequence(impl: str, kind: str, normalization: str) -> None:
    """``segment_ids`` with the per-sequence normalisations and the causal shift: the kernels
    read the per-token coefficients ``w_t / (n_s S)`` (or ``w_t / S``) as runtime data."""
    options = {**options_for(kind), "normalization": normalization, "segment_ids": SEGMENT_IDS, "causal_shift": True}
    check(impl, kind, "float32", True, options, seed=3)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_are_deterministic(impl: str) -> None:
    """Two runs give the same bits (no atomics: every output element has one writer)."""
    inputs = make_inputs("reverse_kl", "float32", seed=5)
    first = run(impl, "reverse_kl", inputs, "float32", True, options_for("reverse_kl"))
    second = run(impl, "reverse_kl", inputs, "float32", True, options_for("reverse_kl"))
    assert first[0].tobytes() == second[0].tobytes()
    for name in first[1]:
        assert first[1][name].tobytes() == second[1][name].tobytes(), name


# --------------------------------------------------------------------------------------------
# Soft caps (the kernels' HAS_SOFTCAP path; LossConfig gains logit_softcap on another branch):
# the drivers are called directly against the oracle on the capped float64 logits.
# --------------------------------------------------------------------------------------------


class _Capped:
    """``config`` with ``logit_softcap`` / ``teacher_logit_softcap`` attributes."""

    def __init__(self, config: Any, cap: float, t_cap: float) -> None:
        self._config, self.logit_softcap, self.teacher_logit_softcap = config, cap, t_cap

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _capped_reference(kind: str, inputs: dict[str, Any], coef: np.ndarray, cap: float, t_cap: float, options: dict[str, Any]) -> tuple:
    """``(sum_i coef_i l_i, dh, dW, db)`` in float64 with ``z -> cap tanh(z / cap)``."""
    h = inputs["hidden"].reshape(-1, H).astype(np.float64)
    raw = spec_linear.head_logits(h, inputs["weight"], inputs["bias"])
    z = cap * np.tanh(raw / cap)
    if kind == "cross_entropy":
        target = inputs["labels"].reshape(-1)
    else:
        t = spec_linear.head_logits(inputs["teacher_hidden"].reshape(-1, HT), inputs["teacher_weight"], inputs["teacher_bias"])
        target = t_cap * np.tanh(t / t_cap)
    per_token, g = lossspec.oracle(kind, z, target, coef, normalization="none", **options)
    g = g * (1.0 - np.tanh(raw / cap) ** 2)
    return float(np.sum(per_token)), g @ inputs["weight"].astype(np.float64), g.T @ h, g.sum(axis=0)


@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_softcap(impl: str, kind: str) -> None:
    cap, t_cap = 1.5, 2.0  # small caps: the logits (|z| up to ~6) are bent hard
    inputs = make_inputs(kind, "float32", seed=6)
    options = options_for(kind)
    if kind == "cross_entropy":
        inputs["labels"] = np.abs(inputs["labels"])  # the drivers take safe labels
    coef = inputs["loss_mask"].reshape(-1).astype(np.float32)
    config = lossspec.make_config(kind, **options)
    n = coef.size
    teacher_np = None if kind == "cross_entropy" else (inputs["teacher_hidden"].reshape(n, HT), inputs["teacher_weight"], inputs["teacher_bias"])
    if impl == "triton":
        on_device = lambda a: torch.tensor(a).to(TRITON_DEVICE)  # noqa: E731
        labels = None if kind != "cross_entropy" else on_device(inputs["labels"].reshape(-1))
        teacher = None if teacher_np is None else tuple(on_device(a) for a in teacher_np)
        out = _triton_linear.head_forward(_Capped(config, cap, t_cap), on_device(inputs["hidden"].reshape(n, H)), on_device(inputs["weight"]),
                                          on_device(inputs["bias"]), labels, teacher, on_device(coef), need_grad=True)
        loss, dh, dw, db = (a.detach().cpu().double().numpy() for a in out)
    else:
        cfg = KernelConfig(kind=kind, scale=config.student_scale, teacher_scale=config.teacher_scale,
                           label_smoothing=config.label_smoothing, z_loss=config.z_loss)
        labels = None if kind != "cross_entropy" else jnp.asarray(inputs["labels"].reshape(-1), jnp.int32)
        teacher = None if teacher_np is None else tuple(jnp.asarray(a) for a in teacher_np)
        out = _pallas_linear.head_forward(cfg, jnp.asarray(inputs["hidden"].reshape(n, H)), jnp.asarray(inputs["weight"]), jnp.asarray(inputs["bias"]),
                                          labels, teacher, jnp.asarray(coef), with_grad=True, softcaps=(cap, t_cap))
        loss, dh, dw, db = (np.asarray(a, np.float64) for a in out)
    ref_loss, ref_dh, ref_dw, ref_db = _capped_reference(kind, inputs, coef, cap, t_cap, options)
    lossspec.compare_loss(float(np.sum(coef * loss)), ref_loss, f"{impl} softcap loss").check()
    for name, got, want in (("hidden", dh, ref_dh), ("weight", dw, ref_dw), ("bias", db, ref_db)):
        spec_linear.compare_head_grad(got, want, "float32", f"{impl} softcap grad {name}").check()


# --------------------------------------------------------------------------------------------
# GPU readiness without a GPU: the Pallas kernels lower through Pallas' Triton backend (the
# Triton kernels: parity_tests/test_torchloss_triton_aot.py)
# --------------------------------------------------------------------------------------------

TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_pallas_head_lowers_to_triton(kind: str, softcap: bool) -> None:
    """``jax.value_and_grad`` of ``linear_<kind>(impl="pallas")`` exported for CUDA: three Triton
    kernels (forward, dh, dW/db), named after the kind, at a realistic shape; with the soft caps
    too (their runtime values once failed Pallas' Triton lowering, an unsupported ``slice``, on
    an H200 while the interpreter ran them)."""
    n, h, ht, vocab = 64, 256, 128, 50257
    hidden = jax.ShapeDtypeStruct((n, h), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((vocab, h), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((vocab,), jnp.bfloat16)
    fn = getattr(jaxloss, f"linear_{kind}")
    spec = lossspec.KIND_SPECS[kind]
    target: tuple = ()
    if spec.has_labels:
        target = (jax.ShapeDtypeStruct((n,), jnp.int32),)
    elif spec.has_teacher:
        target = (jax.ShapeDtypeStruct((n, ht), jnp.bfloat16), jax.ShapeDtypeStruct((vocab, ht), jnp.bfloat16))

    def step(hidden: Any, weight: Any, bias: Any, *target: Any) -> Any:
        caps = {} if not softcap else dict(logit_softcap=30.0, teacher_logit_softcap=50.0) if spec.has_teacher else dict(logit_softcap=30.0)
        return jax.value_and_grad(lambda h, w, b: fn(h, w, *target, bias=b, impl="pallas", **options_for(kind), **caps), argnums=(0, 1, 2))(hidden, weight, bias)

    exported = export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(
        hidden, weight, bias, *target
    )
    module = exported.mlir_module()
    assert module.count(TRITON_CALL) == 3
    for job in ("forward", "dh", "dw"):
        assert f"jaxloss_linear_{kind}_{job}" in module


# All-positive inputs (``torch.rand``-style, Liger's fused-head tests): ``dh = G W`` cancels, so
# SPEC section 8 measures each element against ``|G||W|`` (``compare_head_grad``'s magnitude).
from parity_tests.support.head_cases import positive_inputs  # noqa: E402  (kept with its tests)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_kernels_all_positive_inputs(impl: str, kind: str) -> None:
    """Every kind on uniform ``[0, 1)`` hidden states and weights (H=33, Ht=67, V=701, 18 tokens
    with some masked, label 2 ignored), a bias, a scalar upstream gradient."""
    inputs = positive_inputs(kind, lead=(2, 9))
    options: dict[str, Any] = {}
    loss, grads = run(impl, kind, inputs, "float32", True, options)
    ref_loss, ref = spec_linear.oracle_head(kind, inputs["hidden"], inputs["weight"], head_target(kind, inputs), inputs["loss_mask"], bias=inputs["bias"],
                                            grad_output=grad_output_for(options))
    lossspec.compare_loss(loss, ref_loss, f"{impl} {kind} loss").check()
    for name, grad in grads.items():
        spec_linear.compare_head_grad(grad, ref[name], "float32", f"{impl} {kind} grad {name}", ref.magnitude[name]).check()
