//! The CUDA destination: each filled staging slot is copied to device
//! memory with `cuMemcpyHtoDAsync` on one of a few streams (round robin, so
//! copies of consecutive slots overlap), and an event recorded after the
//! slot's copies tells when the slot may be read into again.

use std::io;

use super::{first_overlap, scatter, Sink, SlotData};
use crate::cuda::{copy_htod_async, Context, CudaError, DeviceRange, Event, Stream};

/// Streams the copies are spread over.
const STREAMS: usize = 4;

/// A sink into device memory: file bytes `offset..offset + range.len()` land
/// in each target `(offset, range)`; bytes of a slot outside every target
/// are not copied (a safetensors header, say).
pub struct CudaSink<'d> {
    context: Context,
    targets: Vec<(u64, DeviceRange<'d>)>,
    /// Each target's file offset and length, as [`scatter`] takes them.
    spans: Vec<(u64, usize)>,
    streams: Vec<Stream>,
    /// Per slot: recorded after the slot's last copies.
    events: Vec<Option<Event>>,
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
        Ok(CudaSink { context: context.clone(), targets, spans, streams, events: Vec::new() })
    }
}

impl Sink for CudaSink<'_> {
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> io::Result<()> {
        let stream = &self.streams[slot % self.streams.len()];
        let (memory, range) = data.raw();
        for piece in scatter(&self.spans, data.file_offset(), data.len()) {
            let dst = &self.targets[piece.target].1;
            let src = range.start + piece.in_slot.start..range.start + piece.in_slot.end;
            copy_htod_async(dst, piece.in_target, memory, src, stream)?;
        }
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
