//! A block queue's geometry and memory, checked before anything is made.

use std::io;

use serde::Serialize;

/// Smallest block: one page.
pub const MIN_BLOCK_SIZE: usize = 4 << 10;
/// Largest block.
pub const MAX_BLOCK_SIZE: usize = 64 << 20;
/// Most blocks in one ring.
pub const MAX_BLOCKS: usize = 65536;
/// Most bytes of blocks in one ring.
pub const MAX_RING_BYTES: usize = 64 << 30;

/// What the blocks are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueueMemory {
    /// A memfd, sealed against resizing, with `MADV_HUGEPAGE`.
    #[default]
    Memfd,
    /// A dma-buf from the system dma-heap (`/dev/dma_heap/system`).
    DmaHeap,
    /// A memfd exported as a dma-buf by udmabuf (`/dev/udmabuf`).
    Udmabuf,
}

impl QueueMemory {
    pub const ALL: [QueueMemory; 3] = [QueueMemory::Memfd, QueueMemory::DmaHeap, QueueMemory::Udmabuf];

    pub fn name(self) -> &'static str {
        match self {
            QueueMemory::Memfd => "memfd",
            QueueMemory::DmaHeap => "dma-heap",
            QueueMemory::Udmabuf => "udmabuf",
        }
    }

    pub(super) fn is_dmabuf(self) -> bool {
        self != QueueMemory::Memfd
    }
}

impl std::str::FromStr for QueueMemory {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        QueueMemory::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown queue memory {s:?} (expected memfd, dma-heap or udmabuf)"))
    }
}

/// Which end of the queue a process holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Producer,
    Consumer,
}

impl Role {
    pub(super) fn other(self) -> Role {
        match self {
            Role::Producer => Role::Consumer,
            Role::Consumer => Role::Producer,
        }
    }
}

/// The shape of a new queue.
#[derive(Debug, Clone)]
pub struct BlockQueueOptions {
    /// Bytes per block: a multiple of 4 KiB from 4 KiB to 64 MiB.
    pub block_size: usize,
    /// Blocks in the ring (1 to 65536, at most 64 GiB in all).
    pub blocks: usize,
    pub memory: QueueMemory,
}

impl Default for BlockQueueOptions {
    fn default() -> Self {
        BlockQueueOptions { block_size: 1 << 20, blocks: 32, memory: QueueMemory::Memfd }
    }
}

pub(super) fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

pub(super) fn corrupt(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("block queue: {message}"))
}

impl BlockQueueOptions {
    pub(super) fn validate(&self) -> io::Result<()> {
        let b = self.block_size;
        if !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&b) || b % MIN_BLOCK_SIZE != 0 {
            return Err(invalid(format!("block size {b} must be a multiple of 4 KiB from 4 KiB to 64 MiB")));
        }
        if !(1..=MAX_BLOCKS).contains(&self.blocks) {
            return Err(invalid(format!("{} blocks: a ring holds 1 to {MAX_BLOCKS}", self.blocks)));
        }
        if !matches!(b.checked_mul(self.blocks), Some(total) if total <= MAX_RING_BYTES) {
            return Err(invalid(format!("{} blocks of {b} bytes are more than 64 GiB", self.blocks)));
        }
        Ok(())
    }
}
