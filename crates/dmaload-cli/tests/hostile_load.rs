//! `dmaload load` and `info` under hostile input and tiny
//! limits, as a user would meet them: real FIFOs, real process limits
//! (setpriv + prlimit), file names that are not UTF-8.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

mod common;

use common::*;

#[test]
fn fifo_paths_are_errors_not_hangs() {
    let dir = open_scratch("dmaload-hostile-");
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    // (dmaload-bench's tests run its `load` on a FIFO the same way.)
    for args in [&["load"][..], &["info"]] {
        let out = output_or_hang(dmaload().args(args).arg(&fifo));
        assert!(!out.status.success(), "{args:?} succeeded on a FIFO");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("FIFO"), "{args:?}: {stderr}");
    }
}

/// Issue 34: `capture --verify` waited for ever on a FIFO where the other
/// subcommands refuse it at once. Every subcommand that reads a path, given
/// a FIFO, an endless character device, a directory or a dangling symlink,
/// ends at once (a hang fails the test, see `output_or_hang`): with an
/// error that names the path, or, where the input is what the subcommand
/// takes (`info` of a directory's filesystem, `sums` of a directory, a
/// capture of a device until its `--size`), done. (A FIFO is a capture's
/// stream: `capture --source` waits for its writer, 30 s at most, as
/// `a_capture_from_a_fifo_with_a_writer_takes_every_byte` and the capture
/// tests run it.)
#[test]
fn special_files_are_errors_at_once_in_every_subcommand() {
    let dir = open_scratch("dmaload-hostile-");
    let inputs = special_files(dir.path());
    let out = dir.path().join("out");
    let out_arg = out.to_str().unwrap();
    let subcommands: &[&[&str]] = &[
        &["load"],
        &["load", "--verify"],
        &["load", "--hash", "--offset", "4096", "--length", "4096"],
        &["info"],
        &["evict"],
        &["sums"],
        &["copy", "@", out_arg],
        // (dmaload-bench's commands: its tests, the same way.)
        &["capture", "--size", "64K", "--block-size", "64K", "--to", out_arg, "--source"],
        &["capture", "--verify"],
    ];
    for (kind, input) in &inputs {
        for args in subcommands {
            if *kind == "FIFO" && args.contains(&"--source") {
                continue;
            }
            let mut cmd = dmaload();
            match args.iter().position(|a| *a == "@") {
                Some(at) => cmd.args(&args[..at]).arg(input).args(&args[at + 1..]),
                None => cmd.args(*args).arg(input),
            };
            let run = output_or_hang(&mut cmd);
            let takes_it = match (*kind, args[0]) {
                ("directory", "info" | "sums") => true,
                ("character device", "capture") => args.contains(&"--source"),
                _ => false,
            };
            assert_ended_at_once(&run, args, kind, input, takes_it);
            let _ = std::fs::remove_file(&out);
        }
    }
}

/// A capture from a FIFO that a process is writing takes every byte.
#[test]
fn a_capture_from_a_fifo_with_a_writer_takes_every_byte() {
    let dir = open_scratch("dmaload-hostile-");
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let bytes: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    // A descriptor for reading and writing (which never reads) first, so
    // the writer's open does not wait for the capture; both close once
    // every byte is written, which ends the stream.
    let keep = std::fs::OpenOptions::new().read(true).write(true).open(&fifo).unwrap();
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    let to = dir.path().join("cap");
    let capture = dmaload()
        .args(["capture", "--block-size", "64K", "--source"])
        .arg(&fifo)
        .arg("--to")
        .arg(&to)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut writer, &bytes).unwrap();
    drop((writer, keep));
    let out = capture.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&to).unwrap(), bytes);
}

/// Issue 34: `--length 0.0000001k` loaded 0 bytes. A size that is not a
/// whole number of bytes is an error naming the option, in every
/// subcommand (they all parse sizes with one parser).
#[test]
fn a_size_that_is_not_whole_bytes_is_an_error_naming_the_option() {
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), 8192);
    let out = dir.path().join("out");
    let runs: [(&str, Vec<&OsStr>); 4] = [
        ("--length", vec!["load".as_ref(), "--length".as_ref(), "0.0000001k".as_ref(), path.as_os_str()]),
        ("--offset", vec!["load".as_ref(), "--offset".as_ref(), "0.5".as_ref(), path.as_os_str()]),
        ("--size", vec!["save".as_ref(), "--size".as_ref(), "0.1K".as_ref(), out.as_os_str()]),
        (
            "--chunk-size",
            vec!["load".as_ref(), "--chunk-size".as_ref(), "1.0000001M".as_ref(), path.as_os_str()],
        ),
    ];
    for (option, args) in runs {
        let run = output_or_hang(dmaload().args(args));
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{option}: {stderr}");
        assert!(stderr.contains(option) && stderr.contains("not a whole number of bytes"), "{stderr}");
        assert!(!out.exists());
    }
}

