//! The pipeline of one transfer, in either direction: a helper thread
//! makes the memory ready gather by gather behind a [`Gate`] (populating
//! and registering a load's destination, feeding a sink from staging
//! slots, registering a save's windows), the engine runs the plan's chunk
//! requests over what is ready, and a reporting thread passes progress on;
//! see docs/architecture.md.

mod host;
mod object;
mod range;
mod staged;
mod write;

pub(crate) use host::{load_source, with_kept_ring};
pub use object::object_ring_slots;
pub(crate) use object::{
    fill_object, load_object_source, load_object_to_sink, object_expected, stage_object,
};
pub use range::check_memory;
pub(crate) use range::{open_range, range_len, range_within};
pub(crate) use staged::load_open_to_sink;
pub(crate) use write::{write_at, KeptWriteRing};

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::engine::{
    self, EngineParams, EngineRun, Gate, Input, Job, Layout, Progress, ReadModes, RegisterAhead,
};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Allocation, MemoryKind};
use crate::object::Object;
use crate::options::{LoadOptions, DEFAULT_QUEUE_DEPTH};
use crate::plan::Plan;
use crate::sink::{CachedRanges, Sink, SlotData, StagingRing, CACHE_LANE_PIECE, CACHE_LANE_PIECES};
use crate::source::ReadSetup;
use crate::sys::mem::{HugePageAdvice, MappingWriter};
use crate::sys::uring::{Registrar, Ring, RingMemory};
use crate::tune;
use crate::types::{CachePolicy, Direction, Engine, Fallback};
use crate::verify::{Expected, Verifier};

/// Time spent on the helper thread: populating the buffer, and
/// registering it with io_uring.
#[derive(Debug, Default)]
pub(crate) struct PopulateTimes {
    pub all: Duration,
    pub first: Duration,
    pub register: Duration,
}

/// Populates each gather in order and opens the gate behind it; with a
/// registrar, registers each gather with io_uring as the engine comes
/// within reach of it ([`RegisterAhead`]): those due when their populating
/// ends before they are opened, the rest once every gather is populated.
fn populate_gathers(
    dst: MappingWriter<'_>,
    registrar: Option<Registrar<MappingWriter<'_>>>,
    plan: &Plan,
    gate: &Gate,
    threads: usize,
) -> PopulateTimes {
    let mut times = PopulateTimes::default();
    let count = plan.gather_count();
    let range_of = |g| plan.gather_range(g);
    let mut ahead = registrar.as_ref().map(|r| RegisterAhead::new(gate, r, &range_of));
    for g in 0..count {
        if gate.is_cancelled() {
            break;
        }
        let started = Instant::now();
        if let Err(err) = dst.populate_on_threads(plan.gather_range(g), threads) {
            gate.fail(&err);
            ahead = None;
            break;
        }
        let took = started.elapsed();
        times.all += took;
        if g == 0 {
            times.first = took;
        }
        if let Some(ahead) = ahead.as_mut() {
            ahead.register_due(g + 1);
        }
        gate.publish(g + 1);
    }
    if let Some(mut ahead) = ahead {
        ahead.register_rest();
        times.register = ahead.took;
    }
    times
}

/// A buffer allocation's failure as a load's error: a kind this machine
/// cannot give is the options' error (EINVAL); a hugetlb pool that ran
/// short, the memory's (ENOMEM).
pub(crate) fn allocation_error(path: &Path, e: io::Error) -> Error {
    let op = "allocate memory";
    match e.kind() {
        io::ErrorKind::Unsupported => Error::new(ErrorKind::InvalidInput, op, path, e.to_string()),
        io::ErrorKind::OutOfMemory if e.raw_os_error().is_none() => {
            Error::new(ErrorKind::OutOfMemory, op, path, e.to_string())
        }
        _ => Error::io(op, path, e),
    }
}

/// An engine ready to run, chosen from the parameters and what the process
/// may do.
enum Prepared<M: RingMemory> {
    Uring(Box<Ring<M>>),
    Pool {
        threads: usize,
        engine: Engine,
    },
    /// An object's GETs over this many connections.
    Object {
        connections: usize,
    },
}

