//! `dmaload-bench stream`: seed 004's table on this machine, in one run.
//!
//! Block passing between two real processes, per block size: "fileio" (the
//! producer `write`s each block into a pipe, the consumer `read`s it into
//! its own buffer: two copies) against the `BlockQueue` (the producer
//! stamps a free block and enqueues it, the consumer dequeues it, reads the
//! stamp and gives it back: no copy). Both producers only stamp their
//! blocks, as a capture device's DMA would have filled them. MiB/s and the
//! CPU seconds of both processes, each counted from the end of its set-up
//! (the queue attached or created, the pipe's buffer allocated) to its
//! last block, so the two rows compare the per-block work only; runs
//! interleaved.
//!
//! Then capture → storage (`dmaload capture --source synthetic`, 1 MiB
//! blocks, both processes, fsync and rename included) against fio's
//! O_DIRECT sequential write of the same size in the same directory
//! (`end_fsync` included), interleaved.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use dmaload::share::{
    process_cpu_seconds, BlockQueue, BlockQueueOptions, Connection, Listener, QueueMemory, Role,
};
use serde::Serialize;

use crate::benchkit::Spread;
use crate::plot;
use crate::save::fio_write;
use crate::units::{human_bytes, Size};

const SIZES: [usize; 7] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];
const WAIT: Option<Duration> = Some(Duration::from_secs(60));

#[derive(Args)]
pub struct StreamArgs {
    /// Bytes streamed per run and block size (small blocks: at most 64K
    /// blocks).
    #[arg(long, default_value = "1G")]
    bytes: Size,
    /// Blocks in the queue's ring.
    #[arg(long, default_value_t = 32)]
    blocks: usize,
    /// Runs of each method (interleaved).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Directory for the capture → storage rows (default: the current one).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Bytes captured to storage (0 skips those rows).
    #[arg(long, default_value = "1G")]
    capture_bytes: Size,
    /// Blocks (1 MiB each) in the capture's ring: 128 lets up to 96 MiB of
    /// writes be in flight, about fio's 16 × 4 MiB.
    #[arg(long, default_value_t = 128)]
    capture_blocks: usize,
    /// Skip fio even when it is installed.
    #[arg(long)]
    no_fio: bool,
    /// Print one JSON object instead of a Markdown table.
    #[arg(long)]
    json: bool,
    /// Also draw the table as bar charts into this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Internal: the producer process of one run ("fileio" or "queue").
    #[arg(long, hide = true)]
    producer: Option<String>,
    /// Internal: the producer's socket (queue) and block geometry.
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
    #[arg(long, hide = true)]
    block_size: Option<usize>,
    #[arg(long, hide = true)]
    count: Option<u64>,
}

#[derive(Serialize)]
struct Run {
    mib_per_second: f64,
    producer_cpu_seconds: f64,
    consumer_cpu_seconds: f64,
}

#[derive(Serialize)]
struct Row {
    block_size: usize,
    bytes: u64,
    fileio: Vec<Run>,
    queue: Vec<Run>,
    fileio_mib_per_second: f64,
    queue_mib_per_second: f64,
    /// Median queue MiB/s over median fileio MiB/s.
    speedup: f64,
    fileio_cpu_seconds: f64,
    queue_cpu_seconds: f64,
}

#[derive(Serialize)]
struct CaptureRow {
    bytes: u64,
    blocks_in_ring: usize,
    capture_mib_per_second: Vec<f64>,
    fio_mib_per_second: Vec<f64>,
    ratio_to_fio: Option<f64>,
    capture_cpu_seconds: Vec<f64>,
}

#[derive(Serialize)]
struct Table {
    repeat: usize,
    blocks_in_ring: usize,
    fio: String,
    rows: Vec<Row>,
    capture: Option<CaptureRow>,
}

