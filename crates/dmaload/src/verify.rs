//! Verified bytes: a load with [`crate::LoadOptions::verify`] checks the
//! file against the digest a sums file beside it records: `B3SUMS`
//! (BLAKE3, as `b3sum` writes it) or `SHA256SUMS` (SHA-256, as `sha256sum`
//! writes it), whichever lists the file, BLAKE3 first when both do.
//!
//! A sums file means what its tool's `-c` says it means, run in the sums
//! file's directory (`listing`): `SHA256SUMS` as GNU `sha256sum -c` reads
//! it (`<64 hex>  <name>`, ` *` binary marker, the BSD tag form `SHA256
//! (name) = <hex>` that `sha256sum --tag` writes, upper- or lower-case hex,
//! CRLF line ends, names escaped after a leading backslash (`\\`, `\n`,
//! `\r`), `#` comments and blank lines passed over, other lines it cannot
//! read passed over as `sha256sum -c` does with a warning); `B3SUMS` as
//! `b3sum -c` reads it (lower-case hex and two spaces only, `\\` and `\n`
//! escapes, and any line it cannot read fails the file, as it fails `b3sum
//! -c`). A line lists the loaded file when its name is the file's name
//! (after leading `./`), or a path (with a `/`: `sub/name`, `../x/name`,
//! absolute) that leads, symlinks followed, to the same file. Every line
//! that lists the file must match (`-c` checks each): lines that disagree
//! with each other are refused before any read.
//!
//! The digest is computed while the bytes stream in: each gather as the
//! engine completes it, in file order, on a thread beside the engine (or
//! each staging slot as a sink receives it), never in a second pass over
//! the file. A load of the rest of a file whose first bytes the caller read
//! through [`crate::OpenFile::read_head`] (a safetensors header, then its
//! data section to a device) digests those first bytes, then the rest: the
//! whole file, in file order. Any other part of a file cannot be checked
//! against the whole file's digest, and is refused before anything is
//! read.
//!
//! Why two: one file's digest is one sequential stream on one core.
//! SHA-256 runs at about 1.7 GiB/s a core with the CPU's SHA instructions,
//! slower than a fast disk, so it bounds a verified load; BLAKE3 runs at
//! 4 GiB/s and more on one core (its SIMD hashes many 1 KiB chunks at once)
//! and hides behind the reads.

use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::Digest as _;

use crate::error::{Error, ErrorKind, Result};
use crate::source::OpenFile;
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

    /// The tool that writes and checks this digest's sums files.
    pub fn tool(self) -> &'static str {
        match self {
            DigestKind::Sha256 => "sha256sum",
            DigestKind::Blake3 => "b3sum",
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

/// What a sums file records for one file: its digest and where.
struct Listed {
    kind: DigestKind,
    digest: Digest,
    sums: PathBuf,
    /// The lines (from 1) that list the file.
    lines: Vec<usize>,
}

/// The digest the sums files beside `path` record for the file there, and
/// its kind: `B3SUMS` first, then `SHA256SUMS`. An error when neither
/// exists or lists it, when one that exists cannot be read or is refused by
/// its tool, or when its lines for the file disagree.
pub fn expected_digest(path: &Path) -> Result<(DigestKind, Digest)> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io("stat", path, e))?;
    let listed = look_up(path, (meta.dev(), meta.ino()))?;
    Ok((listed.kind, listed.digest))
}

/// [`expected_digest`] of the file `identity` (device, inode) at `path`.
fn look_up(path: &Path, identity: (u64, u64)) -> Result<Listed> {
    look_up_with(path, read_sums_file, |dir, name, own| names_the_file(dir, name, own, identity))
}

