//! Where buffers come from: memfd (shareable by fd, exportable as a dma-buf
//! through udmabuf) or private anonymous memory (no fd); and
//! dma-bufs: allocated from the system dma-heap or exported from memfds
//! with udmabuf.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::buffer::Buffer;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::MemoryFacts;
use crate::sys;
use crate::sys::dmabuf;
pub use crate::sys::mem::SharedMapping;
use crate::sys::mem::{self, HugePageAdvice, Mapping, MemfdPages};

/// The kind of memory a buffer lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryKind {
    /// A memfd (`memfd_create`, Linux 3.17) mapped shared with 4 KiB pages
    /// (`MADV_NOHUGEPAGE`): can be passed to other processes by fd and
    /// exported as a dma-buf with udmabuf. Works everywhere.
    #[default]
    Memfd,
    /// A memfd whose mapping asks for 2 MiB pages (`MADV_HUGEPAGE`), which
    /// shmem gives when `/sys/kernel/mm/transparent_hugepage/shmem_enabled`
    /// is `always`, `within_size`, `advise` or `force`; shareable and
    /// exportable like `memfd`. An error where that policy is `never` or
    /// `deny` (most distributions' default).
    MemfdHuge,
    /// A hugetlb memfd (`MFD_HUGETLB`, Linux 4.14): pages of the
    /// administrator's hugetlb pool (`/proc/sys/vm/nr_hugepages`), reserved
    /// at allocation, in the default huge page size; shareable and
    /// exportable like `memfd`. An error when the pool lacks free pages.
    Hugetlb,
    /// Private anonymous memory with `MADV_HUGEPAGE`: 2 MiB pages where
    /// `transparent_hugepage/enabled` is `always` or `madvise`, but no fd
    /// to share.
    AnonymousThp,
    /// Private anonymous memory in 4 KiB pages (`MADV_NOHUGEPAGE`): no fd
    /// to share, but the cheapest 4 KiB pages to populate, with no page
    /// cache entry or shmem accounting per page (0.4 against 0.75 s/GiB
    /// for a memfd on the development VM). Works everywhere.
    Anonymous,
}

/// What to do when memory without an fd (the anonymous kinds) was asked
/// to be shared, exported or mapped elsewhere: the end of such errors.
pub(crate) const NEEDS_A_MEMFD: &str = "load into a memfd (`to` memfd, or auto with an fd needed)";

impl MemoryKind {
    pub const ALL: [MemoryKind; 5] = [
        MemoryKind::Memfd,
        MemoryKind::MemfdHuge,
        MemoryKind::Hugetlb,
        MemoryKind::AnonymousThp,
        MemoryKind::Anonymous,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Memfd => "memfd",
            MemoryKind::MemfdHuge => "memfd-huge",
            MemoryKind::Hugetlb => "hugetlb",
            MemoryKind::AnonymousThp => "anonymous-thp",
            MemoryKind::Anonymous => "anonymous",
        }
    }

    /// Whether the memory is a memfd, which can be shared by fd and
    /// exported with udmabuf.
    pub fn has_fd(self) -> bool {
        !matches!(self, MemoryKind::AnonymousThp | MemoryKind::Anonymous)
    }
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for MemoryKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        MemoryKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<_> = MemoryKind::ALL.iter().map(|k| k.name()).collect();
            format!("unknown memory kind {s:?} (expected one of: {})", names.join(", "))
        })
    }
}

/// Memory reserved for a buffer, not yet populated: pages are allocated
/// (and zeroed by the kernel) when populated or first touched.
#[derive(Debug)]
pub struct Allocation {
    pub(crate) mapping: Mapping,
    pub(crate) memfd: Option<OwnedFd>,
    pub(crate) kind: MemoryKind,
}

impl Allocation {
    /// Reserves `len` bytes (a multiple of the page size) of `kind` memory
    /// (hugetlb memory: `len` rounded up to whole huge pages). A kind this
    /// kernel cannot give now is an [`io::ErrorKind::Unsupported`] error
    /// that says why and what would change it.
    pub fn new(kind: MemoryKind, len: usize) -> io::Result<Allocation> {
        Self::with_facts(kind, len, &MemoryFacts::read())
    }

