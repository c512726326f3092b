#!/usr/bin/env bash
# Forward or backward profiling on the GPU machine (issue 3): Nsight Compute's full set plus
# SASS-level stall sampling for our kernel and for PyTorch SDPA's FLASH_ATTENTION
# (FlashAttention-2) kernel of the pass (bench/peers/sdpa_profile.py), one non-causal launch
# each per head dim (16k tokens), side by side by scripts/bwd_profile_report.py: time,
# instructions, shared-memory wavefronts, L2 atomics, stalls; then the instructions that
# hold the most stall samples in ours. Reports and CSVs to $OUT (default ./out).
#   fwd: our fwd_kernel vs flash_fwd, seqlen $SEQ (default 512), head dims "256 128";
#        $OUT/fwd_profile.txt and $OUT/fprof.tar.xz
#   bwd: our bwd_main vs flash_bwd_dq_dk_dv, seqlen $SEQ (default 16384), head dims "64 256";
#        $OUT/bwd_profile.txt and $OUT/prof.tar.xz
#   [SEQ=N] bash scripts/profile.sh fwd|bwd [head dims]   (or PASS=fwd|bwd instead of the word,
#   DIMS="..." instead of the head dims)
set -uo pipefail
usage() {
  [ $# -eq 0 ] || echo "profile.sh: $1" >&2
  echo "usage: [SEQ=N] [OUT=dir] [BUILD=dir] bash scripts/profile.sh fwd|bwd [\"head dims\"]" >&2
  echo "       (or PASS=fwd|bwd and DIMS=\"head dims\" in the environment)" >&2
  exit 2
}
case ${1:-} in fwd | bwd) PASS=$1; shift ;; esac
case ${PASS:-} in
  fwd) dims="256 128" seq=512 kernel=fwd_kernel one=- peer=flash_fwd sub=fprof ;;
  bwd) dims="64 256" seq=16384 kernel=bwd_main one=--one peer=dq_dk_dv sub=prof ;;
  *) usage "the first argument (or PASS) must be fwd or bwd, not '${PASS:-${1:-}}'" ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
B=${BUILD:-build/h200}
DIMS=${*:-${DIMS:-$dims}}  # head dims: the arguments after the pass, else $DIMS, else the default
S=${SEQ:-$seq}
mkdir -p "$OUT/$sub"
P="$OUT/$sub"
for d in $DIMS; do
  timeout 180 ncu --set full --import-source no --section SourceCounters --kernel-name regex:$kernel \
    --launch-skip 2 --launch-count 1 -f -o "$P/ours_d$d" "$B/bench/flashattn_cuda_${PASS}_bench" $one "$d" 0 "$S" \
    >"$P/ours_d$d.log" 2>&1 || tail -5 "$P/ours_d$d.log"
  timeout 180 ncu --set full --import-source no --section SourceCounters --profile-from-start off \
    --kernel-name regex:$peer --launch-count 1 -f -o "$P/peer_d$d" \
    python3 bench/peers/sdpa_profile.py "$PASS" "$d" "$S" >"$P/peer_d$d.log" 2>&1 || tail -5 "$P/peer_d$d.log"
  for w in ours peer; do
    [ -f "$P/${w}_d$d.ncu-rep" ] || continue
    ncu -i "$P/${w}_d$d.ncu-rep" --page details --csv >"$P/${w}_d${d}_details.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page raw --csv >"$P/${w}_d${d}_raw.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page source --print-source sass --csv >"$P/${w}_d${d}_sass.csv" 2>/dev/null
  done
done
python3 scripts/bwd_profile_report.py "$P" $DIMS | tee "$OUT/${PASS}_profile.txt"
tar cf - -C "$OUT" "$sub" | xz -T0 -6 >"$OUT/$sub.tar.xz" && rm -rf "$P"
