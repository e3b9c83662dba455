//! `dmaload save`, `copy` and the seed-table benchmarks end to end at tiny
//! sizes: valid JSON, verified content, a PNG; and a save killed midway
//! never leaves a torn file.

use std::path::Path;
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

fn bench(dir: &Path, args: &[&str]) -> Value {
    let png = dir.join("plot.png");
    let out = dmaload().arg("bench").args(args).arg("--json").arg("--plot").arg(&png).output().unwrap();
    let value = json_of(&out);
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "--plot writes a PNG");
    std::fs::remove_file(&png).unwrap();
    value
}

#[test]
fn bench_matrix_emits_every_row_with_a_status_and_verified_numbers() {
    let dir = scratch();
    let d = dir.path().to_str().unwrap();
    let m = bench(dir.path(), &["matrix", "--size", "1M", "--piece", "256K", "--repeat", "2", "--dir", d]);
    let rows = m["rows"].as_array().unwrap();
    // 4 memory types x (4 methods x 2 modes + 2 io_uring) x 2 directions.
    assert_eq!(rows.len(), 80);
    for row in rows {
        let status = row["status"].as_str().unwrap();
        assert!(
            status == "ok" || status.starts_with("unavailable: ") || status.starts_with("refused: "),
            "{row}"
        );
        if status == "ok" {
            assert_eq!(row["samples"].as_array().unwrap().len(), 2);
            let mb = &row["mb_per_s"];
            assert!(mb["min"].as_f64().unwrap() <= mb["median"].as_f64().unwrap());
            assert!(mb["median"].as_f64().unwrap() <= mb["max"].as_f64().unwrap());
        }
    }
    for direction in ["read", "write"] {
        let first = rows.iter().find(|r| r["direction"] == direction).unwrap();
        assert_eq!((first["memory"].as_str(), first["method"].as_str()), (Some("memfd"), Some("read-write")));
        assert_eq!(first["status"], "ok");
        assert!((first["percent_of_first"].as_f64().unwrap() - 100.0).abs() < 1e-9);
    }
}

#[test]
fn bench_sizes_qd_and_save_emit_json_with_spreads() {
    let dir = scratch();
    let d = dir.path().to_str().unwrap();
    let s = bench(dir.path(), &["sizes", "--sizes", "64K,1M", "--repeat", "1", "--dir", d]);
    let rows = s["rows"].as_array().unwrap();
    let schemes: Vec<&str> = rows.iter().map(|r| r["scheme"].as_str().unwrap()).collect();
    // The memfd rows run everywhere; the dma-buf rows where the kernel has the devices.
    for scheme in
        ["normal", "sendfile-buffered", "sendfile-direct", "alloc-read-sync", "alloc-read-pipelined"]
    {
        assert!(schemes.contains(&scheme), "{scheme} missing from {schemes:?}");
    }
    let heap = std::path::Path::new("/dev/dma_heap/system").exists();
    assert_eq!(schemes.contains(&"alloc-read-dma-heap"), heap, "{schemes:?}");
    assert_eq!(schemes.contains(&"alloc-read-udmabuf"), std::path::Path::new("/dev/udmabuf").exists());
    assert_eq!(s["baseline"], if heap { "normal-dma-heap" } else { "normal" });
    let baseline = rows.iter().find(|r| r["scheme"] == s["baseline"]).unwrap();
    assert_eq!(baseline["cells"][1]["speedup_vs_baseline"], 1.0);
    let q = bench(dir.path(), &["qd", "--size", "1M", "--seconds", "0.05", "--repeat", "1", "--dir", d]);
    let cells = q["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 12);
    assert!(cells.iter().all(|c| c["iops"]["median"].as_f64().unwrap() > 0.0));
    assert!(cells.iter().filter(|c| c["registered"] == true).all(|c| c["iops_vs_unregistered"].is_f64()));
    let v = bench(dir.path(), &["save", "--size", "1M", "--repeat", "1", "--dir", d]);
    let rows = v["rows"].as_array().unwrap();
    assert!(rows.len() >= 4);
    assert_eq!(rows[0]["ratio_to_buffered"], 1.0);
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
