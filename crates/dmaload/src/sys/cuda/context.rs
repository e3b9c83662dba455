//! The primary context of a device, and making it current for a call.

use std::ffi::{c_int, c_uint, CStr};
use std::fmt;
use std::marker::PhantomData;
use std::ptr::{self};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;

/// The retained primary context and the device it belongs to.
pub(super) struct ContextInner {
    pub(super) api: &'static Api,
    pub(super) raw: CUcontext,
    pub(super) device: CUdevice,
    pub(super) ordinal: usize,
}

/// Per device (the last entry standing for every ordinal past it): set
/// when a copy did not complete within [`copy_timeout`], for the rest of
/// the process (see [`Context::is_wedged`]).
static WEDGED: [AtomicBool; 64] = [const { AtomicBool::new(false) }; 64];

fn wedged_flag(ordinal: usize) -> &'static AtomicBool {
    &WEDGED[ordinal.min(WEDGED.len() - 1)]
}

/// The error of every call on a device given up for this process.
fn wedged_error(ordinal: usize) -> CudaError {
    CudaError::new(
        "cuda",
        format!(
            "cuda:{ordinal} stopped answering (a copy did not complete within {} s): dmaload does not use it \
             again in this process; restart the process",
            copy_timeout().as_secs_f64()
        ),
        libc::ETIMEDOUT,
    )
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
    pub(super) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Context(cuda:{})", self.inner.ordinal)
    }
}

/// The context made current for one call, popped again on drop. Not
/// `Send`: the context stack is per thread.
pub(super) struct Current {
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
        if wedged_flag(ordinal).load(Ordering::Acquire) {
            return Err(wedged_error(ordinal));
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

    /// Whether a copy in this context did not complete within
    /// [`copy_timeout`]. The device is then given up for this process:
    /// every later call in the context fails at once, and the streams,
    /// events, device allocations and pinned memory dmaload made in it are
    /// left to the driver rather than waited for (a wait would never end)
    /// or freed (a late copy could still read or write them).
    pub fn is_wedged(&self) -> bool {
        wedged_flag(self.inner.ordinal).load(Ordering::Acquire)
    }

    /// Gives the device up (see [`Context::is_wedged`]).
    pub(super) fn wedge(&self) {
        wedged_flag(self.inner.ordinal).store(true, Ordering::Release);
    }

    /// The error of any call in a wedged context.
    pub(super) fn check_not_wedged(&self) -> Result<(), CudaError> {
        if self.is_wedged() {
            return Err(wedged_error(self.inner.ordinal));
        }
        Ok(())
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
    pub(super) fn enter(&self) -> Result<Current, CudaError> {
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
        self.check_not_wedged()?;
        let _current = self.enter()?;
        self.synchronize_current()
    }

    /// `cuCtxSynchronize` with the context already current.
    pub(super) fn synchronize_current(&self) -> Result<(), CudaError> {
        let api = self.inner.api;
        // SAFETY: cuCtxSynchronize takes no arguments.
        api.check("cuCtxSynchronize", unsafe { (api.ctx_synchronize)() })
    }

    /// Waits for the context (if it can still be made current) before a
    /// resource is freed; errors are the caller's to ignore.
    pub(super) fn enter_and_drain(&self) -> Option<Current> {
        if self.is_wedged() {
            return None;
        }
        let current = self.enter().ok()?;
        let _ = self.synchronize_current();
        Some(current)
    }

    /// `cuPointerGetAttribute(attribute)` of `address`, with the context current.
    ///
    /// # Safety
    ///
    /// `T` must be the type the driver writes for `attribute`.
    pub(super) unsafe fn pointer_attribute<T: Default>(
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
