//! `format::safetensors`: the header of a [safetensors] file, parsed and
//! checked as untrusted input, and a loader that hands out the whole file
//! in one [`Buffer`] together with its tensor table.
//!
//! A safetensors file is an 8-byte little-endian header length `n`, `n`
//! bytes of JSON (a map from tensor name to `{dtype, shape, data_offsets}`,
//! plus an optional `__metadata__` map of strings), then the tensor data.
//! `data_offsets` are relative to the first byte after the header.
//!
//! The checks match the reference implementation's: the header is at most
//! [`MAX_HEADER_LEN`] bytes of UTF-8 JSON starting with `{`; every tensor's
//! byte range holds exactly `product(shape) × dtype size` bytes; the ranges,
//! sorted by offset, tile the data section without gap or overlap and end
//! at the end of the file. On top of those, names must be unique and a
//! shape has at most [`MAX_RANK`] dimensions, so no header makes the parser
//! allocate much more than the header's own size.
//!
//! [safetensors]: https://github.com/huggingface/safetensors

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::buffer::Buffer;
use crate::cancel::CancelToken;
use crate::error::Error as IoError;
use crate::load::LoadRequest;
use crate::object::Object;
use crate::options::LoadOptions;
use crate::report::LoadReport;
use crate::source::OpenFile;

/// Largest header accepted, in bytes (the reference implementation's limit).
pub const MAX_HEADER_LEN: u64 = 100_000_000;
/// Most dimensions a tensor may have (NumPy's limit; PyTorch's is lower).
pub const MAX_RANK: usize = 64;
/// Name of the optional string-to-string metadata entry of the header.
pub const METADATA_KEY: &str = "__metadata__";

/// The element types safetensors defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Dtype {
    Bool,
    /// 4-bit float (e2m1), two per byte.
    F4,
    /// 6-bit float (e2m3), packed.
    F6E2M3,
    /// 6-bit float (e3m2), packed.
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E4M3Fnuz,
    F8E5M2Fnuz,
    /// 8-bit exponent-only scale (e8m0).
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    /// Complex of two f32.
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
    pub const ALL: [Dtype; 22] = [
        Dtype::Bool,
        Dtype::F4,
        Dtype::F6E2M3,
        Dtype::F6E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E5M2,
        Dtype::F8E4M3,
        Dtype::F8E4M3Fnuz,
        Dtype::F8E5M2Fnuz,
        Dtype::F8E8M0,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// The name used in the header, e.g. `"BF16"`.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6E2M3 => "F6_E2M3",
            Dtype::F6E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E4M3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E5M2Fnuz => "F8_E5M2FNUZ",
            Dtype::F8E8M0 => "F8_E8M0",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bits per element.
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6E2M3 | Dtype::F6E3M2 => 6,
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8E5M2
            | Dtype::F8E4M3
            | Dtype::F8E4M3Fnuz
            | Dtype::F8E5M2Fnuz
            | Dtype::F8E8M0 => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte range relative to the start of the data section.
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    /// Number of elements (1 for a scalar, 0 when a dimension is 0).
    pub fn elements(&self) -> u64 {
        // Cannot overflow: checked when the header was parsed.
        self.shape.iter().product()
    }

    /// Bytes of data.
    pub fn byte_len(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }
}

/// A parsed and validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Length of the JSON text, the `n` of the first 8 bytes.
    pub header_len: u64,
    /// The tensors in the order of their data in the file.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` entry, if present.
    pub metadata: Option<BTreeMap<String, String>>,
}

impl Header {
    /// Offset in the file of the first byte of tensor data.
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }

    /// Bytes of tensor data.
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.data_offsets.1)
    }

    /// The length of the file this header describes.
    pub fn file_len(&self) -> u64 {
        self.data_start() + self.data_len()
    }

    /// The tensor called `name` (linear search; build a map for many lookups).
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// What is wrong with a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderErrorKind {
    /// Fewer than 8 bytes: no header length.
    TooSmall,
    /// The header length exceeds [`MAX_HEADER_LEN`].
    HeaderTooLarge,
    /// The header length points past the end of the file.
    InvalidHeaderLength,
    /// The header is not UTF-8.
    InvalidUtf8,
    /// The header does not start with `{`.
    InvalidHeaderStart,
    /// The header is not JSON of the expected shape (this includes a
    /// duplicated name, an unknown dtype or too many dimensions).
    InvalidJson,
    /// A tensor's `data_offsets` end before they start.
    InvalidOffsets,
    /// `product(shape) × dtype size` overflows.
    Overflow,
    /// A tensor's byte range does not hold `product(shape) × dtype size` bytes.
    ShapeMismatch,
    /// Two tensors' byte ranges overlap.
    Overlap,
    /// Bytes between two tensors (or before the first) belong to none.
    Gap,
    /// The file is shorter or longer than the header says.
    LengthMismatch,
    /// The file changed while it was being loaded.
    Changed,
}

