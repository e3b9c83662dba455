//! The model-cache service: loads files (and objects) on request with the
//! ordinary loader, keeps each in a sealed memfd, and hands it to clients over a
//! Unix socket. A second process gets a file's bytes by mapping pages that
//! are already in memory, in milliseconds, instead of reading the disk.
//!
//! Security: a client proves it may read a file by sending an open
//! descriptor of it (never a path: the service opens nothing by name on a
//! client's behalf); the descriptor must be a regular file open for
//! reading. The cache key is `(st_dev, st_ino, size, mtime, ctime)` of
//! that descriptor, so a file rewritten or replaced is loaded again, never
//! served stale (where timestamps move: README, "Staleness"). Only the
//! service's own uid and root are served unless `allow_uids`/`allow_gids`
//! widen it (`SO_PEERCRED`, the peer's primary gid); the socket's mode
//! only lets them reach it ([`Service::bind`]). A status shows a user other
//! than the service's own and root only the paths of files handed to it.
//! Requests are length-limited and parsed as untrusted input. An object
//! (`get-object`) comes with a [`Grant`] instead of a descriptor: the
//! service reads it with the grant's presigned queries, never with keys of
//! its own, keeps it under its ETag, and makes the grant's HEAD on every
//! request, so the store decides each time whether the client may read it.
//!
//! Memory: files are dropped least recently used first when a new load
//! would pass the limit (clients that map a dropped file keep their pages
//! until they unmap); a file larger than the limit is loaded for its client
//! and not kept, one such load at a time (others wait their turn), so the
//! service holds at most one file beyond its limit. Each cached file holds
//! a descriptor, so files are dropped the same way before they would hold
//! half of `RLIMIT_NOFILE`: the other half accepts clients and loads.
//! Concurrent requests for one file load it once.
//!
//! Robustness: each client has its own thread; a client that dies, sends
//! garbage or asks for a file that fails to load gets (or misses) an error
//! reply, and the service goes on. A get is acknowledged at once and kept
//! alive while it loads (see [`dmaload::share::protocol`]), so a client tells a slow load
//! from a stopped service. A connection idle for
//! [`ServiceConfig::idle_timeout`] is closed, and one uid holds at most
//! [`MAX_CLIENTS_PER_UID`] connections, so connections that never send
//! cannot keep the client slots from clients that do. Descriptors
//! are owned values: a memfd is closed when it leaves the cache and no
//! handoff is sending it.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dmaload::cancel::CancelToken;
use dmaload::error::{Error, ErrorKind, Result};
use dmaload::load::{Destination, LoadOptions, LoadRequest};
use dmaload::memory::{MemoryChoice, MemoryFacts};
use dmaload::object::{Grant, Object};
use dmaload::share::protocol::{CachedFile, Served, Status, WireError, MAX_STATUS_ENTRIES};
use dmaload::share::{Connection, Listener, PeerCredentials};
use dmaload::sys_share;
use dmaload::sys_share::page_size;

mod connection;
mod device;
mod loaded;
use connection::*;
use loaded::{Loaded, COLLAPSING};

/// Clients served at once; more are refused with an error.
const MAX_CLIENTS: usize = 256;
/// Connections one uid may hold at once, so that one user's idle or stuck
/// connections leave the other users most of the 256 served at once.
pub const MAX_CLIENTS_PER_UID: usize = 64;
/// [`ServiceConfig::idle_timeout`] unless set otherwise: a client sends
/// its request as soon as it connects, so a few seconds is plenty.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the service waits before accepting again after `accept`
/// failed for a limit (descriptors, memory).
const ACCEPT_RETRY: Duration = Duration::from_millis(50);
/// While `accept` keeps failing, how often it is logged again.
const ACCEPT_FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// `accept` failing for a limit since `since`: `count` failures, of which
/// `unlogged` since the line at `logged`.
struct AcceptFailures {
    since: Instant,
    count: u64,
    logged: Instant,
    unlogged: u64,
}

impl AcceptFailures {
    fn new() -> AcceptFailures {
        let now = Instant::now();
        AcceptFailures { since: now, count: 1, logged: now, unlogged: 0 }
    }
}

