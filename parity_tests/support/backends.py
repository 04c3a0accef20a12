"""The backends of the contract suite (``parity_tests/test_contract_*.py``): one small adapter per
``(framework, impl)`` with the same interface, so that one test body states a clause of
docs/spec.md once and every backend is a parameter of it (:func:`over_backends`).

An adapter takes NumPy inputs (logits, target, ``loss_mask``, and options such as
``segment_ids``, ``normalization``, ``denominator``: NumPy arrays among them become the
framework's arrays), calls the framework's public function of the kind with its ``impl``, and
returns float64 NumPy copies of the loss and of ``d(sum(loss * grad_output)) / d logits``
(:meth:`Backend.run`); :meth:`Backend.call` returns the framework's loss as it is, so that a bad
input raises the framework's own error. The kinds' signatures come from ``lossspec.KIND_SPECS``
(the target argument is the table's ``target`` trait).

Interpreted kernels (Pallas interpret mode, the Triton interpreter; compiled where a GPU is)
are marked ``slow`` and take the small shapes of :meth:`Backend.sized`; Triton's parameters are
skipped where triton is not installed (:func:`over_backends`, the parametrisation every contract
test uses). Not a test module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import pytest

import lossspec
from lossspec import KIND_SPECS

# The cases' leading shape [B, T] and vocabulary (not a power of two); the interpreted kernels'.
LEAD, SMALL_LEAD, VOCAB = (3, 8), (2, 4), 37


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A backend's answer as float64 NumPy copies, with the dtypes it had."""

    loss: np.ndarray  # () for the reduced modes, the leading shape for "none"
    grad: np.ndarray  # [..., V]: d(sum(loss * grad_output)) / d logits
    loss_dtype: str
    grad_dtype: str


@dataclasses.dataclass(frozen=True)
class Backend:
    """One ``(framework, impl)``; the subclasses hold the framework's conversions."""

    framework: str
    impl: str

    @property
    def id(self) -> str:
        return f"{self.framework}-{self.impl}"

    @property
    def interpreted(self) -> bool:
        """Whether this is a kernel impl (Pallas, Triton): interpreted on a machine without a GPU,
        so slow and given small shapes."""
        return self.impl in ("pallas", "triton")

    def sized(self, full: Any, small: Any) -> Any:
        """``small`` for the interpreted kernels (seconds per call at the full size), else ``full``."""
        return small if self.interpreted else full

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading shape ``[B, T]`` of the suite's cases (one shape: JAX compiles per shape)."""
        return self.sized(LEAD, SMALL_LEAD)

    @property
    def impls(self) -> tuple[str, ...]:
        """Every ``impl=`` the framework accepts."""
        raise NotImplementedError

    def call(self, kind: str, logits: Any, target: Any = None, loss_mask: Any = None, **options: Any) -> Any:
        """``<framework>.<kind>(logits, [target,] loss_mask, impl=<impl>, **options)`` on the
        host (CPU tensors in torch: where the value checks run), arrays converted as given (no
        cast); ``impl`` in ``options`` overrides the backend's."""
        raise NotImplementedError

    def run(self, kind: str, logits: np.ndarray, target: Optional[np.ndarray] = None, loss_mask: Optional[np.ndarray] = None,
            *, dtype: str = "float32", grad_output: Any = None, **options: Any) -> Outcome:
        """Loss and gradient of one call on this backend's device, the logits (and teacher logits)
        cast to ``dtype`` (their values are representable in it: lossspec.make_case), the upstream
        gradient ``grad_output`` (default 1; per token for ``"none"``)."""
        raise NotImplementedError

    def count_denominator(self, labels: Any = None, loss_mask: Any = None, **options: Any) -> float:
        """The framework's ``count_denominator`` on host arrays, as a float."""
        raise NotImplementedError


def _targets(kind: str, target: Any, convert: Any) -> tuple[Any, ...]:
    """The positional target argument of ``kind`` (none for a kind without a target)."""
    return () if KIND_SPECS[kind].target is None else (convert(target),)


