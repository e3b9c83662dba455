//! The CUDA path under the emulator's race detector and fault injection
//! (tests/cuda-emu): each case runs in a child process of this test binary,
//! since the emulator reads its settings once, at `cuInit`, and a caught
//! race aborts the process. Skips (printing why) where a real NVIDIA
//! driver is installed, whose faults cannot be injected, or where the
//! emulator cannot be built.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{scratch_dir, skip, write_pattern_file};
use dmaload::cuda::{Context, DeviceBuffer, DeviceRange, Event, IpcHandle, IpcMemory, PinnedStaging, Stream};
use dmaload::sink::{CudaSink, Sink, SlotData};
use dmaload::{Engine, LoadOptions, StagingRing};

/// In a child: the case to run (a function below).
const CHILD_CASE: &str = "DMALOAD_TEST_EMU_CASE";
/// In a child: the file it loads.
const CHILD_FILE: &str = "DMALOAD_TEST_EMU_FILE";
/// In an importing child: the IPC handle it opens, in hex.
const CHILD_HANDLE: &str = "DMALOAD_TEST_EMU_HANDLE";
/// In an importing child: "copy", or "copy_after_close" (the bug strict
/// mode catches).
const CHILD_IPC: &str = "DMALOAD_TEST_EMU_IPC";

/// Whether this process can run the cases: the emulator, not a real driver.
fn emulator(test: &str) -> bool {
    if let Err(reason) = common::cuda_driver() {
        skip(test, &reason);
        return false;
    }
    if std::env::var_os("DMALOAD_LIBCUDA").is_none() {
        skip(test, "the installed NVIDIA driver is in use: faults cannot be injected into it");
        return false;
    }
    true
}

