//! The CUDA driver layer. Runs against the installed NVIDIA driver where
//! one loads, else against the emulator in tests/cuda-emu (built by the
//! test itself, strict mode); "SKIP cuda: <reason>" only where neither can
//! run. The no-driver errors are checked in a child process that has no
//! driver.

mod common;

use common::pattern_byte;
use dmaload::cuda::{self, Context, DeviceBuffer, DeviceRange, Event, PinnedStaging, Stream};

/// cuda:0, or `None` after printing why the test cannot run here.
fn gpu(test: &str) -> Option<Context> {
    if let Err(reason) = common::cuda_driver() {
        common::skip(&format!("cuda: {test}"), &reason);
        return None;
    }
    match cuda::device_count() {
        Err(err) => common::skip(&format!("cuda: {test}"), &err.to_string()),
        Ok(0) => common::skip(&format!("cuda: {test}"), "the driver reports no CUDA device"),
        Ok(_) => return Some(Context::primary(0).expect("cuda:0 exists when device_count() > 0")),
    }
    None
}

/// Set in the child process that checks the no-driver errors.
const NO_DRIVER_CHILD: &str = "DMALOAD_TEST_NO_DRIVER_CHILD";

#[test]
fn without_libcuda_every_entry_point_names_the_missing_library() {
    const TEST: &str = "without_libcuda_every_entry_point_names_the_missing_library";
    if std::env::var_os(NO_DRIVER_CHILD).is_none() {
        // This process may be using the emulator (whose soname is
        // libcuda.so.1 too): look from a child without it.
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(NO_DRIVER_CHILD, "1")
            .env_remove("DMALOAD_LIBCUDA")
            .output()
            .unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(stdout.contains("1 passed"), "{stdout}");
        eprint!(
            "{}",
            stderr.lines().filter(|l| l.starts_with("SKIP")).map(|l| format!("{l}\n")).collect::<String>()
        );
        return;
    }
    if common::installed_libcuda_loads() {
        return common::skip(TEST, "libcuda.so.1 loads here, so the no-driver errors cannot be seen");
    }
    let err = Context::primary(0).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("libcuda.so.1"), "{text}");
    assert!(text.contains("no NVIDIA driver is installed"), "{text}");
    assert_eq!(err.op(), "dlopen");
    assert_eq!(err.code(), None);
    assert_eq!(err.errno(), libc::ENODEV);
    for other in [cuda::device_count().unwrap_err(), cuda::driver_version().unwrap_err()] {
        assert_eq!(other.to_string(), text);
    }
    let io = std::io::Error::from(err);
    assert!(io.to_string().contains("libcuda.so.1"), "{io}");
    let inner = io.get_ref().and_then(|e| e.downcast_ref::<cuda::CudaError>()).expect("the CudaError inside");
    assert_eq!(inner.errno(), libc::ENODEV);
}

#[test]
fn the_driver_reports_a_version_devices_and_their_memory() {
    let Some(ctx) = gpu("the_driver_reports_a_version_devices_and_their_memory") else { return };
    let version = cuda::driver_version().unwrap();
    assert!(version >= 11000, "driver version {version}");
    let count = cuda::device_count().unwrap();
    assert!(count >= 1);
    assert_eq!(ctx.ordinal(), 0);
    let name = ctx.device_name().unwrap();
    assert!(!name.is_empty());
    let (free, total) = ctx.mem_info().unwrap();
    assert!(total > 0 && free <= total, "free {free} of {total}");
    ctx.make_current().unwrap();
    ctx.synchronize().unwrap();
    let again = Context::primary(0).unwrap();
    assert!(again.same(&ctx), "both retain the one primary context");
    eprintln!("cuda: driver {version}, {count} device(s), cuda:0 is {name}, {free} of {total} bytes free");
}

#[test]
fn an_ordinal_past_the_devices_is_refused_with_the_count() {
    let Some(_ctx) = gpu("an_ordinal_past_the_devices_is_refused_with_the_count") else { return };
    let count = cuda::device_count().unwrap();
    let err = Context::primary(count).unwrap_err();
    let text = err.to_string();
    assert!(text.contains(&format!("cuda:{count} asked for")), "{text}");
    assert!(text.contains(&format!("sees {count} CUDA device")), "{text}");
    assert_eq!(err.errno(), libc::ENODEV);
}

