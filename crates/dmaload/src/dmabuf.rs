//! A dma-buf filled with a file's (or an object's) bytes
//! ([`crate::LoadRequest::to_dmabuf`]), handed over as an fd the caller
//! owns: `DMA_HEAP_ALLOC_AND_READ_FILE` in userspace.
//!
//! Two producers, one pipeline: `udmabuf` loads a memfd in place (direct
//! I/O where the filesystem allows) and exports its pages, no copy;
//! `dma-heap:NAME` allocates from the heap beside the reads and copies each
//! filled slot of the registered staging ring into the dma-buf's mapping
//! ([`DmaHeapSink`]), since O_DIRECT cannot read into a dma-buf mapping.

use std::io;
use std::path::Path;
use std::time::Instant;

use crate::device::staging_ring_slots;
use crate::error::{Error, ErrorKind, Result};
use crate::heap::DEFAULT_DMA_HEAP;
use crate::heap::{self, CpuAccess, DmaBuf, DmaHeap};
use crate::object::Object;
use crate::options::{Destination, LoadOptions};
use crate::pipeline::{
    check_memory, load_object_source, load_object_to_sink, load_open_to_sink, load_source, object_ring_slots,
    range_len, range_within,
};
use crate::report::LoadReport;
use crate::sink::{DmaHeapSink, StagingRing, DEFAULT_SLOT_SIZE};
use crate::source::OpenFile;
use crate::sys;
use crate::types::Fallback;

/// The staging ring of a dma-heap load: a quarter of the range, at most
/// 128 MiB (16 slots of 8 MiB), in 8 slots or more where the range allows,
/// so a small file neither populates a ring as large as itself nor reads
/// with fewer than 8 requests in flight. Returns (slots, slot size).
pub fn heap_ring_geometry(len: u64) -> (usize, usize) {
    let page = sys::mem::page_size();
    let ring = usize::try_from(len / 4).unwrap_or(usize::MAX).clamp(2 * page, HEAP_RING_BYTES);
    let slot_size = ring.div_ceil(8).div_ceil(page) * page;
    let slot_size = slot_size.clamp(page, HEAP_RING_SLOT_SIZE);
    (ring.div_ceil(slot_size).clamp(2, HEAP_RING_BYTES / HEAP_RING_SLOT_SIZE), slot_size)
}
const HEAP_RING_BYTES: usize = 128 << 20;
const HEAP_RING_SLOT_SIZE: usize = 8 << 20;

/// A dma-buf holding a range of a file.
#[derive(Debug)]
pub struct LoadedDmaBuf {
    /// The dma-buf (whole pages); its fd is the caller's to close.
    pub dmabuf: DmaBuf,
    /// Where the range's first byte sits in the dma-buf: 0, except for a
    /// udmabuf of a range whose offset direct I/O aligned down.
    pub data_offset: u64,
    /// Bytes of the range.
    pub len: u64,
}

impl LoadedDmaBuf {
    /// Reads the range back through a fresh mapping of the dma-buf, inside
    /// one `DMA_BUF_IOCTL_SYNC` read bracket, handing `each` the bytes in
    /// order, a slice of at most 16 MiB at a time (copied out: a device may
    /// write a dma-buf, so no slice of its mapping is formed).
    pub fn read_each(&self, mut each: impl FnMut(&[u8])) -> io::Result<()> {
        let map = self.dmabuf.map(CpuAccess::Read)?;
        let mut slice = vec![0u8; (16 << 20).min(self.len as usize)];
        let mut at = 0u64;
        while at < self.len {
            let n = slice.len().min((self.len - at) as usize);
            map.read_at((self.data_offset + at) as usize, &mut slice[..n])?;
            each(&slice[..n]);
            at += n as u64;
        }
        Ok(())
    }
}

/// The dma-buf producer a load uses.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Producer {
    Udmabuf,
    Heap(String),
}

