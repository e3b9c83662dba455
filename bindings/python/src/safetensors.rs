//! safetensors headers and whole-file loads of shards.

use std::path::PathBuf;

use dmaload::format::model::{self, Model};
use dmaload::format::safetensors as st;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::buffer::Buffer;
use crate::errors::*;
use crate::load::*;
use crate::options::*;
use crate::run::*;

/// The core's header as a `dmaload._header.Header`, its tensors
/// `dmaload._header.TensorInfo` records, built field by field. The
/// destructurings name every field, so a field the core adds to its
/// `Header` or `TensorInfo` is a compile error here until it crosses too.
pub(crate) fn header_object<'py>(py: Python<'py>, header: st::Header) -> PyResult<Bound<'py, PyAny>> {
    let data_start = header.data_start();
    let st::Header { header_len: _, tensors, metadata } = header;
    let module = py.import("dmaload._header")?;
    let tensor_class = module.getattr("TensorInfo")?;
    let tensors = tensors
        .into_iter()
        .map(|tensor| {
            let st::TensorInfo { name, dtype, shape, data_offsets: (begin, end) } = tensor;
            let kw = PyDict::new(py);
            kw.set_item(pyo3::intern!(py, "name"), name)?;
            kw.set_item(pyo3::intern!(py, "dtype"), dtype.name())?;
            kw.set_item(pyo3::intern!(py, "shape"), PyTuple::new(py, shape)?)?;
            kw.set_item(pyo3::intern!(py, "begin"), begin)?;
            kw.set_item(pyo3::intern!(py, "end"), end)?;
            tensor_class.call((), Some(&kw))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let kw = PyDict::new(py);
    kw.set_item("tensors", PyTuple::new(py, tensors)?)?;
    kw.set_item("metadata", metadata)?;
    kw.set_item("data_start", data_start)?;
    module.getattr("Header")?.call((), Some(&kw))
}

/// Parses a safetensors header from bytes: `data` holds at least the
/// first `8 + n` bytes of a file of `file_len` bytes (default: `len(data)`).
#[pyfunction]
#[pyo3(signature = (data, file_len=None))]
pub(crate) fn parse_safetensors_header<'py>(
    py: Python<'py>,
    data: &[u8],
    file_len: Option<u64>,
) -> PyResult<Bound<'py, PyAny>> {
    guard(|| {
        let header = st::parse(data, file_len.unwrap_or(data.len() as u64))
            .map_err(|e| SafetensorError::new_err(e.to_string()))?;
        header_object(py, header)
    })
}

/// Reads and validates the header of a safetensors file without loading it.
#[pyfunction]
pub(crate) fn read_safetensors_header(py: Python<'_>, path: PathBuf) -> PyResult<Bound<'_, PyAny>> {
    // A read no cancellation reaches does not hold Ctrl-C (see run_abandonable).
    let read = run_abandonable(py, &dmaload::CancelToken::new(), move || st::read_header(&path))?;
    let (header, _) = read.map_err(|e| format_error(&e))?;
    guard(|| header_object(py, header))
}

/// The model at `path` as the core resolves it
/// (`dmaload::format::model::Model::resolve`: a file, an index or a
/// directory, or an object URL, key or prefix; the index read and checked): its shard files in order, and
/// the index's weight map as (tensor, normalized shard name) pairs in the
/// index's order, or `None` without an index.
#[pyfunction]
pub(crate) fn resolve_model(py: Python<'_>, path: PathBuf) -> PyResult<ResolvedModel> {
    // As read_safetensors_header: a read no cancellation reaches does not
    // hold Ctrl-C.
    let resolved = run_abandonable(py, &dmaload::CancelToken::new(), move || Model::resolve(&path))?;
    let Model { shards, weight_map } = resolved.map_err(|e| format_error(&e))?;
    // Strings, not pathlib paths: `Path("s3://b/k")` would drop a slash.
    Ok((shards.into_iter().map(PathBuf::into_os_string).collect(), weight_map))
}

/// [`resolve_model`]'s answer: the shards (paths or object URLs), and the
/// weight map if indexed.
type ResolvedModel = (Vec<std::ffi::OsString>, Option<Vec<(String, String)>>);

/// Which of `tables` (each shard's path and tensor names, in the order
/// `resolve_model` gave the shards) holds each tensor, checked by the
/// core's `dmaload::format::model::tensor_index` against each other and
/// `weight_map` (tensor name to shard name, or None without an index): a
/// dict of name to position, in the tables' order, or its
/// SafetensorError.
#[pyfunction]
pub(crate) fn tensor_index<'py>(
    py: Python<'py>,
    tables: Vec<(PathBuf, Vec<String>)>,
    weight_map: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    guard(|| {
        let tables: Vec<(String, Vec<String>)> =
            tables.into_iter().map(|(path, names)| (path.display().to_string(), names)).collect();
        // In the dict's order, the index's: the shards' order is that of
        // their first mention.
        let weight_map: Option<Vec<(String, String)>> = weight_map
            .map(|map| {
                map.iter()
                    .map(|(name, shard)| Ok((name.extract()?, shard.extract()?)))
                    .collect::<PyResult<_>>()
            })
            .transpose()?;
        let owner = model::tensor_index(&tables, weight_map.as_deref()).map_err(|e| format_error(&e))?;
        let index = PyDict::new(py);
        for name in tables.iter().flat_map(|(_, names)| names) {
            index.set_item(name, owner[name])?;
        }
        Ok(index)
    })
}

