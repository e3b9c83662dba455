//! Load reports and fallbacks as the Python objects `dmaload.LoadReport`
//! and `dmaload.Fallback`.

use dmaload::{CachePolicy, LoadReport};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// The name the core's JSON gives a cache policy.
pub(crate) fn cache_name(cache: CachePolicy) -> &'static str {
    match cache {
        CachePolicy::Bypass => "bypass",
        CachePolicy::Keep => "keep",
        CachePolicy::DontCache => "dont-cache",
        CachePolicy::Fadvise => "fadvise",
    }
}

/// The core's report as a `dmaload._report.LoadReport`, field by field.
/// The destructuring names every field, so a field the core adds is a
/// compile error here until it crosses too. `path` is a `str` as
/// `os.fsdecode` gives it (surrogate escapes for bytes that are not UTF-8),
/// so `os.fsencode(report.path)` is the file's name exactly.
pub(crate) fn report_object<'py>(py: Python<'py>, report: &LoadReport) -> PyResult<Bound<'py, PyAny>> {
    let LoadReport {
        path,
        offset,
        bytes,
        engine,
        cache,
        memory,
        memory_reason,
        huge_pages,
        destination,
        filesystem,
        alignment,
        chunk_size,
        gather_size,
        queue_depth,
        request_size,
        fallbacks,
        alloc_seconds,
        register_seconds,
        first_gather_seconds,
        deliver_seconds,
        ring_bytes,
        cache_lane_bytes,
        cache_lane_threads,
        io_seconds,
        waited_for_memory_seconds,
        total_seconds,
        gib_per_second,
        cpu_user_seconds,
        cpu_system_seconds,
        page_cache,
    } = report;
    let module = py.import("dmaload._report")?;
    let kw = PyDict::new(py);
    kw.set_item("path", path.as_os_str())?;
    kw.set_item("offset", offset)?;
    kw.set_item("bytes", bytes)?;
    kw.set_item("engine", engine.name())?;
    kw.set_item("cache", cache_name(*cache))?;
    kw.set_item("memory", memory.name())?;
    kw.set_item("memory_reason", memory_reason)?;
    kw.set_item("huge_pages", huge_pages)?;
    kw.set_item("destination", destination)?;
    kw.set_item("filesystem", filesystem)?;
    kw.set_item("alignment", alignment)?;
    kw.set_item("chunk_size", chunk_size)?;
    kw.set_item("gather_size", gather_size)?;
    kw.set_item("queue_depth", queue_depth)?;
    kw.set_item("request_size", request_size)?;
    kw.set_item("fallbacks", fallback_objects(&module, fallbacks)?)?;
    kw.set_item("alloc_seconds", alloc_seconds)?;
    kw.set_item("register_seconds", register_seconds)?;
    kw.set_item("first_gather_seconds", first_gather_seconds)?;
    kw.set_item("deliver_seconds", deliver_seconds)?;
    kw.set_item("ring_bytes", ring_bytes)?;
    kw.set_item("cache_lane_bytes", cache_lane_bytes)?;
    kw.set_item("cache_lane_threads", cache_lane_threads)?;
    kw.set_item("io_seconds", io_seconds)?;
    kw.set_item("waited_for_memory_seconds", waited_for_memory_seconds)?;
    kw.set_item("total_seconds", total_seconds)?;
    kw.set_item("gib_per_second", gib_per_second)?;
    kw.set_item("cpu_user_seconds", cpu_user_seconds)?;
    kw.set_item("cpu_system_seconds", cpu_system_seconds)?;
    let page_cache = match page_cache {
        Some(r) => Some(module.getattr("PageCacheResidency")?.call1((r.resident_bytes, r.fraction))?),
        None => None,
    };
    kw.set_item("page_cache", page_cache)?;
    module.getattr("LoadReport")?.call((), Some(&kw))
}

/// The core's fallbacks as a tuple of `dmaload._report.Fallback`
/// (`module`), for a load's or a save's report.
pub(crate) fn fallback_objects<'py>(
    module: &Bound<'py, PyModule>,
    fallbacks: &[dmaload::Fallback],
) -> PyResult<Bound<'py, PyTuple>> {
    let py = module.py();
    let fallback_class = module.getattr("Fallback")?;
    let fallbacks = fallbacks
        .iter()
        .map(|f| {
            let kw = PyDict::new(py);
            kw.set_item("from_", &f.from)?;
            kw.set_item("to", &f.to)?;
            kw.set_item("reason", &f.reason)?;
            fallback_class.call((), Some(&kw))
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, fallbacks)
}
