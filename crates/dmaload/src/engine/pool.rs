//! Blocking engines: a pool of threads each taking the next chunk and
//! transferring it with `preadv2` (a load) or `pwritev2` (a save); with one
//! thread this is a plain sequential loop.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::{Engine, EngineResult, EngineRun, GatherTally, Job};
use crate::error::{Error, Result};
use crate::plan::ReadOutcome;
use crate::sys::uring::RingMemory;

/// Runs the job's plan over `mem` on `threads` threads (the calling one
/// among them), reporting the run as `engine`.
pub(crate) fn run<M: RingMemory>(job: &Job<'_>, mem: M, threads: usize, engine: Engine) -> EngineResult {
    let next_chunk = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let longest_wait = Mutex::new(Duration::ZERO);
    let tally = GatherTally::new(job.plan);

    let work = || {
        if let Err(err) = worker(job, mem, &tally, &next_chunk, &stop, &longest_wait) {
            stop.store(true, Ordering::Relaxed);
            // The cause goes in before the gate is cancelled: the workers the
            // cancellation wakes fail with ECANCELED, which must not win.
            first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(err);
            // Wakes workers waiting on the gate: a staged load's helper stops
            // releasing slots once the engine fails.
            job.gate.cancel();
        }
    };
    std::thread::scope(|scope| {
        // The calling thread is one of the workers; helpers the process may
        // not create (RLIMIT_NPROC, cgroup pids.max) leave fewer of them.
        for _ in 1..threads.max(1) {
            let name = format!("dmaload-{}", M::DIRECTION.op());
            if std::thread::Builder::new().name(name).spawn_scoped(scope, work).is_err() {
                break;
            }
        }
        work();
    });
    if let Some(err) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(err);
    }
    let waited_for_memory = longest_wait.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(EngineRun { waited_for_memory, fallbacks: Vec::new(), engine, ..EngineRun::default() })
}

fn worker<M: RingMemory>(
    job: &Job<'_>,
    mem: M,
    tally: &GatherTally,
    next_chunk: &AtomicUsize,
    stop: &AtomicBool,
    longest_wait: &Mutex<Duration>,
) -> Result<()> {
    let plan = job.plan;
    let file = job.file()?;
    let mut waited = Duration::ZERO;
    let rw_flags = job.cache.rw_flags();
    while !stop.load(Ordering::Relaxed) {
        let i = next_chunk.fetch_add(1, Ordering::Relaxed);
        if i >= plan.chunk_count() {
            break;
        }
        let mut req = plan.chunk_request(i);
        if job.gate.caller_cancelled() {
            return Err(job.cancelled(req.start));
        }
        let g = plan.gather_of(req.start);
        if plan.in_cache_lane(g) {
            continue;
        }
        waited += job.gate.wait_for(g).map_err(|e| job.wait_error(req.start, e))?;
        loop {
            let got =
                match mem.transfer_at(file, job.layout.target(plan, job.gate, &req), req.start, rw_flags) {
                    Ok(got) => got as u64,
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                    Err(err) => return Err(job.transfer_error(req.start, err)),
                };
            let (credited, resume_at) = match plan.outcome(job.path, &req, got)? {
                ReadOutcome::Done { credited } => {
                    job.finish_request(&req);
                    (credited, None)
                }
                ReadOutcome::Partial { credited, resume_at } => (credited, Some(resume_at)),
            };
            job.progress.add(credited);
            if tally.credit(g, credited) {
                job.gate.mark_filled(g);
            }
            match resume_at {
                Some(at) => req = plan.request_from(at),
                None => break,
            }
        }
    }
    let mut longest = longest_wait.lock().unwrap_or_else(|p| p.into_inner());
    *longest = (*longest).max(waited);
    Ok(())
}
