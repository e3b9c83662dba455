//! Files: statx alignment, statfs, fadvise,
//! and the in-kernel copies (sendfile, splice, copy_file_range).

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

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

/// Opens `path` read-only with `O_NONBLOCK | O_NOCTTY | O_CLOEXEC`: an open
/// that never waits (a FIFO without a writer) and never makes a terminal
/// the controlling one.
pub fn open_nonblocking(path: &std::path::Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path)
}

/// Sets or clears `O_NONBLOCK` on an open file (`fcntl(F_SETFL)`).
pub fn set_nonblocking(fd: BorrowedFd<'_>, nonblocking: bool) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL take no pointers.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    let flags = if nonblocking { flags | libc::O_NONBLOCK } else { flags & !libc::O_NONBLOCK };
    // SAFETY: as above.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags) }).map(drop)
}

/// A new descriptor (close-on-exec) for the open file at descriptor number
/// `fd`, which someone else owns (a Python object's `fileno()`):
/// `fcntl(F_DUPFD_CLOEXEC)`. Duplicating only reads the descriptor table,
/// so a wrong number gives `EBADF` or another file, never unsoundness.
pub fn dup_raw(fd: std::os::fd::RawFd) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: F_DUPFD_CLOEXEC takes an integer argument and no pointers.
    let new = check(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) })?;
    // SAFETY: `new` was just created by fcntl and nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(new) })
}

/// Whether an open file description may be read: opened `O_RDONLY` or
/// `O_RDWR`, and not an `O_PATH` descriptor, which grants no access to the
/// file's bytes (`fcntl(F_GETFL)`).
pub fn readable(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: F_GETFL takes no pointers.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    let access = flags & libc::O_ACCMODE;
    Ok(flags & libc::O_PATH == 0 && (access == libc::O_RDONLY || access == libc::O_RDWR))
}

/// The (major, minor) numbers of a device number (`st_dev`, `st_rdev`).
pub fn device_numbers(dev: u64) -> (u32, u32) {
    (libc::major(dev), libc::minor(dev))
}

/// The filesystem magic number of `fd` (`fstatfs(2)` `f_type`).
pub fn filesystem_magic(fd: BorrowedFd<'_>) -> io::Result<i64> {
    let mut st = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `st` is a writable statfs struct the kernel fills.
    check(unsafe { libc::fstatfs(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: filled by a successful fstatfs.
    Ok(unsafe { st.assume_init() }.f_type)
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
/// filesystem): a one-byte `preadv2` with the flag, which fails with
/// EOPNOTSUPP where it is not supported. It reads at the largest offset a
/// file can have: the kernel checks the flag before the read, and the read
/// past any file's end ends before it reaches the page cache, so the probe
/// neither does I/O nor leaves a page (or a readahead window) cached.
pub fn supports_dontcache(fd: BorrowedFd<'_>) -> bool {
    let mut byte = 0u8;
    let iov = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
    // The offset plus the length stays within i64, as the kernel requires.
    let past_every_end = i64::MAX - 1;
    // SAFETY: the iovec points at one writable byte on this stack frame.
    let ret = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, past_every_end, libc::RWF_DONTCACHE) };
    ret >= 0
}

/// Sets or clears `O_DIRECT` on an open file (`fcntl(F_SETFL)`); EINVAL
/// when the filesystem has no direct I/O.
pub fn set_direct(fd: BorrowedFd<'_>, direct: bool) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL take no pointers.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    let flags = if direct { flags | libc::O_DIRECT } else { flags & !libc::O_DIRECT };
    // SAFETY: as above.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags) }).map(drop)
}

/// Gives a name to a file opened with `O_TMPFILE` (Linux 3.11):
/// `linkat("/proc/self/fd/N", AT_SYMLINK_FOLLOW)`, which needs no
/// capability (unlike `AT_EMPTY_PATH`). Fails with EEXIST if `new` exists.
pub fn link_tmpfile(fd: BorrowedFd<'_>, new: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let old =
        std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(io::Error::other)?;
    let new = std::ffi::CString::new(new.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: both paths are valid NUL-terminated strings for the call.
    check(unsafe {
        libc::linkat(libc::AT_FDCWD, old.as_ptr(), libc::AT_FDCWD, new.as_ptr(), libc::AT_SYMLINK_FOLLOW)
    })
    .map(drop)
}

/// Opens an unnamed temporary file in directory `dir` with `O_TMPFILE`
/// (Linux 3.11; EOPNOTSUPP, EISDIR or EINVAL where the filesystem or
/// kernel lacks it), read-write, with permission bits `mode`.
pub fn open_tmpfile(dir: &std::path::Path, mode: u32) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).write(true).mode(mode).custom_flags(libc::O_TMPFILE).open(dir)
}

/// Whether an `open_tmpfile` error means "no O_TMPFILE here" rather than a
/// real failure (a missing or unwritable directory).
pub fn tmpfile_unsupported(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL))
}

/// Opens an existing file for writing with `O_NONBLOCK | O_NOCTTY |
/// O_NOFOLLOW`, never creating or truncating it: an open that never waits
/// (a FIFO without a reader fails with ENXIO at once), never makes a
/// terminal the controlling one, and never follows a symlink swapped in.
pub fn open_existing_for_writing(path: &std::path::Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW)
        .open(path)
}

/// Opens an existing file read-only without following a symlink and
/// without waiting (`O_NOFOLLOW | O_NONBLOCK | O_NOCTTY`).
pub fn open_nofollow(path: &std::path::Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
}

/// Sets the permission bits of the socket at `path` without following a
/// symlink there: the path is opened `O_PATH | O_NOFOLLOW`, checked to be
/// a socket, and changed through `/proc/self/fd` (the inode opened, not
/// whatever the path names by then). ENOTSOCK for anything else at `path`.
pub fn chmod_socket(path: &std::path::Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
    let node =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_NOFOLLOW).open(path)?;
    if !node.metadata()?.file_type().is_socket() {
        return Err(io::Error::from_raw_os_error(libc::ENOTSOCK));
    }
    let by_fd = format!("/proc/self/fd/{}", node.as_raw_fd());
    std::fs::set_permissions(by_fd, std::fs::Permissions::from_mode(mode))
}

/// Takes an exclusive `flock(2)` on `fd` without waiting: `Ok(false)` when
/// another open file description holds a lock. The lock lasts until every
/// fd of this open file is closed, which a killed process does too.
pub fn try_lock_exclusive(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: flock takes no pointers.
    match check(unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(e) => Err(e),
    }
}
