//! How each front end (the command line, the C library, the Python
//! package) offers each `LoadOptions` field: a table for the tests, which
//! hold every front end to it (`tests/option_fronts.rs` here, and the
//! CLI's `tests/cli.rs`, which includes this file by path).

// Each including test reads the columns of its own front end only.
#![allow(dead_code)]

/// How one front end offers a load option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spelling {
    /// The flag, struct member or keyword that sets it.
    Named(&'static str),
    /// Not offered there, and why.
    Absent(&'static str),
}

/// One `LoadOptions` field and how the command line, the C library and
/// the Python package offer it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionFronts {
    pub field: &'static str,
    /// A `dmaload load` flag.
    pub cli: Spelling,
    /// A member of C's `dmaload_load_options`.
    pub c: Spelling,
    /// A keyword of Python's loads (`dmaload.LoadOptions`, or of
    /// `dmaload.load` itself for a callback).
    pub python: Spelling,
}

/// Every `LoadOptions` field, in declaration order, and where each front
/// end offers it: the one table the CLI's, C's and Python's tests check
/// themselves against, so a new option cannot be silently missing from
/// one of them (the crate's own test checks the table against the struct).
pub const LOAD_OPTION_FRONTS: &[OptionFronts] = {
    use Spelling::{Absent, Named};
    /// An option every front end offers, under the field's own name but
    /// for the flag.
    const fn same(field: &'static str, flag: &'static str) -> OptionFronts {
        OptionFronts { field, cli: Named(flag), c: Named(field), python: Named(field) }
    }
    &[
        same("engine", "--engine"),
        same("mode", "--mode"),
        same("to", "--to"),
        OptionFronts {
            field: "needs_fd",
            cli: Absent("a command-line load hands out no fd"),
            c: Absent("dmaload_load's buffer keeps its memfd (dmaload_buffer_memfd)"),
            python: Absent("dmaload.load keeps a memfd (fileno); the safetensors loaders need none"),
        },
        same("gather_size", "--gather-size"),
        same("chunk_size", "--chunk-size"),
        same("queue_depth", "--queue-depth"),
        same("threads", "--threads"),
        same("populate_threads", "--populate-threads"),
        same("staging_slots", "--staging-slots"),
        same("staging_slot_size", "--staging-slot-size"),
        same("measure_page_cache", "--no-page-cache"),
        OptionFronts {
            field: "progress",
            cli: Absent("a progress bar on a terminal"),
            c: Absent("no callbacks cross into C"),
            python: Named("progress"),
        },
        OptionFronts {
            field: "cancel",
            cli: Absent("Ctrl-C ends the process"),
            c: Absent("a C load runs to its end or its error"),
            python: Absent("KeyboardInterrupt cancels the load"),
        },
        same("verify", "--verify"),
    ]
};
