//! `dmaload load MODEL`: a generated sharded safetensors model (an index
//! and its shards) loaded by directory and by index, each shard's bytes
//! compared with the file's, `--verify` against each shard's sums entry,
//! every bad index refused before any shard is loaded, and a model loaded
//! to the device through one pinned staging ring.

mod common;
#[path = "../../dmaload/tests/common/cuda_driver.rs"]
mod cuda_driver;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{dmaload, output_or_hang};
use serde_json::{json, Value};

/// A safetensors file of `tensors` (name, element count) of F32 whose bytes
/// depend on the name and position.
fn write_shard(path: &Path, tensors: &[(&str, usize)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, count) in tensors {
        let begin = data.len();
        data.extend((0..count * 4).map(|i| (i as u64 ^ name.len() as u64).wrapping_mul(2_654_435_761) as u8));
        header.insert(
            (*name).to_owned(),
            json!({"dtype": "F32", "shape": [count], "data_offsets": [begin, data.len()]}),
        );
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// Three shards of a few tensors each (one of several MiB) and their index.
fn sharded_model(dir: &Path) -> (Vec<PathBuf>, Value) {
    let layout: [&[(&str, usize)]; 3] = [
        &[("embed", 3 << 20), ("layer0.q", 1000)],
        &[("layer0.k", 17), ("layer1.q", 65_536)],
        &[("layer1.k", 5), ("head", 1 << 20), ("empty", 0)],
    ];
    let mut weight_map = serde_json::Map::new();
    let mut paths = Vec::new();
    for (i, tensors) in layout.iter().enumerate() {
        let name = format!("model-{:05}-of-00003.safetensors", i + 1);
        write_shard(&dir.join(&name), tensors);
        for (tensor, _) in *tensors {
            weight_map.insert((*tensor).to_owned(), json!(name));
        }
        paths.push(dir.join(name));
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    (paths, index)
}

fn json_of(out: &Output) -> Value {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {:?}", out))
}

fn failure(out: &Output) -> String {
    assert!(!out.status.success(), "succeeded: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("dmaload-model-").tempdir_in(std::env::temp_dir()).unwrap()
}

#[test]
fn a_sharded_model_loads_bit_exact_by_directory_and_by_index() {
    let dir = scratch();
    let (shards, _) = sharded_model(dir.path());
    let index = dir.path().join("model.safetensors.index.json");
    for path in [dir.path().to_owned(), index] {
        let report = json_of(&output_or_hang(dmaload().args(["load", "--json", "--hash"]).arg(&path)));
        assert_eq!(report["tensors"], 7);
        let listed = report["shards"].as_array().unwrap();
        assert_eq!(listed.len(), 3);
        let mut total = 0;
        // The index lists its shards in the order of their first mention
        // (this index's keys are sorted): each is one of the files.
        let mut seen: Vec<&str> = listed.iter().map(|s| s["path"].as_str().unwrap()).collect();
        seen.sort();
        assert_eq!(seen, shards.iter().map(|p| p.to_str().unwrap()).collect::<Vec<_>>());
        for shard in listed {
            let file = Path::new(shard["path"].as_str().unwrap());
            let bytes = std::fs::read(file).unwrap();
            assert_eq!(shard["bytes"], bytes.len());
            let expected = xxhash_rust::xxh3::xxh3_64(&bytes);
            assert_eq!(shard["hash"]["xxh3_64"], format!("{expected:016x}"), "{}", file.display());
            total += bytes.len();
        }
        assert_eq!(report["bytes"], total);
        assert!(report["gib_per_second"].as_f64().unwrap() > 0.0);
    }
    let text = output_or_hang(dmaload().arg("load").arg(dir.path()));
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("3 shards") && text.contains("7 tensors") && text.contains("GiB/s"), "{text}");
    // No index: every *.safetensors of the directory, in name order.
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let report = json_of(&output_or_hang(dmaload().args(["load", "--json"]).arg(dir.path())));
    let paths: Vec<&str> =
        report["shards"].as_array().unwrap().iter().map(|s| s["path"].as_str().unwrap()).collect();
    assert_eq!(paths, shards.iter().map(|p| p.to_str().unwrap()).collect::<Vec<_>>());
}

#[test]
fn verify_checks_each_shard_against_its_sums_entry() {
    let dir = scratch();
    let (shards, _) = sharded_model(dir.path());
    let sums = output_or_hang(dmaload().arg("sums").arg(dir.path()));
    assert!(sums.status.success(), "{}", String::from_utf8_lossy(&sums.stderr));
    let report = json_of(&output_or_hang(dmaload().args(["load", "--verify", "--json"]).arg(dir.path())));
    assert_eq!(report["verified"], true);
    // One flipped bit in the last shard's data: the model fails, naming it.
    let mut bytes = std::fs::read(&shards[2]).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shards[2], &bytes).unwrap();
    let stderr = failure(&output_or_hang(dmaload().args(["load", "--verify"]).arg(dir.path())));
    assert!(stderr.contains("mismatch") && stderr.contains("model-00003-of-00003"), "{stderr}");
}

/// A change to an index's weight map.
type Edit = dyn Fn(&mut serde_json::Map<String, Value>);

#[test]
fn a_bad_index_or_disagreeing_shards_are_refused_naming_the_tensor() {
    let dir = scratch();
    let (_, good) = sharded_model(dir.path());
    let index = dir.path().join("model.safetensors.index.json");
    let with_map = |change: &Edit| {
        let mut index_json = good.clone();
        change(index_json["weight_map"].as_object_mut().unwrap());
        std::fs::write(&index, index_json.to_string()).unwrap();
        failure(&output_or_hang(dmaload().arg("load").arg(dir.path())))
    };
    let cases: [(&Edit, &str); 6] = [
        (&|m| drop(m.insert("layer0.q".into(), json!("../x.safetensors"))), "outside the index's directory"),
        (&|m| drop(m.insert("layer0.q".into(), json!("."))), "which is not a file name"),
        (&|m| drop(m.insert("layer0.q".into(), json!("gone.safetensors"))), "which does not exist"),
        (&|m| drop(m.insert("layer0.q".into(), json!("model-00002-of-00003.safetensors"))), "no such tensor"),
        (&|m| drop(m.remove("head")), "does not list it"),
        (&|m| m.clear(), "empty weight_map"),
    ];
    for (change, expected) in cases {
        let stderr = with_map(change);
        assert!(stderr.contains(expected), "{expected}: {stderr}");
    }
    std::fs::write(&index, r#"{"weight_map": {"a": "x", "a": "y"}}"#).unwrap();
    let stderr = failure(&output_or_hang(dmaload().arg("load").arg(&index)));
    assert!(stderr.contains("invalid index JSON") && stderr.contains("appears twice"), "{stderr}");
    // A range is one file's: refused for a model.
    let stderr = failure(&output_or_hang(dmaload().args(["load", "--length", "8"]).arg(dir.path())));
    assert!(stderr.contains("a model is loaded whole"), "{stderr}");
}

/// `dmaload load MODEL --to cuda:0` pins one staging ring for all its
/// shards, each slot once as the loads reach it (the emulator's log of
/// `cuMemHostRegister` calls): no address is pinned twice and nothing is
/// unpinned, where a ring per shard would pin its slots again (or free the
/// last one's); every shard loads bit-exact.
#[test]
fn a_model_loaded_to_the_device_pins_one_ring() {
    let test = "a_model_loaded_to_the_device_pins_one_ring";
    if let Err(reason) = cuda_driver::cuda_driver() {
        return println!("SKIP {test}: {reason}");
    }
    if !std::env::var("DMALOAD_LIBCUDA").is_ok_and(|path| path.contains("cuda-emu")) {
        return println!("SKIP {test}: the driver's pinning is logged by the CUDA emulator only");
    }
    let dir = scratch();
    let (shards, _) = sharded_model(dir.path());
    let log = dir.path().join("emu.log");
    let load = |faults: &str| {
        output_or_hang(
            dmaload()
                .args(["load", "--json", "--hash", "--to", "cuda:0"])
                .arg(dir.path())
                .env("DMALOAD_EMU_FAULTS", faults)
                .env("DMALOAD_EMU_LOG", &log),
        )
    };
    let report = json_of(&load(""));
    let listed = report["shards"].as_array().unwrap();
    assert_eq!(listed.len(), 3);
    for shard in listed {
        let bytes = std::fs::read(shard["path"].as_str().unwrap()).unwrap();
        let expected = xxhash_rust::xxh3::xxh3_64(&bytes);
        assert_eq!(shard["hash"]["xxh3_64"], format!("{expected:016x}"), "{shard}");
    }
    assert!(shards.iter().all(|p| p.exists()));
    let lines = std::fs::read_to_string(&log).unwrap();
    let pinned: Vec<&str> =
        lines.lines().filter_map(|l| l.strip_prefix("register ")?.split_whitespace().next()).collect();
    assert!(!pinned.is_empty(), "nothing was pinned: {lines}");
    let distinct: std::collections::HashSet<&&str> = pinned.iter().collect();
    assert_eq!(distinct.len(), pinned.len(), "an address was pinned twice: {lines}");
    assert!(!lines.contains("unregister "), "a ring was unpinned between shards: {lines}");
    // A registration refused is an error naming the ring.
    let refused = failure(&load("cuMemHostRegister_v2#1=2"));
    assert!(refused.contains("staging ring") && refused.contains("cuMemHostRegister"), "{refused}");
}
