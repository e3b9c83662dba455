//! The CUDA destination: each filled staging slot is copied to device
//! memory with `cuMemcpyHtoDAsync` on one of a few streams (round robin, so
//! copies of consecutive slots overlap), and an event recorded after the
//! slot's copies tells when the slot may be read into again.
//!
//! The slots are pinned before their first copy, where the ring is
//! pinned as it is used ([`super::StagingRing::pinned_as_used`]).
//!
//! Ranges of the file already in the page cache take the cache lane
//! instead ([`CachedRanges`]): threads of the sink's own, each with its own
//! stream and a few small staging pieces, copy from the page cache into a
//! piece and queue its copy to the device, waiting only for their own
//! oldest copy before reusing a piece: no ring, no order, no shared gate.

use std::io;
use std::ops::Range;
use std::sync::Arc;

use super::{first_overlap, scatter, CachedRanges, Sink, SlotData, StagingRing};
use crate::cuda::{copy_htod_async, Context, CudaError, DeviceRange, Event, StagingPins, Stream};
use crate::sys::mem::MappingWriter;
use crate::types::Fallback;

/// Streams the copies are spread over.
const STREAMS: usize = 4;

/// A sink into device memory: file bytes `offset..offset + range.len()` land
/// in each target `(offset, range)`; bytes of a slot outside every target
/// are not copied (a safetensors header, say).
pub struct CudaSink<'d> {
    context: Context,
    /// Shared with the cache lane's threads.
    targets: Arc<Targets<'d>>,
    streams: Vec<Stream>,
    /// Per slot: recorded after the slot's last copies.
    events: Vec<Option<Event>>,
    /// Pins the ring's slots before their first copies ([`Sink::staging_ring`]).
    pins: Option<StagingPins>,
}

impl<'d> CudaSink<'d> {
    /// Copies into `targets` (in any order) through streams of `context`.
    /// Targets that overlap in the file, or end past the largest file
    /// offset, are refused (EINVAL): a byte has one destination.
    pub fn new(context: &Context, mut targets: Vec<(u64, DeviceRange<'d>)>) -> Result<Self, CudaError> {
        // An empty target takes no bytes, wherever it is.
        targets.retain(|(_, dst)| !dst.is_empty());
        targets.sort_by_key(|(offset, _)| *offset);
        let spans: Vec<(u64, usize)> = targets.iter().map(|(offset, dst)| (*offset, dst.len())).collect();
        if let Some(&(offset, len)) =
            spans.iter().find(|(offset, len)| offset.checked_add(*len as u64).is_none())
        {
            let message = format!("a device target of {len} bytes at file offset {offset} ends past 2^64");
            return Err(CudaError::new("CudaSink::new", message, libc::EINVAL));
        }
        if let Some(i) = first_overlap(&spans) {
            let ((a, a_len), (b, b_len)) = (spans[i], spans[i + 1]);
            let message = format!("device targets overlap in the file: bytes {a}+{a_len} and {b}+{b_len}");
            return Err(CudaError::new("CudaSink::new", message, libc::EINVAL));
        }
        let streams = (0..STREAMS).map(|_| Stream::new(context)).collect::<Result<Vec<_>, _>>()?;
        let targets = Arc::new(Targets { targets, spans });
        Ok(CudaSink { context: context.clone(), targets, streams, events: Vec::new(), pins: None })
    }
}

/// Where a sink's bytes go on the device.
struct Targets<'d> {
    targets: Vec<(u64, DeviceRange<'d>)>,
    /// Each target's file offset and length, as [`scatter`] takes them.
    spans: Vec<(u64, usize)>,
}

impl Targets<'_> {
    /// Queues on `stream` the copies of file bytes `file_offset..` held in
    /// `staging[range]` to the targets they fall in.
    fn copy(
        &self,
        staging: MappingWriter<'_>,
        range: Range<usize>,
        file_offset: u64,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        for piece in scatter(&self.spans, file_offset, range.len()) {
            let dst = &self.targets[piece.target].1;
            let src = range.start + piece.in_slot.start..range.start + piece.in_slot.end;
            copy_htod_async(dst, piece.in_target, staging, src, stream)?;
        }
        Ok(())
    }
}

