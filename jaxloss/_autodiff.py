"""The losses' ``jax.custom_vjp``: the kernel (XLA or Pallas, ``jaxloss.backends.xla`` / ``jaxloss.backends.pallas``)
computes the per-token loss and, in the same pass, the gradient ``coef * c * dl/dz`` in the
logits' dtype, the only logits-sized residual; the backward scales it by the upstream gradient
(16-bit logits: recomputed with ``coef * g`` and rounded once, by the gradient pass alone from the
forward's final statistics where the kernels keep them (``KEEPS_FINAL``: Pallas), except with
``inplace=True``, where the logits are not kept and the scaling may round once more, as in
torchloss). Vocab-parallel: the same contract
over ``jaxloss.backends.vocab_parallel``. The twin of ``torchloss._autodiff``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp


from lossspec import Tuning

from .backends import IMPLEMENTATIONS, vocab_parallel as _vocab_parallel, xla as _xla
from .backends.xla import KernelConfig

Array = jax.Array
F32 = jnp.float32

VOCAB_PARALLEL_HIGHER_ORDER_MESSAGE = (
    "jaxloss: higher-order derivatives (grad of grad, jax.hessian, jax.jvp of a gradient) are not supported "
    "with vocab_parallel: the shards' statistics are combined with explicit pmax/psum collectives, which are "
    "never differentiated. Compute them on the whole vocabulary (vocab_parallel=None) with impl='xla' and "
    "float32 logits."
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the loss's ``custom_vjp`` takes as static (hashable): the kernel's config, the
    resolved impl (a name of :data:`jaxloss.backends.IMPLEMENTATIONS`), the call's tuning (each kernel
    reads its fields) and ``inplace`` (the gradient may take the logits' buffer: the logits are not
    kept for the backward)."""

    config: KernelConfig
    impl: str
    tuning: Tuning
    inplace: bool = False


@dataclasses.dataclass(frozen=True)
class VpSpec(Spec):
    """:class:`Spec` of a vocab-parallel call, with the mesh axis names and the global ``V``."""

    axes: tuple = ()
    vocab: int = 0


def _kernel(spec: Spec, x: Array, target: Array, coef: Array, with_grad: bool, inplace: bool = False) -> tuple[Array, Optional[Array]]:
    kernels = IMPLEMENTATIONS[spec.impl].kernels()
    return kernels.fused(spec.config, x, target, coef, with_grad=with_grad, tuning=spec.tuning, inplace=inplace)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_loss(spec: Spec, x: Array, target: Array, coef: Array) -> Array:
    """Per-token ``coef_i * l_i`` ``[N]`` (0 where ``coef == 0``) of logits ``x`` ``[N, V]``."""
    loss, _ = _kernel(spec, x, target, coef, with_grad=False)
    return jnp.where(coef != 0, coef * loss, 0.0)


def _weighted_loss_fwd(spec: Spec, x: Array, target: Array, coef: Array) -> tuple[Array, tuple[Any, ...]]:
    kernels = IMPLEMENTATIONS[spec.impl].kernels()
    fin = None
    if not spec.inplace and jnp.dtype(x.dtype).itemsize < 4 and kernels.KEEPS_FINAL:
        # 16-bit logits on kernels that keep the rows' final statistics (Pallas): the backward's
        # recompute then runs the gradient pass alone (kernels.shard_grad), not both passes.
        loss, grad, fin = kernels.fused(spec.config, x, target, coef, with_grad=True, tuning=spec.tuning, keep_final=True)
    else:
        # inplace: only the gradient that is handed on may take the logits' buffer (the primal call
        # above, a loss without its gradient, keeps the logits whole)
        loss, grad = _kernel(spec, x, target, coef, with_grad=True, inplace=spec.inplace)
    # Residuals: the gradient (one logits-sized buffer, logits' dtype), [N] vectors, and a
    # reference to the logits (no copy) for the 16-bit recompute below; with inplace none (the
    # logits would stay alive, and XLA would copy them before the kernel writes their buffer).
    return jnp.where(coef != 0, coef * loss, 0.0), (grad, coef, target, None if spec.inplace else x, fin)


def _weighted_loss_bwd(spec: Spec, res: tuple[Any, ...], g: Array) -> tuple[Any, Any, Any]:
    grad, coef, target, x, fin = res
    if x is None:
        return backward(grad, coef, g, None)
    if fin is None:
        return backward(grad, coef, g, lambda scaled: _kernel(spec, x, target, scaled, with_grad=True)[1])
    kernels = IMPLEMENTATIONS[spec.impl].kernels()
    return backward(grad, coef, g, lambda scaled: kernels.shard_grad(spec.config, fin, x, target, scaled, vocab=x.shape[1], tuning=spec.tuning))


