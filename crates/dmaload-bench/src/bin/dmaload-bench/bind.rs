//! `dmaload-bench bind`: seed 002's test on this machine. A sparse memfd
//! of each size (nothing allocated), a segment table with every `--page`
//! bytes its own segment (unmerged) and the same merged, then `--binds`
//! binds of one page at random offsets to consecutive addresses of a fresh
//! address space: the first bind, the others (ns per bind, Mop/s), the
//! unbinds and the extent lookup alone; with the linear-walk lookup (a
//! scatter-list walk) as the baseline in the same run.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use dmaload::vm::{self, Access, AddressSpace, BindOp, Locate, SegmentTable};
use serde::Serialize;

use crate::benchkit::Spread;
use crate::plot;
use crate::units::{human_bytes, parse_size};

#[derive(Args)]
pub struct BindArgs {
    /// Buffer sizes (sparse memfds), comma-separated.
    #[arg(long, value_parser = parse_size, value_delimiter = ',', default_value = "1G,4G,16G,64G")]
    sizes: Vec<u64>,
    /// Segment and bind size (seed 002 binds 16 KiB pages).
    #[arg(long, value_parser = parse_size, default_value = "16K")]
    page: u64,
    /// Binds per table row (seed 002: 1e5).
    #[arg(long, default_value_t = 100_000)]
    binds: usize,
    /// Extents the linear baseline may walk per row (bind and locate each):
    /// its rows bind min(--binds, this / (segments / 2)) pages, at least
    /// 100, so that 64 GiB tables finish in about a second.
    #[arg(long, default_value_t = 1_000_000_000)]
    linear_visits: u64,
    /// Runs of each row (interleaved); the table shows median (min–max).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Print one JSON object instead of a Markdown table.
    #[arg(long)]
    json: bool,
    /// Also draw the table as bar charts into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// One run of one row.
#[derive(Debug, Clone, Copy, Serialize)]
struct Sample {
    first_bind_ns: f64,
    bind_ns: f64,
    unbind_ns: f64,
    locate_ns: f64,
}

#[derive(Debug, Serialize)]
struct Row {
    /// Buffer size in bytes.
    size: u64,
    /// "table" (binary search) or "linear" (walk from the first extent).
    locate: &'static str,
    /// Whether contiguous segments were merged (to one, here).
    merged: bool,
    segments: usize,
    /// Heap bytes of the table.
    table_bytes: usize,
    /// Nanoseconds to build the table from its segments.
    build_ns: f64,
    /// Binds (and unbinds, and locates) per run.
    binds: usize,
    /// Medians over the runs.
    first_bind_ns: f64,
    bind_ns: f64,
    unbind_ns: f64,
    locate_ns: f64,
    bind_mops: f64,
    locate_mops: f64,
    /// Linear row's bind_ns over this row's (table rows).
    speedup_vs_linear: Option<f64>,
    bind_spread: Spread,
    samples: Vec<Sample>,
}

#[derive(Debug, Serialize)]
struct Targets {
    /// Unmerged table's ns per bind at the largest size over the smallest (≤ 1.2).
    bind_flatness: f64,
    /// Linear ns per bind over the unmerged table's at 4 GiB (≥ 5), when 4 GiB ran.
    speedup_at_4g: Option<f64>,
    /// Slowest unmerged table's locates per second, millions (≥ 10).
    min_locate_mops: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    page: u64,
    binds: usize,
    repeat: usize,
    /// vm.max_map_count: each bound page is one mapping, so binds run in
    /// rounds of at most this many (bind a round, unbind it, next).
    max_map_count: usize,
    round: usize,
    rows: Vec<Row>,
    targets: Targets,
}

/// xorshift64*: a fixed sequence of offsets on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

fn max_map_count() -> usize {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65530)
}

fn maps_now() -> usize {
    std::fs::read_to_string("/proc/self/maps").map(|s| s.lines().count()).unwrap_or(1000)
}

struct Variant {
    locate: Locate,
    merged: bool,
}

