//! Hostile and careless input to `load`: special files, files replaced or
//! rewritten under the loader, cancellation, slow callbacks, memory limits.

mod common;

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::{assert_pattern, pattern_byte, scratch_dir, skip, write_pattern_file};
use dmaload::{CancelToken, Engine, ErrorKind, LoadOptions};

fn options(engine: Engine) -> LoadOptions {
    LoadOptions { engine, ..LoadOptions::default() }
}

/// Runs `load` on another thread and fails the test if it has not returned
/// within a generous bound: a hang is the bug these tests look for.
fn load_or_hang(path: &Path) -> dmaload::Result<(dmaload::Buffer, dmaload::LoadReport)> {
    let (tx, rx) = mpsc::channel();
    let path = path.to_owned();
    std::thread::spawn(move || {
        let _ = tx.send(dmaload::load(&path, &LoadOptions::default()));
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("load hung instead of returning an error")
}

#[test]
fn fifo_is_refused_without_blocking() {
    let dir = scratch_dir();
    let fifo = dir.path().join("fifo");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(status.success());
    // Nobody ever opens the other end: an open(O_RDONLY) would block forever.
    let err = load_or_hang(&fifo).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("FIFO"), "{err}");
    // The info and residency helpers take the same open.
    let err = dmaload::pagecache::residency(&fifo).unwrap_err();
    assert!(err.to_string().contains("FIFO"), "{err}");
}

#[test]
fn devices_and_sockets_are_refused_by_type_and_directories_by_errno() {
    let dir = scratch_dir();
    let err = load_or_hang(Path::new("/dev/null")).unwrap_err();
    assert!(err.to_string().contains("character device"), "{err}");
    let err = load_or_hang(Path::new("/dev/zero")).unwrap_err();
    assert!(err.to_string().contains("character device"), "{err}");
    let err = load_or_hang(dir.path()).unwrap_err();
    assert_eq!(err.errno(), libc::EISDIR, "{err}");
    let socket_path = dir.path().join("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket_path).unwrap();
    let err = load_or_hang(&socket_path).unwrap_err();
    assert!(err.to_string().contains("socket"), "{err}");
}

#[test]
fn symlinks_are_followed_to_the_file() {
    let dir = scratch_dir();
    let target = dir.path().join("target.bin");
    write_pattern_file(&target, 100_003);
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (buffer, _) = dmaload::load(&link, &LoadOptions::default()).unwrap();
    assert_eq!(buffer.len(), 100_003);
    assert_pattern(&buffer, 0);
}

#[test]
fn pseudo_filesystem_files_are_refused_with_the_reason() {
    for path in ["/proc/self/status", "/sys/kernel/mm/transparent_hugepage/enabled"] {
        if !Path::new(path).exists() {
            continue;
        }
        let err = dmaload::load(path, &LoadOptions::default()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("copy it to a regular file"), "{err}");
    }
}

#[test]
fn a_file_renamed_over_the_path_never_mixes_length_and_bytes() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    // Two files of different lengths and contents, swapped in by rename as
    // atomic savers do, as fast as possible while the loads run.
    let short = dir.path().join("short.bin");
    let long = dir.path().join("long.bin");
    let (short_len, long_len) = (3u64 << 20, (5u64 << 20) + 4097);
    std::fs::write(&short, vec![0xAAu8; short_len as usize]).unwrap();
    std::fs::write(&long, vec![0x55u8; long_len as usize]).unwrap();
    std::fs::copy(&short, &path).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let renames = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (stop, renames, dir, path) = (stop.clone(), renames.clone(), dir.path().to_owned(), path.clone());
        std::thread::spawn(move || {
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let source = if k % 2 == 0 { &long } else { &short };
                let staged = dir.join(format!("staged-{k}"));
                std::fs::copy(source, &staged).unwrap();
                std::fs::rename(&staged, &path).unwrap();
                renames.fetch_add(1, Ordering::Relaxed);
                k += 1;
            }
        })
    };
    let mut loads = 0;
    while loads < 60 || renames.load(Ordering::Relaxed) < 20 {
        let engine = Engine::ALL[loads % Engine::ALL.len()];
        match dmaload::load(&path, &options(engine)) {
            Ok((buffer, _)) => {
                let expected = match buffer.len() as u64 {
                    n if n == short_len => 0xAA,
                    n if n == long_len => 0x55,
                    n => panic!("{engine:?}: loaded {n} bytes, neither file's length"),
                };
                assert!(
                    buffer.iter().all(|&b| b == expected),
                    "{engine:?}: a {}-byte buffer holds bytes of the other file",
                    buffer.len()
                );
            }
            // The file opened was unlinked, not changed: there is no error to expect.
            Err(err) => panic!("{engine:?}: {err}"),
        }
        loads += 1;
        if loads > 2000 {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    assert!(renames.load(Ordering::Relaxed) >= 20, "the file was hardly ever replaced");
}

#[test]
fn a_file_rewritten_in_place_during_the_load_is_an_error() {
    let dir = scratch_dir();
    for engine in Engine::ALL {
        let path = dir.path().join(format!("rewritten-{}", engine.name()));
        let size = 8u64 << 20;
        write_pattern_file(&path, size);
        let writer = OpenOptions::new().write(true).open(&path).unwrap();
        let written = Arc::new(AtomicBool::new(false));
        let flag = written.clone();
        let opts = LoadOptions {
            chunk_size: 1 << 20,
            // Same size, new bytes at the start: only the timestamps tell.
            progress: Some(Arc::new(move |_done, _total| {
                if !flag.swap(true, Ordering::SeqCst) {
                    writer.write_all_at(&[0xEE; 4096], 0).unwrap();
                }
            })),
            ..options(engine)
        };
        let err = dmaload::load(&path, &opts).unwrap_err();
        assert!(written.load(Ordering::SeqCst));
        assert_eq!(err.kind(), ErrorKind::Changed, "{engine:?}: {err}");
        assert_eq!(err.errno(), libc::ESTALE);
        assert!(err.to_string().contains("written during the load"), "{err}");
    }
}

#[test]
fn an_unchanged_file_loads_even_when_the_path_is_replaced_after_the_open() {
    // Replacing the path is not a change of the file that was opened.
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 4 << 20);
    let replacement = dir.path().join("new.bin");
    std::fs::write(&replacement, b"something else").unwrap();
    let replaced = Arc::new(AtomicBool::new(false));
    let (flag, victim) = (replaced.clone(), path.clone());
    let opts = LoadOptions {
        progress: Some(Arc::new(move |_, _| {
            if !flag.swap(true, Ordering::SeqCst) {
                std::fs::rename(&replacement, &victim).unwrap();
            }
        })),
        ..LoadOptions::default()
    };
    let (buffer, _) = dmaload::load(&path, &opts).unwrap();
    assert!(replaced.load(Ordering::SeqCst));
    assert_eq!(buffer.len(), 4 << 20);
    assert_pattern(&buffer, 0);
}

