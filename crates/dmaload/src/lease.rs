//! Views of a warm file's page cache, safe against truncation: a private
//! mapping of the file read under a read lease (docs/guarantees.md,
//! "Mapped views of a warm file").
//!
//! A file mapping turns an access past a truncated file's end into
//! `SIGBUS`. [`LeasedMapping::open`] maps a file only once it holds the
//! file's read lease, which the kernel grants only while no one has the
//! file open for writing, and which makes every later open for writing or
//! truncate wait for the holder (up to `/proc/sys/fs/lease-break-time`). A
//! watcher thread polls the lease ([`POLL_INTERVAL`]); when a writer breaks
//! it, the mapping is detached from the file (its bytes copied into
//! anonymous memory moved over the same address) before the lease is given
//! up, so views keep reading the bytes they read before, of one version,
//! and the writer then goes on. Dropping the mapping unmaps it and gives
//! the lease up: its owner drops it only when no view can reach it.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::pagecache;
use crate::sys::lease::{self, FileView};

/// How often the watcher looks whether a writer is breaking the lease.
/// The writer waits that long at most before the detach begins.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The shortest `/proc/sys/fs/lease-break-time` (seconds) under which a
/// mapping is made: the kernel revokes a lease that long after a break,
/// detach or not, and a detach copies the whole file.
pub const MIN_LEASE_BREAK_SECONDS: u64 = 5;

/// The share of a file's pages in the page cache from which it is mapped:
/// a warm file whose few pages were evicted since it was read (memory
/// pressure) is still warm; the missing pages are read on first access,
/// which the lease makes safe. A colder file is read (faster then).
pub const MAPPED_SHARE: f64 = 0.9;

const BREAK_TIME: &str = "/proc/sys/fs/lease-break-time";

/// A whole file mapped privately under its read lease; see the module doc.
#[derive(Debug)]
pub struct LeasedMapping {
    shared: Arc<Shared>,
    watcher: Option<JoinHandle<()>>,
    address: usize,
    len: usize,
    path: PathBuf,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    broken: AtomicBool,
}

#[derive(Debug)]
struct State {
    view: FileView,
    /// The leased file, until the lease is given up (after a detach).
    file: Option<File>,
    stopping: bool,
}

impl LeasedMapping {
    /// Maps the regular file at `path` under its read lease, if the file
    /// is in the page cache (at least [`MAPPED_SHARE`] of it). Refused (an error naming the operation
    /// and the cause; the caller reads the file instead) where the file is
    /// empty or colder, is open for writing somewhere
    /// (`EAGAIN`), is not this process's to lease (`EACCES`), lives on a
    /// filesystem without leases (`EINVAL`), or where the lease break time
    /// is under [`MIN_LEASE_BREAK_SECONDS`].
    pub fn open(path: &Path) -> Result<LeasedMapping> {
        let break_time = std::fs::read_to_string(BREAK_TIME)
            .map_err(|e| Error::io("read", Path::new(BREAK_TIME), e))?
            .trim()
            .parse::<u64>()
            .unwrap_or(0);
        if break_time < MIN_LEASE_BREAK_SECONDS {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "lease",
                path,
                format!(
                    "{BREAK_TIME} is {break_time} s, under the {MIN_LEASE_BREAK_SECONDS} s a detach may need \
                     before the kernel revokes the lease"
                ),
            ));
        }
        let file = crate::source::open_for_reading(path)?;
        lease::take_read_lease(file.as_fd()).map_err(|e| Error::io("fcntl(F_SETLEASE, F_RDLCK)", path, e))?;
        // From here the lease is held: the length cannot shrink, and every
        // refusal gives the lease up with the file's drop (close).
        let len = file.metadata().map_err(|e| Error::io("fstat", path, e))?.len();
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "lease",
                path,
                "the file is empty: nothing to map",
            ));
        }
        let resident = pagecache::residency_of(&file, path, 0, len)?;
        if resident.fraction < MAPPED_SHARE {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "lease",
                path,
                format!(
                    "{:.0}% of the file is in the page cache, under {:.0}%: it is read, not mapped",
                    resident.fraction * 100.0,
                    MAPPED_SHARE * 100.0
                ),
            ));
        }
        let len = usize::try_from(len)
            .map_err(|_| Error::new(ErrorKind::InvalidInput, "mmap", path, "too large"))?;
        let view = FileView::map(file.as_fd(), len).map_err(|e| Error::io("mmap", path, e))?;
        let address = view.address();
        let shared = Arc::new(Shared {
            state: Mutex::new(State { view, file: Some(file), stopping: false }),
            wake: Condvar::new(),
            broken: AtomicBool::new(false),
        });
        let watched = Arc::clone(&shared);
        let watcher = std::thread::Builder::new()
            .name("dmaload-lease".into())
            .spawn(move || watched.watch())
            .map_err(|e| Error::io("spawn the lease watcher", path, e))?;
        Ok(LeasedMapping { shared, watcher: Some(watcher), address, len, path: path.to_owned() })
    }

    /// The address of the file's first byte; the mapping is readable and
    /// writable (private: writes never reach the file) for [`Self::len`]
    /// bytes until this value is dropped.
    pub fn address(&self) -> usize {
        self.address
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A copy of `dst.len()` bytes from `offset`; `None` past the end.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Option<()> {
        self.shared.lock().view.copy_out(offset, dst)
    }

    /// Whether a writer broke the lease: the mapping then holds a private
    /// copy of the bytes as they were, and the file may have changed since.
    pub fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::Acquire)
    }

    /// Looks at the lease now, as the watcher does (the detach included
    /// where it is broken), and says whether it is still held.
    pub fn check(&self) -> bool {
        self.shared.poll(&mut self.shared.lock());
        !self.is_broken()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn watch(&self) {
        let mut state = self.lock();
        while !state.stopping && state.file.is_some() {
            state = self.wake.wait_timeout(state, POLL_INTERVAL).unwrap_or_else(PoisonError::into_inner).0;
            self.poll(&mut state);
        }
    }

    /// Where a writer is breaking the lease: detaches the view, then gives
    /// the lease up. A detach that fails (no memory for the copy) keeps the
    /// lease, to be tried again at the next poll.
    fn poll(&self, state: &mut State) {
        let Some(file) = &state.file else { return };
        if lease::lease_held(file.as_fd()).unwrap_or(false) {
            return;
        }
        if state.view.detach().is_err() {
            return;
        }
        // An error here leaves nothing to do: the lease goes with the close.
        let _ = lease::release_lease(file.as_fd());
        state.file = None;
        self.broken.store(true, Ordering::Release);
    }
}

impl Drop for LeasedMapping {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        self.shared.wake.notify_all();
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
        // The view is unmapped (State's fields drop in order) before the
        // file closes and its lease goes with it.
    }
}
