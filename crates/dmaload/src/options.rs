//! The options of a load, each defined once: engine, I/O mode, sizes and
//! threads, progress and cancellation, and the fallbacks a load may take.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use serde::Serialize;

use crate::cancel::CancelToken;
use crate::error::{Error, ErrorKind, Result};
use crate::heap::DEFAULT_DMA_HEAP;
use crate::memory::MemoryKind;
use crate::types::{Engine, IoMode, ProgressFn};

/// Bytes populated (and registered) as one unit: seed 000's gather size.
pub const DEFAULT_GATHER_SIZE: usize = 128 << 20;
/// Bytes per read request: on a virtio disk (max_sectors_kb 4096) 4 MiB
/// reads reached the device's best throughput with the least CPU
/// (docs/benchmarks.md, "Figures behind the defaults").
pub const DEFAULT_CHUNK_SIZE: usize = 4 << 20;
/// Read requests kept in flight by the io_uring engines: 32 beat 16 on the
/// same disk, as it did for fio.
pub const DEFAULT_QUEUE_DEPTH: usize = 32;
/// Threads of the pread-pool engine.
pub const DEFAULT_POOL_THREADS: usize = 8;
/// Threads populating each gather: one per CPU, at most 4. Populating 4 KiB
/// pages costs about a CPU-second per GiB or less, so a thread or two keep
/// pace with a fast disk and 4 leave room to spare; huge pages need a
/// quarter of that. Past the CPUs there is nothing to gain, and where more
/// than 4 stops helping is unmeasured (docs/benchmarks.md, "Figures behind the defaults").
pub fn default_populate_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4))
}

/// Largest queue depth accepted (io_uring rings hold at most 32768 entries).
const MAX_QUEUE_DEPTH: usize = 4096;

/// Where a load's bytes go: `auto` (the cheapest host memory that can do
/// what was asked, see [`crate::memory::MemoryFacts::choose`]), a host
/// [`MemoryKind`] (`memfd`, `memfd-huge`, `hugetlb`, `anonymous-thp`,
/// `anonymous`: a
/// [`crate::Buffer`] of that memory), a dma-buf (`udmabuf`,
/// `dma-heap:NAME`, `dmabuf`: an fd the caller owns, from
/// [`crate::LoadRequest::to_dmabuf`]) or `cuda:N` (the memory of CUDA device N,
/// through a staging ring and [`crate::sink::CudaSink`]). Parsed from and
/// shown as those names (`cuda` alone is `cuda:0`, `dma-heap` alone
/// `dma-heap:system`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Destination {
    /// Host memory chosen per load: huge pages where the kernel gives
    /// them, a memfd when the caller needs an fd.
    #[default]
    Auto,
    /// A memfd with 4 KiB pages, shareable by fd and exportable with udmabuf.
    Memfd,
    /// A memfd asking for 2 MiB pages (shmem THP policy permitting).
    MemfdHuge,
    /// A memfd of hugetlb pages from the administrator's pool.
    Hugetlb,
    /// Private anonymous memory with transparent huge pages.
    AnonymousThp,
    /// Private anonymous memory in 4 KiB pages.
    Anonymous,
    /// A dma-buf over a memfd loaded in place (direct I/O where the
    /// filesystem allows), exported with udmabuf: no copy.
    Udmabuf,
    /// A dma-buf allocated from the dma-heap `/dev/dma_heap/NAME`, filled
    /// through a staging ring ([`crate::sink::DmaHeapSink`]).
    DmaHeap(String),
    /// `udmabuf` where it exists and can hold the range, else
    /// `dma-heap:system`; the report says which, and why.
    Dmabuf,
    /// The memory of CUDA device N.
    Cuda(usize),
}

const AUTO: &str = "auto";

impl Destination {
    /// Every form a destination is written in, `NAME` standing for a heap
    /// and `N` for a device number: `auto`, the host memory kinds, the
    /// dma-bufs, then `cuda:N`. Help texts and the Python binding's option
    /// types are checked against this list.
    pub fn forms() -> Vec<String> {
        let others = ["udmabuf", "dmabuf", "dma-heap:NAME", "cuda:N"];
        std::iter::once(AUTO)
            .chain(MemoryKind::ALL.iter().map(|k| k.name()))
            .chain(others)
            .map(str::to_owned)
            .collect()
    }

