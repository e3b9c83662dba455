//! A load from an object store, with the object engine's GETs in place
//! of reads and the rest of the pipeline a file's: into a new host
//! [`Buffer`] in place (a helper thread populates the buffer gather by
//! gather behind the gate; the engine fills what is ready), or through
//! the slots of a [`StagingRing`] into a [`Sink`] (`cuda:N`, memory the
//! caller owns) by [`fill_staged`], the staged run of a file, or into
//! memory the caller has ([`fill_object`]: its whole pages in place, the
//! edges around them through a ring of two pages).

use std::path::Path;
use std::time::{Duration, Instant};

use super::host::hand_out;
use super::range::{check_memory, range_within};
use super::staged::staged_chunk;
use super::{
    allocation_error, fill_staged, follow_gathers, populate_gathers, run_pipeline, DeliverTimes, ReadFrom,
    Transfer,
};
use crate::buffer::Buffer;
use crate::engine::{object::DEFAULT_CONNECTIONS, EngineParams, EngineRun, Gate, Layout, Progress};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Allocation, MemoryChoice, MemoryFacts};
use crate::object::{Object, ObjectUrl};
use crate::options::{host_memory, Destination, LoadOptions, DEFAULT_CHUNK_SIZE, DEFAULT_POOL_THREADS};
use crate::plan::Plan;
use crate::report::LoadReport;
use crate::sink::{HostSink, Sink, StagingRing};
use crate::sys;
use crate::sys::mem::RawBytesMut;
use crate::tune;
use crate::types::{CachePolicy, Engine};
use crate::verify::{sums_too_large, Expected, StreamVerifier, MAX_SUMS_BYTES};

/// Bytes one GET asks for unless `chunk_size` says otherwise: large
/// enough that a request's round trip is small beside its transfer, small
/// enough to keep every connection busy on objects of a few hundred MiB.
const DEFAULT_OBJECT_REQUEST: usize = 8 << 20;

/// The request size of an object load: `chunk_size` when set, else
/// [`DEFAULT_OBJECT_REQUEST`] (the plan's chunk; a tuned load's GETs may
/// ask for less of it at a time).
fn object_request(options: &LoadOptions) -> usize {
    if options.chunk_size == DEFAULT_CHUNK_SIZE {
        DEFAULT_OBJECT_REQUEST
    } else {
        options.chunk_size
    }
}

/// Whether the GETs of a load with `options` are tuned by measurement
/// ([`crate::tune::GetTuner`]): neither the connection count (`threads`)
/// nor the request size (`chunk_size`) was set.
fn gets_tuned(options: &LoadOptions) -> bool {
    options.threads == DEFAULT_POOL_THREADS && options.chunk_size == DEFAULT_CHUNK_SIZE
}

/// What the tuning file remembers for the GETs of a load of `object`
/// with `options`: read for a tuned load ([`gets_tuned`]) only, once per
/// load ([`Started::now`]).
fn remembered_gets(options: &LoadOptions, object: &Object) -> Option<tune::RememberedGets> {
    gets_tuned(options).then(|| tune::remembered_gets(&tune::memory_file()?, &object.endpoint()?)).flatten()
}

/// The engine's parameters for a load with `options`: `threads`, when
/// set, is the connection count; a tuned load ([`gets_tuned`]) starts from
/// the connections and request size `remembered` for the object's
/// endpoint, else [`DEFAULT_CONNECTIONS`] GETs of
/// [`DEFAULT_OBJECT_REQUEST`], and says so by naming the request size
/// (`request_size`, which a fixed load leaves `None`).
fn object_params(options: &LoadOptions, remembered: Option<tune::RememberedGets>) -> EngineParams {
    let tuned = gets_tuned(options);
    let remembered = remembered.filter(|_| tuned);
    let connections = match remembered {
        Some(gets) => gets.connections,
        None if options.threads == DEFAULT_POOL_THREADS => DEFAULT_CONNECTIONS,
        None => options.threads,
    };
    let request = remembered.map_or(DEFAULT_OBJECT_REQUEST, |gets| gets.request.min(DEFAULT_OBJECT_REQUEST));
    EngineParams {
        engine: Engine::PreadPool,
        queue_depth: connections,
        threads: connections,
        cancel: options.cancel.clone(),
        tune: None,
        request_size: tuned.then_some(request),
        read_modes: None,
    }
}

