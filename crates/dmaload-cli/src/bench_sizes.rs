//! `dmaload bench sizes`: seed 000's table on this machine. For 512 KiB,
//! 8 MiB, 1 GiB and 3 GiB files: the time from nothing to a filled
//! buffer with mmap + read (the seed's "normal"), sendfile buffered and
//! direct, a synchronous alloc-then-read (populate everything, then
//! registered O_DIRECT io_uring reads) and dmaload's pipelined
//! alloc-and-read (`load`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use dmaload::transfer::{
    transfer, Direction, MemoryType, Method, TransferBuffer, TransferFile, TransferOptions,
};
use dmaload::LoadOptions;
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
    /// Directory of the generated files (on the device, not tmpfs).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs of each method per size (interleaved).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long)]
    json: bool,
    #[arg(long)]
    plot: Option<PathBuf>,
}

const SEED_SIZES: [u64; 4] = [512 << 10, 8 << 20, 1 << 30, 3 << 30];

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Scheme {
    Normal,
    SendfileBuffered,
    SendfileDirect,
    AllocReadSync,
    AllocReadPipelined,
}

impl Scheme {
    const ALL: [Scheme; 5] = [
        Scheme::Normal,
        Scheme::SendfileBuffered,
        Scheme::SendfileDirect,
        Scheme::AllocReadSync,
        Scheme::AllocReadPipelined,
    ];

    fn name(self) -> &'static str {
        match self {
            Scheme::Normal => "normal: mmap + read, buffered (baseline)",
            Scheme::SendfileBuffered => "sendfile, buffered",
            Scheme::SendfileDirect => "sendfile, direct",
            Scheme::AllocReadSync => "alloc-and-read, sync (populate, then uring-fixed direct)",
            Scheme::AllocReadPipelined => "alloc-and-read, pipelined (dmaload load)",
        }
    }
}

#[derive(Debug, Serialize)]
struct Cell {
    size: u64,
    ms: Spread,
    samples_ms: Vec<f64>,
    /// Median time of the baseline over this one's (> 1: faster).
    speedup_vs_normal: f64,
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
    rows: Vec<Row>,
}

const NOTE: &str = "ms from nothing to a filled memfd buffer (allocation included, closing not); page cache \
     evicted before each run; content verified after each run";

/// One run: fill a buffer with the whole file, verify it, return the time.
fn run_once(scheme: Scheme, path: &Path, size: u64, expected: u64) -> Result<f64, String> {
    let e = |err: dmaload::Error| err.to_string();
    benchkit::evict(path)?;
    let options = TransferOptions::default();
    let via = |method: Method, direct: bool, populate: bool| -> Result<(f64, u64), String> {
        let file = TransferFile::open(path, Direction::Read, direct).map_err(e)?;
        let t = Instant::now();
        let mut buf = TransferBuffer::new(MemoryType::Memfd, size as usize).map_err(e)?;
        if populate {
            buf.populate(dmaload::load::default_populate_threads()).map_err(e)?;
        }
        transfer(&mut buf, &file, 0, method, Direction::Read, &options).map_err(e)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        Ok((ms, buf.with_bytes(xxhash_rust::xxh3::xxh3_64).map_err(e)?))
    };
    let (ms, digest) = match scheme {
        Scheme::Normal => via(Method::ReadWrite, false, false)?,
        Scheme::SendfileBuffered => via(Method::Sendfile, false, false)?,
        Scheme::SendfileDirect => via(Method::Sendfile, true, false)?,
        Scheme::AllocReadSync => via(Method::UringFixed, true, true)?,
        Scheme::AllocReadPipelined => {
            let t = Instant::now();
            let (buffer, _) = dmaload::load(path, &LoadOptions::default()).map_err(e)?;
            (t.elapsed().as_secs_f64() * 1e3, xxhash_rust::xxh3::xxh3_64(&buffer))
        }
    };
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
    let mut samples = vec![vec![Vec::new(); sizes.len()]; Scheme::ALL.len()];
    for (j, &size) in sizes.iter().enumerate() {
        let path = benchkit::bench_file(&dir, size)?;
        let expected = benchkit::file_hash(&path)?;
        for round in 0..repeat {
            for (i, &scheme) in Scheme::ALL.iter().enumerate() {
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
    let baseline: Vec<f64> = samples[0].iter().map(|s| Spread::of(s).median).collect();
    let rows = Scheme::ALL
        .iter()
        .zip(samples)
        .map(|(&scheme, per_size)| Row {
            scheme,
            name: scheme.name(),
            cells: per_size
                .into_iter()
                .zip(&sizes)
                .zip(&baseline)
                .map(|((s, &size), &base)| {
                    let ms = Spread::of(&s);
                    Cell { size, ms, samples_ms: s, speedup_vs_normal: base / ms.median.max(1e-9) }
                })
                .collect(),
        })
        .collect();
    let table = Table { sizes, repeat, note: NOTE, rows };
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
                title: format!("{} file → memfd buffer", human_bytes(size)),
                unit: "ms (lower is better; bar: median, line: min–max)".into(),
                bars: table
                    .rows
                    .iter()
                    .map(|r| plot::Bar {
                        label: r.name.split(" (").next().unwrap_or(r.name).into(),
                        spread: r.cells[j].ms,
                    })
                    .collect(),
            })
            .collect::<Vec<_>>();
        plot::bar_chart(png, &format!("dmaload bench sizes, {} run(s) each", table.repeat), &panels)?;
    }
    Ok(())
}

fn print_markdown(t: &Table) {
    println!(
        "{} run(s) per cell, interleaved; {}. Cells: median ms (min–max) ×speed-up over normal.\n",
        t.repeat, NOTE
    );
    let header: Vec<String> = t.sizes.iter().map(|&s| human_bytes(s)).collect();
    println!("| scheme | {} |", header.join(" | "));
    println!("|---|{}", "---:|".repeat(t.sizes.len()));
    for r in &t.rows {
        let cells: Vec<String> =
            r.cells.iter().map(|c| format!("{} ×{:.2}", c.ms.show(1), c.speedup_vs_normal)).collect();
        println!("| {} | {} |", r.name, cells.join(" | "));
    }
}
