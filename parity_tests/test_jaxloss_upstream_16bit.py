"""16-bit logits with a non-unit upstream gradient: still rounded once (SPEC section 6 bound)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxloss
import lossspec


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("kind", lossspec.KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_non_unit_upstream_gradient(impl: str, kind: str, dtype: str) -> None:
    case = lossspec.make_case(kind, "float_weights", lead_shape=(2, 7), vocab=257, dtype=dtype)
    x = jnp.asarray(case.logits, dtype)
    target = jnp.asarray(case.target, jnp.int32 if kind == "cross_entropy" else dtype)
    mask = jnp.asarray(case.loss_mask)
    per_token = np.random.default_rng(0).uniform(-3, 3, (2, 7)).astype(np.float32)
    per_token[0, :3] = 1.0  # a mix of exact ones and others
    for normalization, upstream in (("none", per_token), ("valid_tokens", np.float32(0.37)), ("sum", np.float32(-1.9))):
        loss, vjp = jax.vjp(lambda x: getattr(jaxloss, kind)(x, target, mask, normalization=normalization, impl=impl), x)
        (grad,) = vjp(jnp.asarray(upstream) * jnp.ones_like(loss))
        ref = case.reference(normalization=normalization, grad_output=upstream)
        lossspec.assert_close_to_oracle(np.asarray(loss), np.asarray(grad.astype(jnp.float32)), ref.loss, ref.grad,
                                        dtype=dtype, g0=ref.g0, what=f"{impl} {kind} {dtype} {normalization}")


@pytest.mark.parametrize("kind", ["cross_entropy", "jensen_shannon"])
def test_pallas_16bit_backward_is_the_gradient_pass_alone(kind: str) -> None:
    """``impl="pallas"`` with bf16 logits: the forward keeps the rows' final statistics and the
    backward's recompute (a non-unit upstream gradient) is the kernel's "grad" mode alone, one
    pallas_call per lowering platform besides the forward's, never the "fused" kernel again
    (which would read the logits twice more, three times for jensen_shannon); the XLA path
    reruns its forward and keeps nothing."""
    case = lossspec.make_case(kind, "random", lead_shape=(4,), vocab=40, dtype="bfloat16", seed=1)
    x = jnp.asarray(case.logits, jnp.bfloat16)
    target = jnp.asarray(case.target, jnp.int32 if kind == "cross_entropy" else jnp.bfloat16)
    mask = jnp.asarray(case.loss_mask)

    def step(x: jax.Array) -> jax.Array:
        return jax.grad(lambda x: 0.5 * getattr(jaxloss, kind)(x, target, mask, impl="pallas"))(x)

    program = str(jax.make_jaxpr(step)(x))
    assert program.count(f"name=jaxloss_{kind}_fused") == 3  # CUDA, ROCm, the interpreter
    assert program.count(f"name=jaxloss_{kind}_grad") == 3
    ref = case.reference(grad_output=0.5)
    lossspec.compare_grad(np.asarray(step(x).astype(jnp.float32)), ref.grad, "bfloat16", ref.g0).check()
