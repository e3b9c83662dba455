//! `dmaload-bench bind` end to end at tiny sizes: one JSON row per size
//! and lookup with sane numbers, a PNG, the Markdown table, and refusals.

use std::process::Command;

use serde_json::Value;

fn dmaload() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dmaload-bench"))
}

const TINY: [&str; 9] = ["bind", "--sizes", "1M,4M", "--page", "16K", "--binds", "300", "--repeat", "2"];

#[test]
fn bench_bind_json_has_a_row_per_size_and_lookup_and_plot_writes_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("bind.png");
    // --linear-visits small enough that the linear rows bind fewer pages.
    let out = dmaload()
        .args(TINY)
        .args(["--linear-visits", "6400", "--json", "--plot"])
        .arg(&png)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    let png_bytes = std::fs::read(&png).unwrap();
    assert_eq!(&png_bytes[..8], b"\x89PNG\r\n\x1a\n", "--plot writes a PNG");

    assert_eq!(report["page"], 16384);
    assert_eq!(report["binds"], 300);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "linear, table and merged table for each of two sizes");
    for (size, chunk) in [(1u64 << 20, &rows[..3]), (4 << 20, &rows[3..])] {
        let pages = size / 16384;
        let kinds: Vec<(&str, bool)> =
            chunk.iter().map(|r| (r["locate"].as_str().unwrap(), r["merged"].as_bool().unwrap())).collect();
        assert_eq!(kinds, [("linear", false), ("table", false), ("table", true)]);
        for row in chunk {
            assert_eq!(row["size"], size);
            for field in ["first_bind_ns", "bind_ns", "unbind_ns", "locate_ns"] {
                let v = row[field].as_f64().unwrap_or_else(|| panic!("{field} missing: {row}"));
                assert!(v > 0.0 && v.is_finite(), "{field} = {v}");
            }
            assert_eq!(row["samples"].as_array().unwrap().len(), 2, "--repeat 2");
        }
        assert_eq!(chunk[0]["segments"], pages, "linear walks the unmerged table");
        assert_eq!(chunk[1]["segments"], pages, "every page its own segment");
        assert_eq!(chunk[2]["segments"], 1, "contiguous pages of one memfd merge");
        assert_eq!(chunk[1]["binds"], 300);
        // 6400 visits / (pages / 2) binds, at least 100.
        assert_eq!(chunk[0]["binds"].as_u64().unwrap(), (6400 / (pages / 2)).clamp(100, 300));
        assert!(chunk[0]["speedup_vs_linear"].is_null());
        assert!(chunk[1]["speedup_vs_linear"].as_f64().unwrap() > 0.0);
    }
    let targets = &report["targets"];
    assert!(targets["bind_flatness"].as_f64().unwrap() > 0.0);
    assert!(targets["speedup_at_4g"].is_null(), "4 GiB was not run");
    assert!(targets["min_locate_mops"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_bind_prints_a_markdown_table_and_refuses_bad_pages() {
    let out = dmaload().args(TINY).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in
        ["| size | locate | segments", "linear walk (baseline)", "table, merged", "Targets:", "max_map_count"]
    {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
    assert_eq!(
        text.lines().filter(|l| l.starts_with("| 1.00 MiB") || l.starts_with("| 4.00 MiB")).count(),
        6
    );

    let out = dmaload().args(["bind", "--sizes", "1M", "--page", "1000"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--page"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
