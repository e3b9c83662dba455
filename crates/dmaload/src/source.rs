//! The file a load reads: opened once, checked once, and read through that
//! one open file from then on.
//!
//! Opening never blocks and never has side effects: the path is `stat`ed
//! first and only regular files and block devices are opened (a FIFO, a
//! character device or a socket is refused by type before any `open`, so a
//! FIFO without a writer cannot hang the caller and a tape or watchdog
//! device is never touched); the open itself is `O_NONBLOCK | O_NOCTTY` and
//! its type is checked again on the fd, in case the path was replaced in
//! between. Everything after (size, alignment, `O_DIRECT`, the reads, the
//! change check at the end) uses that fd, so a file renamed over the path
//! mid-load cannot give one file's length and another file's bytes.

use std::fs::{File, Metadata};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};
use crate::sys::file::{statx_dio_align, DioAlignQuery};
use crate::types::{CachePolicy, Fallback, IoMode};
use crate::{sys, system};

/// A file type in words ("regular file", "FIFO", ...), for messages and
/// reports.
pub fn type_name(meta: &Metadata) -> &'static str {
    let kind = meta.file_type();
    if kind.is_file() {
        "regular file"
    } else if kind.is_dir() {
        "directory"
    } else if kind.is_symlink() {
        "symbolic link"
    } else if kind.is_block_device() {
        "block device"
    } else if kind.is_char_device() {
        "character device"
    } else if kind.is_fifo() {
        "FIFO"
    } else if kind.is_socket() {
        "socket"
    } else {
        "file of unknown type"
    }
}

/// Why a load refuses a file of another type than a regular file or a
/// block device, after "a FIFO" (say).
const NOT_LOADABLE: &str = "has no fixed length to load: dmaload reads regular files and block devices \
                            (copy a stream to a file first)";

/// Refuses anything but a regular file or a block device, saying why with
/// `refusal` after the file's type.
fn check_type(path: &Path, meta: &Metadata, refusal: &str) -> Result<()> {
    let kind = meta.file_type();
    if kind.is_file() || kind.is_block_device() {
        return Ok(());
    }
    if kind.is_dir() {
        return Err(Error::io("open", path, io::Error::from_raw_os_error(libc::EISDIR)));
    }
    Err(Error::new(ErrorKind::InvalidInput, "open", path, format!("a {} {refusal}", type_name(meta))))
}

/// Opens `path` for reading without ever blocking: see the module doc.
/// The fd is a regular file or a block device, in blocking mode.
pub fn open_for_reading(path: &Path) -> Result<File> {
    open_regular(path, NOT_LOADABLE)
}

/// Opens `path` as a stream to read to its end (a capture's source): a
/// regular file, a block or character device, or a FIFO, whose open waits
/// for a writer as any reader's does (the caller bounds that wait). A
/// directory or a socket is refused by type, before and after the open.
pub fn open_stream(path: &Path) -> Result<File> {
    let refuse = |meta: &Metadata| {
        let kind = meta.file_type();
        if kind.is_dir() {
            return Err(Error::io("open", path, io::Error::from_raw_os_error(libc::EISDIR)));
        }
        if kind.is_socket() {
            let why = "a socket is not a stream dmaload reads: give a file, FIFO or character device";
            return Err(Error::new(ErrorKind::InvalidInput, "open", path, why));
        }
        Ok(())
    };
    refuse(&std::fs::metadata(path).map_err(|e| Error::io("open", path, e))?)?;
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    refuse(&file.metadata().map_err(|e| Error::io("fstat", path, e))?)?;
    Ok(file)
}

/// [`open_for_reading`] for another use than a load, which says why a file
/// of another type is refused: `refusal` follows "a FIFO" (say).
pub fn open_regular(path: &Path, refusal: &str) -> Result<File> {
    let before = std::fs::metadata(path).map_err(|e| Error::io("open", path, e))?;
    check_type(path, &before, refusal)?;
    let file = sys::file::open_nonblocking(path).map_err(|e| Error::io("open", path, e))?;
    let opened = file.metadata().map_err(|e| Error::io("fstat", path, e))?;
    check_type(path, &opened, refusal)?;
    sys::file::set_nonblocking(file.as_fd(), false).map_err(|e| Error::io("fcntl", path, e))?;
    Ok(file)
}

