//! `save`: the bytes of any C-contiguous buffer-protocol object written to
//! a file by the core's [`dmaload::save_raw`], with the GIL released and
//! without copying them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dmaload::save::RawBytes;
use dmaload::{SaveOptions, SaveReport};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{guard, os_error};
use crate::options::{DefaultValue, Opts};
use crate::report::report_json;
use crate::run::{run_abandonable, Progress};

/// The bytes of `export`, for the kernel alone to read.
#[allow(unsafe_code)]
fn exported_bytes(export: &PyBuffer<u8>) -> RawBytes<'_> {
    // SAFETY: `export` holds the object's buffer export for as long as the
    // result borrows it: meanwhile the object cannot free, move or shrink
    // the memory (a bytearray refuses to resize, a dmaload.Buffer to
    // close), so `len_bytes` bytes at `buf_ptr` stay mapped and readable.
    // Python code may still write them (a writable buffer, from another
    // thread): that is why they cross as `RawBytes`, never as a `&[u8]`;
    // such a write changes only what is saved.
    unsafe { RawBytes::from_raw_parts(export.buf_ptr().cast::<u8>(), export.len_bytes()) }
}

/// Writes the bytes of `data` (a C-contiguous buffer-protocol object of
/// unsigned bytes: `dmaload.save` casts any other to one) to `path` with
/// the GIL released, as `dmaload save` does: a regular file is replaced
/// atomically (temporary file, fsync unless `sync` is false, rename), a
/// device or FIFO written in place. `sync` None is the core's default
/// (true). Returns the `dmaload.SaveReport`.
#[pyfunction]
#[pyo3(signature = (data, path, *, sync=None, options=None, progress=None))]
pub fn save<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    path: PathBuf,
    sync: Option<bool>,
    options: Option<Bound<'py, PyDict>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(move || {
        let mut options = Opts::from_dict_for("save", options.as_ref())?.to_save_options(sync)?;
        // Held until the save returns: the memory cannot go away meanwhile.
        let export = PyBuffer::<u8>::get(data)?;
        if !export.is_c_contiguous() {
            return Err(PyBufferError::new_err("dmaload.save needs a C-contiguous buffer (copy it first)"));
        }
        // Ctrl-C, or an exception in the callback, cancels the save (as a
        // load's): it ends as a failed save does, and the exception is raised.
        let cancel = dmaload::CancelToken::new();
        options.cancel = cancel.clone();
        let relay = progress.map(|callback| {
            let relay = Progress::new(callback, export.len_bytes() as u64, cancel.clone());
            options.progress = Some(relay.for_load());
            relay
        });
        // The save owns the export: a write that Ctrl-C cannot stop (a
        // silent FUSE or NFS server) keeps the memory mapped until it ends,
        // and the cancelled save then leaves no file (see run_abandonable).
        let result = run_abandonable(py, &cancel, move || {
            let export = export;
            dmaload::save_raw(exported_bytes(&export), &path, &options)
        })?;
        Progress::raised(relay.as_ref())?;
        let report = result.map_err(|e| os_error(&e))?;
        Progress::finish(relay.as_ref())?;
        save_report_object(py, &report)
    })
}

/// The core's report as a `dmaload._report.SaveReport`, through its JSON
/// as a load's report crosses (`report_object`), with `path` and `target`
/// in their exact `os.fsdecode` forms.
fn save_report_object<'py>(py: Python<'py>, report: &SaveReport) -> PyResult<Bound<'py, PyAny>> {
    let json = report_json(report)?;
    let class = py.import("dmaload._report")?.getattr("SaveReport")?;
    class.call_method1("from_json", (json, report.path.as_os_str(), report.target.as_os_str()))
}

/// Every save option the binding takes, with the core's default: the
/// fields of [`SaveOptions`] (all named, so a field the core adds is a
/// compile error here until it crosses) less the callback, which Python
/// passes as `progress`, and the token, which Ctrl-C cancels.
#[pyfunction]
pub fn _save_option_defaults() -> PyResult<BTreeMap<&'static str, DefaultValue>> {
    guard(|| {
        let SaveOptions { engine, mode, sync, chunk_size, queue_depth, threads, progress: _, cancel: _ } =
            SaveOptions::default();
        Ok(BTreeMap::from([
            ("engine", DefaultValue::Name(engine.name().to_owned())),
            ("mode", DefaultValue::Name(mode.name().to_owned())),
            ("sync", DefaultValue::Flag(sync)),
            ("chunk_size", DefaultValue::Number(chunk_size)),
            ("queue_depth", DefaultValue::Number(queue_depth)),
            ("threads", DefaultValue::Number(threads)),
        ]))
    })
}
