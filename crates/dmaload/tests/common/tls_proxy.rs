//! A real TLS server in front of a plain one (Garage's S3 API has no TLS):
//! `tests/support/tls_proxy.py` (Python's `ssl`, OpenSSL) with a server
//! certificate for 127.0.0.1 and localhost, signed by a certificate
//! authority made for this run with the `openssl` CLI; a second authority,
//! which signed nothing, stands for an untrusted one. Killed when dropped.
//! Shared by the core's and the CLI's tests (`#[path]`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub struct TlsProxy {
    child: Child,
    dir: tempfile::TempDir,
    pub port: u16,
}

impl TlsProxy {
    /// A proxy to 127.0.0.1:`target_port`, or `None` (after saying SKIP
    /// for `test`) without `openssl` or `python3`.
    pub fn start(test: &str, target_port: u16) -> Option<TlsProxy> {
        let dir = tempfile::tempdir().unwrap();
        if let Err(why) = make_certificates(dir.path()) {
            eprintln!("SKIP {test}: {why}");
            return None;
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../dmaload/tests/support/tls_proxy.py");
        let spawned = Command::new("python3")
            .arg(script)
            .arg(dir.path().join("server.pem"))
            .arg(dir.path().join("server.key"))
            .arg(target_port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn();
        let Ok(mut child) = spawned else {
            eprintln!("SKIP {test}: no python3 to run the TLS proxy");
            return None;
        };
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| panic!("the TLS proxy said {line:?}"));
        Some(TlsProxy { child, dir, port })
    }

    /// The authority that signed the proxy's certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// An authority that signed nothing the proxy shows.
    pub fn stranger(&self) -> PathBuf {
        self.dir.path().join("stranger.pem")
    }

    /// Kills the proxy: its connections end mid-record.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `ca.pem`, `stranger.pem` and `server.pem`/`server.key` (signed by
/// `ca`, for IP 127.0.0.1 and DNS localhost) in `dir`.
fn make_certificates(dir: &Path) -> Result<(), String> {
    let openssl = |args: &[&str]| -> Result<(), String> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("no openssl CLI to make test certificates: {e}"))?;
        match out.status.success() {
            true => Ok(()),
            false => Err(format!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr))),
        }
    };
    let key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    for ca in ["ca", "stranger"] {
        let (key_file, pem, subject) =
            (format!("{ca}.key"), format!("{ca}.pem"), format!("/CN=dmaload test {ca}"));
        let args = [
            &["req", "-x509"][..],
            &key,
            &["-keyout", &key_file, "-out", &pem, "-days", "2", "-subj", &subject],
        ];
        openssl(&args.concat())?;
    }
    let args =
        [&["req"][..], &key, &["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]];
    openssl(&args.concat())?;
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName = IP:127.0.0.1, DNS:localhost\nbasicConstraints = critical, CA:FALSE\n\
         keyUsage = critical, digitalSignature\nextendedKeyUsage = serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ])
}
