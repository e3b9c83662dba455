//! `load`: allocate a buffer and fill it with a file's bytes in one call,
//! the userspace form of seed 000's DMA_HEAP_ALLOC_AND_READ_FILE.
//!
//! The buffer is reserved up front and populated gather by gather
//! (`fallocate` + `MADV_POPULATE_WRITE`, then io_uring registration) by
//! helper threads while the engine fills the gathers already populated, so
//! T(total) ≈ T(first gather) + max(T(alloc), T(I/O)); gathers ramp up from
//! one chunk, so T(first gather) is milliseconds. The buffer is returned
//! only once every byte has arrived.

use std::fmt;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::buffer::Buffer;
use crate::cancel::CancelToken;
use crate::engine::{self, CachePolicy, Engine, EngineRun, Gate, Job, Progress, ProgressFn};
use crate::error::{Error, ErrorKind, Result};
use crate::heap::{Allocation, MemoryKind};
use crate::pagecache::{self, Residency};
use crate::plan::Plan;
use crate::source::Source;
use crate::sys::file::{statx_dio_align, DioAlignQuery};
use crate::sys::mem::{MappingWriter, Seals};
use crate::sys::uring::{Registrar, Ring};
use crate::{sys, system};

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

/// What a load did and how long each part took.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    #[serde(serialize_with = "crate::error::serialize_path")]
    pub path: PathBuf,
    /// File offset of the first byte loaded.
    pub offset: u64,
    pub bytes: u64,
    /// The engine that did the reading (after fallbacks).
    pub engine: Engine,
    /// How reads treated the page cache (after fallbacks): `bypass` is
    /// direct I/O.
    pub cache: CachePolicy,
    pub memory: MemoryKind,
    /// Whether the kernel's THP policy let the memory use 2 MiB pages (see
    /// [`crate::system::huge_pages_allowed`]).
    pub huge_pages: bool,
    /// The filesystem the file is on ("ext4", "tmpfs", ...), or
    /// "block-device".
    pub filesystem: &'static str,
    /// Offset alignment of the reads (1 for buffered I/O).
    pub alignment: usize,
    pub chunk_size: usize,
    pub gather_size: usize,
    pub queue_depth: usize,
    pub fallbacks: Vec<Fallback>,
    /// Populating (allocating and zeroing) all of the buffer's pages, on the
    /// helper thread.
    pub alloc_seconds: f64,
    /// Registering (pinning) the buffer's gathers with io_uring, on the
    /// helper thread, beside the I/O.
    pub register_seconds: f64,
    /// Populating the first gather: the part of allocation never hidden.
    pub first_gather_seconds: f64,
    /// Reading, from the first request to the last completion, less the time
    /// the reads stalled waiting for memory.
    pub io_seconds: f64,
    /// Time the reads stalled waiting for a gather to be populated.
    pub waited_for_memory_seconds: f64,
    pub total_seconds: f64,
    pub gib_per_second: f64,
    /// CPU time of the whole process during the load (all threads, kernel
    /// page zeroing included).
    pub cpu_user_seconds: f64,
    pub cpu_system_seconds: f64,
    /// How much of the loaded range is in the page cache afterwards.
    pub page_cache: Residency,
}

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