#[test]
fn non_utf8_paths_print_valid_json() {
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::from_bytes(b"model-\xff\xfe.bin"), 12_345);
    let report = json_of(&output_or_hang(dmaload().args(["load", "--json"]).arg(&path)));
    assert_eq!(report["bytes"], 12_345);
    assert!(report["path"].as_str().unwrap().contains("model-\u{fffd}\u{fffd}.bin"), "{report}");
}

#[test]
fn one_process_allowed_loads_without_helper_threads() {
    let name = "one_process_allowed_loads_without_helper_threads";
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), (9 << 20) + 3);
    let expected = xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap());
    for engine in ["uring-fixed", "pread-pool"] {
        // RLIMIT_NPROC counts the user's threads: 1 leaves none to create.
        let Some(mut cmd) = as_nobody_with(name, &["--nproc=1:1"]) else { return };
        let out = output_or_hang(
            cmd.args(["load", "--json", "--hash", "--gather-size", "1M", "--engine", engine]).arg(&path),
        );
        assert_ne!(
            out.status.code(),
            Some(101),
            "{engine}: panicked: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report = json_of(&out);
        assert_eq!(report["hash"]["xxh3_64"], format!("{expected:016x}"), "{engine}");
        let fallbacks = report["fallbacks"].to_string();
        assert!(fallbacks.contains("cannot create a thread"), "{engine}: {fallbacks}");
    }
}

/// Issue 34: a load larger than the staging ring its reads go through
/// (64 MiB and more on a device whose requests take few entries, such as
/// this VM's virtio disk) failed EAGAIN "create the delivery thread"
/// without a thread to spare; it loads on the calling thread.
#[test]
fn one_process_allowed_loads_a_file_larger_than_the_staging_ring() {
    let name = "one_process_allowed_loads_a_file_larger_than_the_staging_ring";
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), (65 << 20) + 3);
    dmaload::pagecache::evict(&path).unwrap();
    let expected = xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap());
    dmaload::pagecache::evict(&path).unwrap();
    let Some(mut cmd) = as_nobody_with(name, &["--nproc=1:1"]) else { return };
    let report = json_of(&output_or_hang(cmd.args(["load", "--json", "--hash"]).arg(&path)));
    assert_eq!(report["hash"]["xxh3_64"], format!("{expected:016x}"), "{report}");
    assert!(report["fallbacks"].to_string().contains("cannot create a thread"), "{report}");
}

#[test]
fn memlock_limit_of_zero_falls_back_to_the_pread_pool() {
    let name = "memlock_limit_of_zero_falls_back_to_the_pread_pool";
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), (5 << 20) + 11);
    let expected = xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap());
    let Some(mut cmd) = as_nobody_with(name, &["--memlock=0:0"]) else { return };
    let out = output_or_hang(cmd.args(["load", "--json", "--hash"]).arg(&path));
    let report = json_of(&out);
    assert_eq!(report["hash"]["xxh3_64"], format!("{expected:016x}"));
    // Where the kernel still sets up a ring under a zero limit, registration
    // is what fails; either way the reason names the limit.
    let fallbacks = report["fallbacks"].to_string();
    assert!(fallbacks.contains("RLIMIT_MEMLOCK"), "{fallbacks}");
    if report["engine"] == "pread-pool" {
        assert!(fallbacks.contains("io_uring_setup failed with ENOMEM"), "{fallbacks}");
    }
}

#[test]
fn without_a_helper_thread_the_engine_registers_each_gather_as_it_comes_near() {
    let name = "without_a_helper_thread_the_engine_registers_each_gather_as_it_comes_near";
    const LIMIT: u64 = 4 << 20;
    if memlock_hard_limit() < LIMIT {
        return skip(name, "RLIMIT_MEMLOCK's hard limit is below 4 MiB");
    }
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), (32 << 20) + 11);
    let expected = xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap());
    // One process allowed: no populate thread, so the memory is populated
    // before the reads and the engine registers the 256 KiB gathers itself,
    // a few ahead of its reads: about 1 MiB pinned at once, under 4 MiB.
    let limits = ["--nproc=1:1", &format!("--memlock={LIMIT}:{LIMIT}")];
    // A user of its own: nobody's pinned pages, from tests beside this one,
    // would count against the same limit.
    let Some(mut cmd) = as_user_with(3_000_000 + std::process::id(), name, &limits) else { return };
    let args = ["load", "--json", "--hash", "--to", "memfd", "--gather-size", "256K", "--chunk-size", "64K"];
    let out = output_or_hang(cmd.args(args).args(["--queue-depth", "4"]).arg(&path));
    let report = json_of(&out);
    assert_eq!(report["hash"]["xxh3_64"], format!("{expected:016x}"));
    let fallbacks = report["fallbacks"].to_string();
    assert!(fallbacks.contains("populate before the reads"), "{fallbacks}");
    assert!(!fallbacks.contains("RLIMIT_MEMLOCK"), "{fallbacks}");
    // io_uring may still cancel reads it has no worker thread for (the pool
    // then reads): where it does not, the buffers stayed registered.
    if report["engine"] != "pread-pool" {
        assert_eq!(report["engine"], "uring-fixed", "{report}");
    }
}

