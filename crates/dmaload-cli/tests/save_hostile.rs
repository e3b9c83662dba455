//! `dmaload save` and `dmaload copy` under hostile input and tiny limits,
//! as a user meets them: devices and FIFOs as targets, a source that is a
//! FIFO or the target itself, file names that are not UTF-8, real process
//! limits (setpriv + prlimit) and real SIGKILLs.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

mod common;

use common::*;

fn failure(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(1),
        "not an error exit: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn json_reports_of_non_utf8_paths_do_not_panic() {
    let dir = open_scratch("dmaload-save-");
    let src = sample(dir.path(), OsStr::new("src.bin"), 70_001);
    let dst = dir.path().join(OsStr::from_bytes(b"out-\xff.bin"));
    let report = json_of(&output_or_hang(dmaload().args(["copy", "--json"]).arg(&src).arg(&dst)));
    assert!(report["save"]["path"].as_str().unwrap().ends_with("out-\u{fffd}.bin"), "{report}");
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&src).unwrap());
    let report = json_of(&output_or_hang(dmaload().args(["save", "--json", "--size", "1M"]).arg(&dst)));
    assert_eq!(report["bytes"], 1 << 20);
    assert!(report["target"].as_str().unwrap().ends_with("out-\u{fffd}.bin"), "{report}");
}

#[test]
fn one_process_allowed_saves_and_copies_without_helper_threads() {
    let name = "one_process_allowed_saves_and_copies_without_helper_threads";
    let dir = open_scratch("dmaload-save-");
    let src = sample(dir.path(), OsStr::new("src.bin"), (9 << 20) + 3);
    for engine in ["uring-fixed", "pread-pool"] {
        let dst = dir.path().join(format!("copy-{engine}"));
        // RLIMIT_NPROC counts the user's threads: 1 leaves none to create.
        let Some(mut cmd) = as_nobody_with(name, &["--nproc=1:1"]) else { return };
        let out = output_or_hang(
            cmd.args(["copy", "--json", "--engine", "pread-pool", "--save-engine", engine])
                .arg(&src)
                .arg(&dst),
        );
        let report = json_of(&out);
        assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&src).unwrap(), "{engine}");
        let fallbacks = report["save"]["fallbacks"].to_string();
        assert!(fallbacks.contains("cannot create a thread"), "{engine}: {fallbacks}");
        let Some(mut cmd) = as_nobody_with(name, &["--nproc=1:1"]) else { return };
        let out =
            output_or_hang(cmd.args(["save", "--json", "--size", "9M", "--save-engine", engine]).arg(&dst));
        let report = json_of(&out);
        assert_eq!(report["bytes"], 9 << 20);
        assert!(report["fallbacks"].to_string().contains("cannot create a thread"), "{engine}: {report}");
    }
}

#[test]
fn registered_windows_stay_a_few_ahead_under_a_memlock_limit_smaller_than_the_save() {
    let name = "registered_windows_stay_a_few_ahead_under_a_memlock_limit_smaller_than_the_save";
    let dir = open_scratch("dmaload-save-");
    let dst = dir.path().join("out.bin");
    // 8 windows of 128 MiB under a 640 MiB limit: registered a few ahead of
    // the writes and unregistered behind them, no more than 4 are pinned.
    let Some(mut cmd) = under_memlock(name, 640 << 20) else { return };
    let out = output_or_hang(
        cmd.args(["save", "--json", "--size", "1G", "--save-engine", "uring-fixed"]).arg(&dst),
    );
    let report = json_of(&out);
    assert_eq!(report["bytes"], 1 << 30);
    assert_eq!(report["engine"], "uring-fixed", "{report}");
    assert_eq!(report["fallbacks"], serde_json::json!([]), "{report}");
}

#[test]
fn save_size_beyond_available_memory_is_an_error_before_allocating() {
    let dir = open_scratch("dmaload-save-");
    let dst = dir.path().join("huge.bin");
    let stderr = failure(&output_or_hang(dmaload().args(["save", "--size", "64T"]).arg(&dst)));
    assert!(
        stderr.contains("64.00 TiB") && stderr.contains("available") && stderr.contains("huge.bin"),
        "{stderr}"
    );
    assert!(!dst.exists());
}

#[test]
fn copy_onto_devices_and_fifos_writes_in_place_and_never_hangs() {
    let dir = open_scratch("dmaload-save-");
    let src = sample(dir.path(), OsStr::new("src.bin"), (2 << 20) + 7);
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let stderr = failure(&output_or_hang(dmaload().arg("copy").arg(&src).arg(&fifo)));
    assert!(stderr.contains("no process is reading the FIFO"), "{stderr}");
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    // A FIFO as the source is refused by the loader, not waited on.
    let stderr = failure(&output_or_hang(dmaload().arg("copy").arg(&fifo).arg(dir.path().join("out"))));
    assert!(stderr.contains("FIFO"), "{stderr}");
    assert!(!dir.path().join("out").exists());
    if !is_root() {
        return skip("copy_onto_devices_and_fifos_writes_in_place_and_never_hangs", "mknod needs root");
    }
    let null = dir.path().join("null");
    assert!(Command::new("mknod").arg(&null).args(["c", "1", "3"]).status().unwrap().success());
    let out = output_or_hang(dmaload().arg("copy").arg(&src).arg(&null));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("written in place into the character device"));
    let meta = std::fs::symlink_metadata(&null).unwrap();
    assert!(meta.file_type().is_char_device() && meta.rdev() == libc::makedev(1, 3));
}

