//! File read leases (`fcntl(F_SETLEASE)`, Linux 2.4) and the private
//! mapping of a leased file that can be detached from it.
//!
//! # Safety
//!
//! A file mapping turns the next access of a page past a shortened file's
//! end into `SIGBUS`. A read lease is what makes [`FileView`] safe to read:
//! while it is held no one can open the file for writing or truncate it
//! (their `open`/`truncate` waits for the holder, up to
//! `/proc/sys/fs/lease-break-time`), so the file keeps at least the mapped
//! length. The invariant this module needs from its one user
//! (`crate::lease`): a `FileView` of a file is read only while that file's
//! read lease is held, or after [`FileView::detach`], which replaces the
//! file's pages by anonymous memory holding the same bytes.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

/// The signal a lease break sends this process between taking the lease
/// and silencing it ([`take_read_lease`]): `SIGURG`, whose default action
/// is to ignore it. The default, `SIGIO`, would terminate the process.
const BREAK_SIGNAL: libc::c_int = libc::SIGURG;

/// `F_SETSIG` (asm-generic/fcntl.h; the libc crate lacks it for glibc).
const F_SETSIG: libc::c_int = 10;

/// Takes a read lease on `fd` (`F_SETLEASE F_RDLCK`): fails with `EAGAIN`
/// where the file is open for writing anywhere (a writable mapping
/// included), `EACCES` where this process neither owns the file nor holds
/// `CAP_LEASE`, `EINVAL` on a filesystem without leases (NFS, FUSE, ...).
///
/// A break of a lease signals its owner. Before the lease is taken the
/// signal is made [`BREAK_SIGNAL`] (`F_SETSIG`), and once taken the owner
/// is cleared (`F_SETOWN 0`: the kernel then signals no one), so no break
/// ever kills the process or reaches a handler of its own (but for a break
/// within the few instructions between the two calls, delivered as
/// `SIGURG`). Breaks are found by [`lease_held`] instead.
pub fn take_read_lease(fd: BorrowedFd<'_>) -> io::Result<()> {
    fcntl(fd, F_SETSIG, BREAK_SIGNAL)?;
    fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK)?;
    if let Err(err) = fcntl(fd, libc::F_SETOWN, 0) {
        let _ = release_lease(fd);
        return Err(err);
    }
    Ok(())
}

/// Whether `fd`'s read lease is still held and unbroken (`F_GETLEASE`
/// says `F_RDLCK`). While a break is pending the kernel reports the type
/// the lease is to become (`F_UNLCK` for a read lease: fs/locks.c,
/// `target_leasetype`), and after the break time the lease is gone.
pub fn lease_held(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let kind = fcntl(fd, libc::F_GETLEASE, 0)?;
    Ok(kind == libc::F_RDLCK)
}

/// Gives the lease up (`F_SETLEASE F_UNLCK`): a writer waiting on it goes on.
pub fn release_lease(fd: BorrowedFd<'_>) -> io::Result<()> {
    fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK).map(drop)
}

/// `fcntl(fd, cmd, arg)` for the commands here, whose argument is an integer.
fn fcntl(fd: BorrowedFd<'_>, cmd: libc::c_int, arg: libc::c_int) -> io::Result<libc::c_int> {
    // SAFETY: fcntl on a valid descriptor with an integer argument (the
    // lease and signal commands above): it touches no memory of ours.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), cmd, arg) })
}

/// A private mapping (`MAP_PRIVATE`, readable and writable: writes go to
/// private copies of pages, never to the file) of the first `len` bytes
/// of a file, owned by this value and unmapped on drop.
///
/// Its bytes are reached through [`FileView::address`] by others (buffer
/// exports), never through Rust references: they may write in place at
/// any time, so the copy of [`FileView::detach`] is a raw one.
#[derive(Debug)]
pub struct FileView {
    addr: usize,
    len: usize,
    /// Mapped length: `len` rounded up to whole pages.
    mapped: usize,
    detached: bool,
}

impl FileView {
    /// Maps `len` (> 0) bytes of `fd` from offset 0. The caller holds the
    /// file's read lease (see the module's safety note).
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<FileView> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mapped = len.next_multiple_of(super::mem::page_size());
        // SAFETY: addr NULL: the kernel chooses a fresh range that overlaps
        // no memory anyone owns.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(FileView { addr: ptr as usize, len, mapped, detached: false })
    }

    pub fn address(&self) -> usize {
        self.addr
    }

    /// Copies `dst.len()` bytes from `offset` of the view into `dst`;
    /// `None` where that runs past the view's end.
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) -> Option<()> {
        if offset.checked_add(dst.len())? > self.len {
            return None;
        }
        // SAFETY: in bounds (checked above) of a mapping this value owns,
        // readable while the lease is held or once detached (module note).
        // A raw copy: others may write the bytes through their exports.
        unsafe {
            std::ptr::copy_nonoverlapping((self.addr + offset) as *const u8, dst.as_mut_ptr(), dst.len())
        };
        Some(())
    }

    /// Makes the view stop depending on the file, at the same address and
    /// with the same bytes: they are copied into fresh anonymous memory,
    /// which `mremap(MREMAP_MAYMOVE | MREMAP_FIXED)` (Linux 2.4) then
    /// moves over the view in one step under the mmap lock, so a reader on
    /// another thread sees the file's page or its copy, both the same
    /// bytes. Must run while the file's lease is still held (the copy reads
    /// the file's pages). A write through a view on another thread during
    /// the copy may be lost: the view is a loader's, read, not written.
    /// On failure (ENOMEM) the view is still the file's.
    pub fn detach(&mut self) -> io::Result<()> {
        if self.detached {
            return Ok(());
        }
        // SAFETY: a fresh anonymous mapping where the kernel chooses.
        let copy = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if copy == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both ranges are mapped, `mapped` bytes long, readable
        // (the view's pages exist: the lease keeps the file at least `len`
        // long, and the tail of the last page past the end reads zeros) and
        // distinct mappings. Raw pointers only: no Rust reference to the
        // view's bytes is formed while others may write them.
        unsafe { std::ptr::copy_nonoverlapping(self.addr as *const u8, copy.cast::<u8>(), self.mapped) };
        // SAFETY: moves our anonymous mapping onto the view's range, which
        // this value owns; MREMAP_FIXED unmaps the old pages atomically.
        let moved = unsafe {
            libc::mremap(copy, self.mapped, self.mapped, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, self.addr)
        };
        if moved == libc::MAP_FAILED {
            let err = io::Error::last_os_error();
            // SAFETY: the copy is ours and unreachable by anyone else.
            unsafe { libc::munmap(copy, self.mapped) };
            return Err(err);
        }
        self.detached = true;
        Ok(())
    }
}

impl Drop for FileView {
    fn drop(&mut self) {
        // SAFETY: the range is this value's own mapping; its owner drops it
        // only once nothing can reach the bytes (see crate::lease).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.mapped) };
    }
}
