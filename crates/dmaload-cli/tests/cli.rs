//! The `dmaload` binary end to end: reports, fallbacks forced by real
//! process limits (RLIMIT_MEMLOCK, a seccomp filter), and error output.

use std::fs::File;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

mod common;
#[path = "../../dmaload/tests/common/cuda_driver.rs"]
mod cuda_driver;
#[path = "../../dmaload/tests/fronts/mod.rs"]
mod fronts;

use common::{dmaload, have, is_root, output_or_hang, skip};

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("dmaload-cli-").tempdir_in(std::env::temp_dir()).unwrap()
}

/// A file of `len` bytes whose content depends on position.
fn sample_file(dir: &Path, name: &str, len: usize) -> PathBuf {
    let path = dir.join(name);
    let bytes: Vec<u8> =
        (0..len).map(|i| (i as u64).wrapping_mul(2_654_435_761).rotate_right(13) as u8).collect();
    File::create(&path).unwrap().write_all(&bytes).unwrap();
    path
}

fn json_of(out: &Output) -> Value {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn load_json_reports_the_engine_and_a_correct_hash() {
    let dir = scratch();
    let path = sample_file(dir.path(), "model.bin", (3 << 20) + 17);
    let out = dmaload().args(["load", "--json", "--hash"]).arg(&path).output().unwrap();
    let report = json_of(&out);
    assert_eq!(report["bytes"], (3 << 20) + 17);
    assert_eq!(report["engine"], "uring-fixed");
    assert_eq!(report["cache"], "bypass");
    assert_eq!(report["fallbacks"].as_array().unwrap().len(), 0);
    let expected = xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap());
    assert_eq!(report["hash"]["xxh3_64"], format!("{expected:016x}"));
    // Piped stderr: no progress bar, no fallback lines.
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn output_to_a_reader_that_left_ends_quietly_not_in_a_panic() {
    // The pipe's read end is closed before the command writes a byte of
    // its report: the write fails with EPIPE (Rust ignores SIGPIPE).
    let dir = scratch();
    let path = sample_file(dir.path(), "model.bin", 1 << 20);
    for args in [vec!["load", "--json"], vec!["load"], vec!["info"]] {
        let mut child = dmaload()
            .args(&args)
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
}

#[test]
fn load_text_report_names_engine_time_split_and_cache() {
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 1 << 20);
    let out = dmaload().args(["load", "--offset", "5", "--length", "1000"]).arg(&path).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "1000 bytes",
        "at offset 5",
        "uring-fixed",
        "direct (O_DIRECT)",
        "alloc",
        "GiB/s",
        "CPU",
        "page cache",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[test]
fn a_host_load_says_which_memory_and_why_when_it_reads_through_the_ring_too() {
    let dir = scratch();
    // Past the size from which a host load in 4 KiB pages reads through the
    // kept ring where the device splits direct reads into small requests
    // (this VM's virtio disk does).
    let path = sample_file(dir.path(), "f", 65 << 20);
    let out = dmaload().args(["load", "--to", "anonymous"]).arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let memory = text.lines().find(|l| l.starts_with("memory    anonymous: "));
    let memory = memory.unwrap_or_else(|| panic!("no memory line in:\n{text}"));
    if text.contains("through a staging ring") {
        assert!(memory.contains("reads go through a ring"), "{text}");
    }
}

#[test]
fn load_measures_the_page_cache_unless_told_not_to() {
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 1 << 20);
    let report =
        json_of(&dmaload().args(["load", "--json", "--mode", "buffered"]).arg(&path).output().unwrap());
    assert_eq!(report["page_cache"]["resident_bytes"], 1 << 20, "{report}");
    let out = dmaload().args(["load", "--json", "--no-page-cache"]).arg(&path).output().unwrap();
    assert!(json_of(&out)["page_cache"].is_null());
    let out = dmaload().args(["load", "--no-page-cache"]).arg(&path).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("GiB/s") && !text.lines().any(|l| l.starts_with("cache ")), "{text}");
}

#[test]
fn load_cache_without_a_service_reports_like_a_direct_load() {
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 1 << 20);
    let socket = dir.path().join("no-service.sock");
    let out = dmaload()
        .args(["load", "--json", "--mode", "buffered", "--cache"])
        .arg(&socket)
        .arg(&path)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("no cache service"), "{out:?}");
    let report = json_of(&out);
    assert_eq!(report["page_cache"]["resident_bytes"], 1 << 20, "{report}");
    let out = dmaload().args(["load", "--cache"]).arg(&socket).arg(&path).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.lines().any(|l| l.starts_with("cache ")), "{text}");
}

