//! `dmaload sums`: writes the `SHA256SUMS` (or `B3SUMS`) files that
//! `load --verify` checks against, line for line what `sha256sum` (or
//! `b3sum`) prints for the same names.
//!
//! For a directory, the names are those `sha256sum *` run in it sums: every
//! name the shell's `*` matches (not those starting with `.`), in byte
//! order (the C locale's), symlinks followed (a Hugging Face snapshot's
//! files are links into `../../blobs/`). What `sha256sum *` would fail on
//! or that is no file's content (a subdirectory, a dangling link, a FIFO,
//! a socket, a character device) is left out, as are hidden names and the
//! sums files themselves, and each one left out is named on stderr.

use dmaload_cli::outln;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use dmaload::tmpfile::write_file;
use dmaload::verify::{file_digest, sums_line, DigestKind};

/// `--digest`'s values.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum DigestArg {
    Sha256,
    Blake3,
}

impl From<DigestArg> for DigestKind {
    fn from(arg: DigestArg) -> DigestKind {
        match arg {
            DigestArg::Sha256 => DigestKind::Sha256,
            DigestArg::Blake3 => DigestKind::Blake3,
        }
    }
}

pub fn run(paths: &[PathBuf], kind: DigestKind) -> Result<(), String> {
    // Each directory's names, in the order its sums file lists them.
    let mut by_dir: BTreeMap<PathBuf, Vec<OsString>> = BTreeMap::new();
    let mut left_out = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|e| format!("sums {}: {e}", path.display()))?;
        if meta.is_dir() {
            let (names, skipped) = directory_names(path, kind)?;
            by_dir.entry(path.clone()).or_default().extend(names);
            left_out.extend(skipped);
        } else {
            let dir = match path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
                _ => PathBuf::from("."),
            };
            let name = path.file_name().ok_or_else(|| format!("sums {}: not a file name", path.display()))?;
            if let Some(why) = unnameable(kind, name.as_bytes()) {
                return Err(format!("sums {}: {why}", path.display()));
            }
            by_dir.entry(dir).or_default().push(name.to_owned());
        }
    }
    for (path, why) in &left_out {
        eprintln!("dmaload sums: left out {}: {why}", path.display());
    }
    for (dir, names) in by_dir {
        let mut text = Vec::new();
        for name in &names {
            let digest = file_digest(&dir.join(name), kind).map_err(|e| e.to_string())?;
            text.extend(sums_line(kind, &digest, name.as_bytes()));
        }
        let sums = dir.join(kind.sums_file());
        write_file(&sums, &text, 0o644).map_err(|e| e.to_string())?;
        outln!("{}: {} files", sums.display(), names.len());
    }
    Ok(())
}

/// The names `sha256sum *` sums in `dir` (see the module doc), and each
/// entry left out with why.
type Names = (Vec<OsString>, Vec<(PathBuf, String)>);

fn directory_names(dir: &Path, kind: DigestKind) -> Result<Names, String> {
    let fail = |e: std::io::Error| format!("sums {}: {e}", dir.display());
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(fail)? {
        entries.push(entry.map_err(fail)?.file_name().into_vec());
    }
    // Byte order, as a shell's `*` sorts in the C locale.
    entries.sort();
    let (mut names, mut skipped) = (Vec::new(), Vec::new());
    for name in entries {
        let path = dir.join(std::ffi::OsStr::from_bytes(&name));
        let why = if name.starts_with(b".") {
            Some("a hidden name, which `sha256sum *` does not match".to_owned())
        } else if DigestKind::is_sums_file(std::ffi::OsStr::from_bytes(&name)) {
            Some("a sums file".to_owned())
        } else {
            match std::fs::metadata(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("a symlink to nothing".to_owned()),
                Err(e) => return Err(format!("sums {}: {e}", path.display())),
                Ok(meta) => {
                    let kind_of = meta.file_type();
                    if kind_of.is_file() || kind_of.is_block_device() {
                        unnameable(kind, &name)
                    } else if kind_of.is_dir() {
                        Some("a directory (run `dmaload sums` on it for a sums file of its own)".to_owned())
                    } else {
                        Some("not a regular file (a FIFO, socket or character device)".to_owned())
                    }
                }
            }
        };
        match why {
            Some(why) => skipped.push((path, why)),
            None => names.push(OsString::from_vec(name)),
        }
    }
    Ok((names, skipped))
}

/// Why a sums file of `kind` cannot list `name`, if it cannot: `b3sum`
/// reads only UTF-8 names (and writes others changed).
fn unnameable(kind: DigestKind, name: &[u8]) -> Option<String> {
    (kind == DigestKind::Blake3 && std::str::from_utf8(name).is_err())
        .then(|| "the name is not UTF-8, which `b3sum -c` cannot read".to_owned())
}
