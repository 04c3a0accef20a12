"""The tiny LM's architecture and its initial weights, as NumPy arrays shared by both frameworks.

``forward(tokens [B, T]) -> logits [B, T, 256]``::

    x = tok_emb[tokens] + pos_emb[:T]
    x = x + causal_attention(layer_norm(x, ln1)) @ wo          (one head)
    x = x + gelu_tanh(layer_norm(x, ln2) @ w1 + b1) @ w2 + b2
    logits = layer_norm(x, lnf) @ head                         (untied head)
"""

from __future__ import annotations

import numpy as np

from .data import SEQ, VOCAB

LN_EPS = 1e-5


def init_weights(hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float) -> np.ndarray:
        return rng.normal(0.0, scale, shape).astype(np.float32)

    h = hidden
    return {
        "tok_emb": normal(VOCAB, h, scale=0.5),
        "pos_emb": normal(SEQ, h, scale=0.1),
        "ln1_g": np.ones(h, np.float32), "ln1_b": np.zeros(h, np.float32),
        "wq": normal(h, h, scale=h**-0.5), "wk": normal(h, h, scale=h**-0.5),
        "wv": normal(h, h, scale=h**-0.5), "wo": normal(h, h, scale=h**-0.5),
        "ln2_g": np.ones(h, np.float32), "ln2_b": np.zeros(h, np.float32),
        "w1": normal(h, 4 * h, scale=h**-0.5), "b1": np.zeros(4 * h, np.float32),
        "w2": normal(4 * h, h, scale=(4 * h) ** -0.5), "b2": np.zeros(h, np.float32),
        "lnf_g": np.ones(h, np.float32), "lnf_b": np.zeros(h, np.float32),
        "head": normal(h, VOCAB, scale=h**-0.5),
    }
