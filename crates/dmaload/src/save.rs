//! `save`: write a buffer to a file, as fast as `load` reads one, without
//! ever leaving a torn file under the target name.
//!
//! What a save writes to depends on what the path names, looked at with
//! `lstat` before anything is written:
//!
//! * **Symbolic links** are followed to their final target, a chain of them
//!   too (at most 40, else ELOOP); a dangling link creates its target. The
//!   links stay links. As the kernel does (`fs.protected_symlinks`), a link
//!   in a sticky world-writable directory such as /tmp is only followed when
//!   it belongs to the caller or to the directory's owner.
//! * **A regular file, or nothing**: the bytes go to a temporary file in the
//!   target's directory (an unnamed `O_TMPFILE` where the filesystem has it,
//!   else `.NAME.dmaload-PID-NANOS.tmp`, the name shortened to fit 255
//!   bytes): space is reserved with `fallocate` (a full filesystem fails
//!   before anything is written), the aligned part is written with O_DIRECT
//!   through io_uring registered buffers, the unaligned tail with a buffered
//!   write, the final size is set, the file is fsynced, named, renamed over
//!   the target and the directory fsynced. Until the rename the old file is
//!   untouched; after it, the new one is complete. A replaced file keeps its
//!   owner, group and permission bits (set-user-ID and set-group-ID
//!   included); where the caller may not give the file to its old owner (not
//!   root), the new file belongs to the caller and the report has a fallback
//!   saying so. Other hard links of a replaced file keep the old bytes: the
//!   rename gives the path a new inode (`other_links` counts them). Extended
//!   attributes and ACLs of the old file are not carried over. RLIMIT_FSIZE
//!   is checked first, so a save past it is an error, not a SIGXFSZ kill.
//! * **A block device, character device or FIFO** is written in place: no
//!   temporary file, no rename, never replaced by a regular file. It is
//!   opened without `O_CREAT` or `O_TRUNC` and with `O_NONBLOCK`, so a FIFO
//!   with no reader is an error at once instead of a hang. A block device
//!   must be at least as large as the data and takes the same engines and
//!   O_DIRECT as a file, then an fsync. A character device or FIFO takes
//!   sequential `write(2)` calls from its current position (no offsets, no
//!   O_DIRECT, no fsync); `/dev/null` makes a copy a read benchmark. A
//!   FIFO whose reader leaves mid-way fails with EPIPE at the offset
//!   reached: SIGPIPE is blocked in the saving thread around the writes,
//!   so it never kills a host whose SIGPIPE has its default action.
//! * **A directory or socket** is an error naming the path and its type.
//!
//! In a sticky directory writable by others (/tmp), an existing regular file
//! or FIFO that belongs neither to the caller nor to the directory's owner
//! is refused, as the kernel refuses `open(O_CREAT)` of it
//! (`fs.protected_regular`, `fs.protected_fifos`): a planted file cannot
//! capture what root saves there.
//!
//! A save killed between naming its temporary file and the rename (a window
//! of microseconds with `O_TMPFILE`, the whole save without it) leaves
//! `.NAME.dmaload-PID-NANOS.tmp` behind. The next save into that directory
//! removes every such file whose PID does not exist in its PID namespace
//! and whose `flock` it can take: a running save holds an exclusive lock on
//! its temporary file from creation, so a save from another PID namespace
//! or host (NFS) is never touched. Removed names are in `removed_tmpfiles`.

