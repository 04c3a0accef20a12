"""The float64 reference: per-token losses, normalised losses and analytic gradients.

Notation (SPEC section 1), per token row: ``x`` logits ``[V]``, ``c = logit_scale / T`` so that
``z = c * x``; teacher ``p = softmax(c_t * t)`` with ``c_t = teacher_logit_scale / T``;
``q = softmax(z)``. Every quantity is computed in *shifted* coordinates
``d = c * (x - max(x))`` so that huge logits lose nothing before the subtraction; the loss is
invariant to the shift except for the z-loss term, which uses ``lse = log sum exp(d) + c * max(x)``.

Losses (per token) and their gradients with respect to ``z``::

  cross_entropy      l = lse - (1-eps) z_y - (eps/V) sum_v z_v + lam lse^2
                     dl/dz = (1 + 2 lam lse) q - (1-eps) onehot(y) - eps/V
  soft_cross_entropy l = lse - sum_v p_v z_v                       dl/dz = q - p
  forward_kl         l = sum_v p_v (log p_v - log q_v)             dl/dz = q - p
  reverse_kl         l = sum_v q_v (log q_v - log p_v)             dl/dz = q (log q - log p - l)
  entropy            l = -sum_v q_v log q_v                        dl/dz = -q (log q + l)
  jensen_shannon     l = beta KL(p || M) + (1-beta) KL(q || M),    M = beta p + (1-beta) q
                     dl/dz = (1-beta) q (log q - log M - KL(q || M))
                     (beta = 0: forward_kl, beta = 1: reverse_kl, exactly; TRL GKD / Liger-Kernel)

Entropy and the JSD are written here in their textbook form (``log M`` by ``logaddexp`` in
float64), independently of the pivoted / two-pass formulation of :mod:`lossspec.stats`.

Soft caps (``logit_softcap``, ``teacher_logit_softcap``; SPEC section 1): the raw logits are
first replaced by ``cap * tanh(x / cap)`` (finite entries; ``+-inf`` and NaN are kept), then
everything above applies to the capped values; the gradient with respect to the raw logits is
the one with respect to the capped ones times ``d/dx cap tanh(x / cap) = 1 / cosh(x / cap)^2``
(written here with ``cosh``, independently of the kernels' ``4 e / (1 + e)^2``).

Normalised loss: ``sum_i coef_i l_i`` with ``coef_i = w_i / D`` (SPEC section 2), or the
per-sequence ``coef_i = w_i / (n_s S)`` / ``w_i / S`` (:mod:`lossspec.sequences`); the gradient
with respect to ``x`` is ``dl/dz * c * coef_i * upstream``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .checks import (broadcast_mask, check_denominator_allowed, check_denominator_type, check_denominator_value, check_inputs,
                     check_labels, check_weights, numpy_meta)
from .causal import scored_positions, shift_targets
from .config import LossConfig, make_config
from .sequences import SEQUENCE_NORMALIZATIONS, scored_segment_ids, sequence_coefficients, sequence_weight_sums

__all__ = ["oracle", "per_token_oracle", "oracle_vocab_parallel", "token_weights", "count_denominator"]


def _where_positive(prob: np.ndarray, value: np.ndarray) -> np.ndarray:
    """``prob * value`` with 0 where ``prob == 0`` (so ``0 * -inf`` is 0, not NaN)."""
    with np.errstate(invalid="ignore"):
        return np.where(prob > 0, prob * np.where(prob > 0, value, 0.0), 0.0)


def _row_is_bad(array: np.ndarray) -> np.ndarray:
    """Rows holding NaN or +inf: their loss must be NaN, never a plausible number."""
    return np.any(np.isnan(array) | (array == np.inf), axis=-1)


def _softcapped(array: np.ndarray, cap: float | None) -> np.ndarray:
    """``cap * tanh(array / cap)`` in float64 on the finite entries (``+-inf``, NaN kept);
    ``array`` itself for ``cap = None``."""
    if cap is None:
        return array
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(array), cap * np.tanh(array / cap), array)


def _softcap_derivative(array: np.ndarray, cap: float | None) -> np.ndarray | float:
    """``d/dx cap tanh(x / cap) = 1 / cosh(x / cap)^2`` at the raw logits (0 at ``+-inf``);
    1 without a cap."""
    if cap is None:
        return 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        return 1.0 / np.cosh(array / cap) ** 2


def _shifted(array: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``(scale * (array - rowmax), rowmax)``; a row of only ``-inf`` keeps max 0."""
    with np.errstate(invalid="ignore"):
        row_max = np.max(array, axis=-1, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, np.where(np.isnan(row_max), np.nan, 0.0))
        return (array - row_max) * scale, row_max[..., 0]


