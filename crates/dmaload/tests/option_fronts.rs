//! Load options are defined once, in `LoadOptions`; `LOAD_OPTION_FRONTS`
//! says how each front end offers each of them. These tests hold the table
//! to the struct, to C's `dmaload_load_options` and to Python's
//! `LoadOptions` keywords; the CLI's own test holds `dmaload load --help`
//! to it. A new field without a row, or a row a front end does not keep,
//! fails here.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

mod fronts;

use dmaload::LoadOptions;
use fronts::{OptionFronts, Spelling, LOAD_OPTION_FRONTS};

/// The field names of `LoadOptions`, by an exhaustive destructure: a new
/// field is a compile error here until it is listed.
macro_rules! field_names {
    ($($field:ident),* $(,)?) => {{
        let LoadOptions { $($field: _),* } = LoadOptions::default();
        vec![$(stringify!($field)),*]
    }};
}

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn named(front: impl Fn(&OptionFronts) -> Spelling) -> BTreeSet<&'static str> {
    LOAD_OPTION_FRONTS
        .iter()
        .filter_map(|row| match front(row) {
            Spelling::Named(name) => Some(name),
            Spelling::Absent(_) => None,
        })
        .collect()
}

#[test]
fn the_table_has_one_row_per_field_in_order() {
    let fields = field_names!(
        engine,
        mode,
        to,
        needs_fd,
        gather_size,
        chunk_size,
        queue_depth,
        threads,
        populate_threads,
        staging_slots,
        staging_slot_size,
        measure_page_cache,
        progress,
        cancel,
        verify,
    );
    let rows: Vec<&str> = LOAD_OPTION_FRONTS.iter().map(|row| row.field).collect();
    assert_eq!(rows, fields, "LOAD_OPTION_FRONTS must list every LoadOptions field once, in order");
    for row in LOAD_OPTION_FRONTS {
        for spelling in [row.cli, row.c, row.python] {
            if let Spelling::Absent(why) = spelling {
                assert!(!why.is_empty(), "{}: an absent option says why", row.field);
            }
        }
    }
}

#[test]
fn c_load_options_has_exactly_the_members_the_table_names() {
    let header =
        fs::read_to_string(repo().join("crates/dmaload-capi/include/dmaload.h")).expect("read dmaload.h");
    let start =
        header.find("typedef struct dmaload_load_options {").expect("the options struct in dmaload.h");
    let end = start + header[start..].find("} dmaload_load_options;").expect("its end");
    let members: BTreeSet<&str> = header[start..end]
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with("//"))
        .map(|line| {
            let declarator = line.trim_end_matches(';').rsplit([' ', '*']).next().expect("a member");
            declarator.trim()
        })
        .collect();
    assert_eq!(members, named(|row| row.c), "dmaload_load_options against LOAD_OPTION_FRONTS");
}

#[test]
fn python_loads_offer_every_keyword_the_table_names() {
    let package = repo().join("bindings/python/python/dmaload");
    let options = fs::read_to_string(package.join("_options.py")).expect("read _options.py");
    let start = options.find("class LoadOptions(TypedDict").expect("class LoadOptions in _options.py");
    // The keys follow the class docstring, up to the next top-level line.
    let after_doc =
        start + options[start..].match_indices("\"\"\"").nth(1).expect("the class docstring").0 + 3;
    let body = &options[after_doc..];
    let body = &body[..body.find("\n\n\n").unwrap_or(body.len())];
    let mut keys: BTreeSet<&str> = body
        .lines()
        .filter_map(|line| line.strip_prefix("    "))
        .filter_map(|line| line.split_once(':').map(|(name, _)| name.trim()))
        .collect();
    // A callback is a keyword of each load function beside the options.
    let load = fs::read_to_string(package.join("_load.py")).expect("read _load.py");
    let signature = &load[load.find("def load(").expect("def load in _load.py")..];
    let signature = &signature[..signature.find("->").expect("its return type")];
    if signature.contains("progress:") {
        keys.insert("progress");
    }
    let missing: Vec<_> = named(|row| row.python).into_iter().filter(|key| !keys.contains(key)).collect();
    assert!(missing.is_empty(), "dmaload.load lacks the keywords {missing:?} (it has {keys:?})");
}

#[test]
fn the_names_the_core_sets_are_the_python_keywords() {
    // Python passes its keywords to `LoadOptions::set` by name; the
    // callback alone crosses another way.
    let mut python = named(|row| row.python);
    python.remove("progress");
    let core: BTreeSet<&str> = LoadOptions::NAMES.into_iter().collect();
    assert_eq!(core, python, "LoadOptions::NAMES against the table's Python keywords");
}
