//! Every file dmaload creates goes through here: a temporary file made
//! exclusively in the target's directory, written, then renamed over the
//! target. The temporary file is an unnamed `O_TMPFILE` where the
//! filesystem has it (Linux 3.11), named with `linkat` (which fails rather
//! than replace anything) just before the rename; elsewhere it is
//! `.NAME.dmaload-PID-NANOS.tmp` created with `O_CREAT | O_EXCL`, which
//! fails on anything planted at that name (a symlink included) instead of
//! following or truncating it. The rename replaces a regular file at the
//! target only: anything else there (a symlink, a directory) is an error
//! naming it, and is neither followed nor replaced. So another user who
//! can write the directory (a shared or sticky one such as /tmp) can make
//! a write fail, never redirect it, and a failed write leaves no temporary
//! file (a named one is removed; an unnamed one never had a name).
//!
//! A writer killed between naming its temporary file and the rename (a
//! window of microseconds with `O_TMPFILE`, the whole write without it)
//! leaves `.NAME.dmaload-PID-NANOS.tmp` behind: [`remove_stale_tmpfiles`]
//! removes every such file whose PID does not exist in this PID namespace
//! and whose `flock` it can take (a running writer holds an exclusive lock
//! on its temporary file from creation, so one in another PID namespace or
//! host, over NFS, is never touched).

use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{Error, ErrorKind, Result};
use crate::source::type_name;
use crate::sys;

/// A file being written before it is put in place. Until
/// [`TmpFile::commit`] a named one is removed on drop; an unnamed one
/// (O_TMPFILE) vanishes with its fd.
pub struct TmpFile {
    file: File,
    name: Option<PathBuf>,
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if let Some(name) = &self.name {
            // Best effort: failing to clean up must not hide the save's error.
            let _ = fs::remove_file(name);
        }
    }
}

/// The longest file name Linux filesystems take (NAME_MAX).
const NAME_MAX: usize = 255;

/// `.NAME.dmaload-PID-NANOS.tmp` in `dir`, a name no other save (or file)
/// is using right now; NAME is cut short so the whole fits in NAME_MAX.
fn tmp_name(dir: &Path, name: &OsStr) -> PathBuf {
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let suffix = format!(".dmaload-{}-{nanos:09}.tmp", std::process::id());
    let bytes = name.as_bytes();
    let mut keep = bytes.len().min(NAME_MAX - 1 - suffix.len());
    // A UTF-8 name is cut at a character boundary, so the name stays UTF-8.
    if let Ok(text) = std::str::from_utf8(bytes) {
        while !text.is_char_boundary(keep) {
            keep -= 1;
        }
    }
    let mut tmp = OsString::from(".");
    tmp.push(OsStr::from_bytes(&bytes[..keep]));
    tmp.push(suffix);
    dir.join(tmp)
}

/// `bytes` split around its last '-'.
fn split_last_dash(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let i = bytes.iter().rposition(|&c| c == b'-')?;
    Some((&bytes[..i], &bytes[i + 1..]))
}

/// The PID in a name [`tmp_name`] made, or `None` for any other name.
fn tmp_name_pid(name: &[u8]) -> Option<u32> {
    let digits = |b: &[u8]| !b.is_empty() && b.iter().all(u8::is_ascii_digit);
    let rest = name.strip_prefix(b".")?.strip_suffix(b".tmp")?;
    let (rest, nanos) = split_last_dash(rest)?;
    let (rest, pid) = split_last_dash(rest)?;
    let base = rest.strip_suffix(b".dmaload")?;
    if base.is_empty() || nanos.len() != 9 || !digits(nanos) || pid.len() > 10 || !digits(pid) {
        return None;
    }
    std::str::from_utf8(pid).ok()?.parse().ok()
}

