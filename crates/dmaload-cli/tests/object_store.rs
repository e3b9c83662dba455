//! `dmaload load s3://BUCKET/KEY` against a real S3 server (a single-node
//! Garage, `crates/dmaload/tests/common/garage.rs`); SKIP without one.

#[path = "../../dmaload/tests/common/cuda_driver.rs"]
mod cuda_driver;
#[path = "../../dmaload/tests/common/garage.rs"]
mod garage;
#[path = "../../dmaload/tests/common/tls_proxy.rs"]
mod tls_proxy;

use std::process::Command;

use garage::{pattern, Garage};
use tls_proxy::TlsProxy;

fn dmaload(garage: &Garage, home: &std::path::Path, args: &[&str]) -> std::process::Output {
    dmaload_with(garage, home, args, &[])
}

/// [`dmaload`] under `strace -f` (each thread's `openat` calls), with the
/// times it opened `file`.
fn dmaload_opening(
    garage: &Garage,
    home: &std::path::Path,
    args: &[&str],
    file: &std::path::Path,
) -> (std::process::Output, usize) {
    let trace = home.join("openat.trace");
    let binary = env!("CARGO_BIN_EXE_dmaload");
    let strace = ["-f", "-qq", "-e", "trace=openat", "-o", trace.to_str().unwrap(), binary];
    let out = run_in_env("strace", garage, home, &[&strace[..], args].concat(), &[]);
    let text = std::fs::read_to_string(&trace).unwrap_or_default();
    let opened = format!("\"{}\"", file.display());
    (out, text.lines().filter(|line| line.contains(&opened)).count())
}

/// [`dmaload`] with `extra` settings over the server's.
fn dmaload_with(
    garage: &Garage,
    home: &std::path::Path,
    args: &[&str],
    extra: &[(&str, String)],
) -> std::process::Output {
    run_in_env(env!("CARGO_BIN_EXE_dmaload"), garage, home, args, extra)
}

