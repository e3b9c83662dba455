//! Address-space reservations: a range of virtual addresses that this
//! process owns, into which file pages are mapped and unmapped in place.
//!
//! # Safety
//!
//! * A [`Reservation`] owns `ptr..ptr + len` from `mmap` until `munmap` on
//!   drop. Every `MAP_FIXED` call made here targets a sub-range that was
//!   bounds-checked against the reservation (an out-of-range request
//!   panics before any syscall), so no mapping of the rest of the process
//!   (the heap, stacks, other `Mapping`s) is ever replaced. A `MAP_FIXED`
//!   the kernel refuses may have unmapped its range first; the placeholder
//!   is put back at once (`MAP_FIXED_NOREPLACE`), so the reservation keeps
//!   no hole for another mmap to land in and `Drop` to unmap. (Another
//!   thread's mmap that takes the hole in the instant between the two
//!   calls is beyond what user space can prevent.)
//! * No Rust reference to the reserved bytes is created in this module.
//!   The bytes are file pages that other mappings and processes can write,
//!   and that `MAP_FIXED` replaces under any pointer, so they are read and
//!   written only by the kernel on our behalf (`process_vm_readv` /
//!   `process_vm_writev`), which reports a page that is not mapped, not
//!   accessible or beyond the end of its file as `EFAULT` instead of a
//!   signal. Callers who turn [`Reservation::addr`] into a slice take on
//!   memmap2's rule themselves, in their own `unsafe`.
//! * A `MAP_SHARED` mapping holds its own reference to the open file, so the
//!   file descriptor passed to [`Reservation::map_file`] may be closed as
//!   soon as the call returns: the pages stay valid while mapped.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

/// Access to mapped pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prot {
    Read,
    ReadWrite,
}

impl Prot {
    fn bits(self) -> libc::c_int {
        match self {
            Prot::Read => libc::PROT_READ,
            Prot::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        }
    }
}

/// A reserved range of virtual addresses, unmapped on drop.
#[derive(Debug)]
pub struct Reservation {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Reservation is an owned address range; its methods are syscalls
// that the kernel serialises per address space, and it hands out no
// references to the bytes, so moving or sharing it between threads is fine.
unsafe impl Send for Reservation {}
// SAFETY: see above; `&Reservation` only reads and writes through the kernel.
unsafe impl Sync for Reservation {}

/// The flags of an inaccessible placeholder: no memory, no swap accounting.
const PLACEHOLDER: libc::c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;

impl Reservation {
    /// Reserves `len` bytes (a positive multiple of the page size) of
    /// address space: `mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS |
    /// MAP_NORESERVE)`. Nothing is allocated; touching it faults.
    pub fn new(len: usize) -> io::Result<Reservation> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: addr NULL lets the kernel choose a free range, which cannot
        // overlap memory that Rust already owns.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, PLACEHOLDER, -1, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Reservation { ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The first reserved address. Dereferencing it is up to the caller.
    pub fn addr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Panics unless `at..at + len` lies inside the reservation: callers
    /// check requests and return errors first, so this is a bug guard.
    fn checked(&self, at: usize, len: usize) -> *mut u8 {
        assert!(
            at.checked_add(len).is_some_and(|end| end <= self.len),
            "range {at}+{len} outside reservation of {} bytes",
            self.len
        );
        // SAFETY: at <= len, so the pointer stays inside (or one past) the range.
        unsafe { self.ptr.as_ptr().add(at) }
    }

