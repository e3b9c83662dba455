//! `dmaload-bench qd`: seed 003's table on this machine. Random O_DIRECT
//! reads at queue depth 1 and 16 × 4k/16k/64k blocks, into plain buffers
//! (the baseline) and registered ones: IOPS, mean submission latency and
//! system CPU.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use dmaload_bench::iops::{random_reads, RandomReadOptions, RandomReadStats};
use serde::Serialize;

use crate::benchkit::{self, Spread};
use crate::plot;
use crate::units::{human_bytes, parse_size};

#[derive(Args)]
pub struct QdArgs {
    /// File to read (default: a generated file of --size in --dir).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Size of the generated file: random offsets spread over all of it.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    size: u64,
    /// Directory of the generated file (on the device, not tmpfs). Default:
    /// the sample cache.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Seconds each cell reads.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Runs of each cell (interleaved).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Print one JSON object instead of a Markdown table.
    #[arg(long)]
    json: bool,
    /// Also draw the table as bar charts into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

const DEPTHS: [usize; 2] = [1, 16];
const BLOCKS: [usize; 3] = [4 << 10, 16 << 10, 64 << 10];

#[derive(Debug, Serialize)]
struct Cell {
    queue_depth: usize,
    block_size: usize,
    registered: bool,
    iops: Spread,
    mean_submit_ns: Spread,
    sys_cpu_percent: Spread,
    /// Median IOPS over the unregistered cell's (registered cells only).
    iops_vs_unregistered: Option<f64>,
    samples: Vec<RandomReadStats>,
}

#[derive(Debug, Serialize)]
struct Table {
    file: String,
    bytes: u64,
    seconds: f64,
    repeat: usize,
    cells: Vec<Cell>,
}

pub fn run(args: &QdArgs) -> Result<(), String> {
    let path = match &args.file {
        Some(f) => f.clone(),
        None => benchkit::bench_file(&args.dir.clone().unwrap_or_else(benchkit::default_dir), args.size)?,
    };
    let bytes = std::fs::metadata(&path).map_err(|e| format!("stat {}: {e}", path.display()))?.len();
    let layout: Vec<(usize, usize, bool)> = DEPTHS
        .iter()
        .flat_map(|&qd| BLOCKS.iter().flat_map(move |&bs| [(qd, bs, false), (qd, bs, true)]))
        .collect();
    let repeat = args.repeat.max(1);
    let mut samples: Vec<Vec<RandomReadStats>> = vec![Vec::new(); layout.len()];
    for round in 0..repeat {
        for i in crate::benchkit::round_order(layout.len(), round) {
            let (queue_depth, block_size, registered) = layout[i];
            eprintln!(
                "bench qd: round {}/{repeat}: qd {queue_depth} {} {}",
                round + 1,
                human_bytes(block_size as u64),
                if registered { "registered" } else { "plain" }
            );
            benchkit::evict(&path)?;
            let options = RandomReadOptions {
                block_size,
                queue_depth,
                registered,
                duration: Duration::from_secs_f64(args.seconds.max(0.01)),
                seed: round as u64 * 1000 + i as u64 / 2,
            };
            samples[i].push(random_reads(&path, &options).map_err(|e| e.to_string())?);
        }
    }
    let spread = |s: &[RandomReadStats], f: fn(&RandomReadStats) -> f64| {
        Spread::of(&s.iter().map(f).collect::<Vec<_>>())
    };
    let mut cells: Vec<Cell> = layout
        .iter()
        .zip(samples)
        .map(|(&(queue_depth, block_size, registered), s)| Cell {
            queue_depth,
            block_size,
            registered,
            iops: spread(&s, |x| x.iops),
            mean_submit_ns: spread(&s, |x| x.mean_submit_ns),
            sys_cpu_percent: spread(&s, |x| x.sys_cpu_percent),
            iops_vs_unregistered: None,
            samples: s,
        })
        .collect();
    for pair in cells.chunks_mut(2) {
        pair[1].iops_vs_unregistered = Some(pair[1].iops.median / pair[0].iops.median.max(1e-9));
    }
    let table = Table { file: path.display().to_string(), bytes, seconds: args.seconds, repeat, cells };
    if args.json {
        println!("{}", serde_json::to_string(&table).expect("table serializes"));
    } else {
        print_markdown(&table);
    }
    if let Some(png) = &args.plot {
        let bars = |f: fn(&Cell) -> Spread| {
            table
                .cells
                .iter()
                .map(|c| plot::Bar {
                    label: format!(
                        "QD{} {} {}",
                        c.queue_depth,
                        human_bytes(c.block_size as u64),
                        if c.registered { "registered" } else { "plain" }
                    ),
                    spread: f(c),
                })
                .collect()
        };
        let panels = vec![
            plot::Panel {
                title: "random O_DIRECT reads".into(),
                unit: "IOPS".into(),
                bars: bars(|c| c.iops),
            },
            plot::Panel {
                title: "submission latency per read".into(),
                unit: "ns (lower is better)".into(),
                bars: bars(|c| c.mean_submit_ns),
            },
        ];
        plot::bar_chart(
            png,
            &format!("dmaload-bench qd, {} run(s) of {} s per cell", table.repeat, table.seconds),
            &panels,
        )?;
    }
    Ok(())
}

fn print_markdown(t: &Table) {
    println!(
        "Random O_DIRECT reads of {} ({}), io_uring, {} run(s) of {} s per cell, interleaved; median (min–max).\n",
        t.file,
        human_bytes(t.bytes),
        t.repeat,
        t.seconds
    );
    println!("| QD | size | buffers | IOPS | × plain | submit ns/read | sys CPU % |");
    println!("|---:|---:|---|---:|---:|---:|---:|");
    for c in &t.cells {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            c.queue_depth,
            human_bytes(c.block_size as u64),
            if c.registered { "registered" } else { "plain" },
            c.iops.show(0),
            c.iops_vs_unregistered.map_or("–".into(), |x| format!("{x:.2}")),
            c.mean_submit_ns.show(0),
            c.sys_cpu_percent.show(1)
        );
    }
}
