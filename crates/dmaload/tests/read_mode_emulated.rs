//! The read-mode choice of an `auto` load on an emulated disk: a FUSE
//! filesystem (`tests/support/rated_fuse.py`) that serves O_DIRECT reads
//! at one rate and buffered reads at another (each READ request carries
//! the file's flags), so each mode can be made the faster: the load keeps
//! whichever is, in place and through the staging ring of a load to
//! `cuda:0` (on the CUDA emulator). The tests point `DMALOAD_CACHE_DIR` at a
//! scratch directory, one at a time.

mod common;

use std::path::Path;
use std::sync::Mutex;

use common::fuse::{self, FuseMount};
use common::{scratch_dir, skip};
use dmaload::{CachePolicy, Destination, LoadOptions, LoadReport, LoadRequest, Loaded};

/// Held by each test: one `DMALOAD_CACHE_DIR` at a time.
static CACHE_HOME: Mutex<()> = Mutex::new(());

/// The byte the rated filesystem serves at `offset`.
fn rated_byte(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// Mounts a file `data` of `size` bytes ([`rated_byte`]) at `dir/name`, read direct
/// at `direct` and buffered at `buffered` megabytes per second.
fn mount_rated(dir: &Path, name: &str, size: u64, direct: f64, buffered: f64) -> Result<FuseMount, String> {
    fuse::mount(dir, name, "rated_fuse.py", &[size.to_string(), direct.to_string(), buffered.to_string()])
}

#[test]
fn on_an_emulated_disk_an_auto_load_keeps_the_read_mode_that_is_faster() {
    let test = "on_an_emulated_disk_an_auto_load_keeps_the_read_mode_that_is_faster";
    let _one = CACHE_HOME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let dir = scratch_dir();
    let cache = dir.path().join("cache");
    std::env::set_var("DMALOAD_CACHE_DIR", &cache);
    // Chunks of 1 MiB: 32 MiB in flight before each of the trial's four
    // windows of 128 MiB; past the warm-up, the windows and the drains.
    let size = 900u64 << 20;
    let options = LoadOptions { chunk_size: 1 << 20, ..LoadOptions::default() };
    // (direct, buffered) megabytes per second, and the mode to keep.
    for (name, direct, buffered) in [("direct-faster", 150.0, 50.0), ("buffered-faster", 50.0, 150.0)] {
        let mount = match mount_rated(dir.path(), name, size, direct, buffered) {
            Ok(mount) => mount,
            Err(reason) => return skip(test, &reason),
        };
        // Measured afresh on each mount (a device number may come again).
        let _ = std::fs::remove_file(cache.join("tuning"));
        let (buffer, report) = dmaload::load(mount.mountpoint.join("data"), &options).unwrap();
        assert_eq!(buffer.len() as u64, size);
        assert!(
            buffer.iter().enumerate().all(|(i, &b)| b == rated_byte(i as u64)),
            "{name}: bytes not loaded"
        );
        if report.alignment == 1 {
            return skip(test, &format!("no direct I/O on FUSE here: {:?}", report.fallbacks));
        }
        assert_kept_faster(name, &report, direct > buffered, &cache);
    }
}

/// Checks that `report`'s load measured both read modes and kept direct
/// reads when `direct_faster`, else buffered, and remembered that mode.
fn assert_kept_faster(name: &str, report: &LoadReport, direct_faster: bool, cache: &Path) {
    eprintln!("{name}: {:?}, {}", report.cache, report.read_choice);
    assert!(report.read_choice.starts_with("measured: direct "), "{name}: {report:#?}");
    let kept_direct = report.cache == CachePolicy::Bypass;
    assert_eq!(kept_direct, direct_faster, "{name}: {report:#?}");
    let tuning = std::fs::read_to_string(cache.join("tuning")).unwrap();
    let kept = if kept_direct { " read=direct " } else { " read=buffered " };
    assert!(tuning.contains(kept), "{name}: {tuning}");
}

/// The tuning file's key of the device `path` is on (`MAJOR:MINOR`, as
/// glibc's `major()` and `minor()` split `st_dev`).
fn device_key(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).unwrap().dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    format!("{major}:{minor}")
}

#[test]
fn on_an_emulated_disk_a_load_to_cuda_keeps_the_read_mode_that_is_faster() {
    // A load to cuda:0 reads through a staging ring of 16 MiB slots, as
    // many as the reads in flight fill and two more (10 for the default
    // 32 requests of 4 MiB): a file of 1 GiB, as users load, is long
    // enough to choose the read mode, not to try a depth or request size.
    let test = "on_an_emulated_disk_a_load_to_cuda_keeps_the_read_mode_that_is_faster";
    let _one = CACHE_HOME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Err(reason) = common::cuda_driver() {
        return skip(test, &reason);
    }
    let dir = scratch_dir();
    let cache = dir.path().join("cache");
    std::env::set_var("DMALOAD_CACHE_DIR", &cache);
    let size = 1u64 << 30;
    let options = LoadOptions { to: Destination::Cuda(0), ..LoadOptions::default() };
    for (name, direct, buffered) in [("direct-faster", 150.0, 50.0), ("buffered-faster", 50.0, 150.0)] {
        let mount = match mount_rated(dir.path(), name, size, direct, buffered) {
            Ok(mount) => mount,
            Err(reason) => return skip(test, &reason),
        };
        let path = mount.mountpoint.join("data");
        // Measured afresh on each mount; on the second, a host load's
        // 4 MiB requests remembered for the device, which the ring's
        // reads do not take (a slot each, whole).
        let before = match name {
            "direct-faster" => String::new(),
            _ => format!("{} request=4194304\n", device_key(&path)),
        };
        std::fs::create_dir_all(&cache).unwrap();
        std::fs::write(cache.join("tuning"), &before).unwrap();
        let (loaded, report) = LoadRequest::path(&path).options(&options).load().unwrap();
        let Loaded::Device(device) = loaded else { panic!("{name}: not loaded to the device") };
        assert_eq!(device.len, size);
        let mut at = 0u64;
        device
            .read_each(|bytes| {
                let wrong = bytes.iter().enumerate().position(|(i, &b)| b != rated_byte(at + i as u64));
                assert!(wrong.is_none(), "{name}: byte {} differs", at + wrong.unwrap() as u64);
                at += bytes.len() as u64;
            })
            .unwrap();
        assert_eq!(at, size);
        if report.alignment == 1 {
            return skip(test, &format!("no direct I/O on FUSE here: {:?}", report.fallbacks));
        }
        assert_kept_faster(name, &report, direct > buffered, &cache);
        assert_eq!(report.request_size, 16 << 20, "{name}: {report:#?}");
        // Only the read mode was measured: the depth and request size the
        // load started from are not written as if they were.
        let tuning = std::fs::read_to_string(cache.join("tuning")).unwrap();
        assert!(!tuning.contains("queue_depth="), "{name}: {tuning}");
        assert_eq!(tuning.contains(" request=4194304 "), !before.is_empty(), "{name}: {tuning}");
    }
}