/// What a dma-buf load reads: a file opened once, or an object looked up
/// once (its GETs pinned to the ETag of that lookup).
#[derive(Clone, Copy)]
pub(crate) enum DmaBufInput<'a> {
    File(&'a OpenFile),
    Object(&'a Object),
}

/// [`crate::LoadRequest::to_dmabuf`]: `len` bytes (to the end when `None`)
/// from `offset` of `input` into a new dma-buf of the kind `options.to`
/// names.
pub(crate) fn load_dmabuf(
    input: DmaBufInput<'_>,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
) -> Result<(LoadedDmaBuf, LoadReport)> {
    let (path, len) = match input {
        DmaBufInput::File(file) => {
            let len = range_len(file.source(), file.path(), offset, len)?;
            // Refused or looked up before any allocation; the load checks again.
            crate::verify::Expected::for_load(file, offset, Some(len), options.verify)?;
            (file.path(), len)
        }
        DmaBufInput::Object(object) => {
            let path = object.name();
            (path, range_within(object.size, "object", path, offset, len)?)
        }
    };
    if len == 0 {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            "an empty range cannot become a dma-buf",
        )
        .at(offset));
    }
    // udmabuf exports whole pages around the bytes.
    let page = sys::mem::page_size() as u64;
    let pages_len = (offset % page + len).div_ceil(page) * page;
    let (producer, why) = choose(path, &options.to, pages_len)?;
    let (loaded, mut report) = match (&producer, &why) {
        (Producer::Udmabuf, _) => load_udmabuf(input, offset, len, options)?,
        // Where neither exists, the error names both.
        (Producer::Heap(name), Choice::FellBack(udmabuf)) => {
            load_heap(input, path, name, offset, len, options)
                .map_err(|err| err.with_note(&format!(" (and not udmabuf: {})", udmabuf.reason)))?
        }
        (Producer::Heap(name), _) => load_heap(input, path, name, offset, len, options)?,
    };
    match why {
        Choice::Asked => {}
        Choice::Chose(reason) => report.destination = format!("{} ({reason})", report.destination),
        Choice::FellBack(fallback) => report.fallbacks.insert(0, fallback),
    }
    Ok((loaded, report))
}

/// Why a producer was used.
enum Choice {
    /// The options named it.
    Asked,
    /// `dmabuf` chose it, for this reason.
    Chose(String),
    /// `dmabuf` could not use udmabuf.
    FellBack(Fallback),
}

/// The producer for `to`, checked before any byte is read: udmabuf's
/// presence and size limit (a heap's presence is checked by opening it,
/// also before the first read).
fn choose(path: &Path, to: &Destination, pages_len: u64) -> Result<(Producer, Choice)> {
    let udmabuf = || -> std::result::Result<u64, String> {
        heap::udmabuf_probe()?;
        match heap::udmabuf_size_limit() {
            Some(limit) if pages_len > limit => Err(format!(
                "{pages_len} bytes exceed udmabuf's size_limit_mb ({} MiB): raise it with the kernel \
                 parameter udmabuf.size_limit_mb=N, or load into dma-heap:{DEFAULT_DMA_HEAP}",
                limit >> 20
            )),
            limit => Ok(limit.unwrap_or(u64::MAX)),
        }
    };
    match to {
        Destination::Udmabuf => match udmabuf() {
            Ok(_) => Ok((Producer::Udmabuf, Choice::Asked)),
            Err(why) => Err(Error::new(
                ErrorKind::InvalidInput,
                "udmabuf create",
                Path::new(heap::UDMABUF_DEVICE),
                why,
            )),
        },
        Destination::DmaHeap(name) => Ok((Producer::Heap(name.clone()), Choice::Asked)),
        Destination::Dmabuf => match udmabuf() {
            Ok(limit) => {
                let fits = if limit == u64::MAX {
                    "no size limit".to_owned()
                } else {
                    format!("its size_limit_mb of {} MiB holds {pages_len} bytes", limit >> 20)
                };
                Ok((
                    Producer::Udmabuf,
                    Choice::Chose(format!("dmabuf: {} exists and {fits}", heap::UDMABUF_DEVICE)),
                ))
            }
            Err(why) => {
                let heap = format!("dma-heap:{DEFAULT_DMA_HEAP}");
                Ok((
                    Producer::Heap(DEFAULT_DMA_HEAP.to_owned()),
                    Choice::FellBack(Fallback::new("udmabuf", &heap, why)),
                ))
            }
        },
        other => Err(Error::new(
            ErrorKind::InvalidInput,
            "load",
            path,
            format!("{other} is not a dma-buf destination (expected udmabuf, dmabuf or dma-heap:NAME)"),
        )),
    }
}

/// The staging ring of a dma-heap load of an object, as a device load of
/// one has it: slots of 16 MiB (the range's pages when smaller), as many as
/// the GETs in flight keep busy. A file's ring ([`heap_ring_geometry`])
/// would cut a small object into GETs of a few hundred KiB. Returns
/// (slots, slot size).
fn object_heap_ring(len: u64, options: &LoadOptions) -> (usize, usize) {
    let page = sys::mem::page_size() as u64;
    let pages = usize::try_from(len.div_ceil(page) * page).unwrap_or(usize::MAX);
    let slot_size = DEFAULT_SLOT_SIZE.min(pages);
    let slots = staging_ring_slots(len, slot_size).min(object_ring_slots(options, slot_size)).max(2);
    (slots, slot_size)
}

