//! The messages that cross a `share` socket: one JSON object per
//! `SOCK_SEQPACKET` message, `{"version": 2, "body": ...}`, plus the
//! descriptors the message carries. Everything received is untrusted: a
//! message longer than its limit is refused whole (the socket layer closes
//! its descriptors), a version other than [`VERSION`] is refused by name,
//! and a request with unknown fields is refused.
//!
//! Requests (client → service): `{"op": "get"}` with one descriptor, the
//! client's open file (read access proven by the descriptor, never a
//! path); `{"op": "status"}` with none; `{"op": "to-device", "device":
//! {"ordinal": N, "handle": HEX, "offset": BYTES, "len": BYTES}}` with the
//! file's descriptor, which asks the service to copy the file into the
//! client's device memory that the CUDA IPC handle names, from `offset`
//! bytes into that allocation (see [`DeviceTarget`]), answered
//! with `copied` once the bytes are there; `{"op": "get-object", "object":
//! GRANT}` with none, which asks for the object a [`Grant`] names (the
//! service reads it with the grant, never with keys of its own), and
//! `to-device` with a grant and no descriptor for an object. Replies: a buffer (its memfd
//! attached), the status, or an error with the same detail as a direct
//! load's (kind, operation, path, offset, errno, message). Before a get's
//! reply the service sends `accepted` as soon as it has read the request,
//! then `working` every [`KEEPALIVE_INTERVAL`] while the load runs, with
//! the bytes its loads have read: a client that hears neither in time
//! ([`ACK_TIMEOUT`], [`KEEPALIVE_TIMEOUT`]) knows the service is stopped
//! or stuck, and one that sees no byte read for [`STALL_TIMEOUT`] knows
//! its loads are.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::object::Grant;
use crate::share::Connection;

/// The protocol version this build speaks.
pub const VERSION: u32 = 2;
/// How long a client waits for `accepted` after sending a get (the
/// service sends it before it looks at the file).
pub const ACK_TIMEOUT: Duration = Duration::from_secs(3);
/// How often the service says `working` while a get's load runs.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(500);
/// How long a client waits for the next message once a get was accepted.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client waits while the service's loads read nothing (a load
/// stuck on a silent network or FUSE server) before it loads directly.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest request a service accepts (a get-object's grant carries two
/// presigned queries, with a session token each where there is one).
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;
/// Longest reply a client accepts (a status lists at most
/// [`MAX_STATUS_ENTRIES`] files, well under this).
pub const MAX_REPLY_BYTES: usize = 128 * 1024;
/// Files a status reply lists at most (most recently used first).
pub const MAX_STATUS_ENTRIES: usize = 100;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope<T> {
    version: u32,
    body: T,
}

/// Just the version, read first so that another version is named in the
/// error rather than failing on its fields.
#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

/// What a client asks the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Request {
    /// The bytes of the file whose open descriptor comes with the request.
    Get,
    /// What the service holds.
    Status,
    /// The bytes of the file whose open descriptor comes with the request,
    /// copied by the service into the client's device memory.
    ToDevice,
    /// The bytes of the object the request's [`Grant`] names, at the
    /// version the service finds with the grant's HEAD.
    GetObject,
}

