#!/usr/bin/env bash
# Run a test binary inside a throw-away QEMU guest whose kernel has dma-heap
# and udmabuf built in, and turn the guest's verdict into our exit status.
#
#   tests/vm/run.sh BINARY [ARGS...]
#
# Exit status: 0 PASS, 1 FAIL (binary exited non-zero, or a path named in
# DMALOAD_VM_REQUIRE is missing in the guest), 2 usage/harness error,
# 3 guest ended without a verdict (kernel panic, init crash, QEMU error),
# 4 timeout, 77 SKIP (prerequisites missing and not installable).
# See tests/vm/README.md for the environment variables and the marker protocol.
set -euo pipefail

# ---- configuration ----------------------------------------------------------
CACHE=${DMALOAD_VM_CACHE:-$HOME/.cache/dmaload-vm}
KERNEL_PKG=${DMALOAD_VM_KERNEL_PKG:-linux-image-6.12-cloud-amd64}
# TCG is 10-50x slower than native, so the default is deliberately generous.
TIMEOUT=${DMALOAD_VM_TIMEOUT:-600}
MEM=${DMALOAD_VM_MEM:-2G}
SMP=${DMALOAD_VM_SMP:-2}
# Stock kernels do not boot under this host's KVM; keep TCG unless told.
ACCEL=${DMALOAD_VM_ACCEL:-tcg}
DISK_SIZE=${DMALOAD_VM_DISK_SIZE:-1G}
MODULES=${DMALOAD_VM_MODULES:-virtio_blk}
KERNEL_ARGS=${DMALOAD_VM_KERNEL_ARGS:-}
GUEST_ENV=${DMALOAD_VM_ENV:-}
# Paths the guest must have (e.g. /dev/udmabuf): the run fails, without
# starting the binary, when one is missing, instead of the binary skipping.
REQUIRE=${DMALOAD_VM_REQUIRE:-}
SAVE_LOG=${DMALOAD_VM_LOG:-}
KEEP=${DMALOAD_VM_KEEP:-0}
# 1: a virtio NIC on QEMU's user-mode network, the guest at 10.0.2.15 and
# the host's 127.0.0.1 reachable as 10.0.2.2 (a server the host started).
NET=${DMALOAD_VM_NET:-0}
NO_INSTALL=${DMALOAD_VM_NO_INSTALL:-0}

