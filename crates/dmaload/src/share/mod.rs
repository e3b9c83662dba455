//! Handing memory to other processes: Unix sockets whose messages keep
//! their boundaries and carry file descriptors (memfds, dma-bufs, eventfds),
//! with the peer's kernel-recorded credentials to decide whom to serve.
//!
//! Block queues, buffer handoff ([`Buffer::send`](crate::Buffer::send))
//! and the wire format are built on these; a memfd sent here reaches the
//! other process as the same memory, not a copy. The model-cache service
//! and its client, which speak [`protocol`] over these sockets, are the
//! `dmaload-share` crate, built on the core's public API.

mod block_queue;
mod capture;
mod handoff;
pub mod protocol;

pub use crate::sys::shm::{SharedBytes, SharedBytesMut};
pub use crate::sys::socket::{
    PeerCredentials, SeqpacketConn as Connection, SeqpacketListener as Listener, CONNECT_TIMEOUT,
    MAX_FDS_PER_MESSAGE,
};
pub use block_queue::{
    BlockQueue, BlockQueueOptions, Filled, ForeignRun, FreeBlock, HeldRun, OfferedQueue, QueueMemory, Role,
    MAX_BLOCKS, MAX_BLOCK_SIZE, MAX_RING_BYTES, MIN_BLOCK_SIZE,
};
pub use capture::{capture_to_file, process_cpu_seconds, CaptureOptions, CaptureReport};
pub use protocol::{CachedFile, Served, Status};
