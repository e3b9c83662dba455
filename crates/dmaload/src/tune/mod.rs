//! The io_uring queue depth and request size, tuned by measurement: a
//! direct-I/O load left at the default depth starts at the depth and
//! request size remembered for its block device (the default depth and the
//! plan's chunk on a device not seen before) and hill-climbs them, the
//! depth first.
//! After a first window of warm-up, each trial of a new depth (double the
//! kept one, or half once doubling did not pay) alternates windows at the
//! kept depth and at the trial one, kept, trial, kept, trial, so a disk
//! whose speed drifts during the load favours neither; the trial depth is
//! kept only when its slower window reads at least [`GAIN`] times faster
//! than the kept depth's faster one (a clear gain, not one lucky window),
//! and the climb goes on in that direction; the first trial that gains too
//! little (after the other direction was tried, if the first trial lost)
//! ends it, and so does the engine waiting for a gather being populated
//! in place: the reads are then not what limits the load, and no depth can
//! be measured.
//!
//! A staged load (reads through the slots of a staging ring, handed on to
//! a GPU or another sink) is tuned too ([`Tuner::in_ring`]): each request
//! in flight holds a slot, so the depth never climbs past the chunks the
//! ring holds (nor at all where it holds no more than [`MIN_DEPTH`]), and
//! a slot not yet free is the destination's back-pressure, which does not
//! end the climb: where the destination is slower than the disk, every
//! trial measures it and none gains, so the climb settles at the depth and
//! request size it started from after a fair trial of each. Its requests
//! start at the whole slot: a request size remembered for the device was
//! measured with the depth's requests in flight, and a smaller request in
//! each slot would only keep fewer bytes in flight.
//!
//! Once the depth has settled, the request size climbs the same way
//! (trials of half and double, [`GAIN`] to keep one) between
//! [`MIN_REQUEST`] and the plan's chunk: never past it, since a request
//! cannot span two chunks (a staging slot comes from a free list, so the
//! file's next chunk is not the next memory; a fixed read must stay in one
//! registered buffer; the plan's gathers and slots are laid out from the
//! chunk before the first read). A smaller size is the engine asking for
//! only that much of a chunk's request: the completion is read against the
//! whole request, and the rest resumed as after a short read. Sizes are
//! tried only where the chunk is a power of two, so every halving stays
//! whole pages and alignment blocks. The depth and size kept are the
//! report's `queue_depth` and `request_size`. When either is not what the
//! load started from, each that a trial measured is remembered for the
//! device in `$XDG_CACHE_HOME/dmaload/tuning` (one whose trial the load
//! did not reach keeps what was remembered before: where a climb starts
//! is not a measurement).
//!
//! An `auto` load whose file takes direct I/O chooses between direct and
//! buffered reads the same way, before the depth ([`Tuner::choosing_reads`]):
//! after the warm-up, four windows alternate direct, buffered, direct,
//! buffered on the one open file (the engine flips `O_DIRECT` on its own
//! file description between windows, once the reads in flight are done,
//! and times each window from there: every window of the trial starts
//! with nothing in flight and pays its mode's ramp-up; timed from a
//! mid-stream point instead, a burst of completions reaped together could
//! make a window of a staging ring's large reads look instant; and no
//! more than [`TRIAL_IN_FLIGHT`] bytes are in flight while the mode is
//! chosen, so a window is timed with the pipe full, not mostly filling
//! it), and buffered is kept only when its
//! slower window reads at least [`GAIN`] times faster than direct's faster
//! one. The mode kept, and the rate of its slower window, are remembered
//! beside the depth (`read=direct|buffered read_rate=BYTES_PER_SECOND`);
//! a later load on the device reads in that mode from its first window
//! and measures one window after the warm-up: only when it reads
//! [`SLOWER`] times slower than remembered are the two modes measured
//! again.
//!
//! The module's files:
//! - `climb.rs`: the hill-climb of one setting, and the limits it and the memory file share;
//! - `memory.rs`: the memory file, a line per device's reads or endpoint's GETs;
//! - `gets.rs`: the climb of an object load's GETs ([`GetTuner`]);
//! - this file: the climb of a disk's reads ([`Tuner`]) and its read mode.

mod climb;
mod gets;
mod memory;

use std::time::Instant;

use climb::{Climb, Step, Windows, GAIN, MIN_DEPTH, MIN_REQUEST, TRIAL_WINDOWS};

pub(crate) use climb::MAX_DEPTH;
pub(crate) use gets::GetTuner;
pub(crate) use memory::{
    memory_file, remember, remember_gets, remembered, remembered_gets, Device, Endpoint, ReadMode,
    Remembered, RememberedGets, RememberedRead,
};

/// Bytes of one measured window.
const WINDOW: u64 = 128 << 20;
/// How much slower than remembered a load's window must read for the read
/// mode to be measured again: clearly slower, not a disk's usual drift.
const SLOWER: f64 = 1.5;
/// The most bytes in flight while the read mode is chosen (its warm-up,
/// check and trial windows): a quarter of a window, so each window is
/// timed with the reads' pipe full for most of it. A staging ring's 32
/// requests of 16 MiB would hold 512 MiB in flight, four windows: those
/// complete in bursts (a disk serving them side by side finishes them
/// together), and a window then times a ramp and a burst, not a rate.
const TRIAL_IN_FLIGHT: usize = (WINDOW / 4) as usize;

