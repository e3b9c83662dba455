//! Writing into a mapping from several threads at once, and populating
//! its pages ahead of the writes.

use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use super::check;

use super::*;

/// Write access to a [`Mapping`] for syscalls and io_uring, shareable
/// between threads. It holds the mapping's mutable borrow, so no Rust slice
/// of the mapping exists while the kernel writes through it.
#[derive(Debug, Clone, Copy)]
pub struct MappingWriter<'m> {
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
    pub(super) _borrow: PhantomData<&'m mut [u8]>,
}

// SAFETY: the writer only passes addresses to the kernel; concurrent kernel
// writes to disjoint (or even overlapping) ranges do not create Rust
// references, and the mapping outlives 'm.
unsafe impl Send for MappingWriter<'_> {}
// SAFETY: see above.
unsafe impl Sync for MappingWriter<'_> {}

impl<'m> MappingWriter<'m> {
    /// Write access to memory the caller owns, which the writer borrows
    /// mutably for its whole life, as it borrows a [`Mapping`]'s.
    pub fn over(dst: &'m mut [u8]) -> MappingWriter<'m> {
        // A slice's pointer is never null (dangling but non-null when empty).
        MappingWriter { ptr: NonNull::from(&mut *dst).cast(), len: dst.len(), _borrow: PhantomData }
    }

    /// Panics if `range` is not inside the mapping: callers compute ranges
    /// from the plan, so an out-of-range request is a bug, not bad input.
    pub(in crate::sys) fn raw_range(&self, range: &Range<usize>) -> (*mut u8, usize) {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} outside mapping of {} bytes",
            self.len
        );
        // SAFETY: start <= len, so the offset stays inside (or one past) the mapping.
        (unsafe { self.ptr.as_ptr().add(range.start) }, range.end - range.start)
    }

    /// One `preadv2(2)` (Linux 4.6) of `fd` at `offset` into `range` of the
    /// mapping, with per-call `RWF_*` flags (e.g. `RWF_DONTCACHE`, Linux
    /// 6.14); returns the count read, which may be short.
    pub fn pread_at(
        &self,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
        offset: u64,
        flags: libc::c_int,
    ) -> io::Result<usize> {
        let iov = self.iovec(&range);
        // SAFETY: the iovec lies inside a mapping kept alive and free of Rust
        // references by this writer's borrow; preadv2 writes at most iov_len bytes.
        let ret = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
        crate::sys::check_size(ret)
    }

    /// One `read(2)` of a byte stream (a socket) into `range` of the
    /// mapping: the bytes of an HTTP body land where they belong, with no
    /// buffer between. Returns the count read (0 at the end of the stream),
    /// which may be short.
    pub fn read_stream(&self, fd: BorrowedFd<'_>, range: Range<usize>) -> io::Result<usize> {
        let (ptr, len) = self.raw_range(&range);
        // SAFETY: ptr..ptr+len lies inside a mapping kept alive and free of
        // Rust references by this writer's borrow; read writes at most len bytes.
        let ret = unsafe { libc::read(fd.as_raw_fd(), ptr.cast(), len) };
        crate::sys::check_size(ret)
    }

    /// Copies `data` into the mapping at `offset` (the first bytes of a body
    /// that arrived with the response's head); panics when it does not fit,
    /// as the offset comes from the plan.
    pub fn copy_in(&self, offset: usize, data: &[u8]) {
        let (ptr, len) = self.raw_range(&(offset..offset + data.len()));
        // SAFETY: ptr..ptr+len lies inside the live mapping (checked by
        // raw_range), which no Rust reference covers while the writer
        // lives, so it cannot overlap `data`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, len) };
    }

    /// Allocates and maps the pages of `range` on `threads` threads, each
    /// taking an equal page-aligned share, with `MADV_POPULATE_WRITE` so the I/O
    /// never faults. No `fallocate` first: it has no mapping to take the
    /// `MADV_HUGEPAGE` hint from, so under `shmem_enabled=advise` it would
    /// allocate a memfd in 4 KiB pages.
    pub fn populate_on_threads(&self, range: Range<usize>, threads: usize) -> io::Result<()> {
        let populate = |part: Range<usize>| self.populate(part);
        let page = page_size();
        let share = range.len().div_ceil(threads.max(1)).div_ceil(page) * page;
        if threads <= 1 || share >= range.len() {
            return populate(range);
        }
        let parts: Vec<Range<usize>> =
            range.clone().step_by(share).map(|start| start..(start + share).min(range.end)).collect();
        std::thread::scope(|scope| {
            // A part whose helper thread cannot be created is populated here.
            let mut result = Ok(());
            let mut helpers = Vec::new();
            for part in &parts[1..] {
                let helper = part.clone();
                match std::thread::Builder::new()
                    .name("dmaload-populate".into())
                    .spawn_scoped(scope, move || populate(helper))
                {
                    Ok(helper) => helpers.push(helper),
                    Err(_) => result = result.and(populate(part.clone())),
                }
            }
            result = result.and(populate(parts[0].clone()));
            for helper in helpers {
                let joined =
                    helper.join().unwrap_or_else(|_| Err(io::Error::other("a populating thread panicked")));
                result = result.and(joined);
            }
            result
        })
    }

    /// Allocates and maps the pages of `range` now instead of on first
    /// touch: `madvise(MADV_POPULATE_WRITE)` (Linux 5.14). On older kernels
    /// (EINVAL) it adds zero to one byte per page with an atomic
    /// read-modify-write instead: a write fault, so the kernel allocates the
    /// page, that never changes a byte, whatever the page already holds and
    /// whoever else writes it meanwhile.
    ///
    /// Memory whose every page is resident already (a caller's buffer filled
    /// again and again, such as a stream's window buffers) is left alone: a
    /// populate would walk and re-mark each of its pages for nothing (a
    /// third of a warm 64 MiB window load's CPU on the development VM).
    pub fn populate(&self, range: Range<usize>) -> io::Result<()> {
        let (ptr, len) = self.raw_range(&range);
        if len == 0 || self.resident(&range) {
            return Ok(());
        }
        // SAFETY: ptr..ptr+len lies inside the mapping (checked above).
        let ret = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) };
        if ret == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(err);
        }
        self.touch_pages(range);
        Ok(())
    }

    /// Bytes of memory it writes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Asks for `advice`'s pages under `range` from now on (`madvise`,
    /// which touches no byte): pages faulted in already keep their size.
    /// The range is widened to whole pages.
    pub fn advise(&self, range: Range<usize>, advice: HugePageAdvice) -> io::Result<()> {
        let page = page_size();
        let (ptr, len) = self.raw_range(&range);
        if len == 0 {
            return Ok(());
        }
        let start = ptr as usize / page * page;
        let end = (ptr as usize + len).next_multiple_of(page);
        // SAFETY: `start..end` covers only pages holding bytes of `range`,
        // inside the live mapping (checked by raw_range); the advice
        // changes how later faults fill them, never their bytes.
        check(unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice.flag()) }).map(drop)
    }

    /// Whether every page under `range` is resident (`mincore`), its first
    /// page asked alone first, so that fresh memory costs one page's look.
    /// For a shared mapping (a memfd) mincore answers for the file's pages,
    /// mapped here or not; an unmapped one is then faulted in by the I/O
    /// itself, a minor fault, so skipping the populate stays correct.
    pub(super) fn resident(&self, range: &Range<usize>) -> bool {
        let page = page_size();
        let (ptr, len) = self.raw_range(range);
        let start = ptr as usize / page * page;
        let end = (ptr as usize + len).next_multiple_of(page);
        let ask = |len: usize, vec: &mut [u8]| {
            // SAFETY: `start..start + len` covers only pages holding bytes of
            // `range`, which lies inside the live mapping (checked by
            // raw_range); mincore reads their page tables and writes one
            // byte per page into `vec`, which has at least that many.
            let ret = unsafe { libc::mincore(start as *mut libc::c_void, len, vec.as_mut_ptr()) };
            ret == 0 && vec.iter().all(|&v| v & 1 == 1)
        };
        ask(page, &mut [0u8; 1]) && ask(end - start, &mut vec![0u8; (end - start) / page])
    }

    /// The populate fallback: one atomic `+= 0` per page of `range`.
    pub(super) fn touch_pages(&self, range: Range<usize>) {
        for start in range.clone().step_by(page_size()) {
            let (ptr, _) = self.raw_range(&(start..start + 1));
            // SAFETY: `ptr` is a byte inside the mapping (checked by
            // raw_range), which lives for 'm; an AtomicU8 has the size and
            // alignment of a u8, and every access to these bytes from this
            // side is the kernel's or atomic, so no Rust reference is
            // invalidated.
            let byte = unsafe { std::sync::atomic::AtomicU8::from_ptr(ptr) };
            byte.fetch_add(0, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Copies `range` of the mapping into `dst` (of the same length). The
    /// bytes are read through the raw pointer, never as a Rust slice, so a
    /// kernel write racing with the copy (a caller that reuses memory too
    /// early) can only give wrong bytes, never undefined behaviour of Rust
    /// references.
    pub fn copy_out(&self, range: Range<usize>, dst: &mut [u8]) {
        let (ptr, len) = self.raw_range(&range);
        assert_eq!(len, dst.len(), "copy_out needs a destination of the range's length");
        // SAFETY: ptr..ptr+len lies inside the live mapping (checked by
        // raw_range); `dst` is a distinct, exclusively borrowed Rust slice
        // of the same length, so the regions cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(ptr.cast_const(), dst.as_mut_ptr(), len) };
    }

    /// Copies `range` of the mapping into `dst` (of the same length),
    /// pointer to pointer: neither side is ever a Rust slice.
    pub fn copy_out_raw(&self, range: Range<usize>, mut dst: RawBytesMut<'_>) {
        let (ptr, len) = self.raw_range(&range);
        assert_eq!(len, dst.len(), "copy_out_raw needs a destination of the range's length");
        // SAFETY: ptr..ptr+len lies inside the live mapping (checked by
        // raw_range), dst..dst+len inside memory its borrow keeps mapped;
        // `copy` allows the two to overlap, and no reference to either is
        // formed, so a racing writer can only leave unspecified bytes.
        unsafe { std::ptr::copy(ptr.cast_const(), dst.writer().ptr.as_ptr(), len) };
    }

    /// The `iovec` of `range`, for registering it with io_uring and for
    /// [`Self::pread_at`].
    pub(in crate::sys) fn iovec(&self, range: &Range<usize>) -> libc::iovec {
        let (ptr, len) = self.raw_range(range);
        libc::iovec { iov_base: ptr.cast(), iov_len: len }
    }
}

/// Memory a load writes that Rust code never reads or writes through a
/// reference: either an ordinary `&mut [u8]`, or memory another thread may
/// touch meanwhile (a Python buffer export filled while the GIL is
/// released, which any Python thread can reach), for which a `&mut [u8]`
/// would be unsound. The loader writes it only through raw copies and the
/// kernel (`read`, io_uring); a racing access can only see or leave
/// unspecified bytes. The borrow keeps the memory mapped.
#[derive(Debug)]
pub struct RawBytesMut<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: only addresses travel; every write is a raw copy or the kernel's,
// and the memory lives for 'a.
unsafe impl Send for RawBytesMut<'_> {}
// SAFETY: see above; `&RawBytesMut` gives out only the address and length.
unsafe impl Sync for RawBytesMut<'_> {}

impl<'a> From<&'a mut [u8]> for RawBytesMut<'a> {
    fn from(bytes: &'a mut [u8]) -> RawBytesMut<'a> {
        // A slice's pointer is never null (dangling but non-null when empty).
        RawBytesMut { ptr: NonNull::from(&mut *bytes).cast(), len: bytes.len(), _borrow: PhantomData }
    }
}

impl<'a> RawBytesMut<'a> {
    /// The `len` bytes at `ptr`, for a load to fill: memory another thread
    /// may read or write meanwhile (a Python buffer's export), which no
    /// `&mut [u8]` may cover.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must stay mapped, writable and not freed for `'a`
    /// (`ptr` non-null, any address when `len` is 0), and must not overlap
    /// memory this program lends as a Rust reference during `'a`. Accesses
    /// by code that forms no Rust reference (another thread's raw or
    /// foreign code, a device) are allowed: they can only see partly
    /// loaded bytes or leave bytes the load then overwrites.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize) -> RawBytesMut<'a> {
        let ptr = NonNull::new(ptr).unwrap_or(NonNull::dangling());
        RawBytesMut { ptr, len, _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte (for alignment checks; never read
    /// through).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The same memory, borrowed for a shorter time.
    pub fn reborrow(&mut self) -> RawBytesMut<'_> {
        RawBytesMut { ptr: self.ptr, len: self.len, _borrow: PhantomData }
    }

    /// The bytes before `mid` and from it; panics when `mid > len`, as
    /// slices do.
    pub fn split_at(self, mid: usize) -> (RawBytesMut<'a>, RawBytesMut<'a>) {
        assert!(mid <= self.len, "split at {mid} of {} bytes", self.len);
        // SAFETY: mid <= len: inside (or one past) the borrowed memory.
        let rest = unsafe { self.ptr.add(mid) };
        (
            RawBytesMut { ptr: self.ptr, len: mid, _borrow: PhantomData },
            RawBytesMut { ptr: rest, len: self.len - mid, _borrow: PhantomData },
        )
    }

    /// Bytes `range`, borrowed for a shorter time; panics when out of
    /// bounds.
    pub fn range(&mut self, range: Range<usize>) -> RawBytesMut<'_> {
        assert!(range.start <= range.end && range.end <= self.len, "range {range:?} of {} bytes", self.len);
        let (_, rest) = self.reborrow().split_at(range.start);
        rest.split_at(range.end - range.start).0
    }

    /// Copies `data` in at `offset`; panics when it does not fit.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) {
        let dst = self.range(offset..offset + data.len());
        // SAFETY: `dst` lies inside the borrowed memory, which `data` (a
        // Rust reference) cannot overlap by this type's contract; no
        // reference to the destination is formed.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst.ptr.as_ptr(), data.len()) };
    }

    /// Write access for syscalls and io_uring, for as long as this borrow.
    pub(crate) fn writer(&mut self) -> MappingWriter<'_> {
        MappingWriter { ptr: self.ptr, len: self.len, _borrow: PhantomData }
    }

    /// The memory back, for writing, and its pages, for faulting in beside.
    pub(crate) fn prefault(self) -> (RawBytesMut<'a>, Prefault<'a>) {
        let pages = Prefault { start: self.ptr.as_ptr() as usize, len: self.len, _memory: PhantomData };
        (self, pages)
    }

    /// Faults in the whole pages inside the memory now
    /// (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14: one call instead of a
    /// fault per page on first write); no byte changes. Pages only partly
    /// inside are left to first touch.
    pub fn populate(&mut self) -> io::Result<()> {
        let (_, pages) = self.reborrow().prefault();
        pages.populate(0..pages.len())
    }
}

