//! `dmaload-bench matrix`: seed 001's table on this machine. Every memory
//! type × method × buffered/direct, reading the file into memory and
//! writing memory out to a file, in pieces (32 MiB, as the seed), with
//! create / I/O / close times, MB/s and % of the first row.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use dmaload_bench::transfer::{
    transfer, Direction, MemoryType, Method, TransferBuffer, TransferFile, TransferOptions,
};
use serde::Serialize;

use crate::benchkit::{self, Spread};
use crate::plot;
use crate::units::{human_bytes, parse_size};

#[derive(Args)]
pub struct MatrixArgs {
    /// Bytes moved per row.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    size: u64,
    /// Read this file (its first --size bytes) instead of a generated one.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Directory for the generated input and the written output (must be on
    /// the device to measure, not tmpfs). Default: the sample cache.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Bytes per buffer: each row creates size/piece buffers (seed: 32 MiB,
    /// which also fits udmabuf's default 64 MiB limit).
    #[arg(long, value_parser = parse_size, default_value = "32M")]
    piece: u64,
    /// Runs of each row (interleaved round by round).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Only the read direction, or only the write direction.
    #[arg(long, value_parser = ["read", "write"])]
    only: Option<String>,
    /// Print one JSON object instead of Markdown.
    #[arg(long)]
    json: bool,
    /// Also draw the MB/s of every row into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, Serialize)]
struct Sample {
    create_ms: f64,
    io_ms: f64,
    close_ms: f64,
}

#[derive(Debug, Serialize)]
struct Row {
    direction: Direction,
    memory: MemoryType,
    method: Method,
    direct: bool,
    label: String,
    /// `ok`, `unavailable: <why>` (this kernel lacks the memory type) or
    /// `refused: <error>` (the kernel rejects this combination).
    status: String,
    samples: Vec<Sample>,
    create_ms: Spread,
    close_ms: Spread,
    io_ms: Spread,
    /// Bytes over I/O time, per sample.
    mb_per_s: Spread,
    /// Median MB/s over the median MB/s of the direction's first row.
    percent_of_first: Option<f64>,
    fallbacks: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Matrix {
    file: String,
    bytes: u64,
    piece: u64,
    repeat: usize,
    note: &'static str,
    rows: Vec<Row>,
}

const NOTE: &str =
    "page cache evicted before each row; read rows verified piece by piece against the file's \
     xxh3; write rows fdatasync'ed inside the I/O time and read back to verify; create = allocating the \
     buffers (memfd/udmabuf/dma-heap + mmap), close = unmapping and closing them";

/// The rows in table order: memfd R/W buffered (the baseline) first.
fn layout(only: Option<&str>) -> Vec<(Direction, MemoryType, Method, bool)> {
    let mut rows = Vec::new();
    for direction in [Direction::Read, Direction::Write] {
        if only.is_some_and(|o| o != direction.name()) {
            continue;
        }
        for memory in MemoryType::ALL {
            for method in Method::ALL {
                for direct in [false, true] {
                    if !direct && method.direct_only() {
                        continue;
                    }
                    rows.push((direction, memory, method, direct));
                }
            }
        }
    }
    rows
}

fn label(memory: MemoryType, method: Method, direct: bool) -> String {
    format!("{} {} {}", memory.name(), if direct { "direct" } else { "buffer" }, method.name())
}

/// One run of one row: create all pieces, move them, drop them; verify.
fn run_row(
    path: &Path,
    out: &Path,
    hashes: &[u64],
    size: u64,
    piece: u64,
    (direction, memory, method, direct): (Direction, MemoryType, Method, bool),
) -> Result<(Sample, Vec<String>), String> {
    let options = TransferOptions::default();
    let e = |err: dmaload::Error| err.to_string();
    let file = match direction {
        Direction::Read => {
            benchkit::evict(path)?;
            TransferFile::open(path, Direction::Read, direct).map_err(e)?
        }
        Direction::Write => {
            let _ = std::fs::remove_file(out);
            TransferFile::open(out, Direction::Write, direct).map_err(e)?
        }
    };
    let mut sample = Sample { create_ms: 0.0, io_ms: 0.0, close_ms: 0.0 };
    let mut buffers = Vec::new();
    let mut fallbacks = Vec::new();
    let mut offset = 0u64;
    while offset < size {
        let len = (size - offset).min(piece) as usize;
        let t = Instant::now();
        let mut buf = TransferBuffer::new(memory, len).map_err(e)?;
        sample.create_ms += t.elapsed().as_secs_f64() * 1e3;
        if direction == Direction::Write {
            buf.with_bytes_mut(|b| crate::sample::fill_pattern(b, offset)).map_err(e)?;
        }
        let t = Instant::now();
        let moved = transfer(&mut buf, &file, offset, method, direction, &options).map_err(e)?;
        sample.io_ms += t.elapsed().as_secs_f64() * 1e3;
        fallbacks.extend(moved.into_iter().map(|f| f.to_string()));
        if direction == Direction::Read {
            let digest = buf.with_bytes(xxhash_rust::xxh3::xxh3_64).map_err(e)?;
            let index = (offset / piece) as usize;
            if hashes.get(index) != Some(&digest) {
                return Err(format!("content mismatch in piece {index} (offset {offset})"));
            }
        }
        buffers.push(buf);
        offset += len as u64;
    }
    if direction == Direction::Write {
        let t = Instant::now();
        file.sync().map_err(e)?;
        sample.io_ms += t.elapsed().as_secs_f64() * 1e3;
    }
    let t = Instant::now();
    drop(buffers);
    sample.close_ms = t.elapsed().as_secs_f64() * 1e3;
    if direction == Direction::Write {
        drop(file);
        // The generated pattern at each offset is what the input file holds.
        if benchkit::piece_hashes(out, piece as usize)? != hashes {
            return Err(format!("{} does not hold what was written", out.display()));
        }
    }
    Ok((sample, fallbacks))
}

pub fn run(args: &MatrixArgs) -> Result<(), String> {
    let dir = args.dir.clone().unwrap_or_else(benchkit::default_dir);
    let piece = args.piece.max(4096) / 4096 * 4096;
    let (path, size) = match &args.file {
        Some(file) => {
            let len = std::fs::metadata(file).map_err(|e| format!("stat {}: {e}", file.display()))?.len();
            (file.clone(), args.size.min(len))
        }
        None => (benchkit::bench_file(&dir, args.size)?, args.size),
    };
    let out = dir.join("dmaload-matrix-write.bin");
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let mut read_hashes = benchkit::piece_hashes(&path, piece as usize)?;
    read_hashes.truncate(size.div_ceil(piece) as usize);
    // Write rows write the generated pattern: their reference is its hashes.
    let write_hashes = match &args.file {
        Some(_) if args.only.as_deref() != Some("read") => {
            benchkit::piece_hashes(&benchkit::bench_file(&dir, size)?, piece as usize)?
        }
        _ => read_hashes.clone(),
    };
    let layout = layout(args.only.as_deref());
    let mut status: Vec<String> = layout
        .iter()
        .map(|&(_, memory, _, _)| match memory.probe() {
            Ok(()) => "ok".into(),
            Err(why) => format!("unavailable: {why}"),
        })
        .collect();
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); layout.len()];
    let mut fallbacks: Vec<Vec<String>> = vec![Vec::new(); layout.len()];
    let repeat = args.repeat.max(1);
    for round in 0..repeat {
        for i in benchkit::round_order(layout.len(), round) {
            let row = layout[i];
            if status[i] != "ok" {
                continue;
            }
            let (direction, memory, method, direct) = row;
            eprintln!(
                "bench matrix: round {}/{repeat}: {} {}",
                round + 1,
                direction.name(),
                label(memory, method, direct)
            );
            let hashes = if direction == Direction::Read { &read_hashes } else { &write_hashes };
            match run_row(&path, &out, hashes, size, piece, row) {
                Ok((sample, notes)) => {
                    samples[i].push(sample);
                    fallbacks[i] = notes;
                }
                // A content mismatch is a bug, not a refusal.
                Err(err) if err.contains("mismatch") || err.contains("does not hold") => return Err(err),
                Err(err) => status[i] = format!("refused: {err}"),
            }
        }
    }
    let _ = std::fs::remove_file(&out);
    benchkit::evict(&path)?;

