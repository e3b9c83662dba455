//! dma-buf producers and CPU access: dma-heap allocation, udmabuf export of
//! memfd ranges, and `DMA_BUF_IOCTL_SYNC`.
//!
//! The ioctl numbers and structs below are the kernel uAPI
//! (`linux/dma-heap.h`, `linux/udmabuf.h`, `linux/dma-buf.h`); the libc crate
//! does not define them.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `_IOC(dir, type, nr, size)` of `asm-generic/ioctl.h`.
const fn ioc(dir: u64, ty: u8, nr: u8, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | ((ty as u64) << 8) | nr as u64
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

/// `struct dma_heap_allocation_data`.
#[repr(C)]
struct DmaHeapAllocationData {
    len: u64,
    fd: u32,
    fd_flags: u32,
    heap_flags: u64,
}
const DMA_HEAP_IOCTL_ALLOC: u64 =
    ioc(IOC_READ | IOC_WRITE, b'H', 0, std::mem::size_of::<DmaHeapAllocationData>());

/// `struct udmabuf_create`.
#[repr(C)]
struct UdmabufCreate {
    memfd: u32,
    flags: u32,
    offset: u64,
    size: u64,
}
/// `struct udmabuf_create_item`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UdmabufCreateItem {
    memfd: u32,
    pad: u32,
    offset: u64,
    size: u64,
}
/// The fixed head of `struct udmabuf_create_list` (a flexible array of
/// items follows).
#[repr(C)]
struct UdmabufCreateListHead {
    flags: u32,
    count: u32,
}
const UDMABUF_FLAGS_CLOEXEC: u32 = 0x01;
const UDMABUF_CREATE: u64 = ioc(IOC_WRITE, b'u', 0x42, std::mem::size_of::<UdmabufCreate>());
const UDMABUF_CREATE_LIST: u64 = ioc(IOC_WRITE, b'u', 0x43, std::mem::size_of::<UdmabufCreateListHead>());

/// `struct dma_buf_sync`.
#[repr(C)]
struct DmaBufSync {
    flags: u64,
}
const DMA_BUF_SYNC_READ: u64 = 1;
const DMA_BUF_SYNC_WRITE: u64 = 2;
const DMA_BUF_SYNC_END: u64 = 1 << 2;
const DMA_BUF_IOCTL_SYNC: u64 = ioc(IOC_WRITE, b'b', 0, std::mem::size_of::<DmaBufSync>());

/// `DMA_BUF_MAGIC` of `linux/magic.h`: the filesystem of every dma-buf's
/// inode (Linux 5.3; dma-bufs were anonymous inodes before).
const DMA_BUF_MAGIC: i64 = 0x444d4142;

/// Whether `fd` is a dma-buf: its inode is on the kernel's dma-buf
/// filesystem (`fstatfs` `f_type`), where only dma-buf exporters make
/// files. Its `/proc/self/fd` link name is no proof: a file on a detached
/// mount reads as `/` plus its own path on that mount, `/dmabuf:x` too.
pub fn is_dmabuf(fd: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(super::file::filesystem_magic(fd)? == DMA_BUF_MAGIC)
}

/// Takes ownership of a new fd returned by an ioctl.
fn owned(ret: libc::c_int) -> io::Result<OwnedFd> {
    let fd = super::check(ret)?;
    // SAFETY: the kernel just created `fd` for this process; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `DMA_HEAP_IOCTL_ALLOC` (Linux 5.6) on an open `/dev/dma_heap/<name>`:
/// a new dma-buf of `len` bytes (page-rounded by the heap), zeroed by the
/// kernel at allocation.
pub fn dma_heap_alloc(heap: BorrowedFd<'_>, len: u64) -> io::Result<OwnedFd> {
    let mut data = DmaHeapAllocationData {
        len,
        fd: 0,
        fd_flags: (libc::O_RDWR | libc::O_CLOEXEC) as u32,
        heap_flags: 0,
    };
    // SAFETY: `data` is a properly laid out dma_heap_allocation_data that
    // lives across the call; the kernel reads len/flags and writes fd.
    super::check(unsafe { libc::ioctl(heap.as_raw_fd(), DMA_HEAP_IOCTL_ALLOC as _, &mut data) })?;
    // SAFETY: on success `data.fd` is a new dma-buf fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(data.fd as libc::c_int) })
}

/// One memfd range for [`udmabuf_create`]: offset and size page-aligned.
#[derive(Debug, Clone, Copy)]
pub struct UdmabufRange<'fd> {
    pub memfd: BorrowedFd<'fd>,
    pub offset: u64,
    pub size: u64,
}

