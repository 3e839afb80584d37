#!/usr/bin/env bash
# The main job: sets up .venv if needed, then runs `epmoe` (default: `epmoe demo`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
if [ $# -eq 0 ]; then set -- demo; fi
exec epmoe "$@"
