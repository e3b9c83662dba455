//! `dmaload._dmaload`: the native half of the `dmaload` Python package.
//!
//! The pure-Python package in `python/dmaload` is the public API; this
//! module holds what must be native: the `Buffer` type with the buffer
//! protocol, and loads and saves that run with the GIL released.
//!
//! `unsafe` code is allowed item by item, each with its SAFETY contract:
//! the buffer protocol (`__getbuffer__` and `__releasebuffer__`, which PyO3
//! requires to be `unsafe fn`, and the function that fills a `Py_buffer`),
//! a caller's descriptor number borrowed for one call (`FileArg`), in
//! `staged.rs` the bytes of a buffer export and device pointers, and in
//! `save.rs` the address of a buffer export that only the kernel reads.
#![deny(unsafe_code)]

mod block_queue;
mod buffer;
mod dmabuf;
mod lease;
mod save;
mod staged;
mod windows;

use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmaload::format::safetensors as st;
use dmaload::{CachePolicy, Destination, Engine, IoMode, LoadOptions, LoadReport, SaveOptions};
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyTuple};

use buffer::Buffer;

create_exception!(
    _dmaload,
    SafetensorError,
    PyValueError,
    "A malformed safetensors file: the message says what is wrong and at which byte."
);

/// A panic's payload as the RuntimeError users see. PyO3 would raise
/// `PanicException`, which derives from BaseException: `except Exception`
/// does not catch it.
fn panic_error(payload: Box<dyn Any + Send>) -> PyErr {
    let what = panic_message(payload.as_ref());
    PyRuntimeError::new_err(format!("internal error in dmaload (a bug: please report it): {what}"))
}

/// What a panic's payload says.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs `f` (with the GIL held) so that a panic in it is a RuntimeError.
/// Every entry point of this module goes through this, [`detached`] or
/// [`run_cancellable`].
fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(panic_error(payload)))
}

/// Runs `f` with the GIL released; a panic in it is a RuntimeError.
fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    py.detach(|| catch_unwind(AssertUnwindSafe(f))).map_err(panic_error)
}

/// The name the core's JSON gives a cache policy.
fn cache_name(cache: CachePolicy) -> &'static str {
    match cache {
        CachePolicy::Bypass => "bypass",
        CachePolicy::Keep => "keep",
        CachePolicy::DontCache => "dont-cache",
        CachePolicy::Fadvise => "fadvise",
    }
}

/// The core's report as a `dmaload._report.LoadReport`, field by field.
/// The destructuring names every field, so a field the core adds is a
/// compile error here until it crosses too. `path` is a `str` as
/// `os.fsdecode` gives it (surrogate escapes for bytes that are not UTF-8),
/// so `os.fsencode(report.path)` is the file's name exactly.
fn report_object<'py>(py: Python<'py>, report: &LoadReport) -> PyResult<Bound<'py, PyAny>> {
    let LoadReport {
        path,
        offset,
        bytes,
        engine,
        cache,
        memory,
        memory_reason,
        huge_pages,
        destination,
        filesystem,
        alignment,
        chunk_size,
        gather_size,
        queue_depth,
        request_size,
        fallbacks,
        alloc_seconds,
        register_seconds,
        first_gather_seconds,
        deliver_seconds,
        ring_bytes,
        cache_lane_bytes,
        cache_lane_threads,
        io_seconds,
        waited_for_memory_seconds,
        total_seconds,
        gib_per_second,
        cpu_user_seconds,
        cpu_system_seconds,
        page_cache,
    } = report;
    let module = py.import("dmaload._report")?;
    let kw = PyDict::new(py);
    kw.set_item("path", path.as_os_str())?;
    kw.set_item("offset", offset)?;
    kw.set_item("bytes", bytes)?;
    kw.set_item("engine", engine.name())?;
    kw.set_item("cache", cache_name(*cache))?;
    kw.set_item("memory", memory.name())?;
    kw.set_item("memory_reason", memory_reason)?;
    kw.set_item("huge_pages", huge_pages)?;
    kw.set_item("destination", destination)?;
    kw.set_item("filesystem", filesystem)?;
    kw.set_item("alignment", alignment)?;
    kw.set_item("chunk_size", chunk_size)?;
    kw.set_item("gather_size", gather_size)?;
    kw.set_item("queue_depth", queue_depth)?;
    kw.set_item("request_size", request_size)?;
    kw.set_item("fallbacks", fallback_objects(&module, fallbacks)?)?;
    kw.set_item("alloc_seconds", alloc_seconds)?;
    kw.set_item("register_seconds", register_seconds)?;
    kw.set_item("first_gather_seconds", first_gather_seconds)?;
    kw.set_item("deliver_seconds", deliver_seconds)?;
    kw.set_item("ring_bytes", ring_bytes)?;
    kw.set_item("cache_lane_bytes", cache_lane_bytes)?;
    kw.set_item("cache_lane_threads", cache_lane_threads)?;
    kw.set_item("io_seconds", io_seconds)?;
    kw.set_item("waited_for_memory_seconds", waited_for_memory_seconds)?;
    kw.set_item("total_seconds", total_seconds)?;
    kw.set_item("gib_per_second", gib_per_second)?;
    kw.set_item("cpu_user_seconds", cpu_user_seconds)?;
    kw.set_item("cpu_system_seconds", cpu_system_seconds)?;
    let page_cache = match page_cache {
        Some(r) => Some(module.getattr("PageCacheResidency")?.call1((r.resident_bytes, r.fraction))?),
        None => None,
    };
    kw.set_item("page_cache", page_cache)?;
    module.getattr("LoadReport")?.call((), Some(&kw))
}

