//! Every way the kernel offers to move bytes between a file and shareable
//! memory, in both directions: seed 001's method table (mmap + read/write,
//! sendfile, splice through a pipe, copy_file_range, each buffered or
//! direct) plus io_uring with and without registered buffers, into memfd
//! memory, memfd exported through udmabuf, a udmabuf's own mapping, or a
//! dma-heap buffer.
//!
//! Nothing here hides a refusal: when the kernel rejects a combination
//! (EXDEV for copy_file_range across filesystems, EINVAL for sendfile into
//! a dma-buf, EFAULT for O_DIRECT into a dma-buf mmap) the error says so.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::engine::write::WriteJob;
use crate::engine::{CachePolicy, Engine};
use crate::error::{Error, ErrorKind, Result};
use crate::heap::{self, CpuAccess, DmaBuf};
use crate::options::{Fallback, LoadOptions, DEFAULT_CHUNK_SIZE, DEFAULT_QUEUE_DEPTH};
use crate::pipeline::fill_mapping;
use crate::plan::Plan;
use crate::source::ReadSetup;
use crate::sys;
use crate::sys::file::{statx_dio_align, DioAlignQuery};
use crate::sys::mem::Mapping;

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
    /// A memfd; I/O through its fd and mapping.
    Memfd,
    /// A memfd exported as a dma-buf with udmabuf; I/O through the memfd
    /// (seed "u+mfd": the way to get direct I/O into a dma-buf).
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
/// as a unit, so both can be timed.
pub struct TransferBuffer {
    // Field order is drop order: unmap, then close the fds.
    mapping: Mapping,
    io: File,
    dmabuf: Option<DmaBuf>,
    _memfd: Option<OwnedFd>,
    kind: MemoryType,
    len: usize,
}

