#!/usr/bin/env bash
# Run on a machine WITH network, before a GPU check on one without (the lent device machines
# reach no registry): puts the GPU peers into .whl/ (git-ignored), to be carried along:
#   .whl/liger_kernel-*.whl             (pure Python; the GPU machine's torch and triton are used)
#   .whl/cut_cross_entropy-*.whl, tokamax-*.whl and what tokamax imports (pure Python)
#   .whl/flash_attn_ce/cross_entropy.py  (flash-attn's Triton cross-entropy, one file of its sdist)
# then on the GPU machine: bash benchmarks/gpu_check.sh (it installs .whl/*.whl with --no-index).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl "liger-kernel${LIGER_VERSION:+==$LIGER_VERSION}"
# the fused head's peers (issue 33): Cut Cross-Entropy (Triton kernels, pure Python) and tokamax
# with the small pure-Python packages it imports (its rows say "unavailable" where one is missing)
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d .whl \
  cut-cross-entropy==25.1.1 tokamax==0.0.12 einshape immutabledict jaxtyping wadler_lindig typeguard==2.13.3 qwix tensorboardX
python3 benchmarks/fetch_flash_attn_ce.py .whl/flash_attn_ce
du -sh .whl && ls -R .whl
