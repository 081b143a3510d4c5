#!/usr/bin/env bash
# Test-only tools that pip's pinned set does not cover:
#  - llama-cpp-python, built from source with portable flags (the -march=native build segfaults on
#    quantised models on these CPUs, docs/FACTS.md, GGUF and llama.cpp); ~5 min once, then cached in .venv;
#  - Debian's chromium for the Space's browser tests (Playwright cannot download browsers here);
#  - the `kernels` package (transformers' Hub kernels, use_kernels) in .venv/kernels-site, not in the venv:
#    there bitsandbytes and transformers would reach for the Hub at import; one test puts it on a subprocess's path;
#  - huggingface_hub 1.x (the GPU image's; pyproject allows >= 1.0, constraints.txt pins 2.x) in .venv/hub1-site:
#    tests/export/test_hub_on_huggingface_hub_1.py runs the Hub tests again with it first on the path.
# Usage: setup_test_tools.sh            install both (the llama wheel from build/wheels when prefetched)
#        setup_test_tools.sh --prefetch  build the llama wheel into build/wheels and install chromium; needs
#                                        no .venv, so scripts/test.sh runs it while pip fills .venv (the build
#                                        is CPU-bound, pip mostly waits on the network)
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA="llama-cpp-python==0.3.36"
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
WHEELS=build/wheels

install_chromium() {
  command -v chromium >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ]; then sudo_cmd=""; elif command -v sudo >/dev/null 2>&1; then sudo_cmd="sudo"; else sudo_cmd="none"; fi
  if [ "$sudo_cmd" != none ]; then
    $sudo_cmd apt-get update -qq >/dev/null && \
      DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq chromium >/dev/null || \
      echo "warning: could not install chromium; browser tests will be skipped"
  else
    echo "warning: no root/sudo to install chromium; browser tests will be skipped"
  fi
}

has_llama() { [ -x .venv/bin/python ] && .venv/bin/python -c "import llama_cpp" 2>/dev/null; }

if [ "${1:-}" = "--prefetch" ]; then
  if ! has_llama && ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building the llama-cpp-python wheel (once, ~5 min)..."
    "${PYTHON:-python3}" -m pip wheel -q --disable-pip-version-check --no-cache-dir --no-deps -w "$WHEELS" "$LLAMA"
  fi
  install_chromium
  exit 0
fi

if ! has_llama; then
  # A prefetched wheel for this interpreter is taken first; pip builds from source when none fits.
  echo "installing llama-cpp-python..."
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir -c constraints.txt \
    --find-links "$WHEELS" "$LLAMA"
fi
install_chromium
HUB1="huggingface_hub==1.33.0"  # its httpx comes from the venv (gradio's)
if [ ! -d .venv/hub1-site/huggingface_hub-1.33.0.dist-info ]; then
  echo "installing $HUB1 into .venv/hub1-site..."
  rm -rf .venv/hub1-site
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps --target .venv/hub1-site "$HUB1"
fi
if [ ! -d .venv/kernels-site/kernels ]; then
  echo "installing kernels into .venv/kernels-site..."
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps -c constraints.txt \
    --target .venv/kernels-site kernels
fi
