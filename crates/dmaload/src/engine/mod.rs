//! Engines move bytes between a file and memory, in the plan's direction:
//! reads for a load, writes for a save or a capture. Each runs one plan: it
//! waits for gathers to be ready (the crate's `Gate`), issues the plan's
//! chunk requests, checks every result and reports progress.

pub(crate) mod object;
pub(crate) mod pool;
pub(crate) mod uring;

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::cancel::CancelToken;
use crate::error::{Error, ErrorKind, Result};
use crate::lead::Lead;
use crate::plan::{Plan, Request};
use crate::sys;
use crate::sys::eventfd::EventFd;
use crate::sys::uring::{Registrar, RingMemory};
use crate::types::{CachePolicy, Direction, Engine, Fallback, ProgressFn};

/// How often a thread blocked on the gate (or on a FIFO a save writes) looks
/// at the caller's [`CancelToken`]: the bound on how late a cancellation is
/// noticed there.
pub(crate) const CANCEL_POLL: Duration = Duration::from_millis(20);

/// Passes units of memory (a load's gathers, a save's windows) between the
/// engine and the helper thread beside it, both ways: the helper says how
/// many gathers may be read into (populated, or staging slots the
/// destination has released) and which registered-buffer slots hold a
/// registered buffer; the engine says which unit it has reached (so the
/// helper registers a few ahead of it, see [`RegisterAhead`]), which slots
/// it is done with, and which gathers are filled (for a staged destination
/// to take); either side learns when the other failed or the caller
/// cancelled. The one coordinator of both directions: `save` runs its
/// writes behind a gate of its own.
pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    cancelled: AtomicBool,
    token: CancelToken,
    /// Each registered-buffer slot: [`SLOT_EMPTY`], [`SLOT_REGISTERED`] or
    /// [`SLOT_RETIRED`].
    slots: Vec<AtomicU8>,
    /// Which slots are due for registration: those within
    /// [`REGISTER_AHEAD`] of the unit the engine has reached.
    registering: Lead,
    /// A staged load's gathers take staging slots from a free list (see
    /// [`Gate::staged`]) instead of waiting for `ready`.
    staged: bool,
    /// Signalled whenever a staging slot frees, for an engine that sleeps
    /// in the kernel on its reads to poll beside them ([`Gate::wake_fd`]);
    /// `None` where no eventfd could be made (the engine then notices a
    /// freed slot at its next completion).
    wake: Option<EventFd>,
}

/// A slot the helper has not registered (yet).
const SLOT_EMPTY: u8 = 0;
/// A slot holding a registered buffer that requests may use.
const SLOT_REGISTERED: u8 = 1;
/// A slot whose unit the engine has finished: never registered again.
const SLOT_RETIRED: u8 = 2;

/// Units (gathers, windows) registered at most this far ahead of the one the
/// engine has reached, so pinned memory (RLIMIT_MEMLOCK) stays at a few
/// units whatever the size of the file.
const REGISTER_AHEAD: usize = 2;

struct GateState {
    ready: usize,
    registration_refused: Option<String>,
    failure: Option<(Option<i32>, String)>,
    /// Gathers whose every byte has arrived (for a staged destination, or
    /// a verified load's hashing).
    filled: Vec<bool>,
    /// Staged: filled gathers not yet taken by the destination, in the
    /// order their last read completed.
    filled_order: VecDeque<usize>,
    /// Staged: the staging slots no gather holds.
    free: VecDeque<usize>,
    /// Staged: the slot each gather took ([`NO_SLOT`] before it took one).
    slot_of: Vec<usize>,
}

/// A gather that holds no staging slot (yet).
const NO_SLOT: usize = usize::MAX;
/// A gather that needs no staging slot: a cache lane carries it.
const IN_CACHE_LANE: usize = usize::MAX - 1;

impl Gate {
    /// A gate for an operation with `slots` registered-buffer slots.
    pub fn new(token: CancelToken, slots: usize) -> Gate {
        Gate {
            token,
            state: Mutex::new(GateState {
                ready: 0,
                registration_refused: None,
                failure: None,
                filled: Vec::new(),
                filled_order: VecDeque::new(),
                free: VecDeque::new(),
                slot_of: Vec::new(),
            }),
            changed: Condvar::new(),
            cancelled: AtomicBool::new(false),
            slots: (0..slots).map(|_| AtomicU8::new(SLOT_EMPTY)).collect(),
            registering: Lead::new(slots, REGISTER_AHEAD + 1),
            staged: false,
            wake: None,
        }
    }

