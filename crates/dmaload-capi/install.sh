#!/usr/bin/env bash
# Installs the C library under PREFIX: lib/libdmaload_capi.{so,a},
# include/dmaload.h and lib/pkgconfig/dmaload.pc (from dmaload.pc.in).
#
#   cargo build --release -p dmaload-capi
#   bash crates/dmaload-capi/install.sh /usr/local [BUILD_DIR]
#
# BUILD_DIR holds the built libraries (default: target/release).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=${1:?usage: install.sh PREFIX [BUILD_DIR]}
built=${2:-$here/../../target/release}
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$here/../../Cargo.toml" | head -n 1)
install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 644 "$here/include/dmaload.h" "$prefix/include/dmaload.h"
install -m 755 "$built/libdmaload_capi.so" "$prefix/lib/libdmaload_capi.so"
install -m 644 "$built/libdmaload_capi.a" "$prefix/lib/libdmaload_capi.a"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" "$here/dmaload.pc.in" >"$prefix/lib/pkgconfig/dmaload.pc"
