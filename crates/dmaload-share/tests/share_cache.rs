//! Sharing what was loaded, between real processes over a real socket:
//! `Buffer::send`/`receive`, and the cache service serving its clients
//! (hits, reloads, limits, huge pages, memory charged). Hostile clients,
//! users and failures: share_cache_hostile.rs. The service and most
//! clients are this test binary run again in a role
//! (`share/mod.rs`), so memfds, credentials and deaths are real.

// The core's test helpers, shared rather than copied.
#[path = "../../dmaload/tests/common/mod.rs"]
mod common;
mod share;

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_pattern, file_hash, scratch_dir, write_pattern_file};
use dmaload::share::protocol::{self, Reply};
use dmaload::share::{Connection, Listener, Served};
use dmaload::{Buffer, LoadOptions};
use dmaload_share::{CacheOutcome, Client};
use share::*;

/// Not a test of its own: this binary run again in a role (`share::process_role`).
#[test]
fn process_role() {
    share::process_role();
}

#[test]
fn a_buffer_crosses_to_another_process_bit_exact_and_private() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, (8 << 20) + 1234);
    let (mut buffer, _) = dmaload::load(&path, &LoadOptions::default()).unwrap();
    let socket = dir.path().join("s");
    let listener = Listener::bind(&socket, 1).unwrap();
    let mut child = role("receive", &socket).stdout(Stdio::piped()).spawn().unwrap();
    let conn = listener.accept().unwrap();
    conn.set_timeouts(Some(Duration::from_secs(60))).unwrap();
    buffer.send(&conn).unwrap();
    assert_eq!(read_role_line(&mut child), format!("hash={}", file_hash(&path)));
    let mut buf = [0u8; 16];
    let (len, _) = conn.recv(&mut buf).unwrap();
    assert_eq!(&buf[..len], b"written");
    assert!(child.wait().unwrap().success());
    // The receiver wrote every byte of its mapping; the sender's are the file's.
    assert_pattern(&buffer, 0);
    // The sender's own writes stay private now that the memfd is shared, so
    // the memfd no longer holds what the buffer shows: sending it again is
    // refused rather than handing out bytes the sender does not show.
    buffer[0] ^= 0xFF;
    let (a, _b) = Connection::pair().unwrap();
    let err = buffer.send(&a).unwrap_err();
    assert!(err.to_string().contains("no longer holds the bytes the buffer shows"), "{err}");
}

#[test]
fn forged_handoffs_are_refused() {
    let dir = scratch_dir();
    let (a, b) = Connection::pair().unwrap();
    let message = |offset: u64, len: u64| {
        protocol::encode(&Reply::Buffer(protocol::BufferInfo { offset, len, served: None, note: None }))
    };
    let file = File::create(dir.path().join("f")).unwrap();
    file.set_len(8192).unwrap();
    a.send(&message(0, 10), &[file.as_fd()]).unwrap();
    let err = Buffer::receive(&b).unwrap_err();
    assert!(err.to_string().contains("not a sealable memfd"), "{err}");

    // A memfd nobody sealed: its owner could write it under the receiver.
    let (loaded, _) = dmaload::load(dir.path().join("f"), &LoadOptions::default()).unwrap();
    let unsealed = loaded.into_memfd().map_err(|e| e.0).unwrap().unwrap();
    a.send(&message(0, 10), &[unsealed.as_fd()]).unwrap();
    let err = Buffer::receive(&b).unwrap_err();
    assert!(err.to_string().contains("not sealed"), "{err}");

    // Sealed, but the range runs past its end; and two descriptors.
    let (sealed, _) = dmaload::load(dir.path().join("f"), &LoadOptions::default()).unwrap();
    let fd = sealed.memfd().unwrap().unwrap();
    a.send(&message(4096, 8192), &[fd]).unwrap();
    let err = Buffer::receive(&b).unwrap_err();
    assert!(err.to_string().contains("run past the end"), "{err}");
    a.send(&message(0, 10), &[fd, fd]).unwrap();
    assert!(Buffer::receive(&b).unwrap_err().to_string().contains("2 descriptors"));
    a.send(b"{\"version\": 9}", &[fd]).unwrap();
    assert!(Buffer::receive(&b).unwrap_err().to_string().contains("protocol version 9"));
    a.send(&message(100, 10), &[fd]).unwrap();
    assert_eq!(Buffer::receive(&b).unwrap().len(), 10);
}

