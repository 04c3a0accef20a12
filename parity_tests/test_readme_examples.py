"""The README and the guide pages are true: every ```python block runs as written (in a fresh
interpreter, from the repository root), the README starts with the commands that set up and run
the project, every relative link points to a file of the repository, and the benchmark figures it
quotes are those of a recorded run on a clean tree.

Signatures and other text that is not meant to run go in ```text blocks. A guide page with
runnable examples is added to ``EXAMPLE_PAGES``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_PAGES = ("README.md", "docs/lossspec.md", "docs/jaxloss.md", "docs/torchloss.md",
                 "docs/distributed.md", "docs/lossparity.md")
README_MAX_LINES = 200


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


BLOCKS = [(page, index, code) for page in EXAMPLE_PAGES if (ROOT / page).exists()
          for index, code in enumerate(python_blocks(page))]


def test_pages_have_examples() -> None:
    assert len(python_blocks("README.md")) >= 2  # the torch and the Flax NNX quickstarts
    assert len(BLOCKS) >= 15


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{page}-{index}" for page, index, _ in BLOCKS])
def test_example_runs(page: str, index: int, code: str) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, f"{page} block {index} failed:\n{code}\n{result.stderr[-3000:]}"


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
