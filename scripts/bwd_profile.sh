#!/usr/bin/env bash
# Backward profiling on the GPU machine (issue 3): Nsight Compute's full set plus SASS-level
# stall sampling for our backward main kernel and for PyTorch SDPA's FLASH_ATTENTION
# (FlashAttention-2) backward kernel, one 16k non-causal launch each per head dim, side by
# side: time, instructions, shared-memory wavefronts, L2 atomics, stalls; then the
# instructions that hold the most stall samples in ours. Reports and CSVs to $OUT.
#   bash scripts/bwd_profile.sh [head dims]   (default "64 256")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
B=${BUILD:-build/h200}
DIMS=${1:-64 256}
S=${SEQ:-16384}
mkdir -p "$OUT/prof"
P="$OUT/prof"
for d in $DIMS; do
  timeout 180 ncu --set full --import-source no --section SourceCounters --kernel-name regex:bwd_main \
    --launch-skip 2 --launch-count 1 -f -o "$P/ours_d$d" "$B/bench/flashattn_cuda_bwd_bench" --one "$d" 0 "$S" \
    >"$P/ours_d$d.log" 2>&1 || tail -5 "$P/ours_d$d.log"
  timeout 180 ncu --set full --import-source no --section SourceCounters --profile-from-start off \
    --kernel-name regex:dq_dk_dv --launch-count 1 -f -o "$P/peer_d$d" \
    python3 bench/peers/sdpa_bwd_profile.py "$d" "$S" >"$P/peer_d$d.log" 2>&1 || tail -5 "$P/peer_d$d.log"
  for w in ours peer; do
    [ -f "$P/${w}_d$d.ncu-rep" ] || continue
    ncu -i "$P/${w}_d$d.ncu-rep" --page details --csv >"$P/${w}_d${d}_details.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page raw --csv >"$P/${w}_d${d}_raw.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page source --print-source sass --csv >"$P/${w}_d${d}_sass.csv" 2>/dev/null
  done
done
python3 scripts/bwd_profile_report.py "$P" $DIMS | tee "$OUT/bwd_profile.txt"
tar cf - -C "$OUT" prof | xz -T0 -6 >"$OUT/prof.tar.xz" && rm -rf "$P"
