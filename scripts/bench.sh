#!/usr/bin/env bash
# The unified benchmark (issue 6) in one command: builds the Python package from this tree
# (CUDA for sm90, head dims 64;128;256, with -j of the machine's cores; CPU-only with
# --cpu) into build-py/bench-site-<mode>, then runs bench/suite.py in one Python process:
# flashattn against PyTorch SDPA's FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION
# and MATH backends and a naive computation, on the standard grid, the decode grid and a
# memory sweep. Results (results.csv, results.json, report.md, PNG plots when matplotlib is
# installed) go to build/bench-results/<date>-<device>/ unless --out DIR is given; the table of
# ratios is printed last.
#
#   bash scripts/bench.sh [--cpu] [--quick] [--out DIR] [--no-build] [suite options]
#   bash scripts/bench.sh --plot DIR     # only the plots, from DIR/results.json
#
# Needs python3 with torch (CUDA build for the GPU mode), numpy, nanobind,
# scikit-build-core, cmake, ninja, and nvcc at /usr/local/cuda for the GPU mode; no network
# (pip builds with --no-build-isolation --no-deps). Environment: PYTHON, JOBS,
# FLASHATTN_CUDA_ARCHS (default 90), FLASHATTN_HEAD_DIMS (default "64;128;256"),
# BENCH_BUILD_DIR, BENCH_SITE (where the package is built and installed).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
mode=cuda
build=1
args=()
for a in "$@"; do
  case "$a" in
    --cpu) mode=cpu; args+=("$a") ;;
    --no-build) build=0 ;;
    --plot) exec "$PYTHON" bench/suite.py "$@" ;;
    -h|--help) sed -n '2,20p' "$0"; exec "$PYTHON" bench/suite.py --help ;;
    *) args+=("$a") ;;
  esac
done

JOBS=${JOBS:-$(nproc)}
SITE=${BENCH_SITE:-build-py/bench-site-$mode}
BUILD_DIR=${BENCH_BUILD_DIR:-build-py/bench-$mode}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1
export PATH=/usr/local/cuda/bin:$PATH
if [ -z "${FLASHATTN_COMMIT:-}" ] && git rev-parse --short HEAD >/dev/null 2>&1; then
  export FLASHATTN_COMMIT=$(git rev-parse --short HEAD)
fi

if [ "$build" = 1 ]; then
  mkdir -p build-py
  if [ "$mode" = cuda ]; then
    defs=(-Ccmake.define.FLASHATTN_CUDA=ON
          -Ccmake.define.FLASHATTN_CUDA_ARCHS="${FLASHATTN_CUDA_ARCHS:-90}"
          -Ccmake.define.FLASHATTN_HEAD_DIMS="${FLASHATTN_HEAD_DIMS:-64;128;256}")
  else
    defs=(-Ccmake.define.FLASHATTN_CUDA=OFF)
  fi
  echo "== building the package ($mode, -j$JOBS) into $SITE" >&2
  t0=$(date +%s)
  if ! "$PYTHON" -m pip install --no-build-isolation --no-deps --upgrade --target "$SITE" . \
      "${defs[@]}" -Cbuild-dir="$BUILD_DIR" -Cbuild.tool-args=-j"$JOBS" -v \
      > build-py/bench-$mode-install.log 2>&1; then
    tail -n 40 build-py/bench-$mode-install.log >&2
    echo "scripts/bench.sh: pip install failed (log: build-py/bench-$mode-install.log)" >&2
    exit 1
  fi
  echo "   built in $(( $(date +%s) - t0 )) s" >&2
fi

[ -d "$SITE/flashattn" ] || { echo "scripts/bench.sh: no package in $SITE (drop --no-build)" >&2; exit 1; }
export PYTHONPATH="$(cd "$SITE" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" bench/suite.py "${args[@]}"
