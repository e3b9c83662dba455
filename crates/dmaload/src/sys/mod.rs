//! The only module of the crate allowed to use `unsafe`.
//!
//! # Safety
//!
//! Everything outside `sys` is `#![deny(unsafe_code)]`; the types here wrap
//! raw syscalls behind safe signatures. The invariants this perimeter keeps:
//!
//! * A [`mem::Mapping`] owns its pages for its whole life and unmaps them on
//!   drop (or, 64 MiB and more, hands the region to the unmapping thread,
//!   which nothing else can reach it through any more). Rust references to
//!   its bytes exist only through `&Mapping` or `&mut Mapping` (slices).
//! * The kernel writes into a mapping only through a [`mem::MappingWriter`],
//!   which mutably borrows the mapping. While a writer (or anything holding
//!   one, such as a [`uring::Ring`]) lives, no slice of the mapping can exist,
//!   so asynchronous kernel writes never race with Rust reads.
//! * A [`uring::Ring`] holds the memory its requests use for its whole life
//!   (a `MappingWriter` it reads into, or `RawBytes` it writes out, which
//!   the kernel only reads) and waits for all of its in-flight requests
//!   before it is dropped, so no request outlives the borrow of its memory.
//! * Every raw pointer handed to the kernel is bounds-checked against the
//!   mapping it points into.
//! * ioctl argument structs ([`dmabuf`]) are `#[repr(C)]` copies of the
//!   kernel uAPI, live across the call, and new fds returned by the kernel
//!   are wrapped in `OwnedFd` at once.
//! * Descriptors received over a socket ([`socket`]) are wrapped in
//!   `OwnedFd` before any check of the message, so a refused message
//!   closes them.
//! * Memory a peer process maps too ([`shm::PeerMapping`]) is reached only
//!   through atomics, raw copies and kernel calls ([`shm::RawBytes`]); its
//!   slices are `unsafe`, as the peer may write it at any time.

pub mod cuda;
pub mod dmabuf;
pub mod eventfd;
pub mod file;
pub mod lease;
pub mod mem;
pub mod process;
pub mod shm;
pub mod signal;
pub mod socket;
pub mod uring;
pub mod vm;

use std::io;

/// Turns a `-1`-on-error libc return value into an `io::Result`.
fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Same as [`check`] for `ssize_t` results.
fn check_size(ret: libc::ssize_t) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}
