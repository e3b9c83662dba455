//! Destinations fed from a ring of staging slots: the engine reads the file
//! into a few registered slots, and a [`Sink`] takes each filled slot (a
//! copy to a GPU, into memory the caller owns, into a dma-buf mapping, onto
//! a socket) and releases it for the next read. Memory used is the ring,
//! whatever the file size.
//!
//! [`crate::LoadRequest::to_sink`] runs it; [`HostSink`] is the simplest
//! destination (memory the caller already has) and the one the CI tests
//! run every staged code path through.

use std::io;
use std::ops::Range;

mod cached;
mod cuda;
mod dma_heap;
mod kept;
pub(crate) use cached::lane_pieces;
pub use cached::{CachedRanges, CACHE_LANE_PIECE, CACHE_LANE_PIECES};
pub use cuda::CudaSink;
pub use dma_heap::DmaHeapSink;
pub use kept::{keep_ring, release_staging, take_ring};

use crate::cuda::{Context, PinnedStaging, StagingPins};
use crate::lead::Lead;
use crate::plan::Plan;
use crate::sys;
use crate::sys::mem::{HugePageAdvice, Mapping, MappingWriter, Prefault, RawBytesMut, SharedMapping};
use crate::types::Fallback;

/// Staging slots by default: deep enough to keep a fast disk busy (the
/// engine reads into every free slot at once) while a GPU copy drains one.
pub const DEFAULT_SLOTS: usize = 32;
/// Bytes per staging slot by default: one 16 MiB read each, the request
/// size at which O_DIRECT reads reached the disk's best on the H100
/// machine (docs/benchmarks.md, "Figures behind the defaults").
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

    /// [`SlotData::copy_to`] into memory others may touch meanwhile: no
    /// slice of `dst` is formed.
    pub fn copy_to_raw(&self, part: Range<usize>, dst: RawBytesMut<'_>) {
        assert!(part.end <= self.len(), "part {part:?} outside a slot of {} bytes", self.len());
        self.memory.copy_out_raw(self.range.start + part.start..self.range.start + part.end, dst);
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

/// Where part of a slot goes: bytes `in_slot` of the slot (relative to its
/// start) land at byte `in_target` of target `target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub target: usize,
    pub in_target: usize,
    pub in_slot: Range<usize>,
}

/// The pieces of a slot holding file bytes `start..start + len` that fall
/// in targets given as `(file offset, length)`, sorted by offset and not
/// overlapping ([`first_overlap`] says); bytes in no target (a header, a
/// gap) go nowhere. A slot may feed several targets, and a target be fed
/// by several slots.
pub(crate) fn scatter(targets: &[(u64, usize)], start: u64, len: usize) -> impl Iterator<Item = Piece> + '_ {
    let end = start + len as u64;
    // The first target that may overlap: sorted, disjoint targets also end
    // in order, so those ending by `start` come first.
    let first = targets.partition_point(|&(offset, tlen)| offset + tlen as u64 <= start);
    let candidates = targets[first..].iter().take_while(move |&&(offset, _)| offset < end);
    candidates.enumerate().filter_map(move |(i, &(offset, tlen))| {
        let from = start.max(offset);
        let to = end.min(offset + tlen as u64);
        (from < to).then(|| Piece {
            target: first + i,
            in_target: (from - offset) as usize,
            in_slot: (from - start) as usize..(to - start) as usize,
        })
    })
}

/// The index of the first of two neighbours that overlap among targets
/// `(file offset, length)` sorted by offset; `None` when none do.
pub(crate) fn first_overlap(targets: &[(u64, usize)]) -> Option<usize> {
    targets.windows(2).position(|pair| pair[0].0.saturating_add(pair[0].1 as u64) > pair[1].0)
}

/// A destination fed from staging slots. Deliveries come in file order from
/// one thread (not the I/O thread), and a slot is read into again only
/// after [`Sink::release`] returned for it.
pub trait Sink: Send + dyn_sink::AsDynSink {
    /// Takes the bytes of a filled slot (`slot` is its index in the ring).
    /// A sink that copies synchronously is done with the slot on return; one
    /// that starts an asynchronous copy finishes it in [`Sink::release`].
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> io::Result<()>;

    /// Blocks until the last delivery from `slot` no longer reads it.
    fn release(&mut self, _slot: usize) -> io::Result<()> {
        Ok(())
    }

