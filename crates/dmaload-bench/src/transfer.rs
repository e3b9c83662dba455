//! Every way the kernel offers to move bytes between a file and shareable
//! memory, in both directions: seed 001's method table (mmap + read/write,
//! sendfile, splice through a pipe, copy_file_range, each buffered or
//! direct) plus io_uring with and without registered buffers, into a memfd
//! in 4 KiB pages (the seed's memfd), that memfd exported through udmabuf,
//! a udmabuf's own mapping, or a dma-heap buffer.
//!
//! The io_uring methods are the library's own pipeline: reads go through
//! [`dmaload::LoadRequest::fill`] (caller memory, filled in place), writes
//! through [`dmaload::save::write_at`]. The other methods are the syscalls
//! themselves (rustix).
//!
//! Nothing here hides a refusal: when the kernel rejects a combination
//! (EXDEV for copy_file_range across filesystems, EINVAL for sendfile into
//! a dma-buf, EFAULT for O_DIRECT into a dma-buf mmap) the error says so;
//! an io_uring read that could only be done by copying through a staging
//! ring is EFAULT too, not a staged row under an io_uring name.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use dmaload::heap::{self, CpuAccess, DmaBuf};
use dmaload::load::{LoadOptions, DEFAULT_CHUNK_SIZE, DEFAULT_QUEUE_DEPTH};
use dmaload::save::SaveOptions;
use dmaload::source::direct_io_alignment;
use dmaload::{Engine, Error, ErrorKind, OpenFile, Result};
use dmaload::{Fallback, IoMode};
use rustix::fs::OFlags;
use rustix::io::Errno;
use rustix::pipe::{PipeFlags, SpliceFlags};
use serde::Serialize;

use crate::sys::memory::Memory;

/// How bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// `read`/`write` between the file and the memory's mmap (seed "R/W").
    ReadWrite,
    /// `sendfile` between the file and the memory's fd.
    Sendfile,
    /// `splice` through a pipe enlarged with `F_SETPIPE_SZ`.
    Splice,
    /// `copy_file_range` between the file and the memory's fd.
    CopyFileRange,
    /// io_uring reads/writes with plain addresses (pages pinned per I/O).
    Uring,
    /// io_uring with registered buffers (pinned once).
    UringFixed,
}

impl Method {
    pub const ALL: [Method; 6] = [
        Method::ReadWrite,
        Method::Sendfile,
        Method::Splice,
        Method::CopyFileRange,
        Method::Uring,
        Method::UringFixed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::ReadWrite => "R/W",
            Method::Sendfile => "sendfile",
            Method::Splice => "splice",
            Method::CopyFileRange => "c_f_r",
            Method::Uring => "uring",
            Method::UringFixed => "uring-fixed",
        }
    }

    /// io_uring methods are measured with direct I/O only: registering
    /// buffers exists to skip per-I/O pinning, which only direct I/O does.
    pub fn direct_only(self) -> bool {
        matches!(self, Method::Uring | Method::UringFixed)
    }
}

/// Which way bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Direction {
    /// File → memory (a load).
    Read,
    /// Memory → file (a save).
    Write,
}

impl Direction {
    pub fn name(self) -> &'static str {
        match self {
            Direction::Read => "read",
            Direction::Write => "write",
        }
    }
}

/// The memory on the other side of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryType {
    /// A memfd in 4 KiB pages (`MADV_NOHUGEPAGE`, as the seed's memfd and
    /// `--to memfd`); I/O through its fd and mapping.
    Memfd,
    /// The same memfd exported as a dma-buf with udmabuf; I/O through the
    /// memfd (seed "u+mfd": the way to get direct I/O into a dma-buf).
    UdmabufMemfd,
    /// The same dma-buf, I/O through the dma-buf's own fd and mmap.
    Udmabuf,
    /// A buffer from the system dma-heap, I/O through its fd and mmap.
    DmaHeap,
}

impl MemoryType {
    pub const ALL: [MemoryType; 4] =
        [MemoryType::Memfd, MemoryType::UdmabufMemfd, MemoryType::Udmabuf, MemoryType::DmaHeap];

