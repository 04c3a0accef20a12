"""The README and the guide pages are true: every ```python block runs as written (in a fresh
process, from the repository root: forked from a Python that has imported only third-party
packages, parity_tests/support/zygote.py, which is ``python -c`` without its imports' time), the README starts with the commands that set up and run
the project, every relative link points to a file of the repository, and the benchmark figures it
quotes are those of a recorded run on a clean tree.

Signatures and other text that is not meant to run go in ```text blocks. A guide page with
runnable examples is added to ``EXAMPLE_PAGES``. The numbers an example prints are checked too:
``ORACLE_CHECKS`` holds, per block, code run after it in the same interpreter that recomputes
what it printed with the float64 oracle (from the block's own inputs, in float64) and compares
the printed numbers, parsed from its output, at the SPEC loss bound.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from parity_tests.support import zygote

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PAGES = ("README.md", "docs/lossspec.md", "docs/jaxloss.md", "docs/torchloss.md",
                 "docs/distributed.md", "docs/lossparity.md")
README_MAX_LINES = 200


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


BLOCKS = [(page, index, code) for page in EXAMPLE_PAGES if (ROOT / page).exists()
          for index, code in enumerate(python_blocks(page))]


# Run before a block: its output is kept (still printed) so that the check after it can read it.
_CAPTURE = """\
import io as _io, sys as _sys
class _Tee(_io.TextIOBase):
    def __init__(self, out):
        self.out, self.seen = out, []
    def write(self, text):
        self.seen.append(text)
        return self.out.write(text)
    def flush(self):
        self.out.flush()
_tee = _Tee(_sys.stdout)
_sys.stdout = _tee
"""
# Run after a block, before its check: ``_numbers(i)`` are the numbers of the block's i-th printed
# line; ``_printed_matches(printed, oracle_loss, what)`` asserts a printed number at the loss bound.
_HELPERS = """\
import copy as _copy, re as _re
import numpy as _np
import lossspec as _spec
_sys.stdout = _tee.out
_lines = "".join(_tee.seen).splitlines()
_checked = []
def _numbers(line):
    return [float(n) for n in _re.findall(r"[-+]?(?:\\d+\\.\\d*|\\.\\d+|\\d+)(?:[eE][-+]?\\d+)?", _lines[line])]
def _f64(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu().double()
    return _np.asarray(x).astype(_np.float64)
def _printed_matches(printed, oracle_loss, what):
    _spec.compare_loss(printed, float(oracle_loss), what).check()
    _checked.append(what)
"""
_DONE = """
assert _checked
print("oracle checks:", ", ".join(_checked))
"""

# Per block ("page-index"): recompute the printed numbers with the float64 oracle.
ORACLE_CHECKS = {
    "README.md-0": """
torch.manual_seed(0)  # the block's first model, before its optimizer steps: step 0's loss
start = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100)).double()
ref, _ = _spec.oracle("cross_entropy", _f64(start(tokens)), labels.numpy(), label_smoothing=0.1)
_printed_matches(_numbers(0)[1], ref, "step 0 loss")
""",
    "README.md-1": """
start = TinyLM(100, 32, nnx.Rngs(0))  # the block's model before its first update: step 0's loss
logits = _f64(start.embed.embedding[...])[_np.asarray(tokens)] @ _f64(start.head.kernel[...]) + _f64(start.head.bias[...])
ref, _ = _spec.oracle("cross_entropy", logits, _np.asarray(labels), label_smoothing=0.1)
_printed_matches(_numbers(0)[1], ref, "step 0 loss")
""",
    "docs/lossspec.md-0": """
ref = case.reference(label_smoothing=0.1)
_printed_matches(_numbers(0)[0], ref.loss, "loss")
assert 0 <= _numbers(0)[1] <= 1
""",
    "docs/jaxloss.md-0": """
ref, _ = _spec.oracle("cross_entropy", _f64(logits), _np.asarray(labels), _np.asarray(loss_mask), label_smoothing=0.1, z_loss=1e-4)
_printed_matches(_numbers(0)[0], ref, "cross_entropy")
""",
    "docs/jaxloss.md-1": """
