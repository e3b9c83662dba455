//! The climb of an object load's GETs: connections, then request size.

use std::time::Instant;

use super::climb::{Climb, Step, MAX_CONNECTIONS, MIN_CONNECTIONS, MIN_REQUEST, TRIAL_WINDOWS};
use super::memory::RememberedGets;

/// Bytes of one measured window of GETs: smaller than a disk's, so that a
/// 1 GiB object finishes the warm-up and two trials.
const GET_WINDOW: u64 = 64 << 20;

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
    use crate::tune::climb::GAIN;
    use std::time::Duration;

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
}
