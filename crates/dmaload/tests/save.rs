//! `save`: content, engines, O_DIRECT with a buffered tail, and crash
//! safety against a full filesystem (a small tmpfs and a small ext4 loop
//! mount, where root can make them).

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use common::*;
use dmaload::{CachePolicy, Engine, ErrorKind, IoMode, LoadOptions, SaveOptions};

/// A page-aligned buffer holding the pattern, as a load returns it.
fn loaded_pattern(dir: &Path, len: u64) -> dmaload::Buffer {
    let src = dir.join(format!("src{len}"));
    write_pattern_file(&src, len);
    dmaload::load(&src, &LoadOptions::default()).unwrap().0
}

/// Files in `dir` other than `keep`: a save must leave no temporary behind.
fn strays(dir: &Path, keep: &[&str]) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()) && !n.starts_with("src"))
        .collect()
}

#[test]
fn every_engine_saves_odd_sizes_exactly_with_a_direct_body_and_buffered_tail() {
    let dir = scratch_dir();
    for len in [0u64, 1, 4095, 4096, 4097, (1 << 20) + 3, (5 << 20) + 4097] {
        let buffer = loaded_pattern(dir.path(), len);
        for engine in Engine::ALL {
            let target = dir.path().join("out");
            let opts = SaveOptions { engine, chunk_size: 1 << 20, ..SaveOptions::default() };
            let report = dmaload::save(&buffer, &target, &opts).unwrap();
            let bytes = std::fs::read(&target).unwrap();
            assert_eq!(bytes.len() as u64, len, "{engine:?} {len}");
            assert_pattern(&bytes, 0);
            assert_eq!(report.bytes, len);
            if len > 0 {
                assert_eq!(report.cache, CachePolicy::Bypass, "ext4 takes O_DIRECT: {:?}", report.fallbacks);
                assert_eq!(report.direct_bytes, len / report.alignment as u64 * report.alignment as u64);
            }
            assert_eq!(report.fallbacks, vec![], "{engine:?}");
            assert_eq!(strays(dir.path(), &["out"]), Vec::<String>::new());
        }
    }
}

#[test]
fn replacing_keeps_the_old_permissions_and_buffered_mode_works() {
    let dir = scratch_dir();
    let target = dir.path().join("model.bin");
    std::fs::write(&target, b"old contents").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
    let buffer = loaded_pattern(dir.path(), 100_000);
    let opts = SaveOptions { mode: IoMode::Buffered, ..SaveOptions::default() };
    let report = dmaload::save(&buffer, &target, &opts).unwrap();
    assert!(report.replaced);
    assert_eq!(report.cache, CachePolicy::Keep);
    assert_pattern(&std::fs::read(&target).unwrap(), 0);
    assert_eq!(std::fs::metadata(&target).unwrap().permissions().mode() & 0o777, 0o640);
}

#[test]
fn unaligned_memory_falls_back_to_buffered_or_fails_when_direct_is_required() {
    let dir = scratch_dir();
    let buffer = loaded_pattern(dir.path(), 70_000);
    let unaligned = &buffer[1..];
    let target = dir.path().join("t");
    let report = dmaload::save(unaligned, &target, &SaveOptions::default()).unwrap();
    assert_eq!(report.cache, CachePolicy::Keep);
    assert!(report.fallbacks[0].reason.contains("not aligned"), "{:?}", report.fallbacks);
    assert_pattern(&std::fs::read(&target).unwrap(), 1);
    let err =
        dmaload::save(unaligned, &target, &SaveOptions { mode: IoMode::Direct, ..SaveOptions::default() })
            .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DirectIoUnavailable);
    assert_pattern(&std::fs::read(&target).unwrap(), 1);
}

#[test]
fn a_missing_directory_is_an_error_naming_it() {
    let dir = scratch_dir();
    let target = dir.path().join("nope").join("f");
    let err = dmaload::save(b"x", &target, &SaveOptions::default()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    assert!(err.to_string().contains("nope"), "{err}");
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Unmounts (and detaches the loop device of) a test mount on drop.
struct Mounted(std::path::PathBuf);
impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-d").arg(&self.0).status();
    }
}

