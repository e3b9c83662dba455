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

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::sys;

/// Bytes of one measured window.
const WINDOW: u64 = 128 << 20;
/// How much faster a window must read to keep a depth change.
const GAIN: f64 = 1.10;
/// The depths the climb stays between. Above 64 requests of 4 MiB the
/// development VM's disk now and then collapses for a whole load (0.14 and
/// 0.20 GiB/s at depths 128 and 256, against 1.2-2.2 GiB/s at 32-64;
/// docs/benchmarks-archive.md), which a trial of a few windows cannot see coming.
const MIN_DEPTH: usize = 16;
pub(crate) const MAX_DEPTH: usize = 64;
/// The smallest request size tried: smaller direct reads only add
/// per-request cost on the disks measured (docs/benchmarks-archive.md).
const MIN_REQUEST: usize = 1 << 20;
/// The largest request size a memory file may name (a plan's chunk is never
/// larger than a staging slot, at most 1 GiB).
const MAX_REQUEST: usize = 1 << 30;
/// The memory file is this small; a larger one is not ours to trust.
const MEMORY_LIMIT: u64 = 64 << 10;
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

/// How an `auto` load's file reads go (see the module's comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadMode {
    /// O_DIRECT.
    Direct,
    /// Through the page cache (with `RWF_DONTCACHE` where the filesystem
    /// has it: the engine's choice, [`crate::engine::ReadModes`]).
    Buffered,
}

impl ReadMode {
    pub fn name(self) -> &'static str {
        match self {
            ReadMode::Direct => "direct",
            ReadMode::Buffered => "buffered",
        }
    }

    fn parse(word: &str) -> Option<ReadMode> {
        [ReadMode::Direct, ReadMode::Buffered].into_iter().find(|mode| mode.name() == word)
    }

    fn other(self) -> ReadMode {
        match self {
            ReadMode::Direct => ReadMode::Buffered,
            ReadMode::Buffered => ReadMode::Direct,
        }
    }
}

/// The read mode a device's measurement kept, and the rate (bytes per
/// second) of its slower window then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RememberedRead {
    pub mode: ReadMode,
    pub rate: u64,
}

/// A block device, by its numbers: what a depth is remembered for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Device {
    major: u32,
    minor: u32,
}

impl Device {
    /// The device `file` is read from: itself for a block device, else the
    /// one holding its filesystem.
    pub fn of(file: &File) -> io::Result<Device> {
        let meta = file.metadata()?;
        let dev = if meta.file_type().is_block_device() { meta.rdev() } else { meta.dev() };
        let (major, minor) = sys::file::device_numbers(dev);
        Ok(Device { major, minor })
    }

    fn key(&self) -> String {
        format!("{}:{}", self.major, self.minor)
    }
}

/// Where depths are remembered (see [`crate::user_cache::path`]).
pub(crate) fn memory_file() -> Option<PathBuf> {
    crate::user_cache::path("tuning")
}

/// What a device's reads were tuned to: the depth and the request size
/// where a load measured them (a line without one keeps the options'
/// depth or the plan's chunk), and the read mode where an `auto` load
/// measured one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Remembered {
    pub depth: Option<usize>,
    pub request: Option<usize>,
    pub read: Option<RememberedRead>,
}

/// One `MAJOR:MINOR[ queue_depth=N][ request=BYTES][ read=MODE
/// read_rate=BYTES_PER_SECOND]` line, or `None` where a field's value does
/// not parse; fields it does not know (a later version's) are skipped, and
/// a read mode without its rate is not used.
fn parse_line(line: &str) -> Option<(String, Remembered)> {
    let mut words = line.split_whitespace();
    let key = words.next()?;
    let (major, minor) = key.split_once(':')?;
    major.parse::<u32>().ok()?;
    minor.parse::<u32>().ok()?;
    let (mut depth, mut request, mut mode, mut rate) = (None, None, None, None);
    for word in words {
        let (name, value) = word.split_once('=')?;
        match name {
            "queue_depth" => {
                depth = Some(value.parse().ok().filter(|d| (MIN_DEPTH..=MAX_DEPTH).contains(d))?)
            }
            "request" => request = Some(parse_request(value)?),
            "read" => mode = Some(ReadMode::parse(value)?),
            "read_rate" => rate = Some(value.parse::<u64>().ok().filter(|&r| r > 0)?),
            _ => {}
        }
    }
    let read = mode.zip(rate).map(|(mode, rate)| RememberedRead { mode, rate });
    Some((key.to_owned(), Remembered { depth, request, read }))
}

