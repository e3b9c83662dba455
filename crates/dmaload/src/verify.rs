//! Verified bytes: a load with [`crate::LoadOptions::verify`] checks the
//! file against the digest a sums file beside it records: `B3SUMS`
//! (BLAKE3, as `b3sum` writes it) or `SHA256SUMS` (SHA-256, as `sha256sum`
//! writes it), whichever lists the file, BLAKE3 first when both do. Both
//! tools write, and `-c` reads, the same format (`<64 hex>
//! <space><space or *><name>`, a name with a newline or a backslash
//! escaped and its line started with a backslash). The digest is computed
//! while the bytes stream in: each gather as the engine completes it, in
//! file order, on a thread beside the engine (or each staging slot as a
//! sink receives it), never in a second pass over the file.
//!
//! Why two: one file's digest is one sequential stream on one core.
//! SHA-256 runs at about 1.7 GiB/s a core with the CPU's SHA instructions,
//! slower than a fast disk, so it bounds a verified load; BLAKE3 runs at
//! 4 GiB/s and more on one core (its SIMD hashes many 1 KiB chunks at once)
//! and hides behind the reads.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sha2::Digest as _;

use crate::error::{Error, ErrorKind, Result};
use crate::plan::Plan;
use crate::sys::mem::MappingWriter;

/// The digest a sums file records, and so the hash a verified load runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigestKind {
    /// SHA-256, in `SHA256SUMS` (what `sha256sum` writes).
    Sha256,
    /// BLAKE3 with its default 32-byte output, in `B3SUMS` (what `b3sum`
    /// writes).
    Blake3,
}

impl DigestKind {
    /// In the order a verified load looks for their sums files.
    pub const ALL: [DigestKind; 2] = [DigestKind::Blake3, DigestKind::Sha256];

    /// The sums file of this digest, looked for beside each verified file.
    pub fn sums_file(self) -> &'static str {
        match self {
            DigestKind::Sha256 => "SHA256SUMS",
            DigestKind::Blake3 => "B3SUMS",
        }
    }

    /// The digest's name as people write it.
    pub fn name(self) -> &'static str {
        match self {
            DigestKind::Sha256 => "SHA-256",
            DigestKind::Blake3 => "BLAKE3",
        }
    }

    /// The name of the sums file of any digest (a file no digest is taken of).
    pub fn is_sums_file(name: &std::ffi::OsStr) -> bool {
        DigestKind::ALL.iter().any(|kind| name == kind.sums_file())
    }
}

/// A digest in the middle of its stream.
enum Hasher {
    Sha256(sha2::Sha256),
    Blake3(Box<blake3::Hasher>),
}

impl Hasher {
    fn new(kind: DigestKind) -> Hasher {
        match kind {
            DigestKind::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            DigestKind::Blake3 => Hasher::Blake3(Box::new(blake3::Hasher::new())),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(hasher) => hasher.update(bytes),
            Hasher::Blake3(hasher) => {
                hasher.update(bytes);
            }
        }
    }

    fn finalize(self) -> Digest {
        match self {
            Hasher::Sha256(hasher) => hasher.finalize().into(),
            Hasher::Blake3(hasher) => *hasher.finalize().as_bytes(),
        }
    }
}

/// Bytes hashed at a time: copied out of the destination (never viewed as
/// a Rust slice while the kernel may write beside it) into a buffer that
/// stays in the CPU's cache.
const HASH_CHUNK: usize = 256 << 10;

/// A digest of either kind (both are 32 bytes).
pub type Digest = [u8; 32];

/// The digest the sums files beside `path` record for it, and its kind:
/// `B3SUMS` first, then `SHA256SUMS`. An error when neither exists or
/// lists `path`, or one that exists cannot be read or has a malformed line.
pub fn expected_digest(path: &Path) -> Result<(DigestKind, Digest)> {
    let mut looked = Vec::new();
    for kind in DigestKind::ALL {
        let sums = sums_path(path, kind);
        let Some(text) = read_sums_file(&sums)? else { continue };
        if let Some(digest) = listed_digest(path, &sums, &text)? {
            return Ok((kind, digest));
        }
        looked.push(sums);
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let why = match looked.as_slice() {
        [] => format!(
            "no {} or {} beside it to verify against (`dmaload sums` writes one)",
            DigestKind::Blake3.sums_file(),
            DigestKind::Sha256.sums_file()
        ),
        [sums] => format!("{name:?} is not listed in {}", sums.display()),
        _ => format!(
            "{name:?} is not listed in {}",
            looked.iter().map(|s| s.display().to_string()).collect::<Vec<_>>().join(" or ")
        ),
    };
    Err(Error::new(ErrorKind::InvalidInput, "verify", path, why))
}

/// The digest the sums file `sums` (its text) records for `path`, if it
/// lists it.
fn listed_digest(path: &Path, sums: &Path, text: &str) -> Result<Option<Digest>> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut found = None;
    for (number, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let (digest, listed) = parse_line(line).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                "read the sums file",
                sums,
                format!("line {} is not `<64 hex digits>  <name>`", number + 1),
            )
        })?;
        if listed.strip_prefix("./").unwrap_or(&listed) == name {
            found = Some(digest);
        }
    }
    Ok(found)
}

