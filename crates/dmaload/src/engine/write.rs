//! Write engines: the save direction of the read engines. Each writes a
//! byte slice to a file at an offset in `chunk`-sized requests and checks
//! every result (short writes are resumed, zero-byte writes are errors).

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::Engine;
use crate::error::{Error, Result};
use crate::load::Fallback;
use crate::sys::uring::{Completion, WriteRing};

/// Bytes registered (pinned) as one io_uring buffer while writing: the
/// write direction of a gather.
const WINDOW: usize = 128 << 20;
/// Most registered buffers a ring holds.
const MAX_SLOTS: usize = 16384;

/// One write of `src` to `file` at `file_offset`.
pub(crate) struct WriteJob<'a> {
    pub path: &'a Path,
    pub file: &'a File,
    pub src: &'a [u8],
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
    /// chunk.
    fn pool(&self, threads: usize, engine: Engine) -> Result<WriteRun> {
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let chunks = self.src.len().div_ceil(self.chunk);
        std::thread::scope(|scope| {
            for _ in 0..threads.clamp(1, chunks.max(1)) {
                scope.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= chunks {
                            break;
                        }
                        let range = self.request(i * self.chunk);
                        let start = range.start;
                        if let Err(err) =
                            self.file.write_all_at(&self.src[range], self.file_offset + start as u64)
                        {
                            stop.store(true, Ordering::Relaxed);
                            failure
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert(self.error(start, err));
                        }
                    }
                });
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(err) => Err(err),
            None => Ok(WriteRun { engine, fallbacks: Vec::new() }),
        }
    }

    /// `queue_depth` writes in flight on one io_uring; with `fixed`, each
    /// 128 MiB window of the source is registered when its first chunk is
    /// queued and unregistered when its last one lands.
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
        while self.src.len().div_ceil(window) > MAX_SLOTS {
            window *= 2;
        }
        let windows = self.src.len().div_ceil(window);
        let mut registering = fixed;
        if fixed {
            if let Err(err) = ring.register_slots(windows.max(1) as u32) {
                fallbacks.push(Fallback::new(
                    "uring-fixed",
                    "uring",
                    format!("cannot create a sparse registered-buffer table (Linux 5.19+): {err}"),
                ));
                registering = false;
            }
        }
        // Per window: bytes not yet written, and whether it is registered.
        let mut unfinished: Vec<usize> =
            (0..windows).map(|w| (self.src.len() - w * window).min(window)).collect();
        let mut registered = vec![false; windows];
        let mut retries: Vec<usize> = Vec::new();
        let mut next = 0usize;
        let mut completions: Vec<Completion> = Vec::with_capacity(self.queue_depth);
        loop {
            let mut queue = |ring: &mut WriteRing<'_>, start: usize| -> Result<()> {
                let w = start / window;
                if registering && !registered[w] {
                    let range = w * window..((w + 1) * window).min(self.src.len());
                    match ring.register(w as u32, range) {
                        Ok(()) => registered[w] = true,
                        Err(err) => {
                            fallbacks.push(Fallback::new(
                                "uring-fixed",
                                "uring",
                                super::uring::register_refusal(&err),
                            ));
                            registering = false;
                        }
                    }
                }
                let slot = registered[w].then_some(w as u16);
                let range = self.request(start);
                ring.queue_write(
                    self.file.as_fd(),
                    range,
                    self.file_offset + start as u64,
                    slot,
                    start as u64,
                )
                .map_err(|e| self.error(start, e))
            };
            for start in std::mem::take(&mut retries) {
                queue(&mut ring, start)?;
            }
            while ring.in_flight() < self.queue_depth && next < self.src.len() {
                queue(&mut ring, next)?;
                next = self.request(next).end;
            }
            if ring.in_flight() == 0 {
                break;
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
                if unfinished[w] == 0 && registered[w] {
                    // Unpin early; a failure only keeps pages pinned until the ring closes.
                    let _ = ring.unregister(w as u32);
                    registered[w] = false;
                }
            }
        }
        let engine = if fixed && fallbacks.is_empty() { Engine::UringFixed } else { Engine::Uring };
        Ok(WriteRun { engine, fallbacks })
    }
}
