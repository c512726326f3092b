#!/usr/bin/env bash
# The sm90 MLA decode kernel's load overlap (branch mla-next: in the P-first order the
# other's tile is released before the wait for the own stage, so two tile loads can be in
# flight; each stage lands in 3 column-block groups with a full barrier each and S(t) issues
# a group's k-steps as soon as it has landed) against main (c0e7acf), on the GPU machine, in
# one call of ~4-7 minutes:
#   1. the MLA test suites of the new build ('CudaMla*:*/CudaMla*', the new
#      CudaMlaKVCacheRescale included), in three processes under `timeout 150 stdbuf -oL`
#      (each case runs the sm90 and the sm80 kernel: gpu_families());
#   2. racecheck (compute-sanitizer --tool racecheck --racecheck-report hazard) of the new
#      build on three small MLA cases (paged 16 with 5 splits, the growing-scores case,
#      the 1-4 tiles per split case), under `timeout 240`;
#   3. the MLA decode bench (BENCH_MLA=1: batch 64, 128 query heads over one latent head,
#      d 64 + d_v 512, paged 64, bf16, contexts 4k and 32k), base and new alternating, two
#      rounds (base, new, base, new), each into its own CSV;
#   4. a short table last: us per call of each round, useful TFLOP/s (2 x 128 x 1088 flops
#      per key and sequence) of the better round, new / base speed.
#
#   bash scripts/mla_gpu.sh [tests|bench|race|all]   (default all; from the repository root)
#   TESTS_FILTER=<gtest filter>                    one test process with that filter instead
#
# Binaries, from mla2_pack.tar.zst (unpacked here when mla-new/ is missing; zstd from the
# PATH or .carry/tools/):
#   mla-base/flashattn_cuda_tests, mla-base/flashattn_cuda_decode_bench   (main c0e7acf)
#   mla-new/flashattn_cuda_tests,  mla-new/flashattn_cuda_decode_bench    (this branch)
# built with -DFLASHATTN_CUDA=ON -DFLASHATTN_CUDA_ARCHS=90 -DFLASHATTN_HEAD_DIMS="64;128"
# (Release). Logs and CSVs go to $OUT (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gtest_state.sh
STEPS=${1:-all}
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/mla_gpu.log"
: >"$LOG"
summary=()

PACK=mla2_pack.tar.zst
if [ ! -x mla-new/flashattn_cuda_tests ] && [ -f "$PACK" ]; then
  if command -v zstd >/dev/null; then
    zstd -dc --long=29 "$PACK" | tar xf -
  elif [ -x .carry/tools/zstd ]; then
    LD_LIBRARY_PATH=.carry/tools${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} .carry/tools/zstd -dc --long=29 "$PACK" | tar xf -
  fi
fi
for v in mla-base mla-new; do
  for b in flashattn_cuda_tests flashattn_cuda_decode_bench; do
    [ -x "$v/$b" ] || { echo "mla_gpu: $v/$b missing (unpack $PACK here)" | tee -a "$LOG" >&2; exit 1; }
  done
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$LOG"

# ---------------------------------------------------------------- 1. tests (new build)
run_tests() {  # name filter
  local name=$1 filter=$2 out="$OUT/mla_tests_$1.txt" t0 rc state
  echo "==== tests $name: $filter" | tee -a "$LOG"
  t0=$(date +%s)
  timeout 150 stdbuf -oL mla-new/flashattn_cuda_tests --gtest_filter="$filter" >"$out" 2>&1
  rc=$?
  cat "$out" >>"$LOG"
  state=$(gtest_state "$out" $rc 150)
  summary+=("tests $name: $state ($(($(date +%s) - t0)) s)")
}
if [ "$STEPS" = all ] || [ "$STEPS" = tests ]; then
  if [ -n "${TESTS_FILTER:-}" ]; then
    run_tests filter "$TESTS_FILTER"
  else
    # 'CudaMla*:*/CudaMla*' in three processes (the parameterized KV-cache suite alone
    # takes ~1 minute with both kernels per case).
    run_tests kvcache '*/CudaMlaKVCache.*'
    run_tests options 'CudaMlaKVCacheRescale.*:CudaMlaKVCacheOptions.*:CudaMlaKVCacheSplits.*:CudaMlaKVCacheGraph.*'
    run_tests forward 'CudaMlaForward.*:CudaMlaSm90Dispatch.*:CudaMlaErrors.*:*/CudaMlaForward*'
  fi
