#!/usr/bin/env bash
# One run on an NVIDIA GPU machine checks and measures everything, within 10 minutes:
#   1. finds or installs CUDA builds of torch and JAX (the machine's python3 when it has them,
#      else scripts/setup.sh: torch==2.13.0 and jax[cuda12]==0.10.2) and the GPU peers:
#      liger-kernel, and flash-attn's Triton cross-entropy (one file taken from the flash-attn
#      sdist: the package's CUDA extension takes hours to build and that kernel does not use it),
#      from .whl/ when carried there (benchmarks/prepare_gpu_carry.sh, for machines without
#      network), else from PyPI;
#   2. prints the GPU, the driver and the library versions;
#   3. checks every kernel against the float64 oracle on the GPU: the test suite's kernel tests
#      (pytest -k "pallas or triton"), then lossparity with the Pallas and Triton backends;
#   4. runs the GPU benchmark (python -m benchmarks.run --gpu-quick --name gpu_quick) in the time
#      that is left: per loss kind, the contenders of each framework share a process and are timed
#      in interleaved rounds (7 by default), the speed-of-light pass writes a pre-faulted buffer
#      and its floor is the best of its calls; cells that would not finish in the budget are
#      skipped whole (reported). Its plan and expected time are printed first (--dry-run).
# Everything goes to benchmarks/results/gpu_check_<date>.log; the benchmark writes
# benchmarks/results/gpu_quick.{json,md} and gpu_quick_{time,memory}.png, which record the
# commit, whether the tree was clean, the load average before and after and the versions.
#
# --short (or GPU_CHECK_SHORT=1): a lent machine's 15 minutes hold this whole run once, so the
# short mode fits in about 6 minutes (GPU_CHECK_SECONDS 360): the kernel suites that issue 32
# changed (the Pallas and Triton kernels' tests), no lossparity, a 45 s sweep of the Triton kernels'
# pipelining and persistent programs (gpu_triton_sweep --grid pipeline, and the 16-bit backward
# with a non-unit upstream gradient at the default launch), and the
# benchmark rows at the issue's shape (16384 x 131072 bf16, 30% masked, the loss group): our
# kernels (with and without the in-place gradient), Liger, flash-attn and the speed-of-light
# passes, cross-entropy first; the slow peers (torch.compile, eager, optax, the torch path) and the
# LM head are left out. --head (or GPU_CHECK_HEAD=1), issue 33's run in about 6 minutes too: the
# fused head's tests on the GPU (precision="tensor", the bf16 matmuls), the head's matmuls alone
# (benchmarks/gpu_matmul_probe.py: bf16->bf16, mm(out_dtype=fp32), the Triton matmul, fp32, JAX's
# dot) and the head rows at 16384 x 4096 x 131072 bf16: the tensor heads, the opted-in bf16 split,
# Liger's fused head, Cut Cross-Entropy, tokamax and both frameworks' three matmuls (the exact
# fp32 heads, 1.4-2.4 s a call there, are left out). --dry-run (or GPU_CHECK_DRY_RUN=1): print the
# plan and exit 0, run nothing (on a machine without a GPU it says so first).
#
# Environment: GPU_CHECK_SECONDS (default 600, --short 360) the whole budget; GPU_CHECK_PYTEST_SECONDS
# (default 150, --short 120) the kernel tests' share of it; GPU_CHECK_SWEEP_SECONDS (default 60,
# --short 45) the Triton launch-shape sweep's; GPU_CHECK_PALLAS_SWEEP_SECONDS (default 45, full
# mode only) the Pallas one's (benchmarks/gpu_pallas_sweep.py); GPU_CHECK_BENCH_ARGS more arguments of the benchmark
# (they replace the short mode's); GPU_CHECK_TESTS other test files; GPU_CHECK_SKIP_PARITY=1 leaves
# lossparity out; PYTHON_BIN a Python to use as it is. The project is imported from this checkout
# (PYTHONPATH), never installed.
# Exit status: 0 when every check passed (or a dry run), 1 otherwise (the benchmark runs either way).
set -uo pipefail
cd "$(dirname "$0")/.."

short=${GPU_CHECK_SHORT:-}
head=${GPU_CHECK_HEAD:-}
dry_run=${GPU_CHECK_DRY_RUN:-}
for arg in "$@"; do
  case "$arg" in
    --short) short=1 ;;
    --head) head=1 ;;
    --dry-run) dry_run=1 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--short | --head] [--dry-run]  (unknown argument: $arg)"; exit 2 ;;
  esac
done
probe_seconds=0
pallas_sweep_seconds=0
sweep_args="--grid all --head"

