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
//! * Host memory is pinned by a [`HostRegistration`] (borrowing the
//!   mapping, so the mapping outlives it) or a [`PinnedStaging`] (owning
//!   it). Both wait for their context before unpinning, so no copy reads
//!   pages the driver no longer holds; an unpinned source is copied by the
//!   driver into its own staging memory before the copy call returns.

use std::ffi::{c_char, c_int, c_uchar, c_uint, c_void, CStr};
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

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
    pointer_get_attribute = c"cuPointerGetAttribute" (*mut c_void, c_uint, CUdeviceptr);
    stream_create = c"cuStreamCreate" (*mut CUstream, c_uint);
    stream_synchronize = c"cuStreamSynchronize" (CUstream);
    stream_destroy = c"cuStreamDestroy_v2" (CUstream);
    event_create = c"cuEventCreate" (*mut CUevent, c_uint);
    event_record = c"cuEventRecord" (CUevent, CUstream);
    event_query = c"cuEventQuery" (CUevent);
    event_synchronize = c"cuEventSynchronize" (CUevent);
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

/// The retained primary context and the device it belongs to.
struct ContextInner {
    api: &'static Api,
    raw: CUcontext,
    device: CUdevice,
    ordinal: usize,
}

// SAFETY: a CUcontext is a handle the driver API accepts from any thread;
// the primary context stays retained until this value drops.
unsafe impl Send for ContextInner {}
// SAFETY: as above; the handle is never changed after construction.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: releases the one retain taken in `Context::primary`;
        // every object made in the context held a `Context`, so none is left.
        unsafe { (self.api.primary_ctx_release)(self.device) };
    }
}

/// A device's primary context (`cuDevicePrimaryCtxRetain`): the context the
/// CUDA runtime (and so PyTorch) uses for that device, retained for as long
/// as any clone of this value, or anything made in it, lives.
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Context(cuda:{})", self.inner.ordinal)
    }
}

/// The context made current for one call, popped again on drop. Not
/// `Send`: the context stack is per thread.
struct Current {
    api: &'static Api,
    pushed: bool,
    _thread: PhantomData<*const ()>,
}

impl Drop for Current {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: CUcontext = ptr::null_mut();
            // SAFETY: pops the context `Context::enter` pushed on this thread
            // (the guard cannot leave it); `popped` is a valid out-pointer.
            unsafe { (self.api.ctx_pop_current)(&mut popped) };
        }
    }
}

impl Context {
    /// Retains the primary context of device `ordinal` (cuda:`ordinal`),
    /// after `cuInit` and a check that the device exists.
    pub fn primary(ordinal: usize) -> Result<Context, CudaError> {
        let api = driver()?;
        let count = api.device_count()?;
        if ordinal >= count {
            return Err(no_such_device(ordinal, count));
        }
        // `ordinal < count`, which is a c_int.
        let index = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
        let mut device: CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer for the call.
        api.check("cuDeviceGet", unsafe { (api.device_get)(&mut device, index) })?;
        let mut raw: CUcontext = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and `device` a handle from cuDeviceGet.
        api.check("cuDevicePrimaryCtxRetain", unsafe { (api.primary_ctx_retain)(&mut raw, device) })?;
        Ok(Context { inner: Arc::new(ContextInner { api, raw, device, ordinal }) })
    }

    /// The device's index: this is cuda:`ordinal()`.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Whether `other` is the same context.
    pub fn same(&self, other: &Context) -> bool {
        self.inner.raw == other.inner.raw
    }

    /// `cuCtxSetCurrent`: makes this context current on the calling thread,
    /// for code there that calls CUDA itself. dmaload's own calls do not
    /// need it: each makes its context current for its own duration
    /// (`cuCtxPushCurrent`) and then restores the thread's (`cuCtxPopCurrent`).
    pub fn make_current(&self) -> Result<(), CudaError> {
        let api = self.inner.api;
        // SAFETY: the context is retained while `self` lives.
        api.check("cuCtxSetCurrent", unsafe { (api.ctx_set_current)(self.inner.raw) })
    }