/// A memfd loaded in place, then exported with udmabuf: no copy.
fn load_udmabuf(
    input: DmaBufInput<'_>,
    offset: u64,
    len: u64,
    options: &LoadOptions,
) -> Result<(LoadedDmaBuf, LoadReport)> {
    // udmabuf exports a memfd of 4 KiB pages, whatever `auto` would choose.
    let memfd = LoadOptions { to: Destination::Memfd, ..options.clone() };
    let (buffer, mut report) = match input {
        DmaBufInput::File(file) => load_source(file, offset, Some(len), &memfd)?,
        DmaBufInput::Object(object) => load_object_source(object, offset, Some(len), &memfd)?,
    };
    let data_offset = (buffer.memfd_offset() % sys::mem::page_size()) as u64;
    let started = Instant::now();
    let dmabuf = buffer.into_dmabuf().map_err(|refused| refused.0)?;
    let export = started.elapsed().as_secs_f64();
    report.total_seconds += export;
    report.deliver_seconds = export;
    report.gib_per_second = len as f64 / (1u64 << 30) as f64 / report.total_seconds.max(1e-9);
    report.destination = "udmabuf (memfd exported, no copy)".into();
    Ok((LoadedDmaBuf { dmabuf, data_offset, len }, report))
}

/// A dma-buf from the heap `name`, allocated beside the reads and filled
/// from a staging ring sized to the file ([`heap_ring_geometry`]), or as
/// `options.staging_slots` and `staging_slot_size` say.
fn load_heap(
    input: DmaBufInput<'_>,
    path: &Path,
    name: &str,
    offset: u64,
    len: u64,
    options: &LoadOptions,
) -> Result<(LoadedDmaBuf, LoadReport)> {
    let started = Instant::now();
    let heap = DmaHeap::open(name)?;
    check_memory(path, len)?;
    // Allocation starts first, so the ring's populating overlaps it too.
    let mut sink = DmaHeapSink::allocate(heap, offset, len)?;
    // The options' staging ring where given, else one sized to the range.
    let (slots, slot_size) = match input {
        DmaBufInput::File(_) => heap_ring_geometry(len),
        DmaBufInput::Object(_) => object_heap_ring(len, options),
    };
    let slots = options.staging_slots.unwrap_or(slots);
    let slot_size = options.staging_slot_size.unwrap_or(slot_size);
    let chunk = options.chunk_size.min(slot_size);
    let mut ring = StagingRing::new(slots, slot_size, chunk)
        .map_err(|e| Error::io("allocate the staging ring", path, e))?;
    let loaded = match input {
        DmaBufInput::File(file) => load_open_to_sink(file, offset, Some(len), &mut ring, &mut sink, options),
        DmaBufInput::Object(object) => {
            load_object_to_sink(object, offset, Some(len), &mut ring, &mut sink, options)
        }
    };
    let mut report = match loaded {
        Ok(report) => report,
        // The allocation's own error is the cause: the load saw only that
        // its delivery stopped.
        Err(err) => return Err(sink.take_error().unwrap_or(err)),
    };
    let alloc_seconds = sink.alloc_seconds();
    let dmabuf =
        sink.into_dmabuf().map_err(|e| Error::io("dma-heap alloc", Path::new(heap::DMA_HEAP_DIR), e))?;
    report.alloc_seconds = alloc_seconds;
    report.total_seconds = started.elapsed().as_secs_f64();
    report.gib_per_second = len as f64 / (1u64 << 30) as f64 / report.total_seconds.max(1e-9);
    report.destination = format!("dma-heap:{name} via {}", report.destination);
    Ok((LoadedDmaBuf { dmabuf, data_offset: 0, len }, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heap_ring_is_a_quarter_of_the_file_in_8_slots_at_most_128_mib() {
        assert_eq!(sys::mem::page_size(), 4096);
        let mib = 1 << 20;
        assert_eq!(heap_ring_geometry(100), (2, 4096));
        assert_eq!(heap_ring_geometry(512 << 10), (8, 16 << 10));
        assert_eq!(heap_ring_geometry(8 * mib as u64), (8, 256 << 10));
        assert_eq!(heap_ring_geometry(64 * mib as u64), (8, 2 * mib));
        assert_eq!(heap_ring_geometry(1 << 30), (16, 8 * mib));
        assert_eq!(heap_ring_geometry(3 << 30), (16, 8 * mib));
        assert_eq!(heap_ring_geometry(u64::MAX), (16, 8 * mib));
    }

    #[test]
    fn an_objects_heap_ring_takes_whole_gets_in_the_slots_its_connections_fill() {
        let (options, mib) = (LoadOptions::default(), 1 << 20);
        // A small object: one slot of its pages, two slots at least.
        assert_eq!(object_heap_ring(5 * mib as u64 + 123, &options), (2, 5 * mib + 4096));
        // A large one: 16 MiB slots, as many as 8 GETs of 8 MiB fill, and two more.
        assert_eq!(object_heap_ring(1 << 30, &options), (6, 16 * mib));
    }
}