kernel_tests=(parity_tests/test_torchloss_triton_kernels.py
              parity_tests/test_torchloss_triton_vocab_parallel.py parity_tests/test_jaxloss_kernels.py
              parity_tests/test_jaxloss_oracle.py parity_tests/test_linear_head_bf16_matmuls.py)
kernel_filter="pallas or triton or bf16_matmuls"
bench_args="--gpu-quick --name gpu_quick"
if [ -n "$head" ]; then
  budget=${GPU_CHECK_SECONDS:-360}
  pytest_seconds=${GPU_CHECK_PYTEST_SECONDS:-90}
  sweep_seconds=0
  probe_seconds=${GPU_CHECK_PROBE_SECONDS:-60}
  # the fused head's suites that issue 33 changed (JAX's default device and torch's CUDA tensors)
  kernel_tests=(parity_tests/test_linear_head_tensor.py parity_tests/test_linear_head_bf16_matmuls.py)
  kernel_filter="not memory"
  skip_parity=1
  bench_args="--gpu-quick --name gpu_head --kinds cross_entropy --backends head-torchloss-fused-tensor,head-jaxloss-fused-tensor,head-torchloss-fused-bf16mm,head-jaxloss-fused-bf16mm,head-liger,head-cce,head-tokamax,head-matmul-sol,head-jax-matmul-sol"
elif [ -n "$short" ]; then
  budget=${GPU_CHECK_SECONDS:-360}
  pytest_seconds=${GPU_CHECK_PYTEST_SECONDS:-120}
  sweep_seconds=${GPU_CHECK_SWEEP_SECONDS:-45}
  # the block x warps grid ran on the H200 (benchmarks/results/gpu_triton_sweep_a73ea56.json):
  # the short run times the untimed knobs only, pipelining x persistent programs, 10 reps each
  sweep_args="--grid pipeline --reps 10"
  # the suites of the kernels issue 32 changed: the Pallas and Triton loss kernels, and the
  # contract's -inf / NaN rows on them (the compiled Pallas kernels' NaN-dropping minimum and
  # per-row NaN scale are numbers only a GPU shows)
  kernel_tests=(parity_tests/test_jaxloss_kernels.py parity_tests/test_torchloss_triton_kernels.py parity_tests/test_jaxloss_inplace.py
                parity_tests/test_jaxloss_upstream_16bit.py
                parity_tests/test_contract_kinds.py::test_neg_inf_logits_get_zero_gradient
                parity_tests/test_contract_kinds.py::test_nan_and_inf_rows)
  kernel_filter="pallas or triton"
  skip_parity=1
  bench_args="--gpu-quick --name gpu_quick_short --no-head --skip-backends torch-compile,torch-eager,optax,torchloss
    --kinds cross_entropy,reverse_kl,forward_kl,soft_cross_entropy,entropy,jensen_shannon"
else
  budget=${GPU_CHECK_SECONDS:-600}
  pytest_seconds=${GPU_CHECK_PYTEST_SECONDS:-150}
  sweep_seconds=${GPU_CHECK_SWEEP_SECONDS:-60}
  # the Pallas kernels' persistent programs and block shapes (never swept on a GPU)
  pallas_sweep_seconds=${GPU_CHECK_PALLAS_SWEEP_SECONDS:-45}
  skip_parity=${GPU_CHECK_SKIP_PARITY:-}
fi
# GPU_CHECK_TESTS: another list of test files (a rerun of what changed, when device time is short)
[ -n "${GPU_CHECK_TESTS:-}" ] && read -r -a kernel_tests <<< "$GPU_CHECK_TESTS"
[ -n "${GPU_CHECK_BENCH_ARGS:-}" ] && bench_args="--gpu-quick --name gpu_quick $GPU_CHECK_BENCH_ARGS"
bench_args=$(echo $bench_args)  # one line

deadline=$(( $(date +%s) + budget ))
left() { echo $(( deadline - $(date +%s) )); }
at_least() { if [ "$1" -lt "$2" ]; then echo "$2"; else echo "$1"; fi; }  # timeout 0 would mean none
step() { echo; echo "=== [$(date +%H:%M:%S), $(left) s left] $*"; }
failures=()

