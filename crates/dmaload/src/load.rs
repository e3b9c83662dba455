//! `load`: allocate a buffer and fill it with a file's bytes in one call,
//! the userspace form of seed 000's DMA_HEAP_ALLOC_AND_READ_FILE.
//!
//! The file is opened and checked once ([`crate::source`]); the buffer is
//! reserved up front and filled by the pipeline ([`crate::pipeline`]):
//! helper threads populate it gather by gather (`MADV_POPULATE_WRITE`, then
//! io_uring registration) while the engine fills the gathers already
//! populated, so T(total) ≈ T(first gather) + max(T(alloc), T(I/O));
//! gathers ramp up from one chunk, so T(first gather) is milliseconds. The
//! buffer is returned only once every byte has arrived and the file shows
//! no change since it was opened.

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Instant;

use crate::buffer::Buffer;
use crate::engine::{CachePolicy, Engine};
use crate::error::{Error, ErrorKind, Result};
use crate::options::validate;
pub use crate::options::{
    default_populate_threads, Fallback, IoMode, LoadOptions, DEFAULT_CHUNK_SIZE, DEFAULT_GATHER_SIZE,
    DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH,
};
use crate::pagecache;
use crate::pipeline::{fill, Filled};
use crate::plan::Plan;
pub use crate::report::LoadReport;
use crate::source::{buffered, cache_name, choose_read_setup, no_residue_policy, Source};
use crate::sys::mem::Seals;
use crate::{sys, system};

/// Loads the whole file at `path`.
pub fn load(path: impl AsRef<Path>, options: &LoadOptions) -> Result<(Buffer, LoadReport)> {
    load_impl(path.as_ref(), 0, None, options)
}

/// Loads `len` bytes of the file at `path` from byte `offset` (neither needs
/// any alignment). A range that extends past the end of the file is an error.
pub fn load_range(
    path: impl AsRef<Path>,
    offset: u64,
    len: u64,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    load_impl(path.as_ref(), offset, Some(len), options)
}

/// Loads the file at `path` from byte `offset` (any alignment) to its end,
/// its length taken from the open file itself (so a file replaced at the
/// path between a `stat` and the load cannot change what "the end" means).
pub fn load_from(path: impl AsRef<Path>, offset: u64, options: &LoadOptions) -> Result<(Buffer, LoadReport)> {
    load_impl(path.as_ref(), offset, None, options)
}

/// Loads from a file the caller has already opened (any flags: it is
/// reopened through `/proc/self/fd`, so the caller's fd is never changed):
/// `len` bytes from `offset`, or to the end when `len` is `None`. The same
/// checks as a load by path apply (regular file or block device, changes
/// during the load detected).
pub fn load_fd(
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    validate(Path::new("fd"), options)?;
    let (source, path) = Source::from_fd(fd)?;
    load_source(source, &path, offset, len, options)
}

fn load_impl(
    path: &Path,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    validate(path, options)?;
    load_source(Source::open(path)?, path, offset, len, options)
}

