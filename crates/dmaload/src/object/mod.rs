//! An object in an S3-compatible store (`s3://BUCKET/KEY`) as the source of
//! a load: opened once with a HEAD (its size and ETag), then read in
//! ranged GETs that each pin that ETag (`If-Match`), so an object replaced
//! mid-load fails the load ([`ErrorKind::Changed`]) instead of mixing two
//! versions. The engine that runs the GETs over a pool of kept-alive
//! connections is `engine::object`; see docs/object-storage.md.
//!
//! `http://` and `https://` endpoints: TLS is `rustls` on `ring`, checking
//! the server against `AWS_CA_BUNDLE`, the profile's `ca_bundle`, else the
//! system's certificates (`tls`). A certificate that does not verify fails
//! the open at once, naming the host and the trust roots; connection
//! failures (resets, stalls) are retried as on plain HTTP.

pub mod config;
mod http;
mod proxy;
pub mod sigv4;
mod tls;
mod xml;

use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cancel::CancelToken;
use crate::error::{Error, ErrorKind, Result};
use crate::sys::mem::MappingWriter;
use config::{Addressing, Config};
pub(crate) use http::{Connection, Waiter};
use tls::Tls;

/// `s3://BUCKET/KEY`, taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectUrl {
    pub bucket: String,
    pub key: String,
}

impl ObjectUrl {
    /// `None` when `url` is not an `s3://` URL; an error when it is one
    /// without a bucket or a key.
    pub fn parse(url: &str) -> Option<Result<ObjectUrl>> {
        let rest = url.strip_prefix("s3://")?;
        Some(match rest.split_once('/') {
            Some((bucket, key)) if !bucket.is_empty() && !key.is_empty() => {
                Ok(ObjectUrl { bucket: bucket.to_owned(), key: key.to_owned() })
            }
            _ => Err(Error::new(
                ErrorKind::InvalidInput,
                "open",
                Path::new(url),
                "an object URL is s3://BUCKET/KEY",
            )),
        })
    }
}

/// Whether `path` names an object (`s3://...`) rather than a file.
pub fn is_object_url(path: &Path) -> bool {
    path.to_str().is_some_and(|p| p.starts_with("s3://"))
}

/// Attempts at one request, the first included.
const MAX_ATTEMPTS: u32 = 8;
/// The first retry waits up to this long; each next one up to twice as long.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// An object opened for loading: where it is, its size and the ETag every
/// read pins.
#[derive(Debug)]
pub struct Object {
    url: ObjectUrl,
    name: PathBuf,
    config: Config,
    /// Host header and address of every request.
    host: String,
    path: String,
    pub size: u64,
    pub etag: String,
    stall: Duration,
    retry_for: Duration,
    /// The TLS client of an `https://` endpoint (its trust roots read once
    /// per process, `tls`).
    tls: Option<Tls>,
    /// Requests authorized by another process's [`Grant`] instead of keys.
    granted: Option<Granted>,
    /// The proxy connections to `host` go through (`https_proxy`...).
    proxy: Option<proxy::Proxy>,
}

/// The queries of a [`Grant`] this object's requests carry.
#[derive(Debug)]
struct Granted {
    head: String,
    get: String,
}

/// What lets another process (the cache service) read one object with
/// this process's authority but without its keys: where the object is,
/// and presigned queries that authorize a HEAD and ranged GETs of it for
/// [`GRANT_SECONDS`] ([`sigv4::presign`]). The store checks them on every
/// request, so the holder can read this object, and nothing else, while
/// the grant lasts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// `s3://BUCKET/KEY`.
    pub url: String,
    /// `http(s)://host[:port][/prefix]`, as `AWS_ENDPOINT_URL` spells it.
    pub endpoint: String,
    /// The bucket goes in the path (`true`) or the host name.
    pub path_style: bool,
    pub region: String,
    /// The query that authorizes the HEAD ("" for an unsigned request).
    pub head: String,
    /// The query that authorizes the GETs.
    pub get: String,
    /// The version the granting process opened: the holder reads that
    /// one or fails ([`ErrorKind::Changed`]).
    pub etag: String,
}

/// How long a [`Grant`] lasts: long enough for the holder to read a large
/// object at a slow rate (each GET is checked when it starts).
pub const GRANT_SECONDS: u64 = 6 * 3600;

/// How a failed attempt ends: tried again, or the load's error.
enum Failure {
    Retry(String),
    Fatal(Error),
}