plan() {
  echo "plan ($([ -n "$head" ] && echo head || { [ -n "$short" ] && echo short || echo full; }) mode, budget ${budget} s):"
  echo "  1. the GPU, the driver, the Python with CUDA torch and JAX, the carried peers (.whl/), the versions"
  echo "  2. kernel tests (${pytest_seconds} s): pytest ${kernel_tests[*]} -k '$kernel_filter'"
  if [ -n "$skip_parity" ]; then echo "  3. lossparity: skipped"; else echo "  3. lossparity: Pallas and Triton vs the oracle"; fi
  if [ "$sweep_seconds" -gt 0 ]; then echo "  4. Triton launch shapes (${sweep_seconds} s): python -m benchmarks.gpu_triton_sweep --max-seconds $sweep_seconds $sweep_args"; fi
  if [ "$pallas_sweep_seconds" -gt 0 ]; then echo "  4. Pallas launch shapes (${pallas_sweep_seconds} s): python -m benchmarks.gpu_pallas_sweep --max-seconds $pallas_sweep_seconds"; fi
  if [ "$probe_seconds" -gt 0 ]; then echo "  4. the head's matmuls alone (${probe_seconds} s): python -m benchmarks.gpu_matmul_probe"; fi
  echo "  5. benchmark (the time left): python -m benchmarks.run $bench_args"
}

if [ -n "$dry_run" ]; then
  if ! nvidia-smi -L 2>/dev/null; then
    echo "no NVIDIA GPU visible (nvidia-smi -L failed): a real run would stop here (exit 1)"
  fi
  plan
  echo "dry run: nothing run"
  exit 0
fi

mkdir -p benchmarks/results
log=benchmarks/results/gpu_check_$(date +%Y%m%d_%H%M%S).log
exec > >(tee -a "$log") 2>&1
plan

step "GPU"
if ! nvidia-smi -L; then
  echo "no NVIDIA GPU visible (nvidia-smi -L failed): nothing to check here"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv

export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch processes share the GPU

# ---- 1. Python and packages ------------------------------------------------------------------
# Three cases: PYTHON_BIN given (used as it is); a machine whose python3 already holds CUDA
# builds of torch and JAX (the lent device machines, which reach no network: the GPU peers come
# from .whl/, made beforehand by benchmarks/prepare_gpu_carry.sh and carried along); otherwise
# scripts/setup.sh installs the CUDA builds into .venv/ and the peers come from PyPI.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the project itself, without installing it
if [ -n "${PYTHON_BIN:-}" ]; then
  py=$PYTHON_BIN
  step "Python: $py (PYTHON_BIN)"
elif timeout 120 python3 -c "import torch, jax; assert torch.cuda.is_available() and jax.default_backend() == 'gpu'" 2>/dev/null; then
  py=python3
  step "Python: the machine's python3 (CUDA builds of torch and JAX already there)"
else
  step "install: CUDA builds of torch and JAX, the project (scripts/setup.sh)"
  timeout "$(at_least $(( $(left) - 420 )) 60)" bash scripts/setup.sh || failures+=("install (scripts/setup.sh)")
  py=.venv/bin/python
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  step "install: carried wheels (.whl/): $(cd .whl && ls *.whl | tr '\n' ' ')"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/gpu_check_site || echo "carried wheels did not install: the peers' rows will say unavailable"
elif [ "$py" = .venv/bin/python ]; then
  step "install: liger-kernel"
  timeout 45 "$py" -m pip install --quiet --disable-pip-version-check liger-kernel || echo "liger-kernel did not install: its rows will say unavailable"
fi
for ce_file in .whl/flash_attn_ce/cross_entropy.py .venv/flash_attn_ce/cross_entropy.py; do
  [ -f "$ce_file" ] && { export FLASH_ATTN_CE_FILE=$PWD/$ce_file; break; }
done
if [ -z "${FLASH_ATTN_CE_FILE:-}" ]; then
  step "fetch: flash-attn's Triton cross-entropy (one file from the flash-attn sdist)"
  timeout 45 "$py" benchmarks/fetch_flash_attn_ce.py .venv/flash_attn_ce \
    && export FLASH_ATTN_CE_FILE=$PWD/.venv/flash_attn_ce/cross_entropy.py \
    || echo "flash-attn cross-entropy not fetched (no network?): its rows will say unavailable"
fi

# ---- 2. versions -----------------------------------------------------------------------------
step "versions"
timeout 60 "$py" - <<'EOF' || failures+=("import torch/jax on the GPU")
import platform
from importlib import metadata
for name in ("numpy", "jax", "jaxlib", "jax-cuda12-plugin", "optax", "torch", "triton", "liger-kernel", "flash-attn",
             "cut-cross-entropy", "tokamax"):
    try:
        print(f"{name:18} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name:18} -")
