//! The cache service from Python: loads through it, evictions, the
//! default socket.

use std::path::PathBuf;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use dmaload_share::CacheRequest;

use crate::buffer::Buffer;
use crate::errors::*;
use crate::load::Source;
use crate::options::*;
use crate::run::*;

/// A connection over a duplicate of `socket`'s descriptor (a socket
/// object's `fileno()`, or an int).
pub(crate) fn connection(socket: &Bound<'_, PyAny>) -> PyResult<dmaload::share::Connection> {
    let fd: i32 = match socket.extract::<i32>() {
        Ok(fd) => fd,
        Err(_) => socket.call_method0("fileno")?.extract()?,
    };
    dmaload_share::connection_from_raw_fd(fd)
        .map_err(|e| PyOSError::new_err((e.raw_os_error().unwrap_or(libc::EINVAL), format!("socket: {e}"))))
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
pub(crate) fn load_cached(
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
        let source = detached(py, || Source::open(&file, &cancel))?.map_err(|e| os_error(&e))?;
        // Without a fallback, only what the service serves (the caller
        // loads otherwise, its own way).
        let load = move || {
            let request = match &source {
                Source::File(file) => CacheRequest::open(file, &socket),
                Source::Object(object) => CacheRequest::object(object, &socket),
            }
            .options(&options);
            if fallback {
                return request
                    .to_buffer()
                    .map(|(buffer, report, outcome)| served_buffer(buffer, report, outcome));
            }
            Ok(match request.from_service()? {
                Ok((buffer, report, served, note)) => {
                    (Some(Buffer::new(buffer, report)), Some(served.name()), note)
                }
                Err(reason) => (None, None, Some(reason)),
            })
        };
        run_abandonable(py, &cancel, load)?.map_err(|e| os_error(&e))
    })
}

/// What Python gets for a buffer [`CacheRequest::to_buffer`] returned: the
/// buffer, how the service served it (None: loaded directly), and what to
/// tell the user.
fn served_buffer(
    buffer: dmaload::Buffer,
    report: dmaload::LoadReport,
    outcome: dmaload_share::CacheOutcome,
) -> (Option<Buffer>, Option<&'static str>, Option<String>) {
    let (served, message) = match outcome {
        dmaload_share::CacheOutcome::Service { served, note } => (Some(served.name()), note),
        dmaload_share::CacheOutcome::Direct { reason } => (None, Some(reason)),
    };
    (Some(Buffer::new(buffer, report)), served, message)
}

/// Drops the file at `path` from the page cache (fdatasync, then
/// `POSIX_FADV_DONTNEED`; no root needed), so that its next read comes from
/// the device: the core's `pagecache::evict`, the one the CLI uses. A
/// FIFO, socket or character device is refused unopened: it has no page
/// cache.
#[pyfunction]
pub(crate) fn evict(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    detached(py, || dmaload::pagecache::evict(&path))?.map_err(|e| os_error(&e))
}

/// The cache service's default socket: `$XDG_RUNTIME_DIR/dmaload.sock`,
/// else `/run/user/UID/dmaload.sock`.
#[pyfunction]
pub(crate) fn default_cache_socket() -> PathBuf {
    dmaload_share::default_socket()
}