/// Sets up the engine the parameters ask for: the ring and, for registered
/// buffers, its sparse buffer table and a registrar for the helper thread.
/// Falls back to the pread pool when io_uring is unavailable to this
/// process, and to plain addresses when the table is.
fn prepare_engine<M: RingMemory>(
    path: &Path,
    plan: &Plan,
    layout: Layout,
    mem: M,
    params: &EngineParams,
    fallbacks: &mut Vec<Fallback>,
) -> Result<(Prepared<M>, Option<Registrar<M>>)> {
    if matches!(params.engine, Engine::PreadPool | Engine::Read) {
        return Ok((Prepared::Pool { threads: params.pool_threads(), engine: params.engine }, None));
    }
    if plan.chunk_count() == 0 {
        // Nothing to transfer (an empty file or range): no ring, no buffers
        // to register, and no fallback to report.
        return Ok((Prepared::Pool { threads: 1, engine: params.engine }, None));
    }
    // A tuned depth may climb up to the tuner's limit.
    let most =
        if params.tune.is_some() { params.queue_depth.max(tune::MAX_DEPTH) } else { params.queue_depth };
    let entries = (most as u32).next_power_of_two();
    let mut ring = match Ring::new(entries, mem) {
        Ok(ring) => ring,
        Err(err) if engine::io_uring_unavailable(&err) => {
            fallbacks.push(engine::no_uring(params.engine, &err));
            return Ok((Prepared::Pool { threads: params.threads, engine: Engine::PreadPool }, None));
        }
        Err(err) => return Err(Error::io("io_uring_setup", path, err)),
    };
    let registrar = if params.engine == Engine::UringFixed {
        match ring.register_slots(layout.table_len(plan)).map(|()| ring.registrar()) {
            Ok(Ok(registrar)) => Some(registrar),
            Ok(Err(err)) => {
                fallbacks.push(engine::no_registrar(&err));
                None
            }
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

/// The engine's parameters for a load with `options` through `setup`:
/// direct reads by io_uring at the default depth are tuned
/// ([`crate::tune`]), from the depth, request size and read mode
/// remembered for the file's device; in `auto` mode the tuner chooses
/// between those direct reads and buffered ones.
fn load_params(options: &LoadOptions, setup: &ReadSetup) -> EngineParams {
    let tuned = setup.cache == CachePolicy::Bypass
        && options.queue_depth == DEFAULT_QUEUE_DEPTH
        && matches!(options.engine, Engine::Uring | Engine::UringFixed);
    let tune = tuned.then(|| tune::Device::of(&setup.file).ok()).flatten();
    let remembered = tune.and_then(|device| tune::remembered(&tune::memory_file()?, device));
    let read_modes = setup
        .buffered
        .filter(|_| tune.is_some())
        .map(|buffered| ReadModes { buffered, remembered: remembered.and_then(|tuned| tuned.read) });
    EngineParams {
        engine: options.engine,
        queue_depth: remembered.and_then(|tuned| tuned.depth).unwrap_or(options.queue_depth),
        threads: options.threads,
        cancel: options.cancel.clone(),
        tune,
        request_size: remembered.and_then(|tuned| tuned.request),
        read_modes,
    }
}

/// After a load that tuned its reads: when the depth, request size or
/// read mode it kept is not the one it started from (a window measured
/// it faster), or the read modes were measured, remembers for the device
/// what its trials measured, and keeps what was remembered before for
/// the rest (a load that ended before the request size's trial, or whose
/// staging ring left no depth to try, measured neither, and the values it
/// started from are not a measurement). The memory is a cache: a failure
/// to write it (a read-only home, say) loses nothing.
fn remember_tuned(params: &EngineParams, run: &EngineRun) {
    let (Some(device), Some(tuner)) = (params.tune, run.tuner.as_ref()) else { return };
    if tuner.moved() {
        if let Some(path) = tune::memory_file() {
            let before = tune::remembered(&path, device);
            let tuned = tune::Remembered {
                depth: tuner.tuned_depth().or(before.and_then(|b| b.depth)),
                request: tuner.tuned_request().or(before.and_then(|b| b.request)),
                // A load that chose no read mode (`--mode direct`) keeps
                // the one an `auto` load measured.
                read: tuner.read_to_remember().or(before.and_then(|b| b.read)),
            };
            let _ = tune::remember(&path, device, tuned);
        }
    }
}

/// Where a pipeline's reads come from: a file opened for the load (the
/// io_uring and pread engines, tuned per device), or an object (the
/// object engine's ranged GETs). Everything after the engine, the gate,
/// the helper and the sink, is the same for both.
#[derive(Clone, Copy)]
pub(crate) enum ReadFrom<'a> {
    File(&'a ReadSetup),
    /// An object, with the parameters its load chose once at its start
    /// (from the GETs remembered for its endpoint).
    Object(&'a Object, &'a EngineParams),
}

impl ReadFrom<'_> {
    /// The engine's parameters for a load with `options` from here.
    fn params(self, options: &LoadOptions) -> EngineParams {
        match self {
            ReadFrom::File(setup) => load_params(options, setup),
            ReadFrom::Object(_, params) => params.clone(),
        }
    }
}

/// What one successful fill produced.
pub(crate) struct Filled {
    pub alloc: Allocation,
    pub run: EngineRun,
    pub times: PopulateTimes,
    pub engine_wall: Duration,
}

/// One attempt at filling a fresh allocation of `memory`, checked against
/// `expected` (a verified load); the allocation is dropped (never
/// returned) when it fails.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill(
    path: &Path,
    setup: &ReadSetup,
    plan: &Plan,
    len: u64,
    options: &LoadOptions,
    memory: MemoryKind,
    facts: &crate::memory::MemoryFacts,
    expected: Option<&Expected>,
) -> Result<Filled> {
    let mut alloc =
        Allocation::with_facts(memory, plan.mapping_len, facts).map_err(|e| allocation_error(path, e))?;
    let started = Instant::now();
    let verifier = expected.map(Expected::verifier);
    let (run, times) =
        fill_mapping(path, setup, plan, len, options, alloc.mapping.writer(), None, verifier.as_ref())?;
    if let Some(verifier) = verifier {
        verifier.check(path)?;
    }
    Ok(Filled { alloc, run, times, engine_wall: started.elapsed() })
}

/// Reads the plan's range into `dst` (at least `plan.mapping_len` bytes)
/// with the options' engine, a helper thread populating (and registering)
/// each gather ahead of the reads. `arrived`, when given, is called from a
/// thread beside the engine with `n` each time the requested bytes `0..n`
/// have all arrived (gather by gather, in file order; a retried load
/// starts from 0 again). `verifier`, when given, is fed every gather in
/// file order; the caller checks it. On error the memory holds a partial
/// read, which the caller must not hand out as loaded.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill_mapping(
    path: &Path,
    setup: &ReadSetup,
    plan: &Plan,
    len: u64,
    options: &LoadOptions,
    dst: MappingWriter<'_>,
    arrived: Option<&(dyn Fn(u64) + Sync)>,
    verifier: Option<&Verifier<'_>>,
) -> Result<(EngineRun, PopulateTimes)> {
    let populate = |registrar: Option<Registrar<MappingWriter<'_>>>, gate: &Gate| {
        populate_gathers(dst, registrar, plan, gate, options.populate_threads)
    };
    let follow = |gate: &Gate| follow_gathers(verifier, arrived, dst, plan, gate);
    let beside: Option<&(dyn Fn(&Gate) + Sync)> =
        (verifier.is_some() || arrived.is_some()).then_some(&follow as _);
    let params = load_params(options, setup);
    let (run, times) = Progress::reporting(len, options.progress.as_deref(), |progress| {
        let transfer = Transfer::read(path, ReadFrom::File(setup), plan, &params, progress);
        let (run, times) = run_pipeline(&transfer, dst, Layout::InPlace, beside, populate);
        debug_assert!(run.is_err() || progress.done() == len);
        run.map(|run| (run, times))
    })?;
    remember_tuned(&params, &run);
    Ok((run, times.unwrap_or_default()))
}

