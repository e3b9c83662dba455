//! io_uring engine: keeps `queue_depth` chunk requests in flight from one
//! thread (a depth a load's reads may tune, [`crate::tune`]), reads or
//! writes as the memory's direction says. In place, with
//! registered buffers, each gather (a save's window) is registered (pinned)
//! a little ahead of the requests ([`super::RegisterAhead`]) and
//! unregistered when its last chunk is done, so pinned memory stays at a few
//! gathers whatever the file size, and pinning runs beside the I/O instead
//! of before it. Staged, the slots stay registered for the whole load and
//! each filled gather is handed to the destination through the gate;
//! placed, the memory's owner registered it once for many runs.

use std::io;
use std::os::fd::BorrowedFd;
use std::time::Instant;

use super::{Engine, EngineResult, EngineRun, GatherTally, Job, Layout, RegisterAhead};
use crate::error::Error;
use crate::plan::{ReadOutcome, Request};
use crate::sys;
use crate::sys::uring::{Completion, Registrar, Ring, RingMemory};
use crate::tune::{ReadMode, Tuner};
use crate::types::Fallback;

/// Runs the job's plan on `ring`. With `fixed`, the gathers are registered
/// in the ring's sparse buffer table a little ahead of the requests (see
/// [`RegisterAhead`]): by the helper thread, or by this thread between its
/// requests when a registrar is given as `inline` (no helper thread could
/// be created); in place, this thread unregisters each gather once its last
/// chunk is done. A failure may leave requests in flight: the ring waits
/// for them when it drops.
pub(crate) fn run<M: RingMemory>(
    job: &Job<'_>,
    ring: &mut Ring<M>,
    fixed: bool,
    inline: Option<Registrar<M>>,
) -> EngineResult {
    let plan = job.plan;
    debug_assert_eq!(plan.direction, M::DIRECTION, "a plan runs on memory of its direction");
    let file = job.file()?;
    let mut run = EngineRun { engine: Engine::Uring, ..EngineRun::default() };
    let tally = GatherTally::new(plan);
    let mut next_chunk = 0;
    let mut retries: Vec<Request> = Vec::new();
    let mut completions: Vec<Completion> = Vec::with_capacity(job.queue_depth);
    // An `auto` load's reads flip between direct and buffered windows.
    let mut direct = DirectFlag { file, direct: true };
    let range_of = |g| plan.gather_range(g);
    let mut inline = inline.as_ref().map(|r| RegisterAhead::new(job.gate, r, &range_of));
    // The gather the gate was last told the engine has reached.
    let mut reached = None;
    let mut tuner = job.tune.then(|| {
        let tuner =
            Tuner::new(job.queue_depth, job.request_size.unwrap_or(plan.chunk), plan.chunk, Instant::now());
        let tuner = match job.read_modes {
            Some(modes) => tuner.choosing_reads(modes.remembered, plan.data_end - plan.file_start),
            None => tuner,
        };
        match job.layout {
            Layout::Staged { slots, slot_len } => tuner.in_ring(slots * slot_len / plan.chunk),
            Layout::InPlace | Layout::Placed { .. } => tuner,
        }
    });
    let mut depth = tuner.as_ref().map_or(job.queue_depth, Tuner::depth);

    // Queues `req`, asking for at most `most` bytes of it: a tuned request
    // size smaller than the plan's chunk. The completion is read against
    // the whole request (`request_from` its start), so the rest is resumed
    // as after a short read, again at most `most` bytes at a time.
    let queue = |ring: &mut Ring<M>, req: &Request, most: usize, rw_flags: i32| -> io::Result<()> {
        let g = plan.gather_of(req.start);
        let index = job.layout.buffer_index(job.gate, g);
        let slot = job.gate.is_registered(index.into()).then_some(index);
        let mut target = job.layout.target(plan, job.gate, req);
        target.end = target.end.min(target.start.saturating_add(most));
        ring.queue_transfer(file, target, req.start, slot, rw_flags, req.start)
    };
    // A poll of the gate's wake eventfd beside the reads, armed while the
    // next gather waits for a staging slot: a slot freeing ends the wait in
    // `submit` at once, not at the next read's completion. Signalled on the
    // way out (also on an error), so the ring's drain sees it complete.
    let mut wake_armed = false;
    let _disarm = WakeOnExit(job.gate);

    loop {
        if job.gate.caller_cancelled() {
            // Dropping the ring waits for the reads in flight.
            let next = plan.chunk_request(next_chunk.min(plan.chunk_count().saturating_sub(1))).start;
            return Err(job.cancelled(next));
        }
        let most = tuner.as_ref().map_or(usize::MAX, Tuner::request);
        // An `auto` load's read mode flips once the reads in flight are
        // done, so each window of the trial measures one mode from none in
        // flight (the kernel would take either: it reads O_DIRECT from the
        // file's flags each time it issues a read, a retry from its
        // workers too, and every request is whole alignment blocks).
        let mut rw_flags = job.cache.rw_flags();
        let mut draining = false;
        if let (Some(modes), Some(tuner)) = (job.read_modes, tuner.as_mut()) {
            draining = tuner.draining() && ring.in_flight() > usize::from(wake_armed);
            if !draining {
                direct
                    .set(tuner.read_mode() == ReadMode::Direct)
                    .map_err(|e| Error::io("fcntl(O_DIRECT)", job.path, e))?;
                if tuner.draining() {
                    tuner.flipped(Instant::now());
                }
            }
            if !direct.direct {
                rw_flags = modes.buffered.rw_flags();
            }
        }
        if !draining {
            for req in retries.drain(..) {
                queue(ring, &req, most, rw_flags).map_err(|e| job.transfer_error(req.start, e))?;
            }
        }
        while !draining && ring.in_flight() < depth && next_chunk < plan.chunk_count() {
            let req = plan.chunk_request(next_chunk);
            let g = plan.gather_of(req.start);
            if plan.in_cache_lane(g) {
                next_chunk += 1;
                continue;
            }
            if fixed && reached != Some(g) {
                reached = Some(g);
                job.gate.reach(g);
                if let Some(ahead) = inline.as_mut() {
                    ahead.register_due(plan.gather_count());
                }
            }
            if !job.gate.is_ready(g) {
                if let Some(tuner) = tuner.as_mut() {
                    depth = tuner.memory_bound();
                }
                if ring.in_flight() > usize::from(wake_armed) {
                    if let Some(wake) = job.gate.wake_fd().filter(|_| !wake_armed) {
                        ring.queue_poll_readable(wake, WAKE_TAG)
                            .map_err(|e| job.transfer_error(req.start, e))?;
                        wake_armed = true;
                    }
                    break; // reap what is running while the gather populates
                }
                run.waited_for_memory += job.gate.wait_for(g).map_err(|e| job.wait_error(req.start, e))?;
            }
            queue(ring, &req, most, rw_flags).map_err(|e| job.transfer_error(req.start, e))?;
            next_chunk += 1;
        }
        if ring.in_flight() == usize::from(wake_armed) {
            break;
        }
        ring.submit(1).map_err(|e| Error::io("io_uring_enter", job.path, e))?;
        completions.clear();
        ring.reap(&mut completions);
        for done in &completions {
            if done.tag == WAKE_TAG {
                wake_armed = false;
                job.gate.drain_wake();
                continue;
            }
            let req = plan.request_from(done.tag);
            if done.result < 0 {
                return Err(job.transfer_error(req.start, io::Error::from_raw_os_error(-done.result)));
            }
            let credited = match plan.outcome(job.path, &req, done.result as u64)? {
                ReadOutcome::Done { credited } => {
                    job.finish_request(&req);
                    credited
                }
                ReadOutcome::Partial { credited, resume_at } => {
                    retries.push(plan.request_from(resume_at));
                    credited
                }
            };
            job.progress.add(credited);
            if let Some(tuner) = tuner.as_mut() {
                depth = tuner.observe(credited, Instant::now());
            }
            let g = plan.gather_of(req.start);
            if tally.credit(g, credited) {
                // A failure to unpin early only means the pages stay pinned
                // until the ring closes.
                if job.layout == Layout::InPlace && job.gate.retire(g) {
                    drop(ring.unregister(g as u32));
                }
                job.gate.mark_filled(g);
            }
        }
    }
    if fixed {
        match job.gate.registration_refused() {
            Some(reason) => run.fallbacks.push(Fallback::new("uring-fixed", "uring", reason)),
            None => run.engine = Engine::UringFixed,
        }
    }
    run.tuner = tuner;
    Ok(run)
}

