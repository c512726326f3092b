#!/usr/bin/env bash
# flash-attention's own tests (tests/test_flash_attn.py of Dao-AILab/flash-attention)
# against flashattn's drop-in: `import flash_attn` resolves to flashattn's shim
# (flashattn.compat, put first on PYTHONPATH for this run only; a real flash_attn installed
# beside it is not touched), a seeded random sample of the collected tests runs, and the
# pass count is printed. Fetches nothing: the test file is given as an argument.
#
#   tests/python/run_upstream.sh PATH/test_flash_attn.py [SAMPLE [SEED]] [-- PYTEST_ARGS...]
#
# SAMPLE: tests to draw (default 400; 0 = all, 508,772 in v2.8.3), SEED (default 0): the
# same file, SAMPLE and SEED run the same tests; `-- -k NAME` draws them from the tests
# -k keeps (-k test_flash_attn_causal: that function alone). Needs a GPU (the test file
# asks torch for the device capability at import), flashattn installed with the CUDA
# backend (e.g. by tests/python/run_gpu_tests.sh, or `pip install .`), torch, pytest and
# einops. Head dims that are not compiled into the build (FLASHATTN_HEAD_DIMS) fail as
# UnsupportedError: build all eight buckets for a fair count. Writes
# build-py/upstream-{junit.xml,pytest.log}.
#
# UPSTREAM_TIME_LIMIT=S: stop the tests after S seconds (SIGINT to pytest) and count those
# that ran.
#
# UPSTREAM_CPU=1: no GPU needed. A copy of the test file with its CUDA device strings
# turned into "cpu" (and compute capability 9.0) runs on CPU tensors with the drop-in's
# CUDA-tensor paths forced on (flashattn.interface._EMULATE_CUDA: head-dim padding,
# cache_leftpad as a paged cache, flash_attn's S_dmask layout); slow (the CPU backend):
# draw small samples. A check of the Python layer, not of the CUDA kernels.
set -euo pipefail
if [[ $# -lt 1 || ! -f $1 ]]; then
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
test_file=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
sample=400
seed=0
if [[ $# -gt 0 && $1 != -- ]]; then sample=$1; shift; fi
if [[ $# -gt 0 && $1 != -- ]]; then seed=$1; shift; fi
if [[ $# -gt 0 && $1 == -- ]]; then shift; fi

repo=$(cd "$(dirname "$0")/../.." && pwd)
if [[ ${UPSTREAM_CPU:-0} == 1 ]]; then
  cpu_dir=$(mktemp -d)
  trap 'rm -rf "$cpu_dir"' EXIT
  sed -e 's/device *= *"cuda"/device = "cpu"/g' -e 's/device="cuda"/device="cpu"/g' \
      -e 's/torch\.cuda\.get_device_capability("cuda")/(9, 0)/g' \
      -e 's/torch\.cuda\.get_device_properties("cuda")\.total_memory/(80 * 2**30)/g' \
      "$test_file" > "$cpu_dir/$(basename "$test_file")"
  printf '%s\n' "# UPSTREAM_CPU=1: the CUDA-tensor paths of the drop-in on CPU tensors" \
      "import flashattn.interface" "flashattn.interface._EMULATE_CUDA = True" \
      > "$cpu_dir/conftest.py"
  test_file=$cpu_dir/$(basename "$test_file")
fi
PYTHON=${PYTHON:-python3}
mkdir -p "$repo/build-py"
junit=$repo/build-py/upstream-junit.xml
log=$repo/build-py/upstream-pytest.log

shim=$(cd /tmp && "$PYTHON" -m flashattn.compat)
export PYTHONPATH="$shim:$repo/tests/python/upstream${PYTHONPATH:+:$PYTHONPATH}"
(cd /tmp && "$PYTHON" - <<'PY'
import flash_attn, flashattn
assert getattr(flash_attn, "__flashattn_shim__", False), flash_attn.__file__
try:
    import einops  # noqa: F401
except ImportError:
    print("run_upstream: warning: einops is not installed; flash-attention's test file "
          "imports it (pip install einops)")
print(f"flash_attn -> flashattn {flashattn.__version__} (shim {flash_attn.__file__}), "
      f"CUDA backend: {flashattn.cuda_available()}")
PY
)

set +e
# From the test file's folder, with no config file: its own conftest.py (if any) applies,
# this repository's pytest settings do not.
# SIGINT, not TERM: pytest stops at its current test and still writes the junit report.
limit=()
if [[ -n ${UPSTREAM_TIME_LIMIT:-} ]]; then limit=(timeout -s INT -k 30 "$UPSTREAM_TIME_LIMIT"); fi
(cd "$(dirname "$test_file")" && "${limit[@]}" "$PYTHON" -m pytest "$test_file" -c /dev/null \
   --rootdir "$(dirname "$test_file")" -p upstream_sample --upstream-sample "$sample" \
   --upstream-seed "$seed" -q -p no:cacheprovider --junitxml "$junit" -o junit_family=xunit2 \
   "$@" > "$log" 2>&1)
status=$?
set -e
tail -n 15 "$log"
"$PYTHON" - "$junit" "$sample" "$seed" <<'PY'
import sys
import xml.etree.ElementTree as ET
path, sample, seed = sys.argv[1:]
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"run_upstream: no junit report ({e}); see the pytest log")
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
total = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) for s in suites)
errors = sum(int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
passed = total - failed - errors - skipped
print(f"upstream: {passed} passed of {total - skipped} run ({total} sampled with seed {seed}; "
      f"{failed} failed, {errors} errors, {skipped} skipped)")
PY
# pytest's status: 0 all passed, 1 some failed; 5 nothing collected.
if [[ $status -ne 0 && $status -ne 1 ]]; then exit "$status"; fi
