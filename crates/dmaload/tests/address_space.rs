//! Page-cache residency under a tight RLIMIT_AS, in a child process (this
//! test binary, re-executed) whose limit is set to just above what it has
//! mapped: residency maps the file a window at a time, and where even one
//! window does not fit, it is unknown rather than a failed load.

mod common;

use std::path::Path;
use std::process::Command;

use common::{skip, write_pattern_file};

const CHILD_FILE: &str = "DMALOAD_ADDRESS_SPACE_CHILD_FILE";

/// Not a test of its own: the child of the test below, run when it sets
/// `CHILD_FILE`. Limits its own address space, then prints what residency
/// gives.
#[test]
fn child_measures_residency_without_address_space() {
    let Ok(path) = std::env::var(CHILD_FILE) else { return };
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let mapped_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    // 16 MiB of room: less than one 64 MiB window of the file.
    let limit = (mapped_kib << 10) + (16 << 20);
    let set = Command::new("prlimit")
        .arg(format!("--pid={}", std::process::id()))
        .arg(format!("--as={limit}"))
        .status()
        .unwrap();
    assert!(set.success());
    let file = std::fs::File::open(&path).unwrap();
    let len = file.metadata().unwrap().len();
    let strict = dmaload::pagecache::residency_of(&file, Path::new(&path), 0, len);
    let known = dmaload::pagecache::known_residency_of(&file, Path::new(&path), 0, len);
    println!(
        "OUT strict={} known={known:?}",
        strict.map(|_| "ok".to_owned()).unwrap_or_else(|e| e.to_string())
    );
}

#[test]
fn residency_without_room_to_map_the_file_is_unknown_not_an_error() {
    let test = "residency_without_room_to_map_the_file_is_unknown_not_an_error";
    if !Command::new("prlimit").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return skip(test, "prlimit (util-linux) not installed");
    }
    let dir = common::scratch_dir();
    let path = dir.path().join("big.bin");
    write_pattern_file(&path, 200 << 20);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_measures_residency_without_address_space",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_FILE, &path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    // libtest may print its own words before the child's on that line.
    let line = stdout.lines().find_map(|l| l.split_once("OUT ").map(|(_, out)| out)).unwrap_or_default();
    assert!(line.contains("Cannot allocate memory"), "the window did not fit: {line}");
    assert!(line.ends_with("known=Ok(None)"), "{line}");
}
