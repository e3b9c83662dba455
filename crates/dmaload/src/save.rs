//! `save`: write a buffer to a file, as fast as `load` reads one, without
//! ever leaving a torn file under the target name.
//!
//! The bytes go to a temporary file in the target's directory (an unnamed
//! `O_TMPFILE` where the filesystem has it, so a killed process leaves
//! nothing behind): space is reserved with `fallocate` (a full filesystem
//! fails before anything is written), the aligned part is written with
//! O_DIRECT through io_uring registered buffers, the unaligned tail with a
//! buffered write, the final size is set, the file is fsynced, renamed over
//! the target and the directory fsynced. Until the rename the old file is
//! untouched; after it, the new one is complete.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use serde::Serialize;

use crate::engine::write::WriteJob;
use crate::engine::{CachePolicy, Engine};
use crate::error::{Error, ErrorKind, Result};
use crate::load::{Fallback, IoMode, DEFAULT_CHUNK_SIZE, DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH};
use crate::sys::file::{statx_dio_align, DioAlignQuery};
use crate::{sys, system};

/// Options of [`save`]; `SaveOptions::default()` is what a user gets
/// without flags.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// `uring-fixed` (default), `uring`, `pread-pool` (a pool of threads
    /// issuing `pwrite`) or `read` (one thread of sequential writes).
    pub engine: Engine,
    /// `auto`: O_DIRECT where the filesystem and the buffer's alignment
    /// allow, else buffered; `direct`: O_DIRECT or an error; `buffered`;
    /// `dontcache`: buffered, then the file's pages are dropped from the
    /// page cache after the sync.
    pub mode: IoMode,
    /// fsync the file before the rename and the directory after it. Off
    /// (`--no-sync`, for scratch data) a crash of the machine may lose the
    /// new file, but a killed process still never leaves a torn one.
    pub sync: bool,
    /// Bytes per write request.
    pub chunk_size: usize,
    /// Writes in flight (io_uring engines).
    pub queue_depth: usize,
    /// Threads (pread-pool engine).
    pub threads: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            engine: Engine::default(),
            mode: IoMode::default(),
            sync: true,
            chunk_size: DEFAULT_CHUNK_SIZE,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            threads: DEFAULT_POOL_THREADS,
        }
    }
}

/// What a save did and how long each part took.
#[derive(Debug, Clone, Serialize)]
pub struct SaveReport {
    pub path: PathBuf,
    pub bytes: u64,
    /// The engine that wrote the aligned part (after fallbacks).
    pub engine: Engine,
    /// `bypass` is O_DIRECT.
    pub cache: CachePolicy,
    pub filesystem: &'static str,
    /// Offset alignment of the direct writes (1 when buffered).
    pub alignment: usize,
    /// Bytes written with O_DIRECT (the rest is the buffered tail).
    pub direct_bytes: u64,
    pub fallbacks: Vec<Fallback>,
    /// Whether the temporary file was an unnamed `O_TMPFILE`.
    pub anonymous_tmpfile: bool,
    /// Whether a previous file was replaced.
    pub replaced: bool,
    /// Reserving space (`fallocate`).
    pub allocate_seconds: f64,
    /// Writing all bytes (aligned part and tail) and setting the size.
    pub write_seconds: f64,
    /// fsync of the file, rename, fsync of the directory.
    pub sync_seconds: f64,
    pub total_seconds: f64,
    pub gib_per_second: f64,
    pub cpu_user_seconds: f64,
    pub cpu_system_seconds: f64,
}

/// The temporary file of a save. Until [`TmpFile::commit`] a named one is
/// removed on drop; an unnamed one (O_TMPFILE) vanishes with its fd.
struct TmpFile {
    file: File,
    name: Option<PathBuf>,
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if let Some(name) = &self.name {
            // Best effort: failing to clean up must not hide the save's error.
            let _ = fs::remove_file(name);
        }
    }
}

/// A name in `dir` that no other save (or file) is using right now.
fn tmp_name(dir: &Path, target: &Path) -> PathBuf {
    let base = target.file_name().map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    dir.join(format!(".{base}.dmaload-{}-{nanos:09}.tmp", std::process::id()))
}

