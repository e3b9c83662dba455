//! The `dmaload` command.

mod capture;
mod demo;
mod model_cmd;
mod save_cmd;
mod serve;
mod sums;

use dmaload_cli::{out, outln};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};
use dmaload::load::{DEFAULT_CHUNK_SIZE, DEFAULT_GATHER_SIZE, DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH};
use dmaload::{Destination, Engine, IoMode, LoadOptions, LoadRequest};
use dmaload_cli::{output, sample, units};
use dmaload_share::CacheRequest;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use units::Size;

#[derive(Parser)]
#[command(
    name = "dmaload",
    version,
    about = "Load huge files into DMA-shareable memory at the speed of the disk"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Allocate a buffer and fill it with a file (or a byte range of it).
    Load(LoadCommand),
    /// Show what this machine (and the filesystem of PATH) can do.
    Info {
        path: Option<PathBuf>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Populate a few hundred MiB of each memory kind, record what it
        /// cost per GiB (in $XDG_CACHE_HOME/dmaload, else
        /// ~/.cache/dmaload) and let `--to auto` choose by those figures.
        #[arg(long)]
        probe_memory: bool,
    },
    /// Generate a ~1 GiB sample model once, then load it with the default
    /// engine and with a plain buffered read, side by side.
    Demo(demo::DemoArgs),
    /// Write a generated buffer to a file, crash-safe (tmp + fsync + rename).
    Save(save_cmd::SaveCommand),
    /// Load SRC into memory (`--to`, by default the cheapest host memory) and
    /// save it to DST; reports both halves.
    Copy(save_cmd::CopyCommand),
    /// Serve loaded files to other processes from memory (a model cache):
    /// clients send an open file, get its bytes as a sealed memfd.
    Serve(serve::ServeArgs),
    /// Stream blocks from a source to a file through a block queue between
    /// two processes (the producer is this program run again).
    Capture(capture::CaptureCommand),
    /// Drop files from the page cache (fdatasync, then POSIX_FADV_DONTNEED;
    /// no root needed), so the next read of each comes from the device.
    Evict {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Moved: the benchmarks are the `dmaload-bench` binary. Hidden; it
    /// only says where they went.
    #[command(hide = true, disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Write SHA256SUMS (or B3SUMS) for `load --verify`: for a directory,
    /// of what `sha256sum *` sums there (every name not starting with `.`,
    /// in byte order, symlinks followed; what is left out is named on
    /// stderr); for files, in each one's directory, in the order given. The
    /// same bytes `sha256sum` (or `b3sum`) prints for those names there.
    Sums {
        #[arg(required = true, value_name = "DIR_OR_FILES")]
        paths: Vec<PathBuf>,
        /// The digest: sha256 (SHA256SUMS, what every system can check) or
        /// blake3 (B3SUMS: a verified load then runs at the disk's speed
        /// where SHA-256 on one core cannot keep up with it).
        #[arg(long, value_enum, default_value = "sha256")]
        digest: sums::DigestArg,
    },
}

