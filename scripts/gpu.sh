#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: builds what is missing (preset h200: sm90
# SASS, every head dim), runs the CUDA tests per kernel family, compute-sanitizer
# (memcheck, racecheck, synccheck, initcheck; SANITIZERS="memcheck racecheck" picks tools,
# SANITIZE_TIMEOUT the seconds each) on a small filter, the SASS checks, the main job,
# the benchmark's forward and backward standard grid (bf16, bench/suite.py: flashattn
# against FA4 when importable, cuDNN and FA2), optionally the Python suite, and prints a
# short table last. Logs and CSVs go to $OUT (default ./out), bundled into logs.tgz at the end.
#   bash scripts/gpu.sh [steps]   steps: comma list of tests,sanitize,sass,main,fwd,bwd,memory,decode,dsweep,sparse,fp8,python,upstream
#                                 (TESTS_FILTER=<gtest filter>: the tests step runs only those)
#                                 (default: all but python and upstream)
# Name the commit for the benchmark's results (FLASHATTN_COMMIT=<hash> bash scripts/gpu.sh):
# the git metadata of the device machine's copy of the tree can be that of an older commit.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-tests,sanitize,sass,main,fwd,bwd,memory}
OUT=${OUT:-out}
mkdir -p "$OUT"
B=${BUILD:-build/h200}
T=$B/tests/flashattn_cuda_tests
summary=()
add() { summary+=("$1"); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
# Binaries packed here by scripts/device_pack.sh and carried (.carry/bin.tar.zst).
if [ -f .carry/bin.tar.zst ] && [ ! -x "$T" ]; then
  LD_LIBRARY_PATH=.carry/tools${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} .carry/tools/zstd -dc --long=29 .carry/bin.tar.zst | tar xf -
fi
need=()
[[ $STEPS == *tests* || $STEPS == *sanitize* || $STEPS == *sass* ]] && need+=("$T")
[[ $STEPS == *main* ]] && need+=("$B/bench/flashattn_main")
[[ $STEPS == *memory* ]] && need+=("$B/bench/flashattn_cuda_bwd_bench")
[[ $STEPS == *decode* ]] && need+=("$B/bench/flashattn_cuda_decode_bench")
[[ $STEPS == *sparse* || $STEPS == *fp8* ]] && need+=("$B/bench/flashattn_cuda_fwd_bench")
missing=0
for x in "${need[@]}"; do [ -x "$x" ] || missing=1; done
if [ $missing = 1 ]; then
  echo "== building $B"
  t0=$(date +%s)
  cmake --preset h200 >/dev/null && cmake --build --preset h200 -j"$(nproc)" >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  add "build (h200 preset, $(nproc) cores): $(( $(date +%s) - t0 )) s"
fi

# tests: every family the H200 runs: auto (the sm90 forward, sm80 elsewhere), the sm80
# family forced, and the sm80 family under a 99 KiB shared-memory cap (sm86 / sm89 parts:
# their forward, backward and decode configurations; the tests of what such a part lacks,
# the backward above head dim 160, the 512 forward bucket and draft trees over 16-bit caches
# above 128, check the error or skip with the test that checks it, and the fp8 forward, the
# sm90 family's, skips). One process per test
# suite, so that a crash (2026-12-05: a segfault in CudaIndexGuards) names its test and the
# other suites still run; the failing tests' output goes to the log.
run_suites() {  # name [filter]: one process per suite (or one for the filter); sets passed / failed / crashed
  local name=$1 filter=$2 s rc n log="$OUT/cuda_tests_$1.txt"
  passed=0 failed=0 crashed=""
  : >"$log"
  for s in $(if [ -n "$filter" ]; then echo "$filter"; else "$T" --gtest_list_tests | grep -E '^[^ ]+\.( |$)' | sed 's/\. *.*$/.*/'; fi); do
    timeout 200 "$T" --gtest_brief=1 --gtest_filter="$s" >/tmp/suite.txt 2>&1; rc=$?
    n=$(grep -oE 'PASSED  \] [0-9]+' /tmp/suite.txt | grep -oE '[0-9]+$')
    passed=$((passed + ${n:-0}))
    if [ $rc != 0 ]; then
      { echo "== $s rc=$rc"; cat /tmp/suite.txt; } >>"$log"
      failed=$((failed + $(grep -c '^\[  FAILED  \] [A-Za-z]' /tmp/suite.txt)))
      if [ $rc -ge 124 ]; then  # killed, timed out or crashed: name the test
        local t
        t=$("$T" --gtest_filter="$s" 2>&1 | grep -E '^\[ RUN' | tail -1 | sed 's/.*RUN *\] *//')
        crashed="$crashed $t (rc $rc)"
        # Where it crashed (cuda-gdb debugs the host side too): the backtrace into the log.
        [ -n "$t" ] && timeout 120 cuda-gdb -batch -ex run -ex bt --args "$T" --gtest_filter="$t" 2>&1 |
          grep -E '^#|signal' | head -30 >>"$log"
      fi
    fi
  done
}
if [[ $STEPS == *tests* ]]; then
  # TESTS_FILTER (a gtest filter): only those tests, in one process per family, where a
  # call has little device time (e.g. the suites a change touched first).
  for run in "auto::${TESTS_FILTER:-}" "sm80::${TESTS_FILTER:-}" "sm80-99k:101376:${TESTS_FILTER:-}"; do
    IFS=: read -r name cap filter <<<"$run"
    family=${name%-99k}
    export FLASHATTN_KERNEL_FAMILY=$family FLASHATTN_SMEM_CAP=${cap:-0}
    run_suites "$name" "$filter"
    unset FLASHATTN_KERNEL_FAMILY FLASHATTN_SMEM_CAP
    grep -E "^\[  FAILED|Failure" "$OUT/cuda_tests_$name.txt" | head -10
    add "CUDA tests ($name): $passed passed, $failed failed${crashed:+, crashed:$crashed}"
  done
fi
if [[ $STEPS == *sanitize* ]]; then
  # sm90 forward (dense, GQA, causal, ALiBi, hdim 256, varlen, dense / paged KV cache), the
  # sm90 backward (hdim 64 / 128, GQA, causal, window, softcap, varlen; head dims through
  # the buckets) and the sm80 kernels (the backward with dropout, decode and split merge);
  # the clamped index guards under capture, non-finite inputs and sinks; seqused_q, d_v != d
  # (KV-cache calls with their append too) and block-sparse masks on CUDA, forward and
  # backward (issues 22, 25); the forward's TMA-store epilogue over strided out rows and the
  # sm90 MLA kernel's hand-over of P between its consumers (1-4 key tiles a split; racecheck
  # reported write-write hazards there on 2026-12-06, docs/performance.md) (the deterministic
  # block-sparse test is left out: its spin-waits on other blocks' counters only cost time
  # under the tools).
  f='Cuda/CudaForwardFeature.MatchesOracle/plain:Cuda/CudaForwardFeature.MatchesOracle/gqa4_causal:Cuda/CudaForwardFeature.MatchesOracle/alibi:Cuda/CudaForwardFeature.MatchesOracle/everything:Cuda/CudaForwardFeature.MatchesOracle/hd256_long:CudaForward.VarlenWith*:CudaForward.KVCache*:Cuda/CudaBackwardFeature.MatchesOracle/plain:Cuda/CudaBackwardFeature.MatchesOracle/gqa2:Cuda/CudaBackwardFeature.MatchesOracle/causal:Cuda/CudaBackwardFeature.MatchesOracle/window_both:Cuda/CudaBackwardFeature.MatchesOracle/softcap:Cuda/CudaBackwardFeature.MatchesOracle/dropout:CudaBackward.HeadDims:CudaBackward.VarlenWith*:CudaKVCache.RandomPagedLayouts:CudaKVCache.Fp8Caches:CudaKVCache.Split*:CudaIndexGuards.*:CudaNonFinite.*:CudaSink.VarlenForwardAndBackward:CudaSink.KVCacheDecodeSplitsPagedWindows:CudaSequsedQ.*:Cuda/CudaHeadDimV.ForwardAndBackwardMatchOracle/deepseek_192_128:Cuda/CudaKVCacheHeadDimV.MatchesCpuAndOracle/d192_dv128_append:Cuda/CudaKVCacheHeadDimV.MatchesCpuAndOracle/d64_dv128_paged:Cuda/CudaBlockSparse.ForwardMatchesOracle/causal_gqa_d128:Cuda/CudaBlockSparse.BackwardMatchesOracle/causal_gqa_d128:CudaBlockSparseRule.*:CudaForward.PackedQkvAndPaddedOut:Cuda/CudaMlaKVCache.MatchesCpuAndOracle/decode_h64_*tile_counts*:-CudaBlockSparseRule.DeterministicBackwardIsReproducible'
  for tool in ${SANITIZERS:-memcheck racecheck synccheck initcheck}; do
    FLASHATTN_TEST_UNGATED=1 timeout "${SANITIZE_TIMEOUT:-200}" compute-sanitizer --tool $tool --error-exitcode 9 "$T" --gtest_filter="$f" >"$OUT/$tool.txt" 2>&1
    add "$tool: rc=$? $(grep -m1 -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/$tool.txt")"
  done
