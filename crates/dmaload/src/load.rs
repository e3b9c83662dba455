//! `load`: allocate a buffer and fill it with a file's bytes in one call,
//! the userspace form of seed 000's DMA_HEAP_ALLOC_AND_READ_FILE.
//!
//! The file is opened and checked once ([`crate::source`]); the buffer is
//! reserved up front and filled by the pipeline (`pipeline.rs`):
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
use crate::engine::EngineRun;
use crate::engine::{CachePolicy, Engine};
use crate::error::{Error, ErrorKind, Result};
use crate::heap::MemoryKind;
use crate::memory::{MemoryChoice, MemoryFacts};
use crate::options::{check_host, host_memory, validate};
pub use crate::options::{
    default_populate_threads, Destination, Fallback, IoMode, LoadOptions, DEFAULT_CHUNK_SIZE,
    DEFAULT_GATHER_SIZE, DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH,
};
use crate::pagecache;
use crate::pipeline::{fill, fill_staged, Filled};
use crate::plan::Plan;
pub use crate::report::LoadReport;
use crate::sink::{HostSink, Sink, StagingRing};
use crate::source::{
    buffered, cache_name, choose_read_setup, no_residue_policy, OpenFile, ReadSetup, Source,
};
use crate::sys::mem::Seals;
use crate::system::DeviceQueue;
use crate::{sys, system};

/// Loads the whole file at `path` into a host [`Buffer`] of the memory
/// `options.to` names. A device destination (`cuda:N`) is an
/// [`ErrorKind::InvalidInput`] error: a device is loaded through a sink
/// ([`load_to_sink`] with [`crate::sink::CudaSink`]).
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
    check_host(Path::new("fd"), options)?;
    load_open(&OpenFile::from_fd(fd)?, offset, len, options)
}

/// Loads `len` bytes (to the end when `None`) from `offset` of a file
/// already opened once with [`OpenFile`] (by path or from a caller's fd),
/// for a caller that looked at the open file first (its length, a
/// header): the bytes come from that same open file.
pub fn load_open(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    validate(file.path(), options)?;
    check_host(file.path(), options)?;
    load_source(file, offset, len, options)
}

fn load_impl(
    path: &Path,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    validate(path, options)?;
    check_host(path, options)?;
    load_source(&OpenFile::open(path)?, offset, len, options)
}

/// The length of the range `offset..offset + len` (to the end of the file
/// when `len` is `None`), checked against the open file.
pub(crate) fn range_len(source: &Source, path: &Path, offset: u64, len: Option<u64>) -> Result<u64> {
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
    offset.checked_add(len).filter(|&end| end <= size).ok_or_else(|| {
        Error::new(
            ErrorKind::Truncated,
            "load",
            path,
            format!("range {offset}+{len} extends past the end of the file ({size} bytes)"),
        )
        .at(size)
    })?;
    Ok(len)
}

/// Whether `len` bytes of fresh memory are available: an
/// [`ErrorKind::OutOfMemory`] error before allocating, not the OOM killer
/// after.
pub(crate) fn check_memory(path: &Path, len: u64) -> Result<()> {
    let budget = system::memory_budget_for(len).map_err(|e| Error::io("read /proc/meminfo", path, e))?;
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
    Ok(())
}

/// A file range checked and ready to read: what every destination's load
/// starts from.
pub(crate) struct Opened<'p> {
    source: &'p Source,
    path: &'p Path,
    offset: u64,
    len: u64,
    pub setup: ReadSetup,
    pub fallbacks: Vec<Fallback>,
    started: Instant,
    cpu_before: (std::time::Duration, std::time::Duration),
}

/// Checks the range against the open file (and, when the destination is
/// fresh host memory, against the memory that is available) and chooses
/// the read setup.
pub(crate) fn open_range<'p>(
    source: &'p Source,
    path: &'p Path,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
    memory_needed: bool,
) -> Result<Opened<'p>> {
    let started = Instant::now();
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let len = range_len(source, path, offset, len)?;
    if memory_needed {
        check_memory(path, len)?;
    }
    let mut fallbacks = Vec::new();
    let setup = choose_read_setup(path, &source.file, source, options.mode, &mut fallbacks)?;
    Ok(Opened { source, path, offset, len, setup, fallbacks, started, cpu_before })
}