#[test]
fn copy_onto_its_own_source_keeps_the_bytes() {
    let dir = open_scratch("dmaload-save-");
    let src = sample(dir.path(), OsStr::new("model.bin"), (4 << 20) + 99);
    let before = std::fs::read(&src).unwrap();
    std::os::unix::fs::symlink("model.bin", dir.path().join("alias")).unwrap();
    for dst in [src.clone(), dir.path().join("alias")] {
        let report = json_of(&output_or_hang(dmaload().args(["copy", "--json"]).arg(&src).arg(&dst)));
        assert_eq!(report["save"]["bytes"], before.len());
        assert_eq!(std::fs::read(&src).unwrap(), before);
    }
    assert!(std::fs::symlink_metadata(dir.path().join("alias")).unwrap().file_type().is_symlink());
}

#[test]
fn an_unwritable_directory_is_an_error_naming_it() {
    let name = "an_unwritable_directory_is_an_error_naming_it";
    let dir = open_scratch("dmaload-save-");
    let locked = dir.path().join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::os::unix::fs::PermissionsExt::from_mode(0o555)).unwrap();
    let Some(mut cmd) = as_nobody_with(name, &[]) else { return };
    let stderr = failure(&output_or_hang(cmd.args(["save", "--size", "4K"]).arg(locked.join("f"))));
    assert!(stderr.contains("Permission denied") && stderr.contains("locked"), "{stderr}");
}

#[test]
fn a_user_replacing_another_users_file_is_told_who_owns_the_new_one() {
    let name = "a_user_replacing_another_users_file_is_told_who_owns_the_new_one";
    let dir = open_scratch("dmaload-save-");
    let target = sample(dir.path(), OsStr::new("shared.bin"), 100);
    std::os::unix::fs::chown(&target, Some(65533), Some(65533)).unwrap();
    let Some(mut cmd) = as_nobody_with(name, &[]) else { return };
    let report = json_of(&output_or_hang(cmd.args(["save", "--json", "--size", "8K"]).arg(&target)));
    let fallbacks = report["fallbacks"].to_string();
    assert!(fallbacks.contains("uid 65533") && fallbacks.contains("belongs to uid 65534"), "{fallbacks}");
    assert_eq!(std::fs::metadata(&target).unwrap().uid(), 65534);
}

#[test]
fn a_file_size_limit_is_an_error_not_sigxfsz() {
    let name = "a_file_size_limit_is_an_error_not_sigxfsz";
    if !have("prlimit") {
        return skip(name, "prlimit (util-linux) not installed");
    }
    let dir = open_scratch("dmaload-save-");
    let src = sample(dir.path(), OsStr::new("src.bin"), 1 << 20);
    let dst = dir.path().join("dst.bin");
    let out = output_or_hang(
        Command::new("prlimit")
            .arg("--fsize=65536")
            .arg(env!("CARGO_BIN_EXE_dmaload"))
            .args(["copy", "--to", "anonymous-thp"])
            .arg(&src)
            .arg(&dst),
    );
    let stderr = failure(&out);
    assert!(stderr.contains("RLIMIT_FSIZE") && stderr.contains("dst.bin"), "{stderr}");
    assert!(!dst.exists());
    // `save` generates its bytes in a memfd, which the limit covers too.
    let out = output_or_hang(
        Command::new("prlimit")
            .arg("--fsize=65536")
            .arg(env!("CARGO_BIN_EXE_dmaload"))
            .args(["save", "--size", "1M"])
            .arg(&dst),
    );
    let stderr = failure(&out);
    assert!(stderr.contains("RLIMIT_FSIZE (65536 bytes)") && stderr.contains("dst.bin"), "{stderr}");
    assert!(!dst.exists());
}

#[test]
fn killed_saves_leave_nothing_that_the_next_save_does_not_remove() {
    let dir = open_scratch("dmaload-save-");
    let dst = dir.path().join("snapshot.bin");
    for round in 0..20u64 {
        let mut child = dmaload()
            .args(["save", "--size", "16M", "--save-mode", "buffered"])
            .arg(&dst)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Kill at a different point of the save each round.
        std::thread::sleep(Duration::from_millis(round * 7 % 60));
        let _ = child.kill();
        child.wait().unwrap();
    }
    let out = output_or_hang(dmaload().args(["save", "--size", "1M"]).arg(&dst));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["snapshot.bin".to_string()]);
    assert_eq!(std::fs::metadata(&dst).unwrap().len(), 1 << 20);
}
