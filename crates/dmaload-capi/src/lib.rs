//! dmaload's C library: load (whole file or range) into shareable memory,
//! load into a dma-buf (seed 000's alloc-and-read), save, and their
//! reports, behind a C ABI. The header `include/dmaload.h` is generated
//! from this file by cbindgen (`tests/header.rs` checks it is current).
//!
//! Rules every function follows:
//! - Functions that can fail return 0, or a positive errno value (also
//!   stored in `errno`) with a message for [`dmaload_last_error`] on the
//!   calling thread, naming the operation, the path, the file offset where
//!   there is one, and the cause.
//! - No panic unwinds into C: every entry point catches it and returns EIO
//!   (`internal error` in the message).
//! - Pointers are checked for NULL; strings are NUL-terminated; a path may
//!   be any bytes but empty.
//! - Everything may be called from any thread at once; the last error is
//!   per thread. An object may be read from several threads, but freed once,
//!   by one thread, when no other uses it.
#![allow(non_camel_case_types)]

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_void, CStr, CString, OsStr};
use std::os::fd::{AsRawFd, BorrowedFd, IntoRawFd};
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use dmaload::heap::DmaBuf;
use dmaload::{
    Buffer, Destination, Engine, IoMode, LoadOptions, LoadReport, LoadRequest, LoadedDmaBuf, SaveOptions,
};

/// `engine`: io_uring reads into registered buffers (the default).
pub const DMALOAD_ENGINE_URING_FIXED: u32 = 0;
/// `engine`: io_uring reads.
pub const DMALOAD_ENGINE_URING: u32 = 1;
/// `engine`: a pool of threads issuing `pread` (`pwrite` for a save).
pub const DMALOAD_ENGINE_PREAD_POOL: u32 = 2;
/// `engine`: one thread of sequential `read` (`write`) calls.
pub const DMALOAD_ENGINE_READ: u32 = 3;

/// `mode`: direct I/O where the filesystem allows, else buffered without
/// page-cache residue (the default).
pub const DMALOAD_MODE_AUTO: u32 = 0;
/// `mode`: direct I/O (O_DIRECT) or an error.
pub const DMALOAD_MODE_DIRECT: u32 = 1;
/// `mode`: buffered, through the page cache, which keeps the file.
pub const DMALOAD_MODE_BUFFERED: u32 = 2;
/// `mode`: buffered, dropping the pages read (or written).
pub const DMALOAD_MODE_DONTCACHE: u32 = 3;

/// Options of a load. Start from `dmaload_load_options_default()` and
/// change fields: a zero-filled struct is not the defaults.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dmaload_load_options {
    /// `DMALOAD_ENGINE_*`.
    pub engine: u32,
    /// `DMALOAD_MODE_*`.
    pub mode: u32,
    /// Where `dmaload_load` puts the bytes, as the CLI's `--to` names it:
    /// "auto" (also when NULL: the cheapest memory that keeps an fd),
    /// "memfd", "memfd-huge", "hugetlb", "anonymous-thp" or "anonymous".
    /// Borrowed for the call only. `dmaload_load_dmabuf` takes its target separately.
    pub to: *const c_char,
    /// Bytes populated (and registered) as one unit.
    pub gather_size: u64,
    /// Bytes per read request.
    pub chunk_size: u64,
    /// Requests in flight (io_uring engines); left at the default, direct
    /// reads tune it per block device.
    pub queue_depth: u32,
    /// Threads of the pread-pool engine.
    pub threads: u32,
    /// Threads populating memory ahead of the reads.
    pub populate_threads: u32,
    /// Slots of the staging ring `dmaload_load_dmabuf` reads through for a
    /// "dma-heap:NAME" target, at least 2; 0 (the default): sized from the
    /// range (a quarter of it, at most 128 MiB). Other loads take no ring.
    pub staging_slots: u32,
    /// Bytes per staging slot, at most 1 GiB; 0 (the default): the heap
    /// ring's own.
    pub staging_slot_size: u64,
    /// Non-zero: after the load, measure how much of the range is in the
    /// page cache (in the report's JSON, `page_cache`).
    pub measure_page_cache: u32,
    /// Non-zero: check the file against the digest that the `B3SUMS` or
    /// `SHA256SUMS` file beside it records (what `b3sum` or `sha256sum`
    /// writes; BLAKE3 first when both list it), hashing the bytes
    /// as they arrive. A mismatch fails with errno `EBADMSG` (the message
    /// names the file and both digests); a missing sums file or a file it
    /// does not list with `EINVAL`. No buffer is returned either way.
    /// Whole files only (`dmaload_load`).
    pub verify: u32,
}

/// Options of a save. Start from `dmaload_save_options_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct dmaload_save_options {
    /// `DMALOAD_ENGINE_*`.
    pub engine: u32,
    /// `DMALOAD_MODE_*`.
    pub mode: u32,
    /// Non-zero (the default): fsync the file before the rename and the
    /// directory after it. Zero: a crash of the machine may lose the new
    /// file (a killed process still never leaves a torn one).
    pub sync: u32,
    /// Bytes per write request.
    pub chunk_size: u64,
    /// Writes in flight (io_uring engines).
    pub queue_depth: u32,
    /// Threads (pread-pool engine).
    pub threads: u32,
}

