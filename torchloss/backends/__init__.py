"""The registry of ``impl=``: one :class:`Backend` per name in :data:`IMPLEMENTATIONS`, and :func:`resolve`.

:func:`resolve` is the one place where an ``impl`` argument (``"auto"`` included) becomes a
backend; the public functions call it once per call (``api.py`` for the losses, ``head.py`` for
the fused head). Everything after it reads the backend's entry (its modules and traits), or its
name where only a name can travel (the ``torch.compile`` custom op of ``_ops.py``, the head's
plan), never compares ``impl`` strings. The backends (the twin of ``jaxloss.backends``)::

    name      the losses' kernels   vocab-parallel shard steps        the fused head          "auto" picks it
    "torch"   backends/torch.py     backends/vocab_parallel.py's own  head.py's framework path  off CUDA (the head: everywhere)
    "triton"  backends/triton.py    backends/triton.py                backends/triton_head.py   on CUDA tensors (the losses only)

``backends/cpu_tiles.py`` (the torch path's CPU tiling and threads), ``backends/triton_kernels.py``
(the ``@triton.jit`` kernels of ``triton.py``) and ``backends/triton_matmul.py`` (the head's bf16
matmul on CUDA) serve these and are no backend of their own.

A backend holds loaders of its modules (an import statement each: ``torch.compile`` traces it);
a module is imported when first used (``triton`` is optional) and its functions are read at each
call (so a test may replace one of them, or a knob). What each module offers:

- ``loss``: ``forward(config, logits [N, V], target, coef [N], *, need_grad, out) ->
  (loss [N], grad [N, V] or None)`` and ``regrad_(config, logits, target, coef, upstream, grad)``
  (the 16-bit backward);
- ``shard`` (``None``: the torch steps of ``backends/vocab_parallel.py``):
  ``shard_stats(config, x, target, coef, offset)`` and ``shard_grad(...)`` (``VocabParallel``);
- ``head`` (``None``: ``head.py``'s framework path): ``head_forward(...)`` with
  ``head.head_forward``'s arguments, no vocabulary shards.

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
    #: the fused head's kernels; ``None``: ``head.py``'s framework path
    head: Optional[Callable[[], ModuleType]]
    #: whether ``impl="auto"`` picks this backend for the losses of these logits (the first that
    #: does, in :data:`IMPLEMENTATIONS`' order)
    auto: Callable[[Any], bool]
    #: the package its modules need (``ImportError`` naming it when missing), or ``None``
    requires: Optional[str]
    #: whether its head kernels take float64 inputs (else those take the framework path whatever
    #: ``impl`` says: the kernels compute in fp32)
    head_float64: bool

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

    def head_kernels(self) -> Optional[ModuleType]:
        """The fused head's kernels (``head_forward``), or ``None``."""
        return None if self.head is None else self._load(self.head)


def _torch_path() -> ModuleType:
    from . import torch as kernels

    return kernels


def _triton() -> ModuleType:
    from . import triton as kernels

    return kernels


def _triton_head() -> ModuleType:
    from . import triton_head as kernels

    return kernels


def _on_cuda(logits: Any) -> bool:
    # Not a tensor: refused by the checks that follow; until then it counts as off CUDA.
    return bool(getattr(logits, "is_cuda", False))


IMPLEMENTATIONS: dict[str, Backend] = {
    "triton": Backend(
        name="triton",
        loss=_triton,
        shard=_triton,
        head=_triton_head,
        auto=_on_cuda,
        requires="triton",
        head_float64=False,
    ),
    "torch": Backend(
        name="torch",
        loss=_torch_path,
        shard=None,
        head=None,
        auto=lambda logits: True,
        requires=None,
        head_float64=True,
    ),
}

#: The framework path: what ``"auto"`` is for the fused head on every device (its kernels are
#: opt-in), and the only path of the head with ``vocab_parallel`` and ``recompute_logits``.
PLAIN: str = next(name for name, backend in IMPLEMENTATIONS.items() if backend.head is None)


def resolve(impl: str, reference: Any, *, head: bool = False, vocab_parallel: bool = False) -> Backend:
    """The backend of one call's ``impl`` (checked against :data:`IMPLS`: a ``ValueError``).

    The losses: ``"auto"`` is the first backend of :data:`IMPLEMENTATIONS` whose ``auto`` holds
    for ``reference`` (the logits: Triton on CUDA tensors, the torch path elsewhere). The fused
    head (``head=True``, ``reference`` the hidden states): ``"auto"`` is :data:`PLAIN` on every
    device, a backend with head kernels refuses ``vocab_parallel``
    (:func:`lossspec.linear.head_impl`: its rules and errors, shared with jaxloss), and float64
    inputs take :data:`PLAIN` unless the backend's head kernels take them. Nothing is imported
    here (:meth:`Backend.kernels` does)."""
    lossspec.check_impl(impl, IMPLS)
    if head:
        backend = IMPLEMENTATIONS[spec_linear.head_impl(impl, IMPLS, PLAIN, vocab_parallel)]
        dtype = reference.dtype  # float64: the only 8-byte floating dtype (no torch import here, see above)
        if dtype.is_floating_point and dtype.itemsize == 8 and not backend.head_float64:
            return IMPLEMENTATIONS[PLAIN]
        return backend
    if impl == AUTO:
        return next(backend for backend in IMPLEMENTATIONS.values() if backend.auto(reference))
    return IMPLEMENTATIONS[impl]