pub fn run(args: &StreamArgs) -> Result<(), String> {
    if let Some(role) = &args.producer {
        return produce(args, role);
    }
    let repeat = args.repeat.max(1);
    let mut rows = Vec::new();
    for &block in &SIZES {
        let count = (args.bytes.0 / block as u64).clamp(1, 65536);
        let (mut fileio, mut queue) = (Vec::new(), Vec::new());
        for round in 0..repeat {
            // A shuffled order per round, as every bench: not always the pipe first.
            for row in crate::benchkit::round_order(2, round) {
                match row {
                    0 => fileio.push(fileio_run(block, count)?),
                    _ => queue.push(queue_run(block, count, args.blocks)?),
                }
            }
        }
        let median =
            |runs: &[Run], f: fn(&Run) -> f64| Spread::of(&runs.iter().map(f).collect::<Vec<_>>()).median;
        let fileio_mib = median(&fileio, |r| r.mib_per_second);
        let queue_mib = median(&queue, |r| r.mib_per_second);
        rows.push(Row {
            block_size: block,
            bytes: count * block as u64,
            fileio_cpu_seconds: median(&fileio, |r| r.producer_cpu_seconds + r.consumer_cpu_seconds),
            queue_cpu_seconds: median(&queue, |r| r.producer_cpu_seconds + r.consumer_cpu_seconds),
            fileio,
            queue,
            fileio_mib_per_second: fileio_mib,
            queue_mib_per_second: queue_mib,
            speedup: queue_mib / fileio_mib.max(1e-9),
        });
    }
    let fio = if args.no_fio { None } else { dmaload_bench::fio::available() };
    let capture =
        if args.capture_bytes.0 > 0 { Some(capture_rows(args, repeat, fio.is_some())?) } else { None };
    let table = Table {
        repeat,
        blocks_in_ring: args.blocks,
        fio: fio.unwrap_or_else(|| "not run (skipped or not installed)".into()),
        rows,
        capture,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&table).map_err(|e| e.to_string())?);
    } else {
        print_table(&table);
    }
    if let Some(png) = &args.plot {
        draw(png, &table)?;
    }
    Ok(())
}

fn print_table(table: &Table) {
    println!(
        "Block passing between two processes, {} run(s) each, interleaved; CPU = producer + consumer seconds \
         (median), each process's from the end of its set-up (queue attached or created, pipe buffer \
         allocated) to its last block\n",
        table.repeat
    );
    println!(
        "| block | bytes | fileio MiB/s | BlockQueue MiB/s | × fileio | fileio CPU s | BlockQueue CPU s |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &table.rows {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.3} | {:.3} |",
            human_bytes(r.block_size as u64),
            human_bytes(r.bytes),
            r.fileio_mib_per_second,
            r.queue_mib_per_second,
            r.speedup,
            r.fileio_cpu_seconds,
            r.queue_cpu_seconds
        );
    }
    if let Some(c) = &table.capture {
        let med = |v: &[f64]| if v.is_empty() { f64::NAN } else { Spread::of(v).median };
        println!(
            "\nCapture → storage, {} (1 MiB blocks, a ring of {}; interleaved with fio: {})\n",
            human_bytes(c.bytes),
            c.blocks_in_ring,
            table.fio
        );
        println!("| method | MiB/s median | × fio |");
        println!("|---|---|---|");
        println!(
            "| dmaload capture (synthetic) | {:.0} | {} |",
            med(&c.capture_mib_per_second),
            c.ratio_to_fio.map_or("–".into(), |x| format!("{x:.2}"))
        );
        if !c.fio_mib_per_second.is_empty() {
            println!("| fio write, io_uring direct bs=4M qd=16 | {:.0} | 1.00 |", med(&c.fio_mib_per_second));
        }
    }
}

fn draw(png: &std::path::Path, table: &Table) -> Result<(), String> {
    let spread = |runs: &[Run]| Spread::of(&runs.iter().map(|r| r.mib_per_second).collect::<Vec<_>>());
    let mut bars = Vec::new();
    for r in &table.rows {
        let size = human_bytes(r.block_size as u64);
        bars.push(plot::Bar { label: format!("{size} fileio"), spread: spread(&r.fileio) });
        bars.push(plot::Bar { label: format!("{size} BlockQueue"), spread: spread(&r.queue) });
    }
    let mut panels = vec![plot::Panel { title: "block passing".into(), unit: "MiB/s".into(), bars }];
    if let Some(c) = &table.capture {
        let mut bars =
            vec![plot::Bar { label: "capture".into(), spread: Spread::of(&c.capture_mib_per_second) }];
        if !c.fio_mib_per_second.is_empty() {
            bars.push(plot::Bar { label: "fio write".into(), spread: Spread::of(&c.fio_mib_per_second) });
        }
        panels.push(plot::Panel { title: "capture → storage".into(), unit: "MiB/s".into(), bars });
    }
    plot::bar_chart(png, &format!("dmaload-bench stream, {} run(s) each", table.repeat), &panels)
}