/// The core's fallbacks as a tuple of `dmaload._report.Fallback`
/// (`module`), for a load's or a save's report.
fn fallback_objects<'py>(
    module: &Bound<'py, PyModule>,
    fallbacks: &[dmaload::Fallback],
) -> PyResult<Bound<'py, PyTuple>> {
    let py = module.py();
    let fallback_class = module.getattr("Fallback")?;
    let fallbacks = fallbacks
        .iter()
        .map(|f| {
            let kw = PyDict::new(py);
            kw.set_item("from_", &f.from)?;
            kw.set_item("to", &f.to)?;
            kw.set_item("reason", &f.reason)?;
            fallback_class.call((), Some(&kw))
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, fallbacks)
}

/// A connection over a duplicate of `socket`'s descriptor (a socket
/// object's `fileno()`, or an int).
fn connection(socket: &Bound<'_, PyAny>) -> PyResult<dmaload::share::Connection> {
    let fd: i32 = match socket.extract::<i32>() {
        Ok(fd) => fd,
        Err(_) => socket.call_method0("fileno")?.extract()?,
    };
    dmaload::share::connection_from_raw_fd(fd)
        .map_err(|e| PyOSError::new_err((e.raw_os_error().unwrap_or(libc::EINVAL), format!("socket: {e}"))))
}

fn no_memfd(buffer: &dmaload::Buffer) -> PyErr {
    PyValueError::new_err(format!(
        "this buffer is {} memory, which has no memfd",
        buffer.memory_kind().name()
    ))
}

/// A core error as OSError(errno, message, filename); the message names the
/// operation and, where known, the file offset.
fn os_error(err: &dmaload::Error) -> PyErr {
    let mut reason = err.io_error().to_string();
    if let Some(code) = err.raw_os_error() {
        // io::Error's Display ends with " (os error N)"; OSError prints errno itself.
        if let Some(stripped) = reason.strip_suffix(&format!(" (os error {code})")) {
            reason = stripped.to_owned();
        }
    }
    let message = match err.offset() {
        Some(offset) => format!("{} at offset {offset}: {reason}", err.op()),
        None => format!("{}: {reason}", err.op()),
    };
    PyOSError::new_err((err.errno(), message, err.path().as_os_str().to_owned()))
}

fn format_error(err: &st::Error) -> PyErr {
    match err {
        st::Error::Io(e) => os_error(e),
        st::Error::Header { .. } => SafetensorError::new_err(err.to_string()),
    }
}

/// Forwards the core's per-load progress to one Python callable, summed
/// over the loads of one call, at most every 50 ms (and at the end).
struct Progress {
    callback: Py<PyAny>,
    /// Cancelled when the callback raises, so the load stops at once.
    cancel: dmaload::CancelToken,
    total: u64,
    done: AtomicU64,
    last_call: Mutex<Instant>,
    reported: AtomicU64,
    failed: AtomicBool,
    error: Mutex<Option<PyErr>>,
}

const PROGRESS_INTERVAL: Duration = Duration::from_millis(50);

impl Progress {
    fn new(callback: Py<PyAny>, total: u64, cancel: dmaload::CancelToken) -> Arc<Progress> {
        Arc::new(Progress {
            callback,
            cancel,
            total,
            done: AtomicU64::new(0),
            last_call: Mutex::new(Instant::now() - PROGRESS_INTERVAL),
            reported: AtomicU64::new(u64::MAX),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
        })
    }

    /// A core progress callback for one load, adding its bytes to the sum.
    fn for_load(self: &Arc<Progress>) -> Arc<dmaload::ProgressFn> {
        let this = Arc::clone(self);
        let seen = AtomicU64::new(0);
        Arc::new(move |done: u64, _total: u64| {
            // Completions may arrive out of order, and a retried load counts
            // from zero again: only growth beyond what was seen counts.
            let before = seen.fetch_max(done, Ordering::AcqRel);
            if done > before {
                this.done.fetch_add(done - before, Ordering::AcqRel);
            }
            this.maybe_call(false);
        })
    }

    fn maybe_call(&self, force: bool) {
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        let done = self.done.load(Ordering::Acquire).min(self.total);
        {
            let Ok(mut last) = self.last_call.try_lock() else { return };
            let due = last.elapsed() >= PROGRESS_INTERVAL || done == self.total;
            if !(force || due) || self.reported.load(Ordering::Acquire) == done {
                return;
            }
            *last = Instant::now();
            self.reported.store(done, Ordering::Release);
        }
        // try_attach: never panic on this thread of the core's, even if
        // the interpreter were shutting down (then the report is skipped).
        let _ = Python::try_attach(|py| {
            if let Err(err) = self.callback.call1(py, (done, self.total)) {
                self.failed.store(true, Ordering::Release);
                *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(err);
                self.cancel.cancel();
            }
        });
    }

    /// The exception the callback raised, if any.
    fn take_error(&self) -> Option<PyErr> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The callback's exception, if it raised one: it outranks the load's
    /// own outcome (the cancellation it caused).
    fn raised(relay: Option<&Arc<Progress>>) -> PyResult<()> {
        relay.and_then(|relay| relay.take_error()).map_or(Ok(()), Err)
    }

    /// After a successful load: one last call with the final figures, and
    /// its exception if it raised one.
    fn finish(relay: Option<&Arc<Progress>>) -> PyResult<()> {
        if let Some(relay) = relay {
            relay.maybe_call(true);
        }
        Progress::raised(relay)
    }
}

