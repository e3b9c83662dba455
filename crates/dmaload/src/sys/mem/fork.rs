//! Loaded memfd mappings made private before a `fork`, so a child gets
//! its own copy, and telling whether a private mapping was written since.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use super::*;

/// Shared mappings of memfds that a `fork` turns private before the child
/// is made ([`Mapping::private_on_fork`]), each with its own copy of the
/// memfd's descriptor: after the fork neither process's writes reach the
/// memfd or the other process, as with any other memory of a process. Held
/// from the `pthread_atfork` prepare handler until the fork is over in
/// both processes, so no mapping joins, leaves or is remapped meanwhile.
pub(super) static PRIVATE_ON_FORK: std::sync::Mutex<Vec<ForkEntry>> = std::sync::Mutex::new(Vec::new());

/// One mapping of [`PRIVATE_ON_FORK`]: what [`Mapping::make_private`] needs.
pub(super) struct ForkEntry {
    pub(super) id: u64,
    addr: usize,
    len: usize,
    advice: Option<HugePageAdvice>,
    memfd: OwnedFd,
}

pub(super) fn fork_registry() -> std::sync::MutexGuard<'static, Vec<ForkEntry>> {
    PRIVATE_ON_FORK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

std::thread_local! {
    /// The registry's lock, held by the forking thread from the prepare
    /// handler to the parent's and the child's handler (the same thread in
    /// both processes).
    static HELD_ACROSS_FORK: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Vec<ForkEntry>>>> =
        const { std::cell::RefCell::new(None) };
}

/// The `pthread_atfork` prepare handler: makes every registered mapping
/// private, and keeps the registry locked until the fork is over.
pub(super) extern "C" fn make_shared_mappings_private_before_fork() {
    let mut registry = fork_registry();
    registry.retain(|entry| {
        // A view of the registered range, never dropped: the mapping's
        // owner unregisters it (under this lock) before unmapping it.
        let mapping = std::mem::ManuallyDrop::new(Mapping {
            ptr: NonNull::new(entry.addr as *mut u8).unwrap_or(NonNull::dangling()),
            len: entry.len,
            advice: entry.advice,
            fork_entry: None,
        });
        match mapping.remap_private(entry.memfd.as_fd()) {
            Ok(()) => false,
            Err(err) => {
                // The fork cannot be refused from here: say what the child shares.
                eprintln!(
                    "dmaload: a buffer of {} bytes could not be made private before fork ({err}): the \
                     child shares its memory with this process",
                    entry.len
                );
                true
            }
        }
    });
    HELD_ACROSS_FORK.with(|held| *held.borrow_mut() = Some(registry));
}

/// The `pthread_atfork` parent and child handler: the fork is over.
pub(super) extern "C" fn fork_done() {
    // `try_with`: nothing to release where the thread-local is gone.
    let _ = HELD_ACROSS_FORK.try_with(|held| held.borrow_mut().take());
}

impl Mapping {
    /// Registers this mapping, a `MAP_SHARED` mapping of `fd` from offset 0
    /// (as [`Mapping::memfd`] and [`Mapping::hugetlb`] make), to be made
    /// private by [`Mapping::make_private`] before every `fork` of the
    /// process, so the child gets its own copy of the bytes: a forked child
    /// no longer writes this process's memory, nor this process the
    /// child's. Until a fork (or `make_private`) the memfd still shows
    /// writes through the mapping. Where the private mapping cannot be made
    /// at fork time (a hugetlb pool without free pages for it, a kernel
    /// before 5.16 for hugetlb memory), the fork goes on with it shared and
    /// says so on stderr.
    pub fn private_on_fork(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        static HANDLERS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if self.len == 0 || self.fork_entry.is_some() {
            return Ok(());
        }
        let installed = *HANDLERS.get_or_init(|| {
            // SAFETY: the handlers are plain `extern "C"` functions that do
            // not unwind; prepare runs before fork in the forking thread,
            // the other two after it in that same thread.
            unsafe {
                libc::pthread_atfork(
                    Some(make_shared_mappings_private_before_fork),
                    Some(fork_done),
                    Some(fork_done),
                ) == 0
            }
        });
        if !installed {
            return Err(io::Error::other("pthread_atfork could not register the fork handlers"));
        }
        let memfd = fd.try_clone_to_owned()?;
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        fork_registry().push(ForkEntry {
            id,
            addr: self.address(),
            len: self.len,
            advice: self.advice,
            memfd,
        });
        self.fork_entry = Some(id);
        Ok(())
    }

    /// Takes this mapping out of the fork registry.
    pub(super) fn leave_fork_registry(&mut self) {
        if let Some(id) = self.fork_entry.take() {
            fork_registry().retain(|entry| entry.id != id);
        }
    }

    /// Whether some page of this mapping is a private copy this process
    /// wrote (copy-on-write), so the file it maps no longer holds the bytes
    /// it shows: a present page that is not the file's, or one swapped out
    /// (a file's own pages are never swap entries of a mapping), read from
    /// `/proc/self/pagemap` (bits 61 to 63, Linux 3.5). A shared mapping
    /// has none.
    pub fn has_private_copies(&self) -> io::Result<bool> {
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        const FILE_OR_SHARED: u64 = 1 << 61;
        use std::os::unix::fs::FileExt;
        let page = page_size();
        let pagemap = std::fs::File::open("/proc/self/pagemap")?;
        let (first, pages) = (self.address() / page, self.len / page);
        let mut entries = vec![0u8; 8 * pages.min(1 << 14)];
        let mut done = 0;
        while done < pages {
            let n = (pages - done).min(entries.len() / 8);
            pagemap.read_exact_at(&mut entries[..8 * n], ((first + done) * 8) as u64)?;
            let private = entries[..8 * n].chunks_exact(8).any(|raw| {
                let entry = u64::from_ne_bytes(raw.try_into().unwrap_or_default());
                entry & SWAPPED != 0 || (entry & PRESENT != 0 && entry & FILE_OR_SHARED == 0)
            });
            if private {
                return Ok(true);
            }
            done += n;
        }
        Ok(false)
    }
}