/// One cache-lane thread: takes cached ranges until none are left, each
/// piece by piece through `thread`'s staging pieces on a stream of its own,
/// a piece read into again only once its event says its copy has landed;
/// drains its stream before it returns, also after a failure (which it
/// hands to `cached`, with the file offset, and which stops the others).
fn carry_cached(context: &Context, targets: &Targets<'_>, cached: &CachedRanges<'_>, thread: usize) {
    let pieces = cached.pieces_of(thread);
    let Some(first) = cached.take() else { return };
    let made = Stream::new(context).and_then(|stream| {
        let events = pieces.iter().map(|_| Event::new(context)).collect::<Result<Vec<_>, _>>()?;
        Ok((stream, events))
    });
    let (stream, events) = match made {
        Ok(made) => made,
        Err(err) => return cached.fail(first.start, err.into()),
    };
    let staging = cached.staging();
    let mut turn = 0;
    let mut carry = |range: Range<u64>| -> Result<(), (u64, io::Error)> {
        let mut at = range.start;
        while at < range.end {
            if cached.is_stopped() {
                return Ok(());
            }
            let i = turn % pieces.len();
            turn += 1;
            let piece = &pieces[i];
            let len = piece.len().min((range.end - at) as usize);
            let part = piece.start..piece.start + len;
            // The piece's last copy must have read it before it is rewritten.
            events[i].synchronize().map_err(|e| (at, e.into()))?;
            cached.read_piece(part.clone(), at).map_err(|e| (at, e))?;
            targets.copy(staging, part, at, &stream).map_err(|e| (at, e.into()))?;
            events[i].record(&stream).map_err(|e| (at, e.into()))?;
            cached.carried(len as u64);
            at += len as u64;
        }
        Ok(())
    };
    let mut range = Some(first);
    let mut last = 0;
    while let Some(next) = range {
        last = next.end;
        if let Err((offset, err)) = carry(next) {
            cached.fail(offset, err);
            break;
        }
        range = cached.take();
    }
    // Every copy from the pieces lands (or the wait gives up on a wedged
    // device) before the pieces can be reused by the ring or freed.
    if let Err(err) = stream.synchronize() {
        cached.fail(last, err.into());
    }
}

impl Sink for CudaSink<'_> {
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> io::Result<()> {
        let stream = &self.streams[slot % self.streams.len()];
        let (memory, range) = data.raw();
        if let Some(pins) = &self.pins {
            pins.pin(range.clone()).map_err(|err| {
                let err = io::Error::from(err);
                io::Error::new(err.kind(), format!("pin slot {slot} of the staging ring: {err}"))
            })?;
        }
        self.targets.copy(memory, range, data.file_offset(), stream)?;
        if self.events.len() <= slot {
            self.events.resize_with(slot + 1, || None);
        }
        let event = match &mut self.events[slot] {
            Some(event) => event,
            empty => empty.insert(Event::new(&self.context)?),
        };
        event.record(stream)?;
        Ok(())
    }

    fn release(&mut self, slot: usize) -> io::Result<()> {
        match self.events.get(slot) {
            Some(Some(event)) => Ok(event.synchronize()?),
            _ => Ok(()),
        }
    }

    fn is_released(&mut self, slot: usize) -> io::Result<bool> {
        match self.events.get(slot) {
            Some(Some(event)) => Ok(event.is_complete()?),
            _ => Ok(true),
        }
    }

    fn has_cache_lane(&self) -> bool {
        true
    }

    fn staging_ring(&mut self, ring: &StagingRing) {
        self.pins = ring.pins();
    }

    fn feed(
        &mut self,
        _threads: usize,
        cached: Option<&CachedRanges<'_>>,
        deliveries: &mut dyn FnMut(&mut dyn Sink),
    ) -> Vec<Fallback> {
        let Some(cached) = cached else {
            deliveries(self);
            return Vec::new();
        };
        // The lane's pieces, whole slots at the ring's end, pinned as one
        // registration before any lane thread copies from them (a piece
        // may straddle two slots).
        let lane = (0..cached.threads()).flat_map(|t| cached.pieces_of(t)).fold(None, |span, piece| {
            let (start, end) = span.unwrap_or((piece.start, piece.end));
            Some((start.min(piece.start), end.max(piece.end)))
        });
        if let (Some(pins), Some((start, end))) = (&self.pins, lane) {
            if let Err(err) = pins.pin(start..end) {
                // Where the lane would have started: its first range.
                let at = cached.take().map_or(0, |range| range.start);
                cached.fail(at, err.into());
                deliveries(self);
                return Vec::new();
            }
        }
        let (context, targets) = (self.context.clone(), Arc::clone(&self.targets));
        let lane = |thread| carry_cached(&context, &targets, cached, thread);
        std::thread::scope(|scope| {
            let mut unspawned = Vec::new();
            for thread in 0..cached.threads() {
                let name = std::thread::Builder::new().name("dmaload-cache-lane".into());
                if let Err(err) = name.spawn_scoped(scope, move || lane(thread)) {
                    unspawned.push((thread, err));
                }
            }
            deliveries(self);
            // A lane no thread could run is run here, after the deliveries:
            // the first takes every range still left.
            let fallbacks = match unspawned.first() {
                Some((_, err)) => vec![Fallback::new(
                    &format!("carry the cached ranges on {} threads", cached.threads()),
                    &format!("on {} threads and the delivering one", cached.threads() - unspawned.len()),
                    format!("cannot create a thread: {err}"),
                )],
                None => Vec::new(),
            };
            unspawned.into_iter().for_each(|(thread, _)| lane(thread));
            fallbacks
        })
    }

    fn finish(&mut self) -> io::Result<()> {
        // Every stream, even after an error on one: no copy may still read
        // the slots when the load returns.
        let mut result = Ok(());
        for stream in &self.streams {
            result = result.and(stream.synchronize());
        }
        Ok(result?)
    }
}
