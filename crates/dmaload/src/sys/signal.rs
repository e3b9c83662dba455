//! Signals as readable descriptors (`signalfd(2)`, Linux 2.6.22) and
//! waiting on several descriptors at once (`poll(2)`): a service loop
//! learns of SIGINT/SIGTERM the way it learns of a new connection, with no
//! handler running in the middle of its code.

use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::{check, check_size};

/// A descriptor that becomes readable when one of its signals is pending.
/// Creating it blocks those signals in the calling thread, so call it
/// before starting threads (they inherit the mask), or a thread that
/// leaves the signal unblocked takes its default action instead.
#[derive(Debug)]
pub struct SignalFd {
    fd: OwnedFd,
}

impl SignalFd {
    /// Blocks `signals` (`pthread_sigmask(SIG_BLOCK)`) and returns a
    /// non-blocking, close-on-exec signalfd for them.
    pub fn new(signals: &[libc::c_int]) -> io::Result<SignalFd> {
        let mut set = MaybeUninit::<libc::sigset_t>::zeroed();
        // SAFETY: `set` is a writable sigset_t that sigemptyset initialises.
        check(unsafe { libc::sigemptyset(set.as_mut_ptr()) })?;
        for &signal in signals {
            // SAFETY: `set` was initialised by sigemptyset above.
            check(unsafe { libc::sigaddset(set.as_mut_ptr(), signal) })?;
        }
        // SAFETY: initialised by sigemptyset/sigaddset.
        let set = unsafe { set.assume_init() };
        // SAFETY: `set` is a valid sigset_t; a null old set is allowed.
        let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if ret != 0 {
            return Err(io::Error::from_raw_os_error(ret));
        }
        // SAFETY: -1 asks for a new signalfd; `set` lives across the call.
        let fd = check(unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) })?;
        // SAFETY: `fd` was just returned by signalfd and nothing else owns it.
        Ok(SignalFd { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// The next pending signal's number, or `None` when none is pending.
    pub fn take(&self) -> io::Result<Option<u32>> {
        let mut info = MaybeUninit::<libc::signalfd_siginfo>::zeroed();
        // SAFETY: `info` is a writable signalfd_siginfo of the size given.
        let read = unsafe {
            libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), size_of::<libc::signalfd_siginfo>())
        };
        match check_size(read) {
            Ok(n) if n == size_of::<libc::signalfd_siginfo>() => {
                // SAFETY: zero-initialised plain data, filled by the read.
                Ok(Some(unsafe { info.assume_init() }.ssi_signo))
            }
            Ok(_) => Ok(None),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(err) => Err(err),
        }
    }
}

impl AsFd for SignalFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Waits until at least one of `fds` is readable (or hung up), or until
/// `timeout` passes (`None`: forever); returns which are. An interrupted
/// wait (`EINTR`) returns all `false`.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<Vec<bool>> {
    let mut polled: Vec<libc::pollfd> =
        fds.iter().map(|fd| libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
    let timeout = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as libc::c_int);
    // SAFETY: `polled` is a writable array of `len` pollfds that lives
    // across the call.
    match check(unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, timeout) }) {
        Ok(_) => Ok(polled.iter().map(|p| p.revents != 0).collect()),
        Err(err) if err.kind() == io::ErrorKind::Interrupted => Ok(vec![false; fds.len()]),
        Err(err) => Err(err),
    }
}
