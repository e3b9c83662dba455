//! `save`: content, engines, O_DIRECT with a buffered tail, and crash
//! safety against a full filesystem (a small tmpfs and a small ext4 loop
//! mount, where root can make them).

mod common;

use std::os::unix::fs::PermissionsExt;
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
