"""The fused head's kernels on small shapes, shared by their suite (test_linear_head_kernels.py)
and the soft-cap suite: seeded inputs at shapes that split every axis into several interpreted
16 x 16 x 16 tiles with a ragged tail (N = 36, V = 37, H = 40, Ht = 20), and one runner per impl
(``"pallas"``: jaxloss, ``"triton"``: torchloss on ``torch_problem.TRITON_DEVICE``). Not a test
module."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxloss
import lossspec
import torchloss
from parity_tests.support.head_cases import make_inputs as head_inputs
from parity_tests.support.torch_problem import TRITON_DEVICE

KINDS = tuple(lossspec.KINDS)
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
    """``(loss, {name: grad})`` of ``linear_<kind>(..., impl=impl)`` (float64 NumPy)."""
    grad_output = grad_output_for(options)
    ids = options.get("segment_ids")
    if IMPLS[impl] == "jax":
        if ids is not None:
            options = {**options, "segment_ids": jnp.asarray(ids)}
        jdt = jnp.dtype(dtype)
        params = {"hidden": jnp.asarray(inputs["hidden"], jdt), "weight": jnp.asarray(inputs["weight"], jdt)}
        if with_bias:
            params["bias"] = jnp.asarray(inputs["bias"], jdt)
        if kind == "cross_entropy":
            target: tuple = (jnp.asarray(inputs["labels"], jnp.int32),)
            extra: dict[str, Any] = {}
        else:
            target = (jnp.asarray(inputs["teacher_hidden"], jdt), jnp.asarray(inputs["teacher_weight"], jdt))
            extra = {"teacher_bias": jnp.asarray(inputs["teacher_bias"], jdt)}
        fn = getattr(jaxloss, f"linear_{kind}")
        loss, vjp = jax.vjp(lambda p: fn(p["hidden"], p["weight"], *target, jnp.asarray(inputs["loss_mask"]), bias=p.get("bias"),
                                         **extra, **options, impl=impl), params)
        (grads,) = vjp(jnp.asarray(grad_output))
        assert all(grads[name].dtype == jdt for name in grads)
        return np.asarray(loss, np.float64), {k: np.asarray(g.astype(jnp.float32), np.float64) for k, g in grads.items()}
    if ids is not None:
        options = {**options, "segment_ids": torch.tensor(ids).to(TRITON_DEVICE)}
    tdt = getattr(torch, dtype)
    as_t = lambda a: torch.tensor(np.asarray(a, np.float32)).to(tdt).to(TRITON_DEVICE)  # noqa: E731  (exact)
    params = {"hidden": as_t(inputs["hidden"]), "weight": as_t(inputs["weight"])}
    if with_bias:
        params["bias"] = as_t(inputs["bias"])
    for p in params.values():
        p.requires_grad_(True)
    if kind == "cross_entropy":
        target = (torch.tensor(inputs["labels"]).to(TRITON_DEVICE),)
        extra = {}
    else:
        target = (as_t(inputs["teacher_hidden"]), as_t(inputs["teacher_weight"]))
        extra = {"teacher_bias": as_t(inputs["teacher_bias"])}
    fn = getattr(torchloss, f"linear_{kind}")
    loss = fn(params["hidden"], params["weight"], *target, torch.tensor(inputs["loss_mask"]).to(TRITON_DEVICE), bias=params.get("bias"),
              **extra, **options, impl=impl)
    loss.backward(torch.tensor(grad_output).to(TRITON_DEVICE))
    assert all(p.grad.dtype == tdt for p in params.values())
    return loss.detach().cpu().double().numpy(), {k: p.grad.cpu().float().double().numpy() for k, p in params.items()}
