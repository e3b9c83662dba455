#!/usr/bin/env bash
# Two dmaload binaries, one file, cold loads alternating: the check that a
# change did not slow the default load ("the new default >= 0.98x the old").
#
#   bench/old_vs_new.sh OLD_DMALOAD NEW_DMALOAD FILE [ROUNDS] [-- LOAD_ARGS...]
#
# Each round runs `dmaload load FILE --json --hash LOAD_ARGS...` once with
# each binary, the order swapped every round (old first, then new first),
# each run after evicting FILE from the page cache (`NEW_DMALOAD evict`:
# fdatasync + POSIX_FADV_DONTNEED; no root needed). Every run's bytes are
# checked: the xxh3-64 the load reports (`--hash`, taken after its timing)
# must equal `xxhsum -H3` of the same range of FILE, read by xxhsum itself
# (apt-get install xxhash); a mismatch stops the script with exit status 1.
# Prints every run, then per binary the median (min-max) of the GiB/s the
# load reports (allocation and reads, from the open to the last byte) and
# of the wall clock of the whole process (exit, and so the unmap, included;
# the in-process hash's own reported seconds taken out), and new/old ratios
# of the medians. ROUNDS defaults to 6.
set -euo pipefail

usage() { sed -n '2,18s/^# \{0,1\}//p' "$0" >&2; exit 2; }
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

command -v xxhsum >/dev/null || { echo "xxhsum not found: the runs' bytes are checked against it (apt-get install xxhash)" >&2; exit 2; }

evict() { "$new" evict "$1"; }

# Sets $want to the xxh3-64 of BYTES bytes of FILE from OFFSET, read by
# dd and xxhsum (not by dmaload); each range is read once.
declare -A reference=()
file_hash() {
    local offset=$1 bytes=$2 key="$1:$2" digest
    if [[ -z ${reference[$key]:-} ]]; then
        digest=$(dd if="$file" iflag=skip_bytes,count_bytes skip="$offset" count="$bytes" bs=4M status=none |
            xxhsum -H3 | awk '{print $NF}')
        digest=${digest#XXH3_}
        [[ $digest =~ ^[0-9a-f]{16}$ ]] || { echo "cannot read xxhsum -H3's output: '$digest'" >&2; exit 2; }
        reference[$key]=$digest
    fi
    want=${reference[$key]}
}

results=$(mktemp)
trap 'rm -f "$results"' EXIT

# One run: "<label> <reported GiB/s> <wall GiB/s>" appended to $results,
# once its bytes have matched the file's.
run_one() {
    local label=$1 bin=$2 round=$3 json start end line offset bytes got
    evict "$file"
    start=$(date +%s%N)
    json=$("$bin" load "$file" --json --hash "${extra[@]}")
    end=$(date +%s%N)
    # "<label> <reported> <wall> <offset> <bytes> <xxh3>"; the wall clock
    # less the hash's own seconds, which the load's report times apart.
    line=$(python3 -c '
import json, sys
r = json.loads(sys.argv[1])
h = r.get("hash") or {}
wall = (int(sys.argv[3]) - int(sys.argv[2])) / 1e9 - h.get("seconds", 0.0)
gib = r["bytes"] / 2**30
print(sys.argv[4], "%.4f" % r["gib_per_second"], "%.4f" % (gib / wall), r.get("offset", 0), r["bytes"],
      h.get("xxh3_64", "none"))
' "$json" "$start" "$end" "$label")
    read -r _ _ _ offset bytes got <<<"$line"
    file_hash "$offset" "$bytes"
    if [[ $got != "$want" ]]; then
        echo "BYTES DIFFER: round $round, $label ($bin) loaded bytes [$offset, +$bytes) of $file" \
            "with xxh3 $got; xxhsum -H3 of that range is $want" >&2
        exit 1
    fi
    echo "${line% * * *}" | tee -a "$results"
}

echo "file: $file ($(stat -c %s "$file") bytes), $rounds rounds, old: $old, new: $new" >&2
# The whole file's reference, read before the first timed run (each run evicts first).
file_hash 0 "$(stat -c %s "$file")"
echo "xxh3 (xxhsum -H3): $want" >&2
for ((r = 1; r <= rounds; r++)); do
    echo "round $r/$rounds" >&2
    if ((r % 2)); then
        run_one old "$old" "$r" >&2
        run_one new "$new" "$r" >&2
    else
        run_one new "$new" "$r" >&2
        run_one old "$old" "$r" >&2
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
print(f"\nevery run's bytes matched xxhsum -H3 of the same bytes of the file")
print(f"new/old (medians): reported {med['new'][0] / med['old'][0]:.3f}x, "
      f"wall {med['new'][1] / med['old'][1]:.3f}x")
EOF
