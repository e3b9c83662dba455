//! `dmaload demo`: the README's first command. Loads a generated sample
//! model with the default engine and with a plain buffered read, cold each
//! time, and compares them.

use dmaload_cli::{out, outln};
use std::path::PathBuf;

use clap::Args;
use dmaload::{Engine, IoMode, LoadOptions};

use crate::output::{hash_timed, load_text};
use crate::units::{human_bytes, parse_size};
use crate::{progress_bar, sample};

#[derive(Args)]
pub struct DemoArgs {
    /// Size of the sample model.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    size: u64,
    /// Where the sample model is generated and kept (default:
    /// $DMALOAD_CACHE_DIR, $XDG_CACHE_HOME/dmaload or ~/.cache/dmaload).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

pub fn run(args: &DemoArgs) -> Result<(), String> {
    let dir = args.cache_dir.clone().unwrap_or_else(sample::default_cache_dir);
    eprintln!("dmaload demo: preparing a {} sample model in {}", human_bytes(args.size), dir.display());
    let (path, generated) = sample::cached_model(&dir, args.size)
        .map_err(|e| format!("writing sample model in {}: {e}", dir.display()))?;
    if generated {
        eprintln!("dmaload demo: generated {}", path.display());
    }
    let runs = [
        ("default (io_uring, registered buffers, direct I/O)", LoadOptions::default()),
        (
            "baseline (plain read() into the buffer, through the page cache)",
            LoadOptions { engine: Engine::Read, mode: IoMode::Buffered, ..LoadOptions::default() },
        ),
    ];
    let mut results = Vec::new();
    for (label, mut options) in runs {
        // The comparison shows what each load leaves in the page cache.
        options.measure_page_cache = true;
        dmaload::pagecache::evict(&path).map_err(|e| e.to_string())?;
        let (bar, callback) = progress_bar(label.split(' ').next().unwrap_or(label));
        options.progress = Some(callback);
        let loaded = dmaload::load(&path, &options);
        bar.finish_and_clear();
        let (buffer, report) = loaded.map_err(|e| e.to_string())?;
        let hash = hash_timed(&buffer);
        outln!("== {label}");
        out!("{}", load_text(&report, Some(&hash)));
        outln!();
        results.push((report, hash.xxh3_64));
    }
    let (fast, slow) = (&results[0], &results[1]);
    outln!(
        "default vs baseline: {:.2}x faster ({:.3} s vs {:.3} s); content identical: {}",
        slow.0.total_seconds / fast.0.total_seconds,
        fast.0.total_seconds,
        slow.0.total_seconds,
        if fast.1 == slow.1 { "yes" } else { "NO" }
    );
    if fast.1 != slow.1 {
        return Err("the two loads returned different bytes".into());
    }
    dmaload::pagecache::evict(&path).map_err(|e| e.to_string())?;
    Ok(())
}
