#!/usr/bin/env bash
# The GPU path's two emulated targets (issue 25), side by side in one run,
# against the CUDA driver emulator (tests/cuda-emu), no GPU needed:
#
#   bench/gpu-emu.sh [SIZE] [ROUNDS] [LINK_GIBS] [DELAY_MS]
#
#   link-bound:   `dmaload load F --to cuda:0` with the file in the page
#                 cache and the emulated link at LINK_GIBS (default 0.5):
#                 the load's GiB/s over the link's
#   source-bound: `dmaload load F --mode direct --to cuda:0` over an
#                 unlimited link against `dmaload load F --mode direct`
#                 (host memory), the page cache evicted before each
#   slow copy:    the link-bound load with one copy in the middle of the
#                 load (`copy#N=delay:US`, DELAY_MS, default 200) starting
#                 late: the seconds it adds to the link-bound load's
#                 against its own delay (target: at most 1x)
#   warm lane:    `dmaload load F --to cuda:0`, file in the page cache,
#                 unlimited link: the cache lane carries every window
#                 (each thread its own small pinned pieces and stream),
#                 against the ring the same file took before the lane
#                 (`--mode buffered --engine pread-pool --threads T`: the
#                 page-cache copy on the lane's T threads through the
#                 32 x 16 MiB ring): the lane's GiB/s over the ring's
#
#   whole process: the link-bound and source-bound runs again, each
#                 timed from outside as a user sees it (process start, CUDA
#                 init, device allocation, ring set-up and exit included):
#                 the same runs' wall seconds, not their reports' seconds
#
# ROUNDS (default 3) interleave the six runs, alternating which of the
# two cold runs goes first; the ratios printed are of the medians. SIZE
# (default 1G) is the test file's, kept under .dev/gpu-emu/ between runs.
# Strict mode is off (its hashing would compete with the reads).
# Needs the release CLI (cargo build --release -p dmaload-cli) and gcc.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
size=${1:-1G}
rounds=${2:-3}
link=${3:-0.5}
delay_ms=${4:-200}
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
# A field of one load's --json report (gib_per_second, total_seconds),
# then the whole process's wall seconds, timed around it from outside.
field() {
    local key=$1
    shift
    python3 -c '
import json, subprocess, sys, time
start = time.perf_counter()
out = subprocess.run(sys.argv[2:] + ["--json"], check=True, stdout=subprocess.PIPE).stdout
print(json.loads(out)[sys.argv[1]], time.perf_counter() - start)' "$key" "$@"
}
host_cold() { evict; field gib_per_second "$cli" load "$file" --mode direct; }
gpu_cold() { evict; DMALOAD_LIBCUDA=$emu field gib_per_second "$cli" load "$file" --mode direct --to cuda:0; }
gpu_link() { warm; DMALOAD_LIBCUDA=$emu DMALOAD_EMU_LINK_GIBS=$link field total_seconds "$cli" load "$file" --to cuda:0; }
# The middle copy of the load: one per 16 MiB slot.
slow_copy=$(($(stat -Lc %s "$file") / (16 << 20) / 2 + 1))
gpu_slow() { DMALOAD_EMU_FAULTS=copy#$slow_copy=delay:$((delay_ms * 1000)) gpu_link; }
# The warm file over an unlimited link: the cache lane, and the ring on as
# many threads (the lane's, from its report).
read -r lane_threads _ <<<"$(warm; DMALOAD_LIBCUDA=$emu field cache_lane_threads "$cli" load "$file" --to cuda:0)"
warm_lane() { warm; DMALOAD_LIBCUDA=$emu field gib_per_second "$cli" load "$file" --to cuda:0; }
warm_ring() {
    warm
    DMALOAD_LIBCUDA=$emu field gib_per_second "$cli" load "$file" --to cuda:0 --mode buffered \
        --engine pread-pool --threads "$lane_threads"
}

link_runs=() slow_runs=() host_runs=() gpu_runs=() lane_runs=() ring_runs=()
link_walls=() host_walls=() gpu_walls=()
# Each run's report field into the array named $1, its wall seconds into
# the one named $2 (or nowhere).
record() {
    local -n values=$1
    local value wall
    read -r value wall <<<"$("${@:3}")"
    values+=("$value")
    if [[ $2 != - ]]; then
        local -n walls=$2
        walls+=("$wall")
    fi
}
for ((r = 0; r < rounds; r++)); do
    record link_runs link_walls gpu_link
    record slow_runs - gpu_slow
    if ((r % 2)); then
        record gpu_runs gpu_walls gpu_cold
        record host_runs host_walls host_cold
        record ring_runs - warm_ring
        record lane_runs - warm_lane
    else
        record host_runs host_walls host_cold
        record gpu_runs gpu_walls gpu_cold
        record lane_runs - warm_lane
        record ring_runs - warm_ring
    fi
    echo "round $((r + 1)): link-bound ${link_runs[r]} s (whole process ${link_walls[r]} s)," \
        "with a slow copy ${slow_runs[r]} s, cold to device ${gpu_runs[r]} GiB/s (whole ${gpu_walls[r]} s)," \
        "cold host ${host_runs[r]} GiB/s (whole ${host_walls[r]} s)," \
        "warm lane ${lane_runs[r]} GiB/s, warm ring ${ring_runs[r]} GiB/s" >&2
done

python3 - "$link" "$(stat -Lc %s "$file")" "$delay_ms" "$lane_threads" "${link_runs[*]}" "${slow_runs[*]}" \
    "${gpu_runs[*]}" "${host_runs[*]}" "${lane_runs[*]}" "${ring_runs[*]}" \
    "${link_walls[*]}" "${gpu_walls[*]}" "${host_walls[*]}" <<'EOF'
import statistics, sys
link, size, delay = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) / 1000
threads = sys.argv[4]
medians = [statistics.median(map(float, a.split())) for a in sys.argv[5:]]
link_s, slow_s, gpu, host, lane, ring, link_wall, gpu_wall, host_wall = medians
link_rate = size / 2**30 / link_s
print(f"{'target':<14}{'measured':>16}{'against':>16}{'ratio':>8}")
print(f"{'link-bound':<14}{link_rate:>10.3f} GiB/s{link:>10.3f} GiB/s{link_rate / link:>8.2f}")
print(f"{'source-bound':<14}{gpu:>10.3f} GiB/s{host:>10.3f} GiB/s{gpu / host:>8.2f}")
print(f"{'slow copy':<14}{slow_s - link_s:>14.3f} s{delay:>14.3f} s{(slow_s - link_s) / delay:>8.2f}")
print(f"{'warm lane':<14}{lane:>10.3f} GiB/s{ring:>10.3f} GiB/s{lane / ring:>8.2f}"
      f"  (the ring: buffered reads on the lane's {threads} threads)")
# The whole process: the same runs' wall seconds (a rate from the file's size).
link_whole, gpu_whole, host_whole = (size / 2**30 / s for s in (link_wall, gpu_wall, host_wall))
print(f"{'link, whole':<14}{link_whole:>10.3f} GiB/s{link:>10.3f} GiB/s{link_whole / link:>8.2f}"
      f"  ({link_wall:.2f} s for the load's {link_s:.2f} s)")
print(f"{'source, whole':<14}{gpu_whole:>10.3f} GiB/s{host_whole:>10.3f} GiB/s{gpu_whole / host_whole:>8.2f}"
      f"  ({gpu_wall:.2f} s against the host's {host_wall:.2f} s)")
EOF
