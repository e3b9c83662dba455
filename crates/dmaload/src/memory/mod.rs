//! Host memory: the kinds a buffer can live in (memfd, shareable by fd and
//! exportable as a dma-buf through udmabuf; hugetlb; private anonymous
//! memory with no fd), reserving it ([`Allocation`]), populating it, and
//! giving it back; then [`MemoryFacts`], what decides which kind a load
//! gets.
//!
//! Choosing host memory for `to: auto`: which kinds this kernel can give
//! now (the THP policies, the hugetlb pool), what each costs here (the
//! figures `dmaload info --probe-memory` recorded), and the rule between
//! them. The facts are a plain value ([`MemoryFacts`]), read from /sys and
//! /proc by [`MemoryFacts::read`] or built by hand, so the rule is testable
//! on any machine.
//!

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use serde::{Deserialize, Serialize};

use crate::sys::mem::{self, HugePageAdvice, Mapping, MemfdPages};

mod facts;
pub use facts::{
    huge_page_bytes, probe_path, KindProbe, MemoryChoice, MemoryFacts, MemoryProbe, SHMEM_HUGE_PAGES_HINT,
};

/// The kind of memory a buffer lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryKind {
    /// A memfd (`memfd_create`, Linux 3.17) mapped shared with 4 KiB pages
    /// (`MADV_NOHUGEPAGE`): can be passed to other processes by fd and
    /// exported as a dma-buf with udmabuf. Works everywhere.
    #[default]
    Memfd,
    /// A memfd whose mapping asks for 2 MiB pages (`MADV_HUGEPAGE`), which
    /// shmem gives when `/sys/kernel/mm/transparent_hugepage/shmem_enabled`
    /// is `always`, `within_size`, `advise` or `force`; shareable and
    /// exportable like `memfd`. An error where that policy is `never` or
    /// `deny` (most distributions' default).
    MemfdHuge,
    /// A hugetlb memfd (`MFD_HUGETLB`, Linux 4.14): pages of the
    /// administrator's hugetlb pool (`/proc/sys/vm/nr_hugepages`), reserved
    /// at allocation, in the default huge page size; shareable and
    /// exportable like `memfd`. An error when the pool lacks free pages.
    Hugetlb,
    /// Private anonymous memory with `MADV_HUGEPAGE`: 2 MiB pages where
    /// `transparent_hugepage/enabled` is `always` or `madvise`, but no fd
    /// to share.
    AnonymousThp,
    /// Private anonymous memory in 4 KiB pages (`MADV_NOHUGEPAGE`): no fd
    /// to share, but the cheapest 4 KiB pages to populate, with no page
    /// cache entry or shmem accounting per page (about half a memfd's cost;
    /// docs/benchmarks.md, "Figures behind the defaults"). Works everywhere.
    Anonymous,
}

/// What to do when memory without an fd (the anonymous kinds) was asked
/// to be shared, exported or mapped elsewhere: the end of such errors.
pub(crate) const NEEDS_A_MEMFD: &str = "load into a memfd (`to` memfd, or auto with an fd needed)";

impl MemoryKind {
    pub const ALL: [MemoryKind; 5] = [
        MemoryKind::Memfd,
        MemoryKind::MemfdHuge,
        MemoryKind::Hugetlb,
        MemoryKind::AnonymousThp,
        MemoryKind::Anonymous,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Memfd => "memfd",
            MemoryKind::MemfdHuge => "memfd-huge",
            MemoryKind::Hugetlb => "hugetlb",
            MemoryKind::AnonymousThp => "anonymous-thp",
            MemoryKind::Anonymous => "anonymous",
        }
    }

    /// Whether the memory is a memfd, which can be shared by fd and
    /// exported with udmabuf.
    pub fn has_fd(self) -> bool {
        !matches!(self, MemoryKind::AnonymousThp | MemoryKind::Anonymous)
    }
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for MemoryKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        MemoryKind::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<_> = MemoryKind::ALL.iter().map(|k| k.name()).collect();
            format!("unknown memory kind {s:?} (expected one of: {})", names.join(", "))
        })
    }
}

/// Memory reserved for a buffer, not yet populated: pages are allocated
/// (and zeroed by the kernel) when populated or first touched.
///
/// Until it becomes a buffer it is left out of any process forked
/// meanwhile (`Mapping::loading`): a child forked while a load fills it
/// neither shares its memory nor keeps it alive.
#[derive(Debug)]
pub struct Allocation {
    pub(crate) mapping: Mapping,
    pub(crate) memfd: Option<OwnedFd>,
    pub(crate) kind: MemoryKind,
    /// The process that made it: a child forked meanwhile has none of its memory.
    pid: u32,
}

