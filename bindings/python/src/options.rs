//! Options as the native entry points take them: one dict of names and
//! values (`dmaload._options.native_options`), and what a load reads.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dmaload::{Destination, Engine, IoMode, LoadOptions, SaveOptions};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

use crate::errors::*;

/// The load options of every native entry point, passed as one dict
/// (`dmaload._options.native_options` builds it): the core's
/// [`LoadOptions`], names and values as the core spells them (see
/// [`_option_defaults`]), sizes in bytes, plus the staging ring of device
/// loads. A name not listed here is a TypeError, so an option one side
/// lacks cannot pass unnoticed. Each entry point uses the options that
/// apply to it: a host load ignores the staging ring, a staged load the
/// host memory's (`to`, `gather_size`, `populate_threads`).
#[derive(Default)]
pub(crate) struct Opts {
    pub(crate) engine: Option<String>,
    pub(crate) mode: Option<String>,
    pub(crate) to: Option<String>,
    pub(crate) gather_size: Option<usize>,
    pub(crate) chunk_size: Option<usize>,
    pub(crate) queue_depth: Option<usize>,
    pub(crate) threads: Option<usize>,
    pub(crate) populate_threads: Option<usize>,
    pub(crate) measure_page_cache: Option<bool>,
    pub(crate) verify: Option<bool>,
    pub(crate) staging_slots: Option<usize>,
    pub(crate) staging_slot_size: Option<usize>,
}

impl Opts {
    /// Reads `options` (None: every default); a value of None is the default.
    pub(crate) fn from_dict(options: Option<&Bound<'_, PyDict>>) -> PyResult<Opts> {
        Opts::from_dict_for("load", options)
    }

    /// [`Opts::from_dict`] for an entry point whose errors call the options
    /// `what` options ("save option chunk_size: ...").
    pub(crate) fn from_dict_for(what: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Opts> {
        let mut o = Opts::default();
        for (name, value) in options.into_iter().flat_map(|dict| dict.iter()) {
            let name: String = name.extract()?;
            if value.is_none() {
                continue;
            }
            let typed = |e: PyErr| PyTypeError::new_err(format!("{what} option {name}: {e}"));
            // A bool is an int to Python, but True is never the count 1 a user meant.
            let number = || -> PyResult<usize> {
                if value.is_instance_of::<PyBool>() {
                    return Err(PyTypeError::new_err(format!(
                        "{what} option {name}: a bool is not a number"
                    )));
                }
                value.extract().map_err(typed)
            };
            match name.as_str() {
                "engine" => o.engine = Some(value.extract().map_err(typed)?),
                "mode" => o.mode = Some(value.extract().map_err(typed)?),
                "to" => o.to = Some(value.extract().map_err(typed)?),
                "gather_size" => o.gather_size = Some(number()?),
                "chunk_size" => o.chunk_size = Some(number()?),
                "queue_depth" => o.queue_depth = Some(number()?),
                "threads" => o.threads = Some(number()?),
                "populate_threads" => o.populate_threads = Some(number()?),
                "measure_page_cache" => o.measure_page_cache = Some(value.extract().map_err(typed)?),
                "verify" => o.verify = Some(value.extract().map_err(typed)?),
                "staging_slots" => o.staging_slots = Some(number()?),
                "staging_slot_size" => o.staging_slot_size = Some(number()?),
                _ => return Err(PyTypeError::new_err(format!("unknown {what} option {name:?}"))),
            }
        }
        Ok(o)
    }

    pub(crate) fn engine(&self) -> PyResult<Option<Engine>> {
        self.engine.as_deref().map(|e| e.parse::<Engine>().map_err(PyValueError::new_err)).transpose()
    }

    pub(crate) fn mode(&self) -> PyResult<Option<IoMode>> {
        self.mode.as_deref().map(|m| m.parse::<IoMode>().map_err(PyValueError::new_err)).transpose()
    }

    pub(crate) fn to_options(&self) -> PyResult<LoadOptions> {
        let mut o = LoadOptions::default();
        o.engine = self.engine()?.unwrap_or(o.engine);
        o.mode = self.mode()?.unwrap_or(o.mode);
        if let Some(to) = &self.to {
            o.to = to.parse::<Destination>().map_err(PyValueError::new_err)?;
        }
        o.gather_size = self.gather_size.unwrap_or(o.gather_size);
        o.chunk_size = self.chunk_size.unwrap_or(o.chunk_size);
        o.queue_depth = self.queue_depth.unwrap_or(o.queue_depth);
        o.threads = self.threads.unwrap_or(o.threads);
        o.populate_threads = self.populate_threads.unwrap_or(o.populate_threads);
        o.measure_page_cache = self.measure_page_cache.unwrap_or(o.measure_page_cache);
        o.verify = self.verify.unwrap_or(o.verify);
        Ok(o)
    }

    /// The options of a save: those a write shares with a load (`engine`,
    /// `mode`, `chunk_size`, `queue_depth`, `threads`) and `sync` (None:
    /// the default). One only
    /// a load takes is a TypeError naming it.
    pub(crate) fn to_save_options(&self, sync: Option<bool>) -> PyResult<SaveOptions> {
        let load_only = [
            ("to", self.to.is_some()),
            ("gather_size", self.gather_size.is_some()),
            ("populate_threads", self.populate_threads.is_some()),
            ("measure_page_cache", self.measure_page_cache.is_some()),
            ("verify", self.verify.is_some()),
            ("staging_slots", self.staging_slots.is_some()),
            ("staging_slot_size", self.staging_slot_size.is_some()),
        ];
        if let Some((name, _)) = load_only.iter().find(|(_, set)| *set) {
            return Err(PyTypeError::new_err(format!("unknown save option {name:?} (a load option)")));
        }
        let mut o = SaveOptions::default();
        o.sync = sync.unwrap_or(o.sync);
        o.engine = self.engine()?.unwrap_or(o.engine);
        o.mode = self.mode()?.unwrap_or(o.mode);
        o.chunk_size = self.chunk_size.unwrap_or(o.chunk_size);
        o.queue_depth = self.queue_depth.unwrap_or(o.queue_depth);
        o.threads = self.threads.unwrap_or(o.threads);
        Ok(o)
    }
}

/// The file a load reads: a path, or a descriptor number the caller holds
/// open (an int: `os.open`'s, or a file object's `fileno()`).
#[derive(FromPyObject)]
pub(crate) enum FileArg {
    Fd(std::os::fd::RawFd),
    Path(PathBuf),
}

impl FileArg {
    /// Opens the file once; a descriptor is reopened through
    /// `/proc/self/fd` (see [`dmaload::OpenFile::from_fd`]), never changed.
    pub(crate) fn open(&self) -> Result<dmaload::OpenFile, dmaload::Error> {
        match self {
            FileArg::Path(path) => dmaload::OpenFile::open(path),
            FileArg::Fd(fd) if *fd < 0 => Err(dmaload::Error::io(
                "open",
                std::path::Path::new(&format!("fd {fd}")),
                std::io::Error::from_raw_os_error(libc::EBADF),
            )),
            // SAFETY: a descriptor number the Python caller passed as open,
            // as `os.fstat(fd)` takes one; it is only borrowed within this
            // call, to duplicate it and reopen its file, never closed. Another
            // thread closing it meanwhile gives EBADF, or another file whose
            // identity `from_fd` checks against the reopened one.
            #[allow(unsafe_code)]
            FileArg::Fd(fd) => {
                dmaload::OpenFile::from_fd(unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) })
            }
        }
    }
}