    /// Makes the context current on this thread until the guard drops:
    /// nothing when it already is (`cuCtxGetCurrent`), else
    /// `cuCtxPushCurrent` now and `cuCtxPopCurrent` on drop, so the thread's
    /// current context (and the CUDA runtime's current device) is as before.
    fn enter(&self) -> Result<Current, CudaError> {
        let api = self.inner.api;
        let mut current: CUcontext = ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer for the call.
        api.check("cuCtxGetCurrent", unsafe { (api.ctx_get_current)(&mut current) })?;
        if current == self.inner.raw {
            return Ok(Current { api, pushed: false, _thread: PhantomData });
        }
        // SAFETY: the context is retained while `self` lives; the guard pops it.
        api.check("cuCtxPushCurrent", unsafe { (api.ctx_push_current)(self.inner.raw) })?;
        Ok(Current { api, pushed: true, _thread: PhantomData })
    }

    /// `cuDeviceGetName`: the device's marketing name.
    pub fn device_name(&self) -> Result<String, CudaError> {
        let api = self.inner.api;
        const LEN: usize = 256;
        let mut name = [0u8; LEN];
        // SAFETY: the buffer holds LEN bytes, the length passed.
        let code =
            unsafe { (api.device_get_name)(name.as_mut_ptr().cast(), LEN as c_int, self.inner.device) };
        api.check("cuDeviceGetName", code)?;
        let name = CStr::from_bytes_until_nul(&name).map(CStr::to_string_lossy).unwrap_or_default();
        Ok(name.into_owned())
    }

    /// `cuMemGetInfo`: (free, total) bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        let api = self.inner.api;
        let _current = self.enter()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers for the call.
        api.check("cuMemGetInfo", unsafe { (api.mem_get_info)(&mut free, &mut total) })?;
        Ok((free, total))
    }

    /// `cuCtxSynchronize`: waits for all work in the context, other
    /// libraries' included.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let _current = self.enter()?;
        self.synchronize_current()
    }

    /// `cuCtxSynchronize` with the context already current.
    fn synchronize_current(&self) -> Result<(), CudaError> {
        let api = self.inner.api;
        // SAFETY: cuCtxSynchronize takes no arguments.
        api.check("cuCtxSynchronize", unsafe { (api.ctx_synchronize)() })
    }

    /// Waits for the context (if it can still be made current) before a
    /// resource is freed; errors are the caller's to ignore.
    fn enter_and_drain(&self) -> Option<Current> {
        let current = self.enter().ok()?;
        let _ = self.synchronize_current();
        Some(current)
    }

    /// `cuPointerGetAttribute(attribute)` of `address`, with the context current.
    ///
    /// # Safety
    ///
    /// `T` must be the type the driver writes for `attribute`.
    unsafe fn pointer_attribute<T: Default>(
        &self,
        attribute: c_uint,
        address: CUdeviceptr,
    ) -> Result<T, CudaError> {
        let api = self.inner.api;
        let mut value = T::default();
        // SAFETY: `value` is a valid out-pointer of the attribute's type
        // (this function's contract).
        let code = unsafe { (api.pointer_get_attribute)((&mut value as *mut T).cast(), attribute, address) };
        api.check("cuPointerGetAttribute", code)?;
        Ok(value)
    }
}

/// The error for an ordinal past the devices this process sees.
fn no_such_device(ordinal: usize, count: usize) -> CudaError {
    let devices = match count {
        0 => "no CUDA device".to_owned(),
        1 => "1 CUDA device (cuda:0)".to_owned(),
        n => format!("{n} CUDA devices (cuda:0 to cuda:{})", n - 1),
    };
    let mut message = format!("cuda:{ordinal} asked for, but this process sees {devices}");
    if let Ok(visible) = std::env::var("CUDA_VISIBLE_DEVICES") {
        message.push_str(&format!("; CUDA_VISIBLE_DEVICES={visible} limits which GPUs it sees"));
    }
    CudaError::new("cuDeviceGet", message, libc::ENODEV)
}

/// A CUDA stream (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`): copies
/// queued on it run in order, beside other libraries' work on the legacy
/// default stream. Dropping it waits for its work (`cuStreamSynchronize`)
/// before `cuStreamDestroy`.
pub struct Stream {
    ctx: Context,
    raw: CUstream,
}

// SAFETY: a CUstream is a handle the driver API accepts from any thread,
// valid until the drop below; the context is retained by `ctx`.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises calls on one stream itself.
unsafe impl Sync for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream(cuda:{}, {:p})", self.ctx.ordinal(), self.raw)
    }
}

