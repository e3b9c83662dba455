//! A loaded buffer: the bytes of a file (or a range of it) in memory that
//! can be shared.

use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::heap::{self, DmaBuf};
use crate::memory::{Allocation, MemoryKind, NEEDS_A_MEMFD};
use crate::sys;
use crate::sys::mem::{page_size, Mapping, Seals};
use crate::types::Fallback;

/// The seals a memfd carries before it leaves the process, and that a
/// receiver checks: no shrinking or growing, no writes at all
/// (`F_SEAL_WRITE`, which the kernel adds only while no process holds a
/// writable shared mapping of the memfd and no page is pinned, so the bytes
/// can never change again), and no further seals. `F_SEAL_FUTURE_WRITE`
/// alone is not enough: it leaves writable shared mappings made before it
/// writable, and a receiver's private mapping shows their writes.
pub(crate) const SHARING_SEALS: Seals =
    Seals::SHRINK.union(Seals::GROW).union(Seals::WRITE).union(Seals::FUTURE_WRITE).union(Seals::SEAL);

/// The name errors give a buffer's memfd.
const MEMFD: &str = "memfd";
/// Where the kernel says which pages of a mapping are private copies.
const PAGEMAP: &str = "/proc/self/pagemap";
/// Why a buffer's memfd is not handed out after the buffer was written.
const WRITTEN_SINCE_PRIVATE: &str =
    "the buffer was written in place after its memory became private to this process (it was \
     received, its memfd was handed out before, or the process forked since the load), so its \
     memfd no longer holds the bytes the buffer shows: copy them into a new buffer to share them";

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
///
/// A process forked after the load gets its own copy of the bytes: just
/// before a fork the mapping of a loaded memfd buffer is made private
/// copy-on-write, so neither process's later writes reach the other
/// (where that cannot be done, hugetlb memory whose pool lacks the pages a
/// private mapping reserves or a kernel before 5.16, the fork goes on with
/// the memory shared and says so on stderr). The memfd is handed out ([`Buffer::memfd`], [`Buffer::send`],
/// [`Buffer::into_memfd`], [`Buffer::into_dmabuf`]) only while it holds
/// the bytes the buffer shows.
pub struct Buffer {
    mapping: Mapping,
    memfd: Option<OwnedFd>,
    kind: MemoryKind,
    data: Range<usize>,
    segments: Vec<Segment>,
    /// Held while the memfd is sealed for sharing and the mapping made
    /// private, so two threads never remap one after the other (the second
    /// would drop the first's private writes).
    sharing: Mutex<()>,
}

impl Buffer {
    /// A buffer over `data` of a filled allocation, whose gathers (ranges of
    /// the mapping) are `gathers`. Its memory, which a fork left out of the
    /// child while it was loaded, is part of forked children again, and a
    /// memfd's mapping is registered to be made private before a fork
    /// ([`Mapping::loaded`]): a forked child gets its own copy of the bytes,
    /// as of any other memory. Where no descriptor is left for the
    /// registry's copy (RLIMIT_NOFILE), the buffer stays shared across a
    /// fork and the returned fallback says so.
    pub(crate) fn new(
        mut alloc: Allocation,
        data: Range<usize>,
        gathers: &[Range<usize>],
    ) -> (Buffer, Option<Fallback>) {
        // The registry keeps a descriptor of its own: where none is left
        // (RLIMIT_NOFILE), the buffer is still handed out, shared across a
        // fork as before, and the load says so.
        let unregistered =
            alloc.mapping.loaded(alloc.memfd.as_ref().map(|memfd| memfd.as_fd())).err().map(|err| {
                Fallback::new(
                    "private on fork",
                    "shared across fork",
                    format!(
                    "no descriptor under RLIMIT_NOFILE for the fork registry's copy of the memfd ({err}): a \
                     forked child shares this buffer's pages"
                ),
                )
            });
        let segments = gathers
            .iter()
            .filter_map(|g| {
                let start = g.start.max(data.start);
                let end = g.end.min(data.end);
                (start < end).then(|| Segment { offset: start - data.start, len: end - start })
            })
            .collect();
        let buffer = Buffer {
            mapping: alloc.mapping,
            memfd: alloc.memfd,
            kind: alloc.kind,
            data,
            segments,
            sharing: Mutex::new(()),
        };
        (buffer, unregistered)
    }

    /// A buffer over `data` of a memfd another process sealed for sharing,
    /// mapped privately (`mapping` is [`Mapping::private`] of `memfd`).
    pub(crate) fn received(mapping: Mapping, memfd: OwnedFd, data: Range<usize>) -> Buffer {
        let segments = vec![Segment { offset: 0, len: data.len() }];
        Buffer {
            mapping,
            memfd: Some(memfd),
            kind: MemoryKind::Memfd,
            data,
            segments,
            sharing: Mutex::new(()),
        }
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
        crate::memory::huge_page_bytes(self.mapping.address(), self.mapping.len())
    }