print("python            ", platform.python_version())
import torch
print("torch CUDA        ", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))
import torchloss.head as head
print("torch bf16 mm->fp32", head._cuda_mm_out_dtype(torch.device("cuda")), "(the fused head's tensor-core matmuls)")
import jax
print("jax devices       ", jax.devices())
assert torch.cuda.is_available(), "torch sees no GPU"
assert jax.default_backend() == "gpu", f"JAX runs on {jax.default_backend()}, not the GPU"
EOF

# ---- 3. kernel checks against the oracle -----------------------------------------------------
# The kernel suites (compiled for the GPU here, where CPU machines interpret them); every failure
# is listed (-rf, no -x). A worker per two host cores: each compiles its own kernels.
workers=$(( $(nproc) / 2 )); [ "$workers" -ge 1 ] || workers=1
step "kernel tests on the GPU: pytest ${kernel_tests[*]} -k '$kernel_filter' -n $workers"
timeout "$pytest_seconds" "$py" -m pytest -q -rf -n "$workers" -p no:cacheprovider "${kernel_tests[@]}" -k "$kernel_filter"
code=$?
if [ $code -eq 5 ]; then
  echo "(no kernel tests selected)"
elif [ $code -ne 0 ]; then
  failures+=("pytest kernel tests (exit $code)")
fi

if [ -n "$skip_parity" ]; then
  step "lossparity: skipped (GPU_CHECK_SKIP_PARITY or --short)"
else
step "lossparity: Pallas and Triton kernels vs the oracle (V=32768 and a ragged V=50257)"
mkdir -p benchmarks/results/gpu_parity
timeout 60 "$py" -m lossparity --quiet --backends jax-pallas,torch-triton --shape 2x64x32768 \
  --dtypes float32,bfloat16 --out benchmarks/results/gpu_parity || failures+=("lossparity 2x64x32768")
timeout 30 "$py" -m lossparity --quiet --backends jax-pallas,torch-triton --shape 3x41x50257 --dtypes bfloat16 \
  --normalizations valid_tokens --no-plot --out benchmarks/results/gpu_parity/ragged || failures+=("lossparity 3x41x50257")
fi

if [ "$sweep_seconds" -gt 0 ]; then
step "Triton launch shapes: python -m benchmarks.gpu_triton_sweep (pipelining x persistent programs; block x warps)"
# shellcheck disable=SC2086  # sweep_args: several arguments
timeout "$(( sweep_seconds + 50 ))" "$py" -m benchmarks.gpu_triton_sweep --max-seconds "$sweep_seconds" $sweep_args \
  --json benchmarks/results/gpu_triton_sweep.json || failures+=("Triton sweep")
fi
if [ "$pallas_sweep_seconds" -gt 0 ]; then
step "Pallas launch shapes: python -m benchmarks.gpu_pallas_sweep (persistent programs; rows x block x warps)"
timeout "$(( pallas_sweep_seconds + 60 ))" "$py" -m benchmarks.gpu_pallas_sweep --max-seconds "$pallas_sweep_seconds" \
  --json benchmarks/results/gpu_pallas_sweep.json || failures+=("Pallas sweep")
fi
if [ "$probe_seconds" -gt 0 ]; then
step "the head's matmuls alone: python -m benchmarks.gpu_matmul_probe (R=2048, H=4096, V=131072)"
timeout "$probe_seconds" "$py" -m benchmarks.gpu_matmul_probe --json benchmarks/results/gpu_matmul_probe.json || failures+=("matmul probe")
fi

# ---- 4. benchmark ----------------------------------------------------------------------------
remaining=$(left)
minutes=$(awk -v r="$remaining" 'BEGIN { printf "%.1f", (r - 45) / 60 }')
step "benchmark: python -m benchmarks.run $bench_args --max-minutes $minutes"
if [ $(( remaining - 45 )) -ge 60 ]; then
  # GPU_CHECK_BENCH_ARGS: more arguments, e.g. --kinds in the order the cells should run
  timeout 60 "$py" -m benchmarks.run $bench_args --dry-run || true
  timeout "$(at_least $(( remaining - 10 )) 30)" "$py" -m benchmarks.run $bench_args --max-minutes "$minutes" \
    || failures+=("benchmark (exit $?)")
else
  failures+=("benchmark: no time left")
fi

step "done: log $log"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then  # the lent device machines return what is under $OUT
  tar czf "$OUT/gpu_results.tgz" benchmarks/results/gpu_* && echo "results packed into \$OUT/gpu_results.tgz"
fi
if [ ${#failures[@]} -eq 0 ]; then
  echo "GPU CHECK PASSED"
  exit 0
fi
printf 'GPU CHECK FAILED: %s\n' "${failures[@]}"
exit 1
