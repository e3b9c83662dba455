//! Safetensors files loaded through a staging ring into memory the caller
//! allocated: a CUDA device (the tensors' one allocation per file, from
//! PyTorch) or, for the tests that run without a GPU, host memory.

use std::path::{Path, PathBuf};

use dmaload::cuda::{Context, DeviceRange};
use dmaload::format::safetensors as st;
use dmaload::object::Object;
use dmaload::sink::{keep_ring, take_ring, CudaSink, HostSink, StagingRing, DEFAULT_SLOT_SIZE};
use dmaload::RawBytesMut;
use dmaload_share::CacheRequest;

use crate::options::FileArg;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{detached, format_error, guard, os_error};
use crate::load::Source;
use crate::options::Opts;
use crate::report::report_object;
use crate::run::{run_abandonable, Progress};
use crate::safetensors::header_object;

/// A safetensors file (or object) opened once, its header read and
/// validated; the data are loaded from this same open file (or the object
/// version the open found) by `_load_staged`.
#[pyclass(module = "dmaload._dmaload", name = "SafetensorsFile", frozen)]
pub struct SafetensorsFile {
    source: Source,
    /// The `dmaload._header.Header`, built once when the file was opened.
    header: Py<PyAny>,
    data_start: u64,
    data_len: u64,
}

#[pymethods]
impl SafetensorsFile {
    /// The `dmaload._header.Header`, as `read_safetensors_header` gives.
    #[getter]
    fn header(&self, py: Python<'_>) -> Py<PyAny> {
        self.header.clone_ref(py)
    }

    /// The path the file was opened at (as ``os.fsdecode`` gives it), or
    /// the object's URL.
    #[getter]
    fn path(&self) -> std::ffi::OsString {
        self.source.path().as_os_str().to_owned()
    }

    /// Offset of the data section in the file (the header's bytes before it).
    #[getter]
    fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Bytes of the data section (what the destination must hold).
    #[getter]
    fn data_len(&self) -> u64 {
        self.data_len
    }
}

/// Opens a safetensors file and validates its header: a path, or a
/// descriptor the caller holds open, such as a cached file's memfd, of
/// which `length` bytes are the file and which messages call `name`. An
/// object URL (`s3://BUCKET/KEY`) is looked up (a HEAD) and its header read
/// with a ranged GET by the core (`read_object_header`).
#[pyfunction]
#[pyo3(signature = (file, length=None, name=None))]
pub fn open_safetensors(
    py: Python<'_>,
    file: FileArg,
    length: Option<u64>,
    name: Option<PathBuf>,
) -> PyResult<SafetensorsFile> {
    if let FileArg::Path(url) = &file {
        if dmaload::object::is_object_url(url) {
            return open_object(py, url.to_string_lossy().into_owned());
        }
    }
    // Opened here, before the caller can close a descriptor it named; the
    // header is read by work that a read no cancellation reaches (a silent
    // FUSE or NFS server) does not hold past Ctrl-C (see run_abandonable).
    let file = detached(py, || file.open())?.map_err(|e| format_error(&e.into()))?;
    let opened = run_abandonable(py, &dmaload::CancelToken::new(), move || -> Result<_, st::Error> {
        let mut file = file;
        if let Some(name) = name {
            file = file.named(name);
        }
        if let Some(len) = length {
            file = file.first_bytes(len)?;
        }
        let (header, _) = st::read_header_of(&file)?;
        Ok((file, header))
    })?;
    let (file, header) = opened.map_err(|e| format_error(&e))?;
    opened_file(py, Source::File(file), header)
}

/// [`open_safetensors`] of an object: looked up and its header read, with
/// Ctrl-C cancelling both.
fn open_object(py: Python<'_>, url: String) -> PyResult<SafetensorsFile> {
    let cancel = dmaload::CancelToken::new();
    let opened = run_abandonable(py, &cancel, {
        let cancel = cancel.clone();
        move || -> Result<_, st::Error> {
            let object = Object::open(&url, &cancel)?;
            let (header, _) = st::read_object_header(&object, &cancel)?;
            Ok((object, header))
        }
    })?;
    let (object, header) = opened.map_err(|e| format_error(&e))?;
    opened_file(py, Source::Object(Box::new(object)), header)
}