/// SIGINT and SIGTERM as a readable descriptor (`signalfd(2)`), for
/// [`Service::run`] to stop on. Creating it blocks both signals in the
/// calling thread and the threads it starts later: create it first thing
/// in `main`.
#[derive(Debug)]
pub struct StopSignals(sys_share::SignalFd);

impl StopSignals {
    pub fn new() -> io::Result<StopSignals> {
        sys_share::SignalFd::new(&[libc::SIGINT, libc::SIGTERM]).map(StopSignals)
    }

    /// The signal that arrived, if one did (consuming it).
    pub fn take(&self) -> io::Result<Option<u32>> {
        self.0.take()
    }
}

impl AsFd for StopSignals {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// How a service is set up.
#[derive(Clone)]
pub struct ServiceConfig {
    /// Where the socket is bound (see [`crate::default_socket`]).
    pub socket: PathBuf,
    /// Bytes of memory the cached files may hold together.
    pub memory_limit: u64,
    /// Users served besides the service's own and root.
    pub allow_uids: Vec<u32>,
    /// Groups (the client's primary gid) whose users are served.
    pub allow_gids: Vec<u32>,
    /// How files are loaded; the memory is always a memfd (what can be
    /// handed out), with 2 MiB pages where the kernel gives them
    /// ([`dmaload::memory::MemoryFacts::choose_shared`]).
    pub load_options: LoadOptions,
    /// A connection that sends no request this long after connecting or
    /// after its last reply (or does not take a reply this long) is
    /// closed, so idle connections cannot hold the client slots
    /// ([`DEFAULT_IDLE_TIMEOUT`]; zero: never).
    pub idle_timeout: Duration,
    /// Receives one line per request and per event.
    pub log: Arc<dyn Fn(&str) + Send + Sync>,
}

/// A bound, listening cache service; [`Service::run`] serves until stopped.
pub struct Service {
    listener: Listener,
    /// The socket file this service created (device, inode), removed at
    /// the end only if it is still that file.
    socket_id: (u64, u64),
    state: Arc<State>,
}

/// A file's id: what its cache entry is kept under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileId {
    fn of(meta: &std::fs::Metadata) -> FileId {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// What a cache entry is kept under: a file's id, or an object's place and
/// version (a new version has a new ETag, so it is loaded again).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Key {
    File(FileId),
    Object { endpoint: String, bucket: String, key: String, etag: String, size: u64 },
}

struct Ready {
    loaded: Arc<Loaded>,
    /// The users it was handed to: each proved it may read the file, and
    /// only they (besides the service's own user and root) see its path
    /// in a status.
    served_to: Vec<u32>,
    hits: u64,
    handoffs: u64,
    last_used: u64,
}

/// A load in progress, which other requests for the same file wait for.
struct Pending {
    outcome: Mutex<Option<std::result::Result<Arc<Loaded>, WireError>>>,
    done: Condvar,
}

impl Pending {
    fn wait(&self) -> std::result::Result<Arc<Loaded>, WireError> {
        let mut outcome = lock(&self.outcome);
        loop {
            if let Some(outcome) = outcome.as_ref() {
                return outcome.clone();
            }
            outcome = self.done.wait(outcome).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

enum Slot {
    Ready(Ready),
    Loading(Arc<Pending>),
}

/// What a request for a file that is not ready does.
enum Next {
    /// Another request is loading it: wait for that load's outcome.
    Wait(Arc<Pending>),
    /// Load it, the pending entry in place for others to wait on.
    Load(Arc<Pending>),
}

#[derive(Default)]
struct Counters {
    hits: u64,
    misses: u64,
    uncached: u64,
    evictions: u64,
    errors: u64,
    refused: u64,
}

struct Cache {
    files: HashMap<Key, Slot>,
    /// Bytes the ready files hold plus those reserved by loads in flight.
    used: u64,
    clock: u64,
    counters: Counters,
}

struct State {
    config: ServiceConfig,
    /// The memory kind cached files get, and why.
    memory: MemoryChoice,
    /// Whether files loaded into 4 KiB pages are collapsed into 2 MiB
    /// pages afterwards ([`MemoryFacts::collapses_shared`]).
    collapse: bool,
    own_uid: u32,
    /// Files the cache holds at most (loads in flight included): each
    /// holds a memfd, and the service needs descriptors for its clients
    /// and loads too.
    max_files: usize,
    cache: Mutex<Cache>,
    /// Held while a file that is not cached (over the limit) is loaded
    /// and handed out: concurrent requests for such files take turns, so
    /// the service holds one such copy at a time, not one per request.
    uncached_turn: Mutex<()>,
    clients: AtomicUsize,
    /// Bytes every load of the service has read (what keepalives carry).
    loaded: Arc<AtomicU64>,
    /// Connections each uid holds now (only uids with some).
    clients_per_uid: Mutex<HashMap<u32, usize>>,
    /// The CUDA contexts GPU clients' copies run in, by device ordinal.
    device_contexts: Mutex<Vec<(usize, dmaload::cuda::Context)>>,
}

/// A file to send a client, and, for one not cached, its turn
/// ([`State::uncached_turn`]), to be dropped after the file.
struct Handoff<'s> {
    loaded: Arc<Loaded>,
    served: Served,
    note: Option<String>,
    turn: Option<MutexGuard<'s, ()>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while the lock was held leaves counters, never a broken
    // invariant of memory: carry on.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Service {
    /// Binds the socket. Serving only its own user, it is mode 0600 and a
    /// missing directory is created 0700. With `allow_uids`/`allow_gids` it
    /// is mode 0666 (a missing directory is created 0755), and every
    /// directory above it must let others through (`o+x`), else the
    /// allowed users could not connect: an error says so. The mode only
    /// lets users reach the socket; `SO_PEERCRED` decides whom the service
    /// serves. A socket file left by a service that is gone is replaced;
    /// one that answers is an error, as is any other file at the path.
    pub fn bind(config: ServiceConfig) -> Result<Service> {
        let path = config.socket.clone();
        let shared = !config.allow_uids.is_empty() || !config.allow_gids.is_empty();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
            std::fs::DirBuilder::new()
                .mode(if shared { 0o755 } else { 0o700 })
                .create(dir)
                .map_err(|e| Error::io("create socket directory", dir, e))?;
        }
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_socket() => match Connection::connect(&path) {
                Ok(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidInput,
                        "bind",
                        &path,
                        "a cache service is already listening there (dmaload serve --status)",
                    ))
                }
                Err(err) if err.raw_os_error() == Some(libc::ECONNREFUSED) => {
                    std::fs::remove_file(&path).map_err(|e| Error::io("remove stale socket", &path, e))?;
                }
                Err(err) => return Err(Error::io("connect", &path, err)),
            },
            Ok(_) => {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    "bind",
                    &path,
                    "the path exists and is not a socket: choose another --socket",
                ))
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(Error::io("stat", &path, err)),
        }
        if shared {
            unreachable_by_others(&path)?;
        }
        let listener = Listener::bind(&path, 128).map_err(|e| Error::io("bind", &path, e))?;
        // Created 0600 less the umask (never wider); then made exactly the
        // mode this service needs.
        // Never through a symlink put at the path since the bind.
        sys_share::chmod_socket(&path, if shared { 0o666 } else { 0o600 })
            .map_err(|e| Error::io("chmod", &path, e))?;
        let meta = std::fs::symlink_metadata(&path).map_err(|e| Error::io("stat", &path, e))?;
        let facts = MemoryFacts::read();
        let memory = facts.choose_shared();
        let mut config = config;
        config.load_options.to = Destination::from(memory.kind);
        config.load_options.progress = None;
        let state = State {
            config,
            memory,
            collapse: facts.collapses_shared(),
            own_uid: sys_share::effective_uid(),
            max_files: sys_share::open_files_limit()
                .ok()
                .flatten()
                .map_or(usize::MAX, |limit| usize::try_from(limit / 2).unwrap_or(usize::MAX)),
            cache: Mutex::new(Cache {
                files: HashMap::new(),
                used: 0,
                clock: 0,
                counters: Counters::default(),
            }),
            uncached_turn: Mutex::new(()),
            clients: AtomicUsize::new(0),
            loaded: Arc::new(AtomicU64::new(0)),
            clients_per_uid: Mutex::new(HashMap::new()),
            device_contexts: Mutex::new(Vec::new()),
        };
        Ok(Service { listener, socket_id: (meta.dev(), meta.ino()), state: Arc::new(state) })
    }

    pub fn socket(&self) -> &Path {
        &self.state.config.socket
    }

    /// Serves clients, each on its own thread, until `stop` becomes
    /// readable (a [`crate::StopSignals`], or any fd), then removes
    /// the socket. Cached memory is released when the service is dropped;
    /// clients keep what they mapped.
    pub fn run(&self, stop: BorrowedFd<'_>) -> Result<()> {
        let socket = self.socket().to_path_buf();
        let mut accept_failing: Option<AcceptFailures> = None;
        let result = loop {
            let ready = match sys_share::poll_readable(&[self.listener.as_fd(), stop], None) {
                Ok(ready) => ready,
                Err(err) => break Err(Error::io("poll", &socket, err)),
            };
            if ready[1] {
                break Ok(());
            }
            if !ready[0] {
                continue;
            }
            match self.listener.accept() {
                Ok(conn) => {
                    if let Some(failures) = accept_failing.take() {
                        self.log(&format!(
                            "accept works again, after {} failures over {:.1} s",
                            failures.count,
                            failures.since.elapsed().as_secs_f64()
                        ));
                    }
                    let state = Arc::clone(&self.state);
                    let spawned = std::thread::Builder::new()
                        .name("dmaload-client".into())
                        .spawn(move || serve_client(&state, conn));
                    if let Err(err) = spawned {
                        self.log(&format!("cannot start a client thread: {err}"));
                    }
                }
                // The client hung up before being accepted.
                Err(err) if err.raw_os_error() == Some(libc::ECONNABORTED) => {
                    self.log(&format!("accept: {err}"))
                }
                // A limit (descriptors, memory) was hit: wait a moment and
                // try again; logged once, then once per interval while it
                // lasts, not every try.
                Err(err) => {
                    match &mut accept_failing {
                        None => {
                            self.log(&format!(
                                "accept: {err} (clients wait; while this lasts, one line per {} s)",
                                ACCEPT_FAILURE_LOG_INTERVAL.as_secs()
                            ));
                            accept_failing = Some(AcceptFailures::new());
                        }
                        Some(failures) => {
                            failures.count += 1;
                            failures.unlogged += 1;
                            if failures.logged.elapsed() >= ACCEPT_FAILURE_LOG_INTERVAL {
                                self.log(&format!(
                                    "accept: still failing, {} times in the last {:.0} s: {err}",
                                    failures.unlogged,
                                    failures.logged.elapsed().as_secs_f64()
                                ));
                                failures.logged = Instant::now();
                                failures.unlogged = 0;
                            }
                        }
                    }
                    std::thread::sleep(ACCEPT_RETRY);
                }
            }
        };
        let status = self.status();
        self.log(&format!(
            "stopping: {} files cached ({} bytes) released, {} hits, {} misses",
            status.files_cached, status.memory_used, status.hits, status.misses
        ));
        if std::fs::symlink_metadata(&socket).is_ok_and(|m| (m.dev(), m.ino()) == self.socket_id) {
            let _ = std::fs::remove_file(&socket);
        }
        result
    }

    /// What the service holds now.
    pub fn status(&self) -> Status {
        self.state.status(None)
    }

    fn log(&self, line: &str) {
        (self.state.config.log)(line);
    }
}