/// How often a thread waiting for a load looks for a pending signal
/// (Ctrl-C): the bound on how late `KeyboardInterrupt` is raised.
pub(crate) const SIGNAL_POLL: Duration = Duration::from_millis(20);

/// Polls `ready(slice)` (a wait of at most `slice` on a descriptor) in
/// [`SIGNAL_POLL`] slices with the GIL released, looking for signals
/// between them (Ctrl-C raises), until it says ready (`Ok(true)`), fails,
/// or `timeout` runs out (`Ok(false)`; `None`: for ever).
pub(crate) fn wait_in_slices(
    py: Python<'_>,
    timeout: Option<Duration>,
    ready: impl Fn(Duration) -> std::io::Result<bool> + Sync,
) -> PyResult<std::io::Result<bool>> {
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        let slice = left.map_or(SIGNAL_POLL, |left| left.min(SIGNAL_POLL));
        match detached(py, || ready(slice))? {
            Ok(false) if !left.is_some_and(|left| left <= slice) => py.check_signals()?,
            other => return Ok(other),
        }
    }
}

/// Runs `work` with the GIL released on a thread of its own while this
/// thread checks for signals every [`SIGNAL_POLL`]: a pending one (Ctrl-C)
/// cancels `cancel`, waits for `work` to stop, and is raised. A panic in
/// `work` becomes a RuntimeError, never a PanicException (which `except
/// Exception` does not catch). Where no thread can be created the work runs
/// on this thread, with the GIL released but without signal checks.
fn run_cancellable<T: Send>(
    py: Python<'_>,
    cancel: &dmaload::CancelToken,
    work: impl FnOnce() -> T + Send,
) -> PyResult<T> {
    type Outcome<T> = std::thread::Result<T>;
    // Taken by the load thread, or by this one if that cannot be created.
    let slot = Mutex::new(Some(move || std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))));
    let take = || slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    let (tx, rx) = std::sync::mpsc::sync_channel::<Outcome<T>>(1);
    let (result, interrupted) = std::thread::scope(|scope| {
        let spawned = std::thread::Builder::new().name("dmaload-load".into()).spawn_scoped(scope, || {
            if let Some(work) = take() {
                let _ = tx.send(work());
            }
        });
        if spawned.is_err() {
            // The thread never started, so the work is still in the slot.
            return match take() {
                Some(work) => (py.detach(work), None),
                None => (
                    Err(Box::new("the load thread started and vanished") as Box<dyn std::any::Any + Send>),
                    None,
                ),
            };
        }
        let mut interrupted = None;
        let mut rx = rx;
        loop {
            // The receiver moves into the GIL-free closure and back (it is
            // Send, not Sync).
            let (received, back) = py.detach(move || (rx.recv_timeout(SIGNAL_POLL), rx));
            rx = back;
            match received {
                Ok(result) => return (result, interrupted),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                // The thread ended without sending: only a panic in `send` could do that.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let lost: Box<dyn std::any::Any + Send> =
                        Box::new("the load thread ended without a result");
                    return (Err(lost), interrupted);
                }
            }
            if interrupted.is_none() {
                if let Err(err) = py.check_signals() {
                    // Stop the load; keep waiting for it, so nothing it
                    // touches outlives this call.
                    cancel.cancel();
                    interrupted = Some(err);
                }
            }
        }
    });
    if let Some(err) = interrupted {
        return Err(err);
    }
    result.map_err(panic_error)
}

/// How long a load that Ctrl-C cancelled is waited for before
/// [`run_abandonable`] leaves it to its thread: long enough for an engine
/// to notice its token and drain requests that complete, short enough that
/// `KeyboardInterrupt` comes within 100 ms.
const ABANDON_AFTER: Duration = Duration::from_millis(60);

/// [`run_cancellable`] for work that owns everything the kernel can still
/// touch: memory it allocates itself, or the export of a caller's buffer
/// moved into it (which keeps that memory mapped while the work lives).
/// Once Ctrl-C has cancelled it, it is waited for at most
/// [`ABANDON_AFTER`]; a read still in flight then (a FUSE or NFS server
/// that does not answer, which no cancellation reaches) is left to the
/// work's thread, which frees what the load made, or releases the export,
/// once the read ends, and `KeyboardInterrupt` is raised at once. Memory
/// the load allocated is never reached by the caller; a caller's exported
/// buffer may still receive that one read's bytes (its contents are
/// unspecified after a failed load anyway) and stays exported until then.
/// Where no thread can be created the work runs on this thread without
/// signal checks.
pub(crate) fn run_abandonable<T: Send + 'static>(
    py: Python<'_>,
    cancel: &dmaload::CancelToken,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    type Outcome<T> = std::thread::Result<T>;
    // Taken by the load thread, or by this one if that cannot be created.
    let slot =
        Arc::new(Mutex::new(Some(move || std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)))));
    let take = |slot: &Mutex<Option<_>>| slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    let (tx, rx) = std::sync::mpsc::sync_channel::<Outcome<T>>(1);
    let theirs = Arc::clone(&slot);
    let spawned = std::thread::Builder::new().name("dmaload-load".into()).spawn(move || {
        if let Some(work) = take(&theirs) {
            // The receiver is gone when the caller was interrupted: the
            // result (a buffer, say) is dropped here.
            let _ = tx.send(work());
        }
    });
    let thread = match spawned {
        Ok(thread) => thread,
        Err(_) => {
            return match take(&slot) {
                Some(work) => py.detach(work).map_err(panic_error),
                None => Err(PyRuntimeError::new_err("the load thread started and vanished")),
            }
        }
    };
    // A thread that sent its result is ending: joined (without the GIL,
    // which what it drops last may take), so none is left behind.
    let joined = |thread: std::thread::JoinHandle<()>| drop(py.detach(move || thread.join()));
    let wait = |rx: std::sync::mpsc::Receiver<Outcome<T>>, timeout: Duration| {
        py.detach(move || (rx.recv_timeout(timeout), rx))
    };
    let mut rx = rx;
    loop {
        let (received, back) = wait(rx, SIGNAL_POLL);
        rx = back;
        match received {
            Ok(result) => {
                joined(thread);
                return result.map_err(panic_error);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                joined(thread);
                return Err(PyRuntimeError::new_err("the load thread ended without a result"));
            }
        }
        if let Err(interrupted) = py.check_signals() {
            cancel.cancel();
            // A result that comes in time is dropped here, its thread
            // joined; one that does not is dropped by the load thread.
            if wait(rx, ABANDON_AFTER).0.is_ok() {
                joined(thread);
            }
            return Err(interrupted);
        }
    }
}

