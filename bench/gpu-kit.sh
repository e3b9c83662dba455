#!/usr/bin/env bash
# Everything a GPU machine without internet needs to check dmaload's CUDA
# path, built here, then run there in one call.
#
#   bench/gpu-kit.sh build        here (network): builds into .dev/gpu-kit/
#   bench/gpu-kit.sh check        there: the CUDA tests, the CLI's device load
#   bench/gpu-kit.sh bench [ARGS] there: bench/gpu.py ARGS (default: 8 GiB,
#                                 2 rounds, cold and warm)
#   bench/gpu-kit.sh host [SIZE]  there: the host-memory figures a bigger
#                                 machine gives (dmaload-bench load, and
#                                 populating threads 1 to 16) on a SIZE file
#                                 (default 8G)
#   bench/gpu-kit.sh cache [SIZE] there: what each memory kind costs to
#                                 populate (info --probe-memory) and the
#                                 cache service against safetensors
#                                 (bench cache, SIZE model, default 4G)
#   bench/gpu-kit.sh engines      there: collective loads (gloo tests, an
#                                 NCCL group on the GPU) and, where vLLM or
#                                 SGLang is installed, each serving a tiny
#                                 Llama with dmaload (tests/engines; SGLang's
#                                 PyPI build needs CUDA, so its check is here),
#                                 and bench/serving.py's restarts with vLLM's
#                                 own ipc_cache row
#   bench/gpu-kit.sh next         there: the device run in one call, at
#                                 most 8 minutes with every part (children
#                                 included) under `timeout` and a shared
#                                 deadline: the CUDA tests, the core rows
#                                 without torch (bench/gpu_core.py at 4 GiB,
#                                 cold and warm: dmaload's CLI, raw direct
#                                 and buffered reads, pinned H2D through the
#                                 driver), then, where torch sees a GPU,
#                                 bench/gpu.py's peer rows (fastsafetensors
#                                 nogds, dmaload's Python loader) and
#                                 gpu_register.py under a 60 s budget
#   bench/gpu-kit.sh dry-run      here, no GPU: build, then `next` on the
#                                 CUDA driver emulator (tests/cuda-emu) with
#                                 a 128 MiB file; the suite runs it so the
#                                 kit cannot rot between GPU leases
#   bench/gpu-kit.sh register [SIZE]
#                                 there: copies straight from registered
#                                 page-cache and memfd pages to the GPU
#                                 (bench/gpu_register.py, SIZE file,
#                                 default 8G), against pinned H2D
#   bench/gpu-kit.sh verify [SIZE] there: verified cold loads against
#                                 unverified ones, SHA-256 and BLAKE3
#                                 (bench/verify.py, SIZE random file,
#                                 default 4G, 2 rounds; about 2 minutes)
#
# build: the CLI and the CUDA test programs (release, stripped), the Python
# wheel (maturin from the package's venv, else from a build venv of the
# kit's own, so a fresh clone builds it), and the peer loaders' wheels with
# the test tools (pip download for CPython 3.12 manylinux, no dependencies:
# the GPU machine has torch and numpy, where it has them at all). .dev/ is
# ignored by git, so the device tool carries the kit only when asked:
# carry [".dev/gpu-kit"] (build fails a kit over the tool's 64 MiB).
#
# check and bench install the wheels into /tmp/gpu-kit-site and write what
# they print, and bench/gpu.py's JSON, under $OUT when it is set (the device
# tool returns that folder). check exits non-zero when any part fails; a
# machine without a CUDA device fails it (the tests would only skip).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
kit=$root/.dev/gpu-kit
out=${OUT:-$kit/out}
site=/tmp/gpu-kit-site
# The peers bench/gpu.py runs, and what pytest needs.
wheels=(safetensors fastsafetensors runai-model-streamer pytest pluggy iniconfig packaging)

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//p}' "$0" >&2; exit 2; }

# maturin: the package's test venv's (bindings/python/ci.sh), else one
# installed from PyPI into a build venv beside the kit.
maturin_path() {
    local venv=$root/bindings/python/.venv build_venv=$root/.dev/gpu-kit-build-venv
    if [[ -x $venv/bin/maturin ]]; then
        echo "$venv/bin/maturin"
        return
    fi
    if [[ ! -x $build_venv/bin/maturin ]]; then
        python3 -m venv "$build_venv" >&2
        "$build_venv/bin/python" -m pip install --quiet --disable-pip-version-check "maturin>=1.9,<2" >&2
    fi
    echo "$build_venv/bin/maturin"
}

