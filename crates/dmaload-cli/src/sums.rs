//! `dmaload sums`: writes the `SHA256SUMS` (or `B3SUMS`) files that
//! `load --verify` checks against, line for line what `sha256sum` (or
//! `b3sum`) prints.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

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
    let mut by_dir: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|e| format!("sums {}: {e}", path.display()))?;
        if meta.is_dir() {
            let mut names = Vec::new();
            for entry in std::fs::read_dir(path).map_err(|e| format!("sums {}: {e}", path.display()))? {
                let entry = entry.map_err(|e| format!("sums {}: {e}", path.display()))?;
                let is_file = entry.file_type().is_ok_and(|t| t.is_file());
                if is_file && !DigestKind::is_sums_file(&entry.file_name()) {
                    names.push(name_of(path, &entry.path())?);
                }
            }
            // Byte order, as a shell's `*` sorts in the C locale.
            names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
            by_dir.entry(path.clone()).or_default().extend(names);
        } else {
            let dir = match path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
                _ => PathBuf::from("."),
            };
            by_dir.entry(dir).or_default().push(name_of(path, path)?);
        }
    }
    for (dir, names) in by_dir {
        let mut text = String::new();
        for name in &names {
            let digest = file_digest(&dir.join(name), kind).map_err(|e| e.to_string())?;
            text.push_str(&sums_line(&digest, name));
        }
        let sums = dir.join(kind.sums_file());
        write_replacing(&sums, text.as_bytes())?;
        println!("{}: {} files", sums.display(), names.len());
    }
    Ok(())
}

/// The file name of `path` as a sums file lists it (UTF-8 only: the
/// format's names are text).
fn name_of(arg: &Path, path: &Path) -> Result<String, String> {
    let name = path.file_name().ok_or_else(|| format!("sums {}: not a file name", arg.display()))?;
    std::str::from_utf8(name.as_bytes())
        .map(str::to_owned)
        .map_err(|_| format!("sums {}: the name is not UTF-8", path.display()))
}

/// Writes `bytes` to `path` through a temporary file beside it, fsynced
/// and renamed over it: a reader never sees half a sums file.
fn write_replacing(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("write {}: {e}", path.display())
    })
}
