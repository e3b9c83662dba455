//! io_uring engine: keeps `queue_depth` chunk reads in flight from one
//! thread; with registered buffers each gather is registered (pinned) once
//! when populated and unregistered when its last chunk arrives, so pinned
//! memory stays at a few gathers whatever the file size.

use std::io;

use super::{Engine, EngineResult, EngineRun, Job};
use crate::error::Error;
use crate::load::Fallback;
use crate::plan::{ReadOutcome, Request};
use crate::sys::uring::{Completion, Ring};

pub(crate) fn run(job: &Job<'_>, mut ring: Ring<'_>, want_fixed: bool) -> EngineResult {
    let plan = job.plan;
    let mut run = EngineRun { engine: Engine::Uring, ..EngineRun::default() };
    let gathers = plan.gather_count();
    let mut fixed = false;
    if want_fixed {
        match ring.register_slots(gathers as u32) {
            Ok(()) => fixed = true,
            Err(err) => run.fallbacks.push(Fallback::new(
                "uring-fixed",
                "uring",
                format!("cannot create a sparse registered-buffer table (Linux 5.19+): {err}"),
            )),
        }
    }
    // Gathers 0..registered hold a registered buffer (until unregistered).
    let mut registered = 0usize;
    let mut unfinished: Vec<u64> = (0..gathers).map(|g| plan.gather_need(g)).collect();
    let mut next_chunk = 0;
    let mut retries: Vec<Request> = Vec::new();
    let mut completions: Vec<Completion> = Vec::with_capacity(job.queue_depth);
    let rw_flags = job.cache.rw_flags();

    let queue = |ring: &mut Ring<'_>, req: &Request, registered: usize| -> io::Result<()> {
        let g = plan.gather_of(req.start);
        let slot = (g < registered).then_some(g as u16);
        ring.queue_read(job.file, plan.mapping_range(req), req.start, slot, rw_flags, req.start)
    };

    loop {
        for req in retries.drain(..) {
            queue(&mut ring, &req, registered).map_err(|e| job.read_error(req.start, e))?;
        }
        while ring.in_flight() < job.queue_depth && next_chunk < plan.chunk_count() {
            let req = plan.chunk_request(next_chunk);
            let g = plan.gather_of(req.start);
            if !job.gate.is_ready(g) {
                if ring.in_flight() > 0 {
                    break; // reap what is running while the gather populates
                }
                run.waited_for_memory += job
                    .gate
                    .wait_for(g)
                    .map_err(|e| Error::io("populate memory", job.path, e).at(req.start))?;
            }
            if fixed && g == registered {
                match ring.register(g as u32, plan.gather_range(g)) {
                    Ok(()) => registered += 1,
                    Err(err) => {
                        fixed = false;
                        run.fallbacks.push(Fallback::new("uring-fixed", "uring", register_refusal(&err)));
                    }
                }
            }
            queue(&mut ring, &req, registered).map_err(|e| job.read_error(req.start, e))?;
            next_chunk += 1;
        }
        if ring.in_flight() == 0 {
            break;
        }
        ring.submit(1).map_err(|e| Error::io("io_uring_enter", job.path, e))?;
        completions.clear();
        ring.reap(&mut completions);
        for done in &completions {
            let req = plan.request_from(done.tag);
            if done.result < 0 {
                return Err(job.read_error(req.start, io::Error::from_raw_os_error(-done.result)));
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
            let g = plan.gather_of(req.start);
            unfinished[g] -= credited;
            if unfinished[g] == 0 && g < registered {
                // Unpinning early keeps RLIMIT_MEMLOCK use to a few gathers;
                // a failure only means the pages stay pinned until the ring closes.
                let _ = ring.unregister(g as u32);
            }
        }
    }
    if registered > 0 && fixed {
        run.engine = Engine::UringFixed;
    }
    Ok(run)
}

/// Why registering a buffer failed, in words a user can act on.
fn register_refusal(err: &io::Error) -> String {
    if err.raw_os_error() == Some(libc::ENOMEM) {
        let limit = match crate::sys::process::memlock_limit() {
            Ok(Some(bytes)) => format!("{} KiB", bytes / 1024),
            Ok(None) => "unlimited".into(),
            Err(_) => "unknown".into(),
        };
        format!(
            "registering buffers failed with ENOMEM: pinned pages exceed RLIMIT_MEMLOCK \
             ({limit}); raise it (ulimit -l) or grant CAP_IPC_LOCK"
        )
    } else {
        format!("registering buffers failed: {err}")
    }
}