    /// Whether the last delivery from `slot` no longer reads it, without
    /// blocking where the sink can tell (a CUDA sink queries the slot's
    /// event): the pipeline polls this to reuse each slot as soon as its
    /// copy lands, in whatever order copies land. By default,
    /// [`Sink::release`] then `true`.
    fn is_released(&mut self, slot: usize) -> io::Result<bool> {
        self.release(slot).map(|()| true)
    }

    /// Blocks until every delivery started has landed. Called once at the
    /// end of every load, also a failed one, before the slots can be reused
    /// or freed.
    fn finish(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// Whether the sink carries the ranges of the file that are in the page
    /// cache itself, on a lane of its own beside the ring ([`CachedRanges`],
    /// handed to [`Sink::feed`]; the CUDA sink's). By default no: every
    /// byte comes through the ring's slots.
    fn has_cache_lane(&self) -> bool {
        false
    }

    /// Runs `deliveries` (the pipeline's loop, which calls
    /// [`Sink::deliver`] and [`Sink::release`] on the sink it is given)
    /// against this sink, and returns what the sink could not do as it
    /// meant to. A sink with work of its own to do beside its deliveries
    /// (a [`HostSink`] faulting its destination in ahead of them, a CUDA
    /// sink carrying `cached`) does it here, on threads that end before
    /// this returns (a populating sink uses up to `threads`). `cached` is
    /// given only to a sink that [`Sink::has_cache_lane`].
    fn feed(
        &mut self,
        _threads: usize,
        _cached: Option<&CachedRanges<'_>>,
        deliveries: &mut dyn FnMut(&mut dyn Sink),
    ) -> Vec<Fallback> {
        deliveries(self.as_dyn());
        Vec::new()
    }

    /// Told, before a load feeds the sink, the ring it feeds it from. A
    /// sink whose copies need the slots pinned takes the ring's
    /// [`StagingRing::pins`] here and pins each part before its first copy
    /// from it, so a ring pinned as it is used ([`StagingRing::pinned_as_used`])
    /// pays for no slot the load does not reach. By default nothing.
    fn staging_ring(&mut self, _ring: &StagingRing) {}
}

mod dyn_sink {
    /// `&mut dyn Sink` from any sink, for [`super::Sink::feed`]'s default.
    pub trait AsDynSink {
        fn as_dyn(&mut self) -> &mut dyn super::Sink;
    }

    impl<S: super::Sink> AsDynSink for S {
        fn as_dyn(&mut self) -> &mut dyn super::Sink {
            self
        }
    }
}

/// A ring of staging slots: anonymous memory (2 MiB pages where THP
/// allows), populated once, reused by every load it serves; pinned for a
/// CUDA device when it feeds one, all at once ([`StagingRing::pinned`]) or
/// slot by slot as copies first read them ([`StagingRing::pinned_as_used`]).
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
        let mut memory = Mapping::anonymous(len, HugePageAdvice::Huge)?;
        memory.writer().populate_on_threads(0..len, 1)?;
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

    /// [`StagingRing::pinned`] with nothing pinned, nor faulted in, yet: a
    /// slot is pinned (a `cuMemHostRegister` of its own) when a sink told
    /// of the ring ([`Sink::staging_ring`]) first copies from it, so the
    /// set-up of a ring the load does not fill is never paid, and the rest
    /// is paid beside the reads instead of before them. The cache lane's
    /// slots are pinned together, as one registration, when the lane
    /// starts. Pinning stays done for later loads through the ring.
    pub fn pinned_as_used(
        context: &Context,
        slots: usize,
        slot_size: usize,
        chunk: usize,
    ) -> io::Result<StagingRing> {
        let (slot_len, len) = Self::size(slots, slot_size, chunk)?;
        let memory = PinnedStaging::unpinned(context, len, slot_len)?;
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
        Self::size(slots, slot_size, chunk)
            .is_ok_and(|(slot_len, _)| (slots, slot_len) == (self.slots, self.slot_len))
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

    /// Whether the ring is pinned for a CUDA device (or is pinned as it is used).
    pub fn is_pinned(&self) -> bool {
        matches!(self.memory, StagingMemory::Pinned(_))
    }

    /// What pins the ring's memory for its device, `None` for plain memory.
    pub fn pins(&self) -> Option<StagingPins> {
        match &self.memory {
            StagingMemory::Plain(_) => None,
            StagingMemory::Pinned(pinned) => Some(pinned.pins()),
        }
    }

    pub(crate) fn writer(&mut self) -> MappingWriter<'_> {
        match &mut self.memory {
            StagingMemory::Plain(mapping) => mapping.writer(),
            StagingMemory::Pinned(pinned) => pinned.writer(),
        }
    }
}

