//! io_uring (Linux 5.1): one ring type for both directions, reads into a
//! mapping and writes from raw bytes, with optional registered ("fixed")
//! buffers in a sparse table (Linux 5.19), registered from a helper thread.

use std::io;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use io_uring::{opcode, register, squeue, types, IoUring};

use super::mem::MappingWriter;
use super::shm::RawBytes;
use crate::types::Direction;

/// One finished request: the caller's tag and the kernel's result (bytes
/// transferred, or a negative errno).
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    pub tag: u64,
    pub result: i32,
}

/// What both directions share: the ring and the number of requests the
/// kernel still holds. Dropping it waits for all of them, so a request never
/// outlives the memory the owning ring borrows.
struct Core {
    ring: IoUring,
    in_flight: usize,
}

impl Core {
    /// `io_uring_setup(2)`. Asks for cooperative task-run mode (Linux 5.19)
    /// and falls back to a plain ring on older kernels. Not single-issuer:
    /// registrars register buffers from another thread. ENOSYS or EPERM
    /// here means io_uring is unavailable to this process (old kernel,
    /// `kernel.io_uring_disabled`, or a seccomp filter).
    fn new(entries: u32) -> io::Result<Core> {
        let ring = match IoUring::builder().setup_coop_taskrun().build(entries) {
            Ok(ring) => ring,
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => IoUring::new(entries)?,
            Err(err) => return Err(err),
        };
        Ok(Core { ring, in_flight: 0 })
    }

    /// Creates an empty table of `slots` registered buffers
    /// (`IORING_REGISTER_BUFFERS2` with the sparse flag, Linux 5.19).
    fn register_slots(&mut self, slots: u32) -> io::Result<()> {
        self.ring.submitter().register_buffers_sparse(slots)
    }

    /// Empties `slot`, unpinning its pages once no request uses them.
    fn unregister(&mut self, slot: u32) -> io::Result<()> {
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        // SAFETY: an empty iovec clears the slot; nothing is pinned.
        unsafe { self.ring.submitter().register_buffers_update(slot, &[empty], None) }
    }

    /// A duplicate of the ring fd, for registering from another thread.
    fn dup_fd(&self) -> io::Result<OwnedFd> {
        // SAFETY: the ring's fd is open for the duration of the call.
        unsafe { BorrowedFd::borrow_raw(self.ring.as_raw_fd()) }.try_clone_to_owned()
    }

    /// Queues `entry`, submitting first when the queue is full.
    ///
    /// # Safety
    ///
    /// The memory `entry` reads or writes must stay valid until the request
    /// completes; the owning ring guarantees it by borrowing that memory for
    /// longer than this `Core` lives.
    unsafe fn push(&mut self, entry: squeue::Entry) -> io::Result<()> {
        if self.ring.submission().is_full() {
            self.submit(0)?;
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full after submit"))?;
        self.in_flight += 1;
        Ok(())
    }

    /// Submits queued requests and waits until at least `want` completions
    /// are ready (0: just submit). Retries on EINTR.
    fn submit(&mut self, want: usize) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(want.min(self.in_flight)) {
                Ok(_) => return Ok(()),
                Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
                // The completion queue is full: the caller must reap first.
                Err(err) if err.raw_os_error() == Some(libc::EBUSY) && want > 0 => return Ok(()),
                Err(err) => return Err(err),
            }
        }
    }

    /// Moves the ready completions into `out`.
    fn reap(&mut self, out: &mut Vec<Completion>) {
        let before = out.len();
        out.extend(
            self.ring.completion().map(|cqe| Completion { tag: cqe.user_data(), result: cqe.result() }),
        );
        self.in_flight -= out.len() - before;
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        self.drain(|core| core.submit(1), DRAIN_RETRY_FOR);
    }
}

/// How long [`Core::drain`] retries a wait that fails for want of memory
/// or resources (EAGAIN, ENOMEM, EBUSY) without any request completing.
const DRAIN_RETRY_FOR: Duration = Duration::from_secs(5);

/// The pause between those retries, for the kernel to free something.
const DRAIN_RETRY_PAUSE: Duration = Duration::from_millis(10);

