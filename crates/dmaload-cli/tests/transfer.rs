//! `dmaload save` and `copy` end to end at tiny sizes: valid JSON,
//! verified content; and a save killed midway never leaves a torn file.
//! (The seed-table benchmarks: dmaload-bench's tests.)

use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;

fn dmaload() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dmaload"))
}

fn scratch() -> tempfile::TempDir {
    // On the root filesystem (ext4 here), not tmpfs, so direct I/O runs.
    tempfile::Builder::new().prefix("dmaload-cli-transfer-").tempdir_in(std::env::temp_dir()).unwrap()
}

fn json_of(out: &Output) -> Value {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn copy_reports_both_halves_and_copies_exactly() {
    let dir = scratch();
    let src = dir.path().join("src");
    let bytes: Vec<u8> = (0..(3u64 << 20) + 77).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&src, &bytes).unwrap();
    let dst = dir.path().join("dst");
    let out = dmaload().arg("copy").arg(&src).arg(&dst).arg("--json").output().unwrap();
    let report = json_of(&out);
    assert_eq!(report["load"]["bytes"], bytes.len());
    assert_eq!(report["save"]["bytes"], bytes.len());
    assert_eq!(report["save"]["cache"], "bypass");
    assert_eq!(std::fs::read(&dst).unwrap(), bytes);
    let text = dmaload().arg("copy").arg(&src).arg(&dst).output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    for needle in ["== load", "== save", "replaced the previous file", "buffered tail", "== copy"] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[test]
fn a_save_killed_midway_leaves_the_old_file_or_the_whole_new_one() {
    let dir = scratch();
    let size = "192M";
    // The complete new file, for comparison.
    let reference = dir.path().join("reference");
    assert!(dmaload().args(["save", "--size", size]).arg(&reference).output().unwrap().status.success());
    let new = std::fs::read(&reference).unwrap();
    std::fs::remove_file(&reference).unwrap();
    let target = dir.path().join("snapshot");
    let old = b"previous good snapshot".to_vec();
    let mut outcomes = (0, 0);
    for delay_ms in [5u64, 30, 80, 150, 300, 600, 1200] {
        std::fs::write(&target, &old).unwrap();
        let mut child = dmaload().args(["save", "--size", size]).arg(&target).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = child.kill();
        child.wait().unwrap();
        let now = std::fs::read(&target).unwrap();
        if now == old {
            outcomes.0 += 1;
        } else {
            assert!(now == new, "killed after {delay_ms} ms: {} bytes, neither old nor new", now.len());
            outcomes.1 += 1;
        }
        let strays: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "snapshot")
            .collect();
        assert!(strays.is_empty(), "killed after {delay_ms} ms left {strays:?}");
    }
    eprintln!("kill test: {} kills left the old file, {} the complete new one", outcomes.0, outcomes.1);
    assert!(outcomes.0 > 0, "no kill landed mid-save: the test did not test anything");
}

#[test]
fn save_errors_name_the_path_and_errno() {
    let dir = scratch();
    let target = dir.path().join("missing-dir").join("f");
    let out = dmaload().args(["save", "--size", "4K"]).arg(&target).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing-dir") && err.contains("os error 2"), "{err}");
}
