//! `format::model`: a sharded safetensors model resolved from a directory,
//! an index or a file, each shard opened once (a shard replaced at its
//! path after the model was opened is not what loads), its bytes loaded
//! bit-exact, and hostile index files refused without waiting.

use std::path::{Path, PathBuf};

use dmaload::format::model::{Model, INDEX_NAME};
use dmaload::format::safetensors::Error;
use dmaload::{LoadOptions, Loaded};

/// A safetensors file of U8 tensors (name, length) whose bytes are `fill`.
fn write_shard(path: &Path, tensors: &[(&str, usize)], fill: u8) {
    let mut entries = Vec::new();
    let mut offset = 0;
    for (name, len) in tensors {
        entries.push(format!(
            r#""{name}":{{"dtype":"U8","shape":[{len}],"data_offsets":[{offset},{}]}}"#,
            offset + len
        ));
        offset += len;
    }
    let json = format!("{{{}}}", entries.join(","));
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json.as_bytes());
    bytes.extend((0..offset).map(|i| fill ^ i as u8));
    std::fs::write(path, bytes).unwrap();
}

/// Two shards and an index naming them (the second through `./`).
fn model(dir: &Path) -> Vec<PathBuf> {
    write_shard(&dir.join("b.safetensors"), &[("x", 4096), ("y", 3)], 7);
    write_shard(&dir.join("a.safetensors"), &[("z", 100_000)], 9);
    let index = r#"{"metadata": {"total_size": 1}, "weight_map": {"x": "b.safetensors", "z": "./a.safetensors", "y": "b.safetensors"}}"#;
    std::fs::write(dir.join(INDEX_NAME), index).unwrap();
    vec![dir.join("b.safetensors"), dir.join("a.safetensors")]
}

fn host_bytes(loaded: &Loaded) -> Vec<u8> {
    let mut out = Vec::new();
    loaded.read_each(|b| out.extend_from_slice(b)).unwrap();
    out
}

#[test]
fn a_directory_an_index_and_a_file_resolve_to_their_shards() {
    let dir = tempfile::tempdir().unwrap();
    let shards = model(dir.path());
    let by_dir = Model::resolve(dir.path()).unwrap();
    assert_eq!(by_dir, Model::resolve(&dir.path().join(INDEX_NAME)).unwrap());
    // In the order of first mention; "./a.safetensors" is "a.safetensors".
    assert_eq!(by_dir.shards, shards);
    let map: Vec<(&str, &str)> =
        by_dir.weight_map.as_ref().unwrap().iter().map(|(t, s)| (t.as_str(), s.as_str())).collect();
    assert_eq!(map, [("x", "b.safetensors"), ("z", "a.safetensors"), ("y", "b.safetensors")]);
    let one = Model::resolve(&shards[1]).unwrap();
    assert_eq!((one.shards, one.weight_map), (vec![shards[1].clone()], None));
    std::fs::remove_file(dir.path().join(INDEX_NAME)).unwrap();
    let listed = Model::resolve(dir.path()).unwrap();
    assert_eq!(listed.shards, [shards[1].clone(), shards[0].clone()], "name order without an index");
}

#[test]
fn each_shard_loads_bit_exact_from_the_file_opened_before_the_load() {
    let dir = tempfile::tempdir().unwrap();
    let shards = model(dir.path());
    let before: Vec<Vec<u8>> = shards.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let open = Model::resolve(dir.path()).unwrap().open().unwrap();
    assert_eq!(open.owner.get("z"), Some(&1));
    // A shard replaced at its path once the model is open: the load reads
    // the file that was opened (and whose header was read), not this one.
    write_shard(&dir.path().join("new"), &[("x", 4096), ("y", 3)], 0x55);
    std::fs::rename(dir.path().join("new"), &shards[0]).unwrap();
    let loaded = open.load(&LoadOptions::default()).unwrap();
    assert_eq!(loaded.len(), 2);
    for (shard, bytes) in loaded.iter().zip(&before) {
        assert!(matches!(shard.loaded, Loaded::Host(_)));
        assert_eq!(&host_bytes(&shard.loaded), bytes, "{}", shard.path.display());
        assert_eq!(shard.report.bytes, bytes.len() as u64);
    }
    assert_eq!(loaded[0].header.tensors.len(), 2);
}

#[test]
fn an_index_that_is_a_fifo_or_too_large_is_refused_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    model(dir.path());
    let index = dir.path().join(INDEX_NAME);
    std::fs::remove_file(&index).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&index).status().unwrap();
    assert!(made.success());
    match Model::resolve(&index) {
        Err(Error::Io(e)) => assert_eq!(e.errno(), libc::EINVAL, "{e}"),
        other => panic!("a FIFO index: {other:?}"),
    }
    std::fs::remove_file(&index).unwrap();
    let file = std::fs::File::create(&index).unwrap();
    file.set_len(dmaload::format::model::MAX_INDEX_LEN + 1).unwrap(); // sparse
    let err = Model::resolve(dir.path()).unwrap_err().to_string();
    assert!(err.contains("the index exceeds the limit"), "{err}");
}