/// The pages of memory a load writes ([`RawBytesMut::prefault`]), for
/// faulting them in from other threads while the load writes to it: `madvise(MADV_POPULATE_WRITE)`
/// maps a page without changing a byte and forms no Rust reference, so it
/// is no access to the bytes in Rust's sense, and it never falls back to
/// touching them. The borrow keeps the memory mapped while a copy lives.
#[derive(Debug, Clone, Copy)]
pub struct Prefault<'a> {
    start: usize,
    len: usize,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> Prefault<'a> {
    /// Address of the first byte, for aligning ranges to the pages.
    pub fn address(&self) -> usize {
        self.start
    }

    /// Bytes in the slice.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Faults in the whole pages inside bytes `range` (relative to the
    /// slice); pages only partly inside are left to first touch. Fails
    /// with EINVAL before Linux 5.14, where there is nothing this may do
    /// instead (a populating write would race with the owner's writes).
    /// Panics when `range` is outside the slice.
    pub fn populate(&self, range: Range<usize>) -> io::Result<()> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} outside {} bytes",
            self.len
        );
        let page = page_size();
        let start = (self.start + range.start).next_multiple_of(page);
        let end = (self.start + range.end) / page * page;
        if end <= start {
            return Ok(());
        }
        // SAFETY: start..end lies inside the slice, which the borrow 'a
        // keeps mapped; MADV_POPULATE_WRITE only faults pages in, it
        // changes no byte and races with no write of the owner's.
        check(unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) })
            .map(drop)
    }
}
