//! The cache service's client: asks for a file by sending its open
//! descriptor and receives the file's bytes as a private copy-on-write
//! mapping of the service's sealed memfd. [`cached`] falls back to a
//! direct load when no service answers.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::buffer::Buffer;
use crate::cancel::CancelToken;
use crate::cuda::{Context, DeviceRange};
use crate::device::{allocate, load_object_device, load_open_device, LoadedDevice};
use crate::error::{Error, ErrorKind, Result};
use crate::load::{LoadOptions, LoadReport, LoadRequest};
use crate::object::Object;
use crate::share::protocol::{self, DeviceTarget, Reply, Request, Served, Status, DEVICE_UNREACHABLE_OPS};
use crate::share::{Connection, CONNECT_TIMEOUT};
use crate::source::OpenFile;
use crate::types::CachePolicy;
use crate::{source, sys, system};

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
        None => PathBuf::from(format!("/run/user/{}/dmaload.sock", sys::process::effective_uid())),
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
    Connection::from_fd(sys::file::dup_raw(fd)?)
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
        memory: crate::memory::MemoryKind::Memfd,
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
/// connect again for it ([`cached`] connects for each load).
///
/// No wait is long: connecting waits at most [`crate::share::CONNECT_TIMEOUT`]
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
        let own = sys::process::effective_uid();
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
    /// client, keeping them under the object's ETag) with a [`Grant`](crate::object::Grant) of
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
        const OP: &str = "receive device copy";
        let request = protocol::encode_device_request(target);
        match self.request(&request, &[file.as_fd()], path, OP)? {
            (Reply::Copied { len, served }, fds) if fds.is_empty() => Ok((len, served)),
            _ => Err(Error::new(
                ErrorKind::InvalidInput,
                OP,
                &self.socket,
                "a reply of another kind to a to-device request",
            )),
        }
    }

    /// Has the service copy `object` (read with a [`Grant`](crate::object::Grant) of this
    /// process's, as [`Client::get_object`]) into the client's device
    /// memory that `target` names, as [`Client::copy_file_to_device`] does
    /// a file.
    pub fn copy_object_to_device(&self, object: &Object, target: &DeviceTarget) -> Result<(u64, Served)> {
        const OP: &str = "receive device copy";
        let request = protocol::encode_object_device_request(&object.grant(), target);
        match self.request(&request, &[], object.name(), OP)? {
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

/// Where a [`cached`] buffer came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOutcome {
    /// From the service, and how it served it.
    Service { served: Served, note: Option<String> },
    /// Loaded directly: why the service was not used.
    Direct { reason: String },
}

/// Loads the open `file` whole through the cache service at `socket`, or
/// directly (`LoadRequest::open(file)` with `options`) when the service
/// cannot be reached, refuses this client, breaks off, runs out of its own
/// resources (descriptors, memory, threads), or the file is not a regular
/// file; [`CacheOutcome`] says which and why. The service gets a
/// descriptor of `file`, and a direct load reads `file` too, so both are
/// the same file whatever happens to its path. An error about the file
/// itself (it fails to load) is returned as a direct load would return
/// it, not retried.
///
/// A buffer from the service is a private copy-on-write mapping of the
/// service's memfd; its report's `destination` is `cache-service`, its
/// times those of the handoff.
pub fn cached(
    file: &OpenFile,
    socket: &Path,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport, CacheOutcome)> {
    match from_service(file, socket, options)? {
        Ok((buffer, report, served, note)) => Ok((buffer, report, CacheOutcome::Service { served, note })),
        Err(reason) => {
            let (buffer, report) = LoadRequest::open(file).options(options).to_buffer()?;
            Ok((buffer, report, CacheOutcome::Direct { reason }))
        }
    }
}

/// Loads the opened `object` whole through the cache service at `socket`
/// ([`Client::get_object`]: the service reads it with a grant of this
/// process's, and keeps it under its ETag, so the next client, this one
/// restarted say, maps it without a GET), or directly as [`cached`] does
/// for a file. The service's HEAD must find the version this process
/// opened (its ETag): an object replaced since fails with
/// [`ErrorKind::Changed`], as a direct load does.
pub fn cached_object(
    object: &Object,
    socket: &Path,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport, CacheOutcome)> {
    match from_service_with(object.name(), socket, options, |client| client.get_object(object))? {
        Ok((fetched, report)) => {
            let outcome = CacheOutcome::Service { served: fetched.served, note: fetched.note };
            Ok((fetched.buffer, report, outcome))
        }
        Err(reason) => {
            let (buffer, report) = LoadRequest::object(object).options(options).to_buffer()?;
            Ok((buffer, report, CacheOutcome::Direct { reason }))
        }
    }
}

/// What [`from_service`] returns when the service served the file: its
/// bytes, the handoff's report, how it served them, and its note.
pub type ServedFile = (Buffer, LoadReport, Served, Option<String>);

/// The open `file` from the cache service at `socket`, as [`cached`]
/// gets it, or `Ok(Err(why))` where that would load directly instead: for
/// a caller with a better fallback than a host buffer of the whole file (a
/// device load reads the disk itself, from the same `file`).
pub fn from_service(
    file: &OpenFile,
    socket: &Path,
    options: &LoadOptions,
) -> Result<std::result::Result<ServedFile, String>> {
    let path = file.path();
    let file = &file.source().file;
    let meta = file.metadata().map_err(|e| Error::io("fstat", path, e))?;
    if !meta.file_type().is_file() {
        return Ok(Err(format!("a {} is not cached, only regular files", source::type_name(&meta))));
    }
    let fetched = from_service_with(path, socket, options, |client| client.get_file(file, path))?;
    Ok(fetched.map(|(fetched, mut report)| {
        report.filesystem =
            sys::file::filesystem_magic(file.as_fd()).map_or("unknown", system::filesystem_name);
        (fetched.buffer, report, fetched.served, fetched.note)
    }))
}

/// What `get` fetches from a client of the service at `socket`, with the
/// handoff's report (`name` names it), or `Ok(Err(why))` where the caller
/// loads directly: no service, one that cannot serve, or a verified load.
fn from_service_with(
    name: &Path,
    socket: &Path,
    options: &LoadOptions,
    get: impl FnOnce(&Client) -> Result<Fetched>,
) -> Result<std::result::Result<(Fetched, LoadReport), String>> {
    if options.verify {
        return Ok(Err("the cache service does not verify: a verified load reads the file itself".into()));
    }
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", name, e))?;
    let client = match connect_or_why(socket, options)? {
        Ok(client) => client,
        Err(why) => return Ok(Err(why)),
    };
    let fetched = match get(&client) {
        Ok(fetched) => fetched,
        Err(err) if err.kind() == ErrorKind::Cancelled => return Err(err),
        Err(err) if service_unusable(&err) => return Ok(Err(format!("the cache service failed: {err}"))),
        Err(err) => return Err(err),
    };
    let cpu_after = sys::process::cpu_time().map_err(|e| Error::io("getrusage", name, e))?;
    let mut report = handoff_report(
        name,
        fetched.buffer.len() as u64,
        fetched.seconds,
        format!("cache-service ({})", fetched.served.name()),
        options,
    );
    report.cpu_user_seconds = (cpu_after.0 - cpu_before.0).as_secs_f64();
    report.cpu_system_seconds = (cpu_after.1 - cpu_before.1).as_secs_f64();
    Ok(Ok((fetched, report)))
}

/// Whether `err` says the service could not serve (gone, refused this
/// client, spoke nonsense, or ran out of descriptors, memory or threads of
/// its own, which this process may still have) rather than that the file
/// failed to load.
fn service_unusable(err: &Error) -> bool {
    // "request": the service refused the request itself (an older one
    // that knows no get-object, say), not the file.
    matches!(err.op(), "send request" | "receive buffer" | "connect" | "request")
        || matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN))
}