impl Stream {
    /// A new non-blocking stream in `ctx`.
    pub fn new(ctx: &Context) -> Result<Stream, CudaError> {
        let api = ctx.inner.api;
        let _current = ctx.enter()?;
        let mut raw: CUstream = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer for the call.
        api.check("cuStreamCreate", unsafe { (api.stream_create)(&mut raw, CU_STREAM_NON_BLOCKING) })?;
        Ok(Stream { ctx: ctx.clone(), raw })
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// `cuStreamSynchronize`: waits until all work queued so far is done.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        // SAFETY: the stream lives until `self` drops.
        api.check("cuStreamSynchronize", unsafe { (api.stream_synchronize)(self.raw) })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter();
        // SAFETY: the stream is live; waiting first means no copy queued on
        // it outlives this value.
        unsafe { (api.stream_synchronize)(self.raw) };
        // SAFETY: destroys the stream this value owns; nothing uses it after.
        unsafe { (api.stream_destroy)(self.raw) };
    }
}

/// A CUDA event (`cuEventCreate` with `CU_EVENT_DISABLE_TIMING`): a marker
/// recorded on a stream that completes when the stream reaches it.
pub struct Event {
    ctx: Context,
    raw: CUevent,
}

// SAFETY: a CUevent is a handle the driver API accepts from any thread,
// valid until the drop below; the context is retained by `ctx`.
unsafe impl Send for Event {}
// SAFETY: as above; the driver serialises calls on one event itself.
unsafe impl Sync for Event {}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event(cuda:{}, {:p})", self.ctx.ordinal(), self.raw)
    }
}

impl Event {
    /// A new event in `ctx`. Until recorded it counts as complete.
    pub fn new(ctx: &Context) -> Result<Event, CudaError> {
        let api = ctx.inner.api;
        let _current = ctx.enter()?;
        let mut raw: CUevent = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer for the call.
        api.check("cuEventCreate", unsafe { (api.event_create)(&mut raw, CU_EVENT_DISABLE_TIMING) })?;
        Ok(Event { ctx: ctx.clone(), raw })
    }

    /// `cuEventRecord`: the event completes once `stream` has done all the
    /// work queued on it before this call (replacing any earlier record).
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        // SAFETY: both handles are live for the call.
        api.check("cuEventRecord", unsafe { (api.event_record)(self.raw, stream.raw) })
    }

    /// `cuEventQuery`: whether the work before the last record is done
    /// (`CUDA_SUCCESS`) or not yet (`CUDA_ERROR_NOT_READY`).
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        // SAFETY: the event is live for the call.
        match unsafe { (api.event_query)(self.raw) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(api.error("cuEventQuery", code)),
        }
    }

    /// `cuEventSynchronize`: waits until the work before the last record is done.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        // SAFETY: the event is live for the call.
        api.check("cuEventSynchronize", unsafe { (api.event_synchronize)(self.raw) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter();
        // SAFETY: destroys the event this value owns (the driver frees it
        // once a pending record completes); nothing uses it after.
        unsafe { (api.event_destroy)(self.raw) };
    }
}