/// What a load did. Strings are NUL-terminated and owned by the report.
#[repr(C)]
#[derive(Debug)]
pub struct dmaload_report {
    /// First byte of the file loaded.
    pub offset: u64,
    /// Bytes loaded.
    pub bytes: u64,
    /// From the call to the filled destination.
    pub total_seconds: f64,
    /// Reading, less the time reads waited for memory.
    pub io_seconds: f64,
    /// Allocating the destination (beside the reads).
    pub alloc_seconds: f64,
    pub gib_per_second: f64,
    /// Non-zero when the reads used direct I/O.
    pub direct_io: u32,
    /// Paths not taken, and why: listed in `json` under `fallbacks`.
    pub fallback_count: u32,
    /// The engine that did the reading (after fallbacks).
    pub engine: *const c_char,
    /// Where the bytes went ("memfd", "udmabuf (...)", "dma-heap:system
    /// via staging ring (...)"), and for the "dmabuf" target which producer
    /// was chosen and why.
    pub destination: *const c_char,
    /// The whole report as one JSON object, as `dmaload load --json` prints it.
    pub json: *const c_char,
}

/// What a save did. Strings are NUL-terminated and owned by the report.
#[repr(C)]
#[derive(Debug)]
pub struct dmaload_save_report {
    pub bytes: u64,
    /// Bytes written with O_DIRECT (the rest, a buffered tail).
    pub direct_bytes: u64,
    pub total_seconds: f64,
    pub gib_per_second: f64,
    /// Non-zero when a previous file was replaced.
    pub replaced: u32,
    /// The engine that wrote (after fallbacks).
    pub engine: *const c_char,
    /// The whole report as one JSON object.
    pub json: *const c_char,
}

/// A dma-buf holding a file's bytes, from `dmaload_load_dmabuf`.
#[repr(C)]
#[derive(Debug)]
pub struct dmaload_dmabuf {
    /// The dma-buf fd (close-on-exec). The caller owns it: `close()` it when
    /// done, after handing it to a device or another process as needed.
    pub fd: c_int,
    /// Bytes of the dma-buf (whole pages).
    pub size: u64,
    /// Where the file's first loaded byte sits in the dma-buf: 0, except
    /// for a udmabuf of a range whose offset direct I/O aligned down.
    pub data_offset: u64,
    /// Bytes of the file in it, from `data_offset`.
    pub len: u64,
    /// The load's report, owned by the caller: free it with
    /// `dmaload_report_free`.
    pub report: *mut dmaload_report,
}

/// A loaded buffer: the bytes of a file (or a range of it) in memory that
/// can be shared (a memfd). Opaque; free with `dmaload_buffer_free`.
pub struct dmaload_buffer {
    buffer: Buffer,
    report: Box<Report>,
}

/// A [`dmaload_report`] and the strings it points into.
#[repr(C)]
struct Report {
    c: dmaload_report,
    _strings: [CString; 3],
}

/// A [`dmaload_save_report`] and the strings it points into.
#[repr(C)]
struct SaveReport {
    c: dmaload_save_report,
    _strings: [CString; 2],
}

/// A failed call: the errno it returns and the message it leaves.
struct Failure {
    errno: c_int,
    message: String,
}

impl From<dmaload::Error> for Failure {
    fn from(err: dmaload::Error) -> Self {
        Failure { errno: err.errno(), message: err.to_string() }
    }
}

fn invalid(op: &str, what: impl std::fmt::Display) -> Failure {
    Failure { errno: libc::EINVAL, message: format!("{op}: {what}") }
}

thread_local! {
    /// The errno of the thread's last failure: no destructor, so it works
    /// to the thread's last instant (an atexit handler, a pthread key's
    /// destructor).
    static LAST_ERRNO: Cell<c_int> = const { Cell::new(0) };
    /// Its message, freed with the thread's other storage, after which a
    /// call that fails keeps its errno but not its message.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// What `dmaload_last_error` shows once the thread's storage is freed.
const MESSAGE_GONE: &CStr = c"(no message: the thread is exiting and its storage is already freed)";

fn cstring(s: impl Into<Vec<u8>>) -> CString {
    let mut bytes: Vec<u8> = s.into();
    bytes.retain(|&b| b != 0);
    CString::new(bytes).unwrap_or_default()
}

fn fail(failure: Failure) -> c_int {
    LAST_ERRNO.set(failure.errno);
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = cstring(failure.message));
    // SAFETY: no precondition: it returns the address of this thread's errno.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: that address is valid and this thread's alone.
    unsafe { *errno = failure.errno };
    failure.errno
}

