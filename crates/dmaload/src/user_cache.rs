//! Small files dmaload keeps for the user between runs (recorded memory
//! probe figures, tuned queue depths): where they live, and how one is
//! replaced so that no reader, nor a writer racing another, sees half.
//! The directory is also where the CLI's demo keeps its sample model.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

/// The directory: `$DMALOAD_CACHE_DIR` as given, else
/// `$XDG_CACHE_HOME/dmaload`, else `$HOME/.cache/dmaload`; `None` without
/// any (relative XDG and HOME paths are ignored, as the XDG spec asks).
/// The test suite points `$DMALOAD_CACHE_DIR` at a scratch directory, so
/// it neither reads nor rewrites what the user's own loads remembered.
pub fn dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DMALOAD_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let absolute = |name| std::env::var_os(name).map(PathBuf::from).filter(|p| p.is_absolute());
    let cache = absolute("XDG_CACHE_HOME").or_else(|| absolute("HOME").map(|home| home.join(".cache")))?;
    Some(cache.join("dmaload"))
}

/// The file `NAME` in [`dir`].
pub fn path(name: &str) -> Option<PathBuf> {
    dir().map(|dir| dir.join(name))
}

/// The bytes of the file at `path`, `None` when there is none. Anything
/// but a regular file of at most `limit` bytes is an `InvalidData` error,
/// found without blocking or reading on: a FIFO put there would hang every
/// load that looks, a link to `/dev/zero` would fill its memory.
pub(crate) fn read(path: &Path, limit: u64) -> io::Result<Option<Vec<u8>>> {
    let file = match crate::sys::file::open_nonblocking(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let invalid =
        |what: String| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {what}", path.display()));
    if !file.metadata()?.file_type().is_file() {
        return Err(invalid("not a regular file".into()));
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(invalid(format!("larger than {limit} bytes")));
    }
    Ok(Some(bytes))
}

/// Writes `bytes` to `path` (its directory created if needed) through a
/// temporary file of its own beside it, renamed into place
/// ([`crate::tmpfile::write_file`]): readers see the old file or the new
/// one, of two writers the last rename wins whole, and a symlink planted
/// at either name is never followed. On failure no temporary file is left.
pub(crate) fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    fs::create_dir_all(dir)?;
    crate::tmpfile::write_file(path, bytes, 0o644).map_err(io::Error::from)
}
