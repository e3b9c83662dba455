//! `WindowLoader`: the loads of a stream's windows (`load_into` of a file
//! range into a buffer the caller gives), queued ahead by the consumer and
//! started in order on threads of their own that never take the GIL. Each
//! load says how far it has come through its [`Arrival`], which the
//! consumer waits on with the GIL released.
//!
//! Why not one Python thread calling `load_into` per window: that thread
//! takes the GIL to begin each window, to hear each gather arrive and to
//! return, and each time waits for the consumer's Python to let it go (up to
//! the interpreter's switch interval), so beside an engine's per-weight
//! Python the reads ran at half the disk's speed (docs/benchmarks-archive.md,
//! "With an engine's work between tensors").

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use dmaload::format::safetensors as st;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{detached, format_error, guard, os_error, panic_error, panic_message};
use crate::load::Source;
use crate::options::{FileArg, Opts};
use crate::run::{ABANDON_AFTER, SIGNAL_POLL};
use crate::safetensors::header_object;
use crate::staged;

/// Loads of ranges of files opened once, into buffers the caller gives,
/// started in the order submitted, `in_flight` at a time, each on a thread
/// of the loader's own (where no thread can be created, `submit` loads at
/// once with the GIL released). A failed load ends the loader: the loads
/// queued after it are not run, and their arrivals fail saying so.
#[pyclass(module = "dmaload._dmaload", frozen)]
pub(crate) struct WindowLoader {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

/// What the loader's threads and its Python side share.
struct Shared {
    files: Vec<Source>,
    options: dmaload::LoadOptions,
    queue: Mutex<Queue>,
    queued: Condvar,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Targets of loads that ended: the Python side releases them, since
    /// releasing an export takes the GIL, which the loader's threads never
    /// waits for.
    spent: Vec<PyBuffer<u8>>,
    /// `close()` was called: no more loads run or may be submitted.
    closed: bool,
    /// A load failed: no more loads run.
    failed: bool,
}

struct Job {
    file: usize,
    offset: u64,
    target: PyBuffer<u8>,
    arrival: Arc<ArrivalState>,
    watch: Option<Py<PyAny>>,
}

/// Why a load did not complete.
#[derive(Clone)]
enum Failure {
    Load(Arc<dmaload::Error>),
    Panic(String),
    /// Not run: an earlier load failed.
    AfterAnother,
    /// Not run: the loader was closed first.
    Closed,
}

/// Why a loader stops running loads.
#[derive(Clone, Copy, PartialEq)]
enum Stop {
    Closed,
    Failed,
}

impl Failure {
    fn to_py(&self) -> PyErr {
        match self {
            Failure::Load(err) => os_error(err),
            Failure::Panic(what) => panic_error(Box::new(what.clone())),
            Failure::AfterAnother => {
                PyOSError::new_err((libc::ECANCELED, "not loaded: an earlier load of this loader failed"))
            }
            Failure::Closed => PyOSError::new_err((libc::ECANCELED, "not loaded: the loader was closed")),
        }
    }
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `job`: its arrival ends with the outcome; returns the failure.
    fn run(&self, job: Job) -> Option<Failure> {
        let Job { file, offset, mut target, arrival, watch } = job;
        let reported = |n| {
            arrival.arrived(n);
            if let Some(watch) = &watch {
                // try_attach: never panic on this thread, even if the
                // interpreter were shutting down (then the call is skipped).
                let _ = Python::try_attach(|py| {
                    if let Err(err) = watch.call1(py, (n,)) {
                        err.write_unraisable(py, Some(watch.bind(py)));
                    }
                });
            }
        };
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let dst = staged::writable_bytes(&mut target);
            self.files[file]
                .request()
                .range(offset, None)
                .options(&self.options)
                .fill_arriving(dst, &reported)
        }));
        let failure = match loaded {
            Ok(Ok(_report)) => None,
            Ok(Err(err)) => Some(Failure::Load(Arc::new(err))),
            Err(payload) => Some(Failure::Panic(panic_message(payload.as_ref()))),
        };
        arrival.end(failure.clone());
        self.queue().spent.push(target);
        failure
    }

    /// A thread of the loader: runs queued loads, in order, until the loader
    /// ends.
    fn work(&self) {
        loop {
            let job = {
                let mut queue = self.queue();
                loop {
                    if queue.closed || queue.failed {
                        return;
                    }
                    if let Some(job) = queue.jobs.pop_front() {
                        break job;
                    }
                    queue = self.queued.wait(queue).unwrap_or_else(|e| e.into_inner());
                }
            };
            if self.run(job).is_some() {
                self.stop(Stop::Failed);
            }
        }
    }

    /// Stops the loader: the queued loads fail as not run (`Closed` or
    /// `AfterAnother`), their targets spent.
    fn stop(&self, why: Stop) {
        let skipped = if why == Stop::Closed { Failure::Closed } else { Failure::AfterAnother };
        let mut queue = self.queue();
        match why {
            Stop::Closed => queue.closed = true,
            Stop::Failed => queue.failed = true,
        }
        while let Some(job) = queue.jobs.pop_front() {
            job.arrival.end(Some(skipped.clone()));
            queue.spent.push(job.target);
        }
        drop(queue);
        self.queued.notify_all();
    }
}

