//! The `dmaload-bench` command: dmaload's benchmarks, with baselines run
//! side by side in the same run. Kept out of the `dmaload` command users
//! install, so that one links no plotting library and no baselines.

mod benchkit;
mod bind;
mod cache;
mod load;
mod matrix;
mod plot;
mod qd;
mod save;
mod sizes;
mod stream;

use std::process::ExitCode;

use clap::Parser;
// Written once, in dmaload-cli's library, for both commands.
use dmaload_cli::{output, sample, units};

#[derive(Parser)]
#[command(
    name = "dmaload-bench",
    version,
    about = "dmaload's benchmarks: every way to load against its baselines, in one run"
)]
struct Cli {
    #[command(subcommand)]
    command: load::BenchCommand,
}

fn main() -> ExitCode {
    match load::run(&Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dmaload-bench: error: {message}");
            ExitCode::FAILURE
        }
    }
}
