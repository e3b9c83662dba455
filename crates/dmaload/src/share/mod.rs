//! Handing memory to other processes: Unix sockets whose messages keep
//! their boundaries and carry file descriptors (memfds, dma-bufs, eventfds),
//! with the peer's kernel-recorded credentials to decide whom to serve.
//!
//! The model-cache service and block queues are built on these; a memfd
//! sent here reaches the other process as the same memory, not a copy.

mod block_queue;
mod capture;
pub mod client;
mod handoff;
pub mod protocol;
mod request;
pub mod service;

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
pub use client::{
    connection_from_raw_fd, default_socket, handoff_report, socket_from_env, Client, Fetched, CACHE_ENV,
};
pub use protocol::{CachedFile, Served, Status};
pub use request::{CacheOutcome, CacheRequest, ServedFile};
pub use service::{Service, ServiceConfig, StopSignals};
