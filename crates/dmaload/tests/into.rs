//! `load_into`: memory the caller owns, filled in place where it lines up
//! with the file (the edges through a small ring), through a staging ring
//! where it does not; exact bytes either way, for every engine, any
//! offset, any address, and the errors of a load.

mod common;

use common::{assert_pattern, scratch_dir, write_pattern_file};
use dmaload::{Engine, ErrorKind, IoMode, LoadOptions};

const M: usize = 1 << 20;
const PAGE: usize = 4096;

fn write_cold(path: &std::path::Path, size: u64) {
    write_pattern_file(path, size);
    dmaload::pagecache::evict(path).unwrap();
}

fn options(engine: Engine, mode: IoMode) -> LoadOptions {
    LoadOptions { engine, mode, chunk_size: 256 << 10, queue_depth: 4, threads: 3, ..LoadOptions::default() }
}

/// `len` bytes of zeroed memory starting `misalign` bytes past a page
/// boundary, inside a larger vector (kept alive by the caller).
fn memory_at(storage: &mut Vec<u8>, misalign: usize, len: usize) -> &mut [u8] {
    *storage = vec![0u8; len + 2 * PAGE];
    let start = (storage.as_ptr() as usize).next_multiple_of(PAGE) - storage.as_ptr() as usize + misalign;
    &mut storage[start..start + len]
}

#[test]
fn aligned_memory_is_filled_in_place_by_every_engine() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 3 * M + 777;
    write_cold(&path, size as u64);
    for engine in Engine::ALL {
        // (address past a page boundary, file offset, length): address and
        // offset agree modulo the page, so direct I/O can read in place.
        for (misalign, offset, len) in
            [(0, 0, size), (0, PAGE, size - PAGE), (100, 100, size - 100), (0, 8192, 5), (7, 7, 2 * M + 3)]
        {
            let mut storage = Vec::new();
            let dst = memory_at(&mut storage, misalign, len);
            let report = dmaload::LoadRequest::path(&path)
                .range(offset as u64, None)
                .options(&options(engine, IoMode::Auto))
                .fill(dst)
                .unwrap_or_else(|e| panic!("{engine:?} {misalign}/{offset}/{len}: {e}"));
            assert_pattern(dst, offset as u64);
            assert_eq!((report.bytes, report.offset), (len as u64, offset as u64));
            let whole_page = len >= PAGE + (PAGE - misalign) % PAGE;
            assert_eq!(
                report.destination.contains("in place"),
                whole_page,
                "{engine:?} {misalign}/{offset}/{len}: {}",
                report.destination
            );
        }
    }
}

#[test]
fn memory_out_of_line_with_direct_io_goes_through_a_ring_and_buffered_reads_stay_in_place() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, (2 * M + 5) as u64);
    let mut storage = Vec::new();
    let dst = memory_at(&mut storage, 1, 2 * M);
    let report = dmaload::LoadRequest::path(&path)
        .options(&options(Engine::UringFixed, IoMode::Auto))
        .fill(dst)
        .unwrap();
    assert_pattern(dst, 0);
    if report.cache == dmaload::CachePolicy::Bypass {
        assert!(report.destination.starts_with("caller memory (staged through"), "{}", report.destination);
    }
    dst.fill(0);
    let report = dmaload::LoadRequest::path(&path)
        .options(&options(Engine::UringFixed, IoMode::Buffered))
        .fill(dst)
        .unwrap();
    assert_pattern(dst, 0);
    assert_eq!(report.destination, "caller memory (in place)");
}

#[test]
fn a_range_past_the_end_is_refused_and_an_empty_one_is_fine() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, 10_000);
    let mut storage = Vec::new();
    let dst = memory_at(&mut storage, 0, 3 * PAGE);
    let err = dmaload::LoadRequest::path(&path).fill(dst).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Truncated, "{err}");
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    let report = dmaload::LoadRequest::path(&path).range(10_000, None).fill(&mut [][..]).unwrap();
    assert_eq!(report.bytes, 0);
    // A range whose end does not fit in 64 bits: refused, naming the offset.
    let err = dmaload::LoadRequest::path(&path).range(u64::MAX - 8, None).fill(&mut [0u8; 16]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains(&format!("offset {}", u64::MAX - 8)), "{err}");
}

#[test]
fn a_warm_file_is_copied_from_the_page_cache_in_place() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, (4 * M) as u64);
    std::fs::read(&path).unwrap();
    let mut storage = Vec::new();
    let dst = memory_at(&mut storage, 3, 4 * M - 3);
    let report = dmaload::LoadRequest::path(&path)
        .range(3, None)
        .options(&options(Engine::UringFixed, IoMode::Auto))
        .fill(dst)
        .unwrap();
    assert_pattern(dst, 3);
    assert_eq!(report.destination, "caller memory (in place)");
    assert!(report.fallbacks.iter().any(|f| f.to == "page cache"), "{:?}", report.fallbacks);
}

