//! The staged destination (a ring of staging slots feeding a sink) through
//! the host sink: every engine, sizes with odd tails, unaligned ranges, a
//! two-slot ring, many chunks per slot, a sink that fails, truncation and
//! cancellation mid-load. The GPU sink shares all of this code.

mod common;

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{assert_pattern, scratch_dir, write_pattern_file};
use dmaload::{CancelToken, Engine, ErrorKind, HostSink, LoadOptions, Sink, SlotData, StagingRing};

const M: usize = 1 << 20;

/// A pattern file out of the page cache: `auto` mode would otherwise copy it
/// from the cache with the pool (see the last test), whatever the engine.
fn write_cold(path: &std::path::Path, size: u64) {
    write_pattern_file(path, size);
    dmaload::pagecache::evict(path).unwrap();
}

fn options(engine: Engine, chunk: usize) -> LoadOptions {
    LoadOptions { engine, chunk_size: chunk, queue_depth: 4, threads: 3, ..LoadOptions::default() }
}

/// Loads `offset..offset + len` of `path` through a ring into a fresh
/// vector and returns it with the report.
fn load_staged(
    path: &std::path::Path,
    offset: u64,
    len: u64,
    ring: &mut StagingRing,
    options: &LoadOptions,
) -> dmaload::Result<(Vec<u8>, dmaload::LoadReport)> {
    let mut dst = vec![0u8; len as usize];
    let report = dmaload::LoadRequest::path(&path)
        .range(offset, Some(len))
        .options(options)
        .to_sink(ring, &mut HostSink::new(&mut dst, offset))?;
    Ok((dst, report))
}

#[test]
fn every_engine_delivers_every_size_exactly_through_a_two_slot_ring() {
    let dir = scratch_dir();
    for size in [0u64, 1, 4095, 4096, 4097, M as u64 + 1, (5 * M + 777) as u64] {
        let path = dir.path().join(format!("f{size}"));
        write_cold(&path, size);
        for engine in Engine::ALL {
            // Two slots of two 256 KiB chunks: a slot is reused many times.
            let mut ring = StagingRing::new(2, 512 << 10, 256 << 10).unwrap();
            let (bytes, report) = load_staged(&path, 0, size, &mut ring, &options(engine, 256 << 10))
                .unwrap_or_else(|e| panic!("{engine:?} size {size}: {e}"));
            assert_pattern(&bytes, 0);
            assert_eq!(report.bytes, size);
            assert!(report.destination.starts_with("staging ring (2 x 524288"), "{}", report.destination);
        }
    }
}

#[test]
fn unaligned_ranges_arrive_at_their_offsets() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 9 * M as u64 + 123;
    write_cold(&path, size);
    let mut ring = StagingRing::new(3, M, M).unwrap();
    for (offset, len) in
        [(1u64, 10u64), (511, 2 * M as u64), (4097, 5 * M as u64 + 3), (M as u64 - 1, 2), (size - 7, 7)]
    {
        for engine in Engine::ALL {
            let (bytes, _) = load_staged(&path, offset, len, &mut ring, &options(engine, M)).unwrap();
            assert_eq!(bytes.len() as u64, len);
            assert_pattern(&bytes, offset);
        }
    }
}

/// Records what each delivery held and fails at a chosen one; a slot
/// delivered again before its release fails the load (a panic in the
/// delivery thread).
#[derive(Default)]
struct Recorder {
    deliveries: Vec<(usize, u64, usize)>,
    released: Vec<usize>,
    /// Slots delivered and not released since.
    held: std::collections::BTreeSet<usize>,
    fail_at: Option<usize>,
    finished: bool,
}

impl Sink for Recorder {
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> io::Result<()> {
        if self.fail_at == Some(self.deliveries.len()) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let mut bytes = vec![0u8; data.len()];
        data.copy_to(0..data.len(), &mut bytes);
        assert_pattern(&bytes, data.file_offset());
        assert!(self.held.insert(slot), "slot {slot} delivered again before its release");
        self.deliveries.push((slot, data.file_offset(), data.len()));
        Ok(())
    }

    fn release(&mut self, slot: usize) -> io::Result<()> {
        self.held.remove(&slot);
        self.released.push(slot);
        Ok(())
    }

    fn finish(&mut self) -> io::Result<()> {
        self.finished = true;
        Ok(())
    }
}

