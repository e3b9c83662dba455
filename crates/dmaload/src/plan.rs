//! How a transfer is cut up: the file range in aligned chunks (one I/O
//! each), grouped into gathers (populated, and registered with io_uring, as
//! a unit). A load's plan reads; a save's writes ([`Plan::write`]).

use std::ops::Range;
use std::path::Path;

use crate::error::{Error, ErrorKind, Result};
use crate::types::Direction;

/// The byte layout of one transfer. Mapping offset 0 holds file offset
/// `file_start`; reads cover `file_start..read_end`, of which
/// `file_start..data_end` must arrive. The caller asked for
/// `data_start..data_end`; the rest is alignment padding. A write's plan
/// has no padding: its memory is exactly the bytes to write.
#[derive(Debug, Clone)]
pub struct Plan {
    pub direction: Direction,
    pub file_start: u64,
    pub data_start: u64,
    pub data_end: u64,
    pub read_end: u64,
    pub chunk: usize,
    /// Largest gather, in bytes.
    pub gather: usize,
    /// Mapping offset where each gather starts, then `mapping_len`.
    gather_bounds: Vec<usize>,
    /// Offset/length alignment of reads (1 for buffered I/O).
    pub align: usize,
    /// Bytes to reserve: the read span rounded up to whole pages.
    pub mapping_len: usize,
    /// Staged: the gathers a sink's cache lane carries from the page cache
    /// ([`Plan::with_cache_lane`]); the engine reads none of them. Empty
    /// when no gather goes there.
    cache_lane: Vec<bool>,
}

/// One read request: file offsets `start..end` into mapping offsets
/// `start - file_start ..`, of which the first `need` bytes must arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub start: u64,
    pub end: u64,
    pub need: u64,
}

/// What a finished read means for its request.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Everything needed arrived; `credited` bytes of requested data.
    Done { credited: u64 },
    /// A short read: re-issue from `resume_at` (`credited` bytes of
    /// requested data arrived).
    Partial { credited: u64, resume_at: u64 },
}

/// Gather boundaries that start with one chunk and double up to `gather`:
/// the I/O can start as soon as the first chunk's pages exist, instead of
/// after a whole gather (seed 000's T(first gather)), while later gathers
/// are large enough to keep per-gather costs small.
fn ramped_bounds(mapping_len: usize, chunk: usize, gather: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    let mut size = chunk;
    let mut start = 0;
    while start < mapping_len {
        start = (start + size).min(mapping_len);
        bounds.push(start);
        if start >= 2 * size {
            size = (size * 2).min(gather);
        }
    }
    bounds
}

/// Most buffers the io_uring registered-buffer table holds.
const MAX_GATHERS: usize = crate::sys::uring::MAX_REGISTERED_BUFFERS;
/// Largest single registered buffer io_uring accepts.
const MAX_GATHER_BYTES: usize = 1 << 30;

impl Plan {
    /// Plans reading `len` bytes at `offset` with reads aligned to `align`.
    pub fn new(offset: u64, len: u64, align: usize, chunk: usize, gather: usize, page: usize) -> Plan {
        let align_u = align as u64;
        let data_end = offset + len;
        // An empty range reads nothing, wherever it starts: no block around
        // it, so no gather that no byte would ever complete.
        let (file_start, read_end) = match len {
            0 => (offset, offset),
            _ => (offset / align_u * align_u, data_end.div_ceil(align_u) * align_u),
        };
        let span = (read_end - file_start) as usize;
        let mapping_len = span.div_ceil(page) * page;
        // A chunk is whole pages (so every chunk starts page-aligned in memory)
        // and whole alignment blocks (so every read is aligned, and none reads
        // padding alone), and a gather is whole chunks.
        let chunk = Self::request_len(chunk, align, page);
        let mut gather = gather.clamp(chunk, MAX_GATHER_BYTES) / chunk * chunk;
        // The ramp adds at most log2(gather / chunk) + 1 gathers.
        let ramp = |gather: usize| (gather / chunk).ilog2() as usize + 1;
        while mapping_len.div_ceil(gather) + ramp(gather) > MAX_GATHERS && gather * 2 <= MAX_GATHER_BYTES {
            gather *= 2;
        }
        let gather_bounds = ramped_bounds(mapping_len, chunk, gather);
        Plan {
            direction: Direction::Read,
            file_start,
            data_start: offset,
            data_end,
            read_end,
            chunk,
            gather,
            gather_bounds,
            align,
            mapping_len,
            cache_lane: Vec::new(),
        }
    }