/// Loads the open `file` whole into a new allocation on CUDA device
/// `ordinal` through the cache service at `socket`: this process
/// allocates the device memory and sends the service a CUDA IPC handle of
/// it; the service copies the file in from its cached copy, pinned once
/// (see `share::service`). This process pins and copies nothing. Where
/// the service cannot do it (none answers, another version, another user,
/// no such device in the service, the driver refuses the handle or the
/// pinning; [`CacheOutcome::Direct`] says which) the file is loaded
/// directly to the device, as `--to cuda:N` without the cache. Once the
/// service has taken the request, a failure (a failed copy, the service
/// gone mid-copy) is an error: the memory is freed, never returned partly
/// filled.
pub fn cached_to_device(
    file: &OpenFile,
    socket: &Path,
    ordinal: usize,
    options: &LoadOptions,
) -> Result<(LoadedDevice, LoadReport, CacheOutcome)> {
    served_or_direct(Asked::File(file), socket, ordinal, options, || {
        load_open_device(file, 0, None, ordinal, options)
    })
}

/// [`cached_to_device`] of the opened `object`: the service reads it with
/// a grant of this process's (as [`cached_object`]), keeps it under its
/// ETag, and copies it into this process's device memory; where it cannot,
/// the object is loaded directly to the device (its GETs into a pinned
/// ring here). An object replaced since this process opened it is
/// [`ErrorKind::Changed`].
pub fn cached_object_to_device(
    object: &Object,
    socket: &Path,
    ordinal: usize,
    options: &LoadOptions,
) -> Result<(LoadedDevice, LoadReport, CacheOutcome)> {
    served_or_direct(Asked::Object(object), socket, ordinal, options, || {
        load_object_device(object, 0, None, ordinal, options)
    })
}

