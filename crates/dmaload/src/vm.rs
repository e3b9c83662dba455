//! Binding ranges of huge buffers into a reserved address space without
//! copying, in O(log n) per bind (seed 002).
//!
//! A [`SegmentTable`] lists the pieces of file memory behind one logical
//! buffer (which fd, where in it, how long), for example every shard of a
//! model loaded with [`crate::load()`]. [`SegmentTable::locate`] finds the
//! piece holding a byte by binary search over the pieces' start offsets,
//! and contiguous pieces are merged when the table is built, so a bind
//! costs the same for a 1 GiB and a 64 GiB buffer (a walk from the first
//! piece, as a scatter list forces, grows with the offset; that walk is
//! the baseline of `dmaload-bench bind`, behind the crate's `baselines`
//! feature).
//!
//! An [`AddressSpace`] reserves a range of virtual addresses (no memory)
//! and maps table ranges into it with `mmap(MAP_SHARED | MAP_FIXED)` of the
//! backing fds: a range that spans several pieces becomes several mappings
//! that sit side by side, so it reads as one contiguous run of bytes.
//!
//! ```no_run
//! use dmaload::vm::{Access, AddressSpace, SegmentTable};
//! let opts = dmaload::LoadOptions::default();
//! let (a, _) = dmaload::load("shard-1.bin", &opts)?;
//! let (b, _) = dmaload::load("shard-2.bin", &opts)?;
//! let table = SegmentTable::from_buffers(&[&a, &b])?;
//! let mut space = AddressSpace::new(1 << 30)?;
//! space.bind(0, &table, 0, 2 << 20, Access::Read)?; // both shards' first bytes, if page-sized
//! let mut head = [0u8; 16];
//! space.read_at(0, &mut head)?;
//! space.unbind(0, 2 << 20)?;
//! # Ok::<(), dmaload::Error>(())
//! ```
//!
//! # Soundness
//!
//! Bound bytes are pages of files that other mappings (and other processes
//! holding the fd) can write, and that a later bind or unbind replaces, so
//! this module never hands out `&[u8]` of them. The safe way in and out is a
//! copy through the kernel ([`AddressSpace::read_at`],
//! [`AddressSpace::write_at`]), which reports unbound or inaccessible pages
//! as an error rather than a crash. [`AddressSpace::as_ptr`] gives the raw
//! address for code (or devices) that views the bytes in place; building a
//! slice from it is `unsafe` and the caller's promise, as with `memmap2`,
//! that the range is bound readable, that nobody writes it (or truncates its
//! file) while the slice lives, and that no bind or unbind of the range
//! happens meanwhile (both take `&mut self`, which helps only as far as the
//! slice borrows the `AddressSpace`).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;

use crate::buffer::Buffer;
use crate::error::{Error, ErrorKind, Result};
use crate::sys::mem::page_size;
use crate::sys::vm::{Prot, Reservation};

const TABLE: &str = "segment table";
const SPACE: &str = "address space";

fn invalid(op: &'static str, what: &str, message: String) -> Error {
    Error::new(ErrorKind::InvalidInput, op, Path::new(what), message)
}

/// A new memfd of `len` bytes with nothing allocated in it
/// (`memfd_create(2)`, Linux 3.17, then `ftruncate(2)`): shmem pages appear
/// when first written, so a huge table can be built and bound over it at
/// no memory cost (the bind benchmark does).
pub fn sparse_memfd(len: u64) -> Result<File> {
    let fd = crate::sys::mem::memfd_create(c"dmaload-vm", crate::sys::mem::MemfdPages::Shmem)
        .map_err(|e| Error::io("memfd_create", Path::new(TABLE), e))?;
    crate::sys::mem::set_len(fd.as_fd(), len).map_err(|e| Error::io("ftruncate", Path::new(TABLE), e))?;
    Ok(File::from(fd))
}

/// One piece of a [`SegmentTable`]: `len` bytes of file number `file`
/// (see [`SegmentTable::file`]) from byte `offset` of it, which are bytes
/// `start..start + len` of the logical buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Where the extent starts in the logical buffer.
    pub start: u64,
    /// Byte offset in the backing file.
    pub offset: u64,
    /// Length in bytes (never 0).
    pub len: u64,
    /// Index of the backing file in the table.
    pub file: u32,
}