/// A span of device memory that copies may write: `len` bytes from device
/// address `ptr`. Borrowed from a [`DeviceBuffer`] or made from raw parts
/// by a caller who vouches for them ([`DeviceRange::from_raw`]).
#[derive(Debug)]
pub struct DeviceRange<'a> {
    ptr: CUdeviceptr,
    len: usize,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> DeviceRange<'a> {
    /// A range from a device address and length (a tensor's `data_ptr()`
    /// and byte size, say).
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be device memory of the device whose context
    /// the copies run in, allocated, and not freed for as long as copies
    /// into it may run (until a stream or event wait after the last one):
    /// that is longer than `'a` unless the copies are waited for within
    /// it. Nothing else may read or write the span meanwhile.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> DeviceRange<'a> {
        DeviceRange { ptr, len, _memory: PhantomData }
    }

    /// [`DeviceRange::from_raw`] after [`DeviceRange::validate`]: refuses
    /// spans that are not device memory of `ctx`'s device or run past the
    /// end of their allocation. Still unsafe: no check can tell how long the
    /// memory stays allocated, or who else uses it.
    ///
    /// # Safety
    ///
    /// As for [`DeviceRange::from_raw`].
    pub unsafe fn checked(ctx: &Context, ptr: u64, len: usize) -> Result<DeviceRange<'a>, CudaError> {
        DeviceRange::validate(ctx, ptr, len)?;
        Ok(DeviceRange { ptr, len, _memory: PhantomData })
    }

    /// Checks, with `cuPointerGetAttribute`, that `ptr..ptr + len` is device
    /// (or managed) memory of `ctx`'s device inside one allocation
    /// (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`/`RANGE_SIZE`). An allocation
    /// is what the driver handed out: a caching allocator's (PyTorch's)
    /// whole segment, not one tensor.
    pub fn validate(ctx: &Context, ptr: u64, len: usize) -> Result<(), CudaError> {
        const OP: &str = "check device range";
        if len == 0 {
            return Ok(());
        }
        let end = ptr.checked_add(len as u64).ok_or_else(|| {
            CudaError::invalid(OP, format!("{len} bytes at {ptr:#x} wrap the address space"))
        })?;
        let _current = ctx.enter()?;
        // SAFETY: MEMORY_TYPE writes an `unsigned int` (a CUmemorytype).
        let memory_type =
            match unsafe { ctx.pointer_attribute::<c_uint>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) } {
                Err(err) if err.code == Some(CUDA_ERROR_INVALID_VALUE) => {
                    return Err(CudaError {
                        op: OP,
                        message: format!(
                            "{ptr:#x} is not memory CUDA allocated or registered in this process ({})",
                            err.message
                        ),
                        errno: libc::EINVAL,
                        ..err
                    });
                }
                other => other?,
            };
        let kind = match memory_type {
            CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_UNIFIED => None,
            CU_MEMORYTYPE_HOST => Some("host memory registered with CUDA"),
            CU_MEMORYTYPE_ARRAY => Some("a CUDA array"),
            0 => Some("not memory CUDA allocated or registered in this process"),
            _ => Some("memory of an unknown CUDA type"),
        };
        if let Some(kind) = kind {
            return Err(CudaError::invalid(OP, format!("{ptr:#x} is {kind}: not device memory")));
        }
        // SAFETY: DEVICE_ORDINAL writes an `int`.
        let ordinal = unsafe { ctx.pointer_attribute::<c_int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) }?;
        if usize::try_from(ordinal).ok() != Some(ctx.ordinal()) {
            return Err(CudaError::invalid(
                OP,
                format!("{ptr:#x} is memory of cuda:{ordinal}, not of cuda:{}", ctx.ordinal()),
            ));
        }
        // SAFETY: RANGE_START_ADDR writes a `CUdeviceptr`.
        let start =
            unsafe { ctx.pointer_attribute::<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr) }?;
        // SAFETY: RANGE_SIZE writes a `size_t`.
        let size = unsafe { ctx.pointer_attribute::<usize>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr) }?;
        let alloc_end = start.saturating_add(size as u64);
        if start > ptr || end > alloc_end {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "{len} bytes at {ptr:#x} run {} bytes past the end of their allocation \
                     ({size} bytes at {start:#x})",
                    end.saturating_sub(alloc_end)
                ),
            ));
        }
        Ok(())
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Device memory this value owns: `cuMemAlloc`, and on drop a wait for the
/// context (so no copy into it is still running) and `cuMemFree`.
pub struct DeviceBuffer {
    ctx: Context,
    ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: a device address is usable from any thread with the context
// (kept alive by `ctx`) current, which every method makes it.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&self` methods only read the memory (copy_to_host).
unsafe impl Sync for DeviceBuffer {}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer(cuda:{}, {} bytes at {:#x})", self.ctx.ordinal(), self.len, self.ptr)
    }
}

impl DeviceBuffer {
    /// `len` bytes of uninitialised device memory (no allocation for 0).
    pub fn new(ctx: &Context, len: usize) -> Result<DeviceBuffer, CudaError> {
        let mut ptr: CUdeviceptr = 0;
        if len > 0 {
            let api = ctx.inner.api;
            let _current = ctx.enter()?;
            // SAFETY: `ptr` is a valid out-pointer for the call.
            api.check("cuMemAlloc", unsafe { (api.mem_alloc)(&mut ptr, len) })?;
        }
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, len })
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The device address of the first byte (0 when empty).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer as a copy destination. Copies into it may outlive
    /// the borrow: dropping the buffer waits for them.
    pub fn range(&mut self) -> DeviceRange<'_> {
        DeviceRange { ptr: self.ptr, len: self.len, _memory: PhantomData }
    }

    fn check_span(&self, op: &'static str, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::invalid(
                op,
                format!("{len} bytes at offset {offset} run past the {}-byte device buffer", self.len),
            )),
        }
    }

    /// `cuMemcpyDtoH`: copies `dst.len()` bytes from `offset` into `dst`,
    /// returning once they are there. It does not wait for copies queued on
    /// a [`Stream`] (non-blocking streams): synchronize those first.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check_span("cuMemcpyDtoH", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        // SAFETY: the source span is inside this live allocation (checked);
        // `dst` is exclusively borrowed host memory of the same length, and
        // a copy into pageable memory is complete when the call returns.
        let code = unsafe { (api.memcpy_dtoh)(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len()) };
        api.check("cuMemcpyDtoH", code)
    }

    /// `cuMemsetD8`: sets every byte to `byte`, after the context's queued
    /// work and before returning (`cuCtxSynchronize` either side).
    pub fn fill(&mut self, byte: u8) -> Result<(), CudaError> {
        if self.len == 0 {
            return Ok(());
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        self.ctx.synchronize_current()?;
        // SAFETY: the span is exactly this live allocation.
        api.check("cuMemsetD8", unsafe { (api.memset_d8)(self.ptr, byte, self.len) })?;
        self.ctx.synchronize_current()
    }

    /// [`DeviceBuffer::fill`] with zeros.
    pub fn zero(&mut self) -> Result<(), CudaError> {
        self.fill(0)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter_and_drain();
        // SAFETY: frees the allocation this value owns, after the wait for
        // every copy that could still write it; nothing uses it after.
        unsafe { (api.mem_free)(self.ptr) };
    }
}

