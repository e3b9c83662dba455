//! A ring of blocks in memory shared by two processes: a producer fills
//! blocks and enqueues them, a consumer dequeues them in order, uses them
//! and gives them back. Blocks are passed by index, never copied.
//!
//! One process creates the queue ([`BlockQueue::create`]) and sends, over
//! a [`Connection`], a header and four descriptors: the control page (a
//! sealed memfd), the blocks (a sealed memfd with huge pages where the
//! kernel allows, or a dma-buf from the system dma-heap or udmabuf), and
//! two eventfds, one per direction. The other attaches
//! ([`BlockQueue::attach`]) and takes the other role.
//!
//! The control page holds two counters, each written by one side only:
//! `produced` (blocks enqueued) and `consumed` (blocks given back), and per
//! block its length and a tag. Block `n` of the stream lives in slot
//! `n % blocks`. Each side keeps its own counter in private memory and
//! treats everything the page says as untrusted: the peer's counter must
//! move forward and stay within the ring, a length must fit in a block,
//! and anything else is an `InvalidData` error. Indices are computed from
//! the side's own counter, so a hostile peer can make the data wrong or
//! stop the stream, never make this side touch memory outside the ring.
//!
//! Waiting never spins: a side that finds nothing to do raises its
//! `waiting` word, checks once more, and sleeps in `poll(2)` on its eventfd
//! and on the socket. The other side signals the eventfd only when the word
//! is raised, so a stream that never waits makes no system calls per block.
//! The socket wakes the sleeper when the peer's process ends (its socket
//! closes, `POLLRDHUP`), so a dead peer is noticed at once while waiting:
//! a consumer still drains the blocks enqueued before and then fails with
//! `BrokenPipe`; a producer fails with `BrokenPipe`. While the queue runs,
//! the connection carries nothing else.
//!
//! The peer may write any block at any time if it breaks the protocol, so
//! blocks are never safe `&[u8]`: they are filled and read through copies,
//! by the kernel (`read(2)` into a free block, writes from a filled one),
//! or through `unsafe` slices on the caller's promise that the peer keeps
//! to the protocol. On dma-buf blocks every CPU access between dequeue and
//! enqueue/release is bracketed by `DMA_BUF_IOCTL_SYNC`.

use std::collections::BTreeMap;
use std::io;
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Connection;
use crate::sys::dmabuf::{self, SyncAccess};
use crate::sys::eventfd::{poll_two, EventFd, Readiness};
use crate::sys::mem::{self, Seals};
use crate::sys::shm::{BlockWriter, PeerMapping};

mod block;
mod options;

pub use block::*;
pub use options::*;

/// Words of the control page (8 bytes each).
const MAGIC: u64 = u64::from_le_bytes(*b"DMALBQ01");
const W_MAGIC: usize = 0;
const W_PRODUCED: usize = 1;
const W_CONSUMED: usize = 2;
const W_PRODUCER_STATE: usize = 3;
const W_CONSUMER_STATE: usize = 4;
const W_PRODUCER_WAITING: usize = 5;
const W_CONSUMER_WAITING: usize = 6;
/// Slot `i`: its length at `W_SLOTS + 2i`, its tag at `W_SLOTS + 2i + 1`.
const W_SLOTS: usize = 8;

/// A side's state word: running, finished (the producer's end of stream),
/// or gone (dropped or closed before the end).
const RUNNING: u64 = 0;
const FINISHED: u64 = 1;
const GONE: u64 = 2;

fn control_len(blocks: usize) -> usize {
    ((W_SLOTS + 2 * blocks) * 8).next_multiple_of(mem::page_size())
}

/// The creator's first message: these words, then the four descriptors.
const HEADER_WORDS: usize = 6;
const PROTOCOL_VERSION: u64 = 1;
const ATTACHED: &[u8] = b"dmaload block queue attached";