    /// The name the destination is given by (`auto`, `memfd`,
    /// `dma-heap:system`, `cuda:N`, ...).
    pub fn name(&self) -> String {
        self.to_string()
    }

    /// The memory kind a host destination names; `None` for `auto` (chosen
    /// per load), a dma-buf and a device.
    pub fn host_memory(&self) -> Option<MemoryKind> {
        match self {
            Destination::Memfd => Some(MemoryKind::Memfd),
            Destination::MemfdHuge => Some(MemoryKind::MemfdHuge),
            Destination::Hugetlb => Some(MemoryKind::Hugetlb),
            Destination::AnonymousThp => Some(MemoryKind::AnonymousThp),
            Destination::Anonymous => Some(MemoryKind::Anonymous),
            Destination::Auto
            | Destination::Udmabuf
            | Destination::DmaHeap(_)
            | Destination::Dmabuf
            | Destination::Cuda(_) => None,
        }
    }

    /// Whether the destination is a dma-buf ([`crate::LoadRequest::to_dmabuf`]).
    pub fn is_dmabuf(&self) -> bool {
        matches!(self, Destination::Udmabuf | Destination::DmaHeap(_) | Destination::Dmabuf)
    }

    /// Whether the bytes go to host memory (`auto` or a memory kind).
    pub fn is_host(&self) -> bool {
        *self == Destination::Auto || self.host_memory().is_some()
    }
}

impl From<MemoryKind> for Destination {
    fn from(kind: MemoryKind) -> Self {
        match kind {
            MemoryKind::Memfd => Destination::Memfd,
            MemoryKind::MemfdHuge => Destination::MemfdHuge,
            MemoryKind::Hugetlb => Destination::Hugetlb,
            MemoryKind::AnonymousThp => Destination::AnonymousThp,
            MemoryKind::Anonymous => Destination::Anonymous,
        }
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Destination::Auto => f.write_str(AUTO),
            Destination::Udmabuf => f.write_str("udmabuf"),
            Destination::DmaHeap(heap) => write!(f, "dma-heap:{heap}"),
            Destination::Dmabuf => f.write_str("dmabuf"),
            Destination::Cuda(n) => write!(f, "cuda:{n}"),
            host => f.write_str(host.host_memory().map_or("", MemoryKind::name)),
        }
    }
}

/// Whether `name` can name a heap: a single path component under
/// `/dev/dma_heap` (kernel heap names such as `system`, `linux,cma`).
fn valid_heap_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 255
        && !name.bytes().any(|b| b == b'/' || b == 0 || b.is_ascii_whitespace())
}

impl FromStr for Destination {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == AUTO {
            return Ok(Destination::Auto);
        }
        if let Some(kind) = MemoryKind::ALL.into_iter().find(|k| k.name() == s) {
            return Ok(kind.into());
        }
        match s {
            "udmabuf" => return Ok(Destination::Udmabuf),
            "dmabuf" => return Ok(Destination::Dmabuf),
            "dma-heap" => return Ok(Destination::DmaHeap(DEFAULT_DMA_HEAP.to_owned())),
            _ => {}
        }
        if let Some(heap) = s.strip_prefix("dma-heap:") {
            return if valid_heap_name(heap) {
                Ok(Destination::DmaHeap(heap.to_owned()))
            } else {
                Err(format!(
                    "invalid heap {s:?} (expected dma-heap:NAME, NAME a file in /dev/dma_heap such as system)"
                ))
            };
        }
        match s.strip_prefix("cuda") {
            Some("") => Ok(Destination::Cuda(0)),
            Some(n) => n
                .strip_prefix(':')
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .map(Destination::Cuda)
                .ok_or_else(|| format!("invalid device {s:?} (expected cuda or cuda:N, N a device number)")),
            None => Err(format!(
                "unknown destination {s:?} (expected one of: {})",
                Destination::forms().join(", ")
            )),
        }
    }
}

