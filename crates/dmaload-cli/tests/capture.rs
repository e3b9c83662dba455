//! `dmaload capture`: two real processes (the command re-executes itself
//! for the producer) joined by a block queue, writing to a real file.
//! Synthetic captures verify; a FIFO and a file arrive bit-exact; drops are
//! counted the same by both ends; killing either process never hangs the
//! other and never leaves a torn file.

mod common;

use std::ffi::OsStr;
use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{as_user_with, dmaload, have, json_of, open_scratch, output_or_hang, sample, skip};

fn verify(path: &Path) -> std::process::Output {
    output_or_hang(dmaload().args(["capture", "--json", "--verify"]).arg(path))
}

#[test]
fn a_synthetic_capture_verifies_block_by_block() {
    let dir = open_scratch("dmaload-capture-");
    let to = dir.path().join("cap");
    let report = json_of(&output_or_hang(
        dmaload()
            .args([
                "capture",
                "--source",
                "synthetic",
                "--size",
                "40M",
                "--block-size",
                "64K",
                "--blocks",
                "8",
                "--json",
                "--to",
            ])
            .arg(&to),
    ));
    assert_eq!(report["complete"], true);
    assert_eq!(report["blocks"], 640);
    assert_eq!(report["bytes"], 40 << 20);
    assert_eq!(report["dropped"], 0);
    assert!(report["producer_cpu_seconds"].as_f64().unwrap() > 0.0);
    assert!(report["consumer_cpu_seconds"].as_f64().unwrap() > 0.0);
    let verdict = json_of(&verify(&to));
    assert_eq!((verdict["ok"].as_bool(), verdict["blocks"].as_u64()), (Some(true), Some(640)));

    // One flipped byte fails the check, naming the block.
    let mut bytes = std::fs::read(&to).unwrap();
    bytes[3 * 65536 + 1000] ^= 1;
    std::fs::write(&to, &bytes).unwrap();
    let out = verify(&to);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("block 3 at byte 196608: checksum mismatch"));
}

/// A source that cannot be opened fails the capture with one line naming
/// it and the cause (the producer's, said once), before any file exists.
#[test]
fn a_source_that_cannot_be_opened_is_one_error_line() {
    let dir = open_scratch("dmaload-capture-");
    let to = dir.path().join("cap");
    let missing = dir.path().join("no-such-source");
    let out = output_or_hang(
        dmaload().args(["capture", "--size", "1M", "--source"]).arg(&missing).arg("--to").arg(&to),
    );
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!("dmaload: error: open {}: No such file or directory (os error 2)\n", missing.display())
    );
    assert!(!to.exists());
}

/// Runs are written several at once; rings too small to split still make
/// progress, and the largest block size works.
#[test]
fn tiny_rings_and_huge_blocks_capture_whole() {
    let dir = open_scratch("dmaload-capture-");
    for (blocks, block, size) in
        [("1", "64K", "4M"), ("3", "64K", "4M"), ("5", "4K", "4M"), ("2", "64M", "128M")]
    {
        let to = dir.path().join(format!("cap-{blocks}-{block}"));
        let report = json_of(&output_or_hang(
            dmaload()
                .args(["capture", "--source", "synthetic", "--no-sync", "--json", "--size", size])
                .args(["--blocks", blocks, "--block-size", block, "--to"])
                .arg(&to),
        ));
        assert_eq!(report["complete"], true, "{blocks} × {block}");
        let verdict = json_of(&verify(&to));
        assert_eq!(verdict["ok"], true, "{blocks} × {block}");
        std::fs::remove_file(&to).unwrap();
    }
}

