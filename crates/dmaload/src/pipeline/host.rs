//! A load into a new host [`Buffer`]: in place (the pipeline fills the
//! buffer's own pages), or through the process's kept staging ring of huge
//! pages when the buffer's 4 KiB pages would split every direct read into
//! several device requests.

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Instant;

use super::range::open_range;
use super::staged::load_open_to_sink;
use super::{allocation_error, fill, Filled};
use crate::buffer::Buffer;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Allocation, MemoryChoice, MemoryFacts, MemoryKind};
use crate::options::{host_memory, LoadOptions};
use crate::plan::Plan;
use crate::report::LoadReport;
use crate::sink::{HostSink, StagingRing};
use crate::source::{OpenFile, ReadSetup};
use crate::sys;
use crate::sys::mem::Seals;
use crate::system::DeviceQueue;
use crate::types::{CachePolicy, Fallback};
use crate::verify::Expected;

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
    let expected = Expected::for_load(file, offset, len, options.verify)?;
    let mut opened = open_range(source, path, offset, len, options, true)?;
    let (offset, len) = (opened.offset, opened.len);
    let facts = MemoryFacts::read();
    let memory = host_memory(options, len, &facts);
    let kind = memory.kind;
    if let Some(why) = through_ring(kind, len, &opened.setup, &facts, options.chunk_size) {
        drop(opened);
        return load_through_ring(file, offset, len, memory, why, &facts, options);
    }
    let page = sys::mem::page_size();
    let plan_for = |align| Plan::new(offset, len, align, options.chunk_size, options.gather_size, page);
    let (filled, plan) = opened.read(options, plan_for, |setup, plan, options| {
        fill(path, setup, plan, len, options, kind, &facts, expected.as_ref())
    })?;
    let Filled { alloc, run, times, engine_wall } = filled;
    let (buffer, unregistered) = hand_out(alloc, &plan, path)?;
    debug_assert_eq!(len, buffer.len() as u64);
    let waited = run.waited_for_memory;
    let mut report = opened.report(&plan, run, options, memory, &facts)?;
    report.fallbacks.extend(unregistered);
    report.alloc_seconds = times.all.as_secs_f64();
    report.register_seconds = times.register.as_secs_f64();
    report.first_gather_seconds = times.first.as_secs_f64();
    report.io_seconds = engine_wall.saturating_sub(waited).as_secs_f64();
    Ok((buffer, report))
}

/// A load that goes on in a child forked from its own thread (a progress
/// callback that forks) has none of its memory there: an error, never a
/// buffer ([`Allocation::forked_since`]).
/// The buffer a filled allocation becomes, once nothing of the load can
/// reach it any more: refused where the process forked during the load,
/// the bytes outside the plan's range (whole aligned blocks read around
/// it, or page rounding past an object's end) zeroed, since they are not
/// the caller's to see nor to share through the memfd, and the memfd's
/// size sealed (udmabuf requires F_SEAL_SHRINK; Buffer::memfd adds
/// F_SEAL_FUTURE_WRITE when the fd leaves, which udmabuf refuses).
pub(super) fn hand_out(
    mut alloc: Allocation,
    plan: &Plan,
    path: &Path,
) -> Result<(Buffer, Option<Fallback>)> {
    refuse_if_forked(&alloc, path)?;
    let data = plan.data_range();
    let bytes = alloc.mapping.as_mut_slice();
    bytes[..data.start].fill(0);
    bytes[data.end..].fill(0);
    if let Some(memfd) = &alloc.memfd {
        sys::mem::add_seals(memfd.as_fd(), Seals::SHRINK | Seals::GROW)
            .map_err(|e| Error::io("seal memfd", path, e))?;
    }
    Ok(Buffer::new(alloc, data, &plan.gather_ranges()))
}

fn refuse_if_forked(alloc: &Allocation, path: &Path) -> Result<()> {
    match alloc.forked_since() {
        true => Err(Error::new(
            ErrorKind::Io,
            "load",
            path,
            "the process forked during the load: a child gets no part of a load in flight",
        )),
        false => Ok(()),
    }
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
/// requests into 4 KiB pages, 1 into the ring) the ring was clearly faster
/// than in place for the same CPU (the copy costs about what the in-place
/// registration of 4 KiB pages does; docs/benchmarks.md, "Figures behind the defaults").
/// Where the device's queue cannot be read, or requests are bounded
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
    let mut alloc = Allocation::with_facts(memory.kind, bytes.next_multiple_of(page), facts)
        .map_err(|e| allocation_error(path, e))?;
    let alloc_seconds = started.elapsed().as_secs_f64();
    let dst = &mut alloc.mapping.as_mut_slice()[..bytes];
    let mut report = with_kept_ring(path, options.chunk_size, |ring| {
        load_open_to_sink(file, offset, Some(len), ring, &mut HostSink::new(dst, offset), options)
    })?;
    refuse_if_forked(&alloc, path)?;
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
    let (buffer, unregistered) = Buffer::new(alloc, whole.clone(), std::slice::from_ref(&whole));
    report.fallbacks.extend(unregistered);
    Ok((buffer, report))
}