#[test]
fn the_service_hits_reloads_changed_files_and_keeps_clients_apart() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, (16 << 20) + 100);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is private to its user");

    // Two fresh processes: the first loads, the second is served from
    // memory, reading nothing from the disk (the file is evicted first).
    let hash = file_hash(&path);
    dmaload::pagecache::evict(&path).unwrap();
    let before = service.storage_reads();
    assert_eq!(run_client("get", &socket, &path), format!("served=miss hash={hash}"));
    let loaded = service.storage_reads();
    assert!(loaded - before >= 16 << 20, "the miss read the file ({} bytes)", loaded - before);
    dmaload::pagecache::evict(&path).unwrap();
    assert_eq!(run_client("get", &socket, &path), format!("served=hit hash={hash}"));
    assert_eq!(service.storage_reads(), loaded, "a hit reads nothing");
    let status = service.status();
    assert_eq!((status.misses, status.hits, status.files_cached), (1, 1, 1), "{status:?}");
    assert_eq!(status.files[0].bytes, (16 << 20) + 4096);
    // Both clients wrote 0xA5 over all of their bytes before exiting, and
    // a third still gets the file's: their writes were private.
    let client = Client::connect(&socket).unwrap();
    let mut first = client.get(&path).unwrap();
    let second = client.get(&path).unwrap();
    first.buffer[..4096].fill(0);
    assert_eq!(xxh3(&second.buffer), hash);
    assert_pattern(&second.buffer, 0);

    // Rewritten in place (same size): loaded again, never served stale.
    let mut file = File::options().write(true).open(&path).unwrap();
    file.write_all(b"new bytes").unwrap();
    drop(file);
    let hash = file_hash(&path);
    assert_eq!(run_client("get", &socket, &path), format!("served=miss hash={hash}"));
    // ... and replaced by another file at the same path.
    write_pattern_file(&dir.path().join("other"), 5000);
    std::fs::rename(dir.path().join("other"), &path).unwrap();
    assert_eq!(run_client("get", &socket, &path), format!("served=miss hash={}", file_hash(&path)));
    assert_eq!(service.status().misses, 3);
    assert!(service.memfds() >= 1);
    service.stop();
    assert!(!socket.exists(), "a clean stop removes the socket");
}

#[test]
fn concurrent_requests_load_a_file_once() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 64 << 20);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let hash = file_hash(&path);
    let served: Vec<Served> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    let fetched = Client::connect(&socket).unwrap().get(&path).unwrap();
                    assert_eq!(xxh3(&fetched.buffer), hash);
                    fetched.served
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(served.iter().filter(|&&s| s == Served::Miss).count(), 1, "{served:?}");
    let status = service.status();
    assert_eq!((status.misses, status.hits), (1, 3));
    assert_eq!(service.memfds(), 1);
}

#[test]
fn a_file_over_the_limit_is_loaded_for_one_client_at_a_time() {
    // Each request for a file larger than the memory limit is loaded for
    // its client and not kept: several at once take turns, so the service
    // never holds more than one such copy beyond its limit.
    const CLIENTS: usize = 4;
    let dir = scratch_dir();
    let path = dir.path().join("big.bin");
    write_pattern_file(&path, 64 << 20);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 20);
    let hash = file_hash(&path);
    let done = std::sync::atomic::AtomicBool::new(false);
    let start = std::sync::Barrier::new(CLIENTS + 1);
    let (most_held, notes) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            start.wait();
            let mut most = 0;
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                most = most.max(service.memfds());
            }
            most
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| {
                    let client = Client::connect(&socket).unwrap();
                    start.wait();
                    let fetched = client.get(&path).unwrap();
                    assert_eq!(fetched.served, Served::Uncached);
                    assert_eq!(xxh3(&fetched.buffer), hash);
                    fetched.note.unwrap()
                })
            })
            .collect();
        let notes: Vec<String> = clients.into_iter().map(|c| c.join().unwrap()).collect();
        done.store(true, std::sync::atomic::Ordering::Release);
        (sampler.join().unwrap(), notes)
    });
    assert!(most_held <= 1, "the service held {most_held} copies at once");
    assert!(notes.iter().all(|note| note.contains("not cached")), "{notes:?}");
    let status = service.status();
    assert_eq!((status.uncached, status.files_cached), (CLIENTS as u64, 0));
    assert_eq!(service.memfds(), 0);
}

