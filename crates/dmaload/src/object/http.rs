//! One kept-alive HTTP/1.1 connection: a request out, the response's head
//! parsed by `httparse`, and its body received straight into the memory it
//! belongs to (`read(2)` into the destination range: no buffer between),
//! or, for an error's small XML body, into a `Vec`.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use crate::sys::mem::MappingWriter;

/// How often a blocked read looks at the cancellation and the stall clock.
const POLL: Duration = Duration::from_millis(50);
/// Largest response head taken.
const MAX_HEAD: usize = 64 << 10;
/// Largest error body read.
pub const MAX_ERROR_BODY: usize = 64 << 10;

/// When a blocked read gives up: the load was stopped (cancelled, or failed
/// elsewhere), or no byte came for `stall`.
pub struct Waiter<'a> {
    pub stopped: &'a (dyn Fn() -> bool + Sync),
    pub stall: Duration,
}

impl Waiter<'_> {
    /// Runs one read, again while it times out in [`POLL`] slices, until it
    /// gives bytes, the load stops (`ECANCELED`) or the stall time passes
    /// with nothing (`ETIMEDOUT`).
    fn read(&self, mut read: impl FnMut() -> io::Result<usize>) -> io::Result<usize> {
        let started = Instant::now();
        loop {
            match read() {
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                other => return other,
            }
            if (self.stopped)() {
                return Err(io::Error::from_raw_os_error(libc::ECANCELED));
            }
            if started.elapsed() >= self.stall {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the server sent nothing for {} s", self.stall.as_secs_f64()),
                ));
            }
        }
    }
}

/// A response's status line and headers.
#[derive(Debug)]
pub struct Head {
    pub status: u16,
    headers: Vec<(String, String)>,
}

impl Head {
    /// The first header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn content_length(&self) -> Option<u64> {
        self.header("content-length").and_then(|v| v.trim().parse().ok())
    }

    /// Whether the server keeps the connection open after this response.
    pub fn keeps_alive(&self) -> bool {
        !self.header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }
}

/// A connection to one host, used for one request at a time.
pub struct Connection {
    stream: TcpStream,
    /// Bytes read past the head of the response being read: its body's start.
    early: Vec<u8>,
}

impl Connection {
    pub fn open(host: &str, port: u16, timeout: Duration) -> io::Result<Connection> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"));
        for addr in (host.trim_start_matches('[').trim_end_matches(']'), port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    stream.set_read_timeout(Some(POLL))?;
                    stream.set_write_timeout(Some(timeout))?;
                    return Ok(Connection { stream, early: Vec::new() });
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Sends a whole request head (no body).
    pub fn send(&mut self, request: &[u8]) -> io::Result<()> {
        self.stream.write_all(request)
    }

    /// Reads the next response's head; the body's first bytes, read with
    /// it, are kept for the body.
    pub fn read_head(&mut self, waiter: &Waiter<'_>) -> io::Result<Head> {
        let mut buf = vec![0u8; 8 << 10];
        let mut filled = 0;
        loop {
            if filled == buf.len() {
                if buf.len() >= MAX_HEAD {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "response head too long"));
                }
                buf.resize(buf.len() * 2, 0);
            }
            let n = waiter.read(|| self.stream.read(&mut buf[filled..]))?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection before a response",
                ));
            }
            filled += n;
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(&buf[..filled]) {
                Ok(httparse::Status::Complete(len)) => {
                    let head = Head {
                        status: response.code.unwrap_or(0),
                        headers: response
                            .headers
                            .iter()
                            .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                            .collect(),
                    };
                    self.early = buf[len..filled].to_vec();
                    return Ok(head);
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad response head: {e}")))
                }
            }
        }
    }

    /// Receives a body of exactly `range.len()` bytes into `range` of
    /// `dst`: the bytes read with the head are copied, the rest read from
    /// the socket into place. A body that ends early is `UnexpectedEof`.
    pub fn read_body_into(
        &mut self,
        dst: MappingWriter<'_>,
        range: Range<usize>,
        waiter: &Waiter<'_>,
    ) -> io::Result<()> {
        let early = std::mem::take(&mut self.early);
        if early.len() > range.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "more bytes than the body's length"));
        }
        dst.copy_in(range.start, &early);
        let mut at = range.start + early.len();
        while at < range.end {
            let n = waiter.read(|| dst.read_stream(self.stream.as_fd(), at..range.end))?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the body ended after {} of {} bytes", at - range.start, range.len()),
                ));
            }
            at += n;
        }
        Ok(())
    }

    /// Reads a body of `len` bytes (at most [`MAX_ERROR_BODY`]) into a Vec.
    pub fn read_body(&mut self, len: usize, waiter: &Waiter<'_>) -> io::Result<Vec<u8>> {
        let mut body = std::mem::take(&mut self.early);
        body.truncate(len);
        let start = body.len();
        body.resize(len.min(MAX_ERROR_BODY), 0);
        let mut at = start;
        while at < body.len() {
            let n = waiter.read(|| self.stream.read(&mut body[at..]))?;
            if n == 0 {
                break;
            }
            at += n;
        }
        body.truncate(at);
        Ok(body)
    }
}