fn encode_header(options: &BlockQueueOptions, creator: Role) -> [u8; HEADER_WORDS * 8] {
    let memory = QueueMemory::ALL.iter().position(|&m| m == options.memory).unwrap_or(0) as u64;
    let words = [
        MAGIC,
        PROTOCOL_VERSION,
        options.block_size as u64,
        options.blocks as u64,
        memory,
        (creator == Role::Producer) as u64,
    ];
    let mut bytes = [0u8; HEADER_WORDS * 8];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    bytes
}

/// Where [`BlockQueue::id`]s come from: each queue of this process its own.
static NEXT_QUEUE_ID: AtomicU64 = AtomicU64::new(0);

fn next_queue_id() -> u64 {
    NEXT_QUEUE_ID.fetch_add(1, Relaxed)
}

/// One end of a block queue. See the module doc.
#[derive(Debug)]
pub struct BlockQueue {
    /// This end, among the queues of this process: a [`HeldRun`] carries
    /// it, so that a run goes back only to the queue it came from.
    id: u64,
    conn: Connection,
    role: Role,
    options: BlockQueueOptions,
    control: PeerMapping,
    /// Shared with writers of [`HeldRun`]s ([`Self::ring`]).
    data: Arc<PeerMapping>,
    /// Producer: the right to write `data`, lent only to a [`FreeBlock`].
    writer: Option<BlockWriter>,
    /// The blocks' dma-buf, for the CPU-access brackets.
    dmabuf: Option<OwnedFd>,
    /// Signalled by the producer after an enqueue, waited on by the consumer.
    filled: EventFd,
    /// Signalled by the consumer after a release, waited on by the producer.
    freed: EventFd,
    /// This side's counter (enqueued or released blocks): its own copy,
    /// never read back from the page.
    own: u64,
    /// The peer's counter as last read and checked.
    peer: u64,
    /// The producer has finished, or the consumer has seen the end.
    ended: bool,
    /// Consumer: filled blocks a wait waits for (see [`Self::dequeue_run`]).
    want: u64,
    /// Consumer: blocks dequeued (given back or not); `own` counts those
    /// given back, in order.
    taken: u64,
    /// Consumer: runs given back ahead of an earlier one still held
    /// (sequence → blocks), given back for real once the gap closes.
    done: BTreeMap<u64, u64>,
    /// `DMA_BUF_IOCTL_SYNC` calls made (dma-buf blocks only).
    cpu_syncs: u64,
}

/// A queue created and sent to the peer, not yet attached there
/// ([`BlockQueue::offer`]).
pub struct OfferedQueue {
    queue: BlockQueue,
}

impl OfferedQueue {
    /// The connection the peer answers on.
    pub fn connection(&self) -> &Connection {
        &self.queue.conn
    }

    /// Waits up to `timeout` for the peer's attachment: the queue, ready.
    pub fn accept(self, timeout: Option<Duration>) -> io::Result<BlockQueue> {
        self.queue.conn.set_timeouts(timeout)?;
        let mut reply = [0u8; 64];
        let (len, fds) = self
            .queue
            .conn
            .recv(&mut reply)
            .map_err(|e| attach_error("waiting for the peer to attach", e))?;
        if !fds.is_empty() || &reply[..len] != ATTACHED {
            return Err(if len == 0 && fds.is_empty() {
                io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "block queue: the peer hung up instead of attaching",
                )
            } else {
                corrupt("the peer answered something else than its attachment".into())
            });
        }
        Ok(self.queue)
    }
}

impl BlockQueue {
    /// Creates a queue, sends it over `conn` and waits up to `timeout` for
    /// the peer to attach. This process takes `role`, the peer the other.
    /// Its memfds are files to RLIMIT_FSIZE: a ring past it is an error.
    pub fn create(
        conn: Connection,
        role: Role,
        options: &BlockQueueOptions,
        timeout: Option<Duration>,
    ) -> io::Result<BlockQueue> {
        BlockQueue::offer(conn, role, options)?.accept(timeout)
    }