    pub fn name(self) -> &'static str {
        match self {
            MemoryType::Memfd => "memfd",
            MemoryType::UdmabufMemfd => "u+memfd",
            MemoryType::Udmabuf => "udmabuf",
            MemoryType::DmaHeap => "dma-heap",
        }
    }

    /// Whether this kernel has what the memory type needs, and why not.
    pub fn probe(self) -> Result<(), String> {
        match self {
            MemoryType::Memfd => Ok(()),
            MemoryType::UdmabufMemfd | MemoryType::Udmabuf => heap::udmabuf_probe(),
            MemoryType::DmaHeap => heap::dma_heap_probe(),
        }
    }
}

/// Request size, queue depth and pipe size of a transfer.
#[derive(Debug, Clone, Copy)]
pub struct TransferOptions {
    pub chunk_size: usize,
    pub queue_depth: usize,
    /// Pipe capacity for splice (seed 001 used 32 MiB); capped by
    /// /proc/sys/fs/pipe-max-size for unprivileged processes.
    pub pipe_size: usize,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            chunk_size: DEFAULT_CHUNK_SIZE,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            pipe_size: 32 << 20,
        }
    }
}

/// A piece of memory of one [`MemoryType`], created and dropped (closed)
/// as a unit, so both can be timed. Its fds never leave it.
pub struct TransferBuffer {
    memory: Memory,
    kind: MemoryType,
    len: usize,
}

impl TransferBuffer {
    /// Creates `len` bytes of `kind` memory, mapped but not populated (a
    /// dma-heap buffer and a udmabuf's memfd pages are allocated here,
    /// which is part of their cost).
    pub fn new(kind: MemoryType, len: usize) -> Result<TransferBuffer> {
        let page = rustix::param::page_size();
        // dma-bufs cannot be empty; a page keeps zero-length transfers valid.
        let size = len.div_ceil(page).max(1) * page;
        let memory = match kind {
            MemoryType::Memfd => Memory::memfd(size)?,
            MemoryType::UdmabufMemfd => Memory::udmabuf(size, false)?,
            MemoryType::Udmabuf => Memory::udmabuf(size, true)?,
            MemoryType::DmaHeap => Memory::dma_heap(size)?,
        };
        Ok(TransferBuffer { memory, kind, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn kind(&self) -> MemoryType {
        self.kind
    }

    /// Allocates every page now (`MADV_POPULATE_WRITE` on `threads`
    /// threads) instead of on first touch: the "alloc" half of a synchronous
    /// alloc-then-read.
    pub fn populate(&mut self, threads: usize) -> Result<()> {
        if let MemoryType::Udmabuf | MemoryType::DmaHeap = self.kind {
            // A dma-buf's pages exist from its creation.
            return Ok(());
        }
        dmaload::memory::populate(self.memory.bytes_mut(), threads)
            .map_err(|e| Error::io("populate memory", Path::new("memfd"), e))
    }

    /// Runs `f` on the bytes, inside a dma-buf CPU-access bracket where
    /// there is a dma-buf mapping.
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        sync_cpu(self.cpu_bracket(), CpuAccess::Read, true)?;
        let out = f(&self.memory.bytes()[..self.len]);
        sync_cpu(self.cpu_bracket(), CpuAccess::Read, false)?;
        Ok(out)
    }

    /// Runs `f` on the bytes, mutably, inside a CPU-access bracket.
    pub fn with_bytes_mut<R>(&mut self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        sync_cpu(self.cpu_bracket(), CpuAccess::Write, true)?;
        let len = self.len;
        let out = f(&mut self.memory.bytes_mut()[..len]);
        sync_cpu(self.cpu_bracket(), CpuAccess::Write, false)?;
        Ok(out)
    }

    /// The dma-buf whose mmap the CPU uses, if the mapping is one.
    fn cpu_bracket(&self) -> Option<&DmaBuf> {
        match self.kind {
            MemoryType::Udmabuf | MemoryType::DmaHeap => self.memory.dmabuf(),
            MemoryType::Memfd | MemoryType::UdmabufMemfd => None,
        }
    }
}

fn sync_cpu(dmabuf: Option<&DmaBuf>, access: CpuAccess, start: bool) -> Result<()> {
    match dmabuf {
        Some(buf) => {
            let result = if start { buf.begin_cpu_access(access) } else { buf.end_cpu_access(access) };
            result.map_err(|e| Error::io("DMA_BUF_IOCTL_SYNC", Path::new("dma-buf"), e))
        }
        None => Ok(()),
    }
}

/// Sets or clears `O_DIRECT` on an open file.
pub(crate) fn set_direct(file: &File, direct: bool) -> io::Result<()> {
    let mut flags = rustix::fs::fcntl_getfl(file)?;
    flags.set(OFlags::DIRECT, direct);
    Ok(rustix::fs::fcntl_setfl(file, flags)?)
}

/// `pipe2(O_CLOEXEC)` resized with `F_SETPIPE_SZ` to at most `want` bytes:
/// unprivileged processes are capped by /proc/sys/fs/pipe-max-size, so on
/// EPERM it halves down to the default. Returns (read end, write end,
/// capacity).
fn pipe_with_capacity(want: usize) -> io::Result<(OwnedFd, OwnedFd, usize)> {
    let (read, write) = rustix::pipe::pipe_with(PipeFlags::CLOEXEC)?;
    let mut size = want.max(4096);
    loop {
        match rustix::pipe::fcntl_setpipe_size(&write, size) {
            Ok(capacity) => return Ok((read, write, capacity)),
            Err(Errno::PERM | Errno::NOMEM) if size > 65536 => size /= 2,
            Err(e) => return Err(e.into()),
        }
    }
}

/// The file side of transfers: opened buffered or O_DIRECT, for reading or
/// (created, truncated) for writing.
pub struct TransferFile {
    file: File,
    /// For reading: the file as the library's pipeline reads it (the same
    /// inode, reopened through /proc/self/fd).
    source: Option<OpenFile>,
    path: PathBuf,
    direct: bool,
    align: usize,
}

impl TransferFile {
    pub fn open(path: impl AsRef<Path>, direction: Direction, direct: bool) -> Result<TransferFile> {
        let path = path.as_ref();
        let mut options = OpenOptions::new();
        match direction {
            Direction::Read => options.read(true),
            Direction::Write => options.write(true).create(true).truncate(true),
        };
        let file = options.open(path).map_err(|e| Error::io("open", path, e))?;
        let page = rustix::param::page_size();
        let align = match direct {
            false => 1,
            true => {
                set_direct(&file, true).map_err(|e| Error::io("open O_DIRECT", path, e))?;
                direct_io_alignment(&file).map_or(page, |a| a.offset)
            }
        };
        if align > page {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "open O_DIRECT",
                path,
                format!("direct I/O alignment {align} exceeds the page size {page}"),
            ));
        }
        let source = match direction {
            Direction::Read => Some(OpenFile::from_fd(file.as_fd())?),
            Direction::Write => None,
        };
        Ok(TransferFile { file, source, path: path.to_owned(), direct, align })
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// `fdatasync`: a write is only done once it is on the device.
    pub fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(|e| Error::io("fdatasync", &self.path, e))
    }