/// The service's copy of what is `asked` into new memory of device
/// `ordinal`, else `direct`'s load, and which of the two it was.
fn served_or_direct(
    asked: Asked<'_>,
    socket: &Path,
    ordinal: usize,
    options: &LoadOptions,
    direct: impl FnOnce() -> Result<(LoadedDevice, LoadReport)>,
) -> Result<(LoadedDevice, LoadReport, CacheOutcome)> {
    match device_from_service(asked, socket, ordinal, options)? {
        Ok((loaded, report, served)) => Ok((loaded, report, CacheOutcome::Service { served, note: None })),
        Err(reason) => {
            let (loaded, report) = direct()?;
            Ok((loaded, report, CacheOutcome::Direct { reason }))
        }
    }
}

/// What a to-device request asks the service for: a file this process
/// opened (its descriptor goes with the request) or an object it opened
/// (a grant goes instead).
#[derive(Clone, Copy)]
enum Asked<'a> {
    File(&'a OpenFile),
    Object(&'a Object),
}

impl<'a> Asked<'a> {
    fn path(self) -> &'a Path {
        match self {
            Asked::File(file) => file.path(),
            Asked::Object(object) => object.name(),
        }
    }
}

/// The service's copy of `asked` into new memory of device `ordinal`, as
/// [`cached_to_device`] has it made, or `Ok(Err(why))` where it loads
/// directly instead.
fn device_from_service(
    asked: Asked<'_>,
    socket: &Path,
    ordinal: usize,
    options: &LoadOptions,
) -> Result<std::result::Result<(LoadedDevice, LoadReport, Served), String>> {
    let len = match servable_to_device(asked, options)? {
        Ok(len) => len,
        Err(why) => return Ok(Err(why)),
    };
    let started = Instant::now();
    let path = asked.path();
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let client = match connect_or_why(socket, options)? {
        Ok(client) => client,
        Err(why) => return Ok(Err(why)),
    };
    let context = Context::primary(ordinal).map_err(|e| Error::io("open the CUDA device", path, e.into()))?;
    let mut memory = allocate(&context, ordinal, len, path)?;
    let served = match copy_through_service(&client, asked, &context, &memory.range(), len)? {
        Ok(served) => served,
        Err(why) => return Ok(Err(why)),
    };
    let report = device_report(asked, &context, len, served, (started, cpu_before), options)?;
    Ok(Ok((LoadedDevice { memory, len }, report, served)))
}