impl TmpFile {
    /// An unnamed O_TMPFILE in `dir` (Linux 3.11, most local filesystems),
    /// else a named file created exclusively.
    fn create(dir: &Path, target: &Path, mode: u32) -> Result<TmpFile> {
        match OpenOptions::new().read(true).write(true).mode(mode).custom_flags(libc::O_TMPFILE).open(dir) {
            Ok(file) => return Ok(TmpFile { file, name: None }),
            // EOPNOTSUPP/EISDIR/EINVAL: this filesystem or kernel has no O_TMPFILE.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)) => {}
            Err(e) => return Err(Error::io("create temporary file in", dir, e)),
        }
        let name = tmp_name(dir, target);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&name)
            .map_err(|e| Error::io("create", &name, e))?;
        Ok(TmpFile { file, name: Some(name) })
    }

    /// Puts the file in place of `target` atomically.
    fn commit(mut self, dir: &Path, target: &Path) -> Result<()> {
        let name = match self.name.take() {
            Some(name) => name,
            None => {
                // linkat cannot replace a file: name it first, then rename.
                let name = tmp_name(dir, target);
                sys::file::link_tmpfile(self.file.as_fd(), &name).map_err(|e| Error::io("link", &name, e))?;
                name
            }
        };
        if let Err(e) = fs::rename(&name, target) {
            let _ = fs::remove_file(&name);
            return Err(Error::io("rename", target, e));
        }
        Ok(())
    }
}

/// How the aligned part is written: O_DIRECT with this offset alignment,
/// or buffered (`None`).
fn choose_direct(
    path: &Path,
    file: &File,
    data: &[u8],
    magic: i64,
    mode: IoMode,
    fallbacks: &mut Vec<Fallback>,
) -> Result<Option<usize>> {
    // Nothing to write (an empty slice may not even have an aligned address).
    if data.is_empty() || matches!(mode, IoMode::Buffered | IoMode::DontCache) {
        return Ok(None);
    }
    let why = if system::is_memory_filesystem(magic) {
        format!("{} keeps file data in the page cache", system::filesystem_name(magic))
    } else {
        match statx_dio_align(file.as_fd()) {
            Ok(DioAlignQuery::Supported(a)) if data.as_ptr() as usize % a.memory.max(1) as usize != 0 => {
                format!(
                    "the buffer at {:p} is not aligned to the {} bytes O_DIRECT needs",
                    data.as_ptr(),
                    a.memory
                )
            }
            Ok(DioAlignQuery::Supported(a)) => match sys::file::set_direct(file.as_fd(), true) {
                Ok(()) => return Ok(Some(a.offset.max(1) as usize)),
                Err(e) => format!("fcntl(O_DIRECT) refused: {e}"),
            },
            Ok(DioAlignQuery::Unsupported) => {
                format!("{} does not support O_DIRECT on this file", system::filesystem_name(magic))
            }
            // Without STATX_DIOALIGN (Linux < 6.1) the memory alignment is
            // unknown: a page-aligned buffer and block-aligned offsets are safe.
            Ok(DioAlignQuery::Unknown) | Err(_) => {
                let page = sys::mem::page_size();
                if data.as_ptr() as usize % page == 0 && sys::file::set_direct(file.as_fd(), true).is_ok() {
                    return Ok(Some(page));
                }
                "no STATX_DIOALIGN and the buffer is not page-aligned (or O_DIRECT refused)".into()
            }
        }
    };
    if mode == IoMode::Direct {
        return Err(Error::new(ErrorKind::DirectIoUnavailable, "open O_DIRECT", path, why));
    }
    fallbacks.push(Fallback::new("direct", "buffered", why));
    Ok(None)
}

fn validate(path: &Path, o: &SaveOptions) -> Result<()> {
    let bad = |what: String| Err(Error::new(ErrorKind::InvalidInput, "save", path, what));
    if o.chunk_size == 0 || o.chunk_size > 1 << 30 {
        return bad(format!("chunk size {} must be between 1 byte and 1 GiB", o.chunk_size));
    }
    if o.queue_depth == 0 || o.queue_depth > 4096 {
        return bad(format!("queue depth {} must be between 1 and 4096", o.queue_depth));
    }
    if o.threads == 0 || o.threads > 1024 {
        return bad(format!("thread count {} must be between 1 and 1024", o.threads));
    }
    Ok(())
}

