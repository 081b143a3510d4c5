#!/usr/bin/env bash
# Set up .venv (plus llama.cpp's Python binding and Chromium for the browser tests) and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# The llama.cpp build (CPU) runs while pip fills .venv (network); a failed prefetch only means
# setup_test_tools.sh builds in place.
mkdir -p build
bash scripts/setup_test_tools.sh --prefetch > build/prefetch.log 2>&1 &
prefetch=$!
bash scripts/setup_venv.sh dev
wait "$prefetch" || { echo "test tools prefetch failed (building in place):"; tail -20 build/prefetch.log; }
bash scripts/setup_test_tools.sh
echo "setup took ${SECONDS} s"
workers="${PYTEST_WORKERS:-auto}"
# --durations: the slowest tests at the end of every log (the suite's time is a budget too)
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --timeout 900 --durations=25 -q "$@"