/// The load options of every native entry point, passed as one dict
/// (`dmaload._options.native_options` builds it): the core's
/// [`LoadOptions`], names and values as the core spells them (see
/// [`_option_defaults`]), sizes in bytes, plus the staging ring of device
/// loads. A name not listed here is a TypeError, so an option one side
/// lacks cannot pass unnoticed. Each entry point uses the options that
/// apply to it: a host load ignores the staging ring, a staged load the
/// host memory's (`to`, `gather_size`, `populate_threads`).
#[derive(Default)]
pub(crate) struct Opts {
    engine: Option<String>,
    mode: Option<String>,
    to: Option<String>,
    gather_size: Option<usize>,
    chunk_size: Option<usize>,
    queue_depth: Option<usize>,
    threads: Option<usize>,
    populate_threads: Option<usize>,
    measure_page_cache: Option<bool>,
    verify: Option<bool>,
    staging_slots: Option<usize>,
    staging_slot_size: Option<usize>,
}

impl Opts {
    /// Reads `options` (None: every default); a value of None is the default.
    pub(crate) fn from_dict(options: Option<&Bound<'_, PyDict>>) -> PyResult<Opts> {
        Opts::from_dict_for("load", options)
    }

    /// [`Opts::from_dict`] for an entry point whose errors call the options
    /// `what` options ("save option chunk_size: ...").
    pub(crate) fn from_dict_for(what: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Opts> {
        let mut o = Opts::default();
        for (name, value) in options.into_iter().flat_map(|dict| dict.iter()) {
            let name: String = name.extract()?;
            if value.is_none() {
                continue;
            }
            let typed = |e: PyErr| PyTypeError::new_err(format!("{what} option {name}: {e}"));
            // A bool is an int to Python, but True is never the count 1 a user meant.
            let number = || -> PyResult<usize> {
                if value.is_instance_of::<PyBool>() {
                    return Err(PyTypeError::new_err(format!(
                        "{what} option {name}: a bool is not a number"
                    )));
                }
                value.extract().map_err(typed)
            };
            match name.as_str() {
                "engine" => o.engine = Some(value.extract().map_err(typed)?),
                "mode" => o.mode = Some(value.extract().map_err(typed)?),
                "to" => o.to = Some(value.extract().map_err(typed)?),
                "gather_size" => o.gather_size = Some(number()?),
                "chunk_size" => o.chunk_size = Some(number()?),
                "queue_depth" => o.queue_depth = Some(number()?),
                "threads" => o.threads = Some(number()?),
                "populate_threads" => o.populate_threads = Some(number()?),
                "measure_page_cache" => o.measure_page_cache = Some(value.extract().map_err(typed)?),
                "verify" => o.verify = Some(value.extract().map_err(typed)?),
                "staging_slots" => o.staging_slots = Some(number()?),
                "staging_slot_size" => o.staging_slot_size = Some(number()?),
                _ => return Err(PyTypeError::new_err(format!("unknown {what} option {name:?}"))),
            }
        }
        Ok(o)
    }

    fn engine(&self) -> PyResult<Option<Engine>> {
        self.engine.as_deref().map(|e| e.parse::<Engine>().map_err(PyValueError::new_err)).transpose()
    }

    fn mode(&self) -> PyResult<Option<IoMode>> {
        self.mode.as_deref().map(|m| m.parse::<IoMode>().map_err(PyValueError::new_err)).transpose()
    }

    pub(crate) fn to_options(&self) -> PyResult<LoadOptions> {
        let mut o = LoadOptions::default();
        o.engine = self.engine()?.unwrap_or(o.engine);
        o.mode = self.mode()?.unwrap_or(o.mode);
        if let Some(to) = &self.to {
            o.to = to.parse::<Destination>().map_err(PyValueError::new_err)?;
        }
        o.gather_size = self.gather_size.unwrap_or(o.gather_size);
        o.chunk_size = self.chunk_size.unwrap_or(o.chunk_size);
        o.queue_depth = self.queue_depth.unwrap_or(o.queue_depth);
        o.threads = self.threads.unwrap_or(o.threads);
        o.populate_threads = self.populate_threads.unwrap_or(o.populate_threads);
        o.measure_page_cache = self.measure_page_cache.unwrap_or(o.measure_page_cache);
        o.verify = self.verify.unwrap_or(o.verify);
        Ok(o)
    }

    /// The options of a save: those a write shares with a load (`engine`,
    /// `mode`, `chunk_size`, `queue_depth`, `threads`) and `sync` (None:
    /// the default). One only
    /// a load takes is a TypeError naming it.
    pub(crate) fn to_save_options(&self, sync: Option<bool>) -> PyResult<SaveOptions> {
        let load_only = [
            ("to", self.to.is_some()),
            ("gather_size", self.gather_size.is_some()),
            ("populate_threads", self.populate_threads.is_some()),
            ("measure_page_cache", self.measure_page_cache.is_some()),
            ("verify", self.verify.is_some()),
            ("staging_slots", self.staging_slots.is_some()),
            ("staging_slot_size", self.staging_slot_size.is_some()),
        ];
        if let Some((name, _)) = load_only.iter().find(|(_, set)| *set) {
            return Err(PyTypeError::new_err(format!("unknown save option {name:?} (a load option)")));
        }
        let mut o = SaveOptions::default();
        o.sync = sync.unwrap_or(o.sync);
        o.engine = self.engine()?.unwrap_or(o.engine);
        o.mode = self.mode()?.unwrap_or(o.mode);
        o.chunk_size = self.chunk_size.unwrap_or(o.chunk_size);
        o.queue_depth = self.queue_depth.unwrap_or(o.queue_depth);
        o.threads = self.threads.unwrap_or(o.threads);
        Ok(o)
    }
}

/// The file a load reads: a path, or a descriptor number the caller holds
/// open (an int: `os.open`'s, or a file object's `fileno()`).
#[derive(FromPyObject)]
pub(crate) enum FileArg {
    Fd(std::os::fd::RawFd),
    Path(PathBuf),
}

impl FileArg {
    /// Opens the file once; a descriptor is reopened through
    /// `/proc/self/fd` (see [`dmaload::OpenFile::from_fd`]), never changed.
    pub(crate) fn open(&self) -> Result<dmaload::OpenFile, dmaload::Error> {
        match self {
            FileArg::Path(path) => dmaload::OpenFile::open(path),
            FileArg::Fd(fd) if *fd < 0 => Err(dmaload::Error::io(
                "open",
                std::path::Path::new(&format!("fd {fd}")),
                std::io::Error::from_raw_os_error(libc::EBADF),
            )),
            // SAFETY: a descriptor number the Python caller passed as open,
            // as `os.fstat(fd)` takes one; it is only borrowed within this
            // call, to duplicate it and reopen its file, never closed. Another
            // thread closing it meanwhile gives EBADF, or another file whose
            // identity `from_fd` checks against the reopened one.
            #[allow(unsafe_code)]
            FileArg::Fd(fd) => {
                dmaload::OpenFile::from_fd(unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) })
            }
        }
    }
}

