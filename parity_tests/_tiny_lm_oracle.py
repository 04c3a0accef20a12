"""The float64 reference of the distributed tests' tiny model (embedding -> linear head): the
full-batch loss of :func:`lossspec.oracle` on ``logits = emb[tokens] @ head`` computed in float64,
and the parameter gradients chained from the oracle's logit gradient in float64.

Shared by the JAX and torch distributed tests (NumPy only; not a test module). The bound for the
parameter gradients is the one SPEC section 7 gives a fused head: the section 6 rule with
``S = max |float64 reference gradient of that tensor|`` (``G0 = 0``)."""

from __future__ import annotations

from typing import Any

import numpy as np

import lossspec

# Valid tokens per row of the 8 x 5 batch, spread over every split the tests make: 2 rows per
# micro-batch/replica give [5, 7, 0, 4] (micro-batch / replica 2 all masked), 4 rows give
# [12, 4]; within a 4-row replica, 2 micro-batches give [5, 7] and [0, 4] (an empty one).
VALID_PER_ROW = (4, 1, 5, 2, 0, 0, 3, 1)
# Valid positions whose label is ignore_index (cross-entropy): one on each data replica of 2.
IGNORED_ROWS = (2, 6)


def mask_and_ignored(rng: np.random.Generator, seq: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The boolean mask (valid positions scattered over each row, not a prefix) and the
    positions of the ignored labels (the first valid position of each row in IGNORED_ROWS)."""
    mask = np.zeros((len(VALID_PER_ROW), seq), bool)
    for row, count in enumerate(VALID_PER_ROW):
        mask[row, np.sort(rng.permutation(seq)[:count])] = True
    ignored = [(row, int(np.flatnonzero(mask[row])[0])) for row in IGNORED_ROWS]
    return mask, ignored


def reference(kind: str, normalization: str, emb: Any, head: Any, tokens: Any, target: Any, loss_mask: Any,
              **options: Any) -> tuple[float, dict[str, np.ndarray]]:
    """``(loss, {"emb": d loss/d emb, "head": d loss/d head})`` in float64."""
    emb = np.asarray(emb, np.float64)
    head = np.asarray(head, np.float64)
    tokens = np.asarray(tokens)
    hidden = emb[tokens]
    logits = hidden @ head
    loss, grad_logits = lossspec.oracle(kind, logits, np.asarray(target), np.asarray(loss_mask),
                                        normalization=normalization, **options)
    grad_head = np.einsum("bsh,bsv->hv", hidden, grad_logits)
    grad_emb = np.zeros_like(emb)
    np.add.at(grad_emb, tokens, grad_logits @ head.T)
    return float(loss), {"emb": grad_emb, "head": grad_head}


def assert_matches(loss: Any, grads: dict[str, Any], ref_loss: float, ref_grads: dict[str, np.ndarray], what: str) -> None:
    """Loss within ``4e-6 max(1, |ref|)``; each parameter gradient within ``4e-6 max|ref|``."""
    lossspec.compare_loss(np.asarray(loss, np.float64), ref_loss, f"{what} loss").check()
    for name, ref in ref_grads.items():
        lossspec.compare_grad(np.asarray(grads[name], np.float64), ref, "float32", 0.0, f"{what} grad[{name}]").check()
