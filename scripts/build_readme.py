"""Assemble README.md from docs/_readme_head.md and the per-topic sections in docs/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["lossparity.md", "jaxloss.md", "torchloss.md", "distributed.md", "end_to_end.md", "benchmarks.md"]

parts = [(ROOT / "docs" / "_readme_head.md").read_text().rstrip()]
for name in SECTIONS:
    path = ROOT / "docs" / name
    if path.exists():
        parts.append(path.read_text().strip())
parts.append("## Tests\n\n`bash scripts/test.sh` runs `parity_tests/` (pytest, 2 workers): the oracle against finite\n"
             "differences, every backend against the oracle at the SPEC bounds, the parity command, the\n"
             "micro-batch/replica equivalence suites (JAX on 8 host devices, torch on gloo processes), the\n"
             "end-to-end training and every python block of this README. `.ci/run` calls it.")
(ROOT / "README.md").write_text("\n\n".join(parts) + "\n")
print("README.md:", sum(len(p.splitlines()) for p in parts), "lines")