impl State {
    fn log(&self, line: &str) {
        (self.config.log)(line);
    }

    fn allowed(&self, peer: &PeerCredentials) -> bool {
        peer.uid == self.own_uid
            || peer.uid == 0
            || self.config.allow_uids.contains(&peer.uid)
            || self.config.allow_gids.contains(&peer.gid)
    }

    /// What the service holds, as `viewer` may see it: a user other than
    /// the service's own and root (`Some(uid)`) sees the paths of only the
    /// files handed to it; the totals are everyone's.
    fn status(&self, viewer: Option<u32>) -> Status {
        let cache = lock(&self.cache);
        let mut ready: Vec<&Ready> = cache
            .files
            .values()
            .filter_map(|slot| match slot {
                Slot::Ready(ready) => Some(ready),
                Slot::Loading(_) => None,
            })
            .collect();
        ready.sort_by_key(|r| std::cmp::Reverse(r.last_used));
        let memory_used = ready.iter().map(|r| r.loaded.bytes).sum();
        let c = &cache.counters;
        Status {
            pid: std::process::id(),
            socket: self.config.socket.clone(),
            memory_limit: self.config.memory_limit,
            memory_kind: self.memory.kind.name().to_owned(),
            memory_reason: self.memory.reason.clone(),
            memory_used,
            files_cached: ready.len() as u64,
            hits: c.hits,
            misses: c.misses,
            uncached: c.uncached,
            evictions: c.evictions,
            errors: c.errors,
            refused: c.refused,
            clients: self.clients.load(Ordering::Relaxed) as u64,
            files: ready
                .iter()
                .filter(|r| viewer.map_or(true, |uid| r.served_to.contains(&uid)))
                .take(MAX_STATUS_ENTRIES)
                .map(|r| CachedFile {
                    path: r.loaded.path.clone(),
                    bytes: r.loaded.bytes,
                    hits: r.hits,
                    handoffs: r.handoffs,
                    pages: lock(&r.loaded.pages).clone(),
                })
                .collect(),
        }
    }

