//! The engine of an object source: ranged GETs over a pool of kept-alive
//! connections, one per thread, each taking the plan's next chunk and
//! receiving its body into the chunk's place in memory (the gather of an
//! in-place load, the staging slot of a staged one: straight from the
//! socket over plain HTTP, copied in as `rustls` decrypts it over TLS),
//! behind the same gate as the file engines.
//!
//! Where the load tunes its GETs (the job names the request size they
//! start from: neither the connection count nor the request size was set),
//! a [`GetTuner`] measures the bytes the GETs complete and moves the
//! connection count, then the request size, while the load runs: a thread
//! is started for each connection the climb may try, and those past the
//! count of the moment wait, their connections kept alive.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Engine, EngineResult, EngineRun, GatherTally, Job, Layout};
use crate::error::{Error, ErrorKind, Result};
use crate::object::{Connection, Object};
use crate::sys::mem::MappingWriter;
use crate::tune::GetTuner;

/// Connections (and threads) a load starts with where none is remembered
/// for the endpoint: enough GETs in flight to fill a loopback or LAN link
/// from a single server.
pub(crate) const DEFAULT_CONNECTIONS: usize = 8;

/// How often a connection waiting for the climb to reach it looks at the
/// load's end when nothing wakes it (a change of count or the end does).
const IDLE_POLL: Duration = Duration::from_millis(50);

/// The GETs' pace: the connections busy now and the request size, fixed
/// or moved by a tuner.
struct Pace {
    tuner: Mutex<Option<GetTuner>>,
    /// A connection past the count of the moment waits on this.
    changed: Condvar,
    connections: AtomicUsize,
    request: AtomicUsize,
}

impl Pace {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<GetTuner>> {
        self.tuner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `bytes` of a GET arrived: the tuner, if any, measures them.
    fn observe(&self, bytes: u64) {
        let mut tuner = self.lock();
        if let Some(tuner) = tuner.as_mut() {
            tuner.observe(bytes, Instant::now());
            self.follow(tuner);
        }
    }

    fn follow(&self, tuner: &GetTuner) {
        self.request.store(tuner.request(), Ordering::Relaxed);
        if self.connections.swap(tuner.connections(), Ordering::Relaxed) != tuner.connections() {
            self.changed.notify_all();
        }
    }

    /// Waits while connection `index` is past the count of the moment;
    /// false once the load is over (`over`) instead.
    fn wait_turn(&self, index: usize, over: &dyn Fn() -> bool) -> bool {
        let mut tuner = self.lock();
        loop {
            if over() {
                return false;
            }
            if index < self.connections.load(Ordering::Relaxed) {
                return true;
            }
            tuner = self.changed.wait_timeout(tuner, IDLE_POLL).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// Runs the job's plan from `object` into `dst` over `connections`
/// connections (where the GETs are tuned, the count they start from). The
/// report names the engine `pread-pool`: a pool of threads making blocking
/// requests.
pub(crate) fn run(
    job: &Job<'_>,
    object: &Object,
    dst: MappingWriter<'_>,
    connections: usize,
) -> EngineResult {
    let plan = job.plan;
    let connections = connections.max(1);
    let tuner =
        job.request_size.filter(|_| GetTuner::worth_tuning(plan.data_end - plan.data_start)).map(|request| {
            // A GET holds a chunk of a staging ring: no more than it has.
            let most = match job.layout {
                Layout::Staged { slots, slot_len } => slots * slot_len / plan.chunk.max(1),
                Layout::InPlace | Layout::Placed { .. } => usize::MAX,
            };
            GetTuner::new(connections, request, plan.chunk, most, Instant::now())
        });
    let threads = tuner.as_ref().map_or(connections, GetTuner::most_connections);
    let pace = Pace {
        connections: AtomicUsize::new(tuner.as_ref().map_or(connections, GetTuner::connections)),
        // Without a tuner (a fixed load, or one too short to measure), a
        // tuned load's GETs still ask for the size it started from.
        request: AtomicUsize::new(
            tuner.as_ref().map_or(job.request_size.unwrap_or(plan.chunk).min(plan.chunk), GetTuner::request),
        ),
        tuner: Mutex::new(tuner),
        changed: Condvar::new(),
    };
    let next_chunk = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let longest_wait = Mutex::new(Duration::ZERO);
    let tally = GatherTally::new(plan);
    let stopped = || stop.load(Ordering::Relaxed) || job.gate.is_cancelled();
    let work = |index: usize| {
        let gets = Gets { job, object, dst, tally: &tally, next_chunk: &next_chunk, pace: &pace };
        if let Err(err) = gets.worker(index, &stopped, &longest_wait) {
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
        // Whoever ends wakes those waiting for their turn to see the end.
        pace.changed.notify_all();
    };
    std::thread::scope(|scope| {
        for index in 1..threads.min(plan.chunk_count().max(1)) {
            let thread = std::thread::Builder::new().name("dmaload-get".into());
            if thread.spawn_scoped(scope, move || work(index)).is_err() {
                break;
            }
        }
        work(0);
    });
    if let Some(err) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(err);
    }
    let waited_for_memory = longest_wait.into_inner().unwrap_or_else(|p| p.into_inner());
    let gets = pace.tuner.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(EngineRun { waited_for_memory, engine: Engine::PreadPool, gets, ..EngineRun::default() })
}

/// What every connection's thread shares.
struct Gets<'a, 'j> {
    job: &'a Job<'j>,
    object: &'a Object,
    dst: MappingWriter<'a>,
    tally: &'a GatherTally,
    next_chunk: &'a AtomicUsize,
    pace: &'a Pace,
}

impl Gets<'_, '_> {
    /// Connection `index`'s thread: takes the plan's next chunk while its
    /// turn lasts, and receives it in GETs of the request size of the moment.
    fn worker(
        &self,
        index: usize,
        stopped: &(dyn Fn() -> bool + Sync),
        longest_wait: &Mutex<Duration>,
    ) -> Result<()> {
        let (job, plan) = (self.job, self.job.plan);
        let mut connection: Option<Connection> = None;
        let mut waited = Duration::ZERO;
        let over = || stopped() || self.next_chunk.load(Ordering::Relaxed) >= plan.chunk_count();
        while self.pace.wait_turn(index, &over) {
            let i = self.next_chunk.fetch_add(1, Ordering::Relaxed);
            if i >= plan.chunk_count() {
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
            let mut done = 0;
            while done < req.need {
                let n = (req.need - done).min(self.pace.request.load(Ordering::Relaxed).max(1) as u64);
                let (from, to) = (req.start + done, at + done as usize);
                self.object.get_into(
                    &mut connection,
                    from..from + n,
                    self.dst,
                    to..to + n as usize,
                    stopped,
                )?;
                done += n;
                job.progress.add(n);
                self.pace.observe(n);
            }
            if self.tally.credit(g, req.need) {
                job.gate.mark_filled(g);
            }
        }
        let mut longest = longest_wait.lock().unwrap_or_else(|p| p.into_inner());
        *longest = (*longest).max(waited);
        Ok(())
    }
}