/// Where the choice of an `auto` load's read mode is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ModeStep {
    /// The first window: requests ramping up, not measured.
    WarmUp,
    /// Reading one window in the remembered mode, which read at
    /// `remembered` bytes per second.
    Check {
        remembered: f64,
    },
    /// Alternating windows of the kept mode and the other one.
    Trial,
    Settled,
}

/// How the read mode of a load was chosen, for its report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum ReadChoice {
    /// Not by this tuner: the mode asked for, or a load that ended (or was
    /// found memory-bound) before the choice was made.
    NotChosen,
    /// The device's remembered mode (which read as fast as remembered,
    /// where a window was measured).
    Remembered,
    /// Measured: the slower window of each mode (bytes per second); after
    /// a window of the remembered mode read at `slow`, clearly slower than
    /// the `remembered` rate, where that started the measuring.
    Measured { direct: f64, buffered: f64, recheck: Option<(f64, f64)> },
}

/// The choice between direct and buffered reads (see the module's comment).
#[derive(Debug)]
struct ModeChoice {
    kept: ReadMode,
    step: ModeStep,
    window: usize,
    at_kept: Windows,
    at_other: Windows,
    remembered: Option<RememberedRead>,
    /// The check window's rate, where it was clearly slower than remembered.
    recheck: Option<(f64, f64)>,
    choice: ReadChoice,
}

impl ModeChoice {
    /// No choice to make: the reads stay direct.
    fn fixed() -> ModeChoice {
        ModeChoice {
            kept: ReadMode::Direct,
            step: ModeStep::Settled,
            window: 0,
            at_kept: Windows::NONE,
            at_other: Windows::NONE,
            remembered: None,
            recheck: None,
            choice: ReadChoice::NotChosen,
        }
    }

    /// A choice starting from the mode remembered for the device, else direct.
    fn new(remembered: Option<RememberedRead>) -> ModeChoice {
        ModeChoice {
            kept: remembered.map_or(ReadMode::Direct, |read| read.mode),
            step: ModeStep::WarmUp,
            remembered,
            choice: if remembered.is_some() { ReadChoice::Remembered } else { ReadChoice::NotChosen },
            ..ModeChoice::fixed()
        }
    }

    fn value(&self) -> ReadMode {
        match self.step {
            ModeStep::Trial if self.window % 2 == 1 => self.kept.other(),
            _ => self.kept,
        }
    }

    fn window_done(&mut self, rate: f64) {
        match self.step {
            ModeStep::WarmUp => match self.remembered {
                Some(read) => self.step = ModeStep::Check { remembered: read.rate as f64 },
                None => self.step = ModeStep::Trial,
            },
            ModeStep::Check { remembered } => {
                if rate * SLOWER < remembered {
                    self.recheck = Some((rate, remembered));
                    self.step = ModeStep::Trial;
                } else {
                    self.settle(ReadChoice::Remembered);
                }
            }
            ModeStep::Trial => {
                let into = if self.window % 2 == 0 { &mut self.at_kept } else { &mut self.at_other };
                into.add(rate);
                self.window += 1;
                if self.window == TRIAL_WINDOWS {
                    let (kept, other) = (self.at_kept.slowest, self.at_other.slowest);
                    let (direct, buffered) =
                        if self.kept == ReadMode::Direct { (kept, other) } else { (other, kept) };
                    if self.at_other.slowest >= self.at_kept.fastest * GAIN {
                        (self.kept, self.at_kept) = (self.kept.other(), self.at_other);
                    }
                    self.settle(ReadChoice::Measured { direct, buffered, recheck: self.recheck });
                }
            }
            ModeStep::Settled => {}
        }
    }

    /// Ends the choice at the kept mode.
    fn settle(&mut self, choice: ReadChoice) {
        self.step = ModeStep::Settled;
        self.choice = choice;
    }

    /// What to remember of the choice: the mode measured and its slower
    /// window's rate, or the remembered one kept.
    fn to_remember(&self) -> Option<RememberedRead> {
        match self.choice {
            ReadChoice::Measured { .. } => {
                Some(RememberedRead { mode: self.kept, rate: self.at_kept.slowest.max(1.0).round() as u64 })
            }
            ReadChoice::Remembered | ReadChoice::NotChosen => self.remembered,
        }
    }
}

/// The hill-climb of one load's reads: the read mode first (an `auto`
/// load's), then the queue depth, then, once it has settled, the request
/// size (see the module's comment).
#[derive(Debug)]
pub(crate) struct Tuner {
    mode: ModeChoice,
    depth: Climb,
    request: Climb,
    /// The reads fill the slots of a staging ring (see [`Tuner::in_ring`]).
    staged: bool,
    /// A window of the read modes' trial is next: the reads in flight
    /// (of the mode before) are not measured, and the window starts once
    /// they are done ([`Tuner::flipped`]).
    flipping: bool,
    /// Windows measured while the climb was not settled.
    windows: usize,
    window_bytes: u64,
    window_started: Instant,
}