/// The lookup of [`look_up`] wherever the sums are: `read` gives the
/// bytes of the sums file at a path (`None` where there is none), and
/// `names(dir, name, own)` whether `name`, a line's name in a sums file in
/// `dir`, is the loaded one, whose own name is `own`.
fn look_up_with(
    path: &Path,
    mut read: impl FnMut(&Path) -> Result<Option<Vec<u8>>>,
    names: impl Fn(&Path, &[u8], &[u8]) -> bool,
) -> Result<Listed> {
    let mut looked = Vec::new();
    let mut passed_over = String::new();
    for kind in DigestKind::ALL {
        let sums = sums_path(path, kind);
        let Some(text) = read(&sums)? else { continue };
        let listing = listing(kind, &text)
            .map_err(|why| Error::new(ErrorKind::InvalidInput, "read the sums file", &sums, why))?;
        if let Some(listed) = listed_digest(path, &names, &sums, kind, &listing)? {
            return Ok(listed);
        }
        if !listing.passed_over.is_empty() {
            passed_over += &format!(
                "; {} passes over line(s) {} of {} as not checksum lines",
                kind.tool(),
                numbers(&listing.passed_over),
                sums.display()
            );
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
        _ => format!(
            "{name:?} is not listed in {}{passed_over}",
            looked.iter().map(|s| s.display().to_string()).collect::<Vec<_>>().join(" or ")
        ),
    };
    Err(Error::new(ErrorKind::InvalidInput, "verify", path, why))
}

fn numbers(lines: &[usize]) -> String {
    lines.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// The digest the lines of `listing` that list the file at `path` (those
/// `names` accepts, as [`look_up_with`] says) record, if any does; an
/// error where two of them disagree.
fn listed_digest(
    path: &Path,
    names: &impl Fn(&Path, &[u8], &[u8]) -> bool,
    sums: &Path,
    kind: DigestKind,
    listing: &Listing,
) -> Result<Option<Listed>> {
    let dir = sums.parent().unwrap_or(Path::new("."));
    let own = path.file_name().unwrap_or_default().as_bytes();
    let mut found: Option<Listed> = None;
    for entry in &listing.entries {
        if !names(dir, &entry.name, own) {
            continue;
        }
        match &mut found {
            None => {
                let sums = sums.to_owned();
                found = Some(Listed { kind, digest: entry.digest, sums, lines: vec![entry.line] });
            }
            Some(listed) if listed.digest == entry.digest => listed.lines.push(entry.line),
            Some(listed) => {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    "verify",
                    path,
                    format!(
                        "{} lists it on line {} as {} and on line {} as {}: `{} -c` checks both, and no \
                         content matches both",
                        sums.display(),
                        listed.lines[0],
                        hex(&listed.digest),
                        entry.line,
                        hex(&entry.digest),
                        kind.tool()
                    ),
                ))
            }
        }
    }
    Ok(found)
}

/// Whether `name`, a name in a sums file in `dir`, is the file whose name
/// is `own` there and whose identity is `identity`: its own name (after
/// leading `./`), or a path with a `/` that leads to it (opened by `-c`
/// from `dir`, symlinks followed).
fn names_the_file(dir: &Path, name: &[u8], own: &[u8], identity: (u64, u64)) -> bool {
    let mut bare = name;
    while let Some(rest) = bare.strip_prefix(b"./") {
        bare = rest;
    }
    if bare == own {
        return true;
    }
    if !bare.contains(&b'/') {
        return false;
    }
    let listed = dir.join(OsStr::from_bytes(name));
    std::fs::metadata(listed).is_ok_and(|meta| (meta.dev(), meta.ino()) == identity)
}

/// Whether `name`, a name in a sums object in `dir` (`s3://BUCKET/DIR`),
/// is the object whose name is `own` there: its own name (after leading
/// `./`), or a path with a `/` that leads to it within the bucket, `.` and
/// `..` taken lexically (keys have no links).
fn names_the_object(dir: &Path, name: &[u8], own: &[u8]) -> bool {
    let mut bare = name;
    while let Some(rest) = bare.strip_prefix(b"./") {
        bare = rest;
    }
    if bare == own {
        return true;
    }
    if !bare.contains(&b'/') || bare.starts_with(b"/") {
        return false;
    }
    // `s3:` and the bucket, then the key's parts.
    let mut parts: Vec<&OsStr> = dir.iter().collect();
    let bucket = parts.len().min(2);
    for part in Path::new(OsStr::from_bytes(bare)).iter() {
        match part.as_bytes() {
            b"." => {}
            b".." if parts.len() > bucket => drop(parts.pop()),
            b".." => return false,
            _ => parts.push(part),
        }
    }
    parts.pop() == Some(OsStr::from_bytes(own)) && parts.into_iter().eq(dir.iter())
}

