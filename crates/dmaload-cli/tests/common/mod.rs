//! Helpers shared by the CLI's hostile-input tests: the binary, scratch
//! directories an unprivileged user can use, sample files, and runs that
//! fail on a hang instead of stalling the suite.
#![allow(dead_code)] // each test binary uses a different subset

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::Value;

pub fn dmaload() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dmaload"))
}

/// The `dmaload` binary at a path other users (nobody, the tests' own
/// uids) can execute, found or made once per test process
/// ([`reachable::reachable_by_others`]).
pub fn dmaload_for_others() -> PathBuf {
    static REACHABLE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    REACHABLE.get_or_init(|| reachable::reachable_by_others(Path::new(env!("CARGO_BIN_EXE_dmaload")))).clone()
}

#[path = "../../../dmaload/tests/common/reachable.rs"]
mod reachable;

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

/// `dmaload` run as nobody (uid 65534) with no capabilities (so neither
/// CAP_IPC_LOCK nor CAP_DAC_OVERRIDE), under `limits` (prlimit arguments);
/// `None`, after printing why the test skips, where that cannot be arranged.
pub fn as_nobody_with(test: &str, limits: &[&str]) -> Option<Command> {
    as_user_with(65534, test, limits)
}

/// [`as_nobody_with`] as user `uid`, which need not exist. The kernel counts
/// pinned pages (RLIMIT_MEMLOCK) and processes (RLIMIT_NPROC) per user,
/// across every process of it: a uid of its own keeps a test that measures
/// them apart from other tests running as nobody.
pub fn as_user_with(uid: u32, test: &str, limits: &[&str]) -> Option<Command> {
    if !is_root() {
        skip(test, "needs root to drop to an unprivileged user");
        return None;
    }
    if !have("setpriv") || !have("prlimit") {
        skip(test, "setpriv/prlimit (util-linux) not installed");
        return None;
    }
    let mut cmd = Command::new("setpriv");
    cmd.args([format!("--reuid={uid}"), "--regid=65534".into(), "--clear-groups".into()])
        .args(["--inh-caps=-all", "--bounding-set=-all"])
        .arg("prlimit")
        .args(limits)
        .arg(dmaload_for_others());
    Some(cmd)
}

/// `dmaload` run under RLIMIT_MEMLOCK `limit` bytes and without
/// CAP_IPC_LOCK (which exempts root from it); `None`, after printing why the
/// test skips, where that cannot be arranged: no prlimit/setpriv, or a hard
/// limit below `limit` that this process may not raise (no CAP_SYS_RESOURCE).
///
/// As root it runs as a user of its own: io_uring counts pinned memory per
/// user, so another of root's processes without CAP_IPC_LOCK (a test running
/// beside it) would share the limit. Its files must be readable by others
/// (`open_scratch`, `sample`).
pub fn under_memlock(test: &str, limit: u64) -> Option<Command> {
    if !have("prlimit") || (is_root() && !have("setpriv")) {
        skip(test, "prlimit/setpriv (util-linux) not installed");
        return None;
    }
    const CAP_SYS_RESOURCE: u32 = 24;
    let may_raise = std::fs::read_to_string("/proc/self/status").unwrap().lines().any(|l| {
        l.strip_prefix("CapEff:")
            .and_then(|caps| u64::from_str_radix(caps.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
    });
    if memlock_hard_limit() < limit && !may_raise {
        skip(test, &format!("RLIMIT_MEMLOCK's hard limit is below {limit} bytes and may not be raised"));
        return None;
    }
    let mut cmd = Command::new("prlimit");
    cmd.arg(format!("--memlock={limit}:{limit}"));
    if is_root() {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let uid = 3_300_000 + std::process::id() % 100_000 * 16 + NEXT.fetch_add(1, Ordering::Relaxed) % 16;
        cmd.args(["setpriv", &format!("--reuid={uid}"), "--regid=65534", "--clear-groups"]).args([
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
        ]);
    }
    cmd.arg(dmaload_for_others());
    Some(cmd)
}

/// This process's hard RLIMIT_MEMLOCK in bytes (`u64::MAX`: unlimited),
/// which a process without CAP_SYS_RESOURCE may lower but not raise.
pub fn memlock_hard_limit() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max locked memory")).unwrap();
    line.split_whitespace().nth(4).unwrap().parse().unwrap_or(u64::MAX)
}
