//! `dmaload load FILE --to udmabuf|dma-heap:NAME|dmabuf`: the file into a
//! new dma-buf (seed 000's alloc-and-read), hashed back through a fresh
//! mapping of it on request.

use std::path::Path;
use std::time::Instant;

use dmaload::{Error, LoadOptions, LoadReport};

use crate::output::Hash;

/// Loads `len` bytes (to the end when `None`) from `offset` into the
/// dma-buf `options.to` names; with `hash`, the xxh3-64 of its bytes read
/// back through a new mapping, SYNC-bracketed, after the load. The dma-buf
/// is closed when the command exits.
pub fn load(
    path: &Path,
    offset: u64,
    len: Option<u64>,
    options: &LoadOptions,
    hash: bool,
) -> Result<(LoadReport, Option<Hash>), Error> {
    let (loaded, report) = dmaload::load_dmabuf(path, offset, len, options)?;
    let hash = hash.then(|| -> Result<Hash, Error> {
        let started = Instant::now();
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        loaded
            .read_each(|bytes| hasher.update(bytes))
            .map_err(|e| Error::io("read the dma-buf back", path, e))?;
        Ok(Hash { xxh3_64: format!("{:016x}", hasher.digest()), seconds: started.elapsed().as_secs_f64() })
    });
    Ok((report, hash.transpose()?))
}
