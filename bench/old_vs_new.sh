#!/usr/bin/env bash
# Two dmaload binaries, one file, cold loads alternating: the check that a
# change did not slow the default load ("the new default >= 0.98x the old").
#
#   bench/old_vs_new.sh OLD_DMALOAD NEW_DMALOAD FILE [ROUNDS] [-- LOAD_ARGS...]
#
# Each round runs `dmaload load FILE --json LOAD_ARGS...` once with each
# binary, the order swapped every round (old first, then new first), each
# run after evicting FILE from the page cache (`NEW_DMALOAD evict`: fdatasync
# + POSIX_FADV_DONTNEED; no root needed). Prints every run,
# then per binary the median (min-max) of the GiB/s the load reports
# (allocation and reads, from the open to the last byte) and of the wall
# clock of the whole process (exit, and so the unmap, included), and
# new/old ratios of the medians. ROUNDS defaults to 6.
set -euo pipefail

usage() { sed -n '2,14s/^# \{0,1\}//p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
old=$1 new=$2 file=$3
shift 3
rounds=6
if [[ $# -gt 0 && $1 != -- ]]; then rounds=$1; shift; fi
[[ $# -gt 0 && $1 == -- ]] && shift
extra=("$@")
for b in "$old" "$new"; do [[ -x $b ]] || { echo "not an executable: $b" >&2; exit 2; }; done
[[ -f $file ]] || { echo "not a file: $file" >&2; exit 2; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }

evict() { "$new" evict "$1"; }

results=$(mktemp)
trap 'rm -f "$results"' EXIT

# One run: "<label> <reported GiB/s> <wall GiB/s>" appended to $results.
run_one() {
    local label=$1 bin=$2 json start end
    evict "$file"
    start=$(date +%s%N)
    json=$("$bin" load "$file" --json "${extra[@]}")
    end=$(date +%s%N)
    python3 -c '
import json, sys
r = json.loads(sys.argv[1])
wall = (int(sys.argv[3]) - int(sys.argv[2])) / 1e9
gib = r["bytes"] / 2**30
print(sys.argv[4], "%.4f" % r["gib_per_second"], "%.4f" % (gib / wall))
' "$json" "$start" "$end" "$label" | tee -a "$results"
}

echo "file: $file ($(stat -c %s "$file") bytes), $rounds rounds, old: $old, new: $new" >&2
for ((r = 1; r <= rounds; r++)); do
    echo "round $r/$rounds" >&2
    if ((r % 2)); then
        run_one old "$old" >&2
        run_one new "$new" >&2
    else
        run_one new "$new" >&2
        run_one old "$old" >&2
    fi
done
evict "$file"

python3 - "$results" <<'EOF'
import statistics, sys
runs = {"old": [], "new": []}
for line in open(sys.argv[1]):
    label, reported, wall = line.split()
    runs[label].append((float(reported), float(wall)))
print("| binary | runs | reported GiB/s median (min-max) | wall GiB/s median (min-max) |")
print("|---|---:|---:|---:|")
med = {}
for label in ("old", "new"):
    rep = [r for r, _ in runs[label]]
    wall = [w for _, w in runs[label]]
    med[label] = (statistics.median(rep), statistics.median(wall))
    print(f"| {label} | {len(rep)} | {med[label][0]:.2f} ({min(rep):.2f}-{max(rep):.2f}) "
          f"| {med[label][1]:.2f} ({min(wall):.2f}-{max(wall):.2f}) |")
print(f"\nnew/old (medians): reported {med['new'][0] / med['old'][0]:.3f}x, "
      f"wall {med['new'][1] / med['old'][1]:.3f}x")
EOF