impl TransferBuffer {
    /// Creates `len` bytes of `kind` memory, mapped but not populated (a
    /// dma-heap buffer and a udmabuf's memfd pages are allocated here,
    /// which is part of their cost).
    pub fn new(kind: MemoryType, len: usize) -> Result<TransferBuffer> {
        let page = sys::mem::page_size();
        // dma-bufs cannot be empty; a page keeps zero-length transfers valid.
        let size = len.div_ceil(page).max(1) * page;
        let memfd_path = Path::new("memfd");
        let memfd = || -> Result<OwnedFd> {
            let fd = sys::mem::memfd_create(c"dmaload-transfer", sys::mem::MemfdPages::Shmem)
                .map_err(|e| Error::io("memfd_create", memfd_path, e))?;
            sys::mem::set_len(fd.as_fd(), size as u64).map_err(|e| Error::io("ftruncate", memfd_path, e))?;
            Ok(fd)
        };
        let map_memfd = |fd: &OwnedFd| {
            Mapping::memfd(fd.as_fd(), size, sys::mem::HugePageAdvice::Huge)
                .map_err(|e| Error::io("mmap", memfd_path, e))
        };
        let map_dmabuf = |fd: &OwnedFd, path: &str| {
            Mapping::shared(fd.as_fd(), size).map_err(|e| Error::io("mmap", Path::new(path), e))
        };
        let dup = |fd: &OwnedFd, path: &str| {
            fd.try_clone().map(File::from).map_err(|e| Error::io("dup", Path::new(path), e))
        };
        let (mapping, io, dmabuf, memfd) = match kind {
            MemoryType::Memfd => {
                let fd = memfd()?;
                (map_memfd(&fd)?, dup(&fd, "memfd")?, None, Some(fd))
            }
            MemoryType::UdmabufMemfd | MemoryType::Udmabuf => {
                let fd = memfd()?;
                // udmabuf requires the memfd's size to be fixed.
                sys::mem::add_seals(fd.as_fd(), sys::mem::Seals::SHRINK)
                    .map_err(|e| Error::io("seal memfd", memfd_path, e))?;
                let dmabuf = heap::udmabuf_export(&[(fd.as_fd(), 0, size as u64)])?;
                let dmabuf_fd =
                    dmabuf.fd().try_clone_to_owned().map_err(|e| Error::io("dup", memfd_path, e))?;
                if kind == MemoryType::UdmabufMemfd {
                    (map_memfd(&fd)?, dup(&fd, "memfd")?, Some(dmabuf), Some(fd))
                } else {
                    (
                        map_dmabuf(&dmabuf_fd, heap::UDMABUF_DEVICE)?,
                        File::from(dmabuf_fd),
                        Some(dmabuf),
                        Some(fd),
                    )
                }
            }
            MemoryType::DmaHeap => {
                let dmabuf = heap::dma_heap_alloc(size as u64)?;
                let fd = dmabuf
                    .fd()
                    .try_clone_to_owned()
                    .map_err(|e| Error::io("dup", Path::new(heap::SYSTEM_HEAP), e))?;
                (map_dmabuf(&fd, heap::SYSTEM_HEAP)?, File::from(fd), Some(dmabuf), None)
            }
        };
        Ok(TransferBuffer { mapping, io, dmabuf, _memfd: memfd, kind, len })
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

    /// The dma-buf, for the types that have one.
    pub fn dmabuf(&self) -> Option<&DmaBuf> {
        self.dmabuf.as_ref()
    }

    /// Allocates every page now (`MADV_POPULATE_WRITE` on `threads`
    /// threads) instead of on first touch: the "alloc" half of a synchronous
    /// alloc-then-read.
    pub fn populate(&mut self, threads: usize) -> Result<()> {
        if let MemoryType::Udmabuf | MemoryType::DmaHeap = self.kind {
            // A dma-buf's pages exist from its creation.
            return Ok(());
        }
        let len = self.mapping.as_slice().len();
        crate::pipeline::populate_range(self.mapping.writer(), 0..len, threads)
            .map_err(|e| Error::io("populate memory", Path::new("memfd"), e))
    }

    /// Runs `f` on the bytes, inside a dma-buf CPU-access bracket where
    /// there is a dma-buf mapping.
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.cpu_access(CpuAccess::Read, || f(&self.mapping.as_slice()[..self.len]))
    }

    /// Runs `f` on the bytes, mutably, inside a CPU-access bracket.
    pub fn with_bytes_mut<R>(&mut self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let len = self.len;
        let bracket = cpu_bracket(self.kind, &self.dmabuf);
        sync_cpu(bracket, CpuAccess::Write, true)?;
        let out = f(&mut self.mapping.as_mut_slice()[..len]);
        sync_cpu(bracket, CpuAccess::Write, false)?;
        Ok(out)
    }

    fn cpu_access<R>(&self, access: CpuAccess, f: impl FnOnce() -> R) -> Result<R> {
        let bracket = cpu_bracket(self.kind, &self.dmabuf);
        sync_cpu(bracket, access, true)?;
        let out = f();
        sync_cpu(bracket, access, false)?;
        Ok(out)
    }
}

