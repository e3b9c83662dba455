//! Loaded memfd mappings made private before a `fork`, so a child gets
//! its own copy, and telling whether a private mapping was written since.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use super::*;

/// Mappings a `fork` treats apart from other memory: loaded shared
/// mappings of memfds, which a fork turns private before the child is made
/// ([`Mapping::loaded`]), each with its own copy of the memfd's descriptor,
/// so that after the fork neither process's writes reach the memfd or the
/// other process, as with any other memory of a process; and mappings
/// still being filled by a load ([`Mapping::loading`]), which a forked
/// child does not get at all. Held from the `pthread_atfork` prepare
/// handler until the fork is over in both processes, so no mapping joins,
/// leaves or is remapped meanwhile.
pub(super) static PRIVATE_ON_FORK: std::sync::Mutex<Vec<ForkEntry>> = std::sync::Mutex::new(Vec::new());

/// One mapping of [`PRIVATE_ON_FORK`].
pub(super) struct ForkEntry {
    pub(super) id: u64,
    addr: usize,
    len: usize,
    state: ForkState,
}

enum ForkState {
    /// Loaded: made private before a fork ([`Mapping::make_private`] needs
    /// the advice and a descriptor of the memfd).
    Loaded { advice: Option<HugePageAdvice>, memfd: OwnedFd },
    /// Being filled by a load, `MADV_DONTFORK`: a child gets no mapping
    /// there (the child handler reserves the range with fresh memory) and
    /// no descriptor of the memfd `memfd`, the load's own (which the child
    /// handler points at /dev/null).
    Loading { memfd: Option<RawFd> },
}

/// The id of the next entry of [`PRIVATE_ON_FORK`].
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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