use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, File, Metadata};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::cancel::CancelToken;
use crate::engine::{EngineParams, EngineRun, Progress, CANCEL_POLL};
use crate::error::{Error, ErrorKind, Result};
use crate::options::{
    count, wrong_kind, OptionError, OptionValue, DEFAULT_CHUNK_SIZE, DEFAULT_POOL_THREADS,
    DEFAULT_QUEUE_DEPTH,
};
use crate::pipeline::write_at as write_through_engine;
use crate::source::direct_io_alignment;
use crate::source::type_name;
pub use crate::sys::shm::RawBytes;
use crate::tmpfile::{remove_stale_tmpfiles, TmpFile};
use crate::types::{CachePolicy, Engine, Fallback, IoMode, ProgressFn};
use crate::{sys, system};
/// Options of [`save`]; `SaveOptions::default()` is what a user gets
/// without flags.
#[derive(Clone)]
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
    /// Called with (bytes written, bytes in all) as
    /// [`crate::LoadOptions::progress`] is for a load: from a reporting
    /// thread, about every 50 ms while writes complete (all of them may
    /// be reported while the sync still runs), then once with
    /// `done == total` when the save has succeeded, after the sync and
    /// rename. A FIFO or character device is reported as it takes bytes.
    pub progress: Option<Arc<ProgressFn>>,
    /// Stops the save from another thread (as [`crate::LoadOptions::cancel`]
    /// does a load): it ends with [`ErrorKind::Cancelled`] within a few
    /// requests, or within 20 ms while a FIFO or character device is not
    /// taking bytes, and leaves what a failed save leaves (a previous file
    /// untouched, no temporary file; a FIFO or device keeps what reached it).
    pub cancel: CancelToken,
}

impl fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SaveOptions")
            .field("engine", &self.engine)
            .field("mode", &self.mode)
            .field("sync", &self.sync)
            .field("chunk_size", &self.chunk_size)
            .field("queue_depth", &self.queue_depth)
            .field("threads", &self.threads)
            .field("progress", &self.progress.is_some())
            .field("cancel", &self.cancel.is_cancelled())
            .finish()
    }
}

impl SaveOptions {
    /// The options [`SaveOptions::set`] takes, by name: every field but
    /// the progress callback and the cancellation token.
    pub const NAMES: [&'static str; 6] = ["engine", "mode", "sync", "chunk_size", "queue_depth", "threads"];

    /// Sets the option `name` ([`SaveOptions::NAMES`]) to `value`, as
    /// [`crate::LoadOptions::set`] does a load's.
    pub fn set(&mut self, name: &str, value: OptionValue) -> std::result::Result<(), OptionError> {
        use OptionValue::{Flag, Name, Number};
        let parsed = |e: String| OptionError::Value(e);
        match (name, value) {
            ("engine", Name(v)) => self.engine = v.parse().map_err(parsed)?,
            ("mode", Name(v)) => self.mode = v.parse().map_err(parsed)?,
            ("sync", Flag(b)) => self.sync = b,
            ("chunk_size", Number(n)) => self.chunk_size = count(n)?,
            ("queue_depth", Number(n)) => self.queue_depth = count(n)?,
            ("threads", Number(n)) => self.threads = count(n)?,
            (name, value) if Self::NAMES.contains(&name) => {
                let wanted = self.get(name).map_or("another value", |v| v.kind());
                return Err(wrong_kind(wanted, &value));
            }
            _ => return Err(OptionError::Unknown),
        }
        Ok(())
    }

    /// The value of the option `name` ([`SaveOptions::NAMES`]), as
    /// [`SaveOptions::set`] takes it; `None` for a name it does not take.
    pub fn get(&self, name: &str) -> Option<OptionValue> {
        use OptionValue::{Flag, Name, Number};
        Some(match name {
            "engine" => Name(self.engine.name().to_owned()),
            "mode" => Name(self.mode.name().to_owned()),
            "sync" => Flag(self.sync),
            "chunk_size" => Number(self.chunk_size as u64),
            "queue_depth" => Number(self.queue_depth as u64),
            "threads" => Number(self.threads as u64),
            _ => return None,
        })
    }
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
            progress: None,
            cancel: CancelToken::new(),
        }
    }
}