impl Tuner {
    /// A climb from `depth` requests of `request` bytes (the size
    /// remembered for the device, or the plan's chunk), its first window
    /// starting at `now`. `chunk` is the plan's: no request is larger, and
    /// sizes are tried only where it is a power of two (so every halving
    /// stays a whole number of pages and alignment blocks).
    pub fn new(depth: usize, request: usize, chunk: usize, now: Instant) -> Tuner {
        let (min, start) = if chunk.is_power_of_two() && chunk >= MIN_REQUEST {
            let remembered = if request.is_power_of_two() { request } else { chunk };
            (MIN_REQUEST, remembered)
        } else {
            (chunk, chunk)
        };
        Tuner {
            mode: ModeChoice::fixed(),
            depth: Climb::new(depth, MIN_DEPTH, MAX_DEPTH),
            request: Climb::new(start, min, chunk),
            staged: false,
            flipping: false,
            windows: 0,
            window_bytes: 0,
            window_started: now,
        }
    }

    /// The tuner of reads through a staging ring that holds `chunks` of
    /// the plan's chunks: a request in flight holds a slot until the sink
    /// has taken it, so the depth starts at no more than `chunks` and
    /// depths past them are never tried (nor any depth, where the ring
    /// holds no more than [`MIN_DEPTH`] chunks), and waiting for a slot is
    /// the destination's back-pressure, not a reason to stop measuring
    /// ([`Tuner::memory_bound`]). Requests start at the whole chunk, not
    /// at a size remembered for the device: that size was measured with
    /// the depth's requests in flight, and a smaller request in each slot
    /// only keeps fewer bytes in flight.
    pub fn in_ring(mut self, chunks: usize) -> Tuner {
        let start = self.depth.start.min(chunks.max(1));
        self.depth = Climb::new(start, MIN_DEPTH.min(start), MAX_DEPTH.min(chunks).max(start));
        if chunks <= MIN_DEPTH {
            self.depth.step = Step::Settled;
        }
        self.request = Climb::new(self.request.max, self.request.min, self.request.max);
        self.staged = true;
        self
    }

    /// The tuner of an `auto` load of `bytes` that may read direct or
    /// buffered: it measures both before the depth, unless `remembered`
    /// names the mode the device read fastest in (see the module's
    /// comment). A load too short to finish the measuring (or the check of
    /// the remembered mode) reads in the remembered mode, else direct,
    /// without it: a trial it cannot finish would cost its slower windows
    /// every time and remember nothing.
    pub fn choosing_reads(mut self, remembered: Option<RememberedRead>, bytes: u64) -> Tuner {
        let in_flight = (choosing_depth(self.depth.start, self.request.start) * self.request.start) as u64;
        let trials = TRIAL_WINDOWS as u64;
        let needed = match remembered {
            Some(_) => 2 * WINDOW,
            None => (1 + trials) * WINDOW + trials * in_flight,
        };
        self.mode = ModeChoice::new(remembered);
        if bytes < needed {
            self.mode.step = ModeStep::Settled;
        }
        self
    }

    /// How to read now.
    pub fn read_mode(&self) -> ReadMode {
        self.mode.value()
    }

    /// The engine drained the reads in flight and reads in
    /// [`Tuner::read_mode`] from `now`: the next window starts, so that
    /// each window measures reads of one mode from none in flight (a
    /// staging ring's reads in flight may be several windows' worth).
    pub fn flipped(&mut self, now: Instant) {
        self.flipping = false;
        (self.window_bytes, self.window_started) = (0, now);
    }

    /// Whether the engine is to let the reads in flight finish, then call
    /// [`Tuner::flipped`], before reading on.
    pub fn draining(&self) -> bool {
        self.flipping
    }

    /// The read mode measured (or remembered) the faster.
    pub fn kept_read_mode(&self) -> ReadMode {
        self.mode.kept
    }

    /// How the read mode was chosen.
    pub fn read_choice(&self) -> ReadChoice {
        self.mode.choice
    }

    /// The read mode to remember for the device, where one was chosen.
    pub fn read_to_remember(&self) -> Option<RememberedRead> {
        self.mode.to_remember()
    }

    /// The depth to keep in flight now: while the read mode is chosen, no
    /// more requests than [`TRIAL_IN_FLIGHT`] bytes allow.
    pub fn depth(&self) -> usize {
        match self.mode.step {
            ModeStep::Settled => self.depth.value(),
            _ => choosing_depth(self.depth.value(), self.request()),
        }
    }

    /// The most bytes one request may ask for now.
    pub fn request(&self) -> usize {
        self.request.value()
    }

    /// The best depth measured so far (the start one until a trial gains).
    pub fn kept(&self) -> usize {
        self.depth.kept
    }

    /// The best request size measured so far.
    pub fn kept_request(&self) -> usize {
        self.request.kept
    }

    /// The depth to remember: the kept one, where a trial measured it.
    pub fn tuned_depth(&self) -> Option<usize> {
        Some(self.depth.kept).filter(|_| self.depth.measured)
    }

