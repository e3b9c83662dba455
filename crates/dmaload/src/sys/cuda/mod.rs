//! The CUDA driver API, loaded at run time: `dlopen("libcuda.so.1")` (the
//! NVIDIA driver's user-space library) and `dlsym` of the few functions
//! dmaload calls, so the crate builds and runs without CUDA and only the
//! calls that need a GPU fail, saying why.
//!
//! `DMALOAD_LIBCUDA=PATH` in the environment makes dmaload open that file
//! instead (a test driver such as the emulator in `tests/cuda-emu`); it is
//! never set by default, and only dmaload's own handle is affected, unlike
//! `LD_LIBRARY_PATH`, which would also hand it to PyTorch's CUDA runtime.
//!
//! Symbols are the versioned names `cuda.h` maps the API names to
//! (`cuMemAlloc` is `cuMemAlloc_v2`, ...); the newest of them,
//! `cuDevicePrimaryCtxRelease_v2`, needs CUDA 11.0 (driver R450) or newer.
//! Types, flags, attributes and `CUresult` codes are those of `cuda.h`,
//! unchanged from CUDA 11.4 to 13.0.
//!
//! Every call runs with the object's context current and leaves the
//! thread's own current context as it found it (`cuCtxPushCurrent` and
//! `cuCtxPopCurrent` around it, in `Context::enter`), so
//! dmaload never changes the device a caller's CUDA runtime (PyTorch) sees.
//!
//! # Safety
//!
//! * A [`Context`] retains its device's primary context; everything made in
//!   it (streams, events, allocations, registrations) holds a `Context`, so
//!   the context outlives them all.
//! * Device memory is written only through a [`DeviceRange`]: from a
//!   [`DeviceBuffer`] (which waits for the context before `cuMemFree`) or
//!   from [`DeviceRange::from_raw`], whose caller promises the memory stays
//!   allocated while copies into it may run.
//! * Host memory is pinned by a [`PinnedStaging`] (all at once, or unit
//!   by unit as copies first need it, through its [`StagingPins`]), which
//!   owns its mapping and waits for its context before unpinning (and
//!   registers nothing after its drop began), so no copy reads
//!   pages the driver no longer holds; an unpinned source is copied by the
//!   driver into its own staging memory before the copy call returns.
//! * Waiting for copies is bounded: a copy that does not complete within
//!   [`copy_timeout`] (`DMALOAD_CUDA_TIMEOUT` seconds, default 60) fails
//!   the wait with ETIMEDOUT and gives the device up for the process
//!   ([`Context::is_wedged`]). From then on nothing made in it is waited
//!   for or freed: streams, events, device allocations, pinned memory and
//!   its mapping are leaked to the driver, as a copy may still touch them.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::OnceLock;
use std::time::Duration;

use super::mem::{HugePageAdvice, Mapping, MappingWriter};

/// `CUresult` (`enum cudaError_enum`, 32 bits).
type CUresult = c_int;
/// `CUdevice`: a device handle (`int`).
type CUdevice = c_int;
/// `CUdeviceptr` (`CUdeviceptr_v2`: `unsigned long long` on LP64).
type CUdeviceptr = u64;
/// `CUcontext`, `CUstream`, `CUevent`: pointers to opaque driver structs.
type CUcontext = *mut c_void;
type CUstream = *mut c_void;
type CUevent = *mut c_void;
/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct CUipcMemHandle {
    reserved: [u8; 64],
}

// `CUresult` values (cuda.h, `enum cudaError_enum`).
const CUDA_SUCCESS: CUresult = 0;
const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
const CUDA_ERROR_STUB_LIBRARY: CUresult = 34;
const CUDA_ERROR_DEVICE_UNAVAILABLE: CUresult = 46;
const CUDA_ERROR_NO_DEVICE: CUresult = 100;
const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
const CUDA_ERROR_NOT_READY: CUresult = 600;
const CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: CUresult = 803;
const CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: CUresult = 804;

