//! Sharing what was loaded, between real processes over a real socket:
//! `Buffer::send`/`receive`, and the cache service with its clients. The
//! service and most clients are this test binary run again in a role (see
//! `process_role`), so memfds, credentials and deaths are real.

mod common;

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_pattern, file_hash, scratch_dir, write_pattern_file};
use dmaload::share::protocol::{self, Reply, Request};
use dmaload::share::service::{DEFAULT_IDLE_TIMEOUT, MAX_CLIENTS_PER_UID};
use dmaload::share::{CacheOutcome, Client, Connection, Listener, Served, Service, ServiceConfig};
use dmaload::{Buffer, ErrorKind, LoadOptions};

const ROLE: &str = "DMALOAD_SHARE_CACHE_ROLE";
const SOCKET: &str = "DMALOAD_SHARE_CACHE_SOCKET";
const FILE: &str = "DMALOAD_SHARE_CACHE_FILE";
const LIMIT: &str = "DMALOAD_SHARE_CACHE_LIMIT";
const ALLOW_UID: &str = "DMALOAD_SHARE_CACHE_ALLOW_UID";
const IDLE_MS: &str = "DMALOAD_SHARE_CACHE_IDLE_MS";

fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Not a test of its own: what this binary does when run again with
/// `ROLE` set: `service` (serves until its stdin closes), `receive` (takes
/// a buffer from the listener at `SOCKET`), `get` (asks the service for
/// `FILE` and prints how it was served and the bytes' hash), `get-touch`
/// (gets `FILE`, reads a byte of every page, prints the bytes mapped with
/// huge pages), `hang` (sends
/// a request and never reads the reply), `load-cached` (prints where
/// `share::cached` got `FILE` from).
#[test]
fn process_role() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let socket = PathBuf::from(std::env::var(SOCKET).unwrap());
    let file = std::env::var(FILE).map(PathBuf::from);
    match role.as_str() {
        "service" => {
            let limit = std::env::var(LIMIT).unwrap().parse().unwrap();
            let service = Service::bind(ServiceConfig {
                socket,
                memory_limit: limit,
                allow_uids: std::env::var(ALLOW_UID).into_iter().map(|uid| uid.parse().unwrap()).collect(),
                allow_gids: Vec::new(),
                load_options: LoadOptions::default(),
                idle_timeout: std::env::var(IDLE_MS)
                    .map_or(DEFAULT_IDLE_TIMEOUT, |ms| Duration::from_millis(ms.parse().unwrap())),
                log: Arc::new(|line| eprintln!("service: {line}")),
            })
            .unwrap();
            service.run(std::io::stdin().as_fd()).unwrap();
        }
        "receive" => {
            let conn = Connection::connect(&socket).unwrap();
            let mut buffer = Buffer::receive(&conn).unwrap();
            println!("OUT hash={}", xxh3(&buffer));
            // Private copy-on-write: the sender must not see this.
            buffer.fill(0xA5);
            conn.send(b"written", &[]).unwrap();
        }
        "get" => {
            let client = Client::connect(&socket).unwrap();
            let mut fetched = client.get(file.unwrap()).unwrap();
            println!("OUT served={} hash={}", fetched.served.name(), xxh3(&fetched.buffer));
            fetched.buffer.fill(0xA5);
        }
        "get-touch" => {
            let fetched = Client::connect(&socket).unwrap().get(file.unwrap()).unwrap();
            let touched: u64 = fetched.buffer.iter().step_by(4096).map(|&b| u64::from(b)).sum();
            println!("OUT huge={} touched={touched}", fetched.buffer.huge_page_bytes().unwrap());
        }
        "hang" => {
            let conn = Connection::connect(&socket).unwrap();
            let file = File::open(file.unwrap()).unwrap();
            conn.send(&protocol::encode_request(Request::Get), &[file.as_fd()]).unwrap();
            println!("OUT sent");
            std::thread::sleep(Duration::from_secs(120));
        }
        "status" => {
            let status = Client::connect(&socket).unwrap().status().unwrap();
            let paths: Vec<String> = status.files.iter().map(|f| f.path.display().to_string()).collect();
            println!("OUT files={} paths={}", status.files_cached, paths.join(","));
        }
        "hold" => {
            // As many connections as one user may hold, each counted by
            // the service (it answered a status on it), until stdin closes.
            let held: Vec<Client> = (0..MAX_CLIENTS_PER_UID)
                .map(|_| {
                    let client = Client::connect(&socket).unwrap();
                    client.status().unwrap();
                    client
                })
                .collect();
            println!("OUT held {}", held.len());
            std::io::copy(&mut std::io::stdin(), &mut std::io::sink()).unwrap();
        }
        "load-cached" => {
            let (buffer, _, outcome) = dmaload::OpenFile::open(file.unwrap())
                .and_then(|file| dmaload::share::cached(&file, &socket, &LoadOptions::default()))
                .unwrap();
            match outcome {
                CacheOutcome::Service { served, .. } => {
                    println!("OUT service {} {}", served.name(), xxh3(&buffer))
                }
                CacheOutcome::Direct { reason } => println!("OUT direct {} ({reason})", xxh3(&buffer)),
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn role(role: &str, socket: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "process_role", "--nocapture", "--test-threads=1", "--quiet"])
        .env(ROLE, role)
        .env(SOCKET, socket);
    cmd
}

/// `cmd` run through another program (`prlimit`, `setpriv`) and its
/// arguments, which execs it with the same environment.
fn through(program: &[&str], cmd: &Command) -> Command {
    let mut wrapped = Command::new(program[0]);
    // The program, where another user (setpriv) can run it too.
    wrapped
        .args(&program[1..])
        .arg(common::reachable::reachable_by_others(Path::new(cmd.get_program())))
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            wrapped.env(key, value);
        }
    }
    wrapped
}

