//! `dmaload._dmaload.LeasedFile`: a warm file mapped under its read lease
//! (the core's `dmaload::lease::LeasedMapping`), exported through the
//! buffer protocol for tensors over the page cache.

use std::ffi::c_int;
use std::path::PathBuf;

use dmaload::lease::LeasedMapping;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::buffer::export_bytes;
use crate::errors::{detached, guard, os_error};

/// A whole file mapped privately under its read lease, if it is wholly in
/// the page cache: `LeasedFile(path)` raises OSError where it is not
/// mapped (not resident, open for writing elsewhere, not leasable here);
/// read the file instead. A writer of the file (open for writing,
/// truncate) waits until the mapping is detached from the file (its bytes
/// copied into private memory at the same address), so views keep the
/// bytes they had and never fault. The mapping and the lease go when the
/// last reference goes: views (`torch.frombuffer`, memoryview) keep one.
#[pyclass(module = "dmaload._dmaload", name = "LeasedFile", frozen)]
pub struct LeasedFile {
    inner: LeasedMapping,
}

#[pymethods]
impl LeasedFile {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<LeasedFile> {
        let opened = detached(py, || LeasedMapping::open(&path))?;
        opened.map(|inner| LeasedFile { inner }).map_err(|e| os_error(&e))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Whether a writer broke the lease: the views now read a private copy
    /// of the file as it was mapped.
    #[getter]
    fn broken(&self) -> bool {
        self.inner.is_broken()
    }

    #[getter]
    fn path(&self) -> std::ffi::OsString {
        self.inner.path().as_os_str().to_owned()
    }

    /// Exports the bytes: one-dimensional, unsigned bytes (`"B"`), C
    /// contiguous, writable (a private mapping: writes never reach the file).
    #[allow(unsafe_code)]
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("NULL Py_buffer"));
        }
        let (addr, len) = guard(|| Ok((slf.get().inner.address(), slf.get().inner.len())))?;
        // SAFETY: `view` is non-null and CPython hands us a Py_buffer to
        // fill. `addr..addr + len` is the mapping, readable and writable
        // until the object is deallocated, which cannot happen while
        // `view.obj` holds the strong reference stored here, nor while any
        // consumer keeps one; a lease break swaps the pages under it for a
        // copy at the same address, never unmaps it. `format`, `shape` and
        // `strides` point at a static string and at fields of `*view`.
        unsafe { export_bytes(view, slf.into_any(), addr, len, flags) };
        Ok(())
    }

    #[allow(unsafe_code)]
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        // Nothing was allocated for the view.
    }
}