    /// Plans reading `len` bytes at `offset` through a ring of staging slots
    /// of `slot` bytes: every gather is one slot's worth (no ramp: the slots
    /// are populated before the load starts), and their number is not
    /// bounded by the registered-buffer table, since gather `g` reuses slot
    /// `g % slots`. A slot must hold at least one request
    /// ([`Plan::request_len`]).
    pub fn staged(offset: u64, len: u64, align: usize, chunk: usize, slot: usize, page: usize) -> Plan {
        let mut plan = Plan::new(offset, len, align, chunk, slot, page);
        plan.gather = Self::slot_len(plan.chunk, slot, page);
        let gather = plan.gather;
        plan.gather_bounds = (0..plan.mapping_len.div_ceil(gather))
            .map(|g| g * gather)
            .chain(std::iter::once(plan.mapping_len))
            .collect();
        plan
    }

    /// The same plan with the gathers whose requested bytes `cached` calls
    /// in the page cache left to a cache lane ([`crate::sink::CachedRanges`]):
    /// the engine skips them, the rest it reads as before.
    pub fn with_cache_lane(mut self, mut cached: impl FnMut(Range<u64>) -> bool) -> Plan {
        let lane: Vec<bool> = (0..self.gather_count())
            .map(|g| {
                let data = self.gather_data(g);
                !data.is_empty() && cached(data)
            })
            .collect();
        self.cache_lane = if lane.contains(&true) { lane } else { Vec::new() };
        self
    }

    /// Whether gather `g` is carried by the cache lane, not read by the engine.
    pub fn in_cache_lane(&self, g: usize) -> bool {
        self.cache_lane.get(g).copied().unwrap_or(false)
    }

