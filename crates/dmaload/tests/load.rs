//! Loads of real files on the real filesystem, every engine, checked
//! against independently computed contents.

mod common;

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use dmaload::{CachePolicy, Engine, ErrorKind, IoMode, LoadOptions, MemoryKind};

fn options(engine: Engine) -> LoadOptions {
    // Small chunks and gathers so even small files span several of each.
    LoadOptions { engine, chunk_size: 64 << 10, gather_size: 256 << 10, ..LoadOptions::default() }
}

/// Reads the THP policy files directly, independently of the library.
fn thp_policy_allows_huge_pages(memory: MemoryKind) -> bool {
    let (file, allowing): (&str, &[&str]) = match memory {
        MemoryKind::Memfd | MemoryKind::Anonymous => return false,
        MemoryKind::Hugetlb => return true,
        MemoryKind::MemfdHuge => ("shmem_enabled", &["always", "within_size", "advise", "force"]),
        MemoryKind::AnonymousThp => ("enabled", &["always", "madvise"]),
    };
    let text =
        std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{file}")).unwrap_or_default();
    let selected = text.split('[').nth(1).and_then(|rest| rest.split(']').next()).unwrap_or("");
    allowing.contains(&selected)
}

const SMALL_SIZES: [u64; 6] = [0, 1, 4095, 4096, 4097, (1 << 20) + 1];

#[test]
fn every_engine_loads_every_small_size_exactly() {
    let dir = scratch_dir();
    for size in SMALL_SIZES {
        let path = dir.path().join(format!("f{size}"));
        write_pattern_file(&path, size);
        for engine in Engine::ALL {
            for memory in [MemoryKind::Memfd, MemoryKind::AnonymousThp, MemoryKind::Anonymous] {
                let opts = LoadOptions { to: memory.into(), ..options(engine) };
                let (buffer, report) = dmaload::load(&path, &opts).unwrap();
                assert_eq!(buffer.len() as u64, size, "{engine:?} {size}");
                assert_pattern(&buffer, 0);
                assert_eq!(report.bytes, size);
                assert_eq!(report.cache, CachePolicy::Bypass, "ext4 supports O_DIRECT");
                let covered: usize = buffer.segments().iter().map(|s| s.len).sum();
                assert_eq!(covered, buffer.len());
                assert_eq!(buffer.memfd().unwrap().is_some(), memory == MemoryKind::Memfd);
                assert_eq!(report.huge_pages, thp_policy_allows_huge_pages(memory), "{memory:?}");
            }
        }
    }
}

#[test]
fn large_file_with_odd_tail_matches_its_hash_with_every_engine() {
    let dir = scratch_dir();
    let path = dir.path().join("large");
    let size = (300 << 20) + 12_345;
    write_pattern_file(&path, size);
    let expected = file_hash(&path);
    for engine in Engine::ALL {
        dmaload::pagecache::evict(&path).unwrap();
        // Default chunk and gather sizes: the pipeline runs over 3 gathers.
        let opts = LoadOptions { engine, measure_page_cache: true, ..LoadOptions::default() };
        let (buffer, report) = dmaload::load(&path, &opts).unwrap();
        assert_eq!(buffer.len() as u64, size);
        assert_eq!(xxhash_rust::xxh3::xxh3_64(&buffer), expected, "{engine:?}");
        assert_eq!(report.cache, CachePolicy::Bypass);
        let segments = buffer.segments();
        if report.destination.contains("staging ring") {
            // 4 KiB pages where THP is on: read through the ring, one piece.
            assert_eq!(segments.len(), 1, "{}", report.destination);
        } else {
            // In place, gathers ramp up from one chunk: 4, 4, 8, ... 128 MiB, then the rest.
            assert_eq!(segments.len(), 8);
            assert_eq!((segments[0].len, segments[7].offset), (4 << 20, 256 << 20));
        }
        assert!(segments.windows(2).all(|w| w[0].offset + w[0].len == w[1].offset));
        assert_eq!(segments.iter().map(|s| s.len as u64).sum::<u64>(), size);
        let residency = report.page_cache.expect("measured when asked");
        assert!(residency.fraction < 0.01, "direct I/O left {residency:?} cached");
    }
}