impl Serialize for Destination {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Options of a load ([`crate::load()`], [`crate::LoadRequest`]);
/// `LoadOptions::default()` is what a user gets without flags.
#[derive(Clone)]
pub struct LoadOptions {
    pub engine: Engine,
    pub mode: IoMode,
    /// Where the bytes go: [`crate::LoadRequest::load`] takes every kind;
    /// [`crate::load()`] and [`crate::LoadRequest::to_buffer`] fill a host
    /// [`crate::Buffer`], so they take the host kinds only.
    pub to: Destination,
    /// Whether the caller may want the buffer's memfd ([`crate::Buffer::memfd`],
    /// udmabuf export, passing it to another process). With `to: auto` and
    /// `needs_fd: false` a load may choose anonymous memory, which has no
    /// fd. An explicit memory kind is used as named either way.
    pub needs_fd: bool,
    /// Bytes populated (and registered) as one unit (rounded down to whole
    /// read requests, at least one and at most 1 GiB; doubled where a huge
    /// range would need more units than io_uring registers).
    pub gather_size: usize,
    /// Bytes per read request (rounded up to whole pages, and to the
    /// file's direct-I/O alignment when reading direct).
    pub chunk_size: usize,
    /// Requests in flight for the io_uring engines. Left at the default,
    /// direct reads tune it per block device from the depth remembered for
    /// it (the report's `queue_depth` is the depth kept).
    pub queue_depth: usize,
    /// Threads of the pread-pool engine.
    pub threads: usize,
    /// Threads that populate (allocate and zero) each gather ahead of the
    /// I/O, or a [`crate::HostSink`]'s destination ahead of its copies;
    /// page zeroing is CPU-bound, so more threads hide more of it.
    pub populate_threads: usize,
    /// Slots of the staging ring a load to `cuda:N` (pinned) or to
    /// `dma-heap:NAME` reads through, at least 2. `None` (the default):
    /// sized from the range, a device's ring to hold the reads the file's
    /// disk keeps in flight and two copies behind the link
    /// ([`crate::device::ring_slots_for`], at most a quarter of the range
    /// and [`crate::sink::DEFAULT_SLOTS`]; fewer for an object), a heap's to
    /// at most 128 MiB ([`crate::dmabuf::heap_ring_geometry`]). A ring kept
    /// from an earlier load on the device serves where it has as many
    /// slots or more. Other loads take no ring from these options.
    pub staging_slots: Option<usize>,
    /// Bytes per staging slot (whole read requests, at most 1 GiB). `None`
    /// (the default): [`crate::sink::DEFAULT_SLOT_SIZE`] for a device, the
    /// heap ring's own for a dma-heap. A device load whose `chunk_size`
    /// is left at its default reads a slot at a time.
    pub staging_slot_size: Option<usize>,
    /// Measure, after the load, how much of the range is in the page cache
    /// ([`crate::LoadReport::page_cache`]): `mmap` of the whole range, then
    /// `mincore` (a page-cache look-up per page and a status byte per page
    /// of memory), outside the report's times. Off by default: the report's
    /// `page_cache` is then `None`.
    pub measure_page_cache: bool,
    /// Called with (bytes done, bytes in all) from a reporting thread of
    /// the load (never an I/O thread, so a slow callback cannot stall the
    /// reads): about every 50 ms while bytes arrive, and once with
    /// `done == total` before a successful load returns.
    pub progress: Option<Arc<ProgressFn>>,
    /// Cancels the load from another thread (see [`CancelToken`]).
    pub cancel: CancelToken,
    /// Check the file against the digest that the `B3SUMS` (BLAKE3) or
    /// `SHA256SUMS` file beside it records ([`crate::verify`]), hashing the bytes as
    /// they arrive: a mismatch ([`crate::ErrorKind::Corrupt`]), a missing
    /// sums file or a file it does not list is an error, and no buffer is
    /// handed out. Whole files only, on every path (a new buffer, a sink,
    /// caller memory, a device; a data section after a header read with
    /// [`crate::OpenFile::read_head`]): a range is refused where the load is
    /// asked for, before any read; a cached load
    /// (`dmaload_share::CacheRequest`) loads directly.
    pub verify: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            engine: Engine::default(),
            mode: IoMode::default(),
            to: Destination::default(),
            needs_fd: true,
            gather_size: DEFAULT_GATHER_SIZE,
            chunk_size: DEFAULT_CHUNK_SIZE,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            threads: DEFAULT_POOL_THREADS,
            populate_threads: default_populate_threads(),
            staging_slots: None,
            staging_slot_size: None,
            measure_page_cache: false,
            progress: None,
            cancel: CancelToken::default(),
            verify: false,
        }
    }
}