impl Object {
    /// Looks the object up (HEAD, retried like every request) with the
    /// configuration of the environment ([`Config::from_env`]); `cancel`
    /// stops the retries.
    pub fn open(url: &str, cancel: &CancelToken) -> Result<Object> {
        let name = PathBuf::from(url);
        let parsed = ObjectUrl::parse(url)
            .unwrap_or_else(|| Err(Error::new(ErrorKind::InvalidInput, "open", &name, "not an s3:// URL")))?;
        let config =
            Config::from_env().map_err(|why| Error::new(ErrorKind::InvalidInput, "open", &name, why))?;
        Object::with_config(parsed, config, cancel)
    }

    /// [`Object::open`] with a configuration of the caller's.
    pub fn with_config(url: ObjectUrl, config: Config, cancel: &CancelToken) -> Result<Object> {
        Object::unopened(url, config)?.look_up(cancel)
    }

    /// The object before its HEAD: where its requests go, and how.
    fn unopened(url: ObjectUrl, config: Config) -> Result<Object> {
        let name = PathBuf::from(format!("s3://{}/{}", url.bucket, url.key));
        let tls = match config.endpoint.https {
            true => Some(
                Tls::new(config.ca_bundle.as_ref())
                    .map_err(|why| Error::new(ErrorKind::InvalidInput, "open", &name, why))?,
            ),
            false => None,
        };
        let (host, path) = locate(&url, &config);
        let (stall, retry_for) = (config.timeout, config.retry_for);
        let proxy = config.proxies.for_host(&host, config.endpoint.port, config.endpoint.https).cloned();
        Ok(Object {
            url,
            name,
            host,
            path,
            config,
            size: 0,
            etag: String::new(),
            stall,
            retry_for,
            tls,
            granted: None,
            proxy,
        })
    }

    /// Opens the object `grant` names with the grant's authority, as the
    /// cache service does for a client: this process's own keys are never
    /// used, its trust roots, timeouts and retries are. An object whose
    /// ETag is no longer the grant's fails ([`ErrorKind::Changed`]). The grant is
    /// untrusted input: anything in it that would not fit in a request's
    /// head (spaces, control characters) is refused.
    pub fn granted(grant: &Grant, cancel: &CancelToken) -> Result<Object> {
        let name = PathBuf::from(&grant.url);
        let invalid = |why: String| Error::new(ErrorKind::InvalidInput, "open", &name, why);
        let url = ObjectUrl::parse(&grant.url).unwrap_or_else(|| Err(invalid("not an s3:// URL".into())))?;
        let fields = [&grant.url, &grant.endpoint, &grant.region, &grant.head, &grant.get, &grant.etag];
        if fields.iter().any(|f| f.chars().any(|c| c.is_whitespace() || c.is_control())) {
            return Err(invalid("a grant's fields hold no spaces or control characters".into()));
        }
        let mut config = Config::from_env_without_keys().map_err(invalid)?;
        config.region = grant.region.clone();
        config.endpoint = config::Endpoint::parse(&grant.endpoint).map_err(invalid)?;
        config.addressing = if grant.path_style { Addressing::Path } else { Addressing::VirtualHosted };
        let granted = Granted { head: grant.head.clone(), get: grant.get.clone() };
        let mut object = Object::unopened(url, config)?;
        object.granted = Some(granted);
        let object = object.look_up(cancel)?;
        if object.etag != grant.etag {
            return Err(Error::new(
                ErrorKind::Changed,
                "HEAD",
                &name,
                format!(
                    "the object was replaced (ETag {} now, {} when it was granted)",
                    object.etag, grant.etag
                ),
            ));
        }
        Ok(object)
    }

    /// A [`Grant`] of this object for [`GRANT_SECONDS`], signed with this
    /// process's keys (unsigned queries for a public bucket).
    pub fn grant(&self) -> Grant {
        let host = self.config.endpoint.authority(&self.host);
        let presign = |method| match &self.config.credentials {
            Some(credentials) => sigv4::presign(
                method,
                &host,
                &self.path,
                credentials,
                &self.config.region,
                &sigv4::Stamp::now(),
                GRANT_SECONDS,
            ),
            None => String::new(),
        };
        Grant {
            url: format!("s3://{}/{}", self.url.bucket, self.url.key),
            endpoint: self.config.endpoint.url(),
            // `locate` put the bucket in the host name, or left the host as it was.
            path_style: self.host == self.config.endpoint.host,
            region: self.config.region.clone(),
            head: presign("HEAD"),
            get: presign("GET"),
            etag: self.etag.clone(),
        }
    }

