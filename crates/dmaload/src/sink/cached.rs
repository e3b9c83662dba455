//! The cache lane's share of a staged load: ranges of the file already in
//! the page cache, which a sink that can ([`super::Sink::has_cache_lane`])
//! carries on threads of its own beside the ring's deliveries, each thread
//! through a few small staging pieces of its own.

use std::io;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::sys::mem::MappingWriter;

/// Staging pieces each cache-lane thread cycles through: one being read
/// into while the copies of the others run, and it waits only for its own
/// oldest copy before reading into that piece again.
pub const CACHE_LANE_PIECES: usize = 3;
/// Bytes of one cache-lane staging piece at most. Small, so a thread's
/// pieces (3 × 2 MiB) stay in the CPU's cache between the page-cache copy
/// that writes them and the DMA that reads them (a 512 MiB ring never does:
/// every byte then crosses DRAM three times), yet large enough that a
/// copy's fixed cost stays small against its time on the link.
pub const CACHE_LANE_PIECE: usize = 2 << 20;

/// File ranges already in the page cache that a sink's cache lane carries
/// itself, beside the deliveries from the ring: each lane thread takes the
/// next range, reads it (buffered `pread`, through the file's own
/// description, never the `O_DIRECT` one) piece by piece into its own
/// staging pieces, and hands each piece on. Made by the pipeline
/// (`fill_staged`), which also keeps the ring's reads off these ranges.
pub struct CachedRanges<'a> {
    file: BorrowedFd<'a>,
    ranges: Vec<Range<u64>>,
    next: AtomicUsize,
    staging: MappingWriter<'a>,
    /// Each lane thread's staging pieces, ranges of `staging`.
    pieces: Vec<Vec<Range<usize>>>,
    /// Whether the load stopped (failed elsewhere, or cancelled).
    stopped: &'a (dyn Fn() -> bool + Sync),
    /// Counts bytes that arrived on the device (progress).
    carried: &'a (dyn Fn(u64) + Sync),
    /// Stops the rest of the load after a lane failure.
    on_failure: &'a (dyn Fn(&io::Error) + Sync),
    bytes: AtomicU64,
    failure: Mutex<Option<(u64, io::Error)>>,
}

impl<'a> CachedRanges<'a> {
    /// `ranges` of `file` for lane threads whose pieces are `pieces` (one
    /// list per thread) of `staging`, memory nothing else writes meanwhile.
    pub(crate) fn new(
        file: BorrowedFd<'a>,
        ranges: Vec<Range<u64>>,
        staging: MappingWriter<'a>,
        pieces: Vec<Vec<Range<usize>>>,
        stopped: &'a (dyn Fn() -> bool + Sync),
        carried: &'a (dyn Fn(u64) + Sync),
        on_failure: &'a (dyn Fn(&io::Error) + Sync),
    ) -> Self {
        CachedRanges {
            file,
            ranges,
            next: AtomicUsize::new(0),
            staging,
            pieces,
            stopped,
            carried,
            on_failure,
            bytes: AtomicU64::new(0),
            failure: Mutex::new(None),
        }
    }

    /// Lane threads the pieces allow.
    pub(crate) fn threads(&self) -> usize {
        self.pieces.len()
    }

    /// The staging pieces of lane thread `thread`.
    pub(crate) fn pieces_of(&self, thread: usize) -> &[Range<usize>] {
        &self.pieces[thread]
    }

    pub(crate) fn staging(&self) -> MappingWriter<'a> {
        self.staging
    }

    /// The next range for a lane thread, or `None` when all are taken or
    /// the load stopped.
    pub(crate) fn take(&self) -> Option<Range<u64>> {
        if self.is_stopped() {
            return None;
        }
        self.ranges.get(self.next.fetch_add(1, Ordering::Relaxed)).cloned()
    }

    /// Whether the lane should stop: a failure here or elsewhere.
    pub(crate) fn is_stopped(&self) -> bool {
        (self.stopped)() || self.lock().is_some()
    }

    /// Reads file bytes `from..from + piece.len()` into `piece` of the
    /// staging memory from the page cache (the disk where a page was
    /// evicted meanwhile); the file ending first is an error.
    pub(crate) fn read_piece(&self, piece: Range<usize>, from: u64) -> io::Result<()> {
        let mut done = 0;
        while done < piece.len() {
            let part = piece.start + done..piece.end;
            match self.staging.pread_at(self.file, part, from + done as u64, 0) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "the file ended at {} (shorter than when the load began)",
                            from + done as u64
                        ),
                    ))
                }
                Ok(got) => done += got,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        Ok(())
    }

    /// `bytes` of the cached ranges have landed in the destination.
    pub(crate) fn carried(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        (self.carried)(bytes);
    }

    /// The lane failed at file offset `offset`: the first failure is kept
    /// (the load's error) and the rest of the load is stopped.
    pub(crate) fn fail(&self, offset: u64, err: io::Error) {
        (self.on_failure)(&err);
        self.lock().get_or_insert((offset, err));
    }

    /// Bytes the lane carried.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The first failure: its file offset and cause.
    pub(crate) fn take_failure(&self) -> Option<(u64, io::Error)> {
        self.lock().take()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(u64, io::Error)>> {
        self.failure.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How the cache lane divides `staging` (bytes `start..end` of the ring,
/// whole slots the engine leaves alone) among at most `threads` threads:
/// [`CACHE_LANE_PIECES`] pieces of at most [`CACHE_LANE_PIECE`] bytes each
/// (whole pages), as many threads as fit (none when not even one does).
pub(crate) fn lane_pieces(staging: Range<usize>, threads: usize, page: usize) -> Vec<Vec<Range<usize>>> {
    let piece = (staging.len() / CACHE_LANE_PIECES / page * page).min(CACHE_LANE_PIECE);
    if piece == 0 {
        return Vec::new();
    }
    let fit = staging.len() / (piece * CACHE_LANE_PIECES);
    (0..threads.min(fit))
        .map(|t| {
            let first = staging.start + t * piece * CACHE_LANE_PIECES;
            (0..CACHE_LANE_PIECES).map(|i| first + i * piece..first + (i + 1) * piece).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_pieces_are_disjoint_whole_pages_inside_the_staging_range() {
        let page = 4096;
        let pieces = lane_pieces(64 << 20..128 << 20, 16, page);
        assert_eq!(pieces.len(), 10, "64 MiB holds ten threads of 3 x 2 MiB");
        let mut all: Vec<Range<usize>> = pieces.into_iter().flatten().collect();
        all.sort_by_key(|r| r.start);
        assert!(all.windows(2).all(|w| w[0].end <= w[1].start));
        assert!(all.iter().all(|r| r.start >= 64 << 20 && r.end <= 128 << 20 && r.len() == CACHE_LANE_PIECE));
        // A small ring: smaller pieces, still whole pages; none when too small.
        let small = lane_pieces(0..1 << 20, 4, page);
        assert_eq!(small.len(), 1);
        assert!(small[0].iter().all(|r| r.len() % page == 0 && !r.is_empty()));
        assert!(lane_pieces(0..2 * page, 4, page).is_empty());
    }
}
