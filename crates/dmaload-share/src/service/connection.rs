//! One client's connection: the peer check, each request read and
//! answered (with an acknowledgement and keepalives while a load runs),
//! and the per-user count of connections.

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dmaload::error::{Error, ErrorKind};
use dmaload::share::protocol::{self, BufferInfo, Reply, Request, Served, WireError, MAX_REQUEST_BYTES};
use dmaload::share::Connection;
use dmaload::sys_share::HUGE_PAGE_ALIGN;

use super::*;

/// One client's connection: the credentials check, then requests until it
/// hangs up, stays silent for the idle timeout or breaks the protocol.
pub(super) fn serve_client(state: &State, conn: Connection) {
    let peer = match conn.peer_credentials() {
        Ok(peer) => peer,
        Err(err) => return state.log(&format!("client without credentials: {err}")),
    };
    let who = format!("pid {} uid {}", peer.pid, peer.uid);
    let _ = conn.set_timeouts(Some(state.config.idle_timeout));
    // A refusal answers the client's first request: closing with that
    // request unread would reset the connection, and the client would
    // never learn why.
    let refuse = |message: String| {
        state.log(&format!("{who}: refused: {message}"));
        drop(conn.recv(&mut [0u8; MAX_REQUEST_BYTES]));
        let err = Error::new(ErrorKind::InvalidInput, "connect", &state.config.socket, message);
        let reply = protocol::encode(&Reply::Error(WireError::from_error(&err)));
        let _ = conn.send(&reply, &[]);
    };
    if !state.allowed(&peer) {
        lock(&state.cache).counters.refused += 1;
        return refuse(format!(
            "uid {} (gid {}) is not served: only uid {} and root, and those --allow-uid/--allow-gid name",
            peer.uid, peer.gid, state.own_uid
        ));
    }
    let _counted = match ClientCount::enter(state, peer.uid) {
        Ok(counted) => counted,
        Err(why) => return refuse(why),
    };
    let mut buf = vec![0u8; MAX_REQUEST_BYTES];
    loop {
        let (len, mut fds) = match conn.recv(&mut buf) {
            Ok((0, fds)) if fds.is_empty() => break,
            Ok(message) => message,
            Err(err) if err.kind() == io::ErrorKind::InvalidData => {
                // Too long, or too many descriptors: refused whole.
                if !reply_error(state, &conn, &who, &Error::io("request", &state.config.socket, err)) {
                    break;
                }
                continue;
            }
            Err(err) => {
                if err.kind() != io::ErrorKind::WouldBlock {
                    state.log(&format!("{who}: connection lost: {err}"));
                }
                break;
            }
        };
        let started = Instant::now();
        let request = protocol::decode_message(&buf[..len]);
        let sent = match (request, fds.len()) {
            (Ok(protocol::Message { request: Request::ToDevice, device: Some(target), object }), count)
                if count == usize::from(object.is_none()) =>
            {
                if conn.send(&protocol::encode(&Reply::Accepted), &[]).is_err() {
                    break;
                }
                let copied = with_keepalives(&conn, &state.loaded, || {
                    let handoff = match &object {
                        Some(grant) => state.get_object(grant, peer.uid)?,
                        None => state.get(fds.remove(0), peer.uid)?,
                    };
                    state.copy_to_device(&handoff.loaded, &target, peer.uid).map(|()| handoff)
                });
                match copied {
                    Ok(Handoff { loaded, served, turn, .. }) => {
                        let reply = protocol::encode(&Reply::Copied { len: loaded.len, served });
                        let sent = conn.send(&reply, &[]);
                        state.log(&format!(
                            "{who}: to cuda:{} {} ({} bytes): {} in {:.1} ms{}",
                            target.ordinal,
                            loaded.path.display(),
                            loaded.len,
                            served.name(),
                            started.elapsed().as_secs_f64() * 1e3,
                            gone(&sent)
                        ));
                        drop(loaded);
                        drop(turn);
                        sent.is_ok()
                    }
                    Err(err) => reply_error(state, &conn, &who, &err),
                }
            }
            (Ok(protocol::Message { request: Request::Get, .. }), 1) => {
                let fd = fds.remove(0);
                if conn.send(&protocol::encode(&Reply::Accepted), &[]).is_err() {
                    break;
                }
                let handoff = with_keepalives(&conn, &state.loaded, || state.get(fd, peer.uid));
                reply_buffer(state, &conn, &who, "get", started, handoff)
            }
            (Ok(protocol::Message { request: Request::GetObject, object: Some(grant), .. }), 0) => {
                if conn.send(&protocol::encode(&Reply::Accepted), &[]).is_err() {
                    break;
                }
                let handoff = with_keepalives(&conn, &state.loaded, || state.get_object(&grant, peer.uid));
                reply_buffer(state, &conn, &who, "get-object", started, handoff)
            }
            (Ok(protocol::Message { request: Request::Status, .. }), 0) => {
                state.log(&format!("{who}: status"));
                let viewer = (peer.uid != state.own_uid && peer.uid != 0).then_some(peer.uid);
                let mut status = state.status(viewer);
                let mut reply = protocol::encode(&Reply::Status(status.clone()));
                // Long paths could make the list outgrow what a client takes.
                while reply.len() > protocol::MAX_REPLY_BYTES && status.files.pop().is_some() {
                    reply = protocol::encode(&Reply::Status(status.clone()));
                }
                conn.send(&reply, &[]).is_ok()
            }
            (Ok(protocol::Message { request, .. }), count) => reply_error(
                state,
                &conn,
                &who,
                &Error::new(
                    ErrorKind::InvalidInput,
                    "request",
                    &state.config.socket,
                    format!(
                        "{request:?} carried {count} descriptors (get and to-device: 1, status, get-object \
                         and to-device of an object: 0)"
                    ),
                ),
            ),
            (Err(err), _) => {
                reply_error(state, &conn, &who, &Error::io("request", &state.config.socket, err))
            }
        };
        drop(fds);
        if !sent {
            break;
        }
    }
}