/// The sums file of `kind` in the directory of `path`.
fn sums_path(path: &Path, kind: DigestKind) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(kind.sums_file()),
        _ => PathBuf::from(kind.sums_file()),
    }
}

/// One checksum line: where, the digest, the (unescaped) name.
struct Entry {
    line: usize,
    digest: Digest,
    name: Vec<u8>,
}

/// A sums file as its tool's `-c` reads it.
struct Listing {
    entries: Vec<Entry>,
    /// Lines (from 1) the tool passes over with a warning (`sha256sum -c`:
    /// lines not in a checksum format).
    passed_over: Vec<usize>,
}

/// `text`'s lines, numbered from 1, without their `\n` (a last line
/// without one included, nothing after a final `\n`).
fn lines(text: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    let text = text.strip_suffix(b"\n").unwrap_or(text);
    text.split(|&b| b == b'\n').enumerate().map(|(i, line)| (i + 1, line)).filter(move |_| !text.is_empty())
}

/// The checksum lines of a sums file of `kind`, read as its tool reads
/// them (see the module doc); an error where the tool refuses the file.
fn listing(kind: DigestKind, text: &[u8]) -> std::result::Result<Listing, String> {
    let mut listing = Listing { entries: Vec::new(), passed_over: Vec::new() };
    match kind {
        DigestKind::Sha256 => {
            // GNU's "BSD reversed" form (`<hex> <name>`, one space) is
            // taken when the first checksum line has it, and then only it.
            let mut reversed = None;
            for (line, text) in lines(text) {
                if text.first() == Some(&b'#') {
                    continue;
                }
                let text = text.strip_suffix(b"\r").unwrap_or(text);
                if text.is_empty() {
                    continue;
                }
                match coreutils_line(text, &mut reversed) {
                    Some((digest, name)) => listing.entries.push(Entry { line, digest, name }),
                    None => listing.passed_over.push(line),
                }
            }
        }
        DigestKind::Blake3 => {
            let text =
                std::str::from_utf8(text).map_err(|e| format!("not UTF-8, which `b3sum -c` refuses: {e}"))?;
            for (line, text) in lines(text.as_bytes()) {
                let (digest, name) = b3sum_line(text).map_err(|why| {
                    format!(
                        "line {line}: {why}, which fails `b3sum -c` (it reads `<64 lower-case hex>  <name>`)"
                    )
                })?;
                listing.entries.push(Entry { line, digest, name });
            }
        }
    }
    Ok(listing)
}

/// A line as GNU `sha256sum -c` (coreutils 9) reads it: the BSD tag form
/// `SHA256 (<name>) = <hex>`, or `<hex>` and a blank then a binary marker
/// (` ` or `*`) and the name, or `<hex> <name>` where the first line was so.
fn coreutils_line(line: &[u8], reversed: &mut Option<bool>) -> Option<(Digest, Vec<u8>)> {
    let white = |b: &u8| *b == b' ' || *b == b'\t';
    let mut line = &line[line.iter().position(|b| !white(b))?..];
    let escaped = line.first() == Some(&b'\\');
    if escaped {
        line = &line[1..];
    }
    let unescaped = |name: &[u8]| if escaped { unescape(name, true) } else { Some(name.to_vec()) };
    if let Some(tag) = line.strip_prefix(b"SHA256") {
        let tag = tag.strip_prefix(b" ").unwrap_or(tag).strip_prefix(b"(")?;
        let close = tag.iter().rposition(|&b| b == b')')?;
        let mut rest = &tag[close + 1..];
        rest = &rest[rest.iter().position(|b| !white(b)).unwrap_or(rest.len())..];
        rest = rest.strip_prefix(b"=")?;
        rest = &rest[rest.iter().position(|b| !white(b)).unwrap_or(rest.len())..];
        return Some((parse_hex(rest, true)?, unescaped(&tag[..close])?));
    }
    if line.len() < 64 + 2 || !white(&line[64]) {
        return None;
    }
    let mut name = &line[65..];
    if name.len() == 1 || (name[0] != b' ' && name[0] != b'*') {
        if *reversed == Some(false) {
            return None;
        }
        *reversed = Some(true);
    } else if *reversed != Some(true) {
        *reversed = Some(false);
        name = &name[1..];
    }
    Some((parse_hex(&line[..64], true)?, unescaped(name)?))
}

