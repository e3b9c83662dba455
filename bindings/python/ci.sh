#!/usr/bin/env bash
# Builds and tests the dmaload Python package on a fresh machine: creates a
# virtual environment, installs the test dependencies from PyPI, builds the
# extension (release, abi3) into it, then runs cargo fmt/clippy/doc on the
# binding crate, mypy.stubtest on the native module's .pyi, mypy --strict on
# the package, pytest, and safetensors' own tests run against dmaload.safetensors.
#
#   bash bindings/python/ci.sh            # from anywhere
#   DMALOAD_VENV=/path/to/venv ...        # reuse/choose the environment
#   DMALOAD_FUZZ_SECONDS=60 ...           # also run the header fuzzer (needs cargo-fuzz)
#   PYTEST_ARGS="-k safetensors" ...      # extra pytest arguments
#
# torch comes from PyPI, whose Linux wheel pulls the CUDA runtime packages
# (about 4.5 GiB installed, 5.5 GiB for the whole environment): there is no
# CPU-only torch on PyPI itself. Everything works without a GPU.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${DMALOAD_VENV:-$here/.venv}"
python="${PYTHON:-python3}"
started=$SECONDS
step() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - started)); }

step "virtual environment $venv"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"
# maturin develop installs into $VIRTUAL_ENV (else a .venv beside pyproject.toml).
export VIRTUAL_ENV="$venv"
export PATH="$venv/bin:$PATH"
"$py" -m pip install --quiet --upgrade pip

step "test dependencies from PyPI"
# fusepy: the silent-server tests' FUSE server (with libfuse2, which
# .ci/run installs), run by this venv's python.
"$py" -m pip install --quiet \
    "maturin>=1.9,<2" pytest mypy numpy safetensors tqdm ml_dtypes torch fusepy

step "build the extension (maturin develop --release)"
(cd "$here" && "$venv/bin/maturin" develop --release --quiet)

step "cargo fmt --check, clippy and doc (binding crate)"
(cd "$here" && cargo fmt --check && cargo clippy --quiet --all-targets -- -D warnings &&
    RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet)

step "mypy.stubtest on dmaload._dmaload"
(cd "$here" && "$py" -m mypy.stubtest dmaload._dmaload --allowlist stubtest-allowlist.txt)

step "mypy --strict on the package"
(cd "$here" && "$py" -m mypy --strict python/dmaload)

if [ -z "${DMALOAD_CLI:-}" ] && [ -x "$root/target/release/dmaload" ]; then
    export DMALOAD_CLI="$root/target/release/dmaload"   # python -m dmaload execs it
fi

step "pytest"
(cd "$here" && "$py" -m pytest -q tests ${PYTEST_ARGS:-})

step "safetensors' own tests against dmaload.safetensors (upstream_safetensors/run.py)"
(cd "$here" && "$py" upstream_safetensors/run.py)

if [ -n "${DMALOAD_FUZZ_SECONDS:-}" ]; then
    step "fuzz safetensors_header for ${DMALOAD_FUZZ_SECONDS}s"
    corpus="$(mktemp -d)"
    cp "$root/fuzz/corpus/safetensors_header/"* "$corpus/"
    (cd "$root/fuzz" && RUSTC_BOOTSTRAP=1 cargo fuzz run safetensors_header "$corpus" -- \
        -max_total_time="$DMALOAD_FUZZ_SECONDS" -rss_limit_mb=1024 -max_len=65536)
    rm -rf "$corpus"
fi

step "done"
