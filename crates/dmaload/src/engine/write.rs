//! Write engines: the save direction of the read engines. Each writes a
//! byte slice to a file at an offset in `chunk`-sized requests and checks
//! every result (short writes are resumed, zero-byte writes are errors).

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{Engine, Gate, Progress, RegisterAhead};
use crate::cancel::CancelToken;
use crate::error::{Error, Result};
use crate::sys::shm::RawBytes;
use crate::sys::uring::{Completion, Ring, MAX_REGISTERED_BUFFERS};
use crate::types::Fallback;

/// Bytes registered (pinned) as one io_uring buffer while writing: the
/// write direction of a gather, registered ahead of the writes by the same
/// coordinator ([`Gate`], [`RegisterAhead`]) as a load's gathers.
const WINDOW: usize = 128 << 20;

/// One write of `src` to `file` at `file_offset`. The source is raw bytes
/// so that memory a peer process may write (a block queue's blocks) is
/// written without a `&[u8]` of it.
pub(crate) struct WriteJob<'a> {
    pub path: &'a Path,
    pub file: &'a File,
    pub src: RawBytes<'a>,
    pub file_offset: u64,
    pub chunk: usize,
    pub queue_depth: usize,
    pub threads: usize,
    /// Counts the bytes each completed write wrote (a save's progress).
    pub progress: Option<&'a Progress<'a>>,
}

/// What a write engine did: the engine that did it, and paths not taken.
pub(crate) struct WriteRun {
    pub engine: Engine,
    pub fallbacks: Vec<Fallback>,
}