    /// [`Allocation::new`] against facts read beforehand.
    pub(crate) fn with_facts(kind: MemoryKind, len: usize, facts: &MemoryFacts) -> io::Result<Allocation> {
        if let Err(why) = facts.can_give(kind, len as u64) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, format!("{kind} memory: {why}")));
        }
        // (`can_give` checked RLIMIT_FSIZE: a memfd is a file, and sizing it
        // past the limit would kill the process with SIGXFSZ.)
        let memfd = |pages, len: usize| -> io::Result<OwnedFd> {
            let memfd = mem::memfd_create(c"dmaload", pages)?;
            mem::set_len(memfd.as_fd(), len as u64)?;
            Ok(memfd)
        };
        let shmem = |advice| -> io::Result<Allocation> {
            let memfd = memfd(MemfdPages::Shmem, len)?;
            let mapping = Mapping::memfd(memfd.as_fd(), len, advice)?;
            Ok(Allocation { mapping, memfd: Some(memfd), kind })
        };
        let anonymous = |advice| -> io::Result<Allocation> {
            Ok(Allocation { mapping: Mapping::anonymous(len, advice)?, memfd: None, kind })
        };
        match kind {
            MemoryKind::Memfd => shmem(HugePageAdvice::Small),
            MemoryKind::MemfdHuge => shmem(HugePageAdvice::Huge),
            MemoryKind::Hugetlb => {
                let len = len.next_multiple_of(facts.hugetlb_page_size.max(1) as usize);
                facts
                    .can_give(kind, len as u64)
                    .map_err(|why| io::Error::new(io::ErrorKind::Unsupported, why))?;
                let memfd = memfd(MemfdPages::Hugetlb, len)?;
                // A shared hugetlb mapping reserves its pages now: ENOMEM
                // here means the pool ran short since the facts were read.
                let mapping = Mapping::hugetlb(memfd.as_fd(), len).map_err(|e| match e.raw_os_error() {
                    Some(libc::ENOMEM) => io::Error::new(
                        io::ErrorKind::OutOfMemory,
                        format!("hugetlb memory of {len} bytes: the pool has too few free pages ({e})"),
                    ),
                    _ => e,
                })?;
                Ok(Allocation { mapping, memfd: Some(memfd), kind })
            }
            MemoryKind::AnonymousThp => anonymous(HugePageAdvice::Huge),
            MemoryKind::Anonymous => anonymous(HugePageAdvice::Small),
        }
    }
}

/// Allocates every page under `bytes` now, content kept (`MADV_POPULATE_WRITE`
/// on `threads` threads, each an equal share; pages only partly inside
/// `bytes` are left alone), so that reading into them later never faults:
/// what a load does to its buffer before its reads, for memory the caller
/// brings (a load into it with [`crate::load_into`] populates it itself).
pub fn populate(bytes: &mut [u8], threads: usize) -> io::Result<()> {
    let len = bytes.len();
    crate::pipeline::populate_range(mem::MappingWriter::over(bytes), 0..len, threads)
}

/// Bytes of dropped buffers (and other mappings of 64 MiB or more) that a
/// background thread is still unmapping: dropping a large [`Buffer`]
/// returns at once, and the pages go back to the system a moment later.
pub fn bytes_being_freed() -> usize {
    mem::unmap_pending()
}

/// Waits until every dropped buffer's memory has gone back to the system
/// (a load that needs more memory than is available waits so by itself).
pub fn wait_for_freed_memory() {
    mem::wait_for_unmaps()
}

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

    /// Exports whole loaded buffers, in order, as one dma-buf with udmabuf
    /// (`UDMABUF_CREATE_LIST`), without copying: each buffer contributes the
    /// pages around its bytes (its first byte at `memfd_offset() % page
    /// size` of its part). The buffers are consumed: devices may write a
    /// dma-buf, so no `&[u8]` of them may outlive the export. On failure they
    /// come back with the error.
    pub fn udmabuf_join(buffers: Vec<Buffer>) -> std::result::Result<DmaBuf, Box<(Error, Vec<Buffer>)>> {
        let parts: Result<Vec<_>> = buffers.iter().map(Buffer::udmabuf_part).collect();
        match parts.and_then(|parts| udmabuf_export(&parts)) {
            Ok(dmabuf) => Ok(dmabuf),
            Err(err) => Err(Box::new((err, buffers))),
        }
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
    DmaHeap::open(crate::options::DEFAULT_DMA_HEAP)?.alloc(len)
}

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
        let config = if name == crate::options::DEFAULT_DMA_HEAP {
            "CONFIG_DMABUF_HEAPS_SYSTEM"
        } else {
            "a heap of that name"
        };
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
/// [`Buffer`] once [`Buffer::memfd`] handed it out, whose bytes the buffer
/// lends as `&[u8]`) is refused: export a buffer with [`Buffer::into_dmabuf`].
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
/// memfd behind a [`Buffer`] is exported only by consuming the buffer
/// ([`Buffer::into_dmabuf`], [`DmaBuf::udmabuf_join`]).
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
