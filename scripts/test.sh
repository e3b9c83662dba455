#!/usr/bin/env bash
# The whole test suite: formatting, lints, doc links, then every test in
# release mode (the large-file tests are slow unoptimised). Tests that need
# something this kernel or machine lacks print "SKIP <test>: <reason>".
set -euo pipefail
cd "$(dirname "$0")/.."

# What loads remember between runs (tuned depths, the read mode kept per
# device, the memory probe, the demo's sample) goes to a scratch directory:
# the suite neither starts from what the user's own loads remembered (a
# device remembered as faster buffered would change what tests see) nor
# rewrites it.
DMALOAD_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/dmaload-test-cache.XXXXXX")"
export DMALOAD_CACHE_DIR
trap 'rm -rf "$DMALOAD_CACHE_DIR"' EXIT

cargo fmt --all --check
cargo clippy --workspace --all-targets --release -- -D warnings
# Broken or private intra-doc links; --release reuses the dependencies
# clippy just checked (the dev profile would check them all again).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --release --quiet
cargo test --workspace --release -- --nocapture

# The Python package: builds it into its own venv (installing its test
# dependencies from PyPI), then stubtest, mypy and pytest.
bash bindings/python/ci.sh

# The GPU machine's kit, dry-run on the CUDA driver emulator: it builds
# from this clone and its one-call device run completes, so it is ready
# whenever a GPU is lent.
bash bench/gpu-kit.sh dry-run

# Serving engines: vLLM's CPU build (its own venv, from PyPI) serving a
# tiny Llama with --load-format dmaload.
bash tests/engines/ci.sh

# dma-heap and udmabuf, which this kernel lacks: static test binaries booted
# in a QEMU guest on a kernel that has both (prints "SKIP vm: ..." and
# passes where QEMU cannot run).
bash tests/vm/ci.sh
