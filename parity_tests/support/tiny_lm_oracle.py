"""The float64 references of the tests' tiny models.

- :func:`reference`: the distributed tests' model (embedding -> linear head): the full-batch loss
  of :func:`lossspec.oracle` on ``logits = emb[tokens] @ head`` computed in float64, and the
  parameter gradients chained from the oracle's logit gradient in float64 (NumPy only).
- :func:`tied_lm_reference`: the examples' tiny LM (a transformer block, head tied to the
  embedding table; the end-to-end and packed-documents tests): the oracle's loss and logit
  gradient, chained through the block by float64 autograd.

Shared by the JAX and torch tests (not a test module). The bound for the parameter gradients is
the one SPEC section 8 gives a fused head: the section 6 rule with
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


# --------------------------------------------------------------------------------------------
# The examples' tiny LM (examples/tiny_lm/weights.py): a transformer block with a tied head
# --------------------------------------------------------------------------------------------

LN_EPS = 1e-5  # examples/tiny_lm/weights.py


def _tied_lm_hidden(torch: Any, p: dict[str, Any], tokens: Any, segment_ids: Any) -> Any:
    """The final hidden states ``[B, T, H]`` of the tiny LM (float64; formula in weights.py)."""

    def layer_norm(x: Any, gain: Any, bias: Any) -> Any:
        mean = x.mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + LN_EPS) * gain + bias

    seq = tokens.shape[-1]
    x = p["tok_emb"][tokens] + p["pos_emb"][:seq]
    h = layer_norm(x, p["ln1_g"], p["ln1_b"])
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    scores = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    if segment_ids is not None:
        allowed = allowed & (segment_ids[..., :, None] == segment_ids[..., None, :])
    x = x + torch.softmax(scores.masked_fill(~allowed, -np.inf), dim=-1) @ v @ p["wo"]
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    gelu = torch.nn.functional.gelu(h @ p["w1"] + p["b1"], approximate="tanh")
    return layer_norm(x + gelu @ p["w2"] + p["b2"], p["lnf_g"], p["lnf_b"])


def tied_lm_reference(kind: str, weights: dict[str, Any], tokens: Any, target: Any, loss_mask: Any, *,
                      attention_segment_ids: Any = None, **options: Any) -> tuple[float, dict[str, np.ndarray]]:
    """``(loss, {name: d loss / d weight})`` in float64 of the examples' tiny LM with the tied head
    ``logits = hidden @ tok_emb.T``: the loss and its logit gradient are :func:`lossspec.oracle`'s
    (``options``: its keyword options, e.g. ``normalization``, ``segment_ids``, ``causal_shift``,
    ``temperature``); the chain rule through the block is float64 autograd (torch, imported here
    only; no library loss is called). ``tok_emb``'s gradient sums its two uses (lookup and head).
    ``target``: labels, or the teacher's float64 logits for the distillation kinds.
    ``attention_segment_ids``: restrict attention to each document (the packed demo's model)."""
    import torch

    params = {name: torch.tensor(np.asarray(value, np.float64), requires_grad=True) for name, value in weights.items()}
    ids = None if attention_segment_ids is None else torch.as_tensor(np.asarray(attention_segment_ids))
    hidden = _tied_lm_hidden(torch, params, torch.as_tensor(np.asarray(tokens)), ids)
    logits = hidden @ params["tok_emb"].T
    loss, grad_logits = lossspec.oracle(kind, logits.detach().numpy(), np.asarray(target), np.asarray(loss_mask), **options)
    grads = torch.autograd.grad(logits, list(params.values()), grad_outputs=torch.from_numpy(np.asarray(grad_logits)))
    return float(loss), {name: grad.numpy() for name, grad in zip(params, grads)}


def teacher_logits(teacher_hidden: Any, teacher_weight: Any) -> np.ndarray:
    """The float64 logits ``teacher_hidden @ teacher_weight.T`` a fused distillation head forms."""
    return np.asarray(teacher_hidden, np.float64) @ np.asarray(teacher_weight, np.float64).T