/// `UDMABUF_CREATE` (Linux 4.20) for one range, `UDMABUF_CREATE_LIST` for
/// several (concatenated in order) on an open `/dev/udmabuf`: a dma-buf over
/// the memfds' pages, no copy. The memfds must be sealed `F_SEAL_SHRINK`
/// and not `F_SEAL_WRITE`. The total is limited by the module parameter
/// `size_limit_mb` (64 by default; EINVAL above it), the item count by
/// `list_limit` (1024).
pub fn udmabuf_create(dev: BorrowedFd<'_>, ranges: &[UdmabufRange<'_>]) -> io::Result<OwnedFd> {
    if let [one] = ranges {
        let create = UdmabufCreate {
            memfd: one.memfd.as_raw_fd() as u32,
            flags: UDMABUF_FLAGS_CLOEXEC,
            offset: one.offset,
            size: one.size,
        };
        // SAFETY: `create` is a properly laid out udmabuf_create living
        // across the call; the kernel only reads it.
        return owned(unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE as _, &create) });
    }
    let count = u32::try_from(ranges.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // The list head and its items as one contiguous, u64-aligned array of
    // words, packed field by field as the #[repr(C)] structs lay them out.
    let pair = |low: u32, high: u32| {
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&low.to_ne_bytes());
        bytes[4..].copy_from_slice(&high.to_ne_bytes());
        u64::from_ne_bytes(bytes)
    };
    const _: () = assert!(std::mem::size_of::<UdmabufCreateListHead>() == 8);
    const _: () = assert!(std::mem::size_of::<UdmabufCreateItem>() == 24);
    let mut words = vec![pair(UDMABUF_FLAGS_CLOEXEC, count)];
    for r in ranges {
        words.extend([pair(r.memfd.as_raw_fd() as u32, 0), r.offset, r.size]);
    }
    // SAFETY: `words` is a udmabuf_create_list head followed by `count`
    // udmabuf_create_item entries in their C layout (sizes asserted above),
    // 8-byte aligned, alive across the call; the kernel only reads it.
    owned(unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE_LIST as _, words.as_ptr()) })
}

/// Which CPU accesses a [`sync`] bracket covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncAccess {
    Read,
    Write,
    ReadWrite,
}

/// `DMA_BUF_IOCTL_SYNC` (Linux 4.6): `start` before the CPU touches a
/// dma-buf's mmap, `!start` after, so the exporter can flush or invalidate
/// CPU caches for devices that are not cache-coherent.
pub fn sync(dmabuf: BorrowedFd<'_>, access: SyncAccess, start: bool) -> io::Result<()> {
    let mut flags = match access {
        SyncAccess::Read => DMA_BUF_SYNC_READ,
        SyncAccess::Write => DMA_BUF_SYNC_WRITE,
        SyncAccess::ReadWrite => DMA_BUF_SYNC_READ | DMA_BUF_SYNC_WRITE,
    };
    if !start {
        flags |= DMA_BUF_SYNC_END;
    }
    let arg = DmaBufSync { flags };
    loop {
        // SAFETY: `arg` is a dma_buf_sync living across the call; read only.
        let ret = unsafe { libc::ioctl(dmabuf.as_raw_fd(), DMA_BUF_IOCTL_SYNC as _, &arg) };
        match super::check(ret) {
            // The kernel documents EINTR/EAGAIN as "restart the ioctl".
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => continue,
            other => return other.map(drop),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_uapi_headers() {
        assert_eq!(DMA_HEAP_IOCTL_ALLOC, 0xC018_4800);
        assert_eq!(UDMABUF_CREATE, 0x4018_7542);
        assert_eq!(UDMABUF_CREATE_LIST, 0x4008_7543);
        assert_eq!(DMA_BUF_IOCTL_SYNC, 0x4008_6200);
    }
}
