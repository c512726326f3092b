#!/usr/bin/env bash
# Issue 19, short-sequence sm90 forward (branch fwd-short): the next work tile, the row
# normalisers and lse computed under the last P V GEMM's wait instead of after it.
# One device call (~5 minutes), from the repository root with fwdshort_pack.tar.zst there
# (carry ["fwdshort_pack.tar.zst", ".c17"]: the pack and the zstd in .c17/s20/tools):
#   bash scripts/fwd_short_gpu.sh
# The pack (untracked; made on the build machine) holds fwdshort/base/ (main's dev-h200
# build, head dims 64;128: the hint-base binaries of .c17/s23/hint_pack) and fwdshort/new/
# (this branch, same preset, stripped), each flashattn_cuda_fwd_bench and
# flashattn_cuda_tests. Output in $OUT (default ./out): fwd_short.log, the CSVs, and the
# table of the bench rounds last.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/fwd_short.log"
: >"$LOG"
Z=${ZSTD_DIR:-.c17/s20/tools}
if [ ! -x fwdshort/new/flashattn_cuda_fwd_bench ]; then
  LD_LIBRARY_PATH=$Z${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$Z/zstd" -dc --long=29 fwdshort_pack.tar.zst | tar xf -
fi
for b in base new; do
  for f in flashattn_cuda_fwd_bench flashattn_cuda_tests; do
    [ -x "fwdshort/$b/$f" ] || { echo "fwd_short: fwdshort/$b/$f missing" | tee -a "$LOG" >&2; exit 1; }
  done
done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$LOG"

# 1. The forward suites of the new binary (the sm90 forward, varlen, seqused, head-dim-v,
#    sink, fp8, KV-cache prefill through the fused forward, non-finite, index guards).
FILTER='CudaForward*:*/CudaForward*:CudaHeadDimV*:*/CudaHeadDimV*:CudaSink*:*/CudaSink*:CudaFp8*:*/CudaFp8*:CudaKVCache.*:CudaNonFinite*:CudaIndexGuards*'
echo "==== tests (new): $FILTER" | tee -a "$LOG"
timeout 200 stdbuf -oL fwdshort/new/flashattn_cuda_tests --gtest_filter="$FILTER" >"$OUT/tests_new.txt" 2>&1
rc=$?
tail -n 40 "$OUT/tests_new.txt" >>"$LOG"
echo "tests rc=$rc: $(grep -E '^\[  (PASSED|SKIPPED|FAILED) \] [0-9]+' "$OUT/tests_new.txt" | tr '\n' ' ')" | tee -a "$LOG"

# 2. The bench, base / new alternating, two rounds (hdim 64 and 128, causal and not, every length).
for r in 1 2; do
  for b in base new; do
    echo "==== bench $b round $r" | tee -a "$LOG"
    timeout 150 stdbuf -oL "fwdshort/$b/flashattn_cuda_fwd_bench" "$OUT/bench_${b}_$r.csv" 64,128 -1 0 >>"$LOG" 2>&1 \
      || echo "bench $b round $r rc=$?" | tee -a "$LOG"
  done
done

# 3. Table: per cell both rounds of each binary (TFLOP/s) and new / base mean time.
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import csv, sys, os
out = sys.argv[1]
runs = {}
for b in ("base", "new"):
    for r in (1, 2):
        p = os.path.join(out, f"bench_{b}_{r}.csv")
        if not os.path.exists(p):
            continue
        for row in csv.DictReader(open(p)):
            key = (int(row["hdim"]), int(row["causal"]), int(row["seqlen"]))
            runs.setdefault(key, {}).setdefault(b, []).append((float(row["ms"]), float(row["tflops"])))
print("| hdim | causal | seqlen | base TFLOP/s (r1 / r2) | new TFLOP/s (r1 / r2) | new / base time |")
print("|---|---|---|---|---|---|")
for key in sorted(runs):
    d = runs[key]
    def cell(b):
        return " / ".join(f"{t:.1f}" for _, t in d.get(b, [])) or "-"
    ratio = "-"
    if d.get("base") and d.get("new"):
        mb = sum(m for m, _ in d["base"]) / len(d["base"])
        mn = sum(m for m, _ in d["new"]) / len(d["new"])
        ratio = f"{mn / mb:.3f}"
    print(f"| {key[0]} | {'yes' if key[1] else 'no'} | {key[2]} | {cell('base')} | {cell('new')} | {ratio} |")
PY
