//! `dmaload-bench save`: the write direction against its ceiling. Saves a
//! generated buffer with each engine and a buffered write() (the
//! baseline), beside fio's sequential O_DIRECT io_uring write of the same
//! size to the same directory with a closing fsync, interleaved.

use std::path::{Path, PathBuf};

use clap::Args;
use dmaload::{Engine, IoMode, SaveOptions};
use dmaload_bench::fio;
use dmaload_bench::transfer::{MemoryType, TransferBuffer};
use serde::Serialize;

use crate::benchkit::{self, Spread};
use crate::plot;
use crate::units::{human_bytes, parse_size};

#[derive(Args)]
pub struct SaveBenchArgs {
    /// Bytes saved per run.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    size: u64,
    /// Directory written to (on the device to measure). Default: the sample cache.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs of each method (interleaved).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Skip fio even when it is installed.
    #[arg(long)]
    no_fio: bool,
    /// Print one JSON object instead of a Markdown table.
    #[arg(long)]
    json: bool,
    /// Also draw the GiB/s of every method as bars into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Debug, Clone)]
enum Way {
    Save(&'static str, SaveOptions),
    Fio,
}

impl Way {
    fn name(&self) -> &'static str {
        match self {
            Way::Save(name, _) => name,
            Way::Fio => "fio write, io_uring direct bs=4M (or the size) qd=16, end_fsync (ceiling)",
        }
    }
}

#[derive(Debug, Serialize)]
struct Row {
    method: &'static str,
    gib_per_second: Spread,
    samples: Vec<f64>,
    ratio_to_fio: Option<f64>,
    ratio_to_buffered: f64,
}

#[derive(Debug, Serialize)]
struct Table {
    dir: String,
    bytes: u64,
    repeat: usize,
    fio: String,
    rows: Vec<Row>,
}

/// One fio run: fio's own job runtime (its closing fsync included, its
/// start-up and file layout not).
pub(crate) fn fio_write(target: &Path, size: u64) -> Result<f64, String> {
    let job = fio::Job {
        rw: fio::Rw::Write,
        file: target,
        // fio refuses a block larger than the file: tiny CI sizes use the size.
        block_size: size.clamp(4096, 4 << 20) / 4096 * 4096,
        iodepth: 16,
        size: Some(size),
        huge_buffers: false,
    };
    Ok(fio::run(&job)?.job_seconds)
}

pub fn run(args: &SaveBenchArgs) -> Result<(), String> {
    let dir = args.dir.clone().unwrap_or_else(benchkit::default_dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let size = args.size;
    let fio = if args.no_fio { None } else { fio::available() };
    let mut ways = vec![
        Way::Save(
            "save, buffered write() (baseline)",
            SaveOptions { engine: Engine::Read, mode: IoMode::Buffered, ..SaveOptions::default() },
        ),
        Way::Save("save, uring-fixed direct (default)", SaveOptions::default()),
        Way::Save("save, uring direct", SaveOptions { engine: Engine::Uring, ..SaveOptions::default() }),
        Way::Save(
            "save, pread-pool (pwrite threads) direct",
            SaveOptions { engine: Engine::PreadPool, ..SaveOptions::default() },
        ),
    ];
    if fio.is_some() {
        ways.push(Way::Fio);
    }
    let e = |err: dmaload::Error| err.to_string();
    let mut buf = TransferBuffer::new(MemoryType::Memfd, size as usize).map_err(e)?;
    buf.populate(dmaload::load::default_populate_threads()).map_err(e)?;
    buf.with_bytes_mut(|b| crate::sample::fill_pattern(b, 0)).map_err(e)?;
    let expected = buf.with_bytes(xxhash_rust::xxh3::xxh3_64).map_err(e)?;
    let target = dir.join("dmaload-bench-save.bin");
    let repeat = args.repeat.max(1);
    let gib = size as f64 / (1u64 << 30) as f64;
    let mut samples = vec![Vec::new(); ways.len()];
    for round in 0..repeat {
        for i in benchkit::round_order(ways.len(), round) {
            let way = &ways[i];
            eprintln!("bench save: round {}/{repeat}: {}", round + 1, way.name());
            let _ = std::fs::remove_file(&target);
            let seconds = match way {
                Way::Save(_, options) => {
                    let report =
                        buf.with_bytes(|b| dmaload::save(b, &target, options)).map_err(e)?.map_err(e)?;
                    if round == 0 && benchkit::file_hash(&target)? != expected {
                        return Err(format!(
                            "{}: {} does not hold the saved bytes",
                            way.name(),
                            target.display()
                        ));
                    }
                    report.total_seconds
                }
                Way::Fio => fio_write(&target, size)?,
            };
            samples[i].push(gib / seconds.max(1e-9));
        }
    }
    let _ = std::fs::remove_file(&target);
    let medians: Vec<f64> = samples.iter().map(|s| Spread::of(s).median).collect();
    let fio_median = ways.iter().position(|w| matches!(w, Way::Fio)).map(|i| medians[i]);
    let rows = ways
        .iter()
        .zip(samples)
        .zip(&medians)
        .map(|((way, s), &m)| Row {
            method: way.name(),
            gib_per_second: Spread::of(&s),
            samples: s,
            ratio_to_fio: fio_median.map(|f| m / f.max(1e-9)),
            ratio_to_buffered: m / medians[0].max(1e-9),
        })
        .collect();
    let fio_note = match (&fio, args.no_fio) {
        (Some(v), _) => v.clone(),
        (None, true) => "skipped (--no-fio)".into(),
        (None, false) => "not installed (apt-get install fio): no ceiling row".into(),
    };
    let table = Table { dir: dir.display().to_string(), bytes: size, repeat, fio: fio_note, rows };
    if args.json {
        println!("{}", serde_json::to_string(&table).expect("table serializes"));
    } else {
        println!(
            "Saving {} into {}, {} run(s) each, interleaved; a save's time includes creating, fallocate, \
             writing, fsync, rename and directory fsync; fio: {}\n",
            human_bytes(size),
            table.dir,
            repeat,
            table.fio
        );
        println!("| method | GiB/s median (min–max) | × fio | × buffered |");
        println!("|---|---:|---:|---:|");
        for r in &table.rows {
            let fio = r.ratio_to_fio.map_or("–".into(), |x| format!("{x:.2}"));
            println!(
                "| {} | {} | {} | {:.2} |",
                r.method,
                r.gib_per_second.show(2),
                fio,
                r.ratio_to_buffered
            );
        }
    }
    if let Some(png) = &args.plot {
        let bars = table
            .rows
            .iter()
            .map(|r| plot::Bar {
                label: r.method.split(" (").next().unwrap_or(r.method).into(),
                spread: r.gib_per_second,
            })
            .collect();
        let panel = plot::Panel {
            title: format!("save {} to {}", human_bytes(size), table.dir),
            unit: "GiB/s".into(),
            bars,
        };
        plot::bar_chart(png, &format!("dmaload-bench save, {repeat} run(s) each"), &[panel])?;
    }
    Ok(())
}
