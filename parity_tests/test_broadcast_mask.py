"""A ``loss_mask`` that broadcasts to the leading shape (SPEC section 5: ``[T]``, ``[1, T]``,
``[B, 1]``, ``[B, T, 1]`` for logits ``[B, T, V]``) is the explicitly expanded mask: every kind,
``count_denominator`` and the fused heads, in JAX and torch, against the float64 oracle on the
expanded mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss
import lossspec
import torchloss
from lossspec import linear as spec_linear

B, T, V, H = 3, 5, 11, 4
SHAPES = [(T,), (1, T), (B, 1), (B, T, 1)]
HEAD_KINDS = ("cross_entropy", "forward_kl")


def _problem(kind: str, shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """Logits, target, a float mask of ``shape`` (some zeros) and that mask expanded to ``[B, T]``."""
    rng = np.random.default_rng(seed)
    logits = (2 * rng.normal(size=(B, T, V))).astype(np.float32)
    target = {"labels": rng.integers(0, V, (B, T)), "teacher_logits": (2 * rng.normal(size=(B, T, V))).astype(np.float32),
              None: None}[lossspec.KIND_SPECS[kind].target]
    mask = np.where(rng.random(shape) < 0.7, rng.uniform(0.5, 2.0, shape), 0.0).astype(np.float32)
    mask.flat[0] = 1.5
    squeezed = mask.reshape(shape[:-1]) if len(shape) == 3 else mask
    return logits, target, mask, np.broadcast_to(squeezed, (B, T)).copy()


def _jax(kind: str, logits: np.ndarray, target: np.ndarray | None, mask: np.ndarray, **options) -> tuple[np.ndarray, np.ndarray]:
    targets = () if target is None else (jnp.asarray(target),)
    loss, vjp = jax.vjp(lambda x: getattr(jaxloss, kind)(x, *targets, jnp.asarray(mask), impl="xla", **options), jnp.asarray(logits))
    (grad,) = vjp(jnp.ones_like(loss))
    return np.asarray(loss, np.float64), np.asarray(grad, np.float64)


def _torch(kind: str, logits: np.ndarray, target: np.ndarray | None, mask: np.ndarray, **options) -> tuple[np.ndarray, np.ndarray]:
    x = torch.from_numpy(logits).requires_grad_(True)
    targets = () if target is None else (torch.from_numpy(target),)
    loss = getattr(torchloss, kind)(x, *targets, torch.from_numpy(mask), impl="torch", **options)
    loss.backward(torch.ones_like(loss))
    return loss.detach().double().numpy(), x.grad.double().numpy()


# Every kind with the two common shapes; every shape and the other modes on cross-entropy (the
# mask is handled before the kind matters; each case costs a JAX compile).
CASES = [(kind, shape, "valid_tokens") for kind in lossspec.ALL_KINDS for shape in ((T,), (B, T, 1))] + \
        [("cross_entropy", shape, normalization) for shape in SHAPES for normalization in ("none", "sequence_mean")]


@pytest.mark.parametrize("kind, shape, normalization", CASES, ids=[f"{k}-{'x'.join(map(str, s))}-{n}" for k, s, n in CASES])
def test_broadcast_mask_is_the_expanded_mask(kind: str, shape: tuple[int, ...], normalization: str) -> None:
    logits, target, mask, expanded = _problem(kind, shape)
    options = {"normalization": normalization, "causal_shift": True}
    ref_loss, ref_grad = lossspec.oracle(kind, logits, target, expanded, **options)
    g0 = lossspec.Case(kind, "broadcast", "float32", logits, target, expanded).g0(**options)
    for name, run in (("jax", _jax), ("torch", _torch)):
        loss, grad = run(kind, logits, target, mask, **options)
        lossspec.assert_close_to_oracle(loss, grad, ref_loss, ref_grad, dtype="float32", g0=g0, what=f"{name} {kind}")


@pytest.mark.parametrize("normalization", ["valid_tokens", "sequence_sum"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_count_denominator_of_a_broadcast_mask(shape: tuple[int, ...], normalization: str) -> None:
    _, labels, mask, expanded = _problem("cross_entropy", shape)
    labels[0, 2] = -100
    expected = lossspec.count_denominator(labels, expanded, normalization=normalization, causal_shift=True)
    jax_count = jaxloss.count_denominator(jnp.asarray(labels), jnp.asarray(mask), normalization=normalization, causal_shift=True)
    torch_count = torchloss.count_denominator(torch.from_numpy(labels), torch.from_numpy(mask), normalization=normalization,
                                              causal_shift=True)
    assert float(jax_count) == float(torch_count) == float(np.float32(expected))
    numpy_count = jaxloss.count_denominator(labels, mask, normalization=normalization, causal_shift=True)  # host checks path
    assert float(numpy_count) == float(np.float32(expected))


@pytest.mark.parametrize("kind, shape", [("cross_entropy", (B, T, 1)), ("forward_kl", (T,))])
def test_fused_head_takes_a_broadcast_mask(kind: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    hidden, weight = rng.normal(size=(B, T, H)).astype(np.float32), rng.normal(size=(V, H)).astype(np.float32)
    _, labels, mask, expanded = _problem("cross_entropy", shape)
    if kind == "cross_entropy":
        target_np: tuple = (labels,)
        oracle_target = labels
    else:
        teacher_hidden, teacher_weight = rng.normal(size=(B, T, H)).astype(np.float32), rng.normal(size=(V, H)).astype(np.float32)
        target_np = (teacher_hidden, teacher_weight)
        oracle_target = (teacher_hidden, teacher_weight, None)
    ref_loss, ref_grads = spec_linear.oracle_head(kind, hidden, weight, oracle_target, expanded)
    linear = spec_linear.LINEAR_NAMES[kind]

    jax_fn = getattr(jaxloss, linear)
    jax_targets = tuple(jnp.asarray(a) for a in target_np)
    loss, (grad_h, grad_w) = jax.value_and_grad(lambda h, w: jax_fn(h, w, *jax_targets, jnp.asarray(mask)), argnums=(0, 1))(
        jnp.asarray(hidden), jnp.asarray(weight))
    lossspec.compare_loss(loss, ref_loss, "jax loss").check()
    spec_linear.compare_head_grad(grad_h, ref_grads["hidden"], "float32", "jax grad hidden").check()
    spec_linear.compare_head_grad(grad_w, ref_grads["weight"], "float32", "jax grad weight").check()

    h, w = torch.from_numpy(hidden).requires_grad_(True), torch.from_numpy(weight).requires_grad_(True)
    loss = getattr(torchloss, linear)(h, w, *(torch.from_numpy(a) for a in target_np), torch.from_numpy(mask))
    loss.backward()
    lossspec.compare_loss(loss.detach().double().numpy(), ref_loss, "torch loss").check()
    spec_linear.compare_head_grad(h.grad.numpy(), ref_grads["hidden"], "float32", "torch grad hidden").check()
    spec_linear.compare_head_grad(w.grad.numpy(), ref_grads["weight"], "float32", "torch grad weight").check()
