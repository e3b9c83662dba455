//! The plain types every layer shares: which engine, how the file is read,
//! what happens to the page cache, a path not taken, a progress callback.
//! A leaf: it imports nothing of the crate, so any module may use it.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// Which way the engine moves bytes between a file and memory: a load
/// reads, a save (or a capture) writes. A plan carries it; the memory an
/// engine runs over has it too (`sys::uring::RingMemory::DIRECTION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// File → memory.
    Read,
    /// Memory → file.
    Write,
}

impl Direction {
    /// The system call's name, for errors: `read` or `write`.
    pub fn op(self) -> &'static str {
        match self {
            Direction::Read => "read",
            Direction::Write => "write",
        }
    }
}

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

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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

/// How the file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IoMode {
    /// Where the filesystem supports direct I/O, direct or buffered reads
    /// that leave nothing in the page cache, whichever an io_uring load at
    /// the default depth measures faster for the device (docs/cli.md;
    /// direct for other loads); else such buffered reads.
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

impl fmt::Display for IoMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IoMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        IoMode::ALL.into_iter().find(|m| m.name() == s).ok_or_else(|| {
            let names: Vec<_> = IoMode::ALL.iter().map(|m| m.name()).collect();
            format!("unknown mode {s:?} (expected one of: {})", names.join(", "))
        })
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

/// A progress callback: bytes done so far and bytes in all.
pub type ProgressFn = dyn Fn(u64, u64) + Send + Sync;
