#!/usr/bin/env bash
# Backward experiments on the GPU machine (issue 3): for every variant carried in $DIR
# (default build/carry: bwd_bench_<v>, built with experiment macros, and optionally
# bwd_tests_<v>, its CUDA test binary), the backward test suites, then the backward
# benchmark on $CELLS next to the default build's ($BUILD, default build/h200), one
# table of TFLOP/s with each variant's ratio to the default last. Output to $OUT.
#   CELLS="256:0:2048 256:1:16384" bash scripts/bwd_variants.sh   (hdim:causal:seqlen)
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-build/carry}
OUT=${OUT:-out}
B=${BUILD:-build/h200}
CELLS=${CELLS:-"256:0:2048 256:0:16384 256:1:2048 256:1:16384"}
mkdir -p "$OUT"
for t in "$DIR"/bwd_tests_*; do
  [ -x "$t" ] || continue
  v=${t##*/bwd_tests_}
  timeout 200 "$t" --gtest_brief=1 --gtest_filter='*Backward*' >"$OUT/tests_$v.txt" 2>&1
  echo "tests $v: rc=$? $(grep -E '^\[  PASSED  \]' "$OUT/tests_$v.txt")"
  grep -E "FAILED|Failure" "$OUT/tests_$v.txt" | head -5
done
run_cells() {  # binary, label
  for c in $CELLS; do
    IFS=: read -r d causal s <<<"$c"
    timeout 60 "$1" --one "$d" "$causal" "$s" 2>&1 | grep '^bwd' | sed "s/^/$2 /"
  done
}
{
  run_cells "$B/bench/flashattn_cuda_bwd_bench" default
  for b in "$DIR"/bwd_bench_*; do run_cells "$b" "${b##*/bwd_bench_}"; done
} | tee "$OUT/bwd_variants.txt"
python3 - "$OUT/bwd_variants.txt" <<'PY'
import collections, sys
t = collections.OrderedDict(); vs = []
for line in open(sys.argv[1]):
    f = line.split()  # label bwd d causal s ms tflops ...
    if len(f) < 7 or f[1] != "bwd": continue
    if f[0] not in vs: vs.append(f[0])
    t.setdefault((f[2], f[3], f[4]), {})[f[0]] = float(f[6])
print("| hdim | causal | seqlen | " + " | ".join(vs) + " |")
print("|---|---|---|" + "---|" * len(vs))
for (d, c, s), r in t.items():
    base = r.get("default")
    cells = [f"{r[v]:.1f}" + (f" ({r[v] / base:.3f})" if base and v != "default" else "") if v in r else "-" for v in vs]
    print(f"| {d} | {c} | {s} | " + " | ".join(cells) + " |")
PY
