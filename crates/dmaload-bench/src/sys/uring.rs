//! A ring for random reads: io_uring (the io-uring crate) reading blocks
//! into the slots of memory the ring owns, into plain addresses or into
//! that memory registered once as a fixed buffer.

use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd};

use io_uring::{opcode, types, IoUring};

use super::memory::Memory;

/// A finished read: its slot and the kernel's result (bytes or -errno).
pub(crate) struct Completion {
    pub slot: usize,
    pub result: i32,
}

pub(crate) struct ReadRing {
    // Dropped by hand (see Drop): the memory outlives every read into it.
    ring: ManuallyDrop<IoUring>,
    memory: ManuallyDrop<Memory>,
    slot_len: usize,
    slots: usize,
    registered: bool,
    in_flight: usize,
}

impl ReadRing {
    /// `slots` slots of `slot_len` bytes of populated 4 KiB memfd memory
    /// and a ring with room for a read into each; with `register`, the
    /// memory is registered as fixed buffer 0.
    pub(crate) fn new(slots: usize, slot_len: usize, register: bool) -> io::Result<ReadRing> {
        let len = slots.checked_mul(slot_len).filter(|&l| l > 0).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{slots} slots of {slot_len} bytes"))
        })?;
        let size = len.next_multiple_of(rustix::param::page_size());
        let mut memory = Memory::memfd(size).map_err(|e| io::Error::other(e.to_string()))?;
        dmaload::memory::populate(memory.bytes_mut(), 1)?;
        let ring = IoUring::new(u32::try_from(slots.next_power_of_two()).map_err(io::Error::other)?)?;
        if register {
            let (base, len) = memory.raw();
            let iovec = libc::iovec { iov_base: base.cast(), iov_len: len };
            // SAFETY: the iovec covers memory this ring owns and unmaps
            // only after the ring is gone (Drop), so the kernel's pinned
            // pages stay this mapping's for as long as they are registered.
            unsafe { ring.submitter().register_buffers(&[iovec]) }?;
        }
        Ok(ReadRing {
            ring: ManuallyDrop::new(ring),
            memory: ManuallyDrop::new(memory),
            slot_len,
            slots,
            registered: register,
            in_flight: 0,
        })
    }

    /// Queues a read of one slot's worth of `fd` at `offset` into `slot`.
    pub(crate) fn queue_read(&mut self, fd: BorrowedFd<'_>, slot: usize, offset: u64) -> io::Result<()> {
        if slot >= self.slots {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("slot {slot} of {}", self.slots),
            ));
        }
        let len = self.slot_len;
        // In bounds: slot < slots and slots * slot_len <= the memory's length.
        let dst = self.memory.raw().0.wrapping_add(slot * len);
        let fd = types::Fd(fd.as_raw_fd());
        let len = u32::try_from(len).map_err(io::Error::other)?;
        let entry = match self.registered {
            true => opcode::ReadFixed::new(fd, dst, len, 0).offset(offset).build(),
            false => opcode::Read::new(fd, dst, len).offset(offset).build(),
        };
        // SAFETY: `dst..dst + len` is a slot of memory the ring owns and
        // keeps mapped until every read into it has completed (Drop); the
        // ring never forms a reference to that memory once reads can be in
        // flight.
        unsafe { self.ring.submission().push(&entry.user_data(slot as u64)) }
            .map_err(|_| io::Error::other("the submission queue is full"))?;
        self.in_flight += 1;
        Ok(())
    }

    /// Submits what is queued and waits for `wait` completions.
    pub(crate) fn submit(&mut self, wait: usize) -> io::Result<usize> {
        self.ring.submit_and_wait(wait)
    }

    /// Moves every completion into `out`.
    pub(crate) fn reap(&mut self, out: &mut Vec<Completion>) {
        for cqe in self.ring.completion() {
            out.push(Completion { slot: cqe.user_data() as usize, result: cqe.result() });
            self.in_flight -= 1;
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl Drop for ReadRing {
    fn drop(&mut self) {
        let mut done = Vec::new();
        while self.in_flight > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => self.reap(&mut done),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
            done.clear();
        }
        // SAFETY: each field is dropped once, here, and never used again.
        unsafe { ManuallyDrop::drop(&mut self.ring) };
        if self.in_flight == 0 {
            // SAFETY: as above; no read into the memory is left.
            unsafe { ManuallyDrop::drop(&mut self.memory) };
        }
        // Else reads whose end was never seen may still land in the memory:
        // it stays mapped (leaked) rather than be unmapped under them.
    }
}
