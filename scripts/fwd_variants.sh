#!/usr/bin/env bash
# Forward experiments on the GPU machine (issue 3): for every variant carried in $DIR
# (default build/carry: fwd_bench_<v>, built with experiment macros, and optionally
# fwd_tests_<v>, its CUDA test binary), the forward and KV-cache test suites, then the
# forward benchmark's rows $ROWS (hdim:causal, every seqlen) for the default build ($BUILD,
# default build/h200) and each variant, $ROUNDS times in turn, and one table of TFLOP/s
# (the best of the rounds) with each variant's ratio to the default last. Output to $OUT.
#   ROWS="256:0 256:1" ROUNDS=2 bash scripts/fwd_variants.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-build/carry}
OUT=${OUT:-out}
B=${BUILD:-build/h200}
ROWS=${ROWS:-"256:0 256:1"}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
for t in "$DIR"/fwd_tests_*; do
  [ -x "$t" ] || continue
  v=${t##*/fwd_tests_}
  timeout 300 "$t" --gtest_brief=1 --gtest_filter="${FILTER:-*Forward*:*KVCache*}" >"$OUT/fwd_tests_$v.txt" 2>&1
  echo "tests $v: rc=$? $(grep -E '^\[  PASSED  \]' "$OUT/fwd_tests_$v.txt")"
  grep -E "FAILED|Failure" "$OUT/fwd_tests_$v.txt" | head -5
done
run_rows() {  # binary, label
  for r in $ROWS; do
    IFS=: read -r d causal <<<"$r"
    timeout 120 "$1" - "$d" "$causal" 0 2>&1 | awk -v l="$2" '$1 ~ /^[0-9]+$/ {print l, $0}'
  done
}
{
  for ((k = 0; k < ROUNDS; ++k)); do
    run_rows "$B/bench/flashattn_cuda_fwd_bench" default
    for b in "$DIR"/fwd_bench_*; do [ -x "$b" ] && run_rows "$b" "${b##*/fwd_bench_}"; done
  done
} | tee "$OUT/fwd_variants.txt"
python3 - "$OUT/fwd_variants.txt" <<'PY'
import collections, sys
t = collections.OrderedDict(); vs = []
for line in open(sys.argv[1]):
    f = line.split()  # label hdim causal seqlen batch heads ms tflops ...
    if len(f) < 8: continue
    if f[0] not in vs: vs.append(f[0])
    cell = t.setdefault((f[1], f[2], f[3]), {})
    cell[f[0]] = max(cell.get(f[0], 0.0), float(f[7]))
print("| hdim | causal | seqlen | " + " | ".join(vs) + " |")
print("|---|---|---|" + "---|" * len(vs))
for (d, c, s), r in t.items():
    base = r.get("default")
    cells = [f"{r[v]:.1f}" + (f" ({r[v] / base:.3f})" if base and v != "default" else "") if v in r else "-" for v in vs]
    print(f"| {d} | {c} | {s} | " + " | ".join(cells) + " |")
PY