/// What a save did and how long each part took.
#[derive(Debug, Clone, Serialize)]
pub struct SaveReport {
    /// The path as given.
    #[serde(serialize_with = "crate::error::serialize_path")]
    pub path: PathBuf,
    /// The file written: `path` with its symbolic links followed.
    #[serde(serialize_with = "crate::error::serialize_path")]
    pub target: PathBuf,
    /// "regular file", "block device", "character device" or "FIFO".
    pub file_type: &'static str,
    /// Written into an existing device or FIFO: no temporary file, no rename.
    pub in_place: bool,
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
    /// Whether a previous regular file was replaced.
    pub replaced: bool,
    /// Other names (hard links) of the replaced file: they keep the old bytes.
    pub other_links: u64,
    /// Temporary files of killed saves removed from the target's directory.
    pub removed_tmpfiles: Vec<String>,
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

/// The directory a path is in ("." for a bare name).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// How many symbolic links a path may go through, as the kernel allows.
const MAX_SYMLINKS: usize = 40;

/// Follows the symbolic links `path` ends in: the final path and what is
/// there (`None`: nothing yet).
pub(crate) fn resolve(path: &Path) -> Result<(PathBuf, Option<Metadata>)> {
    let mut current = path.to_owned();
    for _ in 0..=MAX_SYMLINKS {
        let bytes = current.as_os_str().as_bytes();
        let names_a_directory =
            current.file_name().is_none() || bytes.ends_with(b"/") || bytes.ends_with(b"/.") || bytes == b".";
        let meta = match fs::symlink_metadata(&current) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound && !names_a_directory => {
                return Ok((current, None))
            }
            Err(e) => return Err(Error::io("stat", &current, e)),
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            check_sticky(&current, &meta)?;
            let link = fs::read_link(&current).map_err(|e| Error::io("readlink", &current, e))?;
            current = match current.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir.join(link),
                _ => link,
            };
        } else if kind.is_dir() {
            return Err(Error::io("save to", &current, io::Error::from_raw_os_error(libc::EISDIR)));
        } else if kind.is_file() || kind.is_block_device() || kind.is_char_device() || kind.is_fifo() {
            return Ok((current, Some(meta)));
        } else {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "save to",
                &current,
                format!("a {} cannot be saved to: dmaload writes files, devices and FIFOs", type_name(&meta)),
            ));
        }
    }
    Err(Error::io("follow the symbolic links of", path, io::Error::from_raw_os_error(libc::ELOOP)))
}

/// The kernel's rule for a file not owned by the caller in directory
/// `dir` at protection `level`: refused in a sticky directory others may
/// write, unless the directory's owner owns the file (`may_follow_link`,
/// `may_create_in_sticky` in fs/namei.c).
fn sticky_refuses(meta: &Metadata, dir: &Metadata, level: u32) -> bool {
    const STICKY: u32 = 0o1000;
    const WORLD_WRITABLE: u32 = 0o002;
    const GROUP_WRITABLE: u32 = 0o020;
    // Level 2 extends the file rules (not the symlink one) to group-writable directories.
    let others_write = dir.mode() & WORLD_WRITABLE != 0
        || (level >= 2 && !meta.file_type().is_symlink() && dir.mode() & GROUP_WRITABLE != 0);
    level > 0 && dir.mode() & STICKY != 0 && meta.uid() != dir.uid() && others_write
}