def _log_softmax_parts(shifted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log sum exp(shifted), softmax(shifted))`` for shifted logits (max entry 0)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        exp = np.exp(shifted)
        sum_exp = exp.sum(axis=-1, keepdims=True)
        return np.log(sum_exp)[..., 0], exp / sum_exp


def per_token_oracle(
    config: LossConfig,
    logits: np.ndarray,
    target: np.ndarray,
    valid: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token loss ``l`` ``[N]`` and ``dl/dz`` ``[N, V]`` in float64 for rows ``[N, V]``.

    ``target`` holds labels ``[N]`` (cross-entropy; rows with ``valid == False`` are never
    indexed), teacher logits ``[N, V]``, or ``None`` (entropy). Invalid rows get loss 0 and
    gradient 0.
    """
    kind = config.formula  # jensen_shannon at beta = 0 / 1 is forward / reverse KL
    raw = np.asarray(logits, dtype=np.float64)
    x = _softcapped(raw, config.logit_softcap)
    rows, vocab = x.shape
    valid = np.ones(rows, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    c = config.student_scale
    d, x_max = _shifted(x, c)
    lse_shift, q = _log_softmax_parts(d)
    bad = _row_is_bad(x)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if kind == "entropy":
            log_q = d - lse_shift[:, None]
            loss = -_where_positive(q, log_q).sum(axis=-1)
            grad_z = -_where_positive(q, log_q + loss[:, None])
        elif kind == "cross_entropy":
            labels = np.where(valid, np.asarray(target), 0).astype(np.int64)
            eps, lam = config.label_smoothing, config.z_loss
            d_y = np.take_along_axis(d, labels[:, None], axis=-1)[:, 0]
            lse = lse_shift + c * x_max
            loss = lse_shift - (1.0 - eps) * d_y
            if eps > 0:
                loss = loss - (eps / vocab) * d.sum(axis=-1)
            if lam > 0:
                loss = loss + lam * lse**2
            onehot = np.zeros_like(d)
            np.put_along_axis(onehot, labels[:, None], 1.0, axis=-1)
            grad_z = (1.0 + 2.0 * lam * lse)[:, None] * q - (1.0 - eps) * onehot - eps / vocab
        else:
            t = _softcapped(np.asarray(target, dtype=np.float64), config.teacher_logit_softcap)
            dt, _ = _shifted(t, config.teacher_scale)
            lse_t_shift, p = _log_softmax_parts(dt)
            bad = bad | _row_is_bad(t)
            log_q = d - lse_shift[:, None]
            log_p = dt - lse_t_shift[:, None]
            if kind == "soft_cross_entropy":
                loss = lse_shift - _where_positive(p, d).sum(axis=-1)
                grad_z = q - p
            elif kind == "jensen_shannon":
                beta = config.beta
                log_m = np.logaddexp(np.log1p(-beta) + log_q, np.log(beta) + log_p)
                kl_pm = _where_positive(p, log_p - log_m).sum(axis=-1)
                kl_qm = _where_positive(q, log_q - log_m).sum(axis=-1)
                loss = beta * kl_pm + (1.0 - beta) * kl_qm
                grad_z = (1.0 - beta) * _where_positive(q, log_q - log_m - kl_qm[:, None])
            elif kind == "forward_kl":
                loss = _where_positive(p, log_p - log_q).sum(axis=-1)
                grad_z = q - p
            else:  # reverse_kl
                loss = _where_positive(q, log_q - log_p).sum(axis=-1)
                grad_z = _where_positive(q, log_q - log_p - loss[:, None])
        # a NaN loss comes with a NaN gradient row (q * ... is 0, not NaN, where q is NaN)
        loss = np.where(bad, np.nan, loss)
        grad_z = grad_z * _softcap_derivative(raw, config.logit_softcap)  # chain rule to the raw logits
        grad_z = np.where(bad[:, None], np.nan, grad_z)
    loss = np.where(valid, loss, 0.0)
    grad_z = np.where(valid[:, None], grad_z, 0.0)
    return loss, grad_z


def token_weights(
    config: LossConfig,
    target: np.ndarray | None,
    loss_mask: np.ndarray | None,
    lead_shape: tuple[int, ...],
    segment_ids: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(valid, weight)`` per token, float64: a token is valid when its mask is non-zero, its
    segment id (if given; the scored ids under ``causal_shift``) is ``>= 0`` and, for
    cross-entropy, its label is not ``ignore_index``; invalid tokens have weight 0."""
    valid = np.ones(lead_shape, dtype=bool)
    if segment_ids is not None:
        valid &= np.asarray(segment_ids) >= 0
    weight = np.ones(lead_shape, dtype=np.float64)
    if loss_mask is not None:
        loss_mask = np.asarray(loss_mask)
        valid &= loss_mask != 0
        weight = loss_mask.astype(np.float64)
    if config.kind == "cross_entropy" and target is not None:
        valid &= np.asarray(target) != config.ignore_index
    return valid, np.where(valid, weight, 0.0)


def count_denominator(
    labels: np.ndarray | None = None,
    loss_mask: np.ndarray | None = None,
    *,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
    causal_shift: bool = False,
    segment_ids: np.ndarray | None = None,
) -> float:
    """The denominator ``D`` of one batch (SPEC sections 2 and 4), float64.

    ``"valid_tokens"``: sum of the weights of valid tokens (mask non-zero, segment id ``>= 0``
    and, when labels are given, label != ignore_index). ``"tokens"``: number of token positions.
    ``"sequence_mean"`` / ``"sequence_sum"``: ``S``, the number of sequences with a positive
    weight sum (:mod:`lossspec.sequences`). Counts add up over micro-batches and data-parallel
    replicas. ``causal_shift=True`` counts the scored positions (:mod:`lossspec.causal`):
    ``labels[..., 1:]`` and ``loss_mask[..., 1:]``, and the sequences of the scored ids.
    """
    from .checks import check_count_args

    check_count_args(
        normalization,
        None if labels is None else numpy_meta(np.asarray(labels)),
        None if loss_mask is None else numpy_meta(np.asarray(loss_mask)),
        causal_shift,
        None if segment_ids is None else numpy_meta(np.asarray(segment_ids)),
    )
    if loss_mask is not None:  # a mask that broadcasts to the labels' (or ids') shape, expanded
        loss_mask = broadcast_mask(loss_mask, next(np.shape(a) for a in (labels, segment_ids, loss_mask) if a is not None))
    ref = np.asarray(next(a for a in (labels, loss_mask, segment_ids) if a is not None))
    if normalization == "tokens":
        return float(scored_positions(ref.shape, causal_shift))
    if loss_mask is not None:
        check_weights(np.asarray(loss_mask)[..., 1:] if causal_shift else np.asarray(loss_mask))
    ids = None
    if segment_ids is not None or normalization in SEQUENCE_NORMALIZATIONS:
        ids = scored_segment_ids(segment_ids, ref.shape, causal_shift)
    if causal_shift:  # position t is scored against index t + 1: index 0 is never a target
        labels, loss_mask = shift_targets(labels, loss_mask, ref.shape)
    config = LossConfig(kind="cross_entropy", ignore_index=ignore_index)
    _, weight = token_weights(config, labels, loss_mask, ref.shape, ids)
    if normalization in SEQUENCE_NORMALIZATIONS:
        return float(sequence_weight_sums(weight, ids)[1])
    return float(weight.sum())


def _prepare(
    kind: str, logits: np.ndarray, target: np.ndarray, loss_mask: np.ndarray | None, options: dict[str, Any]
) -> tuple[LossConfig, Any, Any, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Checks, then ``(config, denominator, grad_output, target, loss_mask, segment_ids)``; with
    ``causal_shift`` the labels, mask and segment ids are those of the scored positions
    (``lossspec.causal``, ``lossspec.sequences``), and the value checks apply to them. The ids are
    ``None`` when neither given nor needed (the token modes without ``segment_ids``)."""
    normalization = options.pop("normalization", "valid_tokens")
    denominator = options.pop("denominator", None)
    grad_output = options.pop("grad_output", None)
    segment_ids = options.pop("segment_ids", None)
    config = make_config(kind, normalization=normalization, **options)
    logits = np.asarray(logits)
    target = np.asarray(target) if config.has_target else None
    target_meta = None if target is None else numpy_meta(target)
    check_inputs(
        config,
        numpy_meta(logits),
        target_meta,
        None if loss_mask is None else numpy_meta(np.asarray(loss_mask)),
        None if segment_ids is None else numpy_meta(np.asarray(segment_ids)),
    )
    if loss_mask is not None:  # a mask that broadcasts to the leading shape (check_inputs), expanded
        loss_mask = broadcast_mask(loss_mask, logits.shape[:-1])
    if segment_ids is not None or config.per_sequence:
        segment_ids = scored_segment_ids(segment_ids, logits.shape[:-1], config.causal_shift)
    check_denominator_allowed(config, denominator)
    if denominator is not None:
        # arrays of any framework (anything with __array__ but a NumPy scalar) by their dtype
        is_array = hasattr(denominator, "__array__") and not isinstance(denominator, np.generic)
        check_denominator_type(denominator, numpy_meta(np.asarray(denominator)) if is_array else None)
        check_denominator_value(denominator)
    if config.causal_shift:
        labels, loss_mask = shift_targets(target if config.kind == "cross_entropy" else None, loss_mask, logits.shape[:-1])
        target = target if labels is None else labels
    if loss_mask is not None:
        check_weights(np.asarray(loss_mask))
    return config, denominator, grad_output, target, loss_mask, segment_ids


def _normalise(
    config: LossConfig,
    logits: np.ndarray,
    target: np.ndarray,
    loss_mask: np.ndarray | None,
    segment_ids: np.ndarray | None,
    denominator: Any,
    grad_output: Any,
    per_token_fn: Any,
) -> tuple[np.ndarray, np.ndarray]:
    logits = np.asarray(logits)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    valid, weight = token_weights(config, target, loss_mask, lead, segment_ids)
    if config.kind == "cross_entropy":
        check_labels(np.asarray(target), valid, vocab, config.causal_shift)
    rows = int(np.prod(lead, dtype=np.int64))
    if not config.has_target:
        flat_target = None
    elif config.kind == "cross_entropy":
        flat_target = np.asarray(target).reshape(rows)
    else:
        flat_target = np.asarray(target).reshape(rows, vocab)
    loss_tok, grad_z = per_token_fn(config, logits.reshape(rows, vocab), flat_target, valid.reshape(rows))
    weight = weight.reshape(rows)
    c = config.student_scale
    if config.normalization == "none":
        upstream = np.ones(rows) if grad_output is None else np.broadcast_to(np.asarray(grad_output, np.float64), lead).reshape(rows)
        loss = np.where(weight > 0, weight * loss_tok, 0.0).reshape(lead)
        coef = weight * upstream
    elif config.per_sequence:
        coef = sequence_coefficients(weight.reshape(lead), segment_ids, config.normalization, denominator).reshape(rows)
        with np.errstate(invalid="ignore"):
            loss = np.sum(np.where(coef > 0, coef * loss_tok, 0.0))
        upstream = 1.0 if grad_output is None else float(grad_output)
        coef = coef * upstream
    else:
        if denominator is not None:
            denom = float(np.asarray(denominator, dtype=np.float64).reshape(()))
        elif config.normalization == "valid_tokens":
            denom = float(weight.sum())
        elif config.normalization == "tokens":
            denom = float(scored_positions(lead, config.causal_shift))
        else:
            denom = 1.0
        coef = weight / denom if denom > 0 else np.zeros_like(weight)
        with np.errstate(invalid="ignore"):
            loss = np.sum(np.where(coef > 0, coef * loss_tok, 0.0))
        upstream = 1.0 if grad_output is None else float(grad_output)
        coef = coef * upstream
    grad = (coef * c)[:, None] * grad_z
    return loss, grad.reshape(logits.shape)


def oracle(
    kind: str,
    logits: np.ndarray,
    target: np.ndarray | None,
    loss_mask: np.ndarray | None = None,
    **options: Any,
) -> tuple[np.ndarray | float, np.ndarray]:
    """The float64 reference ``(loss, grad_logits)`` of SPEC section 3.

    Args:
      kind: ``"cross_entropy" | "soft_cross_entropy" | "forward_kl" | "reverse_kl" |
        "entropy" | "jensen_shannon"``.
      logits: ``[..., V]``.
      target: labels ``[...]``, teacher logits ``[..., V]``, or ``None`` (``entropy``, which
        has no target; ignored there).
      loss_mask: ``[...]`` boolean or float weights, or ``None``.
      **options: the keyword options of the matching public function (``ignore_index``,
        ``label_smoothing``, ``z_loss``, ``logit_scale``, ``temperature``,
        ``teacher_logit_scale``, ``logit_softcap``, ``teacher_logit_softcap``, ``beta``,
        ``causal_shift``, ``normalization``, ``denominator``,
        ``segment_ids``), plus ``grad_output``: the
        upstream gradient (a scalar, or per-token ``[...]`` for ``"none"``; default 1).

    Returns:
      ``loss``: a float64 scalar, or the per-token ``w_i l_i`` ``[...]`` for ``"none"``;
      ``grad_logits``: ``[..., V]`` float64, the gradient of ``sum(loss * grad_output)``.
    """
    config, denominator, grad_output, target, loss_mask, ids = _prepare(kind, logits, target, loss_mask, dict(options))
    loss, grad = _normalise(config, logits, target, loss_mask, ids, denominator, grad_output, per_token_oracle)
    return (loss if config.normalization == "none" else float(loss)), grad


# --------------------------------------------------------------------------------------------
# Vocab-parallel reference: the same numbers from per-shard statistics (SPEC section 3).
# --------------------------------------------------------------------------------------------


def _first_argmax_teacher(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The teacher's logit at the first column of each row's maximum (``-inf`` for an empty
    shard): reverse KL's pivot (``lossspec.stats``)."""
    if x.shape[-1] == 0:
        return np.full(x.shape[0], -np.inf)
    return t[np.arange(x.shape[0]), np.argmax(x, axis=-1)]


def per_token_vocab_parallel(
    config: LossConfig, logits: np.ndarray, target: np.ndarray, valid: np.ndarray, num_shards: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`per_token_oracle` computed shard by shard over a split vocabulary.

    Each shard ``k`` computes, on its own slice and relative to its own maxima ``m_k``
    (student) and ``mt_k`` (teacher): ``S_k = sum exp(c (x - m_k))``, ``St_k``, and the cross
    moments ``sum e * (x - m_k)`` etc. The shards then agree on the global maxima (a pmax),
    rescale their moments by ``exp(c (m_k - m))`` and add them (a psum); each shard finally
    writes the gradient of its own slice. This is the algebra the vocab-parallel kernels follow.
    """
    raw = np.asarray(logits, dtype=np.float64)
    x = _softcapped(raw, config.logit_softcap)
    rows, vocab = x.shape
    kind = config.formula  # jensen_shannon at beta = 0 / 1 is forward / reverse KL
    bounds = np.linspace(0, vocab, num_shards + 1).astype(int)
    slices = [slice(bounds[k], bounds[k + 1]) for k in range(num_shards)]
    c, ct = config.student_scale, config.teacher_scale
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        bad = _row_is_bad(x)
        m_k = np.stack([np.max(x[:, s], axis=-1) if s.stop > s.start else np.full(rows, -np.inf) for s in slices])
        m = np.max(m_k, axis=0)
        m = np.where(np.isfinite(m), m, np.where(np.isnan(m), np.nan, 0.0))
        rescale = np.where(np.isfinite(m_k), np.exp(c * (m_k - m)), 0.0)  # exp(c (m_k - m))
        shift = np.where(np.isfinite(m_k), c * (m_k - m), 0.0)  # c (m_k - m), 0 for empty shards
        d_local = [c * (x[:, s] - np.where(np.isfinite(m_k[k]), m_k[k], 0.0)[:, None]) for k, s in enumerate(slices)]
        s_k = np.stack([np.exp(dl).sum(-1) for dl in d_local])
        sum_exp = np.sum(rescale * s_k, axis=0)
        lse_shift = np.log(sum_exp)
        grads = []
        if kind == "entropy":
            # h = sum e (x - m): each shard's own, moved to the global maximum (lossspec.stats).
            h = 0.0
            for k in range(num_shards):
                own = _where_positive(np.exp(d_local[k]), d_local[k] / c).sum(-1)
                h = h + rescale[k] * (own + s_k[k] * shift[k] / c)
            mean_h = h / sum_exp
            loss = lse_shift - c * mean_h
            for k, s in enumerate(slices):
                q = np.exp(d_local[k] + shift[k][:, None] - lse_shift[:, None])
                grads.append(-c * _where_positive(q, (x[:, s] - m[:, None]) - mean_h[:, None]))
        elif kind == "cross_entropy":
            labels = np.where(valid, np.asarray(target), 0).astype(np.int64)
            eps, lam = config.label_smoothing, config.z_loss
            d_y = np.zeros(rows)
            sum_d = np.zeros(rows)
            for k, s in enumerate(slices):
                owned = (labels >= s.start) & (labels < s.stop)
                local = np.clip(labels - s.start, 0, max(s.stop - s.start - 1, 0))
                if s.stop > s.start:
                    d_y += np.where(owned, d_local[k][np.arange(rows), local] + shift[k], 0.0)
                    sum_d += d_local[k].sum(-1) + (s.stop - s.start) * shift[k]
            lse = lse_shift + c * m
            loss = lse_shift - (1.0 - eps) * d_y
            if eps > 0:
                loss = loss - (eps / vocab) * sum_d
            if lam > 0:
                loss = loss + lam * lse**2
            for k, s in enumerate(slices):
                q = np.exp(d_local[k] + shift[k][:, None] - lse_shift[:, None])
                onehot = (np.arange(s.start, s.stop)[None, :] == labels[:, None]).astype(np.float64)
                grads.append((1.0 + 2.0 * lam * lse)[:, None] * q - (1.0 - eps) * onehot - eps / vocab)
        else:
            t = _softcapped(np.asarray(target, dtype=np.float64), config.teacher_logit_softcap)
            bad = bad | _row_is_bad(t)
            mt_k = np.stack([np.max(t[:, s], axis=-1) if s.stop > s.start else np.full(rows, -np.inf) for s in slices])
            mt = np.max(mt_k, axis=0)
            mt = np.where(np.isfinite(mt), mt, np.where(np.isnan(mt), np.nan, 0.0))
            rescale_t = np.where(np.isfinite(mt_k), np.exp(ct * (mt_k - mt)), 0.0)
            shift_t = np.where(np.isfinite(mt_k), ct * (mt_k - mt), 0.0)
            dt_local = [ct * (t[:, s] - np.where(np.isfinite(mt_k[k]), mt_k[k], 0.0)[:, None]) for k, s in enumerate(slices)]
            st_k = np.stack([np.exp(dl).sum(-1) for dl in dt_local])
            sum_exp_t = np.sum(rescale_t * st_k, axis=0)
            lse_t_shift = np.log(sum_exp_t)
            # Cross moments, each shard in its own coordinates, then rescaled to the global ones:
            # sum_v p_v d_v, sum_v p_v dt_v (lossspec.stats' a and b).
            p_d = p_dt = 0.0
            for k in range(num_shards):
                e_t = np.exp(dt_local[k])
                p_d = p_d + rescale_t[k] * (_where_positive(e_t, d_local[k]).sum(-1) + shift[k] * st_k[k])
                p_dt = p_dt + rescale_t[k] * (_where_positive(e_t, dt_local[k]).sum(-1) + shift_t[k] * st_k[k])
            p_d, p_dt = p_d / sum_exp_t, p_dt / sum_exp_t
            kl_qm = None
            if kind == "jensen_shannon":
                # The second pass: each shard's mixture terms from the global lse's, summed.
                beta = config.beta
                kl_qm = kl_pm = 0.0
                for k in range(num_shards):
                    log_q = d_local[k] + shift[k][:, None] - lse_shift[:, None]
                    log_p = dt_local[k] + shift_t[k][:, None] - lse_t_shift[:, None]
                    log_m = np.logaddexp(np.log1p(-beta) + log_q, np.log(beta) + log_p)
                    kl_qm = kl_qm + _where_positive(np.exp(log_q), log_q - log_m).sum(-1)
                    kl_pm = kl_pm + _where_positive(np.exp(log_p), log_p - log_m).sum(-1)
                loss = beta * kl_pm + (1.0 - beta) * kl_qm
            elif kind == "soft_cross_entropy":
                loss = lse_shift - p_d
            elif kind == "forward_kl":
                loss = (p_dt - lse_t_shift) - (p_d - lse_shift)
            else:
                # Reverse KL pivoted as lossspec.stats says: tau_k, the teacher at the shard's first
                # argmax; the global pivot from the first shard holding the maximum; each shard's
                # e_d = sum e D moved onto it.
                tau_k = np.stack([_first_argmax_teacher(x[:, s], t[:, s]) for s in slices])
                holder = np.argmax(m_k == m[None, :], axis=0)
                tau = tau_k[holder, np.arange(rows)]
                e_d = 0.0
                for k, s in enumerate(slices):
                    d_k = d_local[k] - ct * (t[:, s] - tau_k[k][:, None])
                    own = _where_positive(np.exp(d_local[k]), d_k).sum(-1)
                    moved = np.where(rescale[k] > 0, rescale[k] * (own + s_k[k] * (shift[k] - ct * (tau_k[k] - tau))), 0.0)
                    e_d = e_d + moved
                mean_d = e_d / sum_exp
                loss = mean_d + (lse_t_shift - lse_shift - ct * (tau - mt))
            for k, s in enumerate(slices):
                log_q = d_local[k] + shift[k][:, None] - lse_shift[:, None]
                q = np.exp(log_q)
                if kind == "reverse_kl":
                    d = c * (x[:, s] - m[:, None]) - ct * (t[:, s] - tau[:, None])
                    grads.append(_where_positive(q, d - mean_d[:, None]))
                elif kind == "jensen_shannon":
                    log_p = dt_local[k] + shift_t[k][:, None] - lse_t_shift[:, None]
                    log_m = np.logaddexp(np.log1p(-config.beta) + log_q, np.log(config.beta) + log_p)
                    grads.append((1.0 - config.beta) * _where_positive(q, log_q - log_m - kl_qm[:, None]))
                else:
                    log_p = dt_local[k] + shift_t[k][:, None] - lse_t_shift[:, None]
                    grads.append(q - np.exp(log_p))
        loss = np.where(bad, np.nan, loss)
        grad_z = np.concatenate(grads, axis=-1) * _softcap_derivative(raw, config.logit_softcap)
        grad_z = np.where(bad[:, None], np.nan, grad_z)  # as in per_token_oracle()
    return np.where(valid, loss, 0.0), np.where(valid[:, None], grad_z, 0.0)


def oracle_vocab_parallel(
    kind: str,
    logits: np.ndarray,
    target: np.ndarray,
    loss_mask: np.ndarray | None = None,
    *,
    num_shards: int,
    **options: Any,
) -> tuple[np.ndarray | float, np.ndarray]:
    """:func:`oracle`, computed from ``num_shards`` contiguous vocabulary shards (sizes as even
    as possible) combined as a vocab-parallel kernel would. Equal to :func:`oracle` up to
    float64 rounding; a reference for the algebra of the vocab-parallel paths."""
    config, denominator, grad_output, target, loss_mask, ids = _prepare(kind, logits, target, loss_mask, dict(options))

    def per_token(cfg: LossConfig, x: np.ndarray, tgt: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return per_token_vocab_parallel(cfg, x, tgt, valid, num_shards)

    loss, grad = _normalise(config, logits, target, loss_mask, ids, denominator, grad_output, per_token)
    return (loss if config.normalization == "none" else float(loss)), grad
