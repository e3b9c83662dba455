//! `dmaload-bench load` (and `fio`): every engine against a buffered-read baseline and
//! fio's best O_DIRECT io_uring setting, in one run, interleaved, with the
//! page cache evicted before every run; and the default engine once more
//! through a staging ring into a fresh host buffer, against its own
//! in-place load.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Subcommand;
use dmaload::memory::MemoryFacts;
use dmaload::share::process_cpu_seconds;
use dmaload::{Engine, HostSink, IoMode, LoadOptions, MemoryKind, StagingRing};
use dmaload_bench::fio;
use dmaload_bench::transfer::{MemoryType, TransferBuffer};
use serde::Serialize;

use crate::benchkit::Spread;
use crate::units::{human_bytes, parse_size};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Cold-load FILE with each engine, a buffered read and fio.
    Load {
        file: PathBuf,
        /// Runs of each method (interleaved).
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// Print one JSON object instead of a Markdown table.
        #[arg(long)]
        json: bool,
        /// Skip fio even when it is installed.
        #[arg(long)]
        no_fio: bool,
        /// Only the staged row and the in-place default it is held
        /// against (no baseline, other engines or fio).
        #[arg(long)]
        staged_only: bool,
        /// Only the in-place default and the same load verified against
        /// the B3SUMS or SHA256SUMS beside FILE (`dmaload sums` writes
        /// them), hashing as the bytes arrive.
        #[arg(long, conflicts_with = "staged_only")]
        verified_only: bool,
    },
    /// Seed 001's table: memory type × method × buffered/direct, both directions.
    Matrix(crate::matrix::MatrixArgs),
    /// Seed 000's table: 512K/8M/1G/3G × normal, sendfile, sync and pipelined alloc-and-read.
    Sizes(crate::sizes::SizesArgs),
    /// Seed 003's table: QD1/16 × 4k/16k/64k random reads, plain vs registered buffers.
    Qd(crate::qd::QdArgs),
    /// Save with each engine beside fio's sequential O_DIRECT write.
    Save(crate::save::SaveBenchArgs),
    /// Seed 002's test: random page binds of 1–64 GiB tables, binary search vs linear walk.
    Bind(crate::bind::BindArgs),
    /// A fresh process served by the cache service against loading the file itself.
    Cache(crate::cache::CacheArgs),
    /// Seed 004's table: block passing (pipe read/write vs BlockQueue) per block size, capture vs fio.
    ///
    /// Each process's CPU is counted from the end of its set-up (the queue
    /// attached or created, the pipe's buffer allocated) to its last block:
    /// the rows compare the per-block work, not the attach.
    Stream(crate::stream::StreamArgs),
    /// fio's sequential O_DIRECT io_uring read of FILE (the ceiling `bench
    /// load` compares with), cache evicted before each run: for scripts
    /// (bench/peers.py) that need the same ceiling.
    Fio {
        file: PathBuf,
        /// Bytes per request.
        #[arg(long, value_parser = parse_size, default_value = "4M")]
        block_size: u64,
        /// Requests in flight; repeat the option for several runs.
        #[arg(long = "iodepth", default_values_t = [16u32])]
        iodepths: Vec<u32>,
        /// Print one JSON object per run, one per line.
        #[arg(long)]
        json: bool,
    },
}

/// A method under test.
enum Method {
    Dmaload {
        name: String,
        options: LoadOptions,
    },
    /// `LoadRequest::to_sink` through the bench's staging ring into a fresh memfd
    /// buffer of the file's size (a [`HostSink`]), allocated and populated
    /// in the timing.
    Staged {
        name: String,
        options: LoadOptions,
    },
    Fio {
        block_size: &'static str,
        iodepth: u32,
        /// fio's buffers in hugetlb pages (`--iomem=shmhuge`) instead of
        /// 4 KiB ones: with 254 segments per request at most (virtio-blk
        /// here), a 4 MiB read into 4 KiB pages goes out as several
        /// requests, into 2 MiB pages as one; the ceiling for huge-page rows.
        huge: bool,
    },
}