#[test]
fn every_gather_is_delivered_once_and_each_slot_released_before_reuse() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 10 * M as u64 + 5;
    write_cold(&path, size);
    for engine in Engine::ALL {
        let mut ring = StagingRing::new(3, 2 * M, M).unwrap();
        let mut sink = Recorder::default();
        dmaload::LoadRequest::path(&path).options(&options(engine, M)).to_sink(&mut ring, &mut sink).unwrap();
        assert!(sink.finished);
        // In the order the reads completed: each gather once, whatever the order.
        let mut offsets: Vec<u64> = sink.deliveries.iter().map(|d| d.1).collect();
        offsets.sort_unstable();
        assert_eq!(offsets, [0, 2, 4, 6, 8, 10].map(|m| m * M as u64), "{engine:?}");
        assert!(sink.deliveries.iter().all(|d| d.0 < 3), "{engine:?}");
        assert_eq!(sink.deliveries.iter().map(|d| d.2 as u64).sum::<u64>(), size);
        // Six gathers through three slots: at least three releases came
        // before a reuse (the Recorder fails a reuse without one).
        assert!(sink.released.len() >= 3, "{engine:?}: {:?}", sink.released);
    }
}

#[test]
fn a_failing_sink_stops_the_load_with_its_error_and_is_still_finished() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, 16 * M as u64);
    for engine in Engine::ALL {
        let mut ring = StagingRing::new(2, M, M).unwrap();
        let mut sink = Recorder { fail_at: Some(3), ..Recorder::default() };
        let err = dmaload::LoadRequest::path(&path)
            .options(&options(engine, M))
            .to_sink(&mut ring, &mut sink)
            .unwrap_err();
        assert_eq!(err.errno(), libc::EIO, "{engine:?}: {err}");
        assert_eq!(err.op(), "deliver", "{engine:?}: {err}");
        // The fourth gather delivered, in completion order: one not
        // delivered before.
        let offset = err.offset().unwrap();
        assert!(
            offset % M as u64 == 0 && !sink.deliveries.iter().any(|d| d.1 == offset),
            "{engine:?}: {err}"
        );
        assert!(sink.finished, "{engine:?}: finish is called after a failure too");
        assert_eq!(sink.deliveries.len(), 3);
    }
}

#[test]
fn truncation_mid_load_is_an_error_naming_the_offset() {
    let dir = scratch_dir();
    for engine in Engine::ALL {
        let path = dir.path().join(format!("shrinking-{}", engine.name()));
        let size = 16u64 << 20;
        let cut = (3 << 20) + (1 << 19);
        write_cold(&path, size);
        let truncated = Arc::new(AtomicBool::new(false));
        let (flag, victim) = (truncated.clone(), path.clone());
        let opts = LoadOptions {
            // Pool workers beyond the failing one wait for slots: they must
            // be woken when the load fails.
            queue_depth: 1,
            threads: 3,
            progress: Some(Arc::new(move |_done, _total| {
                if !flag.swap(true, Ordering::SeqCst) {
                    std::fs::OpenOptions::new().write(true).open(&victim).unwrap().set_len(cut).unwrap();
                }
            })),
            ..options(engine, M)
        };
        let mut ring = StagingRing::new(2, M, M).unwrap();
        let err = load_staged(&path, 0, size, &mut ring, &opts).unwrap_err();
        assert!(truncated.load(Ordering::SeqCst));
        assert_eq!(err.kind(), ErrorKind::Truncated, "{engine:?}: {err}");
        let at = err.offset().expect("truncation names an offset");
        assert!(at >= cut && at < size, "{engine:?}: offset {at}");
    }
}

/// A [`Recorder`] that holds its third delivery until the token is
/// cancelled, so a load cannot finish before the progress thread (which
/// may be starved of CPU on a busy machine) has had its say.
struct AwaitCancel {
    recorder: Recorder,
    token: CancelToken,
}

impl Sink for AwaitCancel {
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> io::Result<()> {
        if self.recorder.deliveries.len() == 2 {
            let started = std::time::Instant::now();
            while !self.token.is_cancelled() && started.elapsed() < std::time::Duration::from_secs(60) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        self.recorder.deliver(slot, data)
    }

    fn release(&mut self, slot: usize) -> io::Result<()> {
        self.recorder.release(slot)
    }

    fn finish(&mut self) -> io::Result<()> {
        self.recorder.finish()
    }
}

#[test]
fn cancelling_a_staged_load_stops_it_and_finishes_the_sink() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 64u64 << 20;
    write_cold(&path, size);
    for engine in Engine::ALL {
        dmaload::pagecache::evict(&path).unwrap();
        let token = CancelToken::new();
        let canceller = token.clone();
        let opts = LoadOptions {
            queue_depth: 1,
            threads: 1,
            mode: dmaload::IoMode::Direct,
            cancel: token,
            progress: Some(Arc::new(move |_, _| canceller.cancel())),
            ..options(engine, 64 << 10)
        };
        let mut ring = StagingRing::new(2, 64 << 10, 64 << 10).unwrap();
        let mut sink = AwaitCancel { recorder: Recorder::default(), token: opts.cancel.clone() };
        let err = dmaload::LoadRequest::path(&path).options(&opts).to_sink(&mut ring, &mut sink).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled, "{engine:?}: {err}");
        let sink = sink.recorder;
        assert!(sink.finished);
        assert!((sink.deliveries.len() as u64) < size / (64 << 10), "{engine:?}: every slot was delivered");
    }
}