#[test]
fn least_recently_used_files_are_dropped_under_the_limit() {
    let dir = scratch_dir();
    let mib = 1u64 << 20;
    let files: Vec<PathBuf> = ["a", "b", "c", "big"]
        .iter()
        .zip([mib, mib, mib, 4 * mib])
        .map(|(name, len)| {
            let path = dir.path().join(name);
            write_pattern_file(&path, len);
            path
        })
        .collect();
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 5 * mib / 2);
    let client = Client::connect(&socket).unwrap();
    let served = |i: usize| client.get(&files[i]).unwrap().served;
    assert_eq!(served(0), Served::Miss);
    assert_eq!(served(1), Served::Miss);
    assert_eq!(served(0), Served::Hit); // a is now more recent than b
    let held = client.get(&files[2]).unwrap(); // c evicts b, the least recently used
    assert_eq!(held.served, Served::Miss);
    assert_eq!(served(0), Served::Hit);
    let status = service.status();
    let cached: Vec<_> = status.files.iter().map(|f| f.path.file_name().unwrap().to_owned()).collect();
    assert_eq!(cached, ["a", "c"], "{status:?}");
    assert_eq!(status.evictions, 1);
    assert!(status.memory_used <= status.memory_limit);
    // Larger than the limit: loaded for the client, not kept, and said so.
    let big = client.get(&files[3]).unwrap();
    assert_eq!(big.served, Served::Uncached);
    assert!(big.note.as_deref().unwrap().contains("not cached"), "{:?}", big.note);
    assert_pattern(&big.buffer, 0);
    assert_eq!(served(1), Served::Miss); // b was dropped; c goes, the LRU
    assert_eq!(service.status().files_cached, 2);
    // Every memfd the service holds is a cached file's; dropped ones are
    // closed although `held` (c) still maps its pages.
    assert_eq!(service.memfds(), 2);
    assert_pattern(&held.buffer, 0);
}

#[test]
fn cached_files_leave_the_service_descriptors_to_serve_with() {
    // Each cached file holds a memfd. Under a small RLIMIT_NOFILE the
    // cache drops files before the service runs out of descriptors,
    // rather than failing every load (and accept) from then on.
    const NOFILE: u64 = 64;
    if !Command::new("prlimit").args(["--nofile=64", "true"]).status().is_ok_and(|s| s.success()) {
        return common::skip("cached_files_leave_the_service_descriptors_to_serve_with", "needs prlimit");
    }
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let mut service_role = role("service", &socket);
    service_role.env(LIMIT, (1u64 << 30).to_string());
    let mut cmd = through(&["prlimit", &format!("--nofile={NOFILE}")], &service_role);
    let service = ServiceProcess::start_with(&mut cmd, &socket);
    let client = Client::connect(&socket).unwrap();
    for i in 0..2 * NOFILE {
        let path = dir.path().join(format!("f{i}"));
        write_pattern_file(&path, 5000);
        let fetched = client.get(&path).unwrap_or_else(|err| panic!("file {i}: {err}"));
        assert_eq!(fetched.served, Served::Miss);
        assert_pattern(&fetched.buffer, 0);
    }
    let status = service.status();
    assert!(status.files_cached < NOFILE && status.evictions > 0, "{status:?}");
    assert_eq!(service.memfds() as u64, status.files_cached);
}

