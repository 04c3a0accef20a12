"""torchloss: masked LLM losses for PyTorch with the numbers of ``jaxloss`` and the ``lossspec`` oracle.

Public API (SPEC section 3): :func:`cross_entropy`, :func:`soft_cross_entropy`,
:func:`forward_kl`, :func:`reverse_kl`, :func:`entropy`, :func:`jensen_shannon`,
:func:`count_denominator`; one autograd Function per
kind; ``nn.Module`` wrappers in :mod:`torchloss.nn`; a drop-in for ``transformers``' causal-LM
loss in :mod:`torchloss.hf`. Two implementations: ``impl="torch"``
(tiled PyTorch ops, the default off-GPU) and ``impl="triton"`` (Triton kernels, the default on
CUDA tensors; interpreted on CPU tensors). ``import torchloss`` does not need triton.
"""

import os as _os
import sys as _sys


def _default_to_the_triton_interpreter() -> None:
    """On a machine without CUDA, run Triton kernels through the interpreter (impl="triton" on
    CPU tensors). TRITON_INTERPRET must be set before triton is first imported, and importing
    ``torch.compiler``/``torch._dynamo`` (below) imports triton, hence here and not in backends/triton.py
    alone. A value already in the environment is kept."""
    if "triton" in _sys.modules:
        return  # too late to choose; torchloss.backends.triton reports a mismatch when it is used
    import torch

    if not torch.cuda.is_available():
        _os.environ.setdefault("TRITON_INTERPRET", "1")


_default_to_the_triton_interpreter()

from . import hf, nn  # noqa: E402  (hf does not import transformers)
from .api import (  # noqa: E402
    CrossEntropyFunction,
    EntropyFunction,
    ForwardKLFunction,
    JensenShannonFunction,
    ReverseKLFunction,
    SoftCrossEntropyFunction,
    count_denominator,
    cross_entropy,
    entropy,
    forward_kl,
    jensen_shannon,
    reverse_kl,
    soft_cross_entropy,
)
from .distributed import accumulate, global_denominator  # noqa: E402
from .head import (  # noqa: E402
    linear_cross_entropy, linear_entropy, linear_forward_kl, linear_jensen_shannon, linear_reverse_kl, linear_soft_cross_entropy,
)

__all__ = [
    "cross_entropy",
    "soft_cross_entropy",
    "forward_kl",
    "reverse_kl",
    "entropy",
    "jensen_shannon",
    "count_denominator",
    "accumulate",
    "global_denominator",
    "CrossEntropyFunction",
    "SoftCrossEntropyFunction",
    "ForwardKLFunction",
    "ReverseKLFunction",
    "EntropyFunction",
    "JensenShannonFunction",
    "nn",
    "hf",
    "linear_cross_entropy",
    "linear_soft_cross_entropy",
    "linear_forward_kl",
    "linear_reverse_kl",
    "linear_entropy",
    "linear_jensen_shannon",
]

__version__ = "0.1.0"
