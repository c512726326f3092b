#!/usr/bin/env bash
# Prepares .upstream/ (git-ignored) for the GPU machine, which reaches no network:
# flash-attention's tests/test_flash_attn.py at a tag (default v2.8.3, the flash_attn
# version the drop-in follows) read from a local git mirror of Dao-AILab/flash-attention,
# and the einops wheel (the test file imports it) from PyPI. Nothing of it is committed:
# carry `.upstream` in the device call, then `bash scripts/gpu.sh upstream`.
#   bash scripts/upstream_prep.sh GIT_DIR [TAG]
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 ]]; then sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
git_dir=$1
tag=${2:-v2.8.3}
mkdir -p .upstream/wheels
git --git-dir="$git_dir" show "$tag:tests/test_flash_attn.py" > .upstream/test_flash_attn.py
${PYTHON:-python3} -m pip download --quiet --no-deps --only-binary=:all: -d .upstream/wheels einops
echo "$tag" > .upstream/TAG
ls -l .upstream .upstream/wheels