#[derive(Args)]
struct LoadCommand {
    /// The file, an object (s3://BUCKET/KEY, docs/object-storage.md), or
    /// a safetensors model: a directory (its model.safetensors.index.json,
    /// else its *.safetensors files), an object prefix (s3://BUCKET/DIR/:
    /// its model.safetensors.index.json, else its model.safetensors) or an
    /// index (*.json, a file or an object), every shard loaded whole and
    /// reported with the model's totals.
    file: PathBuf,
    /// First byte to load.
    #[arg(long, value_parser = units::parse_size, default_value = "0")]
    offset: u64,
    /// Bytes to load (default: to the end of the file).
    #[arg(long, value_parser = units::parse_size)]
    length: Option<u64>,
    #[command(flatten)]
    options: LoadArgs,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Also compute an xxh3-64 of the loaded bytes (after the load; from a
    /// device, of its bytes copied back, off the timed path).
    #[arg(long)]
    hash: bool,
    /// Skip measuring how much of the range is in the page cache afterwards
    /// (the `cache` line; `mincore` over the whole range, after the timed
    /// load): the report's `page_cache` is then null.
    #[arg(long)]
    no_page_cache: bool,
    /// Get the whole file from the cache service (`dmaload serve`) at
    /// SOCKET (default: $DMALOAD_CACHE when it names a socket, else the
    /// service's default socket); without a service, load directly and say
    /// why. With --to cuda:N the service copies the file into this
    /// process's device memory (a CUDA IPC handle). DMALOAD_CACHE=1 or a
    /// socket path in the environment does the same for a whole file (a
    /// range is then loaded directly; with --cache it is an error).
    #[arg(long, value_name = "SOCKET", num_args = 0..=1)]
    cache: Option<Option<PathBuf>>,
}

/// The knobs of a load, shared by `load` and `copy`.
#[derive(Args, Clone)]
pub struct LoadArgs {
    /// Engine: uring-fixed, uring, pread-pool or read.
    #[arg(long, default_value_t = Engine::default())]
    engine: Engine,
    /// I/O mode: auto (direct or buffered without cache residue, whichever
    /// measures faster for the device; buffered where direct I/O is not
    /// possible), direct, buffered or dontcache.
    #[arg(long, default_value_t = IoMode::default())]
    mode: IoMode,
    /// Require direct I/O: fail instead of falling back (same as --mode direct).
    #[arg(long, conflicts_with = "mode")]
    direct: bool,
    /// Where the bytes go: auto (the cheapest host memory this kernel gives:
    /// huge pages where it allows, see `dmaload info`), memfd (4 KiB pages,
    /// shareable by fd), memfd-huge (memfd with 2 MiB pages: needs
    /// shmem_enabled always, within_size, advise or force), hugetlb (memfd from the hugetlb pool),
    /// anonymous-thp (no fd, transparent huge pages), anonymous (no fd, 4 KiB
    /// pages), a dma-buf (`load`
    /// only: udmabuf, a memfd exported without copy; dma-heap:NAME, from
    /// /dev/dma_heap/NAME through a staging ring; dmabuf, udmabuf where it
    /// can, else dma-heap:system) or cuda:N (CUDA device N's memory through
    /// a pinned staging ring; `load` only).
    #[arg(long, value_name = "DEST", default_value_t = Destination::default())]
    to: Destination,
    /// Bytes populated and registered as one unit (rounded down to whole
    /// read requests, at least one and at most 1 GiB; doubled where a huge
    /// file would need more units than io_uring registers).
    #[arg(long, default_value_t = Size(DEFAULT_GATHER_SIZE as u64))]
    gather_size: Size,
    /// Bytes per read request (rounded up to whole pages, and to the
    /// file's direct-I/O alignment when reading direct).
    #[arg(long, default_value_t = Size(DEFAULT_CHUNK_SIZE as u64))]
    chunk_size: Size,
    /// Requests in flight (io_uring engines); left at the default, direct
    /// reads tune it per block device.
    #[arg(long, default_value_t = DEFAULT_QUEUE_DEPTH)]
    queue_depth: usize,
    /// Threads (pread-pool engine).
    #[arg(long, default_value_t = DEFAULT_POOL_THREADS)]
    threads: usize,
    /// Threads populating memory ahead of the I/O (the default is this
    /// machine's CPUs, 1 to 4).
    #[arg(long, default_value_t = dmaload::load::default_populate_threads())]
    populate_threads: usize,
    /// Slots of the staging ring a load to cuda:N (pinned) or dma-heap:NAME
    /// reads through, at least 2 (default: for a device the reads in
    /// flight and 2 more, at most a quarter of the range and 32 slots, for
    /// a heap at most 128 MiB).
    #[arg(long, value_name = "N")]
    staging_slots: Option<usize>,
    /// Bytes per staging slot, at most 1G (default: 16M for a device, the
    /// heap ring's own for dma-heap:NAME).
    #[arg(long, value_name = "SIZE")]
    staging_slot_size: Option<Size>,
    /// Check the file against the digest that the B3SUMS (BLAKE3) or
    /// SHA256SUMS file beside it records (`dmaload sums` writes them;
    /// BLAKE3 first when both list it), hashing as the bytes arrive:
    /// a mismatch, a missing sums file or a file it does not list fails the
    /// load. Whole files only (with --cache, loaded directly, saying so).
    /// An object (s3://B/DIR/KEY) is checked against the B3SUMS or
    /// SHA256SUMS object beside it (s3://B/DIR/B3SUMS).
    #[arg(long)]
    verify: bool,
}

impl LoadArgs {
    pub fn to_options(&self) -> LoadOptions {
        LoadOptions {
            engine: self.engine,
            mode: if self.direct { IoMode::Direct } else { self.mode },
            to: self.to.clone(),
            gather_size: usize::try_from(self.gather_size.0).unwrap_or(usize::MAX),
            chunk_size: usize::try_from(self.chunk_size.0).unwrap_or(usize::MAX),
            queue_depth: self.queue_depth,
            threads: self.threads,
            populate_threads: self.populate_threads,
            staging_slots: self.staging_slots,
            staging_slot_size: self.staging_slot_size.map(|s| usize::try_from(s.0).unwrap_or(usize::MAX)),
            verify: self.verify,
            // Each command sets these for itself (`load` hands out no fd and
            // measures the page cache unless --no-page-cache; a terminal
            // gets a progress bar); no `..` here, so a new core option is a
            // compile error until the CLI decides about it.
            needs_fd: true,
            measure_page_cache: false,
            progress: None,
            cancel: dmaload::CancelToken::default(),
        }
    }
}

/// A progress bar on stderr that appears only on a terminal and only once
/// the work has taken longer than a moment.
pub fn progress_bar(label: &str) -> (ProgressBar, Arc<dmaload::ProgressFn>) {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid progress template"),
    );
    bar.set_message(label.to_owned());
    let started = Instant::now();
    let shown = std::sync::atomic::AtomicBool::new(false);
    let handle = bar.clone();
    let callback = move |done: u64, total: u64| {
        if !shown.load(std::sync::atomic::Ordering::Relaxed) && started.elapsed() > Duration::from_millis(300)
        {
            shown.store(true, std::sync::atomic::Ordering::Relaxed);
            // Hidden when stderr is not a terminal.
            handle.set_draw_target(ProgressDrawTarget::stderr());
        }
        handle.set_length(total);
        handle.set_position(done);
    };
    (bar, Arc::new(callback))
}

