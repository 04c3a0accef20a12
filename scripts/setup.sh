#!/usr/bin/env bash
# Create .venv/ and install everything the project needs; a no-op when nothing changed.
# CPU machines get the CPU wheel of torch 2.13.0 from PyTorch's CPU index (a bare `torch` from
# PyPI pulls a multi-GB CUDA build; where that index is unreachable, the configured index's) and
# triton for its interpreter; machines with an NVIDIA GPU get the CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  if command -v python3.11 >/dev/null 2>&1; then python_bin=python3.11; else python_bin=python3; fi
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($python_bin --version)"
  "$python_bin" -m venv .venv
fi
gpu=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=cuda; fi
stamp=.venv/.setup-stamp
want="$gpu $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [ "$gpu" = cuda ]; then
  echo "[setup] NVIDIA GPU found: installing CUDA builds of torch and JAX"
  "${pip[@]}" "torch==2.13.0" "jax[cuda12]==0.10.2"
else
  echo "[setup] no GPU: installing the CPU wheel of torch 2.13.0, triton (interpreter) and JAX (CPU)"
  # PyTorch's CPU index first: on PyPI a bare torch==2.13.0 is the CUDA build (with its multi-GB
  # nvidia-* wheels). The try fails fast where that index cannot be reached (one 10 s attempt),
  # and the plain name then takes whatever the configured index offers (a local CPU wheel, say).
  if ! "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu --timeout 10 --retries 0 "torch==2.13.0"; then
    echo "[setup] PyTorch's CPU index unreachable: installing torch==2.13.0 from the configured index"
    "${pip[@]}" "torch==2.13.0"
  fi
  "${pip[@]}" "triton==3.9.0" "jax[cpu]==0.10.2"
fi
echo "[setup] installing the project and its test tools"
"${pip[@]}" -e ".[jax,torch,dev,peers]" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import lossspec, numpy" >/dev/null
echo "$want" > "$stamp"
echo "[setup] done"
