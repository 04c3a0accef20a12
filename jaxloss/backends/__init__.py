"""The registry of ``impl=``: one :class:`Backend` per name in :data:`IMPLEMENTATIONS`, and :func:`resolve`.

:func:`resolve` is the one place where an ``impl`` argument (``"auto"`` included) becomes a
backend; the public functions call it once per call (``api.py`` for the losses and
:func:`jaxloss.resolve_impl`, ``head.py`` for the fused head). Everything after it carries the
resolved name and reads the backend's entry (its modules and traits), never compares ``impl``
strings. The backends (the twin of ``torchloss.backends``)::

    name      the losses' kernels   vocab-parallel shard steps        the fused head          "auto" picks it
    "xla"     backends/xla.py       backends/vocab_parallel.py's own  head.py's framework path  off-GPU (the head: everywhere)
    "pallas"  backends/pallas.py    backends/pallas.py                backends/pallas_head.py   on a GPU (the losses only)

A backend holds loaders of its modules (an import statement each); a module is imported when
first used and its functions are read at each call (so a test may replace one of them). The
losses' kernels take the call's :class:`lossspec.Tuning` (``tuning=``, read field by field, a
``None`` field being the module's default). What each module offers:

- ``loss``: ``fused(cfg, x [N, V], target, coef [N], *, with_grad, tuning, inplace) -> (loss [N] fp32,
  grad [N, V] in x's dtype or None)`` (``inplace``: the gradient may take ``x``'s buffer; Pallas
  aliases it, XLA leaves it to its buffer assignment); without
  ``higher_order``, ``HIGHER_ORDER_MESSAGE`` (the error of a second derivative);
- ``shard`` (``None``: the XLA steps of ``backends/vocab_parallel.py``):
  ``shard_stats(cfg, x, target, *, tuning) -> Stats`` and
  ``shard_grad(cfg, fin, x, target, coef, *, vocab, tuning) -> grad``;
- ``head`` (``None``: ``head.py``'s framework path): ``head_forward(cfg, hidden, weight,
  bias, labels, teacher, coef, *, with_grad, softcaps, tuning) -> (l, dh, dW, db)`` (``tuning``: the
  call's ``lossspec.HeadTuning``).
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
    #: the fused head's kernels; ``None``: ``head.py``'s framework path
    head: Optional[Callable[[], ModuleType]]
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

    def head_kernels(self) -> Optional[ModuleType]:
        """The fused head's kernels (``head_forward``), or ``None``."""
        return None if self.head is None else self.head()


def _xla() -> ModuleType:
    from . import xla as kernels

    return kernels


def _pallas() -> ModuleType:
    from . import pallas as kernels

    return kernels


def _pallas_head() -> ModuleType:
    from . import pallas_head as kernels

    return kernels


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"  # read at each call: tests set it


IMPLEMENTATIONS: dict[str, Backend] = {
    "pallas": Backend(
        name="pallas",
        loss=_pallas,
        shard=_pallas,
        head=_pallas_head,
        auto=_on_gpu,
        higher_order=False,
    ),
    "xla": Backend(
        name="xla",
        loss=_xla,
        shard=None,
        head=None,
        auto=lambda: True,
        higher_order=True,
    ),
}

#: The framework path: what ``"auto"`` is for the fused head on every device (its kernels are
#: opt-in), and the only path of the head with ``vocab_parallel`` and ``recompute_logits``.
PLAIN: str = next(name for name, backend in IMPLEMENTATIONS.items() if backend.head is None)


def resolve(impl: str, *, head: bool = False, vocab_parallel: bool = False) -> Backend:
    """The backend of one call's ``impl`` (checked against :data:`IMPLS`: a ``ValueError``).

    The losses: ``"auto"`` is the first backend of :data:`IMPLEMENTATIONS` whose ``auto()``
    holds (Pallas on a GPU backend, XLA elsewhere). The fused head (``head=True``): ``"auto"``
    is :data:`PLAIN` on every device, and a backend with head kernels refuses ``vocab_parallel``
    (:func:`lossspec.linear.head_impl`: its rules and errors, shared with torchloss)."""
    lossspec.check_impl(impl, IMPLS)
    if head:
        return IMPLEMENTATIONS[spec_linear.head_impl(impl, IMPLS, PLAIN, vocab_parallel)]
    if impl == AUTO:
        return next(backend for backend in IMPLEMENTATIONS.values() if backend.auto())
    return IMPLEMENTATIONS[impl]
