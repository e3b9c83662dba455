//! Destinations fed from a ring of staging slots: the engine reads the file
//! into a few registered slots, and a [`Sink`] takes each filled slot (a
//! copy to a GPU, into memory the caller owns, into a dma-buf mapping, onto
//! a socket) and releases it for the next read. Memory used is the ring,
//! whatever the file size.
//!
//! [`crate::load::load_to_sink`] runs it; [`HostSink`] is the simplest
//! destination (memory the caller already has) and the one the CI tests
//! run every staged code path through.

use std::io;
use std::ops::Range;

mod cuda;
mod dma_heap;
pub use cuda::CudaSink;
pub use dma_heap::DmaHeapSink;

use crate::cuda::{Context, PinnedStaging};
use crate::plan::Plan;
use crate::sys;
use crate::sys::mem::{Mapping, MappingWriter, SharedMapping};

/// Staging slots by default: deep enough to keep a fast disk busy (the
/// engine reads into every free slot at once) while a GPU copy drains one.
pub const DEFAULT_SLOTS: usize = 32;
/// Bytes per staging slot by default: one 16 MiB read each, the request
/// size at which O_DIRECT reads reached the disk's best on the H100
/// machine (1.71 GiB/s at 64 × 16 MiB against 1.52 at 32 × 4 MiB).
pub const DEFAULT_SLOT_SIZE: usize = 16 << 20;

/// One filled staging slot, handed to [`Sink::deliver`]: file bytes
/// `file_offset..file_offset + len()`, only the range the caller asked for.
pub struct SlotData<'a> {
    memory: MappingWriter<'a>,
    range: Range<usize>,
    file_offset: u64,
}

impl<'a> SlotData<'a> {
    pub(crate) fn new(memory: MappingWriter<'a>, range: Range<usize>, file_offset: u64) -> Self {
        SlotData { memory, range, file_offset }
    }

    /// File offset of the slot's first byte.
    pub fn file_offset(&self) -> u64 {
        self.file_offset
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Copies bytes `part` of the slot (relative to its start) into `dst`.
    /// Panics when `part` is outside the slot or `dst` is not its length.
    pub fn copy_to(&self, part: Range<usize>, dst: &mut [u8]) {
        assert!(part.end <= self.len(), "part {part:?} outside a slot of {} bytes", self.len());
        self.memory.copy_out(self.range.start + part.start..self.range.start + part.end, dst);
    }

    /// Copies bytes `part` of the slot (relative to its start) into `dst`
    /// at byte `at`: a mapping another process or a device may share, so
    /// no slice of it is formed.
    pub fn copy_to_mapping(&self, part: Range<usize>, dst: &mut SharedMapping, at: usize) -> io::Result<()> {
        assert!(part.end <= self.len(), "part {part:?} outside a slot of {} bytes", self.len());
        dst.write_from(at, self.memory, self.range.start + part.start..self.range.start + part.end)
    }

    /// The staging memory and the slot's range in it, for sinks that hand
    /// the bytes to a device (which reads them asynchronously).
    pub(crate) fn raw(&self) -> (MappingWriter<'a>, Range<usize>) {
        (self.memory, self.range.clone())
    }
}

/// A destination fed from staging slots. Deliveries come in file order from
/// one thread (not the I/O thread), and a slot is read into again only
/// after [`Sink::release`] returned for it.
pub trait Sink: Send {
    /// Takes the bytes of a filled slot (`slot` is its index in the ring).
    /// A sink that copies synchronously is done with the slot on return; one
    /// that starts an asynchronous copy finishes it in [`Sink::release`].
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> io::Result<()>;

    /// Blocks until the last delivery from `slot` no longer reads it.
    fn release(&mut self, _slot: usize) -> io::Result<()> {
        Ok(())
    }

