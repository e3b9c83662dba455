//! Options as the native entry points take them: one dict of names and
//! values (`dmaload._options.native_options`), and what a load reads.

use std::collections::BTreeMap;
use std::path::PathBuf;

use dmaload::{Destination, Engine, IoMode, LoadOptions, OptionError, OptionValue, SaveOptions};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt};

use crate::errors::*;

/// The load options of every native entry point, passed as one dict
/// (`dmaload._options.native_options` builds it): the names and values the
/// core's [`LoadOptions::set`] takes (sizes in bytes), checked by it. A
/// name it does not take is a TypeError, so an option one side lacks
/// cannot pass unnoticed. Each entry point uses the options that apply to
/// it: a host load ignores the staging ring, a staged load the host
/// memory's (`to`, `gather_size`, `populate_threads`).
pub(crate) struct Opts {
    /// "load" or "save": what the errors call the options.
    what: &'static str,
    /// The options given, a value of None (the default) left out.
    given: Vec<(String, OptionValue)>,
}

impl Opts {
    /// Reads `options` (None: every default); a value of None is the default.
    pub(crate) fn from_dict(options: Option<&Bound<'_, PyDict>>) -> PyResult<Opts> {
        Opts::from_dict_for("load", options)
    }

    /// [`Opts::from_dict`] for an entry point whose errors call the options
    /// `what` options ("save option chunk_size: ...").
    pub(crate) fn from_dict_for(what: &'static str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Opts> {
        let mut o = Opts { what, given: Vec::new() };
        for (name, value) in options.into_iter().flat_map(|dict| dict.iter()) {
            let name: String = name.extract()?;
            if value.is_none() {
                continue;
            }
            let value = o.value(&name, &value)?;
            o.given.push((name, value));
        }
        Ok(o)
    }

    /// A Python value as the core takes it. A bool is an int to Python,
    /// but True is never the count 1 a user meant: it is a switch.
    fn value(&self, name: &str, value: &Bound<'_, PyAny>) -> PyResult<OptionValue> {
        let what = self.what;
        if value.is_instance_of::<PyBool>() {
            return Ok(OptionValue::Flag(value.extract()?));
        }
        if let Ok(text) = value.extract::<String>() {
            return Ok(OptionValue::Name(text));
        }
        if value.is_instance_of::<PyInt>() {
            let n =
                value.extract().map_err(|e| PyTypeError::new_err(format!("{what} option {name}: {e}")))?;
            return Ok(OptionValue::Number(n));
        }
        let kind = value.get_type().name()?;
        Err(PyTypeError::new_err(format!("{what} option {name}: a str, int or bool, not {kind}")))
    }

    /// Whether the option `name` was given.
    pub(crate) fn given(&self, name: &str) -> bool {
        self.given.iter().any(|(n, _)| n == name)
    }

    /// These options less `names` (options an entry point does not use).
    pub(crate) fn without(mut self, names: &[&str]) -> Opts {
        self.given.retain(|(n, _)| !names.contains(&n.as_str()));
        self
    }

    /// `name` set to `value` unless it was given.
    pub(crate) fn or_default(mut self, name: &str, value: OptionValue) -> Opts {
        if !self.given(name) {
            self.given.push((name.to_owned(), value));
        }
        self
    }

    /// The core's error for the option `name` as the Python exception.
    fn refused(&self, name: &str, error: OptionError) -> PyErr {
        let what = self.what;
        match error {
            OptionError::Unknown if what == "save" && LoadOptions::NAMES.contains(&name) => {
                PyTypeError::new_err(format!("unknown save option {name:?} (a load option)"))
            }
            OptionError::Unknown => PyTypeError::new_err(format!("unknown {what} option {name:?}")),
            OptionError::Type(e) => PyTypeError::new_err(format!("{what} option {name}: {e}")),
            OptionError::Value(e) => PyValueError::new_err(format!("{what} option {name}: {e}")),
        }
    }

    pub(crate) fn to_options(&self) -> PyResult<LoadOptions> {
        let mut o = LoadOptions::default();
        for (name, value) in &self.given {
            o.set(name, value.clone()).map_err(|e| self.refused(name, e))?;
        }
        Ok(o)
    }

    /// The options of a save, with `sync` (None: the default). One only a
    /// load takes is a TypeError naming it.
    pub(crate) fn to_save_options(&self, sync: Option<bool>) -> PyResult<SaveOptions> {
        let mut o = SaveOptions::default();
        o.sync = sync.unwrap_or(o.sync);
        for (name, value) in &self.given {
            o.set(name, value.clone()).map_err(|e| self.refused(name, e))?;
        }
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

/// Every load option the binding takes ([`LoadOptions::NAMES`]), with the
/// core's default.
#[pyfunction]
pub(crate) fn _option_defaults() -> PyResult<BTreeMap<&'static str, DefaultValue>> {
    guard(|| {
        let defaults = LoadOptions::default();
        let mut all: BTreeMap<_, _> = LoadOptions::NAMES
            .iter()
            .filter_map(|&name| {
                let value = match defaults.get(name)? {
                    OptionValue::Name(n) => DefaultValue::Name(n),
                    OptionValue::Number(n) => DefaultValue::Number(n as usize),
                    OptionValue::Flag(b) => DefaultValue::Flag(b),
                };
                Some((name, value))
            })
            .collect();
        // Unset, the staging ring is sized per load: a device's has slots
        // of this size, and at most this many (fewer for less data,
        // dmaload::device::staging_ring_slots).
        all.insert("staging_slots", DefaultValue::Number(dmaload::sink::DEFAULT_SLOTS));
        all.insert("staging_slot_size", DefaultValue::Number(dmaload::sink::DEFAULT_SLOT_SIZE));
        Ok(all)
    })
}

/// A size ("4096", "128M", "1.5GiB") in bytes: the core's one parser, so
/// Python's options read sizes as the command line does.
#[pyfunction]
pub(crate) fn parse_size(text: &str) -> PyResult<u64> {
    dmaload::parse_size(text).map_err(PyValueError::new_err)
}