#[test]
fn a_tiny_file_size_limit_is_an_error_not_sigxfsz() {
    let name = "a_tiny_file_size_limit_is_an_error_not_sigxfsz";
    if !have("prlimit") {
        return skip(name, "prlimit (util-linux) not installed");
    }
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), 1 << 20);
    // A memfd is a file: sizing it past RLIMIT_FSIZE would raise SIGXFSZ.
    let out = output_or_hang(
        Command::new("prlimit")
            .arg("--fsize=4096")
            .arg(env!("CARGO_BIN_EXE_dmaload"))
            .args(["load", "--to", "memfd"])
            .arg(&path),
    );
    assert_eq!(out.status.code(), Some(1), "killed or succeeded: {:?}", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("RLIMIT_FSIZE"), "{stderr}");
    // auto, needing no fd, takes anonymous memory instead and says why.
    let out = output_or_hang(
        Command::new("prlimit").arg("--fsize=4096").arg(env!("CARGO_BIN_EXE_dmaload")).arg("load").arg(&path),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // (By rule, or by figures `dmaload info --probe-memory` recorded here.)
    assert!(stdout.contains("memory    anonymous"), "{stdout}");
    // anonymous memory is not a file, and loads.
    for kind in ["anonymous-thp", "anonymous"] {
        let out = output_or_hang(
            Command::new("prlimit")
                .arg("--fsize=4096")
                .arg(env!("CARGO_BIN_EXE_dmaload"))
                .args(["load", "--to", kind])
                .arg(&path),
        );
        assert!(out.status.success(), "{kind}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn too_few_file_descriptors_for_a_ring_fall_back_to_the_pread_pool() {
    let name = "too_few_file_descriptors_for_a_ring_fall_back_to_the_pread_pool";
    if !have("prlimit") {
        return skip(name, "prlimit (util-linux) not installed");
    }
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), (2 << 20) + 5);
    let expected = xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap());
    // stdin/out/err, the file and the memfd: no descriptor left for a ring.
    let mut cmd = Command::new("prlimit");
    cmd.arg("--nofile=6")
        .arg(env!("CARGO_BIN_EXE_dmaload"))
        .args(["load", "--json", "--hash", "--to", "memfd"]);
    // Without the descriptors this process inherited (a CI runner's, say),
    // which would take the child's few.
    // SAFETY: close_inherited_fds makes one async-signal-safe syscall.
    unsafe { cmd.pre_exec(close_inherited_fds) };
    let out = output_or_hang(cmd.arg(&path));
    let report = json_of(&out);
    assert_eq!(report["hash"]["xxh3_64"], format!("{expected:016x}"));
    assert_eq!(report["engine"], "pread-pool", "{report}");
    assert!(report["fallbacks"].to_string().contains("RLIMIT_NOFILE"), "{report}");
}

/// Marks every descriptor past stdin, stdout and stderr close-on-exec
/// (`close_range` with `CLOSE_RANGE_CLOEXEC`), so the exec drops them.
fn close_inherited_fds() -> std::io::Result<()> {
    // SAFETY: close_range takes no pointers, and with CLOSE_RANGE_CLOEXEC
    // closes nothing before the exec.
    if unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The files dmaload keeps for the user between runs
/// (`$XDG_CACHE_HOME/dmaload/tuning` and `memory-probe.json`) may be
/// anything a path can be: a FIFO (opening it waits for a writer for good)
/// or a link to `/dev/zero` (reading it never ends). A load goes on without
/// them, bit-exact, and its memory choice says why the probe figures were
/// passed over.
#[test]
fn a_fifo_or_endless_device_in_place_of_the_users_cache_files_is_passed_over() {
    let dir = open_scratch("dmaload-hostile-");
    let path = sample(dir.path(), OsStr::new("f.bin"), (3 << 20) + 5);
    let expected = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&std::fs::read(&path).unwrap()));
    let cache = dir.path().join("xdg");
    let kept = cache.join("dmaload");
    for (fifo, endless) in [("tuning", "memory-probe.json"), ("memory-probe.json", "tuning")] {
        let _ = std::fs::remove_dir_all(&kept);
        std::fs::create_dir_all(&kept).unwrap();
        assert!(Command::new("mkfifo").arg(kept.join(fifo)).status().unwrap().success());
        std::os::unix::fs::symlink("/dev/zero", kept.join(endless)).unwrap();
        let out = output_or_hang(
            dmaload()
                .args(["load", "--json", "--hash"])
                .arg(&path)
                .env_remove("DMALOAD_CACHE_DIR")
                .env("XDG_CACHE_HOME", &cache),
        );
        let report = json_of(&out);
        assert_eq!(report["hash"]["xxh3_64"], expected.as_str(), "{report}");
        let reason = report["memory_reason"].as_str().unwrap();
        assert!(reason.contains("memory-probe.json: not a regular file"), "{fifo} a FIFO: {reason}");
    }
}