#[test]
fn low_memlock_limit_falls_back_to_unregistered_io_uring() {
    let name = "low_memlock_limit_falls_back_to_unregistered_io_uring";
    let dir = common::open_scratch("dmaload-cli-");
    let path = common::sample(dir.path(), "f".as_ref(), 4 << 20);
    let Some(mut cmd) = common::under_memlock(name, 65536) else { return };
    let out = cmd.args(["load", "--json", "--gather-size", "1M"]).arg(&path).output().unwrap();
    let report = json_of(&out);
    assert_eq!(report["engine"], "uring", "{report}");
    let reason = report["fallbacks"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("RLIMIT_MEMLOCK") && reason.contains("64 KiB"), "{reason}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("fallback uring-fixed -> uring"), "{stderr}");
}

#[test]
fn registered_buffers_stay_a_few_gathers_ahead_under_a_memlock_limit_smaller_than_the_file() {
    let name = "registered_buffers_stay_a_few_gathers_ahead_under_a_memlock_limit_smaller_than_the_file";
    let dir = common::open_scratch("dmaload-cli-");
    let path = common::sample(dir.path(), "f".as_ref(), 32 << 20);
    // 256 KiB gathers of 4 KiB pages, 256 KiB in flight: registered ahead
    // of the reads and unregistered behind them, about 1 MiB is pinned at
    // once, well under 4 MiB; registering each gather as soon as it is
    // populated (populating outruns the disk) would pin past it.
    let Some(mut cmd) = common::under_memlock(name, 4 << 20) else { return };
    let out = cmd
        .args(["load", "--json", "--to", "memfd", "--gather-size", "256K", "--chunk-size", "64K"])
        .args(["--queue-depth", "4"])
        .arg(&path)
        .output()
        .unwrap();
    let report = json_of(&out);
    assert_eq!(report["engine"], "uring-fixed", "{report}");
    assert_eq!(report["fallbacks"], serde_json::json!([]), "{report}");
}

/// Installs a seccomp filter that makes io_uring_setup fail with ENOSYS,
/// as container runtimes do.
#[cfg(target_arch = "x86_64")]
fn deny_io_uring() -> std::io::Result<()> {
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const SYS_IO_URING_SETUP: u32 = 425;
    const OFFSET_NR: u32 = 0;
    const OFFSET_ARCH: u32 = 4;
    let ld = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let jeq = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    let ret = (libc::BPF_RET | libc::BPF_K) as u16;
    let stmt = |code, k| libc::sock_filter { code, jt: 0, jf: 0, k };
    let jump = |k, jt, jf| libc::sock_filter { code: jeq, jt, jf, k };
    let mut filter = [
        stmt(ld, OFFSET_ARCH),
        jump(AUDIT_ARCH_X86_64, 1, 0),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
        stmt(ld, OFFSET_NR),
        jump(SYS_IO_URING_SETUP, 0, 1),
        stmt(ret, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        stmt(ret, libc::SECCOMP_RET_ALLOW),
    ];
    let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_mut_ptr() };
    // SAFETY: runs in the forked child before exec; this prctl takes no pointers.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; prctl reads `prog`, which lives on this stack frame
    // for the duration of the call.
    if unsafe {
        libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog)
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[test]
#[cfg(target_arch = "x86_64")]
fn io_uring_blocked_by_seccomp_falls_back_to_the_pread_pool() {
    let dir = scratch();
    let path = sample_file(dir.path(), "f", (2 << 20) + 3);
    let mut cmd = dmaload();
    cmd.args(["load", "--json", "--hash"]).arg(&path);
    // SAFETY: deny_io_uring only makes async-signal-safe syscalls (prctl).
    unsafe { cmd.pre_exec(deny_io_uring) };
    let report = json_of(&cmd.output().unwrap());
    assert_eq!(report["engine"], "pread-pool", "{report}");
    let reason = report["fallbacks"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("io_uring is unavailable") && reason.contains("seccomp"), "{reason}");
    let expected = xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap());
    assert_eq!(report["hash"]["xxh3_64"], format!("{expected:016x}"));
}

#[test]
fn errors_name_the_path_and_cause_and_exit_nonzero() {
    let dir = scratch();
    let missing = dir.path().join("nope.safetensors");
    let out = dmaload().arg("load").arg(&missing).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("open") && stderr.contains("nope.safetensors") && stderr.contains("No such file"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn to_names_the_destination_and_its_defaults_are_the_cores() {
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 100_000);
    let out = dmaload().args(["load", "--json", "--to", "anonymous-thp"]).arg(&path).output().unwrap();
    let report = json_of(&out);
    assert_eq!(
        (report["memory"].as_str(), report["destination"].as_str()),
        (Some("anonymous-thp"), Some("anonymous-thp"))
    );
    // The default is auto, and a CLI load shares nothing: the kind the rule
    // (or a recorded probe) gives a load that needs no fd, with its reason.
    let cache = scratch();
    let report = json_of(
        &dmaload()
            .args(["load", "--json"])
            .arg(&path)
            .env("DMALOAD_CACHE_DIR", cache.path())
            .output()
            .unwrap(),
    );
    let mut facts = dmaload::memory::MemoryFacts::read();
    facts.probe = None;
    let auto = facts.choose(100_000, false);
    assert_eq!(
        (report["memory"].as_str(), report["destination"].as_str()),
        (Some(auto.kind.name()), Some(auto.kind.name()))
    );
    assert_eq!(report["memory_reason"].as_str(), Some(auto.reason.as_str()));
    assert_eq!(report["queue_depth"], dmaload::load::DEFAULT_QUEUE_DEPTH);
    let help = String::from_utf8(dmaload().args(["load", "--help"]).output().unwrap().stdout).unwrap();
    for default in ["[default: uring-fixed]", "[default: auto]", "[default: 128M]", "[default: 4M]"] {
        assert!(help.contains(default), "{default} missing from:\n{help}");
    }
    for form in dmaload::Destination::forms() {
        assert!(help.contains(&form), "--help does not name {form}:\n{help}");
    }
    // Unknown names are refused with the choices; --memory is gone.
    let out = dmaload().args(["load", "--to", "vram"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&dmaload::Destination::forms().join(", ")), "{stderr}");
    // An unknown heap is refused before reading, naming its path.
    let out =
        dmaload().args(["load", "--hash", "--to", "dma-heap:no-such-heap"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/dev/dma_heap/no-such-heap"), "{stderr}");
    let out = dmaload().args(["load", "--memory", "memfd"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    // copy saves from host memory: a device destination is refused, saying where it belongs.
    let out =
        dmaload().args(["copy", "--to", "cuda:0"]).arg(&path).arg(dir.path().join("copy")).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not cuda:0") && stderr.contains("dmaload load --to cuda:0"), "{stderr}");
    assert!(!dir.path().join("copy").exists());
}

/// Direct reads at the default depth start from the depth and request size
/// remembered for the file's device (`$XDG_CACHE_HOME/dmaload/tuning`),
/// and the report shows what the load kept (requests smaller than the
/// chunk, each chunk read in several, give the same bytes); an unknown
/// device gets today's default
/// and a load too short to measure one depth against another remembers
/// nothing. The memory serves from a directory the user cannot write (as
/// nobody where the tests run as root); an explicit depth is not tuned.
#[test]
fn a_direct_load_starts_from_the_depth_remembered_for_its_device_and_reports_it() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = common::open_scratch("dmaload-cli-");
    let path = common::sample(dir.path(), "f".as_ref(), 8 << 20);
    let dev = std::fs::metadata(&path).unwrap().dev();
    let key = format!("{}:{}", libc::major(dev), libc::minor(dev));
    let direct = |cmd: &mut Command, cache: &Path, depth: &[&str]| {
        let cmd = cmd.args(["load", "--json", "--hash", "--mode", "direct"]).args(depth).arg(&path);
        json_of(&cmd.env_remove("DMALOAD_CACHE_DIR").env("XDG_CACHE_HOME", cache).output().unwrap())
    };
    let fresh = dir.path().join("fresh-cache");
    let report = direct(&mut dmaload(), &fresh, &[]);
    assert_eq!(report["cache"], "bypass", "{report}");
    assert_eq!(report["queue_depth"], dmaload::load::DEFAULT_QUEUE_DEPTH, "{report}");
    assert_eq!(report["request_size"], report["chunk_size"], "{report}");
    let hash = report["hash"]["xxh3_64"].clone();
    assert!(!fresh.exists(), "a load that compared no depths remembers nothing");

    let cache = dir.path().join("cache");
    let memory = cache.join("dmaload");
    std::fs::create_dir_all(&memory).unwrap();
    std::fs::write(
        memory.join("tuning"),
        format!("8:99 queue_depth=64\n{key} queue_depth=16 request=1048576\n"),
    )
    .unwrap();
    let mode =
        |path: &Path, mode| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    mode(&memory.join("tuning"), 0o444);
    mode(&memory, 0o555);
    mode(&cache, 0o555);
    let mut cmd = dmaload();
    if is_root() && have("setpriv") {
        cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(common::dmaload_for_others());
    }
    let report = direct(&mut cmd, &cache, &[]);
    assert_eq!(report["queue_depth"], 16, "{report}");
    assert_eq!(
        (report["chunk_size"].as_u64(), report["request_size"].as_u64()),
        (Some(4 << 20), Some(1 << 20))
    );
    assert_eq!(report["hash"]["xxh3_64"], hash, "{report}");
    let explicit = direct(&mut dmaload(), &cache, &["--queue-depth", "24"]);
    assert_eq!(explicit["queue_depth"], 24, "{explicit}");
    assert_eq!(std::fs::read_dir(&memory).unwrap().count(), 1, "nothing written beside the memory");
    mode(&cache, 0o755);
    mode(&memory, 0o755);
}

/// `$DMALOAD_CACHE_DIR` names the directory of what loads remember, ahead
/// of `$XDG_CACHE_HOME` (the suite points it at a scratch directory, so a
/// test neither starts from the user's tuned depths nor rewrites them).
#[test]
fn dmaload_cache_dir_comes_before_xdg_cache_home() {
    use std::os::unix::fs::MetadataExt;
    let dir = common::open_scratch("dmaload-cli-");
    let path = common::sample(dir.path(), "f".as_ref(), 8 << 20);
    let dev = std::fs::metadata(&path).unwrap().dev();
    let key = format!("{}:{}", libc::major(dev), libc::minor(dev));
    let (ours, xdg) = (dir.path().join("ours"), dir.path().join("xdg"));
    for (memory, depth) in [(ours.clone(), 16), (xdg.join("dmaload"), 8)] {
        std::fs::create_dir_all(&memory).unwrap();
        std::fs::write(memory.join("tuning"), format!("{key} queue_depth={depth}\n")).unwrap();
    }
    let report = json_of(
        &dmaload()
            .args(["load", "--json", "--mode", "direct"])
            .arg(&path)
            .env("DMALOAD_CACHE_DIR", &ours)
            .env("XDG_CACHE_HOME", &xdg)
            .output()
            .unwrap(),
    );
    assert_eq!(report["queue_depth"], 16, "{report}");
}

#[test]
fn unreadable_file_is_permission_denied() {
    let dir = scratch();
    let path = sample_file(dir.path(), "secret", 4096);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
    let mut cmd = if is_root() {
        if !have("setpriv") {
            return skip(
                "unreadable_file_is_permission_denied",
                "root without setpriv cannot drop privileges",
            );
        }
        // Root reads anything: run as nobody.
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(common::dmaload_for_others());
        cmd
    } else {
        dmaload()
    };
    let out = cmd.arg("load").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("secret") && stderr.contains("Permission denied"), "{stderr}");
}

#[test]
fn direct_flag_refuses_to_fall_back_on_tmpfs() {
    if !Path::new("/dev/shm").is_dir() {
        return skip("direct_flag_refuses_to_fall_back_on_tmpfs", "no /dev/shm");
    }
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = sample_file(dir.path(), "f", 10_000);
    let out = dmaload().args(["load", "--direct"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("O_DIRECT") && stderr.contains("tmpfs"), "{stderr}");
    let out = dmaload().args(["load", "--json"]).arg(&path).output().unwrap();
    assert_eq!(json_of(&out)["fallbacks"][0]["to"], "buffered");
    assert!(String::from_utf8_lossy(&out.stderr).contains("fallback direct -> buffered"));
}

#[test]
fn info_reports_kernel_io_uring_and_path_facts() {
    // The driver this process and the `dmaload info` it starts both see.
    let _ = cuda_driver::cuda_driver();
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 10);
    let info = json_of(&dmaload().args(["info", "--json"]).arg(&path).output().unwrap());
    assert!(info["kernel"].as_str().unwrap().chars().next().unwrap().is_ascii_digit());
    assert!(info["io_uring"]["Ok"]["opcodes"].is_array() || info["io_uring"]["Err"].is_string(), "{info}");
    assert!(info["path"]["filesystem"].is_string());
    assert!(info["path"]["direct_io"]["status"].is_string());
    // Free page reporting: any bound virtio balloon with feature bit 5.
    let balloon_reports = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon").is_ok_and(|entries| {
        entries.flatten().any(|e| {
            std::fs::read_to_string(e.path().join("features")).is_ok_and(|f| f.chars().nth(5) == Some('1'))
        })
    });
    assert_eq!(info["free_page_reporting"].is_u64(), balloon_reports, "{info}");
    // CUDA: the devices, or (no libcuda.so.1 here) why not.
    match dmaload::cuda::device_count() {
        Ok(n) => assert_eq!(info["cuda"]["Ok"].as_str().unwrap().matches("cuda:").count(), n, "{info}"),
        Err(err) => assert_eq!(info["cuda"]["Err"].as_str(), Some(err.to_string().as_str()), "{info}"),
    }
    let text = dmaload().arg("info").output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    for needle in [
        "kernel",
        "io_uring",
        "RLIMIT_MEMLOCK",
        "THP anonymous",
        "THP shmem",
        "hugetlb pool",
        "auto memory",
        "memory probe",
        "page reporting",
        "dma-heap",
        "udmabuf",
        "CUDA",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[test]
fn probe_memory_records_figures_that_auto_then_goes_by() {
    let cache = scratch();
    let run = |args: &[&str]| {
        json_of(&dmaload().args(args).env("DMALOAD_CACHE_DIR", cache.path()).output().unwrap())
    };
    let before = run(&["info", "--json"]);
    assert!(before["memory_probe"].is_null(), "{before}");
    let info = run(&["info", "--json", "--probe-memory"]);
    let file = cache.path().join("memory-probe.json");
    assert_eq!(info["memory_probe_path"].as_str(), Some(file.to_str().unwrap()));
    let probe = dmaload::memory::MemoryProbe::read(&file).unwrap().expect("the probe recorded its figures");
    assert_eq!(serde_json::to_value(&probe).unwrap(), info["memory_probe"]);
    for kind in &probe.kinds {
        match (kind.populate_seconds_per_gib, &kind.error) {
            (Some(cost), None) => assert!(cost > 0.0, "{kind:?}"),
            // memfd-huge and hugetlb where the kernel cannot give them.
            (None, Some(why)) => {
                assert!(kind.kind.has_fd() && kind.kind != dmaload::MemoryKind::Memfd, "{kind:?}");
                skip("probe_memory_records_figures_that_auto_then_goes_by", &format!("{}: {why}", kind.kind));
            }
            other => panic!("{other:?}"),
        }
    }
    // auto now says it chose by the measured figures.
    for (field, needs_fd) in [("auto_shareable", true), ("auto_private", false)] {
        let reason = info[field]["reason"].as_str().unwrap();
        assert!(reason.contains("--probe-memory` measured here"), "{field}: {reason}");
        let cheapest = probe
            .kinds
            .iter()
            .filter(|k| (needs_fd <= k.kind.has_fd()) && k.populate_seconds_per_gib.is_some())
            .min_by(|a, b| {
                a.populate_seconds_per_gib.unwrap().total_cmp(&b.populate_seconds_per_gib.unwrap())
            })
            .unwrap();
        assert_eq!(info[field]["kind"].as_str(), Some(cheapest.kind.name()), "{info}");
    }
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 100_000);
    let report = run(&["load", "--json", path.to_str().unwrap()]);
    assert!(report["memory_reason"].as_str().unwrap().contains("--probe-memory"), "{report}");
}

#[test]
fn demo_generates_a_sample_model_and_compares_two_loads() {
    let dir = scratch();
    let out = dmaload().args(["demo", "--size", "48M", "--cache-dir"]).arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("content identical: yes"), "{text}");
    assert!(text.contains("== default") && text.contains("== baseline"), "{text}");
    // The sample is about --size, not a minimum of 348 MiB.
    let bytes: u64 = text
        .lines()
        .find(|l| l.starts_with("loaded"))
        .and_then(|l| l.split(['(', ' ']).find_map(|w| w.parse().ok()))
        .unwrap();
    assert!(bytes <= 48 << 20, "{text}");
    // The model is generated once and reused.
    let again = dmaload().args(["demo", "--size", "48M", "--cache-dir"]).arg(dir.path()).output().unwrap();
    assert!(!String::from_utf8_lossy(&again.stderr).contains("generated"));
}

#[test]
fn evict_makes_the_next_load_read_the_device() {
    let test = "evict_makes_the_next_load_read_the_device";
    let dir = scratch();
    let path = sample_file(dir.path(), "f", 4 << 20);
    // A direct load leaves the page cache as it found it, and reports how
    // much of the file the cache holds afterwards.
    let cached = |args: &[&str]| {
        let report = json_of(&dmaload().arg("load").arg("--json").args(args).arg(&path).output().unwrap());
        (report["cache"].as_str().unwrap().to_owned(), report["page_cache"]["fraction"].as_f64().unwrap())
    };
    assert_eq!(cached(&["--mode", "buffered"]).1, 1.0);
    let (cache, fraction) = cached(&[]);
    if cache != "bypass" {
        return skip(test, &format!("no direct I/O here (cache {cache})"));
    }
    assert_eq!(fraction, 1.0, "a direct load does not evict");
    let out = dmaload().arg("evict").arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(cached(&[]), ("bypass".to_owned(), 0.0));
    let out = dmaload().arg("evict").arg(&path).arg(dir.path().join("missing")).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing"), "{out:?}");
}

/// A FIFO or a character device given to evict: one line about evicting,
/// naming the path, and no open (a FIFO without a writer would hang it).
#[test]
fn evict_refuses_what_has_no_page_cache_in_one_line() {
    let dir = scratch();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for (path, kind) in [(fifo.as_path(), "FIFO"), (Path::new("/dev/null"), "character device")] {
        let out = common::output_or_hang(dmaload().arg("evict").arg(path));
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!(
                "dmaload: error: open {}: a {kind} has no page cache to evict: \
                 only regular files and block devices have one\n",
                path.display()
            )
        );
    }
}

/// Every load option the core's table gives a flag is a flag of `dmaload
/// load` (and of `copy`, which loads with the same flags).
#[test]
fn load_and_copy_offer_every_flag_of_the_option_table() {
    for command in ["load", "copy"] {
        let out = dmaload().args([command, "--help"]).output().unwrap();
        assert!(out.status.success(), "{command} --help: {}", String::from_utf8_lossy(&out.stderr));
        let help = String::from_utf8_lossy(&out.stdout);
        let flags: Vec<&str> = help
            .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[' || c == '<')
            .filter(|word| word.starts_with("--"))
            .collect();
        for row in fronts::LOAD_OPTION_FRONTS {
            let fronts::Spelling::Named(flag) = row.cli else { continue };
            if command == "copy" && flag == "--no-page-cache" {
                continue; // copy never measures the page cache
            }
            assert!(
                flags.contains(&flag),
                "`dmaload {command}` has no {flag} for LoadOptions::{}: {flags:?}",
                row.field
            );
        }
    }
}

/// Not a test of its own: run by `a_skip_panics_where_skips_are_refused`
/// with `DMALOAD_TEST_SKIP_PROBE` set.
#[test]
fn skip_probe() {
    if std::env::var_os("DMALOAD_TEST_SKIP_PROBE").is_some() {
        skip("skip_probe", "probing how a skip behaves");
    }
}

/// A skip is a failure where the run exists to run everything (the VM
/// guest sets `DMALOAD_TEST_NO_SKIP=1`), and only a log line elsewhere.
#[test]
fn a_skip_panics_where_skips_are_refused() {
    let probe = |no_skip: &str| {
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "skip_probe", "--nocapture", "--test-threads=1"])
            .env("DMALOAD_TEST_SKIP_PROBE", "1")
            .env("DMALOAD_TEST_NO_SKIP", no_skip)
            .output()
            .unwrap()
    };
    let refused = probe("1");
    assert!(!refused.status.success(), "a skip passed under DMALOAD_TEST_NO_SKIP=1");
    let said = [refused.stdout, refused.stderr].concat();
    assert!(
        String::from_utf8_lossy(&said).contains("cannot be skipped here"),
        "{}",
        String::from_utf8_lossy(&said)
    );
    let allowed = probe("0");
    assert!(allowed.status.success(), "{}", String::from_utf8_lossy(&allowed.stderr));
    assert!(String::from_utf8_lossy(&allowed.stderr).contains("SKIP skip_probe: probing"));
}