/// Runs the body of entry point `op`: its failure or panic becomes an errno
/// and the thread's last error.
fn entry(op: &str, body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => 0,
        Ok(Err(failure)) => fail(failure),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            fail(Failure { errno: libc::EIO, message: format!("{op}: internal error (a panic: {what})") })
        }
    }
}

/// Runs an accessor that cannot fail: `fallback` if it panics.
fn accessor<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

/// A borrowed C string argument; `None` when NULL.
fn c_str<'a>(s: *const c_char) -> Option<&'a CStr> {
    // SAFETY: the caller passes NULL or a NUL-terminated string that stays
    // valid for the call (every function's contract).
    (!s.is_null()).then(|| unsafe { CStr::from_ptr(s) })
}

fn path_arg<'a>(op: &str, path: *const c_char) -> Result<&'a Path, Failure> {
    let path = c_str(path).ok_or_else(|| invalid(op, "path is NULL"))?;
    if path.is_empty() {
        return Err(invalid(op, "path is empty"));
    }
    Ok(Path::new(OsStr::from_bytes(path.to_bytes())))
}

/// Runs `run` on a request for `path` with `options`: a file, or an object
/// where `path` is an `s3://BUCKET/KEY` URL (opened here: its size and
/// ETag looked up, every GET pinned to that ETag; docs/object-storage.md).
fn with_request<T>(
    path: &Path,
    options: &LoadOptions,
    run: impl FnOnce(LoadRequest<'_>) -> Result<T, dmaload::Error>,
) -> Result<T, dmaload::Error> {
    if dmaload::object::is_object_url(path) {
        let object = dmaload::object::Object::open(&path.to_string_lossy(), &options.cancel)?;
        return run(LoadRequest::object(&object).options(options));
    }
    run(LoadRequest::path(path).options(options))
}

/// `*ptr`, or `None` when NULL.
fn borrow<'a, T>(ptr: *const T) -> Option<&'a T> {
    // SAFETY: the caller passes NULL or a pointer to a valid, initialized T
    // that stays valid and unchanged for the call (every function's contract).
    unsafe { ptr.as_ref() }
}

/// `*ptr`, or an error naming `what` when NULL.
fn arg<'a, T>(op: &str, what: &str, ptr: *const T) -> Result<&'a T, Failure> {
    borrow(ptr).ok_or_else(|| invalid(op, format!("{what} is NULL")))
}

fn engine(op: &str, value: u32) -> Result<Engine, Failure> {
    match value {
        DMALOAD_ENGINE_URING_FIXED => Ok(Engine::UringFixed),
        DMALOAD_ENGINE_URING => Ok(Engine::Uring),
        DMALOAD_ENGINE_PREAD_POOL => Ok(Engine::PreadPool),
        DMALOAD_ENGINE_READ => Ok(Engine::Read),
        other => Err(invalid(op, format!("engine {other} is not a DMALOAD_ENGINE_* value"))),
    }
}

fn engine_value(engine: Engine) -> u32 {
    match engine {
        Engine::UringFixed => DMALOAD_ENGINE_URING_FIXED,
        Engine::Uring => DMALOAD_ENGINE_URING,
        Engine::PreadPool => DMALOAD_ENGINE_PREAD_POOL,
        Engine::Read => DMALOAD_ENGINE_READ,
    }
}

fn mode(op: &str, value: u32) -> Result<IoMode, Failure> {
    match value {
        DMALOAD_MODE_AUTO => Ok(IoMode::Auto),
        DMALOAD_MODE_DIRECT => Ok(IoMode::Direct),
        DMALOAD_MODE_BUFFERED => Ok(IoMode::Buffered),
        DMALOAD_MODE_DONTCACHE => Ok(IoMode::DontCache),
        other => Err(invalid(op, format!("mode {other} is not a DMALOAD_MODE_* value"))),
    }
}

fn mode_value(mode: IoMode) -> u32 {
    match mode {
        IoMode::Auto => DMALOAD_MODE_AUTO,
        IoMode::Direct => DMALOAD_MODE_DIRECT,
        IoMode::Buffered => DMALOAD_MODE_BUFFERED,
        IoMode::DontCache => DMALOAD_MODE_DONTCACHE,
    }
}

fn size(op: &str, what: &str, value: u64) -> Result<usize, Failure> {
    usize::try_from(value).map_err(|_| invalid(op, format!("{what} {value} does not fit in memory")))
}

/// Refuses a length no memory can have (over `PTRDIFF_MAX`): a caller's
/// bad size, which Rust may not even build a slice of.
fn memory_len(op: &str, len: usize) -> Result<(), Failure> {
    if len > isize::MAX as usize {
        return Err(invalid(op, format!("{len} bytes cannot be in memory")));
    }
    Ok(())
}

fn destination(op: &str, to: *const c_char) -> Result<Option<Destination>, Failure> {
    c_str(to)
        .map(|to| {
            let to = to.to_str().map_err(|_| invalid(op, "the destination is not UTF-8"))?;
            to.parse::<Destination>().map_err(|why| invalid(op, why))
        })
        .transpose()
}

/// The core's options from the C struct (the defaults when NULL).
/// `to` is the destination, or `None` to take the struct's `to`.
fn load_options(
    op: &str,
    options: *const dmaload_load_options,
    to: Option<Destination>,
) -> Result<LoadOptions, Failure> {
    let defaults = dmaload_load_options_default();
    let o = borrow(options).unwrap_or(&defaults);
    let to = match to {
        Some(to) => to,
        None => destination(op, o.to)?.unwrap_or_default(),
    };
    Ok(LoadOptions {
        engine: engine(op, o.engine)?,
        mode: mode(op, o.mode)?,
        to,
        gather_size: size(op, "gather size", o.gather_size)?,
        chunk_size: size(op, "chunk size", o.chunk_size)?,
        queue_depth: o.queue_depth as usize,
        threads: o.threads as usize,
        populate_threads: o.populate_threads as usize,
        // 0 is unset, as in dmaload_load_options_default().
        staging_slots: (o.staging_slots != 0).then_some(o.staging_slots as usize),
        staging_slot_size: match o.staging_slot_size {
            0 => None,
            n => Some(size(op, "staging slot size", n)?),
        },
        measure_page_cache: o.measure_page_cache != 0,
        verify: o.verify != 0,
        // Not in C (the tests' option table, crates/dmaload/tests/fronts,
        // says why); no `..` here, so a new core option is a compile error
        // until C decides about it.
        needs_fd: true,
        progress: None,
        cancel: dmaload::CancelToken::default(),
    })
}

fn report(report: &LoadReport) -> Box<Report> {
    let strings = [
        cstring(report.engine.name()),
        cstring(report.destination.as_str()),
        cstring(serde_json::to_string(report).unwrap_or_default()),
    ];
    let c = dmaload_report {
        offset: report.offset,
        bytes: report.bytes,
        total_seconds: report.total_seconds,
        io_seconds: report.io_seconds,
        alloc_seconds: report.alloc_seconds,
        gib_per_second: report.gib_per_second,
        direct_io: u32::from(report.cache == dmaload::CachePolicy::Bypass),
        fallback_count: u32::try_from(report.fallbacks.len()).unwrap_or(u32::MAX),
        engine: strings[0].as_ptr(),
        destination: strings[1].as_ptr(),
        json: strings[2].as_ptr(),
    };
    // The pointers stay valid: moving a CString moves its handle, not its bytes.
    Box::new(Report { c, _strings: strings })
}

/// The defaults of every load option, as the CLI and the Rust library use
/// them (`to` is NULL: "auto"). Thread-safe; nothing to free.
#[no_mangle]
pub extern "C" fn dmaload_load_options_default() -> dmaload_load_options {
    let d = LoadOptions::default();
    dmaload_load_options {
        engine: engine_value(d.engine),
        mode: mode_value(d.mode),
        to: std::ptr::null(),
        gather_size: d.gather_size as u64,
        chunk_size: d.chunk_size as u64,
        queue_depth: u32::try_from(d.queue_depth).unwrap_or(u32::MAX),
        threads: u32::try_from(d.threads).unwrap_or(u32::MAX),
        populate_threads: u32::try_from(d.populate_threads).unwrap_or(u32::MAX),
        staging_slots: d.staging_slots.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        staging_slot_size: d.staging_slot_size.map_or(0, |n| n as u64),
        measure_page_cache: u32::from(d.measure_page_cache),
        verify: u32::from(d.verify),
    }
}

fn load_impl(
    op: &str,
    path: *const c_char,
    range: Option<(u64, u64)>,
    options: *const dmaload_load_options,
    out: *mut *mut dmaload_buffer,
) -> c_int {
    entry(op, || {
        if out.is_null() {
            return Err(invalid(op, "out is NULL"));
        }
        let path = path_arg(op, path)?;
        let options = load_options(op, options, None)?;
        let (offset, len) = range.map_or((0, None), |(offset, len)| (offset, Some(len)));
        let (buffer, loaded) =
            with_request(path, &options, |request| request.range(offset, len).to_buffer())?;
        let report = report(&loaded);
        let handle = Box::into_raw(Box::new(dmaload_buffer { buffer, report }));
        // SAFETY: `out` is non-NULL (checked) and points to writable
        // storage for a pointer (the contract).
        unsafe { out.write(handle) };
        Ok(())
    })
}

/// Loads the whole file at `path` into a new buffer of host memory
/// (`options->to`; NULL `options` for the defaults) and stores it in `*out`
/// (untouched on failure). The buffer is the caller's: free it with
/// `dmaload_buffer_free`. Returns 0 or an errno (see `dmaload_last_error`):
/// EINVAL for bad arguments, ENOENT for a missing file, ENOMEM when the
/// file does not fit in memory, ENODATA when the file shrank during the
/// load, ESTALE when it was written meanwhile. Thread-safe.
///
/// Every `dmaload_load*` function, `dmaload_load_dmabuf*` included, also
/// takes an object in S3-compatible storage as `path`: `s3://BUCKET/KEY`,
/// with the endpoint, region and credentials from the environment and
/// `~/.aws` (docs/object-storage.md). Its errors name the bucket, key,
/// byte range and the store's error code: EACCES where the store refuses
/// the credentials, ENOENT for a missing bucket or key, ESTALE for an
/// object replaced during the load (every GET is pinned to the ETag the
/// load began with).
///
/// # Safety
/// `path` is NULL or a NUL-terminated string, `options` NULL or a valid struct
/// (its `to` NULL or a NUL-terminated string), `out` NULL or writable, all
/// for the whole call.
#[no_mangle]
pub unsafe extern "C" fn dmaload_load(
    path: *const c_char,
    options: *const dmaload_load_options,
    out: *mut *mut dmaload_buffer,
) -> c_int {
    load_impl("dmaload_load", path, None, options, out)
}

/// `dmaload_load` for `len` bytes from byte `offset` (neither needs any
/// alignment). A range that runs past the end of the file fails with
/// ENODATA, one that starts past it with EINVAL.
/// Ownership and thread safety as for `dmaload_load`.
///
/// # Safety
/// As for `dmaload_load`.
#[no_mangle]
pub unsafe extern "C" fn dmaload_load_range(
    path: *const c_char,
    offset: u64,
    len: u64,
    options: *const dmaload_load_options,
    out: *mut *mut dmaload_buffer,
) -> c_int {
    load_impl("dmaload_load_range", path, Some((offset, len)), options, out)
}

/// Fills `len` bytes of memory the caller owns at `dst` with the file's
/// bytes from `offset` (neither needs any alignment): read in place where
/// the memory lines up with the file (page-aligned memory and an aligned
/// offset, for instance), else through a small staging ring with one copy
/// (the report's `destination` says which). When `report` is not NULL,
/// `*report` receives the load's report, the caller's to free with
/// `dmaload_report_free` (untouched on failure). After a failure the memory
/// holds a mix of old and new bytes. Returns 0 or an errno as for
/// `dmaload_load` (ENODATA when the range runs past the end of the file,
/// EINVAL when it starts past it).
/// Thread-safe, as long as no other thread touches `dst` meanwhile.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string, `options` NULL or a valid
/// struct, `dst` NULL (only with `len` 0) or `len` writable bytes no one
/// else reads or writes during the call, `report` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmaload_load_into(
    path: *const c_char,
    offset: u64,
    dst: *mut c_void,
    len: usize,
    options: *const dmaload_load_options,
    report: *mut *mut dmaload_report,
) -> c_int {
    let op = "dmaload_load_into";
    entry(op, || {
        let path = path_arg(op, path)?;
        let options = load_options(op, options, None)?;
        memory_len(op, len)?;
        let dst: &mut [u8] = match (dst.is_null(), len) {
            (_, 0) => &mut [],
            (true, _) => return Err(invalid(op, "dst is NULL")),
            // SAFETY: `dst` is non-NULL and points to `len` writable bytes
            // that nothing else touches during the call (the contract).
            (false, _) => unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) },
        };
        let loaded = with_request(path, &options, |request| request.range(offset, None).fill(dst))?;
        if !report.is_null() {
            let handle = Box::into_raw(self::report(&loaded)).cast();
            // SAFETY: `report` is non-NULL (checked) and writable (the contract).
            unsafe { report.write(handle) };
        }
        Ok(())
    })
}

