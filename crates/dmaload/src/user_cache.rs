//! Small files dmaload keeps for the user between runs (recorded memory
//! probe figures, tuned queue depths): where they live, and how one is
//! replaced so that no reader, nor a writer racing another, sees half.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// `$XDG_CACHE_HOME/dmaload/NAME`, else `$HOME/.cache/dmaload/NAME`; `None`
/// without either (relative paths are ignored, as the XDG spec asks).
pub fn path(name: &str) -> Option<PathBuf> {
    let absolute = |name| std::env::var_os(name).map(PathBuf::from).filter(|p| p.is_absolute());
    let cache = absolute("XDG_CACHE_HOME").or_else(|| absolute("HOME").map(|home| home.join(".cache")))?;
    Some(cache.join("dmaload").join(name))
}

/// Writes `bytes` to `path` (its directory created if needed) through a
/// temporary file of its own beside it, renamed into place: readers see the
/// old file or the new one, and of two writers the last rename wins whole.
/// On failure the temporary file is removed.
pub(crate) fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    fs::create_dir_all(dir)?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let temp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), nanos.as_nanos()));
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .and_then(|mut file| file.write_all(bytes))
        .and_then(|()| fs::rename(&temp, path));
    if written.is_err() {
        let _ = fs::remove_file(&temp);
    }
    written
}
