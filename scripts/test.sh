#!/usr/bin/env bash
# The test suite on the CPU: sets up .venv if needed, then runs pytest (extra args pass through) on
# EPMOE_TEST_WORKERS pytest-xdist processes (default 2, CI's cores; 0: one process, no xdist).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# worksteal: a worker that runs out takes half of the other's queue (the suite's tests differ 1000x in length)
exec python -m pytest -n "${EPMOE_TEST_WORKERS:-2}" --dist worksteal "$@"
