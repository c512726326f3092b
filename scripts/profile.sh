#!/usr/bin/env bash
# Profiling on the GPU machine (issues 3 and 4), one pass per call. Reports and CSVs to $OUT
# (default ./out); the C++ benchmark binaries come from $BUILD (default build/h200).
#   fwd, bwd: Nsight Compute's full set plus SASS-level stall sampling for our kernel
#     (bench/cuda_<pass>_bench.cpp) and for PyTorch SDPA's FLASH_ATTENTION (FlashAttention-2)
#     kernel of the pass (bench/profile_peer.py), one non-causal launch each per head dim
#     (16k tokens), side by side by scripts/profile_report.py: time, instructions,
#     shared-memory wavefronts, L2 atomics, stalls; then the instructions that hold the most
#     stall samples in ours. PEER=fa4 profiles FlashAttention-4's kernel instead (installed as
#     ../shared/peers/README.md says, PYTHONPATH set); CAUSAL=1 profiles causal calls.
#       fwd: our fwd_kernel vs flash_fwd, seqlen $SEQ (default 512), head dims "256 128";
#            $OUT/fwd_profile.txt and $OUT/fprof.tar.xz
#       bwd: our bwd_main vs flash_bwd_dq_dk_dv, seqlen $SEQ (default 16384), head dims "64 256";
#            $OUT/bwd_profile.txt and $OUT/prof.tar.xz
#   decode: DRAM / L2 / instruction counts of our decode kernel (bench/cuda_decode_bench.cpp,
#     the cache layouts in $NCU_CONFIGS, default "dense"; also paged16 paged256 fp8) and of the
#     SDPA FLASH_ATTENTION and CUDNN_ATTENTION peers' kernels, at context $SEQ (default 32768);
#     $OUT/decode_profile.txt
#   [SEQ=N] bash scripts/profile.sh fwd|bwd [head dims]   (or PASS=fwd|bwd|decode instead of the
#   word, DIMS="..." instead of the head dims)
#   [SEQ=N] [NCU_CONFIGS="dense paged16"] bash scripts/profile.sh decode
# Throughput side by side with the peers is the benchmark's job: scripts/bench.sh.
set -uo pipefail
usage() {
  [ $# -eq 0 ] || echo "profile.sh: $1" >&2
  echo "usage: [SEQ=N] [OUT=dir] [BUILD=dir] bash scripts/profile.sh fwd|bwd [\"head dims\"]" >&2
  echo "       [SEQ=context] [NCU_CONFIGS=\"dense paged16 ...\"] bash scripts/profile.sh decode" >&2
  echo "       (or PASS=fwd|bwd|decode and DIMS=\"head dims\" in the environment)" >&2
  exit 2
}
case ${1:-} in fwd | bwd | decode) PASS=$1; shift ;; esac
case ${PASS:-} in
  fwd) dims="256 128" seq=512 kernel=fwd_kernel one=- peer=flash_fwd sub=fprof ;;
  bwd) dims="64 256" seq=16384 kernel='^(bwd_main_kernel|bwd_kernel)$' one=--one peer=dq_dk_dv sub=prof ;;
  decode) seq=32768 ;;
  *) usage "the first argument (or PASS) must be fwd, bwd or decode, not '${PASS:-${1:-}}'" ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
B=${BUILD:-build/h200}
S=${SEQ:-$seq}
mkdir -p "$OUT"

if [ "$PASS" = decode ]; then
  [ $# -eq 0 ] || usage "decode takes no arguments (SEQ=context, NCU_CONFIGS=...): $*"
  M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
  rm -f "$OUT/ncu_ours.csv"
  for c in ${NCU_CONFIGS:-dense}; do  # the decode bench's configs: dense paged16 paged256 fp8
    BENCH_ONLY=$c:$S timeout 90 ncu --metrics $M --kernel-name regex:decode_kernel --launch-skip 4 \
      --launch-count 1 --csv "$B/bench/flashattn_cuda_decode_bench" >>"$OUT/ncu_ours.csv" 2>>"$OUT/ncu_ours.err"
  done
  timeout 120 ncu --metrics $M --profile-from-start off --csv python3 bench/profile_peer.py decode "$S" \
    >"$OUT/ncu_peers.csv" 2>"$OUT/ncu_peers.err"
  python3 scripts/profile_report.py --metrics "$OUT/ncu_ours.csv" "$OUT/ncu_peers.csv" | tee "$OUT/decode_profile.txt"
  exit 0
fi

case ${PEER:=fa2} in
  fa2) peer_args=() ;;
  fa4) peer_args=(--peer fa4)  # FA4's sm90 kernels: FlashAttention{Forward,Backward}Sm90
       [ "$PASS" = fwd ] && peer=ForwardSm90 || peer=BackwardSm90 ;;
  *) usage "PEER must be fa2 or fa4, not '$PEER'" ;;
esac
causal=${CAUSAL:-0}
[ "$causal" = 1 ] && peer_args+=(--causal)
DIMS=${*:-${DIMS:-$dims}}  # head dims: the arguments after the pass, else $DIMS, else the default
mkdir -p "$OUT/$sub"
P="$OUT/$sub"
for d in $DIMS; do
  timeout 180 ncu --set full --import-source no --section SourceCounters --kernel-name regex:$kernel \
    --launch-skip 2 --launch-count 1 -f -o "$P/ours_d$d" "$B/bench/flashattn_cuda_${PASS}_bench" $one "$d" "$causal" "$S" \
    >"$P/ours_d$d.log" 2>&1 || tail -5 "$P/ours_d$d.log"
  timeout 180 ncu --set full --import-source no --section SourceCounters --profile-from-start off \
    --kernel-name regex:$peer --launch-count 1 -f -o "$P/peer_d$d" \
    python3 bench/profile_peer.py "${peer_args[@]}" "$PASS" "$d" "$S" >"$P/peer_d$d.log" 2>&1 || tail -5 "$P/peer_d$d.log"
  if [ ! -f "$P/peer_d$d.ncu-rep" ]; then  # no kernel matched the name: the call's kernels, named in the log
    timeout 120 ncu --profile-from-start off --launch-count 4 python3 bench/profile_peer.py "${peer_args[@]}" \
      "$PASS" "$d" "$S" 2>&1 | grep -E '^  [A-Za-z_].*\(' | head -8
  fi
  for w in ours peer; do
    [ -f "$P/${w}_d$d.ncu-rep" ] || continue
    ncu -i "$P/${w}_d$d.ncu-rep" --page details --csv >"$P/${w}_d${d}_details.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page raw --csv >"$P/${w}_d${d}_raw.csv" 2>/dev/null
    ncu -i "$P/${w}_d$d.ncu-rep" --page source --print-source sass --csv >"$P/${w}_d${d}_sass.csv" 2>/dev/null
  done
done
python3 scripts/profile_report.py "$P" $DIMS | tee "$OUT/${PASS}_profile.txt"
tar cf - -C "$OUT" "$sub" | xz -T0 -6 >"$OUT/$sub.tar.xz" && rm -rf "$P"
