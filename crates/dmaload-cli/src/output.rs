//! How reports look: text for people, JSON for machines.

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::path::Path;
use std::time::Instant;

use dmaload::info::{system_info, DirectIoInfo};
use dmaload::LoadReport;
use serde::Serialize;

use crate::units::human_bytes;

/// An xxh3-64 of loaded bytes and the time it took.
#[derive(Debug, Serialize)]
pub struct Hash {
    pub xxh3_64: String,
    pub seconds: f64,
}

/// Writes a command's output to stdout (the `out!` and `outln!` macros).
/// A reader that left (`dmaload load F --json | head -c1`: EPIPE, since
/// Rust ignores SIGPIPE, where `println!` would panic) ends the process
/// at once with status 141, quietly, as a tool that SIGPIPE kills does;
/// every command prints only once its work is done, so nothing is left
/// half made. Any other failure to write is an error, and status 1.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    let mut stdout = io::stdout().lock();
    if let Err(err) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        if err.kind() == io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        eprintln!("dmaload: error: write the output to stdout: {err}");
        std::process::exit(1);
    }
}

pub fn hash_timed(bytes: &[u8]) -> Hash {
    let started = Instant::now();
    let digest = xxhash_rust::xxh3::xxh3_64(bytes);
    Hash { xxh3_64: format!("{digest:016x}"), seconds: started.elapsed().as_secs_f64() }
}

/// [`hash_timed`] of whatever a load made, read back as
/// [`dmaload::Loaded::read_each`] gives it (a dma-buf through a fresh
/// mapping, a device's bytes copied back), off the timed load.
pub fn hash_loaded(loaded: &dmaload::Loaded, path: &std::path::Path) -> Result<Hash, dmaload::Error> {
    let started = Instant::now();
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    loaded.read_each(|bytes| hasher.update(bytes)).map_err(|e| dmaload::Error::io("read back", path, e))?;
    Ok(Hash { xxh3_64: format!("{:016x}", hasher.digest()), seconds: started.elapsed().as_secs_f64() })
}

pub fn load_json(report: &LoadReport, hash: Option<&Hash>) -> String {
    #[derive(Serialize)]
    struct Out<'a> {
        #[serde(flatten)]
        report: &'a LoadReport,
        #[serde(skip_serializing_if = "Option::is_none")]
        hash: Option<&'a Hash>,
    }
    // Paths serialize lossily (see dmaload::error::serialize_path): nothing
    // else in a report can fail to serialize.
    serde_json::to_string(&Out { report, hash }).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// The page size a load's memory got, from `LoadReport::huge_pages`.
pub fn page_size_label(huge_pages: bool) -> &'static str {
    if huge_pages {
        "2 MiB"
    } else {
        "4 KiB"
    }
}

/// What free page reporting means for loads and benchmarks.
pub fn free_page_reporting_note(block: u64) -> String {
    format!(
        "on: a virtio balloon hands free blocks of {} and up back to the host about 2 s after they are freed; \
         reusing them costs a host fault and zeroing, so huge pages and loads after idle are slower and benchmarks noisier",
        human_bytes(block)
    )
}

pub fn cache_description(report: &LoadReport) -> &'static str {
    // A GPU load's cache lane copies from the page cache, whatever the
    // ring's reads were set up as.
    if report.cache_lane_bytes > 0 {
        return if report.ring_bytes == 0 {
            "from the page cache (cache lane)"
        } else {
            "direct (O_DIRECT) + from the page cache (cache lane)"
        };
    }
    match report.cache {
        dmaload::CachePolicy::Bypass => "direct (O_DIRECT)",
        dmaload::CachePolicy::Keep => "buffered (page cache kept)",
        dmaload::CachePolicy::DontCache => "buffered (RWF_DONTCACHE)",
        dmaload::CachePolicy::Fadvise => "buffered (POSIX_FADV_DONTNEED per chunk)",
    }
}