/// Where a [`Request::ToDevice`] puts the file: device memory of the
/// client, which the service opens (`cuIpcOpenMemHandle`), copies into on
/// a stream of its own, and closes before it answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceTarget {
    /// The device's ordinal as the client numbers it; the service must
    /// number devices the same way (the same `CUDA_VISIBLE_DEVICES`), or
    /// the open fails and the client loads directly.
    pub ordinal: u32,
    /// The allocation's `CUipcMemHandle`, as 128 hex digits.
    pub handle: String,
    /// Where the file goes in the allocation the handle names (which is
    /// the whole allocation: a tensor of a caching allocator lies inside a
    /// larger one). Absent is 0, and 0 is not sent, so a service or client
    /// of before the field reads what the other sends.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offset: u64,
    /// Bytes the client set aside for the file from `offset`: its length
    /// when it asked.
    pub len: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl DeviceTarget {
    pub fn new(ordinal: u32, handle: &[u8; 64], offset: u64, len: u64) -> DeviceTarget {
        let handle = handle.iter().map(|b| format!("{b:02x}")).collect();
        DeviceTarget { ordinal, handle, offset, len }
    }

    /// The 64 bytes of the handle, or why the text is not one.
    pub fn handle_bytes(&self) -> io::Result<[u8; 64]> {
        let invalid = || io::Error::new(io::ErrorKind::InvalidData, "a device handle is 128 hex digits");
        let text = self.handle.as_bytes();
        if text.len() != 128 {
            return Err(invalid());
        }
        let mut bytes = [0u8; 64];
        for (byte, pair) in bytes.iter_mut().zip(text.chunks(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| invalid())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| invalid())?;
        }
        Ok(bytes)
    }
}

/// A request as it crosses the socket: `{"op": "get"}`, a device target
/// for `to-device` only, an object's grant for `get-object` only.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestBody {
    op: Request,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device: Option<DeviceTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    object: Option<Grant>,
}

/// A received request, as [`decode_message`] checked it.
#[derive(Debug)]
pub struct Message {
    pub request: Request,
    /// Set for [`Request::ToDevice`], and only for it.
    pub device: Option<DeviceTarget>,
    /// Set for [`Request::GetObject`], and for a [`Request::ToDevice`] of
    /// an object.
    pub object: Option<Grant>,
}

/// `request` (neither [`Request::ToDevice`]: [`encode_device_request`],
/// nor [`Request::GetObject`]: [`encode_object_request`]) as bytes to send.
pub fn encode_request(request: Request) -> Vec<u8> {
    encode(&RequestBody { op: request, device: None, object: None })
}

/// A [`Request::ToDevice`] for `target` as bytes to send.
pub fn encode_device_request(target: &DeviceTarget) -> Vec<u8> {
    encode(&RequestBody { op: Request::ToDevice, device: Some(target.clone()), object: None })
}

/// A [`Request::ToDevice`] of the object `grant` names into `target`, as
/// bytes to send (with no descriptor: the grant names the object).
pub fn encode_object_device_request(grant: &Grant, target: &DeviceTarget) -> Vec<u8> {
    encode(&RequestBody { op: Request::ToDevice, device: Some(target.clone()), object: Some(grant.clone()) })
}

/// A [`Request::GetObject`] of the object `grant` names as bytes to send.
pub fn encode_object_request(grant: &Grant) -> Vec<u8> {
    encode(&RequestBody { op: Request::GetObject, device: None, object: Some(grant.clone()) })
}

/// A received request, checked as untrusted input: a device target comes
/// with `to-device` and only with it, its handle well formed; a grant
/// with `get-object` always, with `to-device` for an object (instead of a
/// descriptor), and with nothing else.
pub fn decode_message(bytes: &[u8]) -> io::Result<Message> {
    let body = decode::<RequestBody>(bytes)?;
    let invalid = |message: &str| io::Error::new(io::ErrorKind::InvalidData, message.to_owned());
    match (body.op, &body.device) {
        (Request::ToDevice, Some(target)) => target.handle_bytes().map(drop)?,
        (Request::ToDevice, None) => return Err(invalid("a to-device request names no device")),
        (_, Some(_)) => return Err(invalid("only a to-device request names a device")),
        (_, None) => {}
    }
    match (body.op, &body.object) {
        (Request::GetObject, None) => return Err(invalid("a get-object request names no object")),
        (Request::GetObject | Request::ToDevice, Some(_)) | (_, None) => {}
        (_, Some(_)) => return Err(invalid("only a get-object or to-device request names an object")),
    }
    Ok(Message { request: body.op, device: body.device, object: body.object })
}

