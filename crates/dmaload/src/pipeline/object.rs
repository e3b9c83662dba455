//! A load from an object store into a new host [`Buffer`]: the same
//! pipeline as a file's in-place load (a helper thread populates the
//! buffer gather by gather behind the gate; the engine fills what is
//! ready), with the object engine's GETs in place of reads.

use std::time::Instant;

use super::host::hand_out;
use super::range::{check_memory, range_within};
use super::{allocation_error, populate_gathers, run_pipeline, Transfer};
use crate::buffer::Buffer;
use crate::engine::{object::DEFAULT_CONNECTIONS, EngineParams, Gate, Input, Layout, Progress};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Allocation, MemoryFacts};
use crate::object::Object;
use crate::options::{host_memory, Destination, LoadOptions, DEFAULT_CHUNK_SIZE, DEFAULT_POOL_THREADS};
use crate::plan::Plan;
use crate::report::LoadReport;
use crate::sys;
use crate::types::{CachePolicy, Engine};

/// Bytes one GET asks for unless `chunk_size` says otherwise: large
/// enough that a request's round trip is small beside its transfer, small
/// enough to keep every connection busy on objects of a few hundred MiB.
const DEFAULT_OBJECT_REQUEST: usize = 8 << 20;

/// Loads `len` bytes (to the end when `None`) from `offset` of `object`
/// into a new host buffer of the memory the options name. `chunk_size`
/// and `threads`, when set, are the request size and the connection count.
pub(crate) fn load_object_source(
    object: &Object,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    let path = object.name();
    if options.verify {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            "verify is not supported for objects yet (docs/object-storage.md)",
        ));
    }
    let started = Instant::now();
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let len = range_within(object.size, "object", path, offset, len)?;
    check_memory(path, len)?;
    let facts = MemoryFacts::read();
    let memory = host_memory(options, len, &facts);
    let request =
        if options.chunk_size == DEFAULT_CHUNK_SIZE { DEFAULT_OBJECT_REQUEST } else { options.chunk_size };
    let connections =
        if options.threads == DEFAULT_POOL_THREADS { DEFAULT_CONNECTIONS } else { options.threads };
    let page = sys::mem::page_size();
    let plan = Plan::new(offset, len, 1, request, options.gather_size, page);
    let mut alloc = Allocation::with_facts(memory.kind, plan.mapping_len, &facts)
        .map_err(|e| allocation_error(path, e))?;
    let params = EngineParams {
        engine: Engine::PreadPool,
        queue_depth: connections,
        threads: connections,
        cancel: options.cancel.clone(),
        tune: None,
        request_size: None,
    };
    let dst = alloc.mapping.writer();
    let engine_started = Instant::now();
    let (run, times) = Progress::reporting(len, options.progress.as_deref(), |progress| {
        let transfer = Transfer {
            path,
            input: Input::Object(object),
            cache: CachePolicy::Bypass,
            plan: &plan,
            params: &params,
            progress,
        };
        let populate = |_, gate: &Gate| populate_gathers(dst, None, &plan, gate, options.populate_threads);
        let (run, times) = run_pipeline(&transfer, dst, Layout::InPlace, None, populate);
        run.map(|run| (run, times.unwrap_or_default()))
    })?;
    let engine_wall = engine_started.elapsed();
    let (buffer, unregistered) = hand_out(alloc, &plan, path)?;
    let cpu_after = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let total = started.elapsed();
    let mut fallbacks = run.fallbacks;
    fallbacks.extend(unregistered);
    let report = LoadReport {
        path: path.to_owned(),
        offset,
        bytes: len,
        engine: run.engine,
        cache: CachePolicy::Bypass,
        memory: memory.kind,
        huge_pages: facts.huge_pages(memory.kind),
        destination: Destination::from(memory.kind).name(),
        memory_reason: memory.reason,
        filesystem: "s3",
        alignment: 1,
        chunk_size: plan.chunk,
        gather_size: plan.gather,
        queue_depth: connections,
        request_size: plan.chunk,
        tuning_windows: 0,
        fallbacks,
        alloc_seconds: times.all.as_secs_f64(),
        register_seconds: 0.0,
        first_gather_seconds: times.first.as_secs_f64(),
        deliver_seconds: 0.0,
        ring_bytes: 0,
        cache_lane_bytes: 0,
        cache_lane_threads: 0,
        io_seconds: engine_wall.saturating_sub(run.waited_for_memory).as_secs_f64(),
        waited_for_memory_seconds: run.waited_for_memory.as_secs_f64(),
        total_seconds: total.as_secs_f64(),
        gib_per_second: len as f64 / (1u64 << 30) as f64 / total.as_secs_f64().max(1e-9),
        cpu_user_seconds: cpu_after.0.saturating_sub(cpu_before.0).as_secs_f64(),
        cpu_system_seconds: cpu_after.1.saturating_sub(cpu_before.1).as_secs_f64(),
        page_cache: None,
    };
    Ok((buffer, report))
}
