#!/usr/bin/env bash
# Issue 23's cluster split merge of up to 16 splits, on the GPU machine, in one call of at
# most ~4 minutes: the decode-related CUDA tests (one suite filter at a time, line-buffered,
# each under a timeout), compute-sanitizer racecheck of one 16-cluster-split decode step
# (CudaKVCache.Cluster16Step), then the A/B of split plans at batch 1 (bf16 dense cache, 32
# query heads over 8 KV heads, d 128, one query token; graph launches, median per call):
# contexts 2k, 4k, 8k, 16k, 32k x num_splits 0 (the heuristic), 32 (workspace splits: above
# 16 never a cluster; main's plan at 8k .. 32k), 8 (cluster; main's plan at 2k / 4k) and 16
# (cluster where the device holds 8 clusters of 16), two alternating rounds in one process;
# a table of us per step last.
#
#   bash scripts/decode_cl16_gpu.sh          (from the repository root; carry .cl16)
#
# Binaries: build/cl16/tests/flashattn_cuda_tests and build/cl16/bench/
# flashattn_cuda_decode_bench, unpacked from .cl16/bin.tar.zst (zstd --long=29, with the
# zstd binary and its libraries in .cl16/tools) where missing. Logs go to $OUT (default
# ./out). Environment: BUDGET (seconds for the whole script, default 225), SUITES (space
# separated gtest filters, replacing the default list).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
OUT=${OUT:-out}
mkdir -p "$OUT"
B=build/cl16
T=$B/tests/flashattn_cuda_tests
D=$B/bench/flashattn_cuda_decode_bench
start=$(date +%s)
BUDGET=${BUDGET:-225}
# The seconds a step may take: `want`, but no more than what is left of the budget after
# `reserve` seconds kept for the steps after it (at least 5).
tmo() {
  local want=$1 reserve=$2
  local l=$((BUDGET - ($(date +%s) - start) - reserve))
  [ "$l" -lt 5 ] && l=5
  [ "$want" -lt "$l" ] && echo "$want" || echo "$l"
}
summary=()

if { [ ! -x "$T" ] || [ ! -x "$D" ]; } && [ -f .cl16/bin.tar.zst ]; then
  if command -v zstd >/dev/null 2>&1; then
    zstd -dc --long=29 .cl16/bin.tar.zst | tar xf -
  else
    LD_LIBRARY_PATH=.cl16/tools${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} .cl16/tools/zstd -dc --long=29 .cl16/bin.tar.zst | tar xf -
  fi
fi
for x in "$T" "$D"; do
  [ -x "$x" ] || { echo "decode_cl16_gpu: $x missing (and no .cl16/bin.tar.zst to unpack)" >&2; exit 1; }
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

# ---- tests (the racecheck and the bench keep 130 s of the budget)
if [ -n "${SUITES:-}" ]; then
  read -r -a suites <<<"$SUITES"
else
  # (each also as */Suite*: the parameterized suites' instantiation prefixes)
  suites=("CudaKVCache*:*/CudaKVCache*-CudaKVCacheFp8Q*:*/CudaKVCacheFp8Q*" "CudaIndexGuards*:*/CudaIndexGuards*"
    "CudaSink*:*/CudaSink*" "CudaSmemCap*:*/CudaSmemCap*" "CudaKVCacheFp8Q*:*/CudaKVCacheFp8Q*" "CudaMla*:*/CudaMla*")