/// A remembered request size: a power of two a plan's chunk may be.
fn parse_request(value: &str) -> Option<usize> {
    value.parse().ok().filter(|s: &usize| s.is_power_of_two() && (MIN_REQUEST..=MAX_REQUEST).contains(s))
}

/// What one line of the memory file remembers: a block device's reads,
/// or an object store endpoint's GETs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Line {
    Device(Remembered),
    Endpoint(RememberedGets),
}

impl Line {
    fn parse(line: &str) -> Option<(String, Line)> {
        match line.strip_prefix(ENDPOINT_PREFIX) {
            Some(rest) => parse_endpoint_line(rest).map(|(key, gets)| (key, Line::Endpoint(gets))),
            None => parse_line(line).map(|(key, tuned)| (key, Line::Device(tuned))),
        }
    }

    fn write(&self, key: &str) -> String {
        match self {
            Line::Device(tuned) => {
                let mut line = key.to_owned();
                if let Some(depth) = tuned.depth {
                    line += &format!(" queue_depth={depth}");
                }
                if let Some(request) = tuned.request {
                    line += &format!(" request={request}");
                }
                if let Some(read) = tuned.read {
                    line += &format!(" read={} read_rate={}", read.mode.name(), read.rate);
                }
                line + "\n"
            }
            Line::Endpoint(gets) => {
                format!("{key} connections={} request={}\n", gets.connections, gets.request)
            }
        }
    }
}

/// Each line of the memory file that parses (others are skipped: the file
/// is a cache, never an error).
fn entries(path: &Path) -> Vec<(String, Line)> {
    let Ok(Some(bytes)) = crate::user_cache::read(path, MEMORY_LIMIT) else {
        return Vec::new();
    };
    String::from_utf8_lossy(&bytes).lines().filter_map(Line::parse).collect()
}

/// What is remembered for `device` in the memory file at `path`.
pub(crate) fn remembered(path: &Path, device: Device) -> Option<Remembered> {
    let key = device.key();
    entries(path).into_iter().find_map(|(k, line)| match line {
        Line::Device(tuned) if k == key => Some(tuned),
        _ => None,
    })
}

/// Remembers `tuned` for `device` in the memory file at `path`, creating
/// its directory; the other devices' and endpoints' lines are kept (see
/// [`crate::user_cache::replace`] for concurrent writers).
pub(crate) fn remember(path: &Path, device: Device, tuned: Remembered) -> io::Result<()> {
    replace_line(path, device.key(), Line::Device(tuned))
}

/// Writes the memory file at `path` with `line` for `key` in place of the
/// one it had, the others kept.
fn replace_line(path: &Path, key: String, line: Line) -> io::Result<()> {
    let mut entries = entries(path);
    entries.retain(|(k, _)| *k != key);
    entries.push((key, line));
    let text: String = entries.iter().map(|(k, line)| line.write(k)).collect();
    crate::user_cache::replace(path, text.as_bytes())
}

/// Where a climb is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
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
const TRIAL_WINDOWS: usize = 4;

/// The slowest and the fastest window run at one value (bytes per second).
#[derive(Debug, Clone, Copy)]
struct Windows {
    slowest: f64,
    fastest: f64,
}

impl Windows {
    const NONE: Windows = Windows { slowest: f64::INFINITY, fastest: 0.0 };

