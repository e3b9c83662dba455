//! `dmaload-bench cache`: what the model-cache service buys a fresh
//! process, against loading the file itself, in one run. Each round runs
//! every row once, in a shuffled order that changes from round to round
//! (`benchkit::round_order`), every load in a fresh process, each row
//! after its own preparation:
//!
//! - cold direct: `dmaload load FILE`, no service, the file evicted;
//! - miss: `dmaload load --cache` to a fresh `dmaload serve`, the file
//!   evicted (the service reads the disk and hands the memfd over);
//! - hit: `dmaload load --cache` to a service that holds the file,
//!   collapsed (the one a miss row left, else a fresh one given the file
//!   by an untimed miss): no disk read; the time is connecting, receiving
//!   the memfd and mapping it, no page of it touched;
//! - Python, service holding the file (as a hit):
//!   `dmaload.safetensors.load_file(FILE, cache=)` for NumPy and PyTorch;
//! - Python, no service, the file read into the page cache:
//!   `safetensors.numpy.load_file` and `safetensors.torch.load_file`.
//!
//! Times are those each child measures around its load call; the Python
//! children also touch one byte per page of every tensor afterwards
//! (reported apart: a mapping handed over is faulted in on first touch).
//! The `dmaload` command run is `benchkit::dmaload_exe`'s.
//! Every load is checked against the file, after its timing: the CLI's
//! xxh3 of the whole buffer (`--hash`), the Python children's tensor count
//! and sum of the bytes they touched.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use serde_json::Value;

use crate::benchkit::{evict, Spread};
use crate::units::{human_bytes, Size};

#[derive(Args)]
pub struct CacheArgs {
    /// A safetensors file (default: a generated sample model of --size).
    file: Option<PathBuf>,
    /// Size of the generated sample model when no FILE is given.
    #[arg(long, default_value = "2G")]
    size: Size,
    /// Rounds (each runs every row once; the miss with a fresh service).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// The Python that runs the safetensors rows (needs dmaload, numpy,
    /// torch and safetensors importable; rows it cannot run are skipped).
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// Print one JSON object instead of a Markdown table.
    #[arg(long)]
    json: bool,
}

/// The Python child: loads with one method, prints its times as JSON.
const PYTHON_CHILD: &str = r#"
import json, sys, time
method, path, sock = sys.argv[1], sys.argv[2], sys.argv[3]
if method.endswith("pt"):
    import torch
else:
    import numpy as np
if method.startswith("dmaload"):
    import dmaload.safetensors as dst
    framework = method.split("-")[1]
    start = time.perf_counter()
    tensors = dst.load_file(path, framework=framework, cache=sock)
else:
    import safetensors.numpy as stn, safetensors.torch as stt
    start = time.perf_counter()
    tensors = (stt if method.endswith("pt") else stn).load_file(path)
seconds = time.perf_counter() - start
start = time.perf_counter()
total = 0
for t in tensors.values():
    flat = t.reshape(-1).view(torch.uint8) if method.endswith("pt") else t.reshape(-1).view(np.uint8)
    total += int(flat[::4096].sum())
touch = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "touch_seconds": touch, "tensors": len(tensors), "checksum": total}))
"#;

#[derive(Debug, Serialize)]
struct Row {
    method: String,
    /// The child's time for the load call, per round.
    seconds: Vec<f64>,
    /// The Python children's time to touch every page afterwards.
    touch_seconds: Vec<f64>,
    median_seconds: f64,
    /// Python rows: the median of load + touch per round, the time until
    /// every page of every tensor has been read once (a lazily mapped
    /// file's reads happen in the touch, not the load call).
    median_ready_seconds: Option<f64>,
    median_gib_per_second: f64,
    /// Median cold direct time over this row's median.
    speedup_over_cold_direct: f64,
    skipped: Option<String>,
}

