//! A FUSE filesystem served by one of the Python scripts in
//! `tests/support/` (fusepy over libfuse2), mounted for a test and
//! unmounted when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A mounted filesystem whose one file is `mountpoint/data`.
pub struct FuseMount {
    child: Child,
    pub mountpoint: PathBuf,
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mountpoint).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Mounts `tests/support/SCRIPT` at `dir/name` with `args` after the
/// mountpoint, once its `data` file appears; the reason to skip where
/// FUSE, fusepy or the right to mount is missing.
pub fn mount(dir: &Path, name: &str, script: &str, args: &[String]) -> Result<FuseMount, String> {
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
    let mountpoint = dir.join(name);
    std::fs::create_dir(&mountpoint).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support").join(script);
    let child = Command::new("python3")
        .arg(script)
        .arg(&mountpoint)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting python3: {e}"))?;
    let mut mount = FuseMount { child, mountpoint };
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
