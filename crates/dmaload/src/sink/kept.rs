//! Staging rings kept between loads, at most one per device (and one
//! unpinned ring for host destinations): a process that loads a model
//! shard by shard, or file after file, pins its ring once, not once per
//! file. A load takes the ring out, so two loads at once on one device
//! each have their own; [`release_staging`] frees what is kept.

use std::io;
use std::sync::{Mutex, MutexGuard};

use super::StagingRing;
use crate::cuda::Context;

/// The kept rings: `None` is the host ring, `Some(n)` device `n`'s.
static KEPT: Mutex<Vec<(Option<usize>, StagingRing)>> = Mutex::new(Vec::new());

fn kept() -> MutexGuard<'static, Vec<(Option<usize>, StagingRing)>> {
    // A ring is moved in or out whole: a panic elsewhere cannot leave one torn.
    KEPT.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A ring of at least `slots` slots of `slot_size` bytes for reads of
/// `chunk` bytes, for `device` (ordinal and context; `None`: plain
/// memory): the ring kept for that device when it has slots of that size
/// and enough of them (its slots pinned already where earlier loads used
/// them), else a new one, pinned slot by slot as a sink first copies from
/// it ([`StagingRing::pinned_as_used`]) or plain ([`StagingRing::new`]).
/// Give it back with [`keep_ring`].
pub fn take_ring(
    device: Option<(usize, &Context)>,
    slots: usize,
    slot_size: usize,
    chunk: usize,
) -> io::Result<StagingRing> {
    let ordinal = device.map(|(ordinal, _)| ordinal);
    let (slot_len, _) = StagingRing::size(slots, slot_size, chunk)?;
    let found = {
        let mut rings = kept();
        let at = rings.iter().position(|(kept_for, ring)| {
            *kept_for == ordinal && ring.slot_len == slot_len && ring.slots >= slots
        });
        at.map(|at| rings.swap_remove(at).1)
    };
    match (found, device) {
        (Some(ring), _) => Ok(ring),
        (None, Some((_, context))) => StagingRing::pinned_as_used(context, slots, slot_size, chunk),
        (None, None) => StagingRing::new(slots, slot_size, chunk),
    }
}

/// Keeps `ring` (idle: every copy from it finished) for the next load on
/// `device` (`None`: host destinations), in place of the one kept before
/// unless that one is larger.
pub fn keep_ring(device: Option<usize>, ring: StagingRing) {
    let dropped = {
        let mut rings = kept();
        match rings.iter().position(|(kept_for, _)| *kept_for == device) {
            Some(at) if rings[at].1.len() > ring.len() => Some(ring),
            Some(at) => Some(std::mem::replace(&mut rings[at].1, ring)),
            None => {
                rings.push((device, ring));
                None
            }
        }
    };
    // Unpinned and unmapped outside the lock.
    drop(dropped);
}

/// Frees the staging rings kept for later loads (unpinning them); returns
/// their bytes.
pub fn release_staging() -> usize {
    let rings = std::mem::take(&mut *kept());
    rings.iter().map(|(_, ring)| ring.len()).sum()
}
