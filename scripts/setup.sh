#!/usr/bin/env bash
# Installs what building and testing flashattn needs on a fresh Debian/Ubuntu machine:
# a C++20 compiler with OpenMP, CMake >= 3.24, Ninja and GoogleTest. The CUDA toolkit
# (nvcc 13) is expected at /usr/local/cuda or on PATH; without it only the CPU backend builds.
set -euo pipefail
need=()
command -v g++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
[ -e /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no nvcc found: building the CPU backend only"
fi
