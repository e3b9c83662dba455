//! Verified bytes: a load with [`crate::LoadOptions::verify`] checks the
//! file against the SHA-256 digest a `SHA256SUMS` file beside it records,
//! in the format `sha256sum` writes and `sha256sum -c` reads (`<64 hex>
//! <space><space or *><name>`, a name with a newline or a backslash
//! escaped and its line started with a backslash). The digest is computed
//! while the bytes stream in: each gather as the engine completes it, in
//! file order, on a thread beside the engine (or each staging slot as a
//! sink receives it), never in a second pass over the file.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{Error, ErrorKind, Result};
use crate::plan::Plan;
use crate::sys::mem::MappingWriter;

/// The sums file looked for beside each verified file.
pub const SUMS_FILE: &str = "SHA256SUMS";

/// Bytes hashed at a time: copied out of the destination (never viewed as
/// a Rust slice while the kernel may write beside it) into a buffer that
/// stays in the CPU's cache.
const HASH_CHUNK: usize = 256 << 10;

/// A SHA-256 digest.
pub type Sha256Digest = [u8; 32];

/// The digest `SHA256SUMS` beside `path` records for it: an error when
/// there is no such file, it cannot be read, a line is malformed, or
/// `path` is not listed.
pub fn expected_digest(path: &Path) -> Result<Sha256Digest> {
    let sums = sums_path(path);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let text = read_sums_file(path, &sums)?;
    let mut found = None;
    for (number, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let (digest, listed) = parse_line(line).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                "read the sums file",
                &sums,
                format!("line {} is not `<64 hex digits>  <name>`", number + 1),
            )
        })?;
        if listed.strip_prefix("./").unwrap_or(&listed) == name {
            found = Some(digest);
        }
    }
    found.ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidInput,
            "verify",
            path,
            format!("{name:?} is not listed in {}", sums.display()),
        )
    })
}

/// `SHA256SUMS` in the directory of `path`.
fn sums_path(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(SUMS_FILE),
        _ => PathBuf::from(SUMS_FILE),
    }
}

/// One line of a sums file: its digest and (unescaped) name.
fn parse_line(line: &str) -> Option<(Sha256Digest, String)> {
    let (escaped, line) = match line.strip_prefix('\\') {
        Some(rest) => (true, rest),
        None => (false, line),
    };
    let hex = line.get(..64)?;
    let rest = line.get(64..)?;
    let name = rest.strip_prefix("  ").or_else(|| rest.strip_prefix(" *"))?;
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some((digest, if escaped { unescape(name)? } else { name.to_owned() }))
}

fn unescape(name: &str) -> Option<String> {
    let mut out = String::with_capacity(name.len());
    let mut chars = name.chars();
    while let Some(c) = chars.next() {
        out.push(match c {
            '\\' => match chars.next()? {
                'n' => '\n',
                'r' => '\r',
                '\\' => '\\',
                _ => return None,
            },
            c => c,
        });
    }
    Some(out)
}

/// `digest` as 64 lowercase hex digits.
pub fn hex(digest: &Sha256Digest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The line `sha256sum` prints for `name` (a newline, carriage return or
/// backslash in it escaped, and the line then started with a backslash),
/// with its newline.
pub fn sums_line(digest: &Sha256Digest, name: &str) -> String {
    if name.contains(['\n', '\r', '\\']) {
        let escaped = name.replace('\\', "\\\\").replace('\n', "\\n").replace('\r', "\\r");
        format!("\\{}  {escaped}\n", hex(digest))
    } else {
        format!("{}  {name}\n", hex(digest))
    }
}

/// A sums file is one line a file: more than this is not one.
const MAX_SUMS_BYTES: u64 = 16 << 20;

/// The text of the sums file `sums` beside `path`: a regular file of at
/// most [`MAX_SUMS_BYTES`], opened without blocking (a FIFO or a device
/// put there is refused, not read forever).
fn read_sums_file(path: &Path, sums: &Path) -> Result<String> {
    let meta = match std::fs::metadata(sums) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "verify",
                path,
                format!("no {} beside it to verify against (`dmaload sums` writes one)", sums.display()),
            ))
        }
        Err(e) => return Err(Error::io("read the sums file", sums, e)),
        Ok(meta) => meta,
    };
    if !meta.is_file() || meta.len() > MAX_SUMS_BYTES {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "read the sums file",
            sums,
            format!("not a regular file of at most {MAX_SUMS_BYTES} bytes (the digests `sha256sum` writes)"),
        ));
    }
    let mut text = String::new();
    crate::source::open_for_reading(sums)?
        .take(MAX_SUMS_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| Error::io("read the sums file", sums, e))?;
    Ok(text)
}

/// The SHA-256 of the file at `path`, read through once (what `dmaload
/// sums` records).
pub fn file_digest(path: &Path) -> Result<Sha256Digest> {
    // Regular files and block devices only, opened without blocking: a
    // FIFO named here is refused, not waited on.
    let mut file = crate::source::open_for_reading(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("read", path, e)),
        }
    }
    Ok(hasher.finalize().into())
}

/// The running digest of a verified load, fed its bytes in file order by
/// the pipeline (see the module doc), and the digest it must reach.
pub(crate) struct Verifier {
    expected: Sha256Digest,
    hasher: std::sync::Mutex<(Sha256, Vec<u8>)>,
}

impl Verifier {
    /// The verifier of a load of `plan` from `file` at `path` when the
    /// options ask for one: only whole files are verified (the digest is the
    /// file's), and the sums file must list this one.
    pub fn for_load(path: &Path, file: &File, plan: &Plan, verify: bool) -> Result<Option<Verifier>> {
        if !verify {
            return Ok(None);
        }
        let size = file.metadata().map_err(|e| Error::io("fstat", path, e))?.len();
        if plan.data_start != 0 || plan.data_end != size {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "verify",
                path,
                format!(
                    "only a whole file can be verified against its digest, not bytes {}..{} of {size}",
                    plan.data_start, plan.data_end
                ),
            ));
        }
        let expected = expected_digest(path)?;
        Ok(Some(Verifier { expected, hasher: std::sync::Mutex::new((Sha256::new(), vec![0u8; HASH_CHUNK])) }))
    }

    /// Adds `range` of `src`, the next bytes of the file, all arrived and
    /// written by nothing any more.
    pub fn add(&self, src: MappingWriter<'_>, range: std::ops::Range<usize>) {
        let mut state = self.hasher.lock().unwrap_or_else(|p| p.into_inner());
        let (hasher, scratch) = &mut *state;
        for start in range.clone().step_by(HASH_CHUNK) {
            let end = (start + HASH_CHUNK).min(range.end);
            let chunk = &mut scratch[..end - start];
            src.copy_out(start..end, chunk);
            hasher.update(&*chunk);
        }
    }

    /// Compares the digest of every byte added with the expected one: the
    /// mismatch error names the file, the sums file and both digests.
    pub fn check(self, path: &Path) -> Result<()> {
        let (hasher, _) = self.hasher.into_inner().unwrap_or_else(|p| p.into_inner());
        let computed: Sha256Digest = hasher.finalize().into();
        let expected = &self.expected;
        if &computed == expected {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Corrupt,
            "verify",
            path,
            format!(
                "SHA-256 mismatch: {} expects {}, the bytes read hash to {}",
                sums_path(path).display(),
                hex(expected),
                hex(&computed)
            ),
        ))
    }
}