    let mb = |s: &Sample| size as f64 / 1e6 / (s.io_ms / 1e3).max(1e-9);
    let mut rows: Vec<Row> = Vec::new();
    for (i, &(direction, memory, method, direct)) in layout.iter().enumerate() {
        let s = &samples[i];
        rows.push(Row {
            direction,
            memory,
            method,
            direct,
            label: label(memory, method, direct),
            status: status[i].clone(),
            create_ms: Spread::of(&s.iter().map(|x| x.create_ms).collect::<Vec<_>>()),
            close_ms: Spread::of(&s.iter().map(|x| x.close_ms).collect::<Vec<_>>()),
            io_ms: Spread::of(&s.iter().map(|x| x.io_ms).collect::<Vec<_>>()),
            mb_per_s: Spread::of(&s.iter().map(mb).collect::<Vec<_>>()),
            percent_of_first: None,
            fallbacks: fallbacks[i].clone(),
            samples: s.clone(),
        });
    }
    for direction in [Direction::Read, Direction::Write] {
        let first =
            rows.iter().find(|r| r.direction == direction && r.status == "ok").map(|r| r.mb_per_s.median);
        for row in rows.iter_mut().filter(|r| r.direction == direction && r.status == "ok") {
            row.percent_of_first = first.map(|f| row.mb_per_s.median / f.max(1e-9) * 100.0);
        }
    }
    let matrix = Matrix { file: path.display().to_string(), bytes: size, piece, repeat, note: NOTE, rows };
    if args.json {
        println!("{}", serde_json::to_string(&matrix).expect("matrix serializes"));
    } else {
        print_markdown(&matrix);
    }
    if let Some(png) = &args.plot {
        draw(png, &matrix)?;
    }
    Ok(())
}