impl fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadOptions")
            .field("engine", &self.engine)
            .field("mode", &self.mode)
            .field("to", &self.to)
            .field("needs_fd", &self.needs_fd)
            .field("gather_size", &self.gather_size)
            .field("chunk_size", &self.chunk_size)
            .field("queue_depth", &self.queue_depth)
            .field("threads", &self.threads)
            .field("populate_threads", &self.populate_threads)
            .field("staging_slots", &self.staging_slots)
            .field("staging_slot_size", &self.staging_slot_size)
            .field("measure_page_cache", &self.measure_page_cache)
            .field("progress", &self.progress.is_some())
            .field("cancelled", &self.cancel.is_cancelled())
            .field("verify", &self.verify)
            .finish()
    }
}

impl LoadOptions {
    /// Fails unless `to` names host memory (`auto` or a memory kind): what
    /// a front end whose load returns a host buffer checks before it calls
    /// [`crate::LoadRequest::load`]; the error says where the other kinds go.
    pub fn check_host(&self, path: &Path) -> Result<()> {
        if self.to.is_host() {
            return Ok(());
        }
        let why = if self.to.is_dmabuf() {
            format!(
                "a dma-buf ({to}) is an fd the caller owns, not a host Buffer: load it with load_dmabuf (Python, C) or LoadRequest::to_dmabuf (Rust)",
                to = self.to
            )
        } else {
            format!(
                "a host Buffer cannot live on a device ({to}): load into {to} with LoadRequest::load (or \
                 LoadRequest::to_sink with sink::CudaSink)",
                to = self.to
            )
        };
        Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            format!("{why}, or run `dmaload load --to {}`", self.to),
        ))
    }

    /// Fails unless `to` names a dma-buf (`udmabuf`, `dma-heap:NAME`,
    /// `dmabuf`): the check of a front end whose load returns a dma-buf.
    pub fn check_dmabuf(&self, path: &Path) -> Result<()> {
        if self.to.is_dmabuf() {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            format!("{} is not a dma-buf destination (expected udmabuf, dmabuf or dma-heap:NAME)", self.to),
        ))
    }
}

/// The memory kind a load of `len` bytes into a host [`crate::Buffer`]
/// allocates, and why: the one the destination names, or `auto`'s choice
/// (the facts come from the caller, who allocates against the same ones).
/// The request checked that `to` is a host kind.
pub(crate) fn host_memory(
    o: &LoadOptions,
    len: u64,
    facts: &crate::memory::MemoryFacts,
) -> crate::memory::MemoryChoice {
    match o.to.host_memory() {
        Some(kind) => crate::memory::MemoryChoice { kind, reason: format!("asked for ({kind})") },
        None => facts.choose(len, o.needs_fd),
    }
}

