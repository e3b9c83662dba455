//! include/dmaload.h is generated from src/lib.rs by cbindgen and kept in
//! the repository (C users need no Rust tools): this regenerates it and
//! fails when the committed one differs. `DMALOAD_BLESS=1 cargo test -p
//! dmaload-capi --test header` rewrites it.

use std::path::Path;

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(crate_dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let header = crate_dir.join("include/dmaload.h");
    if std::env::var_os("DMALOAD_BLESS").is_some() {
        std::fs::write(&header, &generated).unwrap();
        return;
    }
    let committed = std::fs::read(&header).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is not what cbindgen generates from src/lib.rs: run \
         `DMALOAD_BLESS=1 cargo test -p dmaload-capi --test header` and commit it",
        header.display()
    );
}
