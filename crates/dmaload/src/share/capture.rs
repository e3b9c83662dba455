//! The consumer end of a [`BlockQueue`] as a destination: every run of
//! filled blocks is written straight from the shared ring to a file by the
//! save path's write loop (io_uring, O_DIRECT where the filesystem allows),
//! then given back. No copy through this process. Up to four runs are
//! written at once, by writer threads whose rings each register the whole
//! block ring once, so no write pins pages of its own. Where the process
//! may not create that many threads (RLIMIT_NPROC, the cgroup's pids.max)
//! fewer runs are in flight, with a fallback; with none, it is an error.
//! Writes io_uring cancels for want of worker threads are written with
//! `pwrite` instead, as a save's are.
//!
//! The file gets `save`'s crash safety: the bytes go to a temporary file in
//! the target's directory (unnamed `O_TMPFILE` where possible), which is
//! fsynced and renamed over the target only at the end. A replaced file's
//! owner, group and permission bits are kept as a save keeps them. A consumer killed
//! mid-stream leaves no file (and a previous one untouched), never a torn
//! one. A stream that breaks (the producer dies, or its control page turns
//! out corrupt) still commits every block written so far (each was given
//! back only once written) and the report says why it is short; one that
//! breaks before any byte arrived is an error and commits nothing. A full
//! filesystem (ENOSPC, or EDQUOT) ends the capture the same way: device
//! data cannot be read again, so the runs written whole before the one
//! that found the disk full are committed, and the report says why the
//! file is short. Any other failed write fails the capture: nothing is
//! committed. So does a run that would grow the file past RLIMIT_FSIZE,
//! checked before it is written (and `expected_bytes` before anything is):
//! an error, not the SIGXFSZ that would kill the process.
//!
//! Runs are written whole with O_DIRECT while the file offset stays
//! aligned; a short block (the stream's last, or one a FIFO ended early)
//! leaves an unaligned tail, which is written through the page cache as
//! `save` writes its tail, and so is everything after it.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{BlockQueue, Filled, HeldRun, Role};
use crate::cancel::CancelToken;
use crate::engine::{EngineParams, EngineRun, Progress};
use crate::error::{Error, ErrorKind, Result};
use crate::load::{DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH};
use crate::pipeline::{write_at, KeptWriteRing};
use crate::save::{check_sticky, choose_direct, keep_owner_and_mode, parent_dir, resolve};
use crate::sys::shm::RawBytes;
use crate::tmpfile::{remove_stale_tmpfiles, TmpFile};
use crate::types::{CachePolicy, Engine, Fallback, IoMode};
use crate::{sys, system};

/// Bytes per write request (or one block, if larger): the largest request
/// common disks take whole (`max_sectors_kb` 4096), as fio's `bs=4M`.
const WRITE_CHUNK: usize = 4 << 20;

/// Runs written at once, each by a writer thread with its own io_uring
/// (over the whole ring, registered once).
const RUNS_IN_FLIGHT: usize = 4;

/// Options of [`capture_to_file`].
#[derive(Debug, Clone)]
pub struct CaptureOptions {
    /// The write engine (`uring-fixed`: registered buffers, by default).
    pub engine: Engine,
    /// `auto`: O_DIRECT where possible; `direct`: or an error; `buffered`.
    pub mode: IoMode,
    /// fsync the file before the rename and the directory after it.
    pub sync: bool,
    /// Writes in flight.
    pub queue_depth: usize,
    /// The expected size, reserved with `fallocate` first when known.
    pub expected_bytes: Option<u64>,
    /// Blocks written as one run (fewer at the ring's end and the
    /// stream's): a quarter of the ring by default, so runs are written
    /// (at most four at once) while the producer refills the other
    /// quarters.
    pub run_blocks: Option<usize>,
    /// How long to wait for the producer (`None`: as long as it lives).
    pub timeout: Option<Duration>,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            engine: Engine::default(),
            mode: IoMode::Auto,
            sync: true,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            expected_bytes: None,
            run_blocks: None,
            timeout: None,
        }
    }
}