/// Parses a size with an optional binary suffix (K, M, G, T; "iB"/"B"
/// optional, case-insensitive). Fractions are allowed where they make
/// whole bytes: "1.5G", not "0.1K" (102.4 bytes) nor "0.0000001k" (which
/// would round to 0). The one size parser: the CLI's flags and Python's
/// options (through the binding) read sizes with it.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let s = text.trim();
    let digits_end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits_end);
    let value: f64 = number.parse().map_err(|_| format!("invalid size {text:?}"))?;
    let shift = match suffix.trim().to_ascii_lowercase().trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        other => return Err(format!("invalid size suffix {other:?} in {text:?} (use K, M, G or T)")),
    };
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("size {text:?} out of range"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!("size {text:?} is {bytes} bytes, not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// Checks `o`'s values as every load does before it opens a file (the
/// same check, for front ends that read their options long before a load,
/// such as the serving engines' loader configs): an `InvalidInput` error
/// saying which value is out of range.
pub fn check_load_options(o: &LoadOptions) -> Result<()> {
    validate(Path::new("options"), o)
}

pub(crate) fn validate(path: &Path, o: &LoadOptions) -> Result<()> {
    let bad = |what: String| Err(Error::new(ErrorKind::InvalidInput, "load", path, what));
    if o.chunk_size == 0 || o.chunk_size > 1 << 30 {
        return bad(format!("chunk size {} must be between 1 byte and 1 GiB", o.chunk_size));
    }
    if o.gather_size == 0 {
        return bad("gather size must be positive".into());
    }
    if o.queue_depth == 0 || o.queue_depth > MAX_QUEUE_DEPTH {
        return bad(format!("queue depth {} must be between 1 and {MAX_QUEUE_DEPTH}", o.queue_depth));
    }
    if o.threads == 0 || o.threads > 1024 {
        return bad(format!("thread count {} must be between 1 and 1024", o.threads));
    }
    if o.populate_threads == 0 || o.populate_threads > 1024 {
        return bad(format!("populate thread count {} must be between 1 and 1024", o.populate_threads));
    }
    if let Some(slots) = o.staging_slots.filter(|&n| n < 2) {
        return bad(format!("staging slots {slots} must be at least 2 (one filling while one is delivered)"));
    }
    if let Some(size) = o.staging_slot_size.filter(|&n| n == 0 || n > 1 << 30) {
        return bad(format!("staging slot size {size} must be between 1 byte and 1 GiB"));
    }
    Ok(())
}

/// A value given to an option by name ([`LoadOptions::set`],
/// [`crate::SaveOptions::set`]): how front ends that take options as names
/// and values (Python's keywords, a serving engine's config) hand them
/// over, so each name is parsed in one place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionValue {
    /// An enumerated option's choice (`engine`, `mode`, `to`).
    Name(String),
    /// A count or a size in bytes.
    Number(u64),
    /// A switch.
    Flag(bool),
}

impl OptionValue {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            OptionValue::Name(_) => "a name",
            OptionValue::Number(_) => "a number",
            OptionValue::Flag(_) => "a bool",
        }
    }
}

/// Why an option given by name was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionError {
    /// No option has this name.
    Unknown,
    /// The option takes another kind of value (the message says which).
    Type(String),
    /// The value is of the right kind but not one the option takes.
    Value(String),
}

impl LoadOptions {
    /// The options [`LoadOptions::set`] takes, by name: every field but
    /// `needs_fd` (each entry point decides it), the progress callback and
    /// the cancellation token.
    pub const NAMES: [&'static str; 12] = [
        "engine",
        "mode",
        "to",
        "gather_size",
        "chunk_size",
        "queue_depth",
        "threads",
        "populate_threads",
        "staging_slots",
        "staging_slot_size",
        "measure_page_cache",
        "verify",
    ];

    /// Sets the option `name` ([`LoadOptions::NAMES`]) to `value`: a choice
    /// parsed as the command line parses it, a count or size in bytes, or a
    /// switch. Ranges are checked when the load starts
    /// ([`check_load_options`]).
    pub fn set(&mut self, name: &str, value: OptionValue) -> std::result::Result<(), OptionError> {
        use OptionValue::{Flag, Name, Number};
        let parsed = |e: String| OptionError::Value(e);
        match (name, value) {
            ("engine", Name(v)) => self.engine = v.parse().map_err(parsed)?,
            ("mode", Name(v)) => self.mode = v.parse().map_err(parsed)?,
            ("to", Name(v)) => self.to = v.parse().map_err(parsed)?,
            ("gather_size", Number(n)) => self.gather_size = count(n)?,
            ("chunk_size", Number(n)) => self.chunk_size = count(n)?,
            ("queue_depth", Number(n)) => self.queue_depth = count(n)?,
            ("threads", Number(n)) => self.threads = count(n)?,
            ("populate_threads", Number(n)) => self.populate_threads = count(n)?,
            ("staging_slots", Number(n)) => self.staging_slots = Some(count(n)?),
            ("staging_slot_size", Number(n)) => self.staging_slot_size = Some(count(n)?),
            ("measure_page_cache", Flag(b)) => self.measure_page_cache = b,
            ("verify", Flag(b)) => self.verify = b,
            // Every option takes a number but the choices and switches,
            // which have a value to name their kind by (an unset staging
            // option has none).
            (name, value) if Self::NAMES.contains(&name) => {
                let wanted = self.get(name).map_or("a number", |v| v.kind());
                return Err(wrong_kind(wanted, &value));
            }
            _ => return Err(OptionError::Unknown),
        }
        Ok(())
    }

