#!/usr/bin/env bash
# The main job: set up .venv and fine-tune the embedded default (about a minute of training on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh "${FASTTUNE_EXTRAS:-dev}"
exec .venv/bin/python examples/quickstart.py "$@"