/// A line as `b3sum -c` reads it, or why it does not.
fn b3sum_line(line: &[u8]) -> std::result::Result<(Digest, Vec<u8>), &'static str> {
    if line.is_empty() {
        return Err("an empty line");
    }
    let (escaped, line) = match line.strip_prefix(b"\\") {
        Some(rest) => (true, rest),
        None => (false, line),
    };
    if line.len() <= 64 + 2 {
        return Err("a short line");
    }
    if line[64..66] != *b"  " {
        return Err("no two spaces after the digest");
    }
    let digest = parse_hex(&line[..64], false).ok_or("not 64 lower-case hex digits")?;
    let name = &line[66..];
    let name = if escaped {
        unescape(name, false).ok_or("an escape other than \\\\ or \\n")?
    } else {
        name.to_vec()
    };
    Ok((digest, name))
}

/// 64 hex digits (upper-case ones too where `any_case`) as a digest.
fn parse_hex(text: &[u8], any_case: bool) -> Option<Digest> {
    let value = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' if any_case => Some(c - b'A' + 10),
        _ => None,
    };
    if text.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (byte, pair) in digest.iter_mut().zip(text.chunks(2)) {
        *byte = value(pair[0])? << 4 | value(pair[1])?;
    }
    Some(digest)
}

/// A name escaped as the tools escape one: `\\` and `\n`, and `\r` where
/// `carriage_return` (coreutils; b3sum writes a carriage return as is).
/// `None` for any other escape, a lone backslash at the end, or a NUL.
fn unescape(name: &[u8], carriage_return: bool) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(name.len());
    let mut bytes = name.iter();
    while let Some(&b) = bytes.next() {
        out.push(match b {
            b'\\' => match bytes.next()? {
                b'n' => b'\n',
                b'r' if carriage_return => b'\r',
                b'\\' => b'\\',
                _ => return None,
            },
            0 => return None,
            b => b,
        });
    }
    Some(out)
}

/// `digest` as 64 lowercase hex digits.
pub fn hex(digest: &Digest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The line the tool of `kind` prints for `name`, with its newline:
/// `sha256sum` escapes a backslash, newline and carriage return in a name
/// (and starts the line with a backslash), `b3sum` a backslash and newline.
pub fn sums_line(kind: DigestKind, digest: &Digest, name: &[u8]) -> Vec<u8> {
    let escape_cr = kind == DigestKind::Sha256;
    let escaped = name.iter().any(|&b| b == b'\n' || b == b'\\' || (escape_cr && b == b'\r'));
    let mut line = Vec::with_capacity(name.len() + 68);
    if escaped {
        line.push(b'\\');
    }
    line.extend_from_slice(hex(digest).as_bytes());
    line.extend_from_slice(b"  ");
    for &b in name {
        match b {
            b'\\' if escaped => line.extend_from_slice(b"\\\\"),
            b'\n' => line.extend_from_slice(b"\\n"),
            b'\r' if escape_cr => line.extend_from_slice(b"\\r"),
            b => line.push(b),
        }
    }
    line.push(b'\n');
    line
}

/// A sums file is one line a file: more than this is not one.
pub(crate) const MAX_SUMS_BYTES: u64 = 16 << 20;

/// The bytes of the sums file `sums`, `None` when there is none: a regular
/// file of at most [`MAX_SUMS_BYTES`], opened without blocking (a FIFO or
/// a device put there is refused, not read forever).
fn read_sums_file(sums: &Path) -> Result<Option<Vec<u8>>> {
    let meta = match std::fs::metadata(sums) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("read the sums file", sums, e)),
        Ok(meta) => meta,
    };
    if !meta.is_file() || meta.len() > MAX_SUMS_BYTES {
        return Err(sums_too_large(sums, "not a regular file"));
    }
    let mut text = Vec::new();
    crate::source::open_for_reading(sums)?
        .take(MAX_SUMS_BYTES)
        .read_to_end(&mut text)
        .map_err(|e| Error::io("read the sums file", sums, e))?;
    Ok(Some(text))
}

