//! Random O_DIRECT reads at a fixed queue depth and block size, into
//! registered or plain buffers: seed 003's IOPS / submission-latency / CPU
//! table, with io_uring as the loader uses it (`READ_FIXED` from one
//! registered buffer, or `READ` with pages pinned per I/O).

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use dmaload::{Error, ErrorKind, Result};
use serde::Serialize;

use crate::sys::uring::{Completion, ReadRing};

/// One cell of the table.
#[derive(Debug, Clone, Copy)]
pub struct RandomReadOptions {
    pub block_size: usize,
    pub queue_depth: usize,
    /// Read into registered buffers (`READ_FIXED`) instead of plain ones.
    pub registered: bool,
    /// How long to keep reading.
    pub duration: Duration,
    /// Seed of the offset sequence (same seed, same offsets).
    pub seed: u64,
}

/// What one cell measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RandomReadStats {
    pub ios: u64,
    pub seconds: f64,
    pub iops: f64,
    /// Mean wall time of the `io_uring_enter` calls that submitted reads,
    /// per read submitted: with direct I/O the kernel issues each read
    /// (and, without registration, pins its buffer) inside this call.
    pub mean_submit_ns: f64,
    /// System CPU time of the process over wall time, in percent.
    pub sys_cpu_percent: f64,
}

/// xorshift64*: cheap, and reproducible from the seed.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Random block-aligned O_DIRECT reads of the file at `path` for
/// `options.duration`, `queue_depth` in flight, each checked for a full
/// block.
pub fn random_reads(path: impl AsRef<Path>, options: &RandomReadOptions) -> Result<RandomReadStats> {
    let path = path.as_ref();
    let bs = options.block_size;
    let qd = options.queue_depth;
    let file = dmaload::source::open_for_reading(path)?;
    crate::transfer::set_direct(&file, true).map_err(|e| Error::io("fcntl(O_DIRECT)", path, e))?;
    let size = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
    let blocks = size / bs.max(1) as u64;
    if bs == 0 || bs % 512 != 0 || qd == 0 || qd > 4096 || blocks == 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "random reads",
            path,
            format!("block size {bs} (a multiple of 512), queue depth {qd} (1-4096) and a file of at least one block ({size} bytes) are needed"),
        ));
    }
    let mut ring =
        ReadRing::new(qd, bs, options.registered).map_err(|e| Error::io("io_uring setup", path, e))?;
    run(&mut ring, &file, path, blocks, options)
}

fn run(
    ring: &mut ReadRing,
    file: &File,
    path: &Path,
    blocks: u64,
    options: &RandomReadOptions,
) -> Result<RandomReadStats> {
    let bs = options.block_size;
    let mut state = options.seed | 1;
    let mut free: Vec<usize> = (0..options.queue_depth).collect();
    let mut completions: Vec<Completion> = Vec::with_capacity(options.queue_depth);
    let (mut ios, mut submitted, mut submit_time) = (0u64, 0u64, Duration::ZERO);
    let cpu_before = dmaload::system::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let started = Instant::now();
    loop {
        let running = started.elapsed() < options.duration;
        if running && !free.is_empty() {
            let queued = free.len();
            for slot in free.drain(..) {
                let offset = next_random(&mut state) % blocks * bs as u64;
                ring.queue_read(file.as_fd(), slot, offset)
                    .map_err(|e| Error::io("read", path, e).at(offset))?;
            }
            let t = Instant::now();
            ring.submit(0).map_err(|e| Error::io("io_uring_enter", path, e))?;
            submit_time += t.elapsed();
            submitted += queued as u64;
        }
        if ring.in_flight() == 0 {
            break;
        }
        ring.submit(1).map_err(|e| Error::io("io_uring_enter", path, e))?;
        completions.clear();
        ring.reap(&mut completions);
        for done in &completions {
            if done.result != bs as i32 {
                let err = if done.result < 0 {
                    io::Error::from_raw_os_error(-done.result)
                } else {
                    io::Error::other(format!("short read: {} of {bs} bytes", done.result))
                };
                return Err(Error::io("read", path, err));
            }
            ios += 1;
            free.push(done.slot);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_after = dmaload::system::cpu_time().map_err(|e| Error::io("getrusage", path, e))?;
    let sys_cpu = cpu_after.1.saturating_sub(cpu_before.1).as_secs_f64();
    Ok(RandomReadStats {
        ios,
        seconds,
        iops: ios as f64 / seconds.max(1e-9),
        mean_submit_ns: submit_time.as_nanos() as f64 / submitted.max(1) as f64,
        sys_cpu_percent: sys_cpu / seconds.max(1e-9) * 100.0,
    })
}