#[test]
fn cancelling_stops_the_load_before_the_end_and_hands_out_nothing() {
    let dir = scratch_dir();
    let path = dir.path().join("big.bin");
    let size = 64u64 << 20;
    write_pattern_file(&path, size);
    for engine in Engine::ALL {
        dmaload::pagecache::evict(&path).unwrap();
        let token = CancelToken::new();
        let (canceller, seen) = (token.clone(), Arc::new(AtomicU64::new(0)));
        let last = seen.clone();
        let opts = LoadOptions {
            // Small reads at depth 1: the load takes many requests.
            chunk_size: 64 << 10,
            queue_depth: 1,
            threads: 1,
            mode: dmaload::IoMode::Direct,
            cancel: token,
            progress: Some(Arc::new(move |done, _| {
                last.store(done, Ordering::SeqCst);
                canceller.cancel();
            })),
            ..options(engine)
        };
        let err = dmaload::load(&path, &opts).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled, "{engine:?}: {err}");
        assert_eq!(err.errno(), libc::ECANCELED);
        let stopped_at = err.offset().expect("a cancelled load names where it stopped");
        assert!(stopped_at < size, "{engine:?}: stopped at {stopped_at} of {size}");
        assert!(seen.load(Ordering::SeqCst) < size, "{engine:?}: every byte had been read");
    }
}

#[test]
fn a_token_cancelled_before_the_load_starts_reads_nothing() {
    let dir = scratch_dir();
    let path = dir.path().join("f.bin");
    write_pattern_file(&path, 1 << 20);
    let token = CancelToken::new();
    token.cancel();
    let err = dmaload::load(&path, &LoadOptions { cancel: token, ..LoadOptions::default() }).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
}

#[test]
fn a_slow_progress_callback_does_not_serialize_the_reads() {
    let dir = scratch_dir();
    let path = dir.path().join("f.bin");
    let size = 32u64 << 20;
    write_pattern_file(&path, size);
    dmaload::pagecache::evict(&path).unwrap();
    // The first progress call blocks until every byte of the file has been
    // read (buffered reads leave it in the page cache, which another thread
    // watches): called on the read path, it would stop the reads behind it
    // and never be released.
    let (read_all, released) = mpsc::channel::<()>();
    let released = std::sync::Mutex::new(released);
    let waited_for_the_reads = Arc::new(AtomicBool::new(false));
    let first = Arc::new(AtomicBool::new(true));
    let (flag, is_first) = (waited_for_the_reads.clone(), first.clone());
    let opts = LoadOptions {
        mode: dmaload::IoMode::Buffered,
        chunk_size: 256 << 10,
        progress: Some(Arc::new(move |_, _| {
            if is_first.swap(false, Ordering::SeqCst) {
                // The timeout only bounds a failure.
                let outcome = released.lock().unwrap().recv_timeout(Duration::from_secs(120));
                flag.store(outcome.is_ok(), Ordering::SeqCst);
            }
        })),
        ..LoadOptions::default()
    };
    let watcher = {
        let path = path.clone();
        std::thread::spawn(move || loop {
            if dmaload::pagecache::residency(&path).unwrap().resident_bytes == size {
                let _ = read_all.send(());
                return;
            }
            std::thread::yield_now();
        })
    };
    let (buffer, _) = dmaload::load(&path, &opts).unwrap();
    assert_pattern(&buffer, 0);
    assert!(!first.load(Ordering::SeqCst), "the callback was never called");
    assert!(waited_for_the_reads.load(Ordering::SeqCst), "the reads stopped while the progress callback ran");
    watcher.join().unwrap();
}

