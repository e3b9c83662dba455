//! A load through the registered slots of a [`StagingRing`] into a
//! [`Sink`]: a GPU, memory the caller owns, a dma-heap mapping, or a host
//! buffer whose pages would split direct reads. The ring is the only host
//! memory it uses.

use std::time::Instant;

use std::ops::Range;
use std::os::fd::AsFd;
use std::path::Path;

use super::range::open_range;
use super::{fill_staged, LaneShare, ReadFrom};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemoryChoice, MemoryFacts};
use crate::options::LoadOptions;
use crate::pagecache::{cache_copy_threads, cached_source_options, known_residency_of, CACHED_SHARE};
use crate::plan::Plan;
use crate::report::LoadReport;
use crate::sink::{Sink, StagingRing};
use crate::source::OpenFile;
use crate::sys;
use crate::types::IoMode;
use crate::verify::Expected;

/// [`crate::LoadRequest::to_sink`] of an open file (the request checked
/// the options): the file is read through `ring`'s slots into `sink`, and
/// a change to it since it was opened is an error.
pub(crate) fn load_open_to_sink(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    options: &LoadOptions,
) -> Result<LoadReport> {
    let path = file.path();
    let expected = Expected::for_load(file, offset, len, options.verify)?;
    let page = sys::mem::page_size();
    let slot = ring.slot_len();
    let chunk = staged_chunk(path, ring, options.chunk_size)?;
    // A sink with a cache lane takes the cached windows of an `auto` load
    // itself, window by window; without one (or where the ring has no
    // room for it, or a verified load hashes in file order through the
    // ring) the whole range goes one way: copied from the page cache when
    // most of it is there.
    let lane = (options.mode == IoMode::Auto && !options.verify && sink.has_cache_lane())
        .then(|| LaneShare::of(ring.slots(), slot, cache_copy_threads()))
        .flatten();
    let warm = match lane {
        Some(_) => None,
        None => cached_source_options(file, offset, len, options)?,
    };
    let (options, cached) = match &warm {
        Some((warm, why)) => (warm, Some(why)),
        None => (options, None),
    };
    let mut opened = open_range(file.source(), path, offset, len, options, false)?;
    opened.fallbacks.extend(cached.cloned());
    opened.fit_reads_to(slot, chunk, options.mode)?;
    let (offset, len) = (opened.offset, opened.len);
    let plan_for = |align| {
        let plan = Plan::staged(offset, len, align, chunk, slot, page);
        match lane {
            Some(_) => plan.with_cache_lane(|window| window_is_cached(file, window)),
            None => plan,
        }
    };
    let lane_file = file.source().file.as_fd();
    let started = Instant::now();
    let ((run, times), plan) = opened.read(options, plan_for, |setup, plan, options| {
        let lane = lane.as_ref().map(|share| (share, lane_file));
        fill_staged(path, ReadFrom::File(setup), plan, len, options, lane, ring, sink, expected.as_ref())
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
    report.cache_lane_bytes = times.cache_lane_bytes;
    report.ring_bytes = report.bytes - times.cache_lane_bytes;
    report.cache_lane_threads = times.cache_lane_threads;
    report.register_seconds = times.register.as_secs_f64();
    report.deliver_seconds = times.deliver.as_secs_f64();
    report.io_seconds = wall.saturating_sub(waited).as_secs_f64();
    Ok(report)
}

/// The request length of a staged load asking for `chunk` bytes a
/// request: whole pages, at most a slot, and a whole number of them in
/// each of `ring`'s slots (else an [`ErrorKind::InvalidInput`] error).
pub(super) fn staged_chunk(path: &Path, ring: &StagingRing, chunk: usize) -> Result<usize> {
    let slot = ring.slot_len();
    let chunk = Plan::chunk_len(chunk.min(slot), sys::mem::page_size());
    if slot % chunk != 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            format!("staging slots of {slot} bytes do not hold whole chunks of {chunk} bytes"),
        ));
    }
    Ok(chunk)
}

/// Whether a load window (a slot's worth of the file) goes to the cache
/// lane: most of its pages are in the page cache (`mincore`), or the file
/// lives in memory (tmpfs: a cache service's memfd). Where residency
/// cannot be known, the disk is read.
fn window_is_cached(file: &OpenFile, window: Range<u64>) -> bool {
    let source = file.source();
    source.in_memory
        || known_residency_of(&source.file, file.path(), window.start, window.end - window.start)
            .ok()
            .flatten()
            .is_some_and(|residency| residency.fraction >= CACHED_SHARE)
}
