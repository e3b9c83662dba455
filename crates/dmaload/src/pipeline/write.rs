//! The write direction of the pipeline: a save's bytes (or a capture run's)
//! go to the file through the same engines, [`Gate`] and register-ahead
//! coordination as a load's, over [`RawBytes`] instead of a mapping
//! writer. The plan's gathers are the windows registered one after another
//! ([`Plan::write`]); the helper beside the engine only registers them, as
//! the bytes are already there.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use super::{run_pipeline, Transfer};
use crate::engine::{self, EngineParams, EngineRun, Gate, Input, Job, Layout, Progress, RegisterAhead};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::sys;
use crate::sys::shm::RawBytes;
use crate::sys::uring::{Registrar, Ring};
use crate::types::{CachePolicy, Direction, Engine, Fallback};

/// Bytes registered (pinned) as one io_uring buffer while writing: the
/// largest window of a write's plan.
const WINDOW: usize = 128 << 20;

/// Writes all of `src` to `file` at `file_offset` in requests of `chunk`
/// bytes (whole `align` blocks: with `O_DIRECT`, `file_offset`, the
/// address and the length of `src` must be aligned too), counting into
/// `progress`. io_uring engines fall back to plain addresses when
/// registration is refused, and to the pread pool without io_uring or when
/// io_uring cannot create its workers. The caller's token stops it
/// between requests with [`crate::ErrorKind::Cancelled`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_at(
    path: &Path,
    file: &File,
    src: RawBytes<'_>,
    file_offset: u64,
    align: usize,
    chunk: usize,
    params: &EngineParams,
    progress: &Progress<'_>,
) -> Result<EngineRun> {
    let plan = Plan::write(file_offset, src.len() as u64, align, chunk, WINDOW, sys::mem::page_size());
    let attempt = |params: &EngineParams| {
        let transfer = Transfer {
            path,
            input: Input::File(file.as_fd()),
            cache: CachePolicy::Keep,
            plan: &plan,
            params,
            progress,
        };
        run_pipeline(&transfer, src, Layout::InPlace, None, |registrar, gate| {
            register_windows(registrar, &plan, gate)
        })
        .0
    };
    match attempt(params) {
        Err(err) if engine::io_wq_refused(params.engine, &params.cancel, &err) => {
            let mut run = attempt(&params.on_pool())?;
            run.fallbacks.insert(0, engine::workers_refused(params.engine, Direction::Write, &err));
            Ok(run)
        }
        other => other,
    }
}

/// The helper of a write: every window may be written at once; with a
/// registrar, each is registered as the engine comes near it.
fn register_windows(registrar: Option<Registrar<RawBytes<'_>>>, plan: &Plan, gate: &Gate) -> Duration {
    gate.publish(plan.gather_count());
    let Some(registrar) = registrar else { return Duration::ZERO };
    let range_of = |w| plan.gather_range(w);
    let mut ahead = RegisterAhead::new(gate, &registrar, &range_of);
    ahead.register_rest();
    ahead.took
}

/// A write ring kept over a whole source (a capture's ring of blocks) for
/// many writes of parts of it: registered once as buffer 0
/// ([`Layout::Placed`]), so each write skips pinning without paying a
/// registration of its own.
pub(crate) struct KeptWriteRing<'s> {
    ring: Ring<RawBytes<'s>>,
    src: RawBytes<'s>,
    registered: bool,
    /// Why the source is not registered, when `uring-fixed` was asked for.
    refused: Option<Fallback>,
    /// Set once io_uring could not create its workers: later writes go to
    /// the pread pool.
    on_pool: Option<Fallback>,
}

impl<'s> KeptWriteRing<'s> {
    /// A ring of `queue_depth` entries over `src`; `register` asks for the
    /// fixed buffer (refused: plain writes, with the reason kept).
    pub fn new(src: RawBytes<'s>, queue_depth: usize, register: bool) -> io::Result<KeptWriteRing<'s>> {
        let mut ring = Ring::new((queue_depth as u32).next_power_of_two(), src)?;
        let mut refused = None;
        if register {
            let registered =
                ring.register_slots(1).and_then(|()| ring.registrar()?.register(0, 0..src.len()));
            if let Err(err) = registered {
                let why = engine::uring::register_refusal(&err);
                refused = Some(Fallback::new(Engine::UringFixed.name(), Engine::Uring.name(), why));
            }
        }
        Ok(KeptWriteRing { ring, src, registered: register && refused.is_none(), refused, on_pool: None })
    }

    /// Writes the `len` bytes at `base` of the source to `file` at
    /// `file_offset` (as [`write_at`] does, on this ring). A failed write
    /// may leave requests in flight: the caller stops using the ring
    /// (dropping it waits for them).
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        path: &Path,
        file: &File,
        base: usize,
        len: usize,
        file_offset: u64,
        align: usize,
        chunk: usize,
        params: &EngineParams,
    ) -> Result<EngineRun> {
        let _ = self.src.range(base..base + len); // a write outside the source panics, as slicing does
        let plan = Plan::write(file_offset, len as u64, align, chunk, WINDOW, sys::mem::page_size());
        let progress = Progress::new(len as u64, None);
        let gate = Gate::new(params.cancel.clone(), 1);
        gate.publish(plan.gather_count());
        if self.registered {
            gate.mark_registered(0);
        }
        let job = Job {
            path,
            input: Input::File(file.as_fd()),
            plan: &plan,
            layout: Layout::Placed { base },
            cache: CachePolicy::Keep,
            gate: &gate,
            progress: &progress,
            queue_depth: params.queue_depth,
            tune: false,
            request_size: None,
            read_modes: None,
        };
        if let Some(on_pool) = &self.on_pool {
            let mut run = engine::pool::run(&job, self.src, params.threads, Engine::PreadPool)?;
            run.fallbacks.insert(0, on_pool.clone());
            return Ok(run);
        }
        match engine::uring::run(&job, &mut self.ring, self.registered, None) {
            Err(err) if engine::io_wq_refused(params.engine, &params.cancel, &err) => {
                self.wait_idle().map_err(|e| Error::io("io_uring_enter", path, e))?;
                self.on_pool = Some(engine::workers_refused(params.engine, Direction::Write, &err));
                self.write(path, file, base, len, file_offset, align, chunk, params)
            }
            Err(err) => Err(err),
            Ok(mut run) => {
                run.engine = if self.registered { Engine::UringFixed } else { Engine::Uring };
                run.fallbacks.extend(self.refused.iter().cloned());
                Ok(run)
            }
        }
    }

    /// Waits until no request is in flight: a failed write may leave some,
    /// and none may read the source once the write has returned.
    fn wait_idle(&mut self) -> io::Result<()> {
        let mut done = Vec::new();
        while self.ring.in_flight() > 0 {
            self.ring.submit(1)?;
            done.clear();
            self.ring.reap(&mut done);
        }
        Ok(())
    }
}
