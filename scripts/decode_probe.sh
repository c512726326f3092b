#!/usr/bin/env bash
# Decode experiments on the GPU machine (issue 4): every decode-bench variant carried in
# $DIR (default build/carry: flashattn_cuda_decode_bench builds with different
# FLASHATTN_DECODE_DEFS, named decode_bench_<variant>) on the decode grid, then Nsight
# Compute's DRAM / L2 / instruction counts for our kernel and the SDPA peers' at one
# context, side by side. Output to $OUT (default ./out), a short table last.
#   bash scripts/decode_probe.sh [context]
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-build/carry}
OUT=${OUT:-out}
CTX=${1:-32768}
mkdir -p "$OUT"
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
for b in "$DIR"/decode_bench_*; do
  v=${b##*/decode_bench_}
  BENCH_ONLY=${BENCH_ONLY:-grid} timeout 60 "$b" >"$OUT/dec_$v.txt" 2>&1
  echo "== $v (rc $?)"; grep '^| [a-z]' "$OUT/dec_$v.txt" | grep -v cache
done
if command -v ncu >/dev/null && [ "${NCU:-1}" = 1 ]; then  # NCU=0: variants only
  base=$(ls "$DIR"/decode_bench_* | head -1)
  for c in ${NCU_CONFIGS:-dense}; do  # bench configs: dense paged16 paged256 fp8
    BENCH_ONLY=$c:$CTX timeout 90 ncu --metrics $M --kernel-name regex:decode_kernel --launch-skip 4 --launch-count 1 \
      --csv "$base" >>"$OUT/ncu_ours.csv" 2>>"$OUT/ncu_ours.err"
  done
  timeout 120 ncu --metrics $M --profile-from-start off --csv python3 bench/peers/sdpa_decode_profile.py "$CTX" \
    >"$OUT/ncu_peers.csv" 2>"$OUT/ncu_peers.err"
  python3 - "$OUT/ncu_ours.csv" "$OUT/ncu_peers.csv" <<'PY'
import csv, sys, collections
for path in sys.argv[1:]:
    rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
    if not rows: print(path, "no rows"); continue
    hdr = rows[0]; ix = {h: i for i, h in enumerate(hdr)}
    k = collections.OrderedDict()
    for r in rows[1:]:
        key = (r[ix["ID"]], r[ix["Kernel Name"]][:60])
        k.setdefault(key, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
    for (i, name), m in k.items():
        print(f"{path.split('/')[-1]} #{i} {name}")
        print("   " + "  ".join(f"{n}={m[n]}" for n in sorted(m)))
PY
fi