#[test]
fn ranges_at_unaligned_offsets_load_exactly() {
    let dir = scratch_dir();
    let path = dir.path().join("ranged");
    let size = (2 << 20) + 333;
    write_pattern_file(&path, size);
    let ranges =
        [(0, 1), (1, 10), (4095, 4098), (5000, (1 << 20) + 3), (size - 1, 1), (size, 0), (777, size - 777)];
    for engine in Engine::ALL {
        for mode in [IoMode::Auto, IoMode::Buffered] {
            for (offset, len) in ranges {
                let last = Arc::new(std::sync::Mutex::new((0, 0)));
                let seen = last.clone();
                let progress = Arc::new(move |done, total| *seen.lock().unwrap() = (done, total));
                let opts = LoadOptions { mode, progress: Some(progress), ..options(engine) };
                let (buffer, report) =
                    dmaload::LoadRequest::path(&path).range(offset, len).options(&opts).to_buffer().unwrap();
                assert_eq!(buffer.len() as u64, len, "{engine:?} {offset}+{len}");
                if len > 0 {
                    // Progress counts requested bytes only, not alignment padding.
                    assert_eq!(*last.lock().unwrap(), (len, len), "{engine:?} {offset}+{len}");
                }
                assert_pattern(&buffer, offset);
                assert_eq!(report.offset, offset);
                if mode == IoMode::Auto && len > 0 {
                    // Direct reads start at an aligned offset at or before the
                    // range (an empty range reads nothing).
                    assert!(buffer.memfd_offset() < report.alignment);
                    assert_eq!((offset - buffer.memfd_offset() as u64) % report.alignment as u64, 0);
                }
            }
        }
    }
}

#[test]
fn range_past_the_end_is_an_error_naming_the_size() {
    let dir = scratch_dir();
    let path = dir.path().join("short");
    write_pattern_file(&path, 10_000);
    let err = dmaload::LoadRequest::path(&path).range(9_000, 2_000).to_buffer().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Truncated);
    assert_eq!(err.offset(), Some(10_000));
    assert!(err.to_string().contains("10000 bytes"), "{err}");
    let err = dmaload::LoadRequest::path(&path).range(20_000, 1).to_buffer().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(err.offset(), Some(20_000));
}

#[test]
fn buffered_modes_read_the_same_bytes_and_control_the_page_cache() {
    let dir = scratch_dir();
    let path = dir.path().join("buffered");
    let size = (8 << 20) + 5;
    write_pattern_file(&path, size);
    for (mode, expect_cached) in [(IoMode::Buffered, true), (IoMode::DontCache, false)] {
        dmaload::pagecache::evict(&path).unwrap();
        let opts = LoadOptions { mode, measure_page_cache: true, ..options(Engine::Uring) };
        let (buffer, report) = dmaload::load(&path, &opts).unwrap();
        assert_pattern(&buffer, 0);
        assert_eq!(report.alignment, 1);
        let residency = report.page_cache.expect("measured when asked");
        if expect_cached {
            assert_eq!(report.cache, CachePolicy::Keep);
            assert!(residency.fraction > 0.99, "{residency:?}");
            assert_eq!(residency.resident_bytes, size);
        } else {
            assert!(matches!(report.cache, CachePolicy::DontCache | CachePolicy::Fadvise));
            assert!(residency.fraction < 0.01, "{:?} left {residency:?}", report.cache);
        }
    }
}

#[test]
fn page_cache_residency_is_measured_only_when_asked() {
    let dir = scratch_dir();
    let path = dir.path().join("residency");
    let size = (1 << 20) + 7;
    write_pattern_file(&path, size);
    // Buffered reads leave the range cached, so a measurement has something to see.
    let opts = LoadOptions { mode: IoMode::Buffered, ..options(Engine::Uring) };
    assert!(!LoadOptions::default().measure_page_cache);
    let (_, report) = dmaload::load(&path, &opts).unwrap();
    assert_eq!(report.page_cache, None);
    let json = serde_json::to_value(&report).unwrap();
    assert!(json["page_cache"].is_null(), "{json}");

    let measured = LoadOptions { measure_page_cache: true, ..opts };
    let (_, report) =
        dmaload::LoadRequest::path(&path).range(4096, 8192).options(&measured).to_buffer().unwrap();
    let residency = report.page_cache.expect("measured when asked");
    assert_eq!(residency.resident_bytes, 8192, "{residency:?}");
    assert!(residency.fraction > 0.99, "{residency:?}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["page_cache"]["resident_bytes"], 8192);
}

#[test]
fn tmpfs_falls_back_to_buffered_and_says_why() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        return skip("tmpfs_falls_back_to_buffered_and_says_why", "/dev/shm does not exist");
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let path = dir.path().join("on-tmpfs");
    write_pattern_file(&path, 100_003);
    let (buffer, report) = dmaload::load(&path, &LoadOptions::default()).unwrap();
    assert_pattern(&buffer, 0);
    assert_eq!(report.filesystem, "tmpfs");
    assert_eq!(report.cache, CachePolicy::Keep);
    assert_eq!(report.fallbacks.len(), 1);
    assert!(report.fallbacks[0].reason.contains("tmpfs"), "{:?}", report.fallbacks);

    let err =
        dmaload::load(&path, &LoadOptions { mode: IoMode::Direct, ..LoadOptions::default() }).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DirectIoUnavailable);
    assert!(err.to_string().contains("on-tmpfs"), "{err}");
}