/// `cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE)`: pins `len` bytes at
/// `ptr` for DMA by every context.
///
/// # Safety
///
/// `ptr..ptr + len` must be mapped, and stay mapped until unregistered.
unsafe fn register_host(ctx: &Context, ptr: *mut u8, len: usize) -> Result<(), CudaError> {
    let api = ctx.inner.api;
    let _current = ctx.enter()?;
    // SAFETY: the span is mapped (this function's contract); the driver
    // pins its pages until cuMemHostUnregister.
    let code = unsafe { (api.mem_host_register)(ptr.cast(), len, CU_MEMHOSTREGISTER_PORTABLE) };
    api.check("cuMemHostRegister", code)
}

/// Waits for `ctx`, then `cuMemHostUnregister` of memory [`register_host`]
/// pinned (errors ignored: this runs in drops).
fn unregister_host(ctx: &Context, ptr: *mut u8) {
    let api = ctx.inner.api;
    let _current = ctx.enter_and_drain();
    // SAFETY: `ptr` starts a registration made by `register_host`, which
    // is still mapped; the wait above let every copy from it finish.
    unsafe { (api.mem_host_unregister)(ptr.cast()) };
}

/// A range of a [`Mapping`] pinned for DMA (`cuMemHostRegister` with
/// `CU_MEMHOSTREGISTER_PORTABLE`), so copies from it run asynchronously at
/// full speed. It holds the mapping's writer, so the mapping outlives it;
/// dropping it waits for its context (`cuCtxSynchronize`) before
/// `cuMemHostUnregister`, so no copy from it outlives the pin.
#[allow(dead_code)] // used by the CUDA sink
pub struct HostRegistration<'m> {
    ctx: Context,
    ptr: *mut u8,
    len: usize,
    range: Range<usize>,
    _memory: MappingWriter<'m>,
}

// SAFETY: the registration only hands addresses to the driver, which
// accepts them from any thread; the mapping lives for 'm.
unsafe impl Send for HostRegistration<'_> {}
// SAFETY: as above; no method mutates it.
unsafe impl Sync for HostRegistration<'_> {}

