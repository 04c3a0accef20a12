"""Packed documents with ``normalization="sequence_mean"``: the full-batch step, K micro-batches
and D replicas train identically in JAX and torch; the naive per-micro-batch mean does not.

    python -m examples.packed_docs.demo [--steps 12] [--rows 16] [--out packed_docs_out]

Rows of 64 bytes are packed with documents of 3 to 60 bytes (``data.py``); the tiny LM
(``examples/tiny_lm``, attention restricted to each document, head tied to the embedding) is
trained with plain SGD on ``cross_entropy(..., segment_ids=, causal_shift=True,
normalization="sequence_mean")``: every document counts the same, ``loss = (1/S) sum_s mean_s``.
Runs, in both frameworks, from the same NumPy weights on the same batches:

  (a) ``full batch``   one call per step;
  (b) ``K=4``          4 micro-batches through ``accumulate`` (``S`` counted over all of them);
  (c) ``D=2``, ``D=2,K=2``  2 replicas: JAX ``shard_map`` over 2 CPU devices with
                       ``accumulate(data_axes=)``; torch simulated in one process (counts summed,
                       then each replica's gradients summed: what ``all_reduce(SUM)`` does);
  (d) ``naive K=4``    each micro-batch's own sequence mean, averaged over the 4.

Bound: SPEC section 6 bounds each step's gradient by ``GRAD_RTOL * S`` (``S = max|grad|`` of the
tensor); the update ``param - lr * grad`` rounds to float32 (one ulp of the parameter). Summed
over the SGD steps, a parameter may be ``sum_steps (lr * GRAD_RTOL * S + ulp(max|param|))`` from
the full-batch run (:func:`param_bounds`; this ignores how SGD carries a difference forward,
which over these short runs is far smaller). (b) and (c) must stay within it at every step;
(d) is reported in units of it (it is off by far more). JAX vs torch (a): within twice the bound.
Writes ``packed.json`` and ``packed.png``; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np  # noqa: E402

from lossspec import GRAD_RTOL, ulp  # noqa: E402

LR = 0.5
HIDDEN = 32
BASE = "full batch"
CONFIGS = {  # name -> (micro-batches K, replicas D, naive)
    BASE: (1, 1, False),
    "K=4": (4, 1, False),
    "D=2": (1, 2, False),
    "D=2,K=2": (2, 2, False),
    "naive K=4": (4, 1, True),
}

History = dict[str, Any]


def param_bounds(base: History, lr: float) -> list[dict[str, float]]:
    """Per step ``t`` and tensor: ``sum_{s <= t} (lr * GRAD_RTOL * max|grad_s| + ulp(max|param_s|))``
    of the base run: the SPEC bound on each step's gradient, plus one float32 ulp per step for the
    rounding of the update ``param - lr * grad`` itself (two runs whose gradients differ in the last
    bit may round a parameter near 1 to neighbouring floats)."""
    bounds, total = [], {name: 0.0 for name in base["grad_max"][0]}
    for grad_max, params in zip(base["grad_max"], base["params"]):
        total = {name: total[name] + lr * GRAD_RTOL * grad_max[name] + float(ulp(np.max(np.abs(params[name])), "float32"))
                 for name in total}
        bounds.append(dict(total))
    return bounds


def param_gaps(run: History, base: History, bounds: list[dict[str, float]]) -> tuple[list[float], list[float]]:
    """Per step: ``max |param - base param|`` over every tensor, and the largest ratio of a
    tensor's max difference to its bound."""
    diffs, ratios = [], []
    for params, base_params, bound in zip(run["params"], base["params"], bounds):
        gaps = {name: float(np.max(np.abs(params[name].astype(np.float64) - base_params[name]))) for name in base_params}
        diffs.append(max(gaps.values()))
        ratios.append(max(gaps[name] / bound[name] if bound[name] > 0 else (np.inf if gaps[name] else 0.0) for name in gaps))
    return diffs, ratios


