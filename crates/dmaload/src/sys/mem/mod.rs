//! Memory: memfd, mappings, populate, mincore.

use std::ffi::CStr;
use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use super::check;

mod fork;
mod maps;
mod residency;
mod seal;
mod shared;
mod unmap;
mod writer;

use fork::*;
use maps::*;
pub use residency::*;
pub use seal::*;
pub use shared::*;
pub use unmap::*;
pub use writer::*;

/// The system page size (`sysconf(_SC_PAGESIZE)`).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

/// Which pages a memfd holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemfdPages {
    /// shmem pages: 4 KiB, or 2 MiB where the shmem THP policy and the
    /// mapping's advice allow.
    Shmem,
    /// Pages of the hugetlb pool in the system's default huge page size
    /// (`MFD_HUGETLB`, Linux 4.14; sealing since 4.16).
    Hugetlb,
}

/// `memfd_create(2)` (Linux 3.17) with `MFD_CLOEXEC | MFD_ALLOW_SEALING`,
/// and `MFD_HUGETLB` for hugetlb pages.
pub fn memfd_create(name: &CStr, pages: MemfdPages) -> io::Result<OwnedFd> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if pages == MemfdPages::Hugetlb {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: `name` is a valid NUL-terminated string for the whole call.
    let fd = check(unsafe { libc::memfd_create(name.as_ptr(), flags) })?;
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether a mapping asks for transparent huge pages (`madvise`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePageAdvice {
    /// `MADV_HUGEPAGE` (Linux 2.6.38): 2 MiB pages where the THP policy
    /// allows advised mappings (`madvise` for anonymous memory, `advise`
    /// for shmem).
    Huge,
    /// `MADV_NOHUGEPAGE`: 4 KiB pages even where the policy is `always`.
    Small,
}

impl HugePageAdvice {
    fn flag(self) -> libc::c_int {
        match self {
            HugePageAdvice::Huge => libc::MADV_HUGEPAGE,
            HugePageAdvice::Small => libc::MADV_NOHUGEPAGE,
        }
    }
}

/// A region of virtual memory owned by this value and unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// The huge-page advice the kernel took for it, which
    /// [`Mapping::make_private`] gives the mapping that replaces it.
    advice: Option<HugePageAdvice>,
    /// Its entry in the fork registry, where [`Mapping::loading`] or
    /// [`Mapping::loaded`] put it: a fork leaves it out of the child, or
    /// makes it private first (see [`PRIVATE_ON_FORK`]).
    fork_entry: Option<u64>,
}

// SAFETY: a Mapping is plain memory; ownership can move between threads, and
// shared references only allow reads.
unsafe impl Send for Mapping {}
// SAFETY: see above; `&Mapping` hands out only `&[u8]`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `mmap(MAP_SHARED)` of `len` bytes of `fd` from offset 0, read-write.
    pub fn shared(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        Self::map(len, READ_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), Placement::HugeAligned)
    }

    /// [`Mapping::shared`] of a hugetlb memfd, placed by the kernel: it
    /// aligns hugetlb mappings to their page size (which may be 1 GiB).
    pub fn hugetlb(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        Self::map(len, READ_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), Placement::Kernel)
    }

    /// [`Mapping::shared`] of a shmem memfd with its page-size advice; a
    /// kernel without THP (EINVAL) just keeps small pages (callers that
    /// need huge ones check the THP policy first).
    pub fn memfd(fd: BorrowedFd<'_>, len: usize, advice: HugePageAdvice) -> io::Result<Mapping> {
        let mut map = Self::shared(fd, len)?;
        match map.advise(advice) {
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => Ok(map),
            other => other.map(|()| map),
        }
    }

    /// `mmap(MAP_PRIVATE)` of `len` bytes of `fd` from offset 0,
    /// read-write: the file's pages until this process writes one, then a
    /// private copy of that page (copy-on-write). Works on a memfd sealed
    /// with `F_SEAL_FUTURE_WRITE`, which refuses only shared writable maps.
    pub fn private(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        Self::map(len, READ_WRITE, libc::MAP_PRIVATE, fd.as_raw_fd(), Placement::HugeAligned)
    }

    /// Turns this mapping, which must be a `MAP_SHARED` mapping of `fd`
    /// from offset 0 (as [`Mapping::memfd`] and [`Mapping::hugetlb`]
    /// make), into a private copy-on-write one at the same address: the
    /// bytes read stay the same pages, while this process's later writes go
    /// to private copies instead of the file, which others may map. Slices
    /// of the mapping stay valid: their bytes do not change.
    ///
    /// The private mapping is made first, where the kernel chooses, then
    /// moved over this one (`mremap(MREMAP_FIXED)`), which replaces it in
    /// one step under the mmap lock. So where the private mapping cannot be
    /// had (ENOMEM where a private hugetlb mapping cannot reserve its pages
    /// in the pool) nothing here was touched, and on any failure the
    /// mapping is still the shared one. The huge-page advice this mapping
    /// was given is given to the private one before the move (advice is a
    /// property of the mapping, which mremap carries, not of the file), so
    /// its page faults keep asking for the same page size. Hugetlb memory
    /// needs Linux 5.16 (mremap of hugetlb mappings): before, it is
    /// `Unsupported`. Calls on one mapping must not overlap (a buffer's
    /// sharing lock orders them).
    ///
    /// A mapping registered with [`Mapping::loaded`] that a fork
    /// has already made private is left as it is (mapping it private again
    /// would drop this process's writes since).
    pub fn make_private(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        let Some(id) = self.fork_entry else { return self.remap_private(fd) };
        let mut registry = fork_registry();
        let Some(at) = registry.iter().position(|entry| entry.id == id) else {
            return Ok(()); // a fork made it private
        };
        self.remap_private(fd)?;
        registry.swap_remove(at);
        Ok(())
    }

    /// The remapping of [`Mapping::make_private`].
    fn remap_private(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        if crate::sys::file::filesystem_magic(fd)? == HUGETLBFS_MAGIC && !mremap_moves_hugetlb() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "making hugetlb memory private in place needs Linux 5.16 (mremap of hugetlb mappings)",
            ));
        }
        // A hugetlb one is aligned to its page size, as mremap needs.
        let mut private =
            Self::map(self.len, READ_WRITE, libc::MAP_PRIVATE, fd.as_raw_fd(), Placement::Kernel)?;
        if let Some(advice) = self.advice {
            private.advise(advice)?;
        }
        let Err(err) = private.move_over(self) else {
            return Ok(());
        };
        match self.after_failed_move(fd) {
            AfterFailedMove::Untouched | AfterFailedMove::MappedAgain => Err(err),
            AfterFailedMove::Lost(why) => {
                // The range holds another thread's mapping, or nothing: slices
                // of this one would read it and the drop would unmap it.
                eprintln!(
                    "dmaload: a failed remap ({err}) unmapped a buffer's memory and it could not be \
                     mapped back ({why}); aborting"
                );
                std::process::abort()
            }
        }
    }

    /// Moves this mapping (made by the caller, which nothing else refers
    /// to) over `dest`, same length, in place of `dest`'s. On failure it
    /// is unmapped here; `dest` may have been unmapped too (see
    /// [`Mapping::after_failed_move`]).
    fn move_over(self, dest: &Mapping) -> io::Result<()> {
        // SAFETY: the source is this value's own mapping, which no
        // reference reaches, and the destination is exactly the range
        // `dest` owns; `make_private` maps the same file from the same
        // offset as `dest`, so the same bytes appear at the same addresses
        // and references into `dest` stay valid. MREMAP_FIXED unmaps only
        // the destination, and swaps the mappings under the mmap lock, so
        // when it succeeds no access sees a hole.
        let moved = unsafe {
            libc::mremap(
                self.ptr.as_ptr().cast(),
                self.len,
                dest.len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                dest.ptr.as_ptr(),
            )
        };
        if moved == libc::MAP_FAILED {
            // Every failure leaves the source where it was: drop unmaps it.
            return Err(io::Error::last_os_error());
        }
        // The range left this address (another thread's mmap may take it
        // at once): it is `dest`'s now, and this value must not unmap it.
        std::mem::forget(self);
        Ok(())
    }

    /// What a failed [`Mapping::move_over`] onto this mapping, a shared
    /// mapping of `fd` from offset 0, left here. mremap unmaps its
    /// destination first and fails after that only for want of kernel
    /// memory or of commit charge (`vm.overcommit_memory` 2): that leaves
    /// a hole, which the shared mapping fills again at once, but which
    /// another thread's mmap may already have taken.
    fn after_failed_move(&self, fd: BorrowedFd<'_>) -> AfterFailedMove {
        // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing at all is
        // mapped in the range (EEXIST otherwise): into a hole the move
        // left, with the same pages the slices showed, never over anything.
        let ptr = unsafe {
            libc::mmap(
                self.ptr.as_ptr().cast(),
                self.len,
                READ_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == self.ptr.as_ptr().cast() {
            return AfterFailedMove::MappedAgain;
        }
        if ptr != libc::MAP_FAILED {
            // A kernel before 4.17 took the address as a hint and mapped
            // elsewhere: that mapping is this call's alone.
            // SAFETY: the mapping just made, which nothing refers to.
            unsafe { libc::munmap(ptr, self.len) };
        }
        match maps_file_from_start(self.address()..self.address() + self.len, fd) {
            Ok(true) => AfterFailedMove::Untouched,
            Ok(false) => AfterFailedMove::Lost("another mapping or none is there now".into()),
            Err(err) => AfterFailedMove::Lost(format!("/proc/self/maps cannot say what is there: {err}")),
        }
    }

    /// Private anonymous memory, asking for transparent huge pages or for
    /// 4 KiB pages whatever the THP policy (`MADV_HUGEPAGE` or
    /// `MADV_NOHUGEPAGE`, Linux 2.6.38).
    pub fn anonymous(len: usize, advice: HugePageAdvice) -> io::Result<Mapping> {
        let mut map =
            Self::map(len, READ_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, Placement::HugeAligned)?;
        map.advise(advice)?;
        Ok(map)
    }

    /// `madvise` with `advice` over the whole mapping, recorded once taken.
    fn advise(&mut self, advice: HugePageAdvice) -> io::Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the range is exactly this mapping; MADV_(NO)HUGEPAGE
        // changes how pages are allocated, not their contents.
        check(unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, advice.flag()) })?;
        self.advice = Some(advice);
        Ok(())
    }

    /// The address of the first byte, to find the mapping in
    /// `/proc/self/smaps`.
    pub fn address(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Unmaps the memory now, on this thread, leaving an empty mapping:
    /// where the unmapping must be over before going on (the pages are
    /// about to be sealed and shared), or to time what a drop would hand
    /// to the background thread.
    pub fn unmap_now(&mut self) {
        self.leave_fork_registry();
        unmap(Unmap { addr: self.ptr.as_ptr() as usize, len: self.len });
        self.ptr = NonNull::dangling();
        self.len = 0;
    }

    /// Maps `len` bytes with protection `prot` where `placement` says.
    /// Every public constructor maps read-write, as the slices assume; only
    /// [`HugePageCollapse`] maps read-only, and never hands the mapping out.
    fn map(
        len: usize,
        prot: libc::c_int,
        flags: libc::c_int,
        fd: libc::c_int,
        placement: Placement,
    ) -> io::Result<Mapping> {
        if len == 0 {
            // A zero-length mmap is EINVAL; an empty buffer needs no pages.
            return Ok(Mapping { ptr: NonNull::dangling(), len: 0, advice: None, fork_entry: None });
        }
        if placement == Placement::HugeAligned && len >= HUGE_PAGE_ALIGN {
            for _ in 0..ALIGNED_PLACEMENT_TRIES {
                if let Some(map) = Self::map_aligned(len, prot, flags, fd)? {
                    return Ok(map);
                }
            }
        }
        // SAFETY: addr NULL: the kernel chooses a fresh range, which
        // overlaps no memory Rust owns.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
        Self::from_mmap(ptr, len)
    }

    /// Maps `len` bytes at an address aligned to [`HUGE_PAGE_ALIGN`] that
    /// was free a moment before; `None` when another thread has mapped
    /// something there since, for the caller to try again.
    ///
    /// `MAP_FIXED_NOREPLACE` (Linux 4.17) maps only where nothing is
    /// mapped, so neither a success nor a failure touches anyone else's
    /// mapping, and a failure leaves nothing of this call's to unmap. A
    /// `MAP_FIXED` over a reservation of our own would not do: when the
    /// file's mmap refuses (a hugetlb reservation, a device's mmap), the
    /// kernel has already unmapped the range (Linux 6.18 too), another
    /// thread's mmap may take the hole, and no cleanup could tell ours
    /// from theirs. Older kernels ignore the flag and take the address as
    /// a hint: a mapping elsewhere is still this call's alone.
    fn map_aligned(
        len: usize,
        prot: libc::c_int,
        flags: libc::c_int,
        fd: libc::c_int,
    ) -> io::Result<Option<Mapping>> {
        let at = free_aligned_address(len, HUGE_PAGE_ALIGN)?;
        // SAFETY: MAP_FIXED_NOREPLACE maps at `at` only if nothing at all is
        // mapped in `at..at + len` (EEXIST otherwise), so it overlaps no
        // memory Rust or anyone else owns.
        let ptr = unsafe { libc::mmap(at, len, prot, flags | libc::MAP_FIXED_NOREPLACE, fd, 0) };
        match Self::from_mmap(ptr, len) {
            Err(err) if err.raw_os_error() == Some(libc::EEXIST) => Ok(None),
            other => other.map(Some),
        }
    }

    /// The mapping an `mmap` of `len` bytes returned, or its error.
    fn from_mmap(ptr: *mut libc::c_void, len: usize) -> io::Result<Mapping> {
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Mapping { ptr, len, advice: None, fork_entry: None })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is mapped readable for the life of self (or
        // dangling with len 0), and writes need `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A handle that lets the kernel (and several threads) write into the
    /// mapping while it is mutably borrowed.
    pub fn writer(&mut self) -> MappingWriter<'_> {
        MappingWriter { ptr: self.ptr, len: self.len, _borrow: PhantomData }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Before the range is unmapped: a fork must not remap it after.
        self.leave_fork_registry();
        if self.len >= BACKGROUND_UNMAP_MIN {
            if let Some(unmapper) = unmapper() {
                // Nothing can reach the region any more (this value owned it
                // and is going away), so the unmapper may take its time.
                unmapper.send(Unmap { addr: self.ptr.as_ptr() as usize, len: self.len });
                return;
            }
        }
        unmap(Unmap { addr: self.ptr.as_ptr() as usize, len: self.len });
    }
}

