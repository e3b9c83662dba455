//! An `auto` load chooses between direct and buffered reads by measuring
//! both, window by window, on the one open file (`crates/dmaload/src/tune/mod.rs`):
//! the bytes are exact while `O_DIRECT` flips between windows, and the
//! mode kept is remembered for the device beside the depth. The only test
//! of this binary: it points `DMALOAD_CACHE_DIR` at a scratch directory.

mod common;

use std::os::unix::fs::MetadataExt;

use common::{assert_pattern, scratch_dir, write_pattern_file};
use dmaload::{CachePolicy, LoadOptions};

const PAGE: usize = 4096;

#[test]
fn an_auto_load_flipping_between_direct_and_buffered_windows_is_exact_and_remembers_the_mode() {
    let dir = scratch_dir();
    let cache = dir.path().join("cache");
    std::env::set_var("DMALOAD_CACHE_DIR", &cache);
    let path = dir.path().join("weights");
    // Past the warm-up, the trial's four windows of 128 MiB and the reads
    // in flight before each (not measured: while the mode is chosen, 8
    // requests of 4 MiB), and not a whole
    // number of blocks: the last read ends past the end of the file.
    let size = (1280usize << 20) + 4097;
    write_pattern_file(&path, size as u64);
    let dev = std::fs::metadata(&path).unwrap().dev();
    let key = format!("{}:{} ", libc::major(dev), libc::minor(dev));
    // Memory the caller has already touched: the reads never wait for it,
    // so nothing ends the measuring early.
    let mut storage = vec![1u8; size + PAGE];
    let start = (storage.as_ptr() as usize).next_multiple_of(PAGE) - storage.as_ptr() as usize;
    let dst = &mut storage[start..start + size];
    let load = |dst: &mut [u8]| {
        dmaload::pagecache::evict(&path).unwrap();
        dst.fill(0);
        let report = dmaload::LoadRequest::path(&path).options(&LoadOptions::default()).fill(dst).unwrap();
        assert_pattern(dst, 0);
        report
    };

    let report = load(dst);
    eprintln!("read mode {:?}: {}", report.cache, report.read_choice);
    assert!(report.read_choice.starts_with("measured: direct "), "{report:#?}");
    assert!(report.tuning_windows >= 5, "{report:#?}");
    let kept = match report.cache {
        CachePolicy::Bypass => "direct",
        CachePolicy::DontCache | CachePolicy::Fadvise => "buffered",
        CachePolicy::Keep => panic!("an auto load's buffered reads leave no residue: {report:#?}"),
    };
    let tuning = std::fs::read_to_string(cache.join("tuning")).unwrap();
    let line = tuning.lines().find(|line| line.starts_with(&key)).unwrap_or_else(|| panic!("{tuning}"));
    assert!(line.contains(&format!(" read={kept} read_rate=")), "{line}");

    // The next load reads in the remembered mode from its first window and
    // measures again only where it reads clearly slower than remembered.
    let again = load(dst);
    eprintln!("again {:?}: {}", again.cache, again.read_choice);
    if again.read_choice == "remembered" {
        assert_eq!(again.cache, report.cache, "{again:#?}");
    } else {
        assert!(again.read_choice.starts_with("re-measured, a window read "), "{again:#?}");
    }
}
