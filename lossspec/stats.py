"""The per-row statistics: one formulation, one set of names, for every backend.

Every backend (JAX XLA and Pallas, torch and Triton, and the vocab-parallel paths of both)
computes a row's loss and gradient from the statistics listed here, in fp32, in the order:
statistics of a vocabulary block (or shard) relative to its own maxima, an associative
combine of two blocks (online softmax; the same algebra merges vocabulary shards), finalize
to the per-token loss, then the gradient of each block from the final statistics. The
records (``Stats`` and ``Final`` in ``jaxloss._stats`` and ``torchloss._stats``) and the
Triton kernels' buffer layouts are derived from :data:`ROW_STATS` and :data:`FINAL_STATS`.

Notation (SPEC section 1): ``c = logit_scale / T``, ``ct = teacher_logit_scale / T``,
``x`` / ``t`` raw student / teacher logits of one row, ``m = max x``, ``mt = max t``,
``e = exp(c (x - m))``, ``et = exp(ct (t - mt))`` (shifted coordinates: subtract the maximum,
*then* scale, so huge logits lose nothing).

Statistics of a block, relative to the block's own maxima:

=============  ================================================  ==========================
stat           definition                                        kinds
=============  ================================================  ==========================
``m``          ``max x`` (``-inf`` when nothing was seen)        all
``s``          ``sum e``                                         all
``x_y``        the label's raw logit (0 where the block does     cross_entropy
               not hold the label)
``sum_shift``  ``sum (x - m)``                                   cross_entropy, eps > 0
``n``          number of columns                                 cross_entropy, eps > 0
``mt``         ``max t``                                         distillation
``st``         ``sum et``                                        distillation
``a``          ``sum et (x - m)``                                soft CE, forward KL
``b``          ``sum et (t - mt)``                               forward KL
``tau``        the pivot: the teacher's raw logit at the         reverse KL
               student's argmax, the *first* column where
               ``x == m`` on ties (``argmax`` semantics)
``e_d``        ``sum e D`` with ``D = c (x - m) - ct (t - tau)``  reverse KL
=============  ================================================  ==========================

Combine (two blocks, or shards, of the same rows; ``m' = max(m1, m2)``): exp-sums are
multiplied by ``r = exp(c (m - m'))`` (teacher: ``exp(ct (mt - mt'))``), moments that carry
``(x - m)`` gain ``(m - m')`` times their weight sum, ``x_y`` and ``n`` add, and the pivot is
the ``tau`` of the block with the larger ``m`` (on equal ``m`` the earlier block's, the tie
rule above, so blocks, shards and a whole row agree: shards in rank / axis-index order); ``e_d`` is re-expressed on the new pivot:
``r (e_d + s (c (m - m') - ct (tau - tau')))``. A block that saw nothing (``m = -inf``)
contributes exactly 0.

Per-token losses from the global statistics, with ``lse' = log s``::

  cross_entropy      l = lse' - (1-eps) c (x_y - m) - (eps/V) c sum_shift + lam (lse' + c m)^2
  soft_cross_entropy l = lse' - c a / st
  forward_kl         l = (ct b / st - log st) - (c a / st - lse')
  reverse_kl         l = e_d / s + (log st - lse' - ct (tau - mt))

Gradients w.r.t. ``z`` (SPEC section 1), ``q = exp(c (x - m) - lse')``,
``p = exp(ct (t - mt) - log st)``::

  cross_entropy      (1 + 2 lam (lse' + c m)) q - (1-eps) onehot(y) - eps/V
  soft CE, fwd KL    q - p
  reverse_kl         q (log q - log p - l) = q (D - e_d / s)   (0 where q == 0)

Why reverse KL is pivoted: its gradient ``q (log q - log p - l)`` cancels catastrophically
when ``l`` is large (huge logits: ``l ~ 1e4`` while the gradient needs the difference to
~1e-6). ``log q - log p = D + const`` per row, and ``D`` is exactly 0 on the student's argmax,
the entry that carries the probability mass, so nothing large is ever subtracted.

Bad rows: a NaN anywhere in a row makes its ``e`` NaN, a ``+inf`` makes ``m = +inf`` and
``x - m`` NaN there; sums propagate NaN whatever ``max`` does with it. A row is bad exactly when
``s`` (or ``st``) is NaN; kernels whose ``max`` may drop NaN (GPUs) set ``s`` to NaN from an
explicit flag. Bad rows give a NaN loss and a NaN gradient row (unless masked: then 0).

The gradient pass needs, per row, the :data:`FINAL_STATS`.
"""

from __future__ import annotations

from .config import LossConfig

# The statistics of a block, in this order (the Triton kernels' buffer layout).
ROW_STATS: tuple[str, ...] = ("m", "s", "x_y", "sum_shift", "n", "mt", "st", "a", "b", "tau", "e_d")

# What finalize returns per row and the gradient pass reads (the Triton kernels' layout).
# ``l`` loss, ``m``/``mt`` the maxima made finite (``-inf`` -> 0), ``lse = log s``,
# ``lse_t = log st``, ``q_coef = 1 + 2 lam (lse + c m)`` (1 without z-loss), ``mean_d = e_d / s``.
FINAL_STATS: tuple[str, ...] = ("l", "m", "s", "lse", "mt", "st", "lse_t", "q_coef", "tau", "mean_d")

ROW_STAT_INDEX: dict[str, int] = {name: i for i, name in enumerate(ROW_STATS)}
FINAL_STAT_INDEX: dict[str, int] = {name: i for i, name in enumerate(FINAL_STATS)}

_KIND_STATS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("m", "s", "x_y"),
    "soft_cross_entropy": ("m", "s", "mt", "st", "a"),
    "forward_kl": ("m", "s", "mt", "st", "a", "b"),
    "reverse_kl": ("m", "s", "mt", "st", "tau", "e_d"),
}

# Integer ids of the kinds (Triton ``constexpr``s are named after them, never compared with
# bare numbers).
KIND_IDS: dict[str, int] = {"cross_entropy": 0, "soft_cross_entropy": 1, "forward_kl": 2, "reverse_kl": 3}


def stats_used(config: LossConfig) -> tuple[str, ...]:
    """The statistics a call computes (in :data:`ROW_STATS` order); the others are ``None``."""
    used = set(_KIND_STATS[config.kind])
    if config.kind == "cross_entropy" and config.label_smoothing > 0:
        used |= {"sum_shift", "n"}
    return tuple(name for name in ROW_STATS if name in used)
