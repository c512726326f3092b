#!/usr/bin/env bash
# CI for the Python package on a machine without a GPU: install the build and test
# requirements with pip, build and install the package CPU-only (`pip install .`), and
# run the pytest suite. The numpy binding suite always runs. torch (CPU use of the PyPI
# wheel: about 2.6 GB of downloads, 4.6 GB installed) and matplotlib are installed too, so
# the torch ops, the ring-attention tests over gloo and the benchmark harness run: set
# FLASHATTN_CI_TORCH=0 to skip them, or they are skipped (with a message) when the disk has
# less than 10 GB free.
# Exits non-zero on any failure, including pytest finding no test (exit status 5).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
JOBS=${JOBS:-2}

echo "== python: $("$PYTHON" --version)"
"$PYTHON" -m pip install --quiet numpy nanobind scikit-build-core pytest
free_gb=$(df -Pk "$("$PYTHON" -c 'import site; print(site.getsitepackages()[0])')" | awk 'NR==2 {print int($4 / 1048576)}')
if [[ "${FLASHATTN_CI_TORCH:-1}" == "1" && $free_gb -ge 10 ]]; then
  start=$(date +%s)
  "$PYTHON" -m pip install --quiet torch matplotlib
  echo "== torch $("$PYTHON" -c 'import torch; print(torch.__version__)') installed in $(( $(date +%s) - start )) s"
else
  echo "== torch not installed (FLASHATTN_CI_TORCH=${FLASHATTN_CI_TORCH:-1}, ${free_gb} GB free): torch-layer, ring and plot tests skip" >&2
fi

echo "== pip install . (CPU backend only)"
"$PYTHON" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall . \
  -Ccmake.define.FLASHATTN_CUDA=OFF \
  -Ccmake.define.FLASHATTN_BUILD_TESTS=OFF \
  -Ccmake.define.FLASHATTN_BUILD_BENCH=OFF \
  -Cbuild.tool-args=-j"$JOBS"

echo "== pytest tests/python"
# From /tmp, so that the installed package is imported (never the source tree).
repo=$(pwd)
set +e
(cd /tmp && "$PYTHON" -m pytest "$repo/tests/python" -q -p no:cacheprovider -rs)
status=$?
set -e
if [[ $status -eq 5 ]]; then
  echo "tests/python: pytest collected no test" >&2
  exit 1
fi
exit $status