#[test]
fn cached_files_get_huge_pages_from_the_policy_or_a_collapse() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 16 << 20);
    let socket = dir.path().join("s");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let status = service.status();
    let huge_in_client = || {
        let out = run_client("get-touch", &socket, &path);
        let huge: u64 =
            out.split_whitespace().next().unwrap().strip_prefix("huge=").unwrap().parse().unwrap();
        (huge, out)
    };
    let (huge_bytes, out) = huge_in_client();
    let facts = dmaload::memory::MemoryFacts::read();
    if facts.huge_pages(dmaload::MemoryKind::MemfdHuge) {
        assert_eq!(status.memory_kind, "memfd-huge", "{}", status.memory_reason);
        // A client's first pass maps the service's 2 MiB pages whole.
        assert!(huge_bytes >= 8 << 20, "{huge_bytes} bytes of huge pages in the client: {out}");
        assert_eq!(service.status().files[0].pages, "2 MiB");
        return service.stop();
    }
    assert_eq!(status.memory_kind, "memfd", "{}", status.memory_reason);
    assert!(status.memory_reason.contains("shmem_enabled"), "{}", status.memory_reason);
    if !facts.collapses_shared() {
        println!("SKIP huge pages in the client: the shmem policy lets memfds have none here");
        assert_eq!((huge_bytes, service.status().files[0].pages.as_str()), (0, "4 KiB"));
        return service.stop();
    }
    // 4 KiB pages first, collapsed into 2 MiB pages behind the first client.
    let started = Instant::now();
    let pages = loop {
        let pages = service.status().files[0].pages.clone();
        if !pages.contains("collapsing") || started.elapsed() > Duration::from_secs(60) {
            break pages;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if pages != "2 MiB" {
        println!("SKIP huge pages in the client: the kernel did not collapse the memfd: {pages}");
        return service.stop();
    }
    let (huge_bytes, out) = huge_in_client();
    assert_eq!(huge_bytes, 16 << 20, "every 2 MiB mapped whole in the client: {out}");
    // The bytes are the file's, and still sealed against writers.
    assert_eq!(run_client("get", &socket, &path), format!("served=hit hash={}", file_hash(&path)));
    service.stop();
}

#[test]
fn a_cached_load_reads_the_file_it_opened_whatever_the_path_becomes() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, (4 << 20) + 5);
    let hash = file_hash(&path);
    let opened = dmaload::OpenFile::open(&path).unwrap();
    // Another file renamed over the path after the open.
    let other = dir.path().join("other");
    std::fs::write(&other, vec![0x5Au8; 4096]).unwrap();
    std::fs::rename(&other, &path).unwrap();
    // No service: the direct load reads the opened file, not the path.
    let absent = dir.path().join("absent.sock");
    let (buffer, _, outcome) = dmaload_share::CacheRequest::open(&opened, &absent).to_buffer().unwrap();
    assert!(matches!(outcome, CacheOutcome::Direct { .. }), "{outcome:?}");
    assert_eq!(xxh3(&buffer), hash);
    // A service gets a descriptor of the opened file too.
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let (buffer, _, outcome) = dmaload_share::CacheRequest::open(&opened, &socket).to_buffer().unwrap();
    assert!(matches!(outcome, CacheOutcome::Service { served: Served::Miss, .. }), "{outcome:?}");
    assert_eq!(xxh3(&buffer), hash);
    service.stop();
}

/// `CacheRequest::load` goes where `options.to` says: host memory from
/// the service, and a dma-buf refused before anything is asked (the
/// service serves none), naming the destination.
#[test]
fn a_cache_request_loads_where_its_options_say_and_refuses_a_dmabuf() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, (2 << 20) + 7);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let opened = dmaload::OpenFile::open(&path).unwrap();
    let (loaded, report, outcome) = dmaload_share::CacheRequest::open(&opened, &socket).load().unwrap();
    assert!(matches!(outcome, CacheOutcome::Service { served: Served::Miss, .. }), "{outcome:?}");
    assert!(report.destination.starts_with("cache-service"), "{}", report.destination);
    match loaded {
        dmaload::Loaded::Host(buffer) => assert_eq!(xxh3(&buffer), file_hash(&path)),
        _ => panic!("a host load gave something else"),
    }
    let options = LoadOptions { to: "udmabuf".parse().unwrap(), ..LoadOptions::default() };
    let err = dmaload_share::CacheRequest::open(&opened, &socket).options(&options).load().unwrap_err();
    assert_eq!(err.kind(), dmaload::ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("not udmabuf"), "{err}");
    // Nothing was asked of the service for it: still one file, one load.
    let status = Client::connect(&socket).unwrap().status().unwrap();
    assert_eq!((status.files_cached, status.hits, status.misses), (1, 0, 1), "{status:?}");
    service.stop();
}