    /// The memfd holding the bytes, for passing to another process;
    /// `None` for anonymous memory. Before handing it out this turns this
    /// buffer's own mapping private copy-on-write, so that nothing here
    /// writes the shared pages any more, then seals the memfd
    /// (`F_SEAL_SHRINK|GROW|WRITE|FUTURE_WRITE|SEAL`: no resizing, no writes
    /// at all, no further seals):
    /// whoever receives the fd sees the bytes as they are now, forever, and
    /// writes through this buffer stay in this process. The kernel refuses
    /// `F_SEAL_WRITE` (EBUSY) while another writable shared mapping of the
    /// memfd exists (a forked child's copy of the mapping) or a page is
    /// pinned (`cudaHostRegister`, a udmabuf): then no fd is handed out,
    /// as it would let others see bytes change. udmabuf refuses sealed
    /// memfds, so export with [`Buffer::into_dmabuf`] before, not after,
    /// handing the fd out. Where the mapping cannot be made private (a
    /// private mapping of hugetlb memory reserves as many pages of the pool
    /// as the buffer has, and needs Linux 5.16), no fd is handed out either.
    pub fn memfd(&self) -> Result<Option<BorrowedFd<'_>>> {
        let Some(fd) = self.memfd.as_ref().map(|fd| fd.as_fd()) else {
            return Ok(None);
        };
        self.seal_for_sharing(fd).map_err(|e| self.sealing_error(Path::new(MEMFD), e))?;
        self.check_memfd_holds_the_bytes("hand out memfd", Path::new(MEMFD))?;
        Ok(Some(fd))
    }

    /// An error where the memfd no longer holds the bytes this buffer
    /// shows: its mapping is private (received, its memfd handed out
    /// before, or a fork since the load) and this process has written some
    /// of its pages since, which went to private copies. Handing the memfd
    /// out then would give others bytes this buffer does not show.
    fn check_memfd_holds_the_bytes(&self, op: &'static str, path: &Path) -> Result<()> {
        if self.mapping.has_private_copies().map_err(|e| Error::io(op, Path::new(PAGEMAP), e))? {
            return Err(Error::new(ErrorKind::InvalidInput, op, path, WRITTEN_SINCE_PRIVATE));
        }
        Ok(())
    }

    /// The error of a failed [`Buffer::seal_for_sharing`], saying what the
    /// pool has to do with it where hugetlb memory could not be mapped
    /// private.
    fn sealing_error(&self, path: &Path, err: std::io::Error) -> Error {
        if err.raw_os_error() == Some(libc::EBUSY) {
            let message = "another writable shared mapping of the memfd (a forked child's) or a pinned \
                           page (cudaHostRegister, a udmabuf) exists, so the kernel refuses \
                           F_SEAL_WRITE: a receiver could see the bytes change";
            return Error::with_errno("seal memfd", path, libc::EBUSY, message);
        }
        if self.kind == MemoryKind::Hugetlb && err.raw_os_error() == Some(libc::ENOMEM) {
            let message = "the pool has too few free pages for the private copy-on-write mapping \
                           sealing needs: one of hugetlb memory reserves as many pages as it maps \
                           (/proc/sys/vm/nr_hugepages)";
            return Error::new(ErrorKind::OutOfMemory, "seal memfd", path, message);
        }
        Error::io("seal memfd", path, err)
    }

    /// Seals `fd` (this buffer's memfd) with `SHARING_SEALS`, making the
    /// mapping private first; done once.
    fn seal_for_sharing(&self, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        let _once = self.sharing.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if sys::mem::seals(fd)?.contains(SHARING_SEALS) {
            return Ok(());
        }
        // The mapping is Allocation::new's shared mapping of this memfd from
        // offset 0: the one make_private accepts.
        self.mapping.make_private(fd)?;
        sys::mem::add_seals(fd, SHARING_SEALS)
    }

    /// The memfd sealed for sharing (as [`Buffer::memfd`] seals it) and the
    /// buffer's byte range in it, for [`Buffer::send`]; `op` and `socket`
    /// name the operation and the socket in errors.
    pub(crate) fn sealed_for_sending(
        &self,
        op: &'static str,
        socket: &Path,
    ) -> Result<(BorrowedFd<'_>, Range<usize>)> {
        let Some(fd) = self.memfd.as_ref().map(|fd| fd.as_fd()) else {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                op,
                socket,
                format!("anonymous memory has no memfd to send: {}", NEEDS_A_MEMFD),
            ));
        };
        self.seal_for_sharing(fd).map_err(|e| self.sealing_error(socket, e))?;
        self.check_memfd_holds_the_bytes(op, socket)?;
        Ok((fd, self.data.clone()))
    }

    /// Maps `len` bytes at `offset` of a memfd received from another
    /// process over `socket` (its name in errors), after checking its
    /// seals and size (as [`Buffer::receive`] does).
    pub fn from_sealed_memfd(
        memfd: OwnedFd,
        offset: u64,
        len: u64,
        socket: &std::path::Path,
    ) -> Result<Buffer> {
        let refused =
            |message: String| Error::new(ErrorKind::InvalidInput, "receive buffer", socket, message);
        let seals = sys::mem::seals(memfd.as_fd())
            .map_err(|e| refused(format!("the descriptor received is not a sealable memfd ({e})")))?;
        if !seals.contains(SHARING_SEALS) {
            return Err(refused(
                "the memfd received is not sealed against resizing and writing (it needs \
                 F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE and F_SEAL_SEAL: F_SEAL_FUTURE_WRITE \
                 alone leaves the sender's writable mappings writable)"
                    .into(),
            ));
        }
        let size = std::fs::File::from(memfd.try_clone().map_err(|e| Error::io("dup", socket, e))?)
            .metadata()
            .map_err(|e| Error::io("fstat", socket, e))?
            .len();
        let end = offset.checked_add(len).filter(|&end| end <= size).ok_or_else(|| {
            refused(format!("bytes {offset}+{len} run past the end of the {size}-byte memfd received"))
        })?;
        let (start, end) = (offset as usize, end as usize);
        let mapping = Mapping::private(memfd.as_fd(), end.div_ceil(page_size()) * page_size())
            .map_err(|e| Error::io("mmap", socket, e))?;
        Ok(Buffer::received(mapping, memfd, start..end))
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
                format!("anonymous memory has no memfd to export: {}", NEEDS_A_MEMFD),
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
        self.check_memfd_holds_the_bytes("export", Path::new(heap::UDMABUF_DEVICE))?;
        let page = page_size();
        let start = self.data.start / page * page;
        let end = self.data.end.div_ceil(page) * page;
        Ok((memfd, start as u64, (end - start) as u64))
    }

    /// Gives up the mapping and returns the memfd sealed for sharing (as
    /// [`Buffer::memfd`] seals it) and where the bytes are in it: what the
    /// cache service keeps of a load.
    pub fn into_sealed_memfd(self) -> std::io::Result<(OwnedFd, Range<usize>)> {
        let Buffer { mut mapping, memfd, data, .. } = self;
        // Unmapped first, here and not by the background thread: no
        // writable shared mapping outlives the seals, and a client mapping
        // the memfd right after does not wait for the unmapping of its pages.
        mapping.unmap_now();
        let memfd = memfd.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "anonymous memory has no memfd to share")
        })?;
        if !sys::mem::seals(memfd.as_fd())?.contains(SHARING_SEALS) {
            sys::mem::add_seals(memfd.as_fd(), SHARING_SEALS)?;
        }
        Ok((memfd, data))
    }

    /// Gives up the mapping and returns the memfd, which keeps the bytes
    /// (`None` for anonymous memory). Refused, the buffer coming back with
    /// the error, where the memfd no longer holds the bytes the buffer
    /// shows: a private mapping (received, its memfd handed out before,
    /// or a fork since the load) written in place since.
    pub fn into_memfd(self) -> std::result::Result<Option<OwnedFd>, Box<(Error, Buffer)>> {
        if self.memfd.is_some() {
            if let Err(err) = self.check_memfd_holds_the_bytes("take memfd", Path::new(MEMFD)) {
                return Err(Box::new((err, self)));
            }
        }
        Ok(self.memfd)
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

// Defined here, not in `heap`, because it consumes buffers: `heap` sits
// below `buffer` and does not know it.
impl DmaBuf {
    /// Exports whole loaded buffers, in order, as one dma-buf with udmabuf
    /// (`UDMABUF_CREATE_LIST`), without copying: each buffer contributes the
    /// pages around its bytes (its first byte at `memfd_offset() % page
    /// size` of its part). The buffers are consumed: devices may write a
    /// dma-buf, so no `&[u8]` of them may outlive the export. On failure they
    /// come back with the error.
    pub fn udmabuf_join(buffers: Vec<Buffer>) -> std::result::Result<DmaBuf, Box<(Error, Vec<Buffer>)>> {
        let parts: Result<Vec<_>> = buffers.iter().map(Buffer::udmabuf_part).collect();
        match parts.and_then(|parts| heap::udmabuf_export(&parts)) {
            Ok(dmabuf) => Ok(dmabuf),
            Err(err) => Err(Box::new((err, buffers))),
        }
    }
}