/// Runs `case` in a child of this test binary (`child_cases` dispatches it)
/// with the emulator settings `env`; a child still running after two
/// minutes is killed and fails the test (a hang, never a pass).
fn run_child(case: &str, env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.args(["child_cases", "--exact", "--nocapture", "--test-threads=1"]).env(CHILD_CASE, case);
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("child {case} hung: {}", text(&child.wait_with_output().unwrap()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// The entry point of every child; a no-op in the parent's own run.
#[test]
fn child_cases() {
    let Some(case) = std::env::var_os(CHILD_CASE) else { return };
    match case.to_str().unwrap() {
        "rewrite_before_event" => rewrite_slot(false),
        "rewrite_after_event" => rewrite_slot(true),
        "load" => load_through_two_slots(),
        "tuned" => tuned_load_through_the_cli_ring(),
        "held_copy" => load_past_a_held_copy(),
        "two_devices" => two_devices(),
        "write_pinned" => write_pinned(),
        "lane" => load_through_the_cache_lane(),
        "verify_whole" => verified_load_to_the_device(),
        "verify_section" => verified_data_section_to_the_device(),
        "ipc_export" => export_device_memory(),
        "ipc_import" => import_device_memory(),
        "pageable" => load_through_an_unpinned_ring(),
        "calls" => call_one_function_of_each_file(),
        other => panic!("no child case {other}"),
    }
}

/// A pinned slot copied to the device, then rewritten: after waiting for
/// its event (the correct release), or before (the bug the race detector
/// must catch). The first copy is held until a wait reaches it
/// (`copy#1=hold`), so the rewrite surely lands while it is pending.
fn rewrite_slot(wait_first: bool) {
    let ctx = Context::primary(0).unwrap();
    let mut slot = PinnedStaging::new(&ctx, 1 << 16).unwrap();
    let mut device = DeviceBuffer::new(&ctx, 1 << 16).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let event = Event::new(&ctx).unwrap();
    slot.write(0, &[1u8; 1 << 16]).unwrap();
    slot.copy_to_device(0..1 << 16, &device.range(), 0, &stream).unwrap();
    event.record(&stream).unwrap();
    if wait_first {
        event.synchronize().unwrap();
    }
    slot.write(0, &[2u8; 1 << 16]).unwrap();
    stream.synchronize().unwrap();
    let mut back = vec![0u8; 1 << 16];
    device.copy_to_host(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 1), "the device holds the bytes of the copy");
    println!("CHILD OK");
}

/// Page faults this thread has taken so far.
fn thread_faults() -> i64 {
    // SAFETY: getrusage writes one rusage into the zeroed value it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD is the calling thread's.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) }, 0);
    usage.ru_minflt + usage.ru_majflt
}

/// Pins 64 MiB of fresh staging memory, then writes all of it (past a
/// first write that faults in the code it runs): prints how many page
/// faults the writes took.
fn write_pinned() {
    const LEN: usize = 64 << 20;
    let ctx = Context::primary(0).unwrap();
    let mut slot = PinnedStaging::new(&ctx, LEN).unwrap();
    let chunk = vec![3u8; 1 << 16];
    slot.write(0, &chunk).unwrap();
    let before = thread_faults();
    for offset in (chunk.len()..LEN).step_by(chunk.len()) {
        slot.write(offset, &chunk).unwrap();
    }
    println!("FAULTS WRITING THE PINNED MEMORY: {}", thread_faults() - before);
}

/// The emulator's function `name`, from the library dmaload opens (a
/// dlopen of the same path shares it where dmaload loaded it already).
fn emulator_symbol(name: &std::ffi::CStr) -> *mut libc::c_void {
    let path = std::ffi::CString::new(std::env::var("DMALOAD_LIBCUDA").unwrap()).unwrap();
    // SAFETY: a NUL-terminated path of the emulator; the handle is never
    // closed.
    let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null());
    // SAFETY: `lib` is a live handle; the name is NUL-terminated.
    let symbol = unsafe { libc::dlsym(lib, name.as_ptr()) };
    assert!(!symbol.is_null(), "no {name:?}");
    symbol
}

/// The thread's current context, asked of the emulator directly.
fn current_context() -> *mut libc::c_void {
    // SAFETY: cuCtxGetCurrent's cuda.h prototype is CUresult (CUcontext *).
    let get: extern "C" fn(*mut *mut libc::c_void) -> libc::c_int =
        unsafe { std::mem::transmute(emulator_symbol(c"cuCtxGetCurrent")) };
    let mut current = std::ptr::null_mut();
    assert_eq!(get(&mut current), 0);
    current
}

/// With two devices: work on cuda:0 leaves the thread's current context
/// (cuda:1, made current by the caller) as it was, and memory of cuda:1
/// is refused as a destination on cuda:0.
fn two_devices() {
    let (zero, one) = (Context::primary(0).unwrap(), Context::primary(1).unwrap());
    assert!(current_context().is_null(), "no context is current before the first call");
    one.make_current().unwrap();
    let before = current_context();
    assert!(!before.is_null());
    let mut on_zero = DeviceBuffer::new(&zero, 4096).unwrap();
    on_zero.fill(7).unwrap();
    let stream = Stream::new(&zero).unwrap();
    let mut staging = PinnedStaging::new(&zero, 4096).unwrap();
    staging.write(0, &[9u8; 4096]).unwrap();
    staging.copy_to_device(0..4096, &on_zero.range(), 0, &stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(current_context(), before, "dmaload changed the thread's current context");
    let on_one = DeviceBuffer::new(&one, 4096).unwrap();
    let err = DeviceRange::validate(&zero, on_one.ptr(), 4096).unwrap_err();
    assert!(err.to_string().contains("is memory of cuda:1, not of cuda:0"), "{err}");
    let mut back = [0u8; 4096];
    on_zero.copy_to_host(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 9));
    assert_eq!(current_context(), before);
    println!("CHILD OK");
}

/// Loads `$DMALOAD_TEST_EMU_FILE` to cuda:0 through a ring of two 1 MiB
/// slots; prints the error a fault gave, then checks the context drains
/// and that a second load through the same ring fails rather than reuse
/// it silently after a sticky error.
fn load_through_two_slots() {
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let ctx = match Context::primary(0) {
        Ok(ctx) => ctx,
        Err(err) => return println!("LOAD ERROR: {err}"),
    };
    let mut gpu = match DeviceBuffer::new(&ctx, len) {
        Ok(gpu) => gpu,
        Err(err) => return println!("LOAD ERROR: {err}"),
    };
    let mut ring = StagingRing::pinned(&ctx, 2, 1 << 20, 1 << 20).unwrap();
    let options = LoadOptions { engine: Engine::UringFixed, chunk_size: 1 << 20, ..LoadOptions::default() };
    let first = {
        let mut sink = CudaSink::new(&ctx, vec![(0, gpu.range())]).unwrap();
        dmaload::LoadRequest::path(&path).options(&options).to_sink(&mut ring, &mut sink)
    };
    match first {
        Ok(_) => {
            let mut back = vec![0u8; len];
            gpu.copy_to_host(0, &mut back).unwrap();
            common::assert_pattern(&back, 0);
            println!("LOAD OK");
        }
        Err(err) => {
            println!("LOAD ERROR: {err}");
            // The load returned, so every stream it used was drained; a
            // context with a sticky error refuses the next load too.
            let again = match CudaSink::new(&ctx, vec![(0, gpu.range())]) {
                Ok(mut sink) => dmaload::LoadRequest::path(&path)
                    .options(&options)
                    .to_sink(&mut ring, &mut sink)
                    .map(drop)
                    .map_err(|err| err.to_string()),
                Err(err) => Err(err.to_string()),
            };
            match again {
                Ok(_) => println!("SECOND LOAD OK"),
                Err(err) => println!("SECOND LOAD ERROR: {err}"),
            }
        }
    }
}

/// In a child: a direct load of the file through a ring the size of the
/// CLI's (32 slots of 16 MiB) at the default depth, 32: the tuner's
/// windows, depth and request size it kept, and the read mode.
fn tuned_load_through_the_cli_ring() {
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let ctx = Context::primary(0).unwrap();
    let mut gpu = DeviceBuffer::new(&ctx, len).unwrap();
    let mut ring = StagingRing::pinned(&ctx, 32, 16 << 20, 16 << 20).unwrap();
    let options =
        LoadOptions { mode: dmaload::IoMode::Direct, chunk_size: 16 << 20, ..LoadOptions::default() };
    let report = {
        let mut sink = CudaSink::new(&ctx, vec![(0, gpu.range())]).unwrap();
        dmaload::LoadRequest::path(&path).options(&options).to_sink(&mut ring, &mut sink).unwrap()
    };
    let mut back = vec![0u8; len];
    gpu.copy_to_host(0, &mut back).unwrap();
    common::assert_pattern(&back, 0);
    println!(
        "TUNED windows {} depth {} request {} cache {:?}",
        report.tuning_windows, report.queue_depth, report.request_size, report.cache
    );
}

/// In a child: the load's I/O mode ("auto" or "direct"); the lane's cases.
const CHILD_MODE: &str = "DMALOAD_TEST_EMU_MODE";
/// In a child: bytes from the file's start to evict from the page cache first.
const CHILD_EVICT: &str = "DMALOAD_TEST_EMU_EVICT";

/// Loads `$DMALOAD_TEST_EMU_FILE` to cuda:0 through a ring of eight 4 MiB
/// slots, in `$DMALOAD_TEST_EMU_MODE`, after evicting its first
/// `$DMALOAD_TEST_EMU_EVICT` bytes from the page cache: prints how many
/// bytes each lane carried and checks the device's bytes equal a host load
/// of the file; prints the error a fault gave instead.
fn load_through_the_cache_lane() {
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let evict: i64 = std::env::var(CHILD_EVICT).map_or(0, |v| v.parse().unwrap());
    if evict > 0 {
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a valid fd and range; fadvise only drops clean pages.
        let rc = unsafe {
            libc::posix_fadvise(std::os::fd::AsRawFd::as_raw_fd(&file), 0, evict, libc::POSIX_FADV_DONTNEED)
        };
        assert_eq!(rc, 0);
    }
    let mode = match std::env::var(CHILD_MODE).as_deref() {
        Ok("direct") => dmaload::IoMode::Direct,
        _ => dmaload::IoMode::Auto,
    };
    let ctx = Context::primary(0).unwrap();
    let mut gpu = DeviceBuffer::new(&ctx, len).unwrap();
    let mut ring = StagingRing::pinned(&ctx, 8, 4 << 20, 4 << 20).unwrap();
    let options = LoadOptions { mode, chunk_size: 4 << 20, ..LoadOptions::default() };
    let loaded = {
        let mut sink = CudaSink::new(&ctx, vec![(0, gpu.range())]).unwrap();
        dmaload::LoadRequest::path(&path).options(&options).to_sink(&mut ring, &mut sink)
    };
    match loaded {
        Ok(report) => {
            assert_eq!(report.ring_bytes + report.cache_lane_bytes, len as u64);
            let mut back = vec![0u8; len];
            gpu.copy_to_host(0, &mut back).unwrap();
            let (host, _) = dmaload::load(&path, &LoadOptions::default()).unwrap();
            assert!(back == host[..], "the device's bytes differ from a host load's");
            println!("LANE OK ring {} cache lane {}", report.ring_bytes, report.cache_lane_bytes);
        }
        Err(err) => println!("LOAD ERROR: {err}"),
    }
}

/// A CUDA sink that counts the deliveries made while the copy of the
/// second one (`copy#2=delay:1000000` in the emulator: it starts a second
/// late) is still running.
struct PastHeld<'d> {
    inner: CudaSink<'d>,
    deliveries: usize,
    held_slot: Option<usize>,
    past_held: usize,
}

