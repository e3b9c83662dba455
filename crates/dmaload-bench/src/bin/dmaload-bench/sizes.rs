//! `dmaload-bench sizes`: seed 000's table on this machine. For 512 KiB,
//! 8 MiB, 1 GiB and 3 GiB files: the time from nothing to a filled
//! buffer with mmap + read (the seed's "normal", into a dma-heap buffer
//! where there is a heap, and into a memfd), sendfile buffered and direct
//! (into a memfd: a dma-buf has no splice_write), udmabuf buffered and
//! direct (the seed's steps: memfd, udmabuf create, read into the memfd's
//! mapping), a synchronous alloc-then-read (populate everything, then
//! registered O_DIRECT io_uring reads) and dmaload's pipelined
//! alloc-and-read into each target (`load`, `load_dmabuf` to udmabuf and
//! to dma-heap:system). Rows whose device this kernel lacks, and udmabuf
//! cells past its size_limit_mb, are not run (the table says why).

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use dmaload::LoadOptions;
use dmaload_bench::transfer::{
    transfer, Direction, MemoryType, Method, TransferBuffer, TransferFile, TransferOptions,
};
use serde::Serialize;

use crate::benchkit::{self, Spread};
use crate::plot;
use crate::units::{human_bytes, parse_size};

#[derive(Args)]
pub struct SizesArgs {
    /// Largest size to run (the seed's sizes above it are left out).
    #[arg(long, value_parser = parse_size, default_value = "3G")]
    max_size: u64,
    /// Sizes to run instead of the seed's (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Directory of the generated files (on the device, not tmpfs). Default:
    /// the sample cache.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs of each method per size (interleaved).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Print one JSON object instead of a Markdown table.
    #[arg(long)]
    json: bool,
    /// Also draw the times of every size as bar charts into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

const SEED_SIZES: [u64; 4] = [512 << 10, 8 << 20, 1 << 30, 3 << 30];

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Scheme {
    Normal,
    NormalDmaHeap,
    SendfileBuffered,
    SendfileDirect,
    UdmabufBuffered,
    UdmabufDirect,
    AllocReadSync,
    AllocReadPipelined,
    AllocReadUdmabuf,
    AllocReadDmaHeap,
}

impl Scheme {
    const ALL: [Scheme; 10] = [
        Scheme::NormalDmaHeap,
        Scheme::Normal,
        Scheme::SendfileBuffered,
        Scheme::SendfileDirect,
        Scheme::UdmabufBuffered,
        Scheme::UdmabufDirect,
        Scheme::AllocReadSync,
        Scheme::AllocReadPipelined,
        Scheme::AllocReadUdmabuf,
        Scheme::AllocReadDmaHeap,
    ];

    fn name(self) -> &'static str {
        match self {
            Scheme::Normal => "normal into a memfd: mmap + read, buffered",
            Scheme::NormalDmaHeap => "normal: dma-heap alloc, mmap + read, buffered (seed baseline)",
            Scheme::SendfileBuffered => "sendfile into a memfd, buffered",
            Scheme::SendfileDirect => "sendfile into a memfd, direct",
            Scheme::UdmabufBuffered => "udmabuf, buffered (memfd + udmabuf create, read into the memfd)",
            Scheme::UdmabufDirect => "udmabuf, direct (memfd + udmabuf create, O_DIRECT read into the memfd)",
            Scheme::AllocReadSync => "alloc-and-read, sync (populate, then uring-fixed direct)",
            Scheme::AllocReadPipelined => "alloc-and-read, pipelined (dmaload load → memfd)",
            Scheme::AllocReadUdmabuf => "alloc-and-read → udmabuf (dmaload load --to udmabuf)",
            Scheme::AllocReadDmaHeap => "alloc-and-read → dma-heap (dmaload load --to dma-heap:system)",
        }
    }

    /// Why the scheme cannot run for a file of `size` bytes here, if not.
    fn unavailable(self, size: u64) -> Option<String> {
        let udmabuf = || {
            dmaload::heap::udmabuf_probe().err().or_else(|| {
                let pages = size.div_ceil(4096).max(1) * 4096;
                dmaload::heap::udmabuf_size_limit()
                    .filter(|&limit| pages > limit)
                    .map(|limit| format!("over udmabuf's size_limit_mb ({} MiB)", limit >> 20))
            })
        };
        match self {
            Scheme::NormalDmaHeap | Scheme::AllocReadDmaHeap => dmaload::heap::dma_heap_probe().err(),
            Scheme::UdmabufBuffered | Scheme::UdmabufDirect | Scheme::AllocReadUdmabuf => udmabuf(),
            _ => None,
        }
    }
}

