//! The system calls the model-cache service (the `dmaload-share` crate)
//! makes beyond the core's loads, as the core's safe wrappers: that crate
//! has no `unsafe` code of its own, all of it stays in the core's private
//! `sys` module. Each is documented where it is defined; none hands out
//! memory that a caller could keep past its mapping.
//!
//! Not a general-purpose system interface: only what the service and its
//! client need, and it changes with them.

/// Process-wide facts: CPU time consumed (a handoff's report), the soft
/// `RLIMIT_NOFILE` (how many files the service may keep open), the
/// effective uid (whom the service serves, the default socket's path).
pub use crate::sys::process::{cpu_time, effective_uid, open_files_limit};

/// Descriptors: a new one for a number someone else owns (a socket handed
/// over by fd), whether one may be read (a client's file), its
/// filesystem's magic number, and a socket's permission bits set without
/// following a symlink.
pub use crate::sys::file::{chmod_socket, dup_raw, filesystem_magic, readable};

/// SIGINT/SIGTERM as a readable descriptor, and waiting on several
/// descriptors at once: the service's accept loop.
pub use crate::sys::signal::{poll_readable, SignalFd};

/// Pages: the base page size, the 2 MiB alignment of huge pages, and a
/// read-only mapping of a memfd that collapses its pages into huge pages
/// (which the service does to a cached file in the background; the
/// mapping never leaves the value).
pub use crate::sys::mem::{page_size, HugePageCollapse, HUGE_PAGE_ALIGN};