fn opened_file(py: Python<'_>, source: Source, header: st::Header) -> PyResult<SafetensorsFile> {
    guard(|| {
        let (data_start, data_len) = (header.data_start(), header.data_len());
        let header = header_object(py, header)?.unbind();
        Ok(SafetensorsFile { source, header, data_start, data_len })
    })
}

/// Where one file's data section goes.
enum Target<'d> {
    Device(DeviceRange<'d>),
    Host(RawBytesMut<'d>),
}

/// Device destinations: each address the start of `lens[i]` bytes of
/// device memory, following `leads[i]` bytes of the same allocation that
/// the destination takes in too, checked as far as the driver can tell.
///
/// # Safety
///
/// Each span must stay allocated, and nothing else may read or write it,
/// until this call's loads return. The Python caller
/// (`dmaload.safetensors._device`) passes the storage of tensors it
/// allocated for this call and holds until it returns.
#[allow(unsafe_code)]
unsafe fn device_targets<'d>(
    ctx: &Context,
    addresses: &[u64],
    leads: &[usize],
    lens: &[usize],
) -> PyResult<Vec<Target<'d>>> {
    addresses
        .iter()
        .zip(leads.iter().zip(lens))
        .map(|(&address, (&lead, &len))| {
            let start = address.checked_sub(lead as u64).ok_or_else(|| {
                PyValueError::new_err(format!("{lead} bytes before device address {address:#x} wrap around"))
            })?;
            let range = match lead + len {
                // SAFETY: an empty range is never written.
                0 => Ok(unsafe { DeviceRange::from_raw(address, 0) }),
                // SAFETY: forwarded from this function's contract; `checked`
                // also refuses spans outside one allocation of the device.
                whole => unsafe { DeviceRange::checked(ctx, start, whole) },
            };
            range.map(Target::Device).map_err(|e| PyOSError::new_err((e.errno(), e.to_string())))
        })
        .collect()
}

/// A writable, C-contiguous buffer-protocol object (`tensor.numpy()`, a
/// bytearray, a numpy array), exported until the returned value drops, so
/// the memory stays valid meanwhile.
pub fn writable_buffer(target: &Bound<'_, PyAny>) -> PyResult<PyBuffer<u8>> {
    let buffer = PyBuffer::<u8>::get(target)?;
    if buffer.readonly() || !buffer.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "the destination must be a writable C-contiguous buffer (readonly={}, contiguous={})",
            buffer.readonly(),
            buffer.is_c_contiguous()
        )));
    }
    Ok(buffer)
}

/// A host destination of a staged load: a [`writable_buffer`] of exactly
/// `len` bytes.
fn host_buffer(target: &Bound<'_, PyAny>, len: usize) -> PyResult<PyBuffer<u8>> {
    let buffer = writable_buffer(target)?;
    if buffer.len_bytes() != len {
        return Err(PyValueError::new_err(format!(
            "a host destination must hold {len} bytes (got {})",
            buffer.len_bytes()
        )));
    }
    Ok(buffer)
}

/// The bytes of a [`writable_buffer`], for the loader to fill with the GIL
/// released: any Python thread may read or write the same object
/// meanwhile, so they are a [`RawBytesMut`] (raw copies and kernel reads
/// only), never a Rust slice.
#[allow(unsafe_code)]
pub fn writable_bytes(buffer: &mut PyBuffer<u8>) -> RawBytesMut<'_> {
    // SAFETY: the export, held by `buffer` and borrowed mutably for the
    // result's lifetime, keeps `len_bytes` bytes at `buf_ptr` mapped and
    // writable (checked in writable_buffer); this crate forms no Rust
    // reference to them. Python code touching them meanwhile forms none
    // either: it can only see or leave unspecified bytes.
    unsafe { RawBytesMut::from_raw_parts(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes()) }
}

