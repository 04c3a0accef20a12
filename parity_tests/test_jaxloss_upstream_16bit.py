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
