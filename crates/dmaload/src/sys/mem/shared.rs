//! Mappings another process or a device may write: bytes copied in and
//! out, never lent as slices.

use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::BorrowedFd;

use super::*;

/// A mapping of memory that something besides this process's Rust code may
/// write at any time: a dma-buf (devices, other processes importing it).
/// Rust's rules forbid a `&[u8]` over bytes that change under it, so the
/// bytes are copied in and out through raw pointers, and slices are
/// `unsafe` with the caller's promise that nothing else writes meanwhile
/// (memmap2's rule).
///
/// Only this crate makes one, over objects that cannot shrink under it (a
/// dma-buf, checked by its filesystem: [`DmaBuf::map`](crate::heap::DmaBuf::map)):
/// a mapping of any fd would raise SIGBUS on the first read past the end of
/// a file another process truncated. So this does not compile:
///
/// ```compile_fail
/// fn map(fd: std::os::fd::BorrowedFd<'_>) {
///     let _ = dmaload::heap::SharedMapping::new(fd, 4096);
/// }
/// ```
#[derive(Debug)]
pub struct SharedMapping {
    mapping: Mapping,
    // Raw copies from several threads at once would race with each other.
    _not_sync: PhantomData<std::cell::Cell<u8>>,
}

impl SharedMapping {
    /// `mmap(MAP_SHARED)` of `len` bytes of `fd`, read-write. The caller
    /// makes sure `fd` cannot shrink below `len` while mapped (a dma-buf,
    /// or a memfd sealed `F_SEAL_SHRINK`): a page past the end raises SIGBUS.
    pub(crate) fn new(fd: BorrowedFd<'_>, len: usize) -> io::Result<SharedMapping> {
        Ok(SharedMapping { mapping: Mapping::shared(fd, len)?, _not_sync: PhantomData })
    }

    pub fn len(&self) -> usize {
        self.mapping.len
    }

    pub fn is_empty(&self) -> bool {
        self.mapping.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> io::Result<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.mapping.len => {
                // SAFETY: offset <= end <= len: inside (or one past) the mapping.
                Ok(unsafe { self.mapping.ptr.as_ptr().add(offset) })
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{len} bytes at offset {offset} run past the {}-byte mapping", self.mapping.len),
            )),
        }
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> io::Result<()> {
        let src = self.check(offset, out.len())?;
        // SAFETY: `src..src + out.len()` is inside the mapping (checked) and
        // cannot overlap `out`, which Rust owns; no reference to the mapped
        // bytes is formed, so a concurrent writer can only make the copy
        // see old or new bytes.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into the mapping at `offset`.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> io::Result<()> {
        let dst = self.check(offset, data.len())?;
        // SAFETY: as in `read_at`, in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies `range` of the staging memory `src` into the mapping at
    /// `offset`, pointer to pointer: neither side is ever a Rust slice.
    pub fn write_from(
        &mut self,
        offset: usize,
        src: MappingWriter<'_>,
        range: Range<usize>,
    ) -> io::Result<()> {
        let (from, len) = src.raw_range(&range);
        let dst = self.check(offset, len)?;
        // SAFETY: `from..from + len` is inside `src`'s live mapping and
        // `dst..dst + len` inside this one (both checked); they are distinct
        // mappings (this one is a dma-buf or file, `src` staging memory), so
        // the regions cannot overlap. No reference to either is formed, so a
        // concurrent writer could only make the copy see old or new bytes.
        unsafe { std::ptr::copy_nonoverlapping(from.cast_const(), dst, len) };
        Ok(())
    }

    /// The bytes as a slice.
    ///
    /// # Safety
    ///
    /// Nothing may write the memory (a device, another process, another
    /// mapping of it in this one) while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        self.mapping.as_slice()
    }

    /// The bytes as a mutable slice.
    ///
    /// # Safety
    ///
    /// Nothing else may read or write the memory (a device, another
    /// process, another mapping of it in this one) while the slice lives.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        self.mapping.as_mut_slice()
    }
}
