//! Unix-domain `SOCK_SEQPACKET` sockets: messages with boundaries that can
//! carry file descriptors (`SCM_RIGHTS`), and the credentials the kernel
//! records for the peer (`SO_PEERCRED`).
//!
//! Sequenced packets keep each message whole: a receiver never sees half a
//! request or the descriptors of one message with the bytes of another, and
//! a message larger than the receive buffer is refused instead of being
//! split.

use std::ffi::OsStr;
use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use super::{check, check_size};

/// Runs a socket call again while it is interrupted (`EINTR`). A blocking
/// socket call with a timeout (`SO_RCVTIMEO`/`SO_SNDTIMEO`) is not restarted
/// by the kernel, and io_uring's task work interrupts whichever thread used
/// a ring, so without this a later `recv` on that thread fails at random.
fn restarting<T>(mut call: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match call() {
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

/// Most descriptors one message carries; a message with more is refused on
/// send, and on receipt the extra descriptors are closed and the message
/// refused.
pub const MAX_FDS_PER_MESSAGE: usize = 16;

/// Who is at the other end of a connected socket, as the kernel recorded at
/// `connect(2)`/`socketpair(2)` time: the peer cannot forge it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

/// A listening `SOCK_SEQPACKET` socket bound to a path.
#[derive(Debug)]
pub struct SeqpacketListener {
    fd: OwnedFd,
}

/// One connected end of a `SOCK_SEQPACKET` socket.
#[derive(Debug)]
pub struct SeqpacketConn {
    fd: OwnedFd,
}

fn new_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket takes no pointers; the new fd is owned at once.
    let fd = check(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by socket and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `path` as a `sockaddr_un`; paths longer than `sun_path` (107 bytes and a
/// NUL) or holding a NUL byte are refused.
fn socket_address(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { MaybeUninit::zeroed().assume_init() };
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket path {:?} must be 1 to {} bytes without NUL",
                OsStr::from_bytes(bytes),
                addr.sun_path.len() - 1
            ),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

impl SeqpacketListener {
    /// Binds a new socket to `path` (which must not exist) and listens with
    /// a backlog of `backlog` connections. The socket file is created with
    /// mode 0600 less the umask: only its owner (and root) may connect,
    /// from the moment it exists; a caller serving other users widens it.
    pub fn bind(path: &Path, backlog: u32) -> io::Result<SeqpacketListener> {
        let fd = new_socket()?;
        let (addr, len) = socket_address(path)?;
        // bind(2) gives the file the socket inode's mode less the umask; a
        // chmod after it would leave a moment when others could connect.
        // SAFETY: fchmod takes no pointers; `fd` is an open socket.
        check(unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) })?;
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes that lives
        // across the call.
        check(unsafe { libc::bind(fd.as_raw_fd(), std::ptr::addr_of!(addr).cast(), len) })?;
        let backlog = backlog.min(i32::MAX as u32) as libc::c_int;
        // SAFETY: listen takes no pointers.
        check(unsafe { libc::listen(fd.as_raw_fd(), backlog) })?;
        Ok(SeqpacketListener { fd })
    }

    /// Waits for the next connection (blocking unless the listener's fd
    /// was made non-blocking, `O_NONBLOCK`: then `WouldBlock` if none waits).
    pub fn accept(&self) -> io::Result<SeqpacketConn> {
        let fd = restarting(|| {
            // SAFETY: null address pointers ask accept4 not to report the peer's
            // address; the new fd is owned at once.
            check(unsafe {
                libc::accept4(
                    self.fd.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            })
        })?;
        // SAFETY: `fd` was just returned by accept4 and nothing else owns it.
        Ok(SeqpacketConn { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// [`Self::accept`] if a connection arrives within `timeout`, else
    /// `None`: lets a caller check on the process it expects in between.
    pub fn accept_timeout(&self, timeout: Duration) -> io::Result<Option<SeqpacketConn>> {
        if super::eventfd::poll_readable(self.fd.as_fd(), timeout)? {
            self.accept().map(Some)
        } else {
            Ok(None)
        }
    }
}

impl AsFd for SeqpacketListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// How long [`SeqpacketConn::connect`] waits for room in a listener's
/// backlog, which fills only when the listening process has stopped
/// accepting (stopped, hung or overwhelmed).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one try of [`SeqpacketConn::connect_until`] waits before it
/// looks at its `stop` again.
pub const CONNECT_SLICE: Duration = Duration::from_millis(20);

impl SeqpacketConn {
    /// Connects to the listener bound at `path`, waiting at most
    /// [`CONNECT_TIMEOUT`] for room in its backlog (then `TimedOut`).
    pub fn connect(path: &Path) -> io::Result<SeqpacketConn> {
        Self::connect_until(path, CONNECT_TIMEOUT, &|| false)
    }

    /// [`SeqpacketConn::connect`], waiting at most `timeout`, and giving up
    /// with `Interrupted` within 20 ms (`CONNECT_SLICE`) of `stop()` turning
    /// true (a caller's Ctrl-C).
    pub fn connect_until(
        path: &Path,
        timeout: Duration,
        stop: &dyn Fn() -> bool,
    ) -> io::Result<SeqpacketConn> {
        let (addr, len) = socket_address(path)?;
        let started = std::time::Instant::now();
        loop {
            if stop() {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "connect cancelled"));
            }
            let conn = SeqpacketConn { fd: new_socket()? };
            // A Unix connect waits for room in the listener's backlog for as
            // long as the send timeout allows (for ever by default): a slice
            // at a time, each on a fresh socket, so `stop` is looked at.
            conn.set_timeout(libc::SO_SNDTIMEO, Some(CONNECT_SLICE.min(timeout)))?;
            // A connect interrupted while it waited left the socket unconnected,
            // so calling again is a fresh attempt.
            let connected = restarting(|| {
                // SAFETY: `addr` is a valid sockaddr_un of `len` bytes that
                // lives across the call.
                check(unsafe { libc::connect(conn.fd.as_raw_fd(), std::ptr::addr_of!(addr).cast(), len) })
            });
            match connected {
                Err(err) if err.raw_os_error() == Some(libc::EAGAIN) => {
                    if started.elapsed() >= timeout {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!(
                                "no room in the listener's backlog after {} s: the process listening is \
                                 not accepting (stopped, hung or overwhelmed)",
                                timeout.as_secs_f64()
                            ),
                        ));
                    }
                }
                other => {
                    other?;
                    conn.set_timeout(libc::SO_SNDTIMEO, None)?;
                    return Ok(conn);
                }
            }
        }
    }

    /// Two connected ends (`socketpair(2)`), e.g. one for a child process.
    pub fn pair() -> io::Result<(SeqpacketConn, SeqpacketConn)> {
        let mut fds: [RawFd; 2] = [-1; 2];
        // SAFETY: `fds` is a writable array of two ints the kernel fills.
        check(unsafe {
            libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr())
        })?;
        // SAFETY: both fds were just returned by socketpair and nothing else
        // owns them.
        let [a, b] = fds.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
        Ok((SeqpacketConn { fd: a }, SeqpacketConn { fd: b }))
    }

    /// Wraps a descriptor that is a connected `SOCK_SEQPACKET` Unix socket
    /// (checked: anything else is refused), e.g. one inherited from a parent.
    pub fn from_fd(fd: OwnedFd) -> io::Result<SeqpacketConn> {
        let refused = || io::Error::new(io::ErrorKind::InvalidInput, "not a Unix SOCK_SEQPACKET socket");
        let option = |name| match socket_option(fd.as_fd(), name) {
            Err(err) if err.raw_os_error() == Some(libc::ENOTSOCK) => Err(refused()),
            other => other,
        };
        if option(libc::SO_DOMAIN)? != libc::AF_UNIX || option(libc::SO_TYPE)? != libc::SOCK_SEQPACKET {
            return Err(refused());
        }
        Ok(SeqpacketConn { fd })
    }

    /// A duplicate (`fcntl(F_DUPFD_CLOEXEC)`) of descriptor number `fd`,
    /// checked as [`Self::from_fd`] checks: for a socket a caller holds only
    /// as a number (a Python `socket.socket`'s `fileno()`). The original
    /// stays open and owned by whoever owns it.
    pub fn duplicate(fd: RawFd) -> io::Result<SeqpacketConn> {
        // SAFETY: F_DUPFD_CLOEXEC takes an integer argument; on an fd that
        // is not open it fails with EBADF and creates nothing.
        let dup = check(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) })?;
        // SAFETY: `dup` was just created by fcntl and nothing else owns it.
        Self::from_fd(unsafe { OwnedFd::from_raw_fd(dup) })
    }

    /// Waits up to `timeout` for a message (or the peer's hang-up); true
    /// when one is there to [`Self::recv`] without blocking. For a caller
    /// that waits in slices, looking at something else between them.
    pub fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        super::eventfd::poll_readable(self.fd.as_fd(), timeout)
    }

    /// Waits up to `timeout` for room to send a message (or the peer's
    /// hang-up, which the send then reports); true when there is. For a
    /// caller that waits in slices, as [`Self::wait_readable`].
    pub fn wait_writable(&self, timeout: Duration) -> io::Result<bool> {
        super::eventfd::poll_writable(self.fd.as_fd(), timeout)
    }

    /// The credentials of the process at the other end.
    pub fn peer_credentials(&self) -> io::Result<PeerCredentials> {
        let mut cred = MaybeUninit::<libc::ucred>::zeroed();
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` is a writable ucred of `len` bytes the kernel fills.
        check(unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                cred.as_mut_ptr().cast(),
                &mut len,
            )
        })?;
        // SAFETY: zero-initialised plain data, filled by a successful call.
        let cred = unsafe { cred.assume_init() };
        Ok(PeerCredentials { pid: cred.pid as u32, uid: cred.uid, gid: cred.gid })
    }

    /// Bounds how long [`Self::recv`] (`SO_RCVTIMEO`) and [`Self::send`]
    /// (`SO_SNDTIMEO`) block; `None` waits forever. A timed-out call fails
    /// with `WouldBlock`.
    pub fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_timeout(libc::SO_RCVTIMEO, timeout)?;
        self.set_timeout(libc::SO_SNDTIMEO, timeout)
    }

    /// Sets one of `SO_RCVTIMEO`/`SO_SNDTIMEO` as [`Self::set_timeouts`] does.
    fn set_timeout(&self, option: libc::c_int, timeout: Option<Duration>) -> io::Result<()> {
        let tv = match timeout {
            Some(t) if !t.is_zero() => libc::timeval {
                tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_usec: t.subsec_micros() as libc::suseconds_t,
            },
            // A zero timeval means "forever" to the kernel; a zero Duration
            // is taken as the shortest wait instead.
            Some(_) => libc::timeval { tv_sec: 0, tv_usec: 1 },
            None => libc::timeval { tv_sec: 0, tv_usec: 0 },
        };
        // SAFETY: `tv` is a valid timeval that lives across the call.
        check(unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                std::ptr::addr_of!(tv).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        })
        .map(drop)
    }

    /// Sends `bytes` as one message carrying duplicates of `fds` (at most
    /// [`MAX_FDS_PER_MESSAGE`]). A peer that has gone away gives `EPIPE`,
    /// never `SIGPIPE`.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        if fds.len() > MAX_FDS_PER_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} descriptors in one message (at most {MAX_FDS_PER_MESSAGE})", fds.len()),
            ));
        }
        let mut control = ControlBuffer::new();
        let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
        // SAFETY: msghdr is plain data; all zeroes is a valid value.
        let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let payload = fds.len() * size_of::<RawFd>();
            // SAFETY: CMSG_SPACE only computes a size.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
            msg.msg_control = control.bytes.as_mut_ptr().cast();
            // SAFETY: msg_control points to `control`, which is aligned for
            // cmsghdr and large enough for MAX_FDS_PER_MESSAGE descriptors,
            // and msg_controllen covers one header; CMSG_FIRSTHDR returns a
            // pointer into it.
            let header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
            // SAFETY: CMSG_LEN only computes a size.
            let cmsg_len = unsafe { libc::CMSG_LEN(payload as u32) } as usize;
            let cmsg = libc::cmsghdr { cmsg_len, cmsg_level: libc::SOL_SOCKET, cmsg_type: libc::SCM_RIGHTS };
            // SAFETY: `header` points to the start of `control` (non-null as
            // msg_controllen ≥ one cmsghdr), valid for writes of a cmsghdr.
            unsafe { header.write(cmsg) };
            let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
            // SAFETY: `header` is the valid first header of `msg`.
            let data = unsafe { libc::CMSG_DATA(header) };
            // SAFETY: `data` points just past the header inside `control`,
            // with room for `payload` bytes (CMSG_SPACE above); copying
            // bytes needs no alignment.
            unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), data, payload) };
        }
        let sent = restarting(|| {
            // SAFETY: `msg` points to `iov` (over `bytes`) and `control`, all
            // alive across the call; the kernel only reads them.
            check_size(unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) })
        })?;
        if sent != bytes.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "message sent in part"));
        }
        Ok(())
    }

    /// Receives one message into `buf`: its length and the descriptors it
    /// carried (close-on-exec). A message longer than `buf` or carrying
    /// more than [`MAX_FDS_PER_MESSAGE`] descriptors is refused with
    /// `InvalidData`, its descriptors closed. Length 0 with no descriptors
    /// means the peer closed its end.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
        let mut control = ControlBuffer::new();
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: msghdr is plain data; all zeroes is a valid value.
        let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.bytes.as_mut_ptr().cast();
        // Room for exactly MAX_FDS_PER_MESSAGE: the kernel closes any more
        // and sets MSG_CTRUNC.
        // SAFETY: CMSG_SPACE only computes a size.
        msg.msg_controllen =
            unsafe { libc::CMSG_SPACE((MAX_FDS_PER_MESSAGE * size_of::<RawFd>()) as u32) } as usize;
        let len = restarting(|| {
            // SAFETY: `msg` points to `iov` (over `buf`) and `control`, both
            // writable and alive across the call.
            check_size(unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) })
        })?;
        // Own every descriptor first, so each refusal below closes them.
        let mut fds = Vec::new();
        // SAFETY: `msg` was filled by a successful recvmsg; CMSG_FIRSTHDR
        // and CMSG_NXTHDR stay within msg_controllen.
        let mut header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        while !header.is_null() {
            // SAFETY: a non-null header from CMSG_FIRSTHDR/NXTHDR lies in
            // `control`, which is aligned for cmsghdr.
            let cmsg = unsafe { header.read() };
            if cmsg.cmsg_level == libc::SOL_SOCKET && cmsg.cmsg_type == libc::SCM_RIGHTS {
                // SAFETY: CMSG_LEN only computes a size.
                let count = (cmsg.cmsg_len - unsafe { libc::CMSG_LEN(0) } as usize) / size_of::<RawFd>();
                // SAFETY: the kernel wrote `count` descriptors after the
                // header, within `control`.
                let data = unsafe { libc::CMSG_DATA(header) };
                for i in 0..count {
                    // SAFETY: descriptor `i` lies within the payload the
                    // kernel wrote, inside `control`.
                    let at = unsafe { data.add(i * size_of::<RawFd>()) };
                    // SAFETY: `at` is readable for one RawFd; unaligned, as
                    // CMSG_DATA need not be int-aligned.
                    let raw = unsafe { at.cast::<RawFd>().read_unaligned() };
                    // SAFETY: the kernel installed `raw` in this process for
                    // this message; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                }
            }
            // SAFETY: `header` is a valid header of `msg`'s control data.
            header = unsafe { libc::CMSG_NXTHDR(&msg, header) };
        }
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("message longer than the {} bytes allowed", buf.len()),
            ));
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("message carried more than {MAX_FDS_PER_MESSAGE} descriptors"),
            ));
        }
        Ok((len, fds))
    }
}

impl AsFd for SeqpacketConn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl From<SeqpacketConn> for OwnedFd {
    fn from(conn: SeqpacketConn) -> OwnedFd {
        conn.fd
    }
}

fn socket_option(fd: BorrowedFd<'_>, option: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` is a writable int of `len` bytes the kernel fills.
    check(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            std::ptr::addr_of_mut!(value).cast(),
            &mut len,
        )
    })?;
    Ok(value)
}