pub fn load_text(r: &LoadReport, hash: Option<&Hash>) -> String {
    let mut s = String::new();
    let cpu = r.cpu_user_seconds + r.cpu_system_seconds;
    let gib = r.bytes as f64 / (1u64 << 30) as f64;
    let _ = writeln!(
        s,
        "loaded    {} ({} bytes) from {} at offset {}",
        human_bytes(r.bytes),
        r.bytes,
        r.path.display(),
        r.offset
    );
    // A handoff from the cache service read nothing: say where it came from.
    if r.destination.starts_with("cache-service") {
        let _ = writeln!(
            s,
            "source    {} | {} memory, private copy-on-write mapping",
            r.destination,
            r.memory.name()
        );
        let _ = writeln!(
            s,
            "time      total {:.3} s | CPU {:.3} s",
            r.total_seconds,
            r.cpu_user_seconds + r.cpu_system_seconds
        );
        if let Some(hash) = hash {
            let _ = writeln!(s, "xxh3-64   {} ({:.3} s)", hash.xxh3_64, hash.seconds);
        }
        return s;
    }
    // A host buffer names its memory and pages; a sink, where the bytes went.
    let destination = if r.deliver_seconds > 0.0 || r.destination.contains("staging ring") {
        r.destination.clone()
    } else {
        format!("{} memory, {} pages", r.memory.name(), page_size_label(r.huge_pages))
    };
    let _ = writeln!(
        s,
        "engine    {} | {} | {} | {} | align {} | chunk {} | gather {} | qd {}{}",
        r.engine.name(),
        cache_description(r),
        destination,
        r.filesystem,
        r.alignment,
        human_bytes(r.chunk_size as u64),
        human_bytes(r.gather_size as u64),
        r.queue_depth,
        // A tuned request size smaller than the chunk.
        if r.request_size != r.chunk_size && r.request_size > 0 {
            format!(" | requests of {}", human_bytes(r.request_size as u64))
        } else {
            String::new()
        }
    );
    // A sink's report has no memory of its own to explain; a host buffer
    // filled through the kept ring ("KIND (through a staging ring ...)") has.
    let host_through_ring = r.destination.starts_with(r.memory.name());
    if (r.deliver_seconds == 0.0 && !r.destination.contains("staging ring")) || host_through_ring {
        let _ = writeln!(s, "memory    {}: {}", r.memory.name(), r.memory_reason);
    }
    if !r.read_choice.is_empty() {
        let _ = writeln!(s, "reads     {} ({})", cache_description(r), r.read_choice);
    }
    if r.cache_lane_bytes > 0 {
        let _ = writeln!(
            s,
            "lanes     ring {} | cache lane {} on {} threads (from the page cache)",
            human_bytes(r.ring_bytes),
            human_bytes(r.cache_lane_bytes),
            r.cache_lane_threads
        );
    }
    for fallback in &r.fallbacks {
        let _ = writeln!(s, "fallback  {fallback}");
    }
    let _ = writeln!(
        s,
        "time      total {:.3} s = first gather {:.3} s + overlap | alloc {:.3} s | register {:.3} s | I/O {:.3} s | I/O waited for memory {:.3} s | delivery {:.3} s",
        r.total_seconds,
        r.first_gather_seconds,
        r.alloc_seconds,
        r.register_seconds,
        r.io_seconds,
        r.waited_for_memory_seconds,
        r.deliver_seconds
    );
    let _ = writeln!(
        s,
        "speed     {:.2} GiB/s | CPU {:.3} s (user {:.3}, system {:.3}) = {:.3} s/GiB",
        r.gib_per_second,
        cpu,
        r.cpu_user_seconds,
        r.cpu_system_seconds,
        if gib > 0.0 { cpu / gib } else { 0.0 }
    );
    // Only a load that asked for it measured the page cache.
    if let Some(residency) = &r.page_cache {
        let _ = writeln!(
            s,
            "cache     {} of the range in the page cache afterwards ({:.1}%)",
            human_bytes(residency.resident_bytes),
            residency.fraction * 100.0
        );
    }
    if let Some(hash) = hash {
        let _ = writeln!(s, "xxh3-64   {} ({:.3} s)", hash.xxh3_64, hash.seconds);
    }
    s
}