/// What a capture wrote.
#[derive(Debug, Clone, Serialize)]
pub struct CaptureReport {
    #[serde(serialize_with = "crate::error::serialize_path")]
    pub target: PathBuf,
    pub filesystem: &'static str,
    pub bytes: u64,
    pub blocks: u64,
    /// Runs of blocks written with one engine call each.
    pub runs: u64,
    pub engine: Engine,
    /// `bypass` is O_DIRECT.
    pub cache: CachePolicy,
    pub alignment: usize,
    pub direct_bytes: u64,
    pub fallbacks: Vec<Fallback>,
    pub removed_tmpfiles: Vec<String>,
    /// Whether the producer marked the end of the stream; when not, the
    /// file holds what arrived and `stream_error` says why it stopped.
    pub complete: bool,
    pub stream_error: Option<String>,
    /// First block dequeued to the file committed.
    pub seconds: f64,
    /// fsync, rename, directory fsync.
    pub sync_seconds: f64,
}

/// Writes every block the producer of `queue` enqueues to `path`, in order,
/// until the end of the stream; `observe` sees each run before it is
/// written (to check or count blocks). See the module doc for what lands
/// where when the stream or the writes fail.
pub fn capture_to_file(
    queue: &mut BlockQueue,
    path: &Path,
    options: &CaptureOptions,
    mut observe: impl FnMut(&Filled<'_>),
) -> Result<CaptureReport> {
    if queue.role() != Role::Consumer {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "capture to",
            path,
            "the queue's producer end cannot capture",
        ));
    }
    let (target, existing) = resolve(path)?;
    if let Some(meta) = &existing {
        if !meta.file_type().is_file() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "capture to",
                &target,
                format!(
                    "a {} is not a capture file: capture writes regular files",
                    crate::source::type_name(meta)
                ),
            ));
        }
        check_sticky(&target, meta)?;
    }
    // Writing past RLIMIT_FSIZE would kill the process with SIGXFSZ.
    let past_limit = |len| {
        sys::process::past_file_size_limit(len)
            .map(|why| Error::new(ErrorKind::InvalidInput, "capture to", &target, why))
    };
    if let Some(err) = options.expected_bytes.and_then(past_limit) {
        return Err(err);
    }
    let dir = parent_dir(&target).to_owned();
    let name = target.file_name().unwrap_or(std::ffi::OsStr::new("capture")).to_owned();
    let removed_tmpfiles = remove_stale_tmpfiles(&dir);
    let mode = existing.as_ref().map_or(0o666, |m| m.mode() & 0o7777);
    let tmp = TmpFile::create(&dir, &name, mode)?;
    let mut fallbacks = Vec::new();
    if let Some(meta) = &existing {
        keep_owner_and_mode(tmp.file(), &target, meta, mode, &mut fallbacks)?;
    }
    let file = tmp.file();
    let magic = sys::file::filesystem_magic(file.as_fd()).map_err(|e| Error::io("fstatfs", &target, e))?;
    if let Some(len) = options.expected_bytes.filter(|&l| l > 0) {
        match sys::mem::allocate(file.as_fd(), 0, len) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
            Err(e) => return Err(Error::io("allocate space for", &target, e)),
        }
    }

    let started = Instant::now();
    let mut writer = RunWriter {
        target: &target,
        file,
        magic,
        options,
        block_size: queue.block_size(),
        direct: None,
        decided: false,
        offset: 0,
        direct_bytes: 0,
        engine: options.engine,
        fallbacks,
    };
    let (mut blocks, mut runs, mut stream_error) = (0u64, 0u64, None);
    // Where the filesystem filled up: the run that started there and every
    // later one are not kept.
    let mut full: Option<(u64, Error)> = None;
    let run_blocks = options.run_blocks.unwrap_or(queue.blocks() / 4).clamp(1, queue.blocks());
    // Dequeuing while `in_flight - 1` runs are held leaves at least one
    // run's worth of blocks to the producer, so the wait always ends.
    let in_flight = (queue.blocks() / run_blocks).clamp(1, RUNS_IN_FLIGHT);
    let ring = queue.ring();
    let whole = ring.raw_bytes(0..queue.block_size() * queue.blocks());
    let written: Result<()> = std::thread::scope(|scope| {
        // One writer thread per run in flight, each with a ring over the
        // whole block ring (registered once), fed runs in turn.
        // Threads the process may not create (RLIMIT_NPROC, the cgroup's
        // pids.max) leave fewer runs in flight, with a fallback.
        let mut writers = Vec::with_capacity(in_flight);
        let mut refused = None;
        for _ in 0..in_flight {
            let (jobs, job_queue) = mpsc::channel::<RunWrite>();
            let (done, results) = mpsc::channel::<Result<EngineRun>>();
            let (engine, depth) = (options.engine, options.queue_depth);
            let (params, target, file, chunk) = (writer.params(), writer.target, writer.file, writer.chunk());
            let write_runs = move || {
                let mut kept = match engine {
                    // Without io_uring here, each run falls back on its own.
                    Engine::UringFixed | Engine::Uring => {
                        KeptWriteRing::new(whole, depth, engine == Engine::UringFixed).ok()
                    }
                    Engine::PreadPool | Engine::Read => None,
                };
                for run in job_queue {
                    let RunWrite { base, len, offset, align } = run;
                    let result = match kept.as_mut() {
                        Some(ring) => ring.write(target, file, base, len, offset, align, chunk, &params),
                        None => {
                            let bytes = whole.range(base..base + len);
                            let progress = Progress::new(len as u64, None);
                            write_at(target, file, bytes, offset, align, chunk, &params, &progress)
                        }
                    };
                    // A failed ring may still hold requests: stop using it
                    // (dropping it waits for them).
                    let failed = result.is_err();
                    if done.send(result).is_err() || failed {
                        break;
                    }
                }
            };
            match std::thread::Builder::new().name("dmaload-capture".into()).spawn_scoped(scope, write_runs) {
                Ok(thread) => writers.push((jobs, results, thread)),
                Err(err) => {
                    refused = Some(err);
                    break;
                }
            }
        }
        if let Some(err) = refused {
            let why =
                format!("cannot create a writing thread: {err} (RLIMIT_NPROC or the cgroup's pids.max)");
            if writers.is_empty() {
                return Err(Error::new(ErrorKind::Io, "capture to", &target, why));
            }
            let fewer = writers.len().to_string();
            writer.fallbacks.push(Fallback::new(&format!("{in_flight} writing threads"), &fewer, why));
        }
        let in_flight = writers.len();
        // Runs being written: each with its writer thread and file offset.
        let mut pending: VecDeque<(HeldRun, usize, u64)> = VecDeque::new();
        let mut turn = 0;
        let mut open = true;
        let outcome = loop {
            if open && pending.len() < in_flight {
                let next = match queue.dequeue_run(run_blocks, run_blocks, options.timeout) {
                    Ok(Some(run)) => {
                        observe(&run);
                        Some(run.hold())
                    }
                    Ok(None) => None,
                    // The writer is sound: keep what was written, say why it stops.
                    Err(e) => {
                        stream_error = Some(e.to_string());
                        None
                    }
                };
                let Some(held) = next else {
                    open = false;
                    continue;
                };
                let range = held.byte_range();
                let bytes = ring.raw_bytes(range.clone());
                if let Err(e) = writer.decide(bytes) {
                    break Err(e);
                }
                let offset = writer.offset;
                writer.offset += bytes.len() as u64;
                if let Some(err) = past_limit(writer.offset) {
                    break Err(err.at(offset));
                }
                if writer.leaves_direct(bytes, offset) {
                    // O_DIRECT is the file's flag: switch with nothing in flight.
                    let mut drained = Ok(());
                    while let Some((earlier, w, start)) = pending.pop_front() {
                        if drained.is_ok() {
                            drained = writer.finish(writers[w].1.recv().ok()).map_err(|e| (start, e));
                        }
                        if drained.is_ok() {
                            blocks += earlier.blocks() as u64;
                            runs += 1;
                            let _ = queue.release_held(earlier);
                        }
                    }
                    let written = drained
                        .and_then(|()| writer.write_leaving_direct(bytes, offset).map_err(|e| (offset, e)));
                    if let Err((start, e)) = written {
                        if fills_the_disk(&e) {
                            full = Some((start, e));
                            break Ok(());
                        }
                        break Err(e);
                    }
                    blocks += held.blocks() as u64;
                    runs += 1;
                    if let Err(e) = queue.release_held(held) {
                        break Err(Error::io("give back blocks of", &target, e));
                    }
                } else {
                    let run = RunWrite {
                        base: range.start,
                        len: bytes.len(),
                        offset,
                        align: writer.direct.unwrap_or(1),
                    };
                    if writer.direct.is_some() {
                        // Counted when queued: a failed write fails the capture.
                        writer.direct_bytes += bytes.len() as u64;
                    }
                    if writers[turn].0.send(run).is_err() {
                        break Err(Error::new(ErrorKind::Io, "write", &target, "a writing thread stopped"));
                    }
                    pending.push_back((held, turn, offset));
                    turn = (turn + 1) % in_flight;
                }
                continue;
            }
            let Some((held, w, start)) = pending.pop_front() else { break Ok(()) };
            match writer.finish(writers[w].1.recv().ok()) {
                Ok(()) => {}
                Err(e) if fills_the_disk(&e) => {
                    full = Some((start, e));
                    break Ok(());
                }
                Err(e) => break Err(e),
            }
            blocks += held.blocks() as u64;
            runs += 1;
            if let Err(e) = queue.release_held(held) {
                break Err(Error::io("give back blocks of", &target, e));
            }
        };
        // Closing the job queues ends the threads; joined here, a panic in
        // one is an error, not a panic of the capture.
        let mut panicked = false;
        for (jobs, _, thread) in writers {
            drop(jobs);
            panicked |= thread.join().is_err();
        }
        match outcome {
            Ok(()) if panicked => {
                Err(Error::new(ErrorKind::Io, "write", &target, "a writing thread panicked"))
            }
            other => other,
        }
    });
    written?;
    let RunWriter { mut offset, direct, mut direct_bytes, engine, fallbacks, .. } = writer;
    if let Some((start, err)) = full {
        if start == 0 {
            // Nothing to keep: a previous file stays.
            return Err(err);
        }
        // Later runs may have landed past `start`: the truncation below
        // drops them with the partial one.
        offset = start;
        direct_bytes = direct_bytes.min(start);
        stream_error = Some(format!("the filesystem is full: {err}"));
    }
    if let (Some(why), 0) = (&stream_error, offset) {
        // An empty file would only replace a previous one: keep that instead.
        return Err(Error::new(
            ErrorKind::Io,
            "capture to",
            &target,
            format!("{why}; no block arrived, so nothing was written"),
        ));
    }
    // Sizes past a shorter last write, or a preallocation larger than what came.
    file.set_len(offset).map_err(|e| Error::io("ftruncate", &target, e))?;
    let syncing = Instant::now();
    if options.sync {
        file.sync_all().map_err(|e| Error::io("fsync", &target, e))?;
    }
    tmp.commit(&dir, &target)?;
    if options.sync {
        File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| Error::io("fsync directory", &dir, e))?;
    }
    Ok(CaptureReport {
        filesystem: system::filesystem_name(magic),
        bytes: offset,
        blocks,
        runs,
        engine,
        cache: if direct_bytes > 0 { CachePolicy::Bypass } else { CachePolicy::Keep },
        alignment: direct.unwrap_or(1),
        direct_bytes,
        fallbacks,
        removed_tmpfiles,
        complete: stream_error.is_none(),
        stream_error,
        sync_seconds: syncing.elapsed().as_secs_f64(),
        seconds: started.elapsed().as_secs_f64(),
        target,
    })
}

