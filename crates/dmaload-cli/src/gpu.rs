//! `dmaload load FILE --to cuda:N`: the file into one device allocation
//! through a pinned staging ring (the pipeline's CUDA sink).

use std::path::Path;
use std::time::Instant;

use dmaload::cuda::{Context, DeviceBuffer};
use dmaload::sink::{CudaSink, DEFAULT_SLOTS, DEFAULT_SLOT_SIZE};
use dmaload::{Error, LoadOptions, LoadReport, OpenFile, StagingRing};

use crate::output::Hash;

/// Loads `len` bytes (to the end when `None`) from `offset` onto device
/// `ordinal`; with `hash`, the xxh3-64 of the device's bytes, copied back
/// in slices after the load.
pub fn load(
    path: &Path,
    offset: u64,
    len: Option<u64>,
    ordinal: usize,
    options: &mut LoadOptions,
    hash: bool,
) -> Result<(LoadReport, Option<Hash>), Error> {
    let cuda = |op: &'static str| move |e: dmaload::cuda::CudaError| Error::io(op, path, e.into());
    let file = OpenFile::open(path)?;
    let len = len.unwrap_or(file.len().saturating_sub(offset));
    let context = Context::primary(ordinal).map_err(cuda("open the CUDA device"))?;
    let (free, _) = context.mem_info().map_err(cuda("cuMemGetInfo"))?;
    if len > free as u64 {
        return Err(Error::new(
            dmaload::ErrorKind::OutOfMemory,
            "load",
            path,
            format!("needs {len} bytes on cuda:{ordinal} but only {free} are free"),
        ));
    }
    let mut device = DeviceBuffer::new(&context, len as usize).map_err(cuda("cuMemAlloc"))?;
    // One read per slot, every slot in flight, unless the flags say otherwise.
    if options.chunk_size == dmaload::load::DEFAULT_CHUNK_SIZE {
        options.chunk_size = DEFAULT_SLOT_SIZE;
    }
    let mut ring = StagingRing::pinned(&context, DEFAULT_SLOTS, DEFAULT_SLOT_SIZE, options.chunk_size)
        .map_err(|e| Error::io("allocate the staging ring", path, e))?;
    let mut report = {
        let mut sink =
            CudaSink::new(&context, vec![(offset, device.range())]).map_err(cuda("cuStreamCreate"))?;
        dmaload::load_open_to_sink(&file, offset, Some(len), &mut ring, &mut sink, options)?
    };
    report.destination =
        format!("cuda:{ordinal} ({}) via {}", context.device_name().unwrap_or_default(), report.destination);
    let hash = hash.then(|| -> Result<Hash, Error> {
        let started = Instant::now();
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut slice = vec![0u8; 64 << 20];
        let mut at = 0usize;
        while at < len as usize {
            let n = slice.len().min(len as usize - at);
            device.copy_to_host(at, &mut slice[..n]).map_err(cuda("cuMemcpyDtoH"))?;
            hasher.update(&slice[..n]);
            at += n;
        }
        Ok(Hash { xxh3_64: format!("{:016x}", hasher.digest()), seconds: started.elapsed().as_secs_f64() })
    });
    Ok((report, hash.transpose()?))
}
