#!/usr/bin/env bash
# Branch bwd-fa3cmp (issue 20, the sm90 backward at hdim 128 in FA3's order: dV's wgmma issued
# after dS^T's shared-memory store, before the dS barrier, the exponentials / dS^T / packs /
# store one basic block on unmasked tiles, so the 32 MUFU.EX2 per warp no longer issue back to
# back; docs/notes/bwd_fa3_sass.md) on the GPU machine, in one call of at most ~9.5 minutes
# (BUDGET, s):
#   1. the backward test suites with the new binary (FLASHATTN_LOG=debug, timeout 150; BASE_TESTS=1
#      also runs base's, for a failure's comparison);
#   2. the C++ bench A/B, `--one <hdim> 0,1 512,...,16384` for hdim 128 and 64, two rounds, base
#      and new alternating in each round (reversed in the second), one process per run;
#   3. with NCU=1 (default off), if ncu exists and 60 s of the budget are left per profile: the
#      main kernel's tensor-pipe activity, time, instructions and warp stall breakdown (per issued
#      instruction), hdim 128 causal 16k, each variant;
#   and prints the bench table last (TFLOP/s per round, mean-time ratios to base).
#
#   bash scripts/bwd_fa3cmp_gpu.sh       (from the repository root; OUT=dir, default ./out)
#   TESTS=0 / BENCH=0 leave that part out; NCU=1 adds the profiles (e.g. a second call:
#   TESTS=0 BENCH=0 NCU=1).
#
# Binaries (FLASHATTN_CUDA_ARCHS=90, FLASHATTN_HEAD_DIMS="64;128", Release), unpacked from
# $PACK (default fa3cmp_pack.tar.zst in the repository root, untracked) where missing:
#   fa3cmp/base/flashattn_cuda_bwd_bench  main at d9c0485 (the branch's base; /work/main/build/dev-h200)
#   fa3cmp/base/flashattn_cuda_tests
#   fa3cmp/new/flashattn_cuda_bwd_bench   bwd-fa3cmp (main's objects with bwd_hdim128.cu.o rebuilt
#                                         from the branch; hdim 64's SASS is base's, so its cells
#                                         show the A/B noise floor)
#   fa3cmp/new/flashattn_cuda_tests
# zstd from PATH, else fa3cmp_tools/zstd (untracked, with its libraries beside it).
# Everything goes to $OUT/bwd_fa3cmp_*.log; the table to $OUT/bwd_fa3cmp_table.txt.
set -uo pipefail
OUT=${OUT:-out}
PACK=${PACK:-fa3cmp_pack.tar.zst}
BUDGET=${BUDGET:-560}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
mkdir -p "$OUT"
LOG="$OUT/bwd_fa3cmp_bench.log"

if [ ! -x fa3cmp/new/flashattn_cuda_bwd_bench ] || [ ! -x fa3cmp/base/flashattn_cuda_bwd_bench ]; then
  if command -v zstd >/dev/null; then
    zstd -dc --long=29 "$PACK" | tar xf -
  elif [ -x fa3cmp_tools/zstd ]; then
    LD_LIBRARY_PATH=fa3cmp_tools${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} fa3cmp_tools/zstd -dc --long=29 "$PACK" | tar xf -
  fi
fi
for b in base new; do
  [ -x fa3cmp/$b/flashattn_cuda_bwd_bench ] || { echo "bwd_fa3cmp_gpu: fa3cmp/$b/flashattn_cuda_bwd_bench missing ($PACK did not unpack?)" >&2; exit 1; }
done
WHO=""
for v in ${VARIANTS:-base new}; do
  [ -x fa3cmp/$v/flashattn_cuda_bwd_bench ] && WHO="$WHO $v"