    /// The bytes of the file `fd` is open on: from the cache, or loaded now.
    /// `uid` is the client's, recorded as one that may see the file's path.
    fn get(&self, fd: OwnedFd, uid: u32) -> std::result::Result<Handoff<'_>, Error> {
        let fd_path = Path::new("fd");
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| Error::io("fstat", fd_path, e))?;
        if !meta.file_type().is_file() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "cache",
                fd_path,
                format!(
                    "the descriptor sent is a {}, not a regular file: only regular files are cached",
                    dmaload::source::type_name(&meta)
                ),
            ));
        }
        if !sys_share::readable(file.as_fd()).map_err(|e| Error::io("fcntl", fd_path, e))? {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "cache",
                fd_path,
                "the descriptor sent is not open for reading (O_WRONLY or O_PATH): it proves no \
                 right to read the file",
            ));
        }
        let id = FileId::of(&meta);
        self.serve(Key::File(id), id.size, uid, || self.load(&file, id))
    }

    /// The bytes of the object `grant` names, at the version its HEAD
    /// finds now: from the cache, or loaded now. The grant's HEAD is made
    /// for every request, a hit included, so a client whose grant the
    /// store refuses gets nothing, cached or not.
    fn get_object(&self, grant: &Grant, uid: u32) -> std::result::Result<Handoff<'_>, Error> {
        let object = Object::granted(grant, &CancelToken::new())?;
        let key = Key::Object {
            endpoint: grant.endpoint.clone(),
            bucket: object.bucket().to_owned(),
            key: object.key().to_owned(),
            etag: object.etag.clone(),
            size: object.size,
        };
        self.serve(key, object.size, uid, || self.load_object(&object))
    }

    /// `key`'s entry handed to `uid`: the cached one, the one another
    /// request is loading, or loaded now with `load` (cached if it fits,
    /// else for this request only).
    fn serve(
        &self,
        key: Key,
        size: u64,
        uid: u32,
        load: impl Fn() -> Result<Loaded>,
    ) -> std::result::Result<Handoff<'_>, Error> {
        let bytes = size.div_ceil(page_size() as u64) * page_size() as u64;
        let next = {
            let mut cache = lock(&self.cache);
            cache.clock += 1;
            let now = cache.clock;
            match cache.files.get_mut(&key) {
                Some(Slot::Ready(ready)) => {
                    ready.hits += 1;
                    ready.handoffs += 1;
                    ready.last_used = now;
                    if !ready.served_to.contains(&uid) {
                        ready.served_to.push(uid);
                    }
                    let loaded = Arc::clone(&ready.loaded);
                    cache.counters.hits += 1;
                    return Ok(Handoff { loaded, served: Served::Hit, note: None, turn: None });
                }
                Some(Slot::Loading(pending)) => Next::Wait(Arc::clone(pending)),
                None => {
                    let limits = Limits { bytes: self.config.memory_limit, files: self.max_files };
                    if let Err(why) = make_room(&mut cache, bytes, limits, &*self.config.log) {
                        cache.counters.uncached += 1;
                        drop(cache);
                        let turn = lock(&self.uncached_turn);
                        let note =
                            format!("{why}: loaded for this request, not cached (one such load at a time)");
                        return load().map(|loaded| Handoff {
                            loaded: Arc::new(loaded),
                            served: Served::Uncached,
                            note: Some(note),
                            turn: Some(turn),
                        });
                    }
                    let pending = Arc::new(Pending { outcome: Mutex::new(None), done: Condvar::new() });
                    cache.files.insert(key.clone(), Slot::Loading(Arc::clone(&pending)));
                    cache.used += bytes;
                    Next::Load(pending)
                }
            }
        };
        match next {
            Next::Wait(pending) => {
                let loaded = pending.wait().map_err(|e| e.into_error(None))?;
                let mut cache = lock(&self.cache);
                cache.clock += 1;
                let now = cache.clock;
                if let Some(Slot::Ready(ready)) = cache.files.get_mut(&key) {
                    ready.hits += 1;
                    ready.handoffs += 1;
                    ready.last_used = now;
                    if !ready.served_to.contains(&uid) {
                        ready.served_to.push(uid);
                    }
                }
                cache.counters.hits += 1;
                Ok(Handoff { loaded, served: Served::Hit, note: None, turn: None })
            }
            Next::Load(pending) => {
                // Completes the waiters even if the load panics.
                let mut finish = Finish { state: self, key, bytes, uid, pending, outcome: None };
                let loaded = load().map(Arc::new);
                finish.outcome = Some(match &loaded {
                    Ok(loaded) => Ok(Arc::clone(loaded)),
                    Err(err) => Err(WireError::from_error(err)),
                });
                drop(finish);
                loaded.map(|loaded| Handoff { loaded, served: Served::Miss, note: None, turn: None })
            }
        }
    }

    /// The service's options for one load: its own, with progress counted
    /// in the bytes every load has read (what keepalives carry).
    fn load_options(&self) -> LoadOptions {
        let mut options = self.config.load_options.clone();
        let (loaded, this_load) = (Arc::clone(&self.loaded), AtomicU64::new(0));
        options.progress = Some(Arc::new(move |done, _total| {
            loaded.fetch_add(done.saturating_sub(this_load.swap(done, Ordering::Relaxed)), Ordering::Relaxed);
        }));
        options
    }

    /// Loads the file with the ordinary loader, from the descriptor the
    /// client sent, then seals the memfd. The file's id must be the same
    /// after the load as when the request came: else the bytes might not
    /// be those of the key they would be cached under.
    fn load(&self, file: &File, id: FileId) -> Result<Loaded> {
        let options = self.load_options();
        let (buffer, report) = LoadRequest::fd(file.as_fd()).options(&options).to_buffer()?;
        let after = file.metadata().map_err(|e| Error::io("fstat", &report.path, e))?;
        if FileId::of(&after) != id {
            return Err(Error::new(
                ErrorKind::Changed,
                "load",
                &report.path,
                "the file was written while the service loaded it: ask again once the writer is done",
            ));
        }
        Loaded::seal(buffer, report)
    }

    /// Loads the object with the ordinary loader, every GET pinned to the
    /// ETag its HEAD found (another version fails the load), then seals
    /// the memfd.
    fn load_object(&self, object: &Object) -> Result<Loaded> {
        let options = self.load_options();
        let (buffer, report) = LoadRequest::object(object).options(&options).to_buffer()?;
        Loaded::seal(buffer, report)
    }
}

