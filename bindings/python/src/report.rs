//! Load and save reports as the Python dataclasses `dmaload.LoadReport` and
//! `dmaload.SaveReport`, through the core's JSON.

use dmaload::LoadReport;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The core's report as a `dmaload._report.LoadReport`: its JSON (the one
/// `dmaload load --json` prints) read by `LoadReport.from_json`, so the
/// fields cross in one place. `path` goes beside it as a `str` as
/// `os.fsdecode` gives it (surrogate escapes for bytes that are not UTF-8;
/// the JSON holds U+FFFD there), so `os.fsencode(report.path)` is the
/// file's name exactly.
pub(crate) fn report_object<'py>(py: Python<'py>, report: &LoadReport) -> PyResult<Bound<'py, PyAny>> {
    let json = report_json(report)?;
    let class = py.import("dmaload._report")?.getattr("LoadReport")?;
    class.call_method1("from_json", (json, report.path.as_os_str()))
}

/// The core's report (a load's or a save's) as its JSON.
pub(crate) fn report_json(report: &impl serde::Serialize) -> PyResult<String> {
    serde_json::to_string(report)
        .map_err(|e| PyRuntimeError::new_err(format!("encoding a report as JSON: {e}")))
}