/// Follows an in-place load's gathers in file order as the engine
/// completes them (a thread beside the engine): hashes each for the
/// verifier and says how far the requested bytes have all arrived; stops
/// quietly when the load fails or is cancelled.
fn follow_gathers(
    verifier: Option<&Verifier<'_>>,
    arrived: Option<&(dyn Fn(u64) + Sync)>,
    dst: MappingWriter<'_>,
    plan: &Plan,
    gate: &Gate,
) {
    for g in 0..plan.gather_count() {
        if gate.wait_filled(g).is_err() {
            return;
        }
        let data = plan.gather_data(g);
        if let Some(verifier) = verifier {
            let range = (data.start - plan.file_start) as usize..(data.end - plan.file_start) as usize;
            verifier.add(dst, range, data.start);
        }
        if let Some(arrived) = arrived {
            arrived(data.end - plan.data_start);
        }
    }
}

/// What feeding a sink cost, on the helper thread.
#[derive(Debug, Default)]
pub(crate) struct DeliverTimes {
    /// Registering the staging slots with io_uring.
    pub register: Duration,
    /// Handing filled slots to the sink and waiting for it to release them.
    pub deliver: Duration,
    /// What the sink could not do beside its deliveries as it meant to.
    pub fallbacks: Vec<Fallback>,
    /// Bytes the sink's cache lane carried from the page cache (the rest
    /// came through the ring), and on how many threads.
    pub cache_lane_bytes: u64,
    pub cache_lane_threads: usize,
}

/// How a staged load shares its ring with the sink's cache lane: the engine
/// reads through the first `engine_slots` slots, the lane's threads use
/// `pieces` (whole slots at the ring's end, [`crate::sink::lane_pieces`]).
#[derive(Debug, Clone)]
pub(crate) struct LaneShare {
    pub engine_slots: usize,
    pub pieces: Vec<Vec<std::ops::Range<usize>>>,
}