/// A full filesystem: the old file survives, nothing is left behind, and
/// the error is ENOSPC naming the target.
fn save_onto_a_full_filesystem(mount: &Path, test: &str) {
    let target = mount.join("snapshot.bin");
    std::fs::write(&target, b"the previous good snapshot").unwrap();
    let dir = scratch_dir();
    let buffer = loaded_pattern(dir.path(), 8 << 20);
    for engine in [Engine::UringFixed, Engine::Read] {
        let err =
            dmaload::save(&buffer, &target, &SaveOptions { engine, ..SaveOptions::default() }).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{test}: {err}");
        assert!(err.to_string().contains(&target.display().to_string()), "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"the previous good snapshot", "{test}");
        assert_eq!(strays(mount, &["snapshot.bin", "lost+found"]), Vec::<String>::new(), "{test}");
    }
}

#[test]
fn enospc_on_a_small_tmpfs_keeps_the_old_file() {
    const TEST: &str = "enospc_on_a_small_tmpfs_keeps_the_old_file";
    if !is_root() {
        return skip(TEST, "mounting a tmpfs needs root");
    }
    let dir = scratch_dir();
    let mount = dir.path().join("mnt");
    std::fs::create_dir(&mount).unwrap();
    if let Err(e) = run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"]).arg(&mount)) {
        return skip(TEST, &e);
    }
    let _mounted = Mounted(mount.clone());
    save_onto_a_full_filesystem(&mount, TEST);
}

#[test]
fn enospc_on_a_small_ext4_loop_mount_keeps_the_old_file() {
    const TEST: &str = "enospc_on_a_small_ext4_loop_mount_keeps_the_old_file";
    if !is_root() {
        return skip(TEST, "loop mounts need root");
    }
    let dir = scratch_dir();
    let image = dir.path().join("fs.img");
    let mount = dir.path().join("mnt");
    std::fs::create_dir(&mount).unwrap();
    let made = run(Command::new("truncate").args(["-s", "4M"]).arg(&image))
        .and_then(|()| run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image)))
        .and_then(|()| run(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&mount)));
    if let Err(e) = made {
        return skip(TEST, &format!("cannot make an ext4 loop mount: {e}"));
    }
    let _mounted = Mounted(mount.clone());
    save_onto_a_full_filesystem(&mount, TEST);
}

#[test]
fn symlinks_are_written_through_and_stay_links() {
    let dir = scratch_dir();
    let d = dir.path();
    let buffer = loaded_pattern(d, 10_000);
    std::fs::write(d.join("real.bin"), b"old").unwrap();
    std::os::unix::fs::symlink("real.bin", d.join("link")).unwrap();
    std::os::unix::fs::symlink(d.join("link"), d.join("chain")).unwrap();
    let report = dmaload::save(&buffer, d.join("chain"), &SaveOptions::default()).unwrap();
    assert_eq!(report.target, d.join("real.bin"));
    assert!(report.replaced && !report.in_place);
    assert_pattern(&std::fs::read(d.join("real.bin")).unwrap(), 0);
    for link in ["link", "chain"] {
        assert!(std::fs::symlink_metadata(d.join(link)).unwrap().file_type().is_symlink(), "{link}");
    }
    // A dangling link creates its target, through a relative path.
    std::fs::create_dir(d.join("sub")).unwrap();
    std::os::unix::fs::symlink("sub/../sub/new.bin", d.join("dangling")).unwrap();
    let report = dmaload::save(&buffer, d.join("dangling"), &SaveOptions::default()).unwrap();
    assert!(!report.replaced);
    assert_pattern(&std::fs::read(d.join("sub/new.bin")).unwrap(), 0);
    assert!(std::fs::symlink_metadata(d.join("dangling")).unwrap().file_type().is_symlink());
    assert_eq!(strays(&d.join("sub"), &["new.bin"]), Vec::<String>::new());
    // A loop is ELOOP, and nothing is created.
    std::os::unix::fs::symlink("loop-b", d.join("loop-a")).unwrap();
    std::os::unix::fs::symlink("loop-a", d.join("loop-b")).unwrap();
    let err = dmaload::save(&buffer, d.join("loop-a"), &SaveOptions::default()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ELOOP), "{err}");
    assert!(std::fs::symlink_metadata(d.join("loop-a")).unwrap().file_type().is_symlink());
}

