//! What the `dmaload` command shares with the `dmaload-bench` binary
//! (crates/dmaload-bench): size parsing and printing, the load report's
//! text and JSON, and the generated sample model and file pattern. Not a
//! public API: the two binaries' common ground, written once.

/// `println!` for a command's output, through [`output::write_stdout`]:
/// a reader that left ends the process quietly instead of a panic.
#[macro_export]
macro_rules! outln {
    () => { $crate::output::write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` for a command's output, through [`output::write_stdout`].
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write_stdout(format_args!($($arg)*)) };
}

pub mod output;
pub mod sample;
pub mod units;