fn validate(path: &Path, o: &LoadOptions) -> Result<()> {
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

/// How the load reads: the file to read from (O_DIRECT or not), the page
/// cache policy and the offset alignment.
pub(crate) struct ReadSetup {
    pub file: File,
    pub cache: CachePolicy,
    pub align: usize,
}

/// Reads through the page cache, on the source's own open file.
fn buffered(path: &Path, file: &File, cache: CachePolicy) -> Result<ReadSetup> {
    let file = file.try_clone().map_err(|e| Error::io("dup", path, e))?;
    // A retry after a rejected direct read: the flag is on the shared open file.
    sys::file::set_direct(file.as_fd(), false).map_err(|e| Error::io("fcntl(O_DIRECT off)", path, e))?;
    Ok(ReadSetup { file, cache, align: 1 })
}

/// Buffered reads that leave no page-cache residue: RWF_DONTCACHE where the
/// filesystem has it, else fadvise per chunk.
fn no_residue_policy(file: &File) -> CachePolicy {
    if sys::file::supports_dontcache(file.as_fd()) {
        CachePolicy::DontCache
    } else {
        CachePolicy::Fadvise
    }
}

fn choose_read_setup(
    path: &Path,
    file: &File,
    source: &Source,
    mode: IoMode,
    fallbacks: &mut Vec<Fallback>,
) -> Result<ReadSetup> {
    match mode {
        IoMode::Buffered => return buffered(path, file, CachePolicy::Keep),
        IoMode::DontCache => return buffered(path, file, no_residue_policy(file)),
        IoMode::Auto | IoMode::Direct => {}
    }
    let refuse = |why: String| -> Result<ReadSetup> {
        Err(Error::new(ErrorKind::DirectIoUnavailable, "open O_DIRECT", path, why))
    };
    if source.in_memory {
        let why =
            format!("{} keeps file data in the page cache, so direct I/O cannot bypass it", source.storage);
        if mode == IoMode::Direct {
            return refuse(why);
        }
        fallbacks.push(Fallback::new("direct", "buffered", why));
        return buffered(path, file, CachePolicy::Keep);
    }
    let align = match statx_dio_align(file.as_fd()) {
        Ok(DioAlignQuery::Supported(a)) => Some(a.offset.max(1) as usize),
        Ok(DioAlignQuery::Unsupported) => None,
        // Older kernels: the filesystem block size is a multiple of the
        // device's logical block size, so it is a safe alignment.
        Ok(DioAlignQuery::Unknown) | Err(_) => {
            let blksize = file.metadata().map(|m| m.blksize() as usize).unwrap_or(4096);
            Some(if blksize.is_power_of_two() && blksize >= 512 { blksize } else { 4096 })
        }
    };
    let mut unsupported = || {
        let why = format!(
            "{} does not support O_DIRECT on this file (statx STATX_DIOALIGN / open EINVAL)",
            source.storage
        );
        if mode == IoMode::Direct {
            return refuse(why);
        }
        let setup = buffered(path, file, no_residue_policy(file))?;
        fallbacks.push(Fallback::new("direct", cache_name(setup.cache), why));
        Ok(setup)
    };
    let Some(align) = align else { return unsupported() };
    // O_DIRECT on the file already opened and checked, never a second open
    // by path: a file renamed over the path since cannot be read by mistake.
    let direct = file.try_clone().map_err(|e| Error::io("dup", path, e))?;
    match sys::file::set_direct(direct.as_fd(), true) {
        Ok(()) => Ok(ReadSetup { file: direct, cache: CachePolicy::Bypass, align }),
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => unsupported(),
        Err(err) => Err(Error::io("fcntl(O_DIRECT)", path, err)),
    }
}

fn cache_name(cache: CachePolicy) -> &'static str {
    match cache {
        CachePolicy::Bypass => "direct",
        CachePolicy::Keep => "buffered",
        CachePolicy::DontCache => "buffered (RWF_DONTCACHE)",
        CachePolicy::Fadvise => "buffered (POSIX_FADV_DONTNEED per chunk)",
    }
}

/// Time spent on the helper thread: populating the buffer, and
/// registering it with io_uring.
#[derive(Debug, Default)]
pub(crate) struct PopulateTimes {
    all: Duration,
    first: Duration,
    register: Duration,
}