    /// The request size to remember: the kept one, where a trial measured it.
    pub fn tuned_request(&self) -> Option<usize> {
        Some(self.request.kept).filter(|_| self.request.measured)
    }

    /// Whether there is something new to remember: the depth or the
    /// request size differs from where the climb started, or the read
    /// modes were measured.
    pub fn moved(&self) -> bool {
        self.depth.kept != self.depth.start
            || self.request.kept != self.request.start
            || matches!(self.mode.choice, ReadChoice::Measured { .. })
    }

    /// Windows of reads measured before the climb settled (or the load
    /// ended): 1 is the warm-up alone.
    pub fn windows(&self) -> usize {
        self.windows
    }

    fn settled(&self) -> bool {
        self.mode.step == ModeStep::Settled
            && self.depth.step == Step::Settled
            && self.request.step == Step::Settled
    }

    /// Counts `bytes` done at `now`; at a window's end, moves the climb
    /// on. Returns the depth to keep in flight from now ([`Tuner::request`]
    /// says the request size).
    pub fn observe(&mut self, bytes: u64, now: Instant) -> usize {
        if self.settled() || self.flipping {
            return self.depth();
        }
        self.window_bytes += bytes;
        if self.window_bytes < WINDOW {
            return self.depth();
        }
        let seconds = now.saturating_duration_since(self.window_started).as_secs_f64();
        let rate = self.window_bytes as f64 / seconds.max(1e-9);
        (self.window_bytes, self.window_started) = (0, now);
        self.windows += 1;
        if self.mode.step != ModeStep::Settled {
            self.mode.window_done(rate);
            self.flipping = self.mode.step == ModeStep::Trial;
            if self.mode.step == ModeStep::Settled {
                // The warm-up is behind: the depth's trials start now.
                if self.depth.step == Step::WarmUp {
                    self.depth.start_trial(true, false);
                } else if self.request.step == Step::WarmUp {
                    self.request.start_trial(true, false);
                }
            }
        } else if self.depth.step != Step::Settled {
            self.depth.window_done(rate);
            if self.depth.step == Step::Settled && self.request.step == Step::WarmUp {
                // The requests ramped long ago: straight to a trial.
                self.request.start_trial(true, false);
            }
        } else {
            self.request.window_done(rate);
        }
        self.depth()
    }

    /// The engine waited for memory, not for reads: past the warm-up and
    /// the read mode's choice, both climbs end at the kept values (a wait
    /// during the choice does not end it: the reads refilled after a
    /// mode's flip may run ahead of the memory for a moment, and where
    /// memory is what limits the load, neither mode reads faster and
    /// direct reads stay), unless the memory is a staging
    /// ring's slot ([`Tuner::in_ring`]), which frees as fast as the
    /// destination takes it: the trials measure that. Returns the depth to
    /// keep in flight.
    pub fn memory_bound(&mut self) -> usize {
        if !self.staged && self.windows > 0 && self.mode.step == ModeStep::Settled {
            self.depth.step = Step::Settled;
            self.request.step = Step::Settled;
        }
        self.depth()
    }
}

