//! The engine of an object source: ranged GETs over a pool of kept-alive
//! connections, one per thread, each taking the plan's next chunk and
//! receiving its body into the chunk's place in memory (the gather of an
//! in-place load, the staging slot of a staged one: straight from the
//! socket over plain HTTP, copied in as `rustls` decrypts it over TLS),
//! behind the same gate as the file engines.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::{Engine, EngineResult, EngineRun, GatherTally, Job};
use crate::error::{Error, ErrorKind, Result};
use crate::object::{Connection, Object};
use crate::sys::mem::MappingWriter;

/// Connections (and threads) a load keeps: enough GETs in flight to fill
/// a loopback or LAN link from a single server; not yet tuned by
/// measurement as the disk's depth is.
pub(crate) const DEFAULT_CONNECTIONS: usize = 8;

/// Runs the job's plan from `object` into `dst` over `connections`
/// connections. The report names the engine `pread-pool`: a pool of
/// threads making blocking requests.
pub(crate) fn run(
    job: &Job<'_>,
    object: &Object,
    dst: MappingWriter<'_>,
    connections: usize,
) -> EngineResult {
    let next_chunk = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let longest_wait = Mutex::new(Duration::ZERO);
    let tally = GatherTally::new(job.plan);
    let stopped = || stop.load(Ordering::Relaxed) || job.gate.is_cancelled();
    let work = || {
        if let Err(err) = worker(job, object, dst, &tally, &next_chunk, &stopped, &longest_wait) {
            stop.store(true, Ordering::Relaxed);
            // The workers stopped by this failure end with a cancellation:
            // the first other error, the cause, outranks those.
            let mut first = first_error.lock().unwrap_or_else(|p| p.into_inner());
            if !matches!(&*first, Some(e) if e.kind() != ErrorKind::Cancelled) {
                *first = Some(err);
            }
            drop(first);
            job.gate.cancel();
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..connections.max(1).min(job.plan.chunk_count().max(1)) {
            if std::thread::Builder::new().name("dmaload-get".into()).spawn_scoped(scope, work).is_err() {
                break;
            }
        }
        work();
    });
    if let Some(err) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(err);
    }
    let waited_for_memory = longest_wait.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(EngineRun { waited_for_memory, fallbacks: Vec::new(), engine: Engine::PreadPool, tuner: None })
}

fn worker(
    job: &Job<'_>,
    object: &Object,
    dst: MappingWriter<'_>,
    tally: &GatherTally,
    next_chunk: &AtomicUsize,
    stopped: &(dyn Fn() -> bool + Sync),
    longest_wait: &Mutex<Duration>,
) -> Result<()> {
    let plan = job.plan;
    let mut connection: Option<Connection> = None;
    let mut waited = Duration::ZERO;
    loop {
        let i = next_chunk.fetch_add(1, Ordering::Relaxed);
        if i >= plan.chunk_count() || stopped() {
            break;
        }
        let req = plan.chunk_request(i);
        if job.gate.caller_cancelled() {
            return Err(job.cancelled(req.start));
        }
        let g = plan.gather_of(req.start);
        waited += job.gate.wait_for(g).map_err(|e| job.wait_error(req.start, e))?;
        // Reads are unaligned (alignment 1): the request is exactly the
        // bytes needed, so a GET of it is the chunk, no more.
        let at = job.layout.target(plan, job.gate, &req).start;
        let need = req.need as usize;
        object.get_into(&mut connection, req.start..req.start + req.need, dst, at..at + need, stopped)?;
        job.progress.add(req.need);
        if tally.credit(g, req.need) {
            job.gate.mark_filled(g);
        }
    }
    let mut longest = longest_wait.lock().unwrap_or_else(|p| p.into_inner());
    *longest = (*longest).max(waited);
    Ok(())
}