const VARIANTS: [Variant; 3] = [
    Variant { locate: Locate::LinearWalk, merged: false },
    Variant { locate: Locate::BinarySearch, merged: false },
    Variant { locate: Locate::BinarySearch, merged: true },
];

/// One size's tables, built once and reused by every run.
struct Tables {
    size: u64,
    unmerged: SegmentTable,
    merged: SegmentTable,
    build_ns: [f64; 2],
}

fn build_tables(size: u64, page: u64) -> Result<Tables, String> {
    let memfd = Arc::new(vm::sparse_memfd(size).map_err(|e| e.to_string())?);
    let build = |merge: bool| -> Result<(SegmentTable, f64), String> {
        let start = Instant::now();
        let mut builder = SegmentTable::builder();
        let file = builder.add_file(memfd.clone()).map_err(|e| e.to_string())?;
        for offset in (0..size).step_by(page as usize) {
            builder.push(file, offset, page).map_err(|e| e.to_string())?;
        }
        let table = if merge { builder.build() } else { builder.build_unmerged() };
        Ok((table, start.elapsed().as_nanos() as f64))
    };
    let (unmerged, unmerged_ns) = build(false)?;
    let (merged, merged_ns) = build(true)?;
    Ok(Tables { size, unmerged, merged, build_ns: [unmerged_ns, merged_ns] })
}

/// Seed 002's sequence: `count` random pages of the table to consecutive
/// addresses.
fn ops(size: u64, page: u64, count: usize, seed: u64) -> Vec<BindOp> {
    let pages = size / page;
    let mut rng = Rng(seed | 1);
    (0..count)
        .map(|i| BindOp {
            at: (i as u64 * page) as usize,
            offset: page * (rng.next() % pages),
            len: page as usize,
            access: Access::ReadWrite,
        })
        .collect()
}

fn err(e: dmaload::Error) -> String {
    e.to_string()
}

/// Binds `ops` in rounds of `round` into a fresh space, unbinds each round,
/// then times the lookups alone.
fn run_once(
    table: &SegmentTable,
    locate: Locate,
    ops: &[BindOp],
    round: usize,
    page: u64,
) -> Result<Sample, String> {
    let mut space = AddressSpace::new(round.min(ops.len()) * page as usize).map_err(err)?;
    let (mut first, mut binds, mut unbinds) = (0.0, 0.0, 0.0);
    for (r, chunk) in ops.chunks(round).enumerate() {
        let base = r * round * page as usize;
        let local: Vec<BindOp> = chunk.iter().map(|op| BindOp { at: op.at - base, ..*op }).collect();
        let rest = if r == 0 {
            let start = Instant::now();
            space.bind_many_using(locate, table, &local[..1]).map_err(err)?;
            first = start.elapsed().as_nanos() as f64;
            &local[1..]
        } else {
            &local[..]
        };
        let start = Instant::now();
        space.bind_many_using(locate, table, rest).map_err(err)?;
        binds += start.elapsed().as_nanos() as f64;
        let ranges: Vec<(usize, usize)> = local.iter().map(|op| (op.at, op.len)).collect();
        let start = Instant::now();
        space.unbind_many(&ranges).map_err(err)?;
        unbinds += start.elapsed().as_nanos() as f64;
    }
    let start = Instant::now();
    let mut sum = 0usize;
    for op in ops {
        let found = match locate {
            Locate::BinarySearch => table.locate(black_box(op.offset)),
            Locate::LinearWalk => table.locate_linear(black_box(op.offset)),
        };
        sum = sum.wrapping_add(found.map_or(0, |(i, within)| i ^ within as usize));
    }
    black_box(sum);
    let locate_ns = start.elapsed().as_nanos() as f64 / ops.len() as f64;
    let n = ops.len() as f64;
    Ok(Sample {
        first_bind_ns: first,
        bind_ns: binds / (n - 1.0).max(1.0),
        unbind_ns: unbinds / n,
        locate_ns,
    })
}

