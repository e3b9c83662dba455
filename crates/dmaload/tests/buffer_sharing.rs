//! What a buffer hands out is what it shows: a real `fork` gives the child
//! its own copy, and a memfd that no longer holds the bytes the buffer
//! shows (a private mapping written in place) is never handed out, by any
//! path (`memfd`, `send`, `into_memfd`, `into_dmabuf`).

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use dmaload::share::Connection;
use dmaload::{Buffer, ErrorKind, LoadOptions, MemoryKind};

const LEN: u64 = 3 * 1024 * 1024 + 5;

/// Held by every test of this file: a fork copies every mapping the
/// process has, so a buffer another test is still loading (shared, not yet
/// registered to turn private) would reach the child as a writable shared
/// mapping, and the kernel would refuse that buffer's `F_SEAL_WRITE` until
/// the child exits.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn loaded(dir: &tempfile::TempDir) -> Buffer {
    let path = dir.path().join("f");
    write_pattern_file(&path, LEN);
    dmaload::load(&path, &LoadOptions { to: MemoryKind::Memfd.into(), ..LoadOptions::default() }).unwrap().0
}

/// The bytes the memfd a buffer hands out holds at its data's place.
fn memfd_bytes(buffer: &Buffer) -> Vec<u8> {
    let fd = buffer.memfd().unwrap().unwrap().try_clone_to_owned().unwrap();
    let mut bytes = vec![0u8; buffer.len()];
    std::fs::File::from(fd).read_exact_at(&mut bytes, buffer.memfd_offset() as u64).unwrap();
    bytes
}

/// Every way out of `buffer` refuses: the memfd no longer holds its bytes.
fn assert_every_way_out_refused(buffer: Buffer) {
    let refused = |err: &dmaload::Error| {
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("no longer holds the bytes"), "{err}");
    };
    refused(&buffer.memfd().unwrap_err());
    let (a, _b) = Connection::pair().unwrap();
    refused(&buffer.send(&a).unwrap_err());
    let shown = buffer.to_vec();
    let (err, buffer) = *buffer.into_memfd().unwrap_err();
    refused(&err);
    assert!(buffer[..] == shown[..]);
    // udmabuf refuses a sealed memfd anyway; the check comes first for an unsealed one.
    let (err, buffer) = *buffer.into_dmabuf().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(buffer[..] == shown[..]);
}

#[test]
fn a_buffer_written_after_its_memfd_went_out_does_not_hand_it_out_again() {
    let _serial = one_at_a_time();
    let dir = scratch_dir();
    let mut buffer = loaded(&dir);
    assert!(memfd_bytes(&buffer) == buffer[..]);
    buffer[7] ^= 0xFF;
    assert_every_way_out_refused(buffer);
}

#[test]
fn a_received_buffer_written_in_place_is_not_passed_on_with_the_senders_bytes() {
    let _serial = one_at_a_time();
    let dir = scratch_dir();
    let buffer = loaded(&dir);
    let (a, b) = Connection::pair().unwrap();
    buffer.send(&a).unwrap();
    let mut received = Buffer::receive(&b).unwrap();
    assert!(received[..] == buffer[..]);
    // Untouched, it passes on.
    received.send(&b).unwrap();
    assert!(Buffer::receive(&a).unwrap()[..] == buffer[..]);
    received[LEN as usize - 1] ^= 0xFF;
    assert_every_way_out_refused(received);
}

/// Forks; the child runs `child` (async-signal-safe work only: the test
/// harness has other threads) and `_exit`s with its result. Returns the
/// child's pid.
fn fork(child: impl FnOnce() -> i32) -> libc::pid_t {
    // SAFETY: the child only runs `child`, which touches memory and
    // sockets and makes no allocation or lock, then `_exit`s without
    // unwinding.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = child();
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    pid
}

fn exit_status(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: waits for our own child; `status` outlives the call.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child died: {status:#x}");
    libc::WEXITSTATUS(status)
}

#[test]
fn a_forked_child_and_its_parent_each_write_their_own_copy() {
    let _serial = one_at_a_time();
    let dir = scratch_dir();
    let mut buffer = loaded(&dir);
    let (child_end, parent_end) = std::os::unix::net::UnixStream::pair().unwrap();
    let pid = fork(|| {
        buffer.iter_mut().for_each(|b| *b = 0xAA);
        // Tells the parent it wrote, then waits for the parent's writes.
        let mut byte = [1u8];
        let fd = std::os::fd::AsRawFd::as_raw_fd(&child_end);
        // SAFETY: one byte to a socket this process owns, from a live buffer.
        let sent = unsafe { libc::write(fd, byte.as_ptr().cast(), 1) };
        // SAFETY: one byte from that socket into a live buffer.
        let got = unsafe { libc::read(fd, byte.as_mut_ptr().cast(), 1) };
        if (sent, got) != (1, 1) {
            return 2;
        }
        i32::from(!buffer.iter().all(|&b| b == 0xAA))
    });
    let mut byte = [0u8];
    std::io::Read::read_exact(&mut &parent_end, &mut byte).unwrap();
    // The child wrote every byte: none of it reached this process.
    assert_pattern(&buffer, 0);
    // Untouched since the fork, the memfd holds what the buffer shows.
    assert!(memfd_bytes(&buffer) == buffer[..]);
    buffer.iter_mut().for_each(|b| *b = 0x11);
    std::io::Write::write_all(&mut &parent_end, &byte).unwrap();
    assert_eq!(exit_status(pid), 0, "this process's writes after the fork reached the child");
    assert_every_way_out_refused(buffer);
}