#[test]
fn files_and_fifos_arrive_bit_exact_with_an_unaligned_tail() {
    let dir = open_scratch("dmaload-capture-");
    let len = (3 << 20) + 12345;
    let src = sample(dir.path(), "src".as_ref(), len);
    let to = dir.path().join("from-file");
    let report = json_of(&output_or_hang(
        dmaload()
            .args(["capture", "--block-size", "256K", "--blocks", "4", "--json", "--source"])
            .arg(&src)
            .arg("--to")
            .arg(&to),
    ));
    assert_eq!(report["bytes"], len);
    assert_eq!(std::fs::read(&to).unwrap(), std::fs::read(&src).unwrap());

    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let data = std::fs::read(&src).unwrap();
    let writer = {
        let fifo = fifo.clone();
        let data = data.clone();
        // Small writes: the producer must fill blocks across many reads.
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().write(true).open(fifo).unwrap();
            for piece in data.chunks(10_000) {
                f.write_all(piece).unwrap();
            }
        })
    };
    let to = dir.path().join("from-fifo");
    let report = json_of(&output_or_hang(
        dmaload()
            .args(["capture", "--block-size", "64K", "--json", "--source"])
            .arg(&fifo)
            .arg("--to")
            .arg(&to),
    ));
    writer.join().unwrap();
    assert_eq!(report["bytes"], len);
    assert_eq!(std::fs::read(&to).unwrap(), data);

    // A character device, bounded by --size.
    let to = dir.path().join("from-device");
    let report = json_of(&output_or_hang(
        dmaload().args(["capture", "--source", "/dev/zero", "--size", "1000000", "--json", "--to"]).arg(&to),
    ));
    assert_eq!(report["bytes"], 1_000_000);
    assert!(std::fs::read(&to).unwrap().iter().all(|&b| b == 0));

    // A source that cannot be opened fails before any file exists.
    let to = dir.path().join("never");
    let out = output_or_hang(dmaload().args(["capture", "--source", "/nonexistent/x", "--to"]).arg(&to));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("open /nonexistent/x"));
    assert!(!to.exists());

    // A capture file that cannot be created is one error, the consumer's:
    // the producer it stops does not add that the consumer went away.
    let to = dir.path().join("no-such-dir").join("cap");
    let out =
        output_or_hang(dmaload().args(["capture", "--source", "synthetic", "--size", "1M", "--to"]).arg(&to));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no-such-dir"), "{stderr}");
    assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
}

