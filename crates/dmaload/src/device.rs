//! `cuda:N` as a destination: a range of a file or an object in one
//! allocation on a CUDA device, read through a pinned staging ring and copied by the
//! [`CudaSink`]; the host holds the ring only, whatever the file's size,
//! and keeps it for the next load on the device ([`crate::sink::take_ring`]).

use std::io;
use std::path::Path;

use crate::cuda::{Context, CudaError, DeviceBuffer};
use crate::error::{Error, ErrorKind, Result};
use crate::object::Object;
use crate::options::LoadOptions;
use crate::pipeline::{
    load_open_to_sink, object_expected, object_ring_slots, range_len, range_within, stage_object,
};
use crate::report::LoadReport;
use crate::sink::{keep_ring, take_ring, CudaSink, Sink, StagingRing, DEFAULT_SLOTS, DEFAULT_SLOT_SIZE};
use crate::source::OpenFile;

/// A range of a file in device memory.
#[derive(Debug)]
pub struct LoadedDevice {
    /// The allocation holding the range from its first byte.
    pub memory: DeviceBuffer,
    /// Bytes of the range.
    pub len: u64,
}

impl LoadedDevice {
    /// Copies the range back to the host (`cuMemcpyDtoH`), handing `each`
    /// the bytes in order, at most 64 MiB at a time.
    pub fn read_each(&self, mut each: impl FnMut(&[u8])) -> io::Result<()> {
        let len = usize::try_from(self.len).map_err(io::Error::other)?;
        let mut slice = vec![0u8; (64 << 20).min(len)];
        let mut at = 0;
        while at < len {
            let n = slice.len().min(len - at);
            self.memory.copy_to_host(at, &mut slice[..n])?;
            each(&slice[..n]);
            at += n;
        }
        Ok(())
    }
}

/// Loads `len` bytes (to the end when `None`) from `offset` of `file` into
/// a new allocation on device `ordinal`. A range larger than the device's
/// free memory is an [`ErrorKind::OutOfMemory`] error before any read.
/// The ring is `options.staging_slots` of `options.staging_slot_size`
/// bytes, each unset one sized for the range and the disk
/// ([`device_ring_slots`] of the reads the file's device keeps in flight,
/// [`DEFAULT_SLOT_SIZE`]), and pinned slot by slot as the copies first
/// read them. Reads are one slot each unless `options.chunk_size` was
/// changed from its default.
pub(crate) fn load_open_device(
    file: &OpenFile,
    offset: u64,
    len: Option<u64>,
    ordinal: usize,
    options: &LoadOptions,
) -> Result<(LoadedDevice, LoadReport)> {
    let path = file.path();
    let len = range_len(file.source(), path, offset, len)?;
    // Refused or looked up before any allocation; the load checks again.
    crate::verify::Expected::for_load(file, offset, Some(len), options.verify)?;
    let slot_size = slot_size(options);
    let slots = ring_slots_for(file, len, options);
    let mut options = options.clone();
    if options.chunk_size == crate::options::DEFAULT_CHUNK_SIZE {
        options.chunk_size = slot_size;
    }
    load_device(path, (offset, len), ordinal, slots, &options, |ring, sink| {
        load_open_to_sink(file, offset, Some(len), ring, sink, &options)
    })
}

/// Loads `len` bytes (to the end when `None`) from `offset` of `object`
/// into a new allocation on device `ordinal`, as [`load_open_device`] does
/// a file's: the GETs receive into the pinned ring's slots, which the
/// [`CudaSink`] copies to the device. The ring has no more slots than the
/// GETs in flight keep busy ([`object_ring_slots`]), unless a larger one
/// is kept for the device or `options.staging_slots` says how many. A
/// range past the object's end, a verified load whose sums object does not
/// list it, or a range larger than the device's free memory is refused
/// before anything is allocated.
pub(crate) fn load_object_device(
    object: &Object,
    offset: u64,
    len: Option<u64>,
    ordinal: usize,
    options: &LoadOptions,
) -> Result<(LoadedDevice, LoadReport)> {
    let path = object.name();
    let len = range_within(object.size, "object", path, offset, len)?;
    let expected = object_expected(object, offset, Some(len), options)?;
    let slot_size = slot_size(options);
    let slots = options.staging_slots.unwrap_or_else(|| {
        staging_ring_slots(len, slot_size).min(object_ring_slots(options, slot_size)).max(2)
    });
    load_device(path, (offset, len), ordinal, slots, options, |ring, sink| {
        stage_object(object, offset, Some(len), ring, sink, (options, expected.as_ref()))
    })
}