/// The error of a sums file (or object) that is not `what` of at most
/// [`MAX_SUMS_BYTES`].
pub(crate) fn sums_too_large(sums: &Path, what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        "read the sums file",
        sums,
        format!("{what} of at most {MAX_SUMS_BYTES} bytes (the digests `sha256sum` or `b3sum` writes)"),
    )
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

/// What a verified load must hash to, found where the load is asked for
/// (before anything is allocated or read): the digest the sums file
/// records, and the file's first bytes the caller already read.
pub(crate) struct Expected {
    listed: Listed,
    /// Bytes `0..start` of the file, read by the caller
    /// ([`OpenFile::read_head`]), hashed before the load's own bytes.
    head: Option<Arc<[u8]>>,
    /// Where the load's own bytes start, and the file's length.
    start: u64,
    end: u64,
}

impl Expected {
    /// What a load of `len` bytes (to the end when `None`) from `offset`
    /// of `file` must hash to, when `verify` asks for a check: `None`
    /// without. The load must cover the file to its end from its first
    /// byte, or from the end of the bytes the caller read first
    /// ([`OpenFile::read_head`]): anything else is refused here, as is a
    /// file no sums file beside it lists.
    pub(crate) fn for_load(
        file: &OpenFile,
        offset: u64,
        len: Option<u64>,
        verify: bool,
    ) -> Result<Option<Expected>> {
        if !verify {
            return Ok(None);
        }
        let path = file.path();
        let size = file.len();
        let head = file.head().filter(|head| head.len() as u64 == offset && offset > 0);
        whole(path, size, offset, len, head.is_some())?;
        let meta = file.source().file.metadata().map_err(|e| Error::io("fstat", path, e))?;
        let listed = look_up(path, (meta.dev(), meta.ino()))?;
        Ok(Some(Expected { listed, head, start: offset, end: size }))
    }

    /// [`for_load`](Self::for_load) of an object (`name`, `s3://BUCKET/KEY`,
    /// of `size` bytes): the load must be the whole object, and the sums
    /// objects beside it (`B3SUMS`, `SHA256SUMS` under the key's
    /// "directory") are read by `read` (`None` where there is none) and
    /// taken as the files' are; a line names the object by its name, or
    /// by a path within the bucket that leads to its key.
    pub(crate) fn for_object(
        name: &Path,
        size: u64,
        offset: u64,
        len: Option<u64>,
        verify: bool,
        read: impl FnMut(&Path) -> Result<Option<Vec<u8>>>,
    ) -> Result<Option<Expected>> {
        if !verify {
            return Ok(None);
        }
        whole(name, size, offset, len, false)?;
        let listed = look_up_with(name, read, names_the_object)?;
        Ok(Some(Expected { listed, head: None, start: 0, end: size }))
    }

    /// A fresh running digest for one attempt at the load (a retried load
    /// starts again), the caller's first bytes already in it.
    pub(crate) fn verifier(&self) -> Verifier<'_> {
        let mut hasher = Hasher::new(self.listed.kind);
        if let Some(head) = &self.head {
            hasher.update(head);
        }
        let running =
            Running { hasher, scratch: vec![0u8; HASH_CHUNK], next: self.start, out_of_order: None };
        Verifier { expected: self, running: std::sync::Mutex::new(running) }
    }
}

/// Refuses a verified load of anything but the whole source at `path` (of
/// `size` bytes) from its first byte, or from the end of the bytes the
/// caller read first (`after_head`): a sums file's digest covers it all.
fn whole(path: &Path, size: u64, offset: u64, len: Option<u64>, after_head: bool) -> Result<()> {
    let end = len.map_or(Some(size), |len| offset.checked_add(len));
    if end == Some(size) && (offset == 0 || after_head) {
        return Ok(());
    }
    let asked = match len {
        Some(len) => format!("{len} bytes from offset {offset}"),
        None => format!("the bytes from offset {offset}"),
    };
    Err(Error::new(
        ErrorKind::InvalidInput,
        "verify",
        path,
        format!(
            "a sums file records the digest of the whole file ({size} bytes): {asked} cannot be \
             checked against it; load the whole file with verify, or the range without"
        ),
    ))
}