/// Runs a client role to completion; its stdout's first line.
fn run_client(role_name: &str, socket: &Path, file: &Path) -> String {
    let out = role(role_name, socket).env(FILE, file).output().unwrap();
    assert!(out.status.success(), "{role_name} failed: {}", String::from_utf8_lossy(&out.stderr));
    role_output(&String::from_utf8_lossy(&out.stdout))
}

/// What a role printed (its lines start with `OUT `; the rest is libtest's).
fn role_output(stdout: &str) -> String {
    stdout.lines().find_map(|line| line.strip_prefix("OUT ")).unwrap_or_default().to_owned()
}

/// The role's first line, read as soon as it is printed.
fn read_role_line(child: &mut Child) -> String {
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            return String::new();
        }
        if let Some(out) = line.trim_end().strip_prefix("OUT ") {
            // Keep reading, so the role's later output never meets a closed pipe.
            std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
            return out.to_owned();
        }
    }
}

/// A service running in its own process, stopped (stdin closed) on drop.
struct ServiceProcess {
    child: Child,
    socket: PathBuf,
}

impl ServiceProcess {
    fn start(socket: &Path, limit: u64) -> ServiceProcess {
        Self::start_with(role("service", socket).env(LIMIT, limit.to_string()), socket)
    }

    fn start_with(cmd: &mut Command, socket: &Path) -> ServiceProcess {
        let child = cmd.stdin(Stdio::piped()).spawn().unwrap();
        let started = Instant::now();
        while Connection::connect(socket).is_err() {
            assert!(started.elapsed() < Duration::from_secs(60), "the service did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        ServiceProcess { child, socket: socket.to_owned() }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn status(&self) -> dmaload::share::Status {
        Client::connect(&self.socket).unwrap().status().unwrap()
    }

    /// Bytes the service has read from storage (`read_bytes` of
    /// `/proc/PID/io`: every thread's block I/O, direct reads included).
    fn storage_reads(&self) -> u64 {
        let io = std::fs::read_to_string(format!("/proc/{}/io", self.pid())).unwrap();
        io.lines().find_map(|l| l.strip_prefix("read_bytes: ")).unwrap().trim().parse().unwrap()
    }

    /// The memfds the service holds open, each counted once however many
    /// descriptors it has open on it (a loaded buffer's fork registry keeps
    /// a second one).
    fn memfds(&self) -> usize {
        use std::os::unix::fs::MetadataExt;
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .filter_map(|entry| {
                let path = entry.ok()?.path();
                let target = std::fs::read_link(&path).ok()?;
                let memfd = target.to_string_lossy().starts_with("/memfd:");
                memfd.then(|| std::fs::metadata(&path).ok().map(|meta| meta.ino())).flatten()
            })
            .collect::<std::collections::BTreeSet<u64>>()
            .len()
    }

    fn stop(mut self) {
        drop(self.child.stdin.take());
        assert!(self.child.wait().unwrap().success(), "the service failed");
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
fn idle_connections_cannot_lock_a_client_out() {
    // One buggy process opens as many connections as the service serves
    // at once and never sends on them: the service closes them after its
    // idle timeout, and a client asking meanwhile is refused (and would
    // load directly) only until then, not for minutes.
    const MAX_CLIENTS: usize = 256;
    // Long enough for a loaded machine to start all their threads.
    const IDLE: Duration = Duration::from_secs(10);
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 1 << 20);
    let socket = dir.path().join("cache.sock");
    let mut cmd = role("service", &socket);
    cmd.env(LIMIT, (1u64 << 30).to_string()).env(IDLE_MS, IDLE.as_millis().to_string());
    let _service = ServiceProcess::start_with(&mut cmd, &socket);
    let idle: Vec<Connection> = (0..MAX_CLIENTS).map(|_| Connection::connect(&socket).unwrap()).collect();
    let started = Instant::now();
    // Their threads start in the service: full once a client is refused.
    let refused = |result: Result<(), dmaload::Error>| match result {
        Ok(()) => false,
        Err(err)
            if err.to_string().contains("clients are connected already")
                || err.to_string().contains("connections already, as many as one user may hold") =>
        {
            true
        }
        Err(err) => panic!("{err}"),
    };
    while !refused(Client::connect(&socket).and_then(|client| client.status()).map(drop)) {
        assert!(started.elapsed() < IDLE, "the idle connections did not fill the client slots");
        std::thread::sleep(Duration::from_millis(10));
    }
    let fetched = loop {
        let result = Client::connect(&socket).and_then(|client| client.get(&path));
        match result {
            Ok(fetched) => break fetched,
            Err(err) => assert!(refused(Err(err))),
        }
        assert!(started.elapsed() < 15 * IDLE, "refused for {:?} behind idle connections", started.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(fetched.served, Served::Miss);
    assert_pattern(&fetched.buffer, 0);
    // The service closed them: each reads as hung up (after the refusal
    // that those counted after the slots were full got).
    for conn in &idle {
        while conn.recv(&mut [0u8; 4096]).unwrap().0 > 0 {}
    }
}

#[test]
fn a_service_out_of_descriptors_logs_accept_failures_once_per_interval() {
    // Connections that hold every descriptor the service may open leave
    // the next ones waiting in the listen backlog, and accept failing
    // (EMFILE) every 50 ms: one line says so, not one per try, then one
    // line per 10 s while it lasts, and one when it works again.
    const NOFILE: u64 = 64;
    if !Command::new("prlimit").args(["--nofile=64", "true"]).status().is_ok_and(|s| s.success()) {
        return common::skip(
            "a_service_out_of_descriptors_logs_accept_failures_once_per_interval",
            "needs prlimit",
        );
    }
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let mut service_role = role("service", &socket);
    service_role.env(LIMIT, (1u64 << 30).to_string()).env(IDLE_MS, "600000");
    let mut cmd = through(&["prlimit", &format!("--nofile={NOFILE}")], &service_role);
    cmd.stderr(Stdio::piped());
    let mut service = ServiceProcess::start_with(&mut cmd, &socket);
    let (lines, log) = std::sync::mpsc::channel();
    let stderr = BufReader::new(service.child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if let Some(line) = line.strip_prefix("service: accept") {
                let _ = lines.send(line.to_owned());
            }
        }
    });
    let idle: Vec<Connection> = (0..NOFILE + 16).map(|_| Connection::connect(&socket).unwrap()).collect();
    let first = log.recv_timeout(Duration::from_secs(60)).expect("accept never failed");
    assert!(first.contains("Too many open files"), "{first}");
    // About 20 failed tries a second, none of them logged: every line up
    // to the first summary (10 s later) is a stretch's first failure or
    // the line saying accept works again (a descriptor the service frees
    // meanwhile, a departing probe's, makes one work again, and a new
    // stretch begins with a line).
    let mut lines = vec![first];
    let summary = loop {
        let line = log.recv_timeout(Duration::from_secs(60)).expect("no summary line");
        if line.starts_with(": still failing") {
            break line;
        }
        lines.push(line);
    };
    for pair in lines.windows(2) {
        assert!(pair[0].starts_with(" works again") || pair[1].starts_with(" works again"), "{lines:?}");
    }
    let tries: u64 = summary
        .strip_prefix(": still failing, ")
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{summary}"));
    assert!(tries > 1, "{summary}");
    drop(idle);
    let again = log.recv_timeout(Duration::from_secs(60)).expect("accept never worked again");
    assert!(again.starts_with(" works again, after "), "{again}");
    assert_eq!(service.status().files_cached, 0);
}

#[test]
fn forged_requests_are_refused_and_the_service_goes_on() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let conn = Connection::connect(&socket).unwrap();
    conn.set_timeouts(Some(Duration::from_secs(60))).unwrap();
    let ask = |bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]| -> String {
        conn.send(bytes, fds).unwrap();
        // A get is acknowledged before the service looks at its descriptor.
        let mut reply = protocol::receive_reply(&conn).unwrap().unwrap().0;
        if fds.len() == 1 {
            assert_eq!(reply, Reply::Accepted);
            reply = protocol::receive_reply(&conn).unwrap().unwrap().0;
        }
        match reply {
            Reply::Error(err) => {
                // A request that is not one is named by the service's socket.
                if err.op == "request" {
                    assert_eq!(Path::new(&err.path), socket, "{err:?}");
                }
                err.message
            }
            other => panic!("{other:?} for a forged request"),
        }
    };
    let get = protocol::encode_request(Request::Get);
    let directory = File::open(dir.path()).unwrap();
    let (sock_a, _sock_b) = Connection::pair().unwrap();
    // A pipe: the read end of a child's stdout.
    let mut sleeper = Command::new("sleep").arg("60").stdout(Stdio::piped()).spawn().unwrap();
    let pipe_r = sleeper.stdout.take().unwrap();
    let write_only = File::options().write(true).open(&path).unwrap();
    let o_path = File::options().read(true).custom_flags(libc::O_PATH).open(&path).unwrap();
    assert!(ask(&get, &[directory.as_fd()]).contains("directory, not a regular file"));
    assert!(ask(&get, &[sock_a.as_fd()]).contains("socket, not a regular file"));
    assert!(ask(&get, &[pipe_r.as_fd()]).contains("not a regular file"));
    assert!(ask(&get, &[write_only.as_fd()]).contains("not open for reading"));
    assert!(ask(&get, &[o_path.as_fd()]).contains("not open for reading"));
    assert!(ask(&get, &[]).contains("0 descriptors"));
    assert!(ask(b"{\"version\": 2, \"body\": {\"op\": \"get\", \"path\": \"/etc/shadow\"}}", &[])
        .contains("malformed"));
    assert!(ask(b"\xff\xfe", &[]).contains("malformed"));
    assert!(ask(&vec![b' '; 100_000], &[]).contains("longer than"));
    // A file that fails to load: the error the client gets is a direct load's.
    let proc_file = Path::new("/proc/self/status");
    let direct = dmaload::load(proc_file, &LoadOptions::default()).unwrap_err();
    let served = Client::connect(&socket).unwrap().get(proc_file).unwrap_err();
    assert_eq!((served.kind(), served.to_string()), (direct.kind(), direct.to_string()));
    // None of it broke the service or its connection.
    let fetched = Client::connect(&socket).unwrap().get(&path).unwrap();
    assert_pattern(&fetched.buffer, 0);
    assert!(ask(&get, &[directory.as_fd()]).contains("not a regular file"));
    let status = service.status();
    assert_eq!((status.errors, status.misses, status.files_cached), (11, 1, 1), "{status:?}");
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
}

/// A stand-in service at `socket`: takes one request per reply, then sends
/// that reply (`None`: hangs up without one).
fn fake_service(socket: &Path, replies: Vec<Option<Vec<u8>>>) -> std::thread::JoinHandle<()> {
    let listener = Listener::bind(socket, 1).unwrap();
    std::thread::spawn(move || {
        for reply in replies {
            let conn = listener.accept().unwrap();
            conn.recv(&mut [0u8; 1024]).unwrap();
            if let Some(reply) = reply {
                conn.send(&reply, &[]).unwrap();
            }
        }
    })
}

#[test]
fn a_service_that_breaks_off_is_named_by_its_socket() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 10_000);
    let socket = dir.path().join("cache.sock");
    // A service that reads each request, then hangs up or answers garbage.
    let service = fake_service(&socket, vec![None, Some(b"garbage".to_vec())]);
    for cause in ["closed the connection", "malformed message"] {
        let err = Client::connect(&socket).unwrap().get(&path).unwrap_err();
        assert_eq!((err.op(), err.path()), ("receive buffer", socket.as_path()), "{err}");
        assert!(err.to_string().contains(cause), "{err}");
    }
    service.join().unwrap();
}