pub fn info(path: Option<&Path>, json: bool, probe_memory: bool) -> Result<(), String> {
    if probe_memory {
        run_memory_probe(json)?;
    }
    let info = system_info(path).map_err(|e| match path {
        Some(p) => format!("info {}: {e}", p.display()),
        None => format!("info: {e}"),
    })?;
    if json {
        outln!("{}", serde_json::to_string(&info).expect("info serializes"));
        return Ok(());
    }
    outln!("kernel            {}", info.kernel);
    match &info.io_uring {
        Ok(probe) => {
            let ops: Vec<String> = probe
                .opcodes
                .iter()
                .map(|(name, ok)| format!("{name} {}", if *ok { "yes" } else { "no" }))
                .collect();
            outln!("io_uring          available: {}", ops.join(", "));
            match &probe.sparse_buffers {
                Ok(()) => outln!("registered bufs   sparse table + update supported (Linux 5.19+)"),
                Err(e) => outln!("registered bufs   no sparse table: {e} (loads register nothing)"),
            }
        }
        Err(e) => outln!("io_uring          unavailable: {e} (loads use the pread pool)"),
    }
    let memlock = match info.memlock_limit {
        Some(bytes) => human_bytes(bytes),
        None => "unlimited".into(),
    };
    let exempt = if info.memlock_exempt {
        "exempt (CAP_IPC_LOCK or unlimited): any gather can be registered"
    } else {
        "counts pinned buffers: gathers larger than this fall back to unregistered I/O"
    };
    outln!("RLIMIT_MEMLOCK    {memlock}, {exempt}");
    let thp = |v: &Option<String>| v.clone().unwrap_or_else(|| "unknown".into());
    outln!("THP anonymous     {}", thp(&info.thp_anonymous));
    outln!(
        "THP shmem         {} (memfds get 2 MiB pages, memfd-huge, only with always/within_size/advise/force)",
        thp(&info.thp_shmem)
    );
    let page = |bytes: u64| human_bytes(bytes);
    outln!(
        "hugetlb pool      {} free pages of {} (/proc/sys/vm/nr_hugepages)",
        info.hugetlb_free_pages,
        page(info.hugetlb_page_size)
    );
    outln!("auto memory       {}: {}", info.auto_shareable.kind, info.auto_shareable.reason);
    outln!("auto, no fd       {}: {}", info.auto_private.kind, info.auto_private.reason);
    if let Some(hint) = info.huge_pages_hint {
        outln!("huge pages hint   as root, `{hint}` gives memfd buffers 2 MiB pages");
    }
    match (&info.memory_probe, &info.memory_probe_path) {
        (Some(probe), Some(path)) => {
            let figures: Vec<String> = probe
                .kinds
                .iter()
                .map(|k| match (k.populate_seconds_per_gib, &k.error) {
                    (Some(s), _) => format!(
                        "{} {s:.3} s/GiB ({:.0}% huge)",
                        k.kind,
                        k.huge_page_share.unwrap_or(0.0) * 100.0
                    ),
                    (None, Some(why)) => format!("{} unavailable ({why})", k.kind),
                    (None, None) => format!("{} unmeasured", k.kind),
                })
                .collect();
            outln!("memory probe      {path}: {}", figures.join("; "));
        }
        (None, Some(path)) => {
            outln!("memory probe      none recorded ({path}): `dmaload info --probe-memory` records one")
        }
        (_, None) => outln!("memory probe      no cache directory ($XDG_CACHE_HOME and $HOME unset)"),
    }
    if let Some(bytes) = info.memory_available {
        outln!("MemAvailable      {}", human_bytes(bytes));
    }
    match info.free_page_reporting {
        Some(block) => outln!("page reporting    {}", free_page_reporting_note(block)),
        None => outln!("page reporting    off (no virtio balloon reporting free memory to a host)"),
    }
    if info.dma_heaps.is_empty() {
        outln!("dma-heap          none (/dev/dma_heap missing: kernel without CONFIG_DMABUF_HEAPS)");
    } else {
        outln!("dma-heap          {}", info.dma_heaps.join(", "));
    }
    match (info.udmabuf, info.udmabuf_size_limit_mb) {
        (true, Some(mb)) => outln!("udmabuf           /dev/udmabuf, size_limit_mb {mb}"),
        (true, None) => outln!("udmabuf           /dev/udmabuf"),
        (false, _) => {
            outln!("udmabuf           none (/dev/udmabuf missing: kernel without CONFIG_UDMABUF)")
        }
    }
    match &info.cuda {
        Ok(devices) => outln!("CUDA              {devices} (--to cuda:N)"),
        Err(why) => outln!("CUDA              unavailable: {why}"),
    }
    if let Some(p) = &info.path {
        outln!("path              {}", p.path);
        outln!("filesystem        {} ({})", p.filesystem, p.filesystem_magic);
        match &p.direct_io {
            DirectIoInfo::Supported { memory_align, offset_align } => {
                outln!("O_DIRECT          supported: memory align {memory_align}, offset align {offset_align} (statx)")
            }
            DirectIoInfo::Unsupported => outln!("O_DIRECT          not supported on this file (statx)"),
            DirectIoInfo::Unknown { reason } => outln!("O_DIRECT          unknown: {reason}"),
        }
        match p.rwf_dontcache {
            Some(true) => outln!("RWF_DONTCACHE     supported"),
            Some(false) => {
                outln!("RWF_DONTCACHE     not supported (buffered fallback uses POSIX_FADV_DONTNEED)")
            }
            None => {}
        }
        if let Some(q) = &p.device_queue {
            let read = 4 << 20;
            outln!(
                "device queue      {}: {} entries and {} a request: a 4 MiB direct read is {} request(s) into 4 KiB pages, {} into 2 MiB pages",
                q.device,
                q.max_segments,
                human_bytes(q.max_request_bytes),
                q.requests(read, 4096),
                q.requests(read, 2 << 20)
            );
        }
    }
    Ok(())
}

/// Bytes of each memory kind `info --probe-memory` populates per round.
const PROBE_BYTES: u64 = 256 << 20;
/// Rounds per kind (interleaved); the medians are recorded.
const PROBE_ROUNDS: usize = 3;

/// `info --probe-memory`: measures each memory kind and records the figures
/// where `auto` finds them.
fn run_memory_probe(json: bool) -> Result<(), String> {
    let path = dmaload::memory::probe_path()
        .ok_or("info --probe-memory: no cache directory ($XDG_CACHE_HOME and $HOME unset)")?;
    if !json {
        eprintln!(
            "probing: populating {} of each memory kind, {PROBE_ROUNDS} rounds",
            human_bytes(PROBE_BYTES)
        );
    }
    let probe = dmaload::memory::MemoryProbe::run(PROBE_BYTES, PROBE_ROUNDS);
    probe.save(&path).map_err(|e| format!("info --probe-memory: write {}: {e}", path.display()))?;
    if !json {
        eprintln!("recorded in {}", path.display());
    }
    Ok(())
}