#[test]
fn a_fifo_is_written_in_place_and_one_without_a_reader_is_an_error_not_a_hang() {
    let dir = scratch_dir();
    let fifo = dir.path().join("fifo");
    if let Err(e) = run(Command::new("mkfifo").arg(&fifo)) {
        return skip("a_fifo_is_written_in_place_and_one_without_a_reader_is_an_error_not_a_hang", &e);
    }
    let buffer = loaded_pattern(dir.path(), (3 << 20) + 5);
    let err = dmaload::save(&buffer, &fifo, &SaveOptions::default()).unwrap_err();
    assert!(err.to_string().contains("no process is reading the FIFO"), "{err}");
    assert!(err.to_string().contains("fifo"), "{err}");
    // A real reader: a process that copies the FIFO to a file.
    let copied = dir.path().join("copied");
    let mut reader =
        Command::new("sh").arg("-c").arg("cat \"$0\" > \"$1\"").arg(&fifo).arg(&copied).spawn().unwrap();
    let report = loop {
        // The reader may not have opened the FIFO yet: ENXIO until it has.
        match dmaload::save(&buffer, &fifo, &SaveOptions::default()) {
            Err(err) if err.to_string().contains("no process is reading") => std::thread::yield_now(),
            other => break other.unwrap(),
        }
    };
    assert!(reader.wait().unwrap().success());
    assert!(report.in_place && report.file_type == "FIFO" && !report.replaced, "{report:?}");
    assert_eq!(report.engine, Engine::Read);
    assert_pattern(&std::fs::read(&copied).unwrap(), 0);
    assert_eq!(std::fs::read(&copied).unwrap().len(), buffer.len());
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    assert_eq!(strays(dir.path(), &["fifo", "copied"]), Vec::<String>::new());
}

#[test]
fn character_devices_are_written_in_place_never_replaced() {
    const TEST: &str = "character_devices_are_written_in_place_never_replaced";
    if !is_root() {
        return skip(TEST, "mknod needs root");
    }
    let dir = scratch_dir();
    let (null, full) = (dir.path().join("null"), dir.path().join("full"));
    // The kernel's /dev/null (1,3) and /dev/full (1,7), made in a scratch directory.
    let made = run(Command::new("mknod").arg(&null).args(["c", "1", "3"]))
        .and_then(|()| run(Command::new("mknod").arg(&full).args(["c", "1", "7"])));
    if let Err(e) = made {
        return skip(TEST, &e);
    }
    let buffer = loaded_pattern(dir.path(), (1 << 20) + 1);
    std::os::unix::fs::symlink("null", dir.path().join("to-null")).unwrap();
    let report = dmaload::save(&buffer, dir.path().join("to-null"), &SaveOptions::default());
    if let Err(err) = &report {
        if err.raw_os_error() == Some(libc::EACCES) {
            return skip(TEST, "the scratch directory is on a nodev mount");
        }
    }
    let report = report.unwrap();
    assert!(report.in_place && report.file_type == "character device", "{report:?}");
    assert_eq!(report.bytes, buffer.len() as u64);
    assert!(report.fallbacks.iter().any(|f| f.to == "read"), "{:?}", report.fallbacks);
    let err = dmaload::save(&buffer, &full, &SaveOptions::default()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!(err.to_string().contains("full"), "{err}");
    let err = dmaload::save(&buffer, &null, &SaveOptions { mode: IoMode::Direct, ..SaveOptions::default() })
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DirectIoUnavailable);
    for (name, rdev) in [(&null, (1, 3)), (&full, (1, 7))] {
        let meta = std::fs::symlink_metadata(name).unwrap();
        assert!(meta.file_type().is_char_device(), "{name:?} replaced");
        assert_eq!((libc::major(meta.rdev()), libc::minor(meta.rdev())), rdev);
    }
    assert_eq!(strays(dir.path(), &["null", "full", "to-null"]), Vec::<String>::new());
}

/// Detaches a loop device on drop.
struct LoopDevice(String);
impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