/// A service out of descriptors, memory or threads of its own is a service
/// that cannot serve: the client loads the file itself, saying why. A file
/// that fails to load in the service fails the client's load alike.
#[test]
fn a_service_out_of_its_own_resources_is_a_fallback_a_failed_file_is_not() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 10_000);
    let socket = dir.path().join("cache.sock");
    let error_reply = |errno, op| {
        let err = dmaload::Error::io(op, Path::new("model.bin"), std::io::Error::from_raw_os_error(errno));
        Some(protocol::encode(&Reply::Error(protocol::WireError::from_error(&err))))
    };
    let service = fake_service(
        &socket,
        vec![error_reply(libc::EMFILE, "allocate memory"), error_reply(libc::EIO, "read")],
    );
    let (buffer, _, outcome) = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload::share::cached(&file, &socket, &LoadOptions::default()))
        .unwrap();
    assert_pattern(&buffer, 0);
    match outcome {
        CacheOutcome::Direct { reason } => assert!(reason.contains("allocate memory"), "{reason}"),
        other => panic!("EMFILE in the service must load directly: {other:?}"),
    }
    let err = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload::share::cached(&file, &socket, &LoadOptions::default()))
        .unwrap_err();
    assert_eq!((err.op(), err.raw_os_error()), ("read", Some(libc::EIO)), "{err}");
    service.join().unwrap();
}