class JaxBackend(Backend):
    @property
    def impls(self) -> tuple[str, ...]:
        return lossspec.JAX_IMPLS

    @staticmethod
    def _array(value: Any) -> Any:
        """A NumPy array or scalar as a JAX array; anything else as it is."""
        import jax.numpy as jnp

        return jnp.asarray(value) if isinstance(value, (np.ndarray, np.generic)) else value

    @classmethod
    def _options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Array options (``segment_ids``, a 0-d ``denominator``) as JAX arrays; scalars as given."""
        return {k: cls._array(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}

    def call(self, kind: str, logits: Any, target: Any = None, loss_mask: Any = None, **options: Any) -> Any:
        import jaxloss

        options = {"impl": self.impl, **self._options(options)}
        return getattr(jaxloss, kind)(self._array(logits), *_targets(kind, target, self._array), self._array(loss_mask), **options)

    def run(self, kind: str, logits: np.ndarray, target: Optional[np.ndarray] = None, loss_mask: Optional[np.ndarray] = None,
            *, dtype: str = "float32", grad_output: Any = None, **options: Any) -> Outcome:
        import jax
        import jax.numpy as jnp

        import jaxloss

        x = jnp.asarray(np.asarray(logits, np.float32)).astype(dtype)
        targets = _targets(kind, target, lambda t: jnp.asarray(t) if KIND_SPECS[kind].has_labels else jnp.asarray(t, jnp.float32).astype(dtype))
        mask = None if loss_mask is None else jnp.asarray(loss_mask)
        kwargs = self._options(options)
        fn = getattr(jaxloss, kind)
        loss, vjp = jax.vjp(lambda z: fn(z, *targets, mask, impl=self.impl, **kwargs), x)
        upstream = jnp.ones_like(loss) if grad_output is None else jnp.broadcast_to(jnp.asarray(grad_output, jnp.float32), loss.shape)
        (grad,) = vjp(upstream)
        return Outcome(np.asarray(loss, np.float64), np.asarray(grad.astype(jnp.float32), np.float64), str(loss.dtype), str(grad.dtype))

    def count_denominator(self, labels: Any = None, loss_mask: Any = None, **options: Any) -> float:
        import jaxloss

        return float(jaxloss.count_denominator(self._array(labels), self._array(loss_mask), **self._options(options)))


class TorchBackend(Backend):
    @property
    def impls(self) -> tuple[str, ...]:
        return lossspec.TORCH_IMPLS

    @staticmethod
    def _tensor(value: Any, device: Any = None) -> Any:
        """A NumPy array (or scalar) as a tensor sharing its memory where it can (so that a
        modified input would show), extension floats (ml_dtypes' bfloat16, float8) through
        float32; anything else as it is."""
        import torch

        if not isinstance(value, (np.ndarray, np.generic)):
            return value
        array = np.asarray(value)
        try:
            tensor = torch.from_numpy(array)
        except TypeError:  # ml_dtypes' floats (bfloat16, float8_*): torch.from_numpy does not know them
            tensor = torch.from_numpy(array.astype(np.float32)).to(getattr(torch, array.dtype.name))
        return tensor if device is None else tensor.to(device)

    @classmethod
    def _options(cls, options: dict[str, Any], device: Any = None) -> dict[str, Any]:
        """Array options (``segment_ids``, a 0-d ``denominator``) as tensors; scalars as given."""
        return {k: cls._tensor(v, device) if isinstance(v, np.ndarray) else v for k, v in options.items()}

    def call(self, kind: str, logits: Any, target: Any = None, loss_mask: Any = None, **options: Any) -> Any:
        import torchloss
        from parity_tests.support.torch_cases import quiet

        options = {"impl": self.impl, **self._options(options)}
        with quiet():
            return getattr(torchloss, kind)(self._tensor(logits), *_targets(kind, target, self._tensor), self._tensor(loss_mask), **options)

    def run(self, kind: str, logits: np.ndarray, target: Optional[np.ndarray] = None, loss_mask: Optional[np.ndarray] = None,
            *, dtype: str = "float32", grad_output: Any = None, **options: Any) -> Outcome:
        import torch

        import torchloss
        from parity_tests.support.torch_cases import quiet
        from parity_tests.support.torch_problem import device_for

        device = device_for(self.impl)  # impl="triton" on CUDA where there is one, else the CPU
        torch_dtype = getattr(torch, dtype)
        x = self._tensor(logits, device).to(torch_dtype).requires_grad_(True)
        targets = _targets(kind, target, lambda t: self._tensor(t, device) if KIND_SPECS[kind].has_labels else self._tensor(t, device).to(torch_dtype))
        kwargs = self._options(options, device)
        with quiet():
            loss = getattr(torchloss, kind)(x, *targets, self._tensor(loss_mask, device), impl=self.impl, **kwargs)
            upstream = torch.ones_like(loss) if grad_output is None else torch.as_tensor(np.asarray(grad_output, np.float32)).to(device)
            loss.backward(upstream.expand_as(loss))
        assert x.grad is not None
        return Outcome(loss.detach().cpu().double().numpy(), x.grad.cpu().double().numpy(), str(loss.dtype).removeprefix("torch."),
                       str(x.grad.dtype).removeprefix("torch."))

    def count_denominator(self, labels: Any = None, loss_mask: Any = None, **options: Any) -> float:
        import torchloss

        return float(torchloss.count_denominator(self._tensor(labels), self._tensor(loss_mask), **self._options(options)))


JAX_XLA = JaxBackend("jax", "xla")
JAX_PALLAS = JaxBackend("jax", "pallas")
TORCH_TORCH = TorchBackend("torch", "torch")
TORCH_TRITON = TorchBackend("torch", "triton")
ALL_BACKENDS = (JAX_XLA, JAX_PALLAS, TORCH_TORCH, TORCH_TRITON)
# One backend per framework, for what does not depend on impl= (count_denominator); ids "jax", "torch".
FRAMEWORKS = (JAX_XLA, TORCH_TORCH)
NO_TRITON = importlib.util.find_spec("triton") is None


def _id(value: Any) -> str:
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def over_backends(argnames: str = "", combos: Sequence[Any] = (), *, ids: Optional[Sequence[str]] = None,
                  cover: Optional[Callable[..., bool]] = None, xla_fast: Optional[Callable[..., bool]] = None,
                  backends: Sequence[Backend] = ALL_BACKENDS) -> Any:
    """``pytest.mark.parametrize("backend, <argnames>", ...)``: the backends with the combos (a
    tuple per combo; a bare value for one argname), ids ``<framework>-<impl>-<combo>``
    (``<framework>-<combo>`` for :data:`FRAMEWORKS`).

    Every new configuration of a call (kind, options, dtype, mask type, shapes) costs JAX a
    compile and the kernels a compile or an interpreted run (about 0.5 to 2 s on the CPU), the
    torch path next to nothing. So the torch path runs every combo, in the fast lane; the other
    backends run the combos of ``cover`` (default: all; a rotation in which every kind, mode,
    dtype, ... of the test occurs at least once), XLA those of ``xla_fast`` (within ``cover``) in
    the fast lane and the rest of its cover in the slow tier; the interpreted kernels (Pallas,
    Triton: the small shapes of :meth:`Backend.sized`) are ``slow`` (the conftest marks ids naming
    them slow too). Triton's combos are skipped where triton is not installed."""
    names = "backend" + (f",{argnames}" if argnames else "")
    rows = [(c if "," in argnames else (c,)) for c in combos] if argnames else [()]
    labels = list(ids) if ids is not None else ["-".join(_id(v) for v in row) for row in rows]
    params = []
    for backend in backends:
        for row, label in zip(rows, labels):
            if backend is not TORCH_TORCH and cover is not None and not cover(*row):
                continue
            marks: list[Any] = []
            if backend.interpreted or (backend is JAX_XLA and xla_fast is not None and not xla_fast(*row)):
                marks.append(pytest.mark.slow)
            if backend is TORCH_TRITON and NO_TRITON:
                marks.append(pytest.mark.skip(reason="triton is not installed (it has wheels for Linux only)"))
            name = backend.framework if backends is FRAMEWORKS else backend.id
            params.append(pytest.param(backend, *row, id=f"{name}-{label}" if label else name, marks=marks))
    return pytest.mark.parametrize(names, params)


def never(*combo: Any) -> bool:
    """``xla_fast=never``: XLA's combos of the test all in the slow tier (the torch path is the
    fast lane's cover of the clause)."""
    return False


def over_frameworks(argnames: str = "", combos: Sequence[Any] = (), *, ids: Optional[Sequence[str]] = None,
                    xla_fast: Optional[Callable[..., bool]] = None) -> Any:
    """:func:`over_backends` over :data:`FRAMEWORKS` (the parameter is still named ``backend``),
    for the functions without ``impl=``."""
    return over_backends(argnames, combos, ids=ids, xla_fast=xla_fast, backends=FRAMEWORKS)


# --------------------------------------------------------------------------------------------
# Against the oracle
# --------------------------------------------------------------------------------------------


def check(backend: Backend, case: lossspec.Case, *, grad_output: Any = None, reference_mask: Optional[np.ndarray] = None,
          **options: Any) -> Outcome:
    """Run ``case`` (its dtype, its mask) on ``backend`` and assert SPEC section 6 against the
    float64 oracle with the same options (``lossspec.assert_close_to_oracle``, the bound of
    ``lossspec.tolerances``); the loss has the labels' leading shape for ``"none"``, else
    ``()``. ``reference_mask``: the mask the oracle and ``G0`` see instead of the case's (a
    broadcast mask's expansion)."""
    out = backend.run(case.kind, case.logits, case.target, case.loss_mask, dtype=case.dtype, grad_output=grad_output, **options)
    ref_case = case if reference_mask is None else dataclasses.replace(case, loss_mask=reference_mask)
    ref_options = {k: (float(v) if k == "denominator" else v) for k, v in options.items()}
    if grad_output is not None:
        ref_options["grad_output"] = np.asarray(np.asarray(grad_output, np.float32), np.float64)
    ref = ref_case.reference(**ref_options)
    lead = case.logits.shape[:-1] if options.get("normalization") == "none" else ()
    assert out.loss.shape == lead, f"{backend.id}: loss shape {out.loss.shape}, expected {lead}"
    lossspec.assert_close_to_oracle(out.loss, out.grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0,
                                    what=f"{backend.id} {case.name} {options}")
    return out


def sample_options(kind: str, *, skip: tuple[str, ...] = ("ignore_index", "logit_softcap", "teacher_logit_softcap", "causal_shift")) -> dict[str, Any]:
    """Every option of ``kind`` in the kind table, bar ``skip``, at a value other than its default
    (:data:`OPTION_VALUES`): the options together, so that each shows."""
    return {name: OPTION_VALUES[name] for name in KIND_SPECS[kind].option_names if name not in skip}


# A non-default value of every option of the kind table (a test fails if the table grows an
# option this does not know: sample_options reads it).
OPTION_VALUES: dict[str, Any] = {
    "ignore_index": 5,
    "label_smoothing": 0.1,
    "z_loss": 1e-3,
    "logit_scale": 1.3,
    "temperature": 1.5,
    "teacher_logit_scale": 0.8,
    "beta": 0.3,
    "logit_softcap": 3.5,
    "teacher_logit_softcap": 5.0,
    "causal_shift": True,
}


def xla_cover() -> tuple[str, ...]:
    """The kinds XLA runs in the fast lane where a test compiles per kind: one kind per target
    type and the kinds with a mixture pass (the tests share their configurations: one compile
    per kind and worker)."""
    return tuple(dict.fromkeys(kinds_by_target() + tuple(k for k, spec in KIND_SPECS.items() if spec.mixture_pass)))


def kinds_by_target() -> tuple[str, ...]:
    """One kind per target type of the table (labels, teacher logits, none): the first of each."""
    seen: dict[Any, str] = {}
    for kind, spec in KIND_SPECS.items():
        seen.setdefault(spec.target, kind)
    return tuple(seen.values())
