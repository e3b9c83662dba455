//! io_uring (Linux 5.1) reads into a mapping, with optional registered
//! ("fixed") buffers in a sparse table (Linux 5.19).

use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use io_uring::{opcode, register, types, IoUring};

use super::mem::MappingWriter;

/// One finished request: the caller's tag and the kernel's result (bytes
/// read, or a negative errno).
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    pub tag: u64,
    pub result: i32,
}

/// An io_uring instance whose reads all land in one mapping.
///
/// It borrows the mapping's writer for its whole life and drains every
/// in-flight request before it is dropped, so the kernel never writes into
/// memory that has been unmapped or handed to Rust code.
pub struct Ring<'m> {
    ring: IoUring,
    dst: MappingWriter<'m>,
    in_flight: usize,
}

impl<'m> Ring<'m> {
    /// `io_uring_setup(2)`. Asks for cooperative task-run mode (Linux 5.19)
    /// and falls back to a plain ring on older kernels. Not single-issuer:
    /// a [`Registrar`] registers buffers from another thread.
    /// ENOSYS or EPERM here means io_uring is unavailable to this process
    /// (old kernel, `kernel.io_uring_disabled`, or a seccomp filter).
    pub fn new(entries: u32, dst: MappingWriter<'m>) -> io::Result<Self> {
        let ring = match IoUring::builder().setup_coop_taskrun().build(entries) {
            Ok(ring) => ring,
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
            Err(err) => return Err(err),
        };
        Ok(Ring { ring, dst, in_flight: 0 })
    }

    /// Creates an empty table of `slots` registered buffers
    /// (`IORING_REGISTER_BUFFERS2` with the sparse flag, Linux 5.19).
    pub fn register_slots(&mut self, slots: u32) -> io::Result<()> {
        self.ring.submitter().register_buffers_sparse(slots)
    }

    /// A handle that registers buffers of this ring from another thread.
    pub fn registrar(&self) -> io::Result<Registrar<'m>> {
        let fd = self.ring.as_raw_fd();
        // SAFETY: `fd` is this ring's open fd for the duration of the call.
        let ring_fd = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
        Ok(Registrar { ring_fd, dst: self.dst })
    }

    /// Empties `slot`, unpinning its pages once no request uses them.
    pub fn unregister(&mut self, slot: u32) -> io::Result<()> {
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        // SAFETY: an empty iovec clears the slot; nothing is pinned.
        unsafe { self.ring.submitter().register_buffers_update(slot, &[empty], None) }
    }

    /// Queues a read of `range.len()` bytes at file `offset` into `range` of
    /// the mapping, through registered buffer `slot` (which must hold the
    /// whole range) when given. Submits first when the queue is full.
    pub fn queue_read(
        &mut self,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
        offset: u64,
        slot: Option<u16>,
        rw_flags: i32,
        tag: u64,
    ) -> io::Result<()> {
        let (ptr, len) = self.dst.raw_range(&range);
        let len = u32::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let fd = types::Fd(fd.as_raw_fd());
        let entry = match slot {
            Some(index) => {
                opcode::ReadFixed::new(fd, ptr, len, index).offset(offset).rw_flags(rw_flags).build()
            }
            None => opcode::Read::new(fd, ptr, len).offset(offset).rw_flags(rw_flags).build(),
        }
        .user_data(tag);
        if self.ring.submission().is_full() {
            self.submit(0)?;
        }
        // SAFETY: the target range is inside the mapping kept alive by 'm;
        // `Drop` waits for this request before the borrow can end. The file
        // is referenced by the kernel from submission on, so `fd` may close.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full after submit"))?;
        self.in_flight += 1;
        Ok(())
    }

    /// Requests queued or running in the kernel.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Submits queued requests and waits until at least `want` completions
    /// are ready (0: just submit). Retries on EINTR.
    pub fn submit(&mut self, want: usize) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(want.min(self.in_flight)) {
                Ok(_) => return Ok(()),
                Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
                Err(err) if err.raw_os_error() == Some(libc::EBUSY) && want > 0 => {
                    // The completion queue is full: the caller must reap first.
                    return Ok(());
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Moves the ready completions into `out`.
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        let before = out.len();
        out.extend(
            self.ring.completion().map(|cqe| Completion { tag: cqe.user_data(), result: cqe.result() }),
        );
        self.in_flight -= out.len() - before;
    }
}

