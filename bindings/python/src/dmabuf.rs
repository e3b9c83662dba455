//! `load_dmabuf`: a file's bytes in a new dma-buf (udmabuf, a dma-heap, or
//! whichever `dmabuf` picks), handed to Python as an object owning its fd.

use std::os::fd::{AsRawFd, IntoRawFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dmaload::{Destination, LoadedDmaBuf, OptionValue};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::types::PyDict;

use crate::errors::{detached, guard, os_error};
use crate::load::Source;
use crate::options::{FileArg, Opts};
use crate::report::report_object;
use crate::run::run_abandonable;

/// A dma-buf holding a range of a file: an fd that devices import
/// (`fileno()`), owned by this object until `close()` or `detach()`. Its
/// bytes are not exported to Python without copying: devices and other
/// processes may write a dma-buf at any time; `tobytes()` copies them out
/// through a fresh mapping.
#[pyclass(module = "dmaload._dmaload", name = "DmaBuf", frozen)]
pub struct DmaBuf {
    /// `None` once closed or detached. Locked only for a moment, never
    /// across a release of the GIL (a thread waiting for the lock with the
    /// GIL would deadlock with one waiting for the GIL with the lock): a
    /// `tobytes()` reads through its own `Arc`, which keeps the fd open
    /// until it is done, even past `close()`.
    inner: Mutex<Option<Arc<LoadedDmaBuf>>>,
    size: u64,
    data_offset: u64,
    len: u64,
    report: Py<PyAny>,
}

impl DmaBuf {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<LoadedDmaBuf>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn open(&self) -> PyResult<Arc<LoadedDmaBuf>> {
        self.slot().clone().ok_or_else(|| PyValueError::new_err("operation on a closed DmaBuf"))
    }
}

#[pymethods]
impl DmaBuf {
    /// The dma-buf's fd, still owned by this object.
    fn fileno(&self) -> PyResult<i32> {
        guard(|| Ok(self.open()?.dmabuf.fd().as_raw_fd()))
    }

    /// Gives up the fd: the caller owns it (and closes it) from now on (a
    /// duplicate of it while a `tobytes()` still reads through the original).
    fn detach(&self) -> PyResult<i32> {
        guard(|| {
            let taken = self.slot().take();
            let loaded = taken.ok_or_else(|| PyValueError::new_err("operation on a closed DmaBuf"))?;
            let fd = match Arc::try_unwrap(loaded) {
                Ok(loaded) => loaded.dmabuf.into_fd(),
                Err(shared) => shared.dmabuf.fd().try_clone_to_owned()?,
            };
            Ok(fd.into_raw_fd())
        })
    }

    /// Closes the fd (the memory lives on while a device or another
    /// process holds the dma-buf). Closing twice is allowed.
    fn close(&self) -> PyResult<()> {
        guard(|| {
            drop(self.slot().take());
            Ok(())
        })
    }

    #[getter]
    fn closed(&self) -> bool {
        self.slot().is_none()
    }

    /// Bytes of the dma-buf (whole pages).
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }

    /// Where the file's first loaded byte sits in the dma-buf.
    #[getter]
    fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Bytes of the file it holds (from `data_offset`).
    fn __len__(&self) -> usize {
        self.len as usize
    }

    /// The load's `dmaload.LoadReport`; its `destination` says which
    /// producer made the dma-buf (and for `to="dmabuf"`, why).
    #[getter]
    fn report(&self, py: Python<'_>) -> Py<PyAny> {
        self.report.clone_ref(py)
    }

    /// The file's bytes, copied out through a fresh mapping of the dma-buf
    /// inside a `DMA_BUF_IOCTL_SYNC` read bracket (GIL released).
    fn tobytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        guard(|| {
            let loaded = self.open()?;
            let bytes = detached(py, move || {
                let mut bytes = Vec::with_capacity(loaded.len as usize);
                loaded.read_each(|part| bytes.extend_from_slice(part)).map(|()| bytes)
            })??;
            Ok(PyBytes::new(py, &bytes))
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _exc_type: Option<Bound<'_, PyAny>>,
        _exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.close()
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { "closed" } else { "open" };
        format!("<dmaload.DmaBuf {state}, {} bytes at {} of {}>", self.len, self.data_offset, self.size)
    }
}

/// Loads a file or an object (`s3://BUCKET/KEY`), or `length` bytes of it
/// from `offset`, into a new dma-buf
/// (`to`: "udmabuf", "dma-heap:NAME" or "dmabuf"), with the GIL released.
#[pyfunction]
#[pyo3(signature = (path, offset=None, length=None, *, options=None))]
pub fn load_dmabuf(
    py: Python<'_>,
    path: PathBuf,
    offset: Option<u64>,
    length: Option<u64>,
    options: Option<Bound<'_, PyDict>>,
) -> PyResult<DmaBuf> {
    guard(move || {
        let opts = Opts::from_dict(options.as_ref())?
            .or_default("to", OptionValue::Name(Destination::Dmabuf.name()));
        let mut options = opts.to_options()?;
        if !options.to.is_dmabuf() {
            return Err(PyValueError::new_err(format!(
                "to={:?} is not a dma-buf (expected \"udmabuf\", \"dmabuf\" or \"dma-heap:NAME\"); \
                 dmaload.load loads host memory",
                options.to.name()
            )));
        }
        let cancel = dmaload::CancelToken::new();
        options.cancel = cancel.clone();
        let offset = offset.unwrap_or(0);
        // A file opened once, or an object (`s3://`) looked up once.
        let source =
            detached(py, || Source::open(&FileArg::Path(path), &cancel))?.map_err(|e| os_error(&e))?;
        // The load owns the dma-buf it fills: a read that Ctrl-C cannot
        // stop is left behind (see run_abandonable).
        let result = run_abandonable(py, &cancel, move || {
            source.request().range(offset, length).options(&options).to_dmabuf()
        })?;
        let (loaded, report) = result.map_err(|e| os_error(&e))?;
        Ok(DmaBuf {
            size: loaded.dmabuf.len(),
            data_offset: loaded.data_offset,
            len: loaded.len,
            report: report_object(py, &report)?.unbind(),
            inner: Mutex::new(Some(Arc::new(loaded))),
        })
    })
}