fn print_markdown(m: &Matrix) {
    println!(
        "{} of {} in {} pieces of {}, {} run(s) per row; {}.\n",
        m.file,
        human_bytes(m.bytes),
        m.bytes.div_ceil(m.piece),
        human_bytes(m.piece),
        m.repeat,
        NOTE
    );
    for direction in [Direction::Read, Direction::Write] {
        let rows: Vec<&Row> = m.rows.iter().filter(|r| r.direction == direction).collect();
        if rows.is_empty() {
            continue;
        }
        let title = match direction {
            Direction::Read => "Read: file → memory",
            Direction::Write => "Write: memory → file",
        };
        println!("### {title}\n");
        println!("| # | method | create ms | close ms | I/O ms (min–max) | MB/s (min–max) | % of #1 |");
        println!("|---:|---|---:|---:|---:|---:|---:|");
        let mut collapsed: Option<MemoryType> = None;
        for (i, r) in rows.iter().enumerate() {
            if r.status.starts_with("unavailable") {
                // One line per missing memory type, not one per method.
                if collapsed != Some(r.memory) {
                    println!("| {}– | {} (every method) | {} | | | | |", i + 1, r.memory.name(), r.status);
                    collapsed = Some(r.memory);
                }
                continue;
            }
            if r.status != "ok" {
                println!("| {} | {} | {} | | | | |", i + 1, r.label, r.status);
                continue;
            }
            let notes =
                if r.fallbacks.is_empty() { String::new() } else { format!(" ({})", r.fallbacks.join("; ")) };
            println!(
                "| {} | {}{} | {:.0} | {:.0} | {} | {} | {:.0}% |",
                i + 1,
                r.label,
                notes,
                r.create_ms.median,
                r.close_ms.median,
                r.io_ms.show(0),
                r.mb_per_s.show(0),
                r.percent_of_first.unwrap_or(0.0)
            );
        }
        println!();
    }
}

fn draw(png: &Path, m: &Matrix) -> Result<(), String> {
    let panels: Vec<plot::Panel> = [Direction::Read, Direction::Write]
        .into_iter()
        .map(|direction| plot::Panel {
            title: format!(
                "{} ({} in {} pieces)",
                if direction == Direction::Read {
                    "file → memory"
                } else {
                    "memory → file (with fdatasync)"
                },
                human_bytes(m.bytes),
                m.bytes.div_ceil(m.piece)
            ),
            unit: "MB/s (bar: median, line: min–max)".into(),
            bars: m
                .rows
                .iter()
                .filter(|r| r.direction == direction && r.status == "ok")
                .map(|r| plot::Bar { label: r.label.clone(), spread: r.mb_per_s })
                .collect(),
        })
        .filter(|p| !p.bars.is_empty())
        .collect();
    plot::bar_chart(png, &format!("dmaload-bench matrix, {} run(s) per row", m.repeat), &panels)
}
