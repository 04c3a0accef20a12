"""The registry of ``impl=``: one :class:`Backend` per name in :data:`IMPLEMENTATIONS`, and :func:`resolve`.

:func:`resolve` is the one place where an ``impl`` argument (``"auto"`` included) becomes a
backend; the public functions call it once per call (``api.py`` for the losses, ``head.py`` for
the fused head). Everything after it reads the backend's entry (its modules and traits), or its
name where only a name can travel (the ``torch.compile`` custom op of ``_ops.py``, the head's
plan), never compares ``impl`` strings. The backends (the twin of ``jaxloss.backends``)::

    name      the losses' kernels   vocab-parallel shard steps        "auto" picks it
    "torch"   backends/torch.py     backends/vocab_parallel.py's own  off CUDA
    "triton"  backends/triton.py    backends/triton.py                on CUDA tensors

The fused head runs on the framework path of ``head.py`` (:data:`PLAIN`) whatever the backend: its
Triton kernels were retired (``lossspec.linear.HEAD_KERNELS_RETIRED``).

``backends/cpu_tiles.py`` (the torch path's CPU tiling and threads), ``backends/triton_kernels.py``
(the ``@triton.jit`` kernels of ``triton.py``) and ``backends/triton_matmul.py`` (the head's bf16
matmul on CUDA) serve these and are no backend of their own.

A backend holds loaders of its modules (an import statement each: ``torch.compile`` traces it);
a module is imported when first used (``triton`` is optional) and its functions are read at each
call (so a test may replace one of them, or a knob). What each module offers:

- ``loss``: ``forward(config, logits [N, V], target, coef [N], *, need_grad, out) ->
  (loss [N], grad [N, V] or None)`` and ``regrad_(config, logits, target, coef, upstream, grad)``
  (the 16-bit backward); ``KEEPS_FINAL``: whether ``forward(..., final=final_buffer(logits))``
  keeps the rows' final statistics, which ``regrad_(..., final=)`` then reads instead of
  running pass 1 again (Triton; the torch path reruns ``forward``);
- ``shard`` (``None``: the torch steps of ``backends/vocab_parallel.py``):
  ``shard_stats(config, x, target, coef, offset)`` and ``shard_grad(...)`` (``VocabParallel``).

This module imports neither torch nor triton: importing a submodule sets it as an attribute of
this package, and ``backends.torch`` / ``backends.triton`` would replace module globals named so.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Callable, Optional

import lossspec
from lossspec import linear as spec_linear

__all__ = ["Backend", "IMPLEMENTATIONS", "IMPLS", "PLAIN", "resolve"]

#: The values ``impl=`` takes (lossspec's contract): ``"auto"`` and the names of :data:`IMPLEMENTATIONS`.
IMPLS: tuple[str, ...] = lossspec.TORCH_IMPLS
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One value of ``impl=``: the loaders of its kernels' modules (see the module docstring for
    what each module offers) and what it supports."""

    name: str
    #: the losses' kernels
    loss: Callable[[], ModuleType]
    #: the vocab-parallel shard steps; ``None``: ``backends/vocab_parallel.py``'s own (torch) steps
    shard: Optional[Callable[[], ModuleType]]
    #: whether ``impl="auto"`` picks this backend for the losses of these logits (the first that
    #: does, in :data:`IMPLEMENTATIONS`' order)
    auto: Callable[[Any], bool]
    #: the package its modules need (``ImportError`` naming it when missing), or ``None``
    requires: Optional[str]

    def _load(self, loader: Callable[[], ModuleType]) -> ModuleType:
        try:
            return loader()
        except ImportError as err:  # pragma: no cover - depends on the installation
            if self.requires is None:
                raise
            raise ImportError(
                f"impl={self.name!r} needs the {self.requires} package (pip install {self.requires}); impl={PLAIN!r} works without it"
            ) from err

    def kernels(self) -> ModuleType:
        """The losses' kernels (``forward``, ``regrad_``)."""
        return self._load(self.loss)

    def shard_kernels(self) -> Optional[ModuleType]:
        """The vocab-parallel shard steps (``shard_stats``, ``shard_grad``), or ``None``."""
        return None if self.shard is None else self._load(self.shard)


def _torch_path() -> ModuleType:
    from . import torch as kernels

    return kernels


def _triton() -> ModuleType:
    from . import triton as kernels

    return kernels


def _on_cuda(logits: Any) -> bool:
    # Not a tensor: refused by the checks that follow; until then it counts as off CUDA.
    return bool(getattr(logits, "is_cuda", False))


IMPLEMENTATIONS: dict[str, Backend] = {
    "triton": Backend(
        name="triton",
        loss=_triton,
        shard=_triton,
        auto=_on_cuda,
        requires="triton",
    ),
    "torch": Backend(
        name="torch",
        loss=_torch_path,
        shard=None,
        auto=lambda logits: True,
        requires=None,
    ),
}

#: The framework path: the losses' twin of the XLA path, and the fused head's only path (what
#: ``"auto"`` and ``"torch"`` give it; ``"triton"`` raises ``lossspec.linear.HEAD_KERNELS_RETIRED``).
PLAIN: str = "torch"


def resolve(impl: str, reference: Any, *, head: bool = False) -> Backend:
    """The backend of one call's ``impl`` (checked against :data:`IMPLS`: a ``ValueError``).

    The losses: ``"auto"`` is the first backend of :data:`IMPLEMENTATIONS` whose ``auto`` holds
    for ``reference`` (the logits: Triton on CUDA tensors, the torch path elsewhere). The fused
    head (``head=True``): :data:`PLAIN` for ``"auto"`` and ``"torch"``, an error for ``"triton"``
    (:func:`lossspec.linear.head_impl`: its rules and errors, shared with jaxloss). Nothing is
    imported here (:meth:`Backend.kernels` does)."""
    lossspec.check_impl(impl, IMPLS)
    if head:
        return IMPLEMENTATIONS[spec_linear.head_impl(impl, IMPLS, PLAIN)]
    if impl == AUTO:
        return next(backend for backend in IMPLEMENTATIONS.values() if backend.auto(reference))
    return IMPLEMENTATIONS[impl]
