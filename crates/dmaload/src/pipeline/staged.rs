//! A load through the registered slots of a [`StagingRing`] into a
//! [`Sink`]: a GPU, memory the caller owns, a dma-heap mapping, or a host
//! buffer whose pages would split direct reads. The ring is the only host
//! memory it uses.

use std::time::Instant;

use super::fill_staged;
use super::range::open_range;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemoryChoice, MemoryFacts};
use crate::options::{validate, LoadOptions};
use crate::pagecache::cached_source_options;
use crate::plan::Plan;
use crate::report::LoadReport;
use crate::sink::{Sink, StagingRing};
use crate::source::OpenFile;
use crate::sys;

/// [`crate::load_to_sink`] from a file opened beforehand (whose header,
/// say, the caller read to size the destination): the same open file is
/// read through `ring`'s slots into `sink`, and a change to it since it was
/// opened is an error.
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