/// After an object load that tuned its GETs: remembers the connection
/// count and request size it kept for the object's endpoint, once a trial
/// measured them, unless they are what the load found `remembered` at its
/// start (the file is then read again only to be rewritten with the other
/// lines kept). The memory is a cache: a failure to write it loses nothing.
fn remember_gets(object: &Object, run: &EngineRun, remembered: Option<tune::RememberedGets>) {
    let Some(gets) = run.gets.as_ref().and_then(tune::GetTuner::to_remember) else { return };
    let (Some(path), Some(endpoint)) = (tune::memory_file(), object.endpoint()) else { return };
    if remembered != Some(gets) {
        let _ = tune::remember_gets(&path, &endpoint, gets);
    }
}

/// Staging slots of `slot_len` bytes an object load with `options` keeps
/// busy (the ring a device load of an object pins, and Python's staged
/// loads of object shards): as many as its GETs in flight fill (a request
/// on each connection: for a tuned load, the count remembered for the
/// environment's endpoint, else 8), and two more,
/// one being delivered while the other waits for a straggler. GETs are
/// slower than a disk's reads, so a ring sized for a file's range (up to
/// 32 slots of 16 MiB) would pin memory that only costs its pinning; the
/// climb of a tuned load tries no more connections than the ring's chunks.
pub fn object_ring_slots(options: &LoadOptions, slot_len: usize) -> usize {
    let remembered = || {
        let endpoint = crate::object::config::Config::from_env_without_keys().ok()?.endpoint;
        let endpoint = tune::Endpoint::new(&endpoint.host, endpoint.port)?;
        tune::remembered_gets(&tune::memory_file()?, &endpoint)
    };
    let connections = match gets_tuned(options) {
        true => remembered().map_or(DEFAULT_CONNECTIONS, |gets| gets.connections),
        false if options.threads == DEFAULT_POOL_THREADS => DEFAULT_CONNECTIONS,
        false => options.threads,
    };
    let in_flight = connections * object_request(options).min(slot_len);
    in_flight.div_ceil(slot_len) + 2
}

