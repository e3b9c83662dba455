//! `LeasedMapping`: a warm file mapped under its read lease. Another
//! process's truncate or in-place rewrite while the mapping is alive makes
//! the holder detach its view and give the lease up: the writer completes,
//! the view keeps the bytes of the version it mapped, and no access ever
//! raises SIGBUS (which would kill this test process). A file open for
//! writing elsewhere is refused.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dmaload::lease::LeasedMapping;

const LEN: usize = 8 << 20;

/// A file of `LEN` patterned bytes, read once so that it is in the page cache.
fn warm_file() -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
    let dir = tempfile::Builder::new().prefix("dmaload-lease-").tempdir_in("/tmp").unwrap();
    let path = dir.path().join("weights.bin");
    let bytes: Vec<u8> = (0..LEN).map(|i| (i * 7 + i / 4096) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    (dir, path, bytes)
}

fn leased(path: &Path) -> Option<LeasedMapping> {
    match LeasedMapping::open(path) {
        Ok(mapping) => Some(mapping),
        Err(err) => {
            // Not root and not the owner, or a filesystem without leases.
            println!("SKIP lease: {err}");
            None
        }
    }
}

fn read_all(mapping: &LeasedMapping) -> Vec<u8> {
    let mut out = vec![0; mapping.len()];
    mapping.read_at(0, &mut out).unwrap();
    out
}

/// Waits for `child` (at most 20 s: the kernel's lease break time is 45 s
/// by default, so a writer done in time was let through by the holder).
fn finishes(mut child: Child, what: &str) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{what}: {status}");
            return;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("{what} still waits on the lease after 20 s: the holder never gave it up");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_truncate_by_another_process_detaches_the_view_and_completes() {
    let (_dir, path, bytes) = warm_file();
    let Some(mapping) = leased(&path) else { return };
    assert_eq!(mapping.len(), LEN);
    assert!(!mapping.is_broken());
    // A blocking open with O_TRUNC (the shell's `>`), which waits for the
    // lease (coreutils' truncate opens O_NONBLOCK and fails with EAGAIN).
    let truncate = Command::new("sh").arg("-c").arg(": > \"$0\"").arg(&path).spawn().unwrap();
    // The view is read all the while the truncate waits and after it ran.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(200) {
        assert_eq!(read_all(&mapping), bytes);
    }
    finishes(truncate, "sh -c ': > FILE'");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0, "the truncate happened");
    assert!(mapping.is_broken());
    assert_eq!(read_all(&mapping), bytes, "the view keeps the bytes it mapped");
    drop(mapping);
}

#[test]
fn an_in_place_rewrite_leaves_the_view_with_one_version() {
    let (_dir, path, bytes) = warm_file();
    let Some(mapping) = leased(&path) else { return };
    // A writer of another process rewrites the whole file in place.
    let rewrite = Command::new("dd")
        .args(["if=/dev/zero", "bs=1M", "count=8", "conv=notrunc,fsync", "status=none"])
        .arg(format!("of={}", path.display()))
        .spawn()
        .unwrap();
    finishes(rewrite, "dd conv=notrunc");
    assert!(std::fs::read(&path).unwrap().iter().all(|&b| b == 0), "the rewrite happened");
    assert!(mapping.is_broken());
    assert_eq!(read_all(&mapping), bytes, "every byte of the view is of the version it mapped");
}

#[test]
fn without_a_writer_the_lease_is_given_up_when_the_mapping_drops() {
    let (_dir, path, bytes) = warm_file();
    let Some(mapping) = leased(&path) else { return };
    assert!(mapping.check(), "no one broke the lease");
    assert_eq!(read_all(&mapping), bytes);
    drop(mapping);
    // No lease left: a non-blocking open for writing succeeds at once
    // (with a lease held it would fail with EWOULDBLOCK).
    let opened = Command::new("sh").arg("-c").arg("exec 3<>\"$0\"").arg(&path).status().unwrap();
    assert!(opened.success());
}

#[test]
fn a_file_open_for_writing_elsewhere_is_refused() {
    let (_dir, path, _) = warm_file();
    // Another process holds the file open for writing until told to go.
    let mut writer = Command::new("sh")
        .arg("-c")
        .arg("exec 3>>\"$0\"; echo open; read _")
        .arg(&path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(writer.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "open");
    let refused = LeasedMapping::open(&path);
    writeln!(writer.stdin.take().unwrap()).unwrap();
    writer.wait().unwrap();
    let err = refused.expect_err("a lease on a file open for writing");
    if err.raw_os_error() != Some(libc_eagain()) {
        println!("SKIP a_file_open_for_writing_elsewhere_is_refused: {err}");
        return;
    }
    assert!(err.to_string().contains("F_SETLEASE"), "{err}");
}

fn libc_eagain() -> i32 {
    std::io::Error::from(std::io::ErrorKind::WouldBlock).raw_os_error().unwrap_or(11)
}