#[allow(dead_code)] // used by the CUDA sink
impl<'m> HostRegistration<'m> {
    /// Pins `range` of `memory`: whole pages, as staging slots are (older
    /// drivers refuse others). A range outside the mapping is a bug and
    /// panics; an empty one pins nothing; one overlapping a range already
    /// pinned fails with `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
    pub fn new(
        ctx: &Context,
        memory: MappingWriter<'m>,
        range: Range<usize>,
    ) -> Result<HostRegistration<'m>, CudaError> {
        let (ptr, len) = memory.raw_range(&range);
        if len > 0 {
            // SAFETY: ptr..ptr+len is inside the mapping (raw_range), which
            // the writer keeps mapped for 'm, longer than this value, whose
            // drop unregisters it.
            unsafe { register_host(ctx, ptr, len) }?;
        }
        Ok(HostRegistration { ctx: ctx.clone(), ptr, len, range, _memory: memory })
    }

    /// The range of the mapping pinned.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        if self.len > 0 {
            unregister_host(&self.ctx, self.ptr);
        }
    }
}

/// `cuMemcpyHtoDAsync`: queues a copy of `src_range` of `src` to
/// `dst_offset..` of `dst` on `stream`, and returns at once when the source
/// is pinned (a [`HostRegistration`], a [`PinnedStaging`]); an unpinned
/// source is first copied by the driver into its own staging memory.
///
/// The copy reads the source until the stream passes it, so the caller
/// must not let `src_range` be rewritten before an [`Event`] recorded on
/// `stream` after the copy completes: a rule for the bytes' integrity, not
/// for memory safety, since a pinned range stays pinned (and its mapping
/// mapped) until a wait for the context. The same wait in
/// [`DeviceBuffer`]'s drop, or [`DeviceRange::from_raw`]'s contract, keeps
/// the destination allocated. A registration waits only for its own
/// context: copy from it on streams of that context.
///
/// `src_range` outside the mapping is a bug and panics; a destination span
/// outside `dst` is an error.
pub fn copy_htod_async(
    dst: &DeviceRange<'_>,
    dst_offset: usize,
    src: MappingWriter<'_>,
    src_range: Range<usize>,
    stream: &Stream,
) -> Result<(), CudaError> {
    let (ptr, len) = src.raw_range(&src_range);
    match dst_offset.checked_add(len) {
        Some(end) if end <= dst.len => {}
        _ => {
            return Err(CudaError::invalid(
                "cuMemcpyHtoDAsync",
                format!("{len} bytes at offset {dst_offset} run past the {}-byte device range", dst.len),
            ))
        }
    }
    if len == 0 {
        return Ok(());
    }
    let api = stream.ctx.inner.api;
    let _current = stream.ctx.enter()?;
    // SAFETY: the source is `len` bytes inside a live mapping (raw_range),
    // pinned until a context wait or staged by the driver before return;
    // the destination span is inside `dst` (checked), device memory that
    // stays allocated while copies into it may run (DeviceRange's
    // contract); the stream is live.
    let code = unsafe {
        (api.memcpy_htod_async)(dst.ptr + dst_offset as u64, ptr.cast_const().cast(), len, stream.raw)
    };
    api.check("cuMemcpyHtoDAsync", code)
}

/// Pinned host memory this value owns: an anonymous mapping, registered
/// with `cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE)`, to stage bytes
/// for asynchronous copies to a device. Dropping it waits for its context
/// before unpinning and unmapping.
pub struct PinnedStaging {
    ctx: Context,
    // Unregistered in `drop`, before the field drops and unmaps.
    memory: Mapping,
    ptr: *mut u8,
}

// SAFETY: the mapping is plain memory (Mapping is Send) and the pin is a
// driver-side state usable from any thread.
unsafe impl Send for PinnedStaging {}
// SAFETY: `&self` methods only read lengths.
unsafe impl Sync for PinnedStaging {}

impl fmt::Debug for PinnedStaging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedStaging(cuda:{}, {} bytes)", self.ctx.ordinal(), self.memory.as_slice().len())
    }
}

impl PinnedStaging {
    /// `len` bytes of zeroed, pinned host memory.
    pub fn new(ctx: &Context, len: usize) -> Result<PinnedStaging, CudaError> {
        let mut memory = Mapping::anonymous(len, HugePageAdvice::Huge).map_err(|err| {
            CudaError::new(
                "mmap",
                format!("{len} bytes of staging memory: {err}"),
                err.raw_os_error().unwrap_or(libc::EIO),
            )
        })?;
        let (ptr, _) = memory.writer().raw_range(&(0..len));
        if len > 0 {
            // Whole pages, as older drivers require.
            let pages = len.next_multiple_of(super::mem::page_size());
            // SAFETY: the span is the whole mapping (mmap maps whole pages),
            // which `memory` keeps mapped at this address until after `drop`
            // unregisters it.
            unsafe { register_host(ctx, ptr, pages) }?;
        }
        Ok(PinnedStaging { ctx: ctx.clone(), memory, ptr })
    }