/// What a load of `len` bytes (to the end when `None`) from `offset` of
/// `object` must hash to when `options.verify` asks (`None` without): the
/// digest that the `B3SUMS` or `SHA256SUMS` object beside it (under the
/// key's "directory") records, found as a file's sums file is
/// ([`Expected::for_object`]). Each sums object is looked up (a HEAD; one
/// that does not exist is passed over) and read whole. Looked up before
/// anything is allocated.
pub(crate) fn object_expected(
    object: &Object,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<Option<Expected>> {
    let read = |sums: &Path| -> Result<Option<Vec<u8>>> {
        // Beside the object, with its configuration (not the environment's).
        let key = sums.to_str().and_then(ObjectUrl::parse).and_then(|url| url.ok()).map(|url| url.key);
        let key =
            key.ok_or_else(|| Error::new(ErrorKind::InvalidInput, "verify", sums, "not an object URL"))?;
        let sums = match object.open_beside(&key, &options.cancel) {
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            sums => sums?,
        };
        if sums.size > MAX_SUMS_BYTES {
            return Err(sums_too_large(sums.name(), "an object"));
        }
        let plain = LoadOptions { cancel: options.cancel.clone(), ..LoadOptions::default() };
        let (bytes, _) = load_object_source(&sums, 0, None, &plain)?;
        Ok(Some(bytes.to_vec()))
    };
    Expected::for_object(object.name(), object.size, offset, len, options.verify, read)
}

impl StreamVerifier {
    /// The verifier of the whole `object`, whose bytes its caller streams
    /// itself (a Python stream's windows, each a load of part of it): the
    /// `B3SUMS` or `SHA256SUMS` object beside it must list it, looked up
    /// and read as a verified load of the object does (`B3SUMS` first when both list it).
    pub fn for_object(object: &Object, cancel: &crate::CancelToken) -> Result<StreamVerifier> {
        let options = LoadOptions { verify: true, cancel: cancel.clone(), ..LoadOptions::default() };
        let expected = object_expected(object, 0, None, &options)?;
        expected.map(StreamVerifier::from_expected).ok_or_else(|| {
            Error::new(ErrorKind::InvalidInput, "verify", object.name(), "no sums entry was looked up")
        })
    }
}

/// Loads `len` bytes (to the end when `None`) from `offset` of `object`
/// into a new host buffer of the memory the options name, checked against
/// the sums object beside it when `options.verify` asks
/// ([`object_expected`]). `chunk_size` and `threads`, when set, are the
/// request size and the connection count.
pub(crate) fn load_object_source(
    object: &Object,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    let path = object.name();
    let started = Started::now(object, options)?;
    let len = range_within(object.size, "object", path, offset, len)?;
    check_memory(path, len)?;
    let expected = object_expected(object, offset, Some(len), options)?;
    let facts = MemoryFacts::read();
    let memory = host_memory(options, len, &facts);
    let page = sys::mem::page_size();
    let plan = Plan::new(offset, len, 1, object_request(options), options.gather_size, page);
    let mut alloc = Allocation::with_facts(memory.kind, plan.mapping_len, &facts)
        .map_err(|e| allocation_error(path, e))?;
    let params = &started.params;
    let dst = alloc.mapping.writer();
    let engine_started = Instant::now();
    // A verified load hashes each gather as it completes, in object order.
    let verifier = expected.as_ref().map(Expected::verifier);
    let follow = |gate: &Gate| follow_gathers(verifier.as_ref(), None, dst, &plan, gate);
    let beside: Option<&(dyn Fn(&Gate) + Sync)> = verifier.is_some().then_some(&follow as _);
    let (run, times) = Progress::reporting(len, options.progress.as_deref(), |progress| {
        let transfer = Transfer::read(path, ReadFrom::Object(object, params), &plan, params, progress);
        let populate = |_, gate: &Gate| populate_gathers(dst, None, &plan, gate, options.populate_threads);
        let (run, times) = run_pipeline(&transfer, dst, Layout::InPlace, beside, populate);
        run.map(|run| (run, times.unwrap_or_default()))
    })?;
    if let Some(verifier) = verifier {
        verifier.check(path)?;
    }
    let engine_wall = engine_started.elapsed();
    let (buffer, unregistered) = hand_out(alloc, &plan, path)?;
    let mut report = started.report(&plan, run, memory, &facts, engine_wall)?;
    report.fallbacks.extend(unregistered);
    report.alloc_seconds = times.all.as_secs_f64();
    report.first_gather_seconds = times.first.as_secs_f64();
    Ok((buffer, report))
}

/// [`crate::LoadRequest::to_sink`] of an object (the request checked the
/// options): `len` bytes (to the end when `None`) from `offset`, received
/// by the GETs into `ring`'s slots and handed from there to `sink`, as a
/// file's staged load, checked against the sums object beside it when
/// `options.verify` asks. Requests are [`DEFAULT_OBJECT_REQUEST`] bytes
/// (`chunk_size` when set), at most a slot and a whole number in each.
pub(crate) fn load_object_to_sink(
    object: &Object,
    offset: u64,
    len: Option<u64>,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    options: &LoadOptions,
) -> Result<LoadReport> {
    let expected = object_expected(object, offset, len, options)?;
    stage_object(object, offset, len, ring, sink, (options, expected.as_ref()))
}

/// [`load_object_to_sink`] with the digest already looked up (`expected`,
/// from [`object_expected`]; `None` unverified).
pub(crate) fn stage_object(
    object: &Object,
    offset: u64,
    len: Option<u64>,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    (options, expected): (&LoadOptions, Option<&Expected>),
) -> Result<LoadReport> {
    let path = object.name();
    let started = Started::now(object, options)?;
    let len = range_within(object.size, "object", path, offset, len)?;
    let (plan, run, times, engine_wall) = stage_with(&started, offset, len, ring, sink, (options, expected))?;
    // No Buffer is allocated: `memory` is what a host load with these
    // options would use; `destination` names the ring (and the caller, the sink).
    let memory = MemoryChoice {
        kind: options.to.host_memory().unwrap_or_default(),
        reason: "a staged load allocates no host buffer".into(),
    };
    let mut report = started.report(&plan, run, memory, &MemoryFacts::read(), engine_wall)?;
    report.destination = format!("staging ring ({} x {} bytes)", ring.slots(), ring.slot_len());
    report.ring_bytes = len;
    report.register_seconds = times.register.as_secs_f64();
    report.deliver_seconds = times.deliver.as_secs_f64();
    Ok(report)
}

/// The staged run of [`stage_object`] (and of [`fill_object`]'s edges):
/// bytes `offset..offset + len` of the load `started` received into
/// `ring`'s slots and handed to `sink`, with the parameters chosen at its
/// start; returns the plan, the engine's run, the delivery's times and how
/// long the engine ran.
fn stage_with(
    started: &Started<'_>,
    offset: u64,
    len: u64,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    (options, expected): (&LoadOptions, Option<&Expected>),
) -> Result<(Plan, EngineRun, DeliverTimes, Duration)> {
    let (object, path) = (started.object, started.object.name());
    let chunk = staged_chunk(path, ring, object_request(options))?;
    let plan = Plan::staged(offset, len, 1, chunk, ring.slot_len(), sys::mem::page_size());
    let engine_started = Instant::now();
    let from = ReadFrom::Object(object, &started.params);
    let (run, times) = fill_staged(path, from, &plan, len, options, None, ring, sink, expected)?;
    Ok((plan, run, times, engine_started.elapsed()))
}

/// [`crate::LoadRequest::fill_arriving`] of an object (the request checked
/// the options): `dst.len()` bytes from `offset`. The whole pages of `dst`
/// receive their GETs' bodies in place, as a new buffer does; the bytes
/// before its first page boundary and after its last whole page (a socket
/// read needs no alignment, but the pages are populated whole) come first
/// and last through a ring of two pages, so `arrived` hears `head + n` as
/// the body's bytes `0..n` come in. Checked against the sums object beside
/// it when `options.verify` asks (and then `arrived` hears nothing before
/// the check). On error `dst` holds an unspecified mix.
pub(crate) fn fill_object(
    object: &Object,
    offset: u64,
    mut dst: RawBytesMut<'_>,
    options: &LoadOptions,
    arrived: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<LoadReport> {
    let path = object.name();
    let started = Started::now(object, options)?;
    let len = range_within(object.size, "object", path, offset, Some(dst.len() as u64))?;
    let expected = object_expected(object, offset, Some(len), options)?;
    let arrived = arrived.filter(|_| expected.is_none());
    let page = sys::mem::page_size();
    let address = dst.as_ptr() as usize;
    let head = (address.next_multiple_of(page) - address).min(dst.len());
    let body = (dst.len() - head) / page * page;
    let (mut head_bytes, rest) = dst.reborrow().split_at(head);
    let (mut body_bytes, mut tail_bytes) = rest.split_at(body);
    let verifier = expected.as_ref().map(Expected::verifier);
    let body_offset = offset + head as u64;
    let tail_offset = body_offset + body as u64;
    stage_edge(&started, offset, head_bytes.reborrow(), options)?;
    if let Some(verifier) = &verifier {
        verifier.add(head_bytes.writer(), 0..head, offset);
    }
    let plan = Plan::new(body_offset, body as u64, 1, object_request(options), options.gather_size, page);
    let params = &started.params;
    let engine_started = Instant::now();
    let (run, times) = if body == 0 {
        (EngineRun { engine: params.engine, ..EngineRun::default() }, Default::default())
    } else {
        let body_dst = body_bytes.writer();
        let after_head = |n: u64| {
            if let Some(arrived) = arrived {
                arrived(head as u64 + n);
            }
        };
        let follow =
            |gate: &Gate| follow_gathers(verifier.as_ref(), Some(&after_head), body_dst, &plan, gate);
        let beside: Option<&(dyn Fn(&Gate) + Sync)> =
            (verifier.is_some() || arrived.is_some()).then_some(&follow as _);
        Progress::reporting(body as u64, options.progress.as_deref(), |progress| {
            let transfer = Transfer::read(path, ReadFrom::Object(object, params), &plan, params, progress);
            let populate =
                |_, gate: &Gate| populate_gathers(body_dst, None, &plan, gate, options.populate_threads);
            let (run, times) = run_pipeline(&transfer, body_dst, Layout::InPlace, beside, populate);
            run.map(|run| (run, times.unwrap_or_default()))
        })?
    };
    let engine_wall = engine_started.elapsed();
    stage_edge(&started, tail_offset, tail_bytes.reborrow(), options)?;
    if let Some(verifier) = verifier {
        let tail = tail_bytes.len();
        verifier.add(tail_bytes.writer(), 0..tail, tail_offset);
        verifier.check(path)?;
    }
    let memory = MemoryChoice { kind: Default::default(), reason: "the caller's memory".into() };
    let whole = Plan::new(offset, len, 1, object_request(options), options.gather_size, page);
    let mut report = started.report(&whole, run, memory, &MemoryFacts::read(), engine_wall)?;
    report.destination = "caller memory (in place)".into();
    report.alloc_seconds = times.all.as_secs_f64();
    report.first_gather_seconds = times.first.as_secs_f64();
    Ok(report)
}

/// Receives bytes `offset..offset + dst.len()` of the object (less than a
/// page: an edge of [`fill_object`]'s memory, the load `started`) through
/// a ring of two pages.
fn stage_edge(started: &Started<'_>, offset: u64, dst: RawBytesMut<'_>, options: &LoadOptions) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    let page = sys::mem::page_size();
    let mut ring = StagingRing::new(2, page, page)
        .map_err(|e| Error::io("allocate staging ring", started.object.name(), e))?;
    // The caller hashes and reports an edge with the rest.
    let quiet = LoadOptions { progress: None, verify: false, ..options.clone() };
    let len = dst.len() as u64;
    stage_with(started, offset, len, &mut ring, &mut HostSink::raw(dst, offset), (&quiet, None))?;
    Ok(())
}

/// When a load of `object` started (its wall clock and the process's CPU
/// time), and what it chose then: the GETs remembered for the endpoint
/// (the tuning file read once for the whole load) and the engine's
/// parameters from them.
struct Started<'a> {
    object: &'a Object,
    at: Instant,
    cpu: (Duration, Duration),
    remembered: Option<tune::RememberedGets>,
    params: EngineParams,
}

