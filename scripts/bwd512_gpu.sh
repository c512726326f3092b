#!/usr/bin/env bash
# Issue 22 on a GPU machine (H100 / H200; an A100 runs it too): the CUDA backward at head
# dims 264 .. 512 (the sm80 family's 512 bucket). Run from the repository root with the
# build compiled at build/d512 (BUILD=<dir> for another), e.g. configured by
#   cmake -S . -B build/d512 -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
#         -DFLASHATTN_CUDA_ARCHS=90 -DFLASHATTN_HEAD_DIMS="128;256;512"
#   ninja -C build/d512 tests/flashattn_cuda_tests bench/flashattn_cuda_bwd_bench
# It needs only $BUILD/tests/flashattn_cuda_tests and $BUILD/bench/flashattn_cuda_bwd_bench.
#
#   1. the new gtests (tests/cuda/test_cuda_backward_512.cpp: both tiles, every feature,
#      varlen, deterministic, the declines), then the existing backward / 512-forward suites
#      as a regression check, each binary run under a timeout with line-buffered output;
#   2. on compute capability 9.0, that the sm90 family declines d > 256 with the
#      FLASHATTN_LOG=debug line and the call runs sm80;
#   3. the backward bench (bench/cuda_bwd_bench.cpp --one) at hdim 256 and 512, bf16, 16k
#      tokens, model dim 2048 (h = 2048 / hdim), seqlen 2k and 8k, causal and not, plus the
#      512 bucket's A100 tile (FLASHATTN_SMEM_CAP=166912) at 8k.
# TFLOP/s count the nominal backward FLOPs, 2.5 x the forward's 4 * b * h * s^2 * d (halved
# when causal), with d = 512 for the 512 cells: the math of the call, not what the kernel
# executes. The 512 backward recomputes nothing beyond what every FlashAttention-2 backward
# recomputes (S and dP, inside the 2.5): its blocks hold every dK / dV / dQ column (no column
# slices over the grid, recomputation factor 1), unlike the 512 forward (1.5x at d_v = 512).
# A short table prints last. Output also goes to $OUT (default out/bwd512). About 2-3 minutes.
#
# The two binaries are ~60 MB each (every kernel linked into both), over the device tool's
# 64 MiB carry: on the build machine `bash scripts/bwd512_gpu.sh --pack` packs them into
# .carry/bwd512.tar.zst (zstd with a long window: ~20 MB) with zstd beside it; carry
# ".carry" and this script unpacks it when the binaries are missing.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BUILD:-build/d512}
T=$B/tests/flashattn_cuda_tests
BENCH=$B/bench/flashattn_cuda_bwd_bench
PACK=.carry/bwd512.tar.zst
if [ "${1:-}" = "--pack" ]; then
  set -e
  mkdir -p .carry/tools
  exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
  if [ -n "$exclude" ]; then
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.carry/' "$exclude" 2>/dev/null || echo '/.carry/' >>"$exclude"
  fi
  zstd_bin=$(command -v zstd)
  cp "$zstd_bin" .carry/tools/
  for lib in $(ldd "$zstd_bin" | awk '/=>/ {print $3}' | grep -E 'zstd|lzma|lz4|libz'); do cp "$lib" .carry/tools/; done
  rm -f "$PACK"
  tar cf - "$T" "$BENCH" | .carry/tools/zstd -T0 -12 --long=29 -q -o "$PACK"
  du -h "$PACK"
  exit 0
fi
if { [ ! -x "$T" ] || [ ! -x "$BENCH" ]; } && [ -f "$PACK" ]; then
  LD_LIBRARY_PATH=.carry/tools${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} .carry/tools/zstd -dc --long=29 "$PACK" | tar xf -
fi
OUT=${OUT:-out/bwd512}
mkdir -p "$OUT"
for x in "$T" "$BENCH"; do
  [ -x "$x" ] || { echo "missing $x (build it first: see the header of $0)"; exit 1; }
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
table=()