/// The buffer's bytes (`dmaload_buffer_len` of them), valid until
/// `dmaload_buffer_free`; NULL for an empty buffer (an empty file or
/// range: no byte to point at; `dmaload_save` and `dmaload_xxh3_64` take
/// NULL with a length of 0) and for a NULL buffer. The memory stays the
/// buffer's: do not free it. Any thread may read it.
///
/// # Safety
/// `buffer` is NULL or a live buffer from `dmaload_load*`.
#[no_mangle]
pub unsafe extern "C" fn dmaload_buffer_data(buffer: *const dmaload_buffer) -> *const u8 {
    accessor(std::ptr::null(), || {
        // An empty slice's pointer is dangling, not one C may pass on.
        borrow(buffer).filter(|b| !b.buffer.is_empty()).map_or(std::ptr::null(), |b| b.buffer.as_ptr())
    })
}

/// Bytes in the buffer; 0 for a NULL buffer. Thread-safe.
///
/// # Safety
/// `buffer` is NULL or a live buffer from `dmaload_load*`.
#[no_mangle]
pub unsafe extern "C" fn dmaload_buffer_len(buffer: *const dmaload_buffer) -> usize {
    accessor(0, || borrow(buffer).map_or(0, |b| b.buffer.len()))
}

/// The memfd holding the buffer's bytes, for passing to another process
/// (sealed against every write first, F_SEAL_WRITE, so no one can change
/// the bytes this buffer or a receiver shows), or -1 for anonymous memory
/// or a NULL buffer, and -1 with an errno and `dmaload_last_error` where it
/// cannot be sealed (EBUSY while another process maps the memfd writable
/// and shared, a forked child say, or a page is pinned; ENOMEM where
/// hugetlb memory's pool cannot back the buffer's private copy-on-write
/// mapping, which sealing needs). The fd
/// stays the buffer's: `dup()` it to keep it past `dmaload_buffer_free`,
/// never `close()` it. The bytes start at `dmaload_buffer_memfd_offset` in
/// it. Thread-safe.
///
/// # Safety
/// `buffer` is NULL or a live buffer from `dmaload_load*`.
#[no_mangle]
pub unsafe extern "C" fn dmaload_buffer_memfd(buffer: *const dmaload_buffer) -> c_int {
    let mut memfd = -1;
    // Set on success only: a failure leaves -1, with its cause.
    entry("dmaload_buffer_memfd", || {
        if let Some(buffer) = borrow(buffer) {
            memfd = buffer.buffer.memfd()?.map_or(-1, |fd: BorrowedFd<'_>| fd.as_raw_fd());
        }
        Ok(())
    });
    memfd
}

/// Where the buffer's first byte sits in its memfd (non-zero when a range
/// was loaded from an offset direct I/O aligned down); 0 for a NULL
/// buffer. Thread-safe.
///
/// # Safety
/// `buffer` is NULL or a live buffer from `dmaload_load*`.
#[no_mangle]
pub unsafe extern "C" fn dmaload_buffer_memfd_offset(buffer: *const dmaload_buffer) -> usize {
    accessor(0, || borrow(buffer).map_or(0, |b| b.buffer.memfd_offset()))
}

/// The report of the load that filled the buffer, owned by the buffer
/// (valid until `dmaload_buffer_free`; do not free it); NULL for a NULL
/// buffer. Thread-safe.
///
/// # Safety
/// `buffer` is NULL or a live buffer from `dmaload_load*`.
#[no_mangle]
pub unsafe extern "C" fn dmaload_buffer_report(buffer: *const dmaload_buffer) -> *const dmaload_report {
    accessor(std::ptr::null(), || {
        borrow(buffer).map_or(std::ptr::null(), |b| &b.report.c as *const dmaload_report)
    })
}

/// Frees a buffer from `dmaload_load` or `dmaload_load_range`: unmaps its
/// memory and closes its memfd (a `dup` of it keeps the bytes alive).
/// NULL is a no-op. Call once, when no thread uses the buffer, its data or
/// its report any more.
///
/// # Safety
/// `buffer` is NULL or a buffer from `dmaload_load*` not freed before.
#[no_mangle]
pub unsafe extern "C" fn dmaload_buffer_free(buffer: *mut dmaload_buffer) {
    if !buffer.is_null() {
        accessor((), || {
            // SAFETY: `buffer` came from Box::into_raw in `load_impl` and is
            // freed once (the contract).
            drop(unsafe { Box::from_raw(buffer) });
        });
    }
}

fn load_dmabuf_impl(
    op: &str,
    path: *const c_char,
    range: (u64, Option<u64>),
    target: *const c_char,
    options: *const dmaload_load_options,
    out: *mut dmaload_dmabuf,
) -> c_int {
    entry(op, || {
        if out.is_null() {
            return Err(invalid(op, "out is NULL"));
        }
        let path = path_arg(op, path)?;
        let to = destination(op, target)?.unwrap_or(Destination::Dmabuf);
        let options = load_options(op, options, Some(to))?;
        let (loaded, loaded_report) =
            with_request(path, &options, |request| request.range(range.0, range.1).to_dmabuf())?;
        let result = dmaload_dmabuf {
            fd: -1,
            size: loaded.dmabuf.len(),
            data_offset: loaded.data_offset,
            len: loaded.len,
            report: Box::into_raw(report(&loaded_report)).cast(),
        };
        let fd = loaded.dmabuf.into_fd().into_raw_fd();
        // SAFETY: `out` is non-NULL (checked) and points to a writable
        // dmaload_dmabuf (the contract).
        unsafe { out.write(dmaload_dmabuf { fd, ..result }) };
        Ok(())
    })
}

/// Seed 000's call: allocates a dma-buf and fills it with the whole file at
/// `path`, storing it in `*out` (untouched on failure). `target` is
/// "udmabuf" (a memfd loaded in place, exported without copy),
/// "dma-heap:NAME" (allocated from /dev/dma_heap/NAME beside the reads,
/// filled through a small staging ring) or "dmabuf" (udmabuf where it exists
/// and can hold the file, else dma-heap:system; also when `target` is NULL);
/// `options` NULL for the defaults (its `to` is ignored). The caller owns
/// `out->fd` (close it) and `out->report` (free it with
/// `dmaload_report_free`). Returns 0 or an errno (see `dmaload_last_error`):
/// EINVAL for bad arguments, an unknown heap, a kernel without udmabuf or
/// a range that starts past the end of the file, ENOENT for a missing
/// file, ENOMEM, ENODATA for a range that runs past the end.
/// Thread-safe.
///
/// # Safety
/// `path` and `target` are NULL or NUL-terminated strings, `options` NULL
/// or a valid struct, `out` NULL or writable, all for the whole call.
#[no_mangle]
pub unsafe extern "C" fn dmaload_load_dmabuf(
    path: *const c_char,
    target: *const c_char,
    options: *const dmaload_load_options,
    out: *mut dmaload_dmabuf,
) -> c_int {
    load_dmabuf_impl("dmaload_load_dmabuf", path, (0, None), target, options, out)
}

/// `dmaload_load_dmabuf` for `len` bytes from byte `offset`. Ownership and
/// thread safety as for `dmaload_load_dmabuf`.
///
/// # Safety
/// As for `dmaload_load_dmabuf`.
#[no_mangle]
pub unsafe extern "C" fn dmaload_load_dmabuf_range(
    path: *const c_char,
    offset: u64,
    len: u64,
    target: *const c_char,
    options: *const dmaload_load_options,
    out: *mut dmaload_dmabuf,
) -> c_int {
    load_dmabuf_impl("dmaload_load_dmabuf_range", path, (offset, Some(len)), target, options, out)
}

/// Frees a report from `dmaload_load_dmabuf` (`out->report`) or
/// `dmaload_load_into` (`*report`). NULL is a no-op. Never pass the report
/// of a buffer (`dmaload_buffer_report`): the buffer frees that. Call once,
/// when no thread reads the report.
///
/// # Safety
/// `report` is NULL or a report from `dmaload_load_dmabuf*` or
/// `dmaload_load_into`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn dmaload_report_free(report: *mut dmaload_report) {
    if !report.is_null() {
        accessor((), || {
            // SAFETY: a report handed out by `load_dmabuf_impl` or
            // `dmaload_load_into` is the first field of a #[repr(C)] Report
            // boxed there, freed once (the contract).
            drop(unsafe { Box::from_raw(report.cast::<Report>()) });
        });
    }
}

