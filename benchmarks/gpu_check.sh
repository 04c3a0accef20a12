#!/usr/bin/env bash
# One run on an NVIDIA GPU machine checks and measures everything, within 10 minutes:
#   1. installs the CUDA builds (scripts/setup.sh: torch==2.13.0 and jax[cuda12]==0.10.2, the
#      project with its extras) plus the GPU peers: liger-kernel, and flash-attn's Triton
#      cross-entropy (one file taken from the flash-attn sdist: the package's CUDA extension takes
#      hours to build and that kernel does not use it);
#   2. prints the GPU, the driver and the library versions;
#   3. checks every kernel against the float64 oracle on the GPU: the test suite's kernel tests
#      (pytest -k "pallas or triton"), then lossparity with the Pallas and Triton backends;
#   4. runs the GPU benchmark (python -m benchmarks.run --gpu-quick) in the time that is left.
# Everything goes to benchmarks/results/gpu_check_<date>.log; the benchmark writes
# benchmarks/results/gpu_quick.{json,md} and gpu_quick_{time,memory}.png.
#
# Environment: GPU_CHECK_SECONDS (default 600) the whole budget; GPU_CHECK_SKIP_INSTALL=1 uses
# the Python in $PYTHON_BIN (default .venv/bin/python) as it is (offline machines).
# Exit status: 0 when every check passed, 1 otherwise (the benchmark runs either way).
set -uo pipefail
cd "$(dirname "$0")/.."

budget=${GPU_CHECK_SECONDS:-600}
deadline=$(( $(date +%s) + budget ))
left() { echo $(( deadline - $(date +%s) )); }
at_least() { if [ "$1" -lt "$2" ]; then echo "$2"; else echo "$1"; fi; }  # timeout 0 would mean none
mkdir -p benchmarks/results
log=benchmarks/results/gpu_check_$(date +%Y%m%d_%H%M%S).log
exec > >(tee -a "$log") 2>&1
step() { echo; echo "=== [$(date +%H:%M:%S), $(left) s left] $*"; }
failures=()

step "GPU"
if ! nvidia-smi -L; then
  echo "no NVIDIA GPU visible (nvidia-smi -L failed): nothing to check here"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv

export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch processes share the GPU
py=${PYTHON_BIN:-.venv/bin/python}

# ---- 1. install ------------------------------------------------------------------------------
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
  step "install: CUDA builds of torch and JAX, the project (scripts/setup.sh)"
  timeout "$(at_least $(( $(left) - 420 )) 60)" bash scripts/setup.sh || failures+=("install (scripts/setup.sh)")
  py=.venv/bin/python
  step "install: liger-kernel"
  timeout 45 "$py" -m pip install --quiet --disable-pip-version-check liger-kernel || echo "liger-kernel did not install: its rows will say unavailable"
  step "fetch: flash-attn's Triton cross-entropy (one file from the flash-attn sdist)"
  ce_file=.venv/flash_attn_ce/cross_entropy.py
  if [ ! -f "$ce_file" ]; then
    timeout 45 "$py" - "$ce_file" <<'EOF' || echo "flash-attn cross-entropy not fetched: its rows will say unavailable"
import io, json, sys, tarfile, urllib.request
from pathlib import Path
dest = Path(sys.argv[1])
meta = json.load(urllib.request.urlopen("https://pypi.org/pypi/flash-attn/json", timeout=30))
sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
print(f"flash-attn {meta['info']['version']}: {sdist['filename']}")
data = urllib.request.urlopen(sdist["url"], timeout=60).read()
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("flash_attn/ops/triton/cross_entropy.py"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(tar.extractfile(member).read())
(dest.parent / "VERSION").write_text(meta["info"]["version"] + "\n")
print(f"wrote {dest}")
EOF
  fi
  [ -f "$ce_file" ] && export FLASH_ATTN_CE_FILE=$PWD/$ce_file
else
  step "install skipped (GPU_CHECK_SKIP_INSTALL=1): using $py"
  [ -f .venv/flash_attn_ce/cross_entropy.py ] && export FLASH_ATTN_CE_FILE=$PWD/.venv/flash_attn_ce/cross_entropy.py
fi

# ---- 2. versions -----------------------------------------------------------------------------
step "versions"
timeout 60 "$py" - <<'EOF' || failures+=("import torch/jax on the GPU")
import platform
from importlib import metadata
for name in ("numpy", "jax", "jaxlib", "jax-cuda12-plugin", "optax", "torch", "triton", "liger-kernel", "flash-attn"):
    try:
        print(f"{name:18} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name:18} -")
print("python            ", platform.python_version())
import torch
print("torch CUDA        ", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))
import jax
print("jax devices       ", jax.devices())
assert torch.cuda.is_available(), "torch sees no GPU"
assert jax.default_backend() == "gpu", f"JAX runs on {jax.default_backend()}, not the GPU"
EOF

# ---- 3. kernel checks against the oracle -----------------------------------------------------
step "kernel tests on the GPU: pytest parity_tests -k 'pallas or triton'"
timeout 90 "$py" -m pytest -q -x -n 4 -p no:cacheprovider parity_tests -k "pallas or triton"
code=$?
if [ $code -eq 5 ]; then
  echo "(no kernel tests selected)"
elif [ $code -ne 0 ]; then
  failures+=("pytest kernel tests (exit $code)")
fi

step "lossparity: Pallas and Triton kernels vs the oracle (V=32768 and a ragged V=50257)"
mkdir -p benchmarks/results/gpu_parity
timeout 60 "$py" -m lossparity --quiet --backends jax-pallas,torch-triton --shape 2x64x32768 \
  --dtypes float32,bfloat16 --out benchmarks/results/gpu_parity || failures+=("lossparity 2x64x32768")
timeout 30 "$py" -m lossparity --quiet --backends jax-pallas,torch-triton --shape 3x41x50257 --dtypes bfloat16 \
  --normalizations valid_tokens --no-plot --out benchmarks/results/gpu_parity/ragged || failures+=("lossparity 3x41x50257")

# ---- 4. benchmark ----------------------------------------------------------------------------
remaining=$(left)
minutes=$(( (remaining - 45) / 60 ))
step "benchmark: python -m benchmarks.run --gpu-quick --max-minutes $minutes"
if [ "$minutes" -ge 1 ]; then
  timeout "$(at_least $(( remaining - 10 )) 30)" "$py" -m benchmarks.run --gpu-quick --max-minutes "$minutes" \
    || failures+=("benchmark (exit $?)")
else
  failures+=("benchmark: no time left")
fi

step "done: log $log"
if [ ${#failures[@]} -eq 0 ]; then
  echo "GPU CHECK PASSED"
  exit 0
fi
printf 'GPU CHECK FAILED: %s\n' "${failures[@]}"
exit 1