/// The sums file of `kind` in the directory of `path`.
fn sums_path(path: &Path, kind: DigestKind) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(kind.sums_file()),
        _ => PathBuf::from(kind.sums_file()),
    }
}

/// One line of a sums file: its digest and (unescaped) name.
fn parse_line(line: &str) -> Option<(Digest, String)> {
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
pub fn hex(digest: &Digest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The line `sha256sum` (or `b3sum`) prints for `name` (a newline,
/// carriage return or backslash in it escaped, and the line then started
/// with a backslash), with its newline.
pub fn sums_line(digest: &Digest, name: &str) -> String {
    if name.contains(['\n', '\r', '\\']) {
        let escaped = name.replace('\\', "\\\\").replace('\n', "\\n").replace('\r', "\\r");
        format!("\\{}  {escaped}\n", hex(digest))
    } else {
        format!("{}  {name}\n", hex(digest))
    }
}

/// A sums file is one line a file: more than this is not one.
const MAX_SUMS_BYTES: u64 = 16 << 20;

/// The text of the sums file `sums`, `None` when there is none: a regular
/// file of at most [`MAX_SUMS_BYTES`], opened without blocking (a FIFO or
/// a device put there is refused, not read forever).
fn read_sums_file(sums: &Path) -> Result<Option<String>> {
    let meta = match std::fs::metadata(sums) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("read the sums file", sums, e)),
        Ok(meta) => meta,
    };
    if !meta.is_file() || meta.len() > MAX_SUMS_BYTES {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "read the sums file",
            sums,
            format!("not a regular file of at most {MAX_SUMS_BYTES} bytes (the digests `sha256sum` or `b3sum` writes)"),
        ));
    }
    let mut text = String::new();
    crate::source::open_for_reading(sums)?
        .take(MAX_SUMS_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| Error::io("read the sums file", sums, e))?;
    Ok(Some(text))
}

/// The digest of `kind` of the file at `path`, read through once (what
/// `dmaload sums` records).
pub fn file_digest(path: &Path, kind: DigestKind) -> Result<Digest> {
    // Regular files and block devices only, opened without blocking: a
    // FIFO named here is refused, not waited on.
    let mut file = crate::source::open_for_reading(path)?;
    let mut hasher = Hasher::new(kind);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("read", path, e)),
        }
    }
    Ok(hasher.finalize())
}

/// The running digest of a verified load, fed its bytes in file order by
/// the pipeline (see the module doc), and the digest it must reach.
pub(crate) struct Verifier {
    kind: DigestKind,
    expected: Digest,
    hasher: std::sync::Mutex<(Hasher, Vec<u8>)>,
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
        let (kind, expected) = expected_digest(path)?;
        let hasher = std::sync::Mutex::new((Hasher::new(kind), vec![0u8; HASH_CHUNK]));
        Ok(Some(Verifier { kind, expected, hasher }))
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
        let computed = hasher.finalize();
        let expected = &self.expected;
        if &computed == expected {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Corrupt,
            "verify",
            path,
            format!(
                "{} mismatch: {} expects {}, the bytes read hash to {}",
                self.kind.name(),
                sums_path(path, self.kind).display(),
                hex(expected),
                hex(&computed)
            ),
        ))
    }
}

/// The digest of a file that its caller streams itself, in file order (a
/// Python stream's windows, each loaded apart): a [`Verifier`] for a load
/// the pipeline does not run as one, with the same sums-file lookup and
/// the same mismatch error.
pub struct StreamVerifier {
    verifier: Verifier,
}

impl StreamVerifier {
    /// The verifier of the file at `path`: its sums file must list it.
    pub fn new(path: &Path) -> Result<StreamVerifier> {
        let (kind, expected) = expected_digest(path)?;
        let hasher = std::sync::Mutex::new((Hasher::new(kind), vec![0u8; HASH_CHUNK]));
        Ok(StreamVerifier { verifier: Verifier { kind, expected, hasher } })
    }

    /// The digest the sums file records, and its kind.
    pub fn expected(&self) -> (DigestKind, Digest) {
        (self.verifier.kind, self.verifier.expected)
    }

    /// Adds `bytes`, the next bytes of the file, which nothing writes any
    /// more.
    pub fn add(&self, mut bytes: crate::sys::mem::RawBytesMut<'_>) {
        let len = bytes.len();
        self.verifier.add(bytes.writer(), 0..len);
    }

    /// [`Verifier::check`]: the digest of every byte added against the
    /// expected one.
    pub fn check(self, path: &Path) -> Result<()> {
        self.verifier.check(path)
    }
}
