#!/usr/bin/env bash
# Set up .venv/ and run the whole test suite (the README's test command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers="${TEST_WORKERS:-2}"
exec .venv/bin/python -m pytest -q -n "$workers" --durations=15 parity_tests "$@"