s, t, m = _f64(student), _f64(teacher), _np.asarray(mask)
for value, (kind, options) in zip(_numbers(0), [("soft_cross_entropy", {"temperature": 2.0}),
                                                 ("forward_kl", {"temperature": 2.0}), ("reverse_kl", {})]):
    _printed_matches(value, _spec.oracle(kind, s, t, m, **options)[0], kind)
""",
    "docs/jaxloss.md-2": """
ref, _ = _spec.oracle("cross_entropy", _f64(logits), _np.asarray(labels), _np.asarray(mask))
_printed_matches(_numbers(0)[0], ref, "sum of micro-batches")
_printed_matches(_numbers(0)[1], ref, "full batch")
""",
    "docs/jaxloss.md-3": """
logits = _f64(params["emb"])[_np.asarray(input_ids)] @ _f64(params["head"])
ref, _ = _spec.oracle("cross_entropy", logits, _np.asarray(input_ids), _np.asarray(padding), causal_shift=True)
_printed_matches(_numbers(0)[0], ref, "full batch")
_printed_matches(_numbers(0)[1], ref, "accumulate")
""",
    "docs/jaxloss.md-6": """
ref, _ = _spec.oracle("cross_entropy", _f64(logits), _np.asarray(labels), label_smoothing=0.1)
_printed_matches(_numbers(0)[0], ref, "vocab-parallel")
_printed_matches(_numbers(0)[1], ref, "full")
""",
    "docs/torchloss.md-0": """
ref, _ = _spec.oracle("cross_entropy", _f64(logits), labels.numpy(), mask.numpy(), label_smoothing=0.1, z_loss=1e-4)
_printed_matches(_numbers(0)[0], ref, "cross_entropy")
""",
    "docs/torchloss.md-2": """
ref, _ = _spec.oracle("cross_entropy", _f64(logits), labels.numpy())
_printed_matches(_numbers(0)[0], ref, "sum of micro-batches")
_printed_matches(_numbers(0)[1], ref, "full batch")
""",
    "docs/torchloss.md-3": """
logits = _f64(_copy.deepcopy(model).double()(input_ids))
ref, _ = _spec.oracle("cross_entropy", logits, input_ids.numpy(), padding.numpy(), causal_shift=True)
_printed_matches(_numbers(0)[0], ref, "full batch")
_printed_matches(_numbers(0)[1], ref, "accumulate")
""",
    "docs/torchloss.md-5": """
ref, _ = _spec.oracle("reverse_kl", _f64(logits), _f64(teacher), temperature=1.5)
_printed_matches(_numbers(0)[0], ref, "torch")
_printed_matches(_numbers(1)[0], ref, "triton")
""",
    "docs/distributed.md-1": """
