//! Engines move bytes between a file and a buffer. Each runs one planned
//! load: it waits for gathers to be populated (see [`Gate`]), issues the
//! chunk reads of the [`Plan`], checks every result and reports progress.

pub(crate) mod pool;
pub(crate) mod uring;
pub(crate) mod write;

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::plan::{Plan, Request};
use crate::sys;

/// Which engine reads the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// io_uring with buffers registered gather by gather (pages pinned
    /// once, not per I/O). The default; falls back to `Uring` when
    /// registration is refused and to `PreadPool` without io_uring.
    #[default]
    UringFixed,
    /// io_uring with plain user addresses (pages pinned per I/O).
    Uring,
    /// A pool of threads each issuing blocking `preadv2` calls.
    PreadPool,
    /// One thread issuing sequential blocking reads: the classic
    /// "mmap the buffer and read() into it".
    Read,
}

impl Engine {
    pub const ALL: [Engine; 4] = [Engine::UringFixed, Engine::Uring, Engine::PreadPool, Engine::Read];

    pub fn name(self) -> &'static str {
        match self {
            Engine::UringFixed => "uring-fixed",
            Engine::Uring => "uring",
            Engine::PreadPool => "pread-pool",
            Engine::Read => "read",
        }
    }
}

impl FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Engine::ALL.into_iter().find(|e| e.name() == s).ok_or_else(|| {
            let names: Vec<_> = Engine::ALL.iter().map(|e| e.name()).collect();
            format!("unknown engine {s:?} (expected one of: {})", names.join(", "))
        })
    }
}

/// What happens to the page cache while reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CachePolicy {
    /// O_DIRECT: the page cache is bypassed.
    Bypass,
    /// Buffered reads that leave the file in the page cache.
    Keep,
    /// Buffered reads with `RWF_DONTCACHE` (Linux 6.14): pages are dropped
    /// once copied.
    DontCache,
    /// Buffered reads followed by `POSIX_FADV_DONTNEED` on each chunk.
    Fadvise,
}

impl CachePolicy {
    pub(crate) fn rw_flags(self) -> i32 {
        if self == CachePolicy::DontCache {
            libc::RWF_DONTCACHE
        } else {
            0
        }
    }
}

/// Tells engines how many gathers are populated (and registered), and the
/// populating thread when to stop because the load failed.
pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    cancelled: AtomicBool,
}

struct GateState {
    ready: usize,
    registered: usize,
    registration_refused: Option<String>,
    failure: Option<(Option<i32>, String)>,
}

impl Gate {
    pub fn new() -> Gate {
        Gate {
            state: Mutex::new(GateState {
                ready: 0,
                registered: 0,
                registration_refused: None,
                failure: None,
            }),
            changed: Condvar::new(),
            cancelled: AtomicBool::new(false),
        }
    }

    /// Gathers `0..registered` hold a registered io_uring buffer (in the
    /// slot of the same number).
    pub fn publish_registered(&self, registered: usize) {
        self.lock().registered = registered;
    }

    /// Registering stopped: later gathers use plain addresses.
    pub fn refuse_registration(&self, reason: String) {
        self.lock().registration_refused = Some(reason);
    }

    pub fn registered(&self) -> usize {
        self.lock().registered
    }

    pub fn registration_refused(&self) -> Option<String> {
        self.lock().registration_refused.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Gathers `0..ready` may now be read into.
    pub fn publish(&self, ready: usize) {
        self.lock().ready = ready;
        self.changed.notify_all();
    }

    /// Populating failed; engines waiting on the gate get this error.
    pub fn fail(&self, err: &io::Error) {
        self.lock().failure = Some((err.raw_os_error(), err.to_string()));
        self.changed.notify_all();
    }

    /// The load failed: stop populating.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Whether gather `g` is ready, without blocking.
    pub fn is_ready(&self, g: usize) -> bool {
        self.lock().ready > g
    }

    /// Blocks until gather `g` is ready; returns how long it waited.
    pub fn wait_for(&self, g: usize) -> io::Result<Duration> {
        let started = Instant::now();
        let mut state = self.lock();
        loop {
            if state.ready > g {
                return Ok(started.elapsed());
            }
            if let Some((errno, message)) = &state.failure {
                let err = match errno {
                    Some(errno) => io::Error::from_raw_os_error(*errno),
                    None => io::Error::other(message.clone()),
                };
                return Err(err);
            }
            state = self.changed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

/// A progress callback: bytes done so far and bytes in all.
pub type ProgressFn = dyn Fn(u64, u64) + Send + Sync;

/// Counts finished bytes and forwards them to the caller's callback.
pub(crate) struct Progress<'a> {
    done: AtomicU64,
    total: u64,
    callback: Option<&'a ProgressFn>,
}

impl<'a> Progress<'a> {
    pub fn new(total: u64, callback: Option<&'a ProgressFn>) -> Self {
        Progress { done: AtomicU64::new(0), total, callback }
    }

    pub fn add(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if let Some(callback) = self.callback {
            callback(done, self.total);
        }
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }
}

/// Everything an engine needs to run one load.
pub(crate) struct Job<'a> {
    pub path: &'a Path,
    pub file: BorrowedFd<'a>,
    pub plan: &'a Plan,
    pub cache: CachePolicy,
    pub gate: &'a Gate,
    pub progress: &'a Progress<'a>,
    pub queue_depth: usize,
}

impl Job<'_> {
    /// Called once a request's data has all arrived: drops its whole chunk
    /// from the page cache when the policy says so.
    pub fn finish_request(&self, req: &Request) {
        if self.cache == CachePolicy::Fadvise {
            let chunk = self.plan.chunk_request(self.plan.chunk_index(req.start));
            // Advice only: a failure leaves pages cached but loses no data.
            let _ = sys::file::fadvise(
                self.file,
                chunk.start,
                chunk.end - chunk.start,
                libc::POSIX_FADV_DONTNEED,
            );
        }
    }

    pub fn read_error(&self, offset: u64, err: io::Error) -> Error {
        Error::io("read", self.path, err).at(offset)
    }
}

/// What an engine reports back.
#[derive(Debug, Default)]
pub(crate) struct EngineRun {
    /// Time spent blocked waiting for gathers to be populated.
    pub waited_for_memory: Duration,
    /// Fallbacks the engine took while running (e.g. registration refused).
    pub fallbacks: Vec<crate::load::Fallback>,
    /// The engine that actually did the work.
    pub engine: Engine,
}

pub(crate) type EngineResult = Result<EngineRun>;

/// The fallback taken when the kernel has no sparse registered-buffer
/// table: io_uring with plain addresses.
pub(crate) fn no_sparse_table(err: &io::Error) -> crate::load::Fallback {
    crate::load::Fallback::new(
        Engine::UringFixed.name(),
        Engine::Uring.name(),
        format!("cannot create a sparse registered-buffer table (Linux 5.19+): {err}"),
    )
}

/// Whether a failed `io_uring_setup` means io_uring is unavailable to this
/// process (old kernel, `kernel.io_uring_disabled`, seccomp), not a bug.
pub(crate) fn io_uring_unavailable(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOSYS | libc::EPERM | libc::EACCES | libc::EOPNOTSUPP))
}