impl Sink for PastHeld<'_> {
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> std::io::Result<()> {
        if let Some(held) = self.held_slot {
            if !self.inner.is_released(held)? {
                self.past_held += 1;
            }
        }
        self.inner.deliver(slot, data)?;
        self.deliveries += 1;
        if self.deliveries == 2 {
            self.held_slot = Some(slot);
        }
        Ok(())
    }

    fn release(&mut self, slot: usize) -> std::io::Result<()> {
        self.inner.release(slot)
    }

    fn is_released(&mut self, slot: usize) -> std::io::Result<bool> {
        self.inner.is_released(slot)
    }

    fn finish(&mut self) -> std::io::Result<()> {
        self.inner.finish()
    }
}

/// Loads `$DMALOAD_TEST_EMU_FILE` through three 1 MiB slots while the
/// emulator delays the second copy: prints how many of the later
/// deliveries went ahead while it was running.
fn load_past_a_held_copy() {
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let ctx = Context::primary(0).unwrap();
    let mut gpu = DeviceBuffer::new(&ctx, len).unwrap();
    let mut ring = StagingRing::pinned(&ctx, 3, 1 << 20, 1 << 20).unwrap();
    let options = LoadOptions { engine: Engine::UringFixed, chunk_size: 1 << 20, ..LoadOptions::default() };
    let (past_held, deliveries) = {
        let inner = CudaSink::new(&ctx, vec![(0, gpu.range())]).unwrap();
        let mut sink = PastHeld { inner, deliveries: 0, held_slot: None, past_held: 0 };
        dmaload::LoadRequest::path(&path).options(&options).to_sink(&mut ring, &mut sink).unwrap();
        (sink.past_held, sink.deliveries)
    };
    let mut back = vec![0u8; len];
    gpu.copy_to_host(0, &mut back).unwrap();
    common::assert_pattern(&back, 0);
    println!("DELIVERED PAST THE HELD COPY: {past_held} of {deliveries}");
}

/// One slow copy delays the load by at most its own latency: while the
/// emulator delays one slot's copy, every later gather is read and
/// delivered through the other slots (a file-order release would wait on
/// the slow copy before the next reuse). Counted, not timed.
#[test]
fn a_slow_copy_holds_back_only_its_own_slot() {
    let test = "a_slow_copy_holds_back_only_its_own_slot";
    if !emulator(test) {
        return;
    }
    let (_dir, path) = fault_file();
    // One copy of the process, the first load's second, starts a second
    // late: long beyond the six other 1 MiB reads and copies.
    let env = [
        ("DMALOAD_EMU_STRICT", "1"),
        ("DMALOAD_EMU_FAULTS", "copy#2=delay:1000000"),
        (CHILD_FILE, path.as_str()),
    ];
    let out = run_child("held_copy", &env);
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    assert!(output.contains("DELIVERED PAST THE HELD COPY: 6 of 8"), "{output}");
}