/// A malformed safetensors header, with the file offset it was found at
/// where one applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderError {
    kind: HeaderErrorKind,
    message: String,
    offset: Option<u64>,
}

impl HeaderError {
    fn new(kind: HeaderErrorKind, message: impl Into<String>) -> Self {
        HeaderError { kind, message: message.into(), offset: None }
    }

    fn at(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }

    pub fn kind(&self) -> HeaderErrorKind {
        self.kind
    }

    /// What is wrong, without the offset.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The byte of the file the problem was found at, if it is tied to one.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(offset) = self.offset {
            write!(f, " (at byte {offset} of the file)")?;
        }
        Ok(())
    }
}

impl std::error::Error for HeaderError {}

/// A failure reading or loading a safetensors file: the file could not be
/// read ([`Error::Io`]), it is not a valid safetensors file, or a model's
/// shards disagree with each other or with its index
/// ([`Error::Model`]: the message names the files and tensors).
#[derive(Debug)]
pub enum Error {
    Io(IoError),
    Header { path: PathBuf, error: HeaderError },
    Model(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io(err) => err.fmt(f),
            Error::Header { path, error } => {
                write!(f, "{}: invalid safetensors file: {error}", path.display())
            }
            Error::Model(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(err) => Some(err),
            Error::Header { error, .. } => Some(error),
            Error::Model(_) => None,
        }
    }
}

impl From<IoError> for Error {
    fn from(err: IoError) -> Self {
        Error::Io(err)
    }
}