impl Core {
    /// Waits until the kernel holds none of this ring's requests, `wait`
    /// being one wait for at least one completion ([`Core::submit`] with 1).
    /// A wait interrupted by a signal (EINTR) is tried again at once; one
    /// that fails for want of memory or resources (EAGAIN, ENOMEM, EBUSY)
    /// after a pause, for up to `retry_for` without a completion. Past that,
    /// or on any other error, the process aborts naming the cause: returning
    /// would let the kernel write into memory about to be freed or handed
    /// out, and there is no safe way on.
    fn drain(&mut self, mut wait: impl FnMut(&mut Core) -> io::Result<()>, retry_for: Duration) {
        let mut completions = Vec::new();
        let mut failing_since: Option<Instant> = None;
        while self.in_flight > 0 {
            if let Err(err) = wait(self) {
                let errno = err.raw_os_error();
                if errno == Some(libc::EINTR) {
                    continue;
                }
                let failing = failing_since.get_or_insert_with(Instant::now).elapsed();
                if !matches!(errno, Some(libc::EAGAIN | libc::ENOMEM | libc::EBUSY)) || failing >= retry_for {
                    eprintln!(
                        "dmaload: io_uring wait failed with {} requests in flight: {err} (failing for \
                         {:.1} s); aborting, as the kernel may still write into memory about to be freed",
                        self.in_flight,
                        failing.as_secs_f64()
                    );
                    std::process::abort();
                }
                std::thread::sleep(DRAIN_RETRY_PAUSE);
            }
            // Some may have completed even when the wait failed.
            completions.clear();
            self.reap(&mut completions);
            if !completions.is_empty() {
                failing_since = None;
            }
        }
    }
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

/// Most buffers a ring's registered-buffer table holds (the kernel's
/// `IORING_MAX_REG_BUFFERS`).
pub const MAX_REGISTERED_BUFFERS: usize = 1 << 14;

/// Registers `iov` in `slot` of the ring behind `ring_fd`, pinning its pages
/// (`IORING_REGISTER_BUFFERS_UPDATE`, Linux 5.13). Pinned pages count
/// against RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK (ENOMEM past
/// it); a buffer is at most 1 GiB; PFN mappings (a dma-buf mmap) get EFAULT.
///
/// # Safety
///
/// `iov` must describe memory that stays mapped for as long as requests may
/// use the slot (the kernel's pin keeps the pages themselves alive).
unsafe fn register_buffer(ring_fd: BorrowedFd<'_>, slot: u32, iov: libc::iovec) -> io::Result<()> {
    let update = RsrcUpdate2 {
        offset: slot,
        resv: 0,
        data: &iov as *const libc::iovec as u64,
        tags: 0,
        nr: 1,
        resv2: 0,
    };
    // SAFETY: `update` and the iovec it points to live across the call; the
    // memory's lifetime is the caller's contract.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring_fd.as_raw_fd(),
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

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::MappingWriter<'_> {}
    impl Sealed for super::RawBytes<'_> {}
}

/// The memory a [`Ring`]'s requests use, which fixes their direction: a
/// [`MappingWriter`] that the kernel writes into (reads from a file) or
/// [`RawBytes`] that it only reads (writes to a file). Sealed: [`Ring`] and
/// [`Registrar`] trust `iovec` to stay inside memory that is mapped for as
/// long as the value's borrow lasts.
pub trait RingMemory: sealed::Sealed + Copy + Send + Sync {
    /// Which way requests on this memory move bytes.
    const DIRECTION: Direction;

    /// The address and length of `range`; panics when `range` is outside the
    /// memory (ranges come from the caller's plan: that is a bug).
    fn iovec(&self, range: Range<usize>) -> libc::iovec;

    /// One blocking transfer between `range` of the memory and `fd` at
    /// `offset` (`preadv2` into a writer, `pwritev2` from raw bytes), with
    /// `rw_flags`; returns the bytes moved, which may be fewer.
    fn transfer_at(
        &self,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
        offset: u64,
        rw_flags: i32,
    ) -> io::Result<usize>;

    /// The memory as a destination other sources write into (an object
    /// store's response bodies); `None` for memory of the write direction.
    fn destination(&self) -> Option<MappingWriter<'_>>;
}

impl RingMemory for MappingWriter<'_> {
    const DIRECTION: Direction = Direction::Read;

    fn iovec(&self, range: Range<usize>) -> libc::iovec {
        let (ptr, len) = self.raw_range(&range);
        libc::iovec { iov_base: ptr.cast(), iov_len: len }
    }

    fn transfer_at(
        &self,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
        offset: u64,
        rw_flags: i32,
    ) -> io::Result<usize> {
        self.pread_at(fd, range, offset, rw_flags)
    }