fn load_source(
    source: Source,
    path: &Path,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    let started = Instant::now();
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let file = &source.file;
    let size = source.size;
    if offset > size {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            format!("offset {offset} is past the end of the file ({size} bytes)"),
        )
        .at(offset));
    }
    let len = len.unwrap_or(size - offset);
    let end = offset.checked_add(len).filter(|&end| end <= size).ok_or_else(|| {
        Error::new(
            ErrorKind::Truncated,
            "load",
            path,
            format!("range {offset}+{len} extends past the end of the file ({size} bytes)"),
        )
        .at(size)
    })?;
    let budget = system::memory_budget().map_err(|e| Error::io("read /proc/meminfo", path, e))?;
    if len > budget.available {
        return Err(Error::new(
            ErrorKind::OutOfMemory,
            "load",
            path,
            format!(
                "needs {len} bytes of memory but only {} are available ({}); load a range instead",
                budget.available, budget.limited_by
            ),
        ));
    }
    let mut fallbacks = Vec::new();
    let mut setup = choose_read_setup(path, file, &source, options.mode, &mut fallbacks)?;
    let page = sys::mem::page_size();
    let mut plan = Plan::new(offset, len, setup.align, options.chunk_size, options.gather_size, page);

    let filled = match fill(path, &setup, &plan, len, options) {
        // Some devices reject the reported alignment: retry once buffered.
        Err(err)
            if setup.cache == CachePolicy::Bypass
                && options.mode == IoMode::Auto
                && err.raw_os_error() == Some(libc::EINVAL) =>
        {
            setup = buffered(path, file, no_residue_policy(file))?;
            fallbacks.push(Fallback::new(
                "direct",
                cache_name(setup.cache),
                format!("O_DIRECT read rejected: {err}"),
            ));
            plan = Plan::new(offset, len, 1, options.chunk_size, options.gather_size, page);
            fill(path, &setup, &plan, len, options)
        }
        // io_uring cancels requests that its io-wq cannot create a worker
        // thread for (RLIMIT_NPROC, cgroup pids.max): the pool reads inline.
        Err(err)
            if matches!(options.engine, Engine::UringFixed | Engine::Uring)
                && err.raw_os_error() == Some(libc::ECANCELED)
                && !options.cancel.is_cancelled() =>
        {
            fallbacks.push(Fallback::new(
                options.engine.name(),
                Engine::PreadPool.name(),
                format!(
                    "io_uring cancelled a read ({err}): its worker threads could not be created \
                     (RLIMIT_NPROC or the cgroup's pids.max)"
                ),
            ));
            fill(path, &setup, &plan, len, &LoadOptions { engine: Engine::PreadPool, ..options.clone() })
        }
        other => other,
    };
    let Filled { mut alloc, run, times, engine_wall } = filled.map_err(|err| match err.kind() {
        ErrorKind::Truncated => match file.metadata() {
            Ok(meta) => err.with_note(&format!("; the file is now {} bytes", meta.len())),
            Err(_) => err,
        },
        _ => err,
    })?;
    // Every byte is in, and progress has said so: a file written meanwhile
    // (in place, or cut short) may have given a mix of old and new bytes.
    source.check_unchanged(path, end)?;
    // Direct I/O read whole aligned blocks around the range: the bytes
    // outside it are not the caller's to see, nor to share through the memfd.
    let data = plan.data_range();
    let bytes = alloc.mapping.as_mut_slice();
    bytes[..data.start].fill(0);
    bytes[data.end..].fill(0);
    if let Some(memfd) = &alloc.memfd {
        // Fix the size: udmabuf requires F_SEAL_SHRINK. (Buffer::memfd adds
        // F_SEAL_FUTURE_WRITE when the fd leaves: udmabuf refuses that seal.)
        sys::mem::add_seals(memfd.as_fd(), Seals::SHRINK | Seals::GROW)
            .map_err(|e| Error::io("seal memfd", path, e))?;
    }
    let buffer = Buffer::new(alloc, plan.data_range(), &plan.gather_ranges());
    let page_cache = pagecache::residency_of(file, path, offset, len)?;
    let cpu_after = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let total = started.elapsed();
    fallbacks.extend(run.fallbacks);
    debug_assert_eq!(end - offset, buffer.len() as u64);
    let report = LoadReport {
        path: path.to_owned(),
        offset,
        bytes: len,
        engine: run.engine,
        cache: setup.cache,
        memory: options.memory,
        huge_pages: crate::system::huge_pages_allowed(options.memory),
        filesystem: source.storage,
        alignment: setup.align,
        chunk_size: plan.chunk,
        gather_size: plan.gather,
        queue_depth: options.queue_depth,
        fallbacks,
        alloc_seconds: times.all.as_secs_f64(),
        register_seconds: times.register.as_secs_f64(),
        first_gather_seconds: times.first.as_secs_f64(),
        io_seconds: engine_wall.saturating_sub(run.waited_for_memory).as_secs_f64(),
        waited_for_memory_seconds: run.waited_for_memory.as_secs_f64(),
        total_seconds: total.as_secs_f64(),
        gib_per_second: len as f64 / (1u64 << 30) as f64 / total.as_secs_f64().max(1e-9),
        cpu_user_seconds: (cpu_after.0.saturating_sub(cpu_before.0)).as_secs_f64(),
        cpu_system_seconds: (cpu_after.1.saturating_sub(cpu_before.1)).as_secs_f64(),
        page_cache,
    };
    Ok((buffer, report))
}
