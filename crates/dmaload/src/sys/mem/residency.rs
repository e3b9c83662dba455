//! Page-cache residency of a file's range (`mincore`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

use super::*;

/// How many pages of bytes `offset..offset + len` of `fd` are in the page
/// cache, and how many pages the range spans: `mmap` + `mincore(2)`.
///
/// Since Linux 5.0, mincore reports every page of a file as resident unless
/// the process owns the file or may write it (a side channel closed by
/// lying): for such a file this fails with `PermissionDenied` instead of
/// answering "all cached".
pub fn page_cache_residency(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<(u64, u64)> {
    if len == 0 {
        return Ok((0, 0));
    }
    if !mincore_tells_the_truth(fd)? {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "mincore reports every page of a file this process neither owns nor may write as cached \
             (Linux 5.0+), so its page-cache residency is unknown",
        ));
    }
    let page = page_size() as u64;
    let start = offset / page * page;
    let end = offset + len;
    let pages = (end - start).div_ceil(page);
    // One window at a time: a mapping of the whole range could need more
    // address space than RLIMIT_AS leaves (a huge file, a tight limit).
    let mut resident = 0;
    let mut vec = vec![0u8; (RESIDENCY_WINDOW / page) as usize];
    let mut at = start;
    while at < end {
        let span = (end - at).min(RESIDENCY_WINDOW) as usize;
        // SAFETY: a fresh read-only shared mapping of the file at a
        // page-aligned offset; mincore only inspects it and we unmap it
        // before going on.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                at as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let window = &mut vec[..span.div_ceil(page as usize)];
        // SAFETY: addr..addr+span is the mapping above; `window` has one
        // byte per page of it.
        let ret = unsafe { libc::mincore(addr, span, window.as_mut_ptr()) };
        let err = io::Error::last_os_error();
        // SAFETY: unmapping the mapping created above, which nothing else uses.
        unsafe { libc::munmap(addr, span) };
        if ret < 0 {
            return Err(err);
        }
        resident += window.iter().filter(|&&b| b & 1 != 0).count() as u64;
        at += span as u64;
    }
    Ok((resident, pages))
}

/// Bytes of a file [`page_cache_residency`] maps at a time.
pub(super) const RESIDENCY_WINDOW: u64 = 64 << 20;

/// Whether mincore tells the truth about `fd`'s file: the process owns it
/// (or is root, which the kernel lets past as owner), or may write it.
pub(super) fn mincore_tells_the_truth(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `stat` is a writable struct stat the kernel fills.
    check(unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) })?;
    // SAFETY: filled by a successful fstat.
    let owner = unsafe { stat.assume_init() }.st_uid;
    let euid = crate::sys::process::effective_uid();
    if euid == 0 || euid == owner {
        return Ok(true);
    }
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `path` is a NUL-terminated string that lives across the call.
    let writable = unsafe { libc::faccessat(libc::AT_FDCWD, path.as_ptr(), libc::W_OK, libc::AT_EACCESS) };
    Ok(writable == 0)
}