def evaluate(runs: dict[str, dict[str, History]], lr: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The checks (every config vs the full batch in its framework; JAX vs torch) and the per-step
    gaps for the plot and the JSON."""
    checks, gaps = [], {}
    for framework, histories in runs.items():
        base = histories[BASE]
        bounds = param_bounds(base, lr)
        for config, history in histories.items():
            if config == BASE:
                continue
            diffs, ratios = param_gaps(history, base, bounds)
            gaps[f"{framework} {config}"] = {"max_abs_param_diff": diffs, "ratio_to_bound": ratios}
            naive = CONFIGS[config][2]
            checks.append({"check": f"{framework}: {config} vs {BASE}", "max_abs_param_diff": max(diffs),
                           "ratio_to_bound": max(ratios), "expect": "differ" if naive else "equal",
                           "ok": max(ratios) > 1.0 if naive else max(ratios) <= 1.0})
    if {"jax", "torch"} <= set(runs):
        bounds = param_bounds(runs["jax"][BASE], lr)
        diffs, ratios = param_gaps(runs["torch"][BASE], runs["jax"][BASE], bounds)
        gaps[f"torch {BASE} vs jax"] = {"max_abs_param_diff": diffs, "ratio_to_bound": ratios}
        checks.append({"check": f"jax vs torch, {BASE}", "max_abs_param_diff": max(diffs), "ratio_to_bound": max(ratios),
                       "expect": "equal (2x bound)", "ok": max(ratios) <= 2.0})
    return checks, gaps


def run(steps: int, rows: int, configs: list[str], out: Path | None, frameworks: tuple[str, ...] = ("jax", "torch"),
        hidden: int = HIDDEN, lr: float = LR) -> dict[str, Any]:
    from examples.tiny_lm.demo import Progress
    from examples.tiny_lm.weights import init_weights

    from . import train_jax, train_torch
    from .data import ROW, make_packed_data

    data = make_packed_data(steps, rows)
    batches = [data.batch(i) for i in range(steps)]
    ids = batches[0]["segment_ids"]
    docs = [int(len(np.unique(row[row >= 0]))) for row in ids]
    quarter = rows // 4
    print(f"data: {rows} rows of {ROW} bytes per step; documents per row at step 0: {docs}; "
          f"per micro-batch of K=4: {[sum(docs[k * quarter:(k + 1) * quarter]) for k in range(4)]}")
    weights = init_weights(hidden=hidden, seed=0, seq=ROW)
    trainers = {"jax": train_jax.train, "torch": train_torch.train}
    runs: dict[str, dict[str, History]] = {}
    for framework in frameworks:
        for config in configs:
            k, replicas, naive = CONFIGS[config]
            runs.setdefault(framework, {})[config] = trainers[framework](
                weights, batches, lr=lr, num_microbatches=k, replicas=replicas, naive=naive,
                progress=Progress(f"{framework} {config}", steps))
    checks, gaps = evaluate(runs, lr)
    losses = {f"{framework} {config}": h["losses"] for framework, histories in runs.items() for config, h in histories.items()}
    result = {"checks": checks, "losses": losses, "gaps": gaps, "lr": lr, "grad_rtol": GRAD_RTOL, "steps": steps, "rows": rows}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "packed.json").write_text(json.dumps(result, indent=1))
        plot(result, out / "packed.png")
    result["runs"] = runs
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    styles = {"jax": "-", "torch": "--"}
    for name, losses in sorted(result["losses"].items()):
        axes[0].plot(range(1, len(losses) + 1), losses, styles[name.split(" ")[0]], label=name,
                     linewidth=2.5 if "naive" in name else 1.2, alpha=0.85)
    axes[0].set(title="logged loss (sequence_mean)", xlabel="optimizer step", ylabel="loss")
    for name, gap in sorted(result["gaps"].items()):
        steps = range(1, len(gap["max_abs_param_diff"]) + 1)
        style = styles[name.split(" ")[0]]
        axes[1].semilogy(steps, np.maximum(gap["max_abs_param_diff"], 1e-12), style, label=name)
        axes[2].semilogy(steps, np.maximum(gap["ratio_to_bound"], 1e-6), style, label=name)
    axes[1].set(title=f"max |param - {BASE} param| (floor 1e-12)", xlabel="optimizer step")
    axes[2].axhline(1.0, color="red", linestyle=":", label="bound: sum over steps of lr GRAD_RTOL max|grad| + ulp(param)")
    axes[2].set(title="the same in units of the bound (floor 1e-6)", xlabel="optimizer step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("packed documents: K micro-batches and D replicas equal the full batch (JAX solid, torch dashed); the naive mean of micro-batch means does not")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.packed_docs.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="SGD steps per run (default 12)")
    parser.add_argument("--rows", type=int, default=16, help="packed rows per step, divisible by 4 (default 16)")
    parser.add_argument("--out", default="packed_docs_out", help="folder for packed.json and packed.png")
    args = parser.parse_args(argv)
    from examples.tiny_lm.demo import single_threaded_torch

    single_threaded_torch()  # why: its docstring
    start = time.perf_counter()
    result = run(args.steps, args.rows, list(CONFIGS), Path(args.out))
    print(f"\n{'check':34s} {'max |param diff|':>16s} {'/ bound':>9s}  expected  result")
    for check in result["checks"]:
        print(f"{check['check']:34s} {check['max_abs_param_diff']:16.3e} {check['ratio_to_bound']:9.3g}  "
              f"{check['expect']:8s}  {'ok' if check['ok'] else 'FAIL'}")
    print("final logged loss: " + ", ".join(f"{name} {values[-1]:.4f}" for name, values in sorted(result["losses"].items())))
    print(f"wrote {args.out}/packed.json and {args.out}/packed.png ({time.perf_counter() - start:.0f} s)")
    return 0 if all(check["ok"] for check in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