impl Opened<'_> {
    /// Makes each read of `chunk` bytes fit in `limit` bytes (a staging
    /// slot) once aligned ([`Plan::request_len`]): a direct-I/O alignment
    /// larger than that (a network filesystem's block size, say) reads
    /// buffered instead, or in `direct` mode is an error.
    pub(crate) fn fit_reads_to(&mut self, limit: usize, chunk: usize, mode: IoMode) -> Result<()> {
        let align = self.setup.align;
        if Plan::request_len(chunk, align, sys::mem::page_size()) <= limit {
            return Ok(());
        }
        let why = format!(
            "direct I/O on this file reads whole blocks of {align} bytes, more than a staging slot of \
             {limit} bytes holds"
        );
        if mode == IoMode::Direct {
            return Err(Error::new(ErrorKind::DirectIoUnavailable, "load", self.path, why));
        }
        let file = &self.source.file;
        self.setup = buffered(self.path, file, no_residue_policy(file))?;
        self.fallbacks.push(Fallback::new("direct", cache_name(self.setup.cache), why));
        Ok(())
    }

    /// Runs `attempt` with the chosen setup and its plan, retrying once the
    /// way a failure allows: buffered after an `EINVAL` on a direct read
    /// (some devices reject the reported alignment), with the pread pool
    /// after io_uring cancelled a read for want of worker threads
    /// (RLIMIT_NPROC, cgroup pids.max). A truncation names the new size.
    pub(crate) fn read<T>(
        &mut self,
        options: &LoadOptions,
        plan_for: impl Fn(usize) -> Plan,
        mut attempt: impl FnMut(&ReadSetup, &Plan, &LoadOptions) -> Result<T>,
    ) -> Result<(T, Plan)> {
        let path = self.path;
        let file = &self.source.file;
        let plan = plan_for(self.setup.align);
        let outcome = match attempt(&self.setup, &plan, options) {
            Err(err)
                if self.setup.cache == CachePolicy::Bypass
                    && options.mode == IoMode::Auto
                    && err.raw_os_error() == Some(libc::EINVAL) =>
            {
                self.setup = buffered(path, file, no_residue_policy(file))?;
                self.fallbacks.push(Fallback::new(
                    "direct",
                    cache_name(self.setup.cache),
                    format!("O_DIRECT read rejected: {err}"),
                ));
                let plan = plan_for(1);
                attempt(&self.setup, &plan, options).map(|done| (done, plan))
            }
            Err(err)
                if matches!(options.engine, Engine::UringFixed | Engine::Uring)
                    && err.raw_os_error() == Some(libc::ECANCELED)
                    && !options.cancel.is_cancelled() =>
            {
                self.fallbacks.push(Fallback::new(
                    options.engine.name(),
                    Engine::PreadPool.name(),
                    format!(
                        "io_uring cancelled a read ({err}): its worker threads could not be created \
                         (RLIMIT_NPROC or the cgroup's pids.max)"
                    ),
                ));
                let pool = LoadOptions { engine: Engine::PreadPool, ..options.clone() };
                attempt(&self.setup, &plan, &pool).map(|done| (done, plan))
            }
            other => other.map(|done| (done, plan)),
        };
        let done = outcome.map_err(|err| match err.kind() {
            ErrorKind::Truncated => match file.metadata() {
                Ok(meta) => err.with_note(&format!("; the file is now {} bytes", meta.len())),
                Err(_) => err,
            },
            _ => err,
        })?;
        // Every byte is in, and progress has said so: a file written meanwhile
        // (in place, or cut short) may have given a mix of old and new bytes.
        self.source.check_unchanged(path, self.offset + self.len)?;
        Ok(done)
    }

    /// The report of a finished load into `memory`; the caller fills in the
    /// destination's own times.
    pub(crate) fn report(
        self,
        plan: &Plan,
        run: EngineRun,
        options: &LoadOptions,
        memory: MemoryChoice,
        facts: &MemoryFacts,
    ) -> Result<LoadReport> {
        let path = self.path;
        let cpu_after = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
        let total = self.started.elapsed();
        // mincore over the whole range, only when asked (it maps the range and
        // walks its pages), and after the clocks stop: it observes the load,
        // it is not part of it.
        let page_cache = options
            .measure_page_cache
            .then(|| pagecache::known_residency_of(&self.source.file, path, self.offset, self.len))
            .transpose()?
            .flatten();
        let mut fallbacks = self.fallbacks;
        fallbacks.extend(run.fallbacks);
        Ok(LoadReport {
            path: path.to_owned(),
            offset: self.offset,
            bytes: self.len,
            engine: run.engine,
            cache: self.setup.cache,
            memory: memory.kind,
            huge_pages: facts.huge_pages(memory.kind),
            destination: Destination::from(memory.kind).name(),
            memory_reason: memory.reason,
            filesystem: self.source.storage,
            alignment: self.setup.align,
            chunk_size: plan.chunk,
            gather_size: plan.gather,
            queue_depth: options.queue_depth,
            fallbacks,
            alloc_seconds: 0.0,
            register_seconds: 0.0,
            first_gather_seconds: 0.0,
            deliver_seconds: 0.0,
            io_seconds: 0.0,
            waited_for_memory_seconds: run.waited_for_memory.as_secs_f64(),
            total_seconds: total.as_secs_f64(),
            gib_per_second: self.len as f64 / (1u64 << 30) as f64 / total.as_secs_f64().max(1e-9),
            cpu_user_seconds: (cpu_after.0.saturating_sub(self.cpu_before.0)).as_secs_f64(),
            cpu_system_seconds: (cpu_after.1.saturating_sub(self.cpu_before.1)).as_secs_f64(),
            page_cache,
        })
    }
}

