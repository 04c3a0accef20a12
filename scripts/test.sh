#!/usr/bin/env bash
# Set up .venv/ and run the whole test suite (the README's test command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers="${TEST_WORKERS:-2}"
# The torchrun/gloo suite launches its own processes: it runs alone, outside the xdist workers
# (under a busy xdist worker its rendezvous was seen to stall).
.venv/bin/python -m pytest -q -n 0 parity_tests/test_distributed_torch.py
exec .venv/bin/python -m pytest -q -n "$workers" --durations=15 parity_tests \
  --ignore=parity_tests/test_distributed_torch.py "$@"