#[test]
fn a_file_dropped_from_the_cache_stops_collapsing() {
    let facts = dmaload::memory::MemoryFacts::read();
    if facts.huge_pages(dmaload::MemoryKind::MemfdHuge) || !facts.collapses_shared() {
        println!("SKIP collapse: cached files get 2 MiB pages from the shmem policy, or none can be had");
        return;
    }
    let dir = scratch_dir();
    let mib = 1u64 << 20;
    // Three collapse windows each; room for one of them.
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    write_pattern_file(&a, 192 * mib);
    write_pattern_file(&b, 192 * mib);
    let socket = dir.path().join("cache.sock");
    let mut cmd = role("service", &socket);
    cmd.env(LIMIT, (300 * mib).to_string()).stderr(Stdio::piped());
    let mut service = ServiceProcess::start_with(&mut cmd, &socket);
    let log = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let stderr = BufReader::new(service.child.stderr.take().unwrap());
    let lines = Arc::clone(&log);
    std::thread::spawn(move || {
        stderr.lines().map_while(|l| l.ok()).for_each(|l| lines.lock().unwrap().push(l))
    });
    let client = Client::connect(&socket).unwrap();
    let (hash_a, hash_b) = (file_hash(&a), file_hash(&b));
    let got = client.get(&a).unwrap();
    assert_eq!((got.served, xxh3(&got.buffer)), (Served::Miss, hash_a));
    // b evicts a, whose collapse has just begun; a stays mapped here.
    let got_b = client.get(&b).unwrap();
    assert_eq!((got_b.served, xxh3(&got_b.buffer)), (Served::Miss, hash_b));
    let a_name = a.display().to_string();
    let ended = |line: &String| {
        line.contains(&a_name)
            && (line.contains("collapse") || line.contains("collapsing"))
            && !line.contains(": get ")
    };
    let started = Instant::now();
    while !log.lock().unwrap().iter().any(ended) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no end of a's collapse: {:?}",
            log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = log.lock().unwrap().clone();
    assert!(log.iter().any(|l| l.contains(&format!("evicted {a_name} "))), "{log:?}");
    // The thread looks between windows (the unit tests of `collapse_windows`
    // check that it stops): one whose last window was under way when the
    // eviction came finishes it, and a stopped one says how far it got.
    let end = log.iter().find(|l| ended(l)).unwrap();
    match end.split_once(&format!("stopped collapsing {a_name} after ")) {
        Some((_, rest)) => {
            let done: u64 = rest.split_whitespace().next().unwrap().parse().unwrap();
            assert!(done < 192 * mib, "{end}");
        }
        None => {
            assert!(end.contains(&format!("collapsed {a_name} into 2 MiB pages")), "{log:?}");
            println!(
                "SKIP stopping a collapse: its last window was under way when the eviction came: {log:?}"
            );
        }
    }
    assert_eq!(service.memfds(), 1);
    assert_eq!(xxh3(&got.buffer), hash_a);
    assert_eq!(client.get(&b).unwrap().served, Served::Hit);
    service.stop();
}

#[test]
fn a_file_replaced_by_rename_with_the_same_size_and_times_is_loaded_again() {
    // A writer that builds a new file beside the old one, gives it the old
    // one's size and mtime, and renames it over the old one: a new inode,
    // so the key differs and the client gets the new bytes, never the
    // cached old ones.
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let client = || Client::connect(&socket).unwrap();
    assert_eq!(client().get(&path).unwrap().served, Served::Miss);
    let old = std::fs::metadata(&path).unwrap();
    let staged = dir.path().join("model.bin.new");
    std::fs::write(&staged, vec![0x5Au8; 100_000]).unwrap();
    File::options().write(true).open(&staged).unwrap().set_modified(old.modified().unwrap()).unwrap();
    std::fs::rename(&staged, &path).unwrap();
    let fetched = client().get(&path).unwrap();
    assert_eq!(fetched.served, Served::Miss);
    assert!(fetched.buffer.iter().all(|&b| b == 0x5A));
    service.stop();
}