/// The pieces of file memory behind one logical buffer, in order, with
/// O(log n) lookup of the piece that holds a byte.
///
/// Lookup is a binary search, narrowed first by a guide: the buffer is cut
/// into as many power-of-two buckets as there are extents, and each bucket
/// records the extent holding its first byte, so the search runs over the
/// extents that start inside one bucket. With evenly sized extents that is
/// one or two (two cache misses per lookup at any size); with very uneven
/// ones it is never worse than a binary search of the whole table. The
/// table costs 32 bytes per extent plus 4 per bucket.
///
/// The table holds its backing files open (`Arc<File>`, shareable between
/// tables), so the memory stays alive as long as the table does, whatever
/// happens to the `Buffer`s it was built from.
#[derive(Debug, Clone)]
pub struct SegmentTable {
    files: Vec<Arc<File>>,
    /// In logical order: `extents[0].start == 0`, each starting where the
    /// previous one ends.
    extents: Vec<Extent>,
    /// `guide[b]`: the extent holding byte `b << shift` (empty when there
    /// are more than 2^32 extents: then the search covers the whole table).
    guide: Vec<u32>,
    shift: u32,
    len: u64,
}

impl SegmentTable {
    /// A builder to list extents by hand.
    pub fn builder() -> SegmentTableBuilder {
        SegmentTableBuilder::default()
    }

    /// The table of one buffer (memfd memory): its segments, merged.
    pub fn from_buffer(buffer: &Buffer) -> Result<SegmentTable> {
        Self::from_buffers(&[buffer])
    }

    /// The table of several buffers laid end to end (e.g. every shard of a
    /// model), contiguous neighbours merged. Needs memfd memory: a buffer of
    /// anonymous memory has no fd to map and is refused.
    pub fn from_buffers(buffers: &[&Buffer]) -> Result<SegmentTable> {
        let mut builder = Self::builder();
        for buffer in buffers {
            builder.add_buffer(buffer)?;
        }
        Ok(builder.build())
    }

    /// Bytes in the table (the logical buffer's length).
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The extents, in logical order.
    pub fn extents(&self) -> &[Extent] {
        &self.extents
    }

    /// Backing file number `index` (as in [`Extent::file`]).
    ///
    /// # Panics
    ///
    /// If `index` is not below [`SegmentTable::file_count`], as indexing does.
    pub fn file(&self, index: u32) -> &Arc<File> {
        &self.files[index as usize]
    }

    /// How many distinct backing files the table holds.
    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// Heap memory the table uses for its extents and lookup guide
    /// (at most 36 bytes per extent).
    pub fn heap_bytes(&self) -> usize {
        self.guide.capacity() * std::mem::size_of::<u32>()
            + self.extents.capacity() * std::mem::size_of::<Extent>()
            + self.files.capacity() * std::mem::size_of::<Arc<File>>()
    }

    /// The extent holding logical byte `offset` and the offset within it,
    /// by binary search between the guide's bounds for the offset's bucket:
    /// O(log n) at worst, O(1) for evenly sized extents. `None` past the
    /// end.
    #[inline]
    pub fn locate(&self, offset: u64) -> Option<(usize, u64)> {
        if offset >= self.len {
            return None;
        }
        let last = self.extents.len() - 1;
        let (lo, hi) = if self.guide.is_empty() {
            (0, last)
        } else {
            // The extent holding the bucket's first byte starts at or before
            // `offset`; the one holding the next bucket's first byte is at or
            // after the one holding `offset`.
            let bucket = (offset >> self.shift) as usize;
            let hi = self.guide.get(bucket + 1).map_or(last, |&h| h as usize);
            (self.guide[bucket] as usize, hi)
        };
        // extents[lo].start <= offset: count the later ones that also are.
        let index = lo + self.extents[lo + 1..=hi].partition_point(|e| e.start <= offset);
        Some((index, offset - self.extents[index].start))
    }

