//! The hill-climb of one setting by doubling and halving, and the limits
//! each climb, and the memory file's lines, stay between.

/// How much faster a window must read to keep a depth change.
pub(super) const GAIN: f64 = 1.10;
/// The depths the climb stays between. Above 64 requests of 4 MiB the
/// development VM's disk now and then collapses for a whole load (0.14 and
/// 0.20 GiB/s at depths 128 and 256, against 1.2-2.2 GiB/s at 32-64;
/// docs/benchmarks-archive.md), which a trial of a few windows cannot see coming.
pub(super) const MIN_DEPTH: usize = 16;
pub(crate) const MAX_DEPTH: usize = 64;
/// The smallest request size tried: smaller direct reads only add
/// per-request cost on the disks measured (docs/benchmarks-archive.md).
pub(super) const MIN_REQUEST: usize = 1 << 20;
/// The largest request size a memory file may name (a plan's chunk is never
/// larger than a staging slot, at most 1 GiB).
pub(super) const MAX_REQUEST: usize = 1 << 30;
/// The connection counts a climb stays between: below 2 a lost connection
/// stops the load's progress until it is reopened; 32 connections of 8 MiB
/// GETs keep 256 MiB in flight, past what one server's link needs.
pub(super) const MIN_CONNECTIONS: usize = 2;
pub(super) const MAX_CONNECTIONS: usize = 32;

/// Where a climb is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// The first window: requests ramping up, not measured.
    WarmUp,
    /// Trying `trial` against the kept value, larger when `up`; `moved`
    /// once a trial in this direction was kept.
    Trial {
        up: bool,
        moved: bool,
    },
    Settled,
}

/// Windows of one trial: the kept value's and the trial value's, alternately.
pub(super) const TRIAL_WINDOWS: usize = 4;

/// The slowest and the fastest window run at one value (bytes per second).
#[derive(Debug, Clone, Copy)]
pub(super) struct Windows {
    pub(super) slowest: f64,
    pub(super) fastest: f64,
}

impl Windows {
    pub(super) const NONE: Windows = Windows { slowest: f64::INFINITY, fastest: 0.0 };

    pub(super) fn add(&mut self, rate: f64) {
        (self.slowest, self.fastest) = (self.slowest.min(rate), self.fastest.max(rate));
    }
}

/// The hill-climb of one setting (the depth, or the request size) between
/// `min` and `max` by doubling and halving (see [`super`]'s comment).
#[derive(Debug)]
pub(super) struct Climb {
    pub(super) start: usize,
    pub(super) kept: usize,
    pub(super) trial: usize,
    pub(super) step: Step,
    /// Windows of the current trial so far; even ones run at `kept`.
    window: usize,
    /// A trial ran to its end: `kept` was measured, not only started from.
    pub(super) measured: bool,
    at_kept: Windows,
    at_trial: Windows,
    pub(super) min: usize,
    pub(super) max: usize,
}

impl Climb {
    pub(super) fn new(start: usize, min: usize, max: usize) -> Climb {
        let start = start.clamp(min, max);
        Climb {
            start,
            kept: start,
            trial: start,
            step: Step::WarmUp,
            window: 0,
            measured: false,
            at_kept: Windows::NONE,
            at_trial: Windows::NONE,
            min,
            max,
        }
    }

    /// The value to run at now.
    pub(super) fn value(&self) -> usize {
        match self.step {
            Step::Trial { .. } if self.window % 2 == 1 => self.trial,
            _ => self.kept,
        }
    }

    /// A window ran at [`Climb::value`] at `rate` bytes per second.
    pub(super) fn window_done(&mut self, rate: f64) {
        match self.step {
            Step::WarmUp => self.start_trial(true, false),
            Step::Trial { up, moved } => {
                let into = if self.window % 2 == 0 { &mut self.at_kept } else { &mut self.at_trial };
                into.add(rate);
                self.window += 1;
                if self.window == TRIAL_WINDOWS {
                    self.measured = true;
                    if self.at_trial.slowest >= self.at_kept.fastest * GAIN {
                        self.kept = self.trial;
                        self.start_trial(up, true);
                    } else if up && !moved {
                        self.start_trial(false, false);
                    } else {
                        self.step = Step::Settled;
                    }
                }
            }
            Step::Settled => {}
        }
    }

    /// Starts trying the next value from the kept one, larger when `up`;
    /// where that leaves the limits, the other direction (when no trial
    /// moved yet), else the climb ends.
    pub(super) fn start_trial(&mut self, up: bool, moved: bool) {
        let next = if up { self.kept * 2 } else { self.kept / 2 };
        if (self.min..=self.max).contains(&next) {
            self.trial = next;
            self.step = Step::Trial { up, moved };
            self.window = 0;
            (self.at_kept, self.at_trial) = (Windows::NONE, Windows::NONE);
        } else if up && !moved {
            self.start_trial(false, false);
        } else {
            self.step = Step::Settled;
        }
    }
}
