//! The one way into a load: a [`LoadRequest`] names where the bytes come
//! from (a path, a file opened once, a caller's fd, an object), which
//! range, and the options; one of its verbs runs it. [`load()`] is the
//! whole file at a path into a host [`Buffer`], the userspace form of
//! `DMA_HEAP_ALLOC_AND_READ_FILE`.
//!
//! ```no_run
//! use dmaload::{LoadOptions, LoadRequest};
//! let options = LoadOptions { to: "dma-heap:system".parse()?, ..LoadOptions::default() };
//! // 1 MiB from byte 4096, into whatever `options.to` names.
//! let (loaded, report) = LoadRequest::path("model.bin").range(4096, 1 << 20).options(&options).load()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A request is resolved once, before anything is opened: the options are
//! checked and the destination decided (a host buffer, a dma-buf, a
//! device, the caller's memory, a sink), so a refused request costs no
//! read. The file is opened and checked once ([`crate::source`]); a host
//! buffer is reserved up front and filled by the pipeline (the private
//! `pipeline`'s `host` and `staged` runs): helper threads populate it
//! gather by gather (`MADV_POPULATE_WRITE`, then io_uring registration)
//! while the engine fills the gathers already populated, so T(total) ≈
//! T(first gather) + max(T(alloc), T(I/O)); gathers ramp up from one
//! chunk, so T(first gather) is milliseconds. What a load made is handed
//! out only once every byte has arrived and the file shows no change
//! since it was opened.

use std::borrow::Cow;
use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use crate::buffer::Buffer;
use crate::device::{load_object_device, load_open_device, LoadedDevice};
use crate::dmabuf::{load_dmabuf, DmaBufInput, LoadedDmaBuf};
use crate::error::{Error, ErrorKind, Result};
use crate::into::fill_into;
use crate::object::Object;
use crate::options::validate;
pub use crate::options::{
    default_populate_threads, Destination, LoadOptions, DEFAULT_CHUNK_SIZE, DEFAULT_GATHER_SIZE,
    DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH,
};
use crate::pipeline::{fill_object, load_object_source, load_object_to_sink, load_open_to_sink, load_source};
pub use crate::report::LoadReport;
use crate::sink::{Sink, StagingRing};
use crate::source::OpenFile;
use crate::sys::mem::RawBytesMut;

/// Loads the whole file at `path` into a host [`Buffer`] of the memory
/// `options.to` names: `LoadRequest::path(path).options(options).to_buffer()`.
/// A dma-buf or device destination is an [`ErrorKind::InvalidInput`]
/// error (run [`LoadRequest::load`] for those).
pub fn load(path: impl AsRef<Path>, options: &LoadOptions) -> Result<(Buffer, LoadReport)> {
    LoadRequest::path(path.as_ref()).options(options).to_buffer()
}

/// What a load made, by the kind of destination `LoadOptions::to` named.
#[derive(Debug)]
pub enum Loaded {
    /// `auto` or a host memory kind: a [`Buffer`].
    Host(Buffer),
    /// `udmabuf`, `dma-heap:NAME` or `dmabuf`: a dma-buf whose fd the
    /// caller owns.
    DmaBuf(LoadedDmaBuf),
    /// `cuda:N`: an allocation on the device.
    Device(LoadedDevice),
}

impl Loaded {
    /// Hands `each` the loaded bytes in order: a host buffer's directly, a
    /// dma-buf's through a fresh SYNC-bracketed mapping, a device's copied
    /// back. For checking a load (a hash), not on its timed path.
    pub fn read_each(&self, mut each: impl FnMut(&[u8])) -> io::Result<()> {
        match self {
            Loaded::Host(buffer) => {
                buffer.chunks(64 << 20).for_each(each);
                Ok(())
            }
            Loaded::DmaBuf(dmabuf) => dmabuf.read_each(each),
            Loaded::Device(device) => device.read_each(&mut each),
        }
    }
}