/// The protection of every mapping handed out: the slices read and write.
const READ_WRITE: libc::c_int = libc::PROT_READ | libc::PROT_WRITE;

/// Where a mapping of at least this size starts: the size of a PMD huge
/// page with 4 KiB base pages (x86-64, arm64).
pub const HUGE_PAGE_ALIGN: usize = 2 << 20;

/// What a failed move left at a mapping's address.
#[derive(Debug, PartialEq, Eq)]
enum AfterFailedMove {
    /// The mapping never left.
    Untouched,
    /// The move had unmapped it; it is mapped again, the same pages.
    MappedAgain,
    /// Something else is there now, or nothing, and why.
    Lost(String),
}

/// `statfs.f_type` of hugetlbfs, which hugetlb memfds live on.
const HUGETLBFS_MAGIC: i64 = 0x958458f6;

/// Whether mremap moves hugetlb mappings (Linux 5.16): before, it
/// refused them with EINVAL, and only after unmapping the destination.
fn mremap_moves_hugetlb() -> bool {
    crate::sys::process::kernel_version().map_or(true, |version| version >= (5, 16))
}

/// Where a new mapping goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Wherever the kernel chooses.
    Kernel,
    /// At an address aligned to [`HUGE_PAGE_ALIGN`] from that size up: a
    /// 2 MiB page of the file (a memfd collapsed into huge pages, say) is
    /// then mapped by one page-table entry instead of 512, which the kernel
    /// does only at an aligned address and, for a memfd under the shmem
    /// policy `never`, does not choose by itself.
    HugeAligned,
}