/// The kind of a received request, checked as [`decode_message`] does.
pub fn decode_request(bytes: &[u8]) -> io::Result<Request> {
    decode_message(bytes).map(|message| message.request)
}

/// The operations a service's error names when it cannot copy into the
/// client's device memory, where the client loads directly instead: the
/// memory cannot be opened (another user, no such device in the service,
/// the driver refused the handle) or the cached file cannot be pinned.
pub const DEVICE_UNREACHABLE_OPS: [&str; 2] = ["open the client's device memory", "register the cached file"];

/// How the service produced a buffer it hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Served {
    /// From the cache: no disk read.
    Hit,
    /// Loaded now, and kept for the next request.
    Miss,
    /// Loaded now for this request only (larger than the memory limit),
    /// one such load at a time.
    Uncached,
}

impl Served {
    pub fn name(self) -> &'static str {
        match self {
            Served::Hit => "hit",
            Served::Miss => "miss",
            Served::Uncached => "uncached",
        }
    }
}

/// A buffer's place in the memfd sent with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferInfo {
    /// Offset of the first byte in the memfd.
    pub offset: u64,
    pub len: u64,
    /// Set by the cache service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<Served>,
    /// Something the receiver should be told (why it was not cached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// One cached file in a status reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachedFile {
    #[serde(serialize_with = "crate::error::serialize_path")]
    pub path: PathBuf,
    /// Bytes of memory the file holds in the cache.
    pub bytes: u64,
    /// Requests answered from the cache.
    pub hits: u64,
    /// Times the memfd was handed to a client (the load included).
    pub handoffs: u64,
    /// The pages that hold it: "2 MiB", "4 KiB", "4 KiB, collapsing into
    /// 2 MiB (N%)", "4 KiB (collapse failed: CAUSE)" or "4 KiB and 2 MiB
    /// (collapse failed at byte N: CAUSE)".
    pub pages: String,
}

/// What the service holds and has done since it started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub pid: u32,
    #[serde(serialize_with = "crate::error::serialize_path")]
    pub socket: PathBuf,
    pub memory_limit: u64,
    /// The memory kind cached files get (`memfd-huge` or `memfd`).
    pub memory_kind: String,
    /// Why that kind, and what would give huge pages where it is not.
    pub memory_reason: String,
    /// Memory the cached files hold.
    pub memory_used: u64,
    /// Files cached (the list below may be cut at [`MAX_STATUS_ENTRIES`]).
    pub files_cached: u64,
    pub hits: u64,
    pub misses: u64,
    /// Files loaded for one client and not kept (over the limit).
    pub uncached: u64,
    /// Files dropped to make room.
    pub evictions: u64,
    /// Requests that failed (the error went back to the client).
    pub errors: u64,
    /// Connections refused by the credentials check.
    pub refused: u64,
    /// Clients connected now.
    pub clients: u64,
    /// The cached files, most recently used first.
    pub files: Vec<CachedFile>,
}

/// An error as it crosses the socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    pub kind: String,
    pub op: String,
    pub path: String,
    #[serde(default)]
    pub offset: Option<u64>,
    /// The OS error number, when a system call failed.
    #[serde(default)]
    pub errno: Option<i32>,
    /// The cause, as the error prints it after the path.
    pub message: String,
}

/// A reply from the service (and the message of [`crate::Buffer::send`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Reply {
    /// A get was received; its reply follows.
    Accepted,
    /// A get's load still runs; `loaded` counts the bytes every load of
    /// the service has read so far.
    Working {
        loaded: u64,
    },
    Buffer(BufferInfo),
    /// A to-device request's bytes are in the client's device memory.
    Copied {
        len: u64,
        served: Served,
    },
    Status(Status),
    Error(WireError),
}