/// A sink into memory the caller already has: file byte `first_offset + i`
/// lands in `dst[i]`, delivery by delivery. The destination's pages are
/// faulted in (`MADV_POPULATE_WRITE`, content-preserving, a fraction of the
/// cost of one fault per page in the copy) by threads of the sink's own
/// that run ahead of the deliveries, at most [`POPULATE_AHEAD`] bytes, so
/// the delivering thread mostly only copies; a part no thread reached yet
/// it populates itself before copying. Memory the caller has not touched
/// yet thus needs no populating pass of its own.
pub struct HostSink<'a> {
    dst: RawBytesMut<'a>,
    first_offset: u64,
    /// The populating threads' progress, while [`Sink::feed`] runs them.
    ahead: Option<&'a Ahead<'a>>,
}

/// How far ahead of the last delivery the populating threads of a
/// [`HostSink`] may fault its destination in: enough to keep them busy
/// through a slow stretch of copies, bounded so a load that fails early has
/// not faulted in all of the caller's memory.
pub const POPULATE_AHEAD: usize = 256 << 20;
/// Bytes one populating thread takes at a time (aligned to this in the
/// address space, so a huge page is faulted in by one call).
const POPULATE_STEP: usize = 2 << 20;

impl<'a> HostSink<'a> {
    /// File bytes `first_offset..first_offset + dst.len()` go into `dst`.
    pub fn new(dst: &'a mut [u8], first_offset: u64) -> Self {
        HostSink::raw(dst.into(), first_offset)
    }

    /// [`HostSink::new`] for memory others may touch meanwhile (see
    /// [`RawBytesMut`]): written by raw copies only.
    pub fn raw(dst: RawBytesMut<'a>, first_offset: u64) -> Self {
        HostSink { dst, first_offset, ahead: None }
    }

    /// Where in `dst` the slot's bytes go.
    fn place(&self, data: &SlotData<'_>) -> io::Result<Range<usize>> {
        data.file_offset()
            .checked_sub(self.first_offset)
            .and_then(|at| usize::try_from(at).ok())
            .filter(|&at| at + data.len() <= self.dst.len())
            .map(|at| at..at + data.len())
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
            })
    }
}

impl Sink for HostSink<'_> {
    fn deliver(&mut self, _slot: usize, data: SlotData<'_>) -> io::Result<()> {
        let place = self.place(&data)?;
        let unclaimed = match self.ahead {
            Some(ahead) => ahead.claim_delivered(place.clone()),
            None => place.clone(),
        };
        // Advice only: a page it could not populate is faulted in by the copy.
        let _ = self.dst.range(unclaimed).populate();
        data.copy_to_raw(0..data.len(), self.dst.range(place));
        Ok(())
    }

    fn feed(
        &mut self,
        threads: usize,
        _cached: Option<&CachedRanges<'_>>,
        deliveries: &mut dyn FnMut(&mut dyn Sink),
    ) -> Vec<Fallback> {
        let (dst, pages) = self.dst.reborrow().prefault();
        // No thread for less than a step: the deliveries populate it as cheaply.
        let threads = threads.min(dst.len() / POPULATE_STEP);
        let ahead = Ahead::new(pages);
        let mut sink = HostSink { dst, first_offset: self.first_offset, ahead: Some(&ahead) };
        std::thread::scope(|scope| {
            // Whatever the deliveries' outcome, a panic included: the threads
            // stop, and the scope waits for them, before the memory is the
            // caller's again.
            let _stop = StopOnDrop(&ahead);
            let mut fallbacks = Vec::new();
            for started in 0..threads {
                let spawned = std::thread::Builder::new()
                    .name("dmaload-populate-ahead".into())
                    .spawn_scoped(scope, || ahead.populate());
                if let Err(err) = spawned {
                    fallbacks.push(Fallback::new(
                        &format!("populate the destination ahead of the deliveries on {threads} threads"),
                        &format!("on {started} threads, the rest as each part is delivered"),
                        format!("cannot create a thread: {err}"),
                    ));
                    break;
                }
            }
            deliveries(&mut sink);
            fallbacks
        })
    }
}

/// The destination of a [`HostSink`] as its populating threads share it:
/// steps of [`POPULATE_STEP`] bytes (aligned in the address space; the
/// first may be shorter), claimed through a [`Lead`] whose consumer is the
/// delivering thread, at most [`POPULATE_AHEAD`] bytes ahead of it.
struct Ahead<'a> {
    pages: Prefault<'a>,
    lead: Lead,
    /// Bytes of the first step (up to the first aligned address).
    head: usize,
}