/// Registering memory pins it as the driver does, allocating every page
/// writable: a staging ring's first reads after `cuMemHostRegister` take
/// no page faults (the driver's cost, paid in the ring's set-up, not in
/// the load; an emulator that only read each page left it to the load).
#[test]
fn pinned_memory_is_written_without_page_faults() {
    let test = "pinned_memory_is_written_without_page_faults";
    if !emulator(test) {
        return;
    }
    let out = run_child("write_pinned", &[]);
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    let faults: i64 = output
        .split("FAULTS WRITING THE PINNED MEMORY: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no fault count in {output}"));
    // 64 MiB of pages not yet allocated would take 32 faults with 2 MiB
    // pages, 16 000 with 4 KiB ones; a few are left for the allocator.
    assert!(faults < 4, "{faults} page faults writing pinned memory: {output}");
}

#[test]
fn the_race_detector_catches_a_slot_rewritten_before_its_event_completes() {
    let test = "the_race_detector_catches_a_slot_rewritten_before_its_event_completes";
    if !emulator(test) {
        return;
    }
    let env = [("DMALOAD_EMU_STRICT", "1"), ("DMALOAD_EMU_FAULTS", "copy#1=hold")];
    let correct = run_child("rewrite_after_event", &env);
    assert!(correct.status.success() && text(&correct).contains("CHILD OK"), "{}", text(&correct));
    let broken = run_child("rewrite_before_event", &env);
    let output = text(&broken);
    assert_eq!(broken.status.signal(), Some(libc::SIGABRT), "{output}");
    assert!(output.contains("strict: the 65536-byte copy source at 0x"), "{output}");
    assert!(output.contains("was rewritten while its copy"), "{output}");
}

#[test]
fn work_on_one_device_leaves_the_threads_current_context_and_refuses_the_others_memory() {
    let test = "work_on_one_device_leaves_the_threads_current_context_and_refuses_the_others_memory";
    if !emulator(test) {
        return;
    }
    let out = run_child("two_devices", &[("DMALOAD_EMU_STRICT", "1"), ("DMALOAD_EMU_DEVICES", "2")]);
    assert!(out.status.success() && text(&out).contains("CHILD OK"), "{}", text(&out));
}

/// A file of 8 MiB: eight slot fills, four copies per stream.
fn fault_file() -> (tempfile::TempDir, String) {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 8 << 20);
    let path = path.to_str().unwrap().to_owned();
    (dir, path)
}

#[test]
fn a_two_slot_ring_loads_bit_exact_under_strict_mode_and_a_slow_link() {
    let test = "a_two_slot_ring_loads_bit_exact_under_strict_mode_and_a_slow_link";
    if !emulator(test) {
        return;
    }
    let (_dir, path) = fault_file();
    let env = [
        ("DMALOAD_EMU_STRICT", "1"),
        ("DMALOAD_EMU_LINK_GIBS", "2"),
        ("DMALOAD_EMU_COPY_LATENCY_US", "200"),
        (CHILD_FILE, path.as_str()),
    ];
    let out = run_child("load", &env);
    assert!(out.status.success() && text(&out).contains("LOAD OK"), "{}", text(&out));
}

#[test]
fn a_staged_direct_load_behind_a_slower_link_tunes_its_reads_past_the_first_trial() {
    // Every slot of the CLI's ring is soon still with the slow link: the
    // tuner used to take the first such wait as memory-bound and settle
    // after the warm-up window (tuning_windows 1); it now runs its trials
    // (a window is 128 MiB: the warm-up and the four of the depth's trial
    // fit in 768 MiB).
    let test = "a_staged_direct_load_behind_a_slower_link_tunes_its_reads_past_the_first_trial";
    if !emulator(test) {
        return;
    }
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 768 << 20);
    let cache = dir.path().join("cache"); // no depth remembered from another run
    let env = [
        ("DMALOAD_EMU_LINK_GIBS", "0.5"),
        ("DMALOAD_CACHE_DIR", cache.to_str().unwrap()),
        (CHILD_FILE, path.to_str().unwrap()),
    ];
    let out = run_child("tuned", &env);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let line = log.lines().find_map(|line| line.split_once("TUNED ")).unwrap_or_else(|| panic!("{log}")).1;
    if !line.ends_with("cache Bypass") {
        return skip(test, &format!("no direct reads of the scratch directory: {line}"));
    }
    let windows: usize = line.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(windows >= 5, "the tuner settled before a trial: {line}");
    assert!(line.contains("depth 32 ") || line.contains("depth 16 "), "never deeper than the ring: {line}");
}

