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
pub struct CancelToken {
    flag: Arc<AtomicBool>,
    /// A child is also cancelled by its parent (see [`CancelToken::child`]).
    parent: Option<Arc<CancelToken>>,
}

impl CancelToken {
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// A token cancelled by this one, and by its own `cancel`, which leaves
    /// this one alone: what a group of operations (the files of
    /// [`crate::many::load_many`]) uses to stop each other without
    /// cancelling the caller's token.
    pub fn child(&self) -> CancelToken {
        CancelToken { flag: Arc::default(), parent: Some(Arc::new(self.clone())) }
    }

    /// Asks every operation holding a clone of this token (or of a child of
    /// it) to stop.
    pub fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire) || self.parent.as_ref().is_some_and(|p| p.is_cancelled())
    }
}

#[cfg(test)]
mod tests {
    use super::CancelToken;

    #[test]
    fn a_child_is_cancelled_by_its_parent_and_not_the_other_way() {
        let parent = CancelToken::new();
        let (a, b) = (parent.child(), parent.child());
        a.cancel();
        assert!(a.is_cancelled() && !b.is_cancelled() && !parent.is_cancelled());
        parent.cancel();
        assert!(b.is_cancelled() && b.clone().is_cancelled());
    }
}