impl<'a> Ahead<'a> {
    fn new(pages: Prefault<'a>) -> Self {
        let len = pages.len();
        let head = (POPULATE_STEP - pages.address() % POPULATE_STEP).min(len);
        let steps = if len == 0 { 0 } else { 1 + (len - head).div_ceil(POPULATE_STEP) };
        Ahead { pages, lead: Lead::new(steps, POPULATE_AHEAD / POPULATE_STEP), head }
    }

    /// The bytes of step `k`.
    fn step(&self, k: usize) -> Range<usize> {
        let start = if k == 0 { 0 } else { self.head + (k - 1) * POPULATE_STEP };
        let end = if k == 0 { self.head } else { start + POPULATE_STEP };
        start..end.min(self.pages.len())
    }

    /// The step that byte `at` falls in.
    fn step_of(&self, at: usize) -> usize {
        if at < self.head {
            0
        } else {
            1 + (at - self.head) / POPULATE_STEP
        }
    }

    /// One populating thread: claims and faults in step after step until
    /// the destination is done or the feed stops. One that fails (a kernel
    /// before 5.14, a memory limit) stops them all: the copy faults in
    /// whatever they left, as it would have without them.
    fn populate(&self) {
        while let Some(k) = self.lead.claim_next() {
            if self.pages.populate(self.step(k)).is_err() {
                self.lead.stop();
                return;
            }
        }
    }

    /// Records a delivery into `place` (which moves the populating threads'
    /// bound on) and returns the part of it (whole steps) that no thread
    /// claimed, which the delivering thread populates itself.
    fn claim_delivered(&self, place: Range<usize>) -> Range<usize> {
        if place.is_empty() {
            return place;
        }
        let taken = self.lead.take_through(self.step_of(place.end - 1) + 1);
        match taken.is_empty() {
            true => place.start..place.start,
            false => self.step(taken.start).start..self.step(taken.end - 1).end,
        }
    }

    fn stop(&self) {
        self.lead.stop();
    }
}

/// Stops the populating threads when dropped.
struct StopOnDrop<'s, 'a>(&'s Ahead<'a>);

impl Drop for StopOnDrop<'_, '_> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where each file byte of a slot goes, byte by byte: the reference
    /// [`scatter`] must agree with.
    fn scatter_bytewise(targets: &[(u64, usize)], start: u64, len: usize) -> Vec<(usize, usize, usize)> {
        (0..len)
            .filter_map(|i| {
                let byte = start + i as u64;
                let target = targets.iter().position(|&(o, l)| (o..o + l as u64).contains(&byte))?;
                Some((target, (byte - targets[target].0) as usize, i))
            })
            .collect()
    }

    #[test]
    fn a_slot_scatters_to_every_target_it_overlaps_and_nowhere_else() {
        // A small LCG: the same layouts every run.
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |below: u64| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % below
        };
        for _ in 0..2000 {
            // Sorted, disjoint targets with gaps (a header, padding) between.
            let mut targets = Vec::new();
            let mut at = next(8);
            for _ in 0..next(6) {
                let len = next(20) as usize + 1;
                targets.push((at, len));
                at += len as u64 + next(3) * next(5);
            }
            assert_eq!(first_overlap(&targets), None);
            let (start, len) = (next(at + 8), next(40) as usize);
            let pieces: Vec<Piece> = scatter(&targets, start, len).collect();
            let bytewise: Vec<(usize, usize, usize)> = pieces
                .iter()
                .flat_map(|p| p.in_slot.clone().enumerate().map(|(k, i)| (p.target, p.in_target + k, i)))
                .collect();
            assert_eq!(bytewise, scatter_bytewise(&targets, start, len), "{targets:?} slot {start}+{len}");
        }
    }

    #[test]
    fn overlapping_targets_are_found() {
        assert_eq!(first_overlap(&[(0, 10), (10, 5), (20, 1)]), None);
        assert_eq!(first_overlap(&[(0, 10), (9, 5)]), Some(0));
        assert_eq!(first_overlap(&[(0, 1), (4, 10), (12, 1)]), Some(1));
    }

    #[test]
    fn a_panic_in_the_deliveries_stops_the_populating_threads() {
        // Past the window, so the threads would wait for a delivery forever.
        let mut dst = vec![0u8; POPULATE_AHEAD + (16 << 20)];
        let mut sink = HostSink::new(&mut dst, 0);
        let fed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sink.feed(2, None, &mut |_| panic!("a delivery panicked"))
        }));
        assert!(fed.is_err());
    }
}