fi
for s in "${suites[@]}"; do
  name=$(echo "${s%%[*:]*}" | tr -c 'A-Za-z0-9\n' '_')
  t=$(tmo 100 130)
  t0=$(date +%s)
  timeout "$t" stdbuf -oL "$T" --gtest_brief=1 --gtest_filter="$s" >"$OUT/test_$name.txt" 2>&1
  rc=$?
  dt=$(($(date +%s) - t0))
  passed=$(grep -oE '\[  PASSED  \] [0-9]+' "$OUT/test_$name.txt" | grep -oE '[0-9]+$' || true)
  skipped=$(grep -oE '\[  SKIPPED \] [0-9]+' "$OUT/test_$name.txt" | grep -oE '[0-9]+$' || true)
  failed=$(grep -E '^\[  FAILED  \] [A-Za-z]' "$OUT/test_$name.txt" | sed 's/^\[  FAILED  \] //' | tr '\n' ' ')
  if [ $rc = 124 ]; then
    state="TIMEOUT after ${t}s (last: $(grep -E '^\[ RUN' "$OUT/test_$name.txt" | tail -1 | sed 's/.*RUN *\] *//'))"
  elif [ $rc = 0 ]; then
    state="ok, ${passed:-0} passed, ${skipped:-0} skipped"
  else
    state="FAILED rc $rc: ${failed:-see $OUT/test_$name.txt}"
    grep -E 'Failure|Expected|Which is|actual|error' "$OUT/test_$name.txt" | head -20
  fi
  echo "tests ${s%%:*}: $state (${dt}s)"
  summary+=("tests ${s%%:*}: $state (${dt}s)")
done

# ---- racecheck of one 16-cluster-split step
t=$(tmo 60 70)
FLASHATTN_TEST_UNGATED=1 timeout "$t" compute-sanitizer --tool racecheck --error-exitcode 9 "$T" \
  --gtest_filter=CudaKVCache.Cluster16Step >"$OUT/racecheck.txt" 2>&1
rc=$?
case $rc in
  0) state="ok ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/racecheck.txt" | tail -1))" ;;
  124) state="TIMEOUT after ${t}s" ;;
  127) state="compute-sanitizer not found" ;;
  *) state="FAILED rc $rc"; grep -E 'hazard|ERROR|Failure' "$OUT/racecheck.txt" | head -10 ;;
esac
grep -E 'SKIPPED|skipped' "$OUT/racecheck.txt" | head -2
echo "racecheck CudaKVCache.Cluster16Step: $state"
summary+=("racecheck CudaKVCache.Cluster16Step: $state")

# ---- A/B of the split plans, batch 1
t=$(tmo 90 3)
BENCH_SWEEP=1 BENCH_SWEEP_BATCHES=1 BENCH_SWEEP_CONTEXTS=2048,4096,8192,16384,32768 BENCH_SWEEP_SPLITS=0,32,8,16 \
  BENCH_SWEEP_ROUNDS=2 timeout "$t" stdbuf -oL "$D" "$OUT/decode_ab.csv" >"$OUT/decode_ab.txt" 2>&1
rc=$?
[ $rc = 0 ] || summary+=("decode A/B bench: rc $rc (124: timeout after ${t}s); $OUT/decode_ab.txt")

echo
echo "== summary ($(($(date +%s) - start)) s)"
for l in "${summary[@]}"; do echo "$l"; done
echo
echo "== us per decode step, batch 1, bf16 dense, 32/8 heads, d 128 (round 0 / round 1; cl: no workspace, ws: workspace)"
echo "== main's plan: 8 cluster splits at 2k / 4k, 32 workspace splits at 8k .. 32k"
awk -F'|' '
  /^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [0-9]+ \|/ {
    r = $2 + 0; ctx = $4 + 0; sp = $5 + 0; ws = $6 + 0; us = $7 + 0;
    key = ctx "," sp; v[key, r] = us; kind[key] = (ws > 0 ? "ws" : "cl"); seen[ctx] = 1;
  }
  END {
    n = split("0 32 8 16", sps, " ");
    printf "| context | heuristic | 32 splits | 8 splits | 16 splits |\n|---|---|---|---|---|\n";
    for (ctx = 1024; ctx <= 131072; ctx *= 2) {
      if (!(ctx in seen)) continue;
      line = "| " ctx;
      for (i = 1; i <= n; ++i) {
        key = ctx "," sps[i];
        if (!(key in kind)) { line = line " | -"; continue; }
        a = ((key, 0) in v) ? sprintf("%.1f", v[key, 0]) : "-";
        b = ((key, 1) in v) ? sprintf("%.1f", v[key, 1]) : "-";
        line = line " | " a " / " b " " kind[key];
      }
      print line " |";
    }
  }' "$OUT/decode_ab.txt"