/// `body` in an envelope, as bytes to send.
pub fn encode<T: Serialize>(body: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail.
    serde_json::to_vec(&Envelope { version: VERSION, body }).unwrap_or_default()
}

/// The body of one received message, checked against [`VERSION`].
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> io::Result<T> {
    let invalid = |message: String| io::Error::new(io::ErrorKind::InvalidData, message);
    let version: VersionOnly =
        serde_json::from_slice(bytes).map_err(|e| invalid(format!("malformed message: {e}")))?;
    if version.version != VERSION {
        return Err(invalid(format!(
            "protocol version {} (this side speaks version {VERSION}): use the same dmaload on both sides",
            version.version
        )));
    }
    let envelope: Envelope<T> =
        serde_json::from_slice(bytes).map_err(|e| invalid(format!("malformed message: {e}")))?;
    Ok(envelope.body)
}

/// Receives one reply of at most [`MAX_REPLY_BYTES`]: `Ok(None)` when the
/// peer closed the connection instead.
pub fn receive_reply(conn: &Connection) -> io::Result<Option<(Reply, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_REPLY_BYTES];
    let (len, fds) = conn.recv(&mut buf)?;
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((decode(&buf[..len])?, fds)))
}

/// Receives the message of a buffer handoff: its description and the one
/// memfd it carries. An error reply becomes that error; anything else is
/// refused (its descriptors closed). `socket` names the connection in
/// errors.
pub fn receive_buffer(conn: &Connection, socket: &Path) -> Result<(BufferInfo, OwnedFd)> {
    let refused = |message: String| Error::new(ErrorKind::InvalidInput, "receive buffer", socket, message);
    let (reply, fds) =
        receive_reply(conn).map_err(|e| Error::io("receive buffer", socket, e))?.ok_or_else(|| {
            Error::io(
                "receive buffer",
                socket,
                io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection"),
            )
        })?;
    match reply {
        Reply::Buffer(info) => {
            let count = fds.len();
            let [memfd]: [OwnedFd; 1] = fds
                .try_into()
                .map_err(|_| refused(format!("a buffer message carried {count} descriptors, not one")))?;
            Ok((info, memfd))
        }
        Reply::Error(err) => Err(err.into_error(None)),
        Reply::Status(_) | Reply::Accepted | Reply::Working { .. } | Reply::Copied { .. } => {
            Err(refused("a reply of another kind where a buffer was expected".into()))
        }
    }
}

const KINDS: [(ErrorKind, &str); 8] = [
    (ErrorKind::Io, "io"),
    (ErrorKind::Truncated, "truncated"),
    (ErrorKind::OutOfMemory, "out-of-memory"),
    (ErrorKind::DirectIoUnavailable, "direct-io-unavailable"),
    (ErrorKind::InvalidInput, "invalid-input"),
    (ErrorKind::Changed, "changed"),
    (ErrorKind::Cancelled, "cancelled"),
    (ErrorKind::Corrupt, "corrupt"),
];

/// Characters of a received error's operation kept.
const MAX_OP_CHARS: usize = 80;

impl WireError {
    pub fn from_error(err: &Error) -> WireError {
        let kind = KINDS.iter().find(|(k, _)| *k == err.kind()).map_or("io", |(_, name)| name);
        WireError {
            kind: kind.to_owned(),
            op: err.op().to_owned(),
            path: err.path().to_string_lossy().into_owned(),
            offset: err.offset(),
            errno: err.raw_os_error(),
            message: err.io_error().to_string(),
        }
    }

