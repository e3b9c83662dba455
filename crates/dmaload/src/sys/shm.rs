//! Memory shared with another process that does not trust us, nor we it:
//! a shared mapping the peer may write at any moment, and raw views of
//! bytes that only the kernel reads.
//!
//! The rule (memmap2's, and [`super::mem::SharedMapping`]'s): no safe
//! `&[u8]` or `&mut [u8]` ever covers bytes the peer can write. Words of a
//! control page are reached as atomics; bytes are copied in and out through
//! raw pointers, or handed to the kernel as addresses ([`RawBytes`]); a
//! slice is `unsafe`, on the caller's promise that the peer keeps away.

use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use super::check_size;

/// `mmap(MAP_SHARED)` of an object another process also maps read-write
/// (a sealed memfd or a dma-buf). Unmapped on drop.
#[derive(Debug)]
pub struct PeerMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory that lives as long as the value and
// may move between threads.
unsafe impl Send for PeerMapping {}
// SAFETY: shared references give out only atomics, raw copies and kernel
// addresses. Every write into the bytes (`copy_in`, `read_from`,
// `SharedBytesMut`) takes the mapping's one `BlockWriter` by `&mut`, so two
// threads of this process never write them at once; the writer exists
// only on the side that fills blocks, whose mapping is read only through
// the holder of that same writer (a block queue lends it to a free block,
// which holds the queue's `&mut` borrow), while the side that reads blocks
// from other threads has no writer at all. What the peer process does is
// outside this process's memory model either way.
unsafe impl Sync for PeerMapping {}

/// The right to write the bytes of one [`PeerMapping`]: made with it
/// ([`PeerMapping::with_writer`]), never cloned, and taken by `&mut` by
/// every write. A block queue keeps it on the producing side and lends it
/// only to a free block, so no safe call writes a block the consumer may
/// be reading: the type, not a protocol elsewhere in the crate, says who
/// may write.
#[derive(Debug)]
pub struct BlockWriter {
    /// The address of the mapping it writes.
    mapping: usize,
}

impl PeerMapping {
    /// Maps `len` bytes of `fd` from offset 0, read-write, shared; with
    /// `huge_pages`, advises `MADV_HUGEPAGE` (shmem honours it when
    /// `shmem_enabled` is `advise`; EINVAL, no THP, keeps small pages).
    ///
    /// The caller makes sure the object cannot shrink below `len` while
    /// mapped (seals on a memfd; a dma-buf never shrinks): touching a page
    /// past the end of the object would raise SIGBUS.
    pub fn new(fd: BorrowedFd<'_>, len: usize, huge_pages: bool) -> io::Result<PeerMapping> {
        Self::map(fd, len, huge_pages)
    }

    /// [`PeerMapping::new`], with the one [`BlockWriter`] of the mapping.
    pub fn with_writer(
        fd: BorrowedFd<'_>,
        len: usize,
        huge_pages: bool,
    ) -> io::Result<(PeerMapping, BlockWriter)> {
        let map = Self::map(fd, len, huge_pages)?;
        let writer = BlockWriter { mapping: map.ptr.as_ptr() as usize };
        Ok((map, writer))
    }

    /// Panics unless `writer` is this mapping's: a writer of another
    /// mapping proves nothing about this one.
    fn check_writer(&self, writer: &BlockWriter) {
        assert_eq!(writer.mapping, self.ptr.as_ptr() as usize, "a BlockWriter of another mapping");
    }

