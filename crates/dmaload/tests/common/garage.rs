//! A real S3 server for tests: a single-node Garage on 127.0.0.1 with a
//! generated configuration in a temporary directory, a bucket and a key,
//! objects uploaded with a signed PUT, killed when dropped. Garage is found
//! through `$DMALOAD_GARAGE`, else `~/.cache/dmaload/garage-2.5.0/bin/garage`
//! (where `.ci/run` builds it), else `garage` on the PATH. Shared by the
//! core's and the CLI's tests (`#[path]`), which each use part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dmaload::object::config::{Addressing, Config, Credentials, Endpoint};
use dmaload::object::{sigv4, Object, ObjectUrl};
use dmaload::CancelToken;

pub const BUCKET: &str = "models";

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
pub struct Garage {
    bin: PathBuf,
    dir: tempfile::TempDir,
    pub child: Child,
    pub s3_port: u16,
    pub key: Credentials,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Garage {
    /// Starts one, or `None` (after saying SKIP for `test`) without a binary.
    pub fn start(test: &str) -> Option<Garage> {
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
            key: Credentials {
                access_key: String::new(),
                secret_key: String::new(),
                session_token: None,
                source: "the test's Garage key".into(),
            },
        };
        garage.set_up();
        Some(garage)
    }

    pub fn cli(&self, args: &[&str]) -> String {
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
        // Up once `garage status` reaches it over RPC (as Garage's own tests wait).
        let started = Instant::now();
        loop {
            let status = Command::new(&self.bin)
                .arg("-c")
                .arg(self.dir.path().join("garage.toml"))
                .arg("status")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap();
            if status.success() {
                break;
            }
            let log = || std::fs::read_to_string(self.dir.path().join("garage.log")).unwrap_or_default();
            assert!(started.elapsed() < Duration::from_secs(60), "garage did not start:\n{}", log());
            std::thread::sleep(Duration::from_millis(200));
        }
        let id = self.cli(&["node", "id", "-q"]);
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

    pub fn config_with(&self, key: Credentials) -> Config {
        Config {
            credentials: Some(key),
            region: "garage".into(),
            endpoint: Endpoint::parse(&format!("http://127.0.0.1:{}", self.s3_port)).unwrap(),
            addressing: Addressing::Path,
            timeout: Duration::from_secs(10),
            retry_for: Duration::from_secs(10),
            ca_bundle: None,
            proxies: Default::default(),
        }
    }

    pub fn config(&self) -> Config {
        self.config_with(self.key.clone())
    }

    /// The environment a front end (the CLI, Python) finds this server,
    /// its keys and region in.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", self.key.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.key.secret_key.clone()),
            ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{}", self.s3_port)),
            ("AWS_REGION", "garage".into()),
        ]
    }

    pub fn open(&self, key: &str) -> dmaload::Result<Object> {
        self.open_with(key, self.config())
    }

    pub fn open_with(&self, key: &str, config: Config) -> dmaload::Result<Object> {
        let url = ObjectUrl { bucket: BUCKET.into(), key: key.into() };
        Object::with_config(url, config, &CancelToken::new())
    }

    /// Uploads `body` as `key` with one signed PUT (retried while the new
    /// layout settles).
    pub fn put(&self, key: &str, body: &[u8]) {
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
            let mut response = Vec::new();
            let sent = TcpStream::connect(&host).and_then(|mut stream| {
                stream.write_all(head.as_bytes())?;
                stream.write_all(body)?;
                stream.read_to_end(&mut response)
            });
            let response = format!("{sent:?} {}", String::from_utf8_lossy(&response));
            if response.starts_with("Ok(") && response.contains(" HTTP/1.1 200") {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "PUT {key}: {response}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn signal(&self, signal: &str) {
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
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
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
