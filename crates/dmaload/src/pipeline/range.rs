//! The front of every load: the range checked against the open file and
//! the memory available, the read setup chosen (direct or buffered, and
//! why), the retries a failure allows, and the report of what was done.

use std::path::Path;
use std::time::Instant;

use crate::engine::{self, EngineRun};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemoryChoice, MemoryFacts};
use crate::options::{Destination, LoadOptions};
use crate::pagecache;
use crate::plan::Plan;
use crate::report::LoadReport;
use crate::source::{buffered, cache_name, choose_read_setup, no_residue_policy, ReadSetup, Source};
use crate::tune::{ReadChoice, ReadMode, Tuner};
use crate::types::{CachePolicy, Direction, Engine, Fallback, IoMode};
use crate::{sys, system};

/// The length of the range `offset..offset + len` (to the end of the file
/// when `len` is `None`), checked against the open file.
pub(crate) fn range_len(source: &Source, path: &Path, offset: u64, len: Option<u64>) -> Result<u64> {
    range_within(source.size, "file", path, offset, len)
}

/// The length of the range `offset..offset + len` (to the end when `len`
/// is `None`) of a source of `size` bytes, a `what` ("file", "object").
pub(crate) fn range_within(size: u64, what: &str, path: &Path, offset: u64, len: Option<u64>) -> Result<u64> {
    if offset > size {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            format!("offset {offset} is past the end of the {what} ({size} bytes)"),
        )
        .at(offset));
    }
    let len = len.unwrap_or(size - offset);
    offset.checked_add(len).filter(|&end| end <= size).ok_or_else(|| {
        Error::new(
            ErrorKind::Truncated,
            "load",
            path,
            format!("range {offset}+{len} extends past the end of the {what} ({size} bytes)"),
        )
        .at(size)
    })?;
    Ok(len)
}

/// Whether `len` bytes of fresh memory are available: an
/// [`ErrorKind::OutOfMemory`] error before allocating, not the OOM killer
/// after.
pub fn check_memory(path: &Path, len: u64) -> Result<()> {
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
    pub offset: u64,
    pub len: u64,
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
            Err(err) if engine::io_wq_refused(options.engine, &options.cancel, &err) => {
                self.fallbacks.push(engine::workers_refused(options.engine, Direction::Read, &err));
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
        let (cache, read_choice) = read_kept(&self.setup, run.tuner.as_ref());
        Ok(LoadReport {
            engine: run.engine,
            cache,
            memory: memory.kind,
            huge_pages: facts.huge_pages(memory.kind),
            destination: Destination::from(memory.kind).name(),
            memory_reason: memory.reason,
            filesystem: self.source.storage,
            alignment: self.setup.align,
            chunk_size: plan.chunk,
            gather_size: plan.gather,
            queue_depth: run.tuner.as_ref().map_or(options.queue_depth, |tuner| tuner.kept()),
            request_size: run.tuner.as_ref().map_or(plan.chunk, |tuner| tuner.kept_request()),
            tuning_windows: run.tuner.as_ref().map_or(0, |tuner| tuner.windows()),
            read_choice,
            fallbacks,
            waited_for_memory_seconds: run.waited_for_memory.as_secs_f64(),
            cpu_user_seconds: (cpu_after.0.saturating_sub(self.cpu_before.0)).as_secs_f64(),
            cpu_system_seconds: (cpu_after.1.saturating_sub(self.cpu_before.1)).as_secs_f64(),
            page_cache,
            ..LoadReport::new(path, self.offset, self.len, total.as_secs_f64())
        })
    }
}

/// How the reads treated the page cache (for an `auto` load whose tuner
/// chose between direct and buffered reads, the mode it kept), and how that
/// mode was chosen, in the report's words ([`LoadReport::read_choice`]).
fn read_kept(setup: &ReadSetup, tuner: Option<&Tuner>) -> (CachePolicy, String) {
    let (Some(buffered), Some(tuner)) = (setup.buffered, tuner) else {
        return (setup.cache, String::new());
    };
    let cache = match tuner.kept_read_mode() {
        ReadMode::Direct => setup.cache,
        ReadMode::Buffered => buffered,
    };
    let gib = |rate: f64| rate / (1u64 << 30) as f64;
    let words = match tuner.read_choice() {
        ReadChoice::NotChosen => String::new(),
        ReadChoice::Remembered => "remembered".to_owned(),
        ReadChoice::Measured { direct, buffered: rate, recheck } => {
            let measured = format!(
                "measured: direct {:.2} GiB/s, {} {:.2} GiB/s",
                gib(direct),
                cache_name(buffered),
                gib(rate)
            );
            match recheck {
                Some((slow, was)) => format!(
                    "re-measured, a window read {:.2} GiB/s against {:.2} remembered: {measured}",
                    gib(slow),
                    gib(was)
                ),
                None => measured,
            }
        }
    };
    (cache, words)
}
