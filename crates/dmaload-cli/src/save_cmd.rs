//! `dmaload save` and `dmaload copy`: the write direction from the command
//! line. `copy` loads SRC into host memory and saves it to DST,
//! reporting both halves; `save` writes a generated buffer (a quick way to
//! see what a device takes).

use std::path::{Path, PathBuf};

use clap::Args;
use dmaload::{Engine, IoMode, SaveOptions, SaveReport};
use dmaload_bench::transfer::{MemoryType, TransferBuffer};
use serde::Serialize;

use crate::output::{cache_description, load_text};
use crate::units::{human_bytes, parse_size};
use crate::{benchkit, progress_bar, LoadArgs};

/// Options of the save half.
#[derive(Args, Clone)]
pub struct SaveArgs {
    /// Save engine: uring-fixed, uring, pread-pool (pwrite threads) or read
    /// (sequential writes).
    #[arg(id = "save_engine", long = "save-engine", default_value = "uring-fixed")]
    engine: Engine,
    /// auto (O_DIRECT where possible), direct, buffered or dontcache.
    #[arg(id = "save_mode", long = "save-mode", default_value = "auto")]
    mode: IoMode,
    /// Skip the fsyncs (scratch data): a killed process still leaves no
    /// torn file, but a machine crash may lose the new one.
    #[arg(long)]
    no_sync: bool,
}

impl SaveArgs {
    fn to_options(&self) -> SaveOptions {
        SaveOptions { engine: self.engine, mode: self.mode, sync: !self.no_sync, ..SaveOptions::default() }
    }
}

