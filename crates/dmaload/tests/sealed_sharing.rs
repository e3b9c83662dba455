//! A buffer crosses to another process only as a memfd no one can write
//! any more (`F_SEAL_WRITE`): `Buffer::receive` refuses one sealed only
//! `F_SEAL_FUTURE_WRITE` by a sender that kept a writable shared mapping,
//! and a sender whose memfd another process still maps writable gets an
//! error (EBUSY, with why) instead of handing the bytes out.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};

use common::{assert_pattern, scratch_dir, write_pattern_file};
use dmaload::share::protocol::{self, BufferInfo, Reply};
use dmaload::share::{Connection, Listener};
use dmaload::{Buffer, ErrorKind, LoadOptions};

const ROLE: &str = "DMALOAD_SEALED_SHARING_ROLE";
const ARG: &str = "DMALOAD_SEALED_SHARING_ARG";
const PAGE: usize = 4096;

/// Not a test of its own: the other process of the tests below, run when
/// `ROLE` is set.
#[test]
fn child_process_role() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let arg = std::env::var(ARG).unwrap();
    match role.as_str() {
        // Sends a memfd it keeps mapped writable and shared, sealed only
        // F_SEAL_FUTURE_WRITE (the kernel refuses it F_SEAL_WRITE), then
        // writes through that mapping once the receiver has answered.
        "forger" => {
            let conn = Connection::connect(Path::new(&arg)).unwrap();
            // SAFETY: memfd_create with a static name.
            let fd = unsafe { libc::memfd_create(c"forged".as_ptr(), libc::MFD_ALLOW_SEALING) };
            assert!(fd >= 0, "{}", std::io::Error::last_os_error());
            // SAFETY: the fd was just created and is owned here only.
            let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
            std::fs::File::from(memfd.try_clone().unwrap()).set_len(PAGE as u64).unwrap();
            // SAFETY: a fresh shared mapping of a memfd of one page.
            let map = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    PAGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            assert_ne!(map, libc::MAP_FAILED);
            // SAFETY: the page is mapped read-write above.
            unsafe { std::ptr::write_bytes(map.cast::<u8>(), b'A', PAGE) };
            // SAFETY: F_ADD_SEALS takes an integer.
            let write_seal = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
            let err = std::io::Error::last_os_error();
            assert_eq!(
                (write_seal, err.raw_os_error()),
                (-1, Some(libc::EBUSY)),
                "F_SEAL_WRITE over a writable map"
            );
            let seals =
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
            // SAFETY: as above.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) }, 0);
            let info = BufferInfo { offset: 0, len: PAGE as u64, served: None, note: None };
            conn.send(&protocol::encode(&Reply::Buffer(info)), &[memfd.as_fd()]).unwrap();
            let mut answer = [0u8; 16];
            conn.recv(&mut answer).unwrap();
            // SAFETY: still mapped; no Rust reference covers it here.
            unsafe { std::ptr::write_bytes(map.cast::<u8>(), b'B', PAGE) };
            conn.send(b"written", &[]).unwrap();
        }
        // Maps the memfd `arg` (a /proc/PID/fd path) writable and shared,
        // says so, and keeps the mapping until its stdin closes.
        "mapper" => {
            let file = std::fs::File::options().read(true).write(true).open(&arg).unwrap();
            // SAFETY: a fresh shared mapping of one page of the memfd.
            let map = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    PAGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(map, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
            println!("mapped");
            std::io::stdout().flush().unwrap();
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
        }
        // Loads the file `arg` with dmaload and sends it.
        "sender" => {
            let (socket, file) = arg.split_once('\n').unwrap();
            let conn = Connection::connect(Path::new(socket)).unwrap();
            let (buffer, _) = dmaload::load(file, &LoadOptions::default()).unwrap();
            buffer.send(&conn).unwrap();
            let mut answer = [0u8; 16];
            conn.recv(&mut answer).unwrap();
        }
        other => panic!("unknown role {other}"),
    }
}

fn role(name: &str, arg: &str) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.args(["--exact", "child_process_role", "--nocapture", "--test-threads=1"]);
    command.env(ROLE, name).env(ARG, arg);
    command
}