build() {
    rm -rf "$kit" && mkdir -p "$kit/wheels"
    cd "$root"
    # The command and the benchmarks' (dmaload-bench), one build, side by side.
    cargo build --release -p dmaload-cli -p dmaload-bench
    strip -o "$kit/dmaload" target/release/dmaload
    strip -o "$kit/dmaload-bench" target/release/dmaload-bench
    # The test programs' paths, from cargo's build messages.
    cargo test --release -p dmaload --test cuda --test cuda_sink --no-run --message-format=json |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do strip -o "$kit/$name" "$exe"; done
    (cd bindings/python && "$(maturin_path)" build --release --quiet --out "$kit/wheels")
    python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$kit/wheels" "${wheels[@]}"
    ls "$kit" "$kit/wheels"
    local mib
    mib=$(du -sm "$kit" | cut -f1)
    echo "kit: $mib MiB (the device tool carries at most 64)"
    ((mib <= 64)) || { echo "the kit is over 64 MiB: the device tool would not carry it" >&2; exit 1; }
}

install() {
    [[ -d $kit/wheels ]] || { echo "no kit at $kit: run 'bench/gpu-kit.sh build' where there is network, and carry .dev/gpu-kit" >&2; exit 2; }
    mkdir -p "$out"
    # One at a time: a peer built for another Python is left out (bench/gpu.py
    # lists it as missing), not the whole kit.
    local wheel
    for wheel in "$kit"/wheels/*.whl; do
        python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$wheel" 2>/dev/null || echo "not installed (not for this Python): ${wheel##*/}" >&2
    done
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} DMALOAD_CLI=$kit/dmaload
}

# Runs one part, its output to the terminal and to $out/NAME.log; records a failure.
failed=()
part() {
    local name=$1
    shift
    echo "== $name: $*"
    if ! "$@" 2>&1 | tee "$out/$name.log"; then failed+=("$name"); fi
}

device_load() {
    # The same file loaded into the device and into host memory: the hashes must match.
    local file=$out/device-load.bin
    head -c $((1 << 30)) /dev/urandom > "$file"
    "$kit/dmaload" evict "$file"
    local device host
    device=$("$kit/dmaload" load "$file" --to cuda:0 --hash | tee /dev/stderr | grep -o 'xxh3-64 *[0-9a-f]*')
    host=$("$kit/dmaload" load "$file" --hash | tee /dev/stderr | grep -o 'xxh3-64 *[0-9a-f]*')
    rm -f "$file"
    [[ -n $device && $device == "$host" ]] || { echo "device $device, host $host: they differ" >&2; return 1; }
}