#[test]
fn missing_file_and_directory_are_errors_naming_the_path() {
    let dir = scratch_dir();
    let missing = dir.path().join("does-not-exist");
    let err = dmaload::load(&missing, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    assert_eq!(err.op(), "open");
    assert!(err.to_string().contains("does-not-exist"), "{err}");

    let err = dmaload::load(dir.path(), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EISDIR));
    assert!(err.to_string().contains(&*dir.path().to_string_lossy()), "{err}");
}

#[test]
fn invalid_options_are_rejected_before_any_io() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 10);
    for opts in [
        LoadOptions { queue_depth: 0, ..LoadOptions::default() },
        LoadOptions { chunk_size: 0, ..LoadOptions::default() },
        LoadOptions { threads: 0, ..LoadOptions::default() },
    ] {
        let err = dmaload::load(&path, &opts).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{opts:?}");
    }
}

#[test]
fn a_device_destination_is_refused_by_host_loads_saying_where_to_go() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 10);
    let opts = LoadOptions { to: "cuda:1".parse().unwrap(), ..LoadOptions::default() };
    let errors = [
        dmaload::load(&path, &opts).unwrap_err(),
        dmaload::LoadRequest::path(&path).range(1, 2).options(&opts).to_buffer().unwrap_err(),
        dmaload::LoadRequest::path(&path).range(1, None).options(&opts).to_buffer().unwrap_err(),
        dmaload::LoadRequest::fd(std::fs::File::open(&path).unwrap().as_fd())
            .options(&opts)
            .to_buffer()
            .unwrap_err(),
        // Before the file is even opened.
        dmaload::load(dir.path().join("missing"), &opts).unwrap_err(),
    ];
    for err in errors {
        assert_eq!((err.kind(), err.errno()), (ErrorKind::InvalidInput, libc::EINVAL), "{err}");
        let message = err.to_string();
        assert!(message.contains("cannot live on a device (cuda:1)"), "{message}");
        assert!(message.contains("CudaSink") && message.contains("dmaload load --to cuda:1"), "{message}");
    }
}

