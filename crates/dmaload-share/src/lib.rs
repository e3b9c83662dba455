//! dmaload's model-cache service: one process loads files (and objects)
//! with the ordinary loader and keeps each in a sealed memfd; others get
//! a file's bytes over a Unix socket as the same memory, mapped in
//! milliseconds instead of read from the disk, or copied into their CUDA
//! device memory by the service.
//!
//! [`Service`] is the server, [`Client`] its client, and [`CacheRequest`]
//! a load that asks the service first and loads directly where it cannot
//! serve. The socket, the wire format ([`dmaload::share::protocol`]) and
//! buffer handoff stay in the core, which knows nothing of this crate.
//!
//! This crate has no `unsafe` code: the system calls it needs are the
//! core's safe wrappers in [`dmaload::sys_share`].
#![forbid(unsafe_code)]

pub mod client;
mod request;
pub mod service;

pub use client::{
    connection_from_raw_fd, default_socket, handoff_report, socket_from_env, Client, Fetched, CACHE_ENV,
};
pub use request::{CacheOutcome, CacheRequest, ServedFile};
pub use service::{Service, ServiceConfig, StopSignals};