#[test]
fn another_user_is_refused() {
    if !can_become_nobody() {
        return common::skip("another_user_is_refused", "needs root and setpriv (util-linux)");
    }
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    // Let uid 65534 reach the socket and the file, so that the service's
    // SO_PEERCRED check, not the file mode, is what refuses it.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let as_nobody = |socket: &Path| {
        let mut client = role("load-cached", socket);
        client.env(FILE, &path);
        let out = through(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], &client)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        role_output(&String::from_utf8_lossy(&out.stdout))
    };
    // Refused, and the client loaded the file itself, saying why.
    let stdout = as_nobody(&socket);
    assert!(stdout.starts_with(&format!("direct {} (", file_hash(&path))), "{stdout}");
    assert!(stdout.contains("uid 65534 (gid 65534) is not served"), "{stdout}");
    let status = service.status();
    assert_eq!((status.refused, status.misses), (1, 0));

    // --allow-uid 65534: the service makes its directory and socket
    // reachable by others itself, and serves uid 65534 from the
    // descriptor it sent.
    let allowing = dir.path().join("shared").join("allowing.sock");
    let cmd = &mut role("service", &allowing);
    let service = ServiceProcess::start_with(cmd.env(LIMIT, "1000000000").env(ALLOW_UID, "65534"), &allowing);
    assert_eq!(as_nobody(&allowing), format!("service miss {}", file_hash(&path)));
    assert_eq!(service.status().refused, 0);

    // Its status names only the files it was handed, not one another user
    // had cached (a file uid 65534 cannot open).
    let private = dir.path().join("private.bin");
    write_pattern_file(&private, 50_000);
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(Client::connect(&allowing).unwrap().get(&private).is_ok());
    let status = role("status", &allowing);
    let out =
        through(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], &status).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        role_output(&String::from_utf8_lossy(&out.stdout)),
        format!("files=2 paths={}", path.display())
    );
    let all = service.status().files.iter().map(|f| f.path.clone()).collect::<Vec<_>>();
    assert_eq!(all, [private.clone(), path.clone()], "root sees every path");
}

