//! Loads through the cache service: a [`CacheRequest`] names a whole file
//! or object, the service's socket and the options, and one verb runs it.
//! Where the service cannot serve (none answers, another user, an older
//! service, no such device in it) the verbs that may load directly do,
//! and say why ([`CacheOutcome::Direct`]).

use std::borrow::Cow;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::client::{handoff_report, Client, Fetched};
use dmaload::buffer::Buffer;
use dmaload::cuda::{Context, DeviceRange};
use dmaload::device::{allocate, LoadedDevice};
use dmaload::error::{Error, ErrorKind, Result};
use dmaload::load::{LoadOptions, LoadReport, LoadRequest, Loaded};
use dmaload::object::Object;
use dmaload::share::protocol::{DeviceTarget, Served, DEVICE_UNREACHABLE_OPS};
use dmaload::source::OpenFile;
use dmaload::Destination;
use dmaload::{source, sys_share, system};

/// Where the bytes of a [`CacheRequest`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOutcome {
    /// From the service, and how it served them.
    Service { served: Served, note: Option<String> },
    /// Loaded directly: why the service was not used.
    Direct { reason: String },
}

/// What [`CacheRequest::from_service`] returns when the service served:
/// the bytes, the handoff's report, how it served them, and its note.
pub type ServedFile = (Buffer, LoadReport, Served, Option<String>);

/// A whole file or object to load through the cache service at a socket,
/// with options, run by one verb:
///
/// | verb | destination | where the service cannot serve |
/// |---|---|---|
/// | [`load`](Self::load) | what `options.to` names: host memory or `cuda:N` | loads directly |
/// | [`to_buffer`](Self::to_buffer) | host memory | loads directly |
/// | [`from_service`](Self::from_service) | host memory | `Ok(Err(why))` |
/// | [`into_device`](Self::into_device) | device memory the caller has | `Ok(Err(why))` |
///
/// A file goes to the service as a descriptor of the [`OpenFile`], and a
/// direct load reads that same open file, so both are the same file
/// whatever happens to its path. An object goes as a grant of this
/// process's ([`Client::get_object`]): the service reads it with that,
/// keeps it under its ETag, and its HEAD must find the version this
/// process opened, else the load fails with [`ErrorKind::Changed`], as a
/// direct load does. A verified load never takes the service (it does not
/// verify). An error about the file or object itself is returned as a
/// direct load would return it, not retried.
#[derive(Clone)]
pub struct CacheRequest<'a> {
    asked: Asked<'a>,
    socket: &'a Path,
    options: Cow<'a, LoadOptions>,
}

/// What a request asks the service for: a file this process opened (its
/// descriptor goes with the request) or an object it opened (a grant goes
/// instead).
#[derive(Clone, Copy)]
enum Asked<'a> {
    File(&'a OpenFile),
    Object(&'a Object),
}

impl<'a> Asked<'a> {
    fn name(self) -> &'a Path {
        match self {
            Asked::File(file) => file.path(),
            Asked::Object(object) => object.name(),
        }
    }
}

impl<'a> CacheRequest<'a> {
    fn new(asked: Asked<'a>, socket: &'a Path) -> Self {
        CacheRequest { asked, socket, options: Cow::Owned(LoadOptions::default()) }
    }

    /// The whole open `file`, through the service at `socket`.
    pub fn open(file: &'a OpenFile, socket: &'a Path) -> Self {
        Self::new(Asked::File(file), socket)
    }

    /// The whole opened `object` (`s3://BUCKET/KEY`), through the service
    /// at `socket`.
    pub fn object(object: &'a Object, socket: &'a Path) -> Self {
        Self::new(Asked::Object(object), socket)
    }

    /// The options (the defaults unless given); a direct load runs with
    /// them too.
    pub fn options(mut self, options: &'a LoadOptions) -> Self {
        self.options = Cow::Borrowed(options);
        self
    }

    /// Loads into what `options.to` names: a host memory kind gives
    /// [`Loaded::Host`] (as [`to_buffer`](Self::to_buffer)); `cuda:N`
    /// gives [`Loaded::Device`], new memory of device N that this process
    /// allocates and the service copies into from its cached copy, pinned
    /// once (see [`service`](crate::service)): this process sends a CUDA IPC handle
    /// and pins and copies nothing. Where the service cannot fill it (see
    /// [`into_device`](Self::into_device)) the load runs directly to the
    /// device, as `--to cuda:N` without the cache. Once the service has
    /// taken a device request, a failure is an error and the memory is
    /// freed, never returned partly filled. A dma-buf destination is an
    /// [`ErrorKind::InvalidInput`] error: the service serves no dma-bufs.
    pub fn load(&self) -> Result<(Loaded, LoadReport, CacheOutcome)> {
        match self.options.to {
            Destination::Cuda(ordinal) => {
                let (device, report, outcome) = self.to_device(ordinal)?;
                Ok((Loaded::Device(device), report, outcome))
            }
            ref to if to.is_host() => {
                let (buffer, report, outcome) = self.to_buffer()?;
                Ok((Loaded::Host(buffer), report, outcome))
            }
            ref to => Err(Error::new(
                ErrorKind::InvalidInput,
                "load",
                self.asked.name(),
                format!("the cache service serves host memory or a CUDA device, not {to}"),
            )),
        }
    }