/// Loads safetensors files whole, `concurrency` at a time, with the GIL
/// released; returns (buffer, `Header`) per file, in order.
#[pyfunction]
#[pyo3(signature = (paths, *, concurrency=4, options=None, progress=None))]
pub(crate) fn load_safetensors<'py>(
    py: Python<'py>,
    paths: Vec<PathBuf>,
    concurrency: usize,
    options: Option<Bound<'py, PyDict>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Vec<(Buffer, Bound<'py, PyAny>)>> {
    guard(move || {
        let mut options = Opts::from_dict(options.as_ref())?.to_options()?;
        // The tensors never expose the memfd: `to="auto"` may pick
        // anonymous huge pages.
        options.needs_fd = false;
        if concurrency == 0 {
            return Err(PyValueError::new_err("concurrency must be at least 1"));
        }
        if paths.first().is_some_and(|p| dmaload::object::is_object_url(p)) {
            return load_objects(py, paths, options, progress);
        }
        // The progress total; the core checks the files against the memory
        // budget together, before allocating anything.
        let total =
            detached(py, || -> Result<u64, dmaload::Error> { paths.iter().map(|p| file_len(p)).sum() })?
                .map_err(|e| os_error(&e))?;
        // One token for every shard: a callback's exception or Ctrl-C stops them all.
        let cancel = dmaload::CancelToken::new();
        options.cancel = cancel.clone();
        let relay = progress.map(|callback| Progress::new(callback, total, cancel.clone()));
        options.progress = relay.as_ref().map(|relay| relay.for_load());
        let loaded = run_abandonable(py, &cancel, move || {
            dmaload::load_many(&paths, &options, concurrency, |path, options| st::load(path, options))
        })?;
        Progress::raised(relay.as_ref())?;
        let out = loaded
            .map_err(|err| format_error(&err))?
            .into_iter()
            .map(|loaded| Ok((Buffer::new(loaded.buffer, loaded.report), header_object(py, loaded.header)?)))
            .collect::<PyResult<Vec<_>>>()?;
        Progress::finish(relay.as_ref())?;
        Ok(out)
    })
}

/// [`load_safetensors`] of shard objects (`s3://BUCKET/KEY`): each looked
/// up (a HEAD), then loaded once into host memory by the core
/// (`ObjectModel::load`), its header parsed from the loaded bytes.
fn load_objects<'py>(
    py: Python<'py>,
    paths: Vec<PathBuf>,
    mut options: dmaload::LoadOptions,
    progress: Option<Py<PyAny>>,
) -> PyResult<Vec<(Buffer, Bound<'py, PyAny>)>> {
    let cancel = dmaload::CancelToken::new();
    options.cancel = cancel.clone();
    let model = Model { shards: paths, weight_map: None };
    let opened = run_abandonable(py, &cancel, {
        let cancel = cancel.clone();
        move || model.open_objects(&cancel)
    })?;
    let objects = opened.map_err(|e| format_error(&e))?;
    let relay = progress.map(|callback| Progress::new(callback, objects.len(), cancel.clone()));
    options.progress = relay.as_ref().map(|relay| relay.for_load());
    let loaded = run_abandonable(py, &cancel, move || objects.load(&options))?;
    Progress::raised(relay.as_ref())?;
    let out = loaded
        .map_err(|e| format_error(&e))?
        .into_iter()
        .map(|shard| match shard.loaded {
            dmaload::Loaded::Host(buffer) => {
                Ok((Buffer::new(buffer, shard.report), header_object(py, shard.header)?))
            }
            // ObjectModel::load loads into host memory only.
            _ => Err(pyo3::exceptions::PyRuntimeError::new_err("an object shard loaded outside host memory")),
        })
        .collect::<PyResult<Vec<_>>>()?;
    Progress::finish(relay.as_ref())?;
    Ok(out)
}

/// The dtype names safetensors defines, with their sizes in bits.
#[pyfunction]
pub(crate) fn safetensors_dtypes() -> PyResult<Vec<(&'static str, u64)>> {
    guard(|| Ok(st::Dtype::ALL.iter().map(|d| (d.name(), d.bits())).collect()))
}