    pub fn len(&self) -> usize {
        self.memory.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn check_span(&self, op: &'static str, range: &Range<usize>) -> Result<(), CudaError> {
        if range.start <= range.end && range.end <= self.len() {
            Ok(())
        } else {
            Err(CudaError::invalid(
                op,
                format!("bytes {range:?} run past the {}-byte staging memory", self.len()),
            ))
        }
    }

    /// Write access for the kernel and io_uring (reads into staging
    /// slots). The borrow keeps the memory mapped and pinned meanwhile.
    pub(crate) fn writer(&mut self) -> MappingWriter<'_> {
        self.memory.writer()
    }

    /// Copies `data` in at `offset`. A copy still reading those bytes (see
    /// [`PinnedStaging::copy_to_device`]) would send a mix of old and new.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        let range = offset..offset.saturating_add(data.len());
        self.check_span("write staging memory", &range)?;
        self.memory.as_mut_slice()[range].copy_from_slice(data);
        Ok(())
    }

    /// `cuMemcpyHtoDAsync`: queues a copy of `range` to `dst_offset..` of
    /// `dst` on `stream` (which must be of this memory's context) and
    /// returns at once. The copy reads the staging bytes until the stream
    /// passes it: record an [`Event`] after it and wait for the event
    /// before writing `range` again, or the device may get a mix of old
    /// and new bytes. Dropping the staging memory waits for the context, so
    /// no copy reads it after it is unpinned.
    pub fn copy_to_device(
        &mut self,
        range: Range<usize>,
        dst: &DeviceRange<'_>,
        dst_offset: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        const OP: &str = "cuMemcpyHtoDAsync";
        self.check_span(OP, &range)?;
        if !stream.ctx.same(&self.ctx) {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "a stream of cuda:{} copying from staging memory of cuda:{}: use a stream of the same context",
                    stream.ctx.ordinal(),
                    self.ctx.ordinal()
                ),
            ));
        }
        copy_htod_async(dst, dst_offset, self.memory.writer(), range, stream)
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        if !self.is_empty() {
            unregister_host(&self.ctx, self.ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registered range of a mapping copied to the device and back.
    #[test]
    fn a_registered_mapping_range_round_trips_through_the_device() {
        let ctx = match Context::primary(0) {
            Ok(ctx) => ctx,
            Err(err) => {
                eprintln!("SKIP cuda: {err}");
                return;
            }
        };
        let page = super::super::mem::page_size();
        let mut map = Mapping::anonymous(4 * page, HugePageAdvice::Small).unwrap();
        for (i, byte) in map.as_mut_slice().iter_mut().enumerate() {
            *byte = (i % 253) as u8;
        }
        let mut device = DeviceBuffer::new(&ctx, 2 * page).unwrap();
        device.fill(0xA5).unwrap();
        {
            let writer = map.writer();
            let pinned = HostRegistration::new(&ctx, writer, page..3 * page).unwrap();
            assert_eq!(pinned.range(), page..3 * page);
            let stream = Stream::new(&ctx).unwrap();
            let event = Event::new(&ctx).unwrap();
            let dst = device.range();
            copy_htod_async(&dst, 16, writer, page..2 * page, &stream).unwrap();
            let past = copy_htod_async(&dst, page + 1, writer, page..2 * page, &stream).unwrap_err();
            assert_eq!(past.errno(), libc::EINVAL, "{past}");
            event.record(&stream).unwrap();
            event.synchronize().unwrap();
            assert!(event.is_complete().unwrap());
        }
        let mut back = vec![0u8; 2 * page];
        device.copy_to_host(0, &mut back).unwrap();
        assert!(back[..16].iter().all(|&b| b == 0xA5));
        assert_eq!(&back[16..16 + page], &map.as_slice()[page..2 * page]);
        assert!(back[16 + page..].iter().all(|&b| b == 0xA5));
    }
}