/// The device side of a load to `cuda:N`, whatever the source: checks the
/// device's free memory for the range's `len` bytes (from `offset` of the
/// source), allocates them, takes the ring kept for the device (or pins
/// one of `slots` slots of `options.staging_slot_size`), and has `load`
/// fill the allocation through it with a [`CudaSink`]; the ring is kept
/// again afterwards.
fn load_device(
    path: &Path,
    (offset, len): (u64, u64),
    ordinal: usize,
    slots: usize,
    options: &LoadOptions,
    load: impl FnOnce(&mut StagingRing, &mut CudaSink) -> Result<LoadReport>,
) -> Result<(LoadedDevice, LoadReport)> {
    let cuda = |op: &'static str| move |e: CudaError| Error::io(op, path, e.into());
    let context = Context::primary(ordinal).map_err(cuda("open the CUDA device"))?;
    let mut memory = allocate(&context, ordinal, len, path)?;
    let ring_started = std::time::Instant::now();
    let device = Some((ordinal, &context));
    let slot_size = slot_size(options);
    let mut ring = take_ring(device, slots, slot_size, options.chunk_size)
        .map_err(|e| Error::io("allocate the staging ring", path, e))?;
    let ring_setup = ring_started.elapsed();
    let loaded = CudaSink::new(&context, vec![(offset, memory.range())])
        .map_err(cuda("cuStreamCreate"))
        .and_then(|mut sink| {
            sink.staging_ring(&ring);
            load(&mut ring, &mut sink)
        });
    // Every copy has finished when the load returns, so the ring is idle
    // and serves the next load on this device, unless the context is
    // broken (a sticky error, a lost device): its pinned memory must not
    // be used again.
    if loaded.is_ok() || context.synchronize().is_ok() {
        keep_ring(Some(ordinal), ring);
    }
    let mut report = loaded?;
    report.alloc_seconds = ring_setup.as_secs_f64();
    report.destination =
        format!("cuda:{ordinal} ({}) via {}", context.device_name().unwrap_or_default(), report.destination);
    Ok((LoadedDevice { memory, len }, report))
}

/// `len` bytes of device memory on `context` (device `ordinal`) for a load
/// of `path`, after [`check_device_memory`].
pub fn allocate(context: &Context, ordinal: usize, len: u64, path: &Path) -> Result<DeviceBuffer> {
    let cuda = |op: &'static str| move |e: CudaError| Error::io(op, path, e.into());
    check_device_memory(context, ordinal, len, path)?;
    let bytes =
        usize::try_from(len).map_err(|_| Error::new(ErrorKind::InvalidInput, "load", path, "too large"))?;
    DeviceBuffer::new(context, bytes).map_err(cuda("cuMemAlloc"))
}

/// The one check that a load of `path` needing `len` bytes on `context`
/// (device `ordinal`) fits in what the device has free: an `OutOfMemory`
/// error naming both figures, for a caller to make before it allocates
/// anything (the CLI's loads, and Python's before PyTorch allocates).
pub fn check_device_memory(context: &Context, ordinal: usize, len: u64, path: &Path) -> Result<()> {
    let (free, _) = context.mem_info().map_err(|e| Error::io("cuMemGetInfo", path, e.into()))?;
    if len > free as u64 {
        return Err(Error::new(
            ErrorKind::OutOfMemory,
            "load",
            path,
            format!("needs {len} bytes on cuda:{ordinal} but only {free} are free"),
        ));
    }
    Ok(())
}

/// Slots of `slot_len` bytes in the staging ring of a device load of `len`
/// bytes: a quarter of the range, or all of it up to 8 slots
/// (pinning costs time and memory for every slot: with 16 MiB slots a
/// 40 MiB file pins 3, a 1 GiB file 16, not 32), at least the 2 a ring
/// needs, at most [`DEFAULT_SLOTS`]. A file's ring to a device never
/// exceeds it ([`device_ring_slots`]), unless
/// [`LoadOptions::staging_slots`] is given.
pub fn staging_ring_slots(len: u64, slot_len: usize) -> usize {
    let filled = usize::try_from(len.div_ceil(slot_len.max(1) as u64)).unwrap_or(usize::MAX);
    filled.div_ceil(4).max(filled.min(MIN_RING_SLOTS)).clamp(2, DEFAULT_SLOTS)
}

/// Slots of `slot_len` bytes in the staging ring of a device load of
/// `len` bytes whose reads keep `reads_in_flight` bytes in flight: the
/// slots those reads fill, plus two whose copies to the device are
/// queued (one on the link, one waiting), so neither the disk nor the link waits for a
/// slot and the ring holds no more than the slower of them keeps busy;
/// never more than [`staging_ring_slots`] gives the range, at least 2
/// (see [`ring_slots_for`]).
pub fn device_ring_slots(len: u64, slot_len: usize, reads_in_flight: u64) -> usize {
    let reads = usize::try_from(reads_in_flight.div_ceil(slot_len.max(1) as u64)).unwrap_or(usize::MAX);
    let needed = reads.max(1).saturating_add(COPIES_BEHIND_THE_LINK);
    needed.min(staging_ring_slots(len, slot_len)).max(2)
}