fi

# ---------------------------------------------------------------- 2. racecheck (new build)
if [ "$STEPS" = all ] || [ "$STEPS" = race ]; then
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  race_filter='Cuda/CudaMlaKVCache.MatchesCpuAndOracle/decode_h16_paged16_split5:CudaMlaKVCacheRescale.GrowingScores'
  race_filter="$race_filter:Cuda/CudaMlaKVCache.MatchesCpuAndOracle/decode_h64_paged64_tile_counts"
  echo "==== racecheck: $race_filter" | tee -a "$LOG"
  t0=$(date +%s)
  if [ -x "$SAN" ]; then
    timeout 240 "$SAN" --tool racecheck --racecheck-report hazard \
      mla-new/flashattn_cuda_tests --gtest_filter="$race_filter" >"$OUT/mla_racecheck.txt" 2>&1
    rc=$?
    cat "$OUT/mla_racecheck.txt" >>"$LOG"
    hazards=$(grep -E 'RACECHECK SUMMARY|hazard' "$OUT/mla_racecheck.txt" | tail -3 | tr '\n' ' ')
    ran=$(grep -cE '^\[       OK \]' "$OUT/mla_racecheck.txt" || true)
    summary+=("racecheck: rc $rc, $ran tests ok; ${hazards:-no hazard lines} ($(($(date +%s) - t0)) s)")
  else
    summary+=("racecheck: compute-sanitizer not found")
  fi
fi

# ---------------------------------------------------------------- 3. bench A/B
if [ "$STEPS" = all ] || [ "$STEPS" = bench ]; then
  for round in 1 2; do
    for v in base new; do
      csv="$OUT/mla_bench_${v}_r$round.csv"
      echo "==== bench $v round $round" | tee -a "$LOG"
      BENCH_MLA=1 BENCH_BATCH=64 timeout 240 stdbuf -oL "mla-$v/flashattn_cuda_decode_bench" "$csv" >>"$LOG" 2>&1 ||
        echo "bench $v round $round: rc $?" | tee -a "$LOG"
    done
  done
  # CSV rows: mla,batch,ctx,block,fp8,us,tbps,tokens_per_s,stream_us,stream_tbps
  table=$(python3 - "$OUT" <<'EOF'
import csv, sys, os
out = sys.argv[1]
us = {}  # (variant, ctx) -> [us per round]
for v in ('base', 'new'):
    for r in (1, 2):
        p = os.path.join(out, f'mla_bench_{v}_r{r}.csv')
        if not os.path.exists(p):
            continue
        for row in csv.DictReader(open(p)):
            us.setdefault((v, int(row['ctx'])), []).append(float(row['us']))
print('| context | base us (rounds) | new us (rounds) | base TFLOP/s | new TFLOP/s | new / base speed |')
print('|---|---|---|---|---|---|')
for ctx in (4096, 32768):
    b, n = us.get(('base', ctx), []), us.get(('new', ctx), [])
    flops = 2.0 * 128 * 1088 * ctx * 64
    tf = lambda l: f'{flops / min(l) / 1e6:.0f}' if l else '-'
    sp = f'{min(b) / min(n):.3f}' if b and n else '-'
    print(f"| {ctx} | {' / '.join(f'{x:.1f}' for x in b) or '-'} | {' / '.join(f'{x:.1f}' for x in n) or '-'} "
          f"| {tf(b)} | {tf(n)} | {sp} |")
EOF
  )
  echo "$table" >>"$LOG"
fi

echo
echo "==== summary (log: $LOG)"
for s in "${summary[@]}"; do echo "$s"; done
[ -n "${table:-}" ] && echo "$table"