impl LaneShare {
    /// The share for a lane of up to `threads` threads in a ring of
    /// `slots` slots of `slot_len` bytes: whole slots from the end, as many
    /// as the threads' pieces fill, always leaving the engine two (one
    /// filling while the sink drains the other). `None` where no lane
    /// thread fits.
    pub fn of(slots: usize, slot_len: usize, threads: usize) -> Option<LaneShare> {
        let page = crate::sys::mem::page_size();
        let spare = slots.checked_sub(SLOTS_THE_ENGINE_KEEPS).filter(|&spare| spare > 0)?;
        let wanted = (threads * CACHE_LANE_PIECES * CACHE_LANE_PIECE).div_ceil(slot_len).clamp(1, spare);
        let engine_slots = slots - wanted;
        let pieces = crate::sink::lane_pieces(engine_slots * slot_len..slots * slot_len, threads, page);
        (!pieces.is_empty()).then_some(LaneShare { engine_slots, pieces })
    }
}

/// Staging slots the engine keeps when the cache lane takes a share.
const SLOTS_THE_ENGINE_KEEPS: usize = 2;

/// Reads the plan's range, from a file or an object (`from`), through
/// `ring`'s staging slots into `sink`: the engine fills slots, a helper thread hands each filled slot to the sink
/// (in file order) and gives it back to the engine once the sink has
/// released it (where no such thread can be created and the slots are
/// reused, the load runs in parts on this thread: [`run_in_parts`]). With
/// `lane` (its share of the ring, and the file's own
/// buffered description), the gathers the plan leaves to the cache lane
/// ([`Plan::in_cache_lane`]) are carried by the sink's lane threads through
/// their pieces of the ring's last slots, beside the engine, which reads
/// the rest through the slots before them. Whatever happens, the sink is
/// finished (every delivery it started has landed) and every lane thread
/// has drained its stream before this returns, so the slots are quiet; a
/// lane failure is the load's error, naming its file offset. A verified
/// load (`expected`) hashes each gather as it is delivered, in file order,
/// and checks the digest once the sink has finished.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill_staged(
    path: &Path,
    from: ReadFrom<'_>,
    plan: &Plan,
    len: u64,
    options: &LoadOptions,
    lane: Option<(&LaneShare, BorrowedFd<'_>)>,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    expected: Option<&Expected>,
) -> Result<(EngineRun, DeliverTimes)> {
    let verifier = expected.map(Expected::verifier);
    let (ring_slots, slot_len) = (ring.slots(), ring.slot_len());
    // The gathers the lane carries are the plan's only where the lane has a share.
    debug_assert!(plan.cache_lane_gathers().next().is_none() || lane.is_some());
    let dst = ring.writer();
    let sink = std::sync::Mutex::new(sink);
    let params = from.params(options);
    // One run of the pipeline over `plan`, with `lane` carrying the
    // gathers the plan leaves to it.
    let run_plan = |plan: &Plan, lane: Option<(&LaneShare, BorrowedFd<'_>)>, progress: &Progress<'_>| {
        let cached: Vec<std::ops::Range<u64>> =
            plan.cache_lane_gathers().map(|g| plan.gather_data(g)).collect();
        let lane = lane.filter(|_| !cached.is_empty());
        let engine_slots = lane.map_or(ring_slots, |(share, _)| share.engine_slots);
        let layout = Layout::Staged { slots: engine_slots, slot_len };
        let feed = |registrar: Option<Registrar<MappingWriter<'_>>>, gate: &Gate| {
            let stopped = || gate.is_cancelled();
            let carried = |bytes| progress.add(bytes);
            let stop_all = |err: &io::Error| {
                gate.fail(err);
                gate.cancel();
            };
            let cached = lane.map(|(share, file)| {
                let pieces = share.pieces.clone();
                CachedRanges::new(file, cached.clone(), dst, pieces, &stopped, &carried, &stop_all)
            });
            let mut sink = sink.lock().unwrap_or_else(|p| p.into_inner());
            let slots = (engine_slots, slot_len);
            let hash = verifier.as_ref();
            let threads = options.populate_threads;
            let fed = feed_sink(
                path,
                dst,
                registrar,
                plan,
                slots,
                threads,
                gate,
                hash,
                cached.as_ref(),
                &mut **sink,
            );
            let carried = cached.as_ref().map(|c| (c.bytes(), c.threads(), c.take_failure()));
            (fed, carried)
        };
        let transfer = Transfer::read(path, from, plan, &params, progress);
        run_pipeline(&transfer, dst, layout, None, feed)
    };
    let mut fed = None;
    // Bytes the lane was to carry: none when the load ran in parts.
    let mut cached_bytes: u64 = plan.cache_lane_gathers().map(|g| plan.gather_need(g)).sum();
    let run = Progress::reporting(len, options.progress.as_deref(), |progress| {
        let (run, helped) = match run_plan(plan, lane, progress) {
            (Err(err), None) if err.op() == NO_DELIVERY_THREAD => {
                cached_bytes = 0;
                run_in_parts(plan, ring_slots, err, |part| {
                    let (run, mut helped) = run_plan(part, None, progress);
                    // Every slot free again before the next part reads into it.
                    let mut sink = sink.lock().unwrap_or_else(|p| p.into_inner());
                    let released = (0..part.gather_count()).try_for_each(|slot| sink.release(slot));
                    if let (Err(err), Some((delivered @ Ok(_), _))) = (released, helped.as_mut()) {
                        *delivered = Err(Error::io("release staging slot", path, err).at(part.data_start));
                    }
                    (run, helped)
                })
            }
            other => other,
        };
        // A lane that stopped short is an error below.
        let lane_short = matches!(&helped, Some((_, Some((bytes, _, _))))
            if *bytes < cached_bytes);
        debug_assert!(run.is_err() || lane_short || progress.done() == len);
        fed = helped;
        run
    });
    let finished = sink.into_inner().unwrap_or_else(|p| p.into_inner()).finish();
    let Some((fed, carried)) = fed else {
        run?;
        return Err(Error::new(ErrorKind::Io, "deliver", path, "the delivery thread stopped"));
    };
    // The lane's or the sink's own error is the cause; the engine only saw
    // it stop.
    let (lane_bytes, lane_threads, lane_failure) = carried.unwrap_or((0, 0, None));
    if let Some((offset, err)) = lane_failure {
        return Err(Error::io("copy from the page cache to the destination", path, err).at(offset));
    }
    let mut times = fed?;
    if lane_bytes < cached_bytes {
        // Stopped by the engine's failure, or a cancellation (the engine
        // may have finished first).
        run?;
        let first = plan.cache_lane_gathers().next().map_or(plan.data_start, |g| plan.gather_data(g).start);
        return Err(engine::cancelled_error("copy from the page cache to the destination", path, first));
    }
    (times.cache_lane_bytes, times.cache_lane_threads) = (lane_bytes, lane_threads);
    let mut run = run?;
    finished.map_err(|e| Error::io("finish delivery", path, e))?;
    if let Some(verifier) = verifier {
        verifier.check(path)?;
    }
    remember_tuned(&params, &run);
    run.fallbacks.append(&mut times.fallbacks);
    Ok((run, times))
}