/// Refuses host destinations that share bytes: two loads must not write
/// the same memory, whose bytes would then be neither file's.
fn disjoint(buffers: &[PyBuffer<u8>]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize)> =
        buffers.iter().map(|b| (b.buf_ptr() as usize, b.len_bytes())).filter(|&(_, len)| len > 0).collect();
    spans.sort_unstable();
    if spans.windows(2).any(|pair| pair[0].0 + pair[0].1 > pair[1].0) {
        return Err(PyValueError::new_err("host destinations overlap: each file needs memory of its own"));
    }
    Ok(())
}

fn host_target(buffer: &mut PyBuffer<u8>) -> Target<'_> {
    Target::Host(writable_bytes(buffer))
}

/// Loads one file's data into `target` (which takes in `lead` bytes of
/// header before the data): through the cache service at `socket` where
/// given and able, else through the staging ring `ring` makes.
fn load_one<'r>(
    file: &SafetensorsFile,
    target: Target<'_>,
    lead: usize,
    socket: Option<&Path>,
    context: Option<&Context>,
    options: &dmaload::LoadOptions,
    ring: impl FnOnce() -> Result<&'r mut StagingRing, dmaload::Error>,
) -> Result<dmaload::LoadReport, dmaload::Error> {
    let (offset, len) = (file.data_start, Some(file.data_len));
    let mut fallback = None;
    let target = match (target, socket, context, &file.source) {
        (Target::Device(whole), Some(socket), Some(ctx), source) => {
            let request = match source {
                Source::File(open) => CacheRequest::open(open, socket),
                Source::Object(object) => CacheRequest::object(object, socket),
            };
            let served = request.options(options).into_device(ctx, &whole)?;
            match served {
                Ok((report, _served)) => {
                    if let Some(progress) = &options.progress {
                        progress(file.data_len, file.data_len);
                    }
                    return Ok(report);
                }
                Err(why) => fallback = Some(dmaload::Fallback::new("cache-service", "staged", why)),
            }
            Target::Device(whole)
        }
        (target, ..) => target,
    };
    let ring = ring()?;
    let path = file.source.path();
    let mut report = match (target, context) {
        (Target::Device(whole), Some(ctx)) => {
            // The data after the header's bytes (`device_targets` made the
            // range of both).
            let data = usize::try_from(file.data_len).ok().and_then(|data_len| whole.sub(lead, data_len));
            let data = data.ok_or_else(|| {
                dmaload::Error::new(
                    dmaload::ErrorKind::InvalidInput,
                    "load",
                    path,
                    "the destination is too small",
                )
            })?;
            let mut sink = CudaSink::new(ctx, vec![(offset, data)])
                .map_err(|e| dmaload::Error::io("load", path, e.into()))?;
            file.source.request().range(offset, len).options(options).to_sink(ring, &mut sink)?
        }
        (Target::Device(_), None) => {
            return Err(dmaload::Error::new(
                dmaload::ErrorKind::InvalidInput,
                "load",
                path,
                "no device context",
            ))
        }
        (Target::Host(dst), _) => {
            let mut sink = HostSink::raw(dst, offset);
            file.source.request().range(offset, len).options(options).to_sink(ring, &mut sink)?
        }
    };
    // First: the service was passed over before the load began.
    report.fallbacks.splice(0..0, fallback);
    Ok(report)
}

/// Refuses, with the core's error (ENOMEM naming both figures), a load of
/// `need` bytes to CUDA device `device` that does not fit in what the
/// device has free; `path` names the load in the message.
#[pyfunction]
pub fn check_device_memory(py: Python<'_>, device: usize, need: u64, path: PathBuf) -> PyResult<()> {
    detached(py, || {
        let context = Context::primary(device).map_err(|e| PyOSError::new_err((e.errno(), e.to_string())))?;
        dmaload::device::check_device_memory(&context, device, need, &path).map_err(|e| os_error(&e))
    })?
}