#[derive(Debug, Serialize)]
struct Table {
    file: String,
    bytes: u64,
    repeat: usize,
    rows: Vec<Row>,
    /// The cold direct load (the disk read into memory) over the CLI hit
    /// (the service's memfd received and mapped, no page touched), target
    /// >= 20.
    cold_over_hit: f64,
    /// safetensors numpy warm / dmaload numpy from the service (load +
    /// touch), target >= 10.
    safetensors_numpy_over_cached: Option<f64>,
    /// safetensors torch warm / dmaload torch from the service (load +
    /// touch), target >= 10.
    safetensors_torch_over_cached: Option<f64>,
    /// The pages the service held the file in when the hits ran.
    service_pages: String,
    /// Per round: seconds from the miss's return until the service had
    /// collapsed the file into 2 MiB pages (the hits wait for it).
    collapse_seconds: Vec<f64>,
    /// Per round, the rows in the order they ran (indices into `rows`).
    orders: Vec<Vec<usize>>,
}

// The rows, by their index in `METHODS`.
const COLD_DIRECT: usize = 0;
const MISS: usize = 1;
const HIT: usize = 2;
const DMALOAD_NUMPY: usize = 3;
const DMALOAD_TORCH: usize = 4;
const SAFETENSORS_NUMPY: usize = 5;

const METHODS: [&str; 7] = [
    "dmaload load, cold (direct)",
    "dmaload load --cache, service cold (miss)",
    "dmaload load --cache, service warm (hit)",
    "dmaload.safetensors np, cache= (hit)",
    "dmaload.safetensors pt, cache= (hit)",
    "safetensors.numpy, warm page cache",
    "safetensors.torch, warm page cache",
];

