//! The `dmaload-bench` command end to end at tiny sizes: every table's
//! rows and JSON, refusals of what it cannot measure (hostile paths, an
//! empty file), files it writes never through a planted symlink, and the
//! rows that run the `dmaload` command (`cache`, `stream`'s capture): that
//! one is found beside `dmaload-bench`, where `cargo test --workspace`
//! builds both. Figures are not checked: timings belong to benchmarks.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

// The CLI's test helpers that name no binary, included, not copied.
#[path = "../../dmaload-cli/tests/common/shared.rs"]
mod common;

use common::*;

fn dmaload_bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dmaload-bench"))
}

/// The `dmaload` command the rows that run it use: beside `dmaload-bench`.
fn dmaload_beside() -> PathBuf {
    let beside = Path::new(env!("CARGO_BIN_EXE_dmaload-bench")).with_file_name("dmaload");
    assert!(
        beside.is_file(),
        "{} missing: build it first (cargo build --release -p dmaload-cli; cargo test --workspace does)",
        beside.display()
    );
    beside
}

/// A scratch directory on the root filesystem, not tmpfs, so direct I/O runs.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("dmaload-bench-").tempdir_in(std::env::temp_dir()).unwrap()
}

/// A file of `len` bytes whose content depends on position.
fn sample_file(dir: &Path, name: &str, len: usize) -> PathBuf {
    sample(dir, OsStr::new(name), len)
}

/// `dmaload-bench ARGS --json --plot PNG`: its JSON, once the PNG is checked.
fn bench(dir: &Path, args: &[&str]) -> Value {
    let png = dir.join("plot.png");
    let out = dmaload_bench().args(args).arg("--json").arg("--plot").arg(&png).output().unwrap();
    let value = json_of(&out);
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "--plot writes a PNG");
    std::fs::remove_file(&png).unwrap();
    value
}

#[test]
fn fifo_paths_are_errors_not_hangs() {
    let dir = open_scratch("dmaload-hostile-");
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let args = ["load", "--no-fio", "--repeat", "1"];
    let out = output_or_hang(dmaload_bench().args(args).arg(&fifo));
    assert!(!out.status.success(), "{args:?} succeeded on a FIFO");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("FIFO"), "{args:?}: {stderr}");
}

/// Every command that reads a path, given a FIFO, an endless character
/// device, a directory or a dangling symlink, ends at once with an error
/// that names the path (as the `dmaload` command's do: its
/// `special_files_are_errors_at_once_in_every_subcommand`).
#[test]
fn special_files_are_errors_at_once_in_every_subcommand() {
    let dir = open_scratch("dmaload-hostile-");
    let subcommands: &[&[&str]] = &[
        &["load", "--no-fio", "--repeat", "1"],
        &["fio"],
        &["matrix", "--repeat", "1", "--file"],
        &["qd", "--repeat", "1", "--file"],
    ];
    for (kind, input) in special_files(dir.path()) {
        for args in subcommands {
            let run = output_or_hang(dmaload_bench().args(*args).arg(&input));
            assert_ended_at_once(&run, args, kind, &input, false);
        }
    }
}

#[test]
fn bench_load_emits_a_table_with_every_engine_and_the_baseline() {
    let dir = scratch();
    let path = sample_file(dir.path(), "f", (4 << 20) + 1);
    let out =
        dmaload_bench().args(["load", "--repeat", "1", "--json", "--no-fio"]).arg(&path).output().unwrap();
    let table = json_of(&out);
    let rows = table["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    for name in [
        "dmaload uring-fixed",
        "dmaload uring",
        "dmaload pread-pool",
        "dmaload read",
        "dmaload uring-fixed staging ring → host buffer",
        "read, buffered (baseline)",
    ] {
        assert!(names.contains(&name), "{name} missing: {names:?}");
    }
    for row in rows {
        assert!(row["median_gib_per_second"].as_f64().unwrap() > 0.0);
        assert!(row["ratio_to_fio_best"].is_null());
        assert!(row["ratio_to_in_place_default"].as_f64().unwrap() > 0.0);
    }
    // The staged row is held against the default engine's in-place row.
    let in_place = rows.iter().find(|r| r["method"] == "dmaload uring-fixed").unwrap();
    assert_eq!(in_place["ratio_to_in_place_default"].as_f64(), Some(1.0));
    assert!(table["staging"].as_str().unwrap().contains("32 slots x 4.00 MiB"), "{table}");
    let markdown = dmaload_bench().args(["load", "--repeat", "1", "--no-fio"]).arg(&path).output().unwrap();
    let markdown = String::from_utf8(markdown.stdout).unwrap();
    assert!(markdown.contains("| method |") && markdown.contains("× buffered"), "{markdown}");
    assert!(markdown.contains("× in-place default") && markdown.contains("staging ring → host buffer"));
}