/// What tells whether a file's content changed between two looks: its size
/// and modification time, which every write, truncation and `fallocate`
/// moves (reads move neither), and its change time (ctime), which also
/// catches a writer that puts the old mtime back (`touch -d`, `cp -p`).
/// ctime also moves on link, unlink, rename over the file (the link count
/// drops), chmod and chown, none of which change a byte: a ctime move
/// alongside such a metadata change is not taken as a write. On kernels
/// with multigrain timestamps (6.13+: ext4, xfs, btrfs, tmpfs) a write
/// after a look always gets newer times; on older ones a write within the
/// same clock tick (a few ms) as the first look can go unseen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    /// Link count, mode and owner: metadata whose change moves ctime only.
    metadata: (u64, u32, u32, u32),
}

impl Stamp {
    fn of(meta: &Metadata) -> Stamp {
        Stamp {
            size: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
            metadata: (meta.nlink(), meta.mode(), meta.uid(), meta.gid()),
        }
    }

    /// Whether the content may differ between `self` and the later `now`.
    fn content_changed(&self, now: &Stamp) -> bool {
        self.size != now.size
            || self.mtime != now.mtime
            || (self.ctime != now.ctime && self.metadata == now.metadata)
    }
}

/// A file opened for loading, kept open so that everything read from it
/// (a header first, then the data) comes from the one file: see the module
/// doc for what opening checks.
pub struct OpenFile {
    source: Source,
    path: PathBuf,
    /// The file's first bytes, as [`OpenFile::read_head`] last read them.
    head: std::sync::Mutex<Option<std::sync::Arc<[u8]>>>,
}

impl OpenFile {
    pub fn open(path: impl AsRef<Path>) -> Result<OpenFile> {
        let path = path.as_ref();
        Ok(OpenFile { source: Source::open(path)?, path: path.to_owned(), head: Default::default() })
    }

    /// A file the caller opened. It is reopened through `/proc/self/fd` (a
    /// description of its own, so setting `O_DIRECT` never changes the
    /// caller's fd), and the reopened file must be the same inode.
    pub fn from_fd(fd: BorrowedFd<'_>) -> Result<OpenFile> {
        let (source, path) = Source::from_fd(fd)?;
        Ok(OpenFile { source, path, head: Default::default() })
    }

