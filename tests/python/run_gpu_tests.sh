#!/usr/bin/env bash
# The Python suite on a GPU machine (H200, sm90): build and install the package from the
# working tree with the CUDA backend, then run tests/python with CUDA tensors.
# Expects python3 with torch (CUDA), numpy, nanobind, scikit-build-core, pytest, cmake,
# ninja and nvcc at /usr/local/cuda; needs no network. Pruned for time: sm90 SASS only,
# head dims 64 and 128 (what the CUDA tests use). Override with FLASHATTN_CUDA_ARCHS /
# FLASHATTN_HEAD_DIMS in the environment. Writes build-py/gpu-*.log.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
ARCHS=${FLASHATTN_CUDA_ARCHS:-90}
HEAD_DIMS=${FLASHATTN_HEAD_DIMS:-64;128}
JOBS=${JOBS:-$(nproc)}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# Ubuntu's system Python is "externally managed" (PEP 668); this machine is disposable.
export PIP_BREAK_SYSTEM_PACKAGES=1
export PATH=/usr/local/cuda/bin:$PATH
mkdir -p build-py

"$PYTHON" - <<'PY'
import torch, sys
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"cuda available: {torch.cuda.is_available()}, "
      f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}")
PY

echo "== pip install . (CUDA archs ${ARCHS}, head dims ${HEAD_DIMS})"
start=$(date +%s)
if ! "$PYTHON" -m pip install --no-build-isolation --no-deps --force-reinstall . \
    -Ccmake.define.FLASHATTN_CUDA=ON \
    -Ccmake.define.FLASHATTN_CUDA_ARCHS="${ARCHS}" \
    -Ccmake.define.FLASHATTN_HEAD_DIMS="${HEAD_DIMS}" \
    -Ccmake.define.FLASHATTN_BUILD_TESTS=OFF \
    -Ccmake.define.FLASHATTN_BUILD_BENCH=OFF \
    -Cbuild.tool-args=-j"${JOBS}" -v > build-py/gpu-install.log 2>&1; then
  tail -n 60 build-py/gpu-install.log
  echo "pip install failed (full log: build-py/gpu-install.log)" >&2
  exit 1
fi
echo "   built and installed in $(( $(date +%s) - start )) s"

echo "== pytest tests/python"
repo=$(pwd)
(cd /tmp && "$PYTHON" - <<'PY'
import flashattn
assert flashattn.cuda_available(), "flashattn was built without CUDA or sees no GPU"
print("flashattn", flashattn.__version__, "with the CUDA backend")
PY
)
set +e
# pipefail (inherited by the subshell) makes its status pytest's.
(cd /tmp && "$PYTHON" -m pytest "$repo/tests/python" -q -p no:cacheprovider -rs \
   --durations=10 2>&1 | tee "$repo/build-py/gpu-pytest.log")
status=$?
set -e
if [[ $status -eq 5 ]]; then
  echo "tests/python: pytest collected no test" >&2
  exit 1
fi
exit "$status"
