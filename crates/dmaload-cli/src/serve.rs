//! `dmaload serve`: the model-cache service in the foreground, one log
//! line per request on stderr, stopped by SIGINT or SIGTERM; and
//! `dmaload serve --status`, which asks a running service what it holds.

use dmaload_cli::{out, outln};
use std::fmt::Write as _;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use dmaload::share::Status;
use dmaload::LoadOptions;
use dmaload_share::{Client, Service, ServiceConfig, StopSignals};

use crate::units::{human_bytes, parse_size};

#[derive(Args)]
pub struct ServeArgs {
    /// The socket (default: $XDG_RUNTIME_DIR/dmaload.sock, else
    /// /run/user/UID/dmaload.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Memory the cached files may hold together: a size (K, M, G, T
    /// suffixes) or a percentage of the memory available at start. Least
    /// recently used files are dropped to make room; a larger file is
    /// loaded for its client and not kept (one such load at a time).
    #[arg(long, value_name = "SIZE|PERCENT", default_value = "50%", value_parser = parse_memory_limit)]
    memory_limit: u64,
    /// Also serve this user (repeatable; the service's own uid and root
    /// always are). With --allow-uid or --allow-gid the socket is mode
    /// 0666 in a directory others can enter (e.g. --socket
    /// /run/dmaload/dmaload.sock): the peer's credentials decide whom the
    /// service serves.
    #[arg(long, value_name = "UID")]
    allow_uid: Vec<u32>,
    /// Also serve users whose primary group is this one (repeatable).
    #[arg(long, value_name = "GID")]
    allow_gid: Vec<u32>,
    /// Print what the running service holds, then exit.
    #[arg(long)]
    status: bool,
    /// With --status: one JSON object.
    #[arg(long, requires = "status")]
    json: bool,
}

fn parse_memory_limit(text: &str) -> Result<u64, String> {
    match text.trim().strip_suffix('%') {
        Some(percent) => {
            let percent: f64 = percent.trim().parse().map_err(|_| format!("bad percentage {text:?}"))?;
            dmaload_share::service::memory_limit_percent(percent)
        }
        None => parse_size(text),
    }
}

pub fn run(args: &ServeArgs) -> Result<(), String> {
    let socket = args.socket.clone().unwrap_or_else(dmaload_share::default_socket);
    if args.status {
        let status =
            Client::connect(&socket).and_then(|client| client.status()).map_err(|e| e.to_string())?;
        if args.json {
            outln!("{}", serde_json::to_string(&status).map_err(|e| e.to_string())?);
        } else {
            out!("{}", status_text(&status));
        }
        return Ok(());
    }
    // Before any thread exists: the threads inherit the blocked signals.
    let stop = StopSignals::new().map_err(|e| format!("signalfd: {e}"))?;
    let config = ServiceConfig {
        socket,
        memory_limit: args.memory_limit,
        allow_uids: args.allow_uid.clone(),
        allow_gids: args.allow_gid.clone(),
        load_options: LoadOptions::default(),
        idle_timeout: dmaload_share::service::DEFAULT_IDLE_TIMEOUT,
        log: Arc::new(|line| eprintln!("dmaload serve: {line}")),
    };
    let service = Service::bind(config).map_err(|e| e.to_string())?;
    let status = service.status();
    eprintln!(
        "dmaload serve: pid {} listening on {} (memory limit {}, {} memory: {}); Ctrl-C or SIGTERM stops",
        std::process::id(),
        service.socket().display(),
        human_bytes(args.memory_limit),
        status.memory_kind,
        status.memory_reason
    );
    service.run(stop.as_fd()).map_err(|e| e.to_string())?;
    if let Ok(Some(signal)) = stop.take() {
        eprintln!("dmaload serve: stopped by signal {signal}");
    }
    Ok(())
}

fn status_text(s: &Status) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "service   pid {} on {}", s.pid, s.socket.display());
    let _ = writeln!(
        out,
        "memory    {} of {} in {} files, {} ({})",
        human_bytes(s.memory_used),
        human_bytes(s.memory_limit),
        s.files_cached,
        s.memory_kind,
        s.memory_reason
    );
    let _ = writeln!(
        out,
        "requests  {} hits, {} misses, {} not cached, {} evictions, {} errors, {} refused; {} clients now",
        s.hits, s.misses, s.uncached, s.evictions, s.errors, s.refused, s.clients
    );
    for file in &s.files {
        let _ = writeln!(
            out,
            "  {:>10}  {:>6} hits  {:>6} handoffs  {}  ({} pages)",
            human_bytes(file.bytes),
            file.hits,
            file.handoffs,
            file.path.display(),
            file.pages
        );
    }
    out
}