    /// The object's size and ETag from a HEAD (retried like every
    /// request); `cancel` stops the retries.
    fn look_up(mut self, cancel: &CancelToken) -> Result<Object> {
        let stopped = || cancel.is_cancelled();
        let head = self.request(&mut None, "HEAD", None, &stopped, |_, head, _| match head.status {
            200 => Ok((head.content_length(), head.header("etag").map(str::to_owned))),
            _ => Err(None),
        });
        let head = match head {
            Err(err) if matches!(err.raw_os_error(), Some(libc::ENOENT | libc::EACCES)) => {
                // A HEAD's error has no body: a one-byte GET of the same
                // object gets the server's code (NoSuchKey, NoSuchBucket,
                // SignatureDoesNotMatch, ...) where it fails the same way.
                let explained: Result<()> =
                    self.request(&mut None, "GET", Some(0..1), &stopped, |_, _, _| Err(None));
                return Err(match explained {
                    Err(explained) if explained.raw_os_error() == err.raw_os_error() => explained,
                    _ => err,
                });
            }
            head => head?,
        };
        match head {
            (Some(size), Some(etag)) => {
                self.size = size;
                self.etag = etag;
                Ok(self)
            }
            _ => Err(Error::new(
                ErrorKind::Io,
                "HEAD",
                &self.name,
                "the response names no Content-Length or no ETag",
            )),
        }
    }

    /// The endpoint its GETs go to, as their tuning is remembered for it
    /// (`None` for a host no line could hold).
    pub(crate) fn endpoint(&self) -> Option<crate::tune::Endpoint> {
        crate::tune::Endpoint::new(&self.config.endpoint.host, self.config.endpoint.port)
    }

    /// The object's URL, as messages and reports name it.
    pub fn name(&self) -> &Path {
        &self.name
    }

    pub fn bucket(&self) -> &str {
        &self.url.bucket
    }

    pub fn key(&self) -> &str {
        &self.url.key
    }

    /// Opens the object `key` of the same bucket with this object's
    /// configuration (its sums object, say): found where this one was,
    /// whatever the environment says.
    pub fn open_beside(&self, key: &str, cancel: &CancelToken) -> Result<Object> {
        let url = ObjectUrl { bucket: self.url.bucket.clone(), key: key.to_owned() };
        Object::with_config(url, self.config.clone(), cancel)
    }

    /// Reads bytes `range` of the object into `at` of `dst` (of the same
    /// length) with one ranged GET pinned to the ETag, on `connection`
    /// (opened or reopened as needed), retried as failures allow.
    pub(crate) fn get_into(
        &self,
        connection: &mut Option<Connection>,
        range: Range<u64>,
        dst: MappingWriter<'_>,
        at: Range<usize>,
        stopped: &(dyn Fn() -> bool + Sync),
    ) -> Result<()> {
        let expected = range.end - range.start;
        let whole = range.start == 0 && range.end == self.size;
        self.request(connection, "GET", Some(range.clone()), stopped, |conn, head, waiter| {
            let length = head.content_length();
            let fits = match head.status {
                206 => content_range(head) == Some((range.start, range.end - 1, self.size)),
                200 => whole,
                _ => return Err(None),
            };
            if !fits || length != Some(expected) {
                let why = format!(
                    "the server answered bytes {range:?} of an object of {} bytes with status {}, \
                     Content-Range {:?}, Content-Length {:?}: not the bytes asked for",
                    self.size,
                    head.status,
                    head.header("content-range"),
                    length
                );
                return Err(Some(Failure::Fatal(
                    Error::new(ErrorKind::Truncated, "GET", &self.name, why).at(range.start),
                )));
            }
            conn.read_body_into(dst, at.clone(), waiter).map_err(|e| Some(self.io_failure(e, range.start)))
        })
    }