impl Drop for Ring<'_> {
    fn drop(&mut self) {
        // In-flight reads still target the mapping: wait for all of them.
        let mut sink = Vec::new();
        while self.in_flight > 0 {
            if let Err(err) = self.submit(1) {
                // Returning now would let the kernel write into memory that
                // is about to be freed; there is no safe way on.
                eprintln!("dmaload: io_uring wait failed with requests in flight: {err}");
                std::process::abort();
            }
            sink.clear();
            self.reap(&mut sink);
        }
    }
}

/// Registers ranges of a ring's mapping as fixed buffers, from any thread
/// (`io_uring_register(2)` on a duplicate of the ring fd).
pub struct Registrar<'m> {
    ring_fd: OwnedFd,
    dst: MappingWriter<'m>,
}

/// `struct io_uring_rsrc_update2` of the io_uring uAPI.
#[repr(C)]
struct RsrcUpdate2 {
    offset: u32,
    resv: u32,
    data: u64,
    tags: u64,
    nr: u32,
    resv2: u32,
}

const IORING_REGISTER_BUFFERS_UPDATE: libc::c_uint = 16;

impl Registrar<'_> {
    /// Registers `range` of the mapping in `slot`, pinning its pages
    /// (`IORING_REGISTER_BUFFERS_UPDATE`, Linux 5.13). Pinned pages count
    /// against RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK; ENOMEM
    /// means the limit is too low. A registered buffer is at most 1 GiB.
    pub fn register(&self, slot: u32, range: Range<usize>) -> io::Result<()> {
        let iov = self.dst.iovec(&range);
        let update = RsrcUpdate2 {
            offset: slot,
            resv: 0,
            data: &iov as *const libc::iovec as u64,
            tags: 0,
            nr: 1,
            resv2: 0,
        };
        // SAFETY: `update` and the iovec it points to live across the call.
        // The iovec lies inside the mapping, which stays mapped for 'm; the
        // kernel pins the pages, so they stay valid for as long as the
        // registration does, even past the ring.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                self.ring_fd.as_raw_fd(),
                IORING_REGISTER_BUFFERS_UPDATE,
                &update as *const RsrcUpdate2,
                std::mem::size_of::<RsrcUpdate2>() as libc::c_uint,
            )
        };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// What this kernel's io_uring offers, for `dmaload info`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct UringProbe {
    /// (opcode name, supported) for the opcodes dmaload uses.
    pub opcodes: Vec<(&'static str, bool)>,
    /// Whether a sparse registered-buffer table could be created.
    pub sparse_buffers: Result<(), String>,
}

/// Creates a small ring and asks it which opcodes it supports
/// (`IORING_REGISTER_PROBE`, Linux 5.6).
pub fn probe() -> io::Result<UringProbe> {
    let ring = IoUring::new(2)?;
    let mut probe = register::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    let opcodes = vec![
        ("READ", probe.is_supported(opcode::Read::CODE)),
        ("READ_FIXED", probe.is_supported(opcode::ReadFixed::CODE)),
        ("WRITE", probe.is_supported(opcode::Write::CODE)),
        ("WRITE_FIXED", probe.is_supported(opcode::WriteFixed::CODE)),
        ("FSYNC", probe.is_supported(opcode::Fsync::CODE)),
    ];
    let sparse_buffers = ring.submitter().register_buffers_sparse(1).map_err(|e| e.to_string());
    Ok(UringProbe { opcodes, sparse_buffers })
}

/// An io_uring instance whose writes all come from one borrowed byte slice
/// (the write direction of [`Ring`]).
///
/// The kernel only reads the slice, which the shared borrow keeps alive and
/// unchanged; every in-flight request is drained before the ring drops, so
/// none outlives the borrow.
pub struct WriteRing<'s> {
    ring: IoUring,
    src: &'s [u8],
    in_flight: usize,
}

impl<'s> WriteRing<'s> {
    /// `io_uring_setup(2)` (Linux 5.1), cooperative task-run mode where the
    /// kernel has it (5.19).
    pub fn new(entries: u32, src: &'s [u8]) -> io::Result<Self> {
        let ring = match IoUring::builder().setup_coop_taskrun().build(entries) {
            Ok(ring) => ring,
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
            Err(err) => return Err(err),
        };
        Ok(WriteRing { ring, src, in_flight: 0 })
    }

    fn raw_range(&self, range: &Range<usize>) -> (*const u8, usize) {
        // Ranges come from the caller's plan: out of range is a bug.
        let bytes = &self.src[range.clone()];
        (bytes.as_ptr(), bytes.len())
    }