#[test]
fn bench_load_staged_only_runs_the_staged_row_and_its_in_place_default() {
    let dir = scratch();
    let path = sample_file(dir.path(), "f", (4 << 20) + 1);
    let out = dmaload_bench()
        .args(["load", "--repeat", "1", "--json", "--staged-only"])
        .arg(&path)
        .output()
        .unwrap();
    let table = json_of(&out);
    let rows = table["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    assert_eq!(names, ["dmaload uring-fixed", "dmaload uring-fixed staging ring → host buffer"]);
    assert!(table["fio"].as_str().unwrap().contains("--staged-only"), "{table}");
    for row in rows {
        assert!(row["ratio_to_buffered"].is_null(), "no baseline row: {row}");
        assert_eq!(row["samples"].as_array().unwrap().len(), 1);
    }
    // The delivery thread's time, for the staged row only.
    assert!(rows[1]["samples"][0]["deliver_seconds"].as_f64().unwrap() > 0.0);
    assert!(rows[0]["samples"][0]["deliver_seconds"].is_null());
}

#[test]
fn bench_fio_reads_the_whole_file_once_per_depth() {
    let test = "bench_fio_reads_the_whole_file_once_per_depth";
    if !have("fio") {
        return skip(test, "fio is not installed");
    }
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 1 << 20);
    let out = dmaload_bench()
        .args(["fio", "--block-size", "64K", "--iodepth", "2", "--iodepth", "4", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("direct") {
        return skip(test, &format!("no O_DIRECT here: {}", String::from_utf8_lossy(&out.stderr)));
    }
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.iter().map(|r| r["iodepth"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 4]);
    for row in &rows {
        assert_eq!(row["bytes"], 1 << 20, "{row}");
        assert!(row["gib_per_second"].as_f64().unwrap() > 0.0, "{row}");
        // fio's own CPU seconds for the job, (usr_cpu + sys_cpu)% of its
        // runtime: a number (a parse of a missing field gives NaN), and at
        // most that runtime times the CPUs it could use.
        let cpu = row["cpu_seconds"].as_f64().unwrap();
        let cpus = std::thread::available_parallelism().unwrap().get() as f64;
        assert!(cpu.is_finite() && cpu <= row["seconds"].as_f64().unwrap() * cpus + 0.002, "{row}");
    }
}

#[test]
fn bench_load_refuses_an_empty_file() {
    let dir = open_scratch("dmaload-hostile-");
    let empty = sample(dir.path(), OsStr::new("empty"), 0);
    let out = output_or_hang(dmaload_bench().args(["load", "--no-fio", "--repeat", "1"]).arg(&empty));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("empty") && !stderr.contains("NaN"), "{stderr}");
}

/// The other files the CLI creates: a benchmark's generated file (today
/// written through `<name>.tmp` beside it) and a `--plot` PNG (today
/// created at the path given). nobody plants symlinks to the caller's file
/// at both names in a directory it may write: the victim stays intact, the
/// generated file is written beside the planted link, the plot fails
/// naming the link it leaves alone, and no temporary file remains.
#[test]
fn bench_files_and_plots_never_write_through_a_planted_symlink() {
    let test = "bench_files_and_plots_never_write_through_a_planted_symlink";
    let Some(_) = as_nobody(test, "true") else { return };
    for mode in [0o777, 0o1777] {
        let scratch = open_scratch("dmaload-bench-planted");
        let victim = victim(scratch.path());
        let dir = scratch.path().join("shared");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        for name in ["dmaload-bench-1048576.tmp", "out.png"] {
            let ln =
                as_nobody(test, "ln").unwrap().arg("-s").arg(&victim).arg(dir.join(name)).status().unwrap();
            assert!(ln.success());
        }
        let out = output_or_hang(
            dmaload_bench()
                .args(["qd", "--size", "1M", "--seconds", "0.02", "--repeat", "1", "--json", "--dir"])
                .arg(&dir)
                .arg("--plot")
                .arg(dir.join("out.png")),
        );
        let now = std::fs::read(&victim).unwrap();
        assert!(now == b"precious\n", "mode {mode:o}: the victim was written ({} bytes now)", now.len());
        assert!(!out.status.success(), "mode {mode:o}: the plot replaced a symlink");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("out.png: a symbolic link is there"), "{stderr}");
        let generated = std::fs::symlink_metadata(dir.join("dmaload-bench-1048576.bin")).unwrap();
        assert!(generated.file_type().is_file() && generated.len() == 1 << 20, "{generated:?}");
        for name in ["dmaload-bench-1048576.tmp", "out.png"] {
            assert_eq!(std::fs::read_link(dir.join(name)).unwrap(), victim, "the planted {name} was changed");
        }
        let left =
            entries_besides(&dir, &["dmaload-bench-1048576.bin", "dmaload-bench-1048576.tmp", "out.png"]);
        assert_eq!(left, Vec::<String>::new(), "mode {mode:o}");
    }
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
fn bench_cache_runs_its_rows_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.bin");
    sample(dir.path(), OsStr::new("model.bin"), 4 << 20);
    let out = dmaload_bench()
        .env("DMALOAD_CLI", dmaload_beside())
        .args(["cache", "--repeat", "3", "--json", "--python", "/nonexistent/python"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = table["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 7);
    for row in &rows[..3] {
        assert!(row["skipped"].is_null(), "{row}");
        assert!(row["median_seconds"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["seconds"].as_array().unwrap().len(), 3, "{row}");
    }
    // Every round runs every row once, and not always in the same order:
    // the hit is prepared on its own wherever it falls (a fresh service
    // given the file, when no miss came before it).
    let orders: Vec<Vec<u64>> = table["orders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_array().unwrap().iter().map(|i| i.as_u64().unwrap()).collect())
        .collect();
    assert_eq!(orders.len(), 3);
    for order in &orders {
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..7).collect::<Vec<u64>>(), "{orders:?}");
    }
    assert!(orders.iter().any(|o| o != &orders[0]), "{orders:?}");
    let position = |o: &Vec<u64>, row: u64| o.iter().position(|&r| r == row).unwrap();
    assert!(orders.iter().any(|o| position(o, 2) < position(o, 1)), "a hit before the miss: {orders:?}");
    // No such Python: its rows say so instead of failing the run.
    for row in &rows[3..] {
        assert!(row["skipped"].as_str().is_some_and(|why| why.contains("nonexistent")), "{row}");
    }
    assert!(table["cold_over_hit"].as_f64().unwrap() > 0.0);
}

/// `bench stream` runs every row with real producer processes (figures are
/// not checked: timings belong to benchmarks, not tests).
#[test]
fn bench_stream_runs_every_row() {
    let dir = open_scratch("dmaload-capture-");
    let table = json_of(&output_or_hang(
        dmaload_bench()
            .env("DMALOAD_CLI", dmaload_beside())
            .args(["stream", "--bytes", "2M", "--capture-bytes", "4M", "--capture-blocks", "8"])
            .args(["--repeat", "1", "--no-fio", "--json", "--dir"])
            .arg(dir.path()),
    ));
    let rows = table["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 7);
    for row in rows {
        for method in ["fileio", "queue"] {
            let run = &row[method][0];
            assert!(run["mib_per_second"].as_f64().unwrap() > 0.0, "{row}");
            assert!(run["producer_cpu_seconds"].as_f64().unwrap() >= 0.0, "{row}");
        }
    }
    assert_eq!(table["capture"]["capture_mib_per_second"].as_array().unwrap().len(), 1);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the bench leaves no file behind");
}