    fn map(fd: BorrowedFd<'_>, len: usize, huge_pages: bool) -> io::Result<PeerMapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "an empty shared mapping"));
        }
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) cannot
        // overlap memory Rust already owns.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        let map = PeerMapping { ptr, len };
        if huge_pages {
            // SAFETY: the range is exactly this mapping; MADV_HUGEPAGE changes
            // how pages are allocated, never their contents.
            let ret = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
            if ret < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(map)
    }

    /// The address of `range`; panics when it is not inside the mapping
    /// (ranges are computed from validated indices: out of range is a bug).
    fn raw_range(&self, range: &Range<usize>) -> *mut u8 {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} outside a shared mapping of {} bytes",
            self.len
        );
        // SAFETY: start <= len: inside (or one past) the mapping.
        unsafe { self.ptr.as_ptr().add(range.start) }
    }

    /// The 64-bit word at `index` (8-byte aligned) as an atomic. Atomics are
    /// the one sound way to share words with a peer that writes them at any
    /// time; what the peer stores is still untrusted data.
    pub fn word(&self, index: usize) -> &AtomicU64 {
        let at = self.raw_range(&(index * 8..index * 8 + 8));
        // SAFETY: the 8 bytes lie inside the mapping (checked), which is
        // page-aligned, so `at` is 8-byte aligned; the mapping outlives the
        // borrow of `self`, and every access to these bytes from this
        // process is atomic.
        unsafe { AtomicU64::from_ptr(at.cast()) }
    }

    /// Copies `out.len()` bytes from `offset` into `out`: a peer writing
    /// meanwhile can only make the copy see old or new bytes.
    pub fn copy_out(&self, offset: usize, out: &mut [u8]) {
        let src = self.raw_range(&(offset..offset + out.len()));
        // SAFETY: the source is inside the live mapping (checked) and cannot
        // overlap `out`, which Rust owns; no reference to the shared bytes
        // is formed.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    }

    /// Copies `data` into the mapping at `offset`.
    pub fn copy_in(&self, writer: &mut BlockWriter, offset: usize, data: &[u8]) {
        self.check_writer(writer);
        let dst = self.raw_range(&(offset..offset + data.len()));
        // SAFETY: as in `copy_out`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
    }

    /// One `read(2)` from `fd` into `range`: the kernel writes the bytes,
    /// no Rust reference covers them. Returns the count read (0 at EOF).
    pub fn read_from(
        &self,
        writer: &mut BlockWriter,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
    ) -> io::Result<usize> {
        self.check_writer(writer);
        let dst = self.raw_range(&range);
        // SAFETY: dst..dst+len lies inside the live mapping (checked); read
        // writes at most that many bytes.
        let ret = unsafe { libc::read(fd.as_raw_fd(), dst.cast(), range.end - range.start) };
        check_size(ret)
    }

    /// `range` as bytes only the kernel reads (a write to a file or socket).
    pub fn raw_bytes(&self, range: Range<usize>) -> RawBytes<'_> {
        let ptr = self.raw_range(&range);
        RawBytes { ptr, len: range.end - range.start, _borrow: PhantomData }
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region this value owns; every view
        // of it borrows `self`, so none outlives it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Bytes the kernel reads (written to a file by `pwrite` or io_uring) that
/// Rust code never reads: either an ordinary slice, or memory a peer
/// process may change meanwhile (a range of a block queue's shared ring),
/// for which a `&[u8]` would be unsound. A racing peer can only change
/// what is written. The borrow keeps the memory mapped.
#[derive(Debug, Clone, Copy)]
pub struct RawBytes<'a> {
    ptr: *const u8,
    len: usize,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: only addresses travel; the memory is kept alive by 'a and read by
// the kernel alone.
unsafe impl Send for RawBytes<'_> {}
// SAFETY: see above.
unsafe impl Sync for RawBytes<'_> {}

impl<'a> From<&'a [u8]> for RawBytes<'a> {
    fn from(bytes: &'a [u8]) -> RawBytes<'a> {
        RawBytes { ptr: bytes.as_ptr(), len: bytes.len(), _borrow: PhantomData }
    }
}

impl<'a> RawBytes<'a> {
    /// The `len` bytes at `ptr`, which only the kernel will read: memory
    /// another thread or process may write meanwhile (a Python buffer's
    /// export, a shared mapping), which no `&[u8]` may cover.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must stay mapped and readable for `'a` (any `ptr`
    /// when `len` is 0). Writes to the bytes meanwhile are allowed: they
    /// change only what is written out.
    pub unsafe fn from_raw_parts(ptr: *const u8, len: usize) -> RawBytes<'a> {
        RawBytes { ptr, len, _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The sub-range `range`; panics when out of bounds, as slicing does.
    pub fn range(&self, range: Range<usize>) -> RawBytes<'a> {
        assert!(range.start <= range.end && range.end <= self.len, "range {range:?} of {} bytes", self.len);
        // SAFETY: start <= len: inside (or one past) the borrowed memory.
        let ptr = unsafe { self.ptr.add(range.start) };
        RawBytes { ptr, len: range.end - range.start, _borrow: PhantomData }
    }

    /// One `write(2)` of the bytes at `fd`'s position (a FIFO, a character
    /// device); returns the count written.
    pub fn write_to(&self, fd: BorrowedFd<'_>) -> io::Result<usize> {
        // SAFETY: the bytes lie inside memory the borrow keeps mapped;
        // write only reads them.
        let ret = unsafe { libc::write(fd.as_raw_fd(), self.ptr.cast(), self.len) };
        check_size(ret)
    }

    /// One `pwritev2(2)` of the bytes at `offset` with `flags`; returns the
    /// count written, which may be short.
    pub fn pwrite_at(&self, fd: BorrowedFd<'_>, offset: u64, flags: libc::c_int) -> io::Result<usize> {
        let iov = libc::iovec { iov_base: self.ptr as *mut libc::c_void, iov_len: self.len };
        // SAFETY: the iovec lies inside memory the borrow keeps mapped;
        // pwritev2 only reads it.
        let ret = unsafe { libc::pwritev2(fd.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
        check_size(ret)
    }

    /// `pwrite(2)` of all the bytes at `offset`, resuming short writes; a
    /// write of zero bytes is `WriteZero`.
    pub fn write_all_at(&self, fd: BorrowedFd<'_>, offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < self.len {
            let rest = self.range(done..self.len);
            // SAFETY: `rest` lies inside memory the borrow keeps mapped;
            // pwrite only reads it.
            let ret = unsafe {
                libc::pwrite(fd.as_raw_fd(), rest.ptr.cast(), rest.len, (offset + done as u64) as libc::off_t)
            };
            match check_size(ret) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A range of memory mapped by this process and a peer that this side
/// holds by protocol (a [`BlockQueue`](crate::share::BlockQueue) block) but
/// that the peer could still write: copies are safe, a slice is not.
#[derive(Debug, Clone, Copy)]
pub struct SharedBytes<'a> {
    ptr: *const u8,
    len: usize,
    _borrow: PhantomData<&'a PeerMapping>,
}

/// The writable form of [`SharedBytes`].
#[derive(Debug)]
pub struct SharedBytesMut<'a> {
    ptr: *mut u8,
    len: usize,
    _borrow: PhantomData<&'a PeerMapping>,
}

impl PeerMapping {
    /// `range` for reading.
    pub fn shared_bytes(&self, range: Range<usize>) -> SharedBytes<'_> {
        let ptr = self.raw_range(&range);
        SharedBytes { ptr, len: range.end - range.start, _borrow: PhantomData }
    }

    /// `range` for writing, for as long as `writer` is lent. Copies through
    /// it are sound whatever else touches the bytes; its `unsafe` slice
    /// needs the caller's promise that nothing else (peer, device, other
    /// view) does.
    pub fn shared_bytes_mut<'a>(
        &'a self,
        writer: &'a mut BlockWriter,
        range: Range<usize>,
    ) -> SharedBytesMut<'a> {
        self.check_writer(writer);
        let ptr = self.raw_range(&range);
        SharedBytesMut { ptr, len: range.end - range.start, _borrow: PhantomData }
    }
}