    /// Blocks until every delivery started has landed. Called once at the
    /// end of every load, also a failed one, before the slots can be reused
    /// or freed.
    fn finish(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A ring of staging slots: anonymous memory (2 MiB pages where THP
/// allows), populated once, reused by every load it serves; pinned for a
/// CUDA device ([`StagingRing::pinned`]) when it feeds one.
#[derive(Debug)]
pub struct StagingRing {
    memory: StagingMemory,
    slots: usize,
    slot_len: usize,
}

#[derive(Debug)]
enum StagingMemory {
    Plain(Mapping),
    /// Page-locked for the device (`cuMemHostRegister`), so copies from it
    /// run asynchronously at the link's speed.
    Pinned(PinnedStaging),
}

impl StagingRing {
    /// `slots` slots (at least 2: one fills while the sink drains another)
    /// for reads of `chunk` bytes, each about `slot_size` bytes (rounded to
    /// whole chunks, at most 1 GiB).
    pub fn new(slots: usize, slot_size: usize, chunk: usize) -> io::Result<StagingRing> {
        let (slot_len, len) = Self::size(slots, slot_size, chunk)?;
        let mut memory = Mapping::anonymous(len, true)?;
        crate::pipeline::populate_range(memory.writer(), 0..len, 1)?;
        Ok(StagingRing { memory: StagingMemory::Plain(memory), slots, slot_len })
    }

    /// [`StagingRing::new`] in memory pinned for `context`'s device.
    pub fn pinned(
        context: &Context,
        slots: usize,
        slot_size: usize,
        chunk: usize,
    ) -> io::Result<StagingRing> {
        let (slot_len, len) = Self::size(slots, slot_size, chunk)?;
        let memory = PinnedStaging::new(context, len)?;
        Ok(StagingRing { memory: StagingMemory::Pinned(memory), slots, slot_len })
    }

    fn size(slots: usize, slot_size: usize, chunk: usize) -> io::Result<(usize, usize)> {
        if slots < 2 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a staging ring needs at least 2 slots"));
        }
        let slot_len = Plan::slot_len(chunk, slot_size, sys::mem::page_size());
        let len = slots
            .checked_mul(slot_len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "staging ring size overflows"))?;
        Ok((slot_len, len))
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether this ring is what [`StagingRing::new`] or
    /// [`StagingRing::pinned`] would make of these arguments, so a ring
    /// kept from an earlier load can serve a new one.
    pub fn has_geometry(&self, slots: usize, slot_size: usize, chunk: usize) -> bool {
        Self::size(slots, slot_size, chunk).is_ok_and(|(slot_len, _)| (slots, slot_len) == (self.slots, self.slot_len))
    }

    /// Bytes per slot (whole chunks).
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Bytes of memory the ring holds.
    pub fn len(&self) -> usize {
        self.slots * self.slot_len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the ring is pinned for a CUDA device.
    pub fn is_pinned(&self) -> bool {
        matches!(self.memory, StagingMemory::Pinned(_))
    }

    pub(crate) fn writer(&mut self) -> MappingWriter<'_> {
        match &mut self.memory {
            StagingMemory::Plain(mapping) => mapping.writer(),
            StagingMemory::Pinned(pinned) => pinned.writer(),
        }
    }
}

/// A sink into memory the caller already has: file byte `first_offset + i`
/// lands in `dst[i]`. Each delivery first populates its part of `dst`
/// (`MADV_POPULATE_WRITE`, beside the reads like the rest of the delivery),
/// which costs a fraction of faulting each page in with the copy: memory the
/// caller has not touched yet needs no populating pass of its own.
pub struct HostSink<'a> {
    dst: &'a mut [u8],
    first_offset: u64,
}

impl<'a> HostSink<'a> {
    /// File bytes `first_offset..first_offset + dst.len()` go into `dst`.
    pub fn new(dst: &'a mut [u8], first_offset: u64) -> Self {
        HostSink { dst, first_offset }
    }
}

impl Sink for HostSink<'_> {
    fn deliver(&mut self, _slot: usize, data: SlotData<'_>) -> io::Result<()> {
        let start = data
            .file_offset()
            .checked_sub(self.first_offset)
            .and_then(|at| usize::try_from(at).ok())
            .filter(|&at| at + data.len() <= self.dst.len())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "file bytes {}+{} fall outside the destination ({} bytes from offset {})",
                        data.file_offset(),
                        data.len(),
                        self.dst.len(),
                        self.first_offset
                    ),
                )
            })?;
        let dst = &mut self.dst[start..start + data.len()];
        // Advice only: a page it could not populate is faulted in by the copy.
        let _ = sys::mem::populate_bytes(dst);
        data.copy_to(0..data.len(), dst);
        Ok(())
    }
}