    /// Maps `len` bytes of `fd` from `fd_offset` at `at` in the
    /// reservation, replacing what was there: `mmap(MAP_SHARED |
    /// MAP_FIXED)`. `at`, `fd_offset` and `len` must be page-aligned (the
    /// kernel says EINVAL otherwise). The fd may be closed afterwards.
    pub fn map_file(
        &self,
        at: usize,
        len: usize,
        fd: BorrowedFd<'_>,
        fd_offset: u64,
        prot: Prot,
    ) -> io::Result<()> {
        let addr = self.checked(at, len);
        let offset =
            libc::off_t::try_from(fd_offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: addr..addr+len lies inside this reservation (checked), which
        // this value owns and of which no Rust reference exists, so
        // MAP_FIXED replaces only pages that nothing in Rust borrows.
        let ret = unsafe {
            libc::mmap(
                addr.cast(),
                len,
                prot.bits(),
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                offset,
            )
        };
        if ret == libc::MAP_FAILED {
            let err = io::Error::last_os_error();
            self.refill(addr, len);
            return Err(err);
        }
        debug_assert_eq!(ret.cast::<u8>(), addr);
        Ok(())
    }

    /// After a failed `MAP_FIXED` at `addr..addr + len` (inside the
    /// reservation): the kernel may have dropped the old pages before it
    /// refused (a file whose mmap method fails, such as a sysfs attribute;
    /// any late failure before Linux 6.12), leaving a hole that another
    /// mmap could take and that `Drop` or a later bind would then unmap
    /// from under its owner. Puts the placeholder back where there is a
    /// hole, replacing nothing (`MAP_FIXED_NOREPLACE`, Linux 4.17: EEXIST
    /// when the old pages are still there).
    fn refill(&self, addr: *mut u8, len: usize) {
        let flags = PLACEHOLDER | libc::MAP_FIXED_NOREPLACE;
        // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped, so
        // it cannot replace memory anyone (Rust or not) uses; the range is
        // inside this reservation (checked by the caller).
        let ret = unsafe { libc::mmap(addr.cast(), len, libc::PROT_NONE, flags, -1, 0) };
        // A kernel before 4.17 treats the flag as a hint: a mapping placed
        // elsewhere is not ours to keep.
        if ret != libc::MAP_FAILED && ret.cast::<u8>() != addr {
            // SAFETY: `ret` is the mapping this call just made, used by nothing.
            unsafe { libc::munmap(ret, len) };
        }
    }

    /// Returns `at..at + len` to the reservation: a fresh inaccessible
    /// placeholder `mmap(PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS |
    /// MAP_NORESERVE)` over it, which drops whatever was mapped there in one
    /// step (no window in which another thread's mmap could take the range,
    /// as there would be after a munmap).
    pub fn clear(&self, at: usize, len: usize) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let addr = self.checked(at, len);
        // SAFETY: as in map_file: the range is inside this reservation and
        // unborrowed; the new mapping is inaccessible anonymous memory.
        let ret =
            unsafe { libc::mmap(addr.cast(), len, libc::PROT_NONE, PLACEHOLDER | libc::MAP_FIXED, -1, 0) };
        if ret == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Copies `buf.len()` bytes at `at` out of the reservation with
    /// `process_vm_readv(2)` on this process (Linux 3.2): a page that is not
    /// bound readable (or lies past the end of its file) is `EFAULT`, not
    /// a signal.
    pub fn read(&self, at: usize, buf: &mut [u8]) -> io::Result<()> {
        let addr = self.checked(at, buf.len());
        let mut done = 0;
        while done < buf.len() {
            let local = libc::iovec { iov_base: buf[done..].as_mut_ptr().cast(), iov_len: buf.len() - done };
            // Inside the checked range; only the kernel dereferences it.
            let remote = libc::iovec { iov_base: addr.wrapping_add(done).cast(), iov_len: buf.len() - done };
            // SAFETY: `local` is a live exclusive buffer of iov_len bytes; the
            // kernel only reads `remote` and reports faults as EFAULT.
            let n = unsafe { libc::process_vm_readv(this_process(), &local, 1, &remote, 1, 0) };
            done += fault_or_progress(n)?;
        }
        Ok(())
    }

    /// Copies `buf` into the reservation at `at` with `process_vm_writev(2)`
    /// (Linux 3.2); pages not bound writable are `EFAULT`.
    pub fn write(&self, at: usize, buf: &[u8]) -> io::Result<()> {
        let addr = self.checked(at, buf.len());
        let mut done = 0;
        while done < buf.len() {
            let local =
                libc::iovec { iov_base: buf[done..].as_ptr().cast_mut().cast(), iov_len: buf.len() - done };
            // Inside the checked range; only the kernel dereferences it.
            let remote = libc::iovec { iov_base: addr.wrapping_add(done).cast(), iov_len: buf.len() - done };
            // SAFETY: the kernel only reads `local` (a live buffer of iov_len
            // bytes) and writes the shared pages at `remote`, which no Rust
            // reference views.
            let n = unsafe { libc::process_vm_writev(this_process(), &local, 1, &remote, 1, 0) };
            done += fault_or_progress(n)?;
        }
        Ok(())
    }
}

/// This process's PID, for the `process_vm_*` calls.
fn this_process() -> libc::pid_t {
    std::process::id() as libc::pid_t
}

/// A `process_vm_*` result: bytes moved, or the error; 0 bytes (the kernel
/// stopped at the first page) is the fault it ran into.
fn fault_or_progress(n: isize) -> io::Result<usize> {
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        0 => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        n => Ok(n as usize),
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the range this value reserved (with all
        // that was bound in it); nothing in Rust borrows it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
