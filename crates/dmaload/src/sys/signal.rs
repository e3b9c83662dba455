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
        let set = signal_set(signals)?;
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

/// Runs `write` (writes to a pipe or FIFO) with SIGPIPE blocked in the
/// calling thread, so that a reader gone away makes them fail with EPIPE
/// instead of killing the process: a library must not kill its host (a C
/// program, or Python after `signal(SIGPIPE, SIG_DFL)`, where SIGPIPE's
/// action is to terminate). A blocked SIGPIPE stays pending, so when
/// `write` fails with EPIPE the one it raised is taken (`sigtimedwait`,
/// zero timeout) before the mask is restored, unless a SIGPIPE was pending
/// already: that one is not ours to take, and it stands for both.
pub fn without_sigpipe<T>(write: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    let sigpipe = signal_set(&[libc::SIGPIPE])?;
    let mut old = MaybeUninit::<libc::sigset_t>::zeroed();
    // SAFETY: `sigpipe` is an initialised sigset_t and `old` a writable one.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &sigpipe, old.as_mut_ptr()) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    // SAFETY: filled by the successful pthread_sigmask.
    let old = unsafe { old.assume_init() };
    let pending_before = sigpipe_pending();
    let result = write();
    let epipe = matches!(&result, Err(err) if err.raw_os_error() == Some(libc::EPIPE));
    if epipe && matches!(pending_before, Ok(false)) {
        let now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // EAGAIN: none pending (an EPIPE that raised no signal); EINTR:
        // interrupted, again.
        // SAFETY: `sigpipe` and `now` live across the call; a null info
        // pointer is allowed.
        while unsafe { libc::sigtimedwait(&sigpipe, std::ptr::null_mut(), &now) } < 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
        {}
    }
    // SAFETY: `old` is the mask read above; a null old-set pointer is allowed.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    debug_assert_eq!(ret, 0, "restoring a mask pthread_sigmask returned cannot fail");
    result
}

/// Whether SIGPIPE is pending for the calling thread or the process.
fn sigpipe_pending() -> io::Result<bool> {
    let mut pending = MaybeUninit::<libc::sigset_t>::zeroed();
    // SAFETY: `pending` is a writable sigset_t the kernel fills.
    check(unsafe { libc::sigpending(pending.as_mut_ptr()) })?;
    // SAFETY: `pending` was filled by sigpending; sigismember only reads it.
    Ok(unsafe { libc::sigismember(pending.as_ptr(), libc::SIGPIPE) } == 1)
}

/// The set of `signals`.
fn signal_set(signals: &[libc::c_int]) -> io::Result<libc::sigset_t> {
    let mut set = MaybeUninit::<libc::sigset_t>::zeroed();
    // SAFETY: `set` is a writable sigset_t that sigemptyset initialises.
    check(unsafe { libc::sigemptyset(set.as_mut_ptr()) })?;
    for &signal in signals {
        // SAFETY: `set` was initialised by sigemptyset above.
        check(unsafe { libc::sigaddset(set.as_mut_ptr(), signal) })?;
    }
    // SAFETY: initialised by sigemptyset/sigaddset.
    Ok(unsafe { set.assume_init() })
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const CHILD: &str = "DMALOAD_TEST_SIGPIPE_CHILD";

    #[test]
    fn a_write_whose_reader_left_fails_with_epipe_under_the_default_sigpipe() {
        let test = "sys::signal::tests::a_write_whose_reader_left_fails_with_epipe_under_the_default_sigpipe";
        if std::env::var_os(CHILD).is_none() {
            // The test harness ignores SIGPIPE, as every Rust program: a
            // child of its own puts it back to the default, killing.
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success() && stdout.contains("CHILD OK"), "{out:?}");
            return;
        }
        // SAFETY: SIG_DFL is a valid disposition and installs no handler.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let (reader, mut writer) = std::io::pipe().unwrap();
        drop(reader);
        let err = without_sigpipe(|| writer.write_all(b"x")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPIPE));
        assert!(!sigpipe_pending().unwrap(), "the write's SIGPIPE was left pending");
        // A SIGPIPE pending before (blocked in this thread, by the signalfd)
        // is not the write's to take: it stays, standing for both.
        let signals = SignalFd::new(&[libc::SIGPIPE]).unwrap();
        // SAFETY: raise takes no pointers; SIGPIPE is blocked, so it stays pending.
        assert_eq!(unsafe { libc::raise(libc::SIGPIPE) }, 0);
        let err = without_sigpipe(|| writer.write_all(b"x")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPIPE));
        assert_eq!(signals.take().unwrap(), Some(libc::SIGPIPE as u32));
        assert_eq!(signals.take().unwrap(), None);
        println!("CHILD OK");
    }
}
