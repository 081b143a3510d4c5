#!/usr/bin/env bash
# Set up .venv (plus llama.cpp's Python binding and Chromium for the browser tests) and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh dev
bash scripts/setup_test_tools.sh
workers="${PYTEST_WORKERS:-auto}"
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --timeout 900 -q "$@"