impl<'a> Started<'a> {
    fn now(object: &'a Object, options: &LoadOptions) -> Result<Started<'a>> {
        let cpu = sys::process::cpu_time().map_err(|e| Error::io("getrusage", object.name(), e))?;
        let remembered = remembered_gets(options, object);
        let params = object_params(options, remembered);
        Ok(Started { object, at: Instant::now(), cpu, remembered, params })
    }

    /// The report of an object load that ran `plan` since then, its engine
    /// busy for `engine_wall`; the GETs' tuning, if any, is remembered.
    fn report(
        &self,
        plan: &Plan,
        run: EngineRun,
        memory: MemoryChoice,
        facts: &MemoryFacts,
        engine_wall: Duration,
    ) -> Result<LoadReport> {
        let (path, params) = (self.object.name(), &self.params);
        remember_gets(self.object, &run, self.remembered);
        let (connections, request, windows) = match run.gets.as_ref() {
            Some(gets) => (gets.kept_connections(), gets.kept_request(), gets.windows()),
            None => (params.queue_depth, params.request_size.map_or(plan.chunk, |r| r.min(plan.chunk)), 0),
        };
        let cpu = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
        let total = self.at.elapsed();
        let len = plan.data_end - plan.data_start;
        Ok(LoadReport {
            engine: run.engine,
            cache: CachePolicy::Bypass,
            memory: memory.kind,
            huge_pages: facts.huge_pages(memory.kind),
            destination: Destination::from(memory.kind).name(),
            memory_reason: memory.reason,
            filesystem: "s3",
            chunk_size: plan.chunk,
            gather_size: plan.gather,
            queue_depth: connections,
            request_size: request,
            tuning_windows: windows,
            fallbacks: run.fallbacks,
            io_seconds: engine_wall.saturating_sub(run.waited_for_memory).as_secs_f64(),
            waited_for_memory_seconds: run.waited_for_memory.as_secs_f64(),
            cpu_user_seconds: cpu.0.saturating_sub(self.cpu.0).as_secs_f64(),
            cpu_system_seconds: cpu.1.saturating_sub(self.cpu.1).as_secs_f64(),
            ..LoadReport::new(path, plan.data_start, len, total.as_secs_f64())
        })
    }
}