#[test]
fn file_larger_than_available_memory_is_refused_before_allocating() {
    let dir = scratch_dir();
    let path = dir.path().join("sparse-huge");
    let available = dmaload::system::memory_available().unwrap();
    // A sparse file costs no disk space.
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(available + (1 << 30)).unwrap();
    let err = dmaload::load(&path, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert_eq!(err.errno(), libc::ENOMEM);
    assert!(err.to_string().contains("MemAvailable"), "{err}");
}

#[test]
fn file_truncated_during_the_load_is_an_error_never_a_buffer() {
    let dir = scratch_dir();
    for engine in Engine::ALL {
        let path = dir.path().join(format!("shrinking-{}", engine.name()));
        let size = 16u64 << 20;
        let cut = (3 << 20) + (1 << 19);
        write_pattern_file(&path, size);
        let truncated = Arc::new(AtomicBool::new(false));
        let (flag, victim) = (truncated.clone(), path.clone());
        let opts = LoadOptions {
            chunk_size: 1 << 20,
            gather_size: 4 << 20,
            queue_depth: 2,
            threads: 2,
            // The first finished chunk shrinks the file under the loader.
            progress: Some(Arc::new(move |_done, _total| {
                if !flag.swap(true, Ordering::SeqCst) {
                    std::fs::OpenOptions::new().write(true).open(&victim).unwrap().set_len(cut).unwrap();
                }
            })),
            ..options(engine)
        };
        let err = dmaload::load(&path, &opts).unwrap_err();
        assert!(truncated.load(Ordering::SeqCst));
        assert_eq!(err.kind(), ErrorKind::Truncated, "{engine:?}: {err}");
        let at = err.offset().expect("truncation names an offset");
        assert!(at >= cut && at < size, "{engine:?}: offset {at}");
        let message = err.to_string();
        assert!(
            message.contains(&*path.to_string_lossy()) && message.contains(&cut.to_string()),
            "{message}"
        );
    }
}

/// A loop device detached on drop.
struct LoopDevice(String);

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[test]
fn block_device_loads_through_direct_io() {
    let name = "block_device_loads_through_direct_io";
    let dir = scratch_dir();
    let backing = dir.path().join("disk.img");
    let size = (6 << 20) + 512;
    write_pattern_file(&backing, size);
    let attached = std::process::Command::new("losetup").args(["--find", "--show"]).arg(&backing).output();
    let device = match attached {
        Ok(out) if out.status.success() => LoopDevice(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        Ok(out) => {
            return skip(name, &format!("losetup failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
        }
        Err(err) => return skip(name, &format!("losetup not available: {err}")),
    };
    let (buffer, report) = dmaload::load(&device.0, &options(Engine::UringFixed)).unwrap();
    assert_eq!(buffer.len() as u64, size);
    assert_pattern(&buffer, 0);
    assert_eq!(report.cache, CachePolicy::Bypass);
    let (range, _) = dmaload::LoadRequest::path(&device.0)
        .range(1001, 70_000)
        .options(&options(Engine::Uring))
        .to_buffer()
        .unwrap();
    assert_pattern(&range, 1001);
}

#[test]
fn a_large_load_into_small_pages_reads_through_the_ring_with_the_same_bytes() {
    let test = "a_large_load_into_small_pages_reads_through_the_ring_with_the_same_bytes";
    let facts = dmaload::memory::MemoryFacts::read();
    if !facts.huge_pages(MemoryKind::AnonymousThp) {
        return skip(test, "transparent huge pages are off: the ring would have 4 KiB pages too");
    }
    let dir = scratch_dir();
    let path = dir.path().join("big");
    let size = (80 << 20) + 4321;
    write_pattern_file(&path, size);
    let expected = file_hash(&path);
    let opts = LoadOptions { to: dmaload::Destination::Memfd, ..LoadOptions::default() };
    dmaload::pagecache::evict(&path).unwrap();
    let (buffer, report) = dmaload::load(&path, &opts).unwrap();
    if report.cache != CachePolicy::Bypass {
        return skip(test, "no direct I/O on the scratch filesystem: loads stay in place");
    }
    // The ring where it makes each 4 MiB read at least 4 times fewer requests.
    let queue = dmaload::system::DeviceQueue::of(&std::fs::metadata(&path).unwrap());
    let fewer = queue.as_ref().map(|q| q.requests(4 << 20, 4096) / q.requests(4 << 20, 2 << 20));
    if !fewer.is_some_and(|fewer| fewer >= 4) {
        assert!(!report.destination.contains("staging ring"), "{} ({queue:?})", report.destination);
        return skip(test, &format!("the scratch device's queue ({queue:?}) gains little from the ring"));
    }
    assert!(report.destination.contains("staging ring"), "{}", report.destination);
    assert!(report.memory_reason.contains(&queue.unwrap().device), "{}", report.memory_reason);
    assert_eq!((report.memory, report.huge_pages), (MemoryKind::Memfd, false));
    assert!(report.memory_reason.contains("4 KiB pages"), "{}", report.memory_reason);
    assert_eq!(xxhash_rust::xxh3::xxh3_64(&buffer), expected);
    // The memfd behind it is sized and sealed as an in-place load's.
    let memfd = buffer.memfd().unwrap().unwrap().try_clone_to_owned().unwrap();
    assert!(std::fs::File::from(memfd).metadata().unwrap().len() >= size);
    drop(buffer);
    // An unaligned range, and a second load reusing the process's ring.
    let (part, report) =
        dmaload::LoadRequest::path(&path).range(12_345, 70 << 20).options(&opts).to_buffer().unwrap();
    assert!(report.destination.contains("staging ring"));
    assert_pattern(&part, 12_345);
    // Below the threshold the load stays in place.
    let (_, small) = dmaload::LoadRequest::path(&path).range(0, 8 << 20).options(&opts).to_buffer().unwrap();
    assert!(!small.destination.contains("staging ring"), "{}", small.destination);
}

/// A direct load sets O_DIRECT on an open file description of its own: the
/// `OpenFile` it read from keeps reading at any offset and length (a `dup`
/// shares the description, where unaligned reads then fail with EINVAL).
#[test]
fn a_direct_load_leaves_the_open_files_own_reads_buffered() {
    const TEST: &str = "a_direct_load_leaves_the_open_files_own_reads_buffered";
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, (1 << 20) + 5);
    let file = dmaload::OpenFile::open(&path).unwrap();
    let read_three = |file: &dmaload::OpenFile| {
        let mut three = [0u8; 3];
        assert_eq!(file.read_at(&mut three, 1).unwrap(), 3);
        assert_pattern(&three, 1);
    };
    read_three(&file);
    let direct = LoadOptions { mode: IoMode::Direct, ..LoadOptions::default() };
    match dmaload::LoadRequest::open(&file).options(&direct).to_buffer() {
        Ok((buffer, _)) => assert_pattern(&buffer, 0),
        Err(err) if err.kind() == ErrorKind::DirectIoUnavailable => return skip(TEST, &err.to_string()),
        Err(err) => panic!("{err}"),
    }
    read_three(&file);
}
