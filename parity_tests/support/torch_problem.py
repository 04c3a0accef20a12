"""The small model and batch of the torch equivalence tests (shared by the tests and their
workers), and its float64 reference (tiny_lm_oracle.py); and :data:`TRITON_DEVICE`, where the
Triton kernel tests put their tensors."""

from __future__ import annotations


import numpy as np
import torch

import torchloss

from parity_tests.support import tiny_lm_oracle

# The device of every test's impl="triton" tensors (the Triton suites and the triton cases of
# the oracle, autograd, soft-cap, 16-bit and other matrices, through support.torch_cases.device_for):
# with CUDA the kernels are compiled and take CUDA tensors only; without it torchloss runs them through the Triton interpreter on CPU tensors. Inputs are made
# on the host as before (NumPy, same seeds) and moved here; results come back with .cpu().
TRITON_DEVICE: torch.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_for(impl: str) -> torch.device:
    """Where the tensors of a call with ``impl`` go: :data:`TRITON_DEVICE` for "triton", the CPU
    for the torch path."""
    return TRITON_DEVICE if impl == "triton" else torch.device("cpu")

KINDS = ("cross_entropy", "soft_cross_entropy", "forward_kl", "reverse_kl")
NORMALIZATIONS = ("valid_tokens", "tokens", "sum")
BATCH, SEQ, VOCAB_IN, HIDDEN, VOCAB = 8, 5, 11, 6, 40
KIND_OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"temperature": 2.0},
    "reverse_kl": {"temperature": 0.8},
}


class TinyLM(torch.nn.Module):
    """Embedding -> linear head: enough to check parameter gradients, not only logit gradients."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.emb = torch.nn.Parameter(torch.tensor(rng.normal(0, 1, (VOCAB_IN, HIDDEN)), dtype=torch.float32))
        self.head = torch.nn.Parameter(torch.tensor(rng.normal(0, 0.5, (HIDDEN, VOCAB)), dtype=torch.float32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb[tokens] @ self.head


def make_model() -> TinyLM:
    return TinyLM()


def make_problem(kind: str, seed: int = 0, float_weights: bool = False) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB_IN, (BATCH, SEQ))
    # Valid counts per row (4, 1, 5, 2, 0, 0, 3, 1): 2 replicas hold 12 / 4, 4 replicas hold
    # 5 / 7 / 0 / 4 (replica 2 all masked); see tiny_lm_oracle.VALID_PER_ROW.
    mask, ignored = tiny_lm_oracle.mask_and_ignored(rng, SEQ)
    weights = np.where(mask, rng.uniform(0.5, 2.0, mask.shape), 0.0).astype(np.float32)
    batch = {"tokens": torch.tensor(tokens), "loss_mask": torch.tensor(weights if float_weights else mask)}
    if kind == "cross_entropy":
        labels = rng.integers(0, VOCAB, (BATCH, SEQ))
        for position in ignored:  # an ignored label among the valid positions of each half
            labels[position] = -100
        batch["labels"] = torch.tensor(labels)
    else:
        batch["teacher"] = torch.tensor(rng.normal(0, 2, (BATCH, SEQ, VOCAB)), dtype=torch.float32)
    return batch


def loss_fn_for(kind: str, normalization: str):
    loss = getattr(torchloss, kind)

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor], denominator) -> torch.Tensor:
        logits = model(batch["tokens"])
        target = batch["labels"] if kind == "cross_entropy" else batch["teacher"]
        return loss(logits, target, batch["loss_mask"], normalization=normalization, denominator=denominator,
                    **KIND_OPTIONS[kind])

    return loss_fn


def oracle(kind: str, normalization: str) -> tuple[float, dict[str, np.ndarray]]:
    """The float64 full-batch loss and ``emb`` / ``head`` gradients of :func:`make_model` on
    :func:`make_problem`'s batch (the same ``float_weights`` rule as the tests: float weights for
    ``"sum"``)."""
    model = make_model()
    batch = make_problem(kind, float_weights=(normalization == "sum"))
    target = batch["labels"] if kind == "cross_entropy" else batch["teacher"]
    return tiny_lm_oracle.reference(kind, normalization, model.emb.detach().numpy(), model.head.detach().numpy(),
                                     batch["tokens"].numpy(), target.numpy(), batch["loss_mask"].numpy(),
                                     **KIND_OPTIONS[kind])
