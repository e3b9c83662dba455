//! `dmaload load FILE --cache --to cuda:0`: the cache service copies the
//! file into the client's device memory through a CUDA IPC handle, from
//! its own pinned copy; the client pins and copies nothing. Run on the
//! CUDA emulator (tests/cuda-emu) in strict mode, service and client each
//! a process of their own sharing one emulated device, with faults
//! injected into the service: an open refused falls back to a direct load
//! (and says why), a failed copy or a service killed mid-copy is an error
//! with no report.

mod common;
#[path = "../../dmaload/tests/common/cuda_driver.rs"]
mod cuda_driver;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use common::{dmaload, output_or_hang};
use serde_json::Value;

/// Whether this process runs the cases: on the emulator (faults are
/// injected into it), else a SKIP line says why not.
fn emulator(test: &str) -> bool {
    if let Err(reason) = cuda_driver::cuda_driver() {
        println!("SKIP {test}: {reason}");
        return false;
    }
    if !std::env::var("DMALOAD_LIBCUDA").is_ok_and(|path| path.contains("cuda-emu")) {
        println!("SKIP {test}: faults are injected into the CUDA emulator only");
        return false;
    }
    true
}

/// A `dmaload serve` process with the emulator settings `env`, killed if
/// a test fails before stopping it.
struct Serving {
    child: Child,
    runtime: PathBuf,
}

