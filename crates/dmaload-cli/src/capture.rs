//! `dmaload capture`: a producer process (a file, FIFO, character device,
//! or a synthetic generator standing in for a capture device) and a
//! consumer process (this one, writing to storage) joined by a
//! `BlockQueue`. The command re-executes itself for the producer.
//!
//! Synthetic blocks start with a 32-byte stamp: `DMALCAP1`, the block's
//! sequence number, its length, and a checksum (the xxh3-64 of the bytes
//! between stamp and trailer, mixed with the sequence number), and end
//! with the sequence number again. The bytes in between are the same in
//! every block, so the generator hashes them once (a capture device costs
//! the CPU nothing per byte either) while a block whose bytes are damaged,
//! whose end belongs to another block, or that is out of place still fails
//! `--verify`.

use dmaload_cli::outln;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use dmaload::load::DEFAULT_QUEUE_DEPTH;
use dmaload::share::{
    capture_to_file, process_cpu_seconds, BlockQueue, BlockQueueOptions, CaptureOptions, Connection,
    Listener, QueueMemory, Role,
};
use dmaload::Engine;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::units::{parse_size, Size};

const STAMP_MAGIC: &[u8; 8] = b"DMALCAP1";
const STAMP_LEN: usize = 32;
const TRAILER_LEN: usize = 8;
/// How long the producer may take to start and attach.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Most dropped ranges a report lists (the count is always exact).
const MAX_LISTED_RANGES: usize = 256;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnFull {
    /// The producer waits for a free block: nothing is lost.
    Wait,
    /// The producer drops the block, counted and reported.
    Drop,
}

#[derive(Args)]
pub struct CaptureCommand {
    /// What to capture: `synthetic`, or a file, FIFO or character device.
    #[arg(long, required_unless_present = "verify")]
    source: Option<String>,
    /// The capture file: never torn; a stream that breaks, or a disk that
    /// fills, leaves every block written before it (the command fails
    /// saying so), another failed write leaves no file (a previous one
    /// untouched).
    #[arg(long, required_unless_present = "verify")]
    to: Option<PathBuf>,
    /// Check a synthetic capture instead: every block present, in order,
    /// checksums right (exit status 0 only then).
    #[arg(long, conflicts_with_all = ["source", "to"])]
    verify: Option<PathBuf>,
    /// Bytes per block (a multiple of 4 KiB, 4 KiB to 64 MiB).
    #[arg(long, default_value = "1M")]
    block_size: Size,
    /// Blocks in the ring.
    #[arg(long, default_value_t = 32)]
    blocks: usize,
    /// Bytes per second the producer delivers at most, e.g. 2G/s.
    #[arg(long, value_parser = parse_rate)]
    rate: Option<u64>,
    /// Stop after this long, e.g. 10s or 500ms.
    #[arg(long, value_parser = parse_duration, conflicts_with = "size")]
    duration: Option<Duration>,
    /// Stop after this many bytes (synthetic: rounded up to whole blocks).
    #[arg(long)]
    size: Option<Size>,
    /// When every block is in use: wait, or drop blocks.
    #[arg(long, value_enum, default_value = "wait")]
    on_full: OnFull,
    /// What the blocks are made of: memfd, dma-heap or udmabuf.
    #[arg(long, default_value = "memfd")]
    memory: String,
    /// Write engine: uring-fixed, uring, pread-pool or read.
    #[arg(long, default_value_t = Engine::default())]
    engine: Engine,
    /// Writes in flight (io_uring engines).
    #[arg(long, default_value_t = DEFAULT_QUEUE_DEPTH)]
    queue_depth: usize,
    /// Skip the fsyncs (scratch captures).
    #[arg(long)]
    no_sync: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Internal: run as the producer, connecting to this socket.
    #[arg(long, hide = true)]
    producer_socket: Option<PathBuf>,
}