    /// The same answer as [`SegmentTable::locate`] by walking the extents
    /// from the first and adding up their lengths, as a scatter-list walk
    /// does: O(n). The baseline of `dmaload-bench bind` (feature
    /// `baselines`).
    #[cfg(feature = "baselines")]
    pub fn locate_linear(&self, offset: u64) -> Option<(usize, u64)> {
        let mut start = 0u64;
        for (index, extent) in self.extents.iter().enumerate() {
            if offset - start < extent.len {
                return Some((index, offset - start));
            }
            start += extent.len;
        }
        None
    }

    /// Copies the table's bytes at `offset` into `buf` with `pread(2)` on
    /// the backing files: the reference for what a bind shows.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(buf.len() as u64).filter(|&end| end <= self.len);
        if end.is_none() {
            return Err(invalid(
                "read",
                TABLE,
                format!("{} bytes at {offset} run past the table's {} bytes", buf.len(), self.len),
            ));
        }
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let (index, within) = self.locate(at).expect("checked above");
            let extent = self.extents[index];
            let n = (buf.len() - done).min((extent.len - within) as usize);
            self.files[extent.file as usize]
                .read_exact_at(&mut buf[done..done + n], extent.offset + within)
                .map_err(|e| Error::io("read", Path::new(TABLE), e).at(at))?;
            done += n;
        }
        Ok(())
    }
}

/// Lists the extents of a [`SegmentTable`].
#[derive(Debug, Default)]
pub struct SegmentTableBuilder {
    files: Vec<Arc<File>>,
    /// (device, inode, size) of each file: the same file added twice gets
    /// one index, so its neighbouring extents merge.
    ids: Vec<(u64, u64, u64)>,
    extents: Vec<Extent>,
    len: u64,
}

impl SegmentTableBuilder {
    /// Adds a backing file (a memfd or any mappable file), kept open by the
    /// table, and returns its index for [`SegmentTableBuilder::push`]. Its
    /// size now bounds the extents pushed for it.
    pub fn add_file(&mut self, file: impl Into<Arc<File>>) -> Result<u32> {
        let file = file.into();
        let meta = file.metadata().map_err(|e| Error::io("fstat", Path::new(TABLE), e))?;
        let id = (meta.dev(), meta.ino(), meta.len());
        if let Some(index) = self.ids.iter().position(|&(dev, ino, _)| (dev, ino) == (id.0, id.1)) {
            self.ids[index].2 = self.ids[index].2.max(id.2);
            return Ok(index as u32);
        }
        let index = u32::try_from(self.files.len())
            .map_err(|_| invalid("add file", TABLE, "more than 2^32 files".into()))?;
        self.files.push(file);
        self.ids.push(id);
        Ok(index)
    }

