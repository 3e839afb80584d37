#!/usr/bin/env bash
# Sourced by scripts/run.sh and scripts/test.sh: makes .venv (Python >= 3.12) and installs
# the project with its pinned dependencies. Idempotent: reinstalls only when pyproject.toml
# changed since the last successful install (a stamp file holds its hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${EPMOE_VENV:-$ROOT/.venv}"

find_python() {
  local c v
  for c in python3.12 python3.13 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/"3.1[2-9]*/bin/python3 python3; do
    [ -x "$(command -v "$c" 2>/dev/null)" ] || continue
    v=$("$c" -c 'import sys; print(int(sys.version_info >= (3, 12)))' 2>/dev/null) || continue
    [ "$v" = 1 ] && { command -v "$c"; return 0; }
  done
  echo "epmoe: no Python >= 3.12 found (tried python3.12, python3.13, pyenv versions, python3); install one" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  PY="$(find_python)"
  echo "epmoe: creating $VENV with $PY" >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

STAMP="$VENV/.epmoe-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "epmoe: installing pinned dependencies into $VENV (first run: several minutes, ~5 GB)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test,bench]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