logits = _f64(_copy.deepcopy(model).double()(batch["tokens"]))
ref, _ = _spec.oracle("cross_entropy", logits, batch["labels"].numpy(), batch["loss_mask"].numpy())
_printed_matches(_numbers(0)[0], ref, "accumulate")
""",
}


def test_pages_have_examples() -> None:
    assert len(python_blocks("README.md")) >= 2  # the torch and the Flax NNX quickstarts
    assert len(BLOCKS) >= 15


@pytest.fixture(scope="module")
def fresh_python() -> Iterator[zygote.Zygote]:
    """Where the blocks run: the environment of the tests with 2 host devices for JAX."""
    started = zygote.started(dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2"), ROOT)
    yield started
    started.close()


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{page}-{index}" for page, index, _ in BLOCKS])
def test_example_runs(page: str, index: int, code: str, fresh_python: zygote.Zygote) -> None:
    check = ORACLE_CHECKS.get(f"{page}-{index}")
    program = code if check is None else _CAPTURE + code + "\n" + _HELPERS + check + _DONE
    result = fresh_python.run(program, timeout=300)
    assert result.returncode == 0, f"{page} block {index} failed:\n{code}\n{result.stderr[-3000:]}"
    if check is not None:  # the printed numbers were compared with the oracle's
        assert "oracle checks: " in result.stdout, result.stdout[-2000:]


def test_fresh_python_runs_a_program_as_python_c_does(fresh_python: zygote.Zygote) -> None:
    """The forked children are what the blocks need of a new interpreter: fresh globals (JAX is
    imported in the zygote, yet a block without ``import jax`` fails), none of the repository's
    packages imported, JAX's devices from the block's environment (2 host devices), the exit
    code, both streams, the exit handlers, a traceback on an uncaught exception, and a kill at
    the timeout that leaves the zygote serving."""
    missing = fresh_python.run("print(jax.numpy.zeros(2))", timeout=60)
    assert missing.returncode == 1 and "NameError: name 'jax' is not defined" in missing.stderr
    seen = fresh_python.run(
        "import sys, atexit, jax\n"
        "atexit.register(print, 'exit handler ran')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lossspec', 'jaxloss', 'torchloss')), jax.device_count())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)",
        timeout=120,
    )
    assert seen.returncode == 3, seen.stderr
    assert seen.stdout.splitlines() == ["[] 2", "exit handler ran"] and seen.stderr == "to stderr\n"
    with pytest.raises(subprocess.TimeoutExpired):
        fresh_python.run("import time\ntime.sleep(60)", timeout=1)
    assert fresh_python.run("print('still serving')", timeout=60).stdout == "still serving\n"
    # A child that ends at once: its exit code can reach the pipe right behind its pid, and must
    # still be read (a buffered readline took both, and the select for the second waited in vain).
    out = fresh_python.folder / "quick.out"
    fresh_python._send({"code": "import sys\nsys.exit(5)", "stdout": str(out), "stderr": None})
    time.sleep(1.0)  # both answers are in the pipe before the first is read
    assert "pid" in fresh_python._reply(10.0) and fresh_python._reply(10.0) == {"returncode": 5}
    out.unlink()


def test_oracle_checks_name_existing_blocks() -> None:
    assert set(ORACLE_CHECKS) <= {f"{page}-{index}" for page, index, _ in BLOCKS}


def test_readme_starts_with_the_setup_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, flags=re.S)
    assert first_block and readme.index(first_block.group(0)) < readme.index("\n## ")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["bash scripts/main.sh", "bash scripts/test.sh"]
    assert any('pytest -m "not slow"' in command for command in commands)
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES


def test_relative_links_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # URLs and anchors within the page
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_quoted_benchmark_numbers_come_from_a_recorded_clean_run() -> None:
    """The README's performance paragraph quotes benchmarks/results/cpu_quick.json: the commit it
    names is the run's, the tree was clean, and every "N ms" is one of that run's medians."""
    import json

    readme = (ROOT / "README.md").read_text()
    paragraph = readme.split("## Performance", 1)[1].split("\n## ", 1)[0]
    run = json.loads((ROOT / "benchmarks" / "results" / "cpu_quick.json").read_text())
    git = run["meta"]["machine"]["git"]
    quoted_commit = re.search(r"commit `([0-9a-f]{7,40})`, clean tree", paragraph)
    assert quoted_commit and git["commit"].startswith(quoted_commit.group(1)) and git["dirty"] is False, (
        f"README quotes {quoted_commit and quoted_commit.group(1)}; cpu_quick.json is from {git}: update the paragraph")
    def median(value: float | list[float]) -> float:
        return value[1] if isinstance(value, list) else value  # peers: [min, median, max]

    measured = {round(1000 * median(seconds)) for row in run["summary"]
                for seconds in (row["ours_s"], row["sol_s"], *row["peers"].values()) if seconds is not None}
    quoted = [int(ms) for ms in re.findall(r"(\d+) ms", paragraph)]
    assert quoted and set(quoted) <= measured, f"not in cpu_quick.json: {sorted(set(quoted) - measured)}"
