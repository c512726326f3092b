#!/usr/bin/env bash
# Issue 22's KV-cache calls at head dims 264 .. 512 (branch kv512), on the GPU machine, in
# one call of at most ~9.5 minutes (BUDGET, seconds): the new suites (test_cuda_kvcache_512
# .cpp, the tree head-dim suite at 320 / 512, FitsQuery) and the existing KV-cache / decode
# suites, one process per pass under `timeout 400 stdbuf -oL` (less where the budget is
# short; a pass with under 30 s left is not run), in the families
#   auto        the process's default family (the sm90 family on an H100 / H200; every
#               KV-cache call above 256 runs the sm80 decode kernel or fused forward)
#   sm80-99k    FLASHATTN_KERNEL_FAMILY=sm80 FLASHATTN_SMEM_CAP=101376 (a 99 KiB sm86 /
#               sm89 part: the 512 decode kernel at every row count, d_v != d above 256
#               skipped where it cannot run, the tests of that error run regardless)
#   sm80        FLASHATTN_KERNEL_FAMILY=sm80, the 512 suites and d_v != d (what differs
#               from auto: the fused forward of KV-cache calls up to 256)
#
#   bash scripts/kv512_gpu.sh      (from the repository root, with carry [".c17"])
#
# The binary, tests/flashattn_cuda_tests (FLASHATTN_CUDA_ARCHS=90, FLASHATTN_HEAD_DIMS
# 128;256;512, Release), is unpacked from .c17/kv512.tar.zst where missing. Packed on the
# build machine (~11 MB):
#   cmake -S . -B build-kv -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHATTN_CUDA=ON \
#         -DFLASHATTN_CUDA_ARCHS=90 -DFLASHATTN_HEAD_DIMS="128;256;512"
#   ninja -C build-kv tests/flashattn_cuda_tests && mkdir -p .c17/tools
#   tar cf - -C build-kv tests/flashattn_cuda_tests | zstd -T2 -12 --long=29 -o .c17/kv512.tar.zst
#   cp "$(command -v zstd)" .c17/tools/   (with its liblzma / liblz4 from ldd beside it)
# Run on the lent H100 on 2026-12-07 (eighteenth session; docs/performance.md, History). Everything
# goes to $OUT/kv512.log (default ./out), one summary line per pass at its end.
set -uo pipefail
. "$(dirname "$0")/gtest_state.sh"
OUT=${OUT:-out}
mkdir -p "$OUT"
LOG="$OUT/kv512.log"
T=tests/flashattn_cuda_tests
BUDGET=${BUDGET:-560}
start=$(date +%s)
: >"$LOG"

if [ ! -x "$T" ]; then
  LD_LIBRARY_PATH=.c17/tools${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} .c17/tools/zstd -dc --long=29 .c17/kv512.tar.zst | tar xf -
fi
[ -x "$T" ] || { echo "gpu_kv512: $T missing (and .c17/kv512.tar.zst did not unpack)" | tee -a "$LOG" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$LOG"

# The new suites and the existing KV-cache / decode ones (each parameterized suite also as
# */Suite*); the MLA kernel's KV-cache suites are left out (nothing of theirs changed).
NEW='CudaKVCache512*:*/CudaKVCache512*:HeadDims/CudaKVCacheTreeHeadDim.*:CudaSmemCap.FitsQuery'
OLD='CudaKVCache.*:CudaKVCacheFp8Q*:*/CudaKVCacheHeadDimV*:CudaKVCacheHeadDimV*:CudaSmemCap*:*/CudaSmemCap*:CudaHeadDim512*:*/CudaHeadDim512*:CudaSink.*KVCache*'

summary=()
# pass name, environment (VAR=value ...), filter
run_pass() {
  local name=$1 env=$2 filter=$3
  local left=$((BUDGET - ($(date +%s) - start)))
  if [ "$left" -lt 30 ]; then
    summary+=("$name: not run (${left}s of the budget left)")
    return
  fi
  local t=$((left < 400 ? left : 400)) t0 rc out
  out="$OUT/kv512_$name.txt"
  echo "==== pass $name ($env) filter $filter, timeout ${t}s" | tee -a "$LOG"
  t0=$(date +%s)
  env $env timeout "$t" stdbuf -oL "$T" --gtest_filter="$filter" >"$out" 2>&1
  rc=$?
  cat "$out" >>"$LOG"
  local state
  state=$(gtest_state "$out" $rc "$t")
  summary+=("$name: $state ($(($(date +%s) - t0))s)")
  rm -f "$out"
}

# The new suites first in each family (a timeout in the long existing ones loses nothing
# of theirs).
run_pass auto-new "" "$NEW"
run_pass sm80-99k-new "FLASHATTN_KERNEL_FAMILY=sm80 FLASHATTN_SMEM_CAP=101376" "$NEW"
run_pass auto-existing "" "$OLD"
run_pass sm80-99k-existing "FLASHATTN_KERNEL_FAMILY=sm80 FLASHATTN_SMEM_CAP=101376" \
  "CudaKVCache.*:CudaKVCacheFp8Q*:CudaSmemCap*:*/CudaSmemCap*:*/CudaKVCacheHeadDimV*"
run_pass sm80-new "FLASHATTN_KERNEL_FAMILY=sm80" "CudaKVCache512*:*/CudaKVCache512*:*/CudaKVCacheHeadDimV*"

{
  echo "==== summary (total $(($(date +%s) - start))s)"
  printf '%s\n' "${summary[@]}"
} | tee -a "$LOG"