impl WriteJob<'_> {
    /// The source range of the request that starts at `start` (a chunk, or
    /// the rest of one after a short write).
    fn request(&self, start: usize) -> Range<usize> {
        let end = (start / self.chunk + 1) * self.chunk;
        start..end.min(self.src.len())
    }

    fn wrote(&self, bytes: u64) {
        if let Some(progress) = self.progress {
            progress.add(bytes);
        }
    }

    fn error(&self, at: usize, err: io::Error) -> Error {
        Error::io("write", self.path, err).at(self.file_offset + at as u64)
    }

    /// Runs `engine` (io_uring engines fall back to plain addresses when
    /// registration is refused, and to a thread pool without io_uring).
    pub fn run(&self, engine: Engine) -> Result<WriteRun> {
        match engine {
            Engine::UringFixed | Engine::Uring => self.uring(engine == Engine::UringFixed),
            Engine::PreadPool => self.pool(self.threads, Engine::PreadPool),
            Engine::Read => self.pool(1, Engine::Read),
        }
    }

    /// Blocking `pwrite` calls from `threads` threads, each taking the next
    /// chunk. The calling thread is one of them; threads the process may not
    /// create (RLIMIT_NPROC, cgroup pids.max) leave fewer, with a fallback.
    fn pool(&self, threads: usize, engine: Engine) -> Result<WriteRun> {
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let chunks = self.src.len().div_ceil(self.chunk);
        let work = || {
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= chunks {
                    break;
                }
                let range = self.request(i * self.chunk);
                let start = range.start;
                let len = range.len() as u64;
                match self.src.range(range).write_all_at(self.file.as_fd(), self.file_offset + start as u64) {
                    Ok(()) => self.wrote(len),
                    Err(err) => {
                        stop.store(true, Ordering::Relaxed);
                        failure
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(self.error(start, err));
                    }
                }
            }
        };
        let wanted = threads.clamp(1, chunks.max(1));
        let mut running = 1;
        let mut refused = None;
        std::thread::scope(|scope| {
            for _ in 1..wanted {
                match std::thread::Builder::new().name("dmaload-write".into()).spawn_scoped(scope, work) {
                    Ok(_) => running += 1,
                    Err(err) => {
                        refused = Some(err);
                        break;
                    }
                }
            }
            work();
        });
        if let Some(err) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(err);
        }
        let fallbacks = refused
            .map(|err| {
                Fallback::new(
                    &format!("{wanted} writing threads"),
                    &format!("{running}"),
                    format!("cannot create a thread: {err}"),
                )
            })
            .into_iter()
            .collect();
        Ok(WriteRun { engine, fallbacks })
    }

    /// `queue_depth` writes in flight on one io_uring; with `fixed`, a
    /// helper thread registers each 128 MiB window of the source a little
    /// ahead of the writes ([`RegisterAhead`]: pinning beside the I/O, not
    /// between it), and each window is unregistered when its last write
    /// lands, so only a few windows are pinned at a time.
    fn uring(&self, fixed: bool) -> Result<WriteRun> {
        let mut fallbacks = Vec::new();
        let entries = (self.queue_depth as u32).next_power_of_two();
        let mut ring = match Ring::new(entries, self.src) {
            Ok(ring) => ring,
            Err(err) if super::io_uring_unavailable(&err) => {
                let mut run = self.pool(self.threads, Engine::PreadPool)?;
                let from = if fixed { Engine::UringFixed } else { Engine::Uring };
                run.fallbacks.push(super::no_uring(from, &err));
                return Ok(run);
            }
            Err(err) => return Err(Error::io("io_uring_setup", self.path, err)),
        };
        let mut window = WINDOW.max(self.chunk) / self.chunk * self.chunk;
        while self.src.len().div_ceil(window) > MAX_REGISTERED_BUFFERS {
            window *= 2;
        }
        let windows = self.src.len().div_ceil(window);
        let registrar = if fixed && windows > 0 {
            match ring.register_slots(windows as u32).map(|()| ring.registrar()) {
                Ok(Ok(registrar)) => Some(registrar),
                Ok(Err(err)) => {
                    fallbacks.push(super::no_registrar(&err));
                    None
                }
                Err(err) => {
                    fallbacks.push(super::no_sparse_table(&err));
                    None
                }
            }
        } else {
            None
        };
        // A save has no caller's token: the gate is cancelled when the writes end.
        let gate = Gate::new(CancelToken::new(), windows);
        let range_of = |w: usize| w * window..((w + 1) * window).min(self.src.len());
        let result = std::thread::scope(|scope| {
            let mut inline = None;
            if let Some(registrar) = &registrar {
                let (gate, range_of) = (&gate, &range_of);
                let helper = move || RegisterAhead::new(gate, registrar, windows, range_of).register_rest();
                let spawned =
                    std::thread::Builder::new().name("dmaload-register".into()).spawn_scoped(scope, helper);
                // Without a helper thread, the writing thread registers each
                // window as it comes near it: pinning between the writes.
                if let Err(err) = spawned {
                    fallbacks.push(Fallback::new(
                        "register beside the writes",
                        "register between the writes",
                        format!("cannot create a thread: {err}"),
                    ));
                    inline = Some(RegisterAhead::new(gate, registrar, windows, range_of));
                }
            }
            let result = self.uring_loop(&mut ring, window, &gate, inline.as_mut(), Placement::default());
            gate.cancel();
            result
        });
        match result {
            // io_uring cancels requests that its io-wq cannot create a worker
            // thread for (RLIMIT_NPROC, cgroup pids.max): write them with pwrite.
            Err(err) if err.raw_os_error() == Some(libc::ECANCELED) => {
                drop(ring);
                let mut run = self.pool(self.threads, Engine::PreadPool)?;
                fallbacks.push(workers_refused(fixed, &err));
                fallbacks.append(&mut run.fallbacks);
                return Ok(WriteRun { engine: Engine::PreadPool, fallbacks });
            }
            other => other?,
        }
        if let Some(reason) = gate.registration_refused() {
            fallbacks.push(Fallback::new("uring-fixed", "uring", reason));
        }
        let engine = if fixed && fallbacks.is_empty() { Engine::UringFixed } else { Engine::Uring };
        Ok(WriteRun { engine, fallbacks })
    }

    /// The submitting side of [`Self::uring`]: tells `gate` which window it
    /// has reached (registering the due ones itself when given `inline`),
    /// and writes through a window's registered buffer once it holds one,
    /// plain before.
    fn uring_loop(
        &self,
        ring: &mut Ring<RawBytes<'_>>,
        window: usize,
        gate: &Gate,
        mut inline: Option<&mut RegisterAhead<'_, RawBytes<'_>>>,
        placement: Placement,
    ) -> Result<()> {
        let windows = self.src.len().div_ceil(window);
        let mut unfinished: Vec<usize> =
            (0..windows).map(|w| (self.src.len() - w * window).min(window)).collect();
        let mut retries: Vec<usize> = Vec::new();
        let mut next = 0usize;
        let mut reached = None;
        let mut completions: Vec<Completion> = Vec::with_capacity(self.queue_depth);
        let queue = |ring: &mut Ring<RawBytes<'_>>, start: usize| -> Result<()> {
            let w = start / window;
            let slot = placement.slot.or_else(|| gate.is_registered(w).then_some(w as u16));
            let range = self.request(start);
            ring.queue_write(
                self.file.as_fd(),
                placement.base + range.start..placement.base + range.end,
                self.file_offset + start as u64,
                slot,
                start as u64,
            )
            .map_err(|e| self.error(start, e))
        };
        loop {
            for start in std::mem::take(&mut retries) {
                queue(ring, start)?;
            }
            while ring.in_flight() < self.queue_depth && next < self.src.len() {
                let w = next / window;
                if reached != Some(w) {
                    reached = Some(w);
                    gate.reach(w);
                    if let Some(ahead) = inline.as_deref_mut() {
                        ahead.register_due(windows);
                    }
                }
                queue(ring, next)?;
                next = self.request(next).end;
            }
            if ring.in_flight() == 0 {
                return Ok(());
            }
            ring.submit(1).map_err(|e| Error::io("io_uring_enter", self.path, e))?;
            completions.clear();
            ring.reap(&mut completions);
            for done in &completions {
                let range = self.request(done.tag as usize);
                if done.result < 0 {
                    return Err(self.error(range.start, io::Error::from_raw_os_error(-done.result)));
                }
                let wrote = done.result as usize;
                if wrote == 0 && !range.is_empty() {
                    return Err(self.error(range.start, io::Error::from(io::ErrorKind::WriteZero)));
                }
                if wrote < range.len() {
                    retries.push(range.start + wrote);
                }
                self.wrote(wrote.min(range.len()) as u64);
                let w = range.start / window;
                unfinished[w] -= wrote.min(range.len());
                if unfinished[w] == 0 && gate.retire(w) {
                    // Unpin early; a failure only keeps pages pinned until the ring closes.
                    let _ = ring.unregister(w as u32);
                }
            }
        }
    }
}

