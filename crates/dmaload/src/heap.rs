//! Where buffers come from: memfd (shareable by fd, exportable as a dma-buf
//! through udmabuf) or anonymous memory with transparent huge pages.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use serde::Serialize;

use crate::sys::mem::{self, Mapping};

/// The kind of memory a buffer lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryKind {
    /// A memfd (`memfd_create`, Linux 3.17) mapped shared: can be passed to
    /// other processes by fd and exported as a dma-buf with udmabuf.
    #[default]
    Memfd,
    /// Private anonymous memory with `MADV_HUGEPAGE`: often faster to
    /// populate, but cannot be shared by fd.
    AnonymousThp,
}

impl MemoryKind {
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Memfd => "memfd",
            MemoryKind::AnonymousThp => "anonymous-thp",
        }
    }
}

/// Memory reserved for a buffer, not yet populated: pages are allocated
/// (and zeroed by the kernel) when populated or first touched.
#[derive(Debug)]
pub struct Allocation {
    pub(crate) mapping: Mapping,
    pub(crate) memfd: Option<OwnedFd>,
    pub(crate) kind: MemoryKind,
}

impl Allocation {
    /// Reserves `len` bytes (a multiple of the page size) of `kind` memory.
    pub fn new(kind: MemoryKind, len: usize) -> io::Result<Allocation> {
        match kind {
            MemoryKind::Memfd => {
                let memfd = mem::memfd_create(c"dmaload")?;
                mem::set_len(memfd.as_fd(), len as u64)?;
                let mapping = Mapping::shared(memfd.as_fd(), len)?;
                Ok(Allocation { mapping, memfd: Some(memfd), kind })
            }
            MemoryKind::AnonymousThp => {
                let mapping = Mapping::anonymous(len, true)?;
                Ok(Allocation { mapping, memfd: None, kind })
            }
        }
    }
}
