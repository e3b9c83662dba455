//! The socket layer of `dmaload::share`: descriptors and credentials cross
//! a real socket between two real processes; messages stay whole; whatever
//! a hostile peer sends (too long, too many descriptors, nothing) is refused
//! with an error, never half-taken.

mod common;

use std::fs::File;
use std::io::{ErrorKind, Read, Seek, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::Command;
use std::time::{Duration, Instant};

use common::scratch_dir;
use dmaload::share::{Connection, Listener, MAX_FDS_PER_MESSAGE};

const CHILD_SOCKET: &str = "DMALOAD_SHARE_TEST_SOCKET";

/// Not a test of its own: the child process of
/// `descriptors_and_credentials_cross_processes`, run when the parent sets
/// `CHILD_SOCKET`.
#[test]
fn child_process_role() {
    let Ok(path) = std::env::var(CHILD_SOCKET) else { return };
    let conn = Connection::connect(path.as_ref()).unwrap();
    let peer = conn.peer_credentials().unwrap();
    assert_eq!(peer.pid, std::os::unix::process::parent_id(), "the listener is the parent");
    let mut buf = [0u8; 64];
    let (len, fds) = conn.recv(&mut buf).unwrap();
    assert_eq!(&buf[..len], b"file");
    let [fd]: [OwnedFd; 1] = fds.try_into().unwrap();
    let mut text = String::new();
    let mut file = File::from(fd);
    file.rewind().unwrap();
    file.read_to_string(&mut text).unwrap();
    conn.send(text.as_bytes(), &[]).unwrap();
}

#[test]
fn descriptors_and_credentials_cross_processes() {
    let dir = scratch_dir();
    let socket = dir.path().join("s");
    let listener = Listener::bind(&socket, 4).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_process_role", "--nocapture", "--test-threads=1"])
        .env(CHILD_SOCKET, &socket)
        .spawn()
        .unwrap();
    let conn = listener.accept().unwrap();
    conn.set_timeouts(Some(Duration::from_secs(60))).unwrap();
    assert_eq!(conn.peer_credentials().unwrap().pid, child.id());
    // A file this process creates is owned by its effective uid.
    let own_uid = std::fs::metadata(dir.path()).unwrap().uid();
    assert_eq!(conn.peer_credentials().unwrap().uid, own_uid);

    // An unlinked file: the child can only reach it through the descriptor.
    let path = dir.path().join("payload");
    let mut file = File::options().read(true).write(true).create_new(true).open(&path).unwrap();
    file.write_all(b"bytes only the descriptor reaches").unwrap();
    std::fs::remove_file(&path).unwrap();
    conn.send(b"file", &[file.as_fd()]).unwrap();
    let mut buf = [0u8; 64];
    let (len, fds) = conn.recv(&mut buf).unwrap();
    assert!(fds.is_empty());
    assert_eq!(&buf[..len], b"bytes only the descriptor reaches");
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_listener_socket_is_private_to_its_user_from_the_moment_it_exists() {
    // Set before bind(2), not by a chmod after it, which would leave a
    // moment when whatever the umask allows (0755 under 022, 0777 under
    // 0) may connect: only the mode bind gave can be checked here.
    let dir = scratch_dir();
    let socket = dir.path().join("s");
    let _listener = Listener::bind(&socket, 1).unwrap();
    let mode = std::fs::symlink_metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "socket mode {:o}: others may connect", mode & 0o777);
}

#[test]
fn hostile_messages_are_refused_whole() {
    let (a, b) = Connection::pair().unwrap();
    let dir = scratch_dir();
    let file = File::create(dir.path().join("f")).unwrap();

    // Longer than the receiver allows: refused, and its descriptor closed.
    a.send(&[7u8; 100], &[file.as_fd()]).unwrap();
    let err = b.recv(&mut [0u8; 10]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");

    // More descriptors than a message may carry: refused before sending.
    let many: Vec<_> = (0..=MAX_FDS_PER_MESSAGE).map(|_| file.as_fd()).collect();
    assert_eq!(a.send(b"x", &many).unwrap_err().kind(), ErrorKind::InvalidInput);
    a.send(b"ok", &many[..MAX_FDS_PER_MESSAGE]).unwrap();
    let (len, fds) = b.recv(&mut [0u8; 10]).unwrap();
    assert_eq!((len, fds.len()), (2, MAX_FDS_PER_MESSAGE));

    // Nothing to read: the timeout bounds the wait.
    b.set_timeouts(Some(Duration::from_millis(50))).unwrap();
    let started = Instant::now();
    assert_eq!(b.recv(&mut [0u8; 10]).unwrap_err().kind(), ErrorKind::WouldBlock);
    assert!(started.elapsed() < Duration::from_secs(30));

    // The peer hung up: an empty message without descriptors.
    drop(a);
    let (len, fds) = b.recv(&mut [0u8; 10]).unwrap();
    assert_eq!((len, fds.len()), (0, 0));
    assert_eq!(b.send(b"x", &[]).unwrap_err().raw_os_error(), Some(libc::EPIPE));
}

#[test]
fn only_seqpacket_unix_sockets_and_short_paths_are_taken() {
    let dir = scratch_dir();
    let file = File::create(dir.path().join("f")).unwrap();
    assert_eq!(Connection::from_fd(file.into()).unwrap_err().kind(), ErrorKind::InvalidInput);
    let (stream, _other) = std::os::unix::net::UnixStream::pair().unwrap();
    assert_eq!(Connection::from_fd(stream.into()).unwrap_err().kind(), ErrorKind::InvalidInput);
    let (seqpacket, _other) = Connection::pair().unwrap();
    Connection::from_fd(seqpacket.into()).unwrap();

    let long = dir.path().join("x".repeat(120));
    assert_eq!(Listener::bind(&long, 1).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(Connection::connect(&dir.path().join("absent")).unwrap_err().kind(), ErrorKind::NotFound);
}
