"""jaxloss inside ``shard_map`` with the default ``check_vma=True`` (JAX 0.10), against the
float64 oracle.

Pallas interpret mode (the CPU stand-in for the GPU kernel) used to fail there with JAX's
"Primitive gather requires varying manual axes to match ... open an issue" (the interpreter
evaluates the kernel on varying operands); it now runs in a nested ``shard_map`` without the
check. And a call whose per-token coefficients do not vary over the mesh (no ``loss_mask``)
used to fail in the backward ("Custom VJP bwd rule must produce an output with the same
type"), on both paths: the mask and the denominator are data and get no cotangent now.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxloss
import lossspec

FNS = {"cross_entropy": jaxloss.cross_entropy, "soft_cross_entropy": jaxloss.soft_cross_entropy,
       "forward_kl": jaxloss.forward_kl, "reverse_kl": jaxloss.reverse_kl}
VOCAB = 40


def _check(case: lossspec.Case, loss: Any, grad: Any, what: str, **options: Any) -> None:
    ref = case.reference(**options)
    lossspec.assert_close_to_oracle(np.asarray(loss), np.asarray(jnp.asarray(grad, jnp.float32)), ref.loss, ref.grad,
                                    dtype=case.dtype, g0=ref.g0, what=what)


# (kind, with a mask, impl): data parallel, global denominator from count_denominator + psum.
DATA_PARALLEL = [
    ("cross_entropy", True, "pallas"),
    ("reverse_kl", False, "pallas"),
    ("forward_kl", False, "xla"),
    ("cross_entropy", False, "xla"),
]


@pytest.mark.parametrize("kind,masked,impl", DATA_PARALLEL, ids=["-".join(map(str, c)) for c in DATA_PARALLEL])
def test_data_parallel_with_check_vma(kind: str, masked: bool, impl: str) -> None:
    """Masked: the global "valid_tokens" denominator (count_denominator + psum). Unmasked:
    "sum", so every replica's coefficients are the same ones (not varying over the mesh)."""
    case = lossspec.make_case(kind, "float_weights", lead_shape=(8, 3), vocab=VOCAB, seed=4)
    ce = kind == "cross_entropy"
    normalization = "valid_tokens" if masked else "sum"
    if not masked:
        labels = np.random.default_rng(5).integers(0, VOCAB, (8, 3))
        case = lossspec.Case(kind, case.scenario, case.dtype, case.logits, labels if ce else case.target, None)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))

    def local(x: jax.Array, t: jax.Array, *mask: jax.Array) -> jax.Array:
        m = mask[0] if mask else None
        denominator = jax.lax.psum(jaxloss.count_denominator(t if ce else None, m), "data") if masked else None
        loss = FNS[kind](x, t, m, normalization=normalization, denominator=denominator, impl=impl)
        return jax.lax.psum(loss, "data")

    arrays = (case.logits, case.target) + ((case.loss_mask,) if masked else ())
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * len(arrays), out_specs=P())  # check_vma=True
    args = jax.device_put(tuple(jnp.asarray(a) for a in arrays), NamedSharding(mesh, P("data")))
    loss, grad = jax.jit(jax.value_and_grad(sharded))(*args)
    _check(case, loss, grad, f"shard_map data/{kind}/{impl}", normalization=normalization)


VOCAB_PARALLEL = [
    ("cross_entropy", {"label_smoothing": 0.1, "z_loss": 1e-3}, "float32"),
    ("forward_kl", {"temperature": 1.7}, "bfloat16"),
]


@pytest.mark.parametrize("kind,options,dtype", VOCAB_PARALLEL, ids=[c[0] for c in VOCAB_PARALLEL])
def test_pallas_vocab_parallel_with_check_vma(kind: str, options: dict[str, Any], dtype: str) -> None:
    case = lossspec.make_case(kind, "random", lead_shape=(2, 5), vocab=VOCAB, dtype=dtype, seed=9)
    ce = kind == "cross_entropy"
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    x = jnp.asarray(case.logits, jnp.float32).astype(dtype)
    target = jnp.asarray(case.target) if ce else jnp.asarray(case.target, jnp.float32).astype(dtype)
    mask = jnp.asarray(case.loss_mask)

    def local(x: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        return FNS[kind](x, t, m, vocab_parallel="model", impl="pallas", **options)

    vocab_spec = P(None, None, "model")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(vocab_spec, P() if ce else vocab_spec, P()), out_specs=P())
    loss, grad = jax.jit(jax.value_and_grad(sharded))(x, target, mask)
    assert grad.dtype == x.dtype
    _check(case, loss, grad, f"shard_map vocab/{kind}/pallas", **options)


@pytest.mark.slow
def test_pallas_data_and_vocab_parallel_with_check_vma() -> None:
    """D = 2 x P = 2: the kernels' operands vary over both mesh axes."""
    kind = "reverse_kl"
    case = lossspec.make_case(kind, "float_weights", lead_shape=(4, 3), vocab=VOCAB, seed=13)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))

    def local(x: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        denominator = jax.lax.psum(jaxloss.count_denominator(None, m), "data")
        loss = jaxloss.reverse_kl(x, t, m, denominator=denominator, vocab_parallel="model", impl="pallas")
        return jax.lax.psum(loss, "data")

    vocab_spec = P("data", None, "model")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(vocab_spec, vocab_spec, P("data")), out_specs=P())
    loss, grad = jax.jit(jax.value_and_grad(sharded))(jnp.asarray(case.logits), jnp.asarray(case.target), jnp.asarray(case.loss_mask))
    _check(case, loss, grad, "shard_map data x vocab/reverse_kl/pallas")