/// What the cache may hold: bytes of memory, and files (descriptors).
#[derive(Clone, Copy)]
struct Limits {
    bytes: u64,
    files: usize,
}

/// Drops least-recently-used ready files until one more of `bytes` fits
/// under `limits`; when it cannot fit even with every ready file gone
/// (loads in flight hold the rest), drops nothing and says why.
fn make_room(
    cache: &mut Cache,
    bytes: u64,
    limits: Limits,
    log: &(dyn Fn(&str) + Send + Sync),
) -> std::result::Result<(), String> {
    let (ready_files, ready_bytes) = cache
        .files
        .values()
        .filter_map(|slot| match slot {
            Slot::Ready(ready) => Some(ready.loaded.bytes),
            Slot::Loading(_) => None,
        })
        .fold((0, 0u64), |(files, sum), bytes| (files + 1, sum + bytes));
    if (cache.used - ready_bytes).saturating_add(bytes) > limits.bytes {
        return Err(format!(
            "{bytes} bytes do not fit in the service's memory limit ({} bytes, {} in use or being loaded)",
            limits.bytes, cache.used
        ));
    }
    let loading_files = cache.files.len() - ready_files;
    if loading_files >= limits.files {
        return Err(format!(
            "{loading_files} files are being loaded, as many as the service caches (half its RLIMIT_NOFILE)"
        ));
    }
    while cache.used.saturating_add(bytes) > limits.bytes || cache.files.len() >= limits.files {
        let oldest = cache.files.iter().filter_map(|(key, slot)| match slot {
            Slot::Ready(ready) => Some((ready.last_used, key.clone())),
            Slot::Loading(_) => None,
        });
        let Some((_, key)) = oldest.min() else { return Err("no cached file is left to drop".into()) };
        if let Some(Slot::Ready(ready)) = cache.files.remove(&key) {
            cache.used -= ready.loaded.bytes;
            cache.counters.evictions += 1;
            log(&format!(
                "evicted {} ({} bytes, {} hits) to make room for a file of {bytes} bytes",
                ready.loaded.path.display(),
                ready.loaded.bytes,
                ready.hits
            ));
        }
    }
    Ok(())
}

