#!/usr/bin/env bash
# The dma-heap / udmabuf tests on a kernel that has them: builds static
# test binaries and the dmaload CLI, then boots each in the VM harness
# (run.sh). Prints "SKIP vm: <reason>" and exits 0 when the VM cannot run
# here (no qemu and no way to install it, no kernel package); fails when it
# runs but the guest lacks /dev/dma_heap/system or /dev/udmabuf.
#
#   bash tests/vm/ci.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

TARGET=x86_64-unknown-linux-gnu
# Own target dir: static and dynamic builds must not evict each other.
TARGET_DIR=${DMALOAD_VM_TARGET_DIR:-target/vm}
export RUSTFLAGS="-C target-feature=+crt-static"

say() { printf 'vm-ci: %s\n' "$*" >&2; }

say "building static test binaries and the CLI ($TARGET, $TARGET_DIR)"
cargo build --release --quiet --target "$TARGET" --target-dir "$TARGET_DIR" -p dmaload-cli
# The test executables' paths, from cargo's JSON messages.
mapfile -t tests < <(cargo test --release --no-run --quiet --target "$TARGET" --target-dir "$TARGET_DIR" \
    -p dmaload --test dmabuf --test transfer --test block_queue --message-format=json |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
declare -A exe=()
for t in "${tests[@]}"; do exe[${t%% *}]=${t#* }; done
[[ -n ${exe[dmabuf]:-} && -n ${exe[transfer]:-} && -n ${exe[block_queue]:-} ]] || {
    say "test binaries not found"
    exit 1
}
cli=$TARGET_DIR/$TARGET/release/dmaload

# 1024 MiB so the matrix's 32 MiB pieces and the tests' loads fit; the
# size-limit test reads the limit, so it still checks the refusal.
export DMALOAD_VM_KERNEL_ARGS=${DMALOAD_VM_KERNEL_ARGS:-udmabuf.size_limit_mb=1024}
# The guest exists to run what this host lacks: a guest without dma-heap or
# udmabuf fails the run (run.sh checks the device nodes before the binary
# starts), and the tests' own probes panic there instead of skipping.
export DMALOAD_VM_REQUIRE="/dev/dma_heap/system /dev/udmabuf"
export DMALOAD_VM_ENV="DMALOAD_TEST_DIR=/mnt/disk RUST_BACKTRACE=1 DMALOAD_TEST_NO_SKIP=1"
export DMALOAD_VM_TIMEOUT=${DMALOAD_VM_TIMEOUT:-900}

vm() {
    local rc=0
    tests/vm/run.sh "$@" || rc=$?
    case $rc in
        0) return 0 ;;
        77) printf 'SKIP vm: the VM harness cannot run here (see above)\n'; exit 0 ;;
        *) say "FAILED (run.sh exit $rc): $*"; exit 1 ;;
    esac
}

started=$(date +%s)
vm "${exe[dmabuf]}" --test-threads=1 --nocapture
vm "${exe[transfer]}" --test-threads=1 --nocapture dmabuf_kinds
# Block queues over dma-buf blocks between two processes (the test binary
# re-executes itself for the peer), DMA_BUF_IOCTL_SYNC counted on both sides.
vm "${exe[block_queue]}" --test-threads=1 --nocapture --exact dmabuf_blocks_cross_processes_with_cpu_sync

# The bench's dma-heap / udmabuf rows must really run in the guest.
log=$(mktemp)
trap 'rm -f "$log" "$log.txt"' EXIT
DMALOAD_VM_LOG=$log vm "$cli" bench matrix --size 8M --piece 4M --repeat 1 --dir /mnt/disk
# Cleaned into a file and grepped there: `tr | grep -q` under pipefail fails
# at random when grep exits early and tr dies of SIGPIPE.
tr -d '\r' <"$log" >"$log.txt"
if grep -q 'unavailable:' "$log.txt"; then
    say "bench matrix in the VM still reports memory types as unavailable"
    exit 1
fi
for row in "u+memfd direct uring-fixed" "udmabuf buffer R/W" "dma-heap buffer R/W"; do
    grep -q "| $row | [0-9]" "$log.txt" || { say "bench matrix row '$row' did not run"; exit 1; }
done
say "all VM tests passed in $(($(date +%s) - started)) s"