#[derive(Debug, Serialize)]
struct Cell {
    size: u64,
    /// `None` when the scheme could not run at this size (`not_run` says why).
    ms: Option<Spread>,
    samples_ms: Vec<f64>,
    /// Median time of the baseline over this one's (> 1: faster).
    speedup_vs_baseline: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    not_run: Option<String>,
}

#[derive(Debug, Serialize)]
struct Row {
    scheme: Scheme,
    name: &'static str,
    cells: Vec<Cell>,
}

#[derive(Debug, Serialize)]
struct Table {
    sizes: Vec<u64>,
    repeat: usize,
    note: &'static str,
    /// The row the speed-ups are against: the seed's normal into a dma-heap
    /// buffer where there is a heap, else normal into a memfd.
    baseline: Scheme,
    rows: Vec<Row>,
}

const NOTE: &str = "ms from nothing to a filled buffer or dma-buf (allocation included, closing not); page \
     cache evicted before each run; content verified after each run (a dma-buf's through a fresh mapping)";

/// One run: fill a buffer with the whole file, verify it, return the time.
fn run_once(scheme: Scheme, path: &Path, size: u64, expected: u64) -> Result<f64, String> {
    let e = |err: dmaload::Error| err.to_string();
    benchkit::evict(path)?;
    let options = TransferOptions::default();
    let via =
        |memory: MemoryType, method: Method, direct: bool, populate: bool| -> Result<(f64, u64), String> {
            let file = TransferFile::open(path, Direction::Read, direct).map_err(e)?;
            let t = Instant::now();
            let mut buf = TransferBuffer::new(memory, size as usize).map_err(e)?;
            if populate {
                buf.populate(dmaload::load::default_populate_threads()).map_err(e)?;
            }
            transfer(&mut buf, &file, 0, method, Direction::Read, &options).map_err(e)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            Ok((ms, buf.with_bytes(xxhash_rust::xxh3::xxh3_64).map_err(e)?))
        };
    let into_dmabuf = |to: &str| -> Result<(f64, u64), String> {
        let options = LoadOptions { to: to.parse()?, ..LoadOptions::default() };
        let t = Instant::now();
        let (loaded, _) = dmaload::LoadRequest::path(&path).options(&options).to_dmabuf().map_err(e)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        loaded
            .read_each(|bytes| hasher.update(bytes))
            .map_err(|err| format!("read the dma-buf back: {err}"))?;
        Ok((ms, hasher.digest()))
    };
    let (ms, digest) = match scheme {
        Scheme::Normal => via(MemoryType::Memfd, Method::ReadWrite, false, false)?,
        Scheme::NormalDmaHeap => via(MemoryType::DmaHeap, Method::ReadWrite, false, false)?,
        Scheme::SendfileBuffered => via(MemoryType::Memfd, Method::Sendfile, false, false)?,
        Scheme::SendfileDirect => via(MemoryType::Memfd, Method::Sendfile, true, false)?,
        Scheme::UdmabufBuffered => via(MemoryType::UdmabufMemfd, Method::ReadWrite, false, false)?,
        Scheme::UdmabufDirect => via(MemoryType::UdmabufMemfd, Method::ReadWrite, true, false)?,
        Scheme::AllocReadSync => via(MemoryType::Memfd, Method::UringFixed, true, true)?,
        Scheme::AllocReadPipelined => {
            let t = Instant::now();
            let (buffer, _) = dmaload::load(path, &LoadOptions::default()).map_err(e)?;
            (t.elapsed().as_secs_f64() * 1e3, xxhash_rust::xxh3::xxh3_64(&buffer))
        }
        Scheme::AllocReadUdmabuf => into_dmabuf("udmabuf")?,
        Scheme::AllocReadDmaHeap => into_dmabuf("dma-heap:system")?,
    };
    // The library unmaps a dropped buffer of 64 MiB or more on a thread of
    // its own: wait for it, so this row's teardown does not run inside the
    // next row's timing (the bench crate's buffers unmap at once).
    dmaload::memory::wait_for_freed_memory();
    if digest != expected {
        return Err(format!("{}: content of {} differs from the file", scheme.name(), path.display()));
    }
    Ok(ms)
}