#[pymethods]
impl WindowLoader {
    /// Opens each of `files` (paths, descriptors the caller holds open,
    /// reopened through `/proc/self/fd`, or `s3://` URLs, looked up with a
    /// HEAD) once, with the GIL released, and
    /// starts the loader's `in_flight` threads. `options` as `load_into`
    /// takes them (no `to`).
    #[new]
    #[pyo3(signature = (files, *, options=None, in_flight=1))]
    fn new(
        py: Python<'_>,
        files: Vec<FileArg>,
        options: Option<Bound<'_, PyDict>>,
        in_flight: usize,
    ) -> PyResult<WindowLoader> {
        guard(|| {
            let opts = Opts::from_dict(options.as_ref())?;
            if opts.given("to") {
                return Err(PyTypeError::new_err(
                    "WindowLoader takes no 'to': the targets are the destinations",
                ));
            }
            let mut options = opts.to_options()?;
            options.cancel = dmaload::CancelToken::new();
            let cancel = &options.cancel;
            let opened = detached(py, || {
                files.iter().map(|f| Source::open(f, cancel)).collect::<Result<Vec<_>, _>>()
            })?
            .map_err(|e| os_error(&e))?;
            let shared = Arc::new(Shared {
                files: opened,
                options,
                queue: Mutex::new(Queue::default()),
                queued: Condvar::new(),
            });
            let workers = (0..in_flight.max(1))
                .map_while(|_| {
                    let theirs = Arc::clone(&shared);
                    std::thread::Builder::new()
                        .name("dmaload-windows".into())
                        .spawn(move || theirs.work())
                        .ok()
                })
                .collect();
            Ok(WindowLoader { shared, workers: Mutex::new(workers) })
        })
    }

    /// Queues the load of `len(target)` bytes of file `file` (an index into
    /// the loader's files) from byte `offset` into `target` (a writable
    /// C-contiguous buffer, exported until its load ends); returns its
    /// [`Arrival`]. ValueError once the loader is closed. `arrived(n)`,
    /// where given, is called after each report of the arrival, with the
    /// GIL, on a thread of the loader (which then waits for the GIL, as
    /// `load_into`'s does: for watching a load, not for speed); what it
    /// raises is printed as unraisable.
    #[pyo3(signature = (file, offset, target, *, arrived=None))]
    fn submit(
        &self,
        py: Python<'_>,
        file: usize,
        offset: u64,
        target: &Bound<'_, PyAny>,
        arrived: Option<Py<PyAny>>,
    ) -> PyResult<Arrival> {
        guard(|| {
            self.file(file)?;
            let target = staged::writable_buffer(target)?;
            let arrival = Arc::new(ArrivalState::default());
            let job = Job { file, offset, target, arrival: Arc::clone(&arrival), watch: arrived };
            let inline = self.workers.lock().unwrap_or_else(|e| e.into_inner()).is_empty();
            let shared = &self.shared;
            let mut queue = shared.queue();
            // Released below, with the GIL.
            let spent = std::mem::take(&mut queue.spent);
            if queue.closed {
                return Err(PyValueError::new_err("submit to a closed WindowLoader"));
            }
            if queue.failed {
                drop(queue);
                arrival.end(Some(Failure::AfterAnother));
            } else if inline {
                drop(queue);
                if detached(py, || shared.run(job))?.is_some() {
                    shared.stop(Stop::Failed);
                }
            } else {
                queue.jobs.push_back(job);
                drop(queue);
                shared.queued.notify_all();
            }
            drop(spent);
            Ok(Arrival { state: arrival })
        })
    }

    /// Raises OSError (ENOMEM) unless `n` more bytes of memory are
    /// available, as a load into fresh memory checks before allocating
    /// (`dmaload::check_memory`: the memory cgroup's headroom and
    /// MemAvailable), naming file `file`: a stream asks before it allocates
    /// a window buffer, not the OOM killer after.
    fn check_memory(&self, py: Python<'_>, file: usize, n: u64) -> PyResult<()> {
        guard(|| {
            // The targets of ended loads are released first (with the GIL,
            // here): memory the stream no longer holds counts as free.
            drop(std::mem::take(&mut self.shared.queue().spent));
            let path = self.file(file)?.path();
            detached(py, || dmaload::check_memory(path, n))?.map_err(|e| os_error(&e))
        })
    }