    /// Loads into a host [`Buffer`]: from the service, else directly (as
    /// [`LoadRequest::to_buffer`]). A buffer from the service is a private
    /// copy-on-write mapping of the service's memfd; its report's
    /// `destination` is `cache-service (...)`, its times the handoff's.
    pub fn to_buffer(&self) -> Result<(Buffer, LoadReport, CacheOutcome)> {
        match self.from_service()? {
            Ok((buffer, report, served, note)) => {
                Ok((buffer, report, CacheOutcome::Service { served, note }))
            }
            Err(reason) => {
                let options = &*self.options;
                let (buffer, report) = match self.asked {
                    Asked::File(file) => LoadRequest::open(file).options(options).to_buffer()?,
                    Asked::Object(object) => LoadRequest::object(object).options(options).to_buffer()?,
                };
                Ok((buffer, report, CacheOutcome::Direct { reason }))
            }
        }
    }

    /// The bytes from the service, as [`to_buffer`](Self::to_buffer) gets
    /// them, or `Ok(Err(why))` where that would load directly instead: for
    /// a caller with a better fallback than a host buffer of the whole file
    /// (a device load reads the disk itself, from the same file).
    pub fn from_service(&self) -> Result<std::result::Result<ServedFile, String>> {
        let fetched = match self.asked {
            Asked::File(open) => {
                let (path, file) = (open.path(), open.file());
                let meta = file.metadata().map_err(|e| Error::io("fstat", path, e))?;
                if !meta.file_type().is_file() {
                    return Ok(Err(format!(
                        "a {} is not cached, only regular files",
                        source::type_name(&meta)
                    )));
                }
                self.fetch(|client| client.get_file(file, path))?
            }
            Asked::Object(object) => self.fetch(|client| client.get_object(object))?,
        };
        Ok(fetched.map(|(fetched, mut report)| {
            report.filesystem = self.filesystem();
            (fetched.buffer, report, fetched.served, fetched.note)
        }))
    }

    /// Has the service copy the whole file or object into `range`, device
    /// memory of `context`'s device that the caller allocated (a tensor
    /// inside a caching allocator's larger segment, say): this process
    /// sends a CUDA IPC handle of the allocation `range` lies in and
    /// `range`'s offset in it, and pins and copies nothing. `range` must
    /// hold the whole length. Returns the report and how the service had
    /// the bytes, or `Ok(Err(why))` where it cannot (none answers, another
    /// user, no such device in the service, the driver refuses the
    /// handle), for the caller to load them itself. Once the service has
    /// taken the request, a failure is an error and `range` holds
    /// unspecified bytes.
    pub fn into_device(
        &self,
        context: &Context,
        range: &DeviceRange<'_>,
    ) -> Result<std::result::Result<(LoadReport, Served), String>> {
        let len = match self.servable_to_device()? {
            Ok(len) => len,
            Err(why) => return Ok(Err(why)),
        };
        let name = self.asked.name();
        if (range.len() as u64) < len {
            return Err(Error::new(
                ErrorKind::Changed,
                "load",
                name,
                format!("it has {len} bytes, more than the {} set aside for it: it changed", range.len()),
            ));
        }
        let began = self.begin()?;
        let client = match self.connect()? {
            Ok(client) => client,
            Err(why) => return Ok(Err(why)),
        };
        let served = match self.copy_through_service(&client, context, range, len)? {
            Ok(served) => served,
            Err(why) => return Ok(Err(why)),
        };
        let report = self.device_report(context, len, served, began)?;
        Ok(Ok((report, served)))
    }