/// The xxh3-64 of the dma-buf's file bytes (`len` bytes from
/// `data_offset`), read through a fresh mapping of `dmabuf->fd` inside a
/// `DMA_BUF_IOCTL_SYNC` read bracket, stored in `*hash`. The fd stays the
/// caller's. Returns 0 or an errno. Thread-safe (each call maps the
/// dma-buf anew).
///
/// # Safety
/// `dmabuf` is NULL or a valid struct whose fd is open, `hash` NULL or
/// writable, for the whole call.
#[no_mangle]
pub unsafe extern "C" fn dmaload_dmabuf_xxh3_64(dmabuf: *const dmaload_dmabuf, hash: *mut u64) -> c_int {
    let op = "dmaload_dmabuf_xxh3_64";
    entry(op, || {
        let d = arg(op, "dmabuf", dmabuf)?;
        if hash.is_null() {
            return Err(invalid(op, "hash is NULL"));
        }
        if d.fd < 0 {
            return Err(invalid(op, format!("fd {} is not a file descriptor", d.fd)));
        }
        let io = |e: std::io::Error| Failure {
            errno: e.raw_os_error().unwrap_or(match e.kind() {
                std::io::ErrorKind::InvalidInput => libc::EINVAL,
                _ => libc::EIO,
            }),
            message: format!("{op}: dma-buf fd {}: {e}", d.fd),
        };
        // SAFETY: the caller's fd is open for the call (the contract); it is
        // only borrowed to duplicate it.
        let fd = unsafe { BorrowedFd::borrow_raw(d.fd) }.try_clone_to_owned().map_err(io)?;
        let dmabuf = DmaBuf::from_fd(fd).map_err(io)?;
        if d.data_offset.checked_add(d.len).filter(|&end| end <= dmabuf.len()).is_none() {
            return Err(invalid(
                op,
                format!("{}+{} is outside the {}-byte dma-buf", d.data_offset, d.len, dmabuf.len()),
            ));
        }
        let loaded = LoadedDmaBuf { dmabuf, data_offset: d.data_offset, len: d.len };
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        loaded.read_each(|bytes| hasher.update(bytes)).map_err(io)?;
        // SAFETY: `hash` is non-NULL (checked) and writable (the contract).
        unsafe { hash.write(hasher.digest()) };
        Ok(())
    })
}

