//! The CUDA destination: each filled staging slot is copied to device
//! memory with `cuMemcpyHtoDAsync` on one of a few streams (round robin, so
//! copies of consecutive slots overlap), and an event recorded after the
//! slot's copies tells when the slot may be read into again.

use std::io;

use super::{Sink, SlotData};
use crate::cuda::{copy_htod_async, Context, CudaError, DeviceRange, Event, Stream};

/// Streams the copies are spread over.
const STREAMS: usize = 4;

/// A sink into device memory: file bytes `offset..offset + range.len()` land
/// in each target `(offset, range)`; bytes of a slot outside every target
/// are not copied (a safetensors header, say).
pub struct CudaSink<'d> {
    context: Context,
    targets: Vec<(u64, DeviceRange<'d>)>,
    streams: Vec<Stream>,
    /// Per slot: recorded after the slot's last copies.
    events: Vec<Option<Event>>,
}

impl<'d> CudaSink<'d> {
    /// Copies into `targets` (in any order; they may not overlap in the
    /// file) through streams of `context`.
    pub fn new(context: &Context, mut targets: Vec<(u64, DeviceRange<'d>)>) -> Result<Self, CudaError> {
        targets.sort_by_key(|(offset, _)| *offset);
        let streams = (0..STREAMS).map(|_| Stream::new(context)).collect::<Result<Vec<_>, _>>()?;
        Ok(CudaSink { context: context.clone(), targets, streams, events: Vec::new() })
    }
}

impl Sink for CudaSink<'_> {
    fn deliver(&mut self, slot: usize, data: SlotData<'_>) -> io::Result<()> {
        let stream = &self.streams[slot % self.streams.len()];
        let (memory, range) = data.raw();
        let start = data.file_offset();
        let end = start + data.len() as u64;
        // The first target that may overlap: targets are sorted by offset.
        let first = self.targets.partition_point(|(offset, dst)| offset + dst.len() as u64 <= start);
        for (offset, dst) in &self.targets[first..] {
            if *offset >= end {
                break;
            }
            let from = start.max(*offset);
            let to = end.min(offset + dst.len() as u64);
            let in_slot = range.start + (from - start) as usize;
            let src = in_slot..in_slot + (to - from) as usize;
            copy_htod_async(dst, (from - offset) as usize, memory, src, stream)?;
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