me=${0##*/}
say() { printf '%s: %s\n' "$me" "$*" >&2; }
die() { say "error: $*"; exit 2; }
skip() { printf 'SKIP: %s\n' "$*"; exit 77; }

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,11s/^# \{0,1\}//p' "$0" >&2
    exit 2
fi
# Kept for booting again after a panic before /init (see the verdict).
ORIGINAL_ARGS=("$@")
BINARY=$1
shift
[[ -f $BINARY && -x $BINARY ]] || die "not an executable file: $BINARY"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "DMALOAD_VM_TIMEOUT must be whole seconds, got '$TIMEOUT'"

# ---- prerequisites ------------------------------------------------------------
# Installing is only attempted where it can work unattended (root + apt), so a
# developer box without them gets a SKIP rather than a sudo prompt.
apt_install() {
    [[ $NO_INSTALL == 1 ]] && return 1
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || return 1
    say "installing $* (apt-get) ..."
    local log
    log=$(mktemp)
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >"$log" 2>&1; then
        # Stale or missing package lists are the usual cause on fresh containers.
        if ! { apt-get update && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y --no-install-recommends "$@"; } >>"$log" 2>&1; then
            tail -n 5 "$log" >&2
            rm -f "$log"
            return 1
        fi
    fi
    rm -f "$log"
}

# cmd:package pairs; the package is what provides the command on Debian.
need_cmds() {
    local pair cmd missing=() pkgs=()
    for pair in "$@"; do
        cmd=${pair%%:*}
        command -v "$cmd" >/dev/null || { missing+=("$cmd"); pkgs+=("${pair#*:}"); }
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    apt_install "${pkgs[@]}" || true
    for cmd in "${missing[@]}"; do
        command -v "$cmd" >/dev/null || skip "'$cmd' not found and could not be installed (package ${pkgs[*]})"
    done
}

need_cmds qemu-system-x86_64:qemu-system-x86 cpio:cpio xz:xz-utils readelf:binutils

# A dynamically linked busybox would need its libc in the guest; insist on static.
# Headers read whole first: `readelf | grep -q` under pipefail can fail on SIGPIPE.
is_static() { local headers; headers=$(readelf -l "$1" 2>/dev/null) && ! grep -q 'program interpreter' <<<"$headers"; }
find_busybox() {
    local b
    for b in ${DMALOAD_VM_BUSYBOX:-} /bin/busybox /usr/bin/busybox; do
        [[ -x $b ]] && is_static "$b" && { echo "$b"; return 0; }
    done
    return 1
}
BUSYBOX=$(find_busybox) || { apt_install busybox-static || true; BUSYBOX=$(find_busybox) || skip "no statically linked busybox (install busybox-static)"; }

# ---- kernel (cached) --------------------------------------------------------------
# The cache holds one extracted kernel per package name. It is never refreshed
# on its own, so runs are reproducible and work offline; delete the directory
# to pick up a newer Debian kernel.
KDIR=$CACHE/$KERNEL_PKG

fetch_kernel() {
    if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
        skip "kernel not cached in $KDIR and apt-get/dpkg-deb are unavailable to fetch $KERNEL_PKG"
    fi
    mkdir -p "$CACHE"
    local dl log deb dep
    dl=$(mktemp -d "$CACHE/.fetch.XXXXXX")
    log=$dl/apt.log
    # apt-get download works unprivileged; package lists may need a refresh (root only).
    download() {
        (cd "$dl" && apt-get download "$1") >>"$log" 2>&1 && return 0
        [[ $(id -u) == 0 && $NO_INSTALL != 1 ]] || return 1
        apt-get update >>"$log" 2>&1 && (cd "$dl" && apt-get download "$1") >>"$log" 2>&1
    }
    say "fetching kernel package $KERNEL_PKG into $CACHE ..."
    download "$KERNEL_PKG" || { tail -n 5 "$log" >&2; rm -rf "$dl"; skip "could not download $KERNEL_PKG"; }
    deb=$(find "$dl" -maxdepth 1 -name '*.deb' | head -n 1)
    dpkg-deb -x "$deb" "$dl/root"
    # The default name is a meta-package; follow its dependency to the real image.
    if ! compgen -G "$dl/root/boot/vmlinuz-*" >/dev/null; then
        dep=$(dpkg-deb -f "$deb" Depends | tr ',|' '\n' | grep -o 'linux-image-[^ ]*' | head -n 1) ||
            { rm -rf "$dl"; die "$KERNEL_PKG contains no kernel and depends on no linux-image"; }
        say "  $KERNEL_PKG -> $dep"
        download "$dep" || { tail -n 5 "$log" >&2; rm -rf "$dl"; skip "could not download $dep"; }
        deb=$(find "$dl" -maxdepth 1 -name "${dep}_*.deb" | head -n 1)
        dpkg-deb -x "$deb" "$dl/root"
    fi
    local kver
    kver=$(basename "$(compgen -G "$dl/root/boot/vmlinuz-*" | head -n 1)")
    kver=${kver#vmlinuz-}
    [[ -n $kver ]] || { rm -rf "$dl"; die "no vmlinuz found in the downloaded package"; }
    mkdir "$dl/k"
    mv "$dl/root/boot/vmlinuz-$kver" "$dl/k/vmlinuz"
    mv "$dl/root/boot/config-$kver" "$dl/k/config"
    mv "$dl/root/lib/modules/$kver" "$dl/k/modules"
    printf '%s\n' "$kver" >"$dl/k/VERSION"
    # Publish atomically so an interrupted fetch never looks like a valid cache.
    if ! mv -T "$dl/k" "$KDIR" 2>/dev/null; then
        [[ -f $KDIR/vmlinuz ]] || { rm -rf "$dl"; die "could not populate $KDIR"; }
    fi
    rm -rf "$dl"
}
[[ -f $KDIR/vmlinuz && -f $KDIR/VERSION ]] || fetch_kernel

# ---- work dir -----------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dmaload-vm.XXXXXX")
QPID=
# shellcheck disable=SC2317  # invoked via trap
cleanup() {
    set +e
    if [[ -n $QPID ]]; then kill "$QPID" 2>/dev/null; fi
    if [[ $KEEP == 1 ]]; then say "kept work dir $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM

ROOT=$WORK/initramfs
mkdir -p "$ROOT"/{bin,dev,proc,sys,tmp,mnt/disk,test,lib/modules}
cp "$BUSYBOX" "$ROOT/bin/busybox"
ln -s busybox "$ROOT/bin/sh"

BIN_NAME=$(basename "$BINARY")
cp "$BINARY" "$ROOT/test/$BIN_NAME"
# Static binaries are the norm, but ordinary `cargo test` binaries are dynamic:
# carry the host's loader and libraries so they run unchanged in the guest.
if ! is_static "$BINARY"; then
    say "note: $BIN_NAME is dynamically linked; copying its libraries from the host"
    while read -r lib; do
        mkdir -p "$ROOT$(dirname "$lib")"
        cp -L "$lib" "$ROOT$lib"
    done < <(ldd "$BINARY" | grep -o '/[^ ]*' | sort -u)
fi

# Modules: resolve dependencies from each module's own modinfo (the Debian package
# ships no modules.dep) and decompress on the host, so busybox insmod suffices.
mod_file() {
    local pat=${1//[-_]/[-_]}
    find "$KDIR/modules" -name "$pat.ko*" -print -quit
}
mod_cat() {
    case $1 in
        *.xz) xz -dc "$1" ;;
        *.zst) zstd -dc "$1" ;;
        *.gz) gzip -dc "$1" ;;
        *) cat "$1" ;;
    esac
}
declare -A MOD_SEEN=()
MOD_ORDER=()
add_module() {
    local name=${1//-/_} f deps d
    [[ -n ${MOD_SEEN[$name]:-} ]] && return 0
    MOD_SEEN[$name]=1
    # Built into this kernel: nothing to load.
    grep -q "/${1//[-_]/[-_]}\.ko\$" "$KDIR/modules/modules.builtin" 2>/dev/null && return 0
    f=$(mod_file "$name")
    [[ -n $f ]] || { say "warning: module $name not found in $KDIR/modules"; return 0; }
    mod_cat "$f" >"$ROOT/lib/modules/$name.ko"
    deps=$(tr '\0' '\n' <"$ROOT/lib/modules/$name.ko" | sed -n 's/^depends=//p' | head -n 1)
    for d in ${deps//,/ }; do add_module "$d"; done
    MOD_ORDER+=("$name")
}
[[ $NET == 1 ]] && MODULES+=" virtio_net"
for m in $MODULES; do add_module "$m"; done

# ---- guest /init ------------------------------------------------------------
# Arguments travel inside the initramfs, single-quoted, so any bytes survive
# (the kernel command line would mangle spaces and quotes).
squote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }
ARGS_Q=""
for a in "$@"; do ARGS_Q+=" $(squote "$a")"; done
ENV_Q=""
for e in $GUEST_ENV; do
    [[ $e == *=* ]] || die "DMALOAD_VM_ENV entries must be NAME=VALUE, got '$e'"
    ENV_Q+=" $(squote "$e")"
done
REQUIRE_Q=""
for p in $REQUIRE; do REQUIRE_Q+=" $(squote "$p")"; done
# A per-run nonce keeps a binary that happens to print marker-like text (or a
# stale log) from being mistaken for the harness's verdict.
NONCE=$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')

cat >"$ROOT/init" <<EOF
#!/bin/sh
# Generated by tests/vm/run.sh; PID 1 of the test guest.
export PATH=/bin HOME=/tmp
/bin/busybox --install -s /bin
mount -t devtmpfs devtmpfs /dev
# The initramfs has no /dev/console node, so the kernel gave us no stdio.
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /tmp
echo "DMALOAD-VM-BOOTED run=$NONCE"

for m in ${MOD_ORDER[*]}; do insmod /lib/modules/\$m.ko || echo "dmaload-vm: insmod \$m failed"; done
if [ "$NET" = 1 ]; then
    ip link set lo up
    ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip route add default via 10.0.2.2 ||
        echo "dmaload-vm: the network did not come up"
fi
workdir=/tmp
if [ -e /sys/block/vda ] || { sleep 1; [ -e /sys/block/vda ]; }; then
    if mount -t ext4 /dev/vda /mnt/disk; then workdir=/mnt/disk; fi
fi

echo "== dmaload-vm diagnostics =="
echo "kernel:  \$(uname -r)"
echo "cmdline: \$(cat /proc/cmdline)"
echo "cpus:    \$(nproc)  \$(grep MemTotal /proc/meminfo)"
ls -l /dev/dma_heap /dev/udmabuf 2>&1
for p in size_limit_mb list_limit; do
    [ -r /sys/module/udmabuf/parameters/\$p ] && echo "udmabuf.\$p=\$(cat /sys/module/udmabuf/parameters/\$p)"
done
echo "workdir: \$workdir (\$(grep " \$workdir " /proc/mounts || echo tmpfs))"
echo "== end diagnostics =="

missing=
set --$REQUIRE_Q
for p in "\$@"; do
    [ -e "\$p" ] || { echo "DMALOAD-VM-MISSING: \$p run=$NONCE"; missing=1; }
done
if [ -n "\$missing" ]; then
    echo "DMALOAD-VM-RESULT: MISSING run=$NONCE"
    poweroff -f
    echo b >/proc/sysrq-trigger
    sleep 1000000
fi

cd "\$workdir"
# Boot ran 'quiet'; from here on show kernel warnings live, since a WARN or
# splat from dma-buf/udmabuf is exactly what a failing test needs to reveal.
echo 5 >/proc/sys/kernel/printk
echo "DMALOAD-VM-START run=$NONCE"
env$ENV_Q /test/$(squote "$BIN_NAME")$ARGS_Q </dev/null
rc=\$?
if [ \$rc -eq 0 ]; then
    echo "DMALOAD-VM-RESULT: PASS run=$NONCE"
else
    echo "DMALOAD-VM-RESULT: FAIL rc=\$rc run=$NONCE"
fi
cd /
sync
umount /mnt/disk 2>/dev/null
poweroff -f
# Only reached if ACPI poweroff failed; -no-reboot turns this into a QEMU exit.
echo b >/proc/sysrq-trigger
sleep 1000000
EOF
chmod +x "$ROOT/init"

# Uncompressed: decompressing a large test binary under TCG costs more than
# QEMU copying a few extra megabytes.
(cd "$ROOT" && find . -print0 | cpio --null -o -H newc -R 0:0 --quiet) >"$WORK/initramfs.cpio"

# ---- disk ---------------------------------------------------------------------
# A real block device (not tmpfs) so O_DIRECT and the block layer are exercised.
DRIVE=()
if [[ $DISK_SIZE != 0 ]]; then
    command -v mkfs.ext4 >/dev/null || apt_install e2fsprogs || true
    if command -v mkfs.ext4 >/dev/null; then
        truncate -s "$DISK_SIZE" "$WORK/disk.img"
        # Initialise inode tables now: lazy init would run in the guest at TCG speed.
        mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$WORK/disk.img"
        DRIVE=(-drive "file=$WORK/disk.img,if=virtio,format=raw")
    else
        say "note: mkfs.ext4 unavailable; the guest will run in tmpfs /tmp (no O_DIRECT-capable disk)"
    fi
fi

# ---- boot ---------------------------------------------------------------------
NIC=(-nic none)
[[ $NET == 1 ]] && NIC=(-nic user,model=virtio-net-pci)
LOG=$WORK/serial.log
say "booting $(cat "$KDIR/VERSION") ($ACCEL, ${SMP} cpu, $MEM, timeout ${TIMEOUT}s): $BIN_NAME${ARGS_Q}"
start=$(date +%s)
: >"$LOG"  # exists before tail opens it
# panic=-1 + -no-reboot: any guest panic ends QEMU at once instead of hanging.
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 \
    -accel "$ACCEL" -cpu max -smp "$SMP" -m "$MEM" \
    -nodefaults -nographic -serial stdio -no-reboot "${NIC[@]}" \
    -kernel "$KDIR/vmlinuz" -initrd "$WORK/initramfs.cpio" \
    -append "console=ttyS0 panic=-1 oops=panic quiet rdinit=/init $KERNEL_ARGS" \
    "${DRIVE[@]}" </dev/null >"$LOG" 2>&1 &
QPID=$!
# Stream the console live (long TCG runs would otherwise look hung).
# Strip CRs and the firmware's terminal-control sequences so CI logs stay readable.
# Backgrounded because bash defers signal traps until a foreground job ends,
# while `wait` returns to run them at once (so Ctrl-C stops QEMU promptly).
tail -n +1 -f --pid="$QPID" "$LOG" | sed -u -e 's/\r$//' -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\x1bc//g' &
TPID=$!
qrc=0
wait "$QPID" || qrc=$?
QPID=
wait "$TPID" || true
elapsed=$(($(date +%s) - start))

[[ -n $SAVE_LOG ]] && cp "$LOG" "$SAVE_LOG"

# ---- verdict ------------------------------------------------------------------
clean=$(tr -d '\r' <"$LOG")
verdict=$(grep -o "DMALOAD-VM-RESULT: [A-Z]*\( rc=[0-9]*\)\{0,1\} run=$NONCE" <<<"$clean" | tail -n 1 || true)
case $verdict in
    *PASS*)
        say "PASS (${elapsed}s)"
        exit 0 ;;
    *MISSING*)
        missing=$(grep -o "^DMALOAD-VM-MISSING: .* run=$NONCE\$" <<<"$clean" | sed "s/^DMALOAD-VM-MISSING: //; s/ run=$NONCE\$//" | tr '\n' ' ')
        say "FAIL: the guest kernel lacks ${missing% } (required by DMALOAD_VM_REQUIRE; $BIN_NAME not run) (${elapsed}s)"
        exit 1 ;;
    *FAIL*)
        rc=${verdict#*rc=}
        say "FAIL: $BIN_NAME exited with status ${rc%% *} in the guest (${elapsed}s)"
        exit 1 ;;
esac
if [[ $qrc == 124 || $qrc == 137 ]]; then
    if grep -q "DMALOAD-VM-START run=$NONCE" <<<"$clean"; then
        say "FAIL: timeout after ${TIMEOUT}s: $BIN_NAME did not finish (raise DMALOAD_VM_TIMEOUT if it is just slow)"
    elif grep -q "DMALOAD-VM-BOOTED run=$NONCE" <<<"$clean"; then
        say "FAIL: timeout after ${TIMEOUT}s: guest /init stalled before starting $BIN_NAME"
    else
        say "FAIL: timeout after ${TIMEOUT}s: guest never reached /init (kernel boot problem)"
    fi
    exit 4
fi
if grep -q 'Kernel panic' <<<"$clean"; then
    # A panic before /init ran is the emulated boot's, not the test's (TCG
    # has oopsed on an int3 while patching kernel text at boot): nothing of
    # ours had started, so boot again, at most twice.
    try=${DMALOAD_VM_BOOT_TRY:-1}
    if ! grep -q "DMALOAD-VM-BOOTED run=$NONCE" <<<"$clean" && ((try < 3)); then
        say "the guest kernel panicked before /init ran ($(grep -m1 'Kernel panic' <<<"$clean")): booting again"
        cleanup
        trap - EXIT
        DMALOAD_VM_BOOT_TRY=$((try + 1)) exec "$0" "${ORIGINAL_ARGS[@]}"
    fi
    say "FAIL: guest kernel panicked: $(grep -m1 'Kernel panic' <<<"$clean")"
else
    say "FAIL: QEMU exited (status $qrc) without a result marker"
fi
exit 3
