//! CUDA devices as a destination: the driver API (`libcuda.so.1`), loaded
//! at run time, so dmaload needs no CUDA to build and only calls that need
//! a GPU fail, with a [`CudaError`] that says why.
//!
//! `DMALOAD_LIBCUDA=PATH` in the environment (read once, at the first CUDA
//! call) loads that file instead of `libcuda.so.1`: the tests point it at
//! the driver emulator in `tests/cuda-emu`. It is never set by default.
//!
//! ```no_run
//! use dmaload::cuda::{Context, DeviceBuffer, Event, PinnedStaging, Stream};
//!
//! let ctx = Context::primary(0)?; // cuda:0, the context PyTorch uses too
//! let mut gpu = DeviceBuffer::new(&ctx, 1 << 20)?;
//! let mut staging = PinnedStaging::new(&ctx, 1 << 20)?;
//! staging.write(0, &[7u8; 1 << 20])?;
//! let stream = Stream::new(&ctx)?;
//! staging.copy_to_device(0..1 << 20, &gpu.range(), 0, &stream)?;
//! let done = Event::new(&ctx)?;
//! done.record(&stream)?;
//! done.synchronize()?; // now the staging bytes may be rewritten
//! let mut back = vec![0u8; 16];
//! gpu.copy_to_host(0, &mut back)?;
//! # Ok::<(), dmaload::cuda::CudaError>(())
//! ```
//!
//! Every call makes its object's context current for its own duration and
//! then restores the calling thread's, so mixing dmaload with a CUDA runtime
//! user (PyTorch) on one thread never changes that user's current device.
//! Needs a driver for CUDA 11.0 (R450) or newer.

use std::io;

pub(crate) use crate::sys::cuda::copy_htod_async;
pub use crate::sys::cuda::{
    copy_timeout, device_count, driver_version, Context, CudaError, DeviceBuffer, DeviceRange, Event,
    IpcHandle, IpcMemory, PinnedStaging, RegisteredFile, StagingPins, Stream,
};

/// Keeps the [`CudaError`] (its [`CudaError::errno`] too, through
/// `get_ref()` and a downcast) with a kind from that errno: `OutOfMemory`
/// for ENOMEM, `InvalidInput` for EINVAL, `Unsupported` for a driver too
/// old (ENOSYS), the OS's kind for ENODEV (no driver or device), `Other`
/// for any other driver error.
impl From<CudaError> for io::Error {
    fn from(err: CudaError) -> io::Error {
        let kind = match err.errno() {
            libc::EIO => io::ErrorKind::Other,
            errno => io::Error::from_raw_os_error(errno).kind(),
        };
        io::Error::new(kind, err)
    }
}
