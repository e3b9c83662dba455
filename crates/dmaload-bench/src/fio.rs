//! fio, the ceiling the benchmarks compare with: one runner for its
//! sequential O_DIRECT io_uring jobs (registered buffers and files, as the
//! default engine), reads and writes alike.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// fio's version, or `None` where fio is not installed.
pub fn available() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Which way a job moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rw {
    /// Reads the whole file (`--rw=read`).
    Read,
    /// Writes `size` bytes, then fsyncs (`--rw=write --end_fsync=1`).
    Write,
}

/// One sequential job.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    pub rw: Rw,
    pub file: &'a Path,
    /// `--bs`: bytes per request.
    pub block_size: u64,
    pub iodepth: u32,
    /// `--size`: bytes to write (writes only; reads take the file's size).
    pub size: Option<u64>,
    /// Buffers in hugetlb pages (`--iomem=shmhuge`) instead of malloc's.
    pub huge_buffers: bool,
}

/// What a job reported.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    /// Bytes read or written.
    pub bytes: u64,
    /// The reads' or writes' own runtime (fio's `read.runtime` /
    /// `write.runtime`).
    pub io_seconds: f64,
    /// The job's runtime, its closing fsync included (`job_runtime`), its
    /// start-up and file layout not.
    pub job_seconds: f64,
    /// The job's user + system CPU seconds, as fio measures them:
    /// getrusage of the job's own thread (`RUSAGE_THREAD` on Linux, whole
    /// milliseconds) from the start of its I/O to its end, reported as
    /// `usr_cpu` and `sys_cpu`, percentages of `job_runtime`. fio's
    /// start-up (its clock calibration, ~0.15 s of CPU on the development
    /// VM) and its other threads are not in it.
    pub cpu_seconds: f64,
}

/// Runs `job` and reads fio's JSON report.
pub fn run(job: &Job<'_>) -> Result<Outcome, String> {
    let mut cmd = Command::new("fio");
    cmd.args(["--name=dmaload-bench", "--ioengine=io_uring", "--direct=1", "--fixedbufs", "--registerfiles"])
        .arg(format!("--filename={}", job.file.display()))
        .arg(format!("--bs={}", job.block_size))
        .arg(format!("--iodepth={}", job.iodepth))
        .arg(format!("--iomem={}", if job.huge_buffers { "shmhuge" } else { "malloc" }))
        .arg("--output-format=json");
    match job.rw {
        Rw::Read => cmd.arg("--rw=read"),
        Rw::Write => cmd.args(["--rw=write", "--end_fsync=1"]),
    };
    if let Some(size) = job.size {
        cmd.arg(format!("--size={size}"));
    }
    let out = cmd.output().map_err(|e| format!("running fio: {e}"))?;
    if !out.status.success() {
        return Err(format!("fio failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    let report: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("parsing fio JSON: {e}"))?;
    let stats = &report["jobs"][0];
    let side = &stats[if job.rw == Rw::Read { "read" } else { "write" }];
    let field = |v: &Value| v.as_f64().ok_or_else(|| format!("fio JSON lacks a field: {stats}"));
    let bytes = side["io_bytes"].as_u64().ok_or_else(|| format!("fio JSON lacks io_bytes: {stats}"))?;
    if job.size.is_some_and(|size| size != bytes) {
        return Err(format!("fio moved {bytes} bytes, not {}", job.size.unwrap_or(0)));
    }
    let job_seconds = field(&stats["job_runtime"])? / 1e3;
    Ok(Outcome {
        bytes,
        io_seconds: field(&side["runtime"])? / 1e3,
        job_seconds,
        // The percentages are of job_runtime: back to the job's seconds.
        cpu_seconds: (field(&stats["usr_cpu"])? + field(&stats["sys_cpu"])?) / 100.0 * job_seconds,
    })
}
