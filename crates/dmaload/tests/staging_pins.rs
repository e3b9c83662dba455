//! A load to `cuda:N` pins its staging ring as it uses it: each slot
//! before its first copy, the cache lane's slots when the lane starts,
//! never a slot the load does not reach, and nothing again for a later
//! load through the ring kept for the device. Read from the emulator's log
//! of `cuMemHostRegister` and `cuMemcpyHtoDAsync` calls
//! (`DMALOAD_EMU_LOG`, tests/cuda-emu), in a child process of this test
//! binary (the emulator reads its settings at `cuInit`), under strict mode:
//! a copy from memory not yet pinned aborts the child.

mod common;

use std::path::Path;
use std::process::Command;

use common::{scratch_dir, skip, write_pattern_file};
use dmaload::{Destination, IoMode, LoadOptions, Loaded};

/// In a child: the case to run, the file it loads.
const CHILD_CASE: &str = "DMALOAD_TEST_PINS_CASE";
const CHILD_FILE: &str = "DMALOAD_TEST_PINS_FILE";

/// Slots of the rings below, of 1 MiB each.
const SLOTS: usize = 32;
const SLOT: usize = 1 << 20;

/// Whether the emulator (not a real driver, which keeps no log) serves
/// this process's CUDA calls.
fn emulator(test: &str) -> bool {
    if let Err(reason) = common::cuda_driver() {
        skip(test, &reason);
        return false;
    }
    if std::env::var_os("DMALOAD_LIBCUDA").is_none() {
        skip(test, "the installed NVIDIA driver is in use: it keeps no log of what it pins");
        return false;
    }
    true
}

/// The line a child adds to the emulator's log before its second load.
const SECOND_LOAD: &str = "second load";

/// Runs `case` on `file` in a child of this test binary with the
/// emulator's log at `log`; returns the log's lines of the first load and
/// of the second.
fn run_child(case: &str, file: &Path, log: &Path) -> (Vec<String>, Vec<String>) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child_cases", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_CASE, case)
        .env(CHILD_FILE, file)
        .env("DMALOAD_EMU_LOG", log)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("LOADED"), "child {case} failed: {text}");
    let lines: Vec<String> = std::fs::read_to_string(log).unwrap().lines().map(str::to_owned).collect();
    let second = lines.iter().position(|l| l == SECOND_LOAD).expect("the child marked its second load");
    (lines[..second].to_vec(), lines[second + 1..].to_vec())
}

/// Bytes registered by the `register ADDR LEN` lines among `lines`.
fn registered(lines: &[String]) -> usize {
    lines.iter().filter_map(|l| l.strip_prefix("register ")).map(length).sum()
}

fn length(fields: &str) -> usize {
    fields.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The entry point of every child; a no-op in the parent's own run.
#[test]
fn child_cases() {
    let Some(case) = std::env::var_os(CHILD_CASE) else { return };
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let mode = match case.to_str().unwrap() {
        "ring" => IoMode::Buffered,
        "lane" => IoMode::Auto,
        other => panic!("no child case {other}"),
    };
    let options = LoadOptions {
        mode,
        to: Destination::Cuda(0),
        staging_slots: Some(SLOTS),
        staging_slot_size: Some(SLOT),
        ..LoadOptions::default()
    };
    let expected = std::fs::read(&path).unwrap();
    // Twice: the second load takes the ring the first kept.
    for load in ["first", "second"] {
        if load == "second" {
            let log = std::env::var_os("DMALOAD_EMU_LOG").unwrap();
            let mut log = std::fs::OpenOptions::new().append(true).open(log).unwrap();
            std::io::Write::write_all(&mut log, format!("{SECOND_LOAD}\n").as_bytes()).unwrap();
        }
        let file = dmaload::OpenFile::open(&path).unwrap();
        let (loaded, report) = dmaload::LoadRequest::open(&file).options(&options).load().unwrap();
        let Loaded::Device(device) = loaded else { panic!("cuda:0 gave no device memory") };
        let mut back = Vec::new();
        device.read_each(|bytes| back.extend_from_slice(bytes)).unwrap();
        assert!(back == expected, "the {load} load's device bytes differ from the file's");
        println!("{load}: {}", report.destination);
    }
    println!("LOADED");
}

/// A load read through the ring (buffered reads, no cache lane) of a file
/// filling 4 of its 32 slots pins those 4, each before its first copy and
/// after the copies from the ones before it: not the whole ring up front.
/// A second load through the kept ring pins nothing.
#[test]
fn a_load_pins_only_the_slots_it_reaches_as_it_reaches_them() {
    const TEST: &str = "a_load_pins_only_the_slots_it_reaches_as_it_reaches_them";
    if !emulator(TEST) {
        return;
    }
    let dir = scratch_dir();
    let (file, log) = (dir.path().join("four-slots"), dir.path().join("emu.log"));
    write_pattern_file(&file, 3 * SLOT as u64 + 1000);
    let (lines, second) = run_child("ring", &file, &log);
    let copies = lines.iter().filter(|l| l.starts_with("copy ")).count();
    assert!(copies >= 4, "the load copied {copies} times: {lines:?}");
    assert_eq!(registered(&lines), 4 * SLOT, "the load pinned more than the 4 slots it used: {lines:?}");
    let first_copy = lines.iter().position(|l| l.starts_with("copy ")).unwrap();
    let last_register = lines.iter().rposition(|l| l.starts_with("register ")).unwrap();
    assert!(
        first_copy < last_register,
        "every slot was pinned before the first copy, not as the load reached it: {lines:?}"
    );
    assert!(
        lines.iter().all(|l| !l.starts_with("unregister ")),
        "a slot was unpinned while the ring is kept: {lines:?}"
    );
    assert_eq!(registered(&second), 0, "the second load pinned its kept ring again: {second:?}");
}

/// A load of a file in the page cache goes on the cache lane, which pins
/// its share of the ring (its threads' pieces, whole slots at the ring's
/// end) once when it starts; the engine's slots, which read nothing, stay
/// unpinned. A second load pins nothing more.
#[test]
fn a_load_on_the_cache_lane_pins_the_lanes_slots_only() {
    const TEST: &str = "a_load_on_the_cache_lane_pins_the_lanes_slots_only";
    if !emulator(TEST) {
        return;
    }
    let dir = scratch_dir();
    let (file, log) = (dir.path().join("warm"), dir.path().join("emu.log"));
    write_pattern_file(&file, 24 * SLOT as u64);
    // In the page cache: just written (and read back here).
    std::fs::read(&file).unwrap();
    let (lines, second) = run_child("lane", &file, &log);
    let pinned = registered(&lines);
    assert!(pinned > 0, "the lane copied from memory never pinned: {lines:?}");
    assert!(
        pinned <= SLOTS * SLOT / 2,
        "the load pinned {pinned} bytes of a {}-byte ring whose engine slots it did not use: {lines:?}",
        SLOTS * SLOT
    );
    assert_eq!(registered(&second), 0, "the second load pinned its kept ring again: {second:?}");
}
