//! One kept-alive HTTP/1.1 connection, plain or over TLS: a request out,
//! the response's head parsed by `httparse`, and its body received into the
//! memory it belongs to, or, for an error's small XML body, into a `Vec`.
//! Plain HTTP reads the body straight into place (`read(2)` into the
//! destination range: no buffer between), each read waiting for a MiB of
//! it (`SO_RCVLOWAT`) rather than waking per segment; TLS records are decrypted by
//! `rustls` in user space, and their plaintext copied into place from its
//! queue.

use std::fmt;
use std::io::{self, BufRead, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rustls::ClientConnection;

use super::proxy::Proxy;
use super::tls::Tls;
use crate::sys;
use crate::sys::mem::MappingWriter;

/// How often a blocked read looks at the cancellation and the stall clock.
const POLL: Duration = Duration::from_millis(50);
/// Largest response head taken.
const MAX_HEAD: usize = 64 << 10;
/// Largest error body read.
pub const MAX_ERROR_BODY: usize = 64 << 10;
/// Bytes a blocked read of a plain body waits for before it wakes (half
/// what is left where that is less): one wakeup and one `read(2)` per MiB
/// instead of one per few segments. On a 1 GiB loopback GET load this
/// took the client from about 14,000 reads and context switches to 1,100
/// reads and 5,000 switches, and its CPU per GiB down by about a quarter
/// (docs/benchmarks.md, "Objects from S3").
const BODY_LOW_WATER: usize = 1 << 20;

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

/// A connection refused for a reason another attempt would meet again (a
/// TLS certificate that does not verify, no protocol in common, a proxy's
/// 4xx to the tunnel): the load's error, never retried.
#[derive(Debug)]
pub struct HandshakeRefused(String);

impl fmt::Display for HandshakeRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HandshakeRefused {}

impl HandshakeRefused {
    /// Whether `err` is one.
    pub fn is(err: &io::Error) -> bool {
        err.get_ref().is_some_and(|inner| inner.is::<HandshakeRefused>())
    }
}

/// A connection to one host, used for one request at a time.
pub struct Connection {
    stream: TcpStream,
    /// The TLS session of an `https://` endpoint; `None` on plain HTTP.
    tls: Option<Box<ClientConnection>>,
    /// Bytes read past the head of the response being read: its body's start.
    early: Vec<u8>,
    /// The socket's `SO_RCVLOWAT` now (1, the kernel's default, at first).
    low_water: usize,
}

impl Connection {
    /// Connects to `host:port`, through a `CONNECT` tunnel of `proxy` when
    /// one is given, and with `tls` makes the TLS handshake (waiting as
    /// `waiter` says). A handshake the server fails, or a tunnel the proxy
    /// refuses with a 4xx, is [`HandshakeRefused`].
    pub fn open(
        host: &str,
        port: u16,
        timeout: Duration,
        tls: Option<&Tls>,
        proxy: Option<&Proxy>,
        waiter: &Waiter<'_>,
    ) -> io::Result<Connection> {
        let (to_host, to_port) = proxy.map_or((host, port), |p| (p.host.as_str(), p.port));
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{to_host} has no address"));
        for addr in (to_host.trim_start_matches('[').trim_end_matches(']'), to_port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    stream.set_read_timeout(Some(POLL))?;
                    stream.set_write_timeout(Some(timeout))?;
                    let mut conn = Connection { stream, tls: None, early: Vec::new(), low_water: 1 };
                    if let Some(proxy) = proxy {
                        conn.send(proxy.connect_request(host, port).as_bytes())?;
                        let status = conn.read_head(waiter)?.status;
                        if !(200..300).contains(&status) || !conn.early.is_empty() {
                            let why = proxy.refusal(host, port, status);
                            return Err(match Proxy::refuses_for_good(status) {
                                true => refused(why),
                                false => io::Error::new(io::ErrorKind::ConnectionRefused, why),
                            });
                        }
                    }
                    if let Some(tls) = tls {
                        let session = tls.session(host).map_err(|e| refused(tls.refusal(host, port, &e)))?;
                        conn.tls = Some(Box::new(session));
                        conn.handshake(tls, host, port, waiter)?;
                    }
                    return Ok(conn);
                }
                Err(e) => last = e,
            }
        }
        Err(match proxy {
            Some(proxy) => io::Error::new(last.kind(), format!("{}: {last}", proxy.shown())),
            None => last,
        })
    }

    /// Runs the TLS handshake to its end. A failure rustls finds (the
    /// certificate, the protocol) is sent to the server as an alert and
    /// returned as [`HandshakeRefused`]; a socket's failure stays itself.
    fn handshake(&mut self, tls: &Tls, host: &str, port: u16, waiter: &Waiter<'_>) -> io::Result<()> {
        let Some(session) = self.tls.as_deref_mut() else { return Ok(()) };
        while session.is_handshaking() {
            while session.wants_write() {
                session.write_tls(&mut self.stream)?;
            }
            if !session.is_handshaking() {
                break;
            }
            let n = waiter.read(|| session.read_tls(&mut self.stream))?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection during the TLS handshake",
                ));
            }
            if let Err(e) = session.process_new_packets() {
                // The alert saying why; the connection is dropped either way.
                let _ = session.write_tls(&mut self.stream);
                return Err(refused(tls.refusal(host, port, &e)));
            }
        }
        Ok(())
    }

    /// Sends a whole request head (no body).
    pub fn send(&mut self, request: &[u8]) -> io::Result<()> {
        match self.tls.as_deref_mut() {
            None => self.stream.write_all(request),
            Some(session) => {
                session.writer().write_all(request)?;
                while session.wants_write() {
                    session.write_tls(&mut self.stream)?;
                }
                Ok(())
            }
        }
    }

    /// One read of the response's bytes into `buf`: 0 at the end of the
    /// stream; `WouldBlock` while none came within [`POLL`].
    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.tls.as_deref_mut() {
            None => self.stream.read(buf),
            Some(session) => plaintext(session, &mut self.stream, |chunk| {
                let n = chunk.len().min(buf.len());
                buf[..n].copy_from_slice(&chunk[..n]);
                n
            }),
        }
    }

    /// Makes a blocking read of the plain socket wait for `bytes` (see
    /// [`sys::socket::set_receive_low_water`]), where it waits for another
    /// count now. TLS reads keep the default: rustls reads a record's worth.
    fn wait_for(&mut self, bytes: usize) -> io::Result<()> {
        if self.tls.is_none() && bytes != self.low_water {
            sys::socket::set_receive_low_water(self.stream.as_fd(), bytes)?;
            self.low_water = bytes;
        }
        Ok(())
    }

    /// Reads the next response's head; the body's first bytes, read with
    /// it, are kept for the body.
    pub fn read_head(&mut self, waiter: &Waiter<'_>) -> io::Result<Head> {
        self.wait_for(1)?;
        let mut buf = vec![0u8; 8 << 10];
        let mut filled = 0;
        loop {
            if filled == buf.len() {
                if buf.len() >= MAX_HEAD {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "response head too long"));
                }
                buf.resize(buf.len() * 2, 0);
            }
            let n = waiter.read(|| self.read_some(&mut buf[filled..]))?;
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
    /// the socket into place (plain HTTP) or copied into place as rustls
    /// decrypts them (TLS). A body that ends early is `UnexpectedEof`.
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
            // At most half of what is left: the kernel wakes a reader when
            // the mark's bytes are queued, not counting those it already
            // took, so a mark above half the rest could wait for bytes that
            // never come (until the read's timeout) at a body's end.
            self.wait_for(((range.end - at) / 2).clamp(1, BODY_LOW_WATER))?;
            let n = waiter.read(|| match self.tls.as_deref_mut() {
                None => dst.read_stream(self.stream.as_fd(), at..range.end),
                Some(session) => plaintext(session, &mut self.stream, |chunk| {
                    let n = chunk.len().min(range.end - at);
                    dst.copy_in(at, &chunk[..n]);
                    n
                }),
            })?;
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
        self.wait_for(1)?;
        let mut body = std::mem::take(&mut self.early);
        body.truncate(len);
        let start = body.len();
        body.resize(len.min(MAX_ERROR_BODY), 0);
        let mut at = start;
        while at < body.len() {
            let n = waiter.read(|| self.read_some(&mut body[at..]))?;
            if n == 0 {
                break;
            }
            at += n;
        }
        body.truncate(at);
        Ok(body)
    }
}