/// `program` (dmaload, or a tracer running it) with `args`, in the
/// environment of [`dmaload_with`].
fn run_in_env(
    program: &str,
    garage: &Garage,
    home: &std::path::Path,
    args: &[&str],
    extra: &[(&str, String)],
) -> std::process::Output {
    Command::new(program)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        // No ~/.aws of the machine's: only the server's settings.
        .env("HOME", home)
        .envs(garage.env())
        .envs(extra.iter().map(|(k, v)| (k, v)))
        // The CUDA driver `cuda_driver` chose (the emulator, strict), if any.
        .envs(
            ["DMALOAD_LIBCUDA", "DMALOAD_EMU_STRICT"].iter().filter_map(|k| Some((k, std::env::var_os(k)?))),
        )
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

/// `dmaload load s3://BUCKET/KEY` from an `https://` endpoint (a TLS
/// server in front of Garage): the uploaded bytes' hash with the test
/// authority as `AWS_CA_BUNDLE`, and as `SSL_CERT_FILE` (the system's trust
/// roots, as OpenSSL finds them); with another authority there, an error
/// naming the host, the certificate's fault and the roots.
#[test]
fn dmaload_load_reads_an_object_over_https_with_the_trust_roots_of_the_environment() {
    let test = "dmaload_load_reads_an_object_over_https_with_the_trust_roots_of_the_environment";
    let Some(garage) = Garage::start(test) else { return };
    let Some(proxy) = TlsProxy::start(test, garage.s3_port) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((5 << 20) + 7, 13);
    garage.put("llama/model.safetensors", &body);
    let url = "s3://models/llama/model.safetensors";
    let endpoint = ("AWS_ENDPOINT_URL", proxy.endpoint());
    let ca = proxy.ca().display().to_string();
    for roots in [("AWS_CA_BUNDLE", ca.clone()), ("SSL_CERT_FILE", ca)] {
        let out = dmaload_with(
            &garage,
            home.path(),
            &["load", url, "--hash", "--json"],
            &[endpoint.clone(), roots],
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let expected = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&body));
        assert_eq!(report["hash"]["xxh3_64"], expected.as_str(), "{report}");
    }
    let stranger = ("SSL_CERT_FILE", proxy.stranger().display().to_string());
    let out = dmaload_with(&garage, home.path(), &["load", url], &[endpoint, stranger.clone()]);
    assert!(!out.status.success() && out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let refused = format!(
        "TLS handshake with 127.0.0.1:{} failed: invalid peer certificate: UnknownIssuer",
        proxy.port
    );
    assert!(stderr.contains(&refused), "{stderr}");
    assert!(stderr.contains(&format!("(trust roots: SSL_CERT_FILE={})", stranger.1)), "{stderr}");
    assert!(!stderr.contains(&garage.key.secret_key), "{stderr}");
}

/// `dmaload load s3://BUCKET/KEY --to cuda:0 --hash` receives the object
/// through the pinned staging ring into a device allocation, copies it
/// back and hashes it: the uploaded bytes' hash, whole (past one 16 MiB
/// slot, not a whole number of pages) and a range (`--offset`, `--length`);
/// the ring a large object pins is sized by the GETs in flight.
#[test]
fn dmaload_load_an_object_to_cuda_hashes_equal_to_the_uploaded_bytes() {
    let test = "dmaload_load_an_object_to_cuda_hashes_equal_to_the_uploaded_bytes";
    if let Err(reason) = cuda_driver::cuda_driver() {
        return eprintln!("SKIP {test}: {reason}");
    }
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((40 << 20) + 4093, 11);
    garage.put("big/model.bin", &body);
    let url = "s3://models/big/model.bin";
    let range = ["--offset", "4097", "--length", "20000001"];
    for (args, bytes) in [(&[][..], &body[..]), (&range[..], &body[4097..4097 + 20_000_001])] {
        let load = ["load", url, "--to", "cuda:0", "--hash", "--json"];
        let out = dmaload(&garage, home.path(), &[&load[..], args].concat());
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["bytes"], bytes.len() as u64, "{report}");
        assert_eq!(report["filesystem"], "s3", "{report}");
        assert!(report["destination"].as_str().unwrap().starts_with("cuda:0"), "{report}");
        assert_eq!(report["hash"]["xxh3_64"], xxh3(bytes).as_str(), "{report}");
    }
    // A larger object pins no more slots than its GETs in flight fill (8
    // connections of 8 MiB requests: 4 slots of 16 MiB, and 2 more), not
    // the 10 its 160 MiB would: each slot serves several gathers.
    let large = pattern((160 << 20) + 1, 12);
    garage.put("big/large.bin", &large);
    let args = ["load", "s3://models/big/large.bin", "--to", "cuda:0", "--hash", "--json"];
    let out = dmaload(&garage, home.path(), &args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["hash"]["xxh3_64"], xxh3(&large).as_str(), "{report}");
    let destination = report["destination"].as_str().unwrap();
    assert!(destination.ends_with("via staging ring (6 x 16777216 bytes)"), "{report}");
}

/// A safetensors file of F32 tensors (name, element count), its bytes
/// depending on the name and position.
fn safetensors(tensors: &[(&str, usize)], seed: u64) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, count) in tensors {
        let begin = data.len();
        data.extend(pattern(count * 4, seed ^ name.len() as u64));
        header.insert(
            (*name).to_owned(),
            serde_json::json!({"dtype": "F32", "shape": [count], "data_offsets": [begin, data.len()]}),
        );
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(data);
    bytes
}