#[test]
fn a_ring_needs_two_slots_and_whole_chunks() {
    assert!(StagingRing::new(1, M, M).is_err());
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, 4 * M as u64);
    let mut ring = StagingRing::new(2, 3 * M, 3 * M).unwrap();
    let err =
        load_staged(&path, 0, 4 * M as u64, &mut ring, &options(Engine::UringFixed, 2 * M)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    // A chunk that divides the slot is fine, and so is one larger than it.
    for chunk in [M, 8 * M] {
        let (bytes, _) =
            load_staged(&path, 0, 4 * M as u64, &mut ring, &options(Engine::UringFixed, chunk)).unwrap();
        assert_pattern(&bytes, 0);
    }
}

#[test]
fn auto_mode_copies_a_cached_file_from_the_page_cache_and_reads_a_cold_one_direct() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    let size = 8 * M as u64 + 9;
    write_pattern_file(&path, size);
    let opts = LoadOptions::default();
    let mut ring = StagingRing::new(4, M, M).unwrap();
    // Warm: read it through the page cache first.
    std::fs::read(&path).unwrap();
    let (bytes, report) = load_staged(&path, 0, size, &mut ring, &opts).unwrap();
    assert_pattern(&bytes, 0);
    assert_eq!(report.engine, Engine::PreadPool, "{:?}", report.fallbacks);
    assert_eq!(report.cache, dmaload::CachePolicy::Keep);
    assert!(report.fallbacks.iter().any(|f| f.to == "page cache" && f.reason.contains("% of the range")));
    // Cold: evicted, so the disk is read with direct I/O as usual.
    dmaload::pagecache::evict(&path).unwrap();
    let (bytes, report) = load_staged(&path, 0, size, &mut ring, &opts).unwrap();
    assert_pattern(&bytes, 0);
    if report.filesystem != "tmpfs" {
        assert_eq!(report.cache, dmaload::CachePolicy::Bypass, "{:?}", report.fallbacks);
        assert!(!report.fallbacks.iter().any(|f| f.to == "page cache"));
    }
}

#[test]
fn a_file_limited_to_its_first_bytes_loads_only_those() {
    // As a cache service's memfd: a file's bytes, then zeros to the page.
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, 3 * M as u64);
    let whole = std::fs::read(&path).unwrap();
    let len = 2 * M as u64 + 12_345;
    let file = dmaload::OpenFile::open(&path).unwrap().first_bytes(len).unwrap();
    assert_eq!(file.len(), len);
    let mut ring = StagingRing::new(2, M, 256 << 10).unwrap();
    let mut dst = vec![0u8; len as usize];
    let opts = options(Engine::UringFixed, 256 << 10);
    let report = dmaload::LoadRequest::open(&file)
        .options(&opts)
        .to_sink(&mut ring, &mut HostSink::new(&mut dst, 0))
        .unwrap();
    assert_eq!(report.bytes, len);
    assert!(dst == whole[..len as usize]);
    let Err(past) = dmaload::OpenFile::open(&path).unwrap().first_bytes(3 * M as u64 + 1) else {
        panic!("more bytes than the file has were accepted");
    };
    assert_eq!(past.kind(), ErrorKind::InvalidInput, "{past}");
}

#[test]
fn pool_workers_waiting_for_a_slot_are_woken_when_the_load_fails() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, 16 * M as u64);
    // Opened at 16 MiB, then cut near the end: the last reads come back
    // short. More workers than chunks in the two slots, so while one meets
    // the end the others wait for a slot that the failed load will never
    // release.
    let file = dmaload::OpenFile::open(&path).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(16 * M as u64 - 100_000).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut ring = StagingRing::new(2, M, 256 << 10).unwrap();
        let mut dst = vec![0u8; 16 * M];
        let opts = LoadOptions { threads: 8, ..options(Engine::PreadPool, 256 << 10) };
        let result = dmaload::LoadRequest::open(&file)
            .options(&opts)
            .to_sink(&mut ring, &mut HostSink::new(&mut dst, 0));
        let _ = done.send(result.map(drop));
    });
    let result = finished.recv_timeout(std::time::Duration::from_secs(60)).expect("the failed load hung");
    assert_eq!(result.unwrap_err().kind(), ErrorKind::Truncated);
}