    /// The first half of [`Self::create`]: creates the queue and sends it
    /// over `conn`, without waiting for the peer. A caller that must stay
    /// interruptible waits for the answer in slices
    /// ([`OfferedQueue::connection`]'s `wait_readable`), then
    /// [`OfferedQueue::accept`]s it; dropping the offer instead frees
    /// everything, and the peer finds the creator gone.
    pub fn offer(conn: Connection, role: Role, options: &BlockQueueOptions) -> io::Result<OfferedQueue> {
        options.validate()?;
        let data_len = options.block_size * options.blocks;
        let control_fd = mem::memfd_create(c"dmaload-queue-control", mem::MemfdPages::Shmem)?;
        mem::set_len(control_fd.as_fd(), control_len(options.blocks) as u64)?;
        mem::add_seals(control_fd.as_fd(), Seals::SHRINK | Seals::GROW)?;
        let control = PeerMapping::new(control_fd.as_fd(), control_len(options.blocks), false)?;
        control.word(W_MAGIC).store(MAGIC, Release);
        let (data_fd, dmabuf) = match options.memory {
            QueueMemory::Memfd => {
                let fd = mem::memfd_create(c"dmaload-queue-blocks", mem::MemfdPages::Shmem)?;
                mem::set_len(fd.as_fd(), data_len as u64)?;
                mem::add_seals(fd.as_fd(), Seals::SHRINK | Seals::GROW)?;
                (fd, None)
            }
            QueueMemory::DmaHeap => {
                let fd = crate::heap::dma_heap_alloc(data_len as u64)?.into_fd();
                (fd.try_clone()?, Some(fd))
            }
            QueueMemory::Udmabuf => {
                let memfd = mem::memfd_create(c"dmaload-queue-blocks", mem::MemfdPages::Shmem)?;
                mem::set_len(memfd.as_fd(), data_len as u64)?;
                mem::add_seals(memfd.as_fd(), Seals::SHRINK | Seals::GROW)?;
                let fd = crate::heap::udmabuf_export(&[(memfd.as_fd(), 0, data_len as u64)])?.into_fd();
                (fd.try_clone()?, Some(fd))
            }
        };
        let (data, writer) = map_blocks(data_fd.as_fd(), data_len, options.memory, role)?;
        let (filled, freed) = (EventFd::new()?, EventFd::new()?);
        let header = encode_header(options, role);
        conn.send(&header, &[control_fd.as_fd(), data_fd.as_fd(), filled.as_fd(), freed.as_fd()])?;
        Ok(OfferedQueue {
            queue: BlockQueue {
                id: next_queue_id(),
                conn,
                role,
                options: options.clone(),
                control,
                data,
                writer,
                dmabuf,
                filled,
                freed,
                own: 0,
                peer: 0,
                ended: false,
                want: 1,
                taken: 0,
                done: BTreeMap::new(),
                cpu_syncs: 0,
            },
        })
    }