/// The dma-buf whose mmap the CPU uses, if the mapping is one.
fn cpu_bracket(kind: MemoryType, dmabuf: &Option<DmaBuf>) -> Option<&DmaBuf> {
    match kind {
        MemoryType::Udmabuf | MemoryType::DmaHeap => dmabuf.as_ref(),
        MemoryType::Memfd | MemoryType::UdmabufMemfd => None,
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

/// The file side of transfers: opened buffered or O_DIRECT, for reading or
/// (created, truncated) for writing.
pub struct TransferFile {
    file: File,
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
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let op = if direct { "open O_DIRECT" } else { "open" };
        let file = options.open(path).map_err(|e| Error::io(op, path, e))?;
        let page = sys::mem::page_size();
        let align = match (direct, statx_dio_align(file.as_fd())) {
            (false, _) => 1,
            (true, Ok(DioAlignQuery::Supported(a))) => a.offset.max(1) as usize,
            (true, _) => page,
        };
        if align > page {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                op,
                path,
                format!("direct I/O alignment {align} exceeds the page size {page}"),
            ));
        }
        Ok(TransferFile { file, path: path.to_owned(), direct, align })
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// `fdatasync`: a write is only done once it is on the device.
    pub fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(|e| Error::io("fdatasync", &self.path, e))
    }

    fn error(&self, op: &'static str, offset: u64, err: io::Error) -> Error {
        Error::io(op, &self.path, err).at(offset)
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
/// `method`, in `direction`. Returns the fallbacks taken (only the io_uring
/// write path has any: registration refused). Writes are not synced; call
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
        true => sync_cpu(cpu_bracket(buf.kind, &buf.dmabuf), access, start),
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
    let io = buf.io.as_fd();
    let mut done = 0usize;
    let mut file_pos = offset as i64;
    let mut mem_pos = 0i64;
    let advance = |done: &mut usize, got: usize| -> Result<bool> {
        if got == 0 {
            return Err(file.eof(offset + *done as u64, offset + need as u64));
        }
        *done += got;
        Ok(*done >= need)
    };
    match method {
        Method::ReadWrite => {
            let dst = buf.mapping.writer();
            loop {
                let got = match sys::file::pread_into(fd, dst, done..want, offset + done as u64, 0) {
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    other => other.map_err(|e| file.error("read", offset + done as u64, e))?,
                };
                if advance(&mut done, got)? {
                    return Ok(Vec::new());
                }
            }
        }
        Method::Sendfile => {
            (&buf.io).seek(SeekFrom::Start(0)).map_err(|e| file.error("lseek memory", 0, e))?;
            loop {
                let got = sys::file::sendfile(io, fd, Some(&mut file_pos), want - done)
                    .map_err(|e| file.error("sendfile", offset + done as u64, e))?;
                if advance(&mut done, got)? {
                    return Ok(Vec::new());
                }
            }
        }
        Method::Splice => {
            let (pipe_r, pipe_w, capacity) = sys::file::pipe_with_capacity(options.pipe_size)
                .map_err(|e| file.error("pipe", offset, e))?;
            loop {
                let len = (want - done).min(capacity);
                let got = sys::file::splice(fd, Some(&mut file_pos), pipe_w.as_fd(), None, len)
                    .map_err(|e| file.error("splice from file", offset + done as u64, e))?;
                let mut left = got;
                while left > 0 {
                    left -= sys::file::splice(pipe_r.as_fd(), None, io, Some(&mut mem_pos), left)
                        .map_err(|e| file.error("splice to memory", offset + done as u64, e))?;
                }
                if advance(&mut done, got)? {
                    return Ok(Vec::new());
                }
            }
        }
        Method::CopyFileRange => loop {
            let got = sys::file::copy_file_range(fd, &mut file_pos, io, &mut mem_pos, want - done)
                .map_err(|e| file.error("copy_file_range", offset + done as u64, e))?;
            if advance(&mut done, got)? {
                return Ok(Vec::new());
            }
        },
        Method::Uring => uring_read(buf, file, offset, Engine::Uring, options),
        Method::UringFixed => uring_read(buf, file, offset, Engine::UringFixed, options),
    }
}