/// One run for a writer thread: `len` bytes at `base` of the block ring,
/// to file offset `offset`, in requests whole `align` blocks long.
struct RunWrite {
    base: usize,
    len: usize,
    offset: u64,
    align: usize,
}

/// Writes runs to the capture file through the pipeline's write direction
/// (the engines a save and a load use), each at the offset it was given
/// when dequeued.
struct RunWriter<'a> {
    target: &'a Path,
    file: &'a File,
    magic: i64,
    options: &'a CaptureOptions,
    block_size: usize,
    /// O_DIRECT with this alignment, while the offset stays aligned.
    direct: Option<usize>,
    decided: bool,
    /// Bytes handed to writes so far: where the next run goes.
    offset: u64,
    direct_bytes: u64,
    engine: Engine,
    fallbacks: Vec<Fallback>,
}

impl<'a> RunWriter<'a> {
    /// Picks O_DIRECT or buffered once, on the first run (the ring is
    /// page-aligned, so the first run decides for all).
    fn decide(&mut self, bytes: RawBytes<'_>) -> Result<()> {
        if !self.decided && !bytes.is_empty() {
            self.direct = choose_direct(
                self.target,
                self.file,
                bytes,
                Some(self.magic),
                self.options.mode,
                &mut self.fallbacks,
            )?;
            self.decided = true;
        }
        Ok(())
    }

