//! Streams that order copies, and events that mark a point in one.

use std::fmt;
use std::ptr::{self};

use super::*;

/// A CUDA stream (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`): copies
/// queued on it run in order, beside other libraries' work on the legacy
/// default stream. Dropping it waits for its work (`cuStreamSynchronize`)
/// before `cuStreamDestroy`.
pub struct Stream {
    pub(super) ctx: Context,
    pub(super) raw: CUstream,
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
    pub(super) ctx: Context,
    pub(super) raw: CUevent,
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