/// `LoadRequest::fill_raw` fills memory another thread reads during the load (as a
/// Python thread may read a numpy array that `load_into` fills with the
/// GIL released): the loader forms no Rust slice over it, and the reader,
/// whose accesses are atomic, only ever sees a byte as it was (zero) or as
/// the file has it, in place and through the staging ring alike.
#[test]
fn memory_others_read_during_the_load_is_filled_through_raw_bytes() {
    use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed};
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 4 * M + 321;
    write_cold(&path, size as u64);
    for misalign in [0, 1] {
        let memory: Vec<AtomicU8> = (0..size + PAGE).map(|_| AtomicU8::new(0)).collect();
        let start = (memory.as_ptr() as usize).next_multiple_of(PAGE) - memory.as_ptr() as usize + misalign;
        let dst = &memory[start..start + size];
        let done = AtomicBool::new(false);
        let report = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut seen = 0u64;
                while !done.load(Relaxed) {
                    for (i, byte) in dst.iter().enumerate().step_by(4093) {
                        let value = byte.load(Relaxed);
                        assert!(
                            value == 0 || value == common::pattern_byte(i as u64),
                            "byte {i} is {value:#x}"
                        );
                        seen += 1;
                    }
                }
                seen
            });
            // SAFETY: `dst` stays allocated for the call; the other
            // thread touches it through atomics only, no Rust reference to
            // plain bytes.
            let raw = unsafe { dmaload::RawBytesMut::from_raw_parts(dst.as_ptr() as *mut u8, size) };
            let report = dmaload::LoadRequest::path(&path)
                .options(&options(Engine::UringFixed, IoMode::Auto))
                .fill_raw(raw);
            done.store(true, Relaxed);
            assert!(reader.join().unwrap() > 0);
            report
        })
        .unwrap();
        assert_eq!(report.bytes, size as u64);
        let loaded: Vec<u8> = dst.iter().map(|b| b.load(Relaxed)).collect();
        assert_pattern(&loaded, 0);
    }
}

/// `len` zeroed atomic bytes on a page boundary, inside `storage`, and the
/// same memory as raw bytes for a load (the test reads it through atomics
/// only, while the load writes it).
fn atomic_memory(storage: &[std::sync::atomic::AtomicU8], len: usize) -> &[std::sync::atomic::AtomicU8] {
    let start = (storage.as_ptr() as usize).next_multiple_of(PAGE) - storage.as_ptr() as usize;
    &storage[start..start + len]
}

/// `LoadRequest::fill_arriving` says how far the load has come while it
/// runs: gather by gather, each count larger than the last, the bytes
/// below it already the file's when it is said (read back from inside the
/// callback), the last one the whole length.
#[test]
fn arrivals_grow_gather_by_gather_over_bytes_already_in() {
    use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 6 * M + 555;
    write_cold(&path, size as u64);
    for mode in [IoMode::Auto, IoMode::Buffered] {
        let storage: Vec<AtomicU8> = (0..size + PAGE).map(|_| AtomicU8::new(0)).collect();
        let dst = atomic_memory(&storage, size);
        let seen = std::sync::Mutex::new(Vec::new());
        let arrived = |n: u64| {
            for (i, byte) in dst[..n as usize].iter().enumerate().step_by(997) {
                assert_eq!(byte.load(Relaxed), common::pattern_byte(i as u64), "byte {i} below {n}");
            }
            seen.lock().unwrap().push(n);
        };
        // SAFETY: `dst` outlives the call; this thread and the callback
        // touch it through atomics only.
        let raw = unsafe { dmaload::RawBytesMut::from_raw_parts(dst.as_ptr() as *mut u8, size) };
        let file = dmaload::OpenFile::open(&path).unwrap();
        let options = LoadOptions { gather_size: M, ..options(Engine::UringFixed, mode) };
        dmaload::LoadRequest::open(&file).options(&options).fill_arriving(raw, &arrived).unwrap();
        let seen = seen.into_inner().unwrap();
        assert!(seen.len() > 2, "{mode:?}: {seen:?}");
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "{mode:?}: {seen:?}");
        assert_eq!(seen.last(), Some(&(size as u64)));
        let loaded: Vec<u8> = dst.iter().map(|b| b.load(Relaxed)).collect();
        assert_pattern(&loaded, 0);
    }
}

/// A file cut short while it loads: nothing is said to have arrived once
/// the cut is seen, and the load fails (Truncated) rather than ending.
#[test]
fn a_file_cut_mid_load_reports_no_more_arrivals_and_fails() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 6 * M;
    write_cold(&path, size as u64);
    let mut memory = Vec::new();
    let dst = memory_at(&mut memory, 0, size);
    let seen = std::sync::Mutex::new(Vec::new());
    let arrived = |n: u64| {
        let mut seen = seen.lock().unwrap();
        if seen.is_empty() {
            std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(M as u64).unwrap();
        }
        seen.push(n);
    };
    let file = dmaload::OpenFile::open(&path).unwrap();
    let options = LoadOptions { gather_size: M, ..options(Engine::UringFixed, IoMode::Auto) };
    let err = dmaload::LoadRequest::open(&file).options(&options).fill_arriving(dst, &arrived).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Truncated | ErrorKind::Changed), "{err}");
    assert_eq!(seen.into_inner().unwrap().len(), 1, "arrivals after the cut");
}
