//! `eventfd(2)` (Linux 2.6.27) counters as wake-up signals between
//! processes, and `poll(2)` to wait on them together with a socket, so a
//! wait ends when the peer signals, when it hangs up, or at a timeout.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use super::check;

/// An eventfd in non-blocking counter mode: [`EventFd::signal`] adds one,
/// [`EventFd::drain`] resets it, and it is readable (pollable) while
/// non-zero.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new eventfd (`EFD_CLOEXEC | EFD_NONBLOCK`).
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; the new fd is owned at once.
        let fd = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: `fd` was just returned by eventfd and nothing else owns it.
        Ok(EventFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Takes a descriptor received from another process, refusing anything
    /// but an eventfd (a pipe or FIFO in its place could block a write), and
    /// makes it non-blocking (the flag is shared with the sender's copy).
    pub fn from_fd(fd: OwnedFd) -> io::Result<EventFd> {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        if link.as_os_str() != "anon_inode:[eventfd]" {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected an eventfd, got {}", link.display()),
            ));
        }
        super::file::set_nonblocking(fd.as_fd(), true)?;
        Ok(EventFd { fd })
    }

    /// Adds one to the counter, waking whoever polls it. A counter at its
    /// maximum (EAGAIN) is already readable, which is all a signal needs.
    pub fn signal(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: `one` is 8 readable bytes living across the call.
        let ret = unsafe { libc::write(self.fd.as_raw_fd(), std::ptr::addr_of!(one).cast(), 8) };
        match super::check_size(ret) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok(()),
            other => other.map(drop),
        }
    }

    /// Resets the counter to zero (nothing to reset is fine).
    pub fn drain(&self) -> io::Result<()> {
        let mut value: u64 = 0;
        // SAFETY: `value` is 8 writable bytes living across the call.
        let ret = unsafe { libc::read(self.fd.as_raw_fd(), std::ptr::addr_of_mut!(value).cast(), 8) };
        match super::check_size(ret) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok(()),
            other => other.map(drop),
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// What [`poll_two`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The first descriptor (the signal) is readable.
    Signalled,
    /// The second descriptor (the peer's socket) hung up, or has a message
    /// or an error pending.
    Peer,
    TimedOut,
}

/// `poll(2)` on `signal` and `peer` for input until one is ready or
/// `timeout` passes (`None`: forever); EINTR resumes with the time left.
/// The signal wins when both are ready.
pub fn poll_two(
    signal: BorrowedFd<'_>,
    peer: BorrowedFd<'_>,
    timeout: Option<Duration>,
) -> io::Result<Readiness> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let mut fds = [
            libc::pollfd { fd: signal.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: peer.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 },
        ];
        let millis = match deadline {
            None => -1,
            Some(at) => {
                let left = at.saturating_duration_since(Instant::now());
                // Round up, so a wait never ends before its timeout.
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int
            }
        };
        // SAFETY: `fds` is a writable array of two pollfds living across the call.
        let ret = unsafe { libc::poll(fds.as_mut_ptr(), 2, millis) };
        match check(ret) {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(e),
            Ok(0) if deadline.is_some_and(|at| Instant::now() >= at) => return Ok(Readiness::TimedOut),
            Ok(0) => continue,
            Ok(_) if fds[0].revents != 0 => return Ok(Readiness::Signalled),
            Ok(_) => return Ok(Readiness::Peer),
        }
    }
}

/// `poll(2)` for input on one descriptor until it is readable or `timeout`
/// passes; true when readable (or hung up). EINTR resumes the wait.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    poll_one(fd, libc::POLLIN, timeout)
}

/// `poll(2)` for output on one descriptor until it takes bytes or `timeout`
/// passes; true when writable (or in error, which the next write reports).
/// EINTR resumes the wait.
pub fn poll_writable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    poll_one(fd, libc::POLLOUT, timeout)
}

fn poll_one(fd: BorrowedFd<'_>, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut pollfd = libc::pollfd { fd: fd.as_raw_fd(), events, revents: 0 };
        let left = deadline.saturating_duration_since(Instant::now());
        let millis = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `pollfd` is one writable pollfd living across the call.
        match check(unsafe { libc::poll(&mut pollfd, 1, millis) }) {
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(e),
            Ok(0) if Instant::now() < deadline => continue,
            Ok(ready) => return Ok(ready > 0),
        }
    }
}