/// Allocates and maps the pages of `range` on `threads` threads, each
/// taking an equal page-aligned share, with `MADV_POPULATE_WRITE` so the I/O
/// never faults. No `fallocate` first: it has no mapping to take the
/// `MADV_HUGEPAGE` hint from, so under `shmem_enabled=advise` it would
/// allocate a memfd in 4 KiB pages.
pub(crate) fn populate_range(dst: MappingWriter<'_>, range: Range<usize>, threads: usize) -> io::Result<()> {
    let populate = |part: Range<usize>| dst.populate(part);
    let page = sys::mem::page_size();
    let share = range.len().div_ceil(threads.max(1)).div_ceil(page) * page;
    if threads <= 1 || share >= range.len() {
        return populate(range);
    }
    let parts: Vec<Range<usize>> =
        range.clone().step_by(share).map(|start| start..(start + share).min(range.end)).collect();
    std::thread::scope(|scope| {
        // A part whose helper thread cannot be created is populated here.
        let mut result = Ok(());
        let mut helpers = Vec::new();
        for part in &parts[1..] {
            let helper = part.clone();
            match std::thread::Builder::new()
                .name("dmaload-populate".into())
                .spawn_scoped(scope, move || populate(helper))
            {
                Ok(helper) => helpers.push(helper),
                Err(_) => result = result.and(populate(part.clone())),
            }
        }
        result = result.and(populate(parts[0].clone()));
        for helper in helpers {
            let joined =
                helper.join().unwrap_or_else(|_| Err(io::Error::other("a populating thread panicked")));
            result = result.and(joined);
        }
        result
    })
}

/// Populates each gather in order, registers it with io_uring when a
/// registrar is given, and opens the gate behind it.
fn populate_gathers(
    dst: MappingWriter<'_>,
    mut registrar: Option<Registrar<'_>>,
    plan: &Plan,
    gate: &Gate,
    threads: usize,
) -> PopulateTimes {
    let mut times = PopulateTimes::default();
    for g in 0..plan.gather_count() {
        if gate.is_cancelled() {
            break;
        }
        let started = Instant::now();
        let range = plan.gather_range(g);
        if let Err(err) = populate_range(dst, range.clone(), threads) {
            gate.fail(&err);
            break;
        }
        let took = started.elapsed();
        times.all += took;
        if g == 0 {
            times.first = took;
        }
        if let Some(reg) = &registrar {
            let started = Instant::now();
            match reg.register(g as u32, range) {
                Ok(()) => gate.publish_registered(g + 1),
                Err(err) => {
                    gate.refuse_registration(engine::uring::register_refusal(&err));
                    registrar = None;
                }
            }
            times.register += started.elapsed();
        }
        gate.publish(g + 1);
    }
    times
}

/// An engine ready to run, chosen from the options and what the process
/// may do.
enum Prepared<'m> {
    Uring(Box<Ring<'m>>),
    Pool { threads: usize, engine: Engine },
}

/// Sets up the engine the options ask for: the ring and, for registered
/// buffers, its sparse buffer table and a registrar for the populating
/// thread. Falls back to the pread pool when io_uring is unavailable to this
/// process, and to plain addresses when the table is.
fn prepare_engine<'m>(
    path: &Path,
    plan: &Plan,
    dst: MappingWriter<'m>,
    options: &LoadOptions,
    fallbacks: &mut Vec<Fallback>,
) -> Result<(Prepared<'m>, Option<Registrar<'m>>)> {
    let pool = |engine: Engine| Prepared::Pool {
        threads: if engine == Engine::Read { 1 } else { options.threads },
        engine,
    };
    if matches!(options.engine, Engine::PreadPool | Engine::Read) {
        return Ok((pool(options.engine), None));
    }
    if plan.chunk_count() == 0 {
        // Nothing to read (an empty file or range): no ring, no buffers to
        // register, and no fallback to report.
        return Ok((Prepared::Pool { threads: 1, engine: options.engine }, None));
    }
    let entries = (options.queue_depth as u32).next_power_of_two();
    let mut ring = match Ring::new(entries, dst) {
        Ok(ring) => ring,
        Err(err) if engine::io_uring_unavailable(&err) => {
            fallbacks.push(Fallback::new(
                options.engine.name(),
                Engine::PreadPool.name(),
                engine::uring_unavailable_reason(&err),
            ));
            return Ok((pool(Engine::PreadPool), None));
        }
        Err(err) => return Err(Error::io("io_uring_setup", path, err)),
    };
    let registrar = if options.engine == Engine::UringFixed {
        match ring.register_slots(plan.gather_count() as u32).and_then(|()| ring.registrar()) {
            Ok(registrar) => Some(registrar),
            Err(err) => {
                fallbacks.push(engine::no_sparse_table(&err));
                None
            }
        }
    } else {
        None
    };
    Ok((Prepared::Uring(Box::new(ring)), registrar))
}

