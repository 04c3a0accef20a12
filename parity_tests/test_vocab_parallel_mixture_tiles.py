"""``jensen_shannon``'s vocab-parallel mixture pass (its second pass over the shard) is tiled in
both frameworks: its fp32 temporaries are one tile, whatever the shard's width, and its sums
are the oracle's.

One process, one "shard" holding a whole row (the mixture sums of a shard need only the global
final statistics, which a single shard's are): ``mixture_shard_sums`` with tiny tiles (several
row tiles and column blocks, ragged ones) against the float64 oracle's per-token JSD, and the
tile sizes it actually works on (torch: the blocks handed to the block math; JAX: every fp32
array of the traced program).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import lossspec
from jaxloss import _block as jax_stats
from jaxloss.backends import vocab_parallel as jax_vp
from torchloss import _block as torch_stats
from torchloss.backends import vocab_parallel as torch_vp

ROWS, VOCAB = 7, 45
# (softcap, dtype): the fast lane keeps the float32 case with caps; the others are slow.
CASES = [pytest.param(cap, dtype, marks=[] if (cap, dtype) == (3.0, "float32") else [pytest.mark.slow])
         for cap in (None, 3.0) for dtype in ("float32", "bfloat16")]
OPTIONS = {"beta": 0.3, "temperature": 1.4, "logit_scale": 0.9, "teacher_logit_scale": 1.2}


def _problem(dtype: str, **options: Any) -> tuple[lossspec.LossConfig, lossspec.Case, np.ndarray]:
    case = lossspec.make_case("jensen_shannon", "neg_inf", lead_shape=(ROWS,), vocab=VOCAB, dtype=dtype, seed=11)
    options = {**OPTIONS, **options}
    config = lossspec.make_config("jensen_shannon", normalization="none", **options)
    ref, _ = lossspec.oracle("jensen_shannon", case.logits, case.target, None, normalization="none", **options)
    return config, case, np.asarray(ref)


@pytest.mark.parametrize("softcap,dtype", CASES)
def test_torch_mixture_pass_is_tiled(dtype: str, softcap: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    config, case, ref = _problem(dtype, logit_softcap=softcap, teacher_logit_softcap=softcap)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    x = torch.from_numpy(case.logits).to(tdt)
    t = torch.from_numpy(case.target).to(tdt)
    coef = torch.ones(ROWS)
    fin = torch_stats.finalize(config, torch_vp.local_stats(config, x, t, coef, 0), VOCAB)
    seen: list[tuple[int, int]] = []
    real = torch_stats.mixture_sums

    def spy(cfg: Any, part: Any, xb: torch.Tensor, tb: torch.Tensor, cache: Any) -> Any:
        seen.append(tuple(xb.shape))
        return real(cfg, part, xb, tb, cache)

    monkeypatch.setattr(torch_stats, "mixture_sums", spy)
    tuning = lossspec.Tuning(cpu_tile_elements=16)  # column blocks of 16 (45 = 16 + 16 + 13), 1 row a tile
    sums = torch_vp.mixture_shard_sums(config, fin, x, t, tuning)
    loss = lossspec.stats.finalize_mixture(torch, config, fin, sums[0], sums[1]).l
    lossspec.compare_loss(loss.double().numpy(), ref, f"torch mixture tiles {dtype}").check()
    assert seen and max(r * c for r, c in seen) <= 16
    assert sum(r * c for r, c in seen) == ROWS * VOCAB  # every entry once


def _float_sizes(jaxpr: Any) -> list[tuple[str, int]]:
    """``(primitive, size)`` of every float array a traced program makes, sub-programs included."""
    out = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                out.append((eqn.primitive.name, int(np.prod(aval.shape))))
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
            out += _float_sizes(sub)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out += _float_sizes(inner)
            elif hasattr(param, "eqns"):
                out += _float_sizes(param)
    return out


@pytest.mark.parametrize("softcap,dtype", CASES)
def test_jax_mixture_pass_is_tiled(dtype: str, softcap: Any) -> None:
    config, case, ref = _problem(dtype, logit_softcap=softcap, teacher_logit_softcap=softcap)
    cfg = jax_stats.KernelConfig.of(config)
    x = jnp.asarray(case.logits).astype(dtype)
    t = jnp.asarray(case.target).astype(dtype)
    stats, _, _ = jax_stats.block_stats(cfg, x.astype(jnp.float32), t.astype(jnp.float32))
    fin = jax_stats.finalize(cfg, stats, VOCAB)
    # Chunks of 3 rows (7 = 3 + 3 + 1, the last moved back) in column blocks of 8 (45 = 5 * 8 + 5).
    tuning = lossspec.Tuning(chunk_elements=24, single_block_vocab=8, vocab_block=8)
    fn = jax.jit(lambda f, a, b: jax_vp.mixture_shard_sums(cfg, f, a, b, tuning))
    kl_qm, kl_pm = fn(fin, x, t)
    loss = lossspec.stats.finalize_mixture(jnp, cfg, fin, kl_qm, kl_pm).l
    lossspec.compare_loss(np.asarray(loss, np.float64), ref, f"jax mixture tiles {dtype}").check()
    # The program's float arrays: [N]-sized sums and [3, 8] blocks; a [3, 45] chunk only as the
    # row slice of the input (a dynamic_slice, which XLA fuses into the block's slice: for 16-bit
    # logits it holds raw bits, not floats).
    sizes = _float_sizes(jax.make_jaxpr(lambda f, a, b: jax_vp.mixture_shard_sums(cfg, f, a, b, tuning))(fin, x, t).jaxpr)
    big = [(name, size) for name, size in sizes if size > max(ROWS, 3 * 8) and name != "dynamic_slice"]
    assert not big, big