    /// A sparse table of `slots` registered buffers (Linux 5.19).
    pub fn register_slots(&mut self, slots: u32) -> io::Result<()> {
        self.ring.submitter().register_buffers_sparse(slots)
    }

    /// Empties `slot`, unpinning its pages once no request uses them.
    pub fn unregister(&mut self, slot: u32) -> io::Result<()> {
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        // SAFETY: an empty iovec clears the slot; nothing is pinned.
        unsafe { self.ring.submitter().register_buffers_update(slot, &[empty], None) }
    }

    /// A handle that registers ranges of the slice from another thread, so
    /// pinning runs beside the writes instead of between them.
    pub fn registrar(&self) -> io::Result<SliceRegistrar<'s>> {
        let fd = self.ring.as_raw_fd();
        // SAFETY: `fd` is this ring's open fd for the duration of the call.
        let ring_fd = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
        Ok(SliceRegistrar { ring_fd, src: self.src })
    }

    /// Queues a write of `range` of the slice at file `offset`, through
    /// registered buffer `slot` (which must hold the whole range) when given.
    pub fn queue_write(
        &mut self,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
        offset: u64,
        slot: Option<u16>,
        tag: u64,
    ) -> io::Result<()> {
        let (ptr, len) = self.raw_range(&range);
        let len = u32::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let fd = types::Fd(fd.as_raw_fd());
        let entry = match slot {
            Some(index) => opcode::WriteFixed::new(fd, ptr, len, index).offset(offset).build(),
            None => opcode::Write::new(fd, ptr, len).offset(offset).build(),
        }
        .user_data(tag);
        if self.ring.submission().is_full() {
            self.submit(0)?;
        }
        // SAFETY: the source range is inside `src`, alive and unchanged for
        // 's; `Drop` waits for this request before the borrow can end.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full after submit"))?;
        self.in_flight += 1;
        Ok(())
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Submits queued requests and waits for at least `want` completions
    /// (0: just submit). Retries on EINTR.
    pub fn submit(&mut self, want: usize) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(want.min(self.in_flight)) {
                Ok(_) => return Ok(()),
                Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
                Err(err) if err.raw_os_error() == Some(libc::EBUSY) && want > 0 => return Ok(()),
                Err(err) => return Err(err),
            }
        }
    }

    /// Moves the ready completions into `out`.
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        let before = out.len();
        out.extend(
            self.ring.completion().map(|cqe| Completion { tag: cqe.user_data(), result: cqe.result() }),
        );
        self.in_flight -= out.len() - before;
    }
}

impl Drop for WriteRing<'_> {
    fn drop(&mut self) {
        // In-flight writes still read `src`: wait for all of them.
        let mut sink = Vec::new();
        while self.in_flight > 0 {
            if let Err(err) = self.submit(1) {
                eprintln!("dmaload: io_uring wait failed with writes in flight: {err}");
                std::process::abort();
            }
            sink.clear();
            self.reap(&mut sink);
        }
    }
}

/// Registers ranges of a [`WriteRing`]'s source slice as fixed buffers from
/// any thread (`io_uring_register(2)` on a duplicate of the ring fd).
pub struct SliceRegistrar<'s> {
    ring_fd: OwnedFd,
    src: &'s [u8],
}

impl SliceRegistrar<'_> {
    /// Registers `range` of the slice in `slot`, pinning its pages
    /// (`IORING_REGISTER_BUFFERS_UPDATE`, Linux 5.13; at most 1 GiB; ENOMEM
    /// past RLIMIT_MEMLOCK; EFAULT for PFN mappings such as a dma-buf mmap).
    pub fn register(&self, slot: u32, range: Range<usize>) -> io::Result<()> {
        let bytes = &self.src[range];
        let iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
        let update = RsrcUpdate2 {
            offset: slot,
            resv: 0,
            data: &iov as *const libc::iovec as u64,
            tags: 0,
            nr: 1,
            resv2: 0,
        };
        // SAFETY: `update` and its iovec live across the call; the iovec lies
        // inside `src`, which outlives the ring, and the kernel only reads
        // the pinned pages (WRITE_FIXED).
        let ret = unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                self.ring_fd.as_raw_fd(),
                IORING_REGISTER_BUFFERS_UPDATE,
                &update as *const RsrcUpdate2,
                std::mem::size_of::<RsrcUpdate2>() as libc::c_uint,
            )
        };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