#[derive(Args)]
pub struct SaveCommand {
    /// File to write (replaced atomically).
    dst: PathBuf,
    /// Bytes of generated content to save.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    size: u64,
    #[command(flatten)]
    save: SaveArgs,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct CopyCommand {
    src: PathBuf,
    dst: PathBuf,
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    save: SaveArgs,
    /// Print one JSON object: the load's report, the save's and
    /// total_seconds.
    #[arg(long)]
    json: bool,
}

pub fn save_text(r: &SaveReport) -> String {
    let cpu = r.cpu_user_seconds + r.cpu_system_seconds;
    let fallbacks: String = r.fallbacks.iter().map(|f| format!("fallback  {f}\n")).collect();
    let mut notes = String::new();
    if r.target != r.path {
        notes += &format!("note      wrote {} (where the symbolic link leads)\n", r.target.display());
    }
    if r.in_place {
        notes +=
            &format!("note      written in place into the {} (no temporary file, no rename)\n", r.file_type);
    }
    if r.other_links > 0 {
        notes += &format!(
            "note      the replaced file had {} other hard link(s): they keep the old bytes\n",
            r.other_links
        );
    }
    for name in &r.removed_tmpfiles {
        notes += &format!("note      removed {name}, left behind by a killed save\n");
    }
    format!(
        "saved     {} ({} bytes) to {}{}\n\
         engine    {} | {} | {} | align {} | {} direct + {} buffered tail | tmpfile {}\n\
         {fallbacks}{notes}\
         time      total {:.3} s | fallocate {:.3} s | write {:.3} s | fsync + rename {:.3} s\n\
         speed     {:.2} GiB/s | CPU {:.3} s (user {:.3}, system {:.3})\n",
        human_bytes(r.bytes),
        r.bytes,
        r.path.display(),
        if r.replaced { " (replaced the previous file)" } else { "" },
        r.engine.name(),
        match r.cache {
            dmaload::CachePolicy::Bypass => "direct (O_DIRECT)",
            dmaload::CachePolicy::Fadvise => "buffered, dropped from the page cache after the sync",
            _ => "buffered",
        },
        r.filesystem,
        r.alignment,
        human_bytes(r.direct_bytes),
        human_bytes(r.bytes - r.direct_bytes),
        if r.anonymous_tmpfile { "O_TMPFILE" } else { "named" },
        r.total_seconds,
        r.allocate_seconds,
        r.write_seconds,
        r.sync_seconds,
        r.gib_per_second,
        cpu,
        r.cpu_user_seconds,
        r.cpu_system_seconds
    )
}

pub fn save(cmd: &SaveCommand) -> Result<(), String> {
    let e = |err: dmaload::Error| err.to_string();
    // The generated buffer is all in memory: refuse a size that cannot fit.
    let budget = dmaload::system::memory_budget()
        .map_err(|err| dmaload::Error::io("read the available memory for", &cmd.dst, err))
        .map_err(e)?;
    if cmd.size > budget.available {
        return Err(e(dmaload::Error::new(
            dmaload::ErrorKind::OutOfMemory,
            "save",
            &cmd.dst,
            format!(
                "--size {} ({} bytes) needs that much memory, but only {} ({} bytes) is available ({})",
                human_bytes(cmd.size),
                cmd.size,
                human_bytes(budget.available),
                budget.available,
                budget.limited_by
            ),
        )));
    }
    // Sizing the memfd past RLIMIT_FSIZE would kill the process with SIGXFSZ.
    if let Some(why) = dmaload::system::past_file_size_limit(cmd.size) {
        return Err(e(dmaload::Error::new(
            dmaload::ErrorKind::InvalidInput,
            "save",
            &cmd.dst,
            format!("--size: the bytes are generated in a memfd, which the limit covers like a file: {why}"),
        )));
    }
    let size = usize::try_from(cmd.size).map_err(|_| format!("--size {} is too large", cmd.size))?;
    let mut buf = TransferBuffer::new(MemoryType::Memfd, size).map_err(e)?;
    buf.with_bytes_mut(|b| benchkit::fill_pattern(b, 0)).map_err(e)?;
    let report = buf.with_bytes(|b| save_showing_progress(b, &cmd.dst, &cmd.save)).map_err(e)?.map_err(e)?;
    for fallback in &report.fallbacks {
        eprintln!("dmaload: fallback {fallback}");
    }
    if cmd.json {
        println!("{}", serde_json::to_string(&report).map_err(|err| format!("report as JSON: {err}"))?);
    } else {
        print!("{}", save_text(&report));
    }
    Ok(())
}

/// `dmaload::save` with a progress bar (on a terminal, once it takes a moment).
fn save_showing_progress(data: &[u8], dst: &Path, args: &SaveArgs) -> Result<SaveReport, dmaload::Error> {
    let (bar, callback) = progress_bar("saving");
    let options = SaveOptions { progress: Some(callback), ..args.to_options() };
    let saved = dmaload::save(data, dst, &options);
    bar.finish_and_clear();
    saved
}

pub fn copy(cmd: &CopyCommand) -> Result<(), String> {
    let mut options = cmd.load.to_options();
    if !options.to.is_host() {
        let host: Vec<_> =
            std::iter::once("auto").chain(dmaload::MemoryKind::ALL.iter().map(|k| k.name())).collect();
        return Err(format!(
            "copy loads SRC into host memory to save it: --to takes {} here, not {to} \
             (a device or a dma-buf is loaded with `dmaload load --to {to}`)",
            host.join(" or "),
            to = options.to
        ));
    }
    // The buffer only goes to the save: no fd to share.
    options.needs_fd = false;
    let (bar, callback) = progress_bar("loading");
    options.progress = Some(callback);
    let loaded = dmaload::load(&cmd.src, &options);
    bar.finish_and_clear();
    let (buffer, load) = loaded.map_err(|e| e.to_string())?;
    let save = save_showing_progress(&buffer, &cmd.dst, &cmd.save).map_err(|e| e.to_string())?;
    for fallback in load.fallbacks.iter().chain(&save.fallbacks) {
        eprintln!("dmaload: fallback {fallback}");
    }
    let total = load.total_seconds + save.total_seconds;
    if cmd.json {
        #[derive(Serialize)]
        struct Out<'a> {
            load: &'a dmaload::LoadReport,
            save: &'a SaveReport,
            total_seconds: f64,
        }
        println!(
            "{}",
            serde_json::to_string(&Out { load: &load, save: &save, total_seconds: total })
                .map_err(|err| format!("report as JSON: {err}"))?
        );
    } else {
        println!("== load ({})", cache_description(&load));
        print!("{}", load_text(&load, None));
        println!("== save");
        print!("{}", save_text(&save));
        println!(
            "== copy      {} in {:.3} s = load {:.3} s + save {:.3} s ({:.2} GiB/s end to end)",
            human_bytes(load.bytes),
            total,
            load.total_seconds,
            save.total_seconds,
            load.bytes as f64 / (1u64 << 30) as f64 / total.max(1e-9)
        );
    }
    Ok(())
}