/// `dmaload load FILE --to cuda:0 --hash` copies the device buffer back
/// and hashes it: equal to the hash of a host load of the same file. Runs
/// on the NVIDIA driver where one loads, else on the emulator (strict).
#[test]
fn a_load_to_cuda_hashes_equal_to_a_host_load() {
    let test = "a_load_to_cuda_hashes_equal_to_a_host_load";
    if let Err(reason) = cuda_driver::cuda_driver() {
        return skip(test, &reason);
    }
    let dir = scratch();
    // Past one 16 MiB staging slot, and not a whole number of pages.
    let path = sample_file(dir.path(), "model.bin", (40 << 20) + 4093);
    let hash_of = |args: &[&str]| {
        let out = dmaload().args(["load", "--json", "--hash"]).args(args).arg(&path).output().unwrap();
        let report = json_of(&out);
        if args.contains(&"cuda:0") {
            // The pinned ring's set-up, before the load, is reported.
            assert!(report["alloc_seconds"].as_f64().unwrap() > 0.0, "{report}");
            // The file was just written, so in the page cache: `auto` takes
            // the cache lane, `direct` the ring.
            let lane = if args.contains(&"direct") { "ring_bytes" } else { "cache_lane_bytes" };
            assert_eq!(report[lane], report["bytes"], "{report}");
        }
        report["hash"]["xxh3_64"].as_str().unwrap().to_owned()
    };
    assert_eq!(hash_of(&["--to", "cuda:0"]), hash_of(&[]));
    assert_eq!(hash_of(&["--to", "cuda:0", "--mode", "direct"]), hash_of(&[]));
    // The text report's engine line says where the bytes came from.
    let engine_line = |args: &[&str]| {
        let out = dmaload().args(["load", "--to", "cuda:0"]).args(args).arg(&path).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines().find(|l| l.starts_with("engine")).unwrap().to_owned()
    };
    assert!(engine_line(&[]).contains("| from the page cache (cache lane) |"), "{}", engine_line(&[]));
    assert!(engine_line(&["--mode", "direct"]).contains("| direct (O_DIRECT) |"));
    assert_eq!(hash_of(&["--to", "cuda:0", "--offset", "4097"]), hash_of(&["--offset", "4097"]));
}

