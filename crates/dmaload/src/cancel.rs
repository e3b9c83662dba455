//! Stopping a load (or save) from another thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A flag shared between the caller and a running operation: once
/// [`cancel`](CancelToken::cancel)led, the engine stops issuing requests,
/// waits for the ones in flight, and the operation returns an error of kind
/// [`crate::ErrorKind::Cancelled`] (errno `ECANCELED`) without handing out
/// anything half-filled. Engines check it between submissions, so a load
/// stops within a few requests' time. Clones share the flag.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Asks every operation holding a clone of this token to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}