    /// The error as a direct load would have returned it; `path` replaces
    /// the service's name for the file (the client knows the path it
    /// asked for).
    pub fn into_error(self, path: Option<&Path>) -> Error {
        let kind = KINDS.iter().find(|(_, name)| *name == self.kind).map_or(ErrorKind::Io, |(k, _)| *k);
        let path = path.map_or_else(|| PathBuf::from(&self.path), Path::to_path_buf);
        let err = match self.errno {
            Some(errno) => Error::with_errno("load", &path, errno, self.message).with_kind(kind),
            None => Error::new(kind, "load", &path, self.message),
        };
        // The service's own name for what failed ("allocate the staging
        // ring", say), bounded: the reply is untrusted.
        let op: String = self.op.chars().take(MAX_OP_CHARS).collect();
        let err = if op.is_empty() { err } else { err.with_op(op) };
        match self.offset {
            Some(offset) => err.at(offset),
            None => err,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_cross_with_their_detail() {
        let path = Path::new("/models/a.bin");
        let direct = Error::new(ErrorKind::Truncated, "load", path, "the file was cut").at(4096);
        let back = WireError::from_error(&direct).into_error(None);
        assert_eq!(back.to_string(), direct.to_string());
        assert_eq!(
            (back.kind(), back.errno(), back.offset()),
            (ErrorKind::Truncated, libc::ENODATA, Some(4096))
        );

        let os = Error::io("read", path, io::Error::from_raw_os_error(libc::EIO)).at(8192);
        let back = WireError::from_error(&os).into_error(Some(Path::new("a.bin")));
        assert_eq!(back.to_string(), "read a.bin at offset 8192: Input/output error (os error 5)");
        assert_eq!(back.raw_os_error(), Some(libc::EIO));

        // Any operation crosses, with its OS error: a service that could
        // not allocate its staging ring says so, as a direct load would.
        let ring = Error::io("allocate the staging ring", path, io::Error::from_raw_os_error(libc::ENOMEM));
        let back = WireError::from_error(&ring).into_error(None);
        assert_eq!(back.to_string(), ring.to_string());
        assert_eq!((back.op(), back.raw_os_error()), ("allocate the staging ring", Some(libc::ENOMEM)));
        // A message told beside an errno crosses with both.
        let busy = Error::with_errno("seal memfd", path, libc::EBUSY, "still mapped writable elsewhere");
        let back = WireError::from_error(&busy).into_error(None);
        assert_eq!(back.to_string(), busy.to_string());
        assert_eq!(back.raw_os_error(), Some(libc::EBUSY));
        let long = WireError { op: "x".repeat(10_000), ..WireError::from_error(&direct) };
        assert_eq!(long.into_error(None).op().len(), MAX_OP_CHARS);
        let unnamed = WireError { op: String::new(), ..WireError::from_error(&direct) };
        assert_eq!(unnamed.into_error(None).op(), "load");
    }

    #[test]
    fn untrusted_messages_are_refused_by_name() {
        assert_eq!(decode_request(&encode_request(Request::Get)).unwrap(), Request::Get);
        assert_eq!(decode_request(br#"{"version": 2, "body": {"op": "status"}}"#).unwrap(), Request::Status);
        let other = br#"{"version": 3, "body": {"op": "get"}}"#;
        assert!(decode_request(other).unwrap_err().to_string().contains("protocol version 3"));
        for bad in [&b"not json"[..], br#"{"version": 2}"#, br#"{"version": 2, "body": {"op": "rm"}}"#] {
            assert_eq!(decode_request(bad).unwrap_err().kind(), io::ErrorKind::InvalidData);
        }
        let extra = br#"{"version": 2, "body": {"op": "get", "path": "/etc/shadow"}}"#;
        assert!(decode_request(extra).is_err(), "a request names no path");
        let outside = br#"{"version": 2, "body": {"op": "get"}, "path": "/etc/shadow"}"#;
        assert!(decode_request(outside).is_err());

        let target = DeviceTarget::new(1, &[0xab; 64], 0, 4096);
        let message = decode_message(&encode_device_request(&target)).unwrap();
        assert_eq!(
            (message.request, message.device.unwrap().handle_bytes().unwrap()),
            (Request::ToDevice, [0xab; 64])
        );
        // An offset crosses; 0 is not sent, so a service of before the
        // field (which refuses unknown fields) reads what it always did.
        let at = DeviceTarget::new(1, &[0xab; 64], 512, 4096);
        assert_eq!(decode_message(&encode_device_request(&at)).unwrap().device.unwrap().offset, 512);
        assert!(!String::from_utf8_lossy(&encode_device_request(&target)).contains("offset"));
        let handle = "ab".repeat(64);
        let device = format!(r#""device": {{"ordinal": 0, "handle": "{handle}", "len": 1}}"#);
        for bad in [
            r#"{"version": 2, "body": {"op": "to-device"}}"#.to_owned(),
            format!(r#"{{"version": 2, "body": {{"op": "get", {device}}}}}"#),
            format!(r#"{{"version": 2, "body": {{"op": "to-device", {}}}}}"#, device.replace("ab", "zz")),
            format!(r#"{{"version": 2, "body": {{"op": "to-device", {}}}}}"#, device.replacen("ab", "", 1)),
            format!(
                r#"{{"version": 2, "body": {{"op": "to-device", {}}}}}"#,
                device.replace("}", r#", "x": 1}"#)
            ),
        ] {
            assert_eq!(
                decode_message(bad.as_bytes()).unwrap_err().kind(),
                io::ErrorKind::InvalidData,
                "{bad}"
            );
        }
        let good = format!(r#"{{"version": 2, "body": {{"op": "to-device", {device}}}}}"#);
        assert_eq!(decode_request(good.as_bytes()).unwrap(), Request::ToDevice);

        let grant = Grant {
            url: "s3://b/k".into(),
            endpoint: "http://127.0.0.1:3900".into(),
            path_style: true,
            region: "r".into(),
            head: "q1".into(),
            get: "q2".into(),
            etag: "\"e\"".into(),
        };
        let message = decode_message(&encode_object_request(&grant)).unwrap();
        assert_eq!((message.request, message.object), (Request::GetObject, Some(grant.clone())));
        let target = DeviceTarget::new(0, &[0xcd; 64], 256, 4096);
        let message = decode_message(&encode_object_device_request(&grant, &target)).unwrap();
        assert_eq!(
            (message.request, message.device, message.object),
            (Request::ToDevice, Some(target), Some(grant))
        );
        for bad in [
            r#"{"version": 2, "body": {"op": "get-object"}}"#.to_owned(),
            format!(r#"{{"version": 2, "body": {{"op": "get", "object": {}}}}}"#, "{}"),
            format!(r#"{{"version": 2, "body": {{"op": "get-object", {device}}}}}"#),
        ] {
            assert_eq!(
                decode_message(bad.as_bytes()).unwrap_err().kind(),
                io::ErrorKind::InvalidData,
                "{bad}"
            );
        }
    }

    /// Mutated valid messages (the fuzz target `share_message` does this
    /// at scale): decoding returns, whatever the bytes.
    #[test]
    fn mutated_messages_never_panic() {
        let seeds = [
            encode_request(Request::Get),
            encode(&Reply::Buffer(BufferInfo { offset: 1, len: 2, served: Some(Served::Hit), note: None })),
            encode(&Reply::Error(WireError::from_error(
                &Error::new(ErrorKind::Changed, "load", Path::new("/m"), "moved").at(7),
            ))),
        ];
        const ALPHABET: &[u8] = b"{}[]\":,0-9e";
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..20_000 {
            let mut bytes = seeds[round % seeds.len()].clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() % bytes.len() as u64) as usize;
                match next() % 3 {
                    0 => bytes[at] = next() as u8,
                    1 => drop(bytes.remove(at)),
                    _ => bytes.insert(at, ALPHABET[(next() % ALPHABET.len() as u64) as usize]),
                }
            }
            let _ = decode_request(&bytes);
            if let Ok(Reply::Error(err)) = decode::<Reply>(&bytes) {
                let _ = err.into_error(None).to_string();
            }
        }
    }
}
