#!/usr/bin/env bash
# Forward profiling on the GPU machine (issue 3): Nsight Compute's full set plus SASS-level
# stall sampling for our forward kernel and for PyTorch SDPA's FLASH_ATTENTION
# (FlashAttention-2) forward kernel, one non-causal launch each per head dim at seqlen $SEQ
# (default 512, 16k tokens), summarised side by side by scripts/bwd_profile_report.py.
#   SEQ=512 bash scripts/fwd_profile.sh [head dims]   (default "256 128")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
B=${BUILD:-build/h200}
DIMS=${1:-256 128}
S=${SEQ:-512}
mkdir -p "$OUT/fprof"
P="$OUT/fprof"
for d in $DIMS; do
  timeout 180 ncu --set full --import-source no --section SourceCounters --kernel-name regex:fwd_kernel \
    --launch-skip 2 --launch-count 1 -f -o "$P/ours_d$d" "$B/bench/flashattn_cuda_fwd_bench" - "$d" 0 "$S" \
    >"$P/ours_d$d.log" 2>&1 || tail -5 "$P/ours_d$d.log"
  timeout 180 ncu --set full --import-source no --section SourceCounters --profile-from-start off \
    --kernel-name regex:flash_fwd --launch-count 1 -f -o "$P/peer_d$d" \
    python3 bench/peers/sdpa_fwd_profile.py "$d" "$S" >"$P/peer_d$d.log" 2>&1 || tail -5 "$P/peer_d$d.log"
  for w in ours peer; do
    [ -f "$P/${w}_d$d.ncu-rep" ] || continue
    ncu -i "$P/${w}_d$d.ncu-rep" --page details --csv >"$P/${w}_d${d}_details.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page raw --csv >"$P/${w}_d${d}_raw.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page source --print-source sass --csv >"$P/${w}_d${d}_sass.csv" 2>/dev/null
  done
done
python3 scripts/bwd_profile_report.py "$P" $DIMS | tee "$OUT/fwd_profile.txt"
tar cf - -C "$OUT" fprof | xz -T0 -6 >"$OUT/fprof.tar.xz" && rm -rf "$P"
