//! Running native work from Python: with the GIL released, progress
//! relayed to a callback, Ctrl-C turned into a cancel.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::errors::*;

/// Forwards the core's per-load progress to one Python callable, summed
/// over the loads of one call, at most every 50 ms (and at the end).
pub(crate) struct Progress {
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

pub(crate) const PROGRESS_INTERVAL: Duration = Duration::from_millis(50);

impl Progress {
    pub(crate) fn new(callback: Py<PyAny>, total: u64, cancel: dmaload::CancelToken) -> Arc<Progress> {
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
    pub(crate) fn for_load(self: &Arc<Progress>) -> Arc<dmaload::ProgressFn> {
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

    pub(crate) fn maybe_call(&self, force: bool) {
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
    pub(crate) fn take_error(&self) -> Option<PyErr> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The callback's exception, if it raised one: it outranks the load's
    /// own outcome (the cancellation it caused).
    pub(crate) fn raised(relay: Option<&Arc<Progress>>) -> PyResult<()> {
        relay.and_then(|relay| relay.take_error()).map_or(Ok(()), Err)
    }

    /// After a successful load: one last call with the final figures, and
    /// its exception if it raised one.
    pub(crate) fn finish(relay: Option<&Arc<Progress>>) -> PyResult<()> {
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
pub(crate) fn run_cancellable<T: Send>(
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
pub(crate) const ABANDON_AFTER: Duration = Duration::from_millis(60);

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

/// For the tests only: panics where `place` says ("gil": with the GIL
/// held; "detached": with it released; "load": on the load thread, as a
/// load would), to prove that every such panic reaches Python as a
/// RuntimeError and never as a PanicException.
#[pyfunction]
pub(crate) fn _test_panic(py: Python<'_>, place: &str) -> PyResult<()> {
    let message = format!("deliberate test panic ({place})");
    match place {
        "gil" => guard(|| panic!("{message}")),
        "detached" => detached(py, || panic!("{message}")),
        "load" => run_cancellable(py, &dmaload::CancelToken::new(), || -> () { panic!("{message}") }),
        other => Err(PyValueError::new_err(format!("unknown place {other:?} (gil, detached or load)"))),
    }
}
