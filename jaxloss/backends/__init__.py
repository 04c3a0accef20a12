"""The registry of ``impl=``: one :class:`Backend` per name in :data:`IMPLEMENTATIONS`, and :func:`resolve`.

:func:`resolve` is the one place where an ``impl`` argument (``"auto"`` included) becomes a
backend; the public functions call it once per call (``api.py`` for the losses and
:func:`jaxloss.resolve_impl`, ``head.py`` for the fused head). Everything after it carries the
resolved name and reads the backend's entry (its modules and traits), never compares ``impl``
strings. The backends (the twin of ``torchloss.backends``)::

    name      the losses' kernels   vocab-parallel shard steps        "auto" picks it
    "xla"     backends/xla.py       backends/vocab_parallel.py's own  off-GPU
    "pallas"  backends/pallas.py    backends/pallas.py                on a GPU

The fused head runs on the framework path of ``head.py`` (:data:`PLAIN`) whatever the backend: its
Pallas kernels were retired (``lossspec.linear.HEAD_KERNELS_RETIRED``).

A backend holds loaders of its modules (an import statement each); a module is imported when
first used and its functions are read at each call (so a test may replace one of them). The
losses' kernels take the call's :class:`lossspec.Tuning` (``tuning=``, read field by field, a
``None`` field being the module's default). What each module offers:

- ``loss``: ``fused(cfg, x [N, V], target, coef [N], *, with_grad, tuning, inplace) -> (loss [N] fp32,
  grad [N, V] in x's dtype or None)`` (``inplace``: the gradient may take ``x``'s buffer; Pallas
  aliases it, XLA leaves it to its buffer assignment); without
  ``higher_order``, ``HIGHER_ORDER_MESSAGE`` (the error of a second derivative); ``KEEPS_FINAL``:
  whether ``fused(..., keep_final=True)`` also returns the rows' ``Final`` statistics, from which
  ``shard_grad`` forms the 16-bit backward's gradient without pass 1 (Pallas; XLA reruns ``fused``);
- ``shard`` (``None``: the XLA steps of ``backends/vocab_parallel.py``):
  ``shard_stats(cfg, x, target, *, tuning) -> Stats`` and
  ``shard_grad(cfg, fin, x, target, coef, *, vocab, tuning) -> grad``.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable, Optional

import jax

import lossspec
from lossspec import linear as spec_linear

__all__ = ["Backend", "IMPLEMENTATIONS", "IMPLS", "PLAIN", "resolve"]

#: The values ``impl=`` takes (lossspec's contract): ``"auto"`` and the names of :data:`IMPLEMENTATIONS`.
IMPLS: tuple[str, ...] = lossspec.JAX_IMPLS
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One value of ``impl=``: the loaders of its kernels' modules (see the module docstring for
    what each module offers) and what it supports."""

    name: str
    #: the losses' kernels
    loss: Callable[[], ModuleType]
    #: the vocab-parallel shard steps; ``None``: ``backends/vocab_parallel.py``'s own (XLA) steps
    shard: Optional[Callable[[], ModuleType]]
    #: whether ``impl="auto"`` picks this backend for the losses here (the first that does, in
    #: :data:`IMPLEMENTATIONS`' order)
    auto: Callable[[], bool]
    #: second derivatives (grad of grad, ``jax.hessian``) with float32 / float64 inputs; without,
    #: they raise the loss module's ``HIGHER_ORDER_MESSAGE``
    higher_order: bool

    def kernels(self) -> ModuleType:
        """The losses' kernels (``fused``)."""
        return self.loss()

    def shard_kernels(self) -> Optional[ModuleType]:
        """The vocab-parallel shard steps (``shard_stats``, ``shard_grad``), or ``None``."""
        return None if self.shard is None else self.shard()


def _xla() -> ModuleType:
    from . import xla as kernels

    return kernels


def _pallas() -> ModuleType:
    from . import pallas as kernels

    return kernels


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"  # read at each call: tests set it


IMPLEMENTATIONS: dict[str, Backend] = {
    "pallas": Backend(
        name="pallas",
        loss=_pallas,
        shard=_pallas,
        auto=_on_gpu,
        higher_order=False,
    ),
    "xla": Backend(
        name="xla",
        loss=_xla,
        shard=None,
        auto=lambda: True,
        higher_order=True,
    ),
}

#: The framework path: the losses' twin of the torch path, and the fused head's only path (what
#: ``"auto"`` and ``"xla"`` give it; ``"pallas"`` raises ``lossspec.linear.HEAD_KERNELS_RETIRED``).
PLAIN: str = "xla"


def resolve(impl: str, *, head: bool = False) -> Backend:
    """The backend of one call's ``impl`` (checked against :data:`IMPLS`: a ``ValueError``).

    The losses: ``"auto"`` is the first backend of :data:`IMPLEMENTATIONS` whose ``auto()``
    holds (Pallas on a GPU backend, XLA elsewhere). The fused head (``head=True``): :data:`PLAIN`
    for ``"auto"`` and ``"xla"``, an error for ``"pallas"`` (:func:`lossspec.linear.head_impl`: its
    rules and errors, shared with torchloss)."""
    lossspec.check_impl(impl, IMPLS)
    if head:
        return IMPLEMENTATIONS[spec_linear.head_impl(impl, IMPLS, PLAIN)]
    if impl == AUTO:
        return next(backend for backend in IMPLEMENTATIONS.values() if backend.auto())
    return IMPLEMENTATIONS[impl]