#[test]
fn a_pinned_async_copy_round_trips_bit_exact() {
    let Some(ctx) = gpu("a_pinned_async_copy_round_trips_bit_exact") else { return };
    let len = (8 << 20) + 12345;
    let mut device = DeviceBuffer::new(&ctx, len + 4096).unwrap();
    device.fill(0x5A).unwrap();
    let mut staging = PinnedStaging::new(&ctx, len).unwrap();
    let pattern: Vec<u8> = (0..len as u64).map(pattern_byte).collect();
    staging.write(0, &pattern).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let done = Event::new(&ctx).unwrap();
    {
        // Two copies, the second landing first in the buffer: order does
        // not matter, only offsets.
        let dst = device.range();
        let half = len / 2;
        staging.copy_to_device(half..len, &dst, 100 + half, &stream).unwrap();
        staging.copy_to_device(0..half, &dst, 100, &stream).unwrap();
        done.record(&stream).unwrap();
        while !done.is_complete().unwrap() {
            std::thread::yield_now();
        }
        done.synchronize().unwrap();
    }
    stream.synchronize().unwrap();
    let mut back = vec![0u8; len + 4096];
    device.copy_to_host(0, &mut back).unwrap();
    assert!(back[..100].iter().all(|&b| b == 0x5A), "bytes before the copy are untouched");
    common::assert_pattern(&back[100..100 + len], 0);
    assert!(back[100 + len..].iter().all(|&b| b == 0x5A), "bytes after the copy are untouched");
    device.zero().unwrap();
    device.copy_to_host(0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0));
}

#[test]
fn copies_outside_either_side_are_errors_not_panics() {
    let Some(ctx) = gpu("copies_outside_either_side_are_errors_not_panics") else { return };
    let mut device = DeviceBuffer::new(&ctx, 4096).unwrap();
    let mut staging = PinnedStaging::new(&ctx, 8192).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let dst = device.range();
    let err = staging.copy_to_device(0..4097, &dst, 0, &stream).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL, "{err}");
    let err = staging.copy_to_device(0..4096, &dst, 1, &stream).unwrap_err();
    assert!(err.to_string().contains("past the 4096-byte device range"), "{err}");
    let err = staging.copy_to_device(8000..8193, &dst, 0, &stream).unwrap_err();
    assert!(err.to_string().contains("staging memory"), "{err}");
    assert!(staging.write(8190, &[1, 2, 3]).is_err());
    let mut out = [0u8; 2];
    assert!(device.copy_to_host(4095, &mut out).is_err());
    assert!(device.copy_to_host(4094, &mut out).is_ok());
    let empty = DeviceBuffer::new(&ctx, 0).unwrap();
    assert!(empty.is_empty());
    empty.copy_to_host(0, &mut []).unwrap();
}

#[test]
fn validation_refuses_ranges_past_an_allocation_or_off_the_device() {
    let Some(ctx) = gpu("validation_refuses_ranges_past_an_allocation_or_off_the_device") else { return };
    // Whole 2 MiB pages, so the allocation is exactly this long however
    // the driver rounds.
    let len = 4 << 20;
    let device = DeviceBuffer::new(&ctx, len).unwrap();
    let ptr = device.ptr();
    DeviceRange::validate(&ctx, ptr, len).unwrap();
    DeviceRange::validate(&ctx, ptr + 4096, len - 4096).unwrap();
    DeviceRange::validate(&ctx, ptr, 0).unwrap();
    let err = DeviceRange::validate(&ctx, ptr + 1, len).unwrap_err();
    assert!(err.to_string().contains("past the end of their allocation"), "{err}");
    assert_eq!(err.errno(), libc::EINVAL);
    let host = vec![0u8; 4096];
    let err = DeviceRange::validate(&ctx, host.as_ptr() as u64, host.len()).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL, "{err}");
    let err = DeviceRange::validate(&ctx, u64::MAX - 10, 100).unwrap_err();
    assert!(err.to_string().contains("wrap"), "{err}");
    // SAFETY: the span is the allocation of `device`, which outlives the
    // range, and nothing else uses it meanwhile.
    let range = unsafe { DeviceRange::checked(&ctx, ptr, len) }.unwrap();
    assert_eq!((range.ptr(), range.len()), (ptr, len));
    // SAFETY: never used for a copy.
    assert!(unsafe { DeviceRange::checked(&ctx, ptr, len + 1) }.is_err());
}

#[test]
fn a_fresh_event_is_complete_and_streams_drain_on_drop() {
    let Some(ctx) = gpu("a_fresh_event_is_complete_and_streams_drain_on_drop") else { return };
    let event = Event::new(&ctx).unwrap();
    assert!(event.is_complete().unwrap(), "an event never recorded counts as complete");
    let stream = Stream::new(&ctx).unwrap();
    event.record(&stream).unwrap();
    stream.synchronize().unwrap();
    assert!(event.is_complete().unwrap());
    // Made on one thread, used and dropped on another.
    std::thread::spawn(move || {
        event.record(&stream).unwrap();
        event.synchronize().unwrap();
        drop(stream);
    })
    .join()
    .unwrap();
}