/// What one run of a staged pipeline gives: the engine's result, and the
/// helper's (the sink's deliveries, and what its cache lane carried).
type StagedRun = (Result<EngineRun>, Option<(Result<DeliverTimes>, Option<LaneCarried>)>);
/// Bytes a cache lane carried, on how many threads, and where it failed.
type LaneCarried = (u64, usize, Option<(u64, io::Error)>);

/// What a staged load without a delivery thread does not do.
const DELIVER_BESIDE: &str = "deliver beside the reads";

/// The op of the error [`run_pipeline`] returns when a staged load's
/// slots are reused and no thread can deliver beside the reads.
const NO_DELIVERY_THREAD: &str = "create the delivery thread";

/// A staged load whose sink no thread can run beside the reads (RLIMIT_NPROC,
/// a cgroup's pids.max), on the calling thread: the plan in parts of one
/// ring each ([`Plan::parts`], no cache lane), the engine filling every slot
/// of a part, then the sink taking them in file order, every slot released
/// before the next part reads into it. `no_thread` is why.
fn run_in_parts(
    plan: &Plan,
    slots: usize,
    no_thread: Error,
    mut run_part: impl FnMut(&Plan) -> StagedRun,
) -> StagedRun {
    let mut all = DeliverTimes::default();
    let mut merged: Option<EngineRun> = None;
    for part in plan.parts(slots) {
        let (run, helped) = run_part(&part);
        let Some((delivered, _)) = helped else { return (run, None) };
        let (run, times) = match (run, delivered) {
            (Ok(run), Ok(times)) => (run, times),
            (run, delivered) => return (run, Some((delivered.map(|_| all), None))),
        };
        all.register += times.register;
        all.deliver += times.deliver;
        for fallback in times.fallbacks {
            if !all.fallbacks.contains(&fallback) {
                all.fallbacks.push(fallback);
            }
        }
        match merged.as_mut() {
            None => merged = Some(EngineRun { tuner: None, ..run }),
            Some(merged) => {
                merged.waited_for_memory += run.waited_for_memory;
                merged.engine = run.engine;
                let new: Vec<Fallback> =
                    run.fallbacks.into_iter().filter(|f| !merged.fallbacks.contains(f)).collect();
                merged.fallbacks.extend(new);
            }
        }
    }
    let Some(mut run) = merged else { return (Err(no_thread), None) };
    // Each part said it delivered after its reads; the load says how.
    run.fallbacks.retain(|f| f.from != DELIVER_BESIDE);
    run.fallbacks.insert(
        0,
        Fallback::new(
            DELIVER_BESIDE,
            &format!("read {slots} slots, then deliver them, in turn on the calling thread"),
            format!("cannot create a thread: {}", no_thread.io_error()),
        ),
    );
    (Ok(run), Some((Ok(all), None)))
}