pub fn run(args: &SizesArgs) -> Result<(), String> {
    let dir = args.dir.clone().unwrap_or_else(benchkit::default_dir);
    let sizes: Vec<u64> = if args.sizes.is_empty() {
        SEED_SIZES.into_iter().filter(|&s| s <= args.max_size).collect()
    } else {
        args.sizes.clone()
    };
    let repeat = args.repeat.max(1);
    let not_run: Vec<Vec<Option<String>>> = Scheme::ALL
        .iter()
        .map(|scheme| sizes.iter().map(|&size| scheme.unavailable(size)).collect())
        .collect();
    let mut samples = vec![vec![Vec::new(); sizes.len()]; Scheme::ALL.len()];
    for (j, &size) in sizes.iter().enumerate() {
        let path = benchkit::bench_file(&dir, size)?;
        let expected = benchkit::file_hash(&path)?;
        for round in 0..repeat {
            for i in benchkit::round_order(Scheme::ALL.len(), round) {
                let scheme = Scheme::ALL[i];
                if not_run[i][j].is_some() {
                    continue;
                }
                eprintln!(
                    "bench sizes: {} round {}/{repeat}: {}",
                    human_bytes(size),
                    round + 1,
                    scheme.name()
                );
                samples[i][j].push(run_once(scheme, &path, size, expected)?);
            }
        }
    }
    // The seed's baseline where the heap exists, else normal into a memfd.
    let baseline =
        if not_run[0].iter().all(Option::is_none) { Scheme::NormalDmaHeap } else { Scheme::Normal };
    let base_index = Scheme::ALL.iter().position(|&s| s == baseline).expect("a scheme");
    let base: Vec<f64> = samples[base_index].iter().map(|s| Spread::of(s).median).collect();
    let rows = Scheme::ALL
        .iter()
        .zip(samples)
        .zip(not_run)
        .filter(|((_, per_size), _)| per_size.iter().any(|s| !s.is_empty()))
        .map(|((&scheme, per_size), why)| Row {
            scheme,
            name: scheme.name(),
            cells: per_size
                .into_iter()
                .zip(&sizes)
                .zip(&base)
                .zip(why)
                .map(|(((s, &size), &base), not_run)| {
                    let ms = (!s.is_empty()).then(|| Spread::of(&s));
                    let speedup_vs_baseline = ms.map(|ms| base / ms.median.max(1e-9));
                    Cell { size, ms, samples_ms: s, speedup_vs_baseline, not_run }
                })
                .collect(),
        })
        .collect();
    let table = Table { sizes, repeat, note: NOTE, baseline, rows };
    if args.json {
        println!("{}", serde_json::to_string(&table).expect("table serializes"));
    } else {
        print_markdown(&table);
    }
    if let Some(png) = &args.plot {
        let panels = table
            .sizes
            .iter()
            .enumerate()
            .map(|(j, &size)| plot::Panel {
                title: format!("{} file → filled buffer", human_bytes(size)),
                unit: "ms (lower is better; bar: median, line: min–max)".into(),
                bars: table
                    .rows
                    .iter()
                    .filter_map(|r| {
                        let spread = r.cells[j].ms?;
                        Some(plot::Bar { label: r.name.split(" (").next().unwrap_or(r.name).into(), spread })
                    })
                    .collect(),
            })
            .collect::<Vec<_>>();
        plot::bar_chart(png, &format!("dmaload-bench sizes, {} run(s) each", table.repeat), &panels)?;
    }
    Ok(())
}

fn print_markdown(t: &Table) {
    println!(
        "{} run(s) per cell, interleaved; {}. Cells: median ms (min–max) ×speed-up over {}.\n",
        t.repeat,
        NOTE,
        t.baseline.name()
    );
    let header: Vec<String> = t.sizes.iter().map(|&s| human_bytes(s)).collect();
    println!("| scheme | {} |", header.join(" | "));
    println!("|---|{}", "---:|".repeat(t.sizes.len()));
    let mut reasons = Vec::new();
    for r in &t.rows {
        let cells: Vec<String> = r
            .cells
            .iter()
            .map(|c| match (c.ms, c.speedup_vs_baseline) {
                (Some(ms), Some(x)) => format!("{} ×{x:.2}", ms.show(1)),
                _ => {
                    reasons.push(format!(
                        "{} at {}: {}",
                        r.name,
                        human_bytes(c.size),
                        c.not_run.as_deref().unwrap_or("")
                    ));
                    "not run".into()
                }
            })
            .collect();
        println!("| {} | {} |", r.name, cells.join(" | "));
    }
    let missing = Scheme::ALL.iter().filter(|s| !t.rows.iter().any(|r| r.scheme == **s));
    reasons.splice(
        0..0,
        missing.map(|s| format!("{}: {}", s.name(), s.unavailable(t.sizes[0]).unwrap_or_default())),
    );
    if !reasons.is_empty() {
        println!("\nNot run:");
        for reason in reasons {
            println!("- {reason}");
        }
    }
}
