//! Loads into a new host buffer (`load`) or memory the caller has
//! (`load_into`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dmaload::LoadRequest;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffer::Buffer;
use crate::errors::*;
use crate::options::*;
use crate::report::*;
use crate::run::*;
use crate::staged;

/// What a load reads (`load`, a stream's windows, a safetensors file): a
/// file opened once, or an object (`s3://BUCKET/KEY`) looked up once, every
/// GET of its loads pinned to the ETag that lookup found (an object
/// replaced meanwhile fails them as `Changed`).
pub(crate) enum Source {
    File(dmaload::OpenFile),
    Object(Box<dmaload::object::Object>),
}

impl Source {
    pub(crate) fn open(file: &FileArg, cancel: &dmaload::CancelToken) -> Result<Source, dmaload::Error> {
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

    pub(crate) fn request(&self) -> LoadRequest<'_> {
        match self {
            Source::File(file) => LoadRequest::open(file),
            Source::Object(object) => LoadRequest::object(object),
        }
    }

    /// The path or URL messages name.
    pub(crate) fn path(&self) -> &std::path::Path {
        match self {
            Source::File(file) => file.path(),
            Source::Object(object) => object.name(),
        }
    }
}

pub(crate) fn file_len(path: &std::path::Path) -> Result<u64, dmaload::Error> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|e| dmaload::Error::io("stat", path, e))
}

/// Loads a file, or `length` bytes of it from `offset`, with the GIL
/// released. See `dmaload.load` for the options.
#[pyfunction]
#[pyo3(signature = (file, offset=None, length=None, *, options=None, progress=None))]
pub(crate) fn load(
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
        let result = run_abandonable(py, &cancel, move || {
            file.request().range(offset, length).options(&options).to_buffer()
        })?;
        Progress::raised(relay.as_ref())?;
        let (buffer, report) = result.map_err(|e| os_error(&e))?;
        Progress::finish(relay.as_ref())?;
        Ok(Buffer::new(buffer, report))
    })
}

/// Relays a load's arrivals (`LoadRequest::fill_arriving`) to one Python
/// callable, on the load's thread beside the engine; the callable raising
/// cancels the load, and its exception outranks the load's own outcome.
pub(crate) struct Arrived {
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
pub(crate) fn load_into<'py>(
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
        if opts.given("to") {
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
            let request = LoadRequest::path(&path).range(offset, None).options(&options);
            match &theirs {
                Some(arrivals) => request.fill_arriving(dst, &|n| arrivals.call(n)),
                None => request.fill_raw(dst),
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