#[test]
fn a_block_device_is_written_in_place_with_o_direct() {
    const TEST: &str = "a_block_device_is_written_in_place_with_o_direct";
    if !is_root() {
        return skip(TEST, "loop devices need root");
    }
    let dir = scratch_dir();
    let image = dir.path().join("disk.img");
    std::fs::write(&image, vec![0xAAu8; 8 << 20]).unwrap();
    let attached = Command::new("losetup").args(["-f", "--show"]).arg(&image).output();
    let device = match attached {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        Ok(out) => return skip(TEST, &format!("losetup: {}", String::from_utf8_lossy(&out.stderr).trim())),
        Err(e) => return skip(TEST, &format!("losetup: {e}")),
    };
    let _detach = LoopDevice(device.clone());
    let link = dir.path().join("disk");
    std::os::unix::fs::symlink(&device, &link).unwrap();
    let buffer = loaded_pattern(dir.path(), (5 << 20) + 3);
    let report = dmaload::save(&buffer, &link, &SaveOptions::default()).unwrap();
    assert!(report.in_place && report.file_type == "block device", "{report:?}");
    assert_eq!(report.cache, CachePolicy::Bypass, "{:?}", report.fallbacks);
    assert!(std::fs::metadata(&device).unwrap().file_type().is_block_device());
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    let _ = run(Command::new("blockdev").arg("--flushbufs").arg(&device));
    let bytes = std::fs::read(&image).unwrap();
    assert_eq!(bytes.len(), 8 << 20, "the image keeps its size");
    assert_pattern(&bytes[..buffer.len()], 0);
    assert!(bytes[buffer.len()..].iter().all(|&b| b == 0xAA), "bytes past the data are untouched");
    let too_big = loaded_pattern(dir.path(), 9 << 20);
    let err = dmaload::save(&too_big, &link, &SaveOptions::default()).unwrap_err();
    assert!(err.to_string().contains("do not fit"), "{err}");
}

#[test]
fn root_replacing_another_users_file_keeps_its_owner_group_and_setuid_bit() {
    const TEST: &str = "root_replacing_another_users_file_keeps_its_owner_group_and_setuid_bit";
    if !is_root() {
        return skip(TEST, "only root can give a file to another user");
    }
    let dir = scratch_dir();
    let target = dir.path().join("tool");
    std::fs::write(&target, b"old").unwrap();
    std::os::unix::fs::chown(&target, Some(65534), Some(65533)).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o4750)).unwrap();
    let buffer = loaded_pattern(dir.path(), 5000);
    let report = dmaload::save(&buffer, &target, &SaveOptions::default()).unwrap();
    assert_eq!(report.fallbacks, vec![]);
    let meta = std::fs::metadata(&target).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (65534, 65533));
    assert_eq!(meta.mode() & 0o7777, 0o4750);
    assert_pattern(&std::fs::read(&target).unwrap(), 0);
}

#[test]
fn other_hard_links_keep_the_old_bytes_and_are_counted() {
    let dir = scratch_dir();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::write(&a, b"old bytes").unwrap();
    std::fs::hard_link(&a, &b).unwrap();
    let buffer = loaded_pattern(dir.path(), 4097);
    let report = dmaload::save(&buffer, &a, &SaveOptions::default()).unwrap();
    assert_eq!(report.other_links, 1);
    assert_pattern(&std::fs::read(&a).unwrap(), 0);
    assert_eq!(std::fs::read(&b).unwrap(), b"old bytes");
    assert_eq!(std::fs::metadata(&a).unwrap().nlink(), 1);
}

