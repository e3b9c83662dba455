#!/usr/bin/env bash
# Builds the CUDA driver emulator: bash tests/cuda-emu/build.sh DIR makes
# DIR/libcuda.so.1. Point dmaload at it with DMALOAD_LIBCUDA=DIR/libcuda.so.1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: build.sh DIR}"
mkdir -p "$out"
# Build beside the target and rename, so a process that has the old file
# open keeps its copy and a concurrent build never leaves half a library.
tmp="$(mktemp "$out/.libcuda.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
${CC:-gcc} -std=gnu11 -O2 -g -Wall -Wextra -Werror -fPIC -fvisibility=hidden -pthread \
    -shared -Wl,-soname,libcuda.so.1 -o "$tmp" "$here"/{emu,memory,copy,ipc}.c
mv -f "$tmp" "$out/libcuda.so.1"
trap - EXIT