/// A staged load on its own thread, failing the test if it hangs.
fn staged_or_hang(path: &std::path::Path) -> dmaload::Result<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = path.to_owned();
    std::thread::spawn(move || {
        let mut ring = StagingRing::new(2, M, M).unwrap();
        let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let mut dst = vec![0u8; len as usize];
        let result = dmaload::LoadRequest::path(&path)
            .options(&options(Engine::UringFixed, M))
            .to_sink(&mut ring, &mut HostSink::new(&mut dst, 0));
        let _ = tx.send(result.map(|_| dst));
    });
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .expect("staged load hung instead of returning an error")
}

#[test]
fn staged_loads_refuse_fifos_and_character_devices_and_follow_symlinks() {
    let dir = scratch_dir();
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let err = staged_or_hang(&fifo).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("FIFO"), "{err}");
    let err = staged_or_hang(std::path::Path::new("/dev/zero")).unwrap_err();
    assert!(err.to_string().contains("character device"), "{err}");
    let target = dir.path().join("target");
    write_cold(&target, 3 * M as u64 + 5);
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    assert_pattern(&staged_or_hang(&link).unwrap(), 0);
}

#[test]
fn a_file_rewritten_during_a_staged_load_is_an_error() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, 16 * M as u64);
    let victim = path.clone();
    let rewritten = Arc::new(AtomicBool::new(false));
    let flag = rewritten.clone();
    let opts = LoadOptions {
        queue_depth: 1,
        // The first progress report rewrites a byte in place (same size).
        progress: Some(Arc::new(move |_, _| {
            if !flag.swap(true, Ordering::SeqCst) {
                use std::os::unix::fs::FileExt;
                let file = std::fs::OpenOptions::new().write(true).open(&victim).unwrap();
                file.write_all_at(b"X", 15 * M as u64).unwrap();
            }
        })),
        ..options(Engine::UringFixed, M)
    };
    let mut ring = StagingRing::new(2, M, M).unwrap();
    let err = load_staged(&path, 0, 16 * M as u64, &mut ring, &opts).unwrap_err();
    assert!(rewritten.load(Ordering::SeqCst));
    assert_eq!(err.kind(), ErrorKind::Changed, "{err}");
}

#[test]
fn an_empty_range_anywhere_is_delivered_at_once() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, 10_000);
    for offset in [0, 1, 4096, 9_999, 10_000] {
        let mut ring = StagingRing::new(2, M, M).unwrap();
        let (bytes, report) = load_staged(&path, offset, 0, &mut ring, &options(Engine::UringFixed, M))
            .unwrap_or_else(|e| panic!("offset {offset}: {e}"));
        assert!(bytes.is_empty());
        assert_eq!(report.bytes, 0);
    }
}

#[test]
fn a_host_sink_populating_ahead_fills_more_than_its_window_and_leaves_its_neighbours_alone() {
    // Past the populating threads' window, through a two-slot ring whose
    // deliveries they outrun (so they wait for the window to move), into a
    // slice that starts and ends mid-page between bytes it must not change.
    let size = dmaload::sink::POPULATE_AHEAD as u64 + (3 * M + 5) as u64;
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_cold(&path, size);
    let (offset, end) = (4096 + 3, 4096 + 3 + size as usize - 7);
    // Untouched (so the threads have pages to fault in) but for the bytes
    // around the slice.
    let mut memory = vec![0u8; end + 2 * 4096];
    memory[..offset].fill(0xa5);
    memory[end..].fill(0xa5);
    let dst = &mut memory[offset..end];
    let mut ring = StagingRing::new(2, M, M).unwrap();
    let options = LoadOptions { populate_threads: 2, ..options(Engine::default(), M) };
    let report = dmaload::LoadRequest::path(&path)
        .range(7, None)
        .options(&options)
        .to_sink(&mut ring, &mut HostSink::new(dst, 7))
        .unwrap();
    assert_eq!(report.bytes, size - 7);
    assert!(report.fallbacks.iter().all(|f| !f.from.contains("populate")), "{:?}", report.fallbacks);
    assert_pattern(&memory[offset..end], 7);
    assert!(memory[..offset].iter().chain(&memory[end..]).all(|&b| b == 0xa5));
}