pub fn run(args: &BindArgs) -> Result<(), String> {
    let page = args.page;
    if page == 0 || page % 4096 != 0 {
        return Err(format!("--page {page} is not a multiple of 4 KiB"));
    }
    let binds = args.binds.max(2);
    let repeat = args.repeat.max(1);
    let max_maps = max_map_count();
    // Leave room for the process's own mappings and the split reservation.
    let room = max_maps.saturating_sub(maps_now() + 1024).max(1000);
    let rounds = binds.div_ceil(room);
    let round = binds.div_ceil(rounds);
    let mut sizes: Vec<u64> = args.sizes.iter().map(|s| s / page * page).filter(|&s| s > 0).collect();
    sizes.dedup();
    if sizes.is_empty() {
        return Err("no --sizes of at least one page".into());
    }

    let mut tables = Vec::new();
    for &size in &sizes {
        eprintln!("bench bind: building the {} tables ({} segments)", human_bytes(size), size / page);
        tables.push(build_tables(size, page)?);
    }
    let linear_binds = |segments: usize| -> usize {
        let per_bind = (segments as u64 / 2).max(1);
        ((args.linear_visits / per_bind) as usize).clamp(100.min(binds), binds)
    };
    // samples[size][variant]
    let mut samples: Vec<Vec<Vec<Sample>>> = vec![vec![Vec::new(); VARIANTS.len()]; tables.len()];
    for r in 0..repeat {
        for (t, tables) in tables.iter().enumerate() {
            let all = ops(tables.size, page, binds, 42 + r as u64);
            for (v, variant) in VARIANTS.iter().enumerate() {
                let table = if variant.merged { &tables.merged } else { &tables.unmerged };
                let count = match variant.locate {
                    Locate::LinearWalk => linear_binds(table.extents().len()),
                    Locate::BinarySearch => binds,
                };
                eprintln!(
                    "bench bind: run {}/{repeat}: {} {} ({count} binds)",
                    r + 1,
                    human_bytes(tables.size),
                    label(variant)
                );
                samples[t][v].push(run_once(table, variant.locate, &all[..count], round, page)?);
            }
        }
    }

    let mut rows = Vec::new();
    for (tables, per_variant) in tables.iter().zip(samples) {
        let mut linear_ns = None;
        for (variant, s) in VARIANTS.iter().zip(per_variant) {
            let table = if variant.merged { &tables.merged } else { &tables.unmerged };
            let median = |f: fn(&Sample) -> f64| Spread::of(&s.iter().map(f).collect::<Vec<_>>()).median;
            let bind_ns = median(|x| x.bind_ns);
            let locate_ns = median(|x| x.locate_ns);
            let is_linear = variant.locate == Locate::LinearWalk;
            if is_linear {
                linear_ns = Some(bind_ns);
            }
            rows.push(Row {
                size: tables.size,
                locate: if is_linear { "linear" } else { "table" },
                merged: variant.merged,
                segments: table.extents().len(),
                table_bytes: table.heap_bytes(),
                build_ns: tables.build_ns[usize::from(variant.merged)],
                binds: if is_linear { linear_binds(table.extents().len()) } else { binds },
                first_bind_ns: median(|x| x.first_bind_ns),
                bind_ns,
                unbind_ns: median(|x| x.unbind_ns),
                locate_ns,
                bind_mops: 1e3 / bind_ns.max(1e-9),
                locate_mops: 1e3 / locate_ns.max(1e-9),
                speedup_vs_linear: if is_linear { None } else { linear_ns.map(|l| l / bind_ns.max(1e-9)) },
                bind_spread: Spread::of(&s.iter().map(|x| x.bind_ns).collect::<Vec<_>>()),
                samples: s,
            });
        }
    }
    let unmerged: Vec<&Row> = rows.iter().filter(|r| r.locate == "table" && !r.merged).collect();
    let targets = Targets {
        bind_flatness: unmerged.last().map_or(1.0, |l| l.bind_ns) / unmerged[0].bind_ns.max(1e-9),
        speedup_at_4g: unmerged.iter().find(|r| r.size == 4 << 30).and_then(|r| r.speedup_vs_linear),
        min_locate_mops: unmerged.iter().map(|r| r.locate_mops).fold(f64::INFINITY, f64::min),
    };
    let report = Report { page, binds, repeat, max_map_count: max_maps, round, rows, targets };
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("report serializes"));
    } else {
        print_markdown(&report);
    }
    if let Some(png) = &args.plot {
        // The baseline is 10-1000x slower: on one axis the table rows would
        // not show, so each lookup gets its own panels.
        let bars = |linear: Option<bool>, f: fn(&Row) -> Spread| {
            report
                .rows
                .iter()
                .filter(|r| linear.map_or(true, |l| (r.locate == "linear") == l))
                .map(|r| plot::Bar {
                    label: format!("{} {}", human_bytes(r.size), row_label(r)),
                    spread: f(r),
                })
                .collect()
        };
        let title = |what: &str| format!("{what}, one {} page at a random offset", human_bytes(page));
        let panels = vec![
            plot::Panel {
                title: title("bind with the table"),
                unit: "ns per bind (lower is better)".into(),
                bars: bars(Some(false), |r| r.bind_spread),
            },
            plot::Panel {
                title: title("bind with the linear walk (baseline)"),
                unit: "ns per bind (lower is better)".into(),
                bars: bars(Some(true), |r| r.bind_spread),
            },
            plot::Panel {
                title: "locate alone, table".into(),
                unit: "ns per locate (lower is better)".into(),
                bars: bars(Some(false), |r| one(r.locate_ns)),
            },
            plot::Panel {
                title: "unbind one page".into(),
                unit: "ns per unbind (lower is better)".into(),
                bars: bars(None, |r| one(r.unbind_ns)),
            },
        ];
        plot::bar_chart(png, &format!("dmaload-bench bind, {} run(s), medians", report.repeat), &panels)?;
    }
    Ok(())
}