/// A ring of two small blocks against storage with fsyncs: the producer
/// outruns the consumer. Waiting loses nothing; dropping loses blocks that
/// both ends count the same and the verifier finds missing.
#[test]
fn a_full_ring_waits_or_drops_and_counts() {
    let dir = open_scratch("dmaload-capture-");
    for policy in ["wait", "drop"] {
        let to = dir.path().join(policy);
        let out = output_or_hang(
            dmaload()
                .args([
                    "capture",
                    "--source",
                    "synthetic",
                    "--size",
                    "16M",
                    "--block-size",
                    "4K",
                    "--blocks",
                    "2",
                ])
                .args(["--on-full", policy, "--json", "--to"])
                .arg(&to),
        );
        let report = json_of(&out);
        let (dropped, gaps) = (report["dropped"].as_u64().unwrap(), report["gaps_seen"].as_u64().unwrap());
        assert_eq!(dropped, gaps, "{policy}: producer and consumer disagree");
        assert_eq!(report["blocks"].as_u64().unwrap() + dropped, 4096, "{policy}");
        let listed: u64 = report["dropped_ranges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r[1].as_u64().unwrap() - r[0].as_u64().unwrap() + 1)
            .sum();
        let verdict = verify(&to);
        let verdict_json: serde_json::Value = serde_json::from_slice(&verdict.stdout).unwrap();
        // The verifier sees the gaps before the last block captured.
        assert!(verdict_json["missing"].as_u64().unwrap() <= dropped, "{policy}");
        if policy == "wait" {
            assert_eq!(dropped, 0);
            assert!(verdict.status.success());
        } else {
            assert!(listed <= dropped);
            assert_eq!(verdict.status.success(), verdict_json["missing"] == 0);
            eprintln!("drop policy: {dropped} of 4096 blocks dropped");
        }
    }
}

/// The producer process of a running capture (the consumer's child).
fn producer_of(consumer: &Child) -> u32 {
    let started = Instant::now();
    loop {
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", consumer.id()))
            .unwrap_or_default();
        if let Some(pid) = children.split_whitespace().next() {
            return pid.parse().unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(30), "no producer started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill(pid: u32) {
    assert!(std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap().success());
}

/// Waits until process `pid` has written bytes into a file under `dir`:
/// a capture's temporary file, unnamed where `O_TMPFILE` works, reached
/// through `/proc/<pid>/fd`. Fails past a generous bound.
fn wait_for_bytes_written(pid: u32, dir: &Path) {
    let started = Instant::now();
    loop {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).into_iter().flatten().flatten();
        let written = fds.into_iter().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|file| file.starts_with(dir))
                && std::fs::metadata(fd.path()).is_ok_and(|meta| meta.len() > 0)
        });
        if written {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the capture wrote nothing in 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_bounded(child: &mut Child) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "hung after its peer was killed");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn start_long_capture(to: &Path) -> Child {
    dmaload()
        .args([
            "capture",
            "--source",
            "synthetic",
            "--rate",
            "40M/s",
            "--duration",
            "60s",
            "--block-size",
            "64K",
            "--to",
        ])
        .arg(to)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_killed_consumer_stops_the_producer_and_leaves_the_old_file() {
    let dir = open_scratch("dmaload-capture-");
    let to = dir.path().join("cap");
    std::fs::write(&to, b"the previous capture").unwrap();
    let mut consumer = start_long_capture(&to);
    let producer = producer_of(&consumer);
    // Killed mid-stream: once a block is on disk.
    wait_for_bytes_written(consumer.id(), dir.path());
    consumer.kill().unwrap();
    consumer.wait().unwrap();
    // The producer is not our child: wait for its /proc entry to go.
    let started = Instant::now();
    while Path::new(&format!("/proc/{producer}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{producer}/stat")).unwrap_or_default().contains(") Z")
    {
        assert!(started.elapsed() < Duration::from_secs(30), "the producer hung after the consumer died");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(std::fs::read(&to).unwrap(), b"the previous capture");
    let stray: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(stray.len(), 1, "{stray:?}");
}

#[test]
fn a_killed_producer_leaves_every_block_it_delivered() {
    let dir = open_scratch("dmaload-capture-");
    let to = dir.path().join("cap");
    let mut consumer = start_long_capture(&to);
    let producer = producer_of(&consumer);
    // Killed once a block is on disk, whatever the machine's load.
    wait_for_bytes_written(consumer.id(), dir.path());
    kill(producer);
    let status = wait_bounded(&mut consumer);
    let out = consumer.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success());
    assert!(stderr.contains("the capture stopped after") && stderr.contains("without finishing"), "{stderr}");
    let verdict = json_of(&verify(&to));
    assert!(verdict["blocks"].as_u64().unwrap() > 0);
    assert_eq!(verdict["missing"], 0);
    assert_eq!(verdict["ok"], true, "every block delivered before the kill is whole and in order");
}

/// Waits until process `pid` sleeps reading an empty FIFO (`path`): every
/// byte written to it has been read and enqueued. Its state, wait channel
/// (`pipe_read`, or `anon_pipe_read` on newer kernels) and current syscall are the
/// marker, not a pause.
fn wait_blocked_reading(pid: u32, path: &Path, writer: &std::fs::File) {
    use std::os::fd::AsRawFd;
    let started = Instant::now();
    loop {
        let mut unread: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int to the pointer given.
        assert_eq!(unsafe { libc::ioctl(writer.as_raw_fd(), libc::FIONREAD, &mut unread) }, 0);
        let fd =
            std::fs::read_dir(format!("/proc/{pid}/fd")).into_iter().flatten().flatten().find_map(|fd| {
                (std::fs::read_link(fd.path()).ok()? == path)
                    .then(|| fd.file_name().to_string_lossy().into_owned())
            });
        let syscall = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
        let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let reading = fd.is_some_and(|fd| {
            let mut words = syscall.split_whitespace();
            // read(2) is syscall 0 on x86_64, 63 on aarch64.
            let read_nr = if cfg!(target_arch = "aarch64") { "63" } else { "0" };
            words.next() == Some(read_nr)
                && words.next() == Some(&format!("0x{:x}", fd.parse::<u32>().unwrap()))
        });
        if unread == 0 && reading && wchan.trim().ends_with("pipe_read") && stat.contains(") S ") {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the producer never waited on the FIFO");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The producer killed after delivering 11 blocks, fewer than a run (8 of
/// a 32-block ring) past the last whole run: all 11 are in the file, and
/// the message counts 11.
#[test]
fn a_killed_producer_leaves_the_blocks_short_of_a_run_too() {
    let dir = open_scratch("dmaload-capture-");
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let to = dir.path().join("cap");
    let mut consumer = dmaload()
        .args(["capture", "--block-size", "64K", "--blocks", "32", "--source"])
        .arg(&fifo)
        .arg("--to")
        .arg(&to)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let producer = producer_of(&consumer);
    // Blocks until the producer opens the FIFO; kept open, so it sees no end.
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    let data: Vec<u8> = (0..11 * 65536u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    writer.write_all(&data).unwrap();
    wait_blocked_reading(producer, &fifo, &writer);
    kill(producer);
    let status = wait_bounded(&mut consumer);
    let out = consumer.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success());
    assert!(stderr.contains("the capture stopped after 11 blocks"), "{stderr}");
    assert!(stderr.contains("without finishing the stream, after 11 blocks"), "{stderr}");
    assert!(std::fs::read(&to).unwrap() == data, "the file holds every delivered block: {stderr}");
}

#[test]
fn a_stream_that_breaks_before_its_first_block_keeps_the_old_file() {
    let dir = open_scratch("dmaload-capture-");
    let to = dir.path().join("cap");
    std::fs::write(&to, b"the previous capture").unwrap();
    // /proc/self/mem opens but cannot be read at offset 0 (EIO): the
    // producer fails before it enqueues anything. (A directory, which did
    // the same, is now refused at its open.)
    let out = output_or_hang(dmaload().args(["capture", "--source", "/proc/self/mem", "--to"]).arg(&to));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("without finishing") && stderr.contains("no block arrived"), "{stderr}");
    assert_eq!(std::fs::read(&to).unwrap(), b"the previous capture");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file is left");
}

/// RLIMIT_NPROC counts the user's processes and threads: the consumer and
/// the producer use up 2, leaving no writing thread; 3 leaves one.
#[test]
fn a_process_limit_leaves_fewer_writing_threads_or_a_clear_error() {
    let name = "a_process_limit_leaves_fewer_writing_threads_or_a_clear_error";
    let dir = open_scratch("dmaload-capture-");
    let to = dir.path().join("cap");
    std::fs::write(&to, b"the previous capture").unwrap();
    let args = ["capture", "--source", "synthetic", "--size", "8M", "--block-size", "64K", "--json", "--to"];
    // A user of its own: other tests' processes do not count against it.
    let uid = 3_100_000 + std::process::id();
    let Some(mut cmd) = as_user_with(uid, name, &["--nproc=2:2"]) else { return };
    let out = output_or_hang(cmd.args(args).arg(&to));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot create a writing thread") && stderr.contains("cap"), "{stderr}");
    assert_eq!(std::fs::read(&to).unwrap(), b"the previous capture");

    let Some(mut cmd) = as_user_with(uid, name, &["--nproc=3:3"]) else { return };
    let out = output_or_hang(cmd.args(args).arg(&to));
    let report = json_of(&out);
    assert_eq!(report["bytes"], 8 << 20);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("fallback 4 writing threads -> 1: cannot create a writing thread"), "{stderr}");
    assert_eq!(json_of(&verify(&to))["ok"], true);
}

/// io_uring cancels the writes it cannot create a worker thread for
/// (RLIMIT_NPROC): a capture writes those with pwrite instead of failing.
#[test]
fn writes_io_uring_cancels_under_a_process_limit_are_written_with_pwrite() {
    let name = "writes_io_uring_cancels_under_a_process_limit_are_written_with_pwrite";
    let dir = open_scratch("dmaload-capture-");
    let src = sample(dir.path(), OsStr::new("src.bin"), (8 << 20) + 5);
    let to = dir.path().join("cap");
    // The consumer, its four writing threads and the producer: no room
    // left for io_uring's workers (a user of its own, as above).
    let Some(mut cmd) = as_user_with(3_200_000 + std::process::id(), name, &["--nproc=6:6"]) else { return };
    let out = output_or_hang(
        cmd.args(["capture", "--json", "--block-size", "64K", "--source"]).arg(&src).arg("--to").arg(&to),
    );
    let report = json_of(&out);
    assert_eq!(report["bytes"], (8 << 20) + 5);
    assert_eq!(std::fs::read(&to).unwrap(), std::fs::read(&src).unwrap());
    if report["engine"] == "pread-pool" {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("io_uring cancelled a write"), "{stderr}");
    }
}

/// RLIMIT_FSIZE limits memfds like files: a ring larger than it is an
/// error, not a SIGXFSZ kill.
#[test]
fn a_ring_past_the_file_size_limit_is_an_error_not_sigxfsz() {
    let name = "a_ring_past_the_file_size_limit_is_an_error_not_sigxfsz";
    if !have("prlimit") {
        return skip(name, "prlimit (util-linux) not installed");
    }
    let dir = open_scratch("dmaload-capture-");
    let to = dir.path().join("cap");
    let out = output_or_hang(
        Command::new("prlimit")
            .arg("--fsize=1048576")
            .arg(env!("CARGO_BIN_EXE_dmaload"))
            .args(["capture", "--source", "synthetic", "--size", "64K", "--block-size", "64K", "--to"])
            .arg(&to),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("2097152 bytes") && stderr.contains("RLIMIT_FSIZE"), "{stderr}");
    assert!(!to.exists());
}

/// A capture that would grow past RLIMIT_FSIZE is an error at the run that
/// would cross it, or before it starts when its size is known: never a
/// SIGXFSZ kill, and the previous file stays.
#[test]
fn a_capture_past_the_file_size_limit_is_an_error_not_sigxfsz() {
    let name = "a_capture_past_the_file_size_limit_is_an_error_not_sigxfsz";
    if !have("prlimit") {
        return skip(name, "prlimit (util-linux) not installed");
    }
    let dir = open_scratch("dmaload-capture-");
    let src = sample(dir.path(), OsStr::new("src.bin"), (2 << 20) + 5);
    let to = dir.path().join("cap");
    std::fs::write(&to, b"the previous capture").unwrap();
    let capture = |source: &[&OsStr]| {
        output_or_hang(
            Command::new("prlimit")
                .arg("--fsize=1048576")
                .arg(env!("CARGO_BIN_EXE_dmaload"))
                .args(["capture", "--block-size", "64K", "--blocks", "4", "--to"])
                .arg(&to)
                .args(source),
        )
    };
    for source in [
        vec![OsStr::new("--source"), src.as_os_str()],
        vec![OsStr::new("--source"), OsStr::new("synthetic"), OsStr::new("--size"), OsStr::new("2M")],
    ] {
        let out = capture(&source);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{source:?}: {stderr}");
        assert!(stderr.contains("RLIMIT_FSIZE (1048576 bytes)") && stderr.contains("cap"), "{stderr}");
        assert_eq!(std::fs::read(&to).unwrap(), b"the previous capture");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "no temporary file is left");
    }
}

/// A replaced capture file keeps its permission bits whatever the umask,
/// and (for root) its owner, as a save's does.
#[test]
fn a_replaced_capture_keeps_the_old_files_mode_and_owner() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = open_scratch("dmaload-capture-");
    let src = sample(dir.path(), OsStr::new("src.bin"), (1 << 20) + 5);
    let to = dir.path().join("cap");
    std::fs::write(&to, b"the previous capture").unwrap();
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o664)).unwrap();
    let owner = common::is_root().then(|| std::os::unix::fs::chown(&to, Some(65533), Some(65533)).unwrap());
    let out = output_or_hang(
        Command::new("sh")
            .args(["-c", "umask 077; exec \"$0\" \"$@\"", env!("CARGO_BIN_EXE_dmaload")])
            .args(["capture", "--block-size", "64K", "--source"])
            .arg(&src)
            .arg("--to")
            .arg(&to),
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&to).unwrap(), std::fs::read(&src).unwrap());
    let meta = std::fs::metadata(&to).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o664);
    if owner.is_some() {
        assert_eq!((meta.uid(), meta.gid()), (65533, 65533));
    }
}