    /// A gate for a staged load through `slots` staging slots, all taken
    /// until [`Gate::free_slot`] frees them: a gather is ready once it holds
    /// a slot, any free one (in the order they were freed), and filled
    /// gathers are taken in completion order ([`Gate::next_filled`]).
    pub fn staged(token: CancelToken, slots: usize) -> Gate {
        Gate { staged: true, wake: EventFd::new().ok(), ..Gate::new(token, slots) }
    }

    /// The eventfd signalled when a staging slot frees, if any.
    pub fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        self.wake.as_ref().map(|wake| wake.as_fd())
    }

    /// Resets the wake eventfd once its signal has been seen.
    pub fn drain_wake(&self) {
        // A failed read only leaves it readable: one spurious wake-up.
        if let Some(wake) = &self.wake {
            drop(wake.drain());
        }
    }

    /// Signals the wake eventfd (a freed slot, or an engine ending whose
    /// pending poll must complete before its ring can close).
    pub fn wake(&self) {
        // A failed signal (never, for a counter far from its maximum) only
        // leaves the engine to notice at its next completion.
        if let Some(wake) = &self.wake {
            drop(wake.signal());
        }
    }

    /// Staging slot `slot` may be read into again (its bytes have left,
    /// or it was never used): the next gather may take it.
    pub fn free_slot(&self, slot: usize) {
        self.lock().free.push_back(slot);
        self.changed.notify_all();
        self.wake();
    }

    /// Gather `g` is carried by a cache lane, beside the engine: it takes
    /// no staging slot, and the gathers after it take theirs as if it had.
    pub fn pass_over(&self, g: usize) {
        let mut state = self.lock();
        if state.slot_of.len() <= g {
            state.slot_of.resize(g + 1, NO_SLOT);
        }
        state.slot_of[g] = IN_CACHE_LANE;
    }

    /// The staging slot gather `g` holds (staged loads, once it is ready).
    pub fn slot_of(&self, g: usize) -> usize {
        self.lock().slot_of[g]
    }

    /// Whether gather `g` may be read into now; a staged gather takes a
    /// free slot here if it holds none, and only once the gather before it
    /// has taken one: with threads of a pool asking out of order, later
    /// gathers could otherwise hold every slot while the first one unfilled
    /// waits for a slot, and a destination that takes gathers in file order
    /// (a verified load) would never free one.
    fn take_ready(&self, state: &mut GateState, g: usize) -> bool {
        if !self.staged {
            return state.ready > g;
        }
        if state.slot_of.len() <= g {
            state.slot_of.resize(g + 1, NO_SLOT);
        }
        if state.slot_of[g] == NO_SLOT {
            if g > 0 && state.slot_of[g - 1] == NO_SLOT {
                return false;
            }
            match state.free.pop_front() {
                Some(slot) => state.slot_of[g] = slot,
                None => return false,
            }
            // The next gather's readers may be waiting for this one's turn.
            self.changed.notify_all();
        }
        true
    }

    /// The next filled gather for a staged destination: the first to
    /// complete, or with `in_file_order` the lowest not yet taken (a
    /// verified load hashes the file in order). Waits at most `timeout`
    /// (`None`: until one is filled); `Ok(None)` when it ran out,
    /// `ECANCELED` when the load failed or was cancelled first.
    pub fn next_filled(
        &self,
        in_file_order: Option<usize>,
        timeout: Option<Duration>,
    ) -> io::Result<Option<usize>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut state = self.lock();
        loop {
            let found = match in_file_order {
                None => state.filled_order.pop_front(),
                Some(g) => {
                    state.filled_order.iter().position(|&f| f == g).and_then(|i| state.filled_order.remove(i))
                }
            };
            if found.is_some() {
                return Ok(found);
            }
            if self.is_cancelled() {
                return Err(io::Error::from_raw_os_error(libc::ECANCELED));
            }
            let wait = match deadline {
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(CANCEL_POLL),
                    _ => return Ok(None),
                },
                None => CANCEL_POLL,
            };
            state = self
                .changed
                .wait_timeout(state, wait)
                .map(|(state, _)| state)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }

    /// Slot `slot` now holds a registered buffer; false when the engine
    /// retired it meanwhile, and the registration must be undone.
    pub fn mark_registered(&self, slot: usize) -> bool {
        self.slots[slot]
            .compare_exchange(SLOT_EMPTY, SLOT_REGISTERED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Whether requests may use slot `slot`'s registered buffer.
    pub fn is_registered(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| s.load(Ordering::Acquire) == SLOT_REGISTERED)
    }

    /// The engine has finished the unit of slot `slot`: it is never
    /// registered from now on. True when it held a buffer, which the caller
    /// unregisters (unpinning early keeps RLIMIT_MEMLOCK use to a few units).
    pub fn retire(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| s.swap(SLOT_RETIRED, Ordering::AcqRel) == SLOT_REGISTERED)
    }

    fn is_retired(&self, slot: usize) -> bool {
        self.slots[slot].load(Ordering::Acquire) == SLOT_RETIRED
    }

    /// The engine is now queueing requests for unit `unit` (called when it
    /// moves on, not per request).
    pub fn reach(&self, unit: usize) {
        self.registering.advance(unit);
    }

    /// The engine has finished, well or not: nothing more is registered.
    pub fn engine_done(&self) {
        self.registering.stop();
    }

    /// Registering stopped: later units use plain addresses.
    pub fn refuse_registration(&self, reason: String) {
        self.lock().registration_refused = Some(reason);
    }

    pub fn registration_refused(&self) -> Option<String> {
        self.lock().registration_refused.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Gathers `0..ready` may now be read into.
    pub fn publish(&self, ready: usize) {
        self.lock().ready = ready;
        self.changed.notify_all();
    }

    /// Populating failed; engines waiting on the gate get this error.
    pub fn fail(&self, err: &io::Error) {
        self.lock().failure = Some((err.raw_os_error(), err.to_string()));
        self.changed.notify_all();
    }

    /// The load failed: stop populating and registering.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
        self.registering.stop();
        self.changed.notify_all();
    }

    /// Whether the load failed or the caller cancelled it.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed) || self.token.is_cancelled()
    }

    /// Whether the caller cancelled the load.
    pub fn caller_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Whether gather `g` is ready, without blocking (a staged gather
    /// takes a free slot if one is, see [`Gate::staged`]).
    pub fn is_ready(&self, g: usize) -> bool {
        let mut state = self.lock();
        self.take_ready(&mut state, g)
    }

    /// The engine has every byte of gather `g`.
    pub fn mark_filled(&self, g: usize) {
        let mut state = self.lock();
        if state.filled.len() <= g {
            state.filled.resize(g + 1, false);
        }
        state.filled[g] = true;
        if self.staged {
            state.filled_order.push_back(g);
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Blocks until the engine has filled gather `g`; `ECANCELED` when the
    /// load failed or was cancelled first.
    pub fn wait_filled(&self, g: usize) -> io::Result<()> {
        self.wait_until(|state| (state.filled.get(g) == Some(&true)).then_some(Ok(())))
    }

    /// Blocks until gather `g` is ready; returns how long it waited. A
    /// populating failure ends the wait with its error, a cancellation (by
    /// the caller, or because the load failed) with `ECANCELED`.
    pub fn wait_for(&self, g: usize) -> io::Result<Duration> {
        let started = Instant::now();
        self.wait_until(|state| {
            if self.take_ready(state, g) {
                return Some(Ok(started.elapsed()));
            }
            let (errno, message) = state.failure.as_ref()?;
            Some(Err(match errno {
                Some(errno) => io::Error::from_raw_os_error(*errno),
                None => io::Error::other(message.clone()),
            }))
        })
    }

    /// Waits on the gate until `outcome` of its state is `Some`, or the load
    /// is cancelled (`ECANCELED`), looking at the token every [`CANCEL_POLL`].
    fn wait_until<T>(
        &self,
        mut outcome: impl FnMut(&mut GateState) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let mut state = self.lock();
        loop {
            if let Some(out) = outcome(&mut state) {
                return out;
            }
            if self.is_cancelled() {
                return Err(io::Error::from_raw_os_error(libc::ECANCELED));
            }
            state = self
                .changed
                .wait_timeout(state, CANCEL_POLL)
                .map(|(state, _)| state)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }
}

/// The registering side of the register-ahead coordination, the same in
/// both directions: unit `u` (gather `u` of an in-place load, window `u` of
/// a save) is registered in slot `u` once the engine has reached unit
/// `u - REGISTER_AHEAD` (the gate's [`Lead`]), so pinning runs beside the
/// I/O yet only a few units are pinned at a time (the engine unregisters
/// each unit it finishes, see [`Gate::retire`]). Runs on the helper thread
/// beside the engine or, without one, on the engine's own thread between
/// its requests ([`RegisterAhead::register_due`] after each
/// [`Gate::reach`]). The first refusal (RLIMIT_MEMLOCK) is kept on the gate
/// and nothing more is registered: later units use plain addresses.
pub(crate) struct RegisterAhead<'a, M: RingMemory> {
    gate: &'a Gate,
    registrar: Option<&'a Registrar<M>>,
    /// The memory range of each unit.
    range_of: &'a dyn Fn(usize) -> Range<usize>,
    /// Time spent in registration calls.
    pub took: Duration,
}

impl<'a, M: RingMemory> RegisterAhead<'a, M> {
    /// Registers the gate's slots (one per unit) with `registrar`.
    pub fn new(
        gate: &'a Gate,
        registrar: &'a Registrar<M>,
        range_of: &'a dyn Fn(usize) -> Range<usize>,
    ) -> Self {
        RegisterAhead { gate, registrar: Some(registrar), range_of, took: Duration::ZERO }
    }

    /// Registers the units below `limit` that are due now, without waiting.
    pub fn register_due(&mut self, limit: usize) {
        while self.registrar.is_some() {
            let Some(unit) = self.gate.registering.claim_due(limit) else { return };
            self.register(unit);
        }
    }

    /// Registers every remaining unit as it falls due; returns after the last
    /// one, a refusal, or when the operation stops.
    pub fn register_rest(&mut self) {
        while self.registrar.is_some() {
            let Some(unit) = self.gate.registering.claim_next() else { return };
            self.register(unit);
        }
    }

    fn register(&mut self, unit: usize) {
        let Some(registrar) = self.registrar else { return };
        if self.gate.is_retired(unit) {
            return; // the engine finished it unregistered: pinning it now is waste
        }
        let started = Instant::now();
        match registrar.register(unit as u32, (self.range_of)(unit)) {
            // Retired between the check and the registration: unpin at once (a
            // failure only keeps the pages pinned until the ring closes).
            Ok(()) if !self.gate.mark_registered(unit) => drop(registrar.unregister(unit as u32)),
            Ok(()) => {}
            Err(err) => {
                self.gate.refuse_registration(uring::register_refusal(&err));
                self.registrar = None;
            }
        }
        self.took += started.elapsed();
    }
}

/// How often the reporting thread passes progress to the caller's callback.
const PROGRESS_INTERVAL: Duration = Duration::from_millis(50);

/// Counts finished bytes. The I/O threads only add to the count; the
/// caller's callback runs on a reporting thread of its own ([`Progress::report`]),
/// so a slow callback delays the next report, never a read.
pub(crate) struct Progress<'a> {
    done: AtomicU64,
    total: u64,
    callback: Option<&'a ProgressFn>,
    finished: Mutex<bool>,
    wake: Condvar,
}

impl<'a> Progress<'a> {
    pub fn new(total: u64, callback: Option<&'a ProgressFn>) -> Self {
        Progress {
            done: AtomicU64::new(0),
            total,
            callback,
            finished: Mutex::new(false),
            wake: Condvar::new(),
        }
    }

    pub fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// The reporting loop: calls the callback with the count every
    /// [`PROGRESS_INTERVAL`] while it grows, until [`Progress::finish`].
    /// Returns at once without a callback.
    pub fn report(&self) {
        let Some(callback) = self.callback else { return };
        let mut reported = 0;
        let mut finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        while !*finished {
            finished = self
                .wake
                .wait_timeout(finished, PROGRESS_INTERVAL)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
            // A save that falls back writes some bytes twice: never past the total.
            let done = self.done().min(self.total);
            if done != reported && !*finished {
                reported = done;
                drop(finished);
                callback(done, self.total);
                finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    /// Runs `work` with a reporting thread beside it ([`Progress::report`];
    /// none without a callback, or when no thread can be created: then only
    /// the last report is made), and once `work` succeeded, the last report
    /// ([`Progress::report_complete`]).
    pub fn reporting<T>(
        total: u64,
        callback: Option<&ProgressFn>,
        work: impl FnOnce(&Progress<'_>) -> Result<T>,
    ) -> Result<T> {
        let progress = Progress::new(total, callback);
        let done = std::thread::scope(|scope| {
            let reporter = callback.and_then(|_| {
                let thread = std::thread::Builder::new().name("dmaload-progress".into());
                thread.spawn_scoped(scope, || progress.report()).ok()
            });
            let done = work(&progress);
            progress.finish();
            // A panicking reporter only means a callback panicked: no bytes are at stake.
            let _ = reporter.map(|r| r.join());
            done
        })?;
        progress.report_complete();
        Ok(done)
    }

    /// Ends the reporting loop (within one callback's time).
    pub fn finish(&self) {
        *self.finished.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.wake.notify_all();
    }

    /// The last report of a load that completed: every byte is done.
    pub fn report_complete(&self) {
        if let Some(callback) = self.callback {
            callback(self.total, self.total);
        }
    }
}

/// Where the engine puts the plan's bytes in the memory it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// In place: plan offset `x` at mapping offset `x`; gather `g` in
    /// registered buffer `g`, registered when populated.
    InPlace,
    /// A ring of `slots` staging slots of `slot_len` bytes each: gather `g`
    /// (one slot's worth) in whichever slot it took from the gate's free
    /// list ([`Gate::slot_of`]), which is registered buffer `slot`.
    Staged { slots: usize, slot_len: usize },
    /// At `base`: plan offset `x` at memory offset `base + x`, inside
    /// memory registered once as buffer 0 by its owner (a capture's block
    /// ring, written run by run through one kept ring).
    Placed { base: usize },
}

impl Layout {
    /// The mapping range that request `req` reads into (`gate` says which
    /// slot a staged gather holds).
    pub fn target(&self, plan: &Plan, gate: &Gate, req: &Request) -> Range<usize> {
        let range = plan.mapping_range(req);
        match *self {
            Layout::InPlace => range,
            Layout::Staged { slot_len, .. } => {
                let g = plan.gather_of(req.start);
                let base = gate.slot_of(g) * slot_len;
                let into = range.start - plan.gather_range(g).start;
                base + into..base + into + range.len()
            }
            Layout::Placed { base } => base + range.start..base + range.end,
        }
    }

    /// The registered buffer that holds gather `g`.
    pub fn buffer_index(&self, gate: &Gate, g: usize) -> u16 {
        match *self {
            Layout::InPlace => g as u16,
            Layout::Staged { .. } => gate.slot_of(g) as u16,
            Layout::Placed { .. } => 0,
        }
    }

    /// Entries of the registered-buffer table the load needs.
    pub fn table_len(&self, plan: &Plan) -> u32 {
        match *self {
            Layout::InPlace => plan.gather_count() as u32,
            Layout::Staged { slots, .. } => slots.min(plan.gather_count()) as u32,
            Layout::Placed { .. } => 1,
        }
    }
}

/// Bytes still to arrive in each gather, counted down by whichever thread
/// completes a read.
pub(crate) struct GatherTally {
    left: Vec<AtomicU64>,
}

impl GatherTally {
    pub fn new(plan: &Plan) -> GatherTally {
        GatherTally { left: (0..plan.gather_count()).map(|g| AtomicU64::new(plan.gather_need(g))).collect() }
    }

    /// Counts `bytes` of gather `g` in; true when that completed it.
    pub fn credit(&self, g: usize, bytes: u64) -> bool {
        bytes > 0 && self.left[g].fetch_sub(bytes, Ordering::AcqRel) == bytes
    }
}

/// How an engine runs, whichever its direction: which engine, how many
/// requests in flight (io_uring) or threads (the pool), and the caller's
/// token.
#[derive(Debug, Clone)]
pub(crate) struct EngineParams {
    pub engine: Engine,
    pub queue_depth: usize,
    pub threads: usize,
    pub cancel: CancelToken,
    /// The device whose reads tune the depth (io_uring only, see
    /// [`crate::tune`]), starting from `queue_depth`.
    pub tune: Option<crate::tune::Device>,
    /// The request size remembered for that device, where one was.
    pub request_size: Option<usize>,
    /// The buffered reads an `auto` load measures against direct ones,
    /// where it does.
    pub read_modes: Option<ReadModes>,
}

/// An `auto` load's choice of read mode, made by its tuner
/// ([`crate::tune::Tuner::choosing_reads`]): direct reads (the setup's
/// file has `O_DIRECT`), or buffered ones with the `buffered` policy
/// (`RWF_DONTCACHE` where the filesystem has it), starting from the mode
/// `remembered` for the device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadModes {
    pub buffered: CachePolicy,
    pub remembered: Option<crate::tune::RememberedRead>,
}

impl EngineParams {
    /// The same, on the pread pool: after io_uring could not run (see
    /// [`workers_refused`]).
    pub fn on_pool(&self) -> EngineParams {
        EngineParams { engine: Engine::PreadPool, ..self.clone() }
    }

    /// The threads an engine of the pool kind uses.
    pub fn pool_threads(&self) -> usize {
        if self.engine == Engine::Read {
            1
        } else {
            self.threads
        }
    }
}

/// What a load reads from, or a save writes to.
#[derive(Clone, Copy)]
pub(crate) enum Input<'a> {
    /// An open file: the io_uring and pread engines.
    File(BorrowedFd<'a>),
    /// An object in a store: the [`object`] engine's GETs.
    Object(&'a crate::object::Object),
}

/// Everything an engine needs to run one plan.
pub(crate) struct Job<'a> {
    pub path: &'a Path,
    pub input: Input<'a>,
    pub plan: &'a Plan,
    pub layout: Layout,
    pub cache: CachePolicy,
    pub gate: &'a Gate,
    pub progress: &'a Progress<'a>,
    pub queue_depth: usize,
    /// Whether io_uring tunes the depth from `queue_depth` as it reads
    /// and then the request size, from `request_size` or the plan's chunk
    /// ([`crate::tune::Tuner`]; the ring must have room for
    /// [`crate::tune::MAX_DEPTH`]).
    pub tune: bool,
    pub request_size: Option<usize>,
    /// Where the tuner chooses between direct and buffered reads.
    pub read_modes: Option<ReadModes>,
}

impl<'a> Job<'a> {
    /// Called once a request's data has all arrived: drops its whole chunk
    /// from the page cache when the policy says so.
    pub fn finish_request(&self, req: &Request) {
        // Buffered windows of an `auto` load with the fadvise policy drop
        // their chunks too (for a chunk read direct, the advice finds
        // nothing to drop).
        let fadvise = self.cache == CachePolicy::Fadvise
            || self.read_modes.is_some_and(|modes| modes.buffered == CachePolicy::Fadvise);
        if let (true, Input::File(file)) = (fadvise, self.input) {
            let chunk = self.plan.chunk_request(self.plan.chunk_index(req.start));
            // Advice only: a failure leaves pages cached but loses no data.
            let _ = sys::file::fadvise(file, chunk.start, chunk.end - chunk.start, libc::POSIX_FADV_DONTNEED);
        }
    }

    /// The open file of a file engine; an object is an error (never met:
    /// the pipeline runs an object on its own engine).
    pub fn file(&self) -> Result<BorrowedFd<'a>> {
        match self.input {
            Input::File(file) => Ok(file),
            Input::Object(_) => Err(Error::new(
                ErrorKind::InvalidInput,
                "load",
                self.path,
                "a file engine cannot read an object",
            )),
        }
    }

    /// A failed request of the plan's direction at file `offset`.
    pub fn transfer_error(&self, offset: u64, err: io::Error) -> Error {
        Error::io(self.plan.direction.op(), self.path, err).at(offset)
    }

    /// A failed wait for gather memory: the populating error, or the caller's
    /// cancellation.
    pub fn wait_error(&self, offset: u64, err: io::Error) -> Error {
        if self.gate.caller_cancelled() {
            return self.cancelled(offset);
        }
        Error::io("populate memory", self.path, err).at(offset)
    }

    /// The error of a transfer the caller cancelled, `offset` being the
    /// first byte not yet requested.
    pub fn cancelled(&self, offset: u64) -> Error {
        let op = match self.plan.direction {
            Direction::Read => "load",
            Direction::Write => "save",
        };
        cancelled_error(op, self.path, offset)
    }
}

/// The error of an operation the caller cancelled through its
/// [`CancelToken`].
pub(crate) fn cancelled_error(op: &'static str, path: &Path, offset: u64) -> Error {
    Error::new(ErrorKind::Cancelled, op, path, "cancelled by the caller; nothing was kept").at(offset)
}

/// What an engine reports back.
#[derive(Debug, Default)]
pub(crate) struct EngineRun {
    /// Time spent blocked waiting for gathers to be populated.
    pub waited_for_memory: Duration,
    /// Fallbacks the engine took while running (e.g. registration refused).
    pub fallbacks: Vec<Fallback>,
    /// The engine that actually did the work.
    pub engine: Engine,
    /// How the depth was tuned, when it was.
    pub tuner: Option<crate::tune::Tuner>,
    /// How an object load's GETs were tuned, when they were.
    pub gets: Option<crate::tune::GetTuner>,
}

pub(crate) type EngineResult = Result<EngineRun>;

/// The fallback taken when the kernel has no sparse registered-buffer
/// table: io_uring with plain addresses.
pub(crate) fn no_sparse_table(err: &io::Error) -> Fallback {
    Fallback::new(
        Engine::UringFixed.name(),
        Engine::Uring.name(),
        format!("cannot create a sparse registered-buffer table (Linux 5.19+): {err}"),
    )
}

/// The fallback taken when the thread that registers buffers beside the
/// I/O cannot get its duplicate of the ring's fd: io_uring with plain
/// addresses.
pub(crate) fn no_registrar(err: &io::Error) -> Fallback {
    Fallback::new(
        Engine::UringFixed.name(),
        Engine::Uring.name(),
        format!("no free file descriptor to register buffers through ({err}): RLIMIT_NOFILE is too small"),
    )
}

/// The fallback taken, by a load or a save, when `io_uring_setup` failed
/// the way [`io_uring_unavailable`] accepts: the pread pool, with why.
pub(crate) fn no_uring(from: Engine, err: &io::Error) -> Fallback {
    Fallback::new(from.name(), Engine::PreadPool.name(), uring_unavailable_reason(err))
}

/// Whether `err`, from a run of `engine` with the caller's token `cancel`,
/// is io_uring cancelling a request for want of io-wq worker threads
/// (RLIMIT_NPROC, the cgroup's pids.max) rather than the caller's
/// cancellation: the run may go again on the pread pool.
pub(crate) fn io_wq_refused(engine: Engine, cancel: &CancelToken, err: &Error) -> bool {
    matches!(engine, Engine::UringFixed | Engine::Uring)
        && err.raw_os_error() == Some(libc::ECANCELED)
        && !cancel.is_cancelled()
}

/// The fallback taken when io_uring cancelled a request (`err`) because
/// its io-wq could not create a worker thread (RLIMIT_NPROC, the cgroup's
/// pids.max): the same transfer again on the pread pool.
pub(crate) fn workers_refused(from: Engine, direction: Direction, err: &Error) -> Fallback {
    Fallback::new(
        from.name(),
        Engine::PreadPool.name(),
        format!(
            "io_uring cancelled a {} ({err}): its worker threads could not be created \
             (RLIMIT_NPROC or the cgroup's pids.max)",
            direction.op()
        ),
    )
}

/// Whether a failed `io_uring_setup` means io_uring is unavailable to this
/// process (old kernel, `kernel.io_uring_disabled`, seccomp, or a
/// RLIMIT_MEMLOCK or RLIMIT_NOFILE too small for the ring itself), not a bug.
pub(crate) fn io_uring_unavailable(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(
            libc::ENOSYS
                | libc::EPERM
                | libc::EACCES
                | libc::EOPNOTSUPP
                | libc::ENOMEM
                | libc::EMFILE
                | libc::ENFILE
        )
    )
}

/// Why `io_uring_setup` failed, in words a user can act on.
fn uring_unavailable_reason(err: &io::Error) -> String {
    if err.raw_os_error() == Some(libc::ENOMEM) {
        format!(
            "io_uring_setup failed with ENOMEM: the ring's own memory counts against RLIMIT_MEMLOCK \
             ({}); raise it (ulimit -l) or grant CAP_IPC_LOCK",
            uring::memlock_limit_words()
        )
    } else if matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
        format!(
            "io_uring_setup found no free file descriptor for the ring ({err}): RLIMIT_NOFILE is too small"
        )
    } else {
        format!("io_uring is unavailable ({err}): old kernel, kernel.io_uring_disabled, or a seccomp filter")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::mem::MappingWriter;
    use crate::sys::uring::Ring;

    #[test]
    fn units_are_registered_only_near_the_engine_and_unregistered_exactly_once() {
        const UNIT: usize = 4096;
        let mut memory = vec![0u8; 8 * UNIT + UNIT];
        let start = (memory.as_ptr() as usize).next_multiple_of(UNIT) - memory.as_ptr() as usize;
        let mem = MappingWriter::over(&mut memory[start..start + 8 * UNIT]);
        let mut ring = match Ring::new(4, mem) {
            Ok(ring) => ring,
            Err(err) => return eprintln!("SKIP units_are_registered_only_near_the_engine: io_uring: {err}"),
        };
        if let Err(err) = ring.register_slots(8) {
            return eprintln!("SKIP units_are_registered_only_near_the_engine: sparse table: {err}");
        }
        let registrar = ring.registrar().unwrap();
        let gate = Gate::new(CancelToken::new(), 8);
        let range_of = |u: usize| u * UNIT..(u + 1) * UNIT;
        let mut ahead = RegisterAhead::new(&gate, &registrar, &range_of);
        let registered = || (0..8).filter(|&u| gate.is_registered(u)).collect::<Vec<_>>();

        ahead.register_due(8);
        assert_eq!(registered(), [0, 1, 2], "two ahead of unit 0");
        gate.reach(1);
        ahead.register_due(3);
        assert_eq!(registered(), [0, 1, 2], "not past the units ready so far");
        // Unit 3 finished before its turn came: it is never pinned.
        assert!(!gate.retire(3));
        gate.reach(2);
        ahead.register_due(8);
        assert_eq!(registered(), [0, 1, 2, 4], "a retired unit is skipped");
        assert!(gate.retire(0), "the engine unregisters a unit that held a buffer");
        assert!(!gate.retire(0), "and only once");
        assert!(!gate.mark_registered(0), "a registration racing a retirement is undone by its thread");
        gate.reach(5);
        ahead.register_rest();
        assert_eq!(registered(), [1, 2, 4, 5, 6, 7]);
        assert!(gate.registration_refused().is_none());
    }

    /// Staging slots go to gathers in file order, whichever gather's reader
    /// asks first: a pool thread that reached gather 1 before the one on
    /// gather 0 asked waits, so gather 0 is never left without a slot
    /// that later gathers took (a verified load, taking gathers in file
    /// order, would then wait for ever).
    #[test]
    fn staging_slots_go_to_gathers_in_file_order() {
        let gate = Gate::staged(CancelToken::new(), 2);
        gate.free_slot(0);
        gate.free_slot(1);
        assert!(!gate.is_ready(1), "gather 1 before gather 0 took a slot");
        assert!(!gate.is_ready(2));
        assert!(gate.is_ready(0));
        assert!(gate.is_ready(1));
        assert!(!gate.is_ready(2), "no slot left");
        assert_eq!((gate.slot_of(0), gate.slot_of(1)), (0, 1));
        gate.free_slot(0);
        assert!(gate.is_ready(2));
        assert_eq!(gate.slot_of(2), 0);
    }
}