    fn error(&self, op: &'static str, offset: u64, err: impl Into<io::Error>) -> Error {
        Error::io(op, &self.path, err.into()).at(offset)
    }

    fn eof(&self, at: u64, expected: u64) -> Error {
        Error::new(
            ErrorKind::Truncated,
            "read",
            &self.path,
            format!("file ended at offset {at} but data was expected up to offset {expected}"),
        )
        .at(at)
    }
}

/// Moves `buf.len()` bytes between `buf` and `file` at file `offset` with
/// `method`, in `direction`. Returns the fallbacks taken (the io_uring
/// methods' only: registration refused). Writes are not synced; call
/// [`TransferFile::sync`].
pub fn transfer(
    buf: &mut TransferBuffer,
    file: &TransferFile,
    offset: u64,
    method: Method,
    direction: Direction,
    options: &TransferOptions,
) -> Result<Vec<Fallback>> {
    let access = if direction == Direction::Read { CpuAccess::Write } else { CpuAccess::Read };
    // Only R/W and io_uring touch the memory through the CPU mapping.
    let cpu = matches!(method, Method::ReadWrite | Method::Uring | Method::UringFixed);
    let sync = |buf: &TransferBuffer, start: bool| match cpu {
        true => sync_cpu(buf.cpu_bracket(), access, start),
        false => Ok(()),
    };
    sync(buf, true)?;
    let result = match direction {
        Direction::Read => read_into(buf, file, offset, method, options),
        Direction::Write => write_from(buf, file, offset, method, options),
    };
    sync(buf, false)?;
    result
}

