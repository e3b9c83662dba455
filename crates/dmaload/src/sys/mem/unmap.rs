//! The background unmapping thread: large mappings given back off the
//! dropping thread, and waited for before a fork and on demand.

/// Mappings at least this large are unmapped on a background thread: giving
/// back gigabytes of 4 KiB pages takes the dropping thread a large part of
/// a second per GiB, which a caller dropping a buffer should not wait for
/// (2 MiB pages take milliseconds; docs/benchmarks.md, "Figures behind the defaults").
/// Smaller ones are unmapped at once.
pub const BACKGROUND_UNMAP_MIN: usize = 64 << 20;

/// A region whose owner has gone: nothing in the process refers to it.
pub(super) struct Unmap {
    pub(super) addr: usize,
    pub(super) len: usize,
}

pub(super) fn unmap(region: Unmap) {
    if region.len > 0 {
        // SAFETY: the region was mapped by a `Mapping` that owned it alone
        // and has been dropped, so no reference into it remains; unmapping
        // it twice cannot happen (the region moved here by value).
        unsafe { libc::munmap(region.addr as *mut libc::c_void, region.len) };
    }
}

/// The background unmapping thread, and the bytes it has still to unmap.
pub(super) struct Unmapper {
    /// The process that started the thread: a child of `fork` has no such
    /// thread (only the forking thread survives a fork), so it unmaps in
    /// place.
    pid: u32,
    queue: std::sync::mpsc::Sender<Unmap>,
    pending: std::sync::Mutex<usize>,
    done: std::sync::Condvar,
}

impl Unmapper {
    pub(super) fn send(&self, region: Unmap) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) += region.len;
        let len = region.len;
        if let Err(std::sync::mpsc::SendError(region)) = self.queue.send(region) {
            // The thread is gone (it never panics, but be safe): unmap here.
            unmap(region);
            self.finished(len);
        }
    }

    fn finished(&self, len: usize) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        *pending -= len;
        if *pending == 0 {
            self.done.notify_all();
        }
    }
}

/// The process's unmapping thread, started on first use; `None` where no
/// thread can be started (RLIMIT_NPROC) and in a child of `fork`: then
/// drops unmap in place.
pub(super) fn unmapper() -> Option<&'static Unmapper> {
    static UNMAPPER: std::sync::OnceLock<Option<Unmapper>> = std::sync::OnceLock::new();
    UNMAPPER
        .get_or_init(|| {
            // A fork copies every mapping still queued into the child, where
            // no thread would ever unmap it: finish them before forking.
            // SAFETY: `finish_unmaps_before_fork` is a plain `extern "C"`
            // function that does not unwind; no child or parent handler.
            if unsafe { libc::pthread_atfork(Some(finish_unmaps_before_fork), None, None) } != 0 {
                return None;
            }
            let (queue, regions) = std::sync::mpsc::channel::<Unmap>();
            std::thread::Builder::new()
                .name("dmaload-unmap".into())
                .spawn(move || {
                    for region in regions {
                        let len = region.len;
                        unmap(region);
                        if let Some(Some(unmapper)) = UNMAPPER.get() {
                            unmapper.finished(len);
                        }
                    }
                })
                .ok()?;
            Some(Unmapper {
                pid: std::process::id(),
                queue,
                pending: std::sync::Mutex::new(0),
                done: std::sync::Condvar::new(),
            })
        })
        .as_ref()
        .filter(|unmapper| unmapper.pid == std::process::id())
}

/// The `pthread_atfork` prepare handler: waits for queued unmaps.
extern "C" fn finish_unmaps_before_fork() {
    wait_for_unmaps();
}

/// Bytes of dropped mappings the background thread has not unmapped yet.
pub fn unmap_pending() -> usize {
    unmapper().map_or(0, |u| *u.pending.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Waits until every dropped mapping has been unmapped: before measuring
/// the memory available, so a buffer just dropped counts as free.
pub fn wait_for_unmaps() {
    let Some(unmapper) = unmapper() else { return };
    let mut pending = unmapper.pending.lock().unwrap_or_else(|p| p.into_inner());
    while *pending > 0 {
        pending = unmapper.done.wait(pending).unwrap_or_else(|p| p.into_inner());
    }
}