/// The running digest of one attempt at a verified load, fed its bytes in
/// file order by the pipeline (see the module doc).
pub(crate) struct Verifier<'e> {
    expected: &'e Expected,
    running: std::sync::Mutex<Running>,
}

struct Running {
    hasher: Hasher,
    scratch: Vec<u8>,
    /// The file offset of the next byte to hash.
    next: u64,
    /// Bytes offered out of file order (a bug): the first offset offered
    /// and the one expected.
    out_of_order: Option<(u64, u64)>,
}

impl Verifier<'_> {
    /// Adds `range` of `src`, file bytes from offset `at`: the next bytes
    /// of the file, all arrived and written by nothing any more.
    pub fn add(&self, src: MappingWriter<'_>, range: std::ops::Range<usize>, at: u64) {
        self.running.lock().unwrap_or_else(|p| p.into_inner()).add(src, range, at);
    }

    /// Compares the digest of the whole file (every byte added, after the
    /// caller's first bytes) with the expected one: the mismatch error
    /// names the file, the sums file and line, and both digests.
    pub fn check(self, path: &Path) -> Result<()> {
        self.expected.check(self.running.into_inner().unwrap_or_else(|p| p.into_inner()), path)
    }
}

impl Running {
    fn add(&mut self, src: MappingWriter<'_>, range: std::ops::Range<usize>, at: u64) {
        let Running { hasher, scratch, next, out_of_order } = self;
        if at != *next || out_of_order.is_some() {
            out_of_order.get_or_insert((at, *next));
            return;
        }
        for start in range.clone().step_by(HASH_CHUNK) {
            let end = (start + HASH_CHUNK).min(range.end);
            let chunk = &mut scratch[..end - start];
            src.copy_out(start..end, chunk);
            hasher.update(&*chunk);
        }
        *next += range.len() as u64;
    }
}

impl Expected {
    /// [`Verifier::check`] of the digest `running` ended with.
    fn check(&self, running: Running, path: &Path) -> Result<()> {
        let Expected { listed, end, .. } = self;
        if let Some((at, next)) = running.out_of_order {
            return Err(Error::new(
                ErrorKind::Io,
                "verify",
                path,
                format!(
                    "bytes from offset {at} came to the digest before those from {next}: not in file order"
                ),
            ));
        }
        if running.next != *end {
            return Err(Error::new(
                ErrorKind::Io,
                "verify",
                path,
                format!("the digest covers bytes 0..{} of {end}, not the whole file", running.next),
            ));
        }
        let computed = running.hasher.finalize();
        if computed == listed.digest {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Corrupt,
            "verify",
            path,
            format!(
                "{} mismatch: {} (line {}) expects {}, the bytes read hash to {}",
                listed.kind.name(),
                listed.sums.display(),
                numbers(&listed.lines),
                hex(&listed.digest),
                hex(&computed)
            ),
        ))
    }
}

/// The digest of a file that its caller streams itself, in file order (a
/// Python stream's windows, each loaded apart): the same sums-file lookup,
/// running digest and mismatch error as a verified load's.
pub struct StreamVerifier {
    expected: Expected,
    running: std::sync::Mutex<Running>,
}