/// Why writes went to `pread-pool`: io_uring cancelled one (`err`).
fn workers_refused(fixed: bool, err: &Error) -> Fallback {
    Fallback::new(
        if fixed { "uring-fixed" } else { "uring" },
        "pread-pool",
        format!(
            "io_uring cancelled a write ({err}): its worker threads could not be created \
             (RLIMIT_NPROC or the cgroup's pids.max)"
        ),
    )
}

/// Where a job's source lies in its ring's source: at byte `base`, inside
/// registered buffer `slot` (if any) for its whole length. A job's own ring
/// has it at 0 and registers windows as it goes.
#[derive(Debug, Clone, Copy, Default)]
struct Placement {
    base: usize,
    slot: Option<u16>,
}

/// A write ring over a whole source (a block queue's ring of blocks) that
/// many jobs over parts of it reuse: registered once as buffer 0 (the
/// `uring-fixed` engine), so each job's writes skip pinning without paying
/// a registration of their own.
pub(crate) struct SharedWriteRing<'s> {
    ring: Ring<RawBytes<'s>>,
    src: RawBytes<'s>,
    registered: bool,
    /// Why the source is not registered, when `uring-fixed` was asked for.
    pub refused: Option<Fallback>,
    /// Set once io_uring cancelled a write: later jobs go to `pread-pool`.
    cancelled: Option<Fallback>,
}

impl<'s> SharedWriteRing<'s> {
    /// A ring of `queue_depth` entries over `src`; `register` asks for the
    /// fixed buffer (refused: plain writes, with the reason kept).
    pub fn new(src: RawBytes<'s>, queue_depth: usize, register: bool) -> io::Result<SharedWriteRing<'s>> {
        let mut ring = Ring::new((queue_depth as u32).next_power_of_two(), src)?;
        let mut refused = None;
        if register {
            let registered =
                ring.register_slots(1).and_then(|()| ring.registrar()?.register(0, 0..src.len()));
            if let Err(err) = registered {
                refused = Some(Fallback::new("uring-fixed", "uring", super::uring::register_refusal(&err)));
            }
        }
        Ok(SharedWriteRing { ring, src, registered: register && refused.is_none(), refused, cancelled: None })
    }

    /// Waits until no request is in flight: a failed job may leave some,
    /// and none may read the source once the job has returned.
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

impl WriteJob<'_> {
    /// Writes on `shared`, whose source holds this job's source at byte
    /// `base` (checked: a job outside it panics, as slicing does).
    pub fn run_on(&self, shared: &mut SharedWriteRing<'_>, base: usize) -> Result<WriteRun> {
        let _ = shared.src.range(base..base + self.src.len());
        if let Some(cancelled) = &shared.cancelled {
            let mut run = self.pool(self.threads, Engine::PreadPool)?;
            run.fallbacks.insert(0, cancelled.clone());
            return Ok(run);
        }
        let placement = Placement { base, slot: shared.registered.then_some(0) };
        // The whole job is one window, in the placement's slot: no slots of its own.
        let gate = Gate::new(CancelToken::new(), 0);
        match self.uring_loop(&mut shared.ring, self.src.len().max(1), &gate, None, placement) {
            // As in `uring`: the workers could not be created, write with pwrite.
            Err(err) if err.raw_os_error() == Some(libc::ECANCELED) => {
                shared.wait_idle().map_err(|e| Error::io("io_uring_enter", self.path, e))?;
                let fixed = shared.registered || shared.refused.is_some();
                shared.cancelled = Some(workers_refused(fixed, &err));
                return self.run_on(shared, base);
            }
            other => other?,
        }
        let engine = if shared.registered { Engine::UringFixed } else { Engine::Uring };
        Ok(WriteRun { engine, fallbacks: shared.refused.iter().cloned().collect() })
    }
}