impl Allocation {
    /// Reserves `len` bytes (a multiple of the page size) of `kind` memory
    /// (hugetlb memory: `len` rounded up to whole huge pages). A kind this
    /// kernel cannot give now is an [`io::ErrorKind::Unsupported`] error
    /// that says why and what would change it.
    pub fn new(kind: MemoryKind, len: usize) -> io::Result<Allocation> {
        Self::with_facts(kind, len, &MemoryFacts::read())
    }

    /// [`Allocation::new`] against facts read beforehand.
    pub(crate) fn with_facts(kind: MemoryKind, len: usize, facts: &MemoryFacts) -> io::Result<Allocation> {
        if let Err(why) = facts.can_give(kind, len as u64) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, format!("{kind} memory: {why}")));
        }
        // (`can_give` checked RLIMIT_FSIZE: a memfd is a file, and sizing it
        // past the limit would kill the process with SIGXFSZ.)
        let memfd = |pages, len: usize| -> io::Result<OwnedFd> {
            let memfd = mem::memfd_create(c"dmaload", pages)?;
            mem::set_len(memfd.as_fd(), len as u64)?;
            Ok(memfd)
        };
        let shmem = |advice| -> io::Result<Allocation> {
            let memfd = memfd(MemfdPages::Shmem, len)?;
            let mapping = Mapping::memfd(memfd.as_fd(), len, advice)?;
            Ok(Allocation { mapping, memfd: Some(memfd), kind, pid: std::process::id() })
        };
        let anonymous = |advice| -> io::Result<Allocation> {
            Ok(Allocation {
                mapping: Mapping::anonymous(len, advice)?,
                memfd: None,
                kind,
                pid: std::process::id(),
            })
        };
        let mut allocation = match kind {
            MemoryKind::Memfd => shmem(HugePageAdvice::Small),
            MemoryKind::MemfdHuge => shmem(HugePageAdvice::Huge),
            MemoryKind::Hugetlb => {
                let len = len.next_multiple_of(facts.hugetlb_page_size.max(1) as usize);
                facts
                    .can_give(kind, len as u64)
                    .map_err(|why| io::Error::new(io::ErrorKind::Unsupported, why))?;
                let memfd = memfd(MemfdPages::Hugetlb, len)?;
                // A shared hugetlb mapping reserves its pages now: ENOMEM
                // here means the pool ran short since the facts were read.
                let mapping = Mapping::hugetlb(memfd.as_fd(), len).map_err(|e| match e.raw_os_error() {
                    Some(libc::ENOMEM) => io::Error::new(
                        io::ErrorKind::OutOfMemory,
                        format!("hugetlb memory of {len} bytes: the pool has too few free pages ({e})"),
                    ),
                    _ => e,
                })?;
                Ok(Allocation { mapping, memfd: Some(memfd), kind, pid: std::process::id() })
            }
            MemoryKind::AnonymousThp => anonymous(HugePageAdvice::Huge),
            MemoryKind::Anonymous => anonymous(HugePageAdvice::Small),
        }?;
        // Where the kernel or libc refuses, a child forked mid-load shares
        // the memory being loaded, as it did before this was done.
        let _ = allocation.mapping.loading(allocation.memfd.as_ref().map(|memfd| memfd.as_fd()));
        Ok(allocation)
    }

    /// Whether this process is a child forked since the allocation was
    /// made (by the thread that runs its load, from a progress callback):
    /// the memory is then not the load's, and must not be handed out.
    pub(crate) fn forked_since(&self) -> bool {
        self.pid != std::process::id()
    }
}

/// Allocates every page under `bytes` now, content kept (`MADV_POPULATE_WRITE`
/// on `threads` threads, each an equal share; pages only partly inside
/// `bytes` are left alone), so that reading into them later never faults:
/// what a load does to its buffer before its reads, for memory the caller
/// brings (a load into it with [`crate::LoadRequest::fill`] populates it itself).
pub fn populate(bytes: &mut [u8], threads: usize) -> io::Result<()> {
    let len = bytes.len();
    mem::MappingWriter::over(bytes).populate_on_threads(0..len, threads)
}

/// Bytes of dropped buffers (and other mappings of 64 MiB or more) that a
/// background thread is still unmapping: dropping a large [`crate::Buffer`]
/// returns at once, and the pages go back to the system a moment later.
pub fn bytes_being_freed() -> usize {
    mem::unmap_pending()
}

/// Waits until every dropped buffer's memory has gone back to the system
/// (a load that needs more memory than is available waits so by itself).
pub fn wait_for_freed_memory() {
    mem::wait_for_unmaps()
}