/// A `/proc/sys/fs` setting (0 where this kernel has none).
fn fs_sysctl(name: &str) -> u32 {
    fs::read_to_string(Path::new("/proc/sys/fs").join(name))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Refuses what the kernel refuses in a sticky directory that others may
/// write (/tmp): following a symlink (`fs.protected_symlinks`), or opening
/// with `O_CREAT` an existing regular file (`fs.protected_regular`) or FIFO
/// (`fs.protected_fifos`) owned by neither the caller nor the directory's
/// owner. Saving follows links and replaces files itself, so it checks the
/// same rules itself.
pub(crate) fn check_sticky(path: &Path, meta: &Metadata) -> Result<()> {
    let kind = meta.file_type();
    let setting = if kind.is_symlink() {
        "protected_symlinks"
    } else if kind.is_file() {
        "protected_regular"
    } else if kind.is_fifo() {
        "protected_fifos"
    } else {
        return Ok(());
    };
    let level = fs_sysctl(setting);
    if level == 0 || meta.uid() == sys::process::effective_uid() {
        return Ok(());
    }
    let dir = parent_dir(path);
    let dir_meta = fs::metadata(dir).map_err(|e| Error::io("stat", dir, e))?;
    if !sticky_refuses(meta, &dir_meta, level) {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::InvalidInput,
        "save to",
        path,
        format!(
            "refused: this {} in a sticky directory others can write belongs to uid {}, neither you nor \
             the directory's owner (fs.{setting} = {level})",
            type_name(meta),
            meta.uid()
        ),
    ))
}