/// Whether the load's own file description has `O_DIRECT` (see
/// [`crate::source::ReadSetup`]): flipped between an `auto` load's
/// windows, and set again when the engine returns, as its setup says.
struct DirectFlag<'a> {
    file: BorrowedFd<'a>,
    direct: bool,
}

impl DirectFlag<'_> {
    fn set(&mut self, direct: bool) -> io::Result<()> {
        if direct != self.direct {
            sys::file::set_direct(self.file, direct)?;
            self.direct = direct;
        }
        Ok(())
    }
}

impl Drop for DirectFlag<'_> {
    fn drop(&mut self) {
        // The flag was set on this description before: setting it again
        // cannot meet a filesystem without direct I/O.
        let _ = self.set(true);
    }
}

/// The tag of the wake poll's completion (no read starts at this offset).
const WAKE_TAG: u64 = u64::MAX;

/// Signals the gate's wake eventfd when the engine returns, so a wake poll
/// still armed completes and the ring (dropped after this) can drain.
struct WakeOnExit<'a>(&'a super::Gate);

impl Drop for WakeOnExit<'_> {
    fn drop(&mut self) {
        self.0.wake();
    }
}

/// Why registering a buffer failed, in words a user can act on.
pub(crate) fn register_refusal(err: &io::Error) -> String {
    if err.raw_os_error() == Some(libc::ENOMEM) {
        let limit = memlock_limit_words();
        format!(
            "registering buffers failed with ENOMEM: pinned pages exceed RLIMIT_MEMLOCK \
             ({limit}); raise it (ulimit -l) or grant CAP_IPC_LOCK"
        )
    } else {
        format!("registering buffers failed: {err}")
    }
}

/// The soft RLIMIT_MEMLOCK, in words: "64 KiB", "unlimited".
pub(crate) fn memlock_limit_words() -> String {
    match crate::sys::process::memlock_limit() {
        Ok(Some(bytes)) => format!("{} KiB", bytes / 1024),
        Ok(None) => "unlimited".into(),
        Err(_) => "unknown".into(),
    }
}