    /// One request with its retries: `done` takes a response's head and
    /// gives the result, `Err(None)` for a status to explain (an error
    /// body's code, a retry on 5xx), or `Err(Some(failure))`.
    fn request<T>(
        &self,
        connection: &mut Option<Connection>,
        method: &str,
        range: Option<Range<u64>>,
        stopped: &(dyn Fn() -> bool + Sync),
        mut done: impl FnMut(&mut Connection, &http::Head, &Waiter<'_>) -> std::result::Result<T, Option<Failure>>,
    ) -> Result<T> {
        let started = Instant::now();
        let offset = range.as_ref().map_or(0, |r| r.start);
        let waiter = Waiter { stopped, stall: self.stall };
        let mut attempt = 0;
        loop {
            attempt += 1;
            if stopped() {
                return Err(self.cancelled(method, offset));
            }
            let outcome = self.attempt(connection, method, range.as_ref(), &waiter, &mut done);
            let why = match outcome {
                Ok(value) => return Ok(value),
                Err(Failure::Fatal(err)) => {
                    *connection = None;
                    return Err(err);
                }
                Err(Failure::Retry(why)) => why,
            };
            *connection = None;
            if stopped() {
                return Err(self.cancelled(method, offset));
            }
            let backoff = jitter(FIRST_BACKOFF.saturating_mul(1 << attempt.min(16)).min(MAX_BACKOFF));
            if attempt >= MAX_ATTEMPTS || started.elapsed() + backoff > self.retry_for {
                let what = self.what(method, range.as_ref());
                let err = Error::with_errno(
                    op(method),
                    &self.name,
                    libc::EIO,
                    format!(
                        "{what}: gave up after {attempt} attempts in {:.1} s: {why}",
                        started.elapsed().as_secs_f64()
                    ),
                );
                return Err(err.at(offset));
            }
            let until = Instant::now() + backoff;
            while Instant::now() < until {
                if stopped() {
                    return Err(self.cancelled(method, offset));
                }
                std::thread::sleep((until - Instant::now()).min(Duration::from_millis(20)));
            }
        }
    }

    fn attempt<T>(
        &self,
        connection: &mut Option<Connection>,
        method: &str,
        range: Option<&Range<u64>>,
        waiter: &Waiter<'_>,
        done: &mut impl FnMut(
            &mut Connection,
            &http::Head,
            &Waiter<'_>,
        ) -> std::result::Result<T, Option<Failure>>,
    ) -> std::result::Result<T, Failure> {
        let offset = range.map_or(0, |r| r.start);
        let conn = match connection {
            Some(conn) => conn,
            None => {
                let (addr, port) = (self.host.as_str(), self.config.endpoint.port);
                let opened =
                    Connection::open(addr, port, self.stall, self.tls.as_ref(), self.proxy.as_ref(), waiter)
                        .map_err(|e| {
                            if http::HandshakeRefused::is(&e) {
                                let err = Error::with_errno(op(method), &self.name, libc::EIO, e.to_string());
                                return Failure::Fatal(err.at(offset));
                            }
                            match self.io_failure(e, offset) {
                                Failure::Retry(why) => {
                                    Failure::Retry(format!("connect to {addr}:{port}: {why}"))
                                }
                                cancelled => cancelled,
                            }
                        })?;
                connection.insert(opened)
            }
        };
        let request = self.request_head(method, range);
        let sent = conn.send(request.as_bytes()).and_then(|()| conn.read_head(waiter));
        let head = match sent {
            Ok(head) => head,
            // A kept-alive connection the server closed meanwhile fails
            // here too: tried again on a new one.
            Err(e) => return Err(self.io_failure(e, offset)),
        };
        let keep = head.keeps_alive();
        let result = match done(conn, &head, waiter) {
            Ok(value) => Ok(value),
            Err(Some(failure)) => Err(failure),
            Err(None) => Err(self.status_failure(conn, &head, method, range, waiter)),
        };
        if !keep || result.is_err() {
            *connection = None;
        }
        result
    }

    /// The request's head: signed when there are credentials, with the
    /// grant's query when it is granted.
    fn request_head(&self, method: &str, range: Option<&Range<u64>>) -> String {
        let host = self.config.endpoint.authority(&self.host);
        let mut headers = vec![("host", host)];
        if let Some(range) = range {
            headers.push(("range", format!("bytes={}-{}", range.start, range.end - 1)));
        }
        if range.is_some() && !self.etag.is_empty() {
            headers.push(("if-match", self.etag.clone()));
        }
        let mut target = self.path.clone();
        match (&self.granted, &self.config.credentials) {
            (Some(granted), _) => {
                let query = if method == "HEAD" { &granted.head } else { &granted.get };
                if !query.is_empty() {
                    target = format!("{target}?{query}");
                }
            }
            (None, Some(credentials)) => {
                let request = sigv4::Request {
                    method,
                    path: &self.path,
                    query: "",
                    headers: &headers,
                    payload_sha256: sigv4::EMPTY_SHA256,
                };
                let signed = sigv4::sign(&request, credentials, &self.config.region, &sigv4::Stamp::now());
                headers.extend(signed);
            }
            (None, None) => {}
        }
        let mut head = format!("{method} {target} HTTP/1.1\r\n");
        for (name, value) in &headers {
            head += &format!("{name}: {value}\r\n");
        }
        head += "user-agent: dmaload\r\n\r\n";
        head
    }

    /// What a response that is no success means: its error body's code
    /// read (for a GET; a HEAD has no body), retried on 5xx and throttling,
    /// else an error naming the status and code.
    fn status_failure(
        &self,
        conn: &mut Connection,
        head: &http::Head,
        method: &str,
        range: Option<&Range<u64>>,
        waiter: &Waiter<'_>,
    ) -> Failure {
        let body = match head.content_length() {
            Some(len) if method != "HEAD" && len as usize <= http::MAX_ERROR_BODY => {
                conn.read_body(len as usize, waiter).unwrap_or_default()
            }
            _ => Vec::new(),
        };
        let body = String::from_utf8_lossy(&body);
        let code = xml::field(&body, "Code");
        let message = xml::field(&body, "Message");
        let status = head.status;
        let what = self.what(method, range);
        let mut told = format!("{what}: HTTP {status}");
        if let Some(code) = &code {
            told += &format!(" {code}");
        }
        if let Some(message) = &message {
            told += &format!(": {message}");
        }
        let offset = range.map_or(0, |r| r.start);
        let throttled = matches!(code.as_deref(), Some("SlowDown" | "RequestTimeout" | "InternalError"));
        if status >= 500 || status == 429 || throttled {
            return Failure::Retry(told);
        }
        let path = &self.name;
        let err = match status {
            412 => Error::new(
                ErrorKind::Changed,
                op(method),
                path,
                format!(
                    "{told}: the object was replaced since the load began (ETag {} no longer matches); \
                     nothing was kept: load it again",
                    self.etag
                ),
            ),
            404 => {
                Error::with_errno(op(method), path, libc::ENOENT, not_found(&told, code.as_deref(), method))
            }
            401 | 403 => {
                Error::with_errno(op(method), path, libc::EACCES, format!("{told} ({})", self.whose()))
            }
            416 => Error::new(ErrorKind::Truncated, op(method), path, told),
            301 | 307 | 308 => {
                let region = head.header("x-amz-bucket-region").unwrap_or("another region");
                Error::with_errno(
                    op(method),
                    path,
                    libc::EIO,
                    format!("{told}: the bucket is in {region}; set AWS_REGION={region}"),
                )
            }
            _ => Error::with_errno(op(method), path, libc::EIO, told),
        };
        Failure::Fatal(err.at(offset))
    }

    /// A failed read or write on the connection: retried (resets, stalls,
    /// a body cut short), except a cancellation.
    fn io_failure(&self, err: io::Error, offset: u64) -> Failure {
        if err.raw_os_error() == Some(libc::ECANCELED) {
            return Failure::Fatal(self.cancelled("GET", offset));
        }
        Failure::Retry(err.to_string())
    }

    /// Whose authority a refused request carried, for its message.
    fn whose(&self) -> String {
        match (&self.granted, &self.config.credentials) {
            (Some(_), _) => "signed by the grant of the process that asked for the load".to_owned(),
            (None, Some(keys)) => format!("signed with keys from {}: check them", keys.source),
            (None, None) => "unsigned: no keys were found (docs/object-storage.md: keys)".to_owned(),
        }
    }

    fn cancelled(&self, method: &str, offset: u64) -> Error {
        Error::new(ErrorKind::Cancelled, op(method), &self.name, "cancelled; nothing was kept").at(offset)
    }

    /// "bucket B, key K, bytes a-b" for messages.
    fn what(&self, method: &str, range: Option<&Range<u64>>) -> String {
        let mut what = format!("{method} of bucket {}, key {}", self.url.bucket, self.url.key);
        if let Some(range) = range {
            what += &format!(", bytes {}-{}", range.start, range.end.saturating_sub(1));
        }
        what
    }
}

/// The host a request for `url` goes to and its (encoded) path, by the
/// configuration's addressing: `host/[prefix/]bucket/key` or
/// `bucket.host/[prefix/]key`. A bucket name with dots goes in the path
/// over TLS, as AWS's SDKs do: `a.b.s3.REGION.amazonaws.com` is not
/// covered by the wildcard certificate `*.s3.REGION.amazonaws.com`.
fn locate(url: &ObjectUrl, config: &Config) -> (String, String) {
    let key = sigv4::uri_encode(&url.key, true);
    let prefix = &config.endpoint.prefix;
    let dotted_over_tls = config.endpoint.https && url.bucket.contains('.');
    match config.addressing {
        Addressing::VirtualHosted if !dotted_over_tls => {
            (format!("{}.{}", url.bucket, config.endpoint.host), format!("{prefix}/{key}"))
        }
        _ => (config.endpoint.host.clone(), format!("{prefix}/{}/{key}", url.bucket)),
    }
}

fn op(method: &str) -> &'static str {
    match method {
        "HEAD" => "HEAD",
        _ => "GET",
    }
}

