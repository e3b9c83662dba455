//! Write engines: the save direction of the read engines. Each writes a
//! byte slice to a file at an offset in `chunk`-sized requests and checks
//! every result (short writes are resumed, zero-byte writes are errors).

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use super::Engine;
use crate::error::{Error, Result};
use crate::load::Fallback;
use crate::sys::shm::RawBytes;
use crate::sys::uring::{Completion, SliceRegistrar, WriteRing, MAX_REGISTERED_BUFFERS};

/// Bytes registered (pinned) as one io_uring buffer while writing: the
/// write direction of a gather.
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
                if let Err(err) =
                    self.src.range(range).write_all_at(self.file.as_fd(), self.file_offset + start as u64)
                {
                    stop.store(true, Ordering::Relaxed);
                    failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(self.error(start, err));
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
    /// ahead of the writes (pinning beside the I/O, not between it), and
    /// each window is unregistered when its last write lands, so only a few
    /// windows are pinned at a time.
    fn uring(&self, fixed: bool) -> Result<WriteRun> {
        let mut fallbacks = Vec::new();
        let entries = (self.queue_depth as u32).next_power_of_two();
        let mut ring = match WriteRing::new(entries, self.src) {
            Ok(ring) => ring,
            Err(err) if super::io_uring_unavailable(&err) => {
                let mut run = self.pool(self.threads, Engine::PreadPool)?;
                run.fallbacks.push(Fallback::new(
                    if fixed { "uring-fixed" } else { "uring" },
                    "pread-pool",
                    format!("io_uring is unavailable ({err})"),
                ));
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
            match ring.register_slots(windows as u32).and_then(|()| ring.registrar()) {
                Ok(registrar) => Some(registrar),
                Err(err) => {
                    fallbacks.push(super::no_sparse_table(&err));
                    None
                }
            }
        } else {
            None
        };
        let ahead = Ahead::new(windows);
        let result = std::thread::scope(|scope| {
            let mut inline = None;
            if let Some(registrar) = &registrar {
                let ahead = &ahead;
                let helper = move || {
                    for w in 0..windows {
                        if !ahead.wait_turn(w) {
                            break;
                        }
                        if !ahead.register(registrar, w, window, self.src.len()) {
                            break;
                        }
                    }
                };
                let spawned =
                    std::thread::Builder::new().name("dmaload-register".into()).spawn_scoped(scope, helper);
                // Without a helper thread, each window is registered by the
                // writing thread when it reaches it: pinning between the writes.
                if let Err(err) = spawned {
                    fallbacks.push(Fallback::new(
                        "register beside the writes",
                        "register between the writes",
                        format!("cannot create a thread: {err}"),
                    ));
                    inline = Some(registrar);
                }
            }
            let result = self.uring_loop(&mut ring, window, &ahead, inline, Placement::default());
            ahead.finish();
            result
        });
        match result {
            // io_uring cancels requests that its io-wq cannot create a worker
            // thread for (RLIMIT_NPROC, cgroup pids.max): write them with pwrite.
            Err(err) if err.raw_os_error() == Some(libc::ECANCELED) => {
                drop(ring);
                let mut run = self.pool(self.threads, Engine::PreadPool)?;
                fallbacks.push(Fallback::new(
                    if fixed { "uring-fixed" } else { "uring" },
                    "pread-pool",
                    format!(
                        "io_uring cancelled a write ({err}): its worker threads could not be created \
                         (RLIMIT_NPROC or the cgroup's pids.max)"
                    ),
                ));
                fallbacks.append(&mut run.fallbacks);
                return Ok(WriteRun { engine: Engine::PreadPool, fallbacks });
            }
            other => other?,
        }
        if let Some(reason) = ahead.refused.into_inner().unwrap_or_else(|p| p.into_inner()) {
            fallbacks.push(Fallback::new("uring-fixed", "uring", reason));
        }
        let engine = if fixed && fallbacks.is_empty() { Engine::UringFixed } else { Engine::Uring };
        Ok(WriteRun { engine, fallbacks })
    }

    /// The submitting side of [`Self::uring`]: writes through a window's
    /// registered buffer once the helper has registered it, plain before.
    fn uring_loop(
        &self,
        ring: &mut WriteRing<'_>,
        window: usize,
        ahead: &Ahead,
        mut inline: Option<&SliceRegistrar<'_>>,
        placement: Placement,
    ) -> Result<()> {
        let windows = ahead.registered.len();
        let mut unfinished: Vec<usize> =
            (0..windows).map(|w| (self.src.len() - w * window).min(window)).collect();
        let mut retries: Vec<usize> = Vec::new();
        let mut next = 0usize;
        let mut completions: Vec<Completion> = Vec::with_capacity(self.queue_depth);
        let queue = |ring: &mut WriteRing<'_>, start: usize| -> Result<()> {
            let w = start / window;
            let slot =
                placement.slot.or_else(|| ahead.registered[w].load(Ordering::Acquire).then_some(w as u16));
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
                ahead.advance(next / window);
                if let Some(registrar) = inline.filter(|_| next % window == 0) {
                    if !ahead.register(registrar, next / window, window, self.src.len()) {
                        inline = None;
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
                let w = range.start / window;
                unfinished[w] -= wrote.min(range.len());
                if unfinished[w] == 0 && ahead.registered[w].swap(false, Ordering::AcqRel) {
                    // Unpin early; a failure only keeps pages pinned until the ring closes.
                    let _ = ring.unregister(w as u32);
                }
            }
        }
    }
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
    ring: WriteRing<'s>,
    src: RawBytes<'s>,
    registered: bool,
    /// Why the source is not registered, when `uring-fixed` was asked for.
    pub refused: Option<Fallback>,
}

impl<'s> SharedWriteRing<'s> {
    /// A ring of `queue_depth` entries over `src`; `register` asks for the
    /// fixed buffer (refused: plain writes, with the reason kept).
    pub fn new(src: RawBytes<'s>, queue_depth: usize, register: bool) -> io::Result<SharedWriteRing<'s>> {
        let mut ring = WriteRing::new((queue_depth as u32).next_power_of_two(), src)?;
        let mut refused = None;
        if register {
            let registered =
                ring.register_slots(1).and_then(|()| ring.registrar()?.register(0, 0..src.len()));
            if let Err(err) = registered {
                refused = Some(Fallback::new("uring-fixed", "uring", super::uring::register_refusal(&err)));
            }
        }
        Ok(SharedWriteRing { ring, src, registered: register && refused.is_none(), refused })
    }
}

impl WriteJob<'_> {
    /// Writes on `shared`, whose source holds this job's source at byte
    /// `base` (checked: a job outside it panics, as slicing does).
    pub fn run_on(&self, shared: &mut SharedWriteRing<'_>, base: usize) -> Result<WriteRun> {
        let _ = shared.src.range(base..base + self.src.len());
        let placement = Placement { base, slot: shared.registered.then_some(0) };
        self.uring_loop(&mut shared.ring, self.src.len().max(1), &Ahead::new(1), None, placement)?;
        let engine = if shared.registered { Engine::UringFixed } else { Engine::Uring };
        Ok(WriteRun { engine, fallbacks: shared.refused.iter().cloned().collect() })
    }
}

/// Windows registered at most this far ahead of the one being written, so
/// pinned memory (RLIMIT_MEMLOCK) stays at a few windows.
const REGISTER_AHEAD: usize = 2;

/// Coordination between the writing thread and the registering helper.
struct Ahead {
    /// Window `w` is registered in slot `w`.
    registered: Vec<AtomicBool>,
    /// (window being written, writing finished)
    state: Mutex<(usize, bool)>,
    changed: Condvar,
    refused: Mutex<Option<String>>,
}

impl Ahead {
    fn new(windows: usize) -> Ahead {
        Ahead {
            registered: (0..windows).map(|_| AtomicBool::new(false)).collect(),
            state: Mutex::new((0, false)),
            changed: Condvar::new(),
            refused: Mutex::new(None),
        }
    }

    /// The writer reached window `w`.
    fn advance(&self, w: usize) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.0 != w {
            state.0 = w;
            self.changed.notify_all();
        }
    }

    /// Registers window `w` of a `len`-byte source; false (and the reason
    /// kept) when the kernel refuses, after which no more are registered.
    fn register(&self, registrar: &SliceRegistrar<'_>, w: usize, window: usize, len: usize) -> bool {
        match registrar.register(w as u32, w * window..((w + 1) * window).min(len)) {
            Ok(()) => {
                self.registered[w].store(true, Ordering::Release);
                true
            }
            Err(err) => {
                *self.refused.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(super::uring::register_refusal(&err));
                false
            }
        }
    }

    fn finish(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.changed.notify_all();
    }

    /// Waits until window `w` is due for registration; false when it no
    /// longer should be (writing finished, or already past it).
    fn wait_turn(&self, w: usize) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while !state.1 && w > state.0 + REGISTER_AHEAD {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        !state.1 && w >= state.0
    }
}