/// Where a request's bytes come from.
#[derive(Clone, Copy)]
enum Input<'a> {
    Path(&'a Path),
    Open(&'a OpenFile),
    Fd(BorrowedFd<'a>),
    Object(&'a Object),
}

/// The destination a request resolved to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Host,
    DmaBuf,
    Device(usize),
}

/// A load to run: a source, a range of it and the options, built in any
/// order, then run by one verb. Every verb resolves the request the same
/// way before it opens anything: the options are checked (as
/// [`crate::check_load_options`] does) and the destination decided, once.
///
/// | verb | destination | gives |
/// |---|---|---|
/// | [`load`](Self::load) | whatever `options.to` names | [`Loaded`] |
/// | [`to_buffer`](Self::to_buffer) | a host memory kind (`auto`, `memfd`, ...) | [`Buffer`] |
/// | [`to_dmabuf`](Self::to_dmabuf) | `udmabuf`, `dma-heap:NAME`, `dmabuf` | [`LoadedDmaBuf`] |
/// | [`fill`](Self::fill), [`fill_raw`](Self::fill_raw), [`fill_arriving`](Self::fill_arriving) | memory the caller has | the report |
/// | [`to_sink`](Self::to_sink) | a [`Sink`], through a [`StagingRing`] | the report |
///
/// The range is the whole source unless [`range`](Self::range) says
/// otherwise; a range past the source's end is an error.
#[derive(Clone)]
pub struct LoadRequest<'a> {
    input: Input<'a>,
    offset: u64,
    len: Option<u64>,
    options: Cow<'a, LoadOptions>,
}

impl<'a> LoadRequest<'a> {
    fn new(input: Input<'a>) -> Self {
        LoadRequest { input, offset: 0, len: None, options: Cow::Owned(LoadOptions::default()) }
    }

    /// The file at `path`, opened when the request runs.
    pub fn path<P: AsRef<Path> + ?Sized>(path: &'a P) -> Self {
        Self::new(Input::Path(path.as_ref()))
    }

    /// A file opened once with [`OpenFile`] (by path or from a caller's
    /// fd), for a caller that looked at it first (its length, a header):
    /// the bytes come from that same open file, and a change to it since
    /// it was opened is an error.
    pub fn open(file: &'a OpenFile) -> Self {
        Self::new(Input::Open(file))
    }

    /// A file the caller has open (any flags: it is reopened through
    /// `/proc/self/fd`, so the caller's fd is never changed). The same
    /// checks as a load by path apply (a regular file or block device,
    /// changes during the load detected).
    pub fn fd(fd: BorrowedFd<'a>) -> Self {
        Self::new(Input::Fd(fd))
    }

    /// An object opened once with [`Object::open`] (`s3://BUCKET/KEY`: its
    /// size and ETag looked up). It loads by every verb: host memory, a
    /// device (`cuda:N`), a dma-buf, caller memory or a [`Sink`]; every GET
    /// pins the ETag the open found, so an object replaced since is
    /// [`ErrorKind::Changed`]. See docs/object-storage.md.
    pub fn object(object: &'a Object) -> Self {
        Self::new(Input::Object(object))
    }

    /// `len` bytes from byte `offset` (neither needs any alignment), or
    /// from `offset` to the end when `len` is `None`: the end as the open
    /// file sees it, so a file replaced at the path meanwhile cannot change
    /// what "the end" means.
    pub fn range(mut self, offset: u64, len: impl Into<Option<u64>>) -> Self {
        (self.offset, self.len) = (offset, len.into());
        self
    }

    /// The options (the defaults unless given).
    pub fn options(mut self, options: &'a LoadOptions) -> Self {
        self.options = Cow::Borrowed(options);
        self
    }

    /// The name errors give the source before it is open.
    fn name(&self) -> &Path {
        match self.input {
            Input::Path(path) => path,
            Input::Open(file) => file.path(),
            Input::Fd(_) => Path::new("fd"),
            Input::Object(object) => object.name(),
        }
    }

    /// The one resolution every verb runs before it opens anything: the
    /// options checked, and the destination `options.to` names, refused
    /// where the verb (`wanted`) cannot deliver it or the source cannot
    /// reach it.
    fn resolve(&self, wanted: Option<Target>) -> Result<Target> {
        let (name, options) = (self.name(), &*self.options);
        validate(name, options)?;
        let target = match &options.to {
            Destination::Cuda(ordinal) => Target::Device(*ordinal),
            to if to.is_dmabuf() => Target::DmaBuf,
            _ => Target::Host,
        };
        match wanted {
            Some(Target::Host) => options.check_host(name)?,
            Some(Target::DmaBuf) => options.check_dmabuf(name)?,
            _ => {}
        }
        Ok(target)
    }

    /// Runs `run` on the request's file, opened now where the request
    /// named a path or an fd. An object is refused: `what` cannot read one.
    fn with_file<T>(&self, what: &str, run: impl FnOnce(&OpenFile) -> Result<T>) -> Result<T> {
        match self.input {
            Input::Path(path) => run(&OpenFile::open(path)?),
            Input::Open(file) => run(file),
            Input::Fd(fd) => run(&OpenFile::from_fd(fd)?),
            Input::Object(object) => Err(Error::new(
                ErrorKind::InvalidInput,
                "load",
                object.name(),
                format!("an object cannot be loaded {what} yet (docs/object-storage.md)"),
            )),
        }
    }

    /// Loads the range into whatever destination `options.to` names: the
    /// verb every front end runs (`dmaload load --to`, C's `dmaload_load`,
    /// Python's loads). A host kind gives [`Loaded::Host`], a dma-buf kind
    /// [`Loaded::DmaBuf`] (as [`to_dmabuf`](Self::to_dmabuf)), `cuda:N`
    /// [`Loaded::Device`] (through a pinned staging ring and
    /// [`crate::sink::CudaSink`]; a range larger than the device's free
    /// memory is an [`ErrorKind::OutOfMemory`] error before any read).
    pub fn load(&self) -> Result<(Loaded, LoadReport)> {
        let target = self.resolve(None)?;
        let (offset, len, options) = (self.offset, self.len, &*self.options);
        if let Input::Object(object) = self.input {
            return match target {
                Target::Device(ordinal) => load_object_device(object, offset, len, ordinal, options)
                    .map(|(d, r)| (Loaded::Device(d), r)),
                Target::DmaBuf => load_dmabuf(DmaBufInput::Object(object), offset, len, options)
                    .map(|(d, r)| (Loaded::DmaBuf(d), r)),
                Target::Host => {
                    load_object_source(object, offset, len, options).map(|(b, r)| (Loaded::Host(b), r))
                }
            };
        }
        self.with_file("there", |file| match target {
            Target::Device(ordinal) => {
                load_open_device(file, offset, len, ordinal, options).map(|(d, r)| (Loaded::Device(d), r))
            }
            Target::DmaBuf => load_dmabuf(DmaBufInput::File(file), offset, len, options)
                .map(|(d, r)| (Loaded::DmaBuf(d), r)),
            Target::Host => load_source(file, offset, len, options).map(|(b, r)| (Loaded::Host(b), r)),
        })
    }

    /// Loads the range into a new host [`Buffer`] of the memory
    /// `options.to` names; a dma-buf or device destination is an
    /// [`ErrorKind::InvalidInput`] error naming the verb that loads it.
    pub fn to_buffer(&self) -> Result<(Buffer, LoadReport)> {
        self.resolve(Some(Target::Host))?;
        let (offset, len, options) = (self.offset, self.len, &*self.options);
        if let Input::Object(object) = self.input {
            return load_object_source(object, offset, len, options);
        }
        self.with_file("there", |file| load_source(file, offset, len, options))
    }

    /// Loads the range into a new dma-buf of the kind `options.to` names
    /// (`udmabuf`, `dma-heap:NAME`, `dmabuf`; anything else is an
    /// [`ErrorKind::InvalidInput`] error). The dma-buf is handed out only
    /// once every byte is in and the file showed no change meanwhile; the
    /// report's `destination` says which producer made it, and for
    /// `dmabuf` why.
    pub fn to_dmabuf(&self) -> Result<(LoadedDmaBuf, LoadReport)> {
        self.resolve(Some(Target::DmaBuf))?;
        let (offset, len, options) = (self.offset, self.len, &*self.options);
        if let Input::Object(object) = self.input {
            return load_dmabuf(DmaBufInput::Object(object), offset, len, options);
        }
        self.with_file("into a dma-buf", |file| load_dmabuf(DmaBufInput::File(file), offset, len, options))
    }

    /// Loads `dst.len()` bytes from the range's offset into memory the
    /// caller already has; `options.to` plays no part, and a range whose
    /// length is not `dst.len()` is an [`ErrorKind::InvalidInput`] error.
    /// Where the memory lines up with the file the engine reads straight
    /// into it, otherwise through a staging ring (docs/library.md). On
    /// error `dst` holds an unspecified mix of old and new bytes and must
    /// not be used as loaded.
    pub fn fill(&self, dst: &mut [u8]) -> Result<LoadReport> {
        self.fill_into(dst.into(), None)
    }

    /// [`fill`](Self::fill) of memory that others may touch during the
    /// load (a Python buffer export filled with the GIL released; see
    /// [`RawBytesMut::from_raw_parts`] for what the caller promises): the
    /// load writes it by raw copies and kernel reads only, never through a
    /// Rust slice.
    pub fn fill_raw(&self, dst: RawBytesMut<'_>) -> Result<LoadReport> {
        self.fill_into(dst, None)
    }

    /// [`fill`](Self::fill) that says how far the load has come while it
    /// runs, so that a consumer can use the first bytes while later ones
    /// are still being read: `arrived(n)` (called from a thread of the
    /// load) means bytes `0..n` of `dst` all hold the file's bytes, and the
    /// file showed no write since it was opened when they were counted.
    /// `n` grows gather by gather where the engine reads straight into
    /// `dst` from its first byte (memory and offset aligned, as a
    /// page-aligned `dst` and an offset that is a multiple of 4096 are);
    /// otherwise it comes once, at the end. A retried load (buffered after
    /// a refused direct read, docs/guarantees.md) counts from 0 again,
    /// rewriting the bytes it reported with the same ones. A load that
    /// fails reports nothing past the bytes it had.
    pub fn fill_arriving<'d>(
        &self,
        dst: impl Into<RawBytesMut<'d>>,
        arrived: &(dyn Fn(u64) + Sync),
    ) -> Result<LoadReport> {
        let dst = dst.into();
        let total = dst.len() as u64;
        let report = self.fill_into(dst, Some(arrived))?;
        arrived(total);
        Ok(report)
    }

    fn fill_into(&self, dst: RawBytesMut<'_>, arrived: Option<&(dyn Fn(u64) + Sync)>) -> Result<LoadReport> {
        validate(self.name(), &self.options)?;
        if self.len.is_some_and(|len| len != dst.len() as u64) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "load",
                self.name(),
                format!(
                    "a range of {} bytes does not fill {} bytes of memory",
                    self.len.unwrap_or(0),
                    dst.len()
                ),
            ));
        }
        if let Input::Object(object) = self.input {
            return fill_object(object, self.offset, dst, &self.options, arrived);
        }
        self.with_file("into caller memory", |file| fill_into(file, self.offset, dst, &self.options, arrived))
    }

    /// Loads the range through the staging slots of `ring` into `sink`:
    /// the pipeline's staged destination (GPU memory, caller memory, a
    /// dma-heap mapping). The ring is the only host memory the load uses,
    /// whatever the file size; it may serve any number of loads, one at a
    /// time. The sink has received every byte when this returns `Ok`;
    /// after an error it may hold part of them, which the caller must not
    /// use. `options.to` plays no part. A file whose direct-I/O alignment
    /// is larger than a slot is read buffered (a fallback in the report),
    /// or in `direct` mode is an [`ErrorKind::DirectIoUnavailable`] error.
    /// An object's GETs receive into the slots as a file's reads do.
    pub fn to_sink(&self, ring: &mut StagingRing, sink: &mut dyn Sink) -> Result<LoadReport> {
        validate(self.name(), &self.options)?;
        sink.staging_ring(ring);
        if let Input::Object(object) = self.input {
            return load_object_to_sink(object, self.offset, self.len, ring, sink, &self.options);
        }
        self.with_file("through a sink", |file| {
            load_open_to_sink(file, self.offset, self.len, ring, sink, &self.options)
        })
    }
}
