"""The fused LM head at its edges, both frameworks against the float64 head oracle: float16
inputs, no token at all, every token masked, and NaN in the hidden states (of a counted token and
of a masked one: the chain rule's NaN pattern, the same in both frameworks and as unfused).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import lossspec
from lossspec import linear as spec_linear

from parity_tests.support.head_cases import KINDS, RUNNERS, options_for, grad_output_for, make_inputs, reference

FRAMEWORKS = list(RUNNERS)


def _compare(framework: str, kind: str, dtype: str, inputs: dict[str, Any], options: dict[str, Any]) -> tuple:
    grad_output = grad_output_for(options.get("normalization", "valid_tokens"), np.shape(inputs["loss_mask"]))
    loss, grads = RUNNERS[framework](kind, inputs, dtype, True, options, grad_output)
    ref_loss, ref_grads = reference(kind, inputs, True, options, grad_output)
    lossspec.compare_loss(loss, ref_loss, f"{framework} {kind} loss").check()
    for name, grad in grads.items():
        assert grad.shape == np.shape(ref_grads[name]), name
        spec_linear.compare_head_grad(grad, ref_grads[name], dtype, f"{framework} {kind} grad {name}", ref_grads.magnitude[name]).check()
    return loss, grads


@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_float16_inputs(framework: str, kind: str) -> None:
    _compare(framework, kind, "float16", make_inputs(kind, "float16", seed=3), options_for(kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_no_tokens(framework: str, kind: str) -> None:
    inputs = make_inputs(kind, "float32")
    for name in ("hidden", "loss_mask", "labels", "teacher_hidden"):
        if name in inputs:
            inputs[name] = inputs[name][:0]  # lead shape (0, 4)
    loss, grads = _compare(framework, kind, "float32", inputs, options_for(kind))
    assert float(loss) == 0.0
    assert not np.any(grads["weight"]) and not np.any(grads["bias"])


@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_token_masked(framework: str, kind: str) -> None:
    inputs = make_inputs(kind, "float32")
    inputs["loss_mask"] = np.zeros_like(inputs["loss_mask"])
    loss, grads = _compare(framework, kind, "float32", inputs, options_for(kind))
    assert float(loss) == 0.0
    assert all(not np.any(g) for g in grads.values())  # exact zeros


@pytest.mark.parametrize("masked", [False, True], ids=["counted", "masked"])
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_nan_hidden_state(framework: str, kind: str, masked: bool) -> None:
    inputs = make_inputs(kind, "float32", seed=5)
    inputs["loss_mask"] = np.ones_like(inputs["loss_mask"])
    if kind == "cross_entropy":
        inputs["labels"] = np.where(inputs["labels"] < 0, 0, inputs["labels"])  # every label valid
    token = (1, 2)
    inputs["hidden"][token + (0,)] = np.nan
    inputs["loss_mask"][token] = 0.0 if masked else 1.0
    loss, grads = _compare(framework, kind, "float32", inputs, options_for(kind))
    # a counted NaN token makes the loss NaN; a masked one does not
    assert np.isnan(float(loss)) != masked
    # the token's own hidden gradient: NaN when counted, exact zeros when masked
    row = grads["hidden"][token]
    assert np.all(np.isnan(row)) if not masked else not np.any(row)
    # the other tokens' hidden gradients stay finite (G W with finite rows of G and a finite W)
    others = np.delete(grads["hidden"].reshape(-1, grads["hidden"].shape[-1]), 1 * 4 + 2, axis=0)
    assert np.all(np.isfinite(others))
    # the weight gradient sums over tokens: a NaN (counted) row of G reaches it (masked: the
    # chain rule's 0 * NaN, whatever the oracle says, checked above)
    assert masked or np.any(np.isnan(grads["weight"]))


@pytest.mark.parametrize("recompute", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("norm", ["valid_tokens", "none"])
@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
def test_jax_head_under_data_parallel_shard_map(kind: str, norm: str, recompute: bool) -> None:
    """The fused head inside ``shard_map`` over a data axis (the default ``check_vma=True``):
    hidden states sharded, the weight replicated. The weight gradient of the replicated weight is
    the sum over replicas (as JAX's own autodiff gives): equal to the full batch's, vs the oracle.
    ``recompute_logits=True`` sums each vocabulary slice's gradient over the replicas before
    its one rounding."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map

    import jaxloss

    inputs = make_inputs(kind, "float32", seed=7)
    options = options_for(kind) | {"normalization": norm}
    if norm == "valid_tokens":  # the global denominator: every replica divides by the whole batch's count
        target = inputs["labels"] if kind == "cross_entropy" else None
        options["denominator"] = lossspec.count_denominator(target, inputs["loss_mask"])
    upstream = grad_output_for(norm, np.shape(inputs["loss_mask"]))
    ref_loss, ref_grads = reference(kind, inputs, False, options, upstream)
    mesh = Mesh(np.array(jax.devices()[:3]), ("data",))  # 3 rows of LEAD = (3, 4): one per replica
    fn = getattr(jaxloss, f"linear_{kind}")
    ce = kind == "cross_entropy"
    targets = (jnp.asarray(inputs["labels"], jnp.int32),) if ce else (
        jnp.asarray(inputs["teacher_hidden"]), jnp.asarray(inputs["teacher_weight"]), jnp.asarray(inputs["teacher_bias"]))
    target_specs = (P("data"),) if ce else (P("data"), P(), P())

    def step(hidden: Any, weight: Any, mask: Any, up: Any, *target: Any) -> Any:
        extra = {} if ce else {"teacher_bias": target[2]}

        def loss_of(hidden: Any, weight: Any) -> Any:
            return fn(hidden, weight, *target[:2], mask, **extra, **options, recompute_logits=recompute)

        loss, vjp = jax.vjp(loss_of, hidden, weight)
        if norm != "none":  # each replica's scalar loss gets the upstream gradient (a varying value)
            up = jax.lax.pcast(up, ("data",), to="varying")
        grad_hidden, grad_weight = vjp(up)
        return jax.lax.psum(jnp.sum(loss), "data"), grad_hidden, grad_weight

    mapped = shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P("data"), P("data") if norm == "none" else P()) + target_specs,
                       out_specs=(P(), P("data"), P()))
    loss, grad_hidden, grad_weight = jax.jit(mapped)(jnp.asarray(inputs["hidden"]), jnp.asarray(inputs["weight"]),
                                                     jnp.asarray(inputs["loss_mask"]), jnp.asarray(upstream), *targets)
    lossspec.compare_loss(float(loss), float(np.sum(ref_loss)), "loss").check()
    spec_linear.compare_head_grad(np.asarray(grad_hidden, np.float64), ref_grads["hidden"], "float32", "grad hidden", ref_grads.magnitude["hidden"]).check()
    spec_linear.compare_head_grad(np.asarray(grad_weight, np.float64), ref_grads["weight"], "float32", "grad weight", ref_grads.magnitude["weight"]).check()