    /// Whether `bytes` at `offset` cannot go whole with O_DIRECT while the
    /// file is in O_DIRECT mode (an unaligned offset or length).
    fn leaves_direct(&self, bytes: RawBytes<'_>, offset: u64) -> bool {
        self.direct.is_some_and(|align| offset % align as u64 != 0 || bytes.len() % align != 0)
    }

    /// The engine's parameters for every write of the capture.
    fn params(&self) -> EngineParams {
        EngineParams {
            engine: self.options.engine,
            queue_depth: self.options.queue_depth,
            threads: DEFAULT_POOL_THREADS,
            cancel: CancelToken::new(),
            tune: None,
            request_size: None,
            read_modes: None,
        }
    }

    /// Bytes per write request: [`WRITE_CHUNK`], or one block if larger.
    fn chunk(&self) -> usize {
        WRITE_CHUNK.max(self.block_size)
    }

    /// Writes `bytes` at `offset` on this thread, through the pipeline.
    fn write_here(&self, bytes: RawBytes<'_>, offset: u64) -> Result<EngineRun> {
        let progress = Progress::new(bytes.len() as u64, None);
        let align = self.direct.unwrap_or(1);
        write_at(self.target, self.file, bytes, offset, align, self.chunk(), &self.params(), &progress)
    }