/// The xxh3-64 of `len` bytes at `data` (as `dmaload load --hash` prints
/// it, `%016llx`); 0 when `data` is NULL and `len` is not, or `len` is over
/// `PTRDIFF_MAX`. Thread-safe.
///
/// # Safety
/// `data` is NULL or points to `len` readable bytes, unchanged for the call.
#[no_mangle]
pub unsafe extern "C" fn dmaload_xxh3_64(data: *const c_void, len: usize) -> u64 {
    if (data.is_null() && len > 0) || len > isize::MAX as usize {
        return 0;
    }
    accessor(0, || {
        if len == 0 {
            return xxhash_rust::xxh3::xxh3_64(&[]);
        }
        // SAFETY: `data..data + len` is readable and unchanged for the call
        // (the contract).
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
        xxhash_rust::xxh3::xxh3_64(bytes)
    })
}

/// The defaults of every save option. Thread-safe; nothing to free.
#[no_mangle]
pub extern "C" fn dmaload_save_options_default() -> dmaload_save_options {
    let d = SaveOptions::default();
    dmaload_save_options {
        engine: engine_value(d.engine),
        mode: mode_value(d.mode),
        sync: u32::from(d.sync),
        chunk_size: d.chunk_size as u64,
        queue_depth: u32::try_from(d.queue_depth).unwrap_or(u32::MAX),
        threads: u32::try_from(d.threads).unwrap_or(u32::MAX),
    }
}

