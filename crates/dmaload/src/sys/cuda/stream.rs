//! Streams that order copies, and events that mark a point in one.

use std::fmt;
use std::ptr::{self};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::*;

/// A CUDA stream (`cuStreamCreate` with `CU_STREAM_NON_BLOCKING`): copies
/// queued on it run in order, beside other libraries' work on the legacy
/// default stream. Dropping it waits for its work (`cuStreamSynchronize`)
/// before `cuStreamDestroy`; in a wedged context it is left to the driver.
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

    /// Waits until all work queued so far is done, at most
    /// [`copy_timeout`] (an event recorded now, waited for as
    /// [`Event::synchronize`] waits).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let event = Event::new(&self.ctx)?;
        event.record(self)?;
        event.synchronize()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.is_wedged() {
            // A copy on it may never end: neither waited for nor destroyed.
            return;
        }
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
    /// When it was last recorded: its work is overdue [`copy_timeout`] later.
    recorded: Mutex<Option<Instant>>,
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
        Ok(Event { ctx: ctx.clone(), raw, recorded: Mutex::new(None) })
    }

    /// `cuEventRecord`: the event completes once `stream` has done all the
    /// work queued on it before this call (replacing any earlier record).
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        // SAFETY: both handles are live for the call.
        api.check("cuEventRecord", unsafe { (api.event_record)(self.raw, stream.raw) })?;
        *self.recorded.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        Ok(())
    }

    /// `cuEventQuery`: whether the work before the last record is done
    /// (`CUDA_SUCCESS`) or not yet (`CUDA_ERROR_NOT_READY`). Work still not
    /// done [`copy_timeout`] after the record means a device that stopped
    /// answering: it is given up ([`Context::is_wedged`]) and this fails
    /// with ETIMEDOUT.
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        self.ctx.check_not_wedged()?;
        let api = self.ctx.inner.api;
        let code = {
            let _current = self.ctx.enter()?;
            // SAFETY: the event is live for the call.
            unsafe { (api.event_query)(self.raw) }
        };
        match code {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => {
                let recorded = *self.recorded.lock().unwrap_or_else(|p| p.into_inner());
                let timeout = copy_timeout();
                if !recorded.is_some_and(|at| at.elapsed() >= timeout) {
                    return Ok(false);
                }
                self.ctx.wedge();
                let message = format!(
                    "a copy to cuda:{} did not complete within {} s (DMALOAD_CUDA_TIMEOUT): the device \
                     stopped answering",
                    self.ctx.ordinal(),
                    timeout.as_secs_f64()
                );
                Err(CudaError::new("cuEventQuery", message, libc::ETIMEDOUT))
            }
            code => Err(api.error("cuEventQuery", code)),
        }
    }

    /// Waits until the work before the last record is done:
    /// [`Event::is_complete`] in a loop (spinning the first 50 µs, then
    /// sleeping an eighth of the time waited so far, at most 1 ms: a
    /// copy's own latency, not a core), so at most [`copy_timeout`] after
    /// the record, where `cuEventSynchronize` would never return.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let started = Instant::now();
        loop {
            if self.is_complete()? {
                return Ok(());
            }
            let waited = started.elapsed();
            if waited < Duration::from_micros(50) {
                std::thread::yield_now();
            } else {
                std::thread::sleep((waited / 8).min(Duration::from_millis(1)));
            }
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.is_wedged() {
            return;
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter();
        // SAFETY: destroys the event this value owns (the driver frees it
        // once a pending record completes); nothing uses it after.
        unsafe { (api.event_destroy)(self.raw) };
    }
}