/// The helper thread of a staged load. It registers a few slots for the
/// engine's fixed reads and frees them to it, then the rest one at a time
/// between deliveries (pinning beside the reads, not before them), and has
/// the sink run (with up to `threads` threads of its own beside, see
/// [`Sink::feed`]) the loop that hands it each filled gather as its reads
/// complete (in file order for a verified load, which hashes the file in
/// order) and gives each slot back to the engine once the sink's copy from
/// it has landed ([`Sink::is_released`], polled: a copy still running
/// never holds back a delivery or a read into another slot). Fails only
/// with the sink's own errors; it stops quietly when the engine does.
#[allow(clippy::too_many_arguments)]
fn feed_sink(
    path: &Path,
    dst: MappingWriter<'_>,
    registrar: Option<Registrar<MappingWriter<'_>>>,
    plan: &Plan,
    (slots, slot_len): (usize, usize),
    threads: usize,
    gate: &Gate,
    verifier: Option<&Verifier<'_>>,
    cached: Option<&CachedRanges<'_>>,
    sink: &mut dyn Sink,
) -> Result<DeliverTimes> {
    // The gathers the engine reads: the cache lane carries the rest.
    let count = plan.gather_count() - plan.cache_lane_gathers().count();
    let used = slots.min(count);
    let mut times = DeliverTimes::default();
    let mut registrar = registrar;
    let mut pages = SlotPages::AsMapped;
    // Slots `opened..used` are neither registered nor free yet.
    let mut opened = 0;
    while opened < used.min(SLOTS_BEFORE_THE_FIRST_READ) {
        open_slot((dst, opened), slot_len, (&mut registrar, &mut pages), gate, &mut times);
        opened += 1;
    }
    let fail = |err: io::Error, op: &'static str, g: usize| {
        gate.fail(&err);
        gate.cancel();
        Error::io(op, path, err).at(plan.gather_data(g).start)
    };
    let mut delivered = Ok(());
    let mut deliveries = |sink: &mut dyn Sink| {
        delivered = (|| {
            // Delivered gathers whose slot the sink may still be reading.
            let mut copying: Vec<(usize, usize)> = Vec::new();
            let mut taken = 0;
            while taken < count {
                let mut released = Ok(());
                copying.retain(|&(slot, g)| match released.is_ok().then(|| sink.is_released(slot)) {
                    Some(Ok(true)) => {
                        gate.free_slot(slot);
                        false
                    }
                    Some(Err(err)) => {
                        released = Err(fail(err, "release staging slot", g));
                        true
                    }
                    _ => true,
                });
                released?;
                if opened < used {
                    open_slot((dst, opened), slot_len, (&mut registrar, &mut pages), gate, &mut times);
                    opened += 1;
                    continue;
                }
                // With copies running, look at their events again soon;
                // without, only a fill can change anything. (The copies
                // still running after the last delivery are the sink's
                // finish to wait for.)
                let wait = (!copying.is_empty()).then_some(RELEASE_POLL);
                let in_file_order = verifier.is_some().then_some(taken);
                let g = match gate.next_filled(in_file_order, wait) {
                    Ok(Some(g)) => g,
                    Ok(None) => continue,
                    Err(_) => break, // the engine failed or was cancelled: its error says why
                };
                taken += 1;
                let started = Instant::now();
                let data = plan.gather_data(g);
                let slot = gate.slot_of(g);
                let into = (data.start - plan.file_start) as usize - plan.gather_range(g).start;
                let range = slot * slot_len + into..slot * slot_len + into + (data.end - data.start) as usize;
                if let Some(verifier) = verifier {
                    verifier.add(dst, range.clone(), data.start);
                }
                sink.deliver(slot, SlotData::new(dst, range, data.start))
                    .map_err(|e| fail(e, "deliver", g))?;
                copying.push((slot, g));
                times.deliver += started.elapsed();
            }
            Ok(())
        })();
    };
    let fallbacks = sink.feed(threads, cached, &mut deliveries);
    delivered?;
    times.fallbacks = fallbacks;
    Ok(times)
}

/// The pages the staging slots not yet opened fault in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotPages {
    /// As the ring was mapped (2 MiB pages asked for).
    AsMapped,
    /// 4 KiB pages: a slot's 2 MiB pages were slow to come.
    Small,
}

/// A staging slot that faults in slower than this (bytes per second) got
/// its 2 MiB pages from memory compaction: on the development VM 0.17
/// GiB/s so (a 16 MiB slot in 0.1 s, the first second of a 1 GiB load to
/// cuda:0 spent on a 10-slot ring), where 4 KiB pages came at 0.8-1.7
/// GiB/s and 2 MiB pages already free at 4-8.
const SLOW_FAULTS: f64 = 0.5 * (1u64 << 30) as f64;