/// Reads the header length from the first 8 bytes of a file and checks it
/// against [`MAX_HEADER_LEN`] and the file's length.
pub fn header_len(prefix: &[u8], file_len: u64) -> Result<u64, HeaderError> {
    let Some(bytes) = prefix.get(..8) else {
        return Err(HeaderError::new(
            HeaderErrorKind::TooSmall,
            format!("file is {} bytes, too small for the 8-byte header length", prefix.len().min(8)),
        ));
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(bytes);
    let n = u64::from_le_bytes(le);
    if n > MAX_HEADER_LEN {
        return Err(HeaderError::new(
            HeaderErrorKind::HeaderTooLarge,
            format!("header length {n} exceeds the limit of {MAX_HEADER_LEN} bytes"),
        )
        .at(0));
    }
    if 8 + n > file_len {
        return Err(HeaderError::new(
            HeaderErrorKind::InvalidHeaderLength,
            format!("header length {n} runs past the end of the file ({file_len} bytes)"),
        )
        .at(0));
    }
    Ok(n)
}

/// Parses a whole file held in memory (or its first `8 + n` bytes, with the
/// file's real length in `file_len`).
pub fn parse(bytes: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    let n = header_len(bytes, file_len)?;
    // header_len checked 8 + n <= file_len, not against bytes.len().
    let json = usize::try_from(8 + n).ok().and_then(|end| bytes.get(8..end)).ok_or_else(|| {
        HeaderError::new(
            HeaderErrorKind::InvalidHeaderLength,
            format!("header length {n} runs past the {} bytes given", bytes.len()),
        )
        .at(0)
    })?;
    parse_header(json, file_len)
}

/// Parses and validates the JSON header `json` (the `n` bytes after the
/// length) of a file of `file_len` bytes.
pub fn parse_header(json: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    let n = json.len() as u64;
    let text = std::str::from_utf8(json).map_err(|e| {
        HeaderError::new(HeaderErrorKind::InvalidUtf8, format!("header is not UTF-8: {e}"))
            .at(8 + e.valid_up_to() as u64)
    })?;
    if !text.starts_with('{') {
        return Err(
            HeaderError::new(HeaderErrorKind::InvalidHeaderStart, "header does not start with '{'").at(8)
        );
    }
    if let Some(at) = too_deep(text) {
        return Err(HeaderError::new(
            HeaderErrorKind::InvalidJson,
            format!("header is not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels"),
        )
        .at(8 + at as u64));
    }
    let raw: RawHeader = serde_json::from_str(text).map_err(|e| {
        let at = line_column_offset(text, e.line(), e.column());
        HeaderError::new(HeaderErrorKind::InvalidJson, format!("header is not valid JSON: {e}")).at(8 + at)
    })?;
    let data_start = 8 + n;
    let mut tensors = Vec::with_capacity(raw.tensors.len());
    for (name, info) in raw.tensors {
        let dtype = Dtype::from_name(&info.dtype).ok_or_else(|| {
            HeaderError::new(
                HeaderErrorKind::InvalidJson,
                format!("tensor {name:?}: unknown dtype {:?}", truncate(&info.dtype)),
            )
        })?;
        let (begin, end) = info.data_offsets;
        if end < begin {
            return Err(HeaderError::new(
                HeaderErrorKind::InvalidOffsets,
                format!("tensor {name:?}: data_offsets [{begin}, {end}] end before they start"),
            )
            .at(data_start.saturating_add(begin)));
        }
        let bits = info
            .shape
            .0
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|elements| elements.checked_mul(dtype.bits()))
            .ok_or_else(|| {
                HeaderError::new(
                    HeaderErrorKind::Overflow,
                    format!("tensor {name:?}: shape {:?} × {dtype} overflows 64 bits", info.shape.0),
                )
            })?;
        if bits % 8 != 0 || bits / 8 != end - begin {
            return Err(HeaderError::new(
                HeaderErrorKind::ShapeMismatch,
                format!(
                    "tensor {name:?}: shape {:?} of {dtype} needs {} bytes but data_offsets [{begin}, {end}] \
                     hold {}",
                    info.shape.0,
                    if bits % 8 == 0 { format!("{}", bits / 8) } else { format!("{bits} bits, not whole") },
                    end - begin
                ),
            )
            .at(data_start.saturating_add(begin)));
        }
        tensors.push(TensorInfo { name, dtype, shape: info.shape.0, data_offsets: (begin, end) });
    }
    tensors.sort_by(|a, b| a.data_offsets.cmp(&b.data_offsets).then_with(|| a.name.cmp(&b.name)));
    let mut expected = 0u64;
    let mut previous: Option<&str> = None;
    for t in &tensors {
        let (begin, _) = t.data_offsets;
        if begin != expected {
            let (kind, what) = if begin < expected {
                (HeaderErrorKind::Overlap, format!("overlaps tensor {:?}", previous.unwrap_or_default()))
            } else {
                (HeaderErrorKind::Gap, format!("leaves {} unused bytes before it", begin - expected))
            };
            return Err(HeaderError::new(
                kind,
                format!("tensor {:?} at data_offsets [{begin}, {}] {what}", t.name, t.data_offsets.1),
            )
            .at(data_start.saturating_add(begin.min(expected))));
        }
        expected = t.data_offsets.1;
        previous = Some(&t.name);
    }
    let claimed = data_start.checked_add(expected).ok_or_else(|| {
        HeaderError::new(HeaderErrorKind::Overflow, "header describes a file larger than 2^64 bytes")
    })?;
    if claimed != file_len {
        let what = if claimed > file_len { "is shorter than" } else { "has bytes past" };
        return Err(HeaderError::new(
            HeaderErrorKind::LengthMismatch,
            format!(
                "file {what} its header says: {file_len} bytes, header describes {claimed} \
                 ({n}-byte header + {expected} bytes of tensors)"
            ),
        )
        .at(claimed.min(file_len)));
    }
    Ok(Header { header_len: n, tensors, metadata: raw.metadata })
}

/// Reads and validates the header of the file at `path` with two `pread`s.
/// Allocates at most `min(file length, MAX_HEADER_LEN)` bytes.
pub fn read_header(path: &Path) -> Result<(Header, Vec<u8>), Error> {
    read_header_of(&OpenFile::open(path)?)
}