    /// This file's first `len` bytes as the whole of it: for a memfd that
    /// holds another file's bytes in whole pages (a cache service's), whose
    /// size is rounded up to the page. Fails when the file is shorter.
    pub fn first_bytes(mut self, len: u64) -> Result<OpenFile> {
        if len > self.source.size {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "open",
                &self.path,
                format!("{len} bytes asked of a file of {} bytes", self.source.size),
            ));
        }
        self.source.size = len;
        Ok(self)
    }

    /// This file under another name in messages and reports: a memfd
    /// standing for the file it holds is named as that file.
    pub fn named(mut self, path: impl Into<PathBuf>) -> OpenFile {
        self.path = path.into();
        self
    }

    /// The length when opened (a block device's capacity).
    pub fn len(&self) -> u64 {
        self.source.size
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `pread` until `buf` is full or the file ends; returns the bytes read.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match std::os::unix::fs::FileExt::read_at(
                &self.source.file,
                &mut buf[done..],
                offset + done as u64,
            ) {
                Ok(0) => break,
                Ok(k) => done += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Reads the file's first `len` bytes (fewer where it ends first) and
    /// keeps them: a verified load of the rest of this open file, from byte
    /// `len` to its end, hashes these bytes first and so checks the whole
    /// file against its digest ([`crate::verify`]), as a safetensors load
    /// to a device does after reading the header to size the destination.
    pub fn read_head(&self, len: usize) -> io::Result<std::sync::Arc<[u8]>> {
        let mut head = vec![0u8; len];
        let got = self.read_at(&mut head, 0)?;
        head.truncate(got);
        let head: std::sync::Arc<[u8]> = head.into();
        *self.head.lock().unwrap_or_else(|p| p.into_inner()) = Some(head.clone());
        Ok(head)
    }

    /// The bytes [`OpenFile::read_head`] last read.
    pub(crate) fn head(&self) -> Option<std::sync::Arc<[u8]>> {
        self.head.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The open file: for a caller that hands it on (the cache service's
    /// client sends its descriptor) or asks the kernel about it.
    pub fn file(&self) -> &File {
        &self.source.file
    }

    /// Fails when the file changed since it was opened: cut short below
    /// `end`, [`ErrorKind::Truncated`] at its new size; any other change
    /// (size, mtime, ctime), [`ErrorKind::Changed`]. A block device is
    /// never found changed.
    pub fn check_unchanged(&self, end: u64) -> Result<()> {
        self.source.check_unchanged(&self.path, end)
    }

    pub(crate) fn source(&self) -> &Source {
        &self.source
    }
}

/// An open file being loaded: what it is, how big, where it lives.
pub(crate) struct Source {
    pub file: File,
    pub size: u64,
    /// The filesystem's name, or "block-device".
    pub storage: &'static str,
    /// tmpfs/ramfs: the file lives in the page cache.
    pub in_memory: bool,
    /// The regular file's stamp when opened; `None` for a block device,
    /// whose node does not change when the device is written.
    stamp: Option<Stamp>,
}

impl Source {
    /// Opens and sizes up `path`: a regular file's length, or a block
    /// device's capacity (the filesystem of a device node says nothing
    /// about the device). Files of pseudo-filesystems (procfs, sysfs, ...)
    /// are refused: their size is not their length.
    pub fn open(path: &Path) -> Result<Source> {
        Source::inspect(open_for_reading(path)?, path)
    }

    /// A source from a file the caller already opened. It is reopened
    /// through `/proc/self/fd` (a description of its own, so setting
    /// `O_DIRECT` never changes the caller's fd) and the reopened file must
    /// be the same inode. Returns the source and the path it was opened at
    /// (for messages and the report).
    pub fn from_fd(fd: BorrowedFd<'_>) -> Result<(Source, PathBuf)> {
        let proc_path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let path = std::fs::read_link(&proc_path).unwrap_or_else(|_| proc_path.clone());
        let given = File::from(fd.try_clone_to_owned().map_err(|e| Error::io("dup", &path, e))?);
        let meta = given.metadata().map_err(|e| Error::io("fstat", &path, e))?;
        check_type(&path, &meta, NOT_LOADABLE)?;
        let file = reopen(&given, &path)?;
        Ok((Source::inspect(file, &path)?, path))
    }

    fn inspect(mut file: File, path: &Path) -> Result<Source> {
        let meta = file.metadata().map_err(|e| Error::io("fstat", path, e))?;
        if meta.file_type().is_block_device() {
            let size = file.seek(SeekFrom::End(0)).map_err(|e| Error::io("seek", path, e))?;
            return Ok(Source { file, size, storage: "block-device", in_memory: false, stamp: None });
        }
        let magic = sys::file::filesystem_magic(file.as_fd()).map_err(|e| Error::io("fstatfs", path, e))?;
        if let Some(pseudo) = system::pseudo_filesystem_name(magic) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "open",
                path,
                format!(
                    "it is a file of {pseudo}, generated when read: its size ({} bytes) is not its \
                     length; copy it to a regular file first (cat FILE > copy)",
                    meta.len()
                ),
            ));
        }
        Ok(Source {
            size: meta.len(),
            storage: system::filesystem_name(magic),
            in_memory: system::is_memory_filesystem(magic),
            stamp: Some(Stamp::of(&meta)),
            file,
        })
    }

    /// Fails when the file changed since it was opened (see [`Stamp`]):
    /// a file cut short below `end` is [`ErrorKind::Truncated`] at its new
    /// size, any other change [`ErrorKind::Changed`].
    pub fn check_unchanged(&self, path: &Path, end: u64) -> Result<()> {
        let Some(before) = self.stamp else { return Ok(()) };
        let now = Stamp::of(&self.file.metadata().map_err(|e| Error::io("fstat", path, e))?);
        if !before.content_changed(&now) {
            return Ok(());
        }
        if now.size < end {
            return Err(Error::new(
                ErrorKind::Truncated,
                "load",
                path,
                format!(
                    "the file was cut from {} to {} bytes during the load, before the end of the \
                     range ({end}); the file is now {} bytes",
                    before.size, now.size, now.size
                ),
            )
            .at(now.size));
        }
        Err(Error::new(
            ErrorKind::Changed,
            "load",
            path,
            format!(
                "the file was written during the load (size {} -> {} bytes, modification or change \
                 time moved): the bytes read may mix old and new content; load it again once the \
                 writer is done",
                before.size, now.size
            ),
        ))
    }
}