/// Registers staging slot `slot` of `dst` for fixed reads (until a
/// registration is refused: the rest use plain addresses) and frees it to
/// the engine.
fn open_slot(
    (dst, slot): (MappingWriter<'_>, usize),
    slot_len: usize,
    (registrar, pages): (&mut Option<Registrar<MappingWriter<'_>>>, &mut SlotPages),
    gate: &Gate,
    times: &mut DeliverTimes,
) {
    if let Some(reg) = registrar {
        let started = Instant::now();
        let range = slot * slot_len..(slot + 1) * slot_len;
        // Faulted in first where it is fresh (a ring pinned as it is
        // used): MADV_POPULATE_WRITE took a twentieth of the time the
        // registration's own faulting did on the development VM (2 MiB
        // pages). Advice only: the registration faults in what it left.
        let _ = dst.populate(range.clone());
        let slow = (slot_len as f64) < SLOW_FAULTS * started.elapsed().as_secs_f64();
        if *pages == SlotPages::AsMapped && slow {
            // Where 2 MiB pages come from compaction, 4 KiB ones come
            // faster: the slots still to open take those. Advice only.
            let rest = range.end..dst.len();
            if dst.advise(rest, HugePageAdvice::Small).is_ok() {
                *pages = SlotPages::Small;
            }
        }
        match reg.register(slot as u32, range) {
            Ok(()) => _ = gate.mark_registered(slot),
            Err(err) => {
                gate.refuse_registration(engine::uring::register_refusal(&err));
                *registrar = None;
            }
        }
        times.register += started.elapsed();
    }
    gate.free_slot(slot);
}

/// Staging slots registered and handed to the engine before its first
/// read; the rest follow beside the reads.
const SLOTS_BEFORE_THE_FIRST_READ: usize = 2;

/// How often the delivery loop looks at the copies still running from its
/// slots when nothing else wakes it (a fill does).
const RELEASE_POLL: Duration = Duration::from_micros(200);

/// What one run of the pipeline moves: the plan's bytes between the open
/// file (or an object) and memory, with the engine the parameters name, counting into
/// `progress` (whose reporting the caller runs, [`Progress::reporting`]).
pub(crate) struct Transfer<'a> {
    pub path: &'a Path,
    pub input: Input<'a>,
    pub cache: CachePolicy,
    pub plan: &'a Plan,
    pub params: &'a EngineParams,
    pub progress: &'a Progress<'a>,
}

impl<'a> Transfer<'a> {
    /// A read of the plan's bytes from the file `setup` opened for it, or
    /// from an object (whose GETs no page cache is involved in).
    fn read(
        path: &'a Path,
        from: ReadFrom<'a>,
        plan: &'a Plan,
        params: &'a EngineParams,
        progress: &'a Progress<'a>,
    ) -> Transfer<'a> {
        let (input, cache) = match from {
            ReadFrom::File(setup) => (Input::File(setup.file.as_fd()), setup.cache),
            ReadFrom::Object(object, _) => (Input::Object(object), CachePolicy::Bypass),
        };
        Transfer { path, input, cache, plan, params, progress }
    }
}