/// Writes `len` bytes at `data` to `path`, crash-safe: a temporary file in
/// the same directory, fsynced, renamed over `path` (a device or FIFO is
/// written in place). Never leaves a torn file or a stray temporary one.
/// `options` NULL for the defaults. With a non-NULL `report`, stores a
/// report the caller owns (free it with `dmaload_save_report_free`).
/// `data` is only read, and may be a buffer's (`dmaload_buffer_data`).
/// Returns 0 or an errno (see `dmaload_last_error`). Thread-safe (saves of
/// the same path at once each replace it whole; the last rename wins).
///
/// # Safety
/// `path` is NULL or a NUL-terminated string, `data` NULL or `len`
/// readable bytes, `options` NULL or a valid struct, `report` NULL or
/// writable, all for the whole call.
#[no_mangle]
pub unsafe extern "C" fn dmaload_save(
    path: *const c_char,
    data: *const c_void,
    len: usize,
    options: *const dmaload_save_options,
    report: *mut *mut dmaload_save_report,
) -> c_int {
    let op = "dmaload_save";
    entry(op, || {
        let path = path_arg(op, path)?;
        if data.is_null() && len > 0 {
            return Err(invalid(op, "data is NULL"));
        }
        memory_len(op, len)?;
        let defaults = dmaload_save_options_default();
        let o = borrow(options).unwrap_or(&defaults);
        let options = SaveOptions {
            engine: engine(op, o.engine)?,
            mode: mode(op, o.mode)?,
            sync: o.sync != 0,
            chunk_size: size(op, "chunk size", o.chunk_size)?,
            queue_depth: o.queue_depth as usize,
            threads: o.threads as usize,
            progress: None,
            // C has no cancellation, for saves as for loads.
            cancel: dmaload::CancelToken::default(),
        };
        let bytes: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: `data..data + len` is readable and unchanged for the
            // call (the contract); non-NULL (checked).
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
        };
        let saved = dmaload::save(bytes, path, &options)?;
        if !report.is_null() {
            let strings =
                [cstring(saved.engine.name()), cstring(serde_json::to_string(&saved).unwrap_or_default())];
            let c = dmaload_save_report {
                bytes: saved.bytes,
                direct_bytes: saved.direct_bytes,
                total_seconds: saved.total_seconds,
                gib_per_second: saved.gib_per_second,
                replaced: u32::from(saved.replaced),
                engine: strings[0].as_ptr(),
                json: strings[1].as_ptr(),
            };
            let boxed = Box::into_raw(Box::new(SaveReport { c, _strings: strings }));
            // SAFETY: `report` is non-NULL (checked) and writable (the contract).
            unsafe { report.write(boxed.cast()) };
        }
        Ok(())
    })
}

