#!/usr/bin/env bash
# Wheels the GPU image lacks for `pytest -m gpu` (the export tests read and write GGUF files; pytest-xdist runs
# the suite on three workers sharing the GPU, benchmarks/gpu_suite.sh), for
# its Python 3.12 at the versions of constraints.txt, into .whl/ beside the peers' wheels
# (../shared/tools/fetch_peer_wheels.sh). Run from the repository root on a machine that reaches
# PyPI; on the GPU machine install .whl/*.whl with `pip install --no-index --no-deps --target
# /tmp/site` as that script says.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    $(grep -E '^(gguf|sentencepiece|pytest-xdist|execnet)==' constraints.txt)
ls .whl | grep -E '^(gguf|sentencepiece|pytest_xdist|execnet)-'
