#!/usr/bin/env bash
# The GPU path's two emulated targets (issue 25), side by side in one run,
# against the CUDA driver emulator (tests/cuda-emu), no GPU needed:
#
#   bench/gpu-emu.sh [SIZE] [ROUNDS] [LINK_GIBS]
#
#   link-bound:   `dmaload load F --to cuda:0` with the file in the page
#                 cache and the emulated link at LINK_GIBS (default 0.5):
#                 the load's GiB/s over the link's
#   source-bound: `dmaload load F --mode direct --to cuda:0` over an
#                 unlimited link against `dmaload load F --mode direct`
#                 (host memory), the page cache evicted before each
#
# ROUNDS (default 3) interleave the three runs, alternating which of the
# two cold runs goes first; the ratios printed are of the medians. SIZE
# (default 1G) is the test file's, kept under .dev/gpu-emu/ between runs.
# Strict mode is off (its hashing would compete with the reads).
# Needs the release CLI (cargo build --release -p dmaload-cli) and gcc.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
size=${1:-1G}
rounds=${2:-3}
link=${3:-0.5}
dir=$root/.dev/gpu-emu
cli=${DMALOAD_CLI:-$root/target/release/dmaload}
mkdir -p "$dir"
bash "$root/tests/cuda-emu/build.sh" "$dir"
emu=$dir/libcuda.so.1
file=$dir/file-$size
if [[ ! -f $file ]]; then
    head -c "$size" /dev/urandom >"$file.tmp" && mv "$file.tmp" "$file"
fi

evict() { python3 -c 'import os,sys; fd=os.open(sys.argv[1],os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)' "$file"; }
warm() { cat "$file" >/dev/null; }
# GiB/s of one load, from its --json report.
rate() { "$@" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["gib_per_second"])'; }
host_cold() { evict; rate "$cli" load "$file" --mode direct; }
gpu_cold() { evict; DMALOAD_LIBCUDA=$emu rate "$cli" load "$file" --mode direct --to cuda:0; }
gpu_link() { warm; DMALOAD_LIBCUDA=$emu DMALOAD_EMU_LINK_GIBS=$link rate "$cli" load "$file" --to cuda:0; }

link_runs=() host_runs=() gpu_runs=()
for ((r = 0; r < rounds; r++)); do
    link_runs+=("$(gpu_link)")
    if ((r % 2)); then
        gpu_runs+=("$(gpu_cold)") host_runs+=("$(host_cold)")
    else
        host_runs+=("$(host_cold)") gpu_runs+=("$(gpu_cold)")
    fi
    echo "round $((r + 1)): link-bound ${link_runs[r]} GiB/s, cold to device ${gpu_runs[r]}, cold host ${host_runs[r]}" >&2
done

python3 - "$link" "${link_runs[*]}" "${gpu_runs[*]}" "${host_runs[*]}" <<'EOF'
import statistics, sys
link = float(sys.argv[1])
med = [statistics.median(map(float, a.split())) for a in sys.argv[2:]]
print(f"{'target':<14}{'measured GiB/s':>16}{'against GiB/s':>15}{'ratio':>8}")
print(f"{'link-bound':<14}{med[0]:>16.3f}{link:>15.3f}{med[0] / link:>8.2f}")
print(f"{'source-bound':<14}{med[1]:>16.3f}{med[2]:>15.3f}{med[1] / med[2]:>8.2f}")
EOF