/// `--staging-slots` and `--staging-slot-size` size the staging ring of a
/// load to cuda:N, which is else sized from the range; a ring of one slot
/// is the core's error, in the words C and Python give too.
#[test]
fn the_staging_flags_size_the_ring_of_a_load_to_cuda() {
    let test = "the_staging_flags_size_the_ring_of_a_load_to_cuda";
    let dir = scratch();
    let path = sample_file(dir.path(), "model.bin", (1 << 20) + 4093);
    for (flag, value, error) in [
        ("--staging-slots", "1", "staging slots 1 must be at least 2"),
        ("--staging-slot-size", "2G", "staging slot size 2147483648 must be between 1 byte and 1 GiB"),
    ] {
        let out = dmaload().args(["load", flag, value]).arg(&path).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(error), "{flag} {value}: {stderr}");
    }
    if let Err(reason) = cuda_driver::cuda_driver() {
        return skip(test, &reason);
    }
    let ring = |args: &[&str]| {
        let out = dmaload()
            .args(["load", "--json", "--hash", "--to", "cuda:0", "--mode", "direct"])
            .args(args)
            .arg(&path)
            .output()
            .unwrap();
        let report = json_of(&out);
        assert_eq!(report["ring_bytes"], report["bytes"], "{report}");
        let destination = report["destination"].as_str().unwrap().to_owned();
        (destination, report["hash"]["xxh3_64"].as_str().unwrap().to_owned())
    };
    let (sized, hash) = ring(&[]);
    assert!(sized.contains("staging ring (2 x 16777216 bytes)"), "{sized}");
    let (given, given_hash) = ring(&["--staging-slots", "3", "--staging-slot-size", "64K"]);
    assert!(given.contains("staging ring (3 x 65536 bytes)"), "{given}");
    assert_eq!(given_hash, hash);
}