    fn add(&mut self, rate: f64) {
        (self.slowest, self.fastest) = (self.slowest.min(rate), self.fastest.max(rate));
    }
}

/// The hill-climb of one setting (the depth, or the request size) between
/// `min` and `max` by doubling and halving (see the module's comment).
#[derive(Debug)]
struct Climb {
    start: usize,
    kept: usize,
    trial: usize,
    step: Step,
    /// Windows of the current trial so far; even ones run at `kept`.
    window: usize,
    /// A trial ran to its end: `kept` was measured, not only started from.
    measured: bool,
    at_kept: Windows,
    at_trial: Windows,
    min: usize,
    max: usize,
}

impl Climb {
    fn new(start: usize, min: usize, max: usize) -> Climb {
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
    fn value(&self) -> usize {
        match self.step {
            Step::Trial { .. } if self.window % 2 == 1 => self.trial,
            _ => self.kept,
        }
    }

    /// A window ran at [`Climb::value`] at `rate` bytes per second.
    fn window_done(&mut self, rate: f64) {
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
    fn start_trial(&mut self, up: bool, moved: bool) {
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

/// The key of an endpoint's line begins with this word (a device's is
/// `MAJOR:MINOR`).
const ENDPOINT_PREFIX: &str = "s3 ";
/// Bytes of one measured window of GETs: smaller than a disk's, so that a
/// 1 GiB object finishes the warm-up and two trials.
const GET_WINDOW: u64 = 64 << 20;
/// The connection counts a climb stays between: below 2 a lost connection
/// stops the load's progress until it is reopened; 32 connections of 8 MiB
/// GETs keep 256 MiB in flight, past what one server's link needs.
const MIN_CONNECTIONS: usize = 2;
pub(crate) const MAX_CONNECTIONS: usize = 32;

/// An object store's endpoint (`HOST:PORT`, the host as the endpoint URL
/// names it): what GETs are tuned for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint(String);

impl Endpoint {
    /// `None` for a host that could not be read back from a line.
    pub fn new(host: &str, port: u16) -> Option<Endpoint> {
        let fits = !host.is_empty() && !host.contains(|c: char| c.is_whitespace() || c.is_control());
        fits.then(|| Endpoint(format!("{host}:{port}")))
    }

    fn key(&self) -> String {
        format!("{ENDPOINT_PREFIX}{}", self.0)
    }
}

/// What an endpoint's GETs were tuned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RememberedGets {
    pub connections: usize,
    pub request: usize,
}

/// The rest of one `s3 HOST:PORT connections=N request=BYTES` line after
/// `s3 `: `None` where the endpoint or a field does not parse or a field is
/// missing; fields it does not know are skipped.
fn parse_endpoint_line(rest: &str) -> Option<(String, RememberedGets)> {
    let mut words = rest.split_whitespace();
    let endpoint = words.next()?;
    let (host, port) = endpoint.rsplit_once(':')?;
    let endpoint = Endpoint::new(host, port.parse().ok()?)?;
    let (mut connections, mut request) = (None, None);
    for word in words {
        let (name, value) = word.split_once('=')?;
        match name {
            "connections" => {
                let fits = |n: &usize| (MIN_CONNECTIONS..=MAX_CONNECTIONS).contains(n);
                connections = Some(value.parse().ok().filter(fits)?);
            }
            "request" => request = Some(parse_request(value)?),
            _ => {}
        }
    }
    Some((endpoint.key(), RememberedGets { connections: connections?, request: request? }))
}

/// What is remembered for `endpoint` in the memory file at `path`.
pub(crate) fn remembered_gets(path: &Path, endpoint: &Endpoint) -> Option<RememberedGets> {
    let key = endpoint.key();
    entries(path).into_iter().find_map(|(k, line)| match line {
        Line::Endpoint(gets) if k == key => Some(gets),
        _ => None,
    })
}

/// Remembers `gets` for `endpoint` in the memory file at `path`, the other
/// lines kept (as [`remember`]).
pub(crate) fn remember_gets(path: &Path, endpoint: &Endpoint, gets: RememberedGets) -> io::Result<()> {
    replace_line(path, endpoint.key(), Line::Endpoint(gets))
}

/// The climb of an object load's GETs: the connection count first, then
/// the request size, each as a disk's depth climbs ([`Climb`]: a warm-up
/// window, then trials of double and half, alternating windows, kept on a
/// clear gain), over windows of [`GET_WINDOW`] bytes. Requests never grow
/// past the plan's chunk (a GET lands in one chunk's memory); a smaller
/// one is the engine asking for a chunk in several GETs.
///
/// Unlike a disk's climb, a GET that waits for its memory (a gather not
/// yet populated, a staging slot the destination has not freed) does not
/// end it: the GETs' threads share the CPUs with the populating, so a
/// wait now and then says little, and where the destination is what
/// limits the load, every trial measures it, none gains, and the climb
/// settles where it started after a fair trial of each value.
#[derive(Debug)]
pub(crate) struct GetTuner {
    connections: Climb,
    request: Climb,
    windows: usize,
    window_bytes: u64,
    window_started: Instant,
}

impl GetTuner {
    /// Whether a load of `bytes` is long enough to finish a warm-up and one
    /// trial: a shorter one (a few requests) runs at its start values.
    pub fn worth_tuning(bytes: u64) -> bool {
        bytes >= (1 + TRIAL_WINDOWS as u64) * GET_WINDOW
    }

    /// A climb from `connections` connections asking for `request` bytes
    /// each, in a plan of `chunk`-byte chunks, with no more than `most`
    /// connections ever (the chunks a staging ring holds, say; the start's
    /// count at least); its first window starts at `now`.
    pub fn new(connections: usize, request: usize, chunk: usize, most: usize, now: Instant) -> GetTuner {
        let most = MAX_CONNECTIONS.min(most).max(connections);
        let (min, start) = if chunk.is_power_of_two() && chunk >= MIN_REQUEST {
            (MIN_REQUEST, if request.is_power_of_two() { request } else { chunk })
        } else {
            (chunk, chunk)
        };
        GetTuner {
            connections: Climb::new(connections, MIN_CONNECTIONS.min(connections), most),
            request: Climb::new(start, min, chunk),
            windows: 0,
            window_bytes: 0,
            window_started: now,
        }
    }

    /// The most connections the climb may try: the threads to start.
    pub fn most_connections(&self) -> usize {
        self.connections.max
    }

    /// The connections to keep busy now.
    pub fn connections(&self) -> usize {
        self.connections.value()
    }

    /// The most bytes one GET may ask for now.
    pub fn request(&self) -> usize {
        self.request.value()
    }

    pub fn kept_connections(&self) -> usize {
        self.connections.kept
    }

    pub fn kept_request(&self) -> usize {
        self.request.kept
    }

    /// Windows measured before the climb settled (or the load ended).
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// What to remember for the endpoint: the kept values, once a trial
    /// measured them (a load that ended in its first trial measured nothing).
    pub fn to_remember(&self) -> Option<RememberedGets> {
        // Each trial is TRIAL_WINDOWS windows after the one warm-up.
        let measured = self.windows > TRIAL_WINDOWS;
        measured.then_some(RememberedGets { connections: self.connections.kept, request: self.request.kept })
    }

    /// Counts `bytes` of a GET done at `now`; at a window's end, moves the
    /// climb on.
    pub fn observe(&mut self, bytes: u64, now: Instant) {
        if self.request.step == Step::Settled {
            return;
        }
        self.window_bytes += bytes;
        if self.window_bytes < GET_WINDOW {
            return;
        }
        let seconds = now.saturating_duration_since(self.window_started).as_secs_f64();
        let rate = self.window_bytes as f64 / seconds.max(1e-9);
        (self.window_bytes, self.window_started) = (0, now);
        self.windows += 1;
        if self.connections.step != Step::Settled {
            self.connections.window_done(rate);
            if self.connections.step == Step::Settled && self.request.step == Step::WarmUp {
                self.request.start_trial(true, false);
            }
        } else {
            self.request.window_done(rate);
        }
    }
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

    #[test]
    fn a_remembered_read_mode_is_read_back_and_old_lines_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning");
        let old = "8:0 queue_depth=16\n259:3 queue_depth=32 request=4194304\n";
        std::fs::write(&path, old).unwrap();
        assert_eq!(
            remembered(&path, device()),
            Some(Remembered { depth: Some(32), request: Some(4 << 20), read: None })
        );
        let read = Some(RememberedRead { mode: Buffered, rate: 1_610_612_736 });
        remember(&path, device(), Remembered { depth: Some(64), request: None, read }).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "8:0 queue_depth=16\n259:3 queue_depth=64 read=buffered read_rate=1610612736\n");
        assert_eq!(remembered(&path, device()).unwrap().read, read);
        // A later version's fields are skipped; a mode without its rate,
        // or a mode not known, is not used.
        let lines = "259:3 queue_depth=32 read=direct read_rate=5 later=x\n8:0 queue_depth=16 read=direct\n\
                     8:1 queue_depth=16 read=sideways read_rate=5\n";
        std::fs::write(&path, lines).unwrap();
        assert_eq!(remembered(&path, device()).unwrap().read, Some(RememberedRead { mode: Direct, rate: 5 }));
        assert_eq!(remembered(&path, Device { major: 8, minor: 0 }).unwrap().read, None);
        assert_eq!(remembered(&path, Device { major: 8, minor: 1 }), None);
        // A line may remember a read mode alone: no depth or request size
        // was measured.
        let read = Some(RememberedRead { mode: Direct, rate: 7 });
        remember(&path, device(), Remembered { depth: None, request: None, read }).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("\n259:3 read=direct read_rate=7\n"));
        assert_eq!(remembered(&path, device()), Some(Remembered { depth: None, request: None, read }));
    }

