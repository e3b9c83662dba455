//! Dma-bufs: allocated from a dma-heap (`/dev/dma_heap/NAME`) or exported
//! from memfds with udmabuf, mapped with CPU access bracketed by
//! `DMA_BUF_IOCTL_SYNC`. Host memory (memfd, hugetlb, anonymous) is
//! [`crate::memory`]'s.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use crate::error::{Error, ErrorKind, Result};
use crate::sys;
use crate::sys::dmabuf;
use crate::sys::mem;
pub use crate::sys::mem::SharedMapping;

/// The system dma-heap: page-backed memory any device driver can import.
pub const SYSTEM_HEAP: &str = "/dev/dma_heap/system";
/// The udmabuf device: turns memfd pages into a dma-buf.
pub const UDMABUF_DEVICE: &str = "/dev/udmabuf";
const UDMABUF_SIZE_LIMIT: &str = "/sys/module/udmabuf/parameters/size_limit_mb";

/// Which CPU accesses a [`DmaBuf::begin_cpu_access`] bracket covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuAccess {
    Read,
    Write,
    ReadWrite,
}

impl From<CpuAccess> for dmabuf::SyncAccess {
    fn from(access: CpuAccess) -> Self {
        match access {
            CpuAccess::Read => dmabuf::SyncAccess::Read,
            CpuAccess::Write => dmabuf::SyncAccess::Write,
            CpuAccess::ReadWrite => dmabuf::SyncAccess::ReadWrite,
        }
    }
}

/// A dma-buf: memory that devices can import and other processes can map,
/// passed around as an fd.
#[derive(Debug)]
pub struct DmaBuf {
    fd: OwnedFd,
    len: u64,
}

impl DmaBuf {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// A dma-buf received as an fd (from a driver, another process,
    /// [`DmaBuf::into_fd`]); its size is the fd's (`lseek(SEEK_END)`, then
    /// back to 0). An fd of anything else (a memfd, a file) is an
    /// `InvalidInput` error: dma-bufs are known by their filesystem
    /// (`DMA_BUF_MAGIC`), not by a name.
    pub fn from_fd(fd: OwnedFd) -> io::Result<DmaBuf> {
        use std::io::Seek;
        if !dmabuf::is_dmabuf(fd.as_fd())? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a dma-buf (its filesystem is not dmabuf)",
            ));
        }
        let mut file = File::from(fd);
        let len = file.seek(io::SeekFrom::End(0))?;
        file.rewind()?;
        Ok(DmaBuf { fd: file.into(), len })
    }

    /// Call before the CPU reads or writes the buffer's mmap
    /// (`DMA_BUF_IOCTL_SYNC` start): on devices that are not cache-coherent
    /// the exporter invalidates or flushes CPU caches here.
    pub fn begin_cpu_access(&self, access: CpuAccess) -> io::Result<()> {
        dmabuf::sync(self.fd.as_fd(), access.into(), true)
    }

    /// Call after the CPU is done with the mmap (`DMA_BUF_IOCTL_SYNC` end).
    pub fn end_cpu_access(&self, access: CpuAccess) -> io::Result<()> {
        dmabuf::sync(self.fd.as_fd(), access.into(), false)
    }

    /// Maps the dma-buf for the CPU (`mmap` of its fd) inside a
    /// begin/end CPU-access bracket that lasts as long as the map. Devices
    /// and other processes may write a dma-buf at any time, so the map is a
    /// [`SharedMapping`]: bytes are copied in and out, and slices are
    /// `unsafe`.
    pub fn map(&self, access: CpuAccess) -> io::Result<DmaBufMap<'_>> {
        let mapping =
            SharedMapping::new(self.fd.as_fd(), usize::try_from(self.len).map_err(io::Error::other)?)?;
        self.begin_cpu_access(access)?;
        Ok(DmaBufMap { mapping, buf: self, access })
    }
}