/// A PID that no process has now: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn a_save_removes_temporary_files_of_dead_saves_and_keeps_live_ones() {
    let dir = scratch_dir();
    let d = dir.path();
    let dead = dead_pid();
    let me = std::process::id();
    let stale = [
        format!(".model.bin.dmaload-{dead}-000000001.tmp"),
        format!(".other.bin.dmaload-{dead}-000000002.tmp"),
    ];
    let kept = [
        // A live process's (this test's).
        format!(".model.bin.dmaload-{me}-000000003.tmp"),
        // Not a name dmaload makes.
        format!(".model.bin.dmaload-{dead}-12.tmp"),
        format!("model.bin.dmaload-{dead}-000000004.tmp"),
        // A dead PID whose file a live process has locked: a save from
        // another PID namespace or host.
        format!(".locked.bin.dmaload-{dead}-000000005.tmp"),
    ];
    for name in stale.iter().chain(&kept) {
        std::fs::write(d.join(name), b"partial").unwrap();
    }
    // Not a regular file: left alone.
    let link = format!(".link.dmaload-{dead}-000000006.tmp");
    std::os::unix::fs::symlink("model.bin", d.join(&link)).unwrap();
    let mut holder = match Command::new("flock")
        .arg(d.join(&kept[3]))
        .args(["-c", "echo locked; exec sleep 600"])
        .stdout(std::process::Stdio::piped())
        .spawn()
    {
        Ok(holder) => holder,
        Err(e) => {
            return skip(
                "a_save_removes_temporary_files_of_dead_saves_and_keeps_live_ones",
                &format!("flock: {e}"),
            )
        }
    };
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut line)
        .unwrap();
    assert_eq!(line.trim(), "locked");
    let buffer = loaded_pattern(d, 1000);
    let report = dmaload::save(&buffer, d.join("model.bin"), &SaveOptions::default());
    holder.kill().unwrap();
    holder.wait().unwrap();
    let report = report.unwrap();
    let mut removed = report.removed_tmpfiles.clone();
    removed.sort();
    assert_eq!(removed, stale.to_vec());
    for name in &stale {
        assert!(!d.join(name).exists(), "{name} kept");
    }
    for name in kept.iter().chain([&link]) {
        assert!(std::fs::symlink_metadata(d.join(name)).is_ok(), "{name} removed");
    }
}

#[test]
fn a_name_of_255_bytes_saves_through_a_shortened_temporary_name() {
    let dir = scratch_dir();
    let buffer = loaded_pattern(dir.path(), 3000);
    // ASCII, and two-byte characters whose cut must not split one.
    for name in ["n".repeat(255), format!("{}x", "é".repeat(127))] {
        assert_eq!(name.len(), 255);
        let target = dir.path().join(&name);
        dmaload::save(&buffer, &target, &SaveOptions::default()).unwrap();
        // Again, replacing it.
        let report = dmaload::save(&buffer, &target, &SaveOptions::default()).unwrap();
        assert!(report.replaced);
        assert_pattern(&std::fs::read(&target).unwrap(), 0);
        assert_eq!(strays(dir.path(), &[&name]), Vec::<String>::new());
        std::fs::remove_file(&target).unwrap();
    }
}

#[test]
fn directories_sockets_and_paths_ending_in_a_slash_are_errors() {
    let dir = scratch_dir();
    let d = dir.path();
    let buffer = loaded_pattern(d, 100);
    std::fs::create_dir(d.join("sub")).unwrap();
    std::os::unix::fs::symlink("sub", d.join("to-sub")).unwrap();
    for target in [d.join("sub"), d.join("to-sub"), d.join("sub/."), d.join("new/"), d.join("sub/..")] {
        let err = dmaload::save(&buffer, &target, &SaveOptions::default()).unwrap_err();
        assert!(
            matches!(err.raw_os_error(), Some(libc::EISDIR | libc::ENOENT)),
            "{}: {err}",
            target.display()
        );
    }
    assert!(!d.join("new").exists());
    let socket = d.join("sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let err = dmaload::save(&buffer, &socket, &SaveOptions::default()).unwrap_err();
    assert!(err.to_string().contains("socket") && err.to_string().contains("sock"), "{err}");
    assert!(std::fs::symlink_metadata(&socket).unwrap().file_type().is_socket());
    assert_eq!(strays(d, &["sub", "to-sub", "sock"]), Vec::<String>::new());
}

#[test]
fn a_read_only_filesystem_is_erofs_naming_the_directory() {
    const TEST: &str = "a_read_only_filesystem_is_erofs_naming_the_directory";
    if !is_root() {
        return skip(TEST, "mounting needs root");
    }
    let dir = scratch_dir();
    let mount = dir.path().join("ro");
    std::fs::create_dir(&mount).unwrap();
    if let Err(e) = run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"]).arg(&mount)) {
        return skip(TEST, &e);
    }
    let _mounted = Mounted(mount.clone());
    std::fs::write(mount.join("old"), b"old").unwrap();
    run(Command::new("mount").args(["-o", "remount,ro"]).arg(&mount)).unwrap();
    let buffer = loaded_pattern(dir.path(), 100);
    for name in ["old", "new"] {
        let err = dmaload::save(&buffer, mount.join(name), &SaveOptions::default()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        assert!(err.to_string().contains(&mount.display().to_string()), "{err}");
    }
    assert_eq!(std::fs::read(mount.join("old")).unwrap(), b"old");
}

/// Each engine reports what it has written, never past the total, ending
/// with every byte once the file is saved; a save that wrote nothing
/// reports nothing.
#[test]
fn a_save_reports_progress_with_every_engine_and_ends_with_every_byte() {
    let dir = scratch_dir();
    let len = (32 << 20) + 123;
    let buffer = loaded_pattern(dir.path(), len);
    for engine in [Engine::UringFixed, Engine::Uring, Engine::PreadPool, Engine::Read] {
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = calls.clone();
        let options = SaveOptions {
            engine,
            chunk_size: 1 << 20,
            progress: Some(std::sync::Arc::new(move |done, total| seen.lock().unwrap().push((done, total)))),
            ..SaveOptions::default()
        };
        let target = dir.path().join("saved.bin");
        dmaload::save(&buffer, &target, &options).unwrap();
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls.last(), Some(&(len, len)), "{engine:?}: {calls:?}");
        assert!(calls.iter().all(|&(done, total)| total == len && done <= len), "{engine:?}: {calls:?}");
        assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0), "{engine:?}: {calls:?}");

        let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = calls.clone();
        let options = SaveOptions {
            progress: Some(std::sync::Arc::new(move |done, total| seen.lock().unwrap().push((done, total)))),
            ..options
        };
        dmaload::save(&buffer, dir.path().join("no-such-dir/saved.bin"), &options).unwrap_err();
        assert_eq!(*calls.lock().unwrap(), [], "{engine:?}: nothing written, nothing reported");
    }
}