/// Publishes a load's outcome to the requests waiting for it and to the
/// cache, on every path out of the load (a panic included).
struct Finish<'s> {
    state: &'s State,
    key: Key,
    bytes: u64,
    /// The client whose request loaded it.
    uid: u32,
    pending: Arc<Pending>,
    outcome: Option<std::result::Result<Arc<Loaded>, WireError>>,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let outcome = self.outcome.take().unwrap_or_else(|| {
            Err(WireError::from_error(&Error::new(
                ErrorKind::Io,
                "load",
                Path::new("fd"),
                "the service's load failed unexpectedly",
            )))
        });
        {
            let mut cache = lock(&self.state.cache);
            cache.clock += 1;
            let now = cache.clock;
            match &outcome {
                Ok(loaded) => {
                    cache.counters.misses += 1;
                    // The reservation becomes the entry's (pages, as reserved).
                    cache.used = cache.used - self.bytes + loaded.bytes;
                    let ready = Ready {
                        loaded: Arc::clone(loaded),
                        served_to: vec![self.uid],
                        hits: 0,
                        handoffs: 1,
                        last_used: now,
                    };
                    cache.files.insert(self.key.clone(), Slot::Ready(ready));
                }
                Err(_) => {
                    cache.used -= self.bytes;
                    cache.files.remove(&self.key);
                }
            }
        }
        *lock(&self.pending.outcome) = Some(outcome);
        self.pending.done.notify_all();
    }
}