#[test]
fn a_shared_socket_in_a_directory_others_cannot_enter_is_refused_at_bind() {
    let dir = scratch_dir();
    let closed = dir.path().join("closed");
    std::fs::create_dir(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    let config = |socket: PathBuf, allow_uids: Vec<u32>| ServiceConfig {
        socket,
        memory_limit: 1 << 20,
        allow_uids,
        allow_gids: Vec::new(),
        load_options: LoadOptions::default(),
        idle_timeout: DEFAULT_IDLE_TIMEOUT,
        log: Arc::new(|_| {}),
    };
    let err = Service::bind(config(closed.join("s.sock"), vec![65534])).err().expect("bound");
    assert!(err.to_string().contains("keeps other users out"), "{err}");
    // Serving only its own user, the same place is fine, and private.
    let service = Service::bind(config(closed.join("s.sock"), Vec::new())).unwrap();
    let mode = std::fs::metadata(service.socket()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn one_user_cannot_hold_every_client_slot() {
    if !can_become_nobody() {
        return common::skip("one_user_cannot_hold_every_client_slot", "needs root and setpriv (util-linux)");
    }
    let dir = scratch_dir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let mut cmd = role("service", &socket);
    cmd.env(LIMIT, (1u64 << 30).to_string()).env(IDLE_MS, "600000").env(ALLOW_UID, "65534");
    let service = ServiceProcess::start_with(&mut cmd, &socket);
    let nobody =
        |cmd: &Command| through(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], cmd);
    let mut holder =
        nobody(&role("hold", &socket)).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    assert_eq!(read_role_line(&mut holder), format!("held {MAX_CLIENTS_PER_UID}"));
    // That user's next connection is refused, and says why...
    let out = nobody(role("load-cached", &socket).env(FILE, &path)).output().unwrap();
    let stdout = role_output(&String::from_utf8_lossy(&out.stdout));
    assert!(stdout.contains(&format!("uid 65534 has {MAX_CLIENTS_PER_UID} connections already")), "{stdout}");
    // ...while another user is served.
    let fetched = Client::connect(&socket).unwrap().get(&path).unwrap();
    assert_eq!(fetched.served, Served::Miss);
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    service.stop();
}

#[test]
fn a_service_whose_loads_read_nothing_is_a_fallback() {
    // A stand-in for a service that is alive (it acknowledges and keeps
    // sending keepalives) but whose load is stuck (a silent network or FUSE
    // server): its keepalives say no byte was read, and after
    // STALL_TIMEOUT the client loads directly, saying so.
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 10_000);
    let socket = dir.path().join("cache.sock");
    let listener = Listener::bind(&socket, 1).unwrap();
    let stuck = std::thread::spawn(move || {
        let conn = listener.accept().unwrap();
        conn.recv(&mut [0u8; 1024]).unwrap();
        conn.send(&protocol::encode(&Reply::Accepted), &[]).unwrap();
        // Until the client hangs up: the pace of a real service's keepalives.
        while conn.send(&protocol::encode(&Reply::Working { loaded: 7 }), &[]).is_ok() {
            std::thread::sleep(protocol::KEEPALIVE_INTERVAL);
        }
    });
    let (buffer, _, outcome) = dmaload::OpenFile::open(&path)
        .and_then(|file| dmaload::share::cached(&file, &socket, &LoadOptions::default()))
        .unwrap();
    assert_pattern(&buffer, 0);
    match outcome {
        CacheOutcome::Direct { reason } => assert!(reason.contains("have read nothing"), "{reason}"),
        other => panic!("a stuck service must load directly: {other:?}"),
    }
    stuck.join().unwrap();
}

#[test]
fn a_stopped_service_is_a_prompt_fallback() {
    // A service that accepted the connection (the kernel did, into the
    // backlog) but is stopped: the client hears no acknowledgement and
    // loads directly, saying so, instead of waiting for the reply.
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 100_000);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let signal = |name: &str| {
        assert!(Command::new("kill").args([name, &service.pid().to_string()]).status().unwrap().success());
    };
    signal("-STOP");
    let client = role("load-cached", &socket).env(FILE, &path).stdout(Stdio::piped()).spawn().unwrap();
    let client_pid = client.id();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || done.send(client.wait_with_output().unwrap()));
    // Generous: the fallback comes after a few seconds, the old wait after 30 minutes.
    let out = finished.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| {
        let _ = Command::new("kill").args(["-KILL", &client_pid.to_string()]).status();
        signal("-CONT");
        panic!("the client still waited for a stopped service after 120 s");
    });
    signal("-CONT");
    let stdout = role_output(&String::from_utf8_lossy(&out.stdout));
    assert!(stdout.starts_with(&format!("direct {} (", file_hash(&path))), "{stdout}");
    assert!(stdout.contains("stopped or stuck"), "{stdout}");
    // Running again, it serves (a hit if it has meanwhile answered the
    // request the client gave up on).
    let again = run_client("load-cached", &socket, &path);
    assert!(again.starts_with("service ") && again.ends_with(&file_hash(&path).to_string()), "{again}");
    service.stop();
}