/// Sends the client the buffer `handoff` holds (or its error), logging
/// the request (`op`) and how it was served; whether the client is still
/// there.
fn reply_buffer(
    state: &State,
    conn: &Connection,
    who: &str,
    op: &str,
    started: Instant,
    handoff: std::result::Result<Handoff<'_>, Error>,
) -> bool {
    let Handoff { loaded, served, note, turn } = match handoff {
        Ok(handoff) => handoff,
        Err(err) => return reply_error(state, conn, who, &err),
    };
    let info =
        BufferInfo { offset: loaded.offset, len: loaded.len, served: Some(served), note: note.clone() };
    let reply = protocol::encode(&Reply::Buffer(info));
    // A file just cached in 4 KiB pages is collapsed once its first client
    // has it, not in its way (the status says so from before the reply).
    let collapse = served == Served::Miss && state.collapse && loaded.bytes >= HUGE_PAGE_ALIGN as u64;
    if collapse {
        *lock(&loaded.pages) = COLLAPSING.into();
    }
    let sent = conn.send(&reply, &[loaded.memfd.as_fd()]);
    if collapse {
        loaded.collapse_in_background(Arc::clone(&state.config.log));
    }
    state.log(&format!(
        "{who}: {op} {} ({} bytes): {} in {:.1} ms{}{}",
        loaded.path.display(),
        loaded.len,
        served.name(),
        started.elapsed().as_secs_f64() * 1e3,
        note.map(|n| format!(" ({n})")).unwrap_or_default(),
        gone(&sent)
    ));
    // An uncached file's last reference here goes before its turn does.
    drop(loaded);
    drop(turn);
    sent.is_ok()
}

/// What a request's log line adds when its reply could not be sent.
fn gone(sent: &io::Result<()>) -> String {
    match sent {
        Ok(()) => String::new(),
        Err(err) => format!("; the client is gone: {err}"),
    }
}

/// Runs `work` while a thread of its own tells the client, every
/// [`protocol::KEEPALIVE_INTERVAL`], that its request is still being worked
/// on, and how many bytes the service's loads have read (`loaded`): a
/// client hears from a live service however long the load takes, one that
/// hears nothing for [`protocol::KEEPALIVE_TIMEOUT`] knows the service is
/// stopped or stuck, and one that sees `loaded` stand still for
/// [`protocol::STALL_TIMEOUT`] knows its loads are. The thread has stopped when this returns,
/// so the reply that follows is the last message.
pub(super) fn with_keepalives<T>(conn: &Connection, loaded: &AtomicU64, work: impl FnOnce() -> T) -> T {
    let (done, finished) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let keepalive =
            std::thread::Builder::new().name("dmaload-keepalive".into()).spawn_scoped(scope, move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    finished.recv_timeout(protocol::KEEPALIVE_INTERVAL)
                {
                    let working = Reply::Working { loaded: loaded.load(Ordering::Relaxed) };
                    if conn.send(&protocol::encode(&working), &[]).is_err() {
                        break;
                    }
                }
            });
        // Without a thread the client hears nothing until the reply, and
        // falls back if the load outlasts its patience: nothing worse.
        let outcome = work();
        drop(done);
        drop(keepalive);
        outcome
    })
}

/// Counts a connected client, in all and for its uid, for as long as it
/// lives, even if serving it panics.
pub(super) struct ClientCount<'a> {
    state: &'a State,
    uid: u32,
}

impl<'a> ClientCount<'a> {
    /// Counts the client in, or says which limit it would pass
    /// ([`MAX_CLIENTS`], [`MAX_CLIENTS_PER_UID`]).
    fn enter(state: &'a State, uid: u32) -> std::result::Result<ClientCount<'a>, String> {
        let mut per_uid = lock(&state.clients_per_uid);
        let mine = per_uid.entry(uid).or_insert(0);
        if *mine >= MAX_CLIENTS_PER_UID {
            return Err(format!(
                "uid {uid} has {MAX_CLIENTS_PER_UID} connections already, as many as one user may hold"
            ));
        }
        if state.clients.load(Ordering::Acquire) >= MAX_CLIENTS {
            return Err(format!("{MAX_CLIENTS} clients are connected already"));
        }
        *mine += 1;
        state.clients.fetch_add(1, Ordering::AcqRel);
        Ok(ClientCount { state, uid })
    }
}

impl Drop for ClientCount<'_> {
    fn drop(&mut self) {
        let mut per_uid = lock(&self.state.clients_per_uid);
        if let Some(count) = per_uid.get_mut(&self.uid) {
            *count -= 1;
            if *count == 0 {
                per_uid.remove(&self.uid);
            }
        }
        self.state.clients.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Sends `err` to the client and logs it; false when the client is gone.
pub(super) fn reply_error(state: &State, conn: &Connection, who: &str, err: &Error) -> bool {
    lock(&state.cache).counters.errors += 1;
    state.log(&format!("{who}: error: {err}"));
    let reply = protocol::encode(&Reply::Error(WireError::from_error(err)));
    conn.send(&reply, &[]).is_ok()
}
