//! Staged loads and loads into caller memory under tiny process limits, in
//! a child process (this test binary, re-executed) running as nobody with
//! no capabilities: RLIMIT_MEMLOCK 0 (nothing may be pinned, so no buffer
//! is registered) falls back and still delivers every byte; RLIMIT_NPROC 1
//! (no thread may be created) is a fallback for every load: a staged one,
//! whose sink cannot run beside the reads, reads a ring's worth of slots
//! and then delivers them, in turn, on the calling thread; RLIMIT_NPROC 3 (a delivery thread, no populating threads beside it)
//! still delivers every byte. The
//! file is root's and read-only to the child, whose page-cache residency
//! the kernel will not tell (mincore calls every page cached): the loads
//! read the disk rather than trust it.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use common::{assert_pattern, skip, write_pattern_file};
use dmaload::{HostSink, LoadOptions, StagingRing};

const CHILD_FILE: &str = "DMALOAD_LIMITS_CHILD_FILE";
const NOBODY: u32 = 65534;
/// A user of its own (no account needed) for the test that counts threads:
/// the other tests' children, run beside it as nobody, do not count.
const THREAD_COUNTING_USER: u32 = 65533;
/// More than the process's kept ring (8 x 4 MiB) holds, so that a load
/// into unaligned memory reuses its slots.
const SIZE: usize = (33 << 20) + 11;

/// Not a test of its own: the child of the tests below, run when they set
/// `CHILD_FILE`. Prints one line per load: its outcome and fallbacks.
#[test]
fn child_loads_under_the_limits_it_was_given() {
    let Ok(path) = std::env::var(CHILD_FILE) else { return };
    // The file is root's and read-only to this process: mincore would call
    // every page cached, so residency is refused rather than invented.
    match dmaload::pagecache::residency(path.as_ref()) {
        Ok(residency) => println!("residency: {residency:?}"),
        Err(err) => println!("residency error: {err}"),
    }
    let options = LoadOptions { chunk_size: 1 << 20, measure_page_cache: true, ..LoadOptions::default() };
    let mut dst = vec![0u8; SIZE];
    let staged = StagingRing::new(4, 1 << 20, 1 << 20).map_err(|e| e.to_string()).and_then(|mut ring| {
        dmaload::LoadRequest::path(&path)
            .options(&options)
            .to_sink(&mut ring, &mut HostSink::new(&mut dst, 0))
            .map_err(|e| e.to_string())
    });
    match staged {
        Ok(report) => {
            assert_pattern(&dst, 0);
            assert_eq!(report.page_cache, None, "unknown residency is not measured");
            println!("staged ok: {:?}", report.fallbacks);
        }
        Err(err) => println!("staged error: {err}"),
    }
    let mut memory = vec![0u8; SIZE + 4097];
    let start = (memory.as_ptr() as usize).next_multiple_of(4096) - memory.as_ptr() as usize;
    match dmaload::LoadRequest::path(&path).options(&options).fill(&mut memory[start..start + SIZE]) {
        Ok(report) => {
            assert_pattern(&memory[start..start + SIZE], 0);
            println!("into ok ({}): {:?}", report.destination, report.fallbacks);
        }
        Err(err) => println!("into error: {err}"),
    }
    // Unaligned memory: staged through the kept ring.
    let unaligned = &mut memory[start + 1..start + 1 + SIZE];
    unaligned.fill(0);
    match dmaload::LoadRequest::path(&path).options(&options).fill(&mut *unaligned) {
        Ok(report) => {
            assert_pattern(unaligned, 0);
            println!("unaligned into ok ({}): {:?}", report.destination, report.fallbacks);
        }
        Err(err) => println!("unaligned into error: {err}"),
    }
}

/// Runs the child as user `uid` (with no other processes, as RLIMIT_NPROC
/// counts the user's) under `limits` (prlimit arguments); `None` (after a
/// printed skip) where that cannot be arranged.
fn child_output(test: &str, uid: u32, limits: &str) -> Option<String> {
    let have = |tool: &str| Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !common::is_root() {
        skip(test, "needs root to drop to an unprivileged user");
        return None;
    }
    if !have("setpriv") || !have("prlimit") {
        skip(test, "setpriv/prlimit (util-linux) not installed");
        return None;
    }
    // Somewhere nobody can read the file and run this binary.
    let dir = tempfile::Builder::new().prefix("dmaload-limits-").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = dir.path().join("f.bin");
    write_pattern_file(&file, SIZE as u64);
    // Out of the page cache, or auto mode would copy it from there.
    dmaload::pagecache::evict(&file).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let exe = dir.path().join("limits-test");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    let out = Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .args(["--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .args(["prlimit", limits])
        .arg(&exe)
        .args(["--exact", "child_loads_under_the_limits_it_was_given", "--nocapture", "--test-threads=1"])
        .env(CHILD_FILE, &file)
        .current_dir(Path::new("/"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{test}: child failed\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    Some(stdout)
}

/// The child's line that starts with `prefix` (after the test harness's
/// own words, which share the line).
fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.find(prefix).map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no '{prefix}' line in:\n{out}"))
}

#[test]
fn no_lockable_memory_falls_back_and_delivers_every_byte() {
    let Some(out) =
        child_output("no_lockable_memory_falls_back_and_delivers_every_byte", NOBODY, "--memlock=0:0")
    else {
        return;
    };
    assert!(line(&out, "residency error").contains("neither owns nor may write"), "{out}");
    for load in ["staged ok", "into ok (caller memory (in place))"] {
        // io_uring without registered buffers, or the pread pool where the
        // kernel refuses the ring itself: either way the reason names the limit.
        assert!(line(&out, load).contains("RLIMIT_MEMLOCK"), "{out}");
    }
}

#[test]
fn no_threads_falls_back_and_delivers_every_byte_staged_and_in_place() {
    // Issue 34: a staged load whose ring its file outgrows failed EAGAIN
    // "create the delivery thread" instead.
    let test = "no_threads_falls_back_and_delivers_every_byte_staged_and_in_place";
    let Some(out) = child_output(test, NOBODY, "--nproc=1:1") else {
        return;
    };
    let staged = line(&out, "staged ok");
    assert!(
        staged.contains("in turn on the calling thread") && staged.contains("cannot create a thread"),
        "{out}"
    );
    assert!(line(&out, "into ok").contains("cannot create a thread"), "{out}");
    let unaligned = line(&out, "unaligned into ok (caller memory (staged through 8 x 4194304 bytes))");
    assert!(unaligned.contains("in turn on the calling thread"), "{out}");
}

#[test]
fn a_delivery_thread_but_none_to_populate_ahead_still_delivers_every_byte() {
    // Three tasks: the child, the test harness's thread for the test (run
    // on the main thread only when that thread is refused) and the staged
    // load's delivery thread; the host sink's populating threads are refused.
    let test = "a_delivery_thread_but_none_to_populate_ahead_still_delivers_every_byte";
    let Some(out) = child_output(test, THREAD_COUNTING_USER, "--nproc=3:3") else {
        return;
    };
    let staged = line(&out, "staged ok");
    assert!(
        staged.contains("populate the destination ahead") && staged.contains("cannot create a thread"),
        "{out}"
    );
}
