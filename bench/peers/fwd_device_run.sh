#!/bin/bash
# One device session for the CUDA forward: GPU tests, compute-sanitizer (memcheck and
# racecheck on a small filter), SASS checks and the benchmark against SDPA's
# FLASH_ATTENTION backend. Results go to $OUT (default ./out).
#   bash bench/peers/fwd_device_run.sh [build dir] [steps: tests,sanitize,sass,bench]
B=${1:-build-cuda-fwd}
STEPS=${2:-tests,sanitize,sass,bench}
OUT=${OUT:-out}
mkdir -p "$OUT"
T=$B/tests/flashattn_cuda_tests
nvidia-smi -L
if [[ $STEPS == *tests* ]]; then
  timeout 240 $T --gtest_filter='CudaForward*:Cuda/CudaForwardFeature*:CudaRuntime*' > "$OUT/tests.txt" 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" "$OUT/tests.txt" | head -40
  grep -B2 -A12 "Failure" "$OUT/tests.txt" | head -80
fi
if [[ $STEPS == *sanitize* ]]; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $T \
    --gtest_filter='CudaForward.HeadDims:CudaForward.VarlenWith*:CudaForward.KVCache*:Cuda/CudaForwardFeature.MatchesOracle/everything' \
    > "$OUT/memcheck.txt" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.txt" | head -5
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $T \
    --gtest_filter='Cuda/CudaForwardFeature.MatchesOracle/plain:Cuda/CudaForwardFeature.MatchesOracle/window_both' \
    > "$OUT/racecheck.txt" 2>&1
  echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" "$OUT/racecheck.txt" | head -5
fi
if [[ $STEPS == *sass* ]]; then
  cuobjdump --dump-sass $T > /tmp/sass.txt
  echo "HMMA in binary: $(grep -c HMMA /tmp/sass.txt); LDL|STL in binary: $(grep -c -E 'LDL|STL' /tmp/sass.txt)"
  # Per forward kernel: HMMA count, LDL/STL count, and how many LDL/STL lie between the
  # first and the last HMMA (the main loop).
  awk 'function hex(x,  i, v) { v = 0; for (i = 1; i <= length(x); i++) v = v * 16 + index("0123456789abcdef", substr(x, i, 1)) - 1; return v }
       /Function : /{f=$3} f ~ /fwd_kernel/ && match($0, /\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]+\*\//) {
         a = hex(substr($0, RSTART + 2, RLENGTH - 4));
         if ($0 ~ /HMMA/) { h[f]++; if (!(f in lo)) lo[f] = a; hi[f] = a }
         if ($0 ~ /LDL|STL/) { n[f]++; addr[f, n[f]] = a } }
       END { for (k in h) { inside = 0; for (i = 1; i <= n[k]; i++) if (addr[k, i] > lo[k] && addr[k, i] < hi[k]) inside++;
             printf "%s HMMA=%d LDL/STL=%d in_main_loop=%d\n", k, h[k], n[k], inside } }' /tmp/sass.txt | sort > "$OUT/sass_fwd.txt"
  cat "$OUT/sass_fwd.txt"
fi
if [[ $STEPS == *bench* ]]; then
  BENCH=${BENCH:-$B/bench/flashattn_cuda_fwd_bench}
  timeout 150 $BENCH "$OUT/ours_fwd.csv" > "$OUT/ours_fwd.txt" 2>&1; echo "bench rc=$?"
  timeout 200 python3 bench/peers/sdpa_fwd.py "$OUT/peer_fwd.csv" > "$OUT/peer_fwd.txt" 2>&1; echo "peer rc=$?"
  python3 bench/peers/compare.py "$OUT/ours_fwd.csv" "$OUT/peer_fwd.csv" "forward, bf16, $(date -u +%F)" | tee "$OUT/fwd_table.md"
fi