/// Whether this process is root and `setpriv` runs ([`through`] runs the
/// test binary from where uid 65534 can reach it).
fn can_become_nobody() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
        && Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "true"])
            .status()
            .is_ok_and(|s| s.success())
}

#[test]
fn killed_clients_and_a_killed_service_leak_nothing() {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 64 << 20);
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    // Clients killed while the service loads and sends: it goes on.
    for _ in 0..3 {
        let mut child = role("hang", &socket).env(FILE, &path).stdout(Stdio::piped()).spawn().unwrap();
        assert_eq!(read_role_line(&mut child), "sent");
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let fetched = Client::connect(&socket).unwrap().get(&path).unwrap();
    assert_pattern(&fetched.buffer, 0);
    // One memfd, the cached file's, however many clients died holding one
    // (the status request is a client itself).
    let started = Instant::now();
    while service.status().clients > 1 && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(service.memfds(), 1);
    assert_eq!(service.status().files_cached, 1);

    // The service killed: the memory it handed out stays valid, and the
    // next client loads directly, saying why.
    let mut service = service;
    service.child.kill().unwrap();
    service.child.wait().unwrap();
    assert_pattern(&fetched.buffer, 0);
    let line = run_client("load-cached", &socket, &path);
    assert!(line.starts_with(&format!("direct {} (no cache service: connect ", file_hash(&path))), "{line}");
    // A new service replaces the dead one's socket file.
    let service = ServiceProcess::start(&socket, 1 << 30);
    assert!(run_client("load-cached", &socket, &path).starts_with("service miss "));
    service.stop();
}