impl StreamVerifier {
    /// The verifier of the file at `path`: its sums file must list it.
    pub fn new(path: &Path) -> Result<StreamVerifier> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io("stat", path, e))?;
        let listed = look_up(path, (meta.dev(), meta.ino()))?;
        Ok(Self::from_expected(Expected { listed, head: None, start: 0, end: meta.len() }))
    }

    /// The verifier of a whole source whose sums entry is `expected`.
    pub(crate) fn from_expected(expected: Expected) -> StreamVerifier {
        let running = expected.verifier().running.into_inner().unwrap_or_else(|p| p.into_inner());
        StreamVerifier { expected, running: std::sync::Mutex::new(running) }
    }

    /// The digest the sums file records, and its kind.
    pub fn expected(&self) -> (DigestKind, Digest) {
        (self.expected.listed.kind, self.expected.listed.digest)
    }

    /// Adds `bytes`, the next bytes of the file, which nothing writes any
    /// more.
    pub fn add(&self, mut bytes: crate::sys::mem::RawBytesMut<'_>) {
        let len = bytes.len();
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let at = running.next;
        running.add(bytes.writer(), 0..len, at);
    }

    /// The digest of every byte added against the
    /// expected one.
    pub fn check(self, path: &Path) -> Result<()> {
        self.expected.check(self.running.into_inner().unwrap_or_else(|p| p.into_inner()), path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(kind: DigestKind, text: &[u8]) -> Vec<(usize, Vec<u8>)> {
        listing(kind, text).unwrap().entries.into_iter().map(|e| (e.line, e.name)).collect()
    }

    #[test]
    fn a_sums_object_names_an_object_by_its_name_or_a_path_within_the_bucket() {
        let dir = Path::new("s3://b/models/llama");
        let own = b"model.safetensors";
        for yes in [
            "model.safetensors",
            "./model.safetensors",
            "sub/../model.safetensors",
            "../llama/model.safetensors",
        ] {
            assert!(names_the_object(dir, yes.as_bytes(), own), "{yes}");
        }
        for no in [
            "other.safetensors",
            "sub/model.safetensors",
            "/model.safetensors",
            "../../../b/model.safetensors",
        ] {
            assert!(!names_the_object(dir, no.as_bytes(), own), "{no}");
        }
        assert!(names_the_object(Path::new("s3://b"), b"x/../k", b"k"));
        assert!(!names_the_object(Path::new("s3://b"), b"../k", b"k"));
    }

    #[test]
    fn lines_are_read_as_sha256sum_reads_them() {
        let hex = "ab".repeat(32);
        let upper = hex.to_uppercase();
        let text = format!(
            "# comment\n\n{hex}  plain\r\n{hex} *binary\n\\{hex}  new\\nline\\\\\\r\nSHA256 (tag) = {upper}\n\
             \\SHA256(a\\\\b)= {hex}\nnot a line\n  {hex}\t sp\n{hex} one\n"
        );
        let listing = listing(DigestKind::Sha256, text.as_bytes()).unwrap();
        let got: Vec<(usize, Vec<u8>)> = listing.entries.into_iter().map(|e| (e.line, e.name)).collect();
        let want: Vec<(usize, &[u8])> =
            vec![(3, b"plain"), (4, b"binary"), (5, b"new\nline\\\r"), (6, b"tag"), (7, b"a\\b"), (9, b"sp")];
        assert_eq!(got, want.into_iter().map(|(l, n)| (l, n.to_vec())).collect::<Vec<_>>());
        // One space after the first line had two: not the BSD reversed form.
        assert_eq!(listing.passed_over, vec![8, 10]);
        // ... and where the first had one space, the others may have one too.
        let reversed = format!("{hex} one\n{hex} two\n");
        assert_eq!(names(DigestKind::Sha256, reversed.as_bytes()).len(), 2);
    }

    #[test]
    fn lines_are_read_as_b3sum_reads_them() {
        let hex = "cd".repeat(32);
        let text = format!("{hex}  plain\n\\{hex}  new\\nline\\\\\n{hex}  cr\r\n");
        let want: Vec<(usize, Vec<u8>)> =
            vec![(1, b"plain".to_vec()), (2, b"new\nline\\".to_vec()), (3, b"cr\r".to_vec())];
        assert_eq!(names(DigestKind::Blake3, text.as_bytes()), want);
        for bad in [
            format!("{hex}  a\n\n"),
            format!("# c\n{hex}  a\n"),
            format!("{}  a\n", hex.to_uppercase()),
            format!("{hex} *a\n"),
            format!("BLAKE3 (a) = {hex}\n"),
            format!("\\{hex}  a\\rb\n"),
        ] {
            assert!(listing(DigestKind::Blake3, bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn each_tool_escapes_its_own_way() {
        let digest = [0x11; 32];
        let hex = hex(&digest);
        assert_eq!(sums_line(DigestKind::Sha256, &digest, b"a\rb"), format!("\\{hex}  a\\rb\n").into_bytes());
        assert_eq!(sums_line(DigestKind::Blake3, &digest, b"a\rb"), format!("{hex}  a\rb\n").into_bytes());
        assert_eq!(
            sums_line(DigestKind::Blake3, &digest, b"a\\b"),
            format!("\\{hex}  a\\\\b\n").into_bytes()
        );
    }
}
