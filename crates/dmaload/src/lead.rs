//! Work done ahead of a consumer: the one coordinator of "do X a little
//! ahead of the engine" (register a load's gathers or a save's windows
//! before the engine reaches them, fault a destination's pages in before
//! the copies reach them). A leaf: it imports nothing of the crate.

use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Units `0..end` of work, claimed in order, each once: by helper threads
/// while a unit is within `reach` units of the consumer's position, or by
/// the consumer itself when it gets to a unit no helper took. So the work
/// runs beside the consumer yet never more than `reach` units ahead of it
/// (bounding what is pinned or faulted in if the consumer stops early).
pub(crate) struct Lead {
    state: Mutex<LeadState>,
    moved: Condvar,
    reach: usize,
    end: usize,
}

struct LeadState {
    /// The first unit nobody has claimed.
    next: usize,
    /// The consumer's position: units below `position + reach` are due.
    position: usize,
    stopped: bool,
}

impl Lead {
    /// Units `0..end`, due up to `reach` (at least 1) past the consumer.
    pub fn new(end: usize, reach: usize) -> Lead {
        Lead {
            state: Mutex::new(LeadState { next: 0, position: 0, stopped: false }),
            moved: Condvar::new(),
            reach: reach.max(1),
            end,
        }
    }

    fn lock(&self) -> MutexGuard<'_, LeadState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims the next unit if it is below `below` and due now.
    pub fn claim_due(&self, below: usize) -> Option<usize> {
        let mut state = self.lock();
        let unit = state.next;
        (!state.stopped && unit < below.min(self.end) && unit < state.position + self.reach).then(|| {
            state.next += 1;
            unit
        })
    }

    /// Claims the next unit, waiting until it is due; `None` once every
    /// unit is claimed or the work was stopped.
    pub fn claim_next(&self) -> Option<usize> {
        let mut state = self.lock();
        loop {
            if state.stopped || state.next >= self.end {
                return None;
            }
            if state.next < state.position + self.reach {
                state.next += 1;
                return Some(state.next - 1);
            }
            state = self.moved.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The consumer has reached unit `position` (it never moves back).
    pub fn advance(&self, position: usize) {
        let mut state = self.lock();
        state.position = state.position.max(position);
        drop(state);
        self.moved.notify_all();
    }

    /// The consumer has reached unit `end` and takes every unit below it
    /// that no helper claimed: those are returned, for it to do itself.
    pub fn take_through(&self, end: usize) -> Range<usize> {
        let mut state = self.lock();
        let end = end.min(self.end);
        let taken = state.next..end.max(state.next);
        state.next = taken.end;
        state.position = state.position.max(end);
        drop(state);
        self.moved.notify_all();
        taken
    }

    /// Ends the work: no unit is claimed from now on, and waiting helpers
    /// return.
    pub fn stop(&self) {
        self.lock().stopped = true;
        self.moved.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::Lead;

    #[test]
    fn units_are_claimed_once_in_order_and_only_within_reach() {
        let lead = Lead::new(10, 3);
        assert_eq!([lead.claim_due(10), lead.claim_due(10), lead.claim_due(10)], [Some(0), Some(1), Some(2)]);
        assert_eq!(lead.claim_due(10), None, "three ahead of position 0");
        lead.advance(2);
        assert_eq!(lead.claim_due(4), Some(3));
        assert_eq!(lead.claim_due(4), None, "not past the bound given");
        // The consumer overtakes the helpers: it does 4..7 itself.
        assert_eq!(lead.take_through(7), 4..7);
        assert_eq!(lead.take_through(6), 7..7, "nothing twice");
        assert_eq!(lead.claim_next(), Some(7));
        lead.advance(1);
        assert_eq!(lead.claim_due(10), Some(8), "the position never moves back");
        assert_eq!(lead.take_through(99), 9..10);
        assert_eq!(lead.claim_next(), None, "all claimed");
    }

    #[test]
    fn a_waiting_helper_goes_on_when_the_consumer_moves_and_returns_when_stopped() {
        let lead = Lead::new(100, 1);
        assert_eq!(lead.claim_next(), Some(0));
        std::thread::scope(|scope| {
            let helper = scope.spawn(|| (lead.claim_next(), lead.claim_next()));
            lead.advance(1);
            // Once the helper has unit 1, it waits for the consumer to reach 1.
            while lead.lock().next < 2 {
                std::thread::yield_now();
            }
            lead.stop();
            assert_eq!(helper.join().unwrap(), (Some(1), None));
        });
    }
}