/// The CPU's view of a [`DmaBuf`]: a [`SharedMapping`]. Dropping it ends
/// the CPU-access bracket and unmaps.
pub struct DmaBufMap<'a> {
    mapping: SharedMapping,
    buf: &'a DmaBuf,
    access: CpuAccess,
}

impl std::ops::Deref for DmaBufMap<'_> {
    type Target = SharedMapping;
    fn deref(&self) -> &SharedMapping {
        &self.mapping
    }
}

impl std::ops::DerefMut for DmaBufMap<'_> {
    fn deref_mut(&mut self) -> &mut SharedMapping {
        &mut self.mapping
    }
}

impl Drop for DmaBufMap<'_> {
    fn drop(&mut self) {
        // Nothing to do on failure: the bytes are in place either way.
        let _ = self.buf.end_cpu_access(self.access);
    }
}

/// Why `device` cannot be used here, if it cannot: missing (kernel built
/// without it) or not openable (permissions).
fn probe_device(device: &str, config: &str) -> Result<File, String> {
    match OpenOptions::new().read(true).write(device == UDMABUF_DEVICE).open(device) {
        Ok(file) => Ok(file),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Err(format!("{device} does not exist (kernel {} without {config})", kernel()))
        }
        Err(e) => Err(format!("cannot open {device}: {e}")),
    }
}

fn kernel() -> String {
    sys::process::kernel_release().unwrap_or_else(|_| "unknown".into())
}

/// Whether the system dma-heap can be used, and why not.
pub fn dma_heap_probe() -> Result<(), String> {
    probe_device(SYSTEM_HEAP, "CONFIG_DMABUF_HEAPS_SYSTEM").map(drop)
}

/// Whether udmabuf can be used, and why not.
pub fn udmabuf_probe() -> Result<(), String> {
    probe_device(UDMABUF_DEVICE, "CONFIG_UDMABUF").map(drop)
}

/// udmabuf's `size_limit_mb` module parameter, in bytes, where readable.
pub fn udmabuf_size_limit() -> Option<u64> {
    std::fs::read_to_string(UDMABUF_SIZE_LIMIT).ok()?.trim().parse::<u64>().ok().map(|mb| mb << 20)
}

/// Allocates `len` bytes from the system dma-heap (`DMA_HEAP_IOCTL_ALLOC`,
/// Linux 5.6). The pages are zeroed and allocated at once.
pub fn dma_heap_alloc(len: u64) -> Result<DmaBuf> {
    DmaHeap::open(DEFAULT_DMA_HEAP)?.alloc(len)
}

/// The heap `dma-heap` alone names.
pub const DEFAULT_DMA_HEAP: &str = "system";

/// The directory of the dma-heaps (Linux 5.6): one character device per heap.
pub const DMA_HEAP_DIR: &str = "/dev/dma_heap";

/// An open dma-heap, `/dev/dma_heap/NAME`: allocates dma-bufs.
#[derive(Debug)]
pub struct DmaHeap {
    file: File,
    path: std::path::PathBuf,
}

