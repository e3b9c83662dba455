//! An executable at a path other users can run: the tests that drop to
//! nobody (or a uid of their own) run a binary of the build, which a clone
//! under a 0700 home directory keeps out of their reach. Shared by the
//! core's and the CLI's tests (`#[path]`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// `exe` itself where every directory above it lets others through and
/// others may run it; else a hard link to it (a copy across filesystems)
/// in a 0755 directory under /tmp of this process's own, removed when the
/// process exits (and, should it be killed, by the next test process to
/// come here).
pub fn reachable_by_others(exe: &Path) -> PathBuf {
    let others_may =
        |path: &Path, bits: u32| std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & bits == bits);
    if others_may(exe, 0o005) && exe.ancestors().skip(1).all(|dir| others_may(dir, 0o001)) {
        return exe.to_owned();
    }
    for entry in std::fs::read_dir("/tmp").into_iter().flatten().flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix(PREFIX));
        if pid.is_some_and(|pid| !Path::new("/proc").join(pid).exists()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let dir = own_dir();
    if !dir.exists() {
        // SAFETY: a plain `extern "C"` function that does not unwind.
        unsafe { libc::atexit(remove_own_dir) };
    }
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let name = exe.file_name().unwrap().to_str().unwrap();
    let reachable = dir.join(name);
    // A link where others may run the file (never a copy onto a link: that
    // would truncate `exe` itself); a copy, renamed in whole, otherwise.
    let linked = others_may(exe, 0o005)
        && std::fs::hard_link(exe, &reachable)
            .or_else(|e| if e.kind() == std::io::ErrorKind::AlreadyExists { Ok(()) } else { Err(e) })
            .is_ok();
    if !linked {
        let part = dir.join(format!(".{name}.{:?}", std::thread::current().id()));
        std::fs::copy(exe, &part).unwrap();
        std::fs::set_permissions(&part, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&part, &reachable).unwrap();
    }
    reachable
}

const PREFIX: &str = "dmaload-test-bin-";

/// This process's directory under /tmp.
fn own_dir() -> PathBuf {
    Path::new("/tmp").join(format!("{PREFIX}{}", std::process::id()))
}

/// Removes [`own_dir`] at exit (`atexit`).
extern "C" fn remove_own_dir() {
    let _ = std::fs::remove_dir_all(own_dir());
}