/// [`read_header`] of a file already open: a load of the same [`OpenFile`]
/// afterwards reads the file this header describes, or fails if it changed.
/// The bytes read are the file's head ([`OpenFile::read_head`]): a verified
/// load of the data section hashes them first, checking the whole file.
pub fn read_header_of(file: &OpenFile) -> Result<(Header, Vec<u8>), Error> {
    let path = file.path();
    let file_len = file.len();
    let mut prefix = [0u8; 8];
    let got = file.read_at(&mut prefix, 0).map_err(|e| IoError::io("read", path, e))?;
    let header = |error| Error::Header { path: path.to_owned(), error };
    let n = header_len(&prefix[..got], file_len).map_err(header)?;
    // n <= MAX_HEADER_LEN (100 MB), so this fits usize and is bounded.
    let head = file.read_head(8 + n as usize).map_err(|e| IoError::io("read", path, e))?;
    if head.len() < 8 + n as usize || head[..8] != prefix {
        return Err(header(
            HeaderError::new(HeaderErrorKind::LengthMismatch, "file changed while its header was read")
                .at(head.len() as u64),
        ));
    }
    let json = head[8..].to_vec();
    let parsed = parse_header(&json, file_len).map_err(header)?;
    Ok((parsed, json))
}

/// Bytes of an object's first GET for its header: most headers fit (a
/// shard of tens of tensors has a header of a few KiB), so one request
/// reads them; a longer one takes a second GET for the rest. Every rank of
/// a group load reads each header, so what the probe reads past it is
/// read once per rank.
const OBJECT_HEADER_PROBE: u64 = 64 << 10;

/// [`read_header_of`] of an object (`s3://BUCKET/KEY`): its first bytes
/// read with a ranged GET pinned to the ETag of the open (two GETs where
/// the header is longer than 64 KiB), checked as a
/// file's header. Where the data cannot be parsed from loaded bytes (a
/// device's), this is how a model in object storage knows its tensors
/// before any data is loaded.
pub fn read_object_header(object: &Object, cancel: &CancelToken) -> Result<(Header, Vec<u8>), Error> {
    let path = object.name();
    let header = |error| Error::Header { path: path.to_owned(), error };
    let options = LoadOptions { cancel: cancel.clone(), ..LoadOptions::default() };
    let read = |offset: u64, len: u64| -> Result<Vec<u8>, Error> {
        let (bytes, _) = LoadRequest::object(object).range(offset, len).options(&options).to_buffer()?;
        Ok(bytes.to_vec())
    };
    let mut head = read(0, object.size.min(OBJECT_HEADER_PROBE))?;
    let n = header_len(&head, object.size).map_err(header)?;
    // header_len checked 8 + n <= the object's size.
    let end = 8 + n;
    if end > head.len() as u64 {
        head.extend(read(head.len() as u64, end - head.len() as u64)?);
    }
    head.truncate(end as usize);
    let json = head.split_off(8);
    let parsed = parse_header(&json, object.size).map_err(header)?;
    Ok((parsed, json))
}

/// A safetensors file loaded whole into one buffer.
#[derive(Debug)]
pub struct Loaded {
    /// All bytes of the file; tensor `t` is
    /// `buffer[header.data_start() + t.data_offsets.0 ..][.. t.byte_len()]`.
    pub buffer: Buffer,
    pub header: Header,
    pub report: LoadReport,
}

