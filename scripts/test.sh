#!/usr/bin/env bash
# The test suite on the CPU: sets up .venv if needed, then runs pytest (extra args pass through) on
# EPMOE_TEST_WORKERS pytest-xdist processes (default 2, CI's cores; 0: one process, no xdist).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest -n "${EPMOE_TEST_WORKERS:-2}" "$@"