    fn destination(&self) -> Option<MappingWriter<'_>> {
        Some(*self)
    }
}

impl RingMemory for RawBytes<'_> {
    const DIRECTION: Direction = Direction::Write;

    fn iovec(&self, range: Range<usize>) -> libc::iovec {
        let bytes = self.range(range);
        libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() }
    }

    fn transfer_at(
        &self,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
        offset: u64,
        rw_flags: i32,
    ) -> io::Result<usize> {
        self.range(range).pwrite_at(fd, offset, rw_flags)
    }

    fn destination(&self) -> Option<MappingWriter<'_>> {
        None
    }
}

/// An io_uring instance whose requests all use one piece of memory `M`:
/// reads land in a mapping ([`MappingWriter`]), writes come from bytes the
/// kernel only reads ([`RawBytes`]).
///
/// It holds `M`, and so `M`'s borrow of the memory, for its whole life, and
/// its [`Core`] drains every in-flight request before the borrow can end: the
/// kernel never touches memory that has been unmapped, or (for reads) handed
/// to Rust code as a slice.
pub struct Ring<M: RingMemory> {
    core: Core,
    mem: M,
}

impl<M: RingMemory> Ring<M> {
    /// See [`Core::new`].
    pub fn new(entries: u32, mem: M) -> io::Result<Self> {
        Ok(Ring { core: Core::new(entries)?, mem })
    }

    /// See [`Core::register_slots`].
    pub fn register_slots(&mut self, slots: u32) -> io::Result<()> {
        self.core.register_slots(slots)
    }

    /// See [`Core::unregister`].
    pub fn unregister(&mut self, slot: u32) -> io::Result<()> {
        self.core.unregister(slot)
    }

    /// A handle that registers ranges of the memory from another thread,
    /// so pinning runs beside the I/O instead of between it.
    pub fn registrar(&self) -> io::Result<Registrar<M>> {
        Ok(Registrar { ring_fd: self.core.dup_fd()?, mem: self.mem })
    }

    /// Queues `opcode` on `range` of the memory: the fixed form (through
    /// registered buffer `slot`, which must hold the whole range) when a
    /// slot is given, the plain one otherwise.
    fn queue(
        &mut self,
        range: Range<usize>,
        slot: Option<u16>,
        tag: u64,
        entry: impl FnOnce(*mut u8, u32, Option<u16>) -> squeue::Entry,
    ) -> io::Result<()> {
        let iov = self.mem.iovec(range);
        let len = u32::try_from(iov.iov_len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let entry = entry(iov.iov_base.cast(), len, slot).user_data(tag);
        // SAFETY: the range lies inside `mem` (checked by `iovec`), which
        // this ring holds, and so keeps mapped (and, for a writer, free of
        // Rust references), for its whole life; the core drains every
        // request before the ring drops. The kernel holds its own reference
        // to the file from submission on.
        unsafe { self.core.push(entry) }
    }

    /// Queues a one-shot poll for `fd` becoming readable (an eventfd that
    /// another thread signals), completing with `tag`: a wait in
    /// [`Ring::submit`] then also ends when that thread signals. The ring
    /// drains it like any request, so whoever signals must do so before
    /// the ring drops.
    pub fn queue_poll_readable(&mut self, fd: BorrowedFd<'_>, tag: u64) -> io::Result<()> {
        let entry =
            opcode::PollAdd::new(types::Fd(fd.as_raw_fd()), libc::POLLIN as u32).build().user_data(tag);
        // SAFETY: a poll names no memory of ours; the kernel holds its own
        // reference to the file from submission on.
        unsafe { self.core.push(entry) }
    }

    /// Requests queued or running in the kernel.
    pub fn in_flight(&self) -> usize {
        self.core.in_flight
    }

    /// See [`Core::submit`].
    pub fn submit(&mut self, want: usize) -> io::Result<()> {
        self.core.submit(want)
    }

    /// See [`Core::reap`].
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        self.core.reap(out)
    }
}