/// How long dmaload waits for one copy (an event or a stream) before it
/// gives the device up: `DMALOAD_CUDA_TIMEOUT` in seconds (a positive
/// number), else 60. A 16 MiB copy takes well under a millisecond over
/// PCIe; a copy queued a minute ago that has not run means a device or
/// driver that stopped answering, and waiting on would hang the caller.
pub fn copy_timeout() -> Duration {
    static TIMEOUT: OnceLock<Duration> = OnceLock::new();
    *TIMEOUT.get_or_init(|| {
        std::env::var("DMALOAD_CUDA_TIMEOUT")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs(60))
    })
}

/// `CU_STREAM_NON_BLOCKING` (`CUstream_flags`): no implicit ordering with
/// the legacy default stream, which other libraries' work may be on.
const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING` (`CUevent_flags`): the cheapest event.
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context, not only the
/// one current at registration.
const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;

// `CUpointer_attribute` values and the type each one writes.
/// `unsigned int` (a `CUmemorytype`).
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_uint = 2;
/// `int`.
const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_uint = 9;
/// `CUdeviceptr`.
const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_uint = 11;
/// `size_t`.
const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_uint = 12;

// `CUmemorytype` values.
const CU_MEMORYTYPE_HOST: c_uint = 1;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;
const CU_MEMORYTYPE_ARRAY: c_uint = 3;
const CU_MEMORYTYPE_UNIFIED: c_uint = 4;

/// The library's soname: the driver installs it; the toolkit ships only a
/// stub (`CUDA_ERROR_STUB_LIBRARY`).
const LIBCUDA: &CStr = c"libcuda.so.1";

/// The oldest driver whose `libcuda.so.1` exports every symbol below.
const MINIMUM_DRIVER: &str = "CUDA 11.0, NVIDIA driver 450";

/// Declares the table of driver functions and its resolver: each entry is
/// a field, the exported symbol, and the argument types of its `cuda.h`
/// prototype (every one returns `CUresult`).
macro_rules! driver_api {
    ($($field:ident = $symbol:literal ($($arg:ty),*);)*) => {
        /// The driver functions dmaload calls, resolved once per process.
        struct Api {
            $($field: unsafe extern "C" fn($($arg),*) -> CUresult,)*
        }

        impl Api {
            /// Resolves every function, or names the first one missing.
            fn resolve(lib: NonNull<c_void>) -> Result<Api, CudaError> {
                Ok(Api {
                    $($field: {
                        let address = symbol(lib, $symbol)?;
                        // SAFETY: `address` is the non-NULL address of the
                        // exported driver function `$symbol`, whose cuda.h
                        // prototype is exactly this function-pointer type.
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CUresult>(
                                address,
                            )
                        }
                    },)*
                })
            }
        }
    };
}

driver_api! {
    init = c"cuInit" (c_uint);
    driver_get_version = c"cuDriverGetVersion" (*mut c_int);
    get_error_name = c"cuGetErrorName" (CUresult, *mut *const c_char);
    get_error_string = c"cuGetErrorString" (CUresult, *mut *const c_char);
    device_get_count = c"cuDeviceGetCount" (*mut c_int);
    device_get = c"cuDeviceGet" (*mut CUdevice, c_int);
    device_get_name = c"cuDeviceGetName" (*mut c_char, c_int, CUdevice);
    primary_ctx_retain = c"cuDevicePrimaryCtxRetain" (*mut CUcontext, CUdevice);
    primary_ctx_release = c"cuDevicePrimaryCtxRelease_v2" (CUdevice);
    ctx_get_current = c"cuCtxGetCurrent" (*mut CUcontext);
    ctx_set_current = c"cuCtxSetCurrent" (CUcontext);
    ctx_push_current = c"cuCtxPushCurrent_v2" (CUcontext);
    ctx_pop_current = c"cuCtxPopCurrent_v2" (*mut CUcontext);
    ctx_synchronize = c"cuCtxSynchronize" ();
    mem_get_info = c"cuMemGetInfo_v2" (*mut usize, *mut usize);
    mem_alloc = c"cuMemAlloc_v2" (*mut CUdeviceptr, usize);
    mem_free = c"cuMemFree_v2" (CUdeviceptr);
    memset_d8 = c"cuMemsetD8_v2" (CUdeviceptr, c_uchar, usize);
    memcpy_htod_async = c"cuMemcpyHtoDAsync_v2" (CUdeviceptr, *const c_void, usize, CUstream);
    memcpy_dtoh = c"cuMemcpyDtoH_v2" (*mut c_void, CUdeviceptr, usize);
    mem_host_register = c"cuMemHostRegister_v2" (*mut c_void, usize, c_uint);
    mem_host_unregister = c"cuMemHostUnregister" (*mut c_void);
    ipc_get_mem_handle = c"cuIpcGetMemHandle" (*mut CUipcMemHandle, CUdeviceptr);
    ipc_open_mem_handle = c"cuIpcOpenMemHandle_v2" (*mut CUdeviceptr, CUipcMemHandle, c_uint);
    ipc_close_mem_handle = c"cuIpcCloseMemHandle" (CUdeviceptr);
    pointer_get_attribute = c"cuPointerGetAttribute" (*mut c_void, c_uint, CUdeviceptr);
    stream_create = c"cuStreamCreate" (*mut CUstream, c_uint);
    stream_synchronize = c"cuStreamSynchronize" (CUstream);
    stream_destroy = c"cuStreamDestroy_v2" (CUstream);
    event_create = c"cuEventCreate" (*mut CUevent, c_uint);
    event_record = c"cuEventRecord" (CUevent, CUstream);
    event_query = c"cuEventQuery" (CUevent);
    event_destroy = c"cuEventDestroy_v2" (CUevent);
}

/// `dlsym(3)` of `name` in the driver library.
fn symbol(lib: NonNull<c_void>, name: &CStr) -> Result<*mut c_void, CudaError> {
    // SAFETY: `lib` is a handle from dlopen that is never closed, and
    // `name` is NUL-terminated.
    let address = unsafe { libc::dlsym(lib.as_ptr(), name.as_ptr()) };
    if address.is_null() {
        let name = name.to_string_lossy();
        return Err(CudaError::new(
            "dlsym",
            format!(
                "{} has no {name}: this NVIDIA driver is older than dmaload needs ({MINIMUM_DRIVER} or newer)",
                LIBCUDA.to_string_lossy()
            ),
            libc::ENOSYS,
        ));
    }
    Ok(address)
}

/// The text of the last `dlopen`/`dlsym` failure on this thread.
fn dlerror_text() -> String {
    // SAFETY: dlerror takes no arguments.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        return format!("{} could not be loaded", LIBCUDA.to_string_lossy());
    }
    // SAFETY: dlerror returned a NUL-terminated string that stays valid
    // until the next dl* call on this thread; it is copied at once.
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

/// The driver library, loaded once per process, and `cuInit`'s outcome.
struct Driver {
    api: Api,
    init: Result<(), CudaError>,
}

static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();

/// The environment variable naming a driver library to open instead of
/// `libcuda.so.1`.
const LIBCUDA_OVERRIDE: &str = "DMALOAD_LIBCUDA";

/// `dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)` (or of `$DMALOAD_LIBCUDA`),
/// every symbol resolved, then `cuInit(0)`.
fn load_driver() -> Result<Driver, CudaError> {
    let chosen = std::env::var_os(LIBCUDA_OVERRIDE).filter(|path| !path.is_empty());
    let name = match &chosen {
        Some(path) => std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
            .map_err(|_| {
                CudaError::invalid("dlopen", format!("{LIBCUDA_OVERRIDE}={path:?} contains a NUL byte"))
            })?,
        None => LIBCUDA.to_owned(),
    };
    // dlopen of a FIFO waits for a writer for good; a missing file is left
    // to dlopen's own error.
    if let Some(kind) = chosen.as_ref().and_then(|path| std::fs::metadata(path).ok()).map(|m| m.file_type()) {
        if !kind.is_file() {
            let path = chosen.as_ref().map(|p| p.to_string_lossy()).unwrap_or_default();
            return Err(CudaError::invalid(
                "dlopen",
                format!("{LIBCUDA_OVERRIDE}={path} is not a regular file"),
            ));
        }
    }
    // SAFETY: the name is NUL-terminated; loading runs the library's
    // initialisers, which need nothing from the caller.
    let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    let Some(lib) = NonNull::new(lib) else {
        let why = match &chosen {
            Some(path) => {
                format!("{} (the driver {LIBCUDA_OVERRIDE}={} names)", dlerror_text(), path.to_string_lossy())
            }
            None => format!(
                "{} (no NVIDIA driver is installed, or its {} is not where the dynamic loader looks: \
                 ldconfig, LD_LIBRARY_PATH)",
                dlerror_text(),
                LIBCUDA.to_string_lossy()
            ),
        };
        return Err(CudaError::new("dlopen", why, libc::ENODEV));
    };
    let api = Api::resolve(lib)?;
    // SAFETY: cuInit takes a flags word (0 is the only valid one) and no pointers.
    let code = unsafe { (api.init)(0) };
    let init = api.check("cuInit", code);
    Ok(Driver { api, init })
}

/// The loaded driver library (whether or not `cuInit` succeeded).
fn library() -> Result<&'static Api, CudaError> {
    match DRIVER.get_or_init(load_driver) {
        Ok(driver) => Ok(&driver.api),
        Err(err) => Err(err.clone()),
    }
}

/// The initialised driver.
fn driver() -> Result<&'static Api, CudaError> {
    match DRIVER.get_or_init(load_driver) {
        Ok(Driver { api, init: Ok(()) }) => Ok(api),
        Ok(Driver { init: Err(err), .. }) | Err(err) => Err(err.clone()),
    }
}

impl Api {
    /// `Ok` for `CUDA_SUCCESS`, else the error `op` failed with.
    fn check(&self, op: &'static str, code: CUresult) -> Result<(), CudaError> {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(op, code))
        }
    }

    /// The error `op` failed with: the driver's own name and description of
    /// `code` (`cuGetErrorName`, `cuGetErrorString`), and what to do about
    /// the codes that have a usual cause.
    fn error(&self, op: &'static str, code: CUresult) -> CudaError {
        let name = error_text(self.get_error_name, code);
        let text = error_text(self.get_error_string, code);
        let mut message = match (name, text) {
            (Some(name), Some(text)) => format!("{name} ({text})"),
            (Some(name), None) => name,
            _ => format!("CUresult {code}, which this driver does not know"),
        };
        if let Some(hint) = hint(code) {
            message.push_str("; ");
            message.push_str(hint);
        }
        let errno = match code {
            CUDA_ERROR_OUT_OF_MEMORY => libc::ENOMEM,
            CUDA_ERROR_NO_DEVICE
            | CUDA_ERROR_INVALID_DEVICE
            | CUDA_ERROR_STUB_LIBRARY
            | CUDA_ERROR_DEVICE_UNAVAILABLE
            | CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
            | CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => libc::ENODEV,
            _ => libc::EIO,
        };
        CudaError { op, code: Some(code), message, errno }
    }

    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<usize, CudaError> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer for the call.
        self.check("cuDeviceGetCount", unsafe { (self.device_get_count)(&mut count) })?;
        Ok(usize::try_from(count).unwrap_or(0))
    }
}

/// `cuGetErrorName` or `cuGetErrorString` of `code`, if the driver knows it.
fn error_text(
    lookup: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
    code: CUresult,
) -> Option<String> {
    let mut text: *const c_char = ptr::null();
    // SAFETY: `text` is a valid out-pointer; the lookup needs no cuInit.
    if unsafe { lookup(code, &mut text) } != CUDA_SUCCESS || text.is_null() {
        return None;
    }
    // SAFETY: on success the driver points `text` at a static NUL-terminated string.
    Some(unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
}

/// What a user can do about the codes that have one usual cause.
fn hint(code: CUresult) -> Option<&'static str> {
    match code {
        CUDA_ERROR_NO_DEVICE => Some(
            "no NVIDIA GPU is visible to this process (check nvidia-smi, CUDA_VISIBLE_DEVICES and \
             access to /dev/nvidia*)",
        ),
        CUDA_ERROR_STUB_LIBRARY => Some(
            "the libcuda.so.1 loaded is the CUDA toolkit's stub, not the NVIDIA driver's \
             (install the driver, or take the stubs directory out of LD_LIBRARY_PATH)",
        ),
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => Some(
            "libcuda.so.1 and the loaded nvidia kernel module are different versions \
             (reboot, or reload the module after the driver update)",
        ),
        CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => Some(
            "the CUDA forward-compatibility libcuda.so.1 in use does not support this GPU \
             (use the driver's own libcuda.so.1)",
        ),
        CUDA_ERROR_DEVICE_UNAVAILABLE => Some(
            "the GPU is unavailable to this process (exclusive-process compute mode with another \
             process on it?)",
        ),
        _ => None,
    }
}

/// A failed CUDA operation: what was being done and why, in words a user
/// can act on (no driver, a driver too old, no device, the driver's own
/// name and description of its error code, a range that does not fit).
#[derive(Debug, Clone)]
pub struct CudaError {
    op: &'static str,
    code: Option<i32>,
    message: String,
    errno: i32,
}

impl CudaError {
    /// An error that is not a driver return code.
    pub(crate) fn new(op: &'static str, message: String, errno: i32) -> CudaError {
        CudaError { op, code: None, message, errno }
    }

    /// An invalid argument (EINVAL).
    fn invalid(op: &'static str, message: String) -> CudaError {
        CudaError::new(op, message, libc::EINVAL)
    }

    /// The call that failed: a driver function without its `_v2` suffix
    /// ("cuMemcpyHtoDAsync"), or "dlopen", "dlsym", "mmap", or the check that
    /// refused its arguments.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The driver's `CUresult`, when a driver call failed.
    pub fn code(&self) -> Option<i32> {
        self.code
    }

    /// Why, without the operation.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The errno that best describes the error, for bindings that need one:
    /// ENODEV without a driver or device, ENOSYS for a driver too old,
    /// ENOMEM when the GPU is out of memory, EINVAL for arguments dmaload
    /// refused, EIO for any other driver error.
    pub fn errno(&self) -> i32 {
        self.errno
    }
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.op, self.message)
    }
}

impl std::error::Error for CudaError {}

/// `cuDriverGetVersion`: the CUDA version the installed driver supports,
/// as 1000 × major + 10 × minor (12040 for 12.4). Needs the driver library
/// but no device.
pub fn driver_version() -> Result<i32, CudaError> {
    let api = library()?;
    let mut version: c_int = 0;
    // SAFETY: `version` is a valid out-pointer for the call.
    api.check("cuDriverGetVersion", unsafe { (api.driver_get_version)(&mut version) })?;
    Ok(version)
}

/// `cuDeviceGetCount`: the CUDA devices this process can use (after
/// `CUDA_VISIBLE_DEVICES`). Without a device `cuInit` fails, and so does
/// this, with `CUDA_ERROR_NO_DEVICE`.
pub fn device_count() -> Result<usize, CudaError> {
    driver()?.device_count()
}

mod context;
mod memory;
mod stream;

pub use context::Context;
pub use memory::{
    copy_htod_async, DeviceBuffer, DeviceRange, IpcHandle, IpcMemory, PinnedStaging, RegisteredFile,
    StagingPins,
};
pub use stream::{Event, Stream};
