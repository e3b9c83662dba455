//! `dmaload.BlockQueue`: the core's `share::BlockQueue` for Python. Blocks
//! cross into Python as copies (`bytes` out, any bytes-like object in): the
//! peer process may write a block at any time if it breaks the protocol,
//! so no view of the shared ring is handed out. Waits release the GIL.

use std::borrow::Cow;
use std::io;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use dmaload::share::{self, BlockQueueOptions, Connection, QueueMemory, Role};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{detached, guard};
use crate::run::{wait_in_slices, SIGNAL_POLL};

/// An OSError whose errno picks the Python subclass: TimeoutError,
/// BrokenPipeError, ...; bad arguments are ValueError.
fn queue_error(err: io::Error) -> PyErr {
    let errno = match err.kind() {
        io::ErrorKind::InvalidInput => return PyValueError::new_err(err.to_string()),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => libc::ETIMEDOUT,
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::InvalidData => libc::EPROTO,
        _ => err.raw_os_error().unwrap_or(libc::EIO),
    };
    PyOSError::new_err((errno, err.to_string()))
}

/// A timeout in seconds as a duration (a negative or non-finite one is a
/// ValueError).
pub(crate) fn seconds(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout
        .map(|t| {
            Duration::try_from_secs_f64(t).map_err(|e| PyValueError::new_err(format!("timeout {t}: {e}")))
        })
        .transpose()
}

/// The socket as a connection of its own (a duplicate of its descriptor).
fn connection(sock: &Bound<'_, PyAny>) -> PyResult<Connection> {
    let fd: i32 = match sock.extract::<i32>() {
        Ok(fd) => fd,
        Err(_) => sock.call_method0("fileno")?.extract()?,
    };
    Connection::duplicate(fd).map_err(queue_error)
}

/// The bytes of a bytes-like object: `bytes` as they are, anything else
/// with the buffer protocol (bytearray, memoryview, a uint8 array) copied
/// now, with the GIL held, so no other thread changes them mid-put.
fn block_data<'a>(py: Python<'_>, data: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, [u8]>> {
    if let Ok(bytes) = data.cast::<PyBytes>() {
        return Ok(Cow::Borrowed(bytes.as_bytes()));
    }
    Ok(Cow::Owned(PyBuffer::<u8>::get(data)?.to_vec(py)?))
}

/// One end of a block queue shared with another process.
#[pyclass(module = "dmaload._dmaload", name = "BlockQueue")]
pub struct BlockQueue {
    /// `None` once closed. Held across waits (`put`, `get`), so it is
    /// only ever locked with the GIL released: a thread waiting for it
    /// with the GIL would stop every other thread of the interpreter,
    /// the one that would let the wait end included.
    inner: Mutex<Option<share::BlockQueue>>,
}

impl BlockQueue {
    fn wrap(queue: share::BlockQueue) -> BlockQueue {
        BlockQueue { inner: Mutex::new(Some(queue)) }
    }

    /// Runs `f` on the queue with the GIL released (see `inner`).
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut share::BlockQueue) -> io::Result<T> + Send,
    ) -> PyResult<T> {
        detached(py, || {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let queue =
                inner.as_mut().ok_or_else(|| PyValueError::new_err("operation on a closed BlockQueue"))?;
            f(queue).map_err(queue_error)
        })?
    }

    /// Runs `wait`, a queue wait that takes a timeout, in slices of at most
    /// [`SIGNAL_POLL`] up to `timeout` (None: for ever), with the GIL
    /// released, checking for signals between slices: Ctrl-C raises
    /// `KeyboardInterrupt` within a slice, and, as a slice that times out
    /// has taken no block, leaves the queue as it was.
    fn interruptible<T: Send>(
        &self,
        py: Python<'_>,
        timeout: Option<Duration>,
        mut wait: impl FnMut(&mut share::BlockQueue, Option<Duration>) -> io::Result<T> + Send,
    ) -> PyResult<T> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let slice = left.map_or(SIGNAL_POLL, |left| left.min(SIGNAL_POLL));
            let last = left.is_some_and(|left| left <= SIGNAL_POLL);
            let wait = &mut wait;
            match self.with(py, move |q| match wait(q, Some(slice)) {
                Err(err) if err.kind() == io::ErrorKind::TimedOut && !last => Ok(None),
                other => other.map(Some),
            })? {
                Some(done) => return Ok(done),
                None => py.check_signals()?,
            }
        }
    }
}

/// Waits for the peer's message on `conn` in [`SIGNAL_POLL`] slices with
/// the GIL released, checking for signals between them (Ctrl-C raises and
/// drops what the caller made), up to `timeout` (None: for ever). Returns
/// the time left for the receive that follows: the message is there then,
/// or the wait ran out and the receive reports the timeout as before.
fn wait_for_peer(py: Python<'_>, conn: &Connection, timeout: Option<Duration>) -> PyResult<Option<Duration>> {
    let deadline = timeout.map(|t| Instant::now() + t);
    wait_in_slices(py, timeout, |slice| conn.wait_readable(slice))?.map_err(queue_error)?;
    Ok(deadline.map(|d| d.saturating_duration_since(Instant::now())))
}

