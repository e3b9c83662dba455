//! `dmaload load MODEL`: a safetensors model (a directory, or its index)
//! loaded shard by shard through the core's `format::model`.

use dmaload_cli::{out, outln};
use std::path::Path;
use std::time::Instant;

use dmaload::format::model::{LoadedShard, Model};
use dmaload::format::safetensors::Error as FormatError;
use dmaload::LoadReport;
use dmaload_cli::output::{self, Hash};
use dmaload_cli::units::human_bytes;
use serde::Serialize;

use crate::{progress_bar, LoadCommand};

/// Whether `path` names a model rather than one file: a directory, an
/// object prefix (`s3://BUCKET/model/`) or an index (`*.json`). A
/// `.safetensors` file or object is loaded as the one it is.
pub fn is_model(path: &Path) -> bool {
    let prefix = dmaload::object::is_object_url(path) && path.to_string_lossy().ends_with('/');
    prefix || path.is_dir() || path.extension().is_some_and(|e| e == "json")
}

/// What `--json` prints for a model.
#[derive(Serialize)]
struct ModelJson<'a> {
    model: String,
    tensors: usize,
    bytes: u64,
    total_seconds: f64,
    gib_per_second: f64,
    verified: bool,
    shards: Vec<ShardJson<'a>>,
}

#[derive(Serialize)]
struct ShardJson<'a> {
    tensors: usize,
    #[serde(flatten)]
    report: &'a LoadReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    hash: Option<Hash>,
}

pub fn run(cmd: &LoadCommand) -> Result<(), String> {
    // A model is whole files: a range, or the cache service (which serves
    // one file per request), would need its own meaning per shard.
    if cmd.offset != 0 || cmd.length.is_some() || cmd.cache.is_some() {
        return Err(format!(
            "{}: --offset, --length and --cache load one file; a model is loaded whole, shard by shard",
            cmd.file.display()
        ));
    }
    let mut options = cmd.options.to_options();
    options.needs_fd = false;
    options.measure_page_cache = !cmd.no_page_cache;
    let (bar, callback) = progress_bar("loading");
    options.progress = Some(callback);
    let started = Instant::now();
    let loaded = Model::resolve(&cmd.file).and_then(|model| model.load(&options));
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let shards = loaded.map_err(|e: FormatError| e.to_string())?;
    let hashes = shards
        .iter()
        .map(|s| cmd.hash.then(|| output::hash_loaded(&s.loaded, &s.path)).transpose())
        .collect::<Result<Vec<Option<Hash>>, _>>()
        .map_err(|e| e.to_string())?;
    for fallback in shards.iter().flat_map(|s| &s.report.fallbacks) {
        eprintln!("dmaload: fallback {fallback}");
    }
    let bytes: u64 = shards.iter().map(|s| s.report.bytes).sum();
    let tensors: usize = shards.iter().map(|s| s.header.tensors.len()).sum();
    let gib_per_second = if seconds > 0.0 { bytes as f64 / f64::from(1 << 30) / seconds } else { 0.0 };
    if cmd.json {
        let out = ModelJson {
            model: cmd.file.to_string_lossy().into_owned(),
            tensors,
            bytes,
            total_seconds: seconds,
            gib_per_second,
            verified: cmd.options.verify,
            shards: shards
                .iter()
                .zip(hashes)
                .map(|(s, hash)| ShardJson { tensors: s.header.tensors.len(), report: &s.report, hash })
                .collect(),
        };
        outln!("{}", serde_json::to_string(&out).map_err(|e| e.to_string())?);
    } else {
        out!("{}", text(&cmd.file, &shards, &hashes, seconds, gib_per_second, cmd.options.verify));
    }
    Ok(())
}

fn text(
    model: &Path,
    shards: &[LoadedShard],
    hashes: &[Option<Hash>],
    seconds: f64,
    gib_per_second: f64,
    verified: bool,
) -> String {
    let mut out = format!("model    {}\n", model.display());
    for (shard, hash) in shards.iter().zip(hashes) {
        let r = &shard.report;
        out += &format!(
            "shard    {}  {} tensors  {}  {:.2} GiB/s  {}",
            shard.path.display(),
            shard.header.tensors.len(),
            human_bytes(r.bytes),
            r.gib_per_second,
            r.destination
        );
        if let Some(hash) = hash {
            out += &format!("  xxh3 {}", hash.xxh3_64);
        }
        out.push('\n');
    }
    let bytes: u64 = shards.iter().map(|s| s.report.bytes).sum();
    let tensors: usize = shards.iter().map(|s| s.header.tensors.len()).sum();
    out += &format!(
        "total    {} shards  {tensors} tensors  {} in {seconds:.3} s  {gib_per_second:.2} GiB/s{}\n",
        shards.len(),
        human_bytes(bytes),
        if verified { "  verified against each shard's sums file" } else { "" }
    );
    out
}
