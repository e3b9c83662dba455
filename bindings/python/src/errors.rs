//! Errors as Python sees them: core errors as OSError, malformed
//! safetensors as SafetensorError, panics as RuntimeError (never across
//! the FFI boundary).

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

use dmaload::format::safetensors as st;
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    _dmaload,
    SafetensorError,
    PyValueError,
    "A malformed safetensors file: the message says what is wrong and at which byte."
);

/// A panic's payload as the RuntimeError users see. PyO3 would raise
/// `PanicException`, which derives from BaseException: `except Exception`
/// does not catch it.
pub(crate) fn panic_error(payload: Box<dyn Any + Send>) -> PyErr {
    let what = panic_message(payload.as_ref());
    PyRuntimeError::new_err(format!("internal error in dmaload (a bug: please report it): {what}"))
}

/// What a panic's payload says.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs `f` (with the GIL held) so that a panic in it is a RuntimeError.
/// Every entry point of this module goes through this, [`detached`] or
/// [`run_cancellable`].
pub(crate) fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(panic_error(payload)))
}

/// Runs `f` with the GIL released; a panic in it is a RuntimeError.
pub(crate) fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    py.detach(|| catch_unwind(AssertUnwindSafe(f))).map_err(panic_error)
}

pub(crate) fn no_memfd(buffer: &dmaload::Buffer) -> PyErr {
    PyValueError::new_err(format!(
        "this buffer is {} memory, which has no memfd",
        buffer.memory_kind().name()
    ))
}

/// A core error as OSError(errno, message, filename); the message names the
/// operation and, where known, the file offset.
pub(crate) fn os_error(err: &dmaload::Error) -> PyErr {
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

pub(crate) fn format_error(err: &st::Error) -> PyErr {
    match err {
        st::Error::Io(e) => os_error(e),
        st::Error::Header { .. } | st::Error::Model(_) => SafetensorError::new_err(err.to_string()),
    }
}
