//! `dmaload load s3://BUCKET/KEY` against a real S3 server (a single-node
//! Garage, `crates/dmaload/tests/common/garage.rs`); SKIP without one.

#[path = "../../dmaload/tests/common/garage.rs"]
mod garage;

use std::process::Command;

use garage::{pattern, Garage};

fn dmaload(garage: &Garage, home: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dmaload"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        // No ~/.aws of the machine's: only the server's settings.
        .env("HOME", home)
        .envs(garage.env())
        .output()
        .unwrap()
}

#[test]
fn dmaload_load_reads_an_object_and_names_a_missing_one() {
    let Some(garage) = Garage::start("dmaload_load_reads_an_object_and_names_a_missing_one") else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((5 << 20) + 7, 9);
    garage.put("llama/model.safetensors", &body);
    let out =
        dmaload(&garage, home.path(), &["load", "s3://models/llama/model.safetensors", "--hash", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["bytes"], body.len() as u64, "{report}");
    assert_eq!(report["filesystem"], "s3");
    let expected = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&body));
    assert_eq!(report["hash"]["xxh3_64"], expected.as_str(), "{report}");

    let out = dmaload(&garage, home.path(), &["load", "s3://models/llama/missing.safetensors"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("HTTP 404") && stderr.contains("key llama/missing.safetensors"), "{stderr}");
    assert!(!stderr.contains(&garage.key.secret_key), "{stderr}");
}