    /// Receives a queue that the process at the other end of `conn` created
    /// (waiting up to `timeout`), checks everything it says, and takes the
    /// role the creator left.
    pub fn attach(conn: Connection, timeout: Option<Duration>) -> io::Result<BlockQueue> {
        conn.set_timeouts(timeout)?;
        let mut header = [0u8; HEADER_WORDS * 8 + 1];
        let (len, fds) = conn.recv(&mut header).map_err(|e| attach_error("waiting for a block queue", e))?;
        if len == 0 && fds.is_empty() {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "block queue: the creator hung up"));
        }
        let Ok::<[OwnedFd; 4], _>([control_fd, data_fd, filled, freed]) = fds.try_into() else {
            return Err(corrupt("the header must carry exactly four descriptors".into()));
        };
        if len != HEADER_WORDS * 8 {
            return Err(corrupt(format!("a header of {len} bytes")));
        }
        let word = |i: usize| u64::from_le_bytes(header[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        if word(0) != MAGIC || word(1) != PROTOCOL_VERSION {
            return Err(corrupt("not a dmaload block queue of protocol version 1".into()));
        }
        let memory = *QueueMemory::ALL
            .get(word(4) as usize)
            .ok_or_else(|| corrupt(format!("unknown memory kind {}", word(4))))?;
        let creator = match word(5) {
            0 => Role::Consumer,
            1 => Role::Producer,
            other => return Err(corrupt(format!("unknown role {other}"))),
        };
        let size = |w: u64| usize::try_from(w).unwrap_or(usize::MAX);
        let options = BlockQueueOptions { block_size: size(word(2)), blocks: size(word(3)), memory };
        options.validate().map_err(|e| corrupt(format!("the creator's shape is refused: {e}")))?;
        let data_len = options.block_size * options.blocks;
        check_shared_object(&control_fd, control_len(options.blocks), false, "control page")?;
        check_shared_object(&data_fd, data_len, memory.is_dmabuf(), "blocks")?;
        let control = PeerMapping::new(control_fd.as_fd(), control_len(options.blocks), false)?;
        if control.word(W_MAGIC).load(Acquire) != MAGIC {
            return Err(corrupt("the control page lacks its magic word".into()));
        }
        let (data, writer) = map_blocks(data_fd.as_fd(), data_len, memory, creator.other())?;
        let queue = BlockQueue {
            id: next_queue_id(),
            role: creator.other(),
            options,
            control,
            data,
            writer,
            dmabuf: memory.is_dmabuf().then_some(data_fd),
            filled: EventFd::from_fd(filled)?,
            freed: EventFd::from_fd(freed)?,
            own: 0,
            peer: 0,
            ended: false,
            want: 1,
            taken: 0,
            done: BTreeMap::new(),
            cpu_syncs: 0,
            conn,
        };
        queue.conn.send(ATTACHED, &[])?;
        Ok(queue)
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn block_size(&self) -> usize {
        self.options.block_size
    }

    pub fn blocks(&self) -> usize {
        self.options.blocks
    }

    pub fn memory(&self) -> QueueMemory {
        self.options.memory
    }

    /// Blocks this side has enqueued (producer) or given back (consumer).
    pub fn count(&self) -> u64 {
        self.own
    }

    /// The connection the queue was set up over; after the stream ended
    /// (an end of stream seen, or a finished queue drained) it may carry
    /// other messages, e.g. a report.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The descriptor this side waits on, for a poll/epoll/io_uring loop:
    /// call [`Self::prepare_wait`] first, and wait only if it says so.
    pub fn wait_fd(&self) -> BorrowedFd<'_> {
        match self.role {
            Role::Producer => self.freed.as_fd(),
            Role::Consumer => self.filled.as_fd(),
        }
    }

    /// Announces that this side is about to wait on [`Self::wait_fd`], so
    /// the peer signals it. Returns false when there is already something
    /// to do (a free block, a filled block or the end): then do not wait.
    pub fn prepare_wait(&mut self) -> io::Result<bool> {
        if self.ready()? {
            return Ok(false);
        }
        self.control.word(self.waiting_word(self.role)).store(self.wake_target() + 1, SeqCst);
        Ok(!self.ready()?)
    }

    /// The value of the peer's counter that gives this side something to
    /// do: the consumer's wanted filled blocks, the producer's first free
    /// one. Kept (plus one; 0 is "not waiting") in this side's `waiting`
    /// word, so the peer wakes it only then, not at every block.
    fn wake_target(&self) -> u64 {
        match self.role {
            Role::Consumer => self.taken + self.want,
            // A quarter of the ring free: refilled in bursts, not block by block.
            Role::Producer => {
                let blocks = self.options.blocks as u64;
                (self.own + (blocks / 4).max(1)).saturating_sub(blocks)
            }
        }
    }

    fn waiting_word(&self, role: Role) -> usize {
        match role {
            Role::Producer => W_PRODUCER_WAITING,
            Role::Consumer => W_CONSUMER_WAITING,
        }
    }

    fn state_word(role: Role) -> usize {
        match role {
            Role::Producer => W_PRODUCER_STATE,
            Role::Consumer => W_CONSUMER_STATE,
        }
    }

    fn require(&self, role: Role, what: &str) -> io::Result<()> {
        if self.role != role {
            return Err(invalid(format!("{what} is for the {role:?} end; this is the {:?} end", self.role)));
        }
        Ok(())
    }

    /// Reads and checks the peer's counter: it only moves forward, and
    /// stays within one ring of this side's.
    fn refresh(&mut self) -> io::Result<u64> {
        let blocks = self.options.blocks as u64;
        let seen = match self.role {
            Role::Consumer => {
                let produced = self.control.word(W_PRODUCED).load(SeqCst);
                if produced < self.peer || produced < self.own || produced - self.own > blocks {
                    return Err(corrupt(format!(
                        "the producer's count {produced} is outside {}..={} (ring of {blocks} blocks)",
                        self.peer.max(self.own),
                        self.own + blocks
                    )));
                }
                produced
            }
            Role::Producer => {
                let consumed = self.control.word(W_CONSUMED).load(SeqCst);
                if consumed < self.peer || consumed > self.own {
                    return Err(corrupt(format!(
                        "the consumer's count {consumed} is outside {}..={}",
                        self.peer, self.own
                    )));
                }
                consumed
            }
        };
        self.peer = seen;
        Ok(seen)
    }

    fn peer_state(&self) -> u64 {
        self.control.word(Self::state_word(self.role.other())).load(SeqCst)
    }

    /// Whether this side has something to do without waiting.
    fn ready(&mut self) -> io::Result<bool> {
        let peer = self.refresh()?;
        Ok(match self.role {
            Role::Producer => self.own - peer < self.options.blocks as u64 || self.peer_state() != RUNNING,
            Role::Consumer => peer - self.taken >= self.want || self.peer_state() != RUNNING,
        })
    }

    /// Tells the peer (if it waits) that this side's counter moved: only
    /// once the counter reaches what the peer waits for.
    fn wake_peer(&self) -> io::Result<()> {
        let target = self.control.word(self.waiting_word(self.role.other())).load(SeqCst);
        if target == 0 || self.own + 1 < target {
            return Ok(());
        }
        self.wake_peer_now()
    }

    /// Tells the peer (if it waits) that something changed whatever it
    /// waits for: a state, not a count.
    fn wake_peer_now(&self) -> io::Result<()> {
        if self.control.word(self.waiting_word(self.role.other())).swap(0, SeqCst) != 0 {
            match self.role {
                Role::Producer => self.filled.signal()?,
                Role::Consumer => self.freed.signal()?,
            }
        }
        Ok(())
    }

    /// Waits until [`Self::ready`], the peer hangs up, or `timeout`.
    fn wait_ready(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if !self.prepare_wait()? {
                return Ok(());
            }
            let left = deadline.map(|at| at.saturating_duration_since(Instant::now()));
            let readiness = poll_two(self.wait_fd(), self.conn.as_fd(), left);
            self.control.word(self.waiting_word(self.role)).store(0, Relaxed);
            match readiness? {
                // A peer that signals without making progress cannot keep
                // this side past its deadline.
                Readiness::Signalled if deadline.is_some_and(|at| Instant::now() >= at) => {
                    if !self.ready()? {
                        return Err(self.timed_out(timeout));
                    }
                }
                Readiness::Signalled => {
                    match self.role {
                        Role::Producer => self.freed.drain()?,
                        Role::Consumer => self.filled.drain()?,
                    };
                }
                // What the peer did before it went is still taken: a
                // consumer takes every block delivered, even fewer than it
                // wanted (they are all there will be).
                Readiness::Peer => {
                    let ready = self.ready()?;
                    let delivered = self.role == Role::Consumer && self.peer > self.taken;
                    return if ready || delivered { Ok(()) } else { Err(self.peer_gone()) };
                }
                Readiness::TimedOut => {
                    return if self.ready()? { Ok(()) } else { Err(self.timed_out(timeout)) };
                }
            }
        }
    }

    fn timed_out(&self, timeout: Option<Duration>) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "block queue: the {:?} did nothing for {:?}",
                self.role.other(),
                timeout.unwrap_or_default()
            ),
        )
    }

    fn peer_gone(&self) -> io::Error {
        let what = match self.role {
            Role::Producer => {
                format!("the consumer went away after taking {} of {} enqueued blocks", self.peer, self.own)
            }
            Role::Consumer => format!(
                "the producer went away without finishing the stream, after {} blocks",
                self.peer.max(self.own)
            ),
        };
        io::Error::new(io::ErrorKind::BrokenPipe, format!("block queue: {what}"))
    }

    fn sync(&mut self, access: SyncAccess, start: bool) -> io::Result<()> {
        match &self.dmabuf {
            Some(fd) => {
                self.cpu_syncs += 1;
                dmabuf::sync(fd.as_fd(), access, start)
            }
            None => Ok(()),
        }
    }

    /// How many CPU-access brackets' ends (`DMA_BUF_IOCTL_SYNC` start or
    /// end) this side has issued: two per block on dma-buf blocks, none on
    /// a memfd.
    pub fn cpu_syncs(&self) -> u64 {
        self.cpu_syncs
    }

    /// Producer: the next free block, waiting up to `timeout` (`None`:
    /// forever) while all blocks are in use. Fails with `TimedOut`, or
    /// `BrokenPipe` when the consumer has gone.
    pub fn dequeue_free(&mut self, timeout: Option<Duration>) -> io::Result<FreeBlock<'_>> {
        self.require(Role::Producer, "dequeue_free")?;
        self.wait_ready(timeout)?;
        if self.own - self.peer >= self.options.blocks as u64 {
            return Err(self.peer_gone());
        }
        self.free_block()?.ok_or_else(|| io::Error::other("block queue: no free block after the wait"))
    }

    /// Producer: the next free block if there is one now.
    pub fn try_dequeue_free(&mut self) -> io::Result<Option<FreeBlock<'_>>> {
        self.require(Role::Producer, "try_dequeue_free")?;
        self.refresh()?;
        self.free_block()
    }

    fn free_block(&mut self) -> io::Result<Option<FreeBlock<'_>>> {
        if self.ended {
            return Err(invalid("the producer already finished the stream".into()));
        }
        if self.peer_state() != RUNNING {
            return Err(self.peer_gone());
        }
        if self.own - self.peer >= self.options.blocks as u64 {
            return Ok(None);
        }
        self.sync(SyncAccess::Write, true)?;
        let slot = (self.own % self.options.blocks as u64) as usize;
        Ok(Some(FreeBlock { queue: self, slot, enqueued: false }))
    }

    /// Producer: the end of the stream. The consumer takes the blocks
    /// already enqueued, then sees the end.
    pub fn finish(&mut self) -> io::Result<()> {
        self.require(Role::Producer, "finish")?;
        if !self.ended {
            self.ended = true;
            self.control.word(W_PRODUCER_STATE).store(FINISHED, SeqCst);
            self.wake_peer_now()?;
        }
        Ok(())
    }

    /// Producer, after [`Self::finish`]: waits until the consumer has given
    /// back every block (`BrokenPipe` if it goes away first).
    pub fn wait_drained(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.require(Role::Producer, "wait_drained")?;
        let deadline = timeout.map(|t| Instant::now() + t);
        while self.refresh()? < self.own {
            if self.peer_state() != RUNNING {
                return Err(self.peer_gone());
            }
            let left = deadline.map(|at| at.saturating_duration_since(Instant::now()));
            // Woken when the consumer has given back everything.
            self.control.word(W_PRODUCER_WAITING).store(self.own + 1, SeqCst);
            if self.refresh()? == self.own {
                break;
            }
            let readiness = poll_two(self.freed.as_fd(), self.conn.as_fd(), left)?;
            self.control.word(W_PRODUCER_WAITING).store(0, Relaxed);
            match readiness {
                Readiness::Signalled => self.freed.drain()?,
                Readiness::Peer if self.refresh()? == self.own => break,
                Readiness::Peer => return Err(self.peer_gone()),
                Readiness::TimedOut => {}
            }
            // Checked after every wake-up: a peer that signals without
            // taking blocks cannot keep this side past its deadline.
            if deadline.is_some_and(|at| Instant::now() >= at) && self.refresh()? < self.own {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "block queue: the consumer had taken {} of {} blocks when the wait timed out",
                        self.peer, self.own
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Consumer: the next filled blocks in order, at least one and at most
    /// `max_blocks`, contiguous in memory and in the stream (a run stops at
    /// the ring's end and after a block shorter than the block size).
    /// Waits up to `timeout`; `None` is the end of the stream.
    pub fn dequeue_filled(
        &mut self,
        max_blocks: usize,
        timeout: Option<Duration>,
    ) -> io::Result<Option<Filled<'_>>> {
        self.dequeue_run(1, max_blocks, timeout)
    }

    /// [`Self::dequeue_filled`], waiting until `min_blocks` are filled
    /// (fewer when the ring's end comes first, the stream ends, or the
    /// producer goes away: every block it delivered is still taken, and
    /// only the call after the last is the error): a
    /// writer that batches its blocks keeps its writes large while the
    /// producer refills the rest of the ring.
    pub fn dequeue_run(
        &mut self,
        min_blocks: usize,
        max_blocks: usize,
        timeout: Option<Duration>,
    ) -> io::Result<Option<Filled<'_>>> {
        self.require(Role::Consumer, "dequeue_filled")?;
        if self.ended {
            return Ok(None);
        }
        let blocks = self.options.blocks;
        let to_ring_end = blocks - (self.taken % blocks as u64) as usize;
        self.want = min_blocks.clamp(1, max_blocks.max(1)).min(to_ring_end) as u64;
        let waited = self.wait_ready(timeout);
        self.want = 1;
        waited?;
        let available = self.peer - self.taken;
        if available == 0 {
            return match self.peer_state() {
                FINISHED => {
                    self.ended = true;
                    Ok(None)
                }
                _ => Err(self.peer_gone()),
            };
        }
        let blocks = self.options.blocks;
        let first = (self.taken % blocks as u64) as usize;
        let limit = (available as usize).min(max_blocks.max(1)).min(blocks - first);
        let mut lens = Vec::with_capacity(limit);
        let mut tags = Vec::with_capacity(limit);
        for slot in first..first + limit {
            // Read once: the snapshot is what this side uses from now on.
            let len = self.control.word(W_SLOTS + 2 * slot).load(Acquire);
            let tag = self.control.word(W_SLOTS + 2 * slot + 1).load(Acquire);
            if len > self.options.block_size as u64 {
                return Err(corrupt(format!(
                    "block {} has length {len}, more than the block size {}",
                    self.taken + (slot - first) as u64,
                    self.options.block_size
                )));
            }
            lens.push(len as usize);
            tags.push(tag);
            if (len as usize) < self.options.block_size {
                break;
            }
        }
        self.sync(SyncAccess::Read, true)?;
        let sequence = self.taken;
        self.taken += lens.len() as u64;
        Ok(Some(Filled { queue: self, sequence, first, lens, tags, released: false }))
    }

    /// The blocks' mapping, for writing held runs from other threads (as
    /// the kernel's to read: [`PeerMapping::raw_bytes`]). A consumer's:
    /// its queue has no [`BlockWriter`], so nothing in this process writes
    /// the mapping those threads read.
    pub(crate) fn ring(&self) -> Arc<PeerMapping> {
        Arc::clone(&self.data)
    }

    /// Consumer: gives back a run that [`Filled::hold`] kept. Runs may come
    /// back in any order; the producer gets blocks back in stream order,
    /// once every earlier run is back too.
    ///
    /// A run held from another queue is refused with `InvalidInput` and
    /// nothing is given back (its sequence numbers would name blocks of
    /// this queue that may still be in use); the error carries the run,
    /// for [`ForeignRun::take`] to give it back to its own queue.
    pub fn release_held(&mut self, run: HeldRun) -> io::Result<()> {
        if run.queue != self.id {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, ForeignRun(run)));
        }
        self.give_back(run.sequence, run.lens.len() as u64)
    }

    fn give_back(&mut self, sequence: u64, blocks: u64) -> io::Result<()> {
        let synced = self.sync(SyncAccess::Read, false);
        self.done.insert(sequence, blocks);
        while let Some(blocks) = self.done.remove(&self.own) {
            self.own += blocks;
        }
        self.control.word(W_CONSUMED).store(self.own, SeqCst);
        self.wake_peer().and(synced)
    }

    /// Leaves the queue before the end: the peer's next wait fails with
    /// `BrokenPipe` (a consumer still takes what was enqueued first).
    /// Dropping the queue does the same, except for a producer that
    /// finished.
    pub fn close(&mut self) -> io::Result<()> {
        self.control.word(Self::state_word(self.role)).store(GONE, SeqCst);
        self.wake_peer_now()
    }

    /// `len` bytes at `offset` of block `slot`, as a range of the ring.
    fn block_span(&self, slot: usize, offset: usize, len: usize) -> io::Result<Range<usize>> {
        let end = offset.checked_add(len).ok_or_else(|| {
            invalid(format!("{len} bytes at {offset} of a block of {} bytes", self.options.block_size))
        })?;
        self.block_range(slot, offset..end)
    }

    fn block_range(&self, slot: usize, range: Range<usize>) -> io::Result<Range<usize>> {
        if range.start > range.end || range.end > self.options.block_size {
            return Err(invalid(format!("bytes {range:?} of a block of {} bytes", self.options.block_size)));
        }
        let base = slot * self.options.block_size;
        Ok(base + range.start..base + range.end)
    }
}