impl DmaHeap {
    /// Opens the heap `name` (`system`, `linux,cma`, ...). A heap that does
    /// not exist is an [`ErrorKind::InvalidInput`] error naming its path and
    /// the heaps there are.
    pub fn open(name: &str) -> Result<DmaHeap> {
        let path = Path::new(DMA_HEAP_DIR).join(name);
        let config =
            if name == DEFAULT_DMA_HEAP { "CONFIG_DMABUF_HEAPS_SYSTEM" } else { "a heap of that name" };
        let file = probe_device(&path.to_string_lossy(), config).map_err(|why| {
            let heaps = match std::fs::read_dir(DMA_HEAP_DIR) {
                Ok(dir) => {
                    let mut names: Vec<String> = dir
                        .filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect();
                    names.sort();
                    format!("heaps here: {}", if names.is_empty() { "none".into() } else { names.join(", ") })
                }
                Err(_) => format!("{DMA_HEAP_DIR} does not exist: no dma-heaps on this kernel"),
            };
            Error::new(ErrorKind::InvalidInput, "open dma-heap", &path, format!("{why}; {heaps}"))
        })?;
        Ok(DmaHeap { file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new dma-buf of `len` bytes rounded up to whole pages
    /// (`DMA_HEAP_IOCTL_ALLOC`): allocated and zeroed by the kernel before
    /// this returns.
    pub fn alloc(&self, len: u64) -> Result<DmaBuf> {
        let len = len.div_ceil(mem::page_size() as u64) * mem::page_size() as u64;
        let fd = dmabuf::dma_heap_alloc(self.file.as_fd(), len)
            .map_err(|e| Error::io("dma-heap alloc", &self.path, e))?;
        Ok(DmaBuf { fd, len })
    }
}

/// Exports `len` bytes of a memfd the caller made, from `offset` (both
/// page-aligned; the memfd sealed `F_SEAL_SHRINK`), as a dma-buf with
/// udmabuf, without copying (at most udmabuf's `size_limit_mb`, 64 MiB by
/// default).
/// Whatever imports the dma-buf may write the memfd's pages, so a memfd
/// sealed against writes (`F_SEAL_FUTURE_WRITE`: the one behind a
/// [`crate::Buffer`] once [`crate::Buffer::memfd`] handed it out, whose bytes the buffer
/// lends as `&[u8]`) is refused: export a buffer with [`crate::Buffer::into_dmabuf`].
pub fn udmabuf_from_memfd(memfd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<DmaBuf> {
    let path = Path::new("memfd");
    let seals = mem::seals(memfd).map_err(|e| Error::io("F_GET_SEALS", path, e))?;
    if seals.contains(mem::Seals::FUTURE_WRITE) {
        let why = "the memfd is sealed against writes (a buffer's shared memfd): export the buffer \
                   itself with Buffer::into_dmabuf";
        return Err(Error::new(ErrorKind::InvalidInput, "udmabuf create", path, why));
    }
    udmabuf_export(&[(memfd, offset, len)])
}

/// Exports ranges of memfds (sealed `F_SEAL_SHRINK`, offsets and sizes
/// page-aligned) as one dma-buf with udmabuf, without copying:
/// `UDMABUF_CREATE` for one range, `UDMABUF_CREATE_LIST` for several.
/// The total is capped by udmabuf's `size_limit_mb` (64 MiB by default).
/// Crate-private: the dma-buf lets devices write the memfds' pages, so a
/// memfd behind a [`crate::Buffer`] is exported only by consuming the buffer
/// ([`crate::Buffer::into_dmabuf`], [`DmaBuf::udmabuf_join`]).
pub(crate) fn udmabuf_export(ranges: &[(BorrowedFd<'_>, u64, u64)]) -> Result<DmaBuf> {
    let path = Path::new(UDMABUF_DEVICE);
    let dev = probe_device(UDMABUF_DEVICE, "CONFIG_UDMABUF")
        .map_err(|why| Error::new(ErrorKind::InvalidInput, "open", path, why))?;
    let len: u64 = ranges.iter().map(|r| r.2).sum();
    let items: Vec<dmabuf::UdmabufRange<'_>> =
        ranges.iter().map(|&(memfd, offset, size)| dmabuf::UdmabufRange { memfd, offset, size }).collect();
    match dmabuf::udmabuf_create(dev.as_fd(), &items) {
        Ok(fd) => Ok(DmaBuf { fd, len }),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && udmabuf_size_limit().is_some_and(|l| len > l) => {
            Err(Error::new(
                ErrorKind::InvalidInput,
                "udmabuf create",
                path,
                format!(
                    "{len} bytes exceed udmabuf's size_limit_mb ({} MiB): raise it with the kernel \
                     parameter udmabuf.size_limit_mb=N or in {UDMABUF_SIZE_LIMIT}",
                    udmabuf_size_limit().unwrap_or(0) >> 20
                ),
            ))
        }
        Err(e) => Err(Error::io("udmabuf create", path, e)),
    }
}