/// A single value as a spread (no whisker).
fn one(v: f64) -> Spread {
    Spread { min: v, median: v, max: v }
}

fn label(v: &Variant) -> &'static str {
    match (v.locate, v.merged) {
        (Locate::LinearWalk, _) => "linear walk (baseline)",
        (Locate::BinarySearch, false) => "table",
        (Locate::BinarySearch, true) => "table, merged",
    }
}

fn row_label(r: &Row) -> &'static str {
    match (r.locate, r.merged) {
        ("linear", _) => "linear walk (baseline)",
        (_, false) => "table",
        (_, true) => "table, merged",
    }
}

fn print_markdown(t: &Report) {
    println!(
        "Binds of one {} page at random offsets of a sparse memfd to consecutive addresses \
         (mmap MAP_SHARED|MAP_FIXED per bind), {} run(s) per row, interleaved; median, ns/bind (min–max).\n",
        human_bytes(t.page),
        t.repeat
    );
    println!(
        "| size | locate | segments | table | binds | first bind µs | ns/bind | Mop/s | ns/unbind | locate ns | × linear |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &t.rows {
        println!(
            "| {} | {} | {} | {} | {} | {:.1} | {} | {:.2} | {:.0} | {:.1} | {} |",
            human_bytes(r.size),
            row_label(r),
            r.segments,
            human_bytes(r.table_bytes as u64),
            r.binds,
            r.first_bind_ns / 1e3,
            r.bind_spread.show(0),
            r.bind_mops,
            r.unbind_ns,
            r.locate_ns,
            r.speedup_vs_linear.map_or("–".into(), |x| format!("{x:.1}"))
        );
    }
    println!(
        "\nLinear rows bind fewer pages (the `binds` column: --linear-visits / (segments / 2)), \
         the same random offsets' first ones. vm.max_map_count is {}: binds run in rounds of {} \
         (bind a round, unbind it).",
        t.max_map_count, t.round
    );
    let tg = &t.targets;
    println!(
        "\nTargets: per-bind time largest/smallest size {:.2}× (≤ 1.2), {} at 4 GiB (≥ 5×), \
         locate ≥ {:.1} M/s (≥ 10).",
        tg.bind_flatness,
        tg.speedup_at_4g.map_or("not run".into(), |x| format!("{x:.1}× linear")),
        tg.min_locate_mops
    );
}
