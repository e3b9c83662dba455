//! The options of a load, each defined once: engine, I/O mode, sizes and
//! threads, progress and cancellation, and the fallbacks a load may take.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use crate::cancel::CancelToken;
use crate::engine::{Engine, ProgressFn};
use crate::error::{Error, ErrorKind, Result};
use crate::heap::MemoryKind;

/// Bytes populated (and registered) as one unit: seed 000's gather size.
pub const DEFAULT_GATHER_SIZE: usize = 128 << 20;
/// Bytes per read request. Measured on a virtio disk (max_sectors_kb 4096):
/// 4 MiB reads reach the device's best throughput with the least CPU.
pub const DEFAULT_CHUNK_SIZE: usize = 4 << 20;
/// Read requests kept in flight by the io_uring engines: 32 × 4 MiB beat
/// 16 on the same disk, as it did for fio.
pub const DEFAULT_QUEUE_DEPTH: usize = 32;
/// Threads of the pread-pool engine.
pub const DEFAULT_POOL_THREADS: usize = 8;
/// Threads populating each gather: one per CPU, at most 4, beyond which
/// memory bandwidth, not CPU, limits page zeroing. The I/O needs little CPU
/// of its own: on 2 vCPUs, 2 populating threads populated 2 GiB in 0.6-0.8 s
/// against 0.9-2.5 s for one, and the reads never waited for memory.
pub fn default_populate_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4))
}

/// Largest queue depth accepted (io_uring rings hold at most 32768 entries).
const MAX_QUEUE_DEPTH: usize = 4096;

/// How the file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IoMode {
    /// Direct I/O where the filesystem supports it, else buffered reads that
    /// leave nothing in the page cache.
    #[default]
    Auto,
    /// Direct I/O (O_DIRECT) or an error: no fallback.
    Direct,
    /// Buffered reads through the page cache, which keeps the file.
    Buffered,
    /// Buffered reads that drop the pages they read (RWF_DONTCACHE, else
    /// POSIX_FADV_DONTNEED per chunk).
    DontCache,
}

impl IoMode {
    pub const ALL: [IoMode; 4] = [IoMode::Auto, IoMode::Direct, IoMode::Buffered, IoMode::DontCache];

    pub fn name(self) -> &'static str {
        match self {
            IoMode::Auto => "auto",
            IoMode::Direct => "direct",
            IoMode::Buffered => "buffered",
            IoMode::DontCache => "dontcache",
        }
    }
}

impl std::str::FromStr for IoMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        IoMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown mode {s:?} (expected one of: auto, direct, buffered, dontcache)"))
    }
}

/// Options of [`load`] and [`load_range`]; `LoadOptions::default()` is
/// what a user gets without flags.
#[derive(Clone)]
pub struct LoadOptions {
    pub engine: Engine,
    pub mode: IoMode,
    pub memory: MemoryKind,
    /// Bytes populated (and registered) as one unit.
    pub gather_size: usize,
    /// Bytes per read request (rounded up to whole pages).
    pub chunk_size: usize,
    /// Requests in flight for the io_uring engines.
    pub queue_depth: usize,
    /// Threads of the pread-pool engine.
    pub threads: usize,
    /// Threads that populate (allocate and zero) each gather ahead of the
    /// I/O; page zeroing is CPU-bound, so more threads hide more of it.
    pub populate_threads: usize,
    /// Called with (bytes done, bytes in all) from a reporting thread of
    /// the load (never an I/O thread, so a slow callback cannot stall the
    /// reads): about every 50 ms while bytes arrive, and once with
    /// `done == total` before a successful load returns.
    pub progress: Option<Arc<ProgressFn>>,
    /// Cancels the load from another thread (see [`CancelToken`]).
    pub cancel: CancelToken,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            engine: Engine::default(),
            mode: IoMode::default(),
            memory: MemoryKind::default(),
            gather_size: DEFAULT_GATHER_SIZE,
            chunk_size: DEFAULT_CHUNK_SIZE,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            threads: DEFAULT_POOL_THREADS,
            populate_threads: default_populate_threads(),
            progress: None,
            cancel: CancelToken::default(),
        }
    }
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("engine", &self.engine)
            .field("mode", &self.mode)
            .field("memory", &self.memory)
            .field("gather_size", &self.gather_size)
            .field("chunk_size", &self.chunk_size)
            .field("queue_depth", &self.queue_depth)
            .field("threads", &self.threads)
            .field("populate_threads", &self.populate_threads)
            .field("progress", &self.progress.is_some())
            .field("cancelled", &self.cancel.is_cancelled())
            .finish()
    }
}

/// A path not taken, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fallback {
    pub from: String,
    pub to: String,
    pub reason: String,
}

impl Fallback {
    pub fn new(from: &str, to: &str, reason: impl Into<String>) -> Self {
        Fallback { from: from.into(), to: to.into(), reason: reason.into() }
    }
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}: {}", self.from, self.to, self.reason)
    }
}

pub(crate) fn validate(path: &Path, o: &LoadOptions) -> Result<()> {
    let bad = |what: String| Err(Error::new(ErrorKind::InvalidInput, "load", path, what));
    if o.chunk_size == 0 || o.chunk_size > 1 << 30 {
        return bad(format!("chunk size {} must be between 1 byte and 1 GiB", o.chunk_size));
    }
    if o.gather_size == 0 {
        return bad("gather size must be positive".into());
    }
    if o.queue_depth == 0 || o.queue_depth > MAX_QUEUE_DEPTH {
        return bad(format!("queue depth {} must be between 1 and {MAX_QUEUE_DEPTH}", o.queue_depth));
    }
    if o.threads == 0 || o.threads > 1024 {
        return bad(format!("thread count {} must be between 1 and 1024", o.threads));
    }
    if o.populate_threads == 0 || o.populate_threads > 1024 {
        return bad(format!("populate thread count {} must be between 1 and 1024", o.populate_threads));
    }
    Ok(())
}