def backward(grad: Array, coef: Array, g: Array, recompute: Any) -> tuple[Array, None, None]:
    """Cotangents of ``(x, target, coef)`` from the forward's gradient buffer ``grad`` and the
    upstream ``g`` ``[N]``; ``recompute(coef')`` recomputes the gradient with coefficient ``coef'``
    (``None``: the logits were not kept, ``inplace=True``: the buffer is scaled instead).

    The target (labels, or the teacher: stop-gradient) and ``coef`` (from the mask and the
    denominator, which are data: stop-gradient) get no cotangent (``None``: zero)."""
    if jnp.dtype(grad.dtype).itemsize >= 4 or recompute is None:
        # fp32/fp64: one more rounding stays far inside the 4e-6 bound (exact when g == 1); 16-bit
        # logits with inplace=True: one more rounding where g != 1 (documented, as in torchloss).
        dx = (grad.astype(F32) * g[:, None]).astype(grad.dtype)
    else:
        # 16-bit logits: scaling an already rounded gradient would round twice (up to ~1.5
        # ulp). Where the upstream gradient is not exactly 1, recompute with coef * g in fp32
        # and round once; the common g == 1 case reuses the forward's buffer.
        unit = jnp.all(jnp.where(coef != 0, g == 1, True))
        dx = jax.lax.cond(unit, lambda: grad, lambda: recompute(jnp.where(coef != 0, coef * g, 0.0)))
    return dx, None, None


_weighted_loss.defvjp(_weighted_loss_fwd, _weighted_loss_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def loss_tokens(spec: Spec, logits: Array, target: Array, coef: Array) -> Array:
    vocab = logits.shape[-1]
    return _weighted_loss(spec, logits.reshape(-1, vocab), target, coef)


# Vocab-parallel: the same contract, the statistics combined over the mesh axis in the forward.
def _vp_losses(spec: VpSpec, x: Array, target: Array, coef: Array, with_grad: bool) -> tuple[Array, Optional[Array], Any]:
    cfg, impl, tuning, axes, vocab = spec.config, spec.impl, spec.tuning, spec.axes, spec.vocab

    def losses(x: Array, target: Array, coef: Array) -> tuple[Array, Optional[Array], Any]:
        return _vocab_parallel.losses(cfg, x, target, coef, axes=axes, vocab=vocab, impl=impl, tuning=tuning, with_grad=with_grad)

    # Higher-order derivatives would differentiate pmax (no rule in JAX) and psum: refuse clearly.
    return _xla.no_derivatives(losses, VOCAB_PARALLEL_HIGHER_ORDER_MESSAGE)(x, target, coef)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_loss_vp(spec: VpSpec, x: Array, target: Array, coef: Array) -> Array:
    """:func:`_weighted_loss` of this replica's vocabulary slice ``x`` ``[N, V_local]``
    (``target``: labels shifted to the slice's column ids, or the teacher's slice)."""
    loss, _, _ = _vp_losses(spec, x, target, coef, with_grad=False)
    return jnp.where(coef != 0, coef * loss, 0.0)


def _weighted_loss_vp_fwd(spec: VpSpec, x: Array, target: Array, coef: Array) -> tuple[Array, tuple[Any, ...]]:
    loss, grad, fin = _vp_losses(spec, x, target, coef, with_grad=True)
    # The global statistics ([N] vectors) are kept: a 16-bit recompute needs no collective. With
    # inplace the logits are not kept (the shard's gradient comes from its own step: no alias).
    return jnp.where(coef != 0, coef * loss, 0.0), (grad, coef, target, None if spec.inplace else x, fin)


def _weighted_loss_vp_bwd(spec: VpSpec, res: tuple[Any, ...], g: Array) -> tuple[Any, Any, Any]:
    grad, coef, target, x, fin = res
    cfg, impl, tuning, vocab = spec.config, spec.impl, spec.tuning, spec.vocab
    if x is None:
        return backward(grad, coef, g, None)

    def recompute(scaled: Array) -> Array:
        return _vocab_parallel.shard_grad(cfg, fin, x, target, scaled, vocab=vocab, impl=impl, tuning=tuning)

    return backward(grad, coef, g, recompute)


_weighted_loss_vp.defvjp(_weighted_loss_vp_fwd, _weighted_loss_vp_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def loss_tokens_vocab_parallel(spec: VpSpec, logits: Array, target: Array, coef: Array) -> Array:
    vocab_local = logits.shape[-1]
    if spec.config.is_ce:
        target = _vocab_parallel.shift_labels(target, vocab_local, spec.axes)
    return _weighted_loss_vp(spec, logits.reshape(-1, vocab_local), target, coef)