/// A new open file description of the file `file` is open on
/// (`/proc/self/fd/N`, checked to be the same inode), for flags of its own:
/// a `dup` shares the description, so `O_DIRECT` set on a dup would change
/// the original's reads too (unaligned `pread` then fails with EINVAL).
fn reopen(file: &File, path: &Path) -> Result<File> {
    let proc_path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let meta = file.metadata().map_err(|e| Error::io("fstat", path, e))?;
    // Non-blocking open: the file was checked to be no FIFO, but the path
    // could still lead elsewhere; the inode check below catches that.
    let reopened = sys::file::open_nonblocking(&proc_path).map_err(|e| Error::io("reopen", &proc_path, e))?;
    let now = reopened.metadata().map_err(|e| Error::io("fstat", path, e))?;
    if (now.dev(), now.ino()) != (meta.dev(), meta.ino()) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "reopen",
            &proc_path,
            "reopening the fd through /proc/self/fd gave another file",
        ));
    }
    sys::file::set_nonblocking(reopened.as_fd(), false).map_err(|e| Error::io("fcntl", path, e))?;
    Ok(reopened)
}

/// How the load reads: the file to read from (O_DIRECT or not), the page
/// cache policy and the offset alignment.
pub(crate) struct ReadSetup {
    pub file: File,
    pub cache: CachePolicy,
    pub align: usize,
    /// For direct reads in `auto` mode, the buffered reads the load's tuner
    /// may measure against them ([`crate::tune`]), flipping `O_DIRECT` on
    /// `file`, a description of the load's own.
    pub buffered: Option<CachePolicy>,
}

/// Reads through the page cache, on the source's own open file.
pub(crate) fn buffered(path: &Path, file: &File, cache: CachePolicy) -> Result<ReadSetup> {
    // The source's own description never has O_DIRECT (direct reads get a
    // description of their own: `reopen`).
    let file = file.try_clone().map_err(|e| Error::io("dup", path, e))?;
    Ok(ReadSetup { file, cache, align: 1, buffered: None })
}

/// Buffered reads that leave no page-cache residue: RWF_DONTCACHE where the
/// filesystem has it, else fadvise per chunk.
pub(crate) fn no_residue_policy(file: &File) -> CachePolicy {
    if sys::file::supports_dontcache(file.as_fd()) {
        CachePolicy::DontCache
    } else {
        CachePolicy::Fadvise
    }
}