/// What `load` reads: a file opened once, or an object (`s3://BUCKET/KEY`)
/// looked up once.
enum Source {
    File(dmaload::OpenFile),
    Object(Box<dmaload::object::Object>),
}

impl Source {
    fn open(file: &FileArg, cancel: &dmaload::CancelToken) -> Result<Source, dmaload::Error> {
        match file {
            FileArg::Path(path) if dmaload::object::is_object_url(path) => {
                dmaload::object::Object::open(&path.to_string_lossy(), cancel)
                    .map(|o| Source::Object(Box::new(o)))
            }
            _ => file.open().map(Source::File),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Source::File(file) => file.len(),
            Source::Object(object) => object.size,
        }
    }

    fn path(&self) -> &std::path::Path {
        match self {
            Source::File(file) => file.path(),
            Source::Object(object) => object.name(),
        }
    }

    fn load_to(
        &self,
        offset: u64,
        len: Option<u64>,
        options: &dmaload::LoadOptions,
    ) -> Result<(dmaload::Loaded, dmaload::LoadReport), dmaload::Error> {
        match self {
            Source::File(file) => dmaload::load_to(file, offset, len, options),
            Source::Object(object) => dmaload::load_object(object, offset, len, options),
        }
    }
}

fn file_len(path: &std::path::Path) -> Result<u64, dmaload::Error> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|e| dmaload::Error::io("stat", path, e))
}

/// Loads a file, or `length` bytes of it from `offset`, with the GIL
/// released. See `dmaload.load` for the options.
#[pyfunction]
#[pyo3(signature = (file, offset=None, length=None, *, options=None, progress=None))]
fn load(
    py: Python<'_>,
    file: FileArg,
    offset: Option<u64>,
    length: Option<u64>,
    options: Option<Bound<'_, PyDict>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Buffer> {
    guard(move || {
        let mut options = Opts::from_dict(options.as_ref())?.to_options()?;
        let cancel = dmaload::CancelToken::new();
        options.cancel = cancel.clone();
        let offset = offset.unwrap_or(0);
        let file = detached(py, || Source::open(&file, &cancel))?.map_err(|e| os_error(&e))?;
        let relay = progress.map(|callback| {
            let total = length.unwrap_or_else(|| file.len().saturating_sub(offset));
            let relay = Progress::new(callback, total, cancel.clone());
            options.progress = Some(relay.for_load());
            relay
        });
        options.check_host(file.path()).map_err(|e| os_error(&e))?;
        let to = options.to.clone();
        let result = run_abandonable(py, &cancel, move || file.load_to(offset, length, &options))?;
        Progress::raised(relay.as_ref())?;
        let (buffer, report) = match result.map_err(|e| os_error(&e))? {
            (dmaload::Loaded::Host(buffer), report) => (buffer, report),
            _ => return Err(PyValueError::new_err(format!("{to} did not load into a host buffer"))),
        };
        Progress::finish(relay.as_ref())?;
        Ok(Buffer::new(buffer, report))
    })
}

