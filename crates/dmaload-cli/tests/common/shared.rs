//! The test helpers that name no binary: skips, scratch directories an
//! unprivileged user can use, sample files, runs that fail on a hang, and
//! planting files as another user. The CLI's tests reach them through
//! `common`; dmaload-bench's tests include this file by path, so neither
//! copies them.
#![allow(dead_code)] // each test binary uses a different subset

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Prints why a test is skipped, in the form the test log shows; panics
/// instead where `DMALOAD_TEST_NO_SKIP=1` (the VM guest, which exists to
/// run what a skip would leave out), as the core's tests do.
pub fn skip(test: &str, reason: &str) {
    if std::env::var_os("DMALOAD_TEST_NO_SKIP").is_some_and(|v| v == "1") {
        panic!("{test} cannot be skipped here (DMALOAD_TEST_NO_SKIP=1): {reason}");
    }
    eprintln!("SKIP {test}: {reason}");
}

pub fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success())
}

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

/// A scratch directory under /tmp that an unprivileged user can read and
/// write.
pub fn open_scratch(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    dir
}

/// A file of `len` bytes whose content depends on position, readable by all.
pub fn sample(dir: &Path, name: &OsStr, len: usize) -> PathBuf {
    let path = dir.join(name);
    let bytes: Vec<u8> =
        (0..len).map(|i| (i as u64).wrapping_mul(0x9E37_79B9).rotate_right(7) as u8).collect();
    std::fs::write(&path, bytes).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    path
}

/// Runs `cmd`, killing it if it outlives a generous bound: a hang must
/// fail the test, not stall the suite.
pub fn output_or_hang(cmd: &mut Command) -> Output {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("{cmd:?} hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The JSON a successful command printed; a panic (exit 101) or failure
/// fails the test with its stderr.
pub fn json_of(out: &Output) -> Value {
    assert_ne!(out.status.code(), Some(101), "panicked: {}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Runs `cmd` as nobody (to plant something in a directory it may write),
/// or `None` where that cannot be arranged.
pub fn as_nobody(test: &str, program: &str) -> Option<Command> {
    if !is_root() || !have("setpriv") {
        skip(test, "needs root and setpriv to act as another user");
        return None;
    }
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", program]);
    Some(cmd)
}

/// A file the caller (root) may write, in a directory nobody else may.
pub fn victim(test_dir: &Path) -> PathBuf {
    let dir = test_dir.join("private");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.join("precious");
    std::fs::write(&path, b"precious\n").unwrap();
    path
}

/// Every entry of `dir` but `keep`: what a command left behind.
pub fn entries_besides(dir: &Path, keep: &[&str]) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect();
    names.sort();
    names
}

/// What the hostile-input tests give every command that reads a path, made
/// in `dir`: (what it is, its path): a FIFO, an endless character device,
/// a directory and a dangling symlink.
pub fn special_files(dir: &Path) -> Vec<(&'static str, PathBuf)> {
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let directory = dir.join("dir");
    std::fs::create_dir(&directory).unwrap();
    let dangling = dir.join("dangling");
    std::os::unix::fs::symlink(dir.join("nothing"), &dangling).unwrap();
    vec![
        ("FIFO", fifo),
        ("character device", PathBuf::from("/dev/zero")),
        ("directory", directory),
        ("dangling symlink", dangling),
    ]
}

/// `args` run on the `kind` of special file at `input` ended without a
/// panic: where it `takes_it`, successfully; else with exit status 1 and an
/// error that names the path.
pub fn assert_ended_at_once(run: &Output, args: &[&str], kind: &str, input: &Path, takes_it: bool) {
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_ne!(run.status.code(), Some(101), "{args:?} on a {kind} panicked: {stderr}");
    if takes_it {
        assert!(run.status.success(), "{args:?} on a {kind}: {stderr}");
    } else {
        assert_eq!(run.status.code(), Some(1), "{args:?} on a {kind}: {stderr}");
        let name = input.file_name().unwrap().to_str().unwrap();
        assert!(stderr.contains(name), "{args:?} on a {kind} does not name it: {stderr}");
    }
}