/// A token cancelled before the save starts: every engine stops before its
/// first write, with `Cancelled`, and the previous file and the directory
/// are as they were.
#[test]
fn a_cancelled_save_keeps_the_previous_file_and_leaves_no_temporary() {
    let dir = scratch_dir();
    let buffer = loaded_pattern(dir.path(), (8 << 20) + 7);
    let target = dir.path().join("saved.bin");
    std::fs::write(&target, b"previous").unwrap();
    for engine in Engine::ALL {
        let cancel = dmaload::CancelToken::new();
        cancel.cancel();
        let options = SaveOptions { engine, cancel, ..SaveOptions::default() };
        let err = dmaload::save(&buffer, &target, &options).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled, "{engine:?}: {err}");
        assert_eq!(err.errno(), libc::ECANCELED, "{engine:?}: {err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"previous", "{engine:?}");
        assert_eq!(strays(dir.path(), &["saved.bin"]), Vec::<String>::new(), "{engine:?}");
    }
}

/// A FIFO whose reader holds it open but never reads fills after 64 KiB:
/// the save then waits, and its token still stops it (cancelled here from
/// the progress callback once bytes have gone in), with the count that
/// reached the FIFO. Before saves took a token this hung for good.
#[test]
fn a_save_waiting_on_a_full_fifo_is_cancelled_by_its_token() {
    const TEST: &str = "a_save_waiting_on_a_full_fifo_is_cancelled_by_its_token";
    let dir = scratch_dir();
    let fifo = dir.path().join("fifo");
    if let Err(e) = run(Command::new("mkfifo").arg(&fifo)) {
        return skip(TEST, &e);
    }
    // Opened read-write, the FIFO has a reader at once; it never reads.
    let mut holder = Command::new("sh")
        .arg("-c")
        .arg("exec 3<>\"$0\"; echo open; exec sleep 600")
        .arg(&fifo)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut line)
        .unwrap();
    assert_eq!(line, "open\n");
    let buffer = loaded_pattern(dir.path(), 4 << 20);
    let cancel = dmaload::CancelToken::new();
    let stop = cancel.clone();
    let options = SaveOptions {
        cancel,
        progress: Some(std::sync::Arc::new(move |done, _| {
            if done > 0 {
                stop.cancel();
            }
        })),
        ..SaveOptions::default()
    };
    let saved = dmaload::save(&buffer, &fifo, &options);
    holder.kill().unwrap();
    holder.wait().unwrap();
    let err = saved.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
    let written = err.offset().unwrap();
    assert!(written > 0 && written < buffer.len() as u64, "{err}");
    assert!(err.to_string().contains(&format!("took the first {written} bytes")), "{err}");
}