fi
if [[ $STEPS == *sass* ]]; then
  cuobjdump --dump-sass "$T" >/tmp/sass.txt 2>/dev/null
  add "SASS: HMMA $(grep -c HMMA /tmp/sass.txt), HGMMA $(grep -c HGMMA /tmp/sass.txt), SETMAXREG $(grep -c SETMAXREG /tmp/sass.txt), LDL/STL $(grep -c -E 'LDL|STL' /tmp/sass.txt) (whole test binary)"
fi
if [[ $STEPS == *main* ]]; then
  timeout 120 "$B/bench/flashattn_main" >"$OUT/main_gpu.txt" 2>&1
  cat "$OUT/main_gpu.txt"
fi
# fwd / bwd: the benchmark (bench/suite.py through scripts/bench.sh, which builds the Python
# package) on the bf16 standard grid of those directions, against FA4 (when importable),
# cuDNN and FA2; its short table of flashattn / best peer is printed last.
dirs=""
[[ $STEPS == *fwd* ]] && dirs=fwd
[[ $STEPS == *bwd* ]] && dirs=${dirs:+$dirs,}bwd
if [ -n "$dirs" ]; then
  timeout 400 bash scripts/bench.sh --grids standard --only "$dirs" --dtypes bf16 \
    --impls flashattn,fa4,sdpa_cudnn,sdpa_flash --no-plot --out "$OUT/bench" >"$OUT/bench.txt" 2>&1
  add "benchmark ($dirs): rc=$? ($OUT/bench/report.md)"