/// Relays a load's arrivals (`load_open_into_arriving`) to one Python
/// callable, on the load's thread beside the engine; the callable raising
/// cancels the load, and its exception outranks the load's own outcome.
struct Arrived {
    callback: Py<PyAny>,
    cancel: dmaload::CancelToken,
    error: Mutex<Option<PyErr>>,
}

impl Arrived {
    fn call(&self, n: u64) {
        let mut error = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if error.is_some() {
            return;
        }
        // try_attach: never panic on the core's thread, even if the
        // interpreter were shutting down (then the report is skipped).
        let _ = Python::try_attach(|py| {
            if let Err(err) = self.callback.call1(py, (n,)) {
                *error = Some(err);
                self.cancel.cancel();
            }
        });
    }

    fn raised(&self) -> PyResult<()> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take().map_or(Ok(()), Err)
    }
}

/// Fills `target` (a writable, C-contiguous buffer-protocol object: a
/// bytearray, a numpy array, `tensor.numpy()`) with its length's worth of
/// the file from `offset`, the GIL released; returns the report. In place
/// where the memory lines up with the file, else through a staging ring.
/// `arrived(n)` is called (with the GIL, from a thread of the load) each
/// time bytes `0..n` of `target` have all arrived.
#[pyfunction]
#[pyo3(signature = (path, target, offset=0, *, options=None, progress=None, arrived=None))]
fn load_into<'py>(
    py: Python<'py>,
    path: PathBuf,
    target: &Bound<'py, PyAny>,
    offset: u64,
    options: Option<Bound<'py, PyDict>>,
    progress: Option<Py<PyAny>>,
    arrived: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(move || {
        let opts = Opts::from_dict(options.as_ref())?;
        if opts.to.is_some() {
            return Err(PyTypeError::new_err("load_into() takes no 'to': the target is the destination"));
        }
        let mut options = opts.to_options()?;
        let cancel = dmaload::CancelToken::new();
        options.cancel = cancel.clone();
        let export = staged::writable_buffer(target)?;
        let relay = progress.map(|callback| {
            let relay = Progress::new(callback, export.len_bytes() as u64, cancel.clone());
            options.progress = Some(relay.for_load());
            relay
        });
        let arrivals = arrived
            .map(|callback| Arc::new(Arrived { callback, cancel: cancel.clone(), error: Mutex::new(None) }));
        let theirs = arrivals.clone();
        // The load owns the export: a read that Ctrl-C cannot stop keeps
        // the target mapped until it ends (see run_abandonable).
        let result = run_abandonable(py, &cancel, move || {
            let mut export = export;
            let dst = staged::writable_bytes(&mut export);
            let file = dmaload::OpenFile::open(&path)?;
            match &theirs {
                Some(arrivals) => {
                    dmaload::load_open_into_arriving(&file, offset, dst, &options, &|n| arrivals.call(n))
                }
                None => dmaload::load_open_into(&file, offset, dst, &options),
            }
        })?;
        if let Some(arrivals) = &arrivals {
            arrivals.raised()?;
        }
        Progress::raised(relay.as_ref())?;
        let report = result.map_err(|e| os_error(&e))?;
        Progress::finish(relay.as_ref())?;
        report_object(py, &report)
    })
}

/// Loads a whole file (a path, or a descriptor the caller holds open)
/// through the cache service at `socket`, or directly when no service
/// serves it (with `fallback=False`, no buffer instead). The file is
/// opened once: the service gets a descriptor of it, and a direct load
/// reads it. Returns the buffer or None, how the service served it ("hit",
/// "miss", "uncached") or None when it did not, and what to tell the user
/// (why not from the service, or why not cached) or None.
#[pyfunction]
#[pyo3(signature = (file, socket, *, options=None, fallback=true))]
fn load_cached(
    py: Python<'_>,
    file: FileArg,
    socket: PathBuf,
    options: Option<Bound<'_, PyDict>>,
    fallback: bool,
) -> PyResult<(Option<Buffer>, Option<&'static str>, Option<String>)> {
    guard(move || {
        let options = Opts::from_dict(options.as_ref())?.to_options()?;
        // Ctrl-C ends the connect, the waits for the service and a direct
        // load alike (each looks at the token within 20 ms, a read no
        // cancellation reaches is left behind: see run_abandonable).
        let cancel = options.cancel.clone();
        // Opened here, before the caller can close a descriptor it named.
        let file = detached(py, || file.open())?.map_err(|e| os_error(&e))?;
        if !fallback {
            let served =
                run_abandonable(py, &cancel, move || dmaload::share::from_service(&file, &socket, &options))?
                    .map_err(|e| os_error(&e))?;
            return Ok(match served {
                Ok((buffer, report, served, note)) => {
                    (Some(Buffer::new(buffer, report)), Some(served.name()), note)
                }
                Err(reason) => (None, None, Some(reason)),
            });
        }
        let (buffer, report, outcome) =
            run_abandonable(py, &cancel, move || dmaload::share::load_cached_open(&file, &socket, &options))?
                .map_err(|e| os_error(&e))?;
        let (served, message) = match outcome {
            dmaload::share::CacheOutcome::Service { served, note } => (Some(served.name()), note),
            dmaload::share::CacheOutcome::Direct { reason } => (None, Some(reason)),
        };
        Ok((Some(Buffer::new(buffer, report)), served, message))
    })
}

