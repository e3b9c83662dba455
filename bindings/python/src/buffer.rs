//! `dmaload.Buffer`: a loaded buffer as a Python object (the buffer
//! protocol, DLPack, its memfd), kept mapped while any view can reach it.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, IntoRawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dmaload::{LoadOptions, LoadReport};
use pyo3::exceptions::{PyBufferError, PyOSError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::cache::*;
use crate::errors::*;
use crate::report::*;
use crate::run::*;

/// A socket object's timeout (`settimeout`); `None` for a descriptor
/// number or a socket without one.
fn socket_timeout(socket: &Bound<'_, PyAny>) -> PyResult<Option<Duration>> {
    let Ok(gettimeout) = socket.getattr("gettimeout") else { return Ok(None) };
    crate::block_queue::seconds(gettimeout.call0()?.extract::<Option<f64>>()?)
}

/// Waits until `ready(slice)` says so, as [`wait_in_slices`] does, up to
/// `timeout` (`None`: for ever; then `TimeoutError` saying `what`).
fn wait_on_socket(
    py: Python<'_>,
    timeout: Option<Duration>,
    what: &str,
    ready: impl Fn(Duration) -> std::io::Result<bool> + Sync,
) -> PyResult<()> {
    let readied = wait_in_slices(py, timeout, ready)?;
    if readied.map_err(|e| PyOSError::new_err((e.raw_os_error().unwrap_or(libc::EIO), e.to_string())))? {
        return Ok(());
    }
    let waited = timeout.unwrap_or_default().as_secs_f64();
    Err(PyOSError::new_err((libc::ETIMEDOUT, format!("{what} within {waited} s"))))
}

/// Bytes loaded from a file, in memfd (or anonymous) memory.
///
/// The bytes are exported through the buffer protocol without copying.
/// While any export (memoryview, numpy array, tensor) exists the buffer
/// cannot be closed; once closed it exports nothing. The memory itself is
/// unmapped only when the object is deallocated: a consumer such as
/// `torch.frombuffer` releases its export at once and keeps only a
/// reference to the object, so `close()` cannot know that nothing reaches
/// the bytes any more, but the last reference going away can.
///
/// A process forked after the load (`os.fork()`, multiprocessing's
/// `fork` start method, DataLoader workers) gets its own copy of the bytes,
/// as of any other object: just before the fork the buffer's mapping is made
/// private copy-on-write, so neither process's later in-place writes reach
/// the other, and views made before the fork keep working in both. (Where
/// that cannot be done, hugetlb memory whose pool lacks the pages a private
/// mapping reserves or a kernel before 5.16, the fork goes on with the memory
/// shared and a line on stderr says so.) The memfd (`fileno()`,
/// `dup_memfd()`, `send()`) is handed out only while it holds the bytes
/// the buffer shows: once the buffer's memory is private (received, its
/// memfd handed out before, or a fork since the load) and written in place,
/// these raise OSError rather than give others bytes the buffer does not
/// show; copy the bytes into a new buffer to share them.
#[pyclass(module = "dmaload._dmaload", name = "Buffer", weakref)]
pub struct Buffer {
    /// Owns the mapping and the memfd until the object is deallocated.
    inner: dmaload::Buffer,
    /// Set by `close()`: no new exports, no fd, length 0. Atomic so that
    /// no method needs `&mut self`: a mutable borrow would make a method
    /// called from another thread while this one waits for the GIL (in an
    /// import, say) fail with "Already borrowed".
    closed: AtomicBool,
    /// Address and length of the bytes, taken once when the buffer was
    /// created: Rust never forms a reference to the bytes afterwards, since
    /// Python may write through exports at any time.
    addr: usize,
    len: usize,
    exports: AtomicUsize,
    path: PathBuf,
    /// The core's report, turned into a `dmaload.LoadReport` field by
    /// field on first use (see [`report_object`]).
    report_data: LoadReport,
    report: OnceLock<Py<PyAny>>,
}

impl Buffer {
    pub(crate) fn new(mut buffer: dmaload::Buffer, report: LoadReport) -> Buffer {
        let bytes: &mut [u8] = &mut buffer;
        let (addr, len) = (bytes.as_mut_ptr() as usize, bytes.len());
        Buffer {
            inner: buffer,
            closed: AtomicBool::new(false),
            addr,
            len,
            exports: AtomicUsize::new(0),
            path: report.path.clone(),
            report_data: report,
            report: OnceLock::new(),
        }
    }

    fn open(&self) -> PyResult<&dmaload::Buffer> {
        if self.is_closed() {
            return Err(PyValueError::new_err("operation on a closed Buffer"));
        }
        Ok(&self.inner)
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

#[pymethods]
impl Buffer {
    fn __len__(&self) -> PyResult<usize> {
        guard(|| Ok(if self.is_closed() { 0 } else { self.len }))
    }

    /// Exports the bytes: one-dimensional, unsigned bytes (`"B"`), C
    /// contiguous, writable.
    #[allow(unsafe_code)]
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("NULL Py_buffer"));
        }
        let (addr, len) = guard(|| {
            let this = slf.try_borrow()?;
            if this.is_closed() {
                return Err(PyValueError::new_err("operation on a closed Buffer"));
            }
            this.exports.fetch_add(1, Ordering::AcqRel);
            Ok((this.addr, this.len))
        })?;
        // SAFETY: `view` is non-null and CPython hands us a Py_buffer to
        // fill. `addr..addr + len` is the buffer's mapping, which stays
        // mapped until the object is deallocated (`close()` never unmaps),
        // and deallocation cannot happen while `view.obj` holds the strong
        // reference stored here, nor while any consumer keeps one. The mapping is
        // PROT_READ|PROT_WRITE, so handing out a writable buffer is sound;
        // Rust itself never reads or writes the bytes after `Buffer::new`.
        // `format`, `shape` and `strides` point at a static string and at
        // fields of `*view` itself, as CPython's own bytes-like objects do.
        unsafe { export_bytes(view, slf.into_any(), addr, len, flags) };
        Ok(())
    }

    #[allow(unsafe_code)]
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        // Nothing was allocated for the view; only the count changes.
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }

    /// Closes the buffer: no new exports, no fd, length 0. Raises
    /// BufferError while exports (memoryviews, arrays) exist, as
    /// `mmap.close()` does. The memory is unmapped when the last reference
    /// to the buffer goes away (at once after `del buf` when nothing else
    /// holds it), never while a view made without an export
    /// (`torch.frombuffer`) can still reach it.
    fn close(&self) -> PyResult<()> {
        guard(|| {
            let exports = self.exports.load(Ordering::Acquire);
            if exports > 0 {
                return Err(PyBufferError::new_err(format!(
                    "cannot close a Buffer with {exports} live export(s) (memoryviews, arrays or tensors)"
                )));
            }
            self.closed.store(true, Ordering::Release);
            Ok(())
        })
    }

    #[getter]
    fn closed(&self) -> bool {
        self.is_closed()
    }

    /// Number of live exports of the bytes.
    #[getter]
    fn exports(&self) -> usize {
        self.exports.load(Ordering::Acquire)
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close()?;
        Ok(false)
    }

    /// The memfd holding the bytes (owned by the buffer: valid until close),
    /// sealed against writes first; OSError where it cannot be sealed.
    fn fileno(&self) -> PyResult<i32> {
        guard(|| {
            let buffer = self.open()?;
            buffer.memfd().map_err(|e| os_error(&e))?.map(|fd| fd.as_raw_fd()).ok_or_else(|| no_memfd(buffer))
        })
    }

    /// A new file descriptor for the memfd, owned by the caller (it keeps
    /// the bytes after the buffer is closed; pass it to another process or
    /// to udmabuf).
    fn dup_memfd(&self) -> PyResult<i32> {
        guard(|| {
            let buffer = self.open()?;
            let fd = buffer.memfd().map_err(|e| os_error(&e))?.ok_or_else(|| no_memfd(buffer))?;
            let owned = fd.try_clone_to_owned().map_err(|e| {
                PyOSError::new_err((e.raw_os_error().unwrap_or(0), format!("dup memfd: {e}")))
            })?;
            Ok(owned.into_raw_fd())
        })
    }

    /// Sends the buffer to the process at the other end of `socket` (a
    /// connected `AF_UNIX`, `SOCK_SEQPACKET` socket, or its fd), which
    /// takes it with `Buffer.receive`: the memfd, sealed first, crosses
    /// with where the bytes are in it; no byte is copied. From now on this
    /// buffer's own writes stay private to this process, as the
    /// receiver's do.
    fn send(&self, py: Python<'_>, socket: &Bound<'_, PyAny>) -> PyResult<()> {
        let conn = connection(socket)?;
        let timeout = socket_timeout(socket)?;
        guard(|| {
            let buffer = self.open()?;
            // A receiver that never reads fills the socket: wait for room
            // in slices that answer Ctrl-C, up to the socket's timeout.
            wait_on_socket(py, timeout, "send: the receiver took nothing", |slice| {
                conn.wait_writable(slice)
            })?;
            detached(py, || buffer.send(&conn))?.map_err(|e| os_error(&e))
        })
    }

    /// Receives a buffer another process sent with `Buffer.send` over
    /// `socket`: the memfd's seals and size are checked, then it is mapped
    /// private copy-on-write (writes stay in this process). Waits until a
    /// message arrives, or a socket object's timeout (`settimeout`) passes
    /// (`TimeoutError`); Ctrl-C ends the wait.
    #[staticmethod]
    fn receive(py: Python<'_>, socket: &Bound<'_, PyAny>) -> PyResult<Buffer> {
        let conn = connection(socket)?;
        let timeout = socket_timeout(socket)?;
        guard(|| {
            let started = Instant::now();
            // A sender that never sends must not hold this thread past
            // Ctrl-C: wait in slices that answer it.
            wait_on_socket(py, timeout, "receive: no buffer arrived", |slice| conn.wait_readable(slice))?;
            let buffer = detached(py, || dmaload::Buffer::receive(&conn))?.map_err(|e| os_error(&e))?;
            let report = dmaload_share::handoff_report(
                std::path::Path::new("socket"),
                buffer.len() as u64,
                started.elapsed().as_secs_f64(),
                "received".into(),
                &LoadOptions::default(),
            );
            Ok(Buffer::new(buffer, report))
        })
    }

    /// Offset of the first byte in the memfd (non-zero for a range whose
    /// start direct I/O had to align down).
    #[getter]
    fn memfd_offset(&self) -> PyResult<usize> {
        guard(|| Ok(self.open()?.memfd_offset()))
    }

    /// The memory kind: "memfd", "memfd-huge", "hugetlb", "anonymous-thp" or
    /// "anonymous".
    #[getter]
    fn memory(&self) -> PyResult<&'static str> {
        guard(|| Ok(self.open()?.memory_kind().name()))
    }

    /// The pieces the buffer was filled in, as (offset, length) pairs.
    #[getter]
    fn segments(&self) -> PyResult<Vec<(usize, usize)>> {
        guard(|| Ok(self.open()?.segments().iter().map(|s| (s.offset, s.len)).collect()))
    }

    /// The file the bytes came from.
    #[getter]
    fn path(&self) -> std::ffi::OsString {
        self.path.clone().into_os_string()
    }

    /// The load's report as the core's JSON (what `dmaload load --json`
    /// prints); `report` is the same as a typed record.
    #[getter]
    fn report_json(&self) -> PyResult<String> {
        guard(|| report_json(&self.report_data))
    }

    /// The load's report, a `dmaload.LoadReport` dataclass built field by
    /// field from the core's report (no JSON in between).
    #[getter]
    fn report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        guard(|| {
            if let Some(report) = self.report.get() {
                return Ok(report.clone_ref(py));
            }
            let report = report_object(py, &self.report_data)?.unbind();
            // Another thread may have won the race while the import ran: keep its object.
            Ok(self.report.get_or_init(|| report).clone_ref(py))
        })
    }

    /// DLPack export (a 1-D uint8 CPU tensor over the bytes, no copy).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<Bound<'py, PyAny>>,
        copy: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        guard(|| {
            py.import("dmaload._buffer")?.getattr("dlpack")?.call1((
                slf,
                stream,
                max_version,
                dl_device,
                copy,
            ))
        })
    }

    /// `(kDLCPU, 0)`: the bytes are host memory.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (1, 0)
    }

    /// Refuses: the bytes live in this process's memory. Share them with
    /// `dup_memfd()` (fd passing), or pickle `bytes(buf)`.
    fn __reduce__(&self) -> PyResult<()> {
        Err(PyTypeError::new_err(
            "cannot pickle or copy a dmaload.Buffer: its bytes live in this process's memory; \
             pass buf.dup_memfd() to another process, or pickle bytes(buf)",
        ))
    }

    fn __repr__(&self) -> PyResult<String> {
        guard(|| {
            Ok(match (!self.is_closed()).then_some(&self.inner) {
                Some(b) => format!(
                    "<dmaload.Buffer {} bytes of {} from {:?}, {} export(s)>",
                    self.len,
                    b.memory_kind().name(),
                    self.path,
                    self.exports.load(Ordering::Acquire)
                ),
                None => format!("<dmaload.Buffer closed, from {:?}>", self.path),
            })
        })
    }
}