fi
if [[ $STEPS == *dsweep* ]]; then
  # Issue 23 in the suite: the decode sweep against cuDNN and FA2 and speculative decoding
  # (1 / 4 / 8 drafts, linear and tree), hdim 128 (FLASHATTN_HEAD_DIMS=128 builds the
  # package faster when no other step needs it).
  timeout 400 bash scripts/bench.sh --grids decode,spec \
    --decode-batches 1,8,64 --decode-contexts 1k,2k,4k,8k,16k,32k,64k,128k \
    --impls flashattn,sdpa_cudnn,sdpa_flash --out "$OUT/dsweep" >"$OUT/dsweep.txt" 2>&1
  add "decode sweep + speculative (suite): rc=$? ($OUT/dsweep/report.md)"
fi
if [[ $STEPS == *sparse* ]]; then
  # Block-sparse forward (issue 22): time against the unmasked call at 10 / 50 / 100 %
  # density, 16k tokens, hdim 64 / 128 / 256 (the backend called directly: kernels and the
  # kinds table's build, no host check).
  for d in 64 128 256; do
    timeout 30 "$B/bench/flashattn_cuda_fwd_bench" --sparse $d 16384
  done >"$OUT/sparse.txt" 2>&1
  add "block-sparse fwd / unmasked (d density:ratio): $(awk '$4 != "0.00" {printf "%s %s:%s  ", $2, $4, $7}' "$OUT/sparse.txt")"
