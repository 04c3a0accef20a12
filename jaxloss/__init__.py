"""jaxloss: masked LLM losses for JAX with identical numbers to ``torchloss`` (SPEC sections 1-3).

Functions (SPEC section 3): :func:`cross_entropy`, :func:`soft_cross_entropy`,
:func:`forward_kl`, :func:`reverse_kl`, :func:`entropy`, :func:`jensen_shannon`, and
:func:`count_denominator` for the two-pass global
normalisation. ``impl="xla"`` is a fused ``custom_vjp`` in plain JAX (default off-GPU),
``impl="pallas"`` the Pallas kernels (Triton lowering on GPUs, interpret mode elsewhere).
Flax NNX modules live in :mod:`jaxloss.nnx`.
"""

from .api import (
    count_denominator,
    cross_entropy,
    entropy,
    forward_kl,
    jensen_shannon,
    resolve_impl,
    reverse_kl,
    soft_cross_entropy,
)
from .head import (
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
    "resolve_impl",
    "linear_cross_entropy",
    "linear_soft_cross_entropy",
    "linear_forward_kl",
    "linear_reverse_kl",
    "linear_entropy",
    "linear_jensen_shannon",
]
__version__ = "0.1.0"