done
WHO=${WHO# }
echo "variants: $WHO"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' |
  tee "$OUT/bwd_fa3cmp_gpu.txt"

# 1. Tests (not the d > 256 suites, sm80 only, nor the 99 KiB one).
FILTER='*CudaBackward*:CudaVarlen.RandomGridBackward:CudaSequsedQ.*:CudaNonFinite.DenseBackward:CudaBlockSparseRule.DeterministicBackwardIsReproducible:-*CudaBackward512*:*CudaBackward99K*'
tests_line=""
TV="new"
[ "${BASE_TESTS:-0}" = 1 ] && TV="new base"
for v in $TV; do
  TLOG="$OUT/bwd_fa3cmp_tests_$v.log"
  if [ "${TESTS:-1}" = 0 ]; then
    echo "tests: not run (TESTS=0)" >"$TLOG"
  elif [ -x fa3cmp/$v/flashattn_cuda_tests ]; then
    FLASHATTN_LOG=debug timeout 150 stdbuf -oL fa3cmp/$v/flashattn_cuda_tests --gtest_filter="$FILTER" >"$TLOG" 2>&1
    echo "tests rc=$?" >>"$TLOG"
  else
    echo "tests: fa3cmp/$v/flashattn_cuda_tests missing" >"$TLOG"
  fi
  line=$(grep -E 'not run|missing|^\[  PASSED  \]|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+|tests rc=' "$TLOG" | tr '\n' ' ')
  grep -E '^\[  FAILED  \] [A-Za-z]' "$TLOG" | sort -u | head -20 | sed "s/^/$v: /"
  echo "tests $v: $line ($(($(date +%s) - start)) s)"
  tests_line="$tests_line $v: $line"
done

# 2. Bench A/B: two rounds, the variants alternating within each (reversed in the second:
# order effects, docs/performance.md), hdim 128 then 64.
LENS=512,1024,2048,4096,8192,16384
: >"$LOG"
for round in 1 2; do
  [ "${BENCH:-1}" = 0 ] && break
  order=$WHO
  [ $round = 2 ] && order=$(echo $WHO | tr ' ' '\n' | tac | tr '\n' ' ')
  for d in 128 64; do
    for who in $order; do
      t=$(left)
      if [ "$t" -lt 40 ]; then
        echo "## skipped round $round d $d $who (${t}s left)" >>"$LOG"
        continue
      fi
      echo "## round $round d $d $who" >>"$LOG"
      timeout $((t < 120 ? t : 120)) stdbuf -oL fa3cmp/$who/flashattn_cuda_bwd_bench --one $d 0,1 $LENS 2>&1 |
        sed "s/^bwd /bwd $who $round /" >>"$LOG"
    done
  done
done
echo "bench: done ($(($(date +%s) - start)) s)"

# 3. ncu (NCU=1), if there and time allows (each profile ~30-60 s: one kernel).
M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,smsp__inst_executed.sum
for s in wait short_scoreboard long_scoreboard barrier math_pipe_throttle mio_throttle dispatch_stall not_selected selected no_instruction sleeping membar branch_resolving lg_throttle drain misc; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
NLOG="$OUT/bwd_fa3cmp_ncu.log"
: >"$NLOG"
if [ "${NCU:-0}" = 0 ]; then
  echo "ncu: not run (NCU=0)" | tee -a "$NLOG"
elif command -v ncu >/dev/null; then
  for who in $WHO; do
    t=$(left)
    if [ "$t" -lt 60 ]; then
      echo "## ncu $who skipped (${t}s left)" >>"$NLOG"
      continue
    fi
    echo "## ncu $who" >>"$NLOG"
    timeout $((t < 150 ? t - 10 : 140)) ncu --metrics "$M" -k regex:bwd_kernel --launch-skip 2 -c 1 \
      fa3cmp/$who/flashattn_cuda_bwd_bench --one 128 1 16384 >>"$NLOG" 2>&1
    echo "## ncu $who rc=$?" >>"$NLOG"
  done
  echo "ncu (hdim 128 causal 16k, main kernel; stalls in cycles per issued instruction):"
  awk '/^## ncu/ { who = $3 } / (smsp__|sm__pipe|gpu__time)/ { m = $1; sub(/smsp__average_warps_issue_stalled_/, "stall_", m); sub(/_per_issue_active.ratio/, "", m); printf "  %-5s %-70s %s %s\n", who, m, $2, $3 }' "$NLOG"
else
  echo "ncu: not found" | tee -a "$NLOG"
fi

# Table: TFLOP/s of each round per cell; ratio = variant / base of the mean time of the rounds.
{
  echo
  echo "sm90 bwd TFLOP/s per round (r1/r2); ratios = mean time / base's (< 1: faster); tests: $tests_line"
  awk -v who="$WHO" '
    $1 == "bwd" && NF >= 8 {
      v = $2; r = $3; k = $4 " " $5 " " $6
      if (!(k in seen)) { seen[k] = 1; keys[n++] = k }
      tf[k, v, r] = $8; ms[k, v] += $7; cnt[k, v]++
      if ($NF != "ok" && $NF !~ /^[0-9.]+$/) bad[k] = bad[k] " " v ":" $NF
    }
    END {
      nv = split(who, vs, " ")
      printf "%4s %6s %6s", "hdim", "causal", "seqlen"
      for (i = 1; i <= nv; ++i) printf " %15s", vs[i]
      for (i = 2; i <= nv; ++i) printf " %9s", vs[i] "/base"
      printf "\n"
      for (j = 0; j < n; ++j) {
        k = keys[j]; split(k, a, " ")
        printf "%4s %6s %6s", a[1], a[2], a[3]
        for (i = 1; i <= nv; ++i) printf " %7s/%-7s", tf[k, vs[i], 1], tf[k, vs[i], 2]
        for (i = 2; i <= nv; ++i)
          if (cnt[k, vs[i]] && cnt[k, "base"]) printf " %9.3f", (ms[k, vs[i]] / cnt[k, vs[i]]) / (ms[k, "base"] / cnt[k, "base"])
          else printf " %9s", "-"
        printf "%s\n", bad[k]
      }
    }' "$LOG"
  echo "total $(($(date +%s) - start)) s"
} | tee "$OUT/bwd_fa3cmp_table.txt"
