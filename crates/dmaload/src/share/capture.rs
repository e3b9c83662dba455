//! The consumer end of a [`BlockQueue`] as a destination: every run of
//! filled blocks is written straight from the shared ring to a file by the
//! save path's write engine (io_uring, registered buffers, O_DIRECT where
//! the filesystem allows), then given back. No copy through this process.
//!
//! The file gets `save`'s crash safety: the bytes go to a temporary file in
//! the target's directory (unnamed `O_TMPFILE` where possible), which is
//! fsynced and renamed over the target only at the end. A consumer killed
//! mid-stream leaves no file (and a previous one untouched), never a torn
//! one. A stream that breaks (the producer dies, or its control page turns
//! out corrupt) still commits every block written so far (each was given
//! back only once written) and the report says why it is short.
//!
//! Runs are written whole with O_DIRECT while the file offset stays
//! aligned; a short block (the stream's last, or one a FIFO ended early)
//! leaves an unaligned tail, which is written through the page cache as
//! `save` writes its tail, and so is everything after it.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{BlockQueue, Filled, Role};
use crate::engine::write::WriteJob;
use crate::engine::{CachePolicy, Engine};
use crate::error::{Error, ErrorKind, Result};
use crate::load::{Fallback, IoMode, DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH};
use crate::save::{check_sticky, choose_direct, parent_dir, remove_stale_tmpfiles, resolve, TmpFile};
use crate::{sys, system};

/// Bytes per write request (or one block, if larger): enough requests in
/// flight to keep the disk busy from a ring of a few dozen MiB.
const WRITE_CHUNK: usize = 1 << 20;

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
    /// Blocks gathered before a run is written (fewer at the ring's end
    /// and the stream's): half the ring by default, so one half is written
    /// while the producer fills the other.
    pub min_run_blocks: Option<usize>,
    /// Most blocks written as one run.
    pub max_run_blocks: usize,
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
            min_run_blocks: None,
            max_run_blocks: usize::MAX,
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
    let dir = parent_dir(&target).to_owned();
    let name = target.file_name().unwrap_or(std::ffi::OsStr::new("capture")).to_owned();
    let removed_tmpfiles = remove_stale_tmpfiles(&dir);
    let mode = existing.as_ref().map_or(0o666, |m| m.mode() & 0o7777);
    let tmp = TmpFile::create(&dir, &name, mode)?;
    let file = &tmp.file;
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
        fallbacks: Vec::new(),
    };
    let (mut blocks, mut runs, mut stream_error) = (0u64, 0u64, None);
    let min_run = options.min_run_blocks.unwrap_or(queue.blocks() / 2);
    loop {
        match queue.dequeue_run(min_run, options.max_run_blocks, options.timeout) {
            Ok(Some(run)) => {
                observe(&run);
                writer.write(&run)?;
                blocks += run.blocks() as u64;
                runs += 1;
                run.release().map_err(|e| Error::io("give back blocks of", &target, e))?;
            }
            Ok(None) => break,
            // The writer is sound: keep what was written, say why it stops.
            Err(e) => {
                stream_error = Some(e.to_string());
                break;
            }
        }
    }
    let RunWriter { offset, direct, direct_bytes, engine, fallbacks, .. } = writer;
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

/// Appends runs to the capture file through the save path's write engine.
struct RunWriter<'a> {
    target: &'a Path,
    file: &'a File,
    magic: i64,
    options: &'a CaptureOptions,
    block_size: usize,
    /// O_DIRECT with this alignment, while the offset stays aligned.
    direct: Option<usize>,
    decided: bool,
    offset: u64,
    direct_bytes: u64,
    engine: Engine,
    fallbacks: Vec<Fallback>,
}

impl RunWriter<'_> {
    fn write(&mut self, run: &Filled<'_>) -> Result<()> {
        let bytes = run.raw_bytes();
        if bytes.is_empty() {
            return Ok(());
        }
        if !self.decided {
            // The ring is page-aligned: its first run decides for all.
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
        let aligned = match self.direct {
            Some(align) if self.offset % align as u64 == 0 => bytes.len() / align * align,
            _ => 0,
        };
        let (target, file, options) = (self.target, self.file, self.options);
        let chunk = WRITE_CHUNK.max(self.block_size);
        let job = |src, file_offset| WriteJob {
            path: target,
            file,
            src,
            file_offset,
            chunk,
            queue_depth: options.queue_depth,
            threads: DEFAULT_POOL_THREADS,
        };
        if aligned > 0 {
            let run = job(bytes.range(0..aligned), self.offset).run(options.engine)?;
            self.note(run);
            self.direct_bytes += aligned as u64;
        }
        if aligned < bytes.len() {
            if self.direct.take().is_some() {
                // An unaligned tail: buffered from here on, as save writes its tail.
                sys::file::set_direct(self.file.as_fd(), false)
                    .map_err(|e| Error::io("fcntl", self.target, e))?;
            }
            let run =
                job(bytes.range(aligned..bytes.len()), self.offset + aligned as u64).run(options.engine)?;
            self.note(run);
        }
        self.offset += bytes.len() as u64;
        Ok(())
    }

    fn note(&mut self, mut run: crate::engine::write::WriteRun) {
        self.engine = run.engine;
        for fallback in run.fallbacks.drain(..) {
            if !self.fallbacks.iter().any(|f| f.from == fallback.from && f.to == fallback.to) {
                self.fallbacks.push(fallback);
            }
        }
    }
}

/// CPU seconds (user + system) this process has used so far
/// (`getrusage(RUSAGE_SELF)`): each end of a stream reports its own.
pub fn process_cpu_seconds() -> std::io::Result<f64> {
    let (user, system) = sys::process::cpu_time()?;
    Ok((user + system).as_secs_f64())
}