    /// [`load`](Self::load) to device `ordinal`: new memory the service
    /// fills, else a direct load to the device.
    fn to_device(&self, ordinal: usize) -> Result<(LoadedDevice, LoadReport, CacheOutcome)> {
        match self.new_device_memory_from_service(ordinal)? {
            Ok((loaded, report, served)) => {
                Ok((loaded, report, CacheOutcome::Service { served, note: None }))
            }
            Err(reason) => {
                let options = &*self.options;
                // `options.to` is `cuda:N`: the direct load allocates on
                // device N (an object's GETs into a pinned ring here).
                let request = match self.asked {
                    Asked::File(file) => LoadRequest::open(file),
                    Asked::Object(object) => LoadRequest::object(object),
                };
                match request.options(options).load()? {
                    (Loaded::Device(loaded), report) => Ok((loaded, report, CacheOutcome::Direct { reason })),
                    // Not reached: `load` gives what `options.to` names.
                    (_, _) => Err(Error::new(
                        ErrorKind::Io,
                        "load",
                        self.asked.name(),
                        format!("a load to cuda:{ordinal} gave no device memory"),
                    )),
                }
            }
        }
    }

    /// The service's copy into new memory of device `ordinal`, or
    /// `Ok(Err(why))` where the request loads directly instead.
    fn new_device_memory_from_service(
        &self,
        ordinal: usize,
    ) -> Result<std::result::Result<(LoadedDevice, LoadReport, Served), String>> {
        let len = match self.servable_to_device()? {
            Ok(len) => len,
            Err(why) => return Ok(Err(why)),
        };
        let began = self.begin()?;
        let client = match self.connect()? {
            Ok(client) => client,
            Err(why) => return Ok(Err(why)),
        };
        let name = self.asked.name();
        let context =
            Context::primary(ordinal).map_err(|e| Error::io("open the CUDA device", name, e.into()))?;
        let mut memory = allocate(&context, ordinal, len, name)?;
        let served = match self.copy_through_service(&client, &context, &memory.range(), len)? {
            Ok(served) => served,
            Err(why) => return Ok(Err(why)),
        };
        let report = self.device_report(&context, len, served, began)?;
        Ok(Ok((LoadedDevice { memory, len }, report, served)))
    }

    /// What `get` fetches from a client of the service, with the handoff's
    /// report, or `Ok(Err(why))` where the caller loads directly: no
    /// service, one that cannot serve, or a verified load.
    fn fetch(
        &self,
        get: impl FnOnce(&Client) -> Result<Fetched>,
    ) -> Result<std::result::Result<(Fetched, LoadReport), String>> {
        if self.options.verify {
            return Ok(Err(NOT_VERIFIED.into()));
        }
        let (_, cpu_before) = self.begin()?;
        let client = match self.connect()? {
            Ok(client) => client,
            Err(why) => return Ok(Err(why)),
        };
        let fetched = match get(&client) {
            Ok(fetched) => fetched,
            Err(err) if err.kind() == ErrorKind::Cancelled => return Err(err),
            Err(err) if service_unusable(&err) => return Ok(Err(format!("the cache service failed: {err}"))),
            Err(err) => return Err(err),
        };
        let name = self.asked.name();
        let mut report = handoff_report(
            name,
            fetched.buffer.len() as u64,
            fetched.seconds,
            format!("cache-service ({})", fetched.served.name()),
            &self.options,
        );
        self.charge_cpu(&mut report, cpu_before)?;
        Ok(Ok((fetched, report)))
    }

    /// The length the service would copy to a device, or why it cannot.
    fn servable_to_device(&self) -> Result<std::result::Result<u64, String>> {
        if self.options.verify {
            return Ok(Err(NOT_VERIFIED.into()));
        }
        let len = match self.asked {
            Asked::File(file) => {
                let meta = file.file().metadata().map_err(|e| Error::io("fstat", file.path(), e))?;
                if !meta.file_type().is_file() {
                    return Ok(Err(format!(
                        "a {} is not cached, only regular files",
                        source::type_name(&meta)
                    )));
                }
                meta.len()
            }
            Asked::Object(object) => object.size,
        };
        if len == 0 {
            return Ok(Err("an empty file has no device memory to fill".into()));
        }
        Ok(Ok(len))
    }

    /// A client of the service, or why there is none (a cancel is an
    /// error).
    fn connect(&self) -> Result<std::result::Result<Client, String>> {
        match Client::connect_cancellable(self.socket, &self.options.cancel) {
            Ok(client) => Ok(Ok(client)),
            Err(err) if err.kind() == ErrorKind::Cancelled => Err(err),
            Err(err) => Ok(Err(format!("no cache service: {err}"))),
        }
    }

    /// The time and the process's CPU time now, where a load through the
    /// service begins.
    fn begin(&self) -> Result<(Instant, (Duration, Duration))> {
        let cpu = sys_share::cpu_time().map_err(|e| Error::io("getrusage", self.asked.name(), e))?;
        Ok((Instant::now(), cpu))
    }

