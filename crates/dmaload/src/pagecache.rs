//! Page-cache residency and eviction of files, for reports and for
//! benchmarks that must start cold.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::Path;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::options::LoadOptions;
use crate::source::OpenFile;
use crate::sys;
use crate::types::{Engine, Fallback, IoMode};

/// How much of a byte range of a file is in the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Residency {
    /// Bytes of the range held in the page cache (whole pages).
    pub resident_bytes: u64,
    /// Fraction of the range's pages that are resident, 0.0 to 1.0.
    pub fraction: f64,
}

/// Page-cache residency of `offset..offset + len` of an open file (`mincore`).
pub fn residency_of(file: &File, path: &Path, offset: u64, len: u64) -> Result<Residency> {
    let (resident, pages) = sys::mem::page_cache_residency(file.as_fd(), offset, len)
        .map_err(|e| Error::io("mincore", path, e))?;
    let page = sys::mem::page_size() as u64;
    let fraction = if pages == 0 { 0.0 } else { resident as f64 / pages as f64 };
    Ok(Residency { resident_bytes: (resident * page).min(len), fraction })
}

/// [`residency_of`], or `None` where it cannot be known: a file this
/// process neither owns nor may write, whose pages mincore calls all
/// cached, or no address space left to map a window of it (`ENOMEM` under
/// a tight `RLIMIT_AS`): residency only informs a load, it must not fail one.
pub fn known_residency_of(file: &File, path: &Path, offset: u64, len: u64) -> Result<Option<Residency>> {
    match residency_of(file, path, offset, len) {
        Err(err) if err.io_error().kind() == std::io::ErrorKind::PermissionDenied => Ok(None),
        Err(err) if err.io_error().kind() == std::io::ErrorKind::OutOfMemory => Ok(None),
        other => other.map(Some),
    }
}

/// Page-cache residency of the whole file at `path`.
pub fn residency(path: &Path) -> Result<Residency> {
    let file = crate::source::open_for_reading(path)?;
    let len = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
    residency_of(&file, path, 0, len)
}

/// Drops the file's clean pages from the page cache after writing back
/// dirty ones (`fdatasync` + `POSIX_FADV_DONTNEED`; no root needed), so the
/// next read comes from the device. A FIFO, socket or character device is
/// refused without being opened: it has no page cache.
pub fn evict(path: &Path) -> Result<()> {
    let refusal = "has no page cache to evict: only regular files and block devices have one";
    let file = crate::source::open_regular(path, refusal)?;
    file.sync_data().map_err(|e| Error::io("fdatasync", path, e))?;
    sys::file::fadvise(file.as_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
        .map_err(|e| Error::io("posix_fadvise(DONTNEED)", path, e))
}

/// Share of a range in the page cache from which a staged load in `auto`
/// mode copies from the cache instead of reading the disk again.
pub const CACHED_SHARE: f64 = 0.5;

/// A staged load looks before it reads: in `auto` mode, when most of the
/// range is already in the page cache (`mincore`), copying it from there on
/// every CPU beats direct I/O re-reading the disk (more than twice as fast
/// on the H100 machine: docs/benchmarks.md, "Figures behind the defaults"). Returns
/// the options for that, and the note the report carries.
pub(crate) fn cached_source_options(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<Option<(LoadOptions, Fallback)>> {
    if options.mode != IoMode::Auto {
        return Ok(None);
    }
    let len = len.unwrap_or(file.len().saturating_sub(offset));
    if offset.checked_add(len).is_none() {
        // No file holds such a range: open_range refuses it, naming the offset.
        return Ok(None);
    }
    // A file of tmpfs (a cache service's memfd, say) is all page cache.
    let cached = if file.source().in_memory {
        None
    } else {
        // Unknown residency (mincore would call every page cached): read the disk.
        match known_residency_of(&file.source().file, file.path(), offset, len)? {
            Some(residency) => Some(residency.fraction),
            None => return Ok(None),
        }
    };
    if len == 0 || cached.is_some_and(|share| share < CACHED_SHARE) {
        return Ok(None);
    }
    let warm = LoadOptions {
        mode: IoMode::Buffered,
        engine: Engine::PreadPool,
        threads: cache_copy_threads(),
        ..options.clone()
    };
    let threads = warm.threads;
    let why = match cached {
        Some(share) => format!(
            "{:.0}% of the range is in the page cache: copying it from there on {threads} threads beats reading \
             the disk again",
            share * 100.0
        ),
        None => format!("the file lives in memory ({}): copied on {threads} threads", file.source().storage),
    };
    Ok(Some((warm, Fallback::new("direct", "page cache", why))))
}

/// Threads that copy a load's cached bytes from the page cache: one per
/// CPU, at most [`MAX_CACHE_COPY_THREADS`]. A copy keeps its CPU busy, so
/// more threads than CPUs only take turns, and on a small host they take
/// the CPU an engine's own work beside the load needs (the options'
/// `threads`, 8 by default, made 8 copying threads on 2 vCPUs).
pub(crate) fn cache_copy_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    cpus.min(MAX_CACHE_COPY_THREADS)
}

/// Threads copying from the page cache at most: memory bandwidth, not
/// CPUs, limits them past this.
const MAX_CACHE_COPY_THREADS: usize = 16;