/// An error when a directory above `socket` keeps other users out (no
/// `o+x`): the users a service allows could not reach its socket.
fn unreachable_by_others(socket: &Path) -> Result<()> {
    let absolute = std::path::absolute(socket).map_err(|e| Error::io("resolve", socket, e))?;
    for dir in absolute.ancestors().skip(1) {
        let meta = std::fs::metadata(dir).map_err(|e| Error::io("stat", dir, e))?;
        if meta.mode() & 0o001 == 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "bind",
                socket,
                format!(
                    "{} (mode {:o}) keeps other users out, so the users --allow-uid/--allow-gid name \
                     could not connect: put the socket in a directory they can reach, such as \
                     /run/dmaload/dmaload.sock",
                    dir.display(),
                    meta.mode() & 0o7777
                ),
            ));
        }
    }
    Ok(())
}

/// `percent` of the memory available now (`MemAvailable`, or the memory
/// cgroup's headroom when smaller), as a memory limit.
pub fn memory_limit_percent(percent: f64) -> std::result::Result<u64, String> {
    if !(percent > 0.0 && percent <= 100.0) {
        return Err(format!("a memory limit of {percent}% is not in (0, 100]"));
    }
    let budget = dmaload::system::memory_budget().map_err(|e| format!("read /proc/meminfo: {e}"))?;
    Ok((budget.available as f64 * percent / 100.0) as u64)
}
