//! What the cache-service tests (share_cache.rs, share_cache_hostile.rs)
//! share: the roles a test binary plays when run again (`process_role`: a
//! service, clients), the service process, stand-ins and user switches.
#![allow(dead_code)] // each test binary uses a different subset

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmaload::share::protocol::{self, Request};
use dmaload::share::{Connection, Listener};
use dmaload::{Buffer, LoadOptions};
use dmaload_share::service::{DEFAULT_IDLE_TIMEOUT, MAX_CLIENTS_PER_UID};
use dmaload_share::{CacheOutcome, Client, Service, ServiceConfig};

pub const ROLE: &str = "DMALOAD_SHARE_CACHE_ROLE";
pub const SOCKET: &str = "DMALOAD_SHARE_CACHE_SOCKET";
pub const FILE: &str = "DMALOAD_SHARE_CACHE_FILE";
pub const LIMIT: &str = "DMALOAD_SHARE_CACHE_LIMIT";
pub const ALLOW_UID: &str = "DMALOAD_SHARE_CACHE_ALLOW_UID";
pub const IDLE_MS: &str = "DMALOAD_SHARE_CACHE_IDLE_MS";

pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// What a test binary that shares this module does when run again with
/// `ROLE` set (its `process_role` test calls this; not a test of its own):
/// `service` (serves until its stdin closes), `receive` (takes
/// a buffer from the listener at `SOCKET`), `get` (asks the service for
/// `FILE` and prints how it was served and the bytes' hash), `get-touch`
/// (gets `FILE`, reads a byte of every page, prints the bytes mapped with
/// huge pages), `hang` (sends
/// a request and never reads the reply), `load-cached` (prints where
/// `share::cached` got `FILE` from).
pub fn process_role() {
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
                .and_then(|file| dmaload_share::CacheRequest::open(&file, &socket).to_buffer())
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

pub fn role(role: &str, socket: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "process_role", "--nocapture", "--test-threads=1", "--quiet"])
        .env(ROLE, role)
        .env(SOCKET, socket);
    cmd
}

/// `cmd` run through another program (`prlimit`, `setpriv`) and its
/// arguments, which execs it with the same environment.
pub fn through(program: &[&str], cmd: &Command) -> Command {
    let mut wrapped = Command::new(program[0]);
    // The program, where another user (setpriv) can run it too.
    wrapped
        .args(&program[1..])
        .arg(crate::common::reachable::reachable_by_others(Path::new(cmd.get_program())))
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            wrapped.env(key, value);
        }
    }
    wrapped
}

/// Runs a client role to completion; its stdout's first line.
pub fn run_client(role_name: &str, socket: &Path, file: &Path) -> String {
    let out = role(role_name, socket).env(FILE, file).output().unwrap();
    assert!(out.status.success(), "{role_name} failed: {}", String::from_utf8_lossy(&out.stderr));
    role_output(&String::from_utf8_lossy(&out.stdout))
}

/// What a role printed (its lines start with `OUT `; the rest is libtest's).
pub fn role_output(stdout: &str) -> String {
    stdout.lines().find_map(|line| line.strip_prefix("OUT ")).unwrap_or_default().to_owned()
}

/// The role's first line, read as soon as it is printed.
pub fn read_role_line(child: &mut Child) -> String {
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
pub struct ServiceProcess {
    pub child: Child,
    pub socket: PathBuf,
}

impl ServiceProcess {
    pub fn start(socket: &Path, limit: u64) -> ServiceProcess {
        Self::start_with(role("service", socket).env(LIMIT, limit.to_string()), socket)
    }

    pub fn start_with(cmd: &mut Command, socket: &Path) -> ServiceProcess {
        let child = cmd.stdin(Stdio::piped()).spawn().unwrap();
        let started = Instant::now();
        while Connection::connect(socket).is_err() {
            assert!(started.elapsed() < Duration::from_secs(60), "the service did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        ServiceProcess { child, socket: socket.to_owned() }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn status(&self) -> dmaload::share::Status {
        Client::connect(&self.socket).unwrap().status().unwrap()
    }

    /// Bytes the service has read from storage (`read_bytes` of
    /// `/proc/PID/io`: every thread's block I/O, direct reads included).
    pub fn storage_reads(&self) -> u64 {
        let io = std::fs::read_to_string(format!("/proc/{}/io", self.pid())).unwrap();
        io.lines().find_map(|l| l.strip_prefix("read_bytes: ")).unwrap().trim().parse().unwrap()
    }

    /// The memfds the service holds open, each counted once however many
    /// descriptors it has open on it (a loaded buffer's fork registry keeps
    /// a second one).
    pub fn memfds(&self) -> usize {
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

    pub fn stop(mut self) {
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

/// A stand-in service at `socket`: takes one request per reply, then sends
/// that reply (`None`: hangs up without one).
pub fn fake_service(socket: &Path, replies: Vec<Option<Vec<u8>>>) -> std::thread::JoinHandle<()> {
    let listener = Listener::bind(socket, 1).unwrap();
    std::thread::spawn(move || {
        for reply in replies {
            let conn = listener.accept().unwrap();
            conn.recv(&mut vec![0u8; protocol::MAX_REQUEST_BYTES]).unwrap();
            if let Some(reply) = reply {
                conn.send(&reply, &[]).unwrap();
            }
        }
    })
}

/// Whether this process is root and `setpriv` runs ([`through`] runs the
/// test binary from where uid 65534 can reach it).
pub fn can_become_nobody() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
        && Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "true"])
            .status()
            .is_ok_and(|s| s.success())
}