pub fn parse_rate(text: &str) -> Result<u64, String> {
    let bytes = text.strip_suffix("/s").ok_or_else(|| format!("rate {text:?} must end in /s, e.g. 2G/s"))?;
    match parse_size(bytes)? {
        0 => Err("a rate of 0 bytes per second".into()),
        rate => Ok(rate),
    }
}

pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(text.len()));
    let value: f64 =
        number.parse().map_err(|_| format!("duration {text:?}: expected e.g. 10s, 500ms, 2m"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" | "" => value,
        "m" => value * 60.0,
        _ => return Err(format!("duration {text:?}: unit must be ms, s or m")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("duration {text:?}: {e}"))
}

/// Sequence numbers `first..=last` that never reached the consumer.
type Range = (u64, u64);

/// What the producer sends back when the stream is done.
#[derive(Serialize, Deserialize)]
struct ProducerReport {
    blocks: u64,
    bytes: u64,
    dropped: u64,
    dropped_ranges: Vec<Range>,
    cpu_seconds: f64,
}

#[derive(Serialize)]
struct Report {
    target: String,
    source: String,
    memory: QueueMemory,
    block_size: usize,
    blocks_in_ring: usize,
    on_full: OnFull,
    complete: bool,
    stream_error: Option<String>,
    bytes: u64,
    blocks: u64,
    seconds: f64,
    mib_per_second: f64,
    dropped: u64,
    dropped_ranges: Vec<Range>,
    /// Blocks the consumer found missing from the sequence tags (and after
    /// the last, from the producer's count): must match `dropped`.
    gaps_seen: u64,
    producer_cpu_seconds: Option<f64>,
    consumer_cpu_seconds: f64,
    direct_bytes: u64,
    /// Engine calls, each writing a run of consecutive blocks.
    runs: u64,
    engine: String,
    filesystem: &'static str,
}

pub fn run(cmd: &CaptureCommand) -> Result<(), String> {
    if let Some(path) = &cmd.verify {
        return verify(path, cmd.json);
    }
    if let Some(socket) = &cmd.producer_socket {
        return produce(cmd, socket);
    }
    consume(cmd)
}

fn queue_options(cmd: &CaptureCommand) -> Result<BlockQueueOptions, String> {
    Ok(BlockQueueOptions {
        block_size: usize::try_from(cmd.block_size.0).map_err(|e| e.to_string())?,
        blocks: cmd.blocks,
        memory: cmd.memory.parse()?,
    })
}

/// A private directory for the rendezvous socket, removed on drop.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn new() -> Result<PrivateDir, String> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("dmaload-capture-{}-{nanos}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| format!("create {}: {e}", dir.display()))?;
        Ok(PrivateDir(dir))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts this program again as the producer of `cmd` and returns it with
/// the connection it made (checked to be that process's).
pub fn spawn_producer(cmd: &CaptureCommand, dir: &Path) -> Result<(Child, Connection), String> {
    let socket = dir.join("producer");
    let listener = Listener::bind(&socket, 1).map_err(|e| format!("bind {}: {e}", socket.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
    let mut args: Vec<String> = vec![
        "capture".into(),
        "--producer-socket".into(),
        socket.display().to_string(),
        "--source".into(),
        cmd.source.clone().unwrap_or_default(),
        "--to".into(),
        "-".into(),
        "--block-size".into(),
        cmd.block_size.0.to_string(),
        "--blocks".into(),
        cmd.blocks.to_string(),
        "--on-full".into(),
        match cmd.on_full {
            OnFull::Wait => "wait".into(),
            OnFull::Drop => "drop".into(),
        },
    ];
    if let Some(rate) = cmd.rate {
        args.extend(["--rate".into(), format!("{rate}/s")]);
    }
    if let Some(d) = cmd.duration {
        args.extend(["--duration".into(), format!("{}ms", d.as_millis())]);
    }
    if let Some(size) = cmd.size {
        args.extend(["--size".into(), size.0.to_string()]);
    }
    let mut child =
        Command::new(exe).args(&args).spawn().map_err(|e| format!("starting the producer: {e}"))?;
    let started = Instant::now();
    loop {
        match listener.accept_timeout(Duration::from_millis(100)) {
            Ok(Some(conn)) => {
                let pid = conn.peer_credentials().map_err(|e| e.to_string())?.pid;
                if pid != child.id() {
                    return Err(format!("process {pid} connected instead of the producer {}", child.id()));
                }
                return wait_source_open(child, conn, cmd.source.as_deref().unwrap_or_default());
            }
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for the producer: {e}")),
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("the producer exited before connecting ({status})"));
        }
        if started.elapsed() > START_TIMEOUT {
            let _ = child.kill();
            return Err("the producer did not connect within 30 s".into());
        }
    }
}

/// The producer's first message once its source is open; anything else is
/// why it could not open it.
const SOURCE_OPEN: &[u8] = b"dmaload capture: source open";

/// Waits for the producer to open its source. Where it cannot, its reason
/// is this process's error: one line, where each process would print its
/// own.
fn wait_source_open(mut child: Child, conn: Connection, source: &str) -> Result<(Child, Connection), String> {
    conn.set_timeouts(Some(START_TIMEOUT)).map_err(|e| e.to_string())?;
    let mut message = vec![0u8; 64 << 10];
    let failure = match conn.recv(&mut message) {
        Ok((len, _)) if &message[..len] == SOURCE_OPEN => return Ok((child, conn)),
        Ok((0, _)) => {
            let status = child.wait().map_or_else(|e| e.to_string(), |status| status.to_string());
            return Err(format!("the producer exited before opening {source} ({status})"));
        }
        Ok((len, _)) => String::from_utf8_lossy(&message[..len]).into_owned(),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            format!("the producer did not open {source} within 30 s")
        }
        Err(e) => format!("waiting for the producer to open {source}: {e}"),
    };
    let _ = child.kill();
    let _ = child.wait();
    Err(failure)
}

/// The consumer (this process): queue, capture to the file, reports.
fn consume(cmd: &CaptureCommand) -> Result<(), String> {
    let to = cmd.to.clone().ok_or("--to is required")?;
    let options = queue_options(cmd)?;
    let dir = PrivateDir::new()?;
    let (mut child, conn) = spawn_producer(cmd, &dir.0)?;
    let mut queue = match BlockQueue::create(conn, Role::Consumer, &options, Some(START_TIMEOUT)) {
        Ok(queue) => queue,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("setting up the block queue: {e}"));
        }
    };
    let capture_options = CaptureOptions {
        sync: !cmd.no_sync,
        engine: cmd.engine,
        queue_depth: cmd.queue_depth,
        expected_bytes: cmd.size.map(|s| s.0.next_multiple_of(options.block_size as u64)),
        ..CaptureOptions::default()
    };
    let mut last_tag: Option<u64> = None;
    let mut gaps_seen = 0u64;
    let outcome = capture_to_file(&mut queue, &to, &capture_options, |run| {
        for i in 0..run.blocks() {
            let tag = run.block(i).1;
            gaps_seen += tag.saturating_sub(last_tag.map_or(0, |t| t + 1));
            last_tag = Some(tag);
        }
    });
    let report = match outcome {
        Ok(report) => report,
        Err(e) => {
            // Nothing was committed; stop the producer too, before it sees
            // the queue close and adds "the consumer went away" to this
            // error.
            let _ = child.kill();
            drop(queue);
            let _ = child.wait();
            return Err(e.to_string());
        }
    };
    for fallback in &report.fallbacks {
        eprintln!("dmaload: fallback {fallback}");
    }
    let producer: Option<ProducerReport> = if report.complete {
        let mut buf = vec![0u8; 64 << 10];
        let conn = queue.connection();
        conn.set_timeouts(Some(START_TIMEOUT)).map_err(|e| e.to_string())?;
        match conn.recv(&mut buf) {
            Ok((len, _)) if len > 0 => serde_json::from_slice(&buf[..len]).ok(),
            _ => None,
        }
    } else {
        None
    };
    drop(queue);
    // Blocks dropped after the last one delivered leave no gap in the tags.
    if let Some(p) = &producer {
        gaps_seen += p.blocks.saturating_sub(last_tag.map_or(0, |t| t + 1));
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let consumer_cpu = process_cpu_seconds().map_err(|e| e.to_string())?;
    let seconds = report.seconds;
    let out = Report {
        target: report.target.display().to_string(),
        source: cmd.source.clone().unwrap_or_default(),
        memory: options.memory,
        block_size: options.block_size,
        blocks_in_ring: options.blocks,
        on_full: cmd.on_full,
        complete: report.complete && status.success(),
        stream_error: report.stream_error.clone(),
        bytes: report.bytes,
        blocks: report.blocks,
        seconds,
        mib_per_second: report.bytes as f64 / (1 << 20) as f64 / seconds.max(1e-9),
        dropped: producer.as_ref().map_or(gaps_seen, |p| p.dropped),
        dropped_ranges: producer.as_ref().map_or_else(Vec::new, |p| p.dropped_ranges.clone()),
        gaps_seen,
        producer_cpu_seconds: producer.as_ref().map(|p| p.cpu_seconds),
        consumer_cpu_seconds: consumer_cpu,
        direct_bytes: report.direct_bytes,
        runs: report.runs,
        engine: report.engine.name().to_owned(),
        filesystem: report.filesystem,
    };
    if cmd.json {
        outln!("{}", serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?);
    } else {
        outln!(
            "captured {} blocks, {} bytes to {} in {:.3} s ({:.1} MiB/s); dropped {}; CPU: producer {}, consumer {:.3} s",
            out.blocks,
            out.bytes,
            out.target,
            out.seconds,
            out.mib_per_second,
            out.dropped,
            out.producer_cpu_seconds.map_or("unknown".into(), |c| format!("{c:.3} s")),
            out.consumer_cpu_seconds
        );
        for (first, last) in &out.dropped_ranges {
            outln!("dropped blocks {first}..={last}");
        }
    }
    if let Some(why) = &out.stream_error {
        return Err(format!(
            "the capture stopped after {} blocks (all of them are in {}): {why}",
            out.blocks, out.target
        ));
    }
    if !status.success() {
        return Err(format!("the producer failed ({status})"));
    }
    Ok(())
}