    /// Appends `len` bytes of file `file` from byte `offset` to the logical
    /// buffer. Empty extents are skipped; extents past the end of their
    /// file are refused.
    pub fn push(&mut self, file: u32, offset: u64, len: u64) -> Result<()> {
        let Some(&(_, _, size)) = self.ids.get(file as usize) else {
            return Err(invalid("push", TABLE, format!("no file number {file} (add it first)")));
        };
        if offset.checked_add(len).map_or(true, |end| end > size) {
            return Err(invalid(
                "push",
                TABLE,
                format!("extent {offset}+{len} runs past the end of file {file} ({size} bytes)"),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        if self.len.checked_add(len).is_none() {
            return Err(invalid("push", TABLE, "the table would exceed 2^64 bytes".into()));
        }
        self.extents.push(Extent { start: self.len, offset, len, file });
        self.len += len;
        Ok(())
    }

    /// Appends the segments of `buffer` (memfd memory only), holding a
    /// duplicate of its memfd.
    pub fn add_buffer(&mut self, buffer: &Buffer) -> Result<()> {
        let Some(memfd) = buffer.memfd()? else {
            return Err(invalid(
                "add buffer",
                TABLE,
                format!("anonymous memory has no fd to map: {}", crate::memory::NEEDS_A_MEMFD),
            ));
        };
        let fd: OwnedFd = memfd.try_clone_to_owned().map_err(|e| Error::io("dup", Path::new(TABLE), e))?;
        let file = self.add_file(File::from(fd))?;
        let base = buffer.memfd_offset() as u64;
        for segment in buffer.segments() {
            self.push(file, base + segment.offset as u64, segment.len as u64)?;
        }
        Ok(())
    }

    /// The table, with each extent that continues its predecessor in the
    /// same file merged into it.
    pub fn build(self) -> SegmentTable {
        let mut merged: Vec<Extent> = Vec::with_capacity(self.extents.len());
        for extent in self.extents {
            match merged.last_mut() {
                Some(last) if last.file == extent.file && last.offset + last.len == extent.offset => {
                    last.len += extent.len;
                }
                _ => merged.push(extent),
            }
        }
        merged.shrink_to_fit();
        Self::finish(self.files, merged, self.len)
    }

    /// The table with the extents exactly as pushed, for measuring what
    /// merging saves (feature `baselines`).
    #[cfg(feature = "baselines")]
    pub fn build_unmerged(self) -> SegmentTable {
        Self::finish(self.files, self.extents, self.len)
    }

    fn finish(files: Vec<Arc<File>>, extents: Vec<Extent>, len: u64) -> SegmentTable {
        let n = extents.len();
        let (mut guide, mut shift) = (Vec::new(), 0);
        if n > 0 && u32::try_from(n).is_ok() {
            // Buckets of a power of two bytes, no more of them than extents.
            let bucket = len.div_ceil(n as u64).next_power_of_two();
            shift = bucket.trailing_zeros();
            let buckets = len.div_ceil(bucket) as usize;
            guide.reserve_exact(buckets);
            let mut index = 0;
            for b in 0..buckets as u64 {
                let first = b << shift;
                while extents[index].start + extents[index].len <= first {
                    index += 1;
                }
                guide.push(index as u32);
            }
        }
        SegmentTable { files, extents, guide, shift, len }
    }
}

/// Access granted to bound pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `PROT_READ`.
    Read,
    /// `PROT_READ | PROT_WRITE`: the backing fd must be open for writing
    /// and, for a memfd, not sealed `F_SEAL_WRITE`/`F_SEAL_FUTURE_WRITE`.
    ReadWrite,
}

impl From<Access> for Prot {
    fn from(access: Access) -> Prot {
        match access {
            Access::Read => Prot::Read,
            Access::ReadWrite => Prot::ReadWrite,
        }
    }
}

/// How a bind finds the extent holding its first byte: the benchmark's
/// choice between the two lookups (feature `baselines`).
#[cfg(feature = "baselines")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Locate {
    /// [`SegmentTable::locate`]: binary search, O(log n).
    #[default]
    BinarySearch,
    /// [`SegmentTable::locate_linear`]: a walk from the first extent, O(n).
    LinearWalk,
}

/// A lookup of the extent holding a byte: [`SegmentTable::locate`], or a
/// baseline's.
type LocateFn = fn(&SegmentTable, u64) -> Option<(usize, u64)>;

/// One bind of a batch: `len` bytes of the table from `offset`, at `at` in
/// the address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindOp {
    pub at: usize,
    pub offset: u64,
    pub len: usize,
    pub access: Access,
}

/// One `mmap` a bind makes: a piece of one extent.
struct Piece {
    at: usize,
    len: usize,
    file: u32,
    offset: u64,
    prot: Prot,
}

/// A reserved range of virtual addresses into which ranges of
/// [`SegmentTable`]s are bound. Offsets (`at`) are relative to its start.
/// Dropping it unmaps the whole range, bindings included.
///
/// It holds no reference to the tables it binds: a `MAP_SHARED` mapping
/// keeps its file open in the kernel by itself, so the bound bytes stay
/// valid after the table (and every fd of the file) is dropped.
#[derive(Debug)]
pub struct AddressSpace {
    reservation: Reservation,
    page: usize,
}