/// Has the cache service at `socket` copy the whole open `file` into
/// `range`, device memory of `context`'s device that the caller allocated
/// (a tensor inside a caching allocator's larger segment, say): this
/// process sends a CUDA IPC handle of the allocation `range` lies in and
/// `range`'s offset in it, and pins and copies nothing. `range` must hold
/// the file's length. Returns the report and how the service had the
/// file, or `Ok(Err(why))` where the service cannot do it (as
/// [`cached_to_device`] falls back: none answers, another user, no such
/// device in the service, the driver refuses the handle), for the caller
/// to load the file itself. Once the service has taken the request, a
/// failure is an error and `range` holds unspecified bytes.
pub fn cached_into_device(
    file: &OpenFile,
    socket: &Path,
    context: &Context,
    range: &DeviceRange<'_>,
    options: &LoadOptions,
) -> Result<std::result::Result<(LoadReport, Served), String>> {
    into_device_from_service(Asked::File(file), socket, context, range, options)
}

/// [`cached_into_device`] of the opened `object`: the service reads it
/// with a grant of this process's and keeps it under its ETag (as
/// [`cached_object`]).
pub fn cached_object_into_device(
    object: &Object,
    socket: &Path,
    context: &Context,
    range: &DeviceRange<'_>,
    options: &LoadOptions,
) -> Result<std::result::Result<(LoadReport, Served), String>> {
    into_device_from_service(Asked::Object(object), socket, context, range, options)
}

fn into_device_from_service(
    asked: Asked<'_>,
    socket: &Path,
    context: &Context,
    range: &DeviceRange<'_>,
    options: &LoadOptions,
) -> Result<std::result::Result<(LoadReport, Served), String>> {
    let len = match servable_to_device(asked, options)? {
        Ok(len) => len,
        Err(why) => return Ok(Err(why)),
    };
    let path = asked.path();
    if (range.len() as u64) < len {
        return Err(Error::new(
            ErrorKind::Changed,
            "load",
            path,
            format!("it has {len} bytes, more than the {} set aside for it: it changed", range.len()),
        ));
    }
    let started = Instant::now();
    let cpu_before = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let client = match connect_or_why(socket, options)? {
        Ok(client) => client,
        Err(why) => return Ok(Err(why)),
    };
    let served = match copy_through_service(&client, asked, context, range, len)? {
        Ok(served) => served,
        Err(why) => return Ok(Err(why)),
    };
    let report = device_report(asked, context, len, served, (started, cpu_before), options)?;
    Ok(Ok((report, served)))
}

/// The length of what is `asked`, which the service can copy to a
/// device, or why it cannot.
fn servable_to_device(asked: Asked<'_>, options: &LoadOptions) -> Result<std::result::Result<u64, String>> {
    if options.verify {
        return Ok(Err("the cache service does not verify: a verified load reads the file itself".into()));
    }
    let len = match asked {
        Asked::File(file) => {
            let meta = file.source().file.metadata().map_err(|e| Error::io("fstat", file.path(), e))?;
            if !meta.file_type().is_file() {
                return Ok(Err(format!("a {} is not cached, only regular files", source::type_name(&meta))));
            }
            meta.len()
        }
        Asked::Object(object) => object.size,
    };
    if len == 0 {
        return Ok(Err("an empty file has no device memory to fill".into()));
    }
    Ok(Ok(len))
}