impl Drop for BlockQueue {
    /// A side dropped before the end tells the peer at once (the socket
    /// closing tells it too, unless another process holds a copy).
    fn drop(&mut self) {
        let state = self.control.word(Self::state_word(self.role));
        if !(self.role == Role::Producer && self.ended) {
            state.store(GONE, SeqCst);
        }
        // Best effort: the socket's hang-up wakes the peer anyway.
        let _ = self.wake_peer_now();
    }
}

fn attach_error(what: &str, err: io::Error) -> io::Error {
    if err.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, format!("block queue: timed out {what}"))
    } else {
        io::Error::new(err.kind(), format!("block queue: {what}: {err}"))
    }
}

/// Maps the blocks for `role`: a producer gets the mapping's writer, a
/// consumer (whose mapping other threads read: [`BlockQueue::ring`]) none.
fn map_blocks(
    fd: BorrowedFd<'_>,
    len: usize,
    memory: QueueMemory,
    role: Role,
) -> io::Result<(Arc<PeerMapping>, Option<BlockWriter>)> {
    let huge_pages = memory == QueueMemory::Memfd;
    Ok(match role {
        Role::Producer => {
            let (data, writer) = PeerMapping::with_writer(fd, len, huge_pages)?;
            (Arc::new(data), Some(writer))
        }
        Role::Consumer => (Arc::new(PeerMapping::new(fd, len, huge_pages)?), None),
    })
}

/// Refuses a received object that could shrink under the mapping (SIGBUS on
/// the next touch) or that is not the size announced: a memfd must be
/// sealed against shrinking and growing; a dma-buf never changes size, and
/// is known by its filesystem, not by its name (a file can be named like
/// one: see [`dmabuf::is_dmabuf`]).
fn check_shared_object(fd: &OwnedFd, len: usize, is_dmabuf: bool, what: &str) -> io::Result<()> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd)))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    if is_dmabuf {
        if !dmabuf::is_dmabuf(fd.as_fd()).is_ok_and(|is| is) {
            return Err(corrupt(format!("the {what} should be a dma-buf, got {link:?}")));
        }
    } else {
        let sealed = mem::seals(fd.as_fd()).is_ok_and(|s| s.contains(Seals::SHRINK | Seals::GROW));
        if !link.starts_with("/memfd:") || !sealed {
            return Err(corrupt(format!(
                "the {what} must be a memfd sealed against shrinking and growing, got {link:?}"
            )));
        }
    }
    let size = std::fs::File::from(fd.try_clone()?).metadata()?.len();
    if size != len as u64 {
        return Err(corrupt(format!("the {what} holds {size} bytes, {len} were announced")));
    }
    Ok(())
}
