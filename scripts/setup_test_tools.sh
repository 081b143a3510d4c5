#!/usr/bin/env bash
# Test-only tools that pip's pinned set does not cover:
#  - llama-cpp-python, built from source with portable flags (the -march=native build segfaults on
#    quantised models on these CPUs, docs/FACTS.md, GGUF and llama.cpp); ~5 min once, then cached in .venv;
#  - Debian's chromium for the Space's browser tests (Playwright cannot download browsers here).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "building llama-cpp-python (once, ~5 min)..."
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir -c constraints.txt llama-cpp-python==0.3.36
fi
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then sudo_cmd=""; elif command -v sudo >/dev/null 2>&1; then sudo_cmd="sudo"; else sudo_cmd="none"; fi
  if [ "$sudo_cmd" != none ]; then
    $sudo_cmd apt-get update -qq >/dev/null && \
      DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq chromium >/dev/null || \
      echo "warning: could not install chromium; browser tests will be skipped"
  else
    echo "warning: no root/sudo to install chromium; browser tests will be skipped"
  fi
fi