fn refused(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, HandshakeRefused(why))
}

/// Hands the session's next decrypted bytes to `take`, which returns how
/// many it used, after reading and decrypting records from `stream` until
/// some are there. Ok(0) at the end of the stream, with or without the
/// server's `close_notify`: the body's length, not the close, says whether
/// all of it came. `WouldBlock` when the socket had nothing within
/// [`POLL`]: the part of a record read so far stays in the session, so a
/// read that is tried again loses nothing.
fn plaintext(
    session: &mut ClientConnection,
    stream: &mut TcpStream,
    take: impl FnOnce(&[u8]) -> usize,
) -> io::Result<usize> {
    loop {
        match session.reader().into_first_chunk() {
            Ok([]) => return Ok(0),
            Ok(chunk) => {
                let n = take(chunk);
                session.reader().consume(n);
                return Ok(n);
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        // At the socket's end rustls notes it, and the reader says so above.
        session.read_tls(stream)?;
        session
            .process_new_packets()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}")))?;
        // What the server's messages ask back (a key update's answer).
        while session.wants_write() {
            session.write_tls(stream)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;

    /// This thread's voluntary context switches so far: one per time it
    /// blocked and was woken.
    fn wakeups() -> u64 {
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn a_body_that_trickles_in_wakes_its_reader_per_low_water_mark_not_per_segment() {
        const PIECES: usize = 128;
        const PIECE: usize = 16 << 10;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let body: Vec<u8> = (0..PIECES * PIECE).map(|i| (i % 251) as u8).collect();
        let sent = body.clone();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream.set_nodelay(true).unwrap();
            write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", sent.len()).unwrap();
            // Each piece its own segment, each arriving while the reader sleeps.
            for piece in sent.chunks(PIECE) {
                stream.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
            // A second response on the kept-alive connection: its small
            // head must not wait for the body's mark.
            stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").unwrap();
            stream
        });
        let never = || false;
        let waiter = Waiter { stopped: &never, stall: Duration::from_secs(30) };
        let mut conn =
            Connection::open("127.0.0.1", port, Duration::from_secs(30), None, None, &waiter).unwrap();
        let head = conn.read_head(&waiter).unwrap();
        assert_eq!(head.content_length(), Some(body.len() as u64));
        let mut got = vec![0u8; body.len()];
        let before = wakeups();
        conn.read_body_into(MappingWriter::over(&mut got), 0..body.len(), &waiter).unwrap();
        let woken = wakeups() - before;
        assert!(got == body, "the body arrived intact");
        // One wake per MiB and one per read timeout (POLL) at most, where
        // a reader woken per segment wakes about once per piece.
        assert!(woken < (PIECES / 4) as u64, "the reader woke {woken} times for {PIECES} segments");
        let head = conn.read_head(&waiter).unwrap();
        assert_eq!(head.status, 200);
        assert_eq!(conn.read_body(5, &waiter).unwrap(), b"hello");
        drop(server.join().unwrap());
    }
}
