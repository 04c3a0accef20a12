"""The fused head's kernels on small shapes, shared by their suite (test_linear_head_kernels.py)
and the soft-cap suite: seeded inputs at shapes that split every axis into several interpreted
16 x 16 x 16 tiles with a ragged tail (N = 36, V = 37, H = 40, Ht = 20), and one runner per impl
(``"pallas"``: jaxloss, ``"triton"``: torchloss on ``torch_problem.TRITON_DEVICE``). Not a test
module."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

import lossspec
from parity_tests.support.head_cases import make_inputs as head_inputs, run_jax, run_torch
from parity_tests.support.torch_problem import TRITON_DEVICE

KINDS = tuple(lossspec.HEAD_KINDS)
LEAD, H, HT, V = (4, 9), 40, 20, 37
IMPLS = {"pallas": "jax", "triton": "torch"}


def make_inputs(kind: str, dtype: str, seed: int = 0) -> dict[str, Any]:
    """Seeded inputs exactly representable in ``dtype`` (``test_linear_head.make_inputs`` at this
    file's shapes); float mask weights with zeros and one ignored label."""
    return head_inputs(kind, dtype, seed, lead=LEAD, sizes=(H, HT, V), weight_scales=(0.4, 0.5))


def grad_output_for(options: dict[str, Any]) -> np.ndarray:
    if options.get("normalization") == "none":
        return np.linspace(0.5, 2.0, int(np.prod(LEAD))).reshape(LEAD).astype(np.float32)
    return np.asarray(1.75, np.float32)


def run(impl: str, kind: str, inputs: dict[str, Any], dtype: str, with_bias: bool, options: dict[str, Any]) -> tuple:
    """``(loss, {name: grad})`` of ``linear_<kind>(..., impl=impl)`` (float64 NumPy): the head
    suites' runners (:mod:`parity_tests.support.head_cases`) with ``impl``, Triton's tensors on
    ``TRITON_DEVICE``."""
    grad_output = grad_output_for(options)
    ids = options.get("segment_ids")
    if IMPLS[impl] == "jax":
        if ids is not None:
            options = {**options, "segment_ids": jnp.asarray(ids)}
        return run_jax(kind, inputs, dtype, with_bias, {**options, "impl": impl}, grad_output)
    if ids is not None:
        options = {**options, "segment_ids": torch.tensor(ids).to(TRITON_DEVICE)}
    return run_torch(kind, inputs, dtype, with_bias, {**options, "impl": impl}, grad_output, device=TRITON_DEVICE)
