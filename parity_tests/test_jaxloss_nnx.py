"""Flax NNX modules of ``jaxloss.nnx``: the same numbers as the functions, options fixed at
construction, a runtime denominator, and a tiny NNX model trained a few steps with them."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxloss
import lossspec
from jaxloss.nnx import CrossEntropyLoss, ForwardKLLoss, ReverseKLLoss, SoftCrossEntropyLoss
from lossspec import KINDS, make_case

MODULES = {
    "cross_entropy": (CrossEntropyLoss, jaxloss.cross_entropy, {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 0.9}),
    "soft_cross_entropy": (SoftCrossEntropyLoss, jaxloss.soft_cross_entropy, {"temperature": 2.0}),
    "forward_kl": (ForwardKLLoss, jaxloss.forward_kl, {"temperature": 1.5, "teacher_logit_scale": 0.8}),
    "reverse_kl": (ReverseKLLoss, jaxloss.reverse_kl, {"logit_scale": 1.2}),
}


def _loss_and_grad(call: Any, x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(loss, d sum(loss) / d x)`` of ``call(x)`` (a unit upstream gradient per token)."""
    loss, vjp = jax.vjp(call, x)
    (grad,) = vjp(jnp.ones_like(loss))
    return np.asarray(loss), np.asarray(grad)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("kind", KINDS)
def test_module_equals_function(kind: str, impl: str) -> None:
    """The module's loss and logit gradient against the float64 oracle (and bit-identical to the
    function's: the module adds nothing to the numbers)."""
    module_cls, fn, options = MODULES[kind]
    case = make_case(kind, "float_weights", lead_shape=(2, 5), vocab=70)
    x = jnp.asarray(case.logits)
    target = jnp.asarray(case.target)
    mask = jnp.asarray(case.loss_mask)
    for normalization, denominator in (("valid_tokens", None), ("none", None), ("valid_tokens", 7.0), ("sum", None)):
        extra = {} if denominator is None else {"denominator": denominator}
        module = module_cls(normalization=normalization, impl=impl, **options)
        got_loss, got_grad = _loss_and_grad(lambda x: module(x, target, mask, **extra), x)
        ref = case.reference(normalization=normalization, **extra, **options)
        lossspec.assert_close_to_oracle(got_loss, got_grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0,
                                        what=f"{module_cls.__name__} {normalization} {extra}")
        want_loss, want_grad = _loss_and_grad(lambda x: fn(x, target, mask, normalization=normalization, impl=impl,
                                                           **extra, **options), x)
        assert got_loss.tobytes() == want_loss.tobytes() and got_grad.tobytes() == want_grad.tobytes()


def test_module_denominator_is_runtime_data() -> None:
    case = make_case("cross_entropy", "random", lead_shape=(6,), vocab=50)
    loss_fn = CrossEntropyLoss(impl="xla")
    traces = []

    @nnx.jit
    def call(module: CrossEntropyLoss, x: jax.Array, denominator: jax.Array) -> jax.Array:
        traces.append(1)
        return module(x, case.target, case.loss_mask, denominator=denominator)

    for denominator in (2.0, 3.0, 9.0):
        got = call(loss_fn, jnp.asarray(case.logits), jnp.float32(denominator))
        lossspec.compare_loss(np.asarray(got), case.reference(denominator=denominator).loss).check()
    assert len(traces) == 1


class TinyLM(nnx.Module):
    """Embedding -> linear head, enough to see a loss go down."""

    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.embed(tokens))


def _oracle_grads(model: TinyLM, kind: str, data: dict[str, Any], target: Any, options: dict[str, Any]) -> tuple[float, dict]:
    """The float64 loss and parameter gradients of ``model``: logits ``E[tokens] @ W + b`` in
    float64, the oracle's logit gradient chained to ``E``, ``W`` and ``b`` in float64."""
    emb = np.asarray(model.embed.embedding[...], np.float64)
    kernel = np.asarray(model.head.kernel[...], np.float64)
    bias = np.asarray(model.head.bias[...], np.float64)
    tokens = np.asarray(data["tokens"])
    hidden = emb[tokens]
    loss, grad = lossspec.oracle(kind, hidden @ kernel + bias, np.asarray(target), np.asarray(data["mask"]), **options)
    grad_emb = np.zeros_like(emb)
    np.add.at(grad_emb, tokens, grad @ kernel.T)
    grads = {"embedding": grad_emb, "kernel": np.einsum("bsh,bsv->hv", hidden, grad), "bias": grad.sum(axis=(0, 1))}
    return loss, grads


def _data(seed: int = 0, vocab: int = 37) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (4, 12))
    labels = (tokens * 7 + 3) % vocab  # a learnable map
    labels[0, :3] = -100  # ignored (prompt) positions
    mask = rng.random((4, 12)) > 0.25
    teacher = rng.normal(0.0, 3.0, (vocab, vocab)).astype(np.float32)[tokens]  # a fixed teacher per token
    return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels), "mask": jnp.asarray(mask), "teacher": jnp.asarray(teacher)}


@pytest.mark.parametrize("kind", KINDS)
def test_train_tiny_nnx_model(kind: str) -> None:
    """A few Adam steps with the loss module inside ``nnx.jit``: the loss falls, and the first
    loss and the NNX parameter gradients are the float64 oracle's."""
    module_cls, fn, options = MODULES[kind]
    data = _data()
    target = data["labels"] if kind == "cross_entropy" else data["teacher"]
    model = TinyLM(37, 16, nnx.Rngs(0))
    loss_module = module_cls(impl="xla", **options)
    optimizer = nnx.Optimizer(model, optax.adam(5e-2), wrt=nnx.Param)

    # The NNX loss and parameter gradients of the module (under nnx.jit) against the float64
    # oracle chained through the model (SPEC section 8's bound: 4e-6 max|ref| per tensor).
    ref_loss, ref_grads = _oracle_grads(model, kind, data, target, options)
    loss, got = nnx.jit(nnx.value_and_grad(lambda m: loss_module(m(data["tokens"]), target, data["mask"])))(model)
    lossspec.compare_loss(np.asarray(loss), ref_loss, f"{kind} loss").check()
    found = {"embedding": got["embed"]["embedding"][...], "kernel": got["head"]["kernel"][...], "bias": got["head"]["bias"][...]}
    for name, ref in ref_grads.items():
        lossspec.compare_grad(np.asarray(found[name]), ref, "float32", 0.0, f"{kind} grad[{name}]").check()

    @nnx.jit
    def step(model: TinyLM, optimizer: nnx.Optimizer, tokens: jax.Array, target: jax.Array, mask: jax.Array) -> jax.Array:
        def loss_of(model: TinyLM) -> jax.Array:
            return loss_module(model(tokens), target, mask)

        loss, grads = nnx.value_and_grad(loss_of)(model)
        optimizer.update(model, grads)
        return loss

    losses = np.array([float(step(model, optimizer, data["tokens"], target, data["mask"])) for _ in range(12)])
    lossspec.compare_loss(losses[0], ref_loss, f"{kind} first step's loss").check()  # before any update
    assert np.all(np.diff(losses) < 0), losses
    # Soft cross-entropy is the teacher's entropy plus KL: only the part above that floor falls.
    floor = float(fn(target, target, data["mask"], impl="xla", **options)) if kind == "soft_cross_entropy" else 0.0
    assert losses[-1] - floor < 0.7 * (losses[0] - floor), (losses, floor)
