//! What a load did and how long each part took.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::memory::MemoryKind;
use crate::pagecache::Residency;
use crate::types::{CachePolicy, Engine, Fallback};

/// What a load did and how long each part took.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    #[serde(serialize_with = "crate::error::serialize_path")]
    pub path: PathBuf,
    /// File offset of the first byte loaded.
    pub offset: u64,
    pub bytes: u64,
    /// The engine that did the reading (after fallbacks).
    pub engine: Engine,
    /// How reads treated the page cache (after fallbacks): `bypass` is
    /// direct I/O. For an `auto` load that measured direct against
    /// buffered reads, the mode it kept (`read_choice`).
    pub cache: CachePolicy,
    /// The memory kind of a host buffer (of a staged load, the kind its
    /// options name, though it allocates no buffer).
    pub memory: MemoryKind,
    /// Why the load has this memory: "asked for" an explicit kind, or why
    /// `auto` chose it (the THP policies, the hugetlb pool, recorded probe
    /// figures).
    pub memory_reason: String,
    /// Whether the kernel's policy gives the memory 2 MiB pages (see
    /// [`crate::memory::MemoryFacts::huge_pages`]).
    pub huge_pages: bool,
    /// Where the bytes went: the [`crate::Destination`] of a host buffer
    /// (the memory kind's name: `memfd`, `memfd-huge`, `hugetlb`,
    /// `anonymous-thp`), or the staging ring a sink was fed from.
    pub destination: String,
    /// The filesystem the file is on ("ext4", "tmpfs", ...), or
    /// "block-device".
    pub filesystem: &'static str,
    /// Offset alignment of the reads (1 for buffered I/O).
    pub alignment: usize,
    pub chunk_size: usize,
    pub gather_size: usize,
    /// io_uring requests kept in flight: for direct reads at the default
    /// depth, the depth the load's tuning kept, which starts from the one
    /// remembered for the device (docs/cli.md).
    pub queue_depth: usize,
    /// Bytes one read request asks for at most: `chunk_size`, or the size
    /// the load's tuning kept (direct reads at the default depth, which
    /// also try smaller requests than the chunk; docs/cli.md).
    pub request_size: usize,
    /// Windows of 128 MiB the load's tuning measured before it settled (or
    /// the load ended): 0 where the reads were not tuned, 1 the warm-up
    /// alone, 5 or more once a trial ran (docs/cli.md).
    pub tuning_windows: usize,
    /// How an `auto` load chose between direct and buffered reads (`cache`
    /// says which it kept): "measured: direct R GiB/s, buffered R GiB/s"
    /// (the slower window of each), the same after "re-measured, a window
    /// read R GiB/s against R remembered: " where the remembered mode
    /// read clearly slower, "remembered" where the device's remembered
    /// mode read as fast as before, or empty where nothing was chosen (a
    /// mode asked for, reads not tuned, a load too short; docs/cli.md).
    pub read_choice: String,
    pub fallbacks: Vec<Fallback>,
    /// Populating (allocating and zeroing) all of the buffer's pages, on the
    /// helper thread. For a load to a `cuda:N` device, allocating and
    /// pinning its staging ring, before the load (outside
    /// `total_seconds`).
    pub alloc_seconds: f64,
    /// Registering (pinning) the buffer's gathers with io_uring, on the
    /// helper thread, beside the I/O.
    pub register_seconds: f64,
    /// Populating the first gather: the part of allocation never hidden.
    pub first_gather_seconds: f64,
    /// Handing filled staging slots to the sink and waiting for it to
    /// release them, on the helper thread, beside the I/O (staged loads).
    pub deliver_seconds: f64,
    /// Of `bytes`, those a staged load read through its staging ring, and
    /// those its sink's cache lane carried from the page cache (a `cuda:N`
    /// load in `auto` mode: the windows found cached); a load that fills
    /// its buffer in place, with no ring, counts them in neither (both 0).
    pub ring_bytes: u64,
    pub cache_lane_bytes: u64,
    /// Threads of the cache lane (0 when it carried nothing).
    pub cache_lane_threads: usize,
    /// Reading, from the first request to the last completion, less the time
    /// the reads stalled waiting for memory.
    pub io_seconds: f64,
    /// Time the reads stalled waiting for a gather to be populated.
    pub waited_for_memory_seconds: f64,
    pub total_seconds: f64,
    pub gib_per_second: f64,
    /// CPU time of the whole process during the load (all threads, kernel
    /// page zeroing included).
    pub cpu_user_seconds: f64,
    pub cpu_system_seconds: f64,
    /// How much of the loaded range is in the page cache afterwards, when
    /// [`crate::LoadOptions::measure_page_cache`] asked for it; `None`
    /// (JSON `null`) when it was not measured, or cannot be: the kernel
    /// calls every page of a file this process neither owns nor may write
    /// cached.
    pub page_cache: Option<Residency>,
}

impl LoadReport {
    /// The report of `bytes` from `offset` of `path` delivered in
    /// `total_seconds`, with the rate that makes, and every other field at
    /// what a load that did nothing else would say: the default engine,
    /// direct reads, a memfd of 4 KiB pages named nowhere, no fallbacks,
    /// no time in any part, sizes and counts 0, nothing measured. Each load
    /// writes what it did over this (`LoadReport { .., ..LoadReport::new(..) }`),
    /// so a new field gets its value for every load here.
    pub fn new(path: &Path, offset: u64, bytes: u64, total_seconds: f64) -> LoadReport {
        LoadReport {
            path: path.to_owned(),
            offset,
            bytes,
            engine: Engine::default(),
            cache: CachePolicy::Bypass,
            memory: MemoryKind::default(),
            memory_reason: String::new(),
            huge_pages: false,
            destination: String::new(),
            filesystem: "unknown",
            alignment: 1,
            chunk_size: 0,
            gather_size: 0,
            queue_depth: 0,
            request_size: 0,
            tuning_windows: 0,
            read_choice: String::new(),
            fallbacks: Vec::new(),
            alloc_seconds: 0.0,
            register_seconds: 0.0,
            first_gather_seconds: 0.0,
            deliver_seconds: 0.0,
            ring_bytes: 0,
            cache_lane_bytes: 0,
            cache_lane_threads: 0,
            io_seconds: 0.0,
            waited_for_memory_seconds: 0.0,
            total_seconds,
            gib_per_second: bytes as f64 / (1u64 << 30) as f64 / total_seconds.max(1e-9),
            cpu_user_seconds: 0.0,
            cpu_system_seconds: 0.0,
            page_cache: None,
        }
    }
}
