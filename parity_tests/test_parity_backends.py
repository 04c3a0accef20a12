"""The backend registries of both frameworks (``jaxloss.backends``, ``torchloss.backends``): the
names ``impl=`` takes, what ``"auto"`` picks for the losses and for the fused head, the head's
refusals (the same errors in both), and that every backend's modules offer what the orchestration
calls. No kernel runs here: the numbers of each backend are the other suites' business."""

from __future__ import annotations

import dataclasses
import inspect
import types

import jax
import pytest
import torch

import jaxloss
import jaxloss.backends as jax_backends
import lossspec
import torchloss.backends as torch_backends


class _Reference:
    """A stand-in for a tensor on a CUDA device (what the torch rules read of it)."""

    def __init__(self, dtype: torch.dtype = torch.float32, is_cuda: bool = True) -> None:
        self.dtype, self.is_cuda = dtype, is_cuda


def test_registries_hold_the_contracts_impl_names() -> None:
    assert ("auto", *sorted(jax_backends.IMPLEMENTATIONS)) == ("auto", *sorted(lossspec.JAX_IMPLS[1:]))
    assert ("auto", *sorted(torch_backends.IMPLEMENTATIONS)) == ("auto", *sorted(lossspec.TORCH_IMPLS[1:]))
    for registry in (jax_backends.IMPLEMENTATIONS, torch_backends.IMPLEMENTATIONS):
        assert all(name == backend.name for name, backend in registry.items())
    assert (jax_backends.PLAIN, torch_backends.PLAIN) == ("xla", "torch")


@pytest.mark.parametrize("backends", [jax_backends, torch_backends], ids=["jaxloss", "torchloss"])
def test_backends_are_frozen(backends: types.ModuleType) -> None:
    backend = backends.IMPLEMENTATIONS[backends.PLAIN]
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.name = "other"  # type: ignore[misc]


def test_jax_auto_for_losses_and_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Losses: Pallas on a GPU backend, XLA elsewhere; the head: XLA on every device."""
    for platform, losses in (("gpu", "pallas"), ("cpu", "xla"), ("tpu", "xla")):
        monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
        assert jax_backends.resolve("auto").name == losses
        assert jaxloss.resolve_impl("auto") == losses
        assert jax_backends.resolve("auto", head=True).name == "xla"
        for name in ("xla", "pallas"):
            assert jax_backends.resolve(name).name == name
        assert jax_backends.resolve("xla", head=True).name == "xla"


def test_torch_auto_for_losses_and_head() -> None:
    """Losses: Triton on CUDA tensors, the torch path elsewhere; the head: the torch path
    everywhere (its Triton kernels were retired: ``test_resolve_refuses_what_the_contract_refuses``)."""
    cpu, cuda = torch.zeros(2, 3), _Reference()
    assert torch_backends.resolve("auto", cpu).name == "torch"
    assert torch_backends.resolve("auto", cuda).name == "triton"
    assert torch_backends.resolve("auto", object()).name == "torch"  # not a tensor: the checks after refuse it
    assert torch_backends.resolve("auto", cuda, head=True).name == "torch"
    for reference in (cpu, cpu.double(), cuda, _Reference(torch.float64), _Reference(torch.bfloat16)):
        assert torch_backends.resolve("torch", reference, head=True).name == "torch"
    for name in ("torch", "triton"):
        assert torch_backends.resolve(name, cuda).name == name


@pytest.mark.parametrize("framework", ["jaxloss", "torchloss"])
def test_resolve_refuses_what_the_contract_refuses(framework: str) -> None:
    """An unknown impl, and the retired head kernels (with or without vocab_parallel): lossspec's
    errors, in both."""
    if framework == "jaxloss":
        resolve, impls, plain, kernels = (lambda impl, **kw: jax_backends.resolve(impl, **kw)), lossspec.JAX_IMPLS, "xla", "pallas"
    else:
        resolve, impls, plain, kernels = (lambda impl, **kw: torch_backends.resolve(impl, torch.zeros(1), **kw)), lossspec.TORCH_IMPLS, "torch", "triton"
    with pytest.raises(ValueError) as got:
        resolve("cuda")
    with pytest.raises(ValueError) as want:
        lossspec.check_impl("cuda", impls)
    assert str(got.value) == str(want.value)
    with pytest.raises(ValueError) as got:
        resolve(kernels, head=True)
    assert str(got.value) == lossspec.linear.HEAD_KERNELS_RETIRED.format(impl=kernels, plain=plain)
    registry = jax_backends if framework == "jaxloss" else torch_backends
    assert resolve(kernels).name == kernels and registry.IMPLEMENTATIONS[kernels].shard is not None  # the losses' kernels have shard steps


def test_jax_backends_offer_what_the_orchestration_calls() -> None:
    for backend in jax_backends.IMPLEMENTATIONS.values():
        kernels = backend.kernels()
        # the call's lossspec.Tuning goes to the kernels (they keep no module-level tuning)
        assert callable(kernels.fused) and "tuning" in inspect.signature(kernels.fused).parameters
        if not backend.higher_order:
            assert "first-order" in kernels.HIGHER_ORDER_MESSAGE
        shard = backend.shard_kernels()
        assert shard is None or (callable(shard.shard_stats) and callable(shard.shard_grad))
    plain = jax_backends.IMPLEMENTATIONS[jax_backends.PLAIN]
    assert plain.higher_order and plain.shard_kernels() is None


def test_torch_backends_offer_what_the_orchestration_calls() -> None:
    for backend in torch_backends.IMPLEMENTATIONS.values():
        kernels = backend.kernels()
        assert callable(kernels.forward) and callable(kernels.regrad_)
        shard = backend.shard_kernels()
        assert shard is None or (callable(shard.shard_stats) and callable(shard.shard_grad))
    plain = torch_backends.IMPLEMENTATIONS[torch_backends.PLAIN]
    assert plain.requires is None and plain.shard_kernels() is None