/// The cache service socket `load` uses: `--cache [SOCKET]`, else
/// `DMALOAD_CACHE`; `None` for a direct load.
fn cache_socket(cmd: &LoadCommand) -> Option<PathBuf> {
    match &cmd.cache {
        Some(Some(socket)) => Some(socket.clone()),
        Some(None) => Some(dmaload_share::socket_from_env().unwrap_or_else(dmaload_share::default_socket)),
        None => dmaload_share::socket_from_env(),
    }
}

fn run_load(cmd: &LoadCommand) -> Result<(), dmaload::Error> {
    let mut options = cmd.options.to_options();
    // The buffer is dropped once the report is out: no fd to share, so
    // `auto` may choose anonymous memory.
    options.needs_fd = false;
    // A whole file to host memory, or to a device (the service copies it
    // into this process's device memory).
    let whole_file = cmd.offset == 0 && cmd.length.is_none();
    let cacheable = whole_file && (options.to.is_host() || matches!(options.to, Destination::Cuda(_)));
    // The report this command prints shows the page cache: measured unless
    // --no-page-cache (the library measures only when asked); a load the
    // cache service cannot take is measured the same way.
    options.measure_page_cache = !cmd.no_page_cache;
    let (bar, callback) = progress_bar("loading");
    options.progress = Some(callback);
    let mut socket = cache_socket(cmd);
    if socket.is_some() && !cacheable {
        const WHY: &str = "the cache service serves whole files to host memory or a CUDA device";
        if cmd.cache.is_some() {
            return Err(dmaload::Error::new(
                dmaload::ErrorKind::InvalidInput,
                "load",
                &cmd.file,
                format!("{WHY}: drop --cache for a range or a dma-buf"),
            ));
        }
        // Only the environment asked: it means "where the cache can serve".
        eprintln!("dmaload: DMALOAD_CACHE left aside: {WHY}, not a range or a dma-buf; loading directly");
        socket = None;
    }
    let is_object = dmaload::object::is_object_url(&cmd.file);
    let hashed = |(loaded, report): (dmaload::Loaded, dmaload::LoadReport)| {
        let hash = cmd.hash.then(|| output::hash_loaded(&loaded, &cmd.file)).transpose()?;
        Ok((report, hash))
    };
    // Every destination, host memory, a dma-buf or a device, is one call;
    // through the service, host memory or a device. An object
    // (s3://BUCKET/KEY) the service reads with this process's grant and
    // keeps under its ETag.
    let result = if is_object {
        dmaload::object::Object::open(&cmd.file.to_string_lossy(), &options.cancel).and_then(|object| {
            match &socket {
                Some(socket) => cached(CacheRequest::object(&object, socket).options(&options), socket),
                None => LoadRequest::object(&object).range(cmd.offset, cmd.length).options(&options).load(),
            }
        })
    } else {
        dmaload::OpenFile::open(&cmd.file).and_then(|file| match &socket {
            Some(socket) => cached(CacheRequest::open(&file, socket).options(&options), socket),
            None => LoadRequest::open(&file).range(cmd.offset, cmd.length).options(&options).load(),
        })
    }
    .and_then(hashed);
    bar.finish_and_clear();
    let (report, hash) = result?;
    for fallback in &report.fallbacks {
        eprintln!("dmaload: fallback {fallback}");
    }
    if cmd.json {
        outln!("{}", output::load_json(&report, hash.as_ref()));
    } else {
        out!("{}", output::load_text(&report, hash.as_ref()));
    }
    Ok(())
}

