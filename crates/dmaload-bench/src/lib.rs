//! dmaload's benchmark harness, kept out of the library: every way the
//! kernel offers to move bytes between a file and shareable memory
//! ([`transfer`], seed 001's table), random-read IOPS into plain and
//! registered buffers ([`iops`], seed 003's table) and fio as the ceiling
//! ([`fio`]). The `dmaload-bench` binary's commands (src/bin/dmaload-bench)
//! are built on it.
//!
//! Loads go through the library's one pipeline (`dmaload::LoadRequest::fill`,
//! `dmaload::save::write_at`); the syscalls the library does not make
//! (sendfile, splice, copy_file_range) come from rustix. All `unsafe` code
//! (the buffers' mappings, the IOPS ring) lives in the private `sys`
//! module.
#![deny(unsafe_code)]

pub mod fio;
pub mod iops;
#[allow(unsafe_code)]
mod sys;
pub mod transfer;