    /// The safetensors header of file `file`, read from the loader's own
    /// open (an object's with a ranged GET pinned to its ETag), so that
    /// every window loaded later is of the bytes this header describes.
    fn header<'py>(&self, py: Python<'py>, file: usize) -> PyResult<Bound<'py, PyAny>> {
        guard(|| {
            let source = self.file(file)?;
            let read = detached(py, || match source {
                Source::File(file) => st::read_header_of(file),
                Source::Object(object) => st::read_object_header(object, &self.shared.options.cancel),
            })?;
            let (header, _) = read.map_err(|e| format_error(&e))?;
            header_object(py, header)
        })
    }

    /// The digest to come of object `file` (its bytes as the loader's
    /// windows hand them over), checked against the `B3SUMS` or
    /// `SHA256SUMS` object beside it, read with the loader's settings;
    /// OSError (EINVAL) when none lists it, ValueError for a file (whose
    /// digest is `StreamDigest(path)`).
    fn digest(&self, py: Python<'_>, file: usize) -> PyResult<StreamDigest> {
        guard(|| {
            let Source::Object(object) = self.file(file)? else {
                return Err(PyValueError::new_err("digest() is for objects: a file's is StreamDigest(path)"));
            };
            let cancel = &self.shared.options.cancel;
            let verifier = detached(py, || dmaload::verify::StreamVerifier::for_object(object, cancel))?
                .map_err(|e| os_error(&e))?;
            Ok(StreamDigest::of(object.name().to_owned(), verifier))
        })
    }

    /// The size of file or object `file` as the loader opened it.
    fn size(&self, file: usize) -> PyResult<u64> {
        Ok(match self.file(file)? {
            Source::Object(object) => object.size,
            Source::File(file) => file.len(),
        })
    }

    /// `file`'s identity for ranks comparing what they load: an object's
    /// `"s3://BUCKET/KEY ETAG SIZE"` (the same bytes wherever it is read),
    /// `None` for a file.
    fn object_identity(&self, file: usize) -> PyResult<Option<String>> {
        Ok(match self.file(file)? {
            Source::Object(object) => {
                Some(format!("{} {} {}", object.name().display(), object.etag, object.size))
            }
            Source::File(_) => None,
        })
    }

    /// Stops the loader: the load under way is cancelled (waited for up to
    /// a moment: a read the cancellation cannot reach keeps its target
    /// exported until it ends, on its thread), the queued ones
    /// fail as not loaded. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            self.shared.options.cancel.cancel();
            self.shared.stop(Stop::Closed);
            let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|e| e.into_inner()));
            let deadline = Instant::now() + ABANDON_AFTER;
            detached(py, || {
                while workers.iter().any(|w| !w.is_finished()) && Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                // The ones still reading are left to end on their own.
                for worker in workers.into_iter().filter(|w| w.is_finished()) {
                    let _ = worker.join();
                }
            })?;
            let spent = std::mem::take(&mut self.shared.queue().spent);
            drop(spent);
            Ok(())
        })
    }
}

impl WindowLoader {
    /// File `file` of the loader's (an index into them).
    fn file(&self, file: usize) -> PyResult<&Source> {
        self.shared.files.get(file).ok_or_else(|| {
            PyIndexError::new_err(format!("file {file} of a loader of {} file(s)", self.shared.files.len()))
        })
    }
}

impl Drop for WindowLoader {
    /// A loader dropped unclosed stops as `close()` stops it, without
    /// waiting: its thread ends on its own.
    fn drop(&mut self) {
        self.shared.options.cancel.cancel();
        self.shared.stop(Stop::Closed);
    }
}

/// How far one load of a [`WindowLoader`] has come.
#[pyclass(module = "dmaload._dmaload", frozen)]
pub(crate) struct Arrival {
    state: Arc<ArrivalState>,
}

#[derive(Default)]
struct ArrivalState {
    progress: Mutex<Progress>,
    changed: Condvar,
}

#[derive(Default)]
struct Progress {
    /// Bytes `0..arrived` of the target hold the file's bytes.
    arrived: u64,
    /// `Some` once the load ended: `None` inside when it succeeded.
    ended: Option<Option<Failure>>,
}

impl ArrivalState {
    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn arrived(&self, n: u64) {
        let mut progress = self.progress();
        progress.arrived = progress.arrived.max(n);
        drop(progress);
        self.changed.notify_all();
    }

    fn end(&self, failure: Option<Failure>) {
        self.progress().ended.get_or_insert(failure);
        self.changed.notify_all();
    }