/// io_uring reads through the load pipeline ([`crate::load`]): a helper
/// thread populates each gather, and for `uring-fixed` registers it, ahead
/// of the reads. (Registering each window on the submitting thread, where
/// the pinning also faulted the pages in, ran at half the plain engine's
/// speed.)
fn uring_read(
    buf: &mut TransferBuffer,
    file: &TransferFile,
    offset: u64,
    engine: Engine,
    options: &TransferOptions,
) -> Result<Vec<Fallback>> {
    if offset % file.align as u64 != 0 {
        let why = format!("direct io_uring reads must start at a multiple of {} bytes", file.align);
        return Err(Error::new(ErrorKind::InvalidInput, "read", &file.path, why).at(offset));
    }
    let load_options = LoadOptions {
        engine,
        chunk_size: options.chunk_size,
        queue_depth: options.queue_depth,
        ..LoadOptions::default()
    };
    let len = buf.len as u64;
    let page = sys::mem::page_size();
    let plan = Plan::new(offset, len, file.align, load_options.chunk_size, load_options.gather_size, page);
    let setup = ReadSetup {
        file: file.file.try_clone().map_err(|e| file.error("dup", offset, e))?,
        cache: if file.direct { CachePolicy::Bypass } else { CachePolicy::Keep },
        align: file.align,
    };
    let (run, _) = fill_mapping(&file.path, &setup, &plan, len, &load_options, buf.mapping.writer())?;
    Ok(run.fallbacks)
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
    let io = buf.io.as_fd();
    let src = &buf.mapping.as_slice()[..aligned];
    let mut fallbacks = Vec::new();
    let mut done = 0usize;
    let mut file_pos = offset as i64;
    let mut mem_pos = 0i64;
    let wrote = |n: usize, at: usize| -> Result<usize> {
        if n == 0 {
            Err(file.error("write", offset + at as u64, io::Error::from(io::ErrorKind::WriteZero)))
        } else {
            Ok(n)
        }
    };
    match method {
        Method::ReadWrite => {
            file.file.write_all_at(src, offset).map_err(|e| file.error("write", offset, e))?;
        }
        Method::Sendfile => {
            (&file.file).seek(SeekFrom::Start(offset)).map_err(|e| file.error("lseek", offset, e))?;
            while done < aligned {
                let n = sys::file::sendfile(fd, io, Some(&mut mem_pos), aligned - done)
                    .map_err(|e| file.error("sendfile", offset + done as u64, e))?;
                done += wrote(n, done)?;
            }
        }
        Method::Splice => {
            let (pipe_r, pipe_w, capacity) = sys::file::pipe_with_capacity(options.pipe_size)
                .map_err(|e| file.error("pipe", offset, e))?;
            while done < aligned {
                let n = sys::file::splice(
                    io,
                    Some(&mut mem_pos),
                    pipe_w.as_fd(),
                    None,
                    (aligned - done).min(capacity),
                )
                .map_err(|e| file.error("splice from memory", offset + done as u64, e))?;
                let mut left = wrote(n, done)?;
                while left > 0 {
                    let out = sys::file::splice(pipe_r.as_fd(), None, fd, Some(&mut file_pos), left)
                        .map_err(|e| file.error("splice to file", offset + done as u64, e))?;
                    left -= wrote(out, done)?;
                }
                done += n;
            }
        }
        Method::CopyFileRange => {
            while done < aligned {
                let n = sys::file::copy_file_range(io, &mut mem_pos, fd, &mut file_pos, aligned - done)
                    .map_err(|e| file.error("copy_file_range", offset + done as u64, e))?;
                done += wrote(n, done)?;
            }
        }
        Method::Uring | Method::UringFixed => {
            let job = WriteJob {
                path: &file.path,
                file: &file.file,
                src: src.into(),
                file_offset: offset,
                chunk: options.chunk_size.div_ceil(file.align) * file.align,
                queue_depth: options.queue_depth,
                threads: 1,
            };
            let engine = if method == Method::UringFixed { Engine::UringFixed } else { Engine::Uring };
            fallbacks = job.run(engine)?.fallbacks;
        }
    }
    if aligned < len {
        let tail = &buf.mapping.as_slice()[aligned..len];
        let at = offset + aligned as u64;
        if file.direct {
            sys::file::set_direct(fd, false).map_err(|e| file.error("fcntl", at, e))?;
        }
        let written = file.file.write_all_at(tail, at).map_err(|e| file.error("write", at, e));
        if file.direct {
            sys::file::set_direct(fd, true).map_err(|e| file.error("fcntl", at, e))?;
        }
        written?;
    }
    Ok(fallbacks)
}
