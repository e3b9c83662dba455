//! `dmaload serve` and `dmaload load --cache`, as a user runs them: the
//! service in its own process on the default socket, clients as fresh
//! processes, SIGTERM and SIGINT stopping it cleanly.

mod common;

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::dmaload;
use serde_json::Value;

fn write_file(path: &Path, len: usize) {
    let bytes: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(path, bytes).unwrap();
}

/// A `dmaload serve` process, killed if a test fails before stopping it.
struct Serving(Option<Child>);

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `dmaload serve` with `$XDG_RUNTIME_DIR` set to `runtime`, waiting
/// until its default socket answers.
fn serve(runtime: &Path, args: &[&str]) -> Serving {
    let child = dmaload()
        .arg("serve")
        .args(args)
        .env("XDG_RUNTIME_DIR", runtime)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let serving = Serving(Some(child));
    let socket = runtime.join("dmaload.sock");
    let started = Instant::now();
    while dmaload::share::Connection::connect(&socket).is_err() {
        assert!(started.elapsed() < Duration::from_secs(60), "the service did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    serving
}

fn load_cached(runtime: &Path, file: &Path, extra: &[&str]) -> Output {
    let out = dmaload()
        .args(["load", "--json", "--hash"])
        .arg(file)
        .args(extra)
        .env("XDG_RUNTIME_DIR", runtime)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap()
}

fn stop(mut serving: Serving, signal: &str) -> String {
    let mut child = serving.0.take().unwrap();
    let status = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    let mut log = String::new();
    child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(exit.success(), "{signal} is a clean stop: {exit:?}\n{log}");
    log
}

#[test]
fn a_second_process_is_served_from_memory_and_sigterm_stops_the_service() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("runtime");
    let file = dir.path().join("model.bin");
    write_file(&file, 3 << 20);
    let service = serve(&runtime, &["--memory-limit", "64M"]);
    let socket = runtime.join("dmaload.sock");
    assert_eq!(std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(&runtime).unwrap().permissions().mode() & 0o777, 0o700);

    let direct = json(&load_cached(&runtime, &file, &[]));
    let first = load_cached(&runtime, &file, &["--cache"]);
    let second = load_cached(&runtime, &file, &["--cache"]);
    assert!(String::from_utf8_lossy(&first.stderr).contains("(miss)"));
    assert!(String::from_utf8_lossy(&second.stderr).contains("(hit)"));
    for out in [&first, &second] {
        let report = json(out);
        assert_eq!(report["hash"]["xxh3_64"], direct["hash"]["xxh3_64"], "bit-exact");
        assert!(report["destination"].as_str().unwrap().starts_with("cache-service"));
    }
    // DMALOAD_CACHE=1 asks for the default socket too.
    let env = dmaload()
        .args(["load", "--json"])
        .arg(&file)
        .env("XDG_RUNTIME_DIR", &runtime)
        .env("DMALOAD_CACHE", "1")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&env.stderr).contains("(hit)"));

    let status =
        dmaload().args(["serve", "--status", "--json"]).env("XDG_RUNTIME_DIR", &runtime).output().unwrap();
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!((status["misses"].as_u64(), status["hits"].as_u64()), (Some(1), Some(2)), "{status}");
    assert_eq!(status["files"][0]["path"].as_str().unwrap(), file.to_str().unwrap());
    let text = dmaload().args(["serve", "--status"]).env("XDG_RUNTIME_DIR", &runtime).output().unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("2 hits, 1 misses"));

    let log = stop(service, "-TERM");
    assert_eq!(log.matches(": get ").count(), 3, "one line per request:\n{log}");
    assert!(log.contains("stopped by signal 15"), "{log}");
    assert!(!socket.exists(), "the socket is removed on a clean stop");

    // No service now: a direct load, and the reason said.
    let out = load_cached(&runtime, &file, &["--cache"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no cache service"));
    assert_eq!(json(&out)["hash"]["xxh3_64"], direct["hash"]["xxh3_64"]);
}

#[test]
fn sigint_stops_the_service_and_a_range_is_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("runtime");
    let file = dir.path().join("model.bin");
    write_file(&file, 1 << 20);
    let service = serve(&runtime, &["--memory-limit", "10%"]);
    let out = dmaload()
        .args(["load", "--cache", "--offset", "4096"])
        .arg(&file)
        .env("XDG_RUNTIME_DIR", &runtime)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("whole files"));
    // DMALOAD_CACHE in the environment leaves a range to a direct load.
    let out = dmaload()
        .args(["load", "--json", "--offset", "4096"])
        .arg(&file)
        .env("XDG_RUNTIME_DIR", &runtime)
        .env("DMALOAD_CACHE", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("whole files"));
    assert_eq!(json(&out)["bytes"], (1 << 20) - 4096);
    let second = dmaload().arg("serve").env("XDG_RUNTIME_DIR", &runtime).output().unwrap();
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("already listening"));
    let log = stop(service, "-INT");
    assert!(log.contains("stopped by signal 2"), "{log}");
}