/// A memfd's whole 2 MiB pages, mapped read-only and shared (a sealed
/// memfd allows that) so that they can be rebuilt as 2 MiB pages, contents
/// kept (`MADV_COLLAPSE`, Linux 6.1), a window at a time. The kernel does
/// this whatever the shmem THP policy says, except `deny`; each 2 MiB is
/// copied into a new huge page, so it costs about a copy of the bytes plus
/// the huge pages' allocation. Processes that map the memfd afterwards at
/// an aligned address (as `Mapping::private` maps a received buffer) take
/// a fault per 2 MiB instead of one per 16 pages. The mapping holds the memfd's pages until
/// this value is dropped, which unmaps it at once.
pub struct HugePageCollapse {
    map: Mapping,
}

impl HugePageCollapse {
    /// Maps the whole 2 MiB pages of the first `len` bytes of `fd` (none
    /// when `len` is under 2 MiB).
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<HugePageCollapse> {
        let len = len / HUGE_PAGE_ALIGN * HUGE_PAGE_ALIGN;
        let map =
            Mapping::map(len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), Placement::HugeAligned)?;
        Ok(HugePageCollapse { map })
    }

    /// Bytes it covers: whole 2 MiB pages.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Whether it covers nothing (the file is under 2 MiB).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Collapses the 2 MiB pages of `range` (its start rounded down to a
    /// 2 MiB page, its end cut at [`HugePageCollapse::len`]). Fails with
    /// `EINVAL` where the kernel cannot (older, without THP, or `deny`),
    /// `EAGAIN` where a page was in use or no huge page was free, `ENOMEM`
    /// where none could be had; whatever collapsed by then stays collapsed.
    pub fn collapse(&self, range: Range<usize>) -> io::Result<()> {
        let start = range.start / HUGE_PAGE_ALIGN * HUGE_PAGE_ALIGN;
        let end = range.end.min(self.len());
        if start >= end {
            return Ok(());
        }
        let at = self.map.ptr.as_ptr().wrapping_add(start);
        // SAFETY: `at..at + end - start` lies within `map`, which no
        // reference reaches (it never leaves this value); collapsing keeps
        // the bytes the file holds.
        check(unsafe { libc::madvise(at.cast(), end - start, libc::MADV_COLLAPSE) }).map(drop)
    }
}