fi
if [[ $STEPS == *fp8* ]]; then
  # The sm90 fp8 forward (issue 21) beside the bf16 forward of the same binary, the standard
  # grid's lengths: e4m3 q, k, v (BENCH_FP8: the V^T copy included and timed alone), each
  # cell checked against its fp8 error bound.
  for d in 64 128 256; do for c in 0 1; do for s in 16384 8192 4096 2048 1024 512; do
    BENCH_FP8=1 timeout 30 "$B/bench/flashattn_cuda_fwd_bench" - $d $c $s 2>&1 | grep -v -E 'hdim|BENCH_FP8' | sed 's/^/fp8 /'
    timeout 30 "$B/bench/flashattn_cuda_fwd_bench" - $d $c $s 2>&1 | grep -v -E '^#|hdim' | sed 's/^/bf16 /'
  done; done; done >"$OUT/fp8.txt" 2>&1
  add "fp8 fwd (d causal s: fp8 / bf16 TFLOP/s): $(awk '$1 == "fp8" && $2 != "#" {k = $2 " " $3 " " $4; f[k] = $8; ok[k] = $11} $1 == "bf16" {k = $2 " " $3 " " $4; printf "%s: %s/%s%s  ", k, f[k], $8, ok[k] == "ok" ? "" : " " ok[k]}' "$OUT/fp8.txt")"
fi
if [[ $STEPS == *memory* ]]; then
  timeout 60 "$B/bench/flashattn_cuda_bwd_bench" --memory >"$OUT/memory.txt" 2>&1
  add "$(grep 'peak fwd+bwd' "$OUT/memory.txt")"
fi
if [[ $STEPS == *decode* ]]; then
  # Issue 4's decode grid (dense, paged 16/256, fp8; 4k/32k/128k, each with its streaming-read
  # bound) and the 200k-token sequence.
  timeout 150 "$B/bench/flashattn_cuda_decode_bench" "$OUT/decode.csv" >"$OUT/decode.txt" 2>&1
  add "decode bench: rc=$? ($OUT/decode.txt)"
  # The paged cache at 4k measured 0.96 of dense in a process of its own and 0.88 after the
  # dense runs of the grid (docs/performance.md, a86ffd1): both orders in one process each.
  for order in paged16:4096,dense:4096,paged256:4096 dense:131072,dense:4096,paged16:4096,paged256:4096; do
    echo "order $order" >>"$OUT/decode_order.txt"
    BENCH_ONLY=$order timeout 60 "$B/bench/flashattn_cuda_decode_bench" 2>&1 | grep '^| [a-z]' | grep -v cache >>"$OUT/decode_order.txt"
  done
  # Issue 23's sweep (batch 1 / 8 / 64 x 1k-128k, each beside the streaming read of its
  # bytes: ~15 s on an H100) and issue 22's MLA decode (qv, DeepSeek-V3's shape).
  BENCH_SWEEP=1 timeout 120 "$B/bench/flashattn_cuda_decode_bench" "$OUT/decode_sweep.csv" >"$OUT/decode_sweep.txt" 2>&1
  add "decode sweep: rc=$? ($OUT/decode_sweep.txt)"
  BENCH_MLA=1 timeout 60 "$B/bench/flashattn_cuda_decode_bench" >"$OUT/decode_mla.txt" 2>&1
  add "MLA decode: rc=$? ($OUT/decode_mla.txt)"
  # MLA on the sm80 kernel forced (the sm90 kernel's gain), speculative decoding (issue 23:
  # 1 / 4 / 8 drafts, chain and tree, 4k / 32k) and the split path against one split.
  FLASHATTN_KERNEL_FAMILY=sm80 BENCH_MLA=1 timeout 60 "$B/bench/flashattn_cuda_decode_bench" >"$OUT/decode_mla_sm80.txt" 2>&1
  add "MLA decode, sm80 forced: rc=$? ($OUT/decode_mla_sm80.txt)"
  BENCH_SPEC=1 timeout 60 "$B/bench/flashattn_cuda_decode_bench" "$OUT/decode_spec.csv" >"$OUT/decode_spec.txt" 2>&1
  add "speculative decoding: rc=$? ($OUT/decode_spec.txt)"
  BENCH_VERIFY=1 timeout 60 "$B/bench/flashattn_cuda_decode_bench" >"$OUT/decode_verify.txt" 2>&1
  add "splits against one split: rc=$? $(grep -c ' ok$' "$OUT/decode_verify.txt") ok"