/// Removes temporary files that killed writers left in `dir` (see the
/// module doc) and returns their names. Best effort: what cannot be read, opened,
/// locked or removed is left alone, and never fails the save.
pub fn remove_stale_tmpfiles(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        match tmp_name_pid(name.as_bytes()) {
            Some(pid) if !sys::process::process_exists(pid) => {}
            _ => continue,
        }
        let path = entry.path();
        let Ok(file) = sys::file::open_nofollow(&path) else { continue };
        let (Ok(opened), Ok(named)) = (file.metadata(), fs::symlink_metadata(&path)) else { continue };
        // A live save (of another PID namespace or host) holds the lock.
        let unlocked = sys::file::try_lock_exclusive(file.as_fd()).unwrap_or(false);
        let same = (opened.dev(), opened.ino()) == (named.dev(), named.ino());
        if unlocked && same && opened.file_type().is_file() && fs::remove_file(&path).is_ok() {
            removed.push(name.to_string_lossy().into_owned());
        }
    }
    removed
}

impl TmpFile {
    /// An unnamed O_TMPFILE in `dir` (Linux 3.11, most local filesystems),
    /// else a named file created exclusively (`O_CREAT | O_EXCL`: a
    /// symlink or file planted at the name fails the create, it is never
    /// followed nor truncated), of permission bits `mode` less the umask;
    /// either way locked (`flock`) before it has a name, so no cleanup
    /// takes it for a killed writer's. `name` is the target's name, kept
    /// in the temporary one.
    pub fn create(dir: &Path, name: &OsStr, mode: u32) -> Result<TmpFile> {
        let tmp = match sys::file::open_tmpfile(dir, mode) {
            Ok(file) => TmpFile { file, name: None },
            Err(e) if sys::file::tmpfile_unsupported(&e) => {
                let name = tmp_name(dir, name);
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(mode)
                    .open(&name)
                    .map_err(|e| Error::io("create", &name, e))?;
                TmpFile { file, name: Some(name) }
            }
            Err(e) => return Err(Error::io("create temporary file in", dir, e)),
        };
        // Where locks are unsupported (ENOLCK) no cleanup can take one either.
        let _ = sys::file::try_lock_exclusive(tmp.file.as_fd());
        Ok(tmp)
    }

    /// The open file, to write.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether the file is an unnamed O_TMPFILE (until its commit).
    pub fn is_anonymous(&self) -> bool {
        self.name.is_none()
    }

    /// Puts the file in place of `target` (a name in `dir`) atomically:
    /// named (`linkat`, which never replaces) and renamed over the target.
    /// Refused when something other than a regular file is at `target` (a
    /// symlink is neither followed nor replaced).
    pub fn commit(mut self, dir: &Path, target: &Path) -> Result<()> {
        if self.name.is_none() {
            // linkat cannot replace a file: name it first, then rename.
            let name = tmp_name(dir, target.file_name().unwrap_or(OsStr::new("file")));
            sys::file::link_tmpfile(self.file.as_fd(), &name).map_err(|e| Error::io("link", &name, e))?;
            self.name = Some(name);
        }
        match fs::symlink_metadata(target) {
            Ok(meta) if !meta.file_type().is_file() => {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    "rename",
                    target,
                    format!(
                        "a {} is there and is left alone: only a \
                         regular file is replaced",
                        type_name(&meta)
                    ),
                ))
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("stat", target, e)),
        }
        if let Some(name) = &self.name {
            fs::rename(name, target).map_err(|e| Error::io("rename", target, e))?;
        }
        self.name = None;
        Ok(())
    }
}

/// Writes `bytes` as the file at `path` (a new file of permission bits
/// `mode` less the umask), through a [`TmpFile`] beside it, fsynced and
/// renamed over it: a reader sees the old file or the whole new one,
/// anything but a regular file at `path` (a symlink) is an error that
/// leaves it alone, and a failure leaves no temporary file.
pub fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = path.file_name().unwrap_or(OsStr::new("file"));
    let tmp = TmpFile::create(dir, name, mode)?;
    let mut file = tmp.file();
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(|e| Error::io("write", path, e))?;
    tmp.commit(dir, path)
}