/// Where the producer's blocks come from.
enum Source {
    /// One block of generated bytes, restamped for each block, and the
    /// hash of what lies between stamp and trailer.
    Synthetic {
        block: Vec<u8>,
        payload_hash: u64,
    },
    File(File),
}

/// The producer (the re-executed process).
fn produce(cmd: &CaptureCommand, socket: &Path) -> Result<(), String> {
    let source_name = cmd.source.clone().ok_or("--source is required")?;
    let conn = Connection::connect(socket).map_err(|e| format!("connect {}: {e}", socket.display()))?;
    // Opened before the queue exists: a source that cannot be opened fails
    // the capture before any file is created.
    let file = match source_name.as_str() {
        "synthetic" => None,
        // A directory or a socket fails at once; a FIFO's writer is waited
        // for, as long as the consumer waits for this open (START_TIMEOUT).
        path => match dmaload::source::open_stream(Path::new(path)) {
            Ok(file) => Some(file),
            Err(e) => {
                let why = e.to_string();
                if conn.send(why.as_bytes(), &[]).is_ok() {
                    // The consumer fails the capture with it: said once.
                    std::process::exit(1);
                }
                return Err(why);
            }
        },
    };
    conn.send(SOURCE_OPEN, &[]).map_err(|e| format!("telling the consumer the source is open: {e}"))?;
    let mut queue = BlockQueue::attach(conn, Some(START_TIMEOUT)).map_err(|e| e.to_string())?;
    let block = queue.block_size();
    let mut source = if let Some(file) = file {
        Source::File(file)
    } else {
        let block: Vec<u8> =
            (0..block).map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15 >> 7) as u8).collect();
        let payload_hash = xxh3_64(&block[STAMP_LEN..block.len() - TRAILER_LEN]);
        Source::Synthetic { block, payload_hash }
    };
    let limit = cmd.size.map(|s| s.0);
    let started = Instant::now();
    let (mut seq, mut bytes, mut dropped) = (0u64, 0u64, 0u64);
    let mut ranges: Vec<Range> = Vec::new();
    let mut scratch = Vec::new();
    loop {
        if cmd.duration.is_some_and(|d| started.elapsed() >= d) || limit.is_some_and(|l| bytes >= l) {
            break;
        }
        if let Some(rate) = cmd.rate {
            // Block `seq` is due once the stream has run seq × block / rate.
            let due = Duration::from_secs_f64(seq as f64 * block as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        let want = match (&source, limit) {
            (Source::File(_), Some(l)) => ((l - bytes) as usize).min(block),
            _ => block,
        };
        let free = match cmd.on_full {
            OnFull::Wait => Some(queue.dequeue_free(None).map_err(|e| e.to_string())?),
            OnFull::Drop => queue.try_dequeue_free().map_err(|e| e.to_string())?,
        };
        let len = match (free, &mut source) {
            (Some(mut free), Source::Synthetic { block: stamped, payload_hash }) => {
                stamp(stamped, seq, *payload_hash);
                free.bytes_mut().write_at(0, stamped).map_err(|e| e.to_string())?;
                free.enqueue(block, seq).map_err(|e| e.to_string())?;
                block
            }
            (Some(mut free), Source::File(file)) => {
                let mut filled = 0;
                while filled < want {
                    match free.read_from(file.as_fd(), filled..want) {
                        Ok(0) => break,
                        Ok(n) => filled += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(format!("read {source_name}: {e}")),
                    }
                }
                if filled == 0 {
                    break;
                }
                free.enqueue(filled, seq).map_err(|e| e.to_string())?;
                filled
            }
            (None, Source::Synthetic { .. }) => {
                note_drop(&mut ranges, &mut dropped, seq);
                block
            }
            (None, Source::File(file)) => {
                // A capture device does not wait: its data is read and lost.
                scratch.resize(want, 0);
                let n = read_full(file, &mut scratch).map_err(|e| format!("read {source_name}: {e}"))?;
                if n == 0 {
                    break;
                }
                note_drop(&mut ranges, &mut dropped, seq);
                n
            }
        };
        seq += 1;
        bytes += len as u64;
    }
    queue.finish().map_err(|e| e.to_string())?;
    queue.wait_drained(None).map_err(|e| e.to_string())?;
    ranges.truncate(MAX_LISTED_RANGES);
    let report = ProducerReport {
        blocks: seq,
        bytes,
        dropped,
        dropped_ranges: ranges,
        cpu_seconds: process_cpu_seconds().map_err(|e| e.to_string())?,
    };
    let json = serde_json::to_vec(&report).map_err(|e| e.to_string())?;
    queue.connection().send(&json, &[]).map_err(|e| format!("sending the report: {e}"))?;
    Ok(())
}

fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn note_drop(ranges: &mut Vec<Range>, dropped: &mut u64, seq: u64) {
    *dropped += 1;
    match ranges.last_mut() {
        Some((_, last)) if *last + 1 == seq => *last = seq,
        _ => ranges.push((seq, seq)),
    }
}

/// The checksum of block `seq` whose payload hashes to `payload_hash`.
fn checksum(payload_hash: u64, seq: u64) -> u64 {
    payload_hash ^ seq.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Writes the stamp and trailer of block `seq` into `block`.
fn stamp(block: &mut [u8], seq: u64, payload_hash: u64) {
    let sum = checksum(payload_hash, seq);
    let end = block.len();
    block[end - TRAILER_LEN..].copy_from_slice(&seq.to_le_bytes());
    block[..8].copy_from_slice(STAMP_MAGIC);
    block[8..16].copy_from_slice(&seq.to_le_bytes());
    let len = block.len() as u64;
    block[16..24].copy_from_slice(&len.to_le_bytes());
    block[24..32].copy_from_slice(&sum.to_le_bytes());
}

#[derive(Serialize)]
struct Verdict {
    file: String,
    blocks: u64,
    bytes: u64,
    first_sequence: Option<u64>,
    missing: u64,
    missing_ranges: Vec<Range>,
    bad_blocks: Vec<String>,
    ok: bool,
}

/// `--verify`: reads the capture block by block (each stamp gives its
/// length) and checks magic, order and checksum.
fn verify(path: &Path, json: bool) -> Result<(), String> {
    // Never waits on a FIFO: only a regular file (or block device) is checked.
    let refusal = "is not a capture file: --verify reads the file a capture wrote";
    let mut file = dmaload::source::open_regular(path, refusal).map_err(|e| e.to_string())?;
    let mut verdict = Verdict {
        file: path.display().to_string(),
        blocks: 0,
        bytes: 0,
        first_sequence: None,
        missing: 0,
        missing_ranges: Vec::new(),
        bad_blocks: Vec::new(),
        ok: false,
    };
    let mut expected = 0u64;
    let mut header = [0u8; STAMP_LEN];
    let mut block = Vec::new();
    loop {
        let n = read_full(&mut file, &mut header).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        let at = verdict.bytes;
        let word = |i: usize| u64::from_le_bytes(header[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        if n < STAMP_LEN
            || &header[..8] != STAMP_MAGIC
            || !((STAMP_LEN + TRAILER_LEN) as u64..=64 << 20).contains(&word(2))
        {
            verdict.bad_blocks.push(format!("no block stamp at byte {at}"));
            break;
        }
        let (seq, len, sum) = (word(1), word(2) as usize, word(3));
        block.resize(len - STAMP_LEN, 0);
        let got = read_full(&mut file, &mut block).map_err(|e| e.to_string())?;
        verdict.bytes += (STAMP_LEN + got) as u64;
        if got < block.len() {
            verdict.bad_blocks.push(format!("block {seq} at byte {at} is cut short"));
            break;
        }
        let (payload, trailer) = block.split_at(block.len() - TRAILER_LEN);
        if checksum(xxh3_64(payload), seq) != sum {
            verdict.bad_blocks.push(format!("block {seq} at byte {at}: checksum mismatch"));
        }
        if trailer != seq.to_le_bytes() {
            verdict
                .bad_blocks
                .push(format!("block {seq} at byte {at}: its last bytes belong to another block"));
        }
        verdict.first_sequence.get_or_insert(seq);
        if seq < expected {
            verdict
                .bad_blocks
                .push(format!("block {seq} at byte {at} is out of order (expected {expected})"));
        } else if seq > expected {
            verdict.missing += seq - expected;
            if verdict.missing_ranges.len() < MAX_LISTED_RANGES {
                verdict.missing_ranges.push((expected, seq - 1));
            }
        }
        expected = seq + 1;
        verdict.blocks += 1;
    }
    verdict.ok = verdict.blocks > 0 && verdict.missing == 0 && verdict.bad_blocks.is_empty();
    if json {
        outln!("{}", serde_json::to_string_pretty(&verdict).map_err(|e| e.to_string())?);
    } else {
        outln!(
            "{}: {} blocks, {} bytes, {} missing, {} bad",
            verdict.file,
            verdict.blocks,
            verdict.bytes,
            verdict.missing,
            verdict.bad_blocks.len()
        );
        for (first, last) in &verdict.missing_ranges {
            outln!("missing blocks {first}..={last}");
        }
        for bad in &verdict.bad_blocks {
            outln!("{bad}");
        }
    }
    if verdict.ok {
        Ok(())
    } else {
        Err(format!("{} is not a complete synthetic capture", path.display()))
    }
}
