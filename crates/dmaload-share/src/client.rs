//! The cache service's client: asks for a file by sending its open
//! descriptor and receives the file's bytes as a private copy-on-write
//! mapping of the service's sealed memfd. [`crate::CacheRequest`]
//! falls back to a direct load when no service answers.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dmaload::buffer::Buffer;
use dmaload::cancel::CancelToken;
use dmaload::error::{Error, ErrorKind, Result};
use dmaload::load::{LoadOptions, LoadReport};
use dmaload::object::Object;
use dmaload::share::protocol::{self, DeviceTarget, Reply, Request, Served, Status};
use dmaload::share::{Connection, CONNECT_TIMEOUT};
use dmaload::CachePolicy;
use dmaload::{source, sys_share};

/// The environment variable that turns caching on for Python's loaders
/// and `dmaload load`: `1` for the default socket, or a socket path.
pub const CACHE_ENV: &str = "DMALOAD_CACHE";

/// How long one wait on the socket lasts before the client looks at its
/// [`CancelToken`] again: the bound on how late a cancel (Python's
/// Ctrl-C) takes effect.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// The default socket: `$XDG_RUNTIME_DIR/dmaload.sock`, else
/// `/run/user/UID/dmaload.sock`.
pub fn default_socket() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("dmaload.sock"),
        None => PathBuf::from(format!("/run/user/{}/dmaload.sock", sys_share::effective_uid())),
    }
}

/// The socket [`CACHE_ENV`] names: `None` when unset, empty or `0`; the
/// default socket for `1`; else the path it holds.
pub fn socket_from_env() -> Option<PathBuf> {
    let value = std::env::var_os(CACHE_ENV)?;
    match value.to_str() {
        Some("" | "0") => None,
        Some("1") => Some(default_socket()),
        _ => Some(PathBuf::from(value)),
    }
}

/// A [`Connection`] over a duplicate of descriptor number `fd`, a
/// connected `SOCK_SEQPACKET` Unix socket that someone else owns (a
/// Python socket's `fileno()`); anything else is refused.
pub fn connection_from_raw_fd(fd: std::os::fd::RawFd) -> io::Result<Connection> {
    Connection::from_fd(sys_share::dup_raw(fd)?)
}

/// A report for a buffer that arrived by handoff rather than a load: the
/// bytes, the time from asking to mapping, where it came from
/// (`destination`); nothing was read, allocated or registered here.
pub fn handoff_report(
    path: &Path,
    bytes: u64,
    seconds: f64,
    destination: String,
    options: &LoadOptions,
) -> LoadReport {
    LoadReport {
        engine: options.engine,
        cache: CachePolicy::Bypass,
        memory: dmaload::memory::MemoryKind::Memfd,
        destination,
        memory_reason: "a sealed memfd handed over by another process".into(),
        chunk_size: options.chunk_size,
        gather_size: options.gather_size,
        queue_depth: options.queue_depth,
        request_size: options.chunk_size,
        ..LoadReport::new(path, 0, bytes, seconds)
    }
}

/// A connection to a cache service. The service closes a connection that
/// sends no request for its idle timeout (5 s by default): the next request
/// of a `Client` kept idle longer fails naming the closed connection, so
/// connect again for it ([`crate::CacheRequest`] connects for each load).
///
/// No wait is long: connecting waits at most [`dmaload::share::CONNECT_TIMEOUT`]
/// for room in the listener's backlog; a get waits
/// [`protocol::ACK_TIMEOUT`] for the service to accept it, then at most
/// [`protocol::KEEPALIVE_TIMEOUT`] for each of the messages the service
/// sends while it loads; a status waits [`protocol::ACK_TIMEOUT`]. A
/// service that is stopped (SIGSTOP, Ctrl-Z) or stuck fails the request
/// with `TimedOut` within those bounds, whatever the size of the file, as
/// does one whose loads read nothing for [`protocol::STALL_TIMEOUT`]. Each
/// wait also ends within 20 ms of the client's [`CancelToken`] being
/// cancelled, with [`ErrorKind::Cancelled`].
pub struct Client {
    conn: Connection,
    socket: PathBuf,
    cancel: CancelToken,
}

/// A file's bytes from the service.
#[derive(Debug)]
pub struct Fetched {
    pub buffer: Buffer,
    pub served: Served,
    /// What the service said about the request (why it was not cached).
    pub note: Option<String>,
    /// From sending the request to mapping the reply.
    pub seconds: f64,
}

impl Client {
    /// Connects to the service at `socket`. The service must run as this
    /// user, as root, or as the user that owns the socket's directory when
    /// no one else may write there (a directory set up for a shared
    /// service, such as `/run/dmaload` of a `dmaload` user, mode 0755): its
    /// `SO_PEERCRED` says which. A socket another user could have put in
    /// place is refused, as the bytes it hands out would be that user's.
    pub fn connect(socket: impl AsRef<Path>) -> Result<Client> {
        Self::connect_cancellable(socket, &CancelToken::new())
    }