/// The `pthread_atfork` prepare handler: makes every loaded mapping
/// private, and keeps the registry locked until the fork is over.
pub(super) extern "C" fn make_shared_mappings_private_before_fork() {
    let mut registry = fork_registry();
    registry.retain(|entry| {
        let ForkState::Loaded { advice, memfd } = &entry.state else { return true };
        // A view of the registered range, never dropped: the mapping's
        // owner unregisters it (under this lock) before unmapping it.
        let mapping = std::mem::ManuallyDrop::new(Mapping {
            ptr: NonNull::new(entry.addr as *mut u8).unwrap_or(NonNull::dangling()),
            len: entry.len,
            advice: *advice,
            fork_entry: None,
        });
        match mapping.remap_private(memfd.as_fd()) {
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

/// The `pthread_atfork` parent handler: the fork is over.
pub(super) extern "C" fn fork_done() {
    // `try_with`: nothing to release where the thread-local is gone.
    let _ = HELD_ACROSS_FORK.try_with(|held| held.borrow_mut().take());
}

/// The `pthread_atfork` child handler: the loads in flight at the fork are
/// the parent's. Their ranges, which `MADV_DONTFORK` left out of the child,
/// are reserved with fresh memory (so that nothing else is mapped where
/// their owner, should it be the forking thread, still writes or unmaps),
/// and their memfds' descriptors point at /dev/null (so the child keeps
/// none of their memory). Then the fork is over.
pub(super) extern "C" fn fork_done_in_child() {
    let _ = HELD_ACROSS_FORK.try_with(|held| {
        if let Some(registry) = held.borrow().as_ref() {
            // SAFETY: a constant C string; open allocates nothing here.
            let null = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            for entry in registry.iter() {
                let ForkState::Loading { memfd } = entry.state else { continue };
                // SAFETY: the range was left out of this process by
                // MADV_DONTFORK, so nothing of this process is there;
                // MAP_FIXED_NOREPLACE (Linux 4.17) maps nothing over
                // whatever another fork handler may have put there since.
                unsafe {
                    libc::mmap(
                        entry.addr as *mut libc::c_void,
                        entry.len,
                        READ_WRITE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_NORESERVE
                            | libc::MAP_FIXED_NOREPLACE,
                        -1,
                        0,
                    );
                }
                if let (Some(fd), true) = (memfd, null >= 0) {
                    // SAFETY: `fd` is the memfd's descriptor, still open here
                    // (its owner closes it only after leaving the registry);
                    // dup2 makes the number refer to /dev/null instead, so it
                    // stays a valid descriptor for whoever closes it.
                    unsafe { libc::dup3(null, fd, libc::O_CLOEXEC) };
                }
            }
            if null >= 0 {
                // SAFETY: `null` was opened above and nothing else owns it.
                unsafe { libc::close(null) };
            }
        }
        held.borrow_mut().take()
    });
}

/// Installs the fork handlers once; `false` where `pthread_atfork` refused.
fn fork_handlers_installed() -> bool {
    static HANDLERS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HANDLERS.get_or_init(|| {
        // SAFETY: the handlers are plain `extern "C"` functions that do not
        // unwind; prepare runs before fork in the forking thread, the other
        // two after it in that same thread.
        unsafe {
            libc::pthread_atfork(
                Some(make_shared_mappings_private_before_fork),
                Some(fork_done),
                Some(fork_done_in_child),
            ) == 0
        }
    })
}

impl Mapping {
    /// Leaves this mapping, which a load is about to fill, out of every
    /// process forked until [`Mapping::loaded`]: `madvise(MADV_DONTFORK)`
    /// (Linux 2.6.16), so a child forked mid-load (by another thread)
    /// neither shares the memory being loaded nor keeps it after this
    /// process frees it; `memfd` is the descriptor of the memfd it maps,
    /// which such a child keeps none of either.
    pub fn loading(&mut self, memfd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        if self.len == 0 || self.fork_entry.is_some() {
            return Ok(());
        }
        if !fork_handlers_installed() {
            return Err(io::Error::other("pthread_atfork could not register the fork handlers"));
        }
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut registry = fork_registry();
        self.madvise_fork(libc::MADV_DONTFORK)?;
        let state = ForkState::Loading { memfd: memfd.map(|fd| fd.as_raw_fd()) };
        registry.push(ForkEntry { id, addr: self.address(), len: self.len, state });
        self.fork_entry = Some(id);
        Ok(())
    }

    /// The load is done: this mapping is part of forked children again
    /// (`MADV_DOFORK`), and with `memfd`, the memfd it maps (a `MAP_SHARED`
    /// mapping from offset 0, as [`Mapping::memfd`] and [`Mapping::hugetlb`]
    /// make), it is made private by [`Mapping::make_private`] before every
    /// `fork` of the process, so the child gets its own copy of the bytes:
    /// a forked child no longer writes this process's memory, nor this
    /// process the child's. Until a fork (or `make_private`) the memfd
    /// still shows writes through the mapping. Where the private mapping
    /// cannot be made at fork time (a hugetlb pool without free pages for
    /// it, a kernel before 5.16 for hugetlb memory), the fork goes on with
    /// it shared and says so on stderr. An error (no descriptor left for the
    /// registry's copy of the memfd) leaves it shared across a fork.
    pub fn loaded(&mut self, memfd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let mut registry = fork_registry();
        if let Some(id) = self.fork_entry {
            if let Some(at) =
                registry.iter().position(|e| e.id == id && matches!(e.state, ForkState::Loading { .. }))
            {
                self.madvise_fork(libc::MADV_DOFORK)?;
                registry.swap_remove(at);
                self.fork_entry = None;
            }
        }
        let Some(memfd) = memfd else { return Ok(()) };
        if self.fork_entry.is_some() {
            return Ok(());
        }
        if !fork_handlers_installed() {
            return Err(io::Error::other("pthread_atfork could not register the fork handlers"));
        }
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let state = ForkState::Loaded { advice: self.advice, memfd: memfd.try_clone_to_owned()? };
        registry.push(ForkEntry { id, addr: self.address(), len: self.len, state });
        self.fork_entry = Some(id);
        Ok(())
    }

    /// `madvise(advice)` over the whole mapping: `MADV_DONTFORK` or `MADV_DOFORK`.
    fn madvise_fork(&self, advice: libc::c_int) -> io::Result<()> {
        // SAFETY: the range is exactly this mapping; (DONT|DO)FORK changes
        // only whether a fork copies it, not its contents.
        check(unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, advice) }).map(drop)
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
