#!/usr/bin/env bash
# Builds the GPU machine's binaries here and packs them for the device tool's `carry`, so that
# a device call spends no minutes compiling: preset h200 (sm_90a, every head dim; ~7 minutes
# from scratch on 2 cores, seconds after a kernel edit), then the chosen executables of
# build/h200 in one zstd stream with a 512 MiB window (--long=29): every executable links
# every kernel, so the window finds the copies (~18 MB for one, ~19 MB for the tests and
# three benches, 2026-12-05; the carry limit is 64 MiB with the tree), into
# .carry/bin.tar.zst with zstd itself beside it.
#   bash scripts/device_pack.sh [target ...]       default: flashattn_cuda_tests flashattn_cuda_bwd_bench
#   EXTRA_DIR=dir bash scripts/device_pack.sh ...  also packs dir (e.g. a baseline build's bench)
# On the device, with `carry: [".carry"]`: scripts/gpu.sh unpacks it when its binaries are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(flashattn_cuda_tests flashattn_cuda_bwd_bench)
cmake --preset h200 >/dev/null
cmake --build --preset h200 -j"$(nproc)" --target "${targets[@]}"
mkdir -p .carry/tools
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >>.git/info/exclude
zstd_bin=$(command -v zstd)
cp "$zstd_bin" .carry/tools/
for lib in $(ldd "$zstd_bin" | awk '/=>/ {print $3}' | grep -E 'zstd|lzma|lz4|libz'); do cp "$lib" .carry/tools/; done
paths=()
for t in "${targets[@]}"; do
  p=$(find build/h200 -maxdepth 2 -type f -name "$t" | head -1)
  [ -n "$p" ] || { echo "device_pack: no executable $t under build/h200" >&2; exit 1; }
  paths+=("$p")
done
rm -f .carry/bin.tar.zst
tar cf - "${paths[@]}" ${EXTRA_DIR:+"$EXTRA_DIR"} | .carry/tools/zstd -T0 -12 --long=29 -q -o .carry/bin.tar.zst
du -h .carry/bin.tar.zst
echo "carry .carry in the device call; scripts/gpu.sh unpacks it"