/// Slots of the staging ring of a load of `len` bytes of `file` to a
/// device with `options`: [`LoadOptions::staging_slots`] where given,
/// else [`device_ring_slots`] of the bytes the file's reads keep in
/// flight. The CLI's and Python's loads of files to `cuda:N` size their
/// ring with it.
pub fn ring_slots_for(file: &OpenFile, len: u64, options: &LoadOptions) -> usize {
    let in_flight = || device_ring_slots(len, slot_size(options), reads_in_flight(file, options));
    options.staging_slots.unwrap_or_else(in_flight)
}

/// Bytes a load of `file` keeps in flight reading it: the depth and
/// request size measured for its device (remembered by earlier loads in
/// the tuning file: only what a trial measured is), else the options'
/// depth of requests of the options' chunk (32 of 4 MiB by default); a
/// depth or chunk the options set is theirs.
fn reads_in_flight(file: &OpenFile, options: &LoadOptions) -> u64 {
    use crate::options::{DEFAULT_CHUNK_SIZE, DEFAULT_QUEUE_DEPTH};
    let remembered = crate::tune::memory_file().zip(crate::tune::Device::of(&file.source().file).ok());
    let tuned = remembered.and_then(|(memory, device)| crate::tune::remembered(&memory, device));
    let depth = match tuned.and_then(|tuned| tuned.depth) {
        Some(depth) if options.queue_depth == DEFAULT_QUEUE_DEPTH => depth,
        _ => options.queue_depth,
    };
    let request = match tuned.and_then(|tuned| tuned.request) {
        Some(request) if options.chunk_size == DEFAULT_CHUNK_SIZE => request,
        _ => options.chunk_size,
    };
    depth as u64 * request as u64
}

/// Bytes per slot of a device's staging ring: as given, else
/// [`DEFAULT_SLOT_SIZE`].
fn slot_size(options: &LoadOptions) -> usize {
    options.staging_slot_size.unwrap_or(DEFAULT_SLOT_SIZE)
}

/// Slots a range fills before the ring holds a quarter of it.
const MIN_RING_SLOTS: usize = 8;

/// Slots of a device's ring whose copies wait behind the link: one on it
/// and one queued, so the link never idles between two copies.
const COPIES_BEHIND_THE_LINK: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_holds_a_quarter_of_the_range_or_what_a_small_one_fills() {
        let slot = DEFAULT_SLOT_SIZE as u64;
        assert_eq!(staging_ring_slots(0, DEFAULT_SLOT_SIZE), 2);
        assert_eq!(staging_ring_slots(1, DEFAULT_SLOT_SIZE), 2);
        assert_eq!(staging_ring_slots(2 * slot + 1, DEFAULT_SLOT_SIZE), 3);
        assert_eq!(staging_ring_slots(40 << 20, DEFAULT_SLOT_SIZE), 3);
        assert_eq!(staging_ring_slots(8 * slot, DEFAULT_SLOT_SIZE), 8);
        assert_eq!(staging_ring_slots(1 << 30, DEFAULT_SLOT_SIZE), 16);
        assert_eq!(staging_ring_slots(4 * DEFAULT_SLOTS as u64 * slot, DEFAULT_SLOT_SIZE), DEFAULT_SLOTS);
        assert_eq!(staging_ring_slots(u64::MAX, DEFAULT_SLOT_SIZE), DEFAULT_SLOTS);
        // Python's staged loads may choose another slot size.
        assert_eq!(staging_ring_slots(600 << 10, 64 << 10), 8);
    }

    #[test]
    fn the_ring_holds_the_reads_in_flight_and_the_copies_behind_the_link() {
        let slot = DEFAULT_SLOT_SIZE as u64;
        let mib = 1u64 << 20;
        // 32 requests of 4 MiB in flight fill 8 slots of 16 MiB; two more
        // hold the copies queued behind the link: a 1 GiB file pins 160 MiB
        // at most, not the 256 MiB a quarter of it would be.
        assert_eq!(device_ring_slots(1 << 30, DEFAULT_SLOT_SIZE, 32 * 4 * mib), 10);
        // A disk tuned to fewer, or smaller, requests needs fewer slots.
        assert_eq!(device_ring_slots(1 << 30, DEFAULT_SLOT_SIZE, 4 * 16 * mib), 6);
        assert_eq!(device_ring_slots(1 << 30, DEFAULT_SLOT_SIZE, 16 * mib + 1), 4);
        // Never more than the range (a quarter of it, or what a small one
        // fills) or the default ring, never fewer than two.
        assert_eq!(device_ring_slots(40 << 20, DEFAULT_SLOT_SIZE, 32 * 16 * mib), 3);
        assert_eq!(device_ring_slots(u64::MAX, DEFAULT_SLOT_SIZE, u64::MAX), DEFAULT_SLOTS);
        assert_eq!(device_ring_slots(64 * slot, DEFAULT_SLOT_SIZE, 32 * 16 * mib), 16);
        assert_eq!(device_ring_slots(1, DEFAULT_SLOT_SIZE, 0), 2);
        assert_eq!(device_ring_slots(1 << 30, DEFAULT_SLOT_SIZE, 0), 3);
    }
}