# tests NAME TIMEOUT FILTER: one process, its summary line into the table.
tests() {
  local name=$1 limit=$2 filter=$3 log="$OUT/tests_$1.txt" rc t0
  echo "== tests $name ($filter, timeout ${limit} s)"
  t0=$(date +%s)
  stdbuf -oL -eL timeout "$limit" "$T" --gtest_brief=1 --gtest_color=no --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  grep -E '^\[  (FAILED|SKIPPED) |Failure|error:|Expected|Which is|actual|seed ' "$log" | head -40
  local passed failed skipped
  passed=$(grep -oE 'PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$')
  failed=$(grep -oE 'FAILED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -1)
  skipped=$(grep -oE 'SKIPPED \] [0-9]+' "$log" | grep -oE '[0-9]+$' | head -1)
  local verdict="rc $rc"
  [ "$rc" = 124 ] && verdict="TIMEOUT after ${limit} s"
  table+=("$(printf 'tests %-11s passed %3s  failed %3s  skipped %3s  %s, %s s' "$name" "${passed:-0}" \
    "${failed:-0}" "${skipped:-0}" "$verdict" "$(( $(date +%s) - t0 ))")")
  tail -3 "$log"
}

tests bwd512 150 'Cuda/CudaBackward512.*:CudaBackward512More.*:CudaBackward512Declined.*'
tests regression 50 'Cuda/CudaBackwardFeature.*:CudaBackward.*:Cuda/CudaHeadDim512.*:CudaHeadDim512*'

# The sm90 family's decline, logged (compute capability 9.0 only: elsewhere auto is sm80).
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
if [ "$cc" = "9.0" ]; then
  FLASHATTN_LOG=debug timeout 60 "$T" --gtest_filter='Cuda/CudaBackward512.MatchesOracle/d512_one_row' \
    >"$OUT/debug_log.txt" 2>&1
  line=$(grep -m1 'backward: sm90 family declined (head dim above 256' "$OUT/debug_log.txt")
  echo "debug log: ${line:-MISSING}"
  table+=("sm90 -> sm80 fallback logged: $([ -n "$line" ] && echo yes || echo NO)")
fi

# The bench cells: one process for the grid (the inputs' host values are generated once),
# one for the A100 tile under FLASHATTN_SMEM_CAP. Lines: "bwd d causal s ms tflops relerr E ok".
echo "== backward bench (bf16, 16k tokens, model dim 2048)"
timeout 90 "$BENCH" --one 256,512 0,1 2048,8192 2>&1 | tee "$OUT/bench.txt"
FLASHATTN_SMEM_CAP=166912 timeout 45 "$BENCH" --one 512 0,1 8192 2>&1 | sed 's/^bwd /bwd-a100tile /' \
  | tee -a "$OUT/bench.txt"
echo
echo "== summary ($(head -1 "$OUT/gpu.txt"))"
for r in "${table[@]}"; do echo "$r"; done
echo "backward, bf16, 16k tokens, model dim 2048; TFLOP/s of the nominal 2.5 x 4 b h s^2 d (/2 causal)"
awk '
  $1 == "bwd" || $1 == "bwd-a100tile" {
    tile = $1 == "bwd" ? "device" : "163KiB"
    printf "%-6s %6s %6s %7s %9s %8s %9s %s\n", $2, $3, $4, tile, $5, $6, $8, $9
    if ($1 == "bwd") tf[$2 "," $3 "," $4] = $6
    n++
  }
  BEGIN { printf "%-6s %6s %6s %7s %9s %8s %9s %s\n", "hdim", "causal", "seqlen", "tile", "ms", "TFLOP/s", "relerr", "check" }
  END {
    for (c = 0; c <= 1; c++) for (s = 2048; s <= 8192; s *= 4) {
      a = tf["512," c "," s]; b = tf["256," c "," s]
      if (a != "" && b != "") printf "hdim 512 / hdim 256 TFLOP/s, causal %d, seqlen %d: %.2f\n", c, s, a / b
    }
    if (n == 0) print "no bench lines (see " FILENAME ")"
  }' "$OUT/bench.txt"