/// The depth of `request`-byte reads while the read mode is chosen: at
/// most `depth`, and no more than [`TRIAL_IN_FLIGHT`] bytes in flight (one
/// request at least).
fn choosing_depth(depth: usize, request: usize) -> usize {
    depth.min(TRIAL_IN_FLIGHT / request.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    /// Runs windows through a tuner whose reads go at `rate_of(depth,
    /// request)` bytes per second until it settles; returns the (depth,
    /// request size) of each window and the tuner. Requests start at
    /// `request` in a plan of `chunk`-byte chunks.
    fn climb_both(
        start: usize,
        (request, chunk): (usize, usize),
        rate_of: impl Fn(usize, usize) -> f64,
    ) -> (Vec<(usize, usize)>, Tuner) {
        let mut now = Instant::now();
        let mut tuner = Tuner::new(start, request, chunk, now);
        let mut windows = Vec::new();
        while !tuner.settled() && windows.len() < 64 {
            windows.push((tuner.depth(), tuner.request()));
            now += Duration::from_secs_f64(WINDOW as f64 / rate_of(tuner.depth(), tuner.request()));
            tuner.observe(WINDOW, now);
        }
        (windows, tuner)
    }

    /// [`climb_both`] with the request size fixed (1 MiB chunks, the
    /// smallest size tried): the depth's climb alone.
    fn climb(start: usize, rate_of: impl Fn(usize) -> f64) -> (Vec<usize>, Tuner) {
        let (windows, tuner) = climb_both(start, (1 << 20, 1 << 20), |depth, _| rate_of(depth));
        (windows.into_iter().map(|(depth, _)| depth).collect(), tuner)
    }

    #[test]
    fn a_deeper_queue_that_reads_clearly_faster_is_kept_and_the_climb_stops_where_gains_end() {
        // Faster up to 32, flat beyond.
        let (windows, tuner) = climb(16, |d| d.min(32) as f64 * 1e7);
        assert_eq!(windows, [16, 16, 32, 16, 32, 32, 64, 32, 64]);
        assert_eq!((tuner.depth(), tuner.kept()), (32, 32));
    }

    #[test]
    fn without_a_clear_gain_either_way_the_start_depth_stays() {
        // 5% faster deeper, 5% slower shallower: neither is clear.
        let (windows, tuner) = climb(32, |d| 1e9 * if d > 32 { 1.05 } else { d as f64 / 32.0 * 0.05 + 0.95 });
        assert_eq!(windows, [32, 32, 64, 32, 64, 32, 16, 32, 16]);
        assert_eq!((tuner.depth(), tuner.kept()), (32, 32));
    }

    #[test]
    fn the_climb_ends_at_its_limit() {
        let (windows, tuner) = climb(32, |d| d as f64 * 1e7);
        assert_eq!(windows, [32, 32, 64, 32, 64]);
        assert_eq!(tuner.kept(), MAX_DEPTH);
    }

    #[test]
    fn a_shallower_queue_that_reads_clearly_faster_is_kept() {
        let (windows, tuner) = climb(64, |d| 1e9 / d as f64);
        assert_eq!(windows, [64, 64, 32, 64, 32, 32, 16, 32, 16]);
        assert_eq!(tuner.kept(), MIN_DEPTH);
    }

    #[test]
    fn a_trial_that_wins_one_window_by_chance_and_loses_the_other_is_not_kept() {
        // The trial's first window lands on a fast spell (30% faster than
        // the kept depth's), its second does not.
        let mut now = Instant::now();
        let mut tuner = Tuner::new(32, 1 << 20, 1 << 20, now);
        let seconds = [0.1, 0.1, 0.077, 0.1, 0.095];
        for s in seconds {
            now += Duration::from_secs_f64(s);
            tuner.observe(WINDOW, now);
        }
        assert_eq!(tuner.kept(), 32);
        assert_eq!(tuner.depth(), 32, "the next trial starts at the kept depth");
        assert_eq!(tuner.depth.trial, 16, "and tries half of it");
    }

    #[test]
    fn waiting_for_memory_ends_the_climb_at_the_kept_depth() {
        let now = Instant::now();
        let mut tuner = Tuner::new(32, 1 << 20, 1 << 20, now);
        assert_eq!(tuner.memory_bound(), 32, "waits in the warm-up (the first gathers) do not count");
        tuner.observe(WINDOW, now + Duration::from_millis(10));
        assert_eq!(tuner.observe(WINDOW, now + Duration::from_millis(20)), 64);
        assert_eq!(tuner.memory_bound(), 32);
        assert_eq!(tuner.observe(WINDOW, now + Duration::from_millis(21)), 32, "settled");
        assert_eq!(tuner.kept(), 32);
    }

    /// [`climb_both`] for reads through a staging ring of `ring` chunks
    /// of `chunk` bytes, starting at `start` requests of the whole chunk:
    /// before every window the engine finds the next slot still with the
    /// sink ([`Tuner::memory_bound`]), as it does once the ring is full.
    fn climb_staged(
        start: usize,
        (ring, chunk): (usize, usize),
        rate_of: impl Fn(usize, usize) -> f64,
    ) -> (Vec<(usize, usize)>, Tuner) {
        let mut now = Instant::now();
        let mut tuner = Tuner::new(start, chunk, chunk, now).in_ring(ring);
        let mut windows = Vec::new();
        while !tuner.settled() && windows.len() < 64 {
            tuner.memory_bound();
            windows.push((tuner.depth(), tuner.request()));
            now += Duration::from_secs_f64(WINDOW as f64 / rate_of(tuner.depth(), tuner.request()));
            tuner.observe(WINDOW, now);
        }
        (windows, tuner)
    }

    /// A disk whose reads go faster with more bytes in flight, up to 256
    /// MiB (bytes per second), behind a ring of `ring` chunks (no more are
    /// ever in flight) and a destination that takes `link` bytes per
    /// second.
    fn staged_rate(ring: usize, link: f64) -> impl Fn(usize, usize) -> f64 {
        move |depth, request| ((depth.min(ring) * request).min(256 << 20) as f64 * 8.0).min(link)
    }

    #[test]
    fn a_staged_load_behind_a_slow_destination_settles_where_it_started_after_a_fair_trial() {
        // 32 slots of 16 MiB at depth 32 (a CLI load to cuda:0), the
        // destination slower than the disk at every depth tried: a trial
        // of each setting, neither kept, never settling at the first wait.
        let (windows, tuner) = climb_staged(32, (32, 16 << 20), staged_rate(32, 0.5e9));
        let trials: Vec<(usize, usize)> =
            windows.iter().map(|&(depth, request)| (depth, request >> 20)).collect();
        // No depth past the ring's 32 slots: half first, then smaller requests.
        assert_eq!(
            trials,
            [(32, 16), (32, 16), (16, 16), (32, 16), (16, 16), (32, 16), (32, 8), (32, 16), (32, 8)]
        );
        assert_eq!((tuner.kept(), tuner.kept_request(), tuner.windows()), (32, 16 << 20, 9));
        assert!(!tuner.moved(), "nothing to remember");
    }

    #[test]
    fn a_staged_load_whose_disk_reads_faster_deeper_climbs_to_the_rings_size_and_no_further() {
        // Remembered at depth 16; the disk gains up to 256 MiB in flight,
        // which the ring of 32 chunks of 8 MiB allows: the climb keeps
        // 32 and tries no deeper than the ring.
        let (windows, tuner) = climb_staged(16, (32, 8 << 20), staged_rate(32, f64::INFINITY));
        let depths: Vec<usize> = windows.iter().map(|&(depth, _)| depth).collect();
        assert_eq!(depths[..5], [16, 16, 32, 16, 32]);
        assert!(depths.iter().all(|&depth| depth <= 32), "never deeper than the ring: {depths:?}");
        assert_eq!((tuner.kept(), tuner.kept_request()), (32, 8 << 20));
        assert!(tuner.moved());
    }

    #[test]
    fn a_staged_load_of_a_ring_that_holds_more_chunks_climbs_past_the_start_depth() {
        // 128 chunks of 2 MiB: depth 64 fits; the disk gains up to 256 MiB
        // in flight, 128 requests of 2 MiB, capped at the climb's limit.
        let (windows, tuner) = climb_staged(32, (128, 2 << 20), staged_rate(128, f64::INFINITY));
        assert_eq!(windows[..5].iter().map(|&(d, _)| d).collect::<Vec<_>>(), [32, 32, 64, 32, 64]);
        assert_eq!((tuner.kept(), tuner.kept_request()), (MAX_DEPTH, 2 << 20));
    }

    #[test]
    fn a_ring_of_few_slots_tunes_the_request_size_alone() {
        // Four slots: the depth is the ring's, and no other is tried.
        let (windows, tuner) = climb_staged(32, (4, 16 << 20), |_, request| request as f64 * 100.0);
        assert!(windows.iter().all(|&(depth, _)| depth == 4));
        assert_eq!(windows.iter().map(|&(_, r)| r >> 20).collect::<Vec<_>>(), [16, 16, 8, 16, 8]);
        assert_eq!(tuner.kept_request(), 16 << 20);
    }

    #[test]
    fn a_load_shorter_than_a_trial_keeps_its_start_depth() {
        let now = Instant::now();
        let mut tuner = Tuner::new(32, 1 << 20, 1 << 20, now);
        for k in 1..=4 {
            tuner.observe(WINDOW, now + Duration::from_millis(10 * k));
        }
        assert_eq!((tuner.depth(), tuner.kept()), (64, 32));
    }

    #[test]
    fn once_the_depth_settles_smaller_requests_that_read_clearly_faster_are_kept() {
        // Depth flat; each halving down to 4 MiB reads 20% faster, 2 MiB
        // no faster than 4.
        let rate = |_, request: usize| 1e9 * 1.2f64.powi(4 - (request.max(4 << 20) >> 20).ilog2() as i32);
        let (windows, tuner) = climb_both(32, (16 << 20, 16 << 20), rate);
        let requests: Vec<usize> = windows.iter().map(|&(_, request)| request >> 20).collect();
        // The depth's climb (flat: up, then down, then settled), then the
        // request size's: larger is past the chunk, so half, half again,
        // and a third half that gains nothing.
        assert_eq!(requests[..9], [16; 9]);
        assert_eq!(requests[9..], [16, 8, 16, 8, 8, 4, 8, 4, 4, 2, 4, 2]);
        assert_eq!((tuner.kept(), tuner.kept_request()), (32, 4 << 20));
    }

    #[test]
    fn a_remembered_request_size_climbs_back_up_when_larger_reads_faster() {
        let rate = |_, request: usize| request as f64 * 100.0;
        let (windows, tuner) = climb_both(32, (4 << 20, 16 << 20), rate);
        assert_eq!(
            windows[9..].iter().map(|&(_, r)| r >> 20).collect::<Vec<_>>(),
            [4, 8, 4, 8, 8, 16, 8, 16]
        );
        assert_eq!(tuner.kept_request(), 16 << 20, "never past the plan's chunk");
    }

    #[test]
    fn request_sizes_are_tuned_only_in_power_of_two_chunks() {
        let now = Instant::now();
        let tuner = Tuner::new(32, 4 << 20, 3 << 20, now);
        assert_eq!((tuner.request(), tuner.request.min, tuner.request.max), (3 << 20, 3 << 20, 3 << 20));
        let tuner = Tuner::new(32, 3 << 20, 16 << 20, now);
        assert_eq!(tuner.request(), 16 << 20, "a remembered size that is no power of two is not used");
    }

    /// Runs windows through an `auto` load's tuner (starting from the
    /// `remembered` read mode) whose reads go at `rate_of(mode)` bytes per
    /// second until the read mode's choice settles; returns the mode of
    /// each window and the tuner.
    fn choose(
        remembered: Option<RememberedRead>,
        rate_of: impl Fn(ReadMode) -> f64,
    ) -> (Vec<ReadMode>, Tuner) {
        let mut now = Instant::now();
        let mut tuner = Tuner::new(32, 1 << 20, 1 << 20, now).choosing_reads(remembered, u64::MAX);
        let mut windows = Vec::new();
        while tuner.mode.step != ModeStep::Settled && windows.len() < 16 {
            let mode = tuner.read_mode();
            if tuner.draining() {
                // The engine's drain before each window of the trial: not measured.
                assert_eq!(tuner.observe(WINDOW, now + Duration::from_secs(1)), 32);
                tuner.flipped(now);
            }
            windows.push(mode);
            now += Duration::from_secs_f64(WINDOW as f64 / rate_of(mode));
            tuner.observe(WINDOW, now);
        }
        (windows, tuner)
    }

    use ReadMode::{Buffered, Direct};

    #[test]
    fn direct_reads_that_are_faster_are_kept_and_the_depth_climb_follows() {
        let (windows, tuner) = choose(None, |mode| if mode == Direct { 1.5e9 } else { 1e9 });
        assert_eq!(windows, [Direct, Direct, Buffered, Direct, Buffered]);
        assert_eq!((tuner.kept_read_mode(), tuner.read_mode()), (Direct, Direct));
        assert!(matches!(tuner.read_choice(), ReadChoice::Measured { recheck: None, .. }));
        let read = tuner.read_to_remember().unwrap();
        assert_eq!((read.mode, read.rate / 1_000_000), (Direct, 1500), "the kept mode's slower window");
        assert!(tuner.moved(), "a measured mode is remembered");
        assert_eq!(tuner.depth(), 32, "the depth's trial starts with a window at the kept depth");
        assert_eq!(tuner.depth.trial, 64, "and no second warm-up");
    }

    #[test]
    fn buffered_reads_that_are_clearly_faster_are_kept() {
        // The H100 machine's disk: buffered readahead 1.46x direct.
        let (windows, tuner) = choose(None, |mode| if mode == Buffered { 1.46e9 } else { 1e9 });
        assert_eq!(windows, [Direct, Direct, Buffered, Direct, Buffered]);
        assert_eq!((tuner.kept_read_mode(), tuner.read_mode()), (Buffered, Buffered));
        let ReadChoice::Measured { direct, buffered, .. } = tuner.read_choice() else { panic!() };
        assert_eq!(((direct / 1e6).round(), (buffered / 1e6).round()), (1000.0, 1460.0));
        assert_eq!(tuner.read_to_remember().map(|read| read.mode), Some(Buffered));
    }

    #[test]
    fn buffered_reads_only_a_little_faster_leave_the_reads_direct() {
        let (_, tuner) = choose(None, |mode| if mode == Buffered { 1.05e9 } else { 1e9 });
        assert_eq!(tuner.kept_read_mode(), Direct);
    }

    #[test]
    fn a_remembered_mode_that_reads_as_fast_as_remembered_is_used_without_measuring() {
        let remembered = RememberedRead { mode: Buffered, rate: 1_500_000_000 };
        let (windows, tuner) = choose(Some(remembered), |mode| if mode == Buffered { 1.2e9 } else { 2e9 });
        assert_eq!(windows, [Buffered, Buffered], "the warm-up and one window: no direct window");
        assert_eq!((tuner.kept_read_mode(), tuner.read_choice()), (Buffered, ReadChoice::Remembered));
        assert_eq!(tuner.read_to_remember(), Some(remembered));
        assert!(!tuner.moved(), "nothing new to remember");
    }

    #[test]
    fn a_remembered_mode_is_measured_again_after_a_clearly_slower_load() {
        // Remembered buffered at 1.5 GB/s; now buffered reads 0.5, direct 1.
        let remembered = RememberedRead { mode: Buffered, rate: 1_500_000_000 };
        let (windows, tuner) = choose(Some(remembered), |mode| if mode == Buffered { 0.5e9 } else { 1e9 });
        assert_eq!(windows, [Buffered, Buffered, Buffered, Direct, Buffered, Direct]);
        assert_eq!(tuner.kept_read_mode(), Direct);
        let ReadChoice::Measured { recheck, .. } = tuner.read_choice() else { panic!() };
        assert_eq!(recheck.map(|(slow, was)| ((slow / 1e6).round(), was)), Some((500.0, 1.5e9)));
        let read = tuner.read_to_remember().unwrap();
        assert_eq!((read.mode, read.rate / 1_000_000), (Direct, 1000));
    }

    #[test]
    fn waiting_for_memory_does_not_end_the_read_modes_trial() {
        let now = Instant::now();
        let mut tuner = Tuner::new(32, 1 << 20, 1 << 20, now).choosing_reads(None, u64::MAX);
        tuner.observe(WINDOW, now + Duration::from_millis(10));
        assert!(tuner.draining(), "the trial's first window starts from none in flight");
        tuner.flipped(now + Duration::from_millis(11));
        tuner.memory_bound();
        tuner.observe(WINDOW, now + Duration::from_millis(20));
        tuner.flipped(now + Duration::from_millis(21));
        assert_eq!(tuner.read_mode(), Buffered, "the trial's buffered window");
        tuner.memory_bound();
        assert_eq!((tuner.read_mode(), tuner.mode.step), (Buffered, ModeStep::Trial));
    }

    #[test]
    fn a_load_too_short_to_finish_the_choice_reads_without_measuring() {
        let now = Instant::now();
        // Requests of 4 MiB, 8 in flight while choosing: the warm-up, four
        // windows and the drain of 32 MiB in flight before each: 768 MiB.
        let short = Tuner::new(32, 4 << 20, 4 << 20, now).choosing_reads(None, 767 << 20);
        assert_eq!((short.read_mode(), short.read_choice()), (Direct, ReadChoice::NotChosen));
        assert_eq!(short.mode.step, ModeStep::Settled);
        let long = Tuner::new(32, 4 << 20, 4 << 20, now).choosing_reads(None, 768 << 20);
        assert_eq!(long.mode.step, ModeStep::WarmUp);
        // A remembered mode is used; checked where two windows fit.
        let remembered = Some(RememberedRead { mode: Buffered, rate: 1 << 30 });
        let short = Tuner::new(32, 4 << 20, 4 << 20, now).choosing_reads(remembered, 200 << 20);
        assert_eq!((short.read_mode(), short.read_choice()), (Buffered, ReadChoice::Remembered));
        assert_eq!(short.mode.step, ModeStep::Settled);
        let long = Tuner::new(32, 4 << 20, 4 << 20, now).choosing_reads(remembered, 256 << 20);
        assert_eq!((long.read_mode(), long.mode.step), (Buffered, ModeStep::WarmUp));
    }

    #[test]
    fn a_staging_rings_large_reads_choose_the_read_mode_a_few_at_a_time() {
        // The CLI's ring: 32 slots of 16 MiB. While the mode is chosen, two
        // requests (32 MiB) in flight, so a window of 128 MiB is timed with
        // the pipe full; the ring's depth once it is chosen.
        let mut now = Instant::now();
        let mut tuner = Tuner::new(32, 16 << 20, 16 << 20, now).choosing_reads(None, 1 << 30).in_ring(32);
        assert_eq!(tuner.depth(), 2, "the warm-up");
        for _ in 0..1 + TRIAL_WINDOWS {
            if tuner.draining() {
                assert_eq!(tuner.observe(32 << 20, now), 2, "the drain");
                tuner.flipped(now);
            }
            assert_eq!(tuner.depth(), 2);
            now += Duration::from_millis(100);
            tuner.observe(WINDOW, now);
        }
        assert!(matches!(tuner.read_choice(), ReadChoice::Measured { .. }));
        assert_eq!(tuner.depth(), 32, "the depth's trial starts at the ring's depth");
        // A 1 GiB file finishes the choice; the drains take 128 MiB of it.
        let short = Tuner::new(32, 16 << 20, 16 << 20, now).choosing_reads(None, 767 << 20).in_ring(32);
        assert_eq!((short.depth(), short.read_choice()), (32, ReadChoice::NotChosen));
    }

    #[test]
    fn a_staged_load_reads_whole_slots_no_deeper_than_its_ring() {
        // Remembered: depth 32 of 4 MiB requests (a host load's chunks).
        // Through a ring of 10 slots of 16 MiB, 10 requests fill it, and
        // each asks for its whole slot: 4 MiB in each would keep 40 MiB in
        // flight, not the 128 MiB measured.
        let now = Instant::now();
        let tuner = Tuner::new(32, 4 << 20, 16 << 20, now).in_ring(10);
        assert_eq!((tuner.depth(), tuner.request()), (10, 16 << 20));
        assert_eq!((tuner.kept(), tuner.kept_request()), (10, 16 << 20));
        // A ring of more chunks than the depth: the depth as remembered.
        let tuner = Tuner::new(16, 4 << 20, 8 << 20, now).in_ring(32);
        assert_eq!((tuner.depth(), tuner.request()), (16, 8 << 20));
    }

    #[test]
    fn only_what_a_trial_measured_is_to_be_remembered() {
        // A staged load of 1 GiB (the CLI's ring of 10 slots) measures
        // the read modes and ends: its depth (no trial within 10 slots)
        // and request size (its trial not reached) are not measurements.
        let mut now = Instant::now();
        let mut tuner = Tuner::new(32, 16 << 20, 16 << 20, now).choosing_reads(None, 1 << 30).in_ring(10);
        for _ in 0..1 + TRIAL_WINDOWS {
            if tuner.draining() {
                tuner.flipped(now);
            }
            now += Duration::from_millis(100);
            tuner.observe(WINDOW, now);
        }
        assert!(tuner.moved(), "the modes were measured");
        assert!(tuner.read_to_remember().is_some());
        assert_eq!((tuner.tuned_depth(), tuner.tuned_request()), (None, None));
        // A host load whose depth's climb ran to its end, the request
        // size's not: the depth only.
        let mut tuner = Tuner::new(32, 4 << 20, 4 << 20, now);
        while tuner.depth.step != Step::Settled {
            now += Duration::from_millis(100);
            tuner.observe(WINDOW, now);
        }
        assert_eq!((tuner.tuned_depth(), tuner.tuned_request()), (Some(32), None));
        while !tuner.settled() {
            now += Duration::from_millis(100);
            tuner.observe(WINDOW, now);
        }
        assert_eq!((tuner.tuned_depth(), tuner.tuned_request()), (Some(32), Some(4 << 20)));
    }
}