fn self_command(role: &str, block: usize, count: u64) -> Result<Command, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "stream",
        "--producer",
        role,
        "--block-size",
        &block.to_string(),
        "--count",
        &count.to_string(),
    ]);
    Ok(cmd)
}

/// The producer's CPU seconds, which it prints as its last stderr line.
fn producer_cpu(child: std::process::Child) -> Result<f64, String> {
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("the producer failed: {text}"));
    }
    text.lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| format!("no CPU figure from the producer: {text}"))
}

fn fileio_run(block: usize, count: u64) -> Result<Run, String> {
    let mut child = self_command("fileio", block, count)?
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut pipe = child.stdout.take().ok_or("no pipe")?;
    let mut buf = vec![0u8; block];
    let cpu_before = process_cpu_seconds().map_err(|e| e.to_string())?;
    let started = Instant::now();
    for seq in 0..count {
        pipe.read_exact(&mut buf).map_err(|e| format!("read from the pipe: {e}"))?;
        if buf[..8] != seq.to_le_bytes() {
            return Err(format!("fileio block {seq} arrived out of order"));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let consumer = process_cpu_seconds().map_err(|e| e.to_string())? - cpu_before;
    drop(pipe);
    Ok(Run {
        mib_per_second: (count * block as u64) as f64 / (1 << 20) as f64 / seconds,
        producer_cpu_seconds: producer_cpu(child)?,
        consumer_cpu_seconds: consumer,
    })
}

fn queue_run(block: usize, count: u64, blocks: usize) -> Result<Run, String> {
    let dir = std::env::temp_dir().join(format!("dmaload-bench-stream-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("s");
    let _ = std::fs::remove_file(&socket);
    let listener = Listener::bind(&socket, 1).map_err(|e| e.to_string())?;
    let child = self_command("queue", block, count)?
        .arg("--socket")
        .arg(&socket)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let conn = listener
        .accept_timeout(Duration::from_secs(30))
        .map_err(|e| e.to_string())?
        .ok_or("the producer did not connect")?;
    let _ = std::fs::remove_dir_all(&dir);
    // A ring of at most 256 MiB, at least 2 blocks.
    let ring = blocks.min((256 << 20) / block).max(2);
    let options = BlockQueueOptions { block_size: block, blocks: ring, memory: QueueMemory::Memfd };
    let mut queue = BlockQueue::create(conn, Role::Consumer, &options, WAIT).map_err(|e| e.to_string())?;
    let cpu_before = process_cpu_seconds().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut stamp = [0u8; 8];
    let mut seq = 0u64;
    // Woken once per quarter of the ring, not per block.
    let batch = (ring / 4).max(1);
    while let Some(run) = queue.dequeue_run(batch, usize::MAX, WAIT).map_err(|e| e.to_string())? {
        for i in 0..run.blocks() {
            run.read_at(i, 0, &mut stamp).map_err(|e| e.to_string())?;
            if stamp != seq.to_le_bytes() {
                return Err(format!("queue block {seq} arrived out of order"));
            }
            seq += 1;
        }
        run.release().map_err(|e| e.to_string())?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let consumer = process_cpu_seconds().map_err(|e| e.to_string())? - cpu_before;
    if seq != count {
        return Err(format!("{seq} of {count} blocks arrived"));
    }
    drop(queue);
    Ok(Run {
        mib_per_second: (count * block as u64) as f64 / (1 << 20) as f64 / seconds,
        producer_cpu_seconds: producer_cpu(child)?,
        consumer_cpu_seconds: consumer,
    })
}

/// The producer processes: stamp each block with its sequence number and
/// pass it on; print last, on stderr, the CPU seconds used from the end of
/// the set-up (the buffer allocated, or the queue attached: the consumer's
/// count starts at the same points) to the last block passed on.
fn produce(args: &StreamArgs, role: &str) -> Result<(), String> {
    let block = args.block_size.ok_or("--block-size")?;
    let count = args.count.ok_or("--count")?;
    let cpu_before;
    match role {
        "fileio" => {
            let mut buf = vec![0x5au8; block];
            let mut out = std::io::stdout().lock();
            cpu_before = process_cpu_seconds().map_err(|e| e.to_string())?;
            for seq in 0..count {
                buf[..8].copy_from_slice(&seq.to_le_bytes());
                out.write_all(&buf).map_err(|e| format!("write to the pipe: {e}"))?;
            }
            out.flush().map_err(|e| e.to_string())?;
        }
        "queue" => {
            let socket = args.socket.as_ref().ok_or("--socket")?;
            let conn = Connection::connect(socket).map_err(|e| e.to_string())?;
            let mut queue = BlockQueue::attach(conn, WAIT).map_err(|e| e.to_string())?;
            cpu_before = process_cpu_seconds().map_err(|e| e.to_string())?;
            for seq in 0..count {
                let mut free = queue.dequeue_free(WAIT).map_err(|e| e.to_string())?;
                free.write_at(0, &seq.to_le_bytes()).map_err(|e| e.to_string())?;
                free.enqueue(block, seq).map_err(|e| e.to_string())?;
            }
            queue.finish().map_err(|e| e.to_string())?;
            queue.wait_drained(WAIT).map_err(|e| e.to_string())?;
        }
        other => return Err(format!("unknown producer {other}")),
    }
    eprintln!("{}", process_cpu_seconds().map_err(|e| e.to_string())? - cpu_before);
    Ok(())
}

fn capture_rows(args: &StreamArgs, repeat: usize, fio: bool) -> Result<CaptureRow, String> {
    let dir = args.dir.clone().unwrap_or_else(|| PathBuf::from("."));
    let size = args.capture_bytes.0.next_multiple_of(1 << 20);
    let target = dir.join(format!(".dmaload-bench-stream-{}", std::process::id()));
    // The capture is the `dmaload capture` command's.
    let exe = crate::benchkit::dmaload_exe()?;
    let (mut capture, mut fio_runs, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..repeat {
        // A shuffled order per round, as every bench: not always the capture first.
        for row in crate::benchkit::round_order(if fio { 2 } else { 1 }, round) {
            if row == 1 {
                let seconds = fio_write(&target, size)?;
                let _ = std::fs::remove_file(&target);
                fio_runs.push(size as f64 / (1 << 20) as f64 / seconds);
                continue;
            }
            let out = Command::new(&exe)
                .args(["capture", "--source", "synthetic", "--json", "--size", &size.to_string()])
                .args(["--blocks", &args.capture_blocks.to_string(), "--to"])
                .arg(&target)
                .output()
                .map_err(|e| e.to_string())?;
            if !out.status.success() {
                let _ = std::fs::remove_file(&target);
                return Err(format!("capture failed: {}", String::from_utf8_lossy(&out.stderr)));
            }
            // Every block there, in order, checksums right (`capture --verify`,
            // after the capture's timing), so a capture that lost or mangled
            // blocks cannot count its speed.
            let verified = Command::new(&exe).arg("capture").arg("--verify").arg(&target).output();
            let _ = std::fs::remove_file(&target);
            let verified = verified.map_err(|e| e.to_string())?;
            if !verified.status.success() {
                return Err(format!(
                    "the capture did not verify: {}{}",
                    String::from_utf8_lossy(&verified.stdout),
                    String::from_utf8_lossy(&verified.stderr)
                ));
            }
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
            if report["bytes"].as_u64() != Some(size) {
                return Err(format!("the capture wrote {} bytes, not {size}", report["bytes"]));
            }
            capture.push(report["mib_per_second"].as_f64().ok_or("capture --json has no mib_per_second")?);
            cpu.push(
                report["producer_cpu_seconds"].as_f64().unwrap_or(0.0)
                    + report["consumer_cpu_seconds"].as_f64().unwrap_or(0.0),
            );
        }
    }
    let ratio = (!fio_runs.is_empty()).then(|| Spread::of(&capture).median / Spread::of(&fio_runs).median);
    Ok(CaptureRow {
        bytes: size,
        blocks_in_ring: args.capture_blocks,
        capture_mib_per_second: capture,
        fio_mib_per_second: fio_runs,
        ratio_to_fio: ratio,
        capture_cpu_seconds: cpu,
    })
}