/// A small file loaded to the device pins a ring it fills, not the 512 MiB
/// of a large load: the whole process's peak RSS (the pinned ring is
/// resident, every page) stays far below 512 MiB for a 4 MiB file.
#[test]
// The child is reaped by wait4 below, for its own rusage.
#[allow(clippy::zombie_processes)]
fn a_small_load_to_cuda_pins_a_small_ring() {
    let test = "a_small_load_to_cuda_pins_a_small_ring";
    if let Err(reason) = cuda_driver::cuda_driver() {
        return skip(test, &reason);
    }
    let dir = scratch();
    let path = sample_file(dir.path(), "small.bin", 4 << 20);
    let child = dmaload()
        .args(["load", "--to", "cuda:0", "--mode", "direct", "--json"])
        .arg(&path)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // wait4, for this child's own peak RSS (RUSAGE_CHILDREN would take the
    // largest of every test's children).
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is our child, not yet reaped; status and usage are valid.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "{}", std::io::Error::last_os_error());
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status}");
    let peak_mib = usage.ru_maxrss / 1024;
    assert!(peak_mib < 256, "peak RSS {peak_mib} MiB for a 4 MiB load to cuda:0");
}

/// A 1 GiB file loaded to the device takes a ring of the reads in flight
/// plus two copies behind the link (at most 8 + 2 slots of 16 MiB, fewer
/// where the disk was tuned to fewer), not the quarter of the range
/// (16 slots) nor the 512 MiB of a load of 2 GiB or more.
#[test]
fn a_load_of_a_1_gib_file_to_cuda_takes_a_ring_of_the_reads_in_flight() {
    let test = "a_load_of_a_1_gib_file_to_cuda_takes_a_ring_of_the_reads_in_flight";
    if let Err(reason) = cuda_driver::cuda_driver() {
        return skip(test, &reason);
    }
    let dir = scratch();
    let path = dir.path().join("sparse.bin");
    std::fs::File::create(&path).unwrap().set_len(1 << 30).unwrap(); // holes read fast
    let out = dmaload().args(["load", "--to", "cuda:0", "--json"]).arg(&path).output().unwrap();
    let report = json_of(&out);
    let destination = report["destination"].as_str().unwrap();
    let slots = destination
        .strip_suffix(" x 16777216 bytes)")
        .and_then(|head| head.rsplit_once("via staging ring ("))
        .and_then(|(_, slots)| slots.parse::<usize>().ok());
    assert!(slots.is_some_and(|slots| (3..=10).contains(&slots)), "{report}");
}

