//! A loaded buffer: the bytes of a file (or a range of it) in memory that
//! can be shared.

use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::error::{Error, ErrorKind, Result};
use crate::heap::{self, Allocation, DmaBuf, MemoryKind};
use crate::sys;
use crate::sys::mem::{page_size, Mapping, Seals};

/// A contiguous piece of a buffer that was populated and filled as one unit
/// (one "gather" of the pipelined load).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Offset of the segment in the buffer, in bytes.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Bytes loaded from a file. Dereferences to `[u8]`.
///
/// The memory is page-aligned and may start with a few bytes before the
/// requested range (direct I/O reads whole aligned blocks); those are not
/// part of the slice but are part of the memfd: see [`Buffer::memfd_offset`].
pub struct Buffer {
    mapping: Mapping,
    memfd: Option<OwnedFd>,
    kind: MemoryKind,
    data: Range<usize>,
    segments: Vec<Segment>,
}

impl Buffer {
    /// A buffer over `data` of a filled allocation, whose gathers (ranges of
    /// the mapping) are `gathers`.
    pub(crate) fn new(alloc: Allocation, data: Range<usize>, gathers: &[Range<usize>]) -> Buffer {
        let segments = gathers
            .iter()
            .filter_map(|g| {
                let start = g.start.max(data.start);
                let end = g.end.min(data.end);
                (start < end).then(|| Segment { offset: start - data.start, len: end - start })
            })
            .collect();
        Buffer { mapping: alloc.mapping, memfd: alloc.memfd, kind: alloc.kind, data, segments }
    }

    /// The pieces the buffer was filled in, in order, covering it exactly.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    pub fn memory_kind(&self) -> MemoryKind {
        self.kind
    }

    /// Bytes of the buffer's memory the kernel backs with huge pages now
    /// (2 MiB THP or hugetlb pages), read from `/proc/self/smaps`: what the
    /// kernel really gave, whatever its policy promised. Reading smaps walks
    /// every mapping of the process, so this is for checks and benchmarks.
    pub fn huge_page_bytes(&self) -> std::io::Result<u64> {
        if self.mapping.len() == 0 {
            return Ok(0);
        }
        crate::memory::huge_page_bytes(self.mapping.address())
    }

    /// The memfd holding the bytes, for passing to another process;
    /// `None` for anonymous memory. Before handing it out this seals it
    /// against writes (`F_SEAL_FUTURE_WRITE`, Linux 5.1; a load already
    /// sealed its size): whoever receives it can map it read-only, or
    /// privately (copy-on-write), but cannot change the bytes this buffer
    /// dereferences to. udmabuf refuses memfds with that seal (Linux
    /// 6.12+), so export with [`Buffer::into_dmabuf`] before, not after,
    /// handing the fd out. (A udmabuf made elsewhere from an unsealed copy
    /// lets devices write the pages, as `/proc/self/mem` lets a debugger:
    /// outside what a seal can stop.)
    pub fn memfd(&self) -> Option<BorrowedFd<'_>> {
        let fd = self.memfd.as_ref()?.as_fd();
        // Kernels before 5.1 have no such seal (EINVAL): the size seals stay.
        let _ = sys::mem::add_seals(fd, Seals::FUTURE_WRITE);
        Some(fd)
    }

    /// Where the buffer's first byte sits in the memfd (non-zero when a
    /// range was loaded from an offset that direct I/O had to align down).
    pub fn memfd_offset(&self) -> usize {
        self.data.start
    }

    /// Exports the buffer's memory as a dma-buf with udmabuf, without
    /// copying: devices import it, and its pages stay alive as long as the
    /// dma-buf does. It covers whole pages, so the buffer's first byte is at
    /// `memfd_offset() % page size` in it. The buffer is consumed: devices
    /// and other processes may write a dma-buf, so no `&[u8]` of the buffer
    /// may outlive the export. Needs memfd memory (a load seals the memfd as
    /// udmabuf requires); past udmabuf's `size_limit_mb` (64 MiB by
    /// default) the kernel refuses. On failure the buffer comes back with
    /// the error.
    pub fn into_dmabuf(self) -> std::result::Result<DmaBuf, Box<(Error, Buffer)>> {
        match self.udmabuf_part() {
            Ok(part) => heap::udmabuf_export(&[part]).map_err(|err| Box::new((err, self))),
            Err(err) => Err(Box::new((err, self))),
        }
    }

    /// The whole pages of the memfd around the buffer's bytes, for udmabuf.
    pub(crate) fn udmabuf_part(&self) -> Result<(BorrowedFd<'_>, u64, u64)> {
        let Some(memfd) = self.memfd.as_ref().map(|fd| fd.as_fd()) else {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "export",
                std::path::Path::new(heap::UDMABUF_DEVICE),
                "anonymous memory has no memfd to export: load with memory memfd",
            ));
        };
        if sys::mem::seals(memfd).is_ok_and(|seals| seals.contains(Seals::FUTURE_WRITE)) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "export",
                std::path::Path::new(heap::UDMABUF_DEVICE),
                "the memfd was handed out (Buffer::memfd) and so sealed against writes, which \
                 udmabuf refuses: export before sharing the fd",
            ));
        }
        let page = page_size();
        let start = self.data.start / page * page;
        let end = self.data.end.div_ceil(page) * page;
        Ok((memfd, start as u64, (end - start) as u64))
    }

    /// Gives up the mapping and returns the memfd, which keeps the bytes.
    pub fn into_memfd(self) -> Option<OwnedFd> {
        self.memfd
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.mapping.as_slice()[self.data.clone()]
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        let data = self.data.clone();
        &mut self.mapping.as_mut_slice()[data]
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.data.len())
            .field("memory", &self.kind)
            .field("segments", &self.segments.len())
            .finish()
    }
}