fn xxh3(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

#[test]
fn dmaload_load_reads_a_sharded_model_by_prefix() {
    let Some(garage) = Garage::start("dmaload_load_reads_a_sharded_model_by_prefix") else { return };
    let home = tempfile::tempdir().unwrap();
    let shards = [
        ("model-00001-of-00002.safetensors", safetensors(&[("embed", 3 << 20), ("layer0.q", 1000)], 1)),
        ("model-00002-of-00002.safetensors", safetensors(&[("layer0.k", 17), ("head", 1 << 20)], 2)),
    ];
    let mut weight_map = serde_json::Map::new();
    for (name, body) in &shards {
        garage.put(&format!("llama/{name}"), body);
        let count = if name.contains("00001") { ["embed", "layer0.q"] } else { ["layer0.k", "head"] };
        for tensor in count {
            weight_map.insert(tensor.into(), serde_json::json!(name));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    garage.put("llama/model.safetensors.index.json", index.to_string().as_bytes());

    for url in ["s3://models/llama/", "s3://models/llama/model.safetensors.index.json"] {
        let out = dmaload(&garage, home.path(), &["load", url, "--hash", "--json"]);
        assert!(out.status.success(), "{url}: {}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["tensors"], 4, "{report}");
        let loaded = report["shards"].as_array().unwrap();
        assert_eq!(loaded.len(), 2, "{report}");
        for ((_, body), shard) in shards.iter().zip(loaded) {
            assert_eq!(shard["hash"]["xxh3_64"], xxh3(body).as_str(), "{report}");
        }
    }

    // A prefix without an index: its one model.safetensors, as a directory's.
    let single = safetensors(&[("w", 1 << 18)], 3);
    garage.put("tiny/model.safetensors", &single);
    let out = dmaload(&garage, home.path(), &["load", "s3://models/tiny/", "--hash", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["shards"][0]["hash"]["xxh3_64"], xxh3(&single).as_str(), "{report}");

    // A shard the index names that the store lacks: named, before any load.
    let broken =
        serde_json::json!({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "gone.safetensors"}});
    garage.put("llama/broken.safetensors.index.json", broken.to_string().as_bytes());
    let out = dmaload(&garage, home.path(), &["load", "s3://models/llama/broken.safetensors.index.json"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("s3://models/llama/gone.safetensors") && stderr.contains("does not exist"),
        "{stderr}"
    );

    // A prefix with neither: ENOENT naming the prefix.
    let out = dmaload(&garage, home.path(), &["load", "s3://models/nothing/"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("s3://models/nothing/") && stderr.contains("model.safetensors.index.json"),
        "{stderr}"
    );

    // A malformed header in an object: the file's error.
    let mut bad = single.clone();
    bad[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    garage.put("bad/model.safetensors", &bad);
    let out = dmaload(&garage, home.path(), &["load", "s3://models/bad/"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("s3://models/bad/model.safetensors: invalid safetensors file: header length"),
        "{stderr}"
    );
}

/// `dmaload load s3://BUCKET/DIR/ --to cuda:0 --hash`: each shard of a
/// sharded model in object storage goes through the core's device path for
/// objects (its header read first with a ranged GET, checked against the
/// index before any data moves), bit-exact on the device; a model whose
/// shards disagree with the index is refused before any shard is loaded.
#[test]
fn dmaload_load_a_sharded_object_model_to_cuda_hashes_equal_to_the_uploaded_shards() {
    let test = "dmaload_load_a_sharded_object_model_to_cuda_hashes_equal_to_the_uploaded_shards";
    if let Err(reason) = cuda_driver::cuda_driver() {
        return eprintln!("SKIP {test}: {reason}");
    }
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let shards = [
        ("model-00001-of-00002.safetensors", safetensors(&[("embed", 5 << 20), ("layer0.q", 1001)], 4)),
        ("model-00002-of-00002.safetensors", safetensors(&[("layer0.k", 19), ("head", 1 << 20)], 5)),
    ];
    let mut weight_map = serde_json::Map::new();
    for (name, body) in &shards {
        garage.put(&format!("gpu/{name}"), body);
        let tensors = if name.contains("00001") { ["embed", "layer0.q"] } else { ["layer0.k", "head"] };
        for tensor in tensors {
            weight_map.insert(tensor.into(), serde_json::json!(name));
        }
    }
    let index = serde_json::json!({"weight_map": weight_map});
    garage.put("gpu/model.safetensors.index.json", index.to_string().as_bytes());
    let out =
        dmaload(&garage, home.path(), &["load", "s3://models/gpu/", "--to", "cuda:0", "--hash", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["tensors"], 4, "{report}");
    let loaded = report["shards"].as_array().unwrap();
    assert_eq!(loaded.len(), 2, "{report}");
    for ((_, body), shard) in shards.iter().zip(loaded) {
        assert!(shard["destination"].as_str().unwrap().starts_with("cuda:0"), "{report}");
        assert_eq!(shard["bytes"], body.len() as u64, "{report}");
        assert_eq!(shard["hash"]["xxh3_64"], xxh3(body).as_str(), "{report}");
    }

    // An index that puts a tensor in a shard lacking it: refused from the
    // headers, naming the tensor, before any shard is loaded to the device.
    let wrong = serde_json::json!({"weight_map": {
        "embed": "model-00002-of-00002.safetensors",
        "layer0.q": "model-00001-of-00002.safetensors",
    }});
    garage.put("gpu/wrong.safetensors.index.json", wrong.to_string().as_bytes());
    let out = dmaload(
        &garage,
        home.path(),
        &["load", "s3://models/gpu/wrong.safetensors.index.json", "--to", "cuda:0"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("tensor 'embed'") && stderr.contains("no such tensor"), "{stderr}");
}

/// The sums line of `kind` (`dmaload sums`' own) for `body` named `name`.
fn sums_line(kind: dmaload::verify::DigestKind, name: &str, body: &[u8]) -> Vec<u8> {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), body).unwrap();
    let digest = dmaload::verify::file_digest(file.path(), kind).unwrap();
    dmaload::verify::sums_line(kind, &digest, name.as_bytes())
}

/// `dmaload load s3://... --verify` checks the object against the
/// `B3SUMS`/`SHA256SUMS` object beside it (under the key's "directory"),
/// as a file's sums file: into host memory and to `cuda:0`, whole objects
/// and the shards of a model; a digest that does not match, a sums object
/// that does not list the object, or none beside it, fails the load and
/// returns nothing; a range cannot be verified.
#[test]
fn dmaload_load_verify_checks_an_object_against_the_sums_object_beside_it() {
    use dmaload::verify::DigestKind::{Blake3, Sha256};
    let test = "dmaload_load_verify_checks_an_object_against_the_sums_object_beside_it";
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((9 << 20) + 3, 21);
    garage.put("v/model.bin", &body);
    let url = "s3://models/v/model.bin";
    let load = |args: &[&str]| dmaload(&garage, home.path(), &[&["load"][..], args].concat());
    let failed = |out: std::process::Output| {
        assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };

    // No sums object beside it: the file's error.
    let stderr = failed(load(&[url, "--verify"]));
    assert!(stderr.contains("no B3SUMS or SHA256SUMS beside it") && stderr.contains(url), "{stderr}");

    // SHA256SUMS lists it (as `./model.bin` too): verified.
    let mut sha = sums_line(Sha256, "model.bin", &body);
    sha.extend(sums_line(Sha256, "./model.bin", &body));
    garage.put("v/SHA256SUMS", &sha);
    let out = load(&[url, "--verify", "--hash", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["hash"]["xxh3_64"], xxh3(&body).as_str(), "{report}");
    let stderr = failed(load(&[url, "--verify", "--offset", "1"]));
    assert!(stderr.contains("cannot be checked against it"), "{stderr}");

    // B3SUMS (read first) records other bytes: a mismatch, nothing returned.
    let mut other = body.clone();
    other[body.len() - 5] ^= 1;
    garage.put("v/B3SUMS", &sums_line(Blake3, "model.bin", &other));
    let stderr = failed(load(&[url, "--verify"]));
    assert!(stderr.contains("BLAKE3 mismatch") && stderr.contains("s3://models/v/B3SUMS"), "{stderr}");
    // A B3SUMS that lists other objects only: not listed.
    garage.put("v/B3SUMS", &sums_line(Blake3, "another.bin", &body));
    garage.put("v/SHA256SUMS", &sums_line(Sha256, "another.bin", &body));
    let stderr = failed(load(&[url, "--verify"]));
    assert!(
        stderr.contains("\"model.bin\" is not listed in s3://models/v/B3SUMS or s3://models/v/SHA256SUMS"),
        "{stderr}"
    );

    // A model's shards, each against the sums beside it, here a line that
    // reaches it through a path in the bucket.
    let shard = safetensors(&[("w", 1 << 20), ("b", 3)], 22);
    garage.put("vm/model.safetensors", &shard);
    garage.put("vm/B3SUMS", &sums_line(Blake3, "sub/../model.safetensors", &shard));
    let out = load(&["s3://models/vm/", "--verify", "--hash", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["shards"][0]["hash"]["xxh3_64"], xxh3(&shard).as_str(), "{report}");

    if let Err(reason) = cuda_driver::cuda_driver() {
        return eprintln!("SKIP {test} (cuda:0): {reason}");
    }
    garage.put("v/B3SUMS", &sums_line(Blake3, "model.bin", &body));
    let out = load(&[url, "--verify", "--to", "cuda:0", "--hash", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["hash"]["xxh3_64"], xxh3(&body).as_str(), "{report}");
    garage.put("v/B3SUMS", &sums_line(Blake3, "model.bin", &other));
    let stderr = failed(load(&[url, "--verify", "--to", "cuda:0"]));
    assert!(stderr.contains("BLAKE3 mismatch"), "{stderr}");
    let out = load(&["s3://models/vm/", "--verify", "--to", "cuda:0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `dmaload load s3://BUCKET/KEY --cache SOCKET`: the service, which has
/// no keys of its own, reads the object with the client's grant once and
/// serves the next load from memory, into host memory and (on the CUDA
/// driver the tests chose: the emulator here) into the client's device
/// memory, which it copies into itself.
#[test]
fn dmaload_load_an_object_through_a_service_without_keys_is_read_once_then_a_hit() {
    let test = "dmaload_load_an_object_through_a_service_without_keys_is_read_once_then_a_hit";
    let cuda = cuda_driver::cuda_driver();
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let socket = home.path().join("cache.sock");
    let socket_arg = socket.to_str().unwrap();
    let body = pattern((3 << 20) + 5, 4);
    garage.put("cached/model.bin", &body);
    let mut service = Command::new(env!("CARGO_BIN_EXE_dmaload"))
        .args(["serve", "--socket", socket_arg])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home.path())
        .envs(
            ["DMALOAD_LIBCUDA", "DMALOAD_EMU_STRICT"].iter().filter_map(|k| Some((k, std::env::var_os(k)?))),
        )
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while dmaload::share::Connection::connect(&socket).is_err() {
        assert!(started.elapsed() < std::time::Duration::from_secs(60), "the service did not start");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let expected = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&body));
    let url = "s3://models/cached/model.bin";
    let mut loads = vec![("miss", vec![]), ("hit", vec![])];
    match &cuda {
        Ok(()) => loads.push(("hit", vec!["--to", "cuda:0"])),
        Err(reason) => eprintln!("SKIP {test} (to cuda:0): {reason}"),
    }
    for (served, to) in loads {
        let args = [&["load", url, "--cache", socket_arg, "--hash", "--json"][..], &to].concat();
        let out = dmaload(&garage, home.path(), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{to:?}: {stderr}");
        assert!(stderr.contains(&format!("from the cache service at {socket_arg} ({served})")), "{stderr}");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["hash"]["xxh3_64"], expected.as_str(), "{report}");
        if !to.is_empty() {
            let destination = report["destination"].as_str().unwrap();
            assert!(
                destination.starts_with("cuda:0") && destination.contains("via cache-service"),
                "{report}"
            );
        }
    }
    // A range is one load's, not the service's whole object.
    let args = ["load", url, "--cache", socket_arg, "--offset", "1"];
    let out = dmaload(&garage, home.path(), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("serves whole files"), "{stderr}");
    let _ = service.kill();
    let _ = service.wait();
}

/// `dmaload load s3://BUCKET/KEY --to udmabuf|dma-heap:system`: an object
/// goes into a dma-buf as a file does. Where the kernel has the producer
/// the dma-buf holds the object (tests/vm/ci.sh runs this in its guest);
/// where it has not, the error names the missing device, not the object.
#[test]
fn dmaload_load_an_object_into_a_dma_buf_holds_it_or_names_the_missing_producer() {
    let test = "dmaload_load_an_object_into_a_dma_buf_holds_it_or_names_the_missing_producer";
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((2 << 20) + 77, 5);
    garage.put("dmabuf/model.bin", &body);
    let expected = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&body));
    for (to, device) in [("udmabuf", "/dev/udmabuf"), ("dma-heap:system", "/dev/dma_heap/system")] {
        let args = ["load", "s3://models/dmabuf/model.bin", "--to", to, "--hash", "--json"];
        let out = dmaload(&garage, home.path(), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if std::path::Path::new(device).exists() {
            assert!(out.status.success(), "{stderr}");
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(report["hash"]["xxh3_64"], expected.as_str(), "{report}");
        } else {
            assert!(!out.status.success() && stderr.contains(device), "{to}: {stderr}");
            assert!(!stderr.contains("an object loads into"), "{to}: {stderr}");
        }
    }
}

/// A load that sets neither `--threads` nor `--chunk-size` tunes its GETs
/// (docs/object-storage.md, "Connections and request size"): the report
/// names the connections and request size it kept, the tuning file
/// remembers them for the endpoint, and the next load starts from that
/// line (a garbled one is ignored; `--threads` is a fixed count).
#[test]
fn dmaload_load_without_threads_tunes_its_gets_and_remembers_them_for_the_endpoint() {
    let test = "dmaload_load_without_threads_tunes_its_gets_and_remembers_them_for_the_endpoint";
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    // Six windows of 64 MiB: a warm-up and a trial fit.
    let body = pattern(384 << 20, 11);
    garage.put("big.bin", &body);
    garage.put("small.bin", &body[..24 << 20]);
    let load = |key: &str, extra: &[&str]| {
        let url = format!("s3://models/{key}");
        let out = dmaload(&garage, home.path(), &[&["load", url.as_str(), "--json"], extra].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let used = |field: &str| report[field].as_u64().unwrap();
        (used("queue_depth"), used("request_size"), used("tuning_windows"))
    };
    let tuning = home.path().join(".cache/dmaload/tuning");
    let (connections, request, windows) = load("big.bin", &[]);
    let endpoint = format!("s3 127.0.0.1:{}", garage.s3_port);
    let line = format!("{endpoint} connections={connections} request={request}");
    assert!(windows > 4, "a warm-up and a trial measured: {windows} windows");
    let text = std::fs::read_to_string(&tuning).unwrap();
    assert!(text.lines().any(|l| l == line), "{line:?} not in {text:?}");

    // A load too short to tune runs at the remembered line's values.
    std::fs::write(&tuning, format!("{endpoint} connections=3 request=2097152\n")).unwrap();
    assert_eq!(load("small.bin", &[]), (3, 2 << 20, 0));
    assert_eq!(load("small.bin", &["--threads", "5"]), (5, 8 << 20, 0), "a fixed count");
    std::fs::write(&tuning, format!("{endpoint} connections=banana request=2097152\n")).unwrap();
    assert_eq!(load("small.bin", &[]), (8, 8 << 20, 0), "a garbled line is ignored");
}

#[test]
fn dmaload_load_of_an_object_reads_the_tuning_file_once() {
    let test = "dmaload_load_of_an_object_reads_the_tuning_file_once";
    if Command::new("strace").arg("-V").output().is_err() {
        return eprintln!("SKIP {test}: no strace");
    }
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((3 << 20) + 5, 13);
    garage.put("model.bin", &body);
    let tuning = home.path().join(".cache/dmaload/tuning");
    std::fs::create_dir_all(tuning.parent().unwrap()).unwrap();
    let line = format!("s3 127.0.0.1:{} connections=3 request=2097152\n", garage.s3_port);
    std::fs::write(&tuning, &line).unwrap();
    let load = |extra: &[&str]| {
        let args = [&["load", "s3://models/model.bin", "--json", "--hash"][..], extra].concat();
        let (out, opened) = dmaload_opening(&garage, home.path(), &args, &tuning);
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["hash"]["xxh3_64"], xxh3(&body).as_str(), "{report}");
        assert_eq!(report["queue_depth"], 3, "the remembered count: {report}");
        opened
    };
    assert_eq!(load(&[]), 1, "a load into host memory reads the tuning file once");
    match cuda_driver::cuda_driver() {
        // The ring is sized from the file before the load, which reads it
        // once for itself (not once per stage of its pipeline as well).
        Ok(()) => assert_eq!(load(&["--to", "cuda:0"]), 2, "a load through a staging ring"),
        Err(reason) => eprintln!("SKIP {test} (to cuda:0): {reason}"),
    }
    assert_eq!(std::fs::read_to_string(&tuning).unwrap(), line, "nothing new to remember");
}

/// [`dmaload`] with the server's endpoint and region but none of its keys
/// in the environment (nor the metadata service of the machine's): the
/// keys come from the sources `extra` names.
fn dmaload_keyless(
    garage: &Garage,
    home: &std::path::Path,
    args: &[&str],
    extra: &[(&str, String)],
) -> std::process::Output {
    let server =
        garage.env().into_iter().filter(|(k, _)| k.starts_with("AWS_ENDPOINT") || *k == "AWS_REGION");
    Command::new(env!("CARGO_BIN_EXE_dmaload"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .envs(server)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .envs(extra.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap()
}

/// A stand-in credentials endpoint on 127.0.0.1 (an ECS/EKS agent, an
/// instance metadata service): each request's line and headers go to
/// `answer`, whose status and body are sent back; every request line is
/// logged. It serves until the test process ends.
fn stand_in(
    answer: impl Fn(&str, &dyn Fn(&str) -> Option<String>) -> (u16, String) + Send + 'static,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let logged = log.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let mut stream = stream.unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut lines = Vec::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                lines.push(line.trim_end().to_owned());
            }
            let Some(request) = lines.first().cloned() else { continue };
            let header = |name: &str| {
                lines[1..].iter().find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
                })
            };
            let (status, body) = answer(&request, &header);
            logged.lock().unwrap().push(format!("{request} -> {status}"));
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(reply.as_bytes());
        }
    });
    (url, log)
}

/// Garage's keys in AWS's JSON shape (no session token), after the
/// fields `extra` names.
fn keys_json(garage: &Garage, extra: &str) -> String {
    format!(
        r#"{{{extra}"AccessKeyId": "{}", "SecretAccessKey": "{}", "Expiration": "2999-01-01T00:00:00Z"}}"#,
        garage.key.access_key, garage.key.secret_key
    )
}

/// A profile's `credential_process` (docs/object-storage.md,
/// "Configuration"): run without a shell, its path and an argument quoted
/// for their spaces, its JSON's keys sign the load; a process that fails
/// or prints no JSON fails the load with a message naming the profile and
/// the program (its stderr too), never the secret.
#[test]
fn dmaload_load_signs_with_the_keys_of_the_profiles_credential_process() {
    let test = "dmaload_load_signs_with_the_keys_of_the_profiles_credential_process";
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((1 << 20) + 3, 21);
    garage.put("process/model.bin", &body);
    let bin = home.path().join("my tools");
    std::fs::create_dir_all(home.path().join(".aws")).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    let script = |name: &str, text: String| {
        let path = bin.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{text}")).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        path.display().to_string()
    };
    let good = script(
        "creds.sh",
        format!(
            "[ \"$1\" = --role ] && [ \"$2\" = 'a b' ] || exit 3\ncat <<'END'\n{}\nEND\n",
            keys_json(&garage, r#""Version": 1, "#)
        ),
    );
    let denied = script("denied.sh", "echo 'denied by policy' >&2\nexit 1\n".into());
    let garbage = script("garbage.sh", format!("echo 'SecretAccessKey={}'\n", garage.key.secret_key));
    std::fs::write(
        home.path().join(".aws/config"),
        format!(
            "[default]\ncredential_process = \"{good}\" --role \"a b\"\n\
             [profile denied]\ncredential_process = \"{denied}\"\n\
             [profile garbage]\ncredential_process = \"{garbage}\"\n"
        ),
    )
    .unwrap();
    let url = "s3://models/process/model.bin";
    let out = dmaload_keyless(&garage, home.path(), &["load", url, "--hash", "--json"], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["hash"]["xxh3_64"], xxh3(&body).as_str(), "{report}");

    for (profile, says) in [("denied", "exit status: 1: denied by policy"), ("garbage", "no JSON object")] {
        let out = dmaload_keyless(&garage, home.path(), &["load", url], &[("AWS_PROFILE", profile.into())]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        let program = bin.join(format!("{profile}.sh"));
        let named = format!("credential_process of profile {profile} ({})", program.display());
        assert!(stderr.contains(&named) && stderr.contains(says), "{stderr}");
        assert!(!stderr.contains(&garage.key.secret_key), "{stderr}");
    }
}

/// Container credentials (ECS, EKS Pod Identity): the keys a stand-in agent
/// on `AWS_CONTAINER_CREDENTIALS_FULL_URI` serves only with the token of
/// `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE` (or `..._TOKEN`) as the
/// `Authorization` header sign the load; a wrong token fails it, naming
/// the URI and the agent's answer.
#[test]
fn dmaload_load_signs_with_container_credentials_sent_for_the_authorization_token() {
    let test = "dmaload_load_signs_with_container_credentials_sent_for_the_authorization_token";
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((1 << 20) + 5, 22);
    garage.put("container/model.bin", &body);
    let keys = keys_json(&garage, r#""RoleArn": "arn:aws:iam::1:role/r", "#);
    let (agent, log) = stand_in(move |request, header| match header("authorization").as_deref() {
        Some("pod-identity-token") if request.starts_with("GET /v1/credentials ") => (200, keys.clone()),
        _ => (401, "{}".into()),
    });
    let token_file = home.path().join("eks-pod-identity-token");
    std::fs::write(&token_file, "pod-identity-token\n").unwrap();
    let uri = ("AWS_CONTAINER_CREDENTIALS_FULL_URI", format!("{agent}/v1/credentials"));
    let url = "s3://models/container/model.bin";
    let load = |auth: (&str, String)| {
        dmaload_keyless(&garage, home.path(), &["load", url, "--hash", "--json"], &[uri.clone(), auth])
    };
    for auth in [
        ("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", token_file.display().to_string()),
        ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "pod-identity-token".to_owned()),
    ] {
        let out = load(auth);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["hash"]["xxh3_64"], xxh3(&body).as_str(), "{report}");
    }
    let out = load(("AWS_CONTAINER_AUTHORIZATION_TOKEN", "stolen".to_owned()));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let named = format!(
        "container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI={agent}/v1/credentials): HTTP 401"
    );
    assert!(stderr.contains(&named), "{stderr}");
    let log = log.lock().unwrap();
    assert_eq!(log.iter().filter(|l| l.ends_with("-> 200")).count(), 2, "{log:?}");
}

/// The EC2 instance metadata service (IMDSv2), asked when nothing else gave
/// keys: a session token from `PUT /latest/api/token` (with its TTL
/// header), then the role's name and its keys, each `GET` with the token
/// (the stand-in at `AWS_EC2_METADATA_SERVICE_ENDPOINT` refuses any request
/// without); `AWS_EC2_METADATA_DISABLED=true` leaves it unasked.
#[test]
fn dmaload_load_signs_with_the_instance_roles_keys_from_imdsv2() {
    let test = "dmaload_load_signs_with_the_instance_roles_keys_from_imdsv2";
    let Some(garage) = Garage::start(test) else { return };
    let home = tempfile::tempdir().unwrap();
    let body = pattern((1 << 20) + 7, 23);
    garage.put("imds/model.bin", &body);
    let keys = keys_json(&garage, r#""Code": "Success", "Type": "AWS-HMAC", "#);
    let (imds, log) = stand_in(move |request, header| {
        let token = header("x-aws-ec2-metadata-token");
        match request.split(' ').take(2).collect::<Vec<_>>()[..] {
            ["PUT", "/latest/api/token"] if header("x-aws-ec2-metadata-token-ttl-seconds").is_some() => {
                (200, "session-token".into())
            }
            ["GET", path] if token.as_deref() == Some("session-token") => {
                match path.strip_prefix("/latest/meta-data/iam/security-credentials/") {
                    Some("") => (200, "dmaload-role\n".into()),
                    Some("dmaload-role") => (200, keys.clone()),
                    _ => (404, String::new()),
                }
            }
            _ => (401, String::new()),
        }
    });
    let url = "s3://models/imds/model.bin";
    let endpoint = ("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.clone());
    let enabled = ("AWS_EC2_METADATA_DISABLED", "false".to_owned());
    let out = dmaload_keyless(
        &garage,
        home.path(),
        &["load", url, "--hash", "--json"],
        &[endpoint.clone(), enabled],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["hash"]["xxh3_64"], xxh3(&body).as_str(), "{report}");
    let asked = log.lock().unwrap().clone();
    assert_eq!(
        asked,
        [
            "PUT /latest/api/token HTTP/1.1 -> 200",
            "GET /latest/meta-data/iam/security-credentials/ HTTP/1.1 -> 200",
            "GET /latest/meta-data/iam/security-credentials/dmaload-role HTTP/1.1 -> 200",
        ]
    );
    // Disabled: unasked, and the load goes unsigned (refused by the bucket).
    let out = dmaload_keyless(&garage, home.path(), &["load", url], &[endpoint]);
    assert!(!out.status.success());
    assert_eq!(log.lock().unwrap().len(), 3);
}