/// Drops the file at `path` from the page cache (fdatasync, then
/// `POSIX_FADV_DONTNEED`; no root needed), so that its next read comes from
/// the device: the core's `pagecache::evict`, the one the CLI uses. A
/// FIFO, socket or character device is refused unopened: it has no page
/// cache.
#[pyfunction]
fn evict(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    detached(py, || dmaload::pagecache::evict(&path))?.map_err(|e| os_error(&e))
}

/// The cache service's default socket: `$XDG_RUNTIME_DIR/dmaload.sock`,
/// else `/run/user/UID/dmaload.sock`.
#[pyfunction]
fn default_cache_socket() -> PathBuf {
    dmaload::share::default_socket()
}

/// The core's header as a `dmaload._header.Header`, its tensors
/// `dmaload._header.TensorInfo` records, built field by field. The
/// destructurings name every field, so a field the core adds to its
/// `Header` or `TensorInfo` is a compile error here until it crosses too.
fn header_object<'py>(py: Python<'py>, header: st::Header) -> PyResult<Bound<'py, PyAny>> {
    let data_start = header.data_start();
    let st::Header { header_len: _, tensors, metadata } = header;
    let module = py.import("dmaload._header")?;
    let tensor_class = module.getattr("TensorInfo")?;
    let tensors = tensors
        .into_iter()
        .map(|tensor| {
            let st::TensorInfo { name, dtype, shape, data_offsets: (begin, end) } = tensor;
            let kw = PyDict::new(py);
            kw.set_item(pyo3::intern!(py, "name"), name)?;
            kw.set_item(pyo3::intern!(py, "dtype"), dtype.name())?;
            kw.set_item(pyo3::intern!(py, "shape"), PyTuple::new(py, shape)?)?;
            kw.set_item(pyo3::intern!(py, "begin"), begin)?;
            kw.set_item(pyo3::intern!(py, "end"), end)?;
            tensor_class.call((), Some(&kw))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let kw = PyDict::new(py);
    kw.set_item("tensors", PyTuple::new(py, tensors)?)?;
    kw.set_item("metadata", metadata)?;
    kw.set_item("data_start", data_start)?;
    module.getattr("Header")?.call((), Some(&kw))
}

/// Parses a safetensors header from bytes: `data` holds at least the
/// first `8 + n` bytes of a file of `file_len` bytes (default: `len(data)`).
#[pyfunction]
#[pyo3(signature = (data, file_len=None))]
fn parse_safetensors_header<'py>(
    py: Python<'py>,
    data: &[u8],
    file_len: Option<u64>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(|| {
        let header = st::parse(data, file_len.unwrap_or(data.len() as u64))
            .map_err(|e| SafetensorError::new_err(e.to_string()))?;
        header_object(py, header)
    })
}

/// Reads and validates the header of a safetensors file without loading it.
#[pyfunction]
fn read_safetensors_header(py: Python<'_>, path: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    // A read no cancellation reaches does not hold Ctrl-C (see run_abandonable).
    let read = run_abandonable(py, &dmaload::CancelToken::new(), move || st::read_header(&path))?;
    let (header, _) = read.map_err(|e| format_error(&e))?;
    guard(|| header_object(py, header))
}

/// Loads safetensors files whole, `concurrency` at a time, with the GIL
/// released; returns (buffer, `Header`) per file, in order.
#[pyfunction]
#[pyo3(signature = (paths, *, concurrency=4, options=None, progress=None))]
fn load_safetensors<'py>(
    py: Python<'py>,
    paths: Vec<PathBuf>,
    concurrency: usize,
    options: Option<Bound<'py, PyDict>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Vec<(Buffer, Bound<'py, PyAny>)>> {
    guard(move || {
        let mut options = Opts::from_dict(options.as_ref())?.to_options()?;
        // The tensors never expose the memfd: `to="auto"` may pick
        // anonymous huge pages.
        options.needs_fd = false;
        if concurrency == 0 {
            return Err(PyValueError::new_err("concurrency must be at least 1"));
        }
        // The progress total; the core checks the files against the memory
        // budget together, before allocating anything.
        let total =
            detached(py, || -> Result<u64, dmaload::Error> { paths.iter().map(|p| file_len(p)).sum() })?
                .map_err(|e| os_error(&e))?;
        // One token for every shard: a callback's exception or Ctrl-C stops them all.
        let cancel = dmaload::CancelToken::new();
        options.cancel = cancel.clone();
        let relay = progress.map(|callback| Progress::new(callback, total, cancel.clone()));
        options.progress = relay.as_ref().map(|relay| relay.for_load());
        let loaded = run_abandonable(py, &cancel, move || {
            dmaload::load_many_safetensors(&paths, &options, concurrency)
        })?;
        Progress::raised(relay.as_ref())?;
        let out = loaded
            .map_err(|err| format_error(&err))?
            .into_iter()
            .map(|loaded| Ok((Buffer::new(loaded.buffer, loaded.report), header_object(py, loaded.header)?)))
            .collect::<PyResult<Vec<_>>>()?;
        Progress::finish(relay.as_ref())?;
        Ok(out)
    })
}

/// The dtype names safetensors defines, with their sizes in bits.
#[pyfunction]
fn safetensors_dtypes() -> PyResult<Vec<(&'static str, u64)>> {
    guard(|| Ok(st::Dtype::ALL.iter().map(|d| (d.name(), d.bits())).collect()))
}