impl Method {
    fn name(&self) -> String {
        match self {
            Method::Dmaload { name, .. } | Method::Staged { name, .. } => name.clone(),
            Method::Fio { block_size, iodepth, huge } => {
                let buffers = if *huge { ", hugetlb buffers" } else { "" };
                format!("fio io_uring direct bs={block_size} qd={iodepth}{buffers}")
            }
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
struct Sample {
    gib_per_second: f64,
    cpu_seconds_per_gib: f64,
    page_cache_residue: f64,
    /// Dropping the buffer, from the drop to its return (host loads).
    drop_seconds: Option<f64>,
    /// From the drop until the background thread had unmapped the memory:
    /// what a drop cost the caller before unmapping moved off its thread.
    freed_seconds: Option<f64>,
    /// Share of the buffer the kernel backed with huge pages
    /// (/proc/self/smaps, first round).
    huge_page_share: Option<f64>,
    /// Time the delivery thread spent in the sink (staged loads).
    deliver_seconds: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Row {
    method: String,
    baseline: bool,
    fio: bool,
    samples: Vec<Sample>,
    median_gib_per_second: f64,
    min_gib_per_second: f64,
    max_gib_per_second: f64,
    median_cpu_seconds_per_gib: f64,
    median_drop_seconds: Option<f64>,
    median_freed_seconds: Option<f64>,
    huge_page_share: Option<f64>,
    max_page_cache_residue: f64,
    ratio_to_fio_best: Option<f64>,
    /// `None` without a baseline row (`--staged-only`).
    ratio_to_buffered: Option<f64>,
    /// Median over the median of the default engine's in-place row.
    ratio_to_in_place_default: f64,
}

#[derive(Debug, Serialize)]
struct Table {
    file: String,
    bytes: u64,
    repeat: usize,
    fio: String,
    /// Which page size each memory kind gets here, and the kinds left out.
    memory: String,
    /// What `auto` chose for the engine rows (a memfd: they keep the fd)
    /// and for a CLI load (no fd), and why.
    auto: String,
    /// See `dmaload::system::free_page_reporting`.
    free_page_reporting: Option<u64>,
    /// Seconds each run waited first for freed memory to go back to the
    /// host (`MemoryFacts::reporting_settle`).
    settle_seconds: Option<u64>,
    /// The staged row's ring and destination.
    staging: String,
    rows: Vec<Row>,
}

pub fn run(cmd: &BenchCommand) -> Result<(), String> {
    match cmd {
        BenchCommand::Load { file, repeat, json, no_fio, staged_only, verified_only } => {
            let only = match (staged_only, verified_only) {
                (true, _) => Only::Staged,
                (_, true) => Only::Verified,
                _ => Only::All,
            };
            bench_load(file, (*repeat).max(1), *json, *no_fio, only)
        }
        BenchCommand::Matrix(args) => crate::matrix::run(args),
        BenchCommand::Sizes(args) => crate::sizes::run(args),
        BenchCommand::Qd(args) => crate::qd::run(args),
        BenchCommand::Save(args) => crate::save::run(args),
        BenchCommand::Bind(args) => crate::bind::run(args),
        BenchCommand::Cache(args) => crate::cache::run(args),
        BenchCommand::Stream(args) => crate::stream::run(args),
        BenchCommand::Fio { file, block_size, iodepths, json } => {
            bench_fio(file, *block_size, iodepths, *json)
        }
    }
}

const BASELINE: &str = "read, buffered (baseline)";

/// The in-place row of the default engine, which the staged row is held
/// against.
fn in_place_default() -> String {
    format!("dmaload {}", Engine::default().name())
}

/// The staging ring of the staged row: one slot per request the in-place
/// default keeps in flight (32), each one request (4 MiB), so both rows
/// issue the same reads and only the destination differs.
fn staging_ring() -> Result<StagingRing, String> {
    let defaults = LoadOptions::default();
    StagingRing::new(defaults.queue_depth, defaults.chunk_size, defaults.chunk_size)
        .map_err(|e| format!("staging ring: {e}"))
}

/// The library's defaults, measuring the page-cache residue each load
/// leaves (the table's column): the library measures it only when asked.
fn measured() -> LoadOptions {
    LoadOptions { measure_page_cache: true, ..LoadOptions::default() }
}

/// The residue a measured load reports.
fn residue(report: &dmaload::LoadReport) -> Result<f64, String> {
    report
        .page_cache
        .map(|r| r.fraction)
        .ok_or_else(|| format!("{}: the load did not measure the page cache", report.path.display()))
}

/// The staged row and the in-place default row it is held against.
fn staged_methods() -> Vec<Method> {
    vec![Method::Dmaload { name: in_place_default(), options: measured() }, staged_method()]
}

/// The in-place default unverified and verified against the sums file
/// beside `file`, side by side.
fn verified_methods(file: &Path) -> Result<Vec<Method>, String> {
    let (digest, _) = dmaload::verify::expected_digest(file).map_err(|e| format!("bench load: {e}"))?;
    Ok(vec![
        Method::Dmaload { name: in_place_default(), options: measured() },
        Method::Dmaload {
            name: format!("{}, verified ({} beside the reads)", in_place_default(), digest.name()),
            options: LoadOptions { verify: true, ..measured() },
        },
    ])
}

/// Which rows `bench load` runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Only {
    All,
    Staged,
    Verified,
}

fn staged_method() -> Method {
    Method::Staged {
        name: format!("dmaload {} staging ring → host buffer", Engine::default().name()),
        options: measured(),
    }
}

fn methods(with_fio: bool, facts: &MemoryFacts, bytes: u64) -> Vec<Method> {
    let mut methods: Vec<Method> = Engine::ALL
        .into_iter()
        .map(|engine| Method::Dmaload {
            name: format!("dmaload {}", engine.name()),
            options: LoadOptions { engine, ..measured() },
        })
        .collect();
    // The default engine again in every memory kind this machine can give
    // a file of `bytes` now, and as `dmaload load` runs it (auto, no fd).
    for kind in MemoryKind::ALL.into_iter().filter(|&kind| facts.can_give(kind, bytes).is_ok()) {
        methods.push(Method::Dmaload {
            name: format!("dmaload {} {}", Engine::default().name(), kind.name()),
            options: LoadOptions { to: kind.into(), ..measured() },
        });
    }
    methods.push(Method::Dmaload {
        name: format!("dmaload {} auto, no fd (dmaload load)", Engine::default().name()),
        options: LoadOptions { needs_fd: false, ..measured() },
    });
    methods.push(staged_method());
    methods.push(Method::Dmaload {
        name: BASELINE.into(),
        options: LoadOptions { engine: Engine::Read, mode: IoMode::Buffered, ..measured() },
    });
    if with_fio {
        for (block_size, iodepth) in [("1M", 16), ("4M", 8), ("4M", 16), ("4M", 32)] {
            methods.push(Method::Fio { block_size, iodepth, huge: false });
        }
        // fio's best setting with huge-page buffers, where the pool holds them.
        if facts.can_give(MemoryKind::Hugetlb, 32 * (4 << 20)).is_ok() {
            methods.push(Method::Fio { block_size: "4M", iodepth: 32, huge: true });
        }
    }
    methods
}

fn bench_load(file: &Path, repeat: usize, json: bool, no_fio: bool, only: Only) -> Result<(), String> {
    // The same checks as a load (no FIFO, device or pseudo-file), before any run.
    let opened = dmaload::source::open_for_reading(file).map_err(|e| e.to_string())?;
    let bytes = opened.metadata().map_err(|e| format!("stat {}: {e}", file.display()))?.len();
    if bytes == 0 {
        return Err(format!(
            "bench load {}: the file is empty, so there is no speed to measure",
            file.display()
        ));
    }
    let gib = bytes as f64 / (1u64 << 30) as f64;
    let fio = if no_fio || only != Only::All { None } else { fio::available() };
    let fio_note = match (&fio, no_fio) {
        (Some(v), _) => v.clone(),
        (None, true) => "skipped (--no-fio)".into(),
        (None, false) if only == Only::Staged => "skipped (--staged-only)".into(),
        (None, false) if only == Only::Verified => "skipped (--verified-only)".into(),
        (None, false) => "not installed (apt-get install fio): no ceiling row".into(),
    };
    let facts = MemoryFacts::read();
    let methods = match only {
        Only::Staged => staged_methods(),
        Only::Verified => verified_methods(file)?,
        Only::All => methods(fio.is_some(), &facts, bytes),
    };
    let settle = facts.reporting_settle();
    // Populated once and reused by every staged run, as a ring is meant to
    // be; each run allocates its own destination.
    let mut ring = staging_ring()?;
    let staging = format!(
        "ring of {} slots x {} populated once before the runs; each run allocates a fresh {} memfd \
         destination, populated by the sink's threads ahead of its deliveries (timed)",
        ring.slots(),
        human_bytes(ring.slot_len() as u64),
        human_bytes(bytes),
    );
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); methods.len()];
    let mut reference_hash: Option<u64> = None;
    for round in 0..repeat {
        for i in crate::benchkit::round_order(methods.len(), round) {
            let method = &methods[i];
            eprintln!("bench: round {}/{repeat}: {}", round + 1, method.name());
            crate::benchkit::evict(file)?;
            if let Some(settle) = settle {
                // Memory as a load after idle meets it: handed back to the
                // host, not warm from the run before (which would favour
                // whichever row follows a large free).
                std::thread::sleep(settle);
            }
            // Every method must return the same bytes.
            let mut check = |name: &str, digest: u64| {
                if *reference_hash.get_or_insert(digest) != digest {
                    return Err(format!("{name} returned different bytes from the first method"));
                }
                Ok(())
            };
            let sample = match method {
                Method::Dmaload { name, options } => {
                    let (buffer, report) = dmaload::load(file, options).map_err(|e| e.to_string())?;
                    let mut huge_page_share = None;
                    if round == 0 {
                        check(name, xxhash_rust::xxh3::xxh3_64(&buffer))?;
                        let huge = buffer.huge_page_bytes().map_err(|e| format!("smaps: {e}"))?;
                        huge_page_share = Some(huge as f64 / buffer.len().max(1) as f64);
                    }
                    let cpu = report.cpu_user_seconds + report.cpu_system_seconds;
                    let dropped = Instant::now();
                    drop(buffer);
                    let drop_seconds = dropped.elapsed().as_secs_f64();
                    dmaload::memory::wait_for_freed_memory();
                    Sample {
                        gib_per_second: report.gib_per_second,
                        cpu_seconds_per_gib: cpu / gib.max(1e-12),
                        page_cache_residue: residue(&report)?,
                        drop_seconds: Some(drop_seconds),
                        freed_seconds: Some(dropped.elapsed().as_secs_f64()),
                        huge_page_share,
                        deliver_seconds: None,
                    }
                }
                Method::Staged { name, options } => {
                    let (sample, digest) = run_staged(file, bytes, &mut ring, options, round == 0)?;
                    if let Some(digest) = digest {
                        check(name, digest)?;
                    }
                    sample
                }
                Method::Fio { block_size, iodepth, huge } => run_fio(file, block_size, *iodepth, *huge)?,
            };
            samples[i].push(sample);
        }
    }
    crate::benchkit::evict(file)?;

    let spread = |v: &[Sample], f: fn(&Sample) -> f64| Spread::of(&v.iter().map(f).collect::<Vec<_>>());
    let median = |v: &[Sample], f: fn(&Sample) -> f64| spread(v, f).median;
    let medians: Vec<f64> = samples.iter().map(|s| median(s, |x| x.gib_per_second)).collect();
    let fio_best = methods
        .iter()
        .zip(&medians)
        .filter(|(m, _)| matches!(m, Method::Fio { .. }))
        .map(|(_, &v)| v)
        .fold(None, |best: Option<f64>, v| Some(best.map_or(v, |b| b.max(v))));
    let buffered = methods.iter().position(|m| m.name() == BASELINE).map(|i| medians[i]);
    let default_index =
        methods.iter().position(|m| m.name() == in_place_default()).expect("in-place default row");
    let in_place = medians[default_index];
    let rows: Vec<Row> = methods
        .iter()
        .zip(samples)
        .zip(&medians)
        .map(|((method, samples), &med)| Row {
            method: method.name(),
            baseline: method.name() == BASELINE,
            fio: matches!(method, Method::Fio { .. }),
            median_gib_per_second: med,
            min_gib_per_second: spread(&samples, |x| x.gib_per_second).min,
            max_gib_per_second: spread(&samples, |x| x.gib_per_second).max,
            median_cpu_seconds_per_gib: median(&samples, |x| x.cpu_seconds_per_gib),
            median_drop_seconds: samples[0]
                .drop_seconds
                .map(|_| median(&samples, |x| x.drop_seconds.unwrap_or(0.0))),
            median_freed_seconds: samples[0]
                .freed_seconds
                .map(|_| median(&samples, |x| x.freed_seconds.unwrap_or(0.0))),
            huge_page_share: samples.iter().find_map(|x| x.huge_page_share),
            max_page_cache_residue: samples.iter().map(|s| s.page_cache_residue).fold(0.0, f64::max),
            ratio_to_fio_best: fio_best.map(|best| med / best),
            ratio_to_buffered: buffered.map(|buffered| med / buffered),
            ratio_to_in_place_default: med / in_place,
            samples,
        })
        .collect();
    let memory = MemoryKind::ALL
        .into_iter()
        .map(|kind| match facts.can_give(kind, bytes) {
            Ok(()) => format!("{kind} {} pages", crate::output::page_size_label(facts.huge_pages(kind))),
            Err(why) => format!("{kind} left out ({why})"),
        })
        .collect::<Vec<_>>()
        .join("; ");
    let auto = format!(
        "engine rows (fd kept): {}; dmaload load (no fd): {}",
        facts.choose(bytes, true).kind,
        facts.choose(bytes, false).kind
    );
    let table = Table {
        file: file.display().to_string(),
        bytes,
        repeat,
        fio: fio_note,
        memory,
        auto,
        free_page_reporting: dmaload::system::free_page_reporting(),
        settle_seconds: settle.map(|settle| settle.as_secs()),
        staging,
        rows,
    };
    if json {
        println!("{}", serde_json::to_string(&table).expect("table serializes"));
    } else {
        print_table(&table);
    }
    Ok(())
}

/// How the CPU s/GiB column is measured, for each kind of row.
const CPU_NOTE: &str = "getrusage, user + system. dmaload rows: this process (RUSAGE_SELF: all its \
     threads, io_uring workers and populating threads included) from the open, or the destination's \
     allocation, to the last byte. fio rows: fio's own figure for its job (usr_cpu + sys_cpu of \
     job_runtime: the job thread's RUSAGE_THREAD from the start of its I/O to its end, in ms), without \
     fio's start-up (its clock calibration) or other threads.";

fn print_table(t: &Table) {
    println!(
        "Cold load of {} ({}), {} run(s) per method, interleaved in a different order each round, page cache evicted before each{}; fio: {}\n",
        t.file,
        human_bytes(t.bytes),
        t.repeat,
        match t.settle_seconds {
            Some(seconds) => format!(" and {seconds} s for free page reporting to take freed memory back"),
            None => String::new(),
        },
        t.fio
    );
    println!("Memory: {}.\n", t.memory);
    println!("Auto chose: {}.\n", t.auto);
    if let Some(block) = t.free_page_reporting {
        println!("Free page reporting {}.\n", crate::output::free_page_reporting_note(block));
    }
    println!("Staging ring → host buffer: {}.\n", t.staging);
    println!("CPU s/GiB: {CPU_NOTE}\n");
    println!(
        "| method | GiB/s (median) | min–max | CPU s/GiB | huge pages | drop s | freed after s | page-cache residue | × fio best | × buffered | × in-place default |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let dash = || "–".to_owned();
    for r in &t.rows {
        let fio = r.ratio_to_fio_best.map_or_else(dash, |x| format!("{x:.2}"));
        let buffered = r.ratio_to_buffered.map_or_else(dash, |x| format!("{x:.2}"));
        println!(
            "| {} | {:.2} | {:.2}–{:.2} | {:.3} | {} | {} | {} | {:.1}% | {} | {} | {:.2} |",
            r.method,
            r.median_gib_per_second,
            r.min_gib_per_second,
            r.max_gib_per_second,
            r.median_cpu_seconds_per_gib,
            r.huge_page_share.map_or_else(dash, |x| format!("{:.0}%", x * 100.0)),
            r.median_drop_seconds.map_or_else(dash, |x| format!("{x:.3}")),
            r.median_freed_seconds.map_or_else(dash, |x| format!("{x:.3}")),
            r.max_page_cache_residue * 100.0,
            fio,
            buffered,
            r.ratio_to_in_place_default
        );
    }
}

/// One staged run: a fresh memfd destination of the file's size (the
/// in-place default's memory kind), not populated: the `HostSink`'s
/// threads populate it ahead of the deliveries, beside the reads, as the
/// in-place load populates beside its reads. Timed from before the
/// allocation to the last byte delivered, as an in-place load's report
/// times its allocation and reads. With `hash`, also the xxh3 of the
/// destination.
fn run_staged(
    file: &Path,
    bytes: u64,
    ring: &mut StagingRing,
    options: &LoadOptions,
    hash: bool,
) -> Result<(Sample, Option<u64>), String> {
    let len = usize::try_from(bytes).map_err(|_| format!("{bytes} bytes do not fit in memory"))?;
    let cpu_before = process_cpu_seconds().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut dst = TransferBuffer::new(MemoryType::Memfd, len).map_err(|e| e.to_string())?;
    let report = dst
        .with_bytes_mut(|dst| {
            dmaload::LoadRequest::path(&file).options(options).to_sink(ring, &mut HostSink::new(dst, 0))
        })
        .and_then(|loaded| loaded)
        .map_err(|e| e.to_string())?;
    let seconds = started.elapsed().as_secs_f64();
    // The populating threads' CPU too, which the load's report leaves out.
    let cpu = process_cpu_seconds().map_err(|e| e.to_string())? - cpu_before;
    let digest = if hash {
        Some(dst.with_bytes(xxhash_rust::xxh3::xxh3_64).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let gib = bytes as f64 / (1u64 << 30) as f64;
    let sample = Sample {
        gib_per_second: gib / seconds.max(1e-9),
        cpu_seconds_per_gib: cpu / gib.max(1e-12),
        page_cache_residue: residue(&report)?,
        drop_seconds: None,
        freed_seconds: None,
        huge_page_share: None,
        deliver_seconds: Some(report.deliver_seconds),
    };
    Ok((sample, digest))
}

/// `dmaload-bench fio`: one cold fio read per queue depth.
fn bench_fio(file: &Path, block_size: u64, iodepths: &[u32], json: bool) -> Result<(), String> {
    fio::available().ok_or("fio is not installed (apt-get install fio)")?;
    for &iodepth in iodepths {
        crate::benchkit::evict(file)?;
        let job = fio::Job { rw: fio::Rw::Read, file, block_size, iodepth, size: None, huge_buffers: false };
        let done = fio::run(&job)?;
        let gib_per_second = done.bytes as f64 / (1u64 << 30) as f64 / done.io_seconds.max(1e-9);
        if json {
            let row = serde_json::json!({
                "block_size": block_size,
                "iodepth": iodepth,
                "bytes": done.bytes,
                "seconds": done.io_seconds,
                "cpu_seconds": done.cpu_seconds,
                "gib_per_second": gib_per_second,
            });
            println!("{row}");
        } else {
            println!(
                "fio io_uring direct bs={} qd={iodepth}: {gib_per_second:.2} GiB/s, {:.3} s, CPU {:.3} s",
                human_bytes(block_size),
                done.io_seconds,
                done.cpu_seconds
            );
        }
    }
    crate::benchkit::evict(file)
}

/// One fio run: sequential O_DIRECT io_uring reads of the whole file with
/// registered buffers and files, the same kind of I/O as the default engine
/// but into one small reused buffer (so it pays no allocation).
/// Its CPU is fio's own figure for the job (see [`fio::Outcome::cpu_seconds`]),
/// per GiB it read.
fn run_fio(file: &Path, block_size: &str, iodepth: u32, huge: bool) -> Result<Sample, String> {
    let job = fio::Job {
        rw: fio::Rw::Read,
        file,
        block_size: parse_size(block_size)?,
        iodepth,
        size: None,
        huge_buffers: huge,
    };
    let done = fio::run(&job)?;
    let residue = dmaload::pagecache::residency(file).map_err(|e| e.to_string())?.fraction;
    let read_gib = done.bytes as f64 / (1u64 << 30) as f64;
    Ok(Sample {
        gib_per_second: read_gib / done.io_seconds.max(1e-9),
        cpu_seconds_per_gib: done.cpu_seconds / read_gib.max(1e-12),
        page_cache_residue: residue,
        drop_seconds: None,
        freed_seconds: None,
        huge_page_share: None,
        deliver_seconds: None,
    })
}