/// How the aligned part is written: O_DIRECT with this offset alignment,
/// or buffered (`None`).
pub(crate) fn choose_direct(
    path: &Path,
    file: &File,
    data: RawBytes<'_>,
    magic: Option<i64>,
    mode: IoMode,
    fallbacks: &mut Vec<Fallback>,
) -> Result<Option<usize>> {
    // Nothing to write (an empty slice may not even have an aligned address).
    if data.is_empty() || matches!(mode, IoMode::Buffered | IoMode::DontCache) {
        return Ok(None);
    }
    // `magic` is the filesystem holding the file; a block device has none.
    let storage = magic.map_or("this block device", system::filesystem_name);
    let why = if magic.is_some_and(system::is_memory_filesystem) {
        format!("{storage} keeps file data in the page cache")
    } else {
        match direct_io_alignment(file) {
            None => format!("{storage} does not support O_DIRECT on this file"),
            Some(a) if data.as_ptr() as usize % a.memory != 0 => {
                format!(
                    "the buffer at {:p} is not aligned to the {} bytes O_DIRECT needs",
                    data.as_ptr(),
                    a.memory
                )
            }
            Some(a) => match sys::file::set_direct(file.as_fd(), true) {
                Ok(()) => return Ok(Some(a.offset)),
                Err(e) => format!("fcntl(O_DIRECT) refused: {e}"),
            },
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

/// Writes all of `data` to the open `file` at `offset` with the engine,
/// request size, queue depth and threads of `options` (`mode` and `sync`
/// play no part: `file`'s own `O_DIRECT` flag decides, and nothing is
/// synced), and returns the fallbacks taken (registration refused). None of
/// [`save`]'s temporary file, rename or checks: the write half of a save,
/// for callers that manage the file themselves (the benchmarks' transfer
/// methods). With `O_DIRECT`, the address and length of `data`, `offset`
/// and `chunk_size` must be multiples of the file's alignment
/// ([`crate::source::direct_io_alignment`]), else the kernel's EINVAL.
/// Feature `baselines`: the benchmarks' entry, not the library's.
#[cfg(feature = "baselines")]
pub fn write_at(
    file: &File,
    path: &Path,
    offset: u64,
    data: &[u8],
    options: &SaveOptions,
) -> Result<Vec<Fallback>> {
    validate(path, options)?;
    let progress = Progress::new(data.len() as u64, None);
    let params = engine_params(options);
    let run =
        write_through_engine(path, file, data.into(), offset, 1, options.chunk_size, &params, &progress)?;
    Ok(run.fallbacks)
}

/// The engine's parameters for a save with `options`.
fn engine_params(options: &SaveOptions) -> EngineParams {
    EngineParams {
        engine: options.engine,
        queue_depth: options.queue_depth,
        threads: options.threads,
        cancel: options.cancel.clone(),
        tune: None,
        request_size: None,
        read_modes: None,
    }
}

/// Writes `data` to `path`: replaces a regular file atomically, writes a
/// device or FIFO in place, follows symbolic links (see the module doc). A
/// failed save leaves a previous regular file as it was and no temporary
/// file behind; the error names the file and the cause.
pub fn save(data: &[u8], path: impl AsRef<Path>, options: &SaveOptions) -> Result<SaveReport> {
    save_raw(data.into(), path, options)
}

/// [`save`] of bytes that Rust code never reads, only the kernel (see
/// [`RawBytes::from_raw_parts`]): memory another thread or process may
/// write meanwhile, such as a Python buffer's export, over which a `&[u8]`
/// would be unsound. A concurrent writer changes only what is saved.
pub fn save_raw(data: RawBytes<'_>, path: impl AsRef<Path>, options: &SaveOptions) -> Result<SaveReport> {
    let path = path.as_ref();
    validate(path, options)?;
    let started = Instant::now();
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let (target, existing) = resolve(path)?;
    let mut report =
        Progress::reporting(data.len() as u64, options.progress.as_deref(), |progress| match existing {
            Some(meta) if !meta.file_type().is_file() => {
                save_in_place(data, path, target, &meta, options, progress)
            }
            previous => save_replacing(data, path, target, previous, options, progress),
        })?;
    let cpu_after = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let total = started.elapsed().as_secs_f64();
    report.total_seconds = total;
    report.gib_per_second = data.len() as f64 / (1u64 << 30) as f64 / total.max(1e-9);
    report.cpu_user_seconds = cpu_after.0.saturating_sub(cpu_before.0).as_secs_f64();
    report.cpu_system_seconds = cpu_after.1.saturating_sub(cpu_before.1).as_secs_f64();
    Ok(report)
}

/// A report with the facts every save has; the rest is filled in by the
/// kind of save.
fn report(path: &Path, target: PathBuf, file_type: &'static str, len: u64, engine: Engine) -> SaveReport {
    SaveReport {
        path: path.to_owned(),
        target,
        file_type,
        in_place: false,
        bytes: len,
        engine,
        cache: CachePolicy::Keep,
        filesystem: "",
        alignment: 1,
        direct_bytes: 0,
        fallbacks: Vec::new(),
        anonymous_tmpfile: false,
        replaced: false,
        other_links: 0,
        removed_tmpfiles: Vec::new(),
        allocate_seconds: 0.0,
        write_seconds: 0.0,
        sync_seconds: 0.0,
        total_seconds: 0.0,
        gib_per_second: 0.0,
        cpu_user_seconds: 0.0,
        cpu_system_seconds: 0.0,
    }
}

/// What [`write_body`] did: the engine run, and the O_DIRECT alignment used.
struct Body {
    run: EngineRun,
    direct: Option<usize>,
    direct_bytes: u64,
}

/// Writes all of `data` at offset 0 of `file` (a regular file or a block
/// device): the aligned part with the engine, O_DIRECT where possible, the
/// unaligned tail buffered.
fn write_body(
    target: &Path,
    file: &File,
    data: RawBytes<'_>,
    magic: Option<i64>,
    options: &SaveOptions,
    progress: &Progress<'_>,
    fallbacks: &mut Vec<Fallback>,
) -> Result<Body> {
    let mut direct = choose_direct(target, file, data, magic, options.mode, fallbacks)?;
    let params = engine_params(options);
    // Requests are whole multiples of the alignment, so each direct write is aligned.
    let write = |part: RawBytes<'_>, align: usize| {
        write_through_engine(target, file, part, 0, align, options.chunk_size, &params, progress)
    };
    let aligned = direct.map_or(data.len(), |a| data.len() / a * a);
    let run = match write(data.range(0..aligned), direct.unwrap_or(1)) {
        // Some devices reject the alignment statx reported: retry buffered once.
        Err(err)
            if direct.is_some()
                && options.mode == IoMode::Auto
                && err.raw_os_error() == Some(libc::EINVAL) =>
        {
            sys::file::set_direct(file.as_fd(), false).map_err(|e| Error::io("fcntl", target, e))?;
            fallbacks.push(Fallback::new("direct", "buffered", format!("O_DIRECT write rejected: {err}")));
            direct = None;
            write(data, 1)?
        }
        other => other?,
    };
    let direct_bytes = if direct.is_some() { aligned as u64 } else { 0 };
    if direct.is_some() && aligned < data.len() {
        // The unaligned tail cannot go direct: write it through the page cache.
        sys::file::set_direct(file.as_fd(), false).map_err(|e| Error::io("fcntl", target, e))?;
        data.range(aligned..data.len())
            .write_all_at(file.as_fd(), aligned as u64)
            .map_err(|e| Error::io("write", target, e).at(aligned as u64))?;
        progress.add((data.len() - aligned) as u64);
    }
    Ok(Body { run, direct, direct_bytes })
}

fn cache_policy(direct: Option<usize>, mode: IoMode) -> CachePolicy {
    match (direct, mode) {
        (Some(_), _) => CachePolicy::Bypass,
        (None, IoMode::DontCache) => CachePolicy::Fadvise,
        (None, _) => CachePolicy::Keep,
    }
}

/// Gives the temporary file the replaced file's owner, group and
/// permission bits. Changing the owner needs CAP_CHOWN: without it the
/// group is kept where the caller belongs to it, and a fallback says who
/// owns the new file.
pub(crate) fn keep_owner_and_mode(
    file: &File,
    target: &Path,
    old: &Metadata,
    mode: u32,
    fallbacks: &mut Vec<Fallback>,
) -> Result<()> {
    let now = file.metadata().map_err(|e| Error::io("fstat", target, e))?;
    if (now.uid(), now.gid()) != (old.uid(), old.gid()) {
        if let Err(err) = std::os::unix::fs::fchown(file, Some(old.uid()), Some(old.gid())) {
            let group_kept = std::os::unix::fs::fchown(file, None, Some(old.gid())).is_ok();
            fallbacks.push(Fallback::new(
                "keep the owner",
                "owned by the saver",
                format!(
                    "the replaced file belonged to uid {} gid {}; changing the owner was refused ({err}), \
                     so the new file belongs to uid {}{}",
                    old.uid(),
                    old.gid(),
                    now.uid(),
                    if group_kept {
                        format!(" and keeps gid {}", old.gid())
                    } else {
                        format!(" gid {}", now.gid())
                    }
                ),
            ));
        }
    }
    // After the chown, which clears the set-user-ID and set-group-ID bits;
    // O_TMPFILE's mode also passed through the umask.
    file.set_permissions(fs::Permissions::from_mode(mode)).map_err(|e| Error::io("fchmod", target, e))
}

/// Saves to a regular file (or a new one) through a temporary file and a
/// rename; see the module doc.
fn save_replacing(
    data: RawBytes<'_>,
    path: &Path,
    target: PathBuf,
    previous: Option<Metadata>,
    options: &SaveOptions,
    progress: &Progress<'_>,
) -> Result<SaveReport> {
    let len = data.len() as u64;
    if let Some(meta) = &previous {
        check_sticky(&target, meta)?;
    }
    // Writing past RLIMIT_FSIZE would kill the process with SIGXFSZ.
    if let Some(why) = sys::process::past_file_size_limit(len) {
        return Err(Error::new(ErrorKind::InvalidInput, "save", &target, why));
    }
    let dir = parent_dir(&target).to_owned();
    let name = target.file_name().unwrap_or(OsStr::new("file")).to_owned();
    let mut out = report(path, target.clone(), "regular file", len, options.engine);
    out.removed_tmpfiles = remove_stale_tmpfiles(&dir);
    // A replaced file keeps its permission bits; a new one gets 0666 & ~umask.
    let mode = previous.as_ref().map_or(0o666, |m| m.mode() & 0o7777);
    let tmp = TmpFile::create(&dir, &name, mode)?;
    if let Some(meta) = &previous {
        keep_owner_and_mode(tmp.file(), &target, meta, mode, &mut out.fallbacks)?;
        out.replaced = true;
        out.other_links = meta.nlink().saturating_sub(1);
    }
    let file = tmp.file();
    let magic = sys::file::filesystem_magic(file.as_fd()).map_err(|e| Error::io("fstatfs", &target, e))?;

    let allocating = Instant::now();
    if len > 0 {
        match sys::mem::allocate(file.as_fd(), 0, len) {
            Ok(()) => {}
            // Not every filesystem can preallocate; the writes still report ENOSPC.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
            Err(e) => return Err(Error::io("allocate space for", &target, e)),
        }
    }
    out.allocate_seconds = allocating.elapsed().as_secs_f64();

    let writing = Instant::now();
    let mut body = write_body(&target, file, data, Some(magic), options, progress, &mut out.fallbacks)?;
    // fallocate past the end of a smaller write: the size is exact.
    file.set_len(len).map_err(|e| Error::io("ftruncate", &target, e))?;
    out.write_seconds = writing.elapsed().as_secs_f64();

    let syncing = Instant::now();
    if options.sync {
        file.sync_all().map_err(|e| Error::io("fsync", &target, e))?;
    }
    if options.mode == IoMode::DontCache {
        // Advice only: failing leaves the pages cached, the data is written.
        let _ = sys::file::fadvise(file.as_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    out.anonymous_tmpfile = tmp.is_anonymous();
    tmp.commit(&dir, &target)?;
    if options.sync {
        File::open(&dir).and_then(|d| d.sync_all()).map_err(|e| Error::io("fsync directory", &dir, e))?;
    }
    out.sync_seconds = syncing.elapsed().as_secs_f64();

    out.engine = body.run.engine;
    out.fallbacks.append(&mut body.run.fallbacks);
    out.cache = cache_policy(body.direct, options.mode);
    out.filesystem = system::filesystem_name(magic);
    out.alignment = body.direct.unwrap_or(1);
    out.direct_bytes = body.direct_bytes;
    Ok(out)
}

/// Writes into an existing block device, character device or FIFO; see
/// the module doc.
fn save_in_place(
    data: RawBytes<'_>,
    path: &Path,
    target: PathBuf,
    meta: &Metadata,
    options: &SaveOptions,
    progress: &Progress<'_>,
) -> Result<SaveReport> {
    let len = data.len() as u64;
    check_sticky(&target, meta)?;
    let kind = meta.file_type();
    let file = sys::file::open_existing_for_writing(&target).map_err(|e| {
        if kind.is_fifo() && e.raw_os_error() == Some(libc::ENXIO) {
            Error::new(
                ErrorKind::Io,
                "open",
                &target,
                "no process is reading the FIFO (dmaload does not wait for one)",
            )
        } else {
            Error::io("open", &target, e)
        }
    })?;
    let opened = file.metadata().map_err(|e| Error::io("fstat", &target, e))?;
    if (opened.dev(), opened.ino()) != (meta.dev(), meta.ino()) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "open",
            &target,
            format!("the {} was replaced while it was opened", type_name(meta)),
        ));
    }
    let mut out = report(path, target.clone(), type_name(meta), len, options.engine);
    out.in_place = true;
    let writing = Instant::now();
    if kind.is_block_device() {
        sys::file::set_nonblocking(file.as_fd(), false).map_err(|e| Error::io("fcntl", &target, e))?;
        let size = (&file).seek(SeekFrom::End(0)).map_err(|e| Error::io("lseek", &target, e))?;
        if len > size {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "save to",
                &target,
                format!("{len} bytes do not fit on this block device of {size} bytes"),
            ));
        }
        let mut body = write_body(&target, &file, data, None, options, progress, &mut out.fallbacks)?;
        out.write_seconds = writing.elapsed().as_secs_f64();
        let syncing = Instant::now();
        if options.sync {
            file.sync_all().map_err(|e| Error::io("fsync", &target, e))?;
        }
        if options.mode == IoMode::DontCache {
            // Advice only: failing leaves the pages cached, the data is written.
            let _ = sys::file::fadvise(file.as_fd(), 0, len, libc::POSIX_FADV_DONTNEED);
        }
        out.sync_seconds = syncing.elapsed().as_secs_f64();
        out.engine = body.run.engine;
        out.fallbacks.append(&mut body.run.fallbacks);
        out.cache = cache_policy(body.direct, options.mode);
        out.filesystem = "block-device";
        out.alignment = body.direct.unwrap_or(1);
        out.direct_bytes = body.direct_bytes;
        return Ok(out);
    }
    // A FIFO or character device has no offsets to write at in parallel.
    if options.mode == IoMode::Direct {
        return Err(Error::new(
            ErrorKind::DirectIoUnavailable,
            "open O_DIRECT",
            &target,
            format!("a {} takes no O_DIRECT", type_name(meta)),
        ));
    }
    if options.engine != Engine::Read {
        out.fallbacks.push(Fallback::new(
            options.engine.name(),
            Engine::Read.name(),
            format!("a {} is written with sequential write(2) calls at its position", type_name(meta)),
        ));
    }
    // A reader that leaves gives EPIPE here, never the SIGPIPE that would
    // kill a host whose SIGPIPE is at its default action. The file stays
    // non-blocking: a full FIFO is waited on in slices, looking at the
    // caller's token between them.
    let mut written = 0;
    sys::signal::without_sigpipe(|| {
        while written < data.len() {
            if options.cancel.is_cancelled() {
                return Err(io::Error::from_raw_os_error(libc::ECANCELED));
            }
            match data.range(written..data.len()).write_to(file.as_fd()) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => {
                    written += n;
                    progress.add(n as u64);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    sys::eventfd::poll_writable(file.as_fd(), CANCEL_POLL)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })
    .map_err(|e| match options.cancel.is_cancelled() && e.raw_os_error() == Some(libc::ECANCELED) {
        true => {
            let why =
                format!("cancelled by the caller; the {} took the first {written} bytes", type_name(meta));
            Error::new(ErrorKind::Cancelled, "save", &target, why).at(written as u64)
        }
        false => Error::io("write", &target, e).at(written as u64),
    })?;
    out.write_seconds = writing.elapsed().as_secs_f64();
    out.engine = Engine::Read;
    out.filesystem = type_name(meta);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_rules_match_the_kernels() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        let link = dir.path().join("l");
        fs::write(&file, b"x").unwrap();
        std::os::unix::fs::symlink("f", &link).unwrap();
        let meta = |p: &Path| fs::symlink_metadata(p).unwrap();
        let set_mode = |mode| fs::set_permissions(dir.path(), fs::Permissions::from_mode(mode)).unwrap();
        // Owned by the directory's owner: never refused.
        set_mode(0o1777);
        assert!(!sticky_refuses(&meta(&file), &meta(dir.path()), 2));
        if sys::process::effective_uid() != 0 {
            return eprintln!("SKIP sticky_rules_match_the_kernels: giving files away needs root");
        }
        std::os::unix::fs::lchown(&file, Some(65534), None).unwrap();
        std::os::unix::fs::lchown(&link, Some(65534), None).unwrap();
        for (mode, level, file_refused, link_refused) in [
            (0o1777, 1, true, true),
            (0o1777, 0, false, false),
            (0o0777, 2, false, false),
            (0o1775, 1, false, false),
            (0o1775, 2, true, false),
        ] {
            set_mode(mode);
            let d = meta(dir.path());
            assert_eq!(sticky_refuses(&meta(&file), &d, level), file_refused, "{mode:o} {level}");
            assert_eq!(sticky_refuses(&meta(&link), &d, level), link_refused, "{mode:o} {level}");
        }
        set_mode(0o700);
    }
}
