"""Assemble README.md from docs/_readme_head.md and the per-topic sections in docs/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["lossparity.md", "jaxloss.md", "torchloss.md", "distributed.md", "end_to_end.md", "benchmarks.md"]

parts = [(ROOT / "docs" / "_readme_head.md").read_text().rstrip()]


def latest_results() -> str:
    """The summary of the latest CPU (and, once measured, GPU) benchmark runs, with their machine."""
    out = []
    for device in ("cpu", "gpu"):
        for mode in ("quick", "full"):
            md = ROOT / "benchmarks" / "results" / f"{device}_{mode}.md"
            if not md.exists():
                continue
            text = md.read_text()
            summary = text.split("All measurements:")[0].strip()
            out.append(f"### Latest {device.upper()} results (`{mode}`)\n\n{summary}\n\n"
                       f"Every measurement, and the plots: `benchmarks/results/{device}_{mode}.md`, "
                       f"`{device}_{mode}.json`, `{device}_{mode}_time.png`, `{device}_{mode}_memory.png`.")
            full = ROOT / "benchmarks" / "results" / f"{device}_full.md"
            if mode == "quick" and full.exists():
                command = next((line for line in full.read_text().splitlines() if line.startswith("Command:")), "")
                out.append(f"The sweep over N and V: `benchmarks/results/{device}_full.md` (and its plots); {command}")
            break  # the quick run is the headline
    if not any(line.startswith("### Latest GPU") for line in out):
        out.append("### GPU results\n\nNot measured yet: no GPU session has run `benchmarks/gpu_check.sh`.")
    return "\n\n".join(out)


for name in SECTIONS:
    path = ROOT / "docs" / name
    if path.exists():
        parts.append(path.read_text().strip().replace("RESULTS_PLACEHOLDER", latest_results()))
parts.append("## Tests\n\n`bash scripts/test.sh` runs `parity_tests/` (pytest, 2 workers): the oracle against finite\n"
             "differences, every backend against the oracle at the SPEC bounds, the parity command, the\n"
             "micro-batch/replica equivalence suites (JAX on 8 host devices, torch on gloo processes), the\n"
             "end-to-end training and every python block of this README. `.ci/run` calls it.")
(ROOT / "README.md").write_text("\n\n".join(parts) + "\n")
print("README.md:", sum(len(p.splitlines()) for p in parts), "lines")