fn check_span(offset: usize, count: usize, len: usize) -> io::Result<()> {
    match offset.checked_add(count) {
        Some(end) if end <= len => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{count} bytes at offset {offset} run past a block of {len} bytes"),
        )),
    }
}

impl<'a> SharedBytes<'a> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> io::Result<()> {
        check_span(offset, out.len(), self.len)?;
        // SAFETY: offset <= len (checked): inside the borrowed range.
        let src = unsafe { self.ptr.add(offset) };
        // SAFETY: the bytes lie inside the mapping the borrow keeps alive
        // (checked) and cannot overlap `out`, which Rust owns; no reference
        // to them is formed.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The bytes as a slice.
    ///
    /// # Safety
    ///
    /// Nothing may write them while the slice lives: the peer keeps to the
    /// protocol, no device writes them, and no other view in this process
    /// does.
    pub unsafe fn as_slice(&self) -> &'a [u8] {
        // SAFETY: inside the live mapping; unchanged while the slice lives
        // by the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl SharedBytesMut<'_> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `data` into the bytes at `offset`.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> io::Result<()> {
        check_span(offset, data.len(), self.len)?;
        // SAFETY: offset <= len (checked): inside the borrowed range.
        let dst = unsafe { self.ptr.add(offset) };
        // SAFETY: as in `SharedBytes::read_at`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> io::Result<()> {
        SharedBytes { ptr: self.ptr, len: self.len, _borrow: PhantomData }.read_at(offset, out)
    }

    /// The bytes as a mutable slice.
    ///
    /// # Safety
    ///
    /// Nothing else may read or write them while the slice lives: the peer
    /// keeps to the protocol, no device touches them, and no other view in
    /// this process does.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: inside the live mapping; exclusive while the slice lives
        // by `&mut self` in-process and the caller's promise for the rest.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::mem;
    use std::os::fd::AsFd;

    fn memfd(len: usize) -> std::os::fd::OwnedFd {
        let fd = mem::memfd_create(c"dmaload-shm-test", mem::MemfdPages::Shmem).unwrap();
        mem::set_len(fd.as_fd(), len as u64).unwrap();
        fd
    }

    #[test]
    fn writes_need_the_mappings_own_writer() {
        let fd = memfd(8192);
        let (ours, mut writer) = PeerMapping::with_writer(fd.as_fd(), 8192, false).unwrap();
        let peer = PeerMapping::new(fd.as_fd(), 8192, false).unwrap();
        ours.copy_in(&mut writer, 4096, b"block");
        let mut out = [0u8; 5];
        peer.copy_out(4096, &mut out);
        assert_eq!(&out, b"block", "the peer's mapping sees the write");
        // A writer proves the right to write its own mapping only.
        let (other, mut others_writer) = PeerMapping::with_writer(memfd(4096).as_fd(), 4096, false).unwrap();
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ours.copy_in(&mut others_writer, 0, b"x");
        }));
        assert!(refused.is_err(), "a writer of another mapping was accepted");
        other.copy_in(&mut others_writer, 0, b"x");
        ours.copy_out(0, &mut out[..1]);
        assert_eq!(out[0], 0, "the refused write left the bytes alone");
    }
}
