//! What the `dmaload` command shares with the `dmaload-bench` binary
//! (crates/dmaload-bench): size parsing and printing, the load report's
//! text and JSON, and the generated sample model and file pattern. Not a
//! public API: the two binaries' common ground, written once.

pub mod output;
pub mod sample;
pub mod units;