    /// The value of the option `name` ([`LoadOptions::NAMES`]), as
    /// [`LoadOptions::set`] takes it; `None` for a name it does not take,
    /// and for a staging option left unset (sized per load).
    pub fn get(&self, name: &str) -> Option<OptionValue> {
        use OptionValue::{Flag, Name, Number};
        Some(match name {
            "engine" => Name(self.engine.name().to_owned()),
            "mode" => Name(self.mode.name().to_owned()),
            "to" => Name(self.to.name()),
            "gather_size" => Number(self.gather_size as u64),
            "chunk_size" => Number(self.chunk_size as u64),
            "queue_depth" => Number(self.queue_depth as u64),
            "threads" => Number(self.threads as u64),
            "populate_threads" => Number(self.populate_threads as u64),
            "staging_slots" => Number(self.staging_slots? as u64),
            "staging_slot_size" => Number(self.staging_slot_size? as u64),
            "measure_page_cache" => Flag(self.measure_page_cache),
            "verify" => Flag(self.verify),
            _ => return None,
        })
    }
}

/// A count or size as the field's `usize`.
pub(crate) fn count(n: u64) -> std::result::Result<usize, OptionError> {
    usize::try_from(n).map_err(|_| OptionError::Value(format!("{n} is too large")))
}

/// The error for a value of another kind than the `wanted` one ("a number").
pub(crate) fn wrong_kind(wanted: &str, given: &OptionValue) -> OptionError {
    OptionError::Type(format!("takes {wanted}, not {}", given.kind()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("128MiB").unwrap(), 128 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("2gb").unwrap(), 2 << 30);
        assert!(parse_size("12x").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_size("0.5M").unwrap(), 512 << 10);
    }

    #[test]
    fn a_size_of_part_of_a_byte_is_an_error_not_rounded() {
        // Issue 34: "0.0000001k" loaded 0 bytes.
        for text in ["0.0000001k", "0.1K", "1.5"] {
            let err = parse_size(text).unwrap_err();
            assert!(err.contains("not a whole number of bytes"), "{text}: {err}");
        }
    }

    #[test]
    fn every_option_enum_parses_the_names_it_prints() {
        for engine in Engine::ALL {
            assert_eq!(engine.name().parse::<Engine>(), Ok(engine));
            assert_eq!(engine.to_string(), engine.name());
        }
        for mode in IoMode::ALL {
            assert_eq!(mode.name().parse::<IoMode>(), Ok(mode));
            assert_eq!(mode.to_string(), mode.name());
        }
        for kind in MemoryKind::ALL {
            assert_eq!(kind.name().parse::<MemoryKind>(), Ok(kind));
            let to = Destination::from(kind);
            assert_eq!((to.name(), to.host_memory()), (kind.name().to_owned(), Some(kind)));
            assert_eq!(to.name().parse::<Destination>(), Ok(to));
        }
        for n in [0, 1, 17] {
            let to = Destination::Cuda(n);
            assert_eq!(to.name(), format!("cuda:{n}"));
            assert_eq!(to.name().parse::<Destination>(), Ok(to.clone()));
            assert_eq!(to.host_memory(), None);
        }
        assert_eq!("cuda".parse::<Destination>(), Ok(Destination::Cuda(0)));
        for to in [Destination::Udmabuf, Destination::Dmabuf, Destination::DmaHeap("linux,cma".into())] {
            assert_eq!(to.name().parse::<Destination>(), Ok(to.clone()));
            assert!(to.is_dmabuf() && to.host_memory().is_none(), "{to}");
        }
        assert_eq!("dma-heap".parse::<Destination>(), Ok(Destination::DmaHeap("system".into())));
        assert_eq!(Engine::default().to_string(), "uring-fixed");
        assert_eq!(LoadOptions::default().to, Destination::Auto);
        assert_eq!("auto".parse::<Destination>(), Ok(Destination::Auto));
        assert_eq!((Destination::Auto.host_memory(), Destination::Auto.is_host()), (None, true));
        assert!(!Destination::Cuda(0).is_host());
    }

    #[test]
    fn destination_forms_are_auto_the_memory_kinds_the_dmabufs_then_cuda() {
        assert_eq!(
            Destination::forms(),
            [
                "auto",
                "memfd",
                "memfd-huge",
                "hugetlb",
                "anonymous-thp",
                "anonymous",
                "udmabuf",
                "dmabuf",
                "dma-heap:NAME",
                "cuda:N"
            ]
        );
        for form in Destination::forms() {
            let example = form.replace("NAME", "system").replace('N', "3");
            assert!(example.parse::<Destination>().is_ok(), "{form}");
        }
    }

    #[test]
    fn bad_names_are_refused_with_the_choices() {
        for bad in [
            "",
            "thp",
            "vram",
            "cuda:",
            "cuda:x",
            "cuda:+1",
            "cuda:-1",
            "cuda0",
            "CUDA:0",
            "memfd ",
            "dma-heap:",
            "dma-heap:..",
            "dma-heap:a/b",
            "dma-heap:../system",
            "dma-heap:a b",
            "dma-heap:a\0",
            "dmaheap:system",
        ] {
            let err = bad.parse::<Destination>().unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
        let err = "vram".parse::<Destination>().unwrap_err();
        assert!(
            err.contains(
                "auto, memfd, memfd-huge, hugetlb, anonymous-thp, anonymous, udmabuf, dmabuf, dma-heap:NAME, \
                 cuda:N"
            ),
            "{err}"
        );
        assert!("warp".parse::<Engine>().unwrap_err().contains("uring-fixed, uring, pread-pool, read"));
        assert!("fast".parse::<IoMode>().unwrap_err().contains("auto, direct, buffered, dontcache"));
        assert!("huge"
            .parse::<MemoryKind>()
            .unwrap_err()
            .contains("memfd, memfd-huge, hugetlb, anonymous-thp, anonymous"));
    }

    #[test]
    fn destinations_serialize_as_their_names() {
        let json = serde_json::to_string(&[
            Destination::Auto,
            Destination::Memfd,
            Destination::Hugetlb,
            Destination::AnonymousThp,
            Destination::Anonymous,
            Destination::DmaHeap("system".into()),
            Destination::Cuda(2),
        ]);
        assert_eq!(
            json.unwrap(),
            r#"["auto","memfd","hugetlb","anonymous-thp","anonymous","dma-heap:system","cuda:2"]"#
        );
    }

    #[test]
    fn every_named_option_round_trips_and_a_wrong_one_says_why() {
        let defaults = LoadOptions::default();
        let mut set = LoadOptions::default();
        for name in LoadOptions::NAMES {
            // Unset by default, the staging ring's are set to a number.
            let value = defaults.get(name).unwrap_or(OptionValue::Number(4));
            set.set(name, value.clone()).expect(name);
            assert_eq!(set.get(name), Some(value));
        }
        assert_eq!((defaults.get("staging_slots"), set.staging_slot_size), (None, Some(4)));
        set.set("engine", OptionValue::Name("read".into())).unwrap();
        set.set("queue_depth", OptionValue::Number(7)).unwrap();
        set.set("to", OptionValue::Name("anonymous-thp".into())).unwrap();
        assert_eq!((set.engine, set.queue_depth, set.to.name().as_str()), (Engine::Read, 7, "anonymous-thp"));
        assert_eq!(set.set("gather", OptionValue::Number(1)), Err(OptionError::Unknown));
        assert_eq!(set.set("needs_fd", OptionValue::Flag(false)), Err(OptionError::Unknown));
        assert!(
            matches!(set.set("threads", OptionValue::Flag(true)), Err(OptionError::Type(e)) if e.contains("a number, not a bool"))
        );
        assert!(matches!(set.set("verify", OptionValue::Number(1)), Err(OptionError::Type(_))));
        let unset = LoadOptions::default().set("staging_slots", OptionValue::Flag(true));
        assert_eq!(unset, Err(OptionError::Type("takes a number, not a bool".into())));
        assert!(matches!(set.set("engine", OptionValue::Name("fast".into())), Err(OptionError::Value(_))));
        let mut save = crate::SaveOptions::default();
        for name in crate::SaveOptions::NAMES {
            save.set(name, crate::SaveOptions::default().get(name).expect(name)).expect(name);
        }
        assert_eq!(save.set("gather_size", OptionValue::Number(1)), Err(OptionError::Unknown));
        save.set("sync", OptionValue::Flag(false)).unwrap();
        assert!(!save.sync);
    }
}