/// Runs one pipeline over `mem` in the plan's direction: the engine on this
/// thread, `helper` (populating a destination, feeding a sink, registering
/// a save's windows) on a thread beside it (or first, when no thread can be
/// created), and `beside`, a task that follows the engine's completions
/// (the hashing of a verified load, the arrival of a load's bytes: on a
/// thread of its own, or after the engine without one). Returns the engine's result and the helper's
/// (`None` if it panicked).
fn run_pipeline<M: RingMemory, T: Send>(
    transfer: &Transfer<'_>,
    mem: M,
    layout: Layout,
    beside: Option<&(dyn Fn(&Gate) + Sync)>,
    helper: impl FnOnce(Option<Registrar<M>>, &Gate) -> T + Send,
) -> (Result<EngineRun>, Option<T>) {
    let Transfer { path, plan, params, .. } = *transfer;
    let table = layout.table_len(plan) as usize;
    let gate = match layout {
        Layout::Staged { .. } => Gate::staged(params.cancel.clone(), table),
        Layout::InPlace | Layout::Placed { .. } => Gate::new(params.cancel.clone(), table),
    };
    plan.cache_lane_gathers().for_each(|g| gate.pass_over(g));
    let job = Job {
        path,
        input: transfer.input,
        plan,
        layout,
        cache: transfer.cache,
        gate: &gate,
        progress: transfer.progress,
        queue_depth: params.queue_depth,
        tune: params.tune.is_some(),
        request_size: params.request_size,
        read_modes: params.read_modes,
    };
    let mut fallbacks = Vec::new();
    let prepared = match transfer.input {
        Input::Object(_) => Ok((Prepared::Object { connections: params.threads }, None)),
        Input::File(_) => prepare_engine(path, plan, layout, mem, params, &mut fallbacks),
    };
    let (prepared, registrar) = match prepared {
        Ok((prepared, registrar)) => (Ok(prepared), registrar),
        Err(err) => (Err(err), None),
    };
    let mut fixed = registrar.is_some();
    // Taken by whichever thread runs the helper (see below).
    let helper = std::sync::Mutex::new(Some((helper, registrar)));
    let (result, helped) = std::thread::scope(|scope| {
        let help = || {
            let (helper, registrar) = helper.lock().unwrap_or_else(|p| p.into_inner()).take()?;
            let helped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| helper(registrar, &gate)));
            // A panic must still open the gate, or the engine would wait forever.
            helped.inspect_err(|_| gate.fail(&io::Error::other("the helper thread panicked"))).ok()
        };
        let helper_thread =
            std::thread::Builder::new().name("dmaload-helper".into()).spawn_scoped(scope, help);
        // Without a thread of its own (RLIMIT_NPROC, cgroup pids.max) the
        // memory is made ready before the engine runs instead of beside it.
        let mut deliver_after = false;
        // The registrar for the engine's own thread, when no helper can take it.
        let mut inline = None;
        let (helper_thread, helped_first) = match helper_thread {
            Ok(handle) => (Some(handle), None),
            Err(err) if layout == Layout::InPlace => {
                fallbacks.push(match plan.direction {
                    Direction::Read => Fallback::new(
                        "populate beside the reads",
                        "populate before the reads",
                        format!("cannot create a thread: {err}"),
                    ),
                    Direction::Write => Fallback::new(
                        "register beside the writes",
                        "register between the writes",
                        format!("cannot create a thread: {err}"),
                    ),
                });
                // Registering waits for the engine to come near each gather:
                // the engine does it itself, between its requests.
                if let Some((_, registrar)) = helper.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                    inline = registrar.take();
                }
                (None, help())
            }
            Err(err) if matches!(layout, Layout::Staged { slots, .. } if plan.gather_count() <= slots) => {
                // Every gather has a slot of its own, none is reused: the
                // engine may fill them all (unregistered, as registering is
                // the helper's part), then the sink takes them here.
                fallbacks.push(Fallback::new(
                    DELIVER_BESIDE,
                    "deliver after the reads",
                    format!("cannot create a thread: {err}"),
                ));
                if let Some((_, registrar)) = helper.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
                    *registrar = None;
                }
                fixed = false;
                (0..plan.gather_count()).for_each(|slot| gate.free_slot(slot));
                deliver_after = true;
                (None, None)
            }
            Err(err) => {
                // A sink must run beside the reads: the slots are reused.
                // The caller runs the plan in parts instead ([`run_in_parts`]).
                return (Err(Error::io(NO_DELIVERY_THREAD, path, err)), None);
            }
        };
        let follower = beside.map(|task| {
            let thread = std::thread::Builder::new().name("dmaload-follow".into());
            (task, thread.spawn_scoped(scope, || task(&gate)))
        });
        let result = prepared.and_then(|prepared| match prepared {
            Prepared::Uring(mut ring) => engine::uring::run(&job, &mut ring, fixed, inline),
            Prepared::Pool { threads, engine } => engine::pool::run(&job, mem, threads, engine),
            Prepared::Object { connections } => match (job.input, mem.destination()) {
                (Input::Object(object), Some(dst)) => engine::object::run(&job, object, dst, connections),
                _ => Err(Error::new(ErrorKind::InvalidInput, "save", path, "an object cannot be written")),
            },
        });
        gate.engine_done();
        if result.is_err() {
            gate.cancel();
        }
        // Without a thread of its own, the task follows the engine.
        let followed = match follower {
            None => true,
            Some((_, Ok(thread))) => thread.join().is_ok(),
            Some((task, Err(_))) => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(&gate))).is_ok()
            }
        };
        let result = match result {
            Ok(_) if !followed => Err(Error::new(
                ErrorKind::Io,
                "follow the reads",
                path,
                "the thread beside the engine panicked",
            )),
            other => other,
        };
        let helped = match helper_thread {
            Some(handle) => handle.join().ok().flatten(),
            None if deliver_after => help(),
            None => helped_first,
        };
        (result, helped)
    });
    let result = result.map(|mut run| {
        fallbacks.append(&mut run.fallbacks);
        run.fallbacks = fallbacks;
        run
    });
    (result, helped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_lane_takes_whole_slots_from_the_rings_end_and_leaves_the_engine_two() {
        let slot = 16 << 20;
        // Eight threads of 3 x 2 MiB fill three 16 MiB slots.
        let share = LaneShare::of(32, slot, 8).unwrap();
        assert_eq!((share.engine_slots, share.pieces.len()), (29, 8));
        assert!(share.pieces.iter().flatten().all(|p| p.start >= 29 * slot && p.end <= 32 * slot));
        // A small ring: the engine keeps two, the lane the rest.
        let share = LaneShare::of(4, slot, 16).unwrap();
        assert_eq!((share.engine_slots, share.pieces.len()), (2, 5));
        // Two slots: none to spare.
        assert!(LaneShare::of(2, slot, 8).is_none());
    }
}
