#!/usr/bin/env bash
# Set up .venv/ and run the whole test suite (the README's test command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers="${TEST_WORKERS:-2}"
# The gloo suites launch their ranks as plain processes (parity_tests/support/ranks.py: a FileStore, no
# TCP rendezvous), each once per session whichever worker asks first: they run inside the xdist
# workers like the rest.
exec .venv/bin/python -m pytest -q -n "$workers" --durations=15 parity_tests "$@"
