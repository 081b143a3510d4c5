#!/usr/bin/env bash
# Creates (or reuses) .venv in the repository root and installs fasttune with the pinned set.
# Usage: bash scripts/setup_venv.sh [extras]      (extras default: dev = everything the tests need)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=".venv/.fasttune-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  # constraints.txt pins torch==2.13.0 so pip takes the CPU wheel where one lies on disk.
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi
