//! `dmaload._dmaload`: the native half of the `dmaload` Python package.
//!
//! The pure-Python package in `python/dmaload` is the public API; this
//! module holds what must be native: the `Buffer` type with the buffer
//! protocol, and loads and saves that run with the GIL released.
//!
//! `unsafe` code is allowed item by item, each with its SAFETY contract:
//! the buffer protocol (`__getbuffer__` and `__releasebuffer__`, which PyO3
//! requires to be `unsafe fn`, and the function that fills a `Py_buffer`),
//! a caller's descriptor number borrowed for one call (`FileArg`), in
//! `staged.rs` the bytes of a buffer export and device pointers, and in
//! `save.rs` the address of a buffer export that only the kernel reads.
#![deny(unsafe_code)]

mod block_queue;
mod buffer;
mod cache;
mod dmabuf;
mod errors;
mod lease;
mod load;
mod options;
mod report;
mod run;
mod safetensors;
mod save;
mod staged;
mod windows;

use pyo3::prelude::*;

/// The module: each submodule's classes and functions, registered here.
#[pymodule]
fn _dmaload(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("MAX_HEADER_LEN", dmaload::format::safetensors::MAX_HEADER_LEN)?;
    m.add("SafetensorError", m.py().get_type::<errors::SafetensorError>())?;
    m.add_class::<buffer::Buffer>()?;
    m.add_class::<dmabuf::DmaBuf>()?;
    m.add_function(wrap_pyfunction!(dmabuf::load_dmabuf, m)?)?;
    m.add_function(wrap_pyfunction!(load::load, m)?)?;
    m.add_function(wrap_pyfunction!(load::load_into, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::load_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(cache::load_cached, m)?)?;
    m.add_function(wrap_pyfunction!(save::save, m)?)?;
    m.add_function(wrap_pyfunction!(save::_save_option_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(cache::default_cache_socket, m)?)?;
    m.add_function(wrap_pyfunction!(cache::evict, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::read_safetensors_header, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::resolve_model, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::tensor_index, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::parse_safetensors_header, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::safetensors_dtypes, m)?)?;
    m.add_class::<block_queue::BlockQueue>()?;
    m.add_class::<windows::WindowLoader>()?;
    m.add_class::<windows::Arrival>()?;
    m.add_class::<windows::StreamDigest>()?;
    m.add_class::<staged::SafetensorsFile>()?;
    m.add_class::<lease::LeasedFile>()?;
    m.add_function(wrap_pyfunction!(staged::open_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(staged::_load_staged, m)?)?;
    m.add_function(wrap_pyfunction!(staged::release_staging, m)?)?;
    m.add_function(wrap_pyfunction!(staged::check_device_memory, m)?)?;
    m.add_function(wrap_pyfunction!(options::_option_choices, m)?)?;
    m.add_function(wrap_pyfunction!(options::_option_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(options::_check_load_options, m)?)?;
    m.add_function(wrap_pyfunction!(options::parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(run::_test_panic, m)?)?;
    Ok(())
}