/// Runs a `--cache` load and says on stderr where its bytes came from.
fn cached(
    request: CacheRequest<'_>,
    socket: &std::path::Path,
) -> Result<(dmaload::Loaded, dmaload::LoadReport), dmaload::Error> {
    let (loaded, report, outcome) = request.load()?;
    match outcome {
        dmaload_share::CacheOutcome::Service { served, note } => {
            eprintln!("dmaload: from the cache service at {} ({})", socket.display(), served.name());
            if let Some(note) = note {
                eprintln!("dmaload: cache service: {note}");
            }
        }
        dmaload_share::CacheOutcome::Direct { reason } => {
            eprintln!("dmaload: {reason}; loaded directly");
        }
    }
    Ok((loaded, report))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        // A directory or an index is a safetensors model, loaded shard by shard.
        Command::Load(cmd) if model_cmd::is_model(&cmd.file) => model_cmd::run(cmd),
        Command::Load(cmd) => run_load(cmd).map_err(|e| e.to_string()),
        Command::Info { path, json, probe_memory } => output::info(path.as_deref(), *json, *probe_memory),
        Command::Demo(args) => demo::run(args),
        Command::Save(cmd) => save_cmd::save(cmd),
        Command::Copy(cmd) => save_cmd::copy(cmd),
        Command::Serve(args) => serve::run(args),
        Command::Capture(cmd) => capture::run(cmd),
        Command::Evict { files } => {
            files.iter().try_for_each(|file| dmaload::pagecache::evict(file).map_err(|e| e.to_string()))
        }
        Command::Bench { args } => Err(format!(
            "the benchmarks moved to the dmaload-bench binary (cargo build --release -p dmaload-bench): \
             run `dmaload-bench {}`",
            if args.is_empty() { "--help".to_owned() } else { args.join(" ") }
        )),
        Command::Sums { paths, digest } => sums::run(paths, (*digest).into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dmaload: error: {message}");
            ExitCode::FAILURE
        }
    }
}