/// Frees a report from `dmaload_save`. NULL is a no-op. Call once, when no
/// thread reads the report.
///
/// # Safety
/// `report` is NULL or a report from `dmaload_save` not freed before.
#[no_mangle]
pub unsafe extern "C" fn dmaload_save_report_free(report: *mut dmaload_save_report) {
    if !report.is_null() {
        accessor((), || {
            // SAFETY: the report is the first field of a #[repr(C)]
            // SaveReport boxed by `dmaload_save`, freed once (the contract).
            drop(unsafe { Box::from_raw(report.cast::<SaveReport>()) });
        });
    }
}

/// The message of the last failed call on this thread ("" when none
/// failed): the operation, the path, the file offset where there is one,
/// and the cause. Valid until the next failing call on this thread; do not
/// free it. While the thread exits (an atexit handler, a pthread key's
/// destructor), a static note that the message is gone.
#[no_mangle]
pub extern "C" fn dmaload_last_error() -> *const c_char {
    accessor(c"".as_ptr(), || {
        LAST_ERROR.try_with(|last| last.borrow().as_ptr()).unwrap_or(MESSAGE_GONE.as_ptr())
    })
}

/// The errno the last failed call on this thread returned (0 when none
/// failed). Each thread has its own.
#[no_mangle]
pub extern "C" fn dmaload_last_errno() -> c_int {
    accessor(0, || LAST_ERRNO.get())
}

/// The library's version, e.g. "0.1.0". Static (any thread; do not free).
#[no_mangle]
pub extern "C" fn dmaload_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(version) => version,
            Err(_) => panic!("the version has no NUL"),
        };
    VERSION.as_ptr()
}