#[pymethods]
impl BlockQueue {
    /// Creates a queue of `blocks` blocks of `block_size` bytes, sends it
    /// over `sock` (a connected AF_UNIX SOCK_SEQPACKET socket, or its fd)
    /// and waits for the peer to attach.
    #[staticmethod]
    #[pyo3(signature = (sock, role, block_size = 1048576, blocks = 32, memory = "memfd", timeout = None))]
    fn create(
        py: Python<'_>,
        sock: &Bound<'_, PyAny>,
        role: &str,
        block_size: usize,
        blocks: usize,
        memory: &str,
        timeout: Option<f64>,
    ) -> PyResult<BlockQueue> {
        guard(|| {
            let role = match role {
                "producer" => Role::Producer,
                "consumer" => Role::Consumer,
                other => return Err(PyValueError::new_err(format!("role {other:?}: producer or consumer"))),
            };
            let memory: QueueMemory = memory.parse().map_err(PyValueError::new_err)?;
            let options = BlockQueueOptions { block_size, blocks, memory };
            let conn = connection(sock)?;
            let timeout = seconds(timeout)?;
            let offered =
                detached(py, || share::BlockQueue::offer(conn, role, &options))?.map_err(queue_error)?;
            let left = wait_for_peer(py, offered.connection(), timeout)?;
            let queue = detached(py, || offered.accept(left))?;
            queue.map(BlockQueue::wrap).map_err(queue_error)
        })
    }

    /// Attaches to the queue the process at the other end of `sock`
    /// created, taking the role it left.
    #[staticmethod]
    #[pyo3(signature = (sock, timeout = None))]
    fn attach(py: Python<'_>, sock: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<BlockQueue> {
        guard(|| {
            let conn = connection(sock)?;
            let timeout = seconds(timeout)?;
            let left = wait_for_peer(py, &conn, timeout)?;
            let queue = detached(py, || share::BlockQueue::attach(conn, left))?;
            queue.map(BlockQueue::wrap).map_err(queue_error)
        })
    }

    /// Producer: copies `data` into the next free block (waiting up to
    /// `timeout` seconds for one) and enqueues it with `tag`; returns the
    /// block's sequence number.
    #[pyo3(signature = (data, tag = 0, timeout = None))]
    fn put(&self, py: Python<'_>, data: &Bound<'_, PyAny>, tag: u64, timeout: Option<f64>) -> PyResult<u64> {
        let timeout = seconds(timeout)?;
        let data = &*block_data(py, data)?;
        self.interruptible(py, timeout, |q, slice| {
            // Refused before the wait: no free block would ever take it.
            if data.len() > q.block_size() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} bytes of data for a block of {} bytes", data.len(), q.block_size()),
                ));
            }
            let mut block = q.dequeue_free(slice)?;
            let sequence = block.sequence();
            block.write_at(0, data)?;
            block.enqueue(data.len(), tag)?;
            Ok(sequence)
        })
    }

    /// Producer: like `put` if a block is free now; False (nothing sent)
    /// when every block is in use.
    #[pyo3(signature = (data, tag = 0))]
    fn try_put(&self, py: Python<'_>, data: &Bound<'_, PyAny>, tag: u64) -> PyResult<bool> {
        let data = &*block_data(py, data)?;
        self.with(py, |q| match q.try_dequeue_free()? {
            Some(mut block) => {
                block.write_at(0, data)?;
                block.enqueue(data.len(), tag).map(|()| true)
            }
            None => Ok(false),
        })
    }

    /// Consumer: the next block as `(tag, bytes)` (a copy; the block goes
    /// back to the producer at once), waiting up to `timeout` seconds;
    /// None at the end of the stream.
    #[pyo3(signature = (timeout = None))]
    fn get(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<(u64, Py<PyBytes>)>> {
        let timeout = seconds(timeout)?;
        let block = self.interruptible(py, timeout, |q, slice| {
            let Some(run) = q.dequeue_filled(1, slice)? else { return Ok(None) };
            let (len, tag) = run.block(0);
            let mut bytes = vec![0u8; len];
            run.read_at(0, 0, &mut bytes)?;
            run.release()?;
            Ok(Some((tag, bytes)))
        })?;
        Ok(block.map(|(tag, bytes)| (tag, PyBytes::new(py, &bytes).unbind())))
    }

    /// Producer: marks the end of the stream.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |q| q.finish())
    }

    /// Producer, after `finish`: waits until the consumer took every block.
    #[pyo3(signature = (timeout = None))]
    fn wait_drained(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = seconds(timeout)?;
        self.interruptible(py, timeout, |q, slice| q.wait_drained(slice))
    }

    /// The descriptor this end waits on, for select/poll/asyncio: call
    /// `prepare_wait()` first and wait only when it returns True.
    fn wait_fd(&self, py: Python<'_>) -> PyResult<i32> {
        self.with(py, |q| Ok(std::os::fd::AsRawFd::as_raw_fd(&q.wait_fd())))
    }

    /// Asks the peer to signal `wait_fd()`; False when there is already
    /// something to do (then do not wait).
    fn prepare_wait(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |q| q.prepare_wait())
    }

    /// Leaves the queue: the peer's waits end with BrokenPipeError (a
    /// producer's after `finish` end normally).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        detached(py, || {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(mut queue) = inner.take() {
                if queue.role() == Role::Consumer {
                    let _ = queue.close();
                }
            }
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    #[getter]
    fn role(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, |q| {
            Ok(match q.role() {
                Role::Producer => "producer",
                Role::Consumer => "consumer",
            })
        })
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |q| Ok(q.block_size()))
    }

    #[getter]
    fn blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |q| Ok(q.blocks()))
    }

    #[getter]
    fn memory(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, |q| Ok(q.memory().name()))
    }

    /// Blocks this end has enqueued (producer) or taken (consumer).
    #[getter]
    fn count(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |q| Ok(q.count()))
    }
}