#[test]
fn a_running_service_is_not_replaced() {
    let dir = scratch_dir();
    let socket = dir.path().join("cache.sock");
    let _service = ServiceProcess::start(&socket, 1 << 20);
    let config = ServiceConfig {
        socket: socket.clone(),
        memory_limit: 1 << 20,
        allow_uids: Vec::new(),
        allow_gids: Vec::new(),
        load_options: LoadOptions::default(),
        idle_timeout: DEFAULT_IDLE_TIMEOUT,
        log: Arc::new(|_| {}),
    };
    let err = Service::bind(config.clone()).err().unwrap();
    assert!(err.to_string().contains("already listening"), "{err}");
    let not_socket = dir.path().join("file");
    File::create(&not_socket).unwrap();
    let err = Service::bind(ServiceConfig { socket: not_socket, ..config }).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
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
    let (buffer, _, outcome) = dmaload::share::cached(&opened, &absent, &LoadOptions::default()).unwrap();
    assert!(matches!(outcome, CacheOutcome::Direct { .. }), "{outcome:?}");
    assert_eq!(xxh3(&buffer), hash);
    // A service gets a descriptor of the opened file too.
    let socket = dir.path().join("cache.sock");
    let service = ServiceProcess::start(&socket, 1 << 30);
    let (buffer, _, outcome) = dmaload::share::cached(&opened, &socket, &LoadOptions::default()).unwrap();
    assert!(matches!(outcome, CacheOutcome::Service { served: Served::Miss, .. }), "{outcome:?}");
    assert_eq!(xxh3(&buffer), hash);
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
