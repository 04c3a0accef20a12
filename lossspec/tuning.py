"""How a loss call splits its work: :class:`Tuning`, the ``tuning=`` argument of the losses.

One frozen dataclass for both frameworks and all four backends. Its fields name block and tile
sizes; ``None`` means "this backend's default". Each backend reads only the fields it uses (its
docstring says which) and ignores the others, so the same :class:`Tuning` can be passed to
``jaxloss`` and ``torchloss`` alike. Tuning changes how a row is split into blocks and how rows
are grouped into tiles, which may move results by a rounding within the bounds of docs/spec.md
section 6; it never changes what is computed. Frozen and hashable: JAX takes it as a static
argument (a new tuning compiles anew), ``torch.compile`` as constants of the graph. The fused
head (``linear_<kind>``) has its own, :class:`lossspec.HeadTuning` (:mod:`lossspec.linear`).

=======================  ==========================================================================
field                    read by (default when ``None``)
=======================  ==========================================================================
``vocab_block``          the most vocabulary columns one block holds; wider rows are processed block
                         by block with online statistics. XLA (2**16, for rows wider than
                         ``single_block_vocab``), Pallas (128 interpreted, 4096 on a GPU), the torch
                         path (2**21), Triton (1024 interpreted, 4096 on a GPU). Pallas and Triton
                         need a power of two.
``single_block_vocab``   XLA: the widest row taken as one block (2**18); only wider rows are split
                         into blocks of ``vocab_block``.
``chunk_elements``       XLA: elements of one row chunk ``[R, B]``, ``R = chunk_elements // B``
                         (2**20; plain cross-entropy on fp32 logits: every row at once, whose only
                         ``[N, V]`` buffer is the gradient); also the tiles of JAX's vocab-parallel
                         mixture pass.
``cpu_tile_elements``    the torch path on the CPU: elements of one row tile (2**20; the kinds with
                         four scratch buffers take half of it); also the tiles of torch's
                         vocab-parallel path and of the per-row scaling of the backward.
``block_rows``           Pallas: rows of one program (8 interpreted, 1 on a GPU; a power of two).
``num_warps``            Pallas (4; 8 with a teacher, 16 with a soft cap), Triton (``torchloss.backends.triton.num_warps``: 4 to 16 by block width).
``num_stages``           Pallas (Triton's default); Triton: the software-pipelining depth of the
                         vocabulary loops (1: none; 2 or more issue the next blocks' loads while a
                         block is computed).
``programs``             Triton: programs of the fused and regrad kernels, each taking every
                         ``programs``-th row in turn (one program per row); Pallas: programs of
                         every kernel, each taking every ``programs``-th block of ``block_rows``
                         rows (one program per block). Fewer rows in flight: more of each row's
                         second read can come from L2.
``interpret``            Pallas: ``True`` / ``False`` forces interpret mode / the Triton lowering
                         (``None``: per lowering platform, the kernel on CUDA / ROCm, else
                         interpreted).
``debug``                Pallas: print the kernel's jaxpr and Triton module when lowering.
=======================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional

#: the fields holding a size (``None`` or a positive ``int``)
SIZE_FIELDS = ("vocab_block", "single_block_vocab", "chunk_elements", "cpu_tile_elements", "block_rows", "num_warps", "num_stages", "programs")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Block and tile sizes of one loss call (module docstring: which backend reads which field,
    and the defaults that ``None`` stands for). Validated on construction: a size is ``None`` or an
    ``int >= 1`` (``TypeError`` / ``ValueError`` naming the field)."""

    vocab_block: Optional[int] = None
    single_block_vocab: Optional[int] = None
    chunk_elements: Optional[int] = None
    cpu_tile_elements: Optional[int] = None
    block_rows: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    programs: Optional[int] = None
    interpret: Optional[bool] = None
    debug: bool = False

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:  # frozen: set through object.__setattr__
            object.__setattr__(self, name, check_size_field("Tuning", name, getattr(self, name)))
        if self.interpret is not None and not isinstance(self.interpret, bool):
            raise TypeError(f"Tuning.interpret must be None, True or False; got {self.interpret!r}")
        if not isinstance(self.debug, bool):
            raise TypeError(f"Tuning.debug must be True or False; got {self.debug!r}")


def check_size_field(owner: str, name: str, value: Any, optional: bool = True) -> Optional[int]:
    """A size field of a tuning dataclass (:class:`Tuning`, ``lossspec.HeadTuning``): ``None``
    (where ``optional``) or an integer ``>= 1``, returned as a Python ``int`` (a NumPy integer
    too); ``TypeError`` / ``ValueError`` naming ``owner.name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be {'None or ' if optional else ''}an int; got {value!r}")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be >= 1; got {value}")
    return int(value)


#: every field at its backend's default
DEFAULT_TUNING = Tuning()


def check_tuning(tuning: Any) -> Tuning:
    """The ``tuning=`` argument of a loss: ``None`` (every backend's defaults) or a :class:`Tuning`."""
    if tuning is None:
        return DEFAULT_TUNING
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be None or a lossspec.Tuning; got {type(tuning).__name__}")
    return tuning


def check_power_of_two(value: int, name: str, impl: str) -> int:
    """``value`` of the field ``name``, which ``impl``'s kernels use as a Triton tensor size."""
    if value & (value - 1):
        raise ValueError(f"Tuning.{name} must be a power of two for impl={impl!r} (Triton tensors); got {value}")
    return value
