//! Files: statx alignment, statfs, positioned reads into mappings, fadvise.

use std::io;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;
use super::mem::MappingWriter;

/// O_DIRECT alignment of an open file, from `statx(STATX_DIOALIGN)` (Linux 6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectIoAlignment {
    /// Required alignment of the user buffer address, in bytes.
    pub memory: u32,
    /// Required alignment of file offsets and lengths, in bytes.
    pub offset: u32,
}

/// What `statx(STATX_DIOALIGN)` says about direct I/O on `fd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DioAlignQuery {
    /// The filesystem supports O_DIRECT on this file with this alignment.
    Supported(DirectIoAlignment),
    /// The filesystem reports that O_DIRECT is not supported on this file.
    Unsupported,
    /// The kernel or filesystem does not report STATX_DIOALIGN.
    Unknown,
}

pub fn statx_dio_align(fd: BorrowedFd<'_>) -> io::Result<DioAlignQuery> {
    let mut stx = MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: an empty path with AT_EMPTY_PATH refers to `fd` itself; `stx`
    // is a writable statx struct the kernel fills.
    check(unsafe {
        libc::statx(fd.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, stx.as_mut_ptr())
    })?;
    // SAFETY: zero-initialised, then filled by a successful statx.
    let stx = unsafe { stx.assume_init() };
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(DioAlignQuery::Unknown);
    }
    if stx.stx_dio_mem_align == 0 || stx.stx_dio_offset_align == 0 {
        return Ok(DioAlignQuery::Unsupported);
    }
    Ok(DioAlignQuery::Supported(DirectIoAlignment {
        memory: stx.stx_dio_mem_align,
        offset: stx.stx_dio_offset_align,
    }))
}

/// The filesystem magic number of `fd` (`fstatfs(2)` `f_type`).
pub fn filesystem_magic(fd: BorrowedFd<'_>) -> io::Result<i64> {
    let mut st = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `st` is a writable statfs struct the kernel fills.
    check(unsafe { libc::fstatfs(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: filled by a successful fstatfs.
    Ok(unsafe { st.assume_init() }.f_type)
}

/// `preadv2(2)` (Linux 4.6) of `range` of the mapping from `offset`, with
/// per-call `RWF_*` flags (e.g. `RWF_DONTCACHE`, Linux 6.14).
pub fn pread_into(
    fd: BorrowedFd<'_>,
    dst: MappingWriter<'_>,
    range: Range<usize>,
    offset: u64,
    flags: libc::c_int,
) -> io::Result<usize> {
    let iov = dst.iovec(&range);
    // SAFETY: the iovec lies inside a mapping kept alive and free of Rust
    // references by `dst`'s borrow; preadv2 writes at most iov_len bytes.
    let ret = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, offset as libc::off_t, flags) };
    super::check_size(ret)
}

/// `posix_fadvise(2)` over a byte range.
pub fn fadvise(fd: BorrowedFd<'_>, offset: u64, len: u64, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: posix_fadvise takes no pointers.
    let ret =
        unsafe { libc::posix_fadvise(fd.as_raw_fd(), offset as libc::off_t, len as libc::off_t, advice) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

/// Whether buffered reads of `fd` accept `RWF_DONTCACHE` (Linux 6.14, per
/// filesystem): a one-byte `preadv2` at offset 0 with the flag, which fails
/// with EOPNOTSUPP where it is not supported. An empty file reads 0 bytes
/// either way, which still tells.
pub fn supports_dontcache(fd: BorrowedFd<'_>) -> bool {
    let mut byte = 0u8;
    let iov = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    // SAFETY: the iovec points at one writable byte on this stack frame.
    let ret = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, 0, libc::RWF_DONTCACHE) };
    ret >= 0
}