/// File → memory. Direct reads ask for the length rounded up to the
/// alignment; the kernel returns the short count at end of file.
fn read_into(
    buf: &mut TransferBuffer,
    file: &TransferFile,
    offset: u64,
    method: Method,
    options: &TransferOptions,
) -> Result<Vec<Fallback>> {
    let need = buf.len;
    if need == 0 {
        return Ok(Vec::new());
    }
    let want = need.div_ceil(file.align) * file.align;
    let fd = file.file.as_fd();
    let mut done = 0usize;
    let mut file_pos = offset;
    let mut mem_pos = 0u64;
    let advance = |done: &mut usize, got: usize| -> Result<bool> {
        if got == 0 {
            return Err(file.eof(offset + *done as u64, offset + need as u64));
        }
        *done += got;
        Ok(*done >= need)
    };
    match method {
        Method::ReadWrite => {
            let dst = buf.memory.bytes_mut();
            loop {
                let got = match file.file.read_at(&mut dst[done..want], offset + done as u64) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    other => other.map_err(|e| file.error("read", offset + done as u64, e))?,
                };
                if advance(&mut done, got)? {
                    return Ok(Vec::new());
                }
            }
        }
        Method::Sendfile => {
            let io = buf.memory.io();
            (&*io).seek(SeekFrom::Start(0)).map_err(|e| file.error("lseek memory", 0, e))?;
            loop {
                let got = rustix::fs::sendfile(io, fd, Some(&mut file_pos), want - done)
                    .map_err(|e| file.error("sendfile", offset + done as u64, e))?;
                if advance(&mut done, got)? {
                    return Ok(Vec::new());
                }
            }
        }
        Method::Splice => {
            let io = buf.memory.io();
            let (pipe_r, pipe_w, capacity) =
                pipe_with_capacity(options.pipe_size).map_err(|e| file.error("pipe", offset, e))?;
            loop {
                let len = (want - done).min(capacity);
                let got =
                    rustix::pipe::splice(fd, Some(&mut file_pos), &pipe_w, None, len, SpliceFlags::MOVE)
                        .map_err(|e| file.error("splice from file", offset + done as u64, e))?;
                let mut left = got;
                while left > 0 {
                    left -=
                        rustix::pipe::splice(&pipe_r, None, io, Some(&mut mem_pos), left, SpliceFlags::MOVE)
                            .map_err(|e| file.error("splice to memory", offset + done as u64, e))?;
                }
                if advance(&mut done, got)? {
                    return Ok(Vec::new());
                }
            }
        }
        Method::CopyFileRange => {
            let io = buf.memory.io();
            loop {
                let got =
                    rustix::fs::copy_file_range(fd, Some(&mut file_pos), io, Some(&mut mem_pos), want - done)
                        .map_err(|e| file.error("copy_file_range", offset + done as u64, e))?;
                if advance(&mut done, got)? {
                    return Ok(Vec::new());
                }
            }
        }
        Method::Uring => uring_read(buf, file, offset, Engine::Uring, options),
        Method::UringFixed => uring_read(buf, file, offset, Engine::UringFixed, options),
    }
}

/// io_uring reads through the library's pipeline into the buffer as
/// caller memory ([`dmaload::LoadRequest::fill`]): a helper thread populates
/// each gather, and for `uring-fixed` registers it, ahead of the reads.
fn uring_read(
    buf: &mut TransferBuffer,
    file: &TransferFile,
    offset: u64,
    engine: Engine,
    options: &TransferOptions,
) -> Result<Vec<Fallback>> {
    let Some(source) = &file.source else {
        let why = "the file was opened for writing";
        return Err(Error::new(ErrorKind::InvalidInput, "read", &file.path, why));
    };
    if offset % file.align as u64 != 0 {
        let why = format!("direct io_uring reads must start at a multiple of {} bytes", file.align);
        return Err(Error::new(ErrorKind::InvalidInput, "read", &file.path, why).at(offset));
    }
    let end = offset + buf.len as u64;
    if end > source.len() {
        return Err(file.eof(source.len().max(offset), end));
    }
    let load_options = LoadOptions {
        engine,
        mode: if file.direct { IoMode::Direct } else { IoMode::Buffered },
        chunk_size: options.chunk_size,
        queue_depth: options.queue_depth,
        measure_page_cache: false,
        ..LoadOptions::default()
    };
    let len = buf.len;
    let report = dmaload::LoadRequest::open(source)
        .range(offset, None)
        .options(&load_options)
        .fill(&mut buf.memory.bytes_mut()[..len])?;
    // Memory that refuses direct I/O into it (a dma-buf's mmap) was read by
    // copying through a staging ring, which load_into records as a fallback
    // from "in place": not what the method names. (A range too short to
    // hold a whole page is staged without one, as any load_into's edges are.)
    if report.fallbacks.iter().any(|f| f.from == "in place") {
        return Err(file.error("io_uring read in place", offset, Errno::FAULT));
    }
    Ok(report.fallbacks)
}