impl AddressSpace {
    /// Reserves `len` bytes (a positive multiple of the page size) of
    /// address space, inaccessible and backed by nothing:
    /// `mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`.
    pub fn new(len: usize) -> Result<AddressSpace> {
        let page = page_size();
        if len == 0 || len % page != 0 {
            return Err(invalid(
                "reserve",
                SPACE,
                format!("{len} bytes is not a positive multiple of the page size {page}"),
            ));
        }
        let reservation = Reservation::new(len).map_err(|e| Error::io("reserve", Path::new(SPACE), e))?;
        Ok(AddressSpace { reservation, page })
    }

    /// Bytes reserved.
    pub fn len(&self) -> usize {
        self.reservation.len()
    }

    /// Always false: a reservation is never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The first address of the range. Reading or writing through it is
    /// `unsafe` and the caller's responsibility: see the module's
    /// soundness rules.
    pub fn as_ptr(&self) -> *const u8 {
        self.reservation.addr()
    }

    /// [`AddressSpace::as_ptr`], mutable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.reservation.addr()
    }

    /// Maps `len` bytes of `table` from `offset` at `at`, replacing what
    /// was bound there: one `mmap(MAP_SHARED | MAP_FIXED)` per extent the
    /// range touches. `at`, `offset` and `len` must be multiples of the
    /// page size, the range must lie inside the address space and the
    /// table, and each extent it touches must sit at a page-aligned file
    /// offset (anything else is [`ErrorKind::InvalidInput`], refused before
    /// any mapping changes). If the kernel refuses a mapping (`ENOMEM`
    /// when `vm.max_map_count` is reached), the range is left unbound.
    pub fn bind(
        &mut self,
        at: usize,
        table: &SegmentTable,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<()> {
        self.bind_many(table, &[BindOp { at, offset, len, access }])
    }

    /// Several binds in one call: all are checked first, then mapped in
    /// order (a later op replaces an earlier one where they overlap). On
    /// a refused op nothing changes; on a kernel error every range of the
    /// batch is left unbound.
    pub fn bind_many(&mut self, table: &SegmentTable, ops: &[BindOp]) -> Result<()> {
        self.bind_many_with(SegmentTable::locate, table, ops)
    }

    /// [`AddressSpace::bind_many`] with a choice of extent lookup (the
    /// linear walk is the baseline `dmaload-bench bind` compares with;
    /// feature `baselines`).
    #[cfg(feature = "baselines")]
    pub fn bind_many_using(&mut self, locate: Locate, table: &SegmentTable, ops: &[BindOp]) -> Result<()> {
        let lookup: LocateFn = match locate {
            Locate::BinarySearch => SegmentTable::locate,
            Locate::LinearWalk => SegmentTable::locate_linear,
        };
        self.bind_many_with(lookup, table, ops)
    }

    fn bind_many_with(&mut self, locate: LocateFn, table: &SegmentTable, ops: &[BindOp]) -> Result<()> {
        let mut pieces = Vec::with_capacity(ops.len());
        for (index, op) in ops.iter().enumerate() {
            self.plan(locate, table, op, &mut pieces).map_err(|e| {
                if ops.len() > 1 {
                    e.with_note(&format!(" (bind {index} of {})", ops.len()))
                } else {
                    e
                }
            })?;
        }
        for (done, piece) in pieces.iter().enumerate() {
            let fd = table.files[piece.file as usize].as_fd();
            if let Err(e) = self.reservation.map_file(piece.at, piece.len, fd, piece.offset, piece.prot) {
                // Leave nothing half-bound: back to the reservation.
                for undo in &pieces[..done] {
                    let _ = self.reservation.clear(undo.at, undo.len);
                }
                return Err(Error::io("bind", Path::new(SPACE), e).at(piece.at as u64));
            }
        }
        Ok(())
    }

    /// Checks that `at..at + len` is page-aligned and inside the space.
    fn check_range(&self, op: &'static str, at: usize, len: usize) -> Result<()> {
        let page = self.page;
        if at % page != 0 || len % page != 0 {
            return Err(invalid(
                op,
                SPACE,
                format!("range {at}+{len} is not aligned to the page size {page}"),
            )
            .at(at as u64));
        }
        if at.checked_add(len).map_or(true, |end| end > self.len()) {
            return Err(invalid(
                op,
                SPACE,
                format!("range {at}+{len} runs past the end of the {}-byte address space", self.len()),
            )
            .at(at as u64));
        }
        Ok(())
    }

    /// Splits one bind into per-extent pieces, checking everything.
    fn plan(
        &self,
        locate: LocateFn,
        table: &SegmentTable,
        op: &BindOp,
        pieces: &mut Vec<Piece>,
    ) -> Result<()> {
        self.check_range("bind", op.at, op.len)?;
        let page = self.page as u64;
        if op.offset % page != 0 {
            return Err(invalid(
                "bind",
                TABLE,
                format!("table offset {} is not aligned to the page size {page}", op.offset),
            )
            .at(op.offset));
        }
        if op.offset.checked_add(op.len as u64).map_or(true, |end| end > table.len()) {
            return Err(invalid(
                "bind",
                TABLE,
                format!("{} bytes at {} run past the table's {} bytes", op.len, op.offset, table.len()),
            )
            .at(op.offset));
        }
        if op.len == 0 {
            return Ok(());
        }
        let (mut index, mut within) = locate(table, op.offset).expect("offset checked");
        let mut done = 0usize;
        while done < op.len {
            let extent = table.extents[index];
            let n = ((extent.len - within) as usize).min(op.len - done);
            let file_offset = extent.offset + within;
            if file_offset % page != 0 || n as u64 % page != 0 {
                return Err(invalid(
                    "bind",
                    TABLE,
                    format!(
                        "extent {index} (file {} at {}, {} bytes) does not start and end on page \
                         boundaries where the bind needs it",
                        extent.file, extent.offset, extent.len
                    ),
                )
                .at(op.offset + done as u64));
            }
            pieces.push(Piece {
                at: op.at + done,
                len: n,
                file: extent.file,
                offset: file_offset,
                prot: op.access.into(),
            });
            done += n;
            index += 1;
            within = 0;
        }
        Ok(())
    }

    /// Returns `at..at + len` (page-aligned, inside the space) to the
    /// reservation: whatever was bound there is unmapped and the range is
    /// `PROT_NONE` again (one `mmap(MAP_FIXED | MAP_ANONYMOUS, PROT_NONE)`).
    pub fn unbind(&mut self, at: usize, len: usize) -> Result<()> {
        self.unbind_many(&[(at, len)])
    }

    /// Several unbinds of `(at, len)` ranges; all are checked before any is
    /// done.
    pub fn unbind_many(&mut self, ranges: &[(usize, usize)]) -> Result<()> {
        for &(at, len) in ranges {
            self.check_range("unbind", at, len)?;
        }
        for &(at, len) in ranges {
            self.reservation
                .clear(at, len)
                .map_err(|e| Error::io("unbind", Path::new(SPACE), e).at(at as u64))?;
        }
        Ok(())
    }

    fn check_copy(&self, op: &'static str, at: usize, len: usize) -> Result<()> {
        if at.checked_add(len).map_or(true, |end| end > self.len()) {
            return Err(invalid(
                op,
                SPACE,
                format!("{len} bytes at {at} run past the end of the {}-byte address space", self.len()),
            )
            .at(at as u64));
        }
        Ok(())
    }

    /// Copies `buf.len()` bytes at `at` out of the address space
    /// (`process_vm_readv(2)` on this process, Linux 3.2). Bytes that are
    /// not bound (or whose file was truncated) are an error (`EFAULT`),
    /// never a crash.
    pub fn read_at(&self, at: usize, buf: &mut [u8]) -> Result<()> {
        self.check_copy("read", at, buf.len())?;
        self.reservation.read(at, buf).map_err(|e| Error::io("read", Path::new(SPACE), e).at(at as u64))
    }

    /// Copies `buf` into the address space at `at` (`process_vm_writev(2)`),
    /// through to the backing files; bytes not bound writable are `EFAULT`.
    pub fn write_at(&self, at: usize, buf: &[u8]) -> Result<()> {
        self.check_copy("write", at, buf.len())?;
        self.reservation.write(at, buf).map_err(|e| Error::io("write", Path::new(SPACE), e).at(at as u64))
    }
}
