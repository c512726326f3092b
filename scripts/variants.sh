#!/usr/bin/env bash
# Forward or backward A/B runs on the GPU machine (issue 3): the pass's C++ benchmark
# (bench/cuda_<pass>_bench.cpp) of the default build ($BUILD, default build/h200) against
# each variant binary carried in $DIR (default build/carry: <pass>_bench_<v>, and optionally
# <pass>_tests_<v>, its CUDA test binary). A variant is that binary built from another tree,
# e.g. another commit: `git worktree add /tmp/v <commit> && cmake -S /tmp/v -B /tmp/v/b
# --preset h200 && cmake --build /tmp/v/b --target flashattn_cuda_<pass>_bench`, then copy it
# to build/carry/<pass>_bench_<v>. (The compile-time experiment switches that variants used
# to be built with are being removed from the kernels.) First the pass's test suites
# ($FILTER) of each variant, then the benchmark of the default build and each variant,
# $ROUNDS times in turn, and one table of TFLOP/s (the best of the rounds) with each
# variant's ratio to the default last. Output to $OUT (default ./out). Peers are the
# benchmark's job (scripts/bench.sh); this compares our own builds, cell by cell, quickly.
#   fwd: rows $ROWS (hdim:causal, every seqlen; default "256:0 256:1"), ROUNDS default 2,
#        FILTER default "*Forward*:*KVCache*"; $OUT/fwd_tests_<v>.txt, $OUT/fwd_variants.txt
#   bwd: cells $CELLS (hdim:causal:seqlen; default "256:0:2048 256:0:16384 256:1:2048
#        256:1:16384"), ROUNDS default 1, FILTER default "*Backward*";
#        $OUT/tests_<v>.txt, $OUT/bwd_variants.txt
#   ROWS="256:0 256:1" ROUNDS=2 bash scripts/variants.sh fwd
#   CELLS="256:0:2048 256:1:16384" bash scripts/variants.sh bwd   (or PASS=fwd|bwd instead of the word)
set -uo pipefail
usage() {
  [ $# -eq 0 ] || echo "variants.sh: $1" >&2
  echo "usage: [ROWS=\"hdim:causal ...\"] [ROUNDS=n] bash scripts/variants.sh fwd" >&2
  echo "       [CELLS=\"hdim:causal:seqlen ...\"] [ROUNDS=n] bash scripts/variants.sh bwd" >&2
  echo "       (or PASS=fwd|bwd; also DIR, BUILD, OUT, FILTER)" >&2
  exit 2
}
case ${1:-} in fwd | bwd) PASS=$1; shift ;; esac
case ${PASS:-} in
  fwd)
    ROWS=${ROWS:-"256:0 256:1"} ROUNDS=${ROUNDS:-2} FILTER=${FILTER:-*Forward*:*KVCache*}
    test_timeout=300 test_log=fwd_tests_ ;;
  bwd)
    CELLS=${CELLS:-"256:0:2048 256:0:16384 256:1:2048 256:1:16384"} ROUNDS=${ROUNDS:-1}
    FILTER=${FILTER:-*Backward*} test_timeout=200 test_log=tests_ ;;
  *) usage "the first argument (or PASS) must be fwd or bwd, not '${PASS:-${1:-}}'" ;;
esac
[ $# -eq 0 ] || usage "no arguments after the pass (set ROWS, CELLS, ROUNDS, ... instead): $*"
cd "$(dirname "$0")/.."
DIR=${DIR:-build/carry}
OUT=${OUT:-out}
B=${BUILD:-build/h200}
mkdir -p "$OUT"
for t in "$DIR/${PASS}_tests_"*; do
  [ -x "$t" ] || continue
  v=${t##*/${PASS}_tests_}
  log=$OUT/$test_log$v.txt
  timeout $test_timeout "$t" --gtest_brief=1 --gtest_filter="$FILTER" >"$log" 2>&1
  echo "tests $v: rc=$? $(grep -E '^\[  PASSED  \]' "$log")"
  grep -E "FAILED|Failure" "$log" | head -5
done
run_one() {  # binary, label: the pass's rows (fwd) or cells (bwd), each line led by the label
  if [ "$PASS" = fwd ]; then
    for r in $ROWS; do
      IFS=: read -r d causal <<<"$r"
      timeout 120 "$1" - "$d" "$causal" 0 2>&1 | awk -v l="$2" '$1 ~ /^[0-9]+$/ {print l, $0}'
    done
  else
    for c in $CELLS; do
      IFS=: read -r d causal s <<<"$c"
      timeout 60 "$1" --one "$d" "$causal" "$s" 2>&1 | grep '^bwd' | sed "s/^/$2 /"
    done
  fi
}
{
  for ((k = 0; k < ROUNDS; ++k)); do
    run_one "$B/bench/flashattn_cuda_${PASS}_bench" default
    for b in "$DIR/${PASS}_bench_"*; do [ -x "$b" ] && run_one "$b" "${b##*/${PASS}_bench_}"; done
  done
} | tee "$OUT/${PASS}_variants.txt"
# fwd lines: label hdim causal seqlen batch heads ms tflops ...; bwd: label bwd d causal s ms tflops ...
python3 - "$OUT/${PASS}_variants.txt" "$PASS" <<'PY'
import collections, sys
key, col, tag = (slice(1, 4), 7, None) if sys.argv[2] == "fwd" else (slice(2, 5), 6, "bwd")
t = collections.OrderedDict(); vs = []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) <= col or (tag and f[1] != tag): continue
    if f[0] not in vs: vs.append(f[0])
    cell = t.setdefault(tuple(f[key]), {})
    x = float(f[col])
    cell[f[0]] = max(cell.get(f[0], x), x)
print("| hdim | causal | seqlen | " + " | ".join(vs) + " |")
print("|---|---|---|" + "---|" * len(vs))
for (d, c, s), r in t.items():
    base = r.get("default")
    cells = [f"{r[v]:.1f}" + (f" ({r[v] / base:.3f})" if base and v != "default" else "") if v in r else "-" for v in vs]
    print(f"| {d} | {c} | {s} | " + " | ".join(cells) + " |")
PY
