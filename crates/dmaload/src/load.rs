//! `load`: allocate a buffer and fill it with a file's bytes in one call,
//! the userspace form of seed 000's DMA_HEAP_ALLOC_AND_READ_FILE.
//!
//! The file is opened and checked once ([`crate::source`]); the buffer is
//! reserved up front and filled by the pipeline (the private `pipeline`'s
//! `host` and `staged` runs):
//! helper threads populate it gather by gather (`MADV_POPULATE_WRITE`, then
//! io_uring registration) while the engine fills the gathers already
//! populated, so T(total) ≈ T(first gather) + max(T(alloc), T(I/O));
//! gathers ramp up from one chunk, so T(first gather) is milliseconds. The
//! buffer is returned only once every byte has arrived and the file shows
//! no change since it was opened.

use std::io;
use std::path::Path;

use crate::buffer::Buffer;
use crate::device::{load_open_device, LoadedDevice};
use crate::dmabuf::{load_open_dmabuf, LoadedDmaBuf};
use crate::error::Result;
use crate::object::Object;
use crate::options::validate;
pub use crate::options::{
    default_populate_threads, Destination, LoadOptions, DEFAULT_CHUNK_SIZE, DEFAULT_GATHER_SIZE,
    DEFAULT_POOL_THREADS, DEFAULT_QUEUE_DEPTH,
};
pub use crate::pipeline::load_open_to_sink;
use crate::pipeline::{load_object_source, load_source};
pub use crate::report::LoadReport;
use crate::sink::{Sink, StagingRing};
use crate::source::OpenFile;

/// Loads the whole file at `path` into a host [`Buffer`] of the memory
/// `options.to` names. A device destination (`cuda:N`) is an
/// [`crate::ErrorKind::InvalidInput`] error: a device is loaded through a sink
/// ([`load_to_sink`] with [`crate::sink::CudaSink`]).
pub fn load(path: impl AsRef<Path>, options: &LoadOptions) -> Result<(Buffer, LoadReport)> {
    load_impl(path.as_ref(), 0, None, options)
}

/// Loads `len` bytes of the file at `path` from byte `offset` (neither needs
/// any alignment). A range that extends past the end of the file is an error.
pub fn load_range(
    path: impl AsRef<Path>,
    offset: u64,
    len: u64,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    load_impl(path.as_ref(), offset, Some(len), options)
}

/// Loads the file at `path` from byte `offset` (any alignment) to its end,
/// its length taken from the open file itself (so a file replaced at the
/// path between a `stat` and the load cannot change what "the end" means).
pub fn load_from(path: impl AsRef<Path>, offset: u64, options: &LoadOptions) -> Result<(Buffer, LoadReport)> {
    load_impl(path.as_ref(), offset, None, options)
}

/// Loads from a file the caller has already opened (any flags: it is
/// reopened through `/proc/self/fd`, so the caller's fd is never changed):
/// `len` bytes from `offset`, or to the end when `len` is `None`. The same
/// checks as a load by path apply (regular file or block device, changes
/// during the load detected).
pub fn load_fd(
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    validate(Path::new("fd"), options)?;
    options.check_host(Path::new("fd"))?;
    load_open(&OpenFile::from_fd(fd)?, offset, len, options)
}

/// Loads `len` bytes (to the end when `None`) from `offset` of a file
/// already opened once with [`OpenFile`] (by path or from a caller's fd),
/// for a caller that looked at the open file first (its length, a
/// header): the bytes come from that same open file.
pub fn load_open(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    validate(file.path(), options)?;
    options.check_host(file.path())?;
    load_source(file, offset, len, options)
}

fn load_impl(
    path: &Path,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Buffer, LoadReport)> {
    validate(path, options)?;
    options.check_host(path)?;
    load_source(&OpenFile::open(path)?, offset, len, options)
}

/// Loads `len` bytes of the file at `path` from `offset` (to the end when
/// `len` is `None`) through the staging slots of `ring` into `sink`: the
/// pipeline's staged destination (GPU memory, caller memory, a dma-heap
/// mapping). The ring is the only host memory the load uses, whatever the
/// file size; it may serve any number of loads, one at a time. The sink has
/// received every byte when this returns `Ok`; after an error it may hold
/// part of them, which the caller must not use. A file whose direct-I/O
/// alignment is larger than a slot is read buffered (a fallback in the
/// report), or in `direct` mode is an [`crate::ErrorKind::DirectIoUnavailable`]
/// error.
pub fn load_to_sink(
    path: impl AsRef<Path>,
    offset: u64,
    len: Option<u64>,
    ring: &mut StagingRing,
    sink: &mut dyn Sink,
    options: &LoadOptions,
) -> Result<LoadReport> {
    let file = OpenFile::open(path.as_ref())?;
    load_open_to_sink(&file, offset, len, ring, sink, options)
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

/// Loads `len` bytes (to the end when `None`) from `offset` of a file opened
/// once into whatever destination `options.to` names: the one entry every
/// destination shares, and what `dmaload load --to` runs. A host kind gives
/// [`Loaded::Host`] (as [`load_open`]), a dma-buf kind [`Loaded::DmaBuf`]
/// (as [`crate::load_dmabuf`]), `cuda:N` [`Loaded::Device`] (through a
/// pinned staging ring and [`crate::sink::CudaSink`]).
pub fn load_to(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Loaded, LoadReport)> {
    validate(file.path(), options)?;
    match &options.to {
        Destination::Cuda(ordinal) => {
            load_open_device(file, offset, len, *ordinal, options).map(|(d, r)| (Loaded::Device(d), r))
        }
        to if to.is_dmabuf() => {
            load_open_dmabuf(file, offset, len, options).map(|(d, r)| (Loaded::DmaBuf(d), r))
        }
        _ => load_source(file, offset, len, options).map(|(b, r)| (Loaded::Host(b), r)),
    }
}

/// Loads `len` bytes (to the end when `None`) from `offset` of an object
/// opened once with [`Object::open`] (`s3://BUCKET/KEY`: its size and ETag
/// looked up) into the destination `options.to` names: host memory so far
/// ([`Loaded::Host`]); a dma-buf or a device is an
/// [`crate::ErrorKind::InvalidInput`] error. Every GET pins the ETag the
/// open found, so an object replaced since is [`crate::ErrorKind::Changed`].
/// See docs/object-storage.md.
pub fn load_object(
    object: &Object,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(Loaded, LoadReport)> {
    let path = object.name();
    validate(path, options)?;
    if !options.to.is_host() {
        return Err(crate::Error::new(
            crate::ErrorKind::InvalidInput,
            "load",
            path,
            format!("an object loads into host memory so far, not {} (docs/object-storage.md)", options.to),
        ));
    }
    load_object_source(object, offset, len, options).map(|(b, r)| (Loaded::Host(b), r))
}
