#!/usr/bin/env bash
# Set up, build everything (the CUDA kernels too, when nvcc is present) and run the tests:
# the C++ suites through CTest, then the Python package's suite (pip install . + pytest).
# CUDA tests skip with a reason when no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
preset=ci
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then preset=cpu; fi
start=$(date +%s)
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
echo "build: $(( $(date +%s) - start )) s"
ctest --preset "$preset"
bash tests/python/ci.sh