pub fn run(args: &CacheArgs) -> Result<(), String> {
    let file = match &args.file {
        Some(file) => file.clone(),
        None => {
            let dir = crate::benchkit::default_dir();
            crate::sample::cached_model(&dir, args.size.0).map_err(|e| format!("sample model: {e}"))?.0
        }
    };
    let bytes = std::fs::metadata(&file).map_err(|e| format!("stat {}: {e}", file.display()))?.len();
    let exe = crate::benchkit::dmaload_exe()?;
    let scratch = tempfile_dir()?;
    let socket = scratch.join("cache.sock");
    let expected = reference(&file)?;
    let mut samples: Vec<(Vec<f64>, Vec<f64>, Option<String>)> =
        vec![(Vec::new(), Vec::new(), None); METHODS.len()];
    let mut collapse_seconds = Vec::new();
    let mut service_pages = String::new();
    let mut orders = Vec::new();
    // The service the hit rows use, once it holds the file.
    let mut service: Option<Child> = None;
    let mut rounds = || -> Result<(), String> {
        for round in 0..args.repeat.max(1) {
            eprintln!("bench cache: round {} of {}", round + 1, args.repeat.max(1));
            let order = crate::benchkit::round_order(METHODS.len(), round);
            for &row in &order {
                if samples[row].2.is_some() {
                    continue; // a row that cannot run here (no such Python or package)
                }
                match row {
                    COLD_DIRECT => {
                        stop_service(service.take())?;
                        evict(&file)?;
                        samples[row].0.push(cli_load(&exe, &file, None, expected.xxh3)?);
                    }
                    MISS => {
                        stop_service(service.take())?;
                        let served = serve_file(&exe, &file, &socket, expected.xxh3)?;
                        samples[row].0.push(served.miss_seconds);
                        collapse_seconds.extend(served.collapse_seconds);
                        service_pages = served.pages;
                        service = Some(served.child);
                    }
                    HIT | DMALOAD_NUMPY | DMALOAD_TORCH => {
                        if service.is_none() {
                            let served = serve_file(&exe, &file, &socket, expected.xxh3)?;
                            service_pages = served.pages;
                            service = Some(served.child);
                        }
                        if row == HIT {
                            samples[row].0.push(cli_load(&exe, &file, Some(&socket), expected.xxh3)?);
                        } else {
                            let method = if row == DMALOAD_NUMPY { "dmaload-np" } else { "dmaload-pt" };
                            let loaded = python_load(&args.python, method, &file, &socket, expected.touched)?;
                            record(&mut samples[row], loaded);
                        }
                    }
                    _ => {
                        stop_service(service.take())?;
                        warm(&file)?;
                        let method =
                            if row == SAFETENSORS_NUMPY { "safetensors-np" } else { "safetensors-pt" };
                        record(
                            &mut samples[row],
                            python_load(&args.python, method, &file, &socket, expected.touched)?,
                        );
                    }
                }
            }
            orders.push(order);
        }
        Ok(())
    };
    let ran = rounds();
    // The service stops whether or not the rounds completed.
    let stopped = stop_service(service.take());
    ran?;
    stopped?;
    let _ = std::fs::remove_dir_all(&scratch);
    let cold = Spread::of(&samples[COLD_DIRECT].0).median;
    let rows: Vec<Row> = samples
        .into_iter()
        .zip(METHODS)
        .map(|((seconds, touch_seconds, skipped), method)| {
            let median = Spread::of(&seconds).median;
            let ready: Vec<f64> =
                seconds.iter().zip(&touch_seconds).map(|(load, touch)| load + touch).collect();
            Row {
                median_ready_seconds: (!ready.is_empty()).then(|| Spread::of(&ready).median),
                method: method.to_owned(),
                median_gib_per_second: if median > 0.0 {
                    bytes as f64 / (1u64 << 30) as f64 / median
                } else {
                    0.0
                },
                speedup_over_cold_direct: if median > 0.0 { cold / median } else { 0.0 },
                median_seconds: median,
                seconds,
                touch_seconds,
                skipped,
            }
        })
        .collect();
    let ratio = |slow: usize, fast: usize| {
        (rows[slow].median_seconds > 0.0 && rows[fast].median_seconds > 0.0)
            .then(|| rows[slow].median_seconds / rows[fast].median_seconds)
    };
    // Tensors are compared ready to use: loaded and every page read once.
    let ready_ratio =
        |slow: usize, fast: usize| match (rows[slow].median_ready_seconds, rows[fast].median_ready_seconds) {
            (Some(slow), Some(fast)) if slow > 0.0 && fast > 0.0 => Some(slow / fast),
            _ => None,
        };
    let table = Table {
        file: file.display().to_string(),
        bytes,
        repeat: args.repeat.max(1),
        cold_over_hit: ratio(COLD_DIRECT, HIT).unwrap_or(0.0),
        safetensors_numpy_over_cached: ready_ratio(SAFETENSORS_NUMPY, DMALOAD_NUMPY),
        safetensors_torch_over_cached: ready_ratio(SAFETENSORS_NUMPY + 1, DMALOAD_TORCH),
        service_pages,
        collapse_seconds,
        orders,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string(&table).map_err(|e| e.to_string())?);
    } else {
        print!("{}", markdown(&table));
    }
    Ok(())
}

fn record(sample: &mut (Vec<f64>, Vec<f64>, Option<String>), result: Result<(f64, f64), String>) {
    match result {
        Ok((seconds, touch)) => {
            sample.0.push(seconds);
            sample.1.push(touch);
        }
        Err(why) => sample.2 = Some(why),
    }
}

