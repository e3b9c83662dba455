//! What the two ends hold between dequeue and enqueue or release: a free
//! block to fill, a run of filled blocks to read, and runs kept past their
//! queue call.

use std::io;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};

use crate::sys::dmabuf::SyncAccess;
use crate::sys::shm::{BlockWriter, PeerMapping, SharedBytes, SharedBytesMut};

use super::*;

/// A free block the producer holds: fill it, then [`FreeBlock::enqueue`]
/// it. Dropped without enqueueing, it stays free.
#[derive(Debug)]
pub struct FreeBlock<'q> {
    pub(super) queue: &'q mut BlockQueue,
    pub(super) slot: usize,
    pub(super) enqueued: bool,
}

impl FreeBlock<'_> {
    /// Its place in the ring (0 to blocks − 1).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Its sequence in the stream: how many blocks were enqueued before.
    pub fn sequence(&self) -> u64 {
        self.queue.own
    }

    pub fn capacity(&self) -> usize {
        self.queue.options.block_size
    }

    /// The blocks' mapping and the right to write it, which only a free
    /// block lends.
    fn writable(&mut self) -> (&PeerMapping, &mut BlockWriter) {
        let queue = &mut *self.queue;
        // dequeue_free requires the producer role, whose queue has the writer.
        (&queue.data, queue.writer.as_mut().expect("a free block's queue is a producer's"))
    }

    /// Copies `data` into the block at `offset`.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> io::Result<()> {
        let range = self.queue.block_span(self.slot, offset, data.len())?;
        let (data_map, writer) = self.writable();
        data_map.copy_in(writer, range.start, data);
        Ok(())
    }

    /// Copies `out.len()` bytes of the block from `offset` (what this side
    /// wrote, if the peer keeps to the protocol).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> io::Result<()> {
        let range = self.queue.block_span(self.slot, offset, out.len())?;
        self.queue.data.copy_out(range.start, out);
        Ok(())
    }

    /// One `read(2)` from `fd` into bytes `range` of the block: the kernel
    /// fills it, no copy through this process. Returns the count (0: EOF).
    pub fn read_from(&mut self, fd: BorrowedFd<'_>, range: Range<usize>) -> io::Result<usize> {
        let range = self.queue.block_range(self.slot, range)?;
        let (data, writer) = self.writable();
        data.read_from(writer, fd, range)
    }

    /// The whole block, for copies in and out and, on the caller's
    /// promise that the consumer keeps to the protocol (it does not touch a
    /// block until it is enqueued), an `unsafe` mutable slice.
    pub fn bytes_mut(&mut self) -> SharedBytesMut<'_> {
        let (size, slot) = (self.queue.options.block_size, self.slot);
        let (data, writer) = self.writable();
        data.shared_bytes_mut(writer, slot * size..(slot + 1) * size)
    }

    /// Hands the first `len` bytes of the block to the consumer, with `tag`
    /// (free for the application, e.g. a sequence number of its own).
    pub fn enqueue(mut self, len: usize, tag: u64) -> io::Result<()> {
        if len > self.queue.options.block_size {
            return Err(invalid(format!(
                "a length of {len} in a block of {} bytes",
                self.queue.options.block_size
            )));
        }
        self.enqueued = true;
        let queue = &mut *self.queue;
        queue.sync(SyncAccess::Write, false)?;
        queue.control.word(W_SLOTS + 2 * self.slot).store(len as u64, Relaxed);
        queue.control.word(W_SLOTS + 2 * self.slot + 1).store(tag, Relaxed);
        queue.own += 1;
        queue.control.word(W_PRODUCED).store(queue.own, SeqCst);
        queue.wake_peer()
    }
}

impl Drop for FreeBlock<'_> {
    fn drop(&mut self) {
        if !self.enqueued {
            // The block stays free; only the CPU-access bracket ends.
            let _ = self.queue.sync(SyncAccess::Write, false);
        }
    }
}

/// Block `i` of a run of `blocks` must be in it: a panic at the caller, as
/// indexing does, but one that names the run.
#[track_caller]
pub(super) fn check_block_index(i: usize, blocks: usize) {
    assert!(i < blocks, "block {i} of a run of {blocks} blocks");
}

/// A run of filled blocks the consumer holds, in stream order; give them
/// back with [`Filled::release`] (dropping them gives them back too).
#[derive(Debug)]
pub struct Filled<'q> {
    pub(super) queue: &'q mut BlockQueue,
    pub(super) sequence: u64,
    pub(super) first: usize,
    pub(super) lens: Vec<usize>,
    pub(super) tags: Vec<u64>,
    pub(super) released: bool,
}