/// Sets `SO_RCVLOWAT` (Linux 2.6.28 for TCP's wakeups) on a stream socket:
/// a blocking read waits until `bytes` are queued (or the stream ends, an
/// error or its timeout comes) instead of waking for each segment, and the
/// kernel wakes a reader only once that many are there. TCP grows the
/// receive buffer to hold them where the application did not fix its size.
pub fn set_receive_low_water(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<()> {
    let value = bytes.clamp(1, libc::c_int::MAX as usize) as libc::c_int;
    // SAFETY: `value` is a readable int of the length passed, alive across the call.
    check(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::addr_of!(value).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Control-message space for one `SCM_RIGHTS` message of
/// [`MAX_FDS_PER_MESSAGE`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuffer {
    bytes: [u8; 128],
}

const _: () = assert!(size_of::<libc::cmsghdr>() + MAX_FDS_PER_MESSAGE * size_of::<RawFd>() <= 128);

impl ControlBuffer {
    fn new() -> ControlBuffer {
        ControlBuffer { bytes: [0; 128] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::thread::JoinHandleExt;

    extern "C" fn ignore(_: libc::c_int) {}

    /// A listener that stopped accepting (a stopped or hung service) fills
    /// its backlog; a connect then fails after its timeout instead of
    /// waiting for ever.
    #[test]
    fn a_connect_to_a_listener_that_accepts_nothing_times_out() {
        let dir = std::env::temp_dir().join(format!("dmaload-connect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let _ = std::fs::remove_file(&path);
        let _listener = SeqpacketListener::bind(&path, 1).unwrap();
        let mut queued = Vec::new();
        let err = loop {
            match SeqpacketConn::connect_until(&path, Duration::from_millis(100), &|| false) {
                Ok(conn) => queued.push(conn),
                Err(err) => break err,
            }
            assert!(queued.len() < 64, "the backlog of 1 never filled");
        };
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!queued.is_empty(), "{err}");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("backlog"), "{err}");
    }

    /// A connect waiting for room in a full backlog gives up, unconnected,
    /// once its `stop` says so, long before its timeout.
    #[test]
    fn a_connect_waiting_for_a_full_backlog_stops_when_asked() {
        let dir = std::env::temp_dir().join(format!("dmaload-connect-stop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let _ = std::fs::remove_file(&path);
        let _listener = SeqpacketListener::bind(&path, 0).unwrap();
        let mut queued = Vec::new();
        while let Ok(conn) = SeqpacketConn::connect_until(&path, Duration::from_millis(50), &|| false) {
            queued.push(conn);
            assert!(queued.len() < 64, "the backlog never filled");
        }
        // Asked to stop on its third look: after two slices of waiting.
        let looks = std::cell::Cell::new(0);
        let stop = || {
            looks.set(looks.get() + 1);
            looks.get() >= 3
        };
        let err = SeqpacketConn::connect_until(&path, Duration::from_secs(3600), &stop).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(err.kind(), io::ErrorKind::Interrupted, "{err}");
        assert_eq!(looks.get(), 3);
    }

    #[test]
    fn signals_during_a_timed_wait_do_not_fail_it() {
        // A handler installed without SA_RESTART makes a blocked socket
        // call return EINTR, as io_uring task work does; SIGURG's default
        // is to ignore it, so no other test notices the handler.
        // SAFETY: sigaction is plain data; all zeroes is a valid value.
        let mut action: libc::sigaction = unsafe { MaybeUninit::zeroed().assume_init() };
        action.sa_sigaction = ignore as *const () as libc::sighandler_t;
        // SAFETY: `action` is valid and `ignore` is async-signal-safe (it
        // does nothing); a null old action is allowed.
        check(unsafe { libc::sigaction(libc::SIGURG, &action, std::ptr::null_mut()) }).unwrap();
        let (a, b) = SeqpacketConn::pair().unwrap();
        b.set_timeouts(Some(Duration::from_secs(30))).unwrap();
        let receiver = std::thread::spawn(move || {
            let mut buf = [0u8; 8];
            b.recv(&mut buf).map(|(len, _)| buf[..len].to_vec())
        });
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(10));
            // SAFETY: the receiver thread is joined only below, so its
            // pthread_t is still valid.
            let sent = unsafe { libc::pthread_kill(receiver.as_pthread_t(), libc::SIGURG) };
            assert_eq!(sent, 0);
        }
        a.send(b"late", &[]).unwrap();
        assert_eq!(receiver.join().unwrap().unwrap(), b"late");
    }
}