    /// Blocks until `reached` holds or the load ended, in [`SIGNAL_POLL`]
    /// slices with the GIL released (Ctrl-C raises KeyboardInterrupt
    /// between them); raises the load's failure once there is one, and
    /// ValueError where it ended short of `reached`.
    fn wait_for(&self, py: Python<'_>, reached: impl Fn(&Progress) -> bool + Sync) -> PyResult<()> {
        // A load that ended settles every wait: one for more bytes than it
        // holds would otherwise never return.
        let settled = |p: &Progress| reached(p) || p.ended.is_some();
        let outcome = |p: &Progress| match &p.ended {
            Some(Some(failure)) => Err(failure.to_py()),
            _ if reached(p) => Ok(()),
            _ => Err(PyValueError::new_err(format!(
                "the load ended with {} bytes: fewer than asked",
                p.arrived
            ))),
        };
        {
            let progress = self.progress();
            if settled(&progress) {
                return outcome(&progress);
            }
        }
        loop {
            let done = detached(py, || {
                let progress = self.progress();
                let (progress, _) = self
                    .changed
                    .wait_timeout_while(progress, SIGNAL_POLL, |p| !settled(p))
                    .unwrap_or_else(|e| e.into_inner());
                settled(&progress)
            })?;
            if done {
                return outcome(&self.progress());
            }
            py.check_signals()?;
        }
    }
}

#[pymethods]
impl Arrival {
    /// Blocks (the GIL released; Ctrl-C raises KeyboardInterrupt) until
    /// bytes `0..n` of the target hold the file's bytes; raises the load's
    /// failure (OSError naming the operation, file and offset) once there
    /// is one, even for bytes that had arrived; ValueError where the load
    /// ended with fewer bytes.
    fn wait(&self, py: Python<'_>, n: u64) -> PyResult<()> {
        guard(|| self.state.wait_for(py, |p| p.arrived >= n))
    }

    /// Blocks until the load has ended; raises its failure (one at its
    /// end check, after its last byte, included).
    fn wait_done(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| self.state.wait_for(py, |p| p.ended.is_some()))
    }

    /// Bytes `0..n` of the target known to hold the file's bytes.
    fn count(&self) -> u64 {
        self.state.progress().arrived
    }
}

/// The digest of one file whose bytes a stream hands over window by
/// window, in file order, checked against the digest its sums file
/// records (`B3SUMS` or `SHA256SUMS` beside it, found by the core's
/// lookup, `dmaload::verify`): what `verify=True` means for a stream, whose
/// windows are loads of parts of the file.
#[pyclass(module = "dmaload._dmaload", frozen)]
pub(crate) struct StreamDigest {
    path: std::path::PathBuf,
    kind: &'static str,
    expected: String,
    /// `None` once checked.
    verifier: Mutex<Option<dmaload::verify::StreamVerifier>>,
}

impl StreamDigest {
    fn of(path: std::path::PathBuf, verifier: dmaload::verify::StreamVerifier) -> StreamDigest {
        let (kind, expected) = verifier.expected();
        StreamDigest {
            path,
            kind: kind.sums_file(),
            expected: dmaload::verify::hex(&expected),
            verifier: Mutex::new(Some(verifier)),
        }
    }
}

#[pymethods]
impl StreamDigest {
    /// The digest of the file at `path` to come; OSError (EINVAL) naming
    /// the sums file when none lists it (`dmaload sums` writes one).
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<StreamDigest> {
        guard(|| {
            let verifier =
                detached(py, || dmaload::verify::StreamVerifier::new(&path))?.map_err(|e| os_error(&e))?;
            Ok(StreamDigest::of(path, verifier))
        })
    }

    /// The sums file that lists the file (`"B3SUMS"` or `"SHA256SUMS"`).
    #[getter]
    fn sums_file(&self) -> &'static str {
        self.kind
    }

    /// The digest it records, in hex: equal on ranks whose sums files
    /// agree.
    #[getter]
    fn expected(&self) -> String {
        self.expected.clone()
    }

    /// Adds the bytes of `data` (a writable C-contiguous buffer: a
    /// window's), the next bytes of the file, hashed with the GIL released.
    fn update(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let mut buffer = staged::writable_buffer(data)?;
            let verifier = self.verifier.lock().unwrap_or_else(|e| e.into_inner());
            let verifier = verifier
                .as_ref()
                .ok_or_else(|| PyValueError::new_err("update of a digest already checked"))?;
            let bytes = staged::writable_bytes(&mut buffer);
            detached(py, || verifier.add(bytes))
        })
    }

    /// Raises OSError (EBADMSG, naming the sums file and both digests)
    /// unless the bytes added hash to the recorded digest. Once only.
    fn check(&self) -> PyResult<()> {
        guard(|| {
            let verifier = self.verifier.lock().unwrap_or_else(|e| e.into_inner()).take();
            let verifier = verifier.ok_or_else(|| PyValueError::new_err("a digest is checked once"))?;
            verifier.check(&self.path).map_err(|e| os_error(&e))
        })
    }
}