#[test]
fn cached_memory_is_charged_to_the_service_and_a_client_can_keep_it_past_the_limit() {
    // The service runs in a memory cgroup of its own. A cached file's pages
    // are charged there (the service populated them), not to the client
    // that maps them; a client that still maps a file the service dropped
    // keeps those pages, and their charge, past --memory-limit until it
    // unmaps. (What the README promises under "Memory charged".)
    const NAME: &str = "cached_memory_is_charged_to_the_service_and_a_client_can_keep_it_past_the_limit";
    let Some(cgroup) = common::memory_cgroup_child("dmaload-cache-charge", 1 << 30) else {
        return common::skip(
            NAME,
            "cannot create a child memory cgroup here (needs root and a memory controller)",
        );
    };
    let mib = 1u64 << 20;
    let dir = scratch_dir();
    let files: Vec<PathBuf> = ["a", "b"]
        .iter()
        .map(|name| {
            let path = dir.path().join(name);
            write_pattern_file(&path, 8 * mib);
            path
        })
        .collect();
    let socket = dir.path().join("cache.sock");
    let mut cmd = cgroup.command(role("service", &socket).env(LIMIT, (12 * mib).to_string()));
    let service = ServiceProcess::start_with(&mut cmd, &socket);
    let before = cgroup.usage();
    // The cgroup's usage is not the files' pages alone: the kernel charges
    // and uncharges through per-CPU stocks of up to 64 pages (256 KiB of
    // 4 KiB pages on each CPU the service ran on), and the service's own
    // memory (a freed stack, kernel objects) moves between two readings.
    // Once it read 8 KiB short of 8 MiB for an 8 MiB file. A file not
    // charged to the service would leave the rise near 0, so an eighth of
    // a file below its size still tells the promise from its breach.
    let slack = mib;
    let client = Client::connect(&socket).unwrap();
    let held = client.get(&files[0]).unwrap();
    assert_eq!(held.served, Served::Miss);
    let with_a = cgroup.usage();
    assert!(
        with_a + slack >= before + 8 * mib,
        "a's pages are not charged to the service: {before} -> {with_a}"
    );
    // b evicts a (16 MiB would pass the 12 MiB limit), but `held` maps a.
    assert_eq!(client.get(&files[1]).unwrap().served, Served::Miss);
    let status = service.status();
    assert_eq!((status.files_cached, status.evictions), (1, 1), "{status:?}");
    assert!(status.memory_used <= status.memory_limit);
    let with_both = cgroup.usage();
    assert!(
        with_both + slack >= before + 16 * mib,
        "a's pages left with its eviction: {before} -> {with_both}"
    );
    assert_pattern(&held.buffer, 0);
    // Unmapped, a's memfd has no user left: its pages and charge go.
    drop(held);
    let started = Instant::now();
    while cgroup.usage() > with_both - 6 * mib {
        assert!(started.elapsed() < Duration::from_secs(60), "a's pages outlived the last mapping");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(client);
    service.stop();
}

/// A cached load with `verify` reads the file itself (the service does not
/// verify), says so, and still fails on a flipped byte.
#[test]
fn a_cached_load_with_verify_loads_directly_and_verifies() {
    const M: usize = 1 << 20;
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 2 * M as u64 + 1);
    let sums = Command::new("sha256sum").arg("f").current_dir(dir.path()).output().unwrap();
    assert!(sums.status.success());
    std::fs::write(dir.path().join("SHA256SUMS"), sums.stdout).unwrap();
    let socket = dir.path().join("no-service");
    let options = LoadOptions { verify: true, ..LoadOptions::default() };
    let (buffer, _, outcome) = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload_share::CacheRequest::open(&file, &socket).options(&options).to_buffer())
        .unwrap();
    assert_eq!(buffer.len(), 2 * M + 1);
    match outcome {
        CacheOutcome::Direct { reason } => assert!(reason.contains("does not verify"), "{reason}"),
        CacheOutcome::Service { .. } => panic!("a verified load was served"),
    }
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[M] ^= 0x20;
    std::fs::write(&path, bytes).unwrap();
    let err = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload_share::CacheRequest::open(&file, &socket).options(&options).to_buffer())
        .unwrap_err();
    assert_eq!(err.kind(), dmaload::ErrorKind::Corrupt, "{err}");
}