/// `DMALOAD_LIBCUDA` naming a file that is not there: the error names the
/// variable and the file, not the usual driver advice.
#[test]
fn a_missing_dmaload_libcuda_is_named_in_the_error() {
    let dir = scratch();
    let path = sample_file(dir.path(), "model.bin", 4096);
    let missing = dir.path().join("no-such-libcuda.so.1");
    let out = dmaload()
        .args(["load", "--to", "cuda:0"])
        .arg(&path)
        .env("DMALOAD_LIBCUDA", &missing)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("DMALOAD_LIBCUDA={}", missing.display())), "{stderr}");
    assert!(stderr.contains("dlopen failed"), "{stderr}");
}

/// `DMALOAD_LIBCUDA` naming a FIFO (which dlopen would wait on for a
/// writer) or a directory: refused by type, naming the variable.
#[test]
fn a_dmaload_libcuda_that_is_no_regular_file_is_refused_not_waited_on() {
    let dir = scratch();
    let path = sample_file(dir.path(), "model.bin", 4096);
    let fifo = dir.path().join("libcuda-fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for driver in [fifo.as_path(), dir.path()] {
        let out = output_or_hang(
            dmaload().args(["load", "--to", "cuda:0"]).arg(&path).env("DMALOAD_LIBCUDA", driver),
        );
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("DMALOAD_LIBCUDA={} is not a regular file", driver.display())),
            "{stderr}"
        );
    }
}