#[test]
fn a_memfd_its_sender_can_still_write_is_refused() {
    let dir = scratch_dir();
    let socket = dir.path().join("s");
    let listener = Listener::bind(&socket, 1).unwrap();
    let mut child = role("forger", socket.to_str().unwrap()).spawn().unwrap();
    let conn = listener.accept().unwrap();
    let received = Buffer::receive(&conn);
    // The sender writes its mapping now, whatever the outcome: a buffer
    // received here would show its bytes change behind a `&[u8]`.
    conn.send(b"go", &[]).unwrap();
    let mut done = [0u8; 16];
    let (len, _) = conn.recv(&mut done).unwrap();
    assert_eq!(&done[..len], b"written");
    match received {
        Ok(buffer) => panic!(
            "a memfd its sender still maps writable was received: it now reads {:?}",
            char::from(buffer[0])
        ),
        Err(err) => {
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
            assert!(err.to_string().contains("F_SEAL_WRITE"), "{err}");
        }
    }
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_buffer_sent_by_dmaload_arrives_sealed_against_every_write() {
    let dir = scratch_dir();
    let socket = dir.path().join("s");
    let file = dir.path().join("f");
    write_pattern_file(&file, (3 << 20) + 123);
    let listener = Listener::bind(&socket, 1).unwrap();
    let arg = format!("{}\n{}", socket.display(), file.display());
    let mut child = role("sender", &arg).spawn().unwrap();
    let conn = listener.accept().unwrap();
    let buffer = Buffer::receive(&conn).unwrap();
    assert_eq!(buffer.len(), (3 << 20) + 123);
    assert_pattern(&buffer, 0);
    let memfd = buffer.memfd().unwrap().unwrap();
    // SAFETY: F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_GET_SEALS) };
    assert_eq!(seals & libc::F_SEAL_WRITE, libc::F_SEAL_WRITE, "seals {seals:#x}");
    conn.send(b"done", &[]).unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_buffer_another_process_maps_writable_is_not_handed_out() {
    let dir = scratch_dir();
    let file = dir.path().join("f");
    write_pattern_file(&file, 1 << 20);
    let (buffer, _) = dmaload::load(&file, &LoadOptions::default()).unwrap();
    // A second process maps this buffer's memfd writable and shared (as a
    // child forked with the buffer mapped holds it).
    let own_memfd = fd_behind(buffer.as_ptr() as usize);
    let path = format!("/proc/{}/fd/{own_memfd}", std::process::id());
    let mut mapper = role("mapper", &path).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    // The test harness prints its own words first, on the same line.
    let mut lines = BufReader::new(mapper.stdout.take().unwrap()).lines();
    assert!(lines.any(|line| line.unwrap().ends_with("mapped")), "the mapper died before mapping");
    let err = buffer.memfd().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
    assert!(err.to_string().contains("writable shared mapping"), "{err}");
    let (a, _b) = Connection::pair().unwrap();
    let err = buffer.send(&a).unwrap_err();
    assert_eq!(err.errno(), libc::EBUSY, "{err}");
    assert_pattern(&buffer, 0);
    drop(mapper.stdin.take());
    assert!(mapper.wait().unwrap().success());
    // Once the other mapping is gone the memfd can be sealed and handed out.
    let memfd = buffer.memfd().unwrap().unwrap();
    // SAFETY: F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_GET_SEALS) };
    assert_eq!(seals & libc::F_SEAL_WRITE, libc::F_SEAL_WRITE, "seals {seals:#x}");
}

/// The number of this process's descriptor of the file mapped at
/// `address` (found by the inode /proc/self/maps gives the mapping).
fn fd_behind(address: usize) -> String {
    use std::os::unix::fs::MetadataExt;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let inode: u64 = maps
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (start, end) = fields[0].split_once('-')?;
            let range = usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?;
            range.contains(&address).then(|| fields[4].parse().unwrap())
        })
        .expect("the buffer is mapped");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .find(|entry| std::fs::metadata(entry.path()).is_ok_and(|meta| meta.ino() == inode))
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .expect("the buffer's memfd is open in this process")
}