/// What one successful fill produced.
struct Filled {
    alloc: Allocation,
    run: EngineRun,
    times: PopulateTimes,
    engine_wall: Duration,
}

/// One attempt at filling a fresh allocation; the allocation is dropped
/// (never returned) when it fails.
fn fill(path: &Path, setup: &ReadSetup, plan: &Plan, len: u64, options: &LoadOptions) -> Result<Filled> {
    let mut alloc = Allocation::new(options.memory, plan.mapping_len)
        .map_err(|e| Error::io("allocate memory", path, e))?;
    let started = Instant::now();
    let (run, times) = fill_mapping(path, setup, plan, len, options, alloc.mapping.writer())?;
    Ok(Filled { alloc, run, times, engine_wall: started.elapsed() })
}

/// Reads the plan's range into `dst` (at least `plan.mapping_len` bytes)
/// with the options' engine, a helper thread populating (and registering)
/// each gather ahead of the reads. On error the memory holds a partial
/// read, which the caller must not hand out as loaded.
pub(crate) fn fill_mapping(
    path: &Path,
    setup: &ReadSetup,
    plan: &Plan,
    len: u64,
    options: &LoadOptions,
    dst: MappingWriter<'_>,
) -> Result<(EngineRun, PopulateTimes)> {
    let gate = Gate::new(options.cancel.clone());
    let progress = Progress::new(len, options.progress.as_deref());
    let job = Job {
        path,
        file: setup.file.as_fd(),
        plan,
        cache: setup.cache,
        gate: &gate,
        progress: &progress,
        queue_depth: options.queue_depth,
    };
    let mut fallbacks = Vec::new();
    let (prepared, registrar) = match prepare_engine(path, plan, dst, options, &mut fallbacks) {
        Ok((prepared, registrar)) => (Ok(prepared), registrar),
        Err(err) => (Err(err), None),
    };
    let fixed = registrar.is_some();
    // Taken by whichever thread populates (see below).
    let registrar = std::sync::Mutex::new(registrar);
    let (result, times) = std::thread::scope(|scope| {
        let populate = || {
            let registrar = registrar.lock().unwrap_or_else(|p| p.into_inner()).take();
            let populated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                populate_gathers(dst, registrar, plan, &gate, options.populate_threads)
            }));
            // A panic must still open the gate, or the engine would wait forever.
            populated.inspect_err(|_| gate.fail(&io::Error::other("the populating thread panicked")))
        };
        let populator =
            std::thread::Builder::new().name("dmaload-populate".into()).spawn_scoped(scope, populate);
        // Without a thread of its own (RLIMIT_NPROC, cgroup pids.max) the
        // memory is populated before the reads instead of beside them.
        let (populator, populated_first) = match populator {
            Ok(handle) => (Some(handle), None),
            Err(err) => {
                fallbacks.push(Fallback::new(
                    "populate beside the reads",
                    "populate before the reads",
                    format!("cannot create a thread: {err}"),
                ));
                (None, Some(populate()))
            }
        };
        let reporter = std::thread::Builder::new()
            .name("dmaload-progress".into())
            .spawn_scoped(scope, || progress.report());
        let result = prepared.and_then(|prepared| match prepared {
            Prepared::Uring(ring) => engine::uring::run(&job, *ring, fixed),
            Prepared::Pool { threads, engine } => engine::pool::run(&job, dst, threads, engine),
        });
        if result.is_err() {
            gate.cancel();
        }
        progress.finish();
        // A panicking reporter only means a callback panicked: no bytes are at stake.
        let _ = reporter.map(|r| r.join());
        let populated = match populator {
            Some(handle) => handle.join().unwrap_or_else(|_| Err(Box::new("populating thread panicked"))),
            None => populated_first.unwrap_or_else(|| Err(Box::new("not populated"))),
        };
        let times = populated.unwrap_or_default();
        (result, times)
    });
    let mut run = result?;
    fallbacks.append(&mut run.fallbacks);
    run.fallbacks = fallbacks;
    debug_assert_eq!(progress.done(), len);
    progress.report_complete();
    Ok((run, times))
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
