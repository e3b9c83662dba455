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
cargo build --release --quiet --target "$TARGET" --target-dir "$TARGET_DIR" -p dmaload-cli -p dmaload-bench -p dmaload-capi
# The test executables' paths, from cargo's JSON messages.
mapfile -t tests < <(cargo test --release --no-run --quiet --target "$TARGET" --target-dir "$TARGET_DIR" \
    -p dmaload -p dmaload-bench --test dmabuf --test transfer --test block_queue --test memory \
    --message-format=json |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
declare -A exe=()
for t in "${tests[@]}"; do exe[${t%% *}]=${t#* }; done
[[ -n ${exe[dmabuf]:-} && -n ${exe[transfer]:-} && -n ${exe[block_queue]:-} && -n ${exe[memory]:-} ]] || {
    say "test binaries not found"
    exit 1
}
cli=$TARGET_DIR/$TARGET/release/dmaload
bench=$TARGET_DIR/$TARGET/release/dmaload-bench
# The C example and the C test program, linked statically against the C
# library (the guest has no libc).
load_c=$TARGET_DIR/load-c
capi_test=$TARGET_DIR/capi-test
for c in "examples/c/load.c $load_c" "crates/dmaload-capi/tests/c/capi_test.c $capi_test"; do
    cc -std=c11 -Wall -Wextra -Werror -static -o "${c#* }" "${c%% *}" -I crates/dmaload-capi/include \
        "$TARGET_DIR/$TARGET/release/libdmaload_capi.a" -lpthread -lm -ldl
done

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
# The bench crate's transfer methods into dma-buf memory, and udmabuf's size limit.
vm "${exe[transfer]}" --test-threads=1 --nocapture dmabuf_kinds udmabuf_beyond_its_size_limit
# The C library's checks, here with every dma-buf target present (a range
# into each, hashed back through dmaload_dmabuf_xxh3_64).
vm "$capi_test" /mnt/disk
# Block queues over dma-buf blocks between two processes (the test binary
# re-executes itself for the peer), DMA_BUF_IOCTL_SYNC counted on both sides.
vm "${exe[block_queue]}" --test-threads=1 --nocapture --exact dmabuf_blocks_cross_processes_with_cpu_sync
# hugetlb memory, which this host's empty pool refuses: a pool of 8 pages
# holds a 5-page load but not the private copy that sharing its memfd needs.
DMALOAD_VM_KERNEL_ARGS="$DMALOAD_VM_KERNEL_ARGS hugepages=8" vm "${exe[memory]}" --test-threads=1 --nocapture \
    --exact a_hugetlb_memfd_uses_the_pool_or_says_how_to_grow_it \
    a_hugetlb_buffer_the_pool_cannot_copy_keeps_its_bytes_and_hands_out_no_fd

# The bench's dma-heap / udmabuf rows must really run in the guest.
log=$(mktemp)
trap 'rm -f "$log" "$log.txt" "$log.host"' EXIT
DMALOAD_VM_LOG=$log vm "$bench" matrix --size 8M --piece 4M --repeat 1 --dir /mnt/disk
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

# Seed 000's table with the dma-buf rows: each must run (and verify its
# bytes) in the guest. Under TCG the times say nothing about speed.
DMALOAD_VM_LOG=$log vm "$bench" sizes --sizes 512K,8M --repeat 1 --dir /mnt/disk
tr -d '\r' <"$log" >"$log.txt"
for row in "normal: dma-heap alloc" "udmabuf, buffered" "udmabuf, direct" "alloc-and-read → udmabuf" \
    "alloc-and-read → dma-heap"; do
    grep -q "^| $row.* | [0-9].* | [0-9]" "$log.txt" || { say "bench sizes row '$row' did not run"; exit 1; }
done

# The dma-buf targets of `dmaload load --to` and of the C library's
# dmaload_load_dmabuf: each hashes the file (the program's own binary, in the
# guest's initramfs) back through a fresh, SYNC-bracketed mapping of the
# dma-buf it got; the host computes the expected hash with a plain load.
hash_of() { sed -n 's/^xxh3-64 *\([0-9a-f]\{16\}\).*/\1/p; s/^\([0-9a-f]\{16\}\)$/\1/p' "$1" | tail -n 1; }
for target in dma-heap:system udmabuf dmabuf; do
    for program in "$cli" "$load_c"; do
        name=$(basename "$program")
        host=$(mktemp)
        if [[ $program == "$cli" ]]; then
            "$cli" load --hash "$cli" >"$host"
            args=(load --hash --to "$target" "/test/$name")
        else
            "$load_c" "$load_c" >"$host"
            args=("/test/$name" "$target")
        fi
        expected=$(hash_of "$host")
        rm -f "$host"
        DMALOAD_VM_LOG=$log vm "$program" "${args[@]}"
        tr -d '\r' <"$log" >"$log.txt"
        got=$(hash_of "$log.txt")
        if [[ -z $expected || $got != "$expected" ]]; then
            say "$name into $target: xxh3 '$got' in the guest, '$expected' on the host"
            exit 1
        fi
        say "$name into $target: xxh3 $got as on the host"
    done
done
# `dmabuf` where udmabuf cannot hold the file (size_limit_mb=1) falls back
# to the system heap, says why, and still holds the file.
DMALOAD_VM_KERNEL_ARGS=udmabuf.size_limit_mb=1 DMALOAD_VM_LOG=$log vm "$cli" load --hash --to dmabuf /test/dmaload
tr -d '\r' <"$log" >"$log.txt"
expected=$("$cli" load --hash "$cli" >"$log.host" && hash_of "$log.host")
if ! grep -q "fallback udmabuf -> dma-heap:system: .*size_limit_mb (1 MiB)" "$log.txt" ||
    [[ $(hash_of "$log.txt") != "$expected" ]]; then
    say "dmabuf past udmabuf's size limit did not fall back to the system heap with the file's bytes"
    exit 1
fi
say "dmabuf past udmabuf's size limit: dma-heap:system, xxh3 as on the host"

# An object from a real S3 server into each dma-buf kind: Garage (where
# .ci/run builds it) on the host's 127.0.0.1, reached by the guest as
# 10.0.2.2 over QEMU's user network (DMALOAD_VM_NET=1).
garage_bin=${DMALOAD_GARAGE:-$HOME/.cache/dmaload/garage-2.5.0/bin/garage}
if [[ -x $garage_bin ]] && command -v curl >/dev/null; then
    gdir=$(mktemp -d)
    free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
    rpc_port=$(free_port)
    s3_port=$(free_port)
    printf '%s\n' "metadata_dir = \"$gdir/meta\"" "data_dir = \"$gdir/data\"" 'db_engine = "sqlite"' \
        'replication_factor = 1' "rpc_bind_addr = \"127.0.0.1:$rpc_port\"" \
        "rpc_public_addr = \"127.0.0.1:$rpc_port\"" \
        "rpc_secret = \"$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')\"" '[s3_api]' 's3_region = "garage"' \
        "api_bind_addr = \"127.0.0.1:$s3_port\"" >"$gdir/garage.toml"
    garage() { "$garage_bin" -c "$gdir/garage.toml" "$@"; }
    # Not through the function: $! must be the server itself, for the trap to stop it.
    "$garage_bin" -c "$gdir/garage.toml" server >"$gdir/garage.log" 2>&1 &
    garage_pid=$!
    trap 'rm -f "$log" "$log.txt" "$log.host"; kill $garage_pid 2>/dev/null; rm -rf "$gdir"' EXIT
    for _ in $(seq 300); do garage status >/dev/null 2>&1 && break; sleep 0.2; done
    garage layout assign -z dc1 -c 1G "$(garage node id -q | cut -d@ -f1)" >/dev/null
    garage layout apply --version 1 >/dev/null
    garage bucket create models >/dev/null
    key_json=$(garage json-api CreateKey '{"name":"vm"}')
    key_id=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["accessKeyId"])' <<<"$key_json")
    secret=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["secretAccessKey"])' <<<"$key_json")
    garage bucket allow --read --write --owner models --key vm >/dev/null
    head -c $(((5 << 20) + 123)) /dev/urandom >"$gdir/vm.bin"
    # Retried while the new layout settles, as the tests' uploads are.
    for _ in $(seq 50); do
        curl -sf --aws-sigv4 "aws:amz:garage:s3" -u "$key_id:$secret" -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
            -T "$gdir/vm.bin" "http://127.0.0.1:$s3_port/models/vm.bin" && break
        sleep 0.2
    done
    expected=$("$cli" load --hash "$gdir/vm.bin" >"$log.host" && hash_of "$log.host")
    s3_env="AWS_ENDPOINT_URL=http://10.0.2.2:$s3_port AWS_REGION=garage AWS_ACCESS_KEY_ID=$key_id"
    s3_env+=" AWS_SECRET_ACCESS_KEY=$secret"
    # The CLI, and the C library (examples/c/load.c: dmaload_load_dmabuf
    # with the URL as its path).
    for target in dma-heap:system udmabuf; do
        for run in "$cli load --hash --to $target s3://models/vm.bin" "$load_c s3://models/vm.bin $target"; do
            # shellcheck disable=SC2086 # $run is the command and its words.
            DMALOAD_VM_NET=1 DMALOAD_VM_ENV="$DMALOAD_VM_ENV $s3_env" DMALOAD_VM_LOG=$log vm $run
            tr -d '\r' <"$log" >"$log.txt"
            got=$(hash_of "$log.txt")
            name=$(basename "${run%% *}")
            if [[ -z $expected || $got != "$expected" ]]; then
                say "$name: s3://models/vm.bin into $target: xxh3 '$got' in the guest, '$expected' on the host"
                exit 1
            fi
            say "$name: s3://models/vm.bin into $target: xxh3 $got as uploaded"
        done
    done
else
    printf 'SKIP vm objects into dma-bufs: no garage binary at %s (or no curl)\n' "$garage_bin"
fi
say "all VM tests passed in $(($(date +%s) - started)) s"