pub(crate) fn choose_read_setup(
    path: &Path,
    file: &File,
    source: &Source,
    mode: IoMode,
    fallbacks: &mut Vec<Fallback>,
) -> Result<ReadSetup> {
    match mode {
        IoMode::Buffered => return buffered(path, file, CachePolicy::Keep),
        IoMode::DontCache => return buffered(path, file, no_residue_policy(file)),
        IoMode::Auto | IoMode::Direct => {}
    }
    let refuse = |why: String| -> Result<ReadSetup> {
        Err(Error::new(ErrorKind::DirectIoUnavailable, "open O_DIRECT", path, why))
    };
    if source.in_memory {
        let why =
            format!("{} keeps file data in the page cache, so direct I/O cannot bypass it", source.storage);
        if mode == IoMode::Direct {
            return refuse(why);
        }
        fallbacks.push(Fallback::new("direct", "buffered", why));
        return buffered(path, file, CachePolicy::Keep);
    }
    let align = direct_io_alignment(file);
    let mut unsupported = || {
        let why = format!(
            "{} does not support O_DIRECT on this file (statx STATX_DIOALIGN / open EINVAL)",
            source.storage
        );
        if mode == IoMode::Direct {
            return refuse(why);
        }
        let setup = buffered(path, file, no_residue_policy(file))?;
        fallbacks.push(Fallback::new("direct", cache_name(setup.cache), why));
        Ok(setup)
    };
    let Some(DirectIoAlignment { offset: align, memory }) = align else { return unsupported() };
    // Reads land in page-aligned memory (gathers, slots, the whole pages of
    // caller memory), which meets any memory alignment up to a page.
    if memory > sys::mem::page_size() {
        let why = format!("direct I/O on this file needs memory aligned to {memory} bytes, more than a page");
        if mode == IoMode::Direct {
            return refuse(why);
        }
        let setup = buffered(path, file, no_residue_policy(file))?;
        fallbacks.push(Fallback::new("direct", cache_name(setup.cache), why));
        return Ok(setup);
    }
    // O_DIRECT on the file already opened and checked, never a second open
    // by path (a file renamed over the path since cannot be read by
    // mistake), and on a description of its own: the source's (and a
    // caller's OpenFile::read_at) keeps buffered reads at any offset.
    let direct = match reopen(file, path) {
        Ok(direct) => direct,
        Err(err) if mode == IoMode::Auto => {
            // /proc/self/fd checks the inode's permissions again: a file
            // whose mode changed since it was opened is still read, buffered.
            let setup = buffered(path, file, no_residue_policy(file))?;
            fallbacks.push(Fallback::new("direct", cache_name(setup.cache), err.to_string()));
            return Ok(setup);
        }
        Err(err) => return Err(err),
    };
    match sys::file::set_direct(direct.as_fd(), true) {
        Ok(()) => {
            let buffered = (mode == IoMode::Auto).then(|| no_residue_policy(file));
            Ok(ReadSetup { file: direct, cache: CachePolicy::Bypass, align, buffered })
        }
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => unsupported(),
        Err(err) => Err(Error::io("fcntl(O_DIRECT)", path, err)),
    }
}

/// What `O_DIRECT` reads and writes of a file need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectIoAlignment {
    /// File offsets and lengths are multiples of this.
    pub offset: usize,
    /// Buffer addresses are multiples of this.
    pub memory: usize,
}

/// What `O_DIRECT` reads and writes of `file` need: statx's
/// `STATX_DIOALIGN` (Linux 6.1); else the filesystem block size for
/// offsets (a multiple of the device's logical block size; 4096 if it is
/// not a power of two of at least 512) and the page size for memory, which
/// every filesystem accepts. `None` where the filesystem has no direct I/O
/// for the file. The one alignment authority of loads, saves and the
/// benchmarks' transfer methods.
pub fn direct_io_alignment(file: &File) -> Option<DirectIoAlignment> {
    match statx_dio_align(file.as_fd()) {
        Ok(DioAlignQuery::Supported(a)) => {
            Some(DirectIoAlignment { offset: a.offset.max(1) as usize, memory: a.memory.max(1) as usize })
        }
        Ok(DioAlignQuery::Unsupported) => None,
        Ok(DioAlignQuery::Unknown) | Err(_) => {
            let blksize = file.metadata().map(|m| m.blksize() as usize).unwrap_or(4096);
            let offset = if blksize.is_power_of_two() && blksize >= 512 { blksize } else { 4096 };
            Some(DirectIoAlignment { offset, memory: sys::mem::page_size() })
        }
    }
}

pub(crate) fn cache_name(cache: CachePolicy) -> &'static str {
    match cache {
        CachePolicy::Bypass => "direct",
        CachePolicy::Keep => "buffered",
        CachePolicy::DontCache => "buffered (RWF_DONTCACHE)",
        CachePolicy::Fadvise => "buffered (POSIX_FADV_DONTNEED per chunk)",
    }
}
