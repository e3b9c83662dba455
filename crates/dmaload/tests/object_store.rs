//! Loads from a real S3 server: each test starts a single-node Garage on
//! 127.0.0.1 with a generated configuration in a temporary directory,
//! creates a bucket and a key, uploads objects with a signed PUT, and
//! stops it at the end. Garage is found through `$DMALOAD_GARAGE`, else
//! `~/.cache/dmaload/garage-2.5.0/bin/garage` (where `.ci/run` builds it),
//! else `garage` on the PATH; without it each test says SKIP.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmaload::object::config::{Addressing, Config, Credentials, Endpoint};
use dmaload::object::{sigv4, Object, ObjectUrl};
use dmaload::{CancelToken, ErrorKind, LoadOptions, Loaded};

const BUCKET: &str = "models";

fn garage_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("DMALOAD_GARAGE") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    let home = std::env::var_os("HOME").map(PathBuf::from)?;
    let cached = home.join(".cache/dmaload/garage-2.5.0/bin/garage");
    if cached.is_file() {
        return Some(cached);
    }
    let on_path = std::env::var_os("PATH")?;
    std::env::split_paths(&on_path).map(|dir| dir.join("garage")).find(|p| p.is_file())
}

/// A single-node Garage, killed when dropped.
struct Garage {
    bin: PathBuf,
    dir: tempfile::TempDir,
    child: Child,
    s3_port: u16,
    key: Credentials,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Garage {
    /// Starts one, or `None` (after saying SKIP for `test`) without a binary.
    fn start(test: &str) -> Option<Garage> {
        let Some(bin) = garage_binary() else {
            eprintln!(
                "SKIP {test}: no garage binary (set DMALOAD_GARAGE, or see README: object storage tests)"
            );
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let (rpc_port, s3_port) = (free_port(), free_port());
        let secret: String = (0..32).map(|_| format!("{:02x}", rand_byte())).collect();
        let config = format!(
            "metadata_dir = \"{d}/meta\"\ndata_dir = \"{d}/data\"\ndb_engine = \"sqlite\"\n\
             replication_factor = 1\nrpc_bind_addr = \"127.0.0.1:{rpc_port}\"\n\
             rpc_public_addr = \"127.0.0.1:{rpc_port}\"\nrpc_secret = \"{secret}\"\n\n\
             [s3_api]\ns3_region = \"garage\"\napi_bind_addr = \"127.0.0.1:{s3_port}\"\n",
            d = dir.path().display()
        );
        std::fs::write(dir.path().join("garage.toml"), config).unwrap();
        let log = std::fs::File::create(dir.path().join("garage.log")).unwrap();
        let child = Command::new(&bin)
            .arg("-c")
            .arg(dir.path().join("garage.toml"))
            .arg("server")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start garage");
        let mut garage = Garage {
            bin,
            dir,
            child,
            s3_port,
            key: Credentials { access_key: String::new(), secret_key: String::new(), session_token: None },
        };
        garage.set_up();
        Some(garage)
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(&self.bin)
            .arg("-c")
            .arg(self.dir.path().join("garage.toml"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "garage {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.path().join("garage.log")).unwrap_or_default()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn set_up(&mut self) {
        let started = Instant::now();
        let id = loop {
            let out = Command::new(&self.bin)
                .arg("-c")
                .arg(self.dir.path().join("garage.toml"))
                .args(["node", "id", "-q"])
                .output()
                .unwrap();
            if out.status.success() {
                break String::from_utf8(out.stdout).unwrap();
            }
            assert!(started.elapsed() < Duration::from_secs(60), "garage did not start");
            std::thread::sleep(Duration::from_millis(200));
        };
        let id = id.trim().split('@').next().unwrap().to_owned();
        self.cli(&["layout", "assign", "-z", "dc1", "-c", "1G", &id]);
        self.cli(&["layout", "apply", "--version", "1"]);
        self.cli(&["bucket", "create", BUCKET]);
        let key: serde_json::Value =
            serde_json::from_str(&self.cli(&["json-api", "CreateKey", r#"{"name":"dmaload"}"#])).unwrap();
        self.key.access_key = key["accessKeyId"].as_str().unwrap().to_owned();
        self.key.secret_key = key["secretAccessKey"].as_str().unwrap().to_owned();
        self.cli(&["bucket", "allow", "--read", "--write", "--owner", BUCKET, "--key", "dmaload"]);
    }

    fn config_with(&self, key: Credentials) -> Config {
        Config {
            credentials: Some(key),
            region: "garage".into(),
            endpoint: Endpoint::parse(&format!("http://127.0.0.1:{}", self.s3_port)).unwrap(),
            addressing: Addressing::Path,
            timeout: Duration::from_secs(10),
            retry_for: Duration::from_secs(10),
        }
    }

    fn config(&self) -> Config {
        self.config_with(self.key.clone())
    }

    fn open(&self, key: &str) -> dmaload::Result<Object> {
        self.open_with(key, self.config())
    }

    fn open_with(&self, key: &str, config: Config) -> dmaload::Result<Object> {
        let url = ObjectUrl { bucket: BUCKET.into(), key: key.into() };
        Object::with_config(url, config, &CancelToken::new())
    }

    /// Uploads `body` as `key` with one signed PUT (retried while the new
    /// layout settles).
    fn put(&self, key: &str, body: &[u8]) {
        let host = format!("127.0.0.1:{}", self.s3_port);
        let path = format!("/{BUCKET}/{}", sigv4::uri_encode(key, true));
        let started = Instant::now();
        loop {
            let headers = [("host", host.clone()), ("content-length", body.len().to_string())];
            let hash = sigv4::sha256_hex(body);
            let request = sigv4::Request {
                method: "PUT",
                path: &path,
                query: "",
                headers: &headers,
                payload_sha256: &hash,
            };
            let signed = sigv4::sign(&request, &self.key, "garage", &sigv4::Stamp::now());
            let mut head = format!("PUT {path} HTTP/1.1\r\nconnection: close\r\n");
            for (name, value) in
                headers.iter().map(|(k, v)| (*k, v)).chain(signed.iter().map(|(k, v)| (*k, v)))
            {
                head += &format!("{name}: {value}\r\n");
            }
            head += "\r\n";
            let mut stream = TcpStream::connect(&host).unwrap();
            stream.write_all(head.as_bytes()).unwrap();
            stream.write_all(body).unwrap();
            let mut response = Vec::new();
            stream.read_to_end(&mut response).unwrap();
            let response = String::from_utf8_lossy(&response);
            if response.starts_with("HTTP/1.1 200") {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "PUT {key}: {response}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status();
        assert!(status.unwrap().success());
    }
}

impl Drop for Garage {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rand_byte() -> u8 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish() as u8
}

/// `len` bytes of a fixed pseudo-random pattern (xorshift) from `seed`.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn host_bytes(loaded: Loaded) -> Vec<u8> {
    match loaded {
        Loaded::Host(buffer) => buffer.to_vec(),
        other => panic!("not a host buffer: {other:?}"),
    }
}

#[test]
fn an_object_loads_bit_exact_whole_and_in_ranges() {
    let Some(garage) = Garage::start("an_object_loads_bit_exact_whole_and_in_ranges") else { return };
    let body = pattern((9 << 20) + 12_345, 7);
    garage.put("dir/model.bin", &body);
    let object = garage.open("dir/model.bin").unwrap();
    assert_eq!(object.size, body.len() as u64);
    // The defaults, and many small GETs in flight on a few connections.
    let small = LoadOptions { chunk_size: 1 << 20, threads: 3, ..LoadOptions::default() };
    for options in [LoadOptions::default(), small] {
        let (loaded, report) = dmaload::load_object(&object, 0, None, &options).unwrap();
        assert_eq!(report.bytes, body.len() as u64);
        assert!(host_bytes(loaded) == body, "the loaded bytes differ from the object's");
        let (loaded, _) = dmaload::load_object(&object, 1_000_003, Some(3_333_333), &options).unwrap();
        assert!(host_bytes(loaded) == body[1_000_003..4_333_336]);
    }
    let (loaded, _) =
        dmaload::load_object(&object, body.len() as u64, None, &LoadOptions::default()).unwrap();
    assert!(host_bytes(loaded).is_empty());
    // Past the end: refused before any GET, naming the object's size.
    let err = dmaload::load_object(&object, 5, Some(body.len() as u64), &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Truncated);
    assert!(err.to_string().contains(&format!("object ({} bytes)", body.len())), "{err}");
}

#[test]
fn an_object_replaced_after_it_was_opened_is_changed_and_nothing_is_returned() {
    let Some(garage) = Garage::start("an_object_replaced_after_it_was_opened_is_changed") else { return };
    garage.put("model.bin", &pattern(3 << 20, 1));
    let object = garage.open("model.bin").unwrap();
    // Same size, other bytes: only the ETag tells.
    garage.put("model.bin", &pattern(3 << 20, 2));
    let err = dmaload::load_object(&object, 0, None, &LoadOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Changed, "{err}");
    let message = err.to_string();
    assert!(message.contains("HTTP 412") && message.contains("bucket models, key model.bin"), "{message}");
}

#[test]
fn wrong_credentials_are_refused_without_showing_the_secret() {
    let Some(garage) = Garage::start("wrong_credentials_are_refused") else { return };
    garage.put("model.bin", b"bytes");
    let wrong = Credentials { secret_key: "not-the-secret-0123456789".into(), ..garage.key.clone() };
    let err = garage.open_with("model.bin", garage.config_with(wrong)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    let message = err.to_string();
    assert!(message.contains("HTTP 403") && message.contains("AWS_SECRET_ACCESS_KEY"), "{message}");
    assert!(!message.contains("not-the-secret") && !message.contains(&garage.key.secret_key), "{message}");
}

#[test]
fn a_missing_key_or_bucket_is_not_found() {
    let Some(garage) = Garage::start("a_missing_key_or_bucket_is_not_found") else { return };
    let err = garage.open("no/such/key").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    assert!(err.to_string().contains("bucket models, key no/such/key"), "{err}");
    let url = ObjectUrl { bucket: "no-such-bucket".into(), key: "k".into() };
    let err = Object::with_config(url, garage.config(), &CancelToken::new()).unwrap_err();
    // Garage refuses a bucket the key has no access to as it does a missing one.
    assert!(matches!(err.raw_os_error(), Some(libc::ENOENT | libc::EACCES)), "{err}");
    assert!(err.to_string().contains("no-such-bucket"), "{err}");
}

#[test]
fn a_server_that_stops_answering_fails_the_load_in_bounded_time() {
    let Some(garage) = Garage::start("a_server_that_stops_answering") else { return };
    garage.put("model.bin", &pattern(1 << 20, 3));
    let config =
        Config { timeout: Duration::from_millis(500), retry_for: Duration::from_secs(2), ..garage.config() };
    let object = garage.open_with("model.bin", config).unwrap();
    garage.signal("STOP");
    let result = dmaload::load_object(&object, 0, None, &LoadOptions::default());
    garage.signal("CONT");
    let err = result.unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(err.to_string().contains("sent nothing"), "{err}");
}

#[test]
fn a_server_killed_during_the_load_fails_it_and_returns_nothing() {
    let Some(mut garage) = Garage::start("a_server_killed_during_the_load") else { return };
    let len = 48 << 20;
    garage.put("model.bin", &pattern(len, 4));
    let config =
        Config { timeout: Duration::from_secs(2), retry_for: Duration::from_secs(2), ..garage.config() };
    let object = garage.open_with("model.bin", config).unwrap();
    // Killed from the first progress report, while GETs are in flight: one
    // connection and 1 MiB requests leave most of the object to come.
    let pid = garage.child.id();
    let killed = Arc::new(AtomicBool::new(false));
    let flag = killed.clone();
    let progress = Arc::new(move |done: u64, total: u64| {
        if done < total && !flag.swap(true, Ordering::SeqCst) {
            let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
        }
    });
    let options =
        LoadOptions { chunk_size: 1 << 20, threads: 1, progress: Some(progress), ..LoadOptions::default() };
    let result = dmaload::load_object(&object, 0, None, &options);
    let _ = garage.child.wait();
    if !killed.load(Ordering::SeqCst) {
        return eprintln!(
            "SKIP a_server_killed_during_the_load: the load ended before its first progress report"
        );
    }
    let err = result.unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(err.to_string().contains("gave up after"), "{err}");
    // Gone before the load: the same clear error.
    let err = dmaload::load_object(&object, 0, None, &LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains("connect to 127.0.0.1"), "{err}");
}