check() {
    install
    part info "$kit/dmaload" info
    python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device")' ||
        { echo "no CUDA device here: the tests would only skip" >&2; exit 1; }
    part cuda-tests "$kit/cuda" --test-threads 1
    part cuda-sink-tests "$kit/cuda_sink" --test-threads 1
    part python-device-tests python3 -m pytest -q -p no:cacheprovider "$root/bindings/python/tests/test_device.py"
    part device-load device_load
    if ((${#failed[@]})); then
        echo "failed: ${failed[*]}" >&2
        exit 1
    fi
    echo "check: every part passed (logs in $out)"
}

bench() {
    install
    local args=("$@")
    ((${#args[@]})) || args=(--size 8G --rounds 2 --cache cold,warm)
    python3 "$root/bench/gpu.py" "${args[@]}" --json "$out/gpu.json" | tee "$out/gpu.md"
}

host() {
    install
    local size=${1:-8G} dir=$root/.dev/host-bench file threads
    rm -rf "$dir" && mkdir -p "$dir"
    # A generated LLM-shaped file, and the ceiling where fio is not
    # installed: 16 threads of O_DIRECT reads into reused buffers.
    python3 "$root/bench/gpu.py" --size "$size" --dir "$dir" --keep --loaders raw --cache cold --rounds 3 |
        tee "$out/raw-ceiling.md"
    file=$(find "$dir" -name '*.safetensors' | head -n 1)
    "$kit/dmaload" info "$file" | tee "$out/host-info.txt"
    "$kit/dmaload-bench" load "$file" --repeat 3 | tee "$out/bench-load.md"
    # Cold loads into 4 KiB memfd pages, the kind that needs the threads most.
    for round in 1 2 3; do
        for threads in 1 2 4 8 12 16; do
            "$kit/dmaload" evict "$file"
            echo "round $round threads $threads $("$kit/dmaload" load "$file" --to memfd --populate-threads "$threads" --json)"
        done
    done | tee "$out/populate-threads.txt"
    rm -rf "$dir"
}

cache() {
    install
    local size=${1:-4G}
    # Recorded figures make auto choose by them on this machine, as a user's would.
    "$kit/dmaload" info --probe-memory | tee "$out/probe-memory.txt"
    "$kit/dmaload-bench" cache --size "$size" --repeat 3 --python python3 | tee "$out/bench-cache.md"
}

engines() {
    install
    part collective-gloo python3 -m pytest -q -p no:cacheprovider "$root/bindings/python/tests/test_collective.py"
    part collective-cuda python3 "$root/tests/engines/cuda_check.py"
    local engine
    for engine in vllm sglang; do
        if python3 -c "import $engine" 2>/dev/null; then
            part "$engine-serve" python3 "$root/tests/engines/serve_check.py" "$engine"
        else
            echo "SKIP $engine-serve: $engine is not installed on this machine"
        fi
    done
    # Restarts against vLLM's own: the default loader, dmaload, and
    # ipc_cache through a `vllm preload` daemon (reported as not measured,
    # with the daemon's error, where this vLLM has none).
    if python3 -c "import vllm, torch; assert torch.cuda.is_available()" 2>/dev/null; then
        part vllm-serving timeout -k 10 1800 python3 "$root/bench/serving.py" --rounds 2 --ranks 1 \
            --states cold,warm --formats dmaload,safetensors,ipc_cache --memory 0.5 --timeout 600
    else
        echo "SKIP vllm-serving: no vLLM with a CUDA device here"
    fi
    if ((${#failed[@]})); then
        echo "failed: ${failed[*]}" >&2
        exit 1
    fi
}

register() {
    install
    mkdir -p "$root/.dev"
    python3 "$root/bench/gpu_register.py" --size "${1:-8G}" --dir "$root/.dev" | tee "$out/register.md"
}

verify() {
    local size=${1:-4G} dir=$root/.dev/verify
    rm -rf "$dir" && mkdir -p "$dir"
    head -c "$size" /dev/urandom >"$dir/model.bin"
    nproc | sed 's/^/CPUs: /' | tee "$out/verify.md"
    python3 "$root/bench/verify.py" "$dir/model.bin" --rounds 2 --cli "$kit/dmaload" --bench "$kit/dmaload-bench" |
        tee -a "$out/verify.md"
    rm -rf "$dir"
}

# One part under the run's shared deadline: at most its own budget, and
# never past what is left of NEXT_SECONDS (default 480: 8 minutes).
bounded() {
    local name=$1 budget=$2 left
    shift 2
    left=$((deadline - SECONDS))
    if ((left < 10)); then
        echo "== $name: skipped, the run's deadline is near" | tee "$out/$name.log"
        failed+=("$name")
        return
    fi
    part "$name" timeout -k 5 $((budget < left ? budget : left)) "$@"
}

# torch with a CUDA device in this Python (the peer rows need it).
torch_gpu() { python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; }

# The device run: every part bounded, logs in $out; exits non-zero when a
# part failed. KIT_SIZE, KIT_ROUNDS and KIT_H2D set the file size (4G),
# gpu_core.py's rounds (2) and its H2D copy size (1G).
next() {
    install
    local dir=$root/.dev/next size=${KIT_SIZE:-4G} model
    deadline=$((SECONDS + ${NEXT_SECONDS:-480}))
    rm -rf "$dir" && mkdir -p "$dir"
    bounded cuda-tests 60 "$kit/cuda" --test-threads 1
    bounded cuda-sink-tests 45 "$kit/cuda_sink" --test-threads 1
    bounded gpu-core 150 python3 "$root/bench/gpu_core.py" --cli "$kit/dmaload" --size "$size" --dir "$dir" \
        --rounds "${KIT_ROUNDS:-2}" --h2d-size "${KIT_H2D:-1G}" --cache cold,warm --timeout 60 --json "$out/gpu-core.json"
    if torch_gpu; then
        bounded gpu-peers 150 python3 "$root/bench/gpu.py" --size "$size" --dir "$dir" --rounds 1 \
            --cache cold,warm --loaders dmaload,fastsafetensors-nogds,h2d --timeout 60 --json "$out/gpu-peers.json"
        bounded register 60 python3 "$root/bench/gpu_register.py" --size 2G --dir "$root/.dev" \
            --windows 16M,64M --threads 1,8 --rounds 1 --budget 45
    else
        echo "SKIP gpu-peers, register: torch sees no CUDA device here (the core rows above need no torch)"
    fi
    rm -rf "$dir"
    echo "next: $((SECONDS + ${NEXT_SECONDS:-480} - deadline)) s, logs in $out"
    if ((${#failed[@]})); then
        echo "failed: ${failed[*]}" >&2
        exit 1
    fi
}

# The kit on the CUDA driver emulator: what the device run does, on a small
# file, so a change that breaks the kit fails the suite, not a GPU lease.
dry_run() {
    local emu=$root/.dev/gpu-kit-emu
    mkdir -p "$emu"
    bash "$root/tests/cuda-emu/build.sh" "$emu"
    build
    out=$root/.dev/gpu-kit-dry-run
    rm -rf "$out"
    DMALOAD_LIBCUDA=$emu/libcuda.so.1 KIT_SIZE=128M KIT_ROUNDS=1 KIT_H2D=64M NEXT_SECONDS=300 next
}

[[ $# -ge 1 ]] || usage
command=$1
shift
case $command in
    build) build ;;
    check) check ;;
    bench) bench "$@" ;;
    host) host "$@" ;;
    cache) cache "$@" ;;
    engines) engines ;;
    register) register "$@" ;;
    next) next ;;
    dry-run) dry_run ;;
    verify) verify "$@" ;;
    *) usage ;;
esac