    /// Takes a run's write result (`None`: its thread stopped) and keeps
    /// what its engine reported.
    fn finish(&mut self, result: Option<Result<EngineRun>>) -> Result<()> {
        let mut run = result.unwrap_or_else(|| {
            Err(Error::new(ErrorKind::Io, "write", self.target, "a writing thread stopped"))
        })?;
        self.engine = run.engine;
        for fallback in run.fallbacks.drain(..) {
            if !self.fallbacks.iter().any(|f| f.from == fallback.from && f.to == fallback.to) {
                self.fallbacks.push(fallback);
            }
        }
        Ok(())
    }

    /// Writes a run that ends the O_DIRECT part (nothing else in flight):
    /// its aligned part direct, the rest buffered, and buffered from then
    /// on, as `save` writes its tail.
    fn write_leaving_direct(&mut self, bytes: RawBytes<'_>, offset: u64) -> Result<()> {
        let Some(align) = self.direct else { return Ok(()) };
        let aligned = if offset % align as u64 == 0 { bytes.len() / align * align } else { 0 };
        if aligned > 0 {
            let run = self.write_here(bytes.range(0..aligned), offset)?;
            self.engine = run.engine;
            self.direct_bytes += aligned as u64;
        }
        self.direct = None;
        sys::file::set_direct(self.file.as_fd(), false).map_err(|e| Error::io("fcntl", self.target, e))?;
        let run = self.write_here(bytes.range(aligned..bytes.len()), offset + aligned as u64)?;
        self.engine = run.engine;
        Ok(())
    }
}

/// Whether a failed write found the filesystem full (or the user's quota
/// spent): the capture keeps what was written before it.
fn fills_the_disk(err: &Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// CPU seconds (user + system) this process has used so far
/// (`getrusage(RUSAGE_SELF)`): each end of a stream reports its own.
pub fn process_cpu_seconds() -> std::io::Result<f64> {
    let (user, system) = sys::process::cpu_time()?;
    Ok((user + system).as_secs_f64())
}
