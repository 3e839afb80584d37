#!/usr/bin/env bash
# The main job: sets up .venv if needed, then runs `epmoe` (default: `epmoe check`, the stage-by-stage
# cross-check of the four implementations on the tiny preset; no GPU needed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
if [ $# -eq 0 ]; then set -- check; fi
exec epmoe "$@"
