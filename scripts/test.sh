#!/usr/bin/env bash
# The test suite on the CPU: sets up .venv if needed, then runs pytest (extra args pass through).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest "$@"