impl<M: RingMemory> Ring<M> {
    /// Queues a transfer of `range` of the memory at file `offset`, in the
    /// memory's direction (a read into a writer, a write from raw bytes),
    /// through registered buffer `slot` when given.
    pub fn queue_transfer(
        &mut self,
        fd: BorrowedFd<'_>,
        range: Range<usize>,
        offset: u64,
        slot: Option<u16>,
        rw_flags: i32,
        tag: u64,
    ) -> io::Result<()> {
        let fd = types::Fd(fd.as_raw_fd());
        self.queue(range, slot, tag, |ptr, len, slot| match (M::DIRECTION, slot) {
            (Direction::Read, Some(index)) => {
                opcode::ReadFixed::new(fd, ptr, len, index).offset(offset).rw_flags(rw_flags).build()
            }
            (Direction::Read, None) => {
                opcode::Read::new(fd, ptr, len).offset(offset).rw_flags(rw_flags).build()
            }
            (Direction::Write, Some(index)) => {
                opcode::WriteFixed::new(fd, ptr, len, index).offset(offset).rw_flags(rw_flags).build()
            }
            (Direction::Write, None) => {
                opcode::Write::new(fd, ptr, len).offset(offset).rw_flags(rw_flags).build()
            }
        })
    }
}

/// Registers ranges of a [`Ring`]'s memory as fixed buffers, from any
/// thread (`io_uring_register(2)` on a duplicate of the ring fd).
pub struct Registrar<M: RingMemory> {
    ring_fd: OwnedFd,
    mem: M,
}

impl<M: RingMemory> Registrar<M> {
    /// Registers `range` of the memory in `slot` (see [`register_buffer`]).
    pub fn register(&self, slot: u32, range: Range<usize>) -> io::Result<()> {
        // SAFETY: the iovec lies inside `mem` (checked by `iovec`), which
        // stays mapped for its borrow, longer than the ring and so longer
        // than any request using the slot.
        unsafe { register_buffer(self.ring_fd.as_fd(), slot, self.mem.iovec(range)) }
    }

    /// Empties `slot`, for a registration that turned out not to be needed
    /// (see [`Core::unregister`]).
    pub fn unregister(&self, slot: u32) -> io::Result<()> {
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        // SAFETY: an empty iovec clears the slot; nothing is pinned.
        unsafe { register_buffer(self.ring_fd.as_fd(), slot, empty) }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    /// A ring with one read in flight from a socket nothing has written to
    /// yet, into `buf`.
    fn ring_waiting_on(socket: &UnixStream, buf: &mut [u8; 4]) -> Core {
        let mut core = Core::new(4).unwrap();
        let read = opcode::Read::new(types::Fd(socket.as_raw_fd()), buf.as_mut_ptr(), 4).build();
        // SAFETY: every caller keeps `buf` alive, and reads it only once
        // the ring has drained (or never, when the process aborts).
        unsafe { core.push(read) }.unwrap();
        core.submit(0).unwrap();
        core
    }

    #[test]
    fn draining_retries_transient_failures_until_the_requests_complete() {
        let (reader, mut writer) = UnixStream::pair().unwrap();
        let mut buf = [0u8; 4];
        let mut core = ring_waiting_on(&reader, &mut buf);
        let mut failures = [libc::EINTR, libc::EAGAIN, libc::ENOMEM, libc::EBUSY, libc::EAGAIN].into_iter();
        core.drain(
            |core| match failures.next() {
                Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                None => {
                    writer.write_all(b"done").unwrap();
                    core.submit(1)
                }
            },
            Duration::from_secs(5),
        );
        assert_eq!(core.in_flight, 0);
        drop(core);
        assert_eq!(&buf, b"done");
    }

    const ABORT_CHILD: &str = "DMALOAD_TEST_DRAIN_ABORT";

    #[test]
    fn draining_aborts_naming_the_cause_when_a_failure_lasts() {
        let test = "sys::uring::tests::draining_aborts_naming_the_cause_when_a_failure_lasts";
        if let Some(errno) = std::env::var_os(ABORT_CHILD) {
            let errno: i32 = errno.to_str().unwrap().parse().unwrap();
            let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: `no_core` is a valid rlimit that lives across the call.
            unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
            let (reader, _writer) = UnixStream::pair().unwrap();
            let mut buf = [0u8; 4];
            let mut core = ring_waiting_on(&reader, &mut buf);
            core.drain(|_| Err(io::Error::from_raw_os_error(errno)), Duration::from_millis(50));
            println!("drained: {buf:?}");
            return;
        }
        // A failure that lasts past the retries, and one never retried.
        for errno in [libc::ENOMEM, libc::EBADF] {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(ABORT_CHILD, errno.to_string())
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{out:?}");
            let cause = io::Error::from_raw_os_error(errno).to_string();
            assert!(stderr.contains(&format!("with 1 requests in flight: {cause}")), "{stderr}");
        }
    }
}