#[test]
fn a_range_memfd_holds_zeros_outside_the_range() {
    let dir = scratch_dir();
    let path = dir.path().join("f.bin");
    write_pattern_file(&path, 3 << 20);
    let (offset, len) = (4096 * 5 + 1234, 100_000u64);
    let (buffer, report) = dmaload::LoadRequest::path(&path).range(offset, len).to_buffer().unwrap();
    assert_eq!(report.cache, dmaload::CachePolicy::Bypass, "this test needs direct I/O");
    assert_pattern(&buffer, offset);
    let memfd = std::fs::File::from(buffer.memfd().unwrap().unwrap().try_clone_to_owned().unwrap());
    let mut whole = Vec::new();
    let mut reader = &memfd;
    reader.seek(SeekFrom::Start(0)).unwrap();
    std::io::Read::read_to_end(&mut reader, &mut whole).unwrap();
    let start = buffer.memfd_offset();
    assert!(start > 0, "direct I/O aligned the range down");
    assert!(whole[..start].iter().all(|&b| b == 0), "bytes before the range are visible");
    assert!(whole[start + len as usize..].iter().all(|&b| b == 0), "bytes after the range are visible");
    assert_eq!(whole[start], pattern_byte(offset));
}

#[test]
fn an_empty_file_loads_without_fallbacks() {
    let dir = scratch_dir();
    let path = dir.path().join("empty");
    std::fs::File::create(&path).unwrap().flush().unwrap();
    for engine in Engine::ALL {
        let (buffer, report) = dmaload::load(&path, &options(engine)).unwrap();
        assert!(buffer.is_empty());
        assert!(report.fallbacks.is_empty(), "{engine:?}: {:?}", report.fallbacks);
        assert_eq!(report.engine, engine);
    }
}

#[test]
fn a_memory_cgroup_limit_is_checked_before_loading() {
    let name = "a_memory_cgroup_limit_is_checked_before_loading";
    let Some(cgroup) = common::memory_cgroup_child("dmaload-hostile-test", 64 << 20) else {
        return skip(name, "no writable memory cgroup (needs root and a cgroup v1 memory or v2 hierarchy)");
    };
    let dir = scratch_dir();
    let path = dir.path().join("f.bin");
    write_pattern_file(&path, 100 << 20);
    let bin = std::env::current_exe().unwrap();
    // This test binary, run again inside the cgroup with only the child test.
    let out = cgroup
        .run(
            std::process::Command::new(bin)
                .args(["--exact", "cgroup_child_loads", "--nocapture"])
                .env("DMALOAD_CGROUP_CHILD_FILE", &path),
        )
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("CHILD-REFUSED"), "{stdout}");
}

/// The child half of the cgroup test: does nothing unless run by it.
#[test]
fn cgroup_child_loads() {
    let Some(path) = std::env::var_os("DMALOAD_CGROUP_CHILD_FILE") else { return };
    let err = dmaload::load(&path, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert!(err.to_string().contains("memory cgroup"), "{err}");
    println!("CHILD-REFUSED");
}

#[test]
fn a_load_from_an_open_fd_reads_that_file_and_leaves_the_fd_as_it_was() {
    let dir = scratch_dir();
    let path = dir.path().join("f.bin");
    write_pattern_file(&path, (3 << 20) + 77);
    let file = std::fs::File::open(&path).unwrap();
    // The path now names another file: the fd is what counts.
    std::fs::rename(&path, dir.path().join("moved.bin")).unwrap();
    std::fs::write(&path, b"another file").unwrap();
    let flags = || {
        std::fs::read_to_string(format!("/proc/self/fdinfo/{}", std::os::fd::AsRawFd::as_raw_fd(&file)))
            .unwrap()
            .lines()
            .find(|l| l.starts_with("flags:"))
            .unwrap()
            .to_owned()
    };
    let before = flags();
    let (buffer, report) = dmaload::LoadRequest::fd(std::os::fd::AsFd::as_fd(&file)).to_buffer().unwrap();
    assert_eq!(buffer.len(), (3 << 20) + 77);
    assert_pattern(&buffer, 0);
    assert_eq!(report.cache, dmaload::CachePolicy::Bypass);
    assert_eq!(flags(), before, "the caller's fd flags changed (O_DIRECT leaked)");
    let (range, _) = dmaload::LoadRequest::fd(std::os::fd::AsFd::as_fd(&file))
        .range(1000, Some(5000))
        .to_buffer()
        .unwrap();
    assert_pattern(&range, 1000);
    // A FIFO's fd is refused by type, without reading.
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let reader = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    let err = dmaload::LoadRequest::fd(std::os::fd::AsFd::as_fd(&reader)).to_buffer().unwrap_err();
    assert!(err.to_string().contains("FIFO"), "{err}");
}