fn markdown(t: &Table) -> String {
    let mut s = format!(
        "File {} ({}), {} rounds, the rows in a shuffled order each round, each after its own \
         preparation (cold: no service, file evicted; miss: a fresh service, file evicted; hits: a \
         service holding the file; warm page cache: no service, file read); each load in a fresh \
         process; times are medians (min–max) of the load call (a hit's: receiving and mapping the \
         service's memfd, no page touched), \"touch\" the Python child's pass over one byte per page \
         afterwards. The hits ran with the service's copy in {} pages{}.\n\n\
         | method | load s | GiB/s | touch s | cold direct / this |\n|---|---|---|---|---|\n",
        t.file,
        human_bytes(t.bytes),
        t.repeat,
        t.service_pages,
        if t.collapse_seconds.is_empty() {
            String::new()
        } else {
            format!(
                ", collapsed from 4 KiB pages in the background in {} s after the miss (the hits waited)",
                Spread::of(&t.collapse_seconds).show(1)
            )
        }
    );
    for row in &t.rows {
        if let Some(why) = &row.skipped {
            s += &format!("| {} | skipped: {why} | | | |\n", row.method);
            continue;
        }
        let touch =
            if row.touch_seconds.is_empty() { "–".into() } else { Spread::of(&row.touch_seconds).show(3) };
        s += &format!(
            "| {} | {} | {:.2} | {} | {:.1}× |\n",
            row.method,
            Spread::of(&row.seconds).show(3),
            row.median_gib_per_second,
            touch,
            row.speedup_over_cold_direct
        );
    }
    s += &format!(
        "\ncold direct load (disk read into memory) / `load --cache` hit (memfd mapped, no page touched): \
         {:.1}× (target ≥ 20×)\n",
        t.cold_over_hit
    );
    for (name, ratio) in
        [("numpy", t.safetensors_numpy_over_cached), ("torch", t.safetensors_torch_over_cached)]
    {
        if let Some(ratio) = ratio {
            s += &format!(
                "safetensors.{name} warm / dmaload cache= {name}, load + touch: {ratio:.1}× (target ≥ 10×)\n"
            );
        }
    }
    s
}

