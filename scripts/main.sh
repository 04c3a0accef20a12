#!/usr/bin/env bash
# Set up .venv/ and run the project's main job: the cross-framework parity matrix (lossparity),
# then the end-to-end demos that train the same tiny LM in Flax NNX and in torch (SFT/distillation
# with the tied fused head; packed documents with segment_ids and sequence_mean).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
echo "== lossparity: every backend against the oracle and against each other =="
.venv/bin/lossparity --out out "$@"
echo
echo "== end-to-end: the tiny LM in JAX and torch, K=1/K=4, D=1/D=2, naive contrast =="
.venv/bin/python -m examples.tiny_lm.demo --out out/tiny_lm
echo
echo "== packed documents: sequence_mean with segment_ids; full batch = K=4 = D=2, naive contrast =="
.venv/bin/python -m examples.packed_docs.demo --out out/packed_docs