/// A 404's message: a HEAD has no body to say whether the bucket or the key
/// is missing.
fn not_found(told: &str, code: Option<&str>, method: &str) -> String {
    match (code, method) {
        (Some(_), _) => told.to_owned(),
        (None, "HEAD") => format!("{told}: no such bucket or key"),
        (None, _) => told.to_owned(),
    }
}

/// `Content-Range: bytes FIRST-LAST/TOTAL`.
fn content_range(head: &http::Head) -> Option<(u64, u64, u64)> {
    let value = head.header("content-range")?.trim().strip_prefix("bytes ")?;
    let (span, total) = value.split_once('/')?;
    let (first, last) = span.split_once('-')?;
    Some((first.parse().ok()?, last.parse().ok()?, total.parse().ok()?))
}

/// A random duration up to `max` ("full jitter"), so that many requests
/// failing together do not retry together.
fn jitter(max: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(Instant::now().elapsed().as_nanos() as u64);
    let fraction = (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64;
    max.mul_f64(fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_error_bodies() {
        let url = ObjectUrl::parse("s3://b/dir/model.safetensors").unwrap().unwrap();
        assert_eq!((url.bucket.as_str(), url.key.as_str()), ("b", "dir/model.safetensors"));
        assert!(ObjectUrl::parse("/tmp/x").is_none());
        assert!(ObjectUrl::parse("s3://b").unwrap().is_err());
        assert!(ObjectUrl::parse("s3://b/").unwrap().is_err());
        let body = "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>Key not found: &quot;k&quot;</Message></Error>";
        assert_eq!(xml::field(body, "Code").as_deref(), Some("NoSuchKey"));
        assert_eq!(xml::field(body, "Message").as_deref(), Some("Key not found: \"k\""));
        assert!(jitter(Duration::from_secs(1)) <= Duration::from_secs(1));
    }

    #[test]
    fn path_style_and_virtual_hosted_requests() {
        let url = ObjectUrl { bucket: "b".into(), key: "dir/a b+c.bin".into() };
        let mut config = Config {
            credentials: None,
            region: "r".into(),
            endpoint: config::Endpoint::parse("http://127.0.0.1:3900/base").unwrap(),
            addressing: Addressing::Path,
            timeout: Duration::from_secs(1),
            retry_for: Duration::from_secs(1),
            ca_bundle: None,
            proxies: Default::default(),
        };
        assert_eq!(locate(&url, &config), ("127.0.0.1".into(), "/base/b/dir/a%20b%2Bc.bin".into()));
        config.endpoint = config::Endpoint::parse("https://s3.eu-west-1.amazonaws.com").unwrap();
        config.addressing = Addressing::VirtualHosted;
        assert_eq!(
            locate(&url, &config),
            ("b.s3.eu-west-1.amazonaws.com".into(), "/dir/a%20b%2Bc.bin".into())
        );
        // A bucket with dots is no name under AWS's wildcard certificate.
        let dotted = ObjectUrl { bucket: "my.models".into(), key: "m.bin".into() };
        assert_eq!(
            locate(&dotted, &config),
            ("s3.eu-west-1.amazonaws.com".into(), "/my.models/m.bin".into())
        );
        config.endpoint = config::Endpoint::parse("http://s3.eu-west-1.amazonaws.com").unwrap();
        assert_eq!(
            locate(&dotted, &config),
            ("my.models.s3.eu-west-1.amazonaws.com".into(), "/m.bin".into())
        );
    }
}
