//! A loaded buffer handed to another process over a [`Connection`]: its
//! memfd, sealed, and where the bytes are in it, in one message; the
//! receiver maps the same pages private copy-on-write. The cache service
//! hands out its files the same way.

use std::path::Path;

use super::protocol;
use super::Connection;
use crate::buffer::Buffer;
use crate::error::{Error, Result};

/// The name errors give the socket a buffer crosses.
const SOCKET: &str = "socket";

impl Buffer {
    /// Sends this buffer over `conn` to the process at the other end, which
    /// takes it with [`Buffer::receive`]: the memfd (sealed first, see
    /// [`Buffer::memfd`]) and where the bytes are in it, in one message.
    /// No byte is copied; the receiver maps the same pages privately. Needs
    /// memfd memory; fails as [`Buffer::memfd`] does where the memfd cannot
    /// be sealed against writes.
    pub fn send(&self, conn: &Connection) -> Result<()> {
        let socket = Path::new(SOCKET);
        let (fd, data) = self.sealed_for_sending("send buffer", socket)?;
        let message = protocol::encode(&protocol::Reply::Buffer(protocol::BufferInfo {
            offset: data.start as u64,
            len: data.len() as u64,
            served: None,
            note: None,
        }));
        conn.send(&message, &[fd]).map_err(|e| Error::io("send buffer", socket, e))
    }

    /// Receives a buffer that the process at the other end of `conn` sent
    /// with [`Buffer::send`] (or the cache service handed out). The message
    /// is untrusted: it must carry exactly one memfd sealed as
    /// [`Buffer::memfd`] seals it, `F_SEAL_WRITE` included, whose size
    /// covers the byte range it names, else it is refused and the
    /// descriptor closed. The memfd is mapped private copy-on-write: writes
    /// to the buffer stay in this process.
    ///
    /// The promise behind the safe `&[u8]`: the kernel adds `F_SEAL_WRITE`
    /// only when no writable shared mapping of the memfd exists anywhere and
    /// no page is pinned, and allows none after, so no process (the sender
    /// included) can change the bytes this buffer shows. A memfd sealed only
    /// `F_SEAL_FUTURE_WRITE` (whose sender may still hold a writable mapping)
    /// is refused. Every dmaload sender (this `send`, Python's `send()`,
    /// the C library's and the CLI's, the cache service) seals so.
    pub fn receive(conn: &Connection) -> Result<Buffer> {
        let socket = Path::new(SOCKET);
        let (info, memfd) = protocol::receive_buffer(conn, socket)?;
        Buffer::from_sealed_memfd(memfd, info.offset, info.len, socket)
    }
}