    /// [`Client::connect`] whose waits, this one and those of its
    /// requests, end when `cancel` is cancelled.
    pub fn connect_cancellable(socket: impl AsRef<Path>, cancel: &CancelToken) -> Result<Client> {
        let socket = socket.as_ref();
        let conn = Connection::connect_until(socket, CONNECT_TIMEOUT, &|| cancel.is_cancelled()).map_err(
            |e| match e.kind() {
                io::ErrorKind::Interrupted if cancel.is_cancelled() => cancelled("connect", socket),
                _ => Error::io("connect", socket, e),
            },
        )?;
        let peer = conn.peer_credentials().map_err(|e| Error::io("SO_PEERCRED", socket, e))?;
        let own = sys_share::effective_uid();
        if peer.uid != own && peer.uid != 0 && directory_owner(socket) != Some(peer.uid) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "connect",
                socket,
                format!(
                    "the service there runs as uid {}, neither this user ({own}) nor root, nor the owner \
                     of a socket directory no one else may write to",
                    peer.uid
                ),
            ));
        }
        conn.set_timeouts(Some(WAIT_SLICE)).map_err(|e| Error::io("setsockopt", socket, e))?;
        Ok(Client { conn, socket: socket.to_owned(), cancel: cancel.clone() })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The bytes of the file at `path`: opened here (as a direct load opens
    /// it), its descriptor sent to the service.
    pub fn get(&self, path: impl AsRef<Path>) -> Result<Fetched> {
        let path = path.as_ref();
        let file = source::open_for_reading(path)?;
        self.get_file(&file, path)
    }

    /// The bytes of the open `file` (`path` names it in errors). The
    /// service refuses anything but a regular file open for reading.
    pub fn get_file(&self, file: &File, path: &Path) -> Result<Fetched> {
        let started = Instant::now();
        let request = protocol::encode_request(Request::Get);
        let reply = self.request(&request, &[file.as_fd()], path, "receive buffer")?;
        self.fetched(reply, started)
    }

    /// The bytes of `object`, which the service reads (once for every
    /// client, keeping them under the object's ETag) with a [`Grant`](dmaload::object::Grant) of
    /// this process's: the store checks the grant on each request, a hit's
    /// included, and this process's keys never leave it.
    pub fn get_object(&self, object: &Object) -> Result<Fetched> {
        let started = Instant::now();
        let request = protocol::encode_object_request(&object.grant());
        let reply = self.request(&request, &[], object.name(), "receive buffer")?;
        self.fetched(reply, started)
    }

    /// The buffer a get's `reply` hands over, mapped.
    fn fetched(&self, reply: (Reply, Vec<OwnedFd>), started: Instant) -> Result<Fetched> {
        let (info, memfd) = match reply {
            (Reply::Buffer(info), fds) => {
                let count = fds.len();
                let [memfd]: [OwnedFd; 1] = fds.try_into().map_err(|_| {
                    self.refused(format!("a buffer message carried {count} descriptors, not one"))
                })?;
                (info, memfd)
            }
            _ => return Err(self.refused("a reply of another kind to a get".into())),
        };
        let buffer = Buffer::from_sealed_memfd(memfd, info.offset, info.len, &self.socket)?;
        let served = info.served.ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                "receive buffer",
                &self.socket,
                "the reply says not how it was served",
            )
        })?;
        Ok(Fetched { buffer, served, note: info.note, seconds: started.elapsed().as_secs_f64() })
    }

    /// Has the service copy the open `file` (`path` names it in errors)
    /// into the client's device memory that `target` names; returns the
    /// bytes copied and how the service had the file. The memory must stay
    /// allocated until this returns, and holds the file only when it
    /// returns `Ok`.
    pub fn copy_file_to_device(
        &self,
        file: &File,
        path: &Path,
        target: &DeviceTarget,
    ) -> Result<(u64, Served)> {
        self.device_copy(&protocol::encode_device_request(target), &[file.as_fd()], path)
    }

    /// Has the service copy `object` (read with a [`Grant`](dmaload::object::Grant) of this
    /// process's, as [`Client::get_object`]) into the client's device
    /// memory that `target` names, as [`Client::copy_file_to_device`] does
    /// a file.
    pub fn copy_object_to_device(&self, object: &Object, target: &DeviceTarget) -> Result<(u64, Served)> {
        self.device_copy(&protocol::encode_object_device_request(&object.grant(), target), &[], object.name())
    }

    /// Sends a to-device `request` (with `fds`; `name` names what it asks
    /// for in errors) and takes the service's `copied` reply.
    fn device_copy(&self, request: &[u8], fds: &[BorrowedFd<'_>], name: &Path) -> Result<(u64, Served)> {
        const OP: &str = "receive device copy";
        match self.request(request, fds, name, OP)? {
            (Reply::Copied { len, served }, fds) if fds.is_empty() => Ok((len, served)),
            _ => Err(Error::new(
                ErrorKind::InvalidInput,
                OP,
                &self.socket,
                "a reply of another kind to a to-device request",
            )),
        }
    }

    /// Sends `request` with the descriptors `fds`, then waits through the
    /// service's acknowledgement and keepalives for its answer (`op` names
    /// the wait, `path` what was asked for): an error reply becomes that
    /// error, a service that goes silent, stops reading or closes the
    /// connection an error of `op`.
    fn request(
        &self,
        request: &[u8],
        fds: &[BorrowedFd<'_>],
        path: &Path,
        op: &'static str,
    ) -> Result<(Reply, Vec<OwnedFd>)> {
        self.conn.send(request, fds).map_err(|e| Error::io("send request", &self.socket, e))?;
        let mut timeout = protocol::ACK_TIMEOUT;
        // The service's bytes read, and when they last moved.
        let mut progress = (0, Instant::now());
        loop {
            match self.receive_within(timeout, op)? {
                (Reply::Accepted, _) => {
                    timeout = protocol::KEEPALIVE_TIMEOUT;
                    progress.1 = Instant::now();
                }
                (Reply::Working { loaded }, _) if loaded != progress.0 => progress = (loaded, Instant::now()),
                (Reply::Working { .. }, _) if progress.1.elapsed() >= protocol::STALL_TIMEOUT => {
                    return Err(Error::io(
                        op,
                        &self.socket,
                        io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!(
                                "the service's loads have read nothing for {} s: it is stuck",
                                protocol::STALL_TIMEOUT.as_secs()
                            ),
                        ),
                    ));
                }
                (Reply::Working { .. }, _) => {}
                // Errors of the service's own name the socket; a failed load
                // names the file as this client knows it.
                (Reply::Error(err), _) if matches!(err.op.as_str(), "connect" | "request") => {
                    return Err(err.into_error(None))
                }
                (Reply::Error(err), _) => return Err(err.into_error(Some(path))),
                answer => return Ok(answer),
            }
        }
    }

    /// What the service holds and has done.
    pub fn status(&self) -> Result<Status> {
        let request = protocol::encode_request(Request::Status);
        self.conn.send(&request, &[]).map_err(|e| Error::io("send request", &self.socket, e))?;
        match self.receive_within(protocol::ACK_TIMEOUT, "receive status")? {
            (Reply::Status(status), _) => Ok(status),
            (Reply::Error(err), _) => Err(err.into_error(None)),
            _ => {
                Err(Error::new(ErrorKind::InvalidInput, "receive status", &self.socket, "not a status reply"))
            }
        }
    }

    /// The next message, if it comes within `timeout`: else `TimedOut`, or
    /// `Cancelled` once the client's token is; `op` names the wait.
    fn receive_within(&self, timeout: Duration, op: &'static str) -> Result<(Reply, Vec<OwnedFd>)> {
        let started = Instant::now();
        loop {
            match protocol::receive_reply(&self.conn) {
                Ok(Some(message)) => return Ok(message),
                Ok(None) => {
                    return Err(Error::io(
                        op,
                        &self.socket,
                        io::Error::new(io::ErrorKind::UnexpectedEof, "the service closed the connection"),
                    ))
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                Err(err) => return Err(Error::io(op, &self.socket, err)),
            }
            if self.cancel.is_cancelled() {
                return Err(cancelled(op, &self.socket));
            }
            if started.elapsed() >= timeout {
                return Err(Error::io(
                    op,
                    &self.socket,
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "the service said nothing for {} s: it is stopped or stuck",
                            timeout.as_secs_f64()
                        ),
                    ),
                ));
            }
        }
    }

    fn refused(&self, message: String) -> Error {
        Error::new(ErrorKind::InvalidInput, "receive buffer", &self.socket, message)
    }
}

/// The error of a wait ended by the client's [`CancelToken`].
fn cancelled(op: &'static str, socket: &Path) -> Error {
    Error::new(ErrorKind::Cancelled, op, socket, "cancelled")
}

/// The owner of `socket`'s directory, if no one else may write there (no
/// group or other write bit): only that user (or root) can have put the
/// socket there.
fn directory_owner(socket: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let dir = socket.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let meta = std::fs::metadata(dir).ok()?;
    (meta.mode() & 0o022 == 0).then_some(meta.uid())
}