impl Filled<'_> {
    /// How many blocks the run holds: at least one, so block 0 is always
    /// there.
    pub fn blocks(&self) -> usize {
        self.lens.len()
    }

    /// The stream sequence of the run's first block.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The length and tag of block `i` of the run, as read once when it
    /// was dequeued.
    ///
    /// # Panics
    ///
    /// If `i` is not below [`Self::blocks`], as indexing does.
    #[track_caller]
    pub fn block(&self, i: usize) -> (usize, u64) {
        check_block_index(i, self.lens.len());
        (self.lens[i], self.tags[i])
    }

    /// Bytes in the whole run (all blocks full but maybe the last).
    pub fn len(&self) -> usize {
        self.lens.iter().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `out.len()` bytes of block `i` from `offset` into `out`,
    /// within its length.
    pub fn read_at(&self, i: usize, offset: usize, out: &mut [u8]) -> io::Result<()> {
        let Some(&len) = self.lens.get(i) else {
            return Err(invalid(format!("block {i} of a run of {} blocks", self.lens.len())));
        };
        if !matches!(offset.checked_add(out.len()), Some(end) if end <= len) {
            return Err(invalid(format!("{} bytes at {offset} of a block of {len} bytes", out.len())));
        }
        let range = self.queue.block_span(self.first + i, offset, out.len())?;
        self.queue.data.copy_out(range.start, out);
        Ok(())
    }

    /// Block `i` (its length), for copies out and, on the caller's promise
    /// that the producer keeps to the protocol (it does not touch a block
    /// until it is given back), an `unsafe` slice.
    ///
    /// # Panics
    ///
    /// If `i` is not below [`Self::blocks`], as indexing does.
    #[track_caller]
    pub fn block_bytes(&self, i: usize) -> SharedBytes<'_> {
        check_block_index(i, self.lens.len());
        let start = (self.first + i) * self.queue.options.block_size;
        self.queue.data.shared_bytes(start..start + self.lens[i])
    }

    /// Gives the blocks back to the producer.
    pub fn release(mut self) -> io::Result<()> {
        self.released = true;
        self.give_back()
    }

    fn give_back(&mut self) -> io::Result<()> {
        self.queue.give_back(self.sequence, self.lens.len() as u64)
    }

    /// Keeps the run past the queue's borrow, so the next runs can be
    /// dequeued while it is still in use (written to storage, say); give it
    /// back with [`BlockQueue::release_held`]. Until then its blocks stay
    /// out of the producer's reach.
    pub fn hold(mut self) -> HeldRun {
        self.released = true;
        HeldRun {
            queue: self.queue.id,
            sequence: self.sequence,
            first: self.first,
            block_size: self.queue.options.block_size,
            lens: std::mem::take(&mut self.lens),
            tags: std::mem::take(&mut self.tags),
        }
    }
}

impl Drop for Filled<'_> {
    fn drop(&mut self) {
        if !self.released {
            // Dropped without release (an early return): given back all the
            // same; errors have nowhere to go and the blocks are done with.
            let _ = self.give_back();
        }
    }
}

/// A run of filled blocks kept with [`Filled::hold`]: its metadata, while
/// its blocks stay out of the producer's reach until
/// [`BlockQueue::release_held`] on the queue it came from (another queue
/// refuses it). Dropped without that, its blocks are never given back, and
/// the stream stalls once the producer needs them.
#[derive(Debug)]
#[must_use = "a held run's blocks go back to the producer only through release_held"]
pub struct HeldRun {
    /// The [`BlockQueue::id`] of the queue it came from.
    pub(super) queue: u64,
    pub(super) sequence: u64,
    pub(super) first: usize,
    pub(super) block_size: usize,
    pub(super) lens: Vec<usize>,
    pub(super) tags: Vec<u64>,
}

impl HeldRun {
    pub fn blocks(&self) -> usize {
        self.lens.len()
    }

    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The length and tag of block `i` of the run.
    ///
    /// # Panics
    ///
    /// If `i` is not below [`Self::blocks`], as indexing does.
    #[track_caller]
    pub fn block(&self, i: usize) -> (usize, u64) {
        check_block_index(i, self.lens.len());
        (self.lens[i], self.tags[i])
    }

    /// Bytes in the whole run.
    pub fn len(&self) -> usize {
        self.lens.iter().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the run's bytes are in the ring mapping ([`BlockQueue::ring`]).
    pub(crate) fn byte_range(&self) -> Range<usize> {
        let start = self.first * self.block_size;
        start..start + self.len()
    }
}

/// The error [`BlockQueue::release_held`] gives for a run held from
/// another queue, with the run inside.
#[derive(Debug)]
pub struct ForeignRun(pub HeldRun);

impl ForeignRun {
    /// The run inside an error of [`BlockQueue::release_held`] that refused
    /// it as foreign; any other error is handed back as it is.
    pub fn take(err: io::Error) -> Result<HeldRun, io::Error> {
        err.downcast::<ForeignRun>().map(|foreign| foreign.0)
    }
}

impl std::fmt::Display for ForeignRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let start = self.0.sequence;
        write!(
            f,
            "block queue: blocks {start}..{} were held from another block queue; \
             they go back only to the queue they came from",
            start + self.0.lens.len() as u64
        )
    }
}

impl std::error::Error for ForeignRun {}