/// Loads from the open `file` into a new host [`Buffer`] of the memory the
/// options name: in place, or through the process's small staging ring of
/// huge pages when the buffer has 4 KiB pages ([`through_ring`]).
pub(crate) fn load_source(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    let (source, path) = (file.source(), file.path());
    let mut opened = open_range(source, path, offset, len, options, true)?;
    let (offset, len) = (opened.offset, opened.len);
    let facts = MemoryFacts::read();
    let memory = host_memory(path, options, len, &facts)?;
    let kind = memory.kind;
    if let Some(why) = through_ring(kind, len, &opened.setup, &facts, options.chunk_size) {
        drop(opened);
        return load_through_ring(file, offset, len, memory, why, &facts, options);
    }
    let page = sys::mem::page_size();
    let plan_for = |align| Plan::new(offset, len, align, options.chunk_size, options.gather_size, page);
    let (filled, plan) = opened.read(options, plan_for, |setup, plan, options| {
        fill(path, setup, plan, len, options, kind, &facts)
    })?;
    let Filled { mut alloc, run, times, engine_wall } = filled;
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
    let buffer = Buffer::new(alloc, plan.data_range(), &plan.gather_ranges())
        .map_err(|e| Error::io("dup memfd", path, e))?;
    debug_assert_eq!(len, buffer.len() as u64);
    let waited = run.waited_for_memory;
    let mut report = opened.report(&plan, run, options, memory, &facts)?;
    report.alloc_seconds = times.all.as_secs_f64();
    report.register_seconds = times.register.as_secs_f64();
    report.first_gather_seconds = times.first.as_secs_f64();
    report.io_seconds = engine_wall.saturating_sub(waited).as_secs_f64();
    Ok((buffer, report))
}

/// Loads at least this large go through the ring when they qualify: below
/// it the ring's own first population would cost more than it saves.
const THROUGH_RING_MIN: u64 = 64 << 20;

/// The ring that [`load_through_ring`] reads into: 8 slots of one 4 MiB
/// read each, 32 MiB of anonymous memory in 2 MiB pages, kept for the
/// process's next load (its first population is paid once).
const HOST_RING_SLOTS: usize = 8;
const HOST_RING_SLOT: usize = 4 << 20;
static HOST_RING: std::sync::Mutex<Option<StagingRing>> = std::sync::Mutex::new(None);

