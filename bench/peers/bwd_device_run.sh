#!/usr/bin/env bash
# One device call of the backward work: GPU backward tests of the candidate build (and of
# a fallback build if they fail), our benchmark and the SDPA flash peer side by side,
# then compute-sanitizer memcheck / racecheck on small filters; the table prints last.
# Usage (repo root, device machine): bench/peers/bwd_device_run.sh CANDIDATE_DIR [FALLBACK_DIR]
# where each dir holds flashattn_cuda_tests and flashattn_cuda_bwd_bench.
cand=$1 fallback=${2:-}
out=${OUT:-/tmp/bwd_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
use=$cand
if ! timeout 60 "$cand/flashattn_cuda_tests" --gtest_filter='*Backward*' >"$out/tests.txt" 2>&1; then
  echo "candidate tests FAILED:"; grep -E "FAILED|Failure|seed" "$out/tests.txt" | head -20
  if [ -n "$fallback" ]; then
    use=$fallback
    timeout 60 "$fallback/flashattn_cuda_tests" --gtest_filter='*Backward*' >"$out/tests_fallback.txt" 2>&1
    echo "fallback tests rc=$?"; tail -3 "$out/tests_fallback.txt"
  fi
fi
tail -3 "$out/tests.txt"
timeout 50 "$use/flashattn_cuda_bwd_bench" >"$out/ours.txt" 2>&1
timeout 70 python3 bench/peers/sdpa_bwd.py --ours "$out/ours.txt" >"$out/table.md" 2>&1
if [ -n "$fallback" ] && [ "$use" = "$cand" ]; then  # fallback's hdim 256 cells, to attribute
  for c in "256 0 2048" "256 0 16384" "256 1 16384"; do
    timeout 8 "$fallback/flashattn_cuda_bwd_bench" --one $c | grep '^bwd' >>"$out/fallback_256.txt"
  done
fi
sani="compute-sanitizer --print-limit 5 --error-exitcode 9"
timeout 40 $sani --tool racecheck "$use/flashattn_cuda_tests" \
  --gtest_filter='Cuda/CudaBackwardFeature.MatchesOracle/plain:CudaBackward.HeadDims' \
  >"$out/racecheck.txt" 2>&1
echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|hazard|PASSED|FAILED" "$out/racecheck.txt" | head -5
timeout 25 $sani --tool memcheck "$use/flashattn_cuda_tests" \
  --gtest_filter='Cuda/CudaBackwardFeature.MatchesOracle/gqa4_causal:CudaBackward.Varlen*:CudaBackward.Deterministic*' \
  >"$out/memcheck.txt" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.txt" | head -5
echo "used: $use"; echo "fallback (hdim 256):"; cat "$out/fallback_256.txt" 2>/dev/null
cat "$out/table.md"