    /// Sets `report`'s CPU times to those spent since `cpu_before`.
    fn charge_cpu(&self, report: &mut LoadReport, cpu_before: (Duration, Duration)) -> Result<()> {
        let cpu_after = sys_share::cpu_time().map_err(|e| Error::io("getrusage", self.asked.name(), e))?;
        report.cpu_user_seconds = (cpu_after.0 - cpu_before.0).as_secs_f64();
        report.cpu_system_seconds = (cpu_after.1 - cpu_before.1).as_secs_f64();
        Ok(())
    }

    /// The filesystem the reports name: the file's, or `s3` for an object.
    fn filesystem(&self) -> &'static str {
        match self.asked {
            Asked::File(file) => {
                sys_share::filesystem_magic(file.file().as_fd()).map_or("unknown", system::filesystem_name)
            }
            Asked::Object(_) => "s3",
        }
    }

    /// Has the service copy the first `len` bytes (all of them, as it had
    /// them) into the start of `range`; how it had them, or why it cannot
    /// fill this process's device memory.
    fn copy_through_service(
        &self,
        client: &Client,
        context: &Context,
        range: &DeviceRange<'_>,
        len: u64,
    ) -> Result<std::result::Result<Served, String>> {
        let name = self.asked.name();
        let (handle, offset) = match range.ipc_handle(context) {
            Ok(named) => named,
            Err(err) => {
                return Ok(Err(format!("the device memory cannot be shared with the service: {err}")))
            }
        };
        let ordinal = u32::try_from(context.ordinal())
            .map_err(|_| Error::new(ErrorKind::InvalidInput, "load", name, "no such device"))?;
        let target = DeviceTarget::new(ordinal, &handle.0, offset, len);
        let copied = match self.asked {
            Asked::File(file) => client.copy_file_to_device(file.file(), name, &target),
            // The service's HEAD pins the grant's ETag: another version fails there.
            Asked::Object(object) => client.copy_object_to_device(object, &target),
        };
        let (copied, served) = match copied {
            Ok(done) => done,
            Err(err) if err.kind() == ErrorKind::Cancelled => return Err(err),
            Err(err) if device_unreachable(&err) => {
                return Ok(Err(format!("the cache service cannot fill device memory: {err}")))
            }
            Err(err) => return Err(err),
        };
        if copied != len {
            return Err(Error::new(
                ErrorKind::Changed,
                "load",
                name,
                format!("the service copied {copied} bytes of the {len} the file had when asked: it changed"),
            ));
        }
        // The bytes must be those of the file as this process opened it (and,
        // in Python, read its header from): a write since, which the service
        // may have loaded, fails the load as it fails a direct one.
        if let Asked::File(file) = self.asked {
            file.check_unchanged(len)?;
        }
        Ok(Ok(served))
    }

    /// The report of a copy the service made: `len` bytes into memory of
    /// `context`'s device, from `began` (when the client began) until now.
    fn device_report(
        &self,
        context: &Context,
        len: u64,
        served: Served,
        began: (Instant, (Duration, Duration)),
    ) -> Result<LoadReport> {
        let (started, cpu_before) = began;
        let device = context.device_name().unwrap_or_default();
        let destination =
            format!("cuda:{} ({device}) via cache-service ({})", context.ordinal(), served.name());
        let mut report = handoff_report(
            self.asked.name(),
            len,
            started.elapsed().as_secs_f64(),
            destination,
            &self.options,
        );
        report.memory_reason =
            "device memory the cache service filled from its pinned copy of the file".into();
        report.filesystem = self.filesystem();
        self.charge_cpu(&mut report, cpu_before)?;
        Ok(report)
    }
}

/// Why a verified load does not take the service.
const NOT_VERIFIED: &str = "the cache service does not verify: a verified load reads the file itself";

/// Whether `err` says the service could not serve (gone, refused this
/// client, spoke nonsense, or ran out of descriptors, memory or threads of
/// its own, which this process may still have) rather than that the file
/// failed to load.
fn service_unusable(err: &Error) -> bool {
    // "request": the service refused the request itself (an older one
    // that knows no get-object, say), not the file.
    matches!(err.op(), "send request" | "receive buffer" | "connect" | "request")
        || matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN))
}

/// Whether `err` from a to-device request means the service cannot write
/// into this client's device memory (or cannot serve at all before it took
/// the request), where a direct load does the job instead.
fn device_unreachable(err: &Error) -> bool {
    DEVICE_UNREACHABLE_OPS.contains(&err.op())
        || matches!(err.op(), "send request" | "connect" | "request")
        || matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::EAGAIN))
}
