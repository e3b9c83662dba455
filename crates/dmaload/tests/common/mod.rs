//! Test files with known contents, written on the real filesystem.
#![allow(dead_code)] // each test binary uses a different subset

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The byte at `offset` of every test file: a position hash, so a byte
/// read from the wrong offset (or a zero page) does not match.
pub fn pattern_byte(offset: u64) -> u8 {
    let x = offset.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((x >> 32) ^ (x >> 17) ^ offset) as u8
}

/// Writes `len` pattern bytes to `path`.
pub fn write_pattern_file(path: &Path, len: u64) {
    let mut file = File::create(path).unwrap();
    let mut block = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    while offset < len {
        let n = (len - offset).min(block.len() as u64) as usize;
        for (i, byte) in block[..n].iter_mut().enumerate() {
            *byte = pattern_byte(offset + i as u64);
        }
        file.write_all(&block[..n]).unwrap();
        offset += n as u64;
    }
    file.sync_all().unwrap();
}

/// Asserts `bytes` equals the pattern from file offset `offset`, naming
/// the first differing offset.
pub fn assert_pattern(bytes: &[u8], offset: u64) {
    if let Some(i) = bytes.iter().enumerate().position(|(i, &b)| b != pattern_byte(offset + i as u64)) {
        panic!(
            "byte {} (file offset {}) is {:#04x}, expected {:#04x}",
            i,
            offset + i as u64,
            bytes[i],
            pattern_byte(offset + i as u64)
        );
    }
}

/// xxh3-64 of a file read with plain buffered `read` calls: an independent
/// reference for large loads.
pub fn file_hash(path: &Path) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut file = File::open(path).unwrap();
    let mut block = vec![0u8; 8 << 20];
    loop {
        let n = file.read(&mut block).unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
    }
    hasher.digest()
}

/// A scratch directory on the root filesystem (ext4 here, where O_DIRECT
/// works), unlike /dev/shm which is tmpfs.
pub fn scratch_dir() -> tempfile::TempDir {
    let base = std::env::var_os("DMALOAD_TEST_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    tempfile::Builder::new().prefix("dmaload-test-").tempdir_in(base).unwrap()
}

/// Prints why a test is skipped, in the form the test log shows; panics
/// instead where `DMALOAD_TEST_NO_SKIP=1` (the VM guest, which exists to
/// run what a skip would leave out).
pub fn skip(test: &str, reason: &str) {
    if std::env::var_os("DMALOAD_TEST_NO_SKIP").is_some_and(|v| v == "1") {
        panic!("{test} cannot be skipped here (DMALOAD_TEST_NO_SKIP=1): {reason}");
    }
    eprintln!("SKIP {test}: {reason}");
}

/// A child memory cgroup with a limit, removed on drop.
pub struct MemoryCgroup {
    dir: PathBuf,
    procs: PathBuf,
}

impl MemoryCgroup {
    /// Runs `cmd` inside the cgroup (a shell moves itself in, then execs it).
    pub fn run(&self, cmd: &mut std::process::Command) -> std::io::Result<std::process::Output> {
        self.command(cmd).output()
    }

    /// `cmd` as a command that runs it inside the cgroup, to spawn.
    pub fn command(&self, cmd: &std::process::Command) -> std::process::Command {
        let mut wrapped = std::process::Command::new("sh");
        wrapped
            .arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(&self.procs)
            .arg(cmd.get_program())
            .args(cmd.get_args());
        for (key, value) in cmd.get_envs() {
            if let Some(value) = value {
                wrapped.env(key, value);
            }
        }
        wrapped
    }

    /// Bytes of memory charged to the cgroup now (v2 `memory.current`,
    /// v1 `memory.usage_in_bytes`).
    pub fn usage(&self) -> u64 {
        ["memory.current", "memory.usage_in_bytes"]
            .iter()
            .find_map(|name| std::fs::read_to_string(self.dir.join(name)).ok())
            .and_then(|text| text.trim().parse().ok())
            .expect("the cgroup's memory usage")
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Creates a child of this process's memory cgroup (v2, else v1) limited
/// to `limit` bytes, or `None` where that is not possible here.
pub fn memory_cgroup_child(name: &str, limit: u64) -> Option<MemoryCgroup> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount_of = |v2: bool| {
        mounts.lines().find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut right = right.split(' ');
            let fstype = right.next()?;
            let options = right.nth(1).unwrap_or("");
            let wanted = if v2 {
                fstype == "cgroup2"
            } else {
                fstype == "cgroup" && options.split(',').any(|o| o == "memory")
            };
            wanted.then(|| PathBuf::from(left.split(' ').nth(4).unwrap()))
        })
    };
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let v2 = controllers.is_empty();
        if !v2 && !controllers.split(',').any(|c| c == "memory") {
            continue;
        }
        let Some(mount) = mount_of(v2) else { continue };
        let parent = mount.join(path.trim_start_matches('/'));
        let dir = parent.join(format!("{name}-{}", std::process::id()));
        let limit_file = if v2 { "memory.max" } else { "memory.limit_in_bytes" };
        if std::fs::create_dir(&dir).is_err() {
            continue;
        }
        let cgroup = MemoryCgroup { procs: dir.join("cgroup.procs"), dir };
        if std::fs::write(cgroup.dir.join(limit_file), limit.to_string()).is_ok() {
            return Some(cgroup);
        }
    }
    None
}

/// Whether this process runs as root (files it creates belong to uid 0).
pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    let dir = scratch_dir();
    std::fs::metadata(dir.path()).is_ok_and(|m| m.uid() == 0)
}

mod cuda_driver;
pub mod fuse;
pub mod reachable;
#[allow(unused_imports)] // each test binary uses a different subset
pub use cuda_driver::{cuda_driver, installed_libcuda_loads};