impl Serving {
    fn start(runtime: &Path, env: &[(&str, &str)]) -> Serving {
        let mut command = dmaload();
        command.args(["serve", "--memory-limit", "256M"]).env("XDG_RUNTIME_DIR", runtime);
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command.stderr(Stdio::piped()).spawn().unwrap();
        let serving = Serving { child, runtime: runtime.to_owned() };
        let started = Instant::now();
        while dmaload::share::Connection::connect(&runtime.join("dmaload.sock")).is_err() {
            assert!(started.elapsed() < Duration::from_secs(60), "the service did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        serving
    }

    /// `dmaload load --json --hash FILE --cache --to cuda:0` with `env`.
    fn load(&self, file: &Path, env: &[(&str, &str)]) -> Output {
        let mut command = dmaload();
        command.args(["load", "--json", "--hash", "--cache", "--to", "cuda:0"]).arg(file);
        command.env("XDG_RUNTIME_DIR", &self.runtime);
        for (name, value) in env {
            command.env(name, value);
        }
        output_or_hang(&mut command)
    }

    /// Stops the service (SIGKILL) and returns its log.
    fn log(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut log = String::new();
        self.child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
        log
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A file past one 16 MiB slot and not a whole number of pages.
fn model(dir: &Path) -> PathBuf {
    let path = dir.join("model.bin");
    let bytes: Vec<u8> =
        (0..(40usize << 20) + 4093).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

fn host_hash(file: &Path) -> Value {
    let out = dmaload().args(["load", "--json", "--hash"]).arg(file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<Value>(&out.stdout).unwrap()["hash"]["xxh3_64"].clone()
}

fn text(out: &Output) -> (Value, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    (serde_json::from_slice(&out.stdout).unwrap(), stderr)
}

/// The client's own driver refuses to pin or copy (its first
/// `cuMemHostRegister` and `cuMemcpyHtoDAsync` fail), so a load that
/// succeeds through the service proves the client did neither.
const CLIENT_PINS_NOTHING: &str = "cuMemHostRegister_v2#1=999,cuMemcpyHtoDAsync_v2#1=999";

#[test]
fn the_service_copies_a_cached_file_into_the_clients_device_memory_bit_exact() {
    let test = "the_service_copies_a_cached_file_into_the_clients_device_memory_bit_exact";
    if !emulator(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = model(dir.path());
    let expected = host_hash(&file);
    let service = Serving::start(&dir.path().join("run"), &[]);
    for served in ["(miss)", "(hit)"] {
        let (report, stderr) = text(&service.load(&file, &[("DMALOAD_EMU_FAULTS", CLIENT_PINS_NOTHING)]));
        assert!(stderr.contains(served), "{stderr}");
        assert_eq!(report["hash"]["xxh3_64"], expected, "bit-exact: {report}");
        let destination = report["destination"].as_str().unwrap();
        assert!(destination.starts_with("cuda:0 (") && destination.contains("via cache-service"), "{report}");
    }
    let log = service.log();
    assert_eq!(log.matches(": to cuda:0 ").count(), 2, "{log}");
}

#[test]
fn where_the_service_cannot_open_the_memory_the_client_loads_directly_and_says_why() {
    let test = "where_the_service_cannot_open_the_memory_the_client_loads_directly_and_says_why";
    if !emulator(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = model(dir.path());
    let expected = host_hash(&file);
    // The driver refuses the handle (as for another user's memory), or
    // the service has no device at all.
    for (faults, cause) in [
        ("cuIpcOpenMemHandle_v2#1=800", "CUDA_ERROR_NOT_PERMITTED"),
        ("cuInit#1=100", "CUDA_ERROR_NO_DEVICE"),
    ] {
        let service = Serving::start(&dir.path().join("run"), &[("DMALOAD_EMU_FAULTS", faults)]);
        let (report, stderr) = text(&service.load(&file, &[]));
        assert!(stderr.contains("the cache service cannot fill device memory"), "{stderr}");
        assert!(stderr.contains("open the client's device memory") && stderr.contains(cause), "{stderr}");
        assert!(stderr.contains("loaded directly"), "{stderr}");
        assert_eq!(report["hash"]["xxh3_64"], expected, "bit-exact: {report}");
        assert!(!report["destination"].as_str().unwrap().contains("cache-service"), "{report}");
        drop(service);
    }
}

#[test]
fn a_failed_copy_or_a_service_killed_mid_copy_fails_the_load_with_no_report() {
    let test = "a_failed_copy_or_a_service_killed_mid_copy_fails_the_load_with_no_report";
    if !emulator(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = model(dir.path());
    let service = Serving::start(&dir.path().join("run"), &[("DMALOAD_EMU_FAULTS", "copy#1=sticky:700")]);
    let out = service.load(&file, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty(), "no report of a failed load");
    assert!(stderr.contains("copy to the client's device memory"), "{stderr}");
    assert!(stderr.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{stderr}");
    drop(service);

    // The copy never ends; once the service has the client's memory open
    // (its mapping shows in /proc), it is killed.
    let service = Serving::start(&dir.path().join("run"), &[("DMALOAD_EMU_FAULTS", "copy#1=hang")]);
    let mut client = dmaload();
    client.args(["load", "--json", "--hash", "--cache", "--to", "cuda:0"]).arg(&file);
    let client =
        client.env("XDG_RUNTIME_DIR", &service.runtime).stdout(Stdio::piped()).stderr(Stdio::piped());
    let client = client.spawn().unwrap();
    let maps = format!("/proc/{}/maps", service.child.id());
    let started = Instant::now();
    while std::fs::read_to_string(&maps).unwrap_or_default().matches("cuda-emu cuda:0").count() == 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "the service never opened the client's memory");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(service);
    let out = wait_output(client);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty(), "no report of a failed load");
    assert!(stderr.contains("receive device copy") && stderr.contains("closed the connection"), "{stderr}");
}

/// A copy that fails to queue after others are queued (the second piece's
/// `cuMemcpyHtoDAsync`, while the first is still moving): the load fails
/// naming the copy, and the service waits for the queued copy before it
/// closes the client's memory (the strict emulator aborts a close with
/// copies pending), so it lives on and serves the next load bit-exact.
#[test]
fn a_copy_failing_behind_queued_ones_closes_the_clients_memory_only_after_them() {
    let test = "a_copy_failing_behind_queued_ones_closes_the_clients_memory_only_after_them";
    if !emulator(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = model(dir.path());
    let expected = host_hash(&file);
    let faults = "copy#1=delay:300000,cuMemcpyHtoDAsync_v2#2=999";
    let service = Serving::start(
        &dir.path().join("run"),
        &[("DMALOAD_EMU_STRICT", "1"), ("DMALOAD_EMU_FAULTS", faults)],
    );
    let out = service.load(&file, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty(), "no report of a failed load");
    assert!(stderr.contains("copy to the client's device memory"), "{stderr}");
    let (report, stderr) = text(&service.load(&file, &[]));
    assert!(stderr.contains("(hit)"), "{stderr}");
    assert_eq!(report["hash"]["xxh3_64"], expected, "bit-exact: {report}");
}

/// The child's output, or a failed test if it outlives two minutes.
fn wait_output(mut child: Child) -> Output {
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the client hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// A copy that outlasts the client's stall timeout (15 s without progress)
/// is not taken for a stuck service: the service counts its copy's
/// progress, piece by piece, in its keepalives. 40 MiB over a link of
/// 1.6 MiB/s takes about 25 s, each 16 MiB piece under 10 s.
#[test]
fn a_copy_over_a_slow_link_is_not_taken_for_a_stalled_service() {
    let test = "a_copy_over_a_slow_link_is_not_taken_for_a_stalled_service";
    if !emulator(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = model(dir.path());
    let expected = host_hash(&file);
    let service = Serving::start(&dir.path().join("run"), &[("DMALOAD_EMU_LINK_GIBS", "0.0016")]);
    let (report, stderr) = text(&service.load(&file, &[]));
    assert!(stderr.contains("(miss)"), "{stderr}");
    assert_eq!(report["hash"]["xxh3_64"], expected, "bit-exact: {report}");
}

/// A tensor of a caching allocator (PyTorch's) lies inside a larger
/// allocation, and a CUDA IPC handle names the whole allocation: the
/// client (`CacheRequest::into_device`, Python's path) sends the handle of
/// the allocation and the span's offset in it; the service copies the file
/// there bit-exact and writes nothing around it. A span that runs past the
/// allocation is refused by the service, naming the offset, the length and
/// the allocation's size.
#[test]
fn the_service_copies_into_a_span_at_an_offset_inside_a_larger_allocation() {
    let test = "the_service_copies_into_a_span_at_an_offset_inside_a_larger_allocation";
    if !emulator(test) {
        return;
    }
    use dmaload::cuda::{Context, DeviceBuffer};
    use dmaload::share::protocol::DeviceTarget;

    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let bytes = std::fs::read(&path).unwrap();
    let service = Serving::start(&dir.path().join("run"), &[]);
    let socket = service.runtime.join("dmaload.sock");
    let ctx = Context::primary(0).unwrap();
    let (before, after) = (12_345, 4_099);
    let mut memory = DeviceBuffer::new(&ctx, before + bytes.len() + after).unwrap();
    memory.fill(0x5a).unwrap();
    let file = dmaload::OpenFile::open(&path).unwrap();
    let options = dmaload::LoadOptions::default();
    let span = memory.range().sub(before, bytes.len()).unwrap();
    let (report, served) = dmaload_share::CacheRequest::open(&file, &socket)
        .options(&options)
        .into_device(&ctx, &span)
        .unwrap()
        .unwrap();
    assert_eq!(served, dmaload::share::Served::Miss);
    assert!(report.destination.contains("via cache-service (miss)"), "{report:?}");
    let mut back = vec![0u8; memory.len()];
    memory.copy_to_host(0, &mut back).unwrap();
    assert!(back[before..before + bytes.len()] == bytes[..], "the file, bit-exact, at the offset");
    assert!(
        back[..before].iter().chain(&back[before + bytes.len()..]).all(|&b| b == 0x5a),
        "nothing around it"
    );

    // One byte past the end, sent as a client could: refused, not copied.
    let handle = memory.ipc_handle().unwrap();
    let over = (before + after + 1) as u64;
    let target = DeviceTarget::new(0, &handle.0, over, bytes.len() as u64);
    let client = dmaload_share::Client::connect(&socket).unwrap();
    let err = client.copy_file_to_device(&std::fs::File::open(&path).unwrap(), &path, &target).unwrap_err();
    let message = err.to_string();
    assert!(message.contains("copy to the client's device memory"), "{message}");
    let size = memory.len().to_string();
    for named in [over.to_string(), bytes.len().to_string(), size] {
        assert!(message.contains(&named), "{named} in {message}");
    }
    memory.copy_to_host(0, &mut back).unwrap();
    assert!(back[before + bytes.len()..].iter().all(|&b| b == 0x5a), "nothing written past the span");
}

/// The client opened the file (Python reads its header then) before the
/// service loads it: a file written in between, which the service loads as
/// it is now, fails the load naming the change, rather than handing out
/// bytes the client's header does not describe.
#[test]
fn a_file_written_after_the_client_opened_it_fails_the_load() {
    let test = "a_file_written_after_the_client_opened_it_fails_the_load";
    if !emulator(test) {
        return;
    }
    use dmaload::cuda::{Context, DeviceBuffer};
    use std::os::unix::fs::FileExt;

    let dir = tempfile::tempdir().unwrap();
    let path = model(dir.path());
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let service = Serving::start(&dir.path().join("run"), &[]);
    let ctx = Context::primary(0).unwrap();
    let mut memory = DeviceBuffer::new(&ctx, len).unwrap();
    let file = dmaload::OpenFile::open(&path).unwrap();
    // Past the filesystem's timestamp granularity, so the write moves them.
    std::thread::sleep(Duration::from_millis(50));
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().write_all_at(b"rewritten", 100).unwrap();
    let socket = service.runtime.join("dmaload.sock");
    let options = dmaload::LoadOptions::default();
    let err = dmaload_share::CacheRequest::open(&file, &socket)
        .options(&options)
        .into_device(&ctx, &memory.range())
        .unwrap_err();
    assert_eq!(err.kind(), dmaload::ErrorKind::Changed, "{err}");
    assert!(err.to_string().contains("written during the load"), "{err}");
}
