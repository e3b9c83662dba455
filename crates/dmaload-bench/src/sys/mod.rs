//! The bench crate's only `unsafe` code, each block with the invariant
//! that makes it sound: mappings of memory the crate keeps to itself
//! ([`memory`]) and the random-read ring ([`uring`]).

pub(crate) mod memory;
pub(crate) mod uring;