    /// The gathers the cache lane carries.
    pub fn cache_lane_gathers(&self) -> impl Iterator<Item = usize> + '_ {
        self.cache_lane.iter().enumerate().filter_map(|(g, &lane)| lane.then_some(g))
    }

    /// The plan cut into consecutive plans of at most `gathers` gathers
    /// each, the same gathers and chunks in the same order, each with its
    /// own mapping from its first gather (a staged load run in rounds of
    /// one ring each when no thread can deliver beside the reads). The
    /// parts carry no cache lane: the engine reads every gather.
    pub fn parts(&self, gathers: usize) -> Vec<Plan> {
        let count = self.gather_count();
        (0..count)
            .step_by(gathers.max(1))
            .map(|first| {
                let bounds = &self.gather_bounds[first..=(first + gathers.max(1)).min(count)];
                let (start, end) = (bounds[0], bounds[bounds.len() - 1]);
                let file_start = self.file_start + start as u64;
                let file_end = self.file_start + end as u64;
                let data_start = self.data_start.max(file_start);
                Plan {
                    file_start,
                    data_start,
                    data_end: self.data_end.min(file_end).max(data_start),
                    read_end: self.read_end.min(file_end),
                    gather_bounds: bounds.iter().map(|b| b - start).collect(),
                    mapping_len: end - start,
                    cache_lane: Vec::new(),
                    ..self.clone()
                }
            })
            .collect()
    }

    /// Plans writing `len` bytes of memory to the file at `offset`, in
    /// requests of `chunk` bytes (whole pages and whole `align` blocks, so
    /// that each direct write is aligned when `offset` is) grouped in
    /// windows of at most `window` bytes, registered one after another as
    /// a load's gathers are. The memory is exactly the `len` bytes.
    pub fn write(offset: u64, len: u64, align: usize, chunk: usize, window: usize, page: usize) -> Plan {
        let mut plan = Plan::new(offset, len, 1, Self::request_len(chunk, align, page), window, page);
        plan.direction = Direction::Write;
        plan.mapping_len = len as usize;
        plan.gather_bounds = ramped_bounds(plan.mapping_len, plan.chunk, plan.gather);
        plan
    }

    /// The length of a staging slot for reads of `chunk` bytes: whole
    /// chunks (themselves whole pages), at most 1 GiB (a registered buffer's
    /// limit).
    pub fn slot_len(chunk: usize, slot: usize, page: usize) -> usize {
        let chunk = Self::chunk_len(chunk, page);
        slot.clamp(chunk, MAX_GATHER_BYTES) / chunk * chunk
    }

    /// The length of a read request for `chunk` bytes asked for: whole
    /// pages, at least one.
    pub fn chunk_len(chunk: usize, page: usize) -> usize {
        chunk.max(page).div_ceil(page) * page
    }

    /// The length of a read request for `chunk` bytes asked for with reads
    /// aligned to `align`: whole pages and whole alignment blocks.
    pub fn request_len(chunk: usize, align: usize, page: usize) -> usize {
        Self::chunk_len(chunk, page).next_multiple_of(align)
    }

    /// The part of gather `g` the caller asked for, as file offsets.
    pub fn gather_data(&self, g: usize) -> Range<u64> {
        let range = self.gather_range(g);
        let start = (self.file_start + range.start as u64).max(self.data_start);
        let end = (self.file_start + range.end as u64).min(self.data_end);
        start..end.max(start)
    }

    /// Where the requested bytes are in the mapping.
    pub fn data_range(&self) -> Range<usize> {
        (self.data_start - self.file_start) as usize..(self.data_end - self.file_start) as usize
    }

    /// How many of the file bytes `start..end` the caller asked for: what
    /// progress and per-gather accounting count (not alignment padding).
    fn requested_bytes(&self, start: u64, end: u64) -> u64 {
        end.min(self.data_end).saturating_sub(start.max(self.data_start))
    }

    pub fn chunk_count(&self) -> usize {
        ((self.read_end - self.file_start) as usize).div_ceil(self.chunk)
    }

    pub fn gather_count(&self) -> usize {
        self.gather_bounds.len() - 1
    }

    /// Mapping range of gather `g`.
    pub fn gather_range(&self, g: usize) -> Range<usize> {
        self.gather_bounds[g]..self.gather_bounds[g + 1]
    }

    pub fn gather_ranges(&self) -> Vec<Range<usize>> {
        (0..self.gather_count()).map(|g| self.gather_range(g)).collect()
    }

    /// The gather that file offset `file_offset` falls in (binary search).
    pub fn gather_of(&self, file_offset: u64) -> usize {
        let at = (file_offset - self.file_start) as usize;
        self.gather_bounds.partition_point(|&start| start <= at) - 1
    }

    /// Bytes of requested data in gather `g`.
    pub fn gather_need(&self, g: usize) -> u64 {
        let range = self.gather_range(g);
        self.requested_bytes(self.file_start + range.start as u64, self.file_start + range.end as u64)
    }

    /// The request for chunk `i`.
    pub fn chunk_request(&self, i: usize) -> Request {
        self.request_from(self.file_start + (i * self.chunk) as u64)
    }

    /// The chunk that file offset `offset` falls in.
    pub fn chunk_index(&self, offset: u64) -> usize {
        ((offset - self.file_start) / self.chunk as u64) as usize
    }

    /// A request from `start` to the end of its chunk.
    pub fn request_from(&self, start: u64) -> Request {
        let chunk_end = self.file_start + (self.chunk_index(start) as u64 + 1) * self.chunk as u64;
        let end = chunk_end.min(self.read_end);
        let need = end.min(self.data_end).saturating_sub(start);
        Request { start, end, need }
    }

    /// The file range `start..end` of a request as a mapping range.
    pub fn mapping_range(&self, req: &Request) -> Range<usize> {
        (req.start - self.file_start) as usize..(req.end - self.file_start) as usize
    }

    /// Interprets `got` bytes transferred for `req`. A short transfer is
    /// resumed, except a read at end of file (0 bytes) or, for direct I/O,
    /// an unaligned count (the kernel stopped at end of file): then the file
    /// is shorter than planned, which is an error naming the offset. A
    /// write of 0 bytes is an error too (`WriteZero`).
    pub fn outcome(&self, path: &Path, req: &Request, got: u64) -> Result<ReadOutcome> {
        if got >= req.need {
            return Ok(ReadOutcome::Done { credited: self.requested_bytes(req.start, req.start + req.need) });
        }
        let stopped_at = req.start + got;
        match self.direction {
            Direction::Write if got == 0 => {
                return Err(Error::io("write", path, std::io::ErrorKind::WriteZero.into()).at(stopped_at));
            }
            Direction::Read if got == 0 || got % self.align as u64 != 0 => {
                return Err(Error::new(
                    ErrorKind::Truncated,
                    "read",
                    path,
                    format!(
                        "file ended at offset {stopped_at} but data was expected up to offset {} \
                         (file shorter than expected, or truncated during the load)",
                        self.data_end
                    ),
                )
                .at(stopped_at));
            }
            _ => {}
        }
        Ok(ReadOutcome::Partial {
            credited: self.requested_bytes(req.start, stopped_at),
            resume_at: stopped_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = 4096;

    #[test]
    fn unaligned_range_rounds_out_to_alignment() {
        let plan = Plan::new(5000, 10_000, 512, 1 << 20, 1 << 27, P);
        assert_eq!(plan.file_start, 4608);
        assert_eq!(plan.data_end, 15_000);
        assert_eq!(plan.read_end, 15_360);
        assert_eq!(plan.data_range(), 392..10_392);
        // Progress counts the requested bytes, not the aligned head.
        let req = plan.chunk_request(0);
        assert_eq!(
            plan.outcome(Path::new("f"), &req, 10_752).unwrap(),
            ReadOutcome::Done { credited: 10_000 }
        );
        assert_eq!(plan.gather_need(0), 10_000);
        assert_eq!(plan.mapping_len, 12_288);
        assert_eq!(plan.chunk_count(), 1);
        assert_eq!(plan.chunk_request(0), Request { start: 4608, end: 15_360, need: 10_392 });
    }

    #[test]
    fn an_empty_range_plans_nothing_to_read() {
        for plan in [Plan::new(10_000, 0, 512, 1 << 20, 1 << 20, P), Plan::staged(10_000, 0, 512, P, P, P)] {
            assert_eq!((plan.mapping_len, plan.chunk_count(), plan.gather_count()), (0, 0, 0));
            assert_eq!(plan.data_range(), 0..0);
        }
    }

    #[test]
    fn gathers_ramp_up_from_one_chunk() {
        const M: usize = 1 << 20;
        let bounds = ramped_bounds(100 * M, M, 16 * M);
        let sizes: Vec<usize> = bounds.windows(2).map(|w| (w[1] - w[0]) / M).collect();
        assert_eq!(sizes, [1, 1, 2, 4, 8, 16, 16, 16, 16, 16, 4]);
        assert_eq!(ramped_bounds(0, M, 16 * M), [0]);
        assert_eq!(ramped_bounds(M / 2, M, 16 * M), [0, M / 2]);
    }

    #[test]
    fn chunks_and_gathers_cover_the_span() {
        let plan = Plan::new(0, 10 * (1 << 20) + 1, 4096, 1 << 20, 4 << 20, P);
        assert_eq!(plan.chunk_count(), 11);
        // Gathers of 1, 1, 2, 4 MiB, then the rest.
        assert_eq!(plan.gather_count(), 5);
        assert_eq!(plan.gather_range(4), (8 << 20)..(10 << 20) + P);
        let total: u64 = (0..plan.gather_count()).map(|g| plan.gather_need(g)).sum();
        assert_eq!(total, 10 * (1 << 20) + 1);
        let last = plan.chunk_request(10);
        assert_eq!((last.end - last.start, last.need), (4096, 1));
        assert_eq!(plan.gather_of(last.start), 4);
        assert_eq!(plan.gather_of(0), 0);
        assert_eq!(plan.gather_of(1 << 20), 1);
        assert_eq!(plan.gather_of((4 << 20) - 1), 2);
    }

    #[test]
    fn staged_gathers_are_slots() {
        const M: usize = 1 << 20;
        // An unaligned range: the first slot holds the alignment head too.
        let plan = Plan::staged(1000, 10 * M as u64, 512, M, 4 * M, P);
        assert_eq!(plan.gather, 4 * M);
        assert_eq!(plan.gather_count(), 3);
        assert_eq!(plan.gather_range(0), 0..4 * M);
        assert_eq!(plan.gather_range(2), 8 * M..plan.mapping_len);
        assert_eq!(plan.gather_data(0), 1000..4 * M as u64 + 512);
        assert_eq!(plan.gather_data(2).end, 1000 + 10 * M as u64);
        let total: u64 = (0..3).map(|g| plan.gather_need(g)).sum();
        assert_eq!(total, 10 * M as u64);
        let covered: u64 = (0..3).map(|g| plan.gather_data(g)).map(|r| r.end - r.start).sum();
        assert_eq!(covered, 10 * M as u64);
        // Far more slot-sized gathers than the registered table holds.
        let huge = Plan::staged(0, 1 << 40, 4096, M, M, P);
        assert_eq!(huge.gather_count(), 1 << 20);
        assert_eq!(Plan::slot_len(3 * M, 4 * M, P), 3 * M);
        assert_eq!(Plan::slot_len(M, 1, P), M);
    }

    #[test]
    fn an_alignment_larger_than_a_chunk_widens_the_chunks() {
        const M: usize = 1 << 20;
        let plan = Plan::new(5000, 3 * M as u64, M, 64 << 10, 4 * M, P);
        assert_eq!((plan.file_start, plan.read_end, plan.chunk), (0, 4 * M as u64, M));
        // Every read starts aligned and carries requested bytes.
        for i in 0..plan.chunk_count() {
            let req = plan.chunk_request(i);
            assert_eq!(req.start % M as u64, 0);
            assert!(req.need > 0, "chunk {i} reads only padding");
        }
    }

    #[test]
    fn a_write_plan_covers_exactly_its_bytes_in_ramped_windows() {
        const M: usize = 1 << 20;
        let len = 10 * M as u64 + 100;
        let plan = Plan::write(3 * M as u64, len, 4096, M, 4 * M, P);
        assert_eq!(
            (plan.file_start, plan.data_end, plan.read_end),
            (3 * M as u64, 3 * M as u64 + len, 3 * M as u64 + len)
        );
        assert_eq!(plan.mapping_len, len as usize);
        assert_eq!(plan.data_range(), 0..len as usize);
        let sizes: Vec<usize> = plan.gather_ranges().iter().map(|r| r.len()).collect();
        assert_eq!(sizes, [M, M, 2 * M, 4 * M, 2 * M + 100]);
        let last = plan.chunk_request(plan.chunk_count() - 1);
        assert_eq!((last.end - last.start, last.need), (100, 100));
        // Short writes resume; a write of nothing is an error at its offset.
        let path = Path::new("f");
        let req = plan.chunk_request(0);
        assert_eq!(
            plan.outcome(path, &req, 100).unwrap(),
            ReadOutcome::Partial { credited: 100, resume_at: req.start + 100 }
        );
        let err = plan.outcome(path, &req, 0).unwrap_err();
        assert_eq!((err.raw_os_error(), err.offset()), (None, Some(req.start)));
        assert!(err.to_string().contains("write"), "{err}");
        // Requests are whole alignment blocks.
        assert_eq!(Plan::write(0, 1 << 30, 64 << 10, 100_000, 128 * M, P).chunk, 128 << 10);
    }

    #[test]
    fn gather_grows_to_fit_the_registered_table() {
        let plan = Plan::new(0, 1 << 40, 4096, 1 << 20, 1 << 20, P);
        assert!(plan.gather_count() <= MAX_GATHERS);
    }

    #[test]
    fn short_reads_resume_or_fail_with_the_offset() {
        let plan = Plan::new(0, 3 * 4096 + 10, 4096, 1 << 20, 1 << 27, P);
        let req = plan.chunk_request(0);
        let path = Path::new("f");
        assert_eq!(plan.outcome(path, &req, 4 * 4096).unwrap(), ReadOutcome::Done { credited: req.need });
        assert_eq!(
            plan.outcome(path, &req, 3 * 4096 + 10).unwrap(),
            ReadOutcome::Done { credited: req.need }
        );
        assert_eq!(
            plan.outcome(path, &req, 4096).unwrap(),
            ReadOutcome::Partial { credited: 4096, resume_at: 4096 }
        );
        let err = plan.outcome(path, &req, 100).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Truncated);
        assert_eq!(err.offset(), Some(100));
        assert_eq!(plan.outcome(path, &req, 0).unwrap_err().offset(), Some(0));
        assert_eq!(plan.request_from(4096), Request { start: 4096, end: 4 * 4096, need: 2 * 4096 + 10 });
    }

    #[test]
    fn parts_read_the_same_chunks_and_need_the_same_bytes_in_the_same_order() {
        // An unaligned range of 11 slots of 4 chunks, in parts of 3 slots.
        let plan = Plan::staged(5000, 11 * 4 * 4096 - 9000, 512, P, 4 * P, P);
        let parts = plan.parts(3);
        assert_eq!(parts.iter().map(Plan::gather_count).collect::<Vec<_>>(), [3, 3, 3, 2]);
        let requests =
            |plan: &Plan| (0..plan.chunk_count()).map(|i| plan.chunk_request(i)).collect::<Vec<_>>();
        assert_eq!(parts.iter().flat_map(requests).collect::<Vec<_>>(), requests(&plan));
        let data = |plan: &Plan| (0..plan.gather_count()).map(|g| plan.gather_data(g)).collect::<Vec<_>>();
        assert_eq!(parts.iter().flat_map(data).collect::<Vec<_>>(), data(&plan));
        let need: u64 =
            parts.iter().map(|p| (0..p.gather_count()).map(|g| p.gather_need(g)).sum::<u64>()).sum();
        assert_eq!(need, plan.data_end - plan.data_start);
    }
}