/// `dmaload sums` writes what `sha256sum` prints for the same names, for a
/// directory and for files; `load --verify` passes on a good file and
/// fails on a flipped byte naming both digests, or without a sums file.
#[test]
fn sums_match_coreutils_and_load_verify_checks_them() {
    let dir = scratch();
    let names = ["a.safetensors", "b c", "back\\slash", "d"];
    for (i, name) in names.iter().enumerate() {
        common::sample(dir.path(), std::ffi::OsStr::new(name), 100_000 * (i + 1) + 7);
    }
    let out = common::output_or_hang(dmaload().arg("sums").arg(dir.path()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut sorted = names.to_vec();
    sorted.sort();
    let coreutils = Command::new("sha256sum").args(&sorted).current_dir(dir.path()).output().unwrap();
    assert_eq!(std::fs::read(dir.path().join("SHA256SUMS")).unwrap(), coreutils.stdout);
    // Files: listed in the order given, in their directory's sums file.
    let out =
        common::output_or_hang(dmaload().arg("sums").arg(dir.path().join("d")).arg(dir.path().join("b c")));
    assert!(out.status.success());
    let coreutils = Command::new("sha256sum").args(["d", "b c"]).current_dir(dir.path()).output().unwrap();
    assert_eq!(std::fs::read(dir.path().join("SHA256SUMS")).unwrap(), coreutils.stdout);

    let file = dir.path().join("d");
    let ok = common::output_or_hang(dmaload().args(["load", "--verify", "--json"]).arg(&file));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[250_000] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let bad = common::output_or_hang(dmaload().args(["load", "--verify"]).arg(&file));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    let expected = String::from_utf8_lossy(&coreutils.stdout[..64]).into_owned();
    assert!(stderr.contains("SHA-256 mismatch") && stderr.contains(&expected), "{stderr}");
    let unlisted =
        common::output_or_hang(dmaload().args(["load", "--verify"]).arg(dir.path().join("a.safetensors")));
    assert!(String::from_utf8_lossy(&unlisted.stderr).contains("is not listed"));
    std::fs::remove_file(dir.path().join("SHA256SUMS")).unwrap();
    let missing = common::output_or_hang(dmaload().args(["load", "--verify"]).arg(&file));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no "), "{:?}", missing);
    assert!(!missing.status.success());
}

/// `sums --digest blake3` writes what `b3sum` prints, as B3SUMS, and
/// `load --verify` checks the file against it.
#[test]
fn sums_digest_blake3_matches_b3sum_and_load_verify_checks_it() {
    let dir = scratch();
    let names = ["a.safetensors", "b c", "d"];
    for (i, name) in names.iter().enumerate() {
        common::sample(dir.path(), std::ffi::OsStr::new(name), 300_000 * (i + 1) + 11);
    }
    let b3sum = match Command::new("b3sum").args(names).current_dir(dir.path()).output() {
        Ok(out) => out,
        Err(err) => return skip("sums_digest_blake3_matches_b3sum", &format!("b3sum cannot run: {err}")),
    };
    let out = common::output_or_hang(dmaload().args(["sums", "--digest", "blake3"]).arg(dir.path()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(dir.path().join("B3SUMS")).unwrap(), b3sum.stdout);
    assert!(!dir.path().join("SHA256SUMS").exists());
    // A second run over the directory leaves the sums file itself out.
    let out = common::output_or_hang(dmaload().args(["sums", "--digest", "blake3"]).arg(dir.path()));
    assert!(out.status.success());
    assert_eq!(std::fs::read(dir.path().join("B3SUMS")).unwrap(), b3sum.stdout);

    let file = dir.path().join("d");
    let ok = common::output_or_hang(dmaload().args(["load", "--verify"]).arg(&file));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[700_000] ^= 4;
    std::fs::write(&file, &bytes).unwrap();
    let bad = common::output_or_hang(dmaload().args(["load", "--verify"]).arg(&file));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(stderr.contains("BLAKE3 mismatch") && stderr.contains("B3SUMS"), "{stderr}");
}
