//! Helpers shared by the CLI's hostile-input tests: the binary, run as
//! another user or under limits, and (`shared`, which dmaload-bench's tests
//! include too) scratch directories an unprivileged user can use, sample
//! files, and runs that fail on a hang instead of stalling the suite.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;

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

mod shared;
pub use shared::*;

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