/// Memory → file. With O_DIRECT the aligned part goes direct and the
/// unaligned tail through the page cache (O_DIRECT cleared for it).
fn write_from(
    buf: &mut TransferBuffer,
    file: &TransferFile,
    offset: u64,
    method: Method,
    options: &TransferOptions,
) -> Result<Vec<Fallback>> {
    let len = buf.len;
    let aligned = len / file.align * file.align;
    let fd = file.file.as_fd();
    let mut fallbacks = Vec::new();
    let mut done = 0usize;
    let mut file_pos = offset;
    let mut mem_pos = 0u64;
    let wrote = |n: usize, at: usize| -> Result<usize> {
        if n == 0 {
            Err(file.error("write", offset + at as u64, io::Error::from(io::ErrorKind::WriteZero)))
        } else {
            Ok(n)
        }
    };
    match method {
        Method::ReadWrite => {
            let src = &buf.memory.bytes()[..aligned];
            file.file.write_all_at(src, offset).map_err(|e| file.error("write", offset, e))?;
        }
        Method::Sendfile => {
            let io = buf.memory.io();
            (&file.file).seek(SeekFrom::Start(offset)).map_err(|e| file.error("lseek", offset, e))?;
            while done < aligned {
                let n = rustix::fs::sendfile(fd, io, Some(&mut mem_pos), aligned - done)
                    .map_err(|e| file.error("sendfile", offset + done as u64, e))?;
                done += wrote(n, done)?;
            }
        }
        Method::Splice => {
            let io = buf.memory.io();
            let (pipe_r, pipe_w, capacity) =
                pipe_with_capacity(options.pipe_size).map_err(|e| file.error("pipe", offset, e))?;
            while done < aligned {
                let len = (aligned - done).min(capacity);
                let n = rustix::pipe::splice(io, Some(&mut mem_pos), &pipe_w, None, len, SpliceFlags::MOVE)
                    .map_err(|e| file.error("splice from memory", offset + done as u64, e))?;
                let mut left = wrote(n, done)?;
                while left > 0 {
                    let out =
                        rustix::pipe::splice(&pipe_r, None, fd, Some(&mut file_pos), left, SpliceFlags::MOVE)
                            .map_err(|e| file.error("splice to file", offset + done as u64, e))?;
                    left -= wrote(out, done)?;
                }
                done += n;
            }
        }
        Method::CopyFileRange => {
            let io = buf.memory.io();
            while done < aligned {
                let n = rustix::fs::copy_file_range(
                    io,
                    Some(&mut mem_pos),
                    fd,
                    Some(&mut file_pos),
                    aligned - done,
                )
                .map_err(|e| file.error("copy_file_range", offset + done as u64, e))?;
                done += wrote(n, done)?;
            }
        }
        Method::Uring | Method::UringFixed => {
            let save = SaveOptions {
                engine: if method == Method::UringFixed { Engine::UringFixed } else { Engine::Uring },
                chunk_size: options.chunk_size.div_ceil(file.align) * file.align,
                queue_depth: options.queue_depth,
                threads: 1,
                ..SaveOptions::default()
            };
            let src = &buf.memory.bytes()[..aligned];
            fallbacks = dmaload::save::write_at(&file.file, &file.path, offset, src, &save)?;
        }
    }
    if aligned < len {
        let tail = &buf.memory.bytes()[aligned..len];
        let at = offset + aligned as u64;
        if file.direct {
            set_direct(&file.file, false).map_err(|e| file.error("fcntl", at, e))?;
        }
        let written = file.file.write_all_at(tail, at).map_err(|e| file.error("write", at, e));
        if file.direct {
            set_direct(&file.file, true).map_err(|e| file.error("fcntl", at, e))?;
        }
        written?;
    }
    Ok(fallbacks)
}
