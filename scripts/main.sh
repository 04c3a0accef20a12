#!/usr/bin/env bash
# Set up .venv/ and run the project's main job: the cross-framework parity matrix.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lossparity "$@"