#[test]
fn every_injected_fault_fails_the_load_cleanly_naming_the_cuda_error() {
    let test = "every_injected_fault_fails_the_load_cleanly_naming_the_cuda_error";
    if !emulator(test) {
        return;
    }
    let (_dir, path) = fault_file();
    // (faults, what the error must say, whether a second load through the
    // same ring must fail too: after a sticky error or a lost device).
    let cases: [(&str, &[&str], bool); 8] = [
        ("cuMemcpyHtoDAsync_v2#5=999", &["cuMemcpyHtoDAsync failed", "CUDA_ERROR_UNKNOWN", &path], false),
        ("cuMemAlloc_v2#1=2", &["cuMemAlloc failed", "CUDA_ERROR_OUT_OF_MEMORY"], false),
        ("copy#3=sticky:700", &["CUDA_ERROR_ILLEGAL_ADDRESS", &path], true),
        ("lost=3145728", &["CUDA_ERROR_UNKNOWN", &path], true),
        ("cuEventQuery#2=719", &["cuEventQuery failed", "CUDA_ERROR_LAUNCH_FAILED", &path], false),
        ("cuInit#1=100", &["cuInit failed", "CUDA_ERROR_NO_DEVICE", "no NVIDIA GPU is visible"], false),
        ("cuInit#1=34", &["cuInit failed", "CUDA_ERROR_STUB_LIBRARY", "stub"], false),
        ("cuInit#1=803", &["cuInit failed", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"], false),
    ];
    for (faults, needles, sticky) in cases {
        let env = [("DMALOAD_EMU_STRICT", "1"), ("DMALOAD_EMU_FAULTS", faults), (CHILD_FILE, path.as_str())];
        let out = run_child("load", &env);
        let output = text(&out);
        assert!(out.status.success(), "{faults}: {output}");
        let error = output
            .lines()
            .find(|l| l.contains("LOAD ERROR: ") && !l.contains("SECOND"))
            .unwrap_or_else(|| panic!("{faults}: {output}"));
        for needle in needles {
            assert!(error.contains(needle), "{faults}: no {needle:?} in {error}");
        }
        if sticky {
            assert!(output.contains("SECOND LOAD ERROR"), "{faults}: the ring was reused: {output}");
        }
    }
}

/// A copy that never completes (`copy#3=hang`): the load fails once the
/// copy timeout passes (`DMALOAD_CUDA_TIMEOUT`, 1 s here), naming the file
/// and the timeout; the device is given up, so the next load on it fails
/// at once; and the child process ends (nothing waits on the hung copy in
/// a drop). Before, the final stream wait never returned.
#[test]
fn a_copy_that_never_completes_fails_the_load_after_the_timeout_and_nothing_hangs() {
    let test = "a_copy_that_never_completes_fails_the_load_after_the_timeout_and_nothing_hangs";
    if !emulator(test) {
        return;
    }
    let (_dir, path) = fault_file();
    let env =
        [("DMALOAD_EMU_FAULTS", "copy#3=hang"), ("DMALOAD_CUDA_TIMEOUT", "1"), (CHILD_FILE, path.as_str())];
    let out = run_child("load", &env);
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    let error = output
        .lines()
        .find(|l| l.contains("LOAD ERROR: ") && !l.contains("SECOND"))
        .unwrap_or_else(|| panic!("{output}"));
    for needle in ["did not complete within 1 s", "DMALOAD_CUDA_TIMEOUT", &path] {
        assert!(error.contains(needle), "no {needle:?} in {error}");
    }
    let again =
        output.lines().find(|l| l.contains("SECOND LOAD ERROR: ")).unwrap_or_else(|| panic!("{output}"));
    assert!(again.contains("stopped answering"), "{again}");
}

/// A file of 32 MiB (eight 4 MiB load windows), in the page cache.
fn lane_file() -> (tempfile::TempDir, String) {
    let dir = scratch_dir();
    let path = dir.path().join("model.bin");
    write_pattern_file(&path, 32 << 20);
    let path = path.to_str().unwrap().to_owned();
    (dir, path)
}

/// The lane's case in a child under strict mode; returns its "LANE OK"
/// line's (ring bytes, cache-lane bytes).
fn lane_split(path: &str, mode: &str, evict: u64) -> (u64, u64) {
    let evict = evict.to_string();
    let env = [
        ("DMALOAD_EMU_STRICT", "1"),
        ("DMALOAD_EMU_LINK_GIBS", "2"),
        (CHILD_FILE, path),
        (CHILD_MODE, mode),
        (CHILD_EVICT, evict.as_str()),
    ];
    let out = run_child("lane", &env);
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    let at = output.find("LANE OK").unwrap_or_else(|| panic!("{output}"));
    let words: Vec<&str> = output[at..].split_whitespace().collect();
    (words[3].parse().unwrap(), words[6].parse().unwrap())
}

/// A file in the page cache goes to the device on the cache lane (no byte
/// through the ring), bit-exact under the race detector; `mode=direct`
/// forces the ring; with its first half evicted, the ring reads that half
/// and the lane carries the rest.
#[test]
fn cached_windows_take_the_cache_lane_and_the_rest_the_ring_bit_exact_under_strict_mode() {
    let test = "cached_windows_take_the_cache_lane_and_the_rest_the_ring_bit_exact_under_strict_mode";
    if !emulator(test) {
        return;
    }
    let (_dir, path) = lane_file();
    assert_eq!(lane_split(&path, "auto", 0), (0, 32 << 20), "a cached file: all on the cache lane");
    assert_eq!(lane_split(&path, "direct", 0), (32 << 20, 0), "mode=direct: all through the ring");
    assert_eq!(lane_split(&path, "auto", 16 << 20), (16 << 20, 16 << 20), "half cached: half each way");
}

/// A fault on the cache lane (a failed copy, a sticky error, a failed
/// event query, a copy that never completes) fails the load cleanly: the
/// error names the file, the offset and the CUDA error, and the child ends
/// (every stream drained or given up, no thread left waiting).
#[test]
fn a_fault_on_the_cache_lane_fails_the_load_cleanly() {
    let test = "a_fault_on_the_cache_lane_fails_the_load_cleanly";
    if !emulator(test) {
        return;
    }
    let (_dir, path) = lane_file();
    let cases: [(&str, &[&str]); 4] = [
        ("cuMemcpyHtoDAsync_v2#5=999", &["cuMemcpyHtoDAsync failed", "CUDA_ERROR_UNKNOWN"]),
        ("copy#3=sticky:700", &["CUDA_ERROR_ILLEGAL_ADDRESS"]),
        ("cuEventQuery#2=719", &["cuEventQuery failed", "CUDA_ERROR_LAUNCH_FAILED"]),
        ("copy#3=hang", &["did not complete within 1 s", "DMALOAD_CUDA_TIMEOUT"]),
    ];
    for (faults, needles) in cases {
        let env = [
            ("DMALOAD_EMU_STRICT", "1"),
            ("DMALOAD_EMU_FAULTS", faults),
            ("DMALOAD_CUDA_TIMEOUT", "1"),
            (CHILD_FILE, path.as_str()),
        ];
        let out = run_child("lane", &env);
        let output = text(&out);
        assert!(out.status.success(), "{faults}: {output}");
        let error = output
            .lines()
            .find(|l| l.contains("LOAD ERROR: "))
            .unwrap_or_else(|| panic!("{faults}: {output}"));
        for needle in needles.iter().chain(&["copy from the page cache", path.as_str(), "at offset"]) {
            assert!(error.contains(needle), "{faults}: no {needle:?} in {error}");
        }
    }
}

/// In a child: `load_to(cuda:0)` of the whole file with `verify`; prints
/// `VERIFY OK` once the device holds the file's bytes, else `VERIFY ERROR`
/// with the error's kind (the load returned no device memory).
fn verified_load_to_the_device() {
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let options = LoadOptions {
        verify: true,
        to: dmaload::Destination::Cuda(0),
        chunk_size: 1 << 20,
        ..LoadOptions::default()
    };
    let file = dmaload::OpenFile::open(&path).unwrap();
    match dmaload::LoadRequest::open(&file).options(&options).load() {
        Ok((dmaload::Loaded::Device(device), _)) => {
            let mut back = Vec::new();
            device.read_each(|bytes| back.extend_from_slice(bytes)).unwrap();
            assert_eq!(back, std::fs::read(&path).unwrap());
            println!("VERIFY OK");
        }
        Ok(_) => panic!("cuda:0 gave no device memory"),
        Err(err) => println!("VERIFY ERROR {:?}: {err}", err.kind()),
    }
}

/// In a child: a safetensors file's header read, then its data section
/// loaded into device memory through a two-slot pinned ring with `verify`
/// (the staged path of `load_file(device="cuda:0")`): prints as above.
fn verified_data_section_to_the_device() {
    use dmaload::format::safetensors as st;
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let ctx = Context::primary(0).unwrap();
    let file = dmaload::OpenFile::open(&path).unwrap();
    let (header, _) = st::read_header_of(&file).unwrap();
    let (start, len) = (header.data_start(), header.data_len());
    let mut gpu = DeviceBuffer::new(&ctx, len as usize).unwrap();
    let mut ring = StagingRing::pinned(&ctx, 2, 1 << 20, 1 << 20).unwrap();
    let options = LoadOptions { verify: true, chunk_size: 1 << 20, ..LoadOptions::default() };
    let loaded = {
        let mut sink = CudaSink::new(&ctx, vec![(start, gpu.range())]).unwrap();
        dmaload::LoadRequest::open(&file)
            .range(start, Some(len))
            .options(&options)
            .to_sink(&mut ring, &mut sink)
    };
    match loaded {
        Ok(_) => {
            let mut back = vec![0u8; len as usize];
            gpu.copy_to_host(0, &mut back).unwrap();
            assert_eq!(back, std::fs::read(&path).unwrap()[start as usize..]);
            println!("VERIFY OK");
        }
        Err(err) => println!("VERIFY ERROR {:?}: {err}", err.kind()),
    }
}

/// `verify` on the CUDA path, under the emulator's strict mode: a whole
/// file to `cuda:0`, and a safetensors file's data section after its header
/// (the digest covers both). Each loads when intact; with a byte flipped
/// (in the data, or a blank of the header's JSON turned into a tab, which
/// still parses) each fails with `Corrupt` and hands out no device memory.
#[test]
fn verified_loads_to_cuda_check_the_whole_file_and_fail_on_a_flipped_byte() {
    let test = "verified_loads_to_cuda_check_the_whole_file_and_fail_on_a_flipped_byte";
    if !emulator(test) {
        return;
    }
    let dir = scratch_dir();
    let whole = dir.path().join("model.bin");
    write_pattern_file(&whole, (5 << 20) + 333);
    let section = dir.path().join("model.safetensors");
    let json = br#"{"a": {"dtype": "U8", "shape": [3145728], "data_offsets": [0, 3145728]}}"#;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json);
    bytes.extend((0..3u32 << 20).map(|i| (i % 253) as u8));
    std::fs::write(&section, &bytes).unwrap();
    let sums =
        Command::new("sha256sum").args(["model.bin", "model.safetensors"]).current_dir(dir.path()).output();
    std::fs::write(dir.path().join("SHA256SUMS"), sums.unwrap().stdout).unwrap();
    let run = |case: &str, path: &std::path::Path| {
        let env = [("DMALOAD_EMU_STRICT", "1"), (CHILD_FILE, path.to_str().unwrap())];
        let out = run_child(case, &env);
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    assert!(run("verify_whole", &whole).contains("VERIFY OK"));
    assert!(run("verify_section", &section).contains("VERIFY OK"));

    let mut flipped = std::fs::read(&whole).unwrap();
    flipped[(4 << 20) + 1] ^= 0x40;
    std::fs::write(&whole, &flipped).unwrap();
    let out = run("verify_whole", &whole);
    assert!(out.contains("VERIFY ERROR Corrupt") && out.contains("SHA-256 mismatch"), "{out}");

    let blank = 8 + bytes[8..].iter().position(|&b| b == b' ').unwrap();
    bytes[blank] = b'\t';
    std::fs::write(&section, &bytes).unwrap();
    let out = run("verify_section", &section);
    assert!(out.contains("VERIFY ERROR Corrupt"), "{out}");
    bytes[blank] = b' ';
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&section, &bytes).unwrap();
    let out = run("verify_section", &section);
    assert!(out.contains("VERIFY ERROR Corrupt"), "{out}");
}

/// The device allocation the IPC cases share: an odd length (not a whole
/// 512-byte granule), and the span of it the importer writes.
const IPC_LEN: usize = (4 << 20) + 123;
const IPC_WRITTEN: std::ops::Range<usize> = 4096..(3 << 20) + 7;

/// Process one of the IPC cases: allocates device memory and fills it
/// with 0xa5, exports it, checks a process cannot open its own handle,
/// lets a second process (`import_device_memory`, mode `$CHILD_IPC`)
/// copy into it, then reads all of it back: the importer's pattern bytes
/// in `IPC_WRITTEN`, 0xa5 around them.
fn export_device_memory() {
    let ctx = Context::primary(0).unwrap();
    let mut gpu = DeviceBuffer::new(&ctx, IPC_LEN).unwrap();
    gpu.fill(0xa5).unwrap();
    let handle = gpu.ipc_handle().unwrap();
    let own = IpcMemory::open(&ctx, &handle).unwrap_err();
    assert!(own.to_string().contains("cuIpcOpenMemHandle"), "{own}");
    let hex: String = handle.0.iter().map(|b| format!("{b:02x}")).collect();
    let mode = std::env::var(CHILD_IPC).unwrap();
    let out = run_child("ipc_import", &[(CHILD_HANDLE, hex.as_str()), (CHILD_IPC, mode.as_str())]);
    println!(
        "IMPORTER EXIT: {:?} signal {:?}\nIMPORTER OUTPUT:\n{}",
        out.status.code(),
        out.status.signal(),
        text(&out)
    );
    let mut back = vec![0u8; IPC_LEN];
    gpu.copy_to_host(0, &mut back).unwrap();
    common::assert_pattern(&back[IPC_WRITTEN], IPC_WRITTEN.start as u64);
    assert!(back[..IPC_WRITTEN.start].iter().chain(&back[IPC_WRITTEN.end..]).all(|&b| b == 0xa5));
    println!("CHILD OK");
}

/// Process two: opens the handle, copies the file pattern of
/// `IPC_WRITTEN` into it from pinned memory, waits and closes it; in mode
/// "copy_after_close" then queues a copy into the closed mapping.
fn import_device_memory() {
    let hex = std::env::var(CHILD_HANDLE).unwrap();
    let mut bytes = [0u8; 64];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let ctx = Context::primary(0).unwrap();
    let mut opened = IpcMemory::open(&ctx, &IpcHandle(bytes)).unwrap();
    assert_eq!(opened.len(), IPC_LEN);
    let len = IPC_WRITTEN.len();
    let mut staging = PinnedStaging::new(&ctx, len).unwrap();
    let data: Vec<u8> = IPC_WRITTEN.map(|at| common::pattern_byte(at as u64)).collect();
    staging.write(0, &data).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    staging.copy_to_device(0..len, &opened.range(), IPC_WRITTEN.start, &stream).unwrap();
    stream.synchronize().unwrap();
    let (ptr, len) = (opened.ptr(), opened.len());
    drop(opened);
    if std::env::var(CHILD_IPC).unwrap() == "copy_after_close" {
        // SAFETY: none: the mapping is closed, which is what the emulator
        // must catch (it aborts before any byte is written).
        let stale = unsafe { DeviceRange::from_raw(ptr, len) };
        let result = staging.copy_to_device(0..64, &stale, 0, &stream);
        println!("COPY AFTER CLOSE RETURNED {result:?}");
    }
    println!("IMPORTED OK");
}

/// Two processes share one emulated device: the importer's copy lands in
/// the exporter's memory bit-exact, and only where it was aimed, under
/// strict mode; a copy into a handle already closed aborts the importer
/// (and writes nothing), where a driver would corrupt or fault.
#[test]
fn device_memory_is_shared_between_processes_through_ipc_handles() {
    let test = "device_memory_is_shared_between_processes_through_ipc_handles";
    if !emulator(test) {
        return;
    }
    let out = run_child("ipc_export", &[("DMALOAD_EMU_STRICT", "1"), (CHILD_IPC, "copy")]);
    let output = text(&out);
    assert!(out.status.success() && output.contains("CHILD OK"), "{output}");
    assert!(output.contains("IMPORTER EXIT: Some(0)") && output.contains("IMPORTED OK"), "{output}");

    let out = run_child("ipc_export", &[("DMALOAD_EMU_STRICT", "1"), (CHILD_IPC, "copy_after_close")]);
    let output = text(&out);
    assert!(out.status.success() && output.contains("CHILD OK"), "{output}");
    assert!(output.contains(&format!("signal Some({})", libc::SIGABRT)), "{output}");
    assert!(output.contains("strict: cuMemcpyHtoDAsync at 0x"), "{output}");
    assert!(output.contains("that cuIpcCloseMemHandle closed"), "{output}");
    assert!(!output.contains("COPY AFTER CLOSE RETURNED"), "{output}");
}

/// Loads `$DMALOAD_TEST_EMU_FILE` to cuda:0 through a ring that is not
/// pinned (`StagingRing::new`): what a ring that lost its pinning does.
fn load_through_an_unpinned_ring() {
    let path = std::path::PathBuf::from(std::env::var_os(CHILD_FILE).unwrap());
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let ctx = Context::primary(0).unwrap();
    let mut gpu = DeviceBuffer::new(&ctx, len).unwrap();
    let mut ring = StagingRing::new(2, 1 << 20, 1 << 20).unwrap();
    {
        let mut sink = CudaSink::new(&ctx, vec![(0, gpu.range())]).unwrap();
        dmaload::LoadRequest::path(&path).to_sink(&mut ring, &mut sink).unwrap();
    }
    let mut back = vec![0u8; len];
    gpu.copy_to_host(0, &mut back).unwrap();
    common::assert_pattern(&back, 0);
    println!("CHILD OK");
}

/// Strict mode refuses a copy from pageable memory, which the driver
/// would stage quietly at a fraction of the link: a staging ring that
/// lost its pinning fails the suite instead of passing it slowly.
#[test]
fn strict_mode_aborts_on_a_copy_from_unpinned_memory() {
    let test = "strict_mode_aborts_on_a_copy_from_unpinned_memory";
    if !emulator(test) {
        return;
    }
    let (_dir, path) = fault_file();
    let lenient = run_child("pageable", &[("DMALOAD_EMU_STRICT", "0"), (CHILD_FILE, path.as_str())]);
    assert!(lenient.status.success() && text(&lenient).contains("CHILD OK"), "{}", text(&lenient));
    let strict = run_child("pageable", &[("DMALOAD_EMU_STRICT", "1"), (CHILD_FILE, path.as_str())]);
    let output = text(&strict);
    assert_eq!(strict.status.signal(), Some(libc::SIGABRT), "{output}");
    assert!(output.contains("strict: cuMemcpyHtoDAsync of 1048576 bytes to 0x"), "{output}");
    assert!(output.contains("from pageable host memory"), "{output}");
}

/// Calls one entry point of each of the emulator's files (emu.c,
/// memory.c, copy.c, ipc.c) in turn, four rounds, straight through dlsym
/// (no dmaload call between to add to the counts); prints each round's
/// results.
fn call_one_function_of_each_file() {
    use libc::{c_int, c_uint};
    use std::mem::transmute;
    type Handle = *mut libc::c_void;
    // SAFETY: cuInit's cuda.h prototype is CUresult (unsigned).
    let init: extern "C" fn(c_uint) -> c_int = unsafe { transmute(emulator_symbol(c"cuInit")) };
    // SAFETY: cuDevicePrimaryCtxRetain's is CUresult (CUcontext *, CUdevice).
    let retain: extern "C" fn(*mut Handle, c_int) -> c_int =
        unsafe { transmute(emulator_symbol(c"cuDevicePrimaryCtxRetain")) };
    // SAFETY: cuCtxSetCurrent's is CUresult (CUcontext).
    let set_current: extern "C" fn(Handle) -> c_int =
        unsafe { transmute(emulator_symbol(c"cuCtxSetCurrent")) };
    // SAFETY: cuDeviceGetCount's is CUresult (int *).
    let count: extern "C" fn(*mut c_int) -> c_int =
        unsafe { transmute(emulator_symbol(c"cuDeviceGetCount")) };
    // SAFETY: cuMemGetInfo_v2's is CUresult (size_t *, size_t *).
    let mem_info: extern "C" fn(*mut usize, *mut usize) -> c_int =
        unsafe { transmute(emulator_symbol(c"cuMemGetInfo_v2")) };
    // SAFETY: cuEventCreate's is CUresult (CUevent *, unsigned).
    let event: extern "C" fn(*mut Handle, c_uint) -> c_int =
        unsafe { transmute(emulator_symbol(c"cuEventCreate")) };
    // SAFETY: cuIpcGetMemHandle's is CUresult (CUipcMemHandle *, CUdeviceptr),
    // the handle 64 bytes.
    let ipc_handle: extern "C" fn(*mut [u8; 64], u64) -> c_int =
        unsafe { transmute(emulator_symbol(c"cuIpcGetMemHandle")) };
    let mut ctx = std::ptr::null_mut();
    assert_eq!((init(0), retain(&mut ctx, 0), set_current(ctx)), (0, 0, 0));
    let rounds: Vec<[c_int; 4]> = (0..4)
        .map(|_| {
            let (mut n, mut free, mut total, mut created) = (0, 0, 0, std::ptr::null_mut());
            // Left to right; no allocation at 0, so cuIpcGetMemHandle's
            // own answer is CUDA_ERROR_INVALID_VALUE (1).
            [
                count(&mut n),
                mem_info(&mut free, &mut total),
                event(&mut created, 0),
                ipc_handle(&mut [0; 64], 0),
            ]
        })
        .collect();
    println!("CALLS {rounds:?}");
}

/// `SYMBOL#N` fails the Nth call of SYMBOL, whichever of the emulator's
/// files defines it, and no other call: each entry point counts its own
/// calls (a counter per position in a file, shared between files, would
/// fail another call, or none).
#[test]
fn an_injected_fault_fails_the_nth_call_of_its_own_function_only() {
    let test = "an_injected_fault_fails_the_nth_call_of_its_own_function_only";
    if !emulator(test) {
        return;
    }
    let faults = "cuDeviceGetCount#3=999,cuMemGetInfo_v2#3=999,cuEventCreate#3=999,cuIpcGetMemHandle#3=999";
    let out = run_child("calls", &[("DMALOAD_EMU_FAULTS", faults)]);
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    let third_fails = "CALLS [[0, 0, 0, 1], [0, 0, 0, 1], [999, 999, 999, 999], [0, 0, 0, 1]]";
    assert!(output.contains(third_fails), "{output}");
}
