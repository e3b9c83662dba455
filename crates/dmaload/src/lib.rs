//! dmaload: load huge files into DMA-shareable memory at the speed of the
//! disk.
//!
//! ```no_run
//! let (buffer, report) = dmaload::load("model.safetensors", &dmaload::LoadOptions::default())?;
//! println!("{} bytes via {} in {:.2} s", buffer.len(), report.engine.name(), report.total_seconds);
//! # Ok::<(), dmaload::Error>(())
//! ```
//!
//! Every other load is a [`LoadRequest`]: a source (a path, an open file,
//! an fd, an object), a range and options, run by one verb into the
//! destination `options.to` names, a host buffer, a dma-buf, caller
//! memory or a sink ([`load`](mod@load) has the table).
//!
//! All `unsafe` code lives in the private `sys` module; [`sys_share`] is
//! the part of it the model-cache service (the `dmaload-share` crate) uses.
#![deny(unsafe_code)]

pub mod buffer;
pub mod cancel;
pub mod cuda;
pub mod device;
pub mod dmabuf;
mod engine;
pub mod error;
pub mod format;
pub mod heap;
pub mod info;
mod into;
mod lead;
pub mod lease;
pub mod load;
pub mod many;
pub mod memory;
pub mod object;
mod options;
pub mod pagecache;
mod pipeline;
mod plan;
mod report;
pub mod save;
pub mod share;
pub mod sink;
pub mod source;
#[allow(unsafe_code)]
mod sys;
pub mod sys_share;
pub mod system;
pub mod tmpfile;
mod tune;
mod types;
pub mod user_cache;
pub mod verify;
pub mod vm;

pub use buffer::{Buffer, Segment};
pub use cancel::CancelToken;
pub use dmabuf::LoadedDmaBuf;
pub use error::{Error, ErrorKind, Result};
pub use load::{load, Destination, LoadOptions, LoadReport, LoadRequest, Loaded};
pub use many::load_many;
pub use memory::MemoryKind;
pub use options::{check_load_options, parse_size, OptionError, OptionValue};
pub use pipeline::{check_memory, object_ring_slots};
pub use save::{save, save_raw, SaveOptions, SaveReport};
pub use sink::{DmaHeapSink, HostSink, Sink, SlotData, StagingRing};
pub use source::OpenFile;
pub use sys::mem::RawBytesMut;
pub use types::{CachePolicy, Engine, Fallback, IoMode, ProgressFn};
