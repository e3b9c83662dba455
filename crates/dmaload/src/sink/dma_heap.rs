//! The dma-heap destination: a dma-buf allocated from `/dev/dma_heap/NAME`
//! on a thread of its own while the engine already reads the first slots,
//! then each filled slot copied into the dma-buf's mapping inside a
//! `DMA_BUF_IOCTL_SYNC` write bracket. O_DIRECT cannot read into a dma-buf
//! mapping (its pages are not pinnable user memory: `EFAULT`), so the
//! registered staging ring is how direct I/O reaches a heap.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Sink, SlotData};
use crate::error::{Error, ErrorKind, Result};
use crate::heap::{CpuAccess, DmaBuf, DmaHeap, SharedMapping};

/// A dma-buf and its CPU mapping.
struct Allocated {
    dmabuf: DmaBuf,
    map: SharedMapping,
    /// Allocating and mapping it took this long.
    took: Duration,
}

fn allocate_and_map(heap: &DmaHeap, len: u64) -> Result<Allocated> {
    let started = Instant::now();
    let dmabuf = heap.alloc(len)?;
    let mmap_error = |e| Error::io("mmap dma-buf", heap.path(), e);
    let size = usize::try_from(dmabuf.len()).map_err(|e| mmap_error(io::Error::other(e)))?;
    let map = SharedMapping::new(dmabuf.fd(), size).map_err(mmap_error)?;
    Ok(Allocated { dmabuf, map, took: started.elapsed() })
}

/// A sink into a new dma-buf from a dma-heap: file bytes
/// `first_offset..first_offset + len` land at the dma-buf's start. The
/// allocation runs beside the load and is waited for at the first
/// delivery; [`DmaHeapSink::into_dmabuf`] hands the filled dma-buf over.
pub struct DmaHeapSink {
    first_offset: u64,
    len: u64,
    allocating: Option<JoinHandle<Result<Allocated>>>,
    allocated: Option<Allocated>,
    /// The allocation's own error, kept whole (the pipeline sees an
    /// `io::Error`): [`DmaHeapSink::take_error`].
    failed: Option<Error>,
}

impl DmaHeapSink {
    /// Starts allocating a dma-buf for `len` bytes from `heap` (whole
    /// pages, at least one) and mapping it for the CPU, on a thread of its
    /// own.
    pub fn allocate(heap: DmaHeap, first_offset: u64, len: u64) -> Result<DmaHeapSink> {
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "dma-heap alloc",
                heap.path(),
                "a dma-buf cannot be empty",
            ));
        }
        let heap = Arc::new(heap);
        let mut sink = DmaHeapSink { first_offset, len, allocating: None, allocated: None, failed: None };
        let job = {
            let heap = Arc::clone(&heap);
            move || allocate_and_map(&heap, len)
        };
        match std::thread::Builder::new().name("dmaload-dma-heap".into()).spawn(job) {
            Ok(thread) => sink.allocating = Some(thread),
            // No thread to spare (RLIMIT_NPROC): allocate here, without the overlap.
            Err(_) => sink.allocated = Some(allocate_and_map(&heap, len)?),
        }
        Ok(sink)
    }

    /// Waits for the allocation.
    fn wait(&mut self) -> io::Result<&mut Allocated> {
        if let Some(thread) = self.allocating.take() {
            let outcome = thread.join().unwrap_or_else(|_| {
                Err(Error::io(
                    "dma-heap alloc",
                    Path::new("dma-heap"),
                    io::Error::other("the thread panicked"),
                ))
            });
            match outcome {
                Ok(allocated) => self.allocated = Some(allocated),
                Err(err) => {
                    let errno = err.errno();
                    self.failed = Some(err);
                    return Err(io::Error::from_raw_os_error(errno));
                }
            }
        }
        match &mut self.allocated {
            Some(allocated) => Ok(allocated),
            None => Err(io::Error::from_raw_os_error(self.failed.as_ref().map_or(libc::EIO, Error::errno))),
        }
    }

    /// The allocation's own error, when it is why the load failed (the
    /// load's error then only says the delivery stopped).
    pub fn take_error(&mut self) -> Option<Error> {
        self.failed.take()
    }

    /// Seconds the allocation and mapping took (on their own thread,
    /// beside the reads), once waited for.
    pub fn alloc_seconds(&self) -> f64 {
        self.allocated.as_ref().map_or(0.0, |a| a.took.as_secs_f64())
    }

    /// The filled dma-buf, after a successful load (its mapping is undone;
    /// the bytes stay). A load that failed leaves it partly filled: never
    /// hand that out.
    pub fn into_dmabuf(mut self) -> io::Result<DmaBuf> {
        self.wait()?;
        Ok(self.allocated.take().expect("waited for above").dmabuf)
    }
}

impl Sink for DmaHeapSink {
    fn deliver(&mut self, _slot: usize, data: SlotData<'_>) -> io::Result<()> {
        let (first, len) = (self.first_offset, self.len);
        let at = data
            .file_offset()
            .checked_sub(first)
            .filter(|&at| at + data.len() as u64 <= len)
            .and_then(|at| usize::try_from(at).ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "file bytes {}+{} fall outside the dma-buf ({len} bytes from offset {first})",
                        data.file_offset(),
                        data.len(),
                    ),
                )
            })?;
        let Allocated { dmabuf, map, .. } = self.wait()?;
        // Each CPU access in its own bracket, so an exporter that is not
        // cache-coherent flushes what the CPU wrote.
        dmabuf.begin_cpu_access(CpuAccess::Write)?;
        let copied = data.copy_to_mapping(0..data.len(), map, at);
        dmabuf.end_cpu_access(CpuAccess::Write)?;
        copied
    }
}

impl Drop for DmaHeapSink {
    fn drop(&mut self) {
        // No thread outlives the sink: a failed load frees its dma-buf here.
        if let Some(thread) = self.allocating.take() {
            let _ = thread.join();
        }
    }
}
