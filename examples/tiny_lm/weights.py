"""The tiny LM's architecture and its initial weights, as NumPy arrays shared by both frameworks.

``hidden_states(tokens [B, T], segment_ids [B, T] | None) -> hidden [B, T, H]``, then the head::

    x = tok_emb[tokens] + pos_emb[:T]
    x = x + attention(layer_norm(x, ln1)) @ wo          (one head; causal, and within a document
                                                       when segment_ids are given)
    x = x + gelu_tanh(layer_norm(x, ln2) @ w1 + b1) @ w2 + b2
    hidden = layer_norm(x, lnf)
    logits = hidden @ tok_emb.T                         (tied head: tok_emb [V, H] is the weight)

The head is never written as a matmul in the trainers: ``linear_<kind>(hidden, tok_emb, ...)``
(the fused head) computes the loss from ``hidden`` and the embedding table, and the gradient of
``tok_emb`` is the sum of its two uses (the lookup and the head).
"""

from __future__ import annotations

import numpy as np

from .data import SEQ, VOCAB

LN_EPS = 1e-5


def init_weights(hidden: int, seed: int = 0, seq: int = SEQ) -> dict[str, np.ndarray]:
    """float32 weights of a model of width ``hidden`` for rows of up to ``seq`` tokens."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float) -> np.ndarray:
        return rng.normal(0.0, scale, shape).astype(np.float32)

    h = hidden
    return {
        # The table is also the output head: logits = layer_norm(x) @ tok_emb.T, of std ~ 0.3 sqrt(H).
        "tok_emb": normal(VOCAB, h, scale=0.3),
        "pos_emb": normal(seq, h, scale=0.1),
        "ln1_g": np.ones(h, np.float32), "ln1_b": np.zeros(h, np.float32),
        "wq": normal(h, h, scale=h**-0.5), "wk": normal(h, h, scale=h**-0.5),
        "wv": normal(h, h, scale=h**-0.5), "wo": normal(h, h, scale=h**-0.5),
        "ln2_g": np.ones(h, np.float32), "ln2_b": np.zeros(h, np.float32),
        "w1": normal(h, 4 * h, scale=h**-0.5), "b1": np.zeros(4 * h, np.float32),
        "w2": normal(4 * h, h, scale=(4 * h) ** -0.5), "b2": np.zeros(h, np.float32),
        "lnf_g": np.ones(h, np.float32), "lnf_b": np.zeros(h, np.float32),
    }