/// The values each enumerated option takes, as the core parses and prints
/// them (`to` lists its forms, `cuda:N` for any device number): the tests
/// check `dmaload._options`' types against these.
#[pyfunction]
fn _option_choices() -> PyResult<BTreeMap<&'static str, Vec<String>>> {
    guard(|| {
        Ok(BTreeMap::from([
            ("engine", Engine::ALL.iter().map(|e| e.name().to_owned()).collect()),
            ("mode", IoMode::ALL.iter().map(|m| m.name().to_owned()).collect()),
            ("to", Destination::forms()),
        ]))
    })
}

/// Checks a load's options (the dict `dmaload._options.native_options`
/// builds) as a load would before it opens a file, without loading: names,
/// types and values. The serving engines' loaders call it when they read
/// their config, so a bad value fails there, not inside the first load.
#[pyfunction]
#[pyo3(signature = (options=None))]
fn _check_load_options(options: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    guard(|| {
        let o = Opts::from_dict(options)?.to_options()?;
        dmaload::check_load_options(&o).map_err(|e| os_error(&e))
    })
}

/// A default the core gives an option: an enumerated option's name, a
/// number, or a switch.
#[derive(IntoPyObject)]
enum DefaultValue {
    Name(String),
    Number(usize),
    Flag(bool),
}

/// Every load option the binding takes, with the core's default: the
/// fields of [`LoadOptions`] (all named, so a field the core adds is a
/// compile error here until it crosses) less the callback and the
/// cancellation token, which Python passes in its own way, `needs_fd`,
/// which each entry point sets (`load` keeps a memfd for `Buffer.fileno`,
/// the safetensors loaders need none), and the staging ring of device
/// loads.
#[pyfunction]
fn _option_defaults() -> PyResult<BTreeMap<&'static str, DefaultValue>> {
    guard(|| {
        let LoadOptions {
            engine,
            mode,
            to,
            gather_size,
            chunk_size,
            queue_depth,
            threads,
            populate_threads,
            measure_page_cache,
            verify,
            needs_fd: _,
            progress: _,
            cancel: _,
        } = LoadOptions::default();
        Ok(BTreeMap::from([
            ("engine", DefaultValue::Name(engine.name().to_owned())),
            ("mode", DefaultValue::Name(mode.name().to_owned())),
            ("to", DefaultValue::Name(to.name())),
            ("gather_size", DefaultValue::Number(gather_size)),
            ("chunk_size", DefaultValue::Number(chunk_size)),
            ("queue_depth", DefaultValue::Number(queue_depth)),
            ("threads", DefaultValue::Number(threads)),
            ("populate_threads", DefaultValue::Number(populate_threads)),
            ("measure_page_cache", DefaultValue::Flag(measure_page_cache)),
            ("verify", DefaultValue::Flag(verify)),
            ("staging_slots", DefaultValue::Number(dmaload::sink::DEFAULT_SLOTS)),
            ("staging_slot_size", DefaultValue::Number(dmaload::sink::DEFAULT_SLOT_SIZE)),
        ]))
    })
}

/// For the tests only: panics where `place` says ("gil": with the GIL
/// held; "detached": with it released; "load": on the load thread, as a
/// load would), to prove that every such panic reaches Python as a
/// RuntimeError and never as a PanicException.
#[pyfunction]
fn _test_panic(py: Python<'_>, place: &str) -> PyResult<()> {
    let message = format!("deliberate test panic ({place})");
    match place {
        "gil" => guard(|| panic!("{message}")),
        "detached" => detached(py, || panic!("{message}")),
        "load" => run_cancellable(py, &dmaload::CancelToken::new(), || -> () { panic!("{message}") }),
        other => Err(PyValueError::new_err(format!("unknown place {other:?} (gil, detached or load)"))),
    }
}

#[pymodule]
fn _dmaload(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_HEADER_LEN", st::MAX_HEADER_LEN)?;
    m.add("SafetensorError", m.py().get_type::<SafetensorError>())?;
    m.add_class::<Buffer>()?;
    m.add_class::<dmabuf::DmaBuf>()?;
    m.add_function(wrap_pyfunction!(dmabuf::load_dmabuf, m)?)?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(load_into, m)?)?;
    m.add_function(wrap_pyfunction!(load_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(load_cached, m)?)?;
    m.add_function(wrap_pyfunction!(save::save, m)?)?;
    m.add_function(wrap_pyfunction!(save::_save_option_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(default_cache_socket, m)?)?;
    m.add_function(wrap_pyfunction!(evict, m)?)?;
    m.add_function(wrap_pyfunction!(read_safetensors_header, m)?)?;
    m.add_function(wrap_pyfunction!(parse_safetensors_header, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_dtypes, m)?)?;
    m.add_class::<block_queue::BlockQueue>()?;
    m.add_class::<windows::WindowLoader>()?;
    m.add_class::<windows::Arrival>()?;
    m.add_class::<windows::StreamDigest>()?;
    m.add_class::<staged::SafetensorsFile>()?;
    m.add_class::<lease::LeasedFile>()?;
    m.add_function(wrap_pyfunction!(staged::open_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(staged::_load_staged, m)?)?;
    m.add_function(wrap_pyfunction!(staged::release_staging, m)?)?;
    m.add_function(wrap_pyfunction!(_option_choices, m)?)?;
    m.add_function(wrap_pyfunction!(_option_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(_check_load_options, m)?)?;
    m.add_function(wrap_pyfunction!(_test_panic, m)?)?;
    Ok(())
}