    fn device() -> Device {
        Device { major: 259, minor: 3 }
    }

    #[test]
    fn a_remembered_depth_is_read_back_and_other_devices_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing/dir/tuning");
        assert_eq!(remembered(&path, device()), None);
        let depth = |depth| Remembered { depth: Some(depth), request: None, read: None };
        remember(&path, Device { major: 8, minor: 0 }, depth(16)).unwrap();
        remember(&path, device(), depth(32)).unwrap();
        let tuned = Remembered { depth: Some(64), request: Some(4 << 20), read: None };
        remember(&path, device(), tuned).unwrap();
        assert_eq!(remembered(&path, device()), Some(tuned));
        assert_eq!(remembered(&path, Device { major: 8, minor: 0 }), Some(depth(16)));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "8:0 queue_depth=16\n259:3 queue_depth=64 request=4194304\n");
        let left: Vec<_> =
            std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["tuning"], "no temporary file is left");
    }

    #[test]
    fn a_corrupt_memory_file_is_ignored_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning");
        let junk =
            "259:3 queue_depth=banana\n259:3 queue_depth=999999\nx:y queue_depth=8\n\u{0}\u{1}garbage\n\
                    259:3 queue_depth=32 request=3000000\n259:3 queue_depth=32 request=4096\n";
        std::fs::write(&path, junk).unwrap();
        assert_eq!(remembered(&path, device()), None);
        std::fs::write(&path, vec![b'a'; MEMORY_LIMIT as usize + 1]).unwrap();
        assert_eq!(remembered(&path, device()), None);
        std::fs::write(&path, [0xff, 0xfe, 0x00]).unwrap(); // not UTF-8
        assert_eq!(remembered(&path, device()), None);
        remember(&path, device(), Remembered { depth: Some(16), request: None, read: None }).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "259:3 queue_depth=16\n");
    }

    #[test]
    fn a_cache_directory_that_cannot_be_made_refuses_the_write_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the directory should be: refused for any user (root
        // too, unlike a read-only directory; the CLI's test covers that).
        std::fs::write(dir.path().join("dmaload"), b"").unwrap();
        let path = dir.path().join("dmaload/tuning");
        assert!(remember(&path, device(), Remembered { depth: Some(64), request: None, read: None }).is_err());
        assert_eq!(remembered(&path, device()), None);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file is left");
    }

    /// Runs windows of GETs through a tuner starting at `connections` and
    /// `request` in 8 MiB chunks (at most `most` connections) whose GETs go
    /// at `rate_of(window, connections, request)` bytes per second, until
    /// it settles; returns the (connections, request) of each window.
    fn climb_gets(
        (connections, request, most): (usize, usize, usize),
        rate_of: impl Fn(usize, usize, usize) -> f64,
    ) -> (Vec<(usize, usize)>, GetTuner) {
        let mut now = Instant::now();
        let mut tuner = GetTuner::new(connections, request, 8 << 20, most, now);
        let mut windows = Vec::new();
        while tuner.request.step != Step::Settled && windows.len() < 64 {
            let (c, r) = (tuner.connections(), tuner.request());
            now += Duration::from_secs_f64(GET_WINDOW as f64 / rate_of(windows.len(), c, r));
            windows.push((c, r));
            // A window's bytes arrive in GETs of the request size.
            for _ in 0..GET_WINDOW / r as u64 {
                tuner.observe(r as u64, now);
            }
        }
        (windows, tuner)
    }

    #[test]
    fn connections_climb_while_the_rate_gains_and_settle_where_it_saturates() {
        // Faster up to 16 connections, flat beyond.
        let (windows, tuner) = climb_gets((8, 8 << 20, usize::MAX), |_, c, _| c.min(16) as f64 * 1e8);
        let connections: Vec<usize> = windows.iter().map(|&(c, _)| c).collect();
        assert_eq!(connections[..9], [8, 8, 16, 8, 16, 16, 32, 16, 32]);
        assert_eq!((tuner.kept_connections(), tuner.connections()), (16, 16));
        // Then the request size: larger is past the chunk, half gains nothing.
        assert_eq!(windows[9..].iter().map(|&(_, r)| r >> 20).collect::<Vec<_>>(), [8, 4, 8, 4]);
        assert_eq!(tuner.to_remember(), Some(RememberedGets { connections: 16, request: 8 << 20 }));
        let (_, capped) = climb_gets((8, 8 << 20, usize::MAX), |_, c, _| c as f64 * 1e8);
        assert_eq!(capped.kept_connections(), MAX_CONNECTIONS, "never past the cap");
    }

    #[test]
    fn a_flat_rate_keeps_the_start_and_is_remembered_as_measured() {
        let (windows, tuner) = climb_gets((8, 8 << 20, usize::MAX), |_, _, _| 1e9);
        let connections: Vec<usize> = windows.iter().map(|&(c, _)| c).collect();
        assert_eq!(connections[..9], [8, 8, 16, 8, 16, 8, 4, 8, 4], "up, then down, then settled");
        assert_eq!((tuner.kept_connections(), tuner.kept_request()), (8, 8 << 20));
        assert_eq!(tuner.to_remember(), Some(RememberedGets { connections: 8, request: 8 << 20 }));
    }

    #[test]
    fn a_noisy_rate_never_runs_away() {
        // Noise within the gain a trial needs never moves the climb; wild
        // noise may, but it stays within the limits and settles.
        for (spread, seeds) in [(0.04, 0..200), (0.5, 200..400)] {
            for seed in seeds {
                let noise = |window: usize| {
                    let mut x = (seed * 64 + window as u64) | 1;
                    for _ in 0..4 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                    }
                    1.0 + spread * ((x % 2001) as f64 / 1000.0 - 1.0)
                };
                let (windows, tuner) = climb_gets((8, 8 << 20, usize::MAX), |w, _, _| 1e9 * noise(w));
                assert!(windows.len() < 64, "settles");
                let kept = (tuner.kept_connections(), tuner.kept_request());
                if spread < GAIN - 1.0 {
                    assert_eq!(kept, (8, 8 << 20), "seed {seed}");
                }
                assert!((MIN_CONNECTIONS..=MAX_CONNECTIONS).contains(&kept.0));
                assert!((MIN_REQUEST..=8 << 20).contains(&kept.1));
            }
        }
    }

    #[test]
    fn a_staging_ring_caps_the_connections_at_the_chunks_it_holds() {
        let (windows, tuner) = climb_gets((8, 8 << 20, 12), |_, c, _| c as f64 * 1e8);
        assert!(windows.iter().all(|&(c, _)| c <= 12), "{windows:?}");
        assert_eq!(tuner.kept_connections(), 8, "double is past the ring; half is slower");
    }

    #[test]
    fn a_load_too_short_for_a_trial_is_not_tuned_and_remembers_nothing() {
        assert!(!GetTuner::worth_tuning(5 * GET_WINDOW - 1));
        assert!(GetTuner::worth_tuning(5 * GET_WINDOW));
        let now = Instant::now();
        let mut tuner = GetTuner::new(8, 8 << 20, 8 << 20, usize::MAX, now);
        for k in 1..=4 {
            tuner.observe(GET_WINDOW, now + Duration::from_millis(10 * k));
        }
        assert_eq!(tuner.to_remember(), None, "the first trial did not finish");
    }

    #[test]
    fn an_endpoints_line_is_read_back_beside_the_devices_and_a_garbled_one_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning");
        let endpoint = Endpoint::new("127.0.0.1", 3900).unwrap();
        let gets = RememberedGets { connections: 16, request: 4 << 20 };
        std::fs::write(&path, "259:3 queue_depth=32\n").unwrap();
        remember_gets(&path, &endpoint, gets).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "259:3 queue_depth=32\ns3 127.0.0.1:3900 connections=16 request=4194304\n");
        assert_eq!(remembered_gets(&path, &endpoint), Some(gets));
        // A device's write keeps the endpoint's line, and the other way round.
        remember(&path, device(), Remembered { depth: Some(64), request: None, read: None }).unwrap();
        assert_eq!(remembered_gets(&path, &endpoint), Some(gets));
        assert_eq!(remembered(&path, device()).and_then(|tuned| tuned.depth), Some(64));
        assert_eq!(remembered_gets(&path, &Endpoint::new("127.0.0.1", 3901).unwrap()), None);
        let v6 = Endpoint::new("[::1]", 443).unwrap();
        remember_gets(&path, &v6, gets).unwrap();
        assert_eq!(remembered_gets(&path, &v6), Some(gets));
        for garbled in [
            "s3 127.0.0.1:3900 connections=banana request=4194304",
            "s3 127.0.0.1:3900 connections=9999 request=4194304",
            "s3 127.0.0.1:3900 connections=16 request=3000000",
            "s3 127.0.0.1:3900 connections=16",
            "s3 127.0.0.1:99999 connections=16 request=4194304",
            "s3 127.0.0.1 connections=16 request=4194304",
            "s3 :3900 connections=16 request=4194304",
            "s3 127.0.0.1:3900 connections=16 request",
        ] {
            std::fs::write(&path, format!("{garbled}\n")).unwrap();
            assert_eq!(remembered_gets(&path, &endpoint), None, "{garbled}");
        }
        // A later version's field is skipped; a line is never a device's.
        std::fs::write(&path, "s3 127.0.0.1:3900 connections=4 request=1048576 later=x\n").unwrap();
        assert_eq!(
            remembered_gets(&path, &endpoint),
            Some(RememberedGets { connections: 4, request: 1 << 20 })
        );
        assert_eq!(Endpoint::new("a b", 1), None);
        assert_eq!(Endpoint::new("", 1), None);
    }
}