/// Fills `view` for a one-dimensional export of `len` unsigned bytes
/// (`"B"`, C contiguous, writable) at `addr`, owned by `obj`, whose strong
/// reference the view takes.
///
/// # Safety
/// `view` is the non-null `Py_buffer` CPython hands `__getbuffer__` to
/// fill, and `addr..addr + len` stays mapped readable and writable for as
/// long as `obj` is alive. `format`, `shape` and `strides` are pointed at a
/// static string and at fields of `*view` itself, as CPython's own
/// bytes-like objects do.
#[allow(unsafe_code)]
pub(crate) unsafe fn export_bytes(
    view: *mut ffi::Py_buffer,
    obj: Bound<'_, PyAny>,
    addr: usize,
    len: usize,
    flags: c_int,
) {
    // SAFETY: the caller's contract above.
    unsafe {
        (*view).obj = obj.into_ptr();
        (*view).buf = addr as *mut c_void;
        (*view).len = len as isize;
        (*view).readonly = 0;
        (*view).itemsize = 1;
        (*view).format =
            if flags & ffi::PyBUF_FORMAT != 0 { c"B".as_ptr().cast_mut() } else { std::ptr::null_mut() };
        (*view).ndim = 1;
        (*view).shape = if flags & ffi::PyBUF_ND != 0 { &raw mut (*view).len } else { std::ptr::null_mut() };
        (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
            &raw mut (*view).itemsize
        } else {
            std::ptr::null_mut()
        };
        (*view).suboffsets = std::ptr::null_mut();
        (*view).internal = std::ptr::null_mut();
    }
}