/// Unmounts a test's tmpfs on drop.
struct Mounted(std::path::PathBuf);
impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Device data cannot be read again: a filesystem that fills up mid-capture
/// keeps the whole blocks written before it, says so, and leaves no
/// temporary file. One that cannot take the first run keeps the old file.
#[test]
fn a_full_filesystem_keeps_the_blocks_written_before_it() {
    const TEST: &str = "a_full_filesystem_keeps_the_blocks_written_before_it";
    if !common::is_root() {
        return skip(TEST, "mounting a tmpfs needs root");
    }
    let dir = open_scratch("dmaload-capture-");
    let mount = dir.path().join("mnt");
    std::fs::create_dir(&mount).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"]).arg(&mount).status();
    if !mounted.is_ok_and(|s| s.success()) {
        return skip(TEST, "cannot mount a tmpfs");
    }
    let _mounted = Mounted(mount.clone());
    let to = mount.join("cap");
    std::fs::write(&to, b"the previous capture").unwrap();
    let capture = |block_size: &str| {
        output_or_hang(
            dmaload()
                .args(["capture", "--source", "synthetic", "--duration", "60s", "--block-size", block_size])
                .args(["--blocks", "32", "--to"])
                .arg(&to),
        )
    };
    // Runs of 8 MiB: the first finds the disk full, nothing to keep.
    let out = capture("1M");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("No space left on device"), "{stderr}");
    assert_eq!(std::fs::read(&to).unwrap(), b"the previous capture");
    // Runs of 512 KiB: several land before the disk fills.
    let out = capture("64K");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the capture stopped after") && stderr.contains("the filesystem is full"),
        "{stderr}"
    );
    let verdict = json_of(&verify(&to));
    let blocks = verdict["blocks"].as_u64().unwrap();
    assert!(blocks > 0 && blocks * 65536 <= 4 << 20, "{verdict}");
    assert_eq!((verdict["ok"].as_bool(), verdict["missing"].as_u64()), (Some(true), Some(0)), "{verdict}");
    assert_eq!(std::fs::metadata(&to).unwrap().len(), blocks * 65536);
    let names: Vec<_> = std::fs::read_dir(&mount).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["cap"], "no temporary file is left");
}
