#!/usr/bin/env bash
# Set up, build the library and run the main job: exact attention against the naive
# computation (max error against fp64, time and memory), on the GPU when one is
# visible, else on the CPU. Extra arguments go to flashattn_main (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
preset=release
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" --target flashattn_main
./build/$preset/bench/flashattn_main "$@"