fn tempfile_dir() -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("dmaload-bench-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// What every load of the file must give: the xxh3 of its bytes (the CLI
/// rows) and, for a safetensors file, its tensor count and the sum of the
/// bytes the Python child touches (the Python rows).
struct Expected {
    xxh3: u64,
    touched: Option<(u64, u64)>,
}

/// The reference, read from the file itself (then evicted).
fn reference(file: &Path) -> Result<Expected, String> {
    let f = std::fs::File::open(file).map_err(|e| format!("open {}: {e}", file.display()))?;
    let expected = expected_of(f).map_err(|e| format!("read {}: {e}", file.display()))?;
    evict(file)?;
    Ok(expected)
}

/// [`Expected`] of the bytes `r` reads, in 8 MiB blocks. The tensor count
/// and sum are as the Python child computes them over a safetensors file:
/// one byte every 4096 from the start of each tensor's data; `None` where
/// the bytes are not a safetensors file.
fn expected_of(mut r: impl Read) -> std::io::Result<Expected> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut head = [0u8; 8];
    let mut filled = 0;
    while filled < 8 {
        match r.read(&mut head[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    hasher.update(&head[..filled]);
    // A safetensors header is at most 100 MB.
    let n = u64::from_le_bytes(head);
    let mut header = Vec::new();
    if filled == 8 && n <= 100_000_000 {
        r.by_ref().take(n).read_to_end(&mut header)?;
        hasher.update(&header);
    }
    let ranges: Option<Vec<(u64, u64)>> =
        serde_json::from_slice::<serde_json::Map<String, Value>>(&header).ok().and_then(|map| {
            map.iter()
                .filter(|(name, _)| *name != "__metadata__")
                .map(|(_, info)| Some((info["data_offsets"][0].as_u64()?, info["data_offsets"][1].as_u64()?)))
                .collect()
        });
    let mut sum = 0u64;
    let mut block = vec![0u8; 8 << 20];
    let mut at = 0u64; // offset in the data, past the header
    loop {
        let got = r.read(&mut block)?;
        if got == 0 {
            break;
        }
        hasher.update(&block[..got]);
        for &(begin, end) in ranges.iter().flatten() {
            // The first position begin + k*4096 at or after this block's start.
            let from = if begin >= at { begin } else { begin + (at - begin).div_ceil(4096) * 4096 };
            let to = end.min(at + got as u64);
            let mut p = from;
            while p < to {
                sum += u64::from(block[(p - at) as usize]);
                p += 4096;
            }
        }
        at += got as u64;
    }
    let touched = ranges.filter(|r| r.iter().all(|&(begin, end)| begin <= end && end <= at));
    Ok(Expected { xxh3: hasher.digest(), touched: touched.map(|r| (r.len() as u64, sum)) })
}

/// `dmaload load FILE --json --hash` (with `--cache SOCKET`) in a fresh
/// process: the load time it reports, once its hash (taken after the
/// timing) is `xxh3`.
fn cli_load(exe: &Path, file: &Path, socket: Option<&Path>, xxh3: u64) -> Result<f64, String> {
    let mut cmd = Command::new(exe);
    cmd.args(["load", "--json", "--hash", "--no-page-cache"]).arg(file).env_remove("DMALOAD_CACHE");
    if let Some(socket) = socket {
        cmd.arg("--cache").arg(socket);
    }
    let out = cmd.output().map_err(|e| format!("run {}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!("dmaload load failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    if socket.is_some() && !String::from_utf8_lossy(&out.stderr).contains("from the cache service") {
        return Err(format!("not served by the cache service: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let report: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("load --json: {e}"))?;
    let got = report["hash"]["xxh3_64"].as_str().unwrap_or("none");
    if got != format!("{xxh3:016x}") {
        return Err(format!(
            "dmaload load{}: xxh3 {got}, the file's is {xxh3:016x}",
            if socket.is_some() { " --cache" } else { "" }
        ));
    }
    report["total_seconds"].as_f64().ok_or_else(|| "load --json has no total_seconds".into())
}

/// One Python row in a fresh process: `Ok(Err(why))` where the row cannot
/// run (no such Python or package, not served), an error where it ran
/// and returned tensors other than the file's.
fn python_load(
    python: &Path,
    method: &str,
    file: &Path,
    socket: &Path,
    expected: Option<(u64, u64)>,
) -> Result<Result<(f64, f64), String>, String> {
    let (seconds, touch, got) = match python_run(python, method, file, socket) {
        Ok(run) => run,
        Err(why) => return Ok(Err(why)),
    };
    match expected {
        Some(want) if got == want => Ok(Ok((seconds, touch))),
        Some((tensors, sum)) => Err(format!(
            "{method}: {} tensors, checksum {} of the bytes touched; the file holds {tensors}, checksum {sum}",
            got.0, got.1
        )),
        None => Ok(Err("not a safetensors file: nothing to check its tensors against".into())),
    }
}

fn python_run(
    python: &Path,
    method: &str,
    file: &Path,
    socket: &Path,
) -> Result<(f64, f64, (u64, u64)), String> {
    let out = Command::new(python)
        .arg("-c")
        .arg(PYTHON_CHILD)
        .arg(method)
        .arg(file)
        .arg(socket)
        .env_remove("DMALOAD_CACHE")
        .output()
        .map_err(|e| format!("{}: {e}", python.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(stderr.lines().last().unwrap_or("failed").to_owned());
    }
    if method.starts_with("dmaload") && String::from_utf8_lossy(&out.stderr).contains("loaded directly") {
        return Err("the service did not serve it".into());
    }
    let result: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("{method}: {e}"))?;
    let count = |key: &str| result[key].as_u64().ok_or_else(|| format!("{method}: no {key} in {result}"));
    Ok((
        result["seconds"].as_f64().unwrap_or(0.0),
        result["touch_seconds"].as_f64().unwrap_or(0.0),
        (count("tensors")?, count("checksum")?),
    ))
}

/// A fresh service given the file by a miss.
struct Served {
    child: Child,
    /// The miss's load time.
    miss_seconds: f64,
    /// Seconds from the miss's return until the file was collapsed, if it
    /// was collapsing.
    collapse_seconds: Option<f64>,
    /// The pages the service holds the file in.
    pages: String,
}

/// Starts a fresh service, evicts the file and loads it through the
/// service once (a miss, checked against `xxh3`), then waits for the
/// service's collapse; the service is stopped again if any step fails.
fn serve_file(exe: &Path, file: &Path, socket: &Path, xxh3: u64) -> Result<Served, String> {
    let child = start_service(exe, socket)?;
    let missed = evict(file)
        .and_then(|()| cli_load(exe, file, Some(socket), xxh3))
        .and_then(|miss| Ok((miss, wait_for_collapse(socket)?)));
    match missed {
        Ok((miss_seconds, (collapse_seconds, pages))) => {
            Ok(Served { child, miss_seconds, collapse_seconds, pages })
        }
        Err(err) => {
            let _ = stop_service(Some(child));
            Err(err)
        }
    }
}

fn start_service(exe: &Path, socket: &Path) -> Result<Child, String> {
    let child = Command::new(exe)
        .args(["serve", "--socket"])
        .arg(socket)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("dmaload serve: {e}"))?;
    let started = Instant::now();
    while dmaload::share::Connection::connect(socket).is_err() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = stop_service(Some(child));
            return Err("dmaload serve did not start".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(child)
}

/// Waits until the service holds no file still collapsing into 2 MiB pages
/// (a minute at most): the seconds waited, if it was collapsing, and the
/// pages the file is in.
fn wait_for_collapse(socket: &Path) -> Result<(Option<f64>, String), String> {
    let started = Instant::now();
    let mut waited = false;
    loop {
        let status = dmaload_share::Client::connect(socket)
            .and_then(|client| client.status())
            .map_err(|e| format!("service status: {e}"))?;
        let pages = status.files.first().map(|f| f.pages.clone()).unwrap_or_default();
        if !pages.contains("collapsing") || started.elapsed() > Duration::from_secs(60) {
            return Ok((waited.then(|| started.elapsed().as_secs_f64()), pages));
        }
        waited = true;
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops the service, if one runs.
fn stop_service(child: Option<Child>) -> Result<(), String> {
    let Some(mut child) = child else { return Ok(()) };
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let status = child.wait().map_err(|e| e.to_string())?;
    if !status.success() {
        let mut log = String::new();
        if let Some(mut stderr) = child.stderr.take() {
            let _ = stderr.read_to_string(&mut log);
        }
        return Err(format!("dmaload serve failed: {log}"));
    }
    Ok(())
}

/// Reads the file once through the page cache.
fn warm(file: &Path) -> Result<(), String> {
    let mut f = std::fs::File::open(file).map_err(|e| format!("open {}: {e}", file.display()))?;
    let mut block = vec![0u8; 8 << 20];
    while f.read(&mut block).map_err(|e| format!("read {}: {e}", file.display()))? > 0 {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_sums_one_byte_per_page_of_each_tensor() {
        // y starts 608 bytes before the first 8 MiB block ends, so its pages
        // straddle the boundary; z is empty.
        let header = br#"{"__metadata__":{"a":"b"},"x":{"dtype":"U8","shape":[8388000],"data_offsets":[0,8388000]},"y":{"dtype":"U8","shape":[612003],"data_offsets":[8388000,9000003]},"z":{"dtype":"U8","shape":[0],"data_offsets":[9000003,9000003]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        let data: Vec<u8> = (0..9_000_003u64).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        file.extend_from_slice(&data);
        let naive = |range: std::ops::Range<usize>| -> u64 {
            data[range].iter().step_by(4096).map(|&b| u64::from(b)).sum()
        };
        let want = naive(0..8_388_000) + naive(8_388_000..9_000_003);
        let expected = expected_of(&file[..]).unwrap();
        assert_eq!(expected.touched, Some((3, want)));
        assert_eq!(expected.xxh3, xxhash_rust::xxh3::xxh3_64(&file));
        assert_eq!(expected_of(&b"not a safetensors file"[..]).unwrap().touched, None);
        // A tensor past the end of the file is no reference either.
        file.truncate(file.len() - 1);
        assert_eq!(expected_of(&file[..]).unwrap().touched, None);
    }
}
