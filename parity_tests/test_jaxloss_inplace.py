"""jaxloss ``inplace=True`` (the twin of torchloss's, ``test_torchloss_autograd.py``): the gradient
may take the logits' buffer. The Pallas kernel's gradient output aliases the logits
(``input_output_aliases``, seen in the jaxpr and in the GPU lowering's custom call), the logits are
not kept for the backward, and the numbers are those of ``inplace=False``; with 16-bit logits and a
non-unit upstream gradient the buffer is scaled (one more rounding, as in torchloss) instead of
recomputed. JAX never refuses it (arrays are immutable: XLA copies logits still needed); only a
non-bool is an error, lossspec's, as in torch."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxloss
import jaxloss.nnx
import lossspec

TRITON_CALL = "__gpu$xla.gpu.triton"
ALIASED = "input_output_aliases=((0, 1),)"


def _inputs(kind: str, dtype: str, n: int = 10, vocab: int = 100) -> tuple[jax.Array, Any, jax.Array]:
    rng = np.random.default_rng(lossspec.ALL_KINDS.index(kind))
    x = jnp.asarray(rng.normal(0.0, 2.0, (n, vocab)).astype(np.float32)).astype(dtype)
    target = lossspec.KIND_SPECS[kind].target
    if target == "labels":
        t: Any = jnp.asarray(rng.integers(0, vocab, n).astype(np.int32))
    elif target == "teacher_logits":
        t = jnp.asarray(rng.normal(0.0, 2.0, (n, vocab)).astype(np.float32)).astype(dtype)
    else:
        t = None
    mask = jnp.asarray(rng.random(n) < 0.7)
    return x, t, mask


def _loss_and_grad(kind: str, x: jax.Array, target: Any, mask: jax.Array, upstream: float = 1.0, **options: Any) -> tuple[np.ndarray, np.ndarray]:
    fn = getattr(jaxloss, kind)

    def loss(x: jax.Array) -> jax.Array:
        value = fn(x, mask, **options) if target is None else fn(x, target, mask, **options)
        return value * upstream

    value, grad = jax.jit(jax.value_and_grad(loss))(x)
    return np.asarray(value), np.asarray(grad.astype(jnp.float32))


@pytest.mark.parametrize("kind", lossspec.ALL_KINDS)
def test_inplace_gradient_xla(kind: str) -> None:
    """The XLA path: the same numbers (nothing aliased; the logits are not kept)."""
    x, target, mask = _inputs(kind, "float32")
    expected = _loss_and_grad(kind, x, target, mask, impl="xla")
    got = _loss_and_grad(kind, x, target, mask, impl="xla", inplace=True)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])  # labels, teacher (the alias is kind-blind)
def test_inplace_gradient_pallas(kind: str) -> None:
    """The aliased Pallas kernel (interpreted): the numbers of ``inplace=False``, bit for bit, and the
    float64 oracle's; a non-unit upstream gradient on bf16 logits scales the buffer (one rounding
    more) instead of recomputing."""
    x, target, mask = _inputs(kind, "bfloat16")
    expected = _loss_and_grad(kind, x, target, mask, impl="pallas")
    got = _loss_and_grad(kind, x, target, mask, impl="pallas", inplace=True)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    # The oracle on the same (bf16-valued) inputs: one rounding of the gradient to bf16 away.
    x64 = np.asarray(x.astype(jnp.float32)).astype(np.float64)
    if target is not None and target.dtype != jnp.int32:
        target = np.asarray(target.astype(jnp.float32)).astype(np.float64)
    ref_loss, ref_grad = lossspec.oracle(kind, x64, None if target is None else np.asarray(target), np.asarray(mask))
    lossspec.compare_loss(got[0], ref_loss).check()
    np.testing.assert_allclose(got[1], ref_grad, rtol=2**-8, atol=1e-30)
    x, target, mask = _inputs(kind, "bfloat16")
    scaled = _loss_and_grad(kind, x, target, mask, upstream=0.3, impl="pallas", inplace=True)
    once_more = (jnp.asarray(got[1]).astype(jnp.bfloat16).astype(jnp.float32) * 0.3).astype(jnp.bfloat16)
    np.testing.assert_array_equal(scaled[1], np.asarray(once_more.astype(jnp.float32)))


@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
def test_inplace_aliases_the_logits_in_the_pallas_kernel(kind: str) -> None:
    """``inplace=True``: every lowering of the Pallas forward (CUDA, ROCm, the interpreter) writes
    the gradient into the logits' buffer, and no recompute kernel keeps the logits alive; the GPU
    lowering's Triton custom call carries the alias. ``inplace=False``: no alias."""
    x, target, mask = _inputs(kind, "bfloat16")

    def program(inplace: bool) -> Any:
        def step(x: jax.Array) -> Any:
            return jax.value_and_grad(lambda x: getattr(jaxloss, kind)(x, target, mask, impl="pallas", inplace=inplace))(x)

        return step

    aliased = str(jax.make_jaxpr(program(True))(x))
    plain = str(jax.make_jaxpr(program(False))(x))
    assert aliased.count("pallas_call") == aliased.count(ALIASED) == 3  # one per lowering platform
    assert ALIASED not in plain and plain.count("pallas_call") == 6  # and the 16-bit recompute's three
    for inplace, aliases in ((True, 1), (False, 0)):
        module = export.export(
            jax.jit(program(inplace)), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
        )(jax.ShapeDtypeStruct(x.shape, x.dtype)).mlir_module()
        assert module.count("output_operand_aliases") == aliases, inplace


def test_inplace_must_be_a_bool_in_both_frameworks() -> None:
    """The one message of ``lossspec.check_inplace``, for the functions and the module classes."""
    x, labels, _ = _inputs("cross_entropy", "float32", n=2, vocab=8)
    with pytest.raises(TypeError, match="inplace must be a bool; got int"):
        jaxloss.cross_entropy(x, labels, inplace=1)
    with pytest.raises(TypeError, match="inplace must be a bool; got str"):
        jaxloss.nnx.EntropyLoss(inplace="yes")
    with pytest.raises(TypeError, match="inplace must be a bool; got int"):
        lossspec.check_inplace(1)
    assert jaxloss.nnx.CrossEntropyLoss(inplace=True).options["inplace"] is True
