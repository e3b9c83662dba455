//! The memory of a transfer buffer: a memfd in 4 KiB pages, a memfd
//! exported as a dma-buf with udmabuf, or a dma-heap buffer, mapped shared.
//!
//! The crate keeps every fd of the memory to itself: the fd the kernel
//! copies through is lent only for the length of a `&mut` borrow of the
//! [`Memory`] (so no slice of its bytes lives meanwhile), and no dma-buf
//! is ever handed to a device or another process. That is what makes the
//! mapping's bytes safe to lend as `&[u8]` and `&mut [u8]`.

use std::ffi::c_void;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;

use dmaload::heap::{self, DmaBuf};
use dmaload::{Error, Result};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{Advice, MapFlags, ProtFlags};

/// A shared read-write mapping of a whole fd, unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// `mmap(MAP_SHARED)` of `len` bytes of `fd` from offset 0 (`len` > 0);
    /// with `small_pages`, `MADV_NOHUGEPAGE` too, so that shmem never backs
    /// it with huge pages whatever `shmem_enabled` says.
    fn shared(fd: BorrowedFd<'_>, len: usize, small_pages: bool) -> io::Result<Mapping> {
        let flags = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: a new mapping at an address the kernel picks: no existing
        // memory is affected.
        let ptr = unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, flags, MapFlags::SHARED, fd, 0) }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        let mapping = Mapping { ptr, len };
        if small_pages {
            // SAFETY: the range is exactly this live mapping; the advice
            // changes how pages are backed, never their contents.
            unsafe { rustix::mm::madvise(ptr.as_ptr().cast(), len, Advice::LinuxNoHugepage) }?;
        }
        Ok(mapping)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `shared`, unmapped once; no slice of
        // it outlives `self` (slices borrow the `Memory` that owns it).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
    }
}

/// Memory of one kind, its mapping and the fd the kernel copies through.
pub(crate) struct Memory {
    // Field order is drop order: unmap, then close the fds.
    mapping: Mapping,
    io: File,
    dmabuf: Option<DmaBuf>,
    _memfd: Option<OwnedFd>,
}

const MEMFD: &str = "memfd";

fn memfd(size: usize) -> Result<OwnedFd> {
    let path = Path::new(MEMFD);
    let fd = rustix::fs::memfd_create("dmaload-transfer", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| Error::io("memfd_create", path, e.into()))?;
    rustix::fs::ftruncate(&fd, size as u64).map_err(|e| Error::io("ftruncate", path, e.into()))?;
    Ok(fd)
}

fn dup(fd: BorrowedFd<'_>, path: &str) -> Result<File> {
    fd.try_clone_to_owned().map(File::from).map_err(|e| Error::io("dup", Path::new(path), e))
}

fn map(fd: BorrowedFd<'_>, size: usize, small_pages: bool, path: &str) -> Result<Mapping> {
    Mapping::shared(fd, size, small_pages).map_err(|e| Error::io("mmap", Path::new(path), e))
}

impl Memory {
    /// `size` bytes (a whole number of pages, at least one) of a memfd
    /// mapped in 4 KiB pages.
    pub(crate) fn memfd(size: usize) -> Result<Memory> {
        let fd = memfd(size)?;
        Ok(Memory {
            mapping: map(fd.as_fd(), size, true, MEMFD)?,
            io: dup(fd.as_fd(), MEMFD)?,
            dmabuf: None,
            _memfd: Some(fd),
        })
    }

    /// A memfd exported with udmabuf: mapped and copied through as the
    /// memfd, or (`through_dmabuf`) through the dma-buf's own fd and mmap.
    pub(crate) fn udmabuf(size: usize, through_dmabuf: bool) -> Result<Memory> {
        let fd = memfd(size)?;
        // udmabuf requires the memfd's size to be fixed.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK)
            .map_err(|e| Error::io("seal memfd", Path::new(MEMFD), e.into()))?;
        let dmabuf = heap::udmabuf_from_memfd(fd.as_fd(), 0, size as u64)?;
        let (mapping, io) = if through_dmabuf {
            (map(dmabuf.fd(), size, false, heap::UDMABUF_DEVICE)?, dup(dmabuf.fd(), heap::UDMABUF_DEVICE)?)
        } else {
            (map(fd.as_fd(), size, true, MEMFD)?, dup(fd.as_fd(), MEMFD)?)
        };
        Ok(Memory { mapping, io, dmabuf: Some(dmabuf), _memfd: Some(fd) })
    }

    /// A buffer from the system dma-heap, mapped and copied through as one.
    pub(crate) fn dma_heap(size: usize) -> Result<Memory> {
        let dmabuf = heap::dma_heap_alloc(size as u64)?;
        let mapping = map(dmabuf.fd(), size, false, heap::SYSTEM_HEAP)?;
        let io = dup(dmabuf.fd(), heap::SYSTEM_HEAP)?;
        Ok(Memory { mapping, io, dmabuf: Some(dmabuf), _memfd: None })
    }

    /// The dma-buf, for CPU-access brackets (never handed out).
    pub(crate) fn dmabuf(&self) -> Option<&DmaBuf> {
        self.dmabuf.as_ref()
    }

    /// The fd the kernel copies through: the `&mut` borrow keeps every
    /// slice of the bytes dead while the kernel writes through it.
    pub(crate) fn io(&mut self) -> &File {
        &self.io
    }

    /// The mapping's address and length, for the kernel to write through
    /// (no reference to the bytes is formed).
    pub(crate) fn raw(&mut self) -> (*mut u8, usize) {
        (self.mapping.ptr.as_ptr(), self.mapping.len)
    }

    /// The whole mapping (whole pages).
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live while `self` is; nothing else writes
        // it while this shared borrow lives (module doc: the fd is lent for
        // writing only under `&mut self`, and no device has the dma-buf).
        unsafe { std::slice::from_raw_parts(self.mapping.ptr.as_ptr(), self.mapping.len) }
    }

    /// The whole mapping, mutably.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.mapping.ptr.as_ptr(), self.mapping.len) }
    }
}