/// A client of the service at `socket`, or why there is none (a cancel is
/// an error).
fn connect_or_why(socket: &Path, options: &LoadOptions) -> Result<std::result::Result<Client, String>> {
    match Client::connect_cancellable(socket, &options.cancel) {
        Ok(client) => Ok(Ok(client)),
        Err(err) if err.kind() == ErrorKind::Cancelled => Err(err),
        Err(err) => Ok(Err(format!("no cache service: {err}"))),
    }
}

/// Has the service copy the first `len` bytes of what is `asked` (all of
/// them, as it had them) into the start of `range`; how it had them, or
/// why it cannot fill this process's device memory.
fn copy_through_service(
    client: &Client,
    asked: Asked<'_>,
    context: &Context,
    range: &DeviceRange<'_>,
    len: u64,
) -> Result<std::result::Result<Served, String>> {
    let path = asked.path();
    let (handle, offset) = match range.ipc_handle(context) {
        Ok(named) => named,
        Err(err) => return Ok(Err(format!("the device memory cannot be shared with the service: {err}"))),
    };
    let ordinal = u32::try_from(context.ordinal())
        .map_err(|_| Error::new(ErrorKind::InvalidInput, "load", path, "no such device"))?;
    let target = DeviceTarget::new(ordinal, &handle.0, offset, len);
    let copied = match asked {
        Asked::File(file) => client.copy_file_to_device(&file.source().file, path, &target),
        // The service's HEAD pins the grant's ETag: another version fails there.
        Asked::Object(object) => client.copy_object_to_device(object, &target),
    };
    let (copied, served) = match copied {
        Ok(done) => done,
        Err(err) if err.kind() == ErrorKind::Cancelled => return Err(err),
        Err(err) if device_unreachable(&err) => {
            return Ok(Err(format!("the cache service cannot fill device memory: {err}")))
        }
        Err(err) => return Err(err),
    };
    if copied != len {
        return Err(Error::new(
            ErrorKind::Changed,
            "load",
            path,
            format!("the service copied {copied} bytes of the {len} the file had when asked: it changed"),
        ));
    }
    // The bytes must be those of the file as this process opened it (and,
    // in Python, read its header from): a write since, which the service
    // may have loaded, fails the load as it fails a direct one.
    if let Asked::File(file) = asked {
        file.source().check_unchanged(path, len)?;
    }
    Ok(Ok(served))
}

/// The report of a copy the service made: `len` bytes of what was `asked`
/// into memory of `context`'s device, from `began` (the time and CPU time
/// when the client began) until now.
fn device_report(
    asked: Asked<'_>,
    context: &Context,
    len: u64,
    served: Served,
    began: (Instant, (Duration, Duration)),
    options: &LoadOptions,
) -> Result<LoadReport> {
    let path = asked.path();
    let (started, cpu_before) = began;
    let cpu_after = sys::process::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let device = context.device_name().unwrap_or_default();
    let destination = format!("cuda:{} ({device}) via cache-service ({})", context.ordinal(), served.name());
    let mut report = handoff_report(path, len, started.elapsed().as_secs_f64(), destination, options);
    report.memory_reason = "device memory the cache service filled from its pinned copy of the file".into();
    report.filesystem = match asked {
        Asked::File(file) => {
            sys::file::filesystem_magic(file.source().file.as_fd()).map_or("unknown", system::filesystem_name)
        }
        Asked::Object(_) => "s3",
    };
    report.cpu_user_seconds = (cpu_after.0 - cpu_before.0).as_secs_f64();
    report.cpu_system_seconds = (cpu_after.1 - cpu_before.1).as_secs_f64();
    Ok(report)
}

/// Whether `err` from a to-device request means the service cannot write
/// into this client's device memory (or cannot serve at all before it took
/// the request), where a direct load does the job instead.
fn device_unreachable(err: &Error) -> bool {
    DEVICE_UNREACHABLE_OPS.contains(&err.op())
        || matches!(err.op(), "send request" | "connect" | "request")
        || matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::EAGAIN))
}