/// Why a load of `len` bytes into `kind` memory should read through the
/// staging ring rather than in place, or `None`. A direct read into 4 KiB
/// pages hands the device a scatter list of a page per entry, which a
/// device that takes few entries a request splits into several requests;
/// into the ring's 2 MiB pages the same read is fewer. The ring is taken
/// where that makes reads of the load's size at least
/// [`RING_MIN_REQUEST_SAVING`] times fewer requests. On the development
/// VM's virtio disk (254 entries, 4 MiB a request: a 4 MiB read is 5
/// requests into 4 KiB pages, 1 into the ring), the same run: staged 2.30
/// GiB/s, in place 1.57, fio's best 2.10 (docs/benchmarks.md), for the same
/// CPU (the copy costs about what the in-place registration of 4 KiB pages
/// does). Where the device's queue cannot be read, or requests are bounded
/// by their bytes rather than their entries (NVMe with `max_sectors_kb`
/// 128, say), the load stays in place and copies nothing.
fn through_ring(
    kind: MemoryKind,
    len: u64,
    setup: &ReadSetup,
    facts: &MemoryFacts,
    chunk: usize,
) -> Option<String> {
    let small_pages = !facts.huge_pages(kind);
    let direct = setup.cache == CachePolicy::Bypass;
    let huge_ring = facts.huge_pages(MemoryKind::AnonymousThp);
    if !(small_pages && direct && huge_ring && len >= THROUGH_RING_MIN) {
        return None;
    }
    let queue = DeviceQueue::of(&setup.file.metadata().ok()?)?;
    let read = ring_read_len(chunk) as u64;
    let in_place = queue.requests(read, sys::mem::page_size() as u64);
    let ringed = queue.requests(read, RING_PAGE);
    (in_place >= ringed.saturating_mul(RING_MIN_REQUEST_SAVING)).then(|| {
        format!(
            "{kind} has 4 KiB pages, which {} ({} entries, {} KiB a request) splits each {} KiB direct read into \
             {in_place} requests, so reads go through a ring of {HOST_RING_SLOTS} x {} MiB in 2 MiB pages \
             ({ringed} a read) and are copied",
            queue.device,
            queue.max_segments,
            queue.max_request_bytes >> 10,
            read >> 10,
            HOST_RING_SLOT >> 20
        )
    })
}

/// Bytes of each read into the kept ring for a load of `chunk`-byte reads:
/// at most one slot.
fn ring_read_len(chunk: usize) -> usize {
    Plan::chunk_len(chunk.min(HOST_RING_SLOT), sys::mem::page_size())
}

/// The ring's pages: anonymous memory in transparent huge pages.
const RING_PAGE: u64 = 2 << 20;

/// How many times fewer requests the ring must make of each read before a
/// load takes it: 5 on the one device measured (see [`through_ring`]);
/// where the saving is smaller it is unmeasured, and in place copies nothing.
const RING_MIN_REQUEST_SAVING: u64 = 4;

/// Runs `load` with the process's kept host ring (made on first use, for
/// reads of at most `chunk` bytes), and keeps it again afterwards: the
/// sink has finished when a load returns, failed or not, so the ring is
/// idle. A load running beside another makes a ring of its own.
pub(crate) fn with_kept_ring<T>(
    path: &Path,
    chunk: usize,
    load: impl FnOnce(&mut StagingRing) -> Result<T>,
) -> Result<T> {
    let chunk = ring_read_len(chunk);
    let kept = HOST_RING.lock().unwrap_or_else(|p| p.into_inner()).take();
    let mut ring = match kept.filter(|ring| ring.has_geometry(HOST_RING_SLOTS, HOST_RING_SLOT, chunk)) {
        Some(ring) => ring,
        None => StagingRing::new(HOST_RING_SLOTS, HOST_RING_SLOT, chunk)
            .map_err(|e| Error::io("allocate the staging ring", path, e))?,
    };
    let loaded = load(&mut ring);
    *HOST_RING.lock().unwrap_or_else(|p| p.into_inner()) = Some(ring);
    loaded
}

/// A host buffer of `memory` filled from the process's kept staging ring by
/// a [`HostSink`] (whose threads populate the buffer ahead of the copies).
fn load_through_ring(
    file: &OpenFile,
    offset: u64,
    len: u64,
    memory: MemoryChoice,
    why: String,
    facts: &MemoryFacts,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    let path = file.path();
    let page = sys::mem::page_size();
    let bytes =
        usize::try_from(len).map_err(|_| Error::new(ErrorKind::InvalidInput, "load", path, "too large"))?;
    let started = Instant::now();
    let mut alloc = crate::heap::Allocation::with_facts(memory.kind, bytes.next_multiple_of(page), facts)
        .map_err(|e| crate::pipeline::allocation_error(path, e))?;
    let alloc_seconds = started.elapsed().as_secs_f64();
    let dst = &mut alloc.mapping.as_mut_slice()[..bytes];
    let mut report = with_kept_ring(path, options.chunk_size, |ring| {
        load_open_to_sink(file, offset, Some(len), ring, &mut HostSink::new(dst, offset), options)
    })?;
    if let Some(memfd) = &alloc.memfd {
        sys::mem::add_seals(memfd.as_fd(), Seals::SHRINK | Seals::GROW)
            .map_err(|e| Error::io("seal memfd", path, e))?;
    }
    report.destination = format!(
        "{} (through a staging ring of {HOST_RING_SLOTS} x {} MiB)",
        memory.kind,
        HOST_RING_SLOT >> 20
    );
    report.memory = memory.kind;
    report.memory_reason = format!("{}; {why}", memory.reason);
    report.huge_pages = false;
    report.alloc_seconds += alloc_seconds;
    let whole = 0..bytes;
    let buffer = Buffer::new(alloc, whole.clone(), std::slice::from_ref(&whole))
        .map_err(|e| Error::io("dup memfd", path, e))?;
    Ok((buffer, report))
}