/// Frees the staging rings kept for later loads; returns their bytes.
#[pyfunction]
pub fn release_staging(py: Python<'_>) -> PyResult<usize> {
    detached(py, dmaload::sink::release_staging)
}

/// Loads the data sections of `files` (one after another, through one
/// staging ring of `staging_slots` × `staging_slot_size` bytes, from
/// `options`) into `targets`: device
/// pointers (ints) on CUDA device `device`, or, when `device` is -1,
/// writable buffer-protocol objects in host memory. Each destination holds
/// `file.data_len` bytes and shares none with another (ValueError
/// otherwise). `keep` holds the objects that own device destinations (the
/// tensors): the load keeps them alive while it runs, past a Ctrl-C that
/// leaves it to its thread. Returns the reports.
///
/// With `socket` (device destinations only), the cache service there
/// copies each whole file into the device memory from its own pinned copy
/// (`dmaload_share::CacheRequest::into_device`): each destination must then
/// follow `file.data_start` bytes of the same allocation, where the header
/// goes. Where the service cannot (none answers, another user, no such
/// device in the service, the driver refuses the IPC handle), that file
/// takes the staging ring as without `socket`, and its report's
/// `fallbacks` says why.
#[pyfunction]
#[pyo3(signature = (files, targets, device, *, options=None, progress=None, keep=None, socket=None))]
#[allow(clippy::too_many_arguments)] // the Python signature
pub fn _load_staged(
    py: Python<'_>,
    files: Vec<Py<SafetensorsFile>>,
    targets: Vec<Bound<'_, PyAny>>,
    device: i64,
    options: Option<Bound<'_, PyDict>>,
    progress: Option<Py<PyAny>>,
    keep: Option<Vec<Py<PyAny>>>,
    socket: Option<PathBuf>,
) -> PyResult<Vec<Py<PyAny>>> {
    if files.len() != targets.len() {
        return Err(PyValueError::new_err("one destination per file is needed"));
    }
    if socket.is_some() && device < 0 {
        return Err(PyValueError::new_err(
            "the cache service fills device memory only: socket= needs a device",
        ));
    }
    // The host memory's options do not apply: the ring is the memory.
    let opts = Opts::from_dict(options.as_ref())?.without(&["to", "gather_size", "populate_threads"]);
    let mut options = opts.to_options()?;
    // Checked before the ring is made of them, as every load checks them.
    dmaload::check_load_options(&options).map_err(|e| os_error(&e))?;
    let slot_size = options.staging_slot_size.unwrap_or(DEFAULT_SLOT_SIZE);
    let first_file = files.iter().find_map(|f| match &f.get().source {
        Source::File(open) => Some(open),
        Source::Object(_) => None,
    });
    let total = files.iter().map(|f| f.get().data_len).sum();
    let slots = match (options.staging_slots, first_file) {
        (Some(slots), _) => slots,
        // The reads the first file's disk keeps in flight, as the core's
        // loads of a file to a device size their ring.
        (None, Some(file)) => dmaload::device::ring_slots_for(file, total, &options),
        // GETs keep fewer slots busy than a disk's reads: the core's ring
        // for objects, its requests of the core's size.
        (None, None) => dmaload::object_ring_slots(&options, slot_size),
    };
    // One read per slot, unless asked otherwise; a file's depth is tuned
    // within the ring, an object's GETs keep every slot busy.
    if !opts.given("chunk_size") && first_file.is_some() {
        options.chunk_size = slot_size;
    }
    if !opts.given("queue_depth") && first_file.is_none() {
        options.queue_depth = slots;
    }
    let too_large = |_| PyValueError::new_err("file too large");
    let lens: Vec<usize> = files
        .iter()
        .map(|f| usize::try_from(f.get().data_len).map_err(too_large))
        .collect::<PyResult<_>>()?;
    // The header's bytes before each destination, where the service puts them.
    let leads: Vec<usize> = match &socket {
        Some(_) => files
            .iter()
            .map(|f| usize::try_from(f.get().data_start).map_err(too_large))
            .collect::<PyResult<_>>()?,
        None => vec![0; files.len()],
    };
    let cancel = dmaload::CancelToken::new();
    options.cancel = cancel.clone();
    let total = files.iter().map(|f| f.get().data_len).sum();
    let relay = progress.map(|callback| Progress::new(callback, total, cancel.clone()));
    let ordinal = match device {
        -1 => None,
        d => Some(usize::try_from(d).map_err(|_| PyValueError::new_err(format!("no device {d}")))?),
    };
    // Host destinations are buffer exports, held until the loads end;
    // device ones are pointers.
    let (host, addresses) = match ordinal {
        None => {
            let host = targets
                .iter()
                .zip(&lens)
                .map(|(t, &len)| host_buffer(t, len))
                .collect::<PyResult<Vec<_>>>()?;
            disjoint(&host)?;
            (host, Vec::new())
        }
        Some(_) => (Vec::new(), targets.iter().map(|t| t.extract::<u64>()).collect::<PyResult<Vec<u64>>>()?),
    };
    let work_relay = relay.clone();
    let work = move || -> Result<Vec<dmaload::LoadReport>, PyErr> {
        // Dropped when the work ends: the owners of device memory stay
        // alive while a copy into it may run.
        let _owners = keep;
        let (relay, mut host) = (work_relay, host);
        let files: Vec<&SafetensorsFile> = files.iter().map(|f| f.get()).collect();
        let context = match ordinal {
            Some(ordinal) => {
                Some(Context::primary(ordinal).map_err(|e| PyOSError::new_err((e.errno(), e.to_string())))?)
            }
            None => None,
        };
        let targets = match &context {
            // SAFETY: the Python caller's promise, documented on `device_targets`.
            #[allow(unsafe_code)]
            Some(ctx) => unsafe { device_targets(ctx, &addresses, &leads, &lens) }?,
            None => host.iter_mut().map(host_target).collect(),
        };
        let device = ordinal.zip(context.as_ref());
        // Made at the first file the service does not fill.
        let mut ring = None;
        let mut reports = Vec::with_capacity(files.len());
        for ((file, target), lead) in files.iter().zip(targets).zip(leads) {
            let mut options = options.clone();
            if let Some(relay) = &relay {
                options.progress = Some(relay.for_load());
            }
            let loaded = load_one(file, target, lead, socket.as_deref(), context.as_ref(), &options, || {
                match ring.take() {
                    Some(kept) => Ok(ring.insert(kept)),
                    None => take_ring(device, slots, slot_size, options.chunk_size)
                        .map(|made| ring.insert(made))
                        .map_err(|e| dmaload::Error::io("allocate the staging ring", file.source.path(), e)),
                }
            });
            match loaded {
                Ok(report) => reports.push(report),
                Err(err) => {
                    // Every sink finished before the error came back: the
                    // ring is idle and can serve the next load, unless the
                    // device's context is broken (a sticky error, a lost
                    // device), whose pinned memory must not be used again.
                    let healthy = context.as_ref().map_or(true, |ctx| ctx.synchronize().is_ok());
                    if let (true, Some(ring)) = (healthy, ring) {
                        keep_ring(ordinal, ring);
                    }
                    return Err(os_error(&err));
                }
            }
        }
        if let Some(ring) = ring {
            keep_ring(ordinal, ring);
        }
        Ok(reports)
    };
    // The work owns the host exports and the device memory's owners
    // (`keep`): a read that Ctrl-C cannot stop keeps them alive until it
    // ends (see run_abandonable); the cancelled delivery copies no more.
    let outcome = run_abandonable(py, &cancel, work)?;
    Progress::raised(relay.as_ref())?;
    let reports = outcome?;
    Progress::finish(relay.as_ref())?;
    guard(|| reports.iter().map(|r| report_object(py, r).map(Bound::unbind)).collect())
}