/// Validates the header of the file at `path`, then loads the whole file
/// with [`crate::load()`], then checks that the header in the loaded bytes is
/// the one validated (the file did not change in between).
pub fn load(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Loaded, Error> {
    let path = path.as_ref();
    let (header, json) = read_header(path)?;
    let (buffer, report) = crate::load(path, options)?;
    check_loaded(path, &header, &json, &buffer)?;
    Ok(Loaded { buffer, header, report })
}

/// Checks that `buffer`, the whole file at `path` loaded, holds the header
/// `header` (whose JSON is `json`) that was validated before the load: an
/// error if the file changed in between.
pub(super) fn check_loaded(path: &Path, header: &Header, json: &[u8], buffer: &Buffer) -> Result<(), Error> {
    let end = 8 + json.len();
    let same = buffer.len() as u64 == header.file_len()
        && buffer.get(..8) == Some(&header.header_len.to_le_bytes()[..])
        && buffer.get(8..end) == Some(json);
    if same {
        return Ok(());
    }
    Err(Error::Header {
        path: path.to_owned(),
        error: HeaderError::new(
            HeaderErrorKind::Changed,
            format!(
                "file changed while it was loaded ({} bytes loaded, header describes {})",
                buffer.len(),
                header.file_len()
            ),
        ),
    })
}

/// Byte offset in `text` of a 1-based (line, column) from serde_json.
fn line_column_offset(text: &str, line: usize, column: usize) -> u64 {
    if line == 0 {
        return 0;
    }
    let line_start: usize = text.split_inclusive('\n').take(line - 1).map(str::len).sum();
    (line_start + column.saturating_sub(1)).min(text.len()) as u64
}

/// At most 32 characters of an untrusted string, for messages.
fn truncate(s: &str) -> String {
    match s.char_indices().nth(32) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// Deepest nesting of JSON arrays and objects accepted, as serde_json (and
/// so the reference implementation) allows: unknown fields of a tensor are
/// skipped without that limit, so it is checked on the text first.
const MAX_JSON_DEPTH: usize = 128;

/// The byte offset where `text` nests arrays or objects deeper than
/// [`MAX_JSON_DEPTH`], if it does (brackets inside strings do not count).
fn too_deep(text: &str) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (at, byte) in text.bytes().enumerate() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_JSON_DEPTH {
                    return Some(at);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// The header as written, before validation.
struct RawHeader {
    tensors: Vec<(String, RawTensor)>,
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct RawTensor {
    dtype: String,
    shape: Shape,
    data_offsets: (u64, u64),
}

/// A shape of at most [`MAX_RANK`] dimensions.
struct Shape(Vec<u64>);

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ShapeVisitor;
        impl<'de> Visitor<'de> for ShapeVisitor {
            type Value = Shape;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a list of at most {MAX_RANK} non-negative integers")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
                let mut dims = Vec::new();
                while let Some(d) = seq.next_element::<u64>()? {
                    if dims.len() == MAX_RANK {
                        return Err(de::Error::custom(format!("shape has more than {MAX_RANK} dimensions")));
                    }
                    dims.push(d);
                }
                Ok(Shape(dims))
            }
        }
        deserializer.deserialize_seq(ShapeVisitor)
    }
}

/// A JSON object read in order, refusing duplicate keys (serde's maps keep
/// the last silently, which would let two entries claim one name).
struct UniqueMap<V>(Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for MapVisitor<V> {
            type Value = UniqueMap<V>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<UniqueMap<V>, A::Error> {
                let mut seen = HashSet::new();
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom(format!("duplicate name {:?}", truncate(&key))));
                    }
                    let value = map.next_value::<V>()?;
                    entries.push((key, value));
                }
                Ok(UniqueMap(entries))
            }
        }
        deserializer.deserialize_map(MapVisitor(PhantomData))
    }
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HeaderVisitor;
        impl<'de> Visitor<'de> for HeaderVisitor {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut seen = HashSet::new();
                let mut tensors = Vec::new();
                let mut metadata = None;
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom(format!("duplicate name {:?}", truncate(&key))));
                    }
                    if key == METADATA_KEY {
                        // `null` is what the reference writes for "no metadata".
                        metadata = map
                            .next_value::<Option<UniqueMap<String>>>()?
                            .map(|entries| entries.0.into_iter().collect());
                    } else {
                        let tensor = map
                            .next_value::<RawTensor>()
                            .map_err(|e| de::Error::custom(format!("tensor {:?}: {e}", truncate(&key))))?;
                        tensors.push((key, tensor));
                    }
                }
                Ok(RawHeader { tensors, metadata })
            }
        }
        deserializer.deserialize_map(HeaderVisitor)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn null_metadata_is_no_metadata_as_in_the_reference() {
        let h = parse_header(br#"{"__metadata__":null}"#, 8 + 21).unwrap();
        assert!(h.metadata.is_none());
        assert!(h.tensors.is_empty());
    }

    #[test]
    fn deep_nesting_is_refused_even_in_fields_that_are_skipped() {
        let deep = "[".repeat(MAX_JSON_DEPTH + 1) + &"]".repeat(MAX_JSON_DEPTH + 1);
        let json = format!(r#"{{"a":{{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":{deep}}}}}"#);
        let err = parse_header(json.as_bytes(), 8 + json.len() as u64 + 1).unwrap_err();
        assert!(err.message().contains("nested deeper than 128"), "{err}");
        // Brackets inside strings are text, and nesting up to the limit is fine.
        let ok = "[".repeat(MAX_JSON_DEPTH - 3) + &"]".repeat(MAX_JSON_DEPTH - 3);
        let json = format!(
            r#"{{"__metadata__":{{"k":"[[[[{{{{"}},"a":{{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":{ok}}}}}"#
        );
        parse_header(json.as_bytes(), 8 + json.len() as u64 + 1).unwrap();
    }

    use super::*;

    /// A file of `json` (padded with spaces to 8 bytes) and `data` bytes.
    fn file(json: &str, data: usize) -> Vec<u8> {
        let mut header = json.as_bytes().to_vec();
        while header.len() % 8 != 0 {
            header.push(b' ');
        }
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend(header);
        out.extend(std::iter::repeat_n(7u8, data));
        out
    }

    fn parse_file(bytes: &[u8]) -> Result<Header, HeaderError> {
        parse(bytes, bytes.len() as u64)
    }

    fn kind(json: &str, data: usize) -> HeaderErrorKind {
        parse_file(&file(json, data)).unwrap_err().kind()
    }

    #[test]
    fn parses_a_valid_header() {
        let json = r#"{"b":{"dtype":"F32","shape":[2,2],"data_offsets":[4,20]},
            "a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
            "s":{"dtype":"BF16","shape":[],"data_offsets":[20,22]},
            "e":{"dtype":"F64","shape":[0,3],"data_offsets":[22,22]},
            "__metadata__":{"format":"pt"}}"#;
        let h = parse_file(&file(json, 22)).unwrap();
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "s", "e"]);
        assert_eq!(h.tensor("s").unwrap().dtype, Dtype::BF16);
        assert_eq!(h.tensor("s").unwrap().elements(), 1);
        assert_eq!(h.data_len(), 22);
        assert_eq!(h.metadata.unwrap()["format"], "pt");
    }

    #[test]
    fn empty_header_and_sub_byte_dtypes() {
        assert!(parse_file(&file("{}", 0)).unwrap().tensors.is_empty());
        let json = r#"{"q":{"dtype":"F4","shape":[3,2],"data_offsets":[0,3]}}"#;
        assert_eq!(parse_file(&file(json, 3)).unwrap().tensors[0].byte_len(), 3);
        let odd = r#"{"q":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
        assert_eq!(kind(odd, 2), HeaderErrorKind::ShapeMismatch);
    }

    #[test]
    fn rejects_every_malformed_case() {
        use HeaderErrorKind::*;
        assert_eq!(parse_file(b"\x01\x00").unwrap_err().kind(), TooSmall);
        let mut huge = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
        huge.extend(b"{}");
        assert_eq!(parse_file(&huge).unwrap_err().kind(), HeaderTooLarge);
        let mut long = 64u64.to_le_bytes().to_vec();
        long.extend(b"{}      ");
        assert_eq!(parse_file(&long).unwrap_err().kind(), InvalidHeaderLength);
        let mut bad_utf8 = 7u64.to_le_bytes().to_vec();
        bad_utf8.extend(b"{\"\xff\":1}");
        assert_eq!(parse_file(&bad_utf8).unwrap_err().kind(), InvalidUtf8);
        assert_eq!(kind("[]", 0), InvalidHeaderStart);
        assert_eq!(kind("{", 0), InvalidJson);
        assert_eq!(kind(r#"{"a":{"dtype":"F9","shape":[],"data_offsets":[0,1]}}"#, 1), InvalidJson);
        let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},
                      "a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        assert_eq!(kind(dup, 2), InvalidJson);
        assert_eq!(kind(r#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#, 1), InvalidJson);
        let rank =
            format!(r#"{{"a":{{"dtype":"U8","shape":[{}],"data_offsets":[0,1]}}}}"#, ["1"; 65].join(","));
        assert_eq!(kind(&rank, 1), InvalidJson);
        assert_eq!(kind(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}}"#, 1), InvalidOffsets);
        let big = r#"{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#;
        assert_eq!(kind(big, 8), Overflow);
        assert_eq!(kind(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#, 4), ShapeMismatch);
        let overlap = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},
                          "b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#;
        assert_eq!(kind(overlap, 3), Overlap);
        assert_eq!(kind(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#, 2), Gap);
        let one = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        assert_eq!(kind(one, 3), LengthMismatch);
        assert_eq!(kind(one, 5), LengthMismatch);
        let far =
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}}"#;
        assert!(matches!(kind(far, 0), Gap | Overflow | LengthMismatch));
    }

    #[test]
    fn messages_name_the_tensor_and_offset() {
        let err =
            parse_file(&file(r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#, 4)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("\"w\"") && text.contains("needs 8 bytes") && text.contains("at byte"),
            "{text}"
        );
    }
}
