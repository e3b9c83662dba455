//! File sizes, space reservation and memfd seals.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

/// `ftruncate(2)`: sets the size of a memfd or file; past `RLIMIT_FSIZE`
/// an `InvalidInput` error instead of the SIGXFSZ that kills the process.
pub fn set_len(fd: BorrowedFd<'_>, len: u64) -> io::Result<()> {
    if let Some(why) = crate::sys::process::past_file_size_limit(len) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("size a memfd or file: {why}")));
    }
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: ftruncate takes no pointers.
    check(unsafe { libc::ftruncate(fd.as_raw_fd(), len) }).map(drop)
}

/// `fallocate(2)` mode 0: reserves `offset..offset + len` of a file, so a
/// full filesystem fails here rather than part-way through the writes.
pub fn allocate(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate takes no pointers.
    check(unsafe { libc::fallocate(fd.as_raw_fd(), 0, offset as libc::off_t, len as libc::off_t) }).map(drop)
}

/// Seals of a memfd (`fcntl(F_ADD_SEALS)`, Linux 3.17): what no one, this
/// process included, may do to it any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seals(libc::c_int);

impl Seals {
    /// No shrinking (`F_SEAL_SHRINK`): udmabuf requires it.
    pub const SHRINK: Seals = Seals(libc::F_SEAL_SHRINK);
    /// No growing (`F_SEAL_GROW`).
    pub const GROW: Seals = Seals(libc::F_SEAL_GROW);
    /// No new writable shared mappings and no `write(2)` (Linux 5.1);
    /// mappings made before stay writable, private mappings are
    /// copy-on-write, and udmabuf still accepts the memfd.
    pub const FUTURE_WRITE: Seals = Seals(libc::F_SEAL_FUTURE_WRITE);
    /// No writes at all (`F_SEAL_WRITE`, Linux 3.17): the kernel adds it
    /// only while no writable shared mapping of the memfd exists in any
    /// process and no page is pinned (a registered io_uring buffer, a
    /// udmabuf, `cudaHostRegister`), failing with EBUSY otherwise; after
    /// it, no `write(2)`, no writable shared mapping. So the bytes can
    /// never change again: what makes a `&[u8]` over them sound in a
    /// process that did not write them. udmabuf refuses such a memfd.
    pub const WRITE: Seals = Seals(libc::F_SEAL_WRITE);
    /// No more seals may be added or removed (`F_SEAL_SEAL`).
    pub const SEAL: Seals = Seals(libc::F_SEAL_SEAL);
}

impl std::ops::BitOr for Seals {
    type Output = Seals;
    fn bitor(self, other: Seals) -> Seals {
        Seals(self.0 | other.0)
    }
}

impl Seals {
    /// Both sets of seals (`|`, usable in constants).
    pub const fn union(self, other: Seals) -> Seals {
        Seals(self.0 | other.0)
    }

    /// Whether every seal of `other` is in `self`.
    pub fn contains(self, other: Seals) -> bool {
        self.0 & other.0 == other.0
    }
}

/// The seals of a memfd (`fcntl(F_GET_SEALS)`).
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<Seals> {
    // SAFETY: F_GET_SEALS takes no argument.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }).map(Seals)
}

/// Adds `seals` to a memfd created with sealing allowed.
pub fn add_seals(fd: BorrowedFd<'_>, seals: Seals) -> io::Result<()> {
    // SAFETY: F_ADD_SEALS takes an integer argument, no pointers.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals.0) }).map(drop)
}