fi
if [[ $STEPS == *python* ]]; then
  timeout 280 bash tests/python/run_gpu_tests.sh >"$OUT/python.txt" 2>&1
  add "python (CUDA): rc=$? $(tail -1 "$OUT/python.txt")"
fi
# flash-attention's own test file against the drop-in (issue 24): a seeded sample of
# UPSTREAM_SAMPLE tests (default 400, seed 0); needs .upstream/ from scripts/upstream_prep.sh
# (carried: the device has no network) and the package installed by the python step with
# every head-dim bucket (FLASHATTN_HEAD_DIMS="32;64;96;128;160;192;224;256" bash
# scripts/gpu.sh python,upstream), else the missing buckets fail as UnsupportedError.
if [[ $STEPS == *upstream* ]]; then
  if [ -f .upstream/test_flash_attn.py ]; then
    python3 -m pip install --quiet --no-index --find-links .upstream/wheels einops
    # pytest stops after UPSTREAM_TIME_LIMIT s (default 300) and still counts what ran.
    UPSTREAM_TIME_LIMIT=${UPSTREAM_TIME_LIMIT:-300} timeout 400 bash tests/python/run_upstream.sh \
      .upstream/test_flash_attn.py "${UPSTREAM_SAMPLE:-400}" 0 >"$OUT/upstream.txt" 2>&1
    add "upstream ($(cat .upstream/TAG 2>/dev/null)): rc=$? $(grep -m1 '^upstream:' "$OUT/upstream.txt")"
  else
    add "upstream: skipped (no .upstream/: run scripts/upstream_prep.sh here and carry .upstream)"
  fi
fi

echo
[ -f "$OUT/bench/report.md" ] && sed -n '/^## flashattn \/ best peer/,$p' "$OUT/bench/report.md"
[ -f "$OUT/decode.txt" ] && grep '^|' "$OUT/decode.txt"
[ -f "$OUT/decode_order.txt" ] && cat "$OUT/decode_order.txt"
[ -f "$OUT/decode_sweep.txt" ] && grep '^|' "$OUT/decode_sweep.txt"
[ -f "$OUT/decode_mla.txt" ] && grep '^|' "$OUT/decode_mla.txt"
[ -f "$OUT/dsweep/report.md" ] && sed -n '/^## Decode/,$p' "$OUT/dsweep/report.md"
echo
printf '%s\n' "${summary[@]}"
# The device tool brings back at most 8 files from $OUT: every log and result in one
# archive (GPU_BUNDLE=0 keeps them apart), the summary beside it.
printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
if [ "${GPU_BUNDLE:-1}" = 1 ]; then
  (cd "$OUT" && tar czf /tmp/gpu_logs.tgz --exclude=summary.txt . && find . -mindepth 1 ! -name summary.txt -delete &&
    mv /tmp/gpu_logs.tgz logs.tgz)
fi