/// The values each enumerated option takes, as the core parses and prints
/// them (`to` lists its forms, `cuda:N` for any device number): the tests
/// check `dmaload._options`' types against these.
#[pyfunction]
pub(crate) fn _option_choices() -> PyResult<BTreeMap<&'static str, Vec<String>>> {
    guard(|| {
        Ok(BTreeMap::from([
            ("engine", Engine::ALL.iter().map(|e| e.name().to_owned()).collect()),
            ("mode", IoMode::ALL.iter().map(|m| m.name().to_owned()).collect()),
            ("to", Destination::forms()),
        ]))
    })
}

/// Checks a load's options (the dict `dmaload._options.native_options`
/// builds) as a load would before it opens a file, without loading: names,
/// types and values. The serving engines' loaders call it when they read
/// their config, so a bad value fails there, not inside the first load.
#[pyfunction]
#[pyo3(signature = (options=None))]
pub(crate) fn _check_load_options(options: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    guard(|| {
        let o = Opts::from_dict(options)?.to_options()?;
        dmaload::check_load_options(&o).map_err(|e| os_error(&e))
    })
}

/// A default the core gives an option: an enumerated option's name, a
/// number, or a switch.
#[derive(IntoPyObject)]
pub(crate) enum DefaultValue {
    Name(String),
    Number(usize),
    Flag(bool),
}

/// Every load option the binding takes, with the core's default: the
/// fields of [`LoadOptions`] (all named, so a field the core adds is a
/// compile error here until it crosses) less the callback and the
/// cancellation token, which Python passes in its own way, `needs_fd`,
/// which each entry point sets (`load` keeps a memfd for `Buffer.fileno`,
/// the safetensors loaders need none), and the staging ring of device
/// loads.
#[pyfunction]
pub(crate) fn _option_defaults() -> PyResult<BTreeMap<&'static str, DefaultValue>> {
    guard(|| {
        let LoadOptions {
            engine,
            mode,
            to,
            gather_size,
            chunk_size,
            queue_depth,
            threads,
            populate_threads,
            measure_page_cache,
            verify,
            needs_fd: _,
            progress: _,
            cancel: _,
        } = LoadOptions::default();
        Ok(BTreeMap::from([
            ("engine", DefaultValue::Name(engine.name().to_owned())),
            ("mode", DefaultValue::Name(mode.name().to_owned())),
            ("to", DefaultValue::Name(to.name())),
            ("gather_size", DefaultValue::Number(gather_size)),
            ("chunk_size", DefaultValue::Number(chunk_size)),
            ("queue_depth", DefaultValue::Number(queue_depth)),
            ("threads", DefaultValue::Number(threads)),
            ("populate_threads", DefaultValue::Number(populate_threads)),
            ("measure_page_cache", DefaultValue::Flag(measure_page_cache)),
            ("verify", DefaultValue::Flag(verify)),
            ("staging_slots", DefaultValue::Number(dmaload::sink::DEFAULT_SLOTS)),
            ("staging_slot_size", DefaultValue::Number(dmaload::sink::DEFAULT_SLOT_SIZE)),
        ]))
    })
}

/// A size ("4096", "128M", "1.5GiB") in bytes: the core's one parser, so
/// Python's options read sizes as the command line does.
#[pyfunction]
pub(crate) fn parse_size(text: &str) -> PyResult<u64> {
    dmaload::parse_size(text).map_err(PyValueError::new_err)
}