impl Drop for HugePageCollapse {
    fn drop(&mut self) {
        // Not on the background thread: a file dropped from a cache gives
        // its memory back as soon as nothing maps it.
        self.map.unmap_now();
    }
}

/// How many aligned addresses [`Mapping::map`] tries before it lets the
/// kernel choose: each is lost only to another thread's mmap in between.
const ALIGNED_PLACEMENT_TRIES: usize = 3;

/// An address aligned to `align` where `len` bytes of address space were
/// free: a reservation of `len + align` bytes (`PROT_NONE`, no memory)
/// made and given back at once, for a `MAP_FIXED_NOREPLACE` mapping.
fn free_aligned_address(len: usize, align: usize) -> io::Result<*mut libc::c_void> {
    let span = len.checked_add(align).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
    // SAFETY: a fresh reservation chosen by the kernel (addr NULL), with no
    // access: it overlaps nothing and nothing can touch it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the reservation just made, which nothing refers to.
    unsafe { libc::munmap(base, span) };
    Ok((base as usize).next_multiple_of(align) as *mut libc::c_void)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn mappings_of_2_mib_or_more_start_aligned_and_a_collapse_keeps_the_bytes() {
        let len = 3 * HUGE_PAGE_ALIGN + page_size();
        let memfd = memfd_create(c"test", MemfdPages::Shmem).unwrap();
        set_len(memfd.as_fd(), len as u64).unwrap();
        // Placement is best effort: another test thread's mmap can take the
        // free address before each of a mapping's tries (it happened once
        // in the parallel suite), so one of a few mappings must be aligned.
        let mut writer = (0..5)
            .map(|_| Mapping::shared(memfd.as_fd(), len).unwrap())
            .find(|mapping| mapping.address() % HUGE_PAGE_ALIGN == 0)
            .expect("none of 5 mappings of 2 MiB or more started 2 MiB-aligned");
        for (i, byte) in writer.as_mut_slice().iter_mut().enumerate() {
            *byte = (i % 253) as u8;
        }
        drop(writer);
        let small = Mapping::private(memfd.as_fd(), page_size()).unwrap();
        assert_eq!(small.as_slice()[1], 1);
        // EINVAL: an older kernel, no THP or shmem_enabled deny; EAGAIN: a
        // page was busy. The bytes must be the same either way. Two
        // windows: the second starts inside the first's last 2 MiB page.
        let collapse = HugePageCollapse::map(memfd.as_fd(), len).unwrap();
        assert_eq!(collapse.len(), 3 * HUGE_PAGE_ALIGN);
        let collapsed = collapse
            .collapse(0..HUGE_PAGE_ALIGN)
            .and_then(|()| collapse.collapse(HUGE_PAGE_ALIGN + 1..len))
            .inspect_err(|err| println!("SKIP collapse: {err}"));
        drop(collapse);
        let reader = Mapping::private(memfd.as_fd(), len).unwrap();
        assert_eq!(reader.address() % HUGE_PAGE_ALIGN, 0);
        assert!(reader.as_slice().iter().enumerate().all(|(i, &b)| b == (i % 253) as u8));
        if collapsed.is_ok() {
            // Read through, each whole 2 MiB is one huge mapping; the last
            // page past them stays small.
            let huge = crate::memory::huge_page_bytes(reader.address(), len).unwrap();
            assert_eq!(huge, 3 * HUGE_PAGE_ALIGN as u64);
        }
        // Not past the whole 2 MiB pages: nothing to collapse.
        let none = HugePageCollapse::map(memfd.as_fd(), HUGE_PAGE_ALIGN - 1).unwrap();
        assert_eq!(none.len(), 0);
        none.collapse(0..len).unwrap();
    }

    #[test]
    fn a_failed_aligned_mapping_never_unmaps_what_another_thread_mapped() {
        // A TCP socket's mmap refuses a writable mapping (EPERM) only after
        // the kernel has cleared the range for it: a MAP_FIXED placement
        // fails leaving a hole there, which another thread's mmap may fill
        // before the failing call cleans up.
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let len = 2 * HUGE_PAGE_ALIGN;
        let (lost, failures) = race_a_neighbour(len, |_| {
            match Mapping::map(len, READ_WRITE, libc::MAP_SHARED, socket.as_raw_fd(), Placement::HugeAligned)
            {
                Err(err) if err.raw_os_error() == Some(libc::EPERM) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        });
        let failures = failures.expect("a writable mapping of a TCP socket fails with EPERM");
        assert_eq!(lost, 0, "{failures} failed mappings unmapped {lost} of another thread's");
    }

    /// Calls `attempt`, a call that must fail without touching memory it
    /// does not own, for 1.5 s while a neighbour thread keeps mapping `len`
    /// bytes near the address `attempt` stores (a hint, which the kernel
    /// follows only where the range is free; none while it is 0) and checks
    /// each mapping is still there. Returns the neighbour's mappings lost,
    /// and the failures seen or how one went wrong.
    fn race_a_neighbour(
        len: usize,
        mut attempt: impl FnMut(&std::sync::atomic::AtomicUsize) -> Result<(), String>,
    ) -> (usize, Result<usize, String>) {
        use std::sync::atomic::Ordering::Relaxed;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let near = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            let neighbour = scope.spawn(|| {
                let mut lost = 0;
                while !stop.load(Relaxed) {
                    let hint = near.load(Relaxed) as *mut libc::c_void;
                    // SAFETY: without MAP_FIXED the address is only a hint:
                    // the kernel maps a fresh range, which overlaps nothing.
                    let ptr = unsafe { libc::mmap(hint, len, READ_WRITE, ANONYMOUS, -1, 0) };
                    let map = Mapping::from_mmap(ptr, len).unwrap();
                    std::thread::yield_now();
                    if !still_mapped(&map) {
                        lost += 1;
                        // Whatever holds the range now is not this value's.
                        std::mem::forget(map);
                    }
                }
                lost
            });
            let started = std::time::Instant::now();
            let mut failures = Ok(0);
            while let Ok(count) = failures {
                if started.elapsed() >= std::time::Duration::from_millis(1500) {
                    break;
                }
                failures = attempt(&near).map(|()| count + 1);
            }
            // Before any assertion: the scope waits for the neighbour.
            stop.store(true, Relaxed);
            (neighbour.join().unwrap(), failures)
        })
    }

    /// A memfd of `len` bytes holding `i % 251` at byte `i`, and its
    /// shared mapping.
    fn patterned_memfd(pages: MemfdPages, len: usize) -> io::Result<(OwnedFd, Mapping)> {
        let memfd = memfd_create(c"test", pages)?;
        set_len(memfd.as_fd(), len as u64)?;
        let mut map = match pages {
            MemfdPages::Shmem => Mapping::memfd(memfd.as_fd(), len, HugePageAdvice::Small)?,
            MemfdPages::Hugetlb => Mapping::hugetlb(memfd.as_fd(), len)?,
        };
        for (i, byte) in map.as_mut_slice().iter_mut().enumerate() {
            *byte = (i % 251) as u8;
        }
        Ok((memfd, map))
    }

    /// Whether `map` is a shared mapping of `memfd` from offset 0.
    fn maps_memfd(map: &Mapping, memfd: &OwnedFd) -> bool {
        maps_file_from_start(map.address()..map.address() + map.len(), memfd.as_fd()).unwrap()
    }

    /// Checks a mapping [`Mapping::make_private`] turned private: same
    /// address and bytes, no longer the shared mapping, and writes stay in
    /// it while the file keeps its bytes.
    fn assert_private_copy(mut map: Mapping, memfd: &OwnedFd, address: usize) {
        assert_eq!(map.address(), address);
        assert!(map.as_slice().iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        assert!(!maps_memfd(&map, memfd), "still the shared mapping");
        let last = map.len() - 1;
        map.as_mut_slice()[0] = 0xEE;
        map.as_mut_slice()[last] = 0xEE;
        let file = Mapping::shared(memfd.as_fd(), map.len()).unwrap();
        assert_eq!((file.as_slice()[0], file.as_slice()[last]), (0, (last % 251) as u8));
        assert_eq!((map.as_slice()[0], map.as_slice()[1]), (0xEE, 1));
    }

    #[test]
    fn make_private_gives_a_copy_on_write_mapping_of_the_same_bytes_in_place() {
        let len = 2 * HUGE_PAGE_ALIGN + 3 * page_size();
        let (memfd, map) = patterned_memfd(MemfdPages::Shmem, len).unwrap();
        assert!(maps_memfd(&map, &memfd));
        let address = map.address();
        map.make_private(memfd.as_fd()).unwrap();
        assert_private_copy(map, &memfd, address);
    }

    /// The `VmFlags` of the mapping that holds `address` (`hg`:
    /// `MADV_HUGEPAGE`, `nh`: `MADV_NOHUGEPAGE`), from /proc/self/smaps.
    fn vm_flags(address: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut holds = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or_default();
            if let Some((start, end)) = first.split_once('-') {
                let bound = |hex| usize::from_str_radix(hex, 16).unwrap();
                holds = (bound(start)..bound(end)).contains(&address);
            } else if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| holds) {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("no mapping holds {address:#x} in /proc/self/smaps")
    }

    #[test]
    fn advice_for_a_range_changes_only_the_pages_under_it() {
        let len = 4 * HUGE_PAGE_ALIGN;
        let mut map = Mapping::anonymous(len, HugePageAdvice::Huge).unwrap();
        if map.advice.is_none() {
            println!("SKIP advice_for_a_range_changes_only_the_pages_under_it: a kernel without THP took no advice");
            return;
        }
        let address = map.address();
        // From inside the second huge page on: the range widens to whole pages.
        map.writer().advise(HUGE_PAGE_ALIGN + 1..len, HugePageAdvice::Small).unwrap();
        let has = |at: usize, flag: &str| vm_flags(address + at).iter().any(|f| f == flag);
        assert!(has(0, "hg") && !has(0, "nh"), "the first page keeps its advice");
        assert!(has(HUGE_PAGE_ALIGN, "nh") && has(len - 1, "nh"));
        assert!(!has(HUGE_PAGE_ALIGN, "hg"));
    }

    #[test]
    fn make_private_keeps_the_huge_page_advice_and_adds_none() {
        let len = 2 * HUGE_PAGE_ALIGN;
        let mut advised = Vec::new();
        for advice in [Some(HugePageAdvice::Huge), Some(HugePageAdvice::Small), None] {
            let memfd = memfd_create(c"test", MemfdPages::Shmem).unwrap();
            set_len(memfd.as_fd(), len as u64).unwrap();
            let map = match advice {
                Some(advice) => Mapping::memfd(memfd.as_fd(), len, advice).unwrap(),
                None => Mapping::shared(memfd.as_fd(), len).unwrap(),
            };
            if advice.is_some() && map.advice.is_none() {
                println!("SKIP make_private_keeps_the_huge_page_advice: a kernel without THP took no advice");
                return;
            }
            let advice_flags = |address| {
                let flags = vm_flags(address);
                ["hg", "nh"].into_iter().filter(|f| flags.iter().any(|g| g == f)).collect::<Vec<_>>()
            };
            let before = advice_flags(map.address());
            map.make_private(memfd.as_fd()).unwrap();
            assert!(!maps_memfd(&map, &memfd), "still the shared mapping");
            assert_eq!(advice_flags(map.address()), before, "{advice:?}");
            advised.push(before);
        }
        assert_eq!(advised, [vec!["hg"], vec!["nh"], vec![]]);
    }

    #[test]
    fn hugetlb_memory_is_made_private_in_place_or_stays_shared() {
        const TEST: &str = "hugetlb_memory_is_made_private_in_place_or_stays_shared";
        let len = 2 * HUGE_PAGE_ALIGN;
        let (memfd, map) = match patterned_memfd(MemfdPages::Hugetlb, len) {
            Ok(made) => made,
            Err(err) => return println!("SKIP {TEST}: no hugetlb memory ({err})"),
        };
        let address = map.address();
        match map.make_private(memfd.as_fd()) {
            Ok(()) => assert_private_copy(map, &memfd, address),
            // The private mapping reserves pages of its own in the pool.
            Err(err) if err.raw_os_error() == Some(libc::ENOMEM) => {
                assert!(maps_memfd(&map, &memfd), "{err}, and the shared mapping left");
                assert!(map.as_slice().iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
                println!("SKIP {TEST}: the pool has no room for the private copy ({err}): it stayed shared");
            }
            Err(err) if err.kind() == io::ErrorKind::Unsupported => {
                assert!(maps_memfd(&map, &memfd));
                println!("SKIP {TEST}: {err}");
            }
            Err(err) => panic!("{err}"),
        }
    }

    #[test]
    fn after_a_failed_move_the_shared_mapping_is_found_put_back_or_reported_lost() {
        let len = 4 * page_size();
        let (memfd, map) = patterned_memfd(MemfdPages::Shmem, len).unwrap();
        assert_eq!(map.after_failed_move(memfd.as_fd()), AfterFailedMove::Untouched);
        // mremap unmapped the destination, then failed: mapped again.
        // SAFETY: the range is `map`'s, which nothing reads until it is
        // mapped again.
        unsafe { libc::munmap(map.ptr.as_ptr().cast(), len) };
        assert_eq!(map.after_failed_move(memfd.as_fd()), AfterFailedMove::MappedAgain);
        assert!(maps_memfd(&map, &memfd));
        assert!(map.as_slice().iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        // ... and another mapping took the hole: a private one of the same
        // file, or anonymous memory.
        for (flags, fd) in [(libc::MAP_PRIVATE, memfd.as_raw_fd()), (ANONYMOUS, -1)] {
            let at = map.ptr.as_ptr().cast();
            // SAFETY: `map`'s range, which nothing reads while it holds the
            // test's stand-in for another thread's mapping.
            let taken = unsafe { libc::mmap(at, len, READ_WRITE, flags | libc::MAP_FIXED, fd, 0) };
            assert_eq!(taken, at);
            assert!(matches!(map.after_failed_move(memfd.as_fd()), AfterFailedMove::Lost(_)));
        }
    }

    #[test]
    fn a_failed_make_private_never_leaves_the_buffer_over_another_threads_memory() {
        const TEST: &str = "a_failed_make_private_never_leaves_the_buffer_over_another_threads_memory";
        // A BPF array map made mmapable maps only shared: its mmap refuses
        // a private mapping (EINVAL), and does so after the kernel has
        // cleared the range for it (Linux 6.18 too), so switching in place
        // with MAP_FIXED fails leaving a hole under the buffer, which
        // another thread's mmap may fill before the shared mapping is put
        // back. (Not a perf ring, which fails the same way: on 6.18 each
        // failed switch leaves the ring's pages counted against the user's
        // RLIMIT_MEMLOCK for good.)
        let array = match mmapable_bpf_array() {
            Ok(array) => array,
            Err(err) => return println!("SKIP {TEST}: BPF_MAP_CREATE refused: {err}"),
        };
        let len = 2 * page_size();
        let fd = array.as_raw_fd();
        let _array_map = match Mapping::map(len, READ_WRITE, libc::MAP_SHARED, fd, Placement::Kernel) {
            Ok(shared) => shared,
            Err(err) => return println!("SKIP {TEST}: a BPF array cannot be mapped: {err}"),
        };
        let (lost, failures) = race_a_neighbour(len, |near| {
            let shared = Mapping::map(len, READ_WRITE, libc::MAP_SHARED, fd, Placement::Kernel).unwrap();
            // The neighbour maps there next, taking any hole at once.
            near.store(shared.address(), std::sync::atomic::Ordering::Relaxed);
            match shared.make_private(array.as_fd()) {
                Err(_) if still_mapped(&shared) => Ok(()),
                Err(err) => Err(format!("{err}, and the buffer is no longer mapped")),
                Ok(()) => Err("a BPF array was mapped private".to_owned()),
            }
        });
        let failures = failures.unwrap();
        assert_eq!(
            lost, 0,
            "{failures} failed switches to private unmapped {lost} of another thread's mappings"
        );
    }

    /// A BPF array map of two pages' worth of values that can be mapped
    /// (`BPF_F_MMAPABLE`); root or CAP_BPF may create one.
    fn mmapable_bpf_array() -> io::Result<OwnedFd> {
        /// The `BPF_MAP_CREATE` part of `union bpf_attr`, zero past it.
        #[repr(C)]
        struct MapCreate {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
            rest: [u32; 27],
        }
        let attr = MapCreate {
            map_type: 2, // BPF_MAP_TYPE_ARRAY
            key_size: 4,
            value_size: page_size() as u32,
            max_entries: 2,
            map_flags: 1 << 10, // BPF_F_MMAPABLE
            rest: [0; 27],
        };
        // SAFETY: `attr` is a zero-padded bpf_attr of the size passed, read
        // during the call; cmd 0 is BPF_MAP_CREATE, which returns a new fd.
        let fd = unsafe {
            libc::syscall(libc::SYS_bpf, 0, &attr as *const MapCreate, std::mem::size_of::<MapCreate>())
        };
        let fd = check(fd as libc::c_int)?;
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    const ANONYMOUS: libc::c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;

    /// Whether every page of `map` is still mapped (`mincore` fails with
    /// ENOMEM over a hole).
    fn still_mapped(map: &Mapping) -> bool {
        let mut vec = vec![0u8; map.len().div_ceil(page_size())];
        // SAFETY: mincore only reads the page tables of the range and
        // writes one byte per page into `vec`, which has that many.
        let ret = unsafe { libc::mincore(map.ptr.as_ptr().cast(), map.len(), vec.as_mut_ptr()) };
        ret == 0
    }

    #[test]
    fn the_populate_fallback_keeps_what_the_pages_hold() {
        let page = page_size();
        let mut map = Mapping::anonymous(4 * page, HugePageAdvice::Small).unwrap();
        for (i, byte) in map.as_mut_slice().iter_mut().enumerate().take(3 * page) {
            *byte = (i % 251) as u8 + 1;
        }
        map.writer().touch_pages(0..4 * page);
        let bytes = map.as_slice();
        assert!(bytes[..3 * page].iter().enumerate().all(|(i, &b)| b == (i % 251) as u8 + 1));
        assert!(bytes[3 * page..].iter().all(|&b| b == 0));
    }

    #[test]
    fn populating_bytes_keeps_them_and_skips_partial_pages() {
        let page = page_size();
        let mut map = Mapping::anonymous(8 * page, HugePageAdvice::Small).unwrap();
        let bytes = map.as_mut_slice();
        for (i, byte) in bytes.iter_mut().enumerate().take(5 * page) {
            *byte = (i % 251) as u8 + 1;
        }
        // Unaligned both ends, and a slice inside one page: nothing to do.
        RawBytesMut::from(&mut bytes[page / 2..7 * page + 3]).populate().unwrap();
        RawBytesMut::from(&mut bytes[10..20]).populate().unwrap();
        assert!(bytes[..5 * page].iter().enumerate().all(|(i, &b)| b == (i % 251) as u8 + 1));
        assert!(bytes[5 * page..].iter().all(|&b| b == 0));
        let (resident, pages) = page_cache_residency_of_anonymous(bytes);
        assert!(resident >= 6 && pages == 8, "{resident} of {pages} pages resident");
    }

    #[test]
    fn memory_is_resident_only_once_every_page_is_and_populating_it_again_keeps_its_bytes() {
        let page = page_size();
        let mut map = Mapping::anonymous(4 * page, HugePageAdvice::Small).unwrap();
        assert!(!map.writer().resident(&(0..4 * page)));
        map.as_mut_slice()[page] = 7;
        assert!(map.writer().resident(&(page..page + 1)));
        assert!(!map.writer().resident(&(0..2 * page)), "the first page was never touched");
        assert!(!map.writer().resident(&(page..3 * page)), "the third page was never touched");
        map.writer().populate(0..4 * page).unwrap();
        assert!(map.writer().resident(&(0..4 * page)));
        // Resident already: left alone, and the bytes stay.
        map.writer().populate(0..4 * page).unwrap();
        assert_eq!(map.as_slice()[page], 7);
        assert_eq!(page_cache_residency_of_anonymous(map.as_slice()), (4, 4));
    }

    /// Resident pages of anonymous memory (`mincore`), for the test above.
    fn page_cache_residency_of_anonymous(bytes: &[u8]) -> (usize, usize) {
        let pages = bytes.len().div_ceil(page_size());
        let mut vec = vec![0u8; pages];
        // SAFETY: `bytes` is a page-aligned mapping (a whole Mapping) of
        // `pages` pages; `vec` has one byte per page.
        let ret =
            unsafe { libc::mincore(bytes.as_ptr() as *mut libc::c_void, bytes.len(), vec.as_mut_ptr()) };
        assert_eq!(ret, 0);
        (vec.iter().filter(|&&v| v & 1 == 1).count(), pages)
    }
}