/// Writes `data` to `path`, replacing any file there atomically (see the
/// module doc). A failed save leaves the previous file as it was and no
/// temporary file behind; the error names the target path.
pub fn save(data: &[u8], path: impl AsRef<Path>, options: &SaveOptions) -> Result<SaveReport> {
    let path = path.as_ref();
    validate(path, options)?;
    let started = Instant::now();
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let previous = match fs::metadata(path) {
        Ok(meta) if meta.is_dir() => {
            return Err(Error::io("save", path, io::Error::from_raw_os_error(libc::EISDIR)))
        }
        Ok(meta) => Some(meta),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io("stat", path, e)),
    };
    // A replaced file keeps its permission bits; a new one gets 0666 & ~umask.
    let mode = previous.as_ref().map_or(0o666, |m| m.permissions().mode() & 0o7777);
    let tmp = TmpFile::create(&dir, path, mode)?;
    if previous.is_some() {
        // O_TMPFILE's mode passes through the umask: restore the old bits.
        tmp.file
            .set_permissions(fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io("fchmod", path, e))?;
    }
    let file = &tmp.file;
    let magic = sys::file::filesystem_magic(file.as_fd()).map_err(|e| Error::io("fstatfs", path, e))?;
    let mut fallbacks = Vec::new();
    let len = data.len() as u64;

    let allocating = Instant::now();
    if len > 0 {
        match sys::mem::allocate(file.as_fd(), 0, len) {
            Ok(()) => {}
            // Not every filesystem can preallocate; the writes still report ENOSPC.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
            Err(e) => return Err(Error::io("allocate space for", path, e)),
        }
    }
    let allocate_seconds = allocating.elapsed().as_secs_f64();

    let writing = Instant::now();
    let mut direct = choose_direct(path, file, data, magic, options.mode, &mut fallbacks)?;
    // Requests are whole multiples of the alignment, so each direct write is aligned.
    let write = |part: &[u8], align: usize| {
        WriteJob {
            path,
            file,
            src: part,
            file_offset: 0,
            chunk: options.chunk_size.div_ceil(align) * align,
            queue_depth: options.queue_depth,
            threads: options.threads,
        }
        .run(options.engine)
    };
    let aligned = direct.map_or(data.len(), |a| data.len() / a * a);
    let mut run = match write(&data[..aligned], direct.unwrap_or(1)) {
        // Some devices reject the alignment statx reported: retry buffered once.
        Err(err)
            if direct.is_some()
                && options.mode == IoMode::Auto
                && err.raw_os_error() == Some(libc::EINVAL) =>
        {
            sys::file::set_direct(file.as_fd(), false).map_err(|e| Error::io("fcntl", path, e))?;
            fallbacks.push(Fallback::new("direct", "buffered", format!("O_DIRECT write rejected: {err}")));
            direct = None;
            write(data, 1)?
        }
        other => other?,
    };
    let direct_bytes = if direct.is_some() { aligned as u64 } else { 0 };
    if direct.is_some() && aligned < data.len() {
        // The unaligned tail cannot go direct: write it through the page cache.
        sys::file::set_direct(file.as_fd(), false).map_err(|e| Error::io("fcntl", path, e))?;
        use std::os::unix::fs::FileExt;
        file.write_all_at(&data[aligned..], aligned as u64)
            .map_err(|e| Error::io("write", path, e).at(aligned as u64))?;
    }
    // fallocate past the end of a smaller write, or an old tmp name: the size is exact.
    file.set_len(len).map_err(|e| Error::io("ftruncate", path, e))?;
    let write_seconds = writing.elapsed().as_secs_f64();

    let syncing = Instant::now();
    if options.sync {
        file.sync_all().map_err(|e| Error::io("fsync", path, e))?;
    }
    if options.mode == IoMode::DontCache {
        // Advice only: failing leaves the pages cached, the data is written.
        let _ = sys::file::fadvise(file.as_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    let anonymous_tmpfile = tmp.name.is_none();
    tmp.commit(&dir, path)?;
    if options.sync {
        File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| Error::io("fsync directory", &dir, e))?;
    }
    let sync_seconds = syncing.elapsed().as_secs_f64();

    let cpu_after = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let total = started.elapsed().as_secs_f64();
    fallbacks.append(&mut run.fallbacks);
    Ok(SaveReport {
        path: path.to_owned(),
        bytes: len,
        engine: run.engine,
        cache: match (direct, options.mode) {
            (Some(_), _) => CachePolicy::Bypass,
            (None, IoMode::DontCache) => CachePolicy::Fadvise,
            (None, _) => CachePolicy::Keep,
        },
        filesystem: system::filesystem_name(magic),
        alignment: direct.unwrap_or(1),
        direct_bytes,
        fallbacks,
        anonymous_tmpfile,
        replaced: previous.is_some(),
        allocate_seconds,
        write_seconds,
        sync_seconds,
        total_seconds: total,
        gib_per_second: len as f64 / (1u64 << 30) as f64 / total.max(1e-9),
        cpu_user_seconds: cpu_after.0.saturating_sub(cpu_before.0).as_secs_f64(),
        cpu_system_seconds: cpu_after.1.saturating_sub(cpu_before.1).as_secs_f64(),
    })
}