/// Loads `len` bytes of the file at `path` from `offset` (to the end when
/// `len` is `None`) through the staging slots of `ring` into `sink`: the
/// pipeline's staged destination (GPU memory, caller memory, a dma-heap
/// mapping). The ring is the only host memory the load uses, whatever the
/// file size; it may serve any number of loads, one at a time. The sink has
/// received every byte when this returns `Ok`; after an error it may hold
/// part of them, which the caller must not use. A file whose direct-I/O
/// alignment is larger than a slot is read buffered (a fallback in the
/// report), or in `direct` mode is an [`ErrorKind::DirectIoUnavailable`]
/// error.
pub fn load_to_sink(
    path: impl AsRef<Path>,
    offset: u64,
    len: Option<u64>,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    options: &LoadOptions,
) -> Result<LoadReport> {
    let file = OpenFile::open(path.as_ref())?;
    load_open_to_sink(&file, offset, len, ring, sink, options)
}

/// Share of a range in the page cache from which a staged load in `auto`
/// mode copies from the cache instead of reading the disk again.
pub const CACHED_SHARE: f64 = 0.5;

/// A staged load looks before it reads: in `auto` mode, when most of the
/// range is already in the page cache (`mincore`), copying it from there on
/// every CPU beats direct I/O re-reading the disk (on the H100 machine: 4.1
/// GiB/s from a warm cache against 1.1-1.8 for O_DIRECT loaders). Returns
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
        match pagecache::known_residency_of(&file.source().file, file.path(), offset, len)? {
            Some(residency) => Some(residency.fraction),
            None => return Ok(None),
        }
    };
    if len == 0 || cached.is_some_and(|share| share < CACHED_SHARE) {
        return Ok(None);
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let warm = LoadOptions {
        mode: IoMode::Buffered,
        engine: Engine::PreadPool,
        threads: options.threads.max(cpus.min(MAX_CACHE_COPY_THREADS)),
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

/// Threads copying from the page cache at most: memory bandwidth, not
/// CPUs, limits them past this.
const MAX_CACHE_COPY_THREADS: usize = 16;

/// [`load_to_sink`] from a file opened beforehand (whose header, say, the
/// caller read to size the destination): the same open file is read, and a
/// change to it since it was opened is an error.
pub fn load_open_to_sink(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    options: &LoadOptions,
) -> Result<LoadReport> {
    let path = file.path();
    validate(path, options)?;
    let page = sys::mem::page_size();
    let slot = ring.slot_len();
    let chunk = Plan::chunk_len(options.chunk_size.min(slot), page);
    if slot % chunk != 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            format!("staging slots of {} bytes do not hold whole chunks of {chunk} bytes", ring.slot_len()),
        ));
    }
    let warm = cached_source_options(file, offset, len, options)?;
    let (options, cached) = match &warm {
        Some((warm, why)) => (warm, Some(why)),
        None => (options, None),
    };
    let mut opened = open_range(file.source(), path, offset, len, options, false)?;
    opened.fallbacks.extend(cached.cloned());
    opened.fit_reads_to(slot, chunk, options.mode)?;
    let (offset, len) = (opened.offset, opened.len);
    let plan_for = |align| Plan::staged(offset, len, align, chunk, slot, page);
    let started = Instant::now();
    let ((run, times), plan) = opened.read(options, plan_for, |setup, plan, options| {
        fill_staged(path, setup, plan, len, options, ring, sink)
    })?;
    let wall = started.elapsed();
    let waited = run.waited_for_memory;
    // No Buffer is allocated: `memory` is what a host load with these options
    // would use; `destination` names the ring (and the caller, the sink).
    let memory = MemoryChoice {
        kind: options.to.host_memory().unwrap_or_default(),
        reason: "a staged load allocates no host buffer".into(),
    };
    let mut report = opened.report(&plan, run, options, memory, &MemoryFacts::read())?;
    report.destination = format!("staging ring ({} x {} bytes)", ring.slots(), ring.slot_len());
    report.register_seconds = times.register.as_secs_f64();
    report.deliver_seconds = times.deliver.as_secs_f64();
    report.io_seconds = wall.saturating_sub(waited).as_secs_f64();
    Ok(report)
}
