//! A device error in the middle of a file: each engine fails with EIO and
//! names the offset, and returns no buffer. The error comes from a real
//! FUSE filesystem whose reads fail over one byte.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{scratch_dir, skip};
use dmaload::{Engine, ErrorKind, LoadOptions};

/// A mounted faulty filesystem, unmounted on drop.
struct FaultyMount {
    child: Child,
    mountpoint: PathBuf,
}

impl Drop for FaultyMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mountpoint).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mount_faulty(dir: &Path, size: u64, bad_offset: u64) -> Result<FaultyMount, String> {
    if !Path::new("/dev/fuse").exists() {
        return Err("no /dev/fuse".into());
    }
    let probe = Command::new("python3").args(["-c", "import fuse"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return Err(
            "python3 with fusepy and libfuse2 not installed (pip install fusepy; apt-get install libfuse2)"
                .into(),
        );
    }
    let mountpoint = dir.join("mnt");
    std::fs::create_dir(&mountpoint).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/faulty_fuse.py");
    let child = Command::new("python3")
        .arg(script)
        .arg(&mountpoint)
        .arg(size.to_string())
        .arg(bad_offset.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting python3: {e}"))?;
    let mut mount = FaultyMount { child, mountpoint };
    let started = Instant::now();
    while !mount.mountpoint.join("data").exists() {
        if let Ok(Some(status)) = mount.child.try_wait() {
            return Err(format!("FUSE server exited ({status}): mounting FUSE not permitted here?"));
        }
        if started.elapsed() > Duration::from_secs(20) {
            return Err("FUSE mount did not appear within 20 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(mount)
}

#[test]
fn eio_mid_file_fails_the_load_and_names_the_offset() {
    let dir = scratch_dir();
    let size = 8u64 << 20;
    let bad = (5 << 20) + 12_345;
    let mount = match mount_faulty(dir.path(), size, bad) {
        Ok(mount) => mount,
        Err(reason) => return skip("eio_mid_file_fails_the_load_and_names_the_offset", &reason),
    };
    let path = mount.mountpoint.join("data");
    let chunk = 1u64 << 20;
    for engine in Engine::ALL {
        let opts = LoadOptions {
            engine,
            chunk_size: chunk as usize,
            gather_size: 2 << 20,
            ..LoadOptions::default()
        };
        let err = dmaload::load(&path, &opts).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io, "{engine:?}: {err}");
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{engine:?}: {err}");
        let at = err.offset().expect("an I/O error names its offset");
        assert!(at <= bad && bad - at < chunk, "{engine:?}: offset {at}, bad byte at {bad}");
        let message = err.to_string();
        assert!(
            message.contains("read") && message.contains("mnt/data") && message.contains(&at.to_string()),
            "{message}"
        );
    }
}
