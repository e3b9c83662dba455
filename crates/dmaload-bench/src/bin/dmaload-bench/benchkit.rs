//! What the seed-table benchmarks share: spread statistics, generated test
//! files with known per-piece hashes, and cold-cache preparation.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::sample::fill_pattern;

/// Minimum, median and maximum of a set of samples.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(samples: &[f64]) -> Spread {
        if samples.is_empty() {
            return Spread::default();
        }
        let mut xs = samples.to_vec();
        xs.sort_by(f64::total_cmp);
        let mid = xs.len() / 2;
        let median = if xs.len() % 2 == 0 { (xs[mid - 1] + xs[mid]) / 2.0 } else { xs[mid] };
        Spread { min: xs[0], median, max: xs[xs.len() - 1] }
    }

    /// "median (min–max)" with `digits` decimals.
    pub fn show(&self, digits: usize) -> String {
        format!("{:.d$} ({:.d$}–{:.d$})", self.median, self.min, self.max, d = digits)
    }
}

/// The order in which `round` runs its `methods` rows: a shuffle that
/// differs from round to round (and is the same in every run of the
/// bench), so no row always follows the same row and inherits its effects
/// (memory it freed, a cache it warmed), as a fixed or rotating order does.
pub fn round_order(methods: usize, round: usize) -> Vec<usize> {
    // splitmix64, seeded by the round: enough to decorrelate neighbours.
    let mut state = (round as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..methods).collect();
    for i in (1..methods).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    order
}

/// A generated bench file of exactly `len` bytes in `dir`, reused when it
/// is already there with that size.
pub fn bench_file(dir: &Path, len: u64) -> Result<PathBuf, String> {
    fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let path = dir.join(format!("dmaload-bench-{len}.bin"));
    if fs::metadata(&path).is_ok_and(|m| m.len() == len) {
        return Ok(path);
    }
    eprintln!("bench: writing a {len}-byte test file {}", path.display());
    // As every file dmaload creates: never through a planted symlink.
    let name = path.file_name().unwrap_or_default();
    let tmp = dmaload::tmpfile::TmpFile::create(dir, name, 0o644).map_err(|e| e.to_string())?;
    let written = (|| -> io::Result<()> {
        let mut file = tmp.file();
        let mut block = vec![0u8; 8 << 20];
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(block.len() as u64) as usize;
            fill_pattern(&mut block[..n], at);
            file.write_all(&block[..n])?;
            at += n as u64;
        }
        file.sync_all()
    })();
    written.map_err(|e| format!("write {}: {e}", path.display()))?;
    tmp.commit(dir, &path).map_err(|e| e.to_string())?;
    Ok(path)
}

/// xxh3-64 of each `piece`-sized piece of the file, read buffered (the
/// reference the benchmarks verify against), then the file is evicted.
pub fn piece_hashes(path: &Path, piece: usize) -> Result<Vec<u64>, String> {
    let fail = |e: io::Error| format!("read {}: {e}", path.display());
    let mut file = dmaload::source::open_for_reading(path).map_err(|e| e.to_string())?;
    let mut hashes = Vec::new();
    let mut block = vec![0u8; piece.max(1)];
    loop {
        let mut filled = 0;
        while filled < block.len() {
            let n = file.read(&mut block[filled..]).map_err(fail)?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        hashes.push(xxhash_rust::xxh3::xxh3_64(&block[..filled]));
        if filled < block.len() {
            break;
        }
    }
    evict(path)?;
    Ok(hashes)
}

/// Drops `path` from the page cache so the next read comes from the device.
pub fn evict(path: &Path) -> Result<(), String> {
    dmaload::pagecache::evict(path).map_err(|e| e.to_string())
}

/// The `dmaload` command the rows that run it in a fresh process use
/// (`cache`'s loads and service, `stream`'s capture): `$DMALOAD_CLI`, else
/// the `dmaload` beside this executable (cargo builds and installs both in
/// one directory), else the first on `PATH`.
pub fn dmaload_exe() -> Result<PathBuf, String> {
    if let Some(given) = std::env::var_os("DMALOAD_CLI") {
        return Ok(given.into());
    }
    let me = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let beside = me.with_file_name("dmaload");
    let on_path =
        std::env::var_os("PATH").into_iter().flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    std::iter::once(beside.clone())
        .chain(on_path.map(|dir| dir.join("dmaload")))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            format!(
                "no dmaload command beside {} or on PATH (build it: cargo build --release -p dmaload-cli; \
                 or set DMALOAD_CLI)",
                me.display()
            )
        })
}

/// The default directory of generated bench files: the sample cache.
pub fn default_dir() -> PathBuf {
    crate::sample::default_cache_dir()
}

/// xxh3-64 of the whole file, read buffered in 8 MiB blocks; then evicted.
pub fn file_hash(path: &Path) -> Result<u64, String> {
    let fail = |e: io::Error| format!("read {}: {e}", path.display());
    let mut file = dmaload::source::open_for_reading(path).map_err(|e| e.to_string())?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut block = vec![0u8; 8 << 20];
    loop {
        let n = file.read(&mut block).map_err(fail)?;
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
    }
    evict(path)?;
    Ok(hasher.digest())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_runs_every_row_once_and_neighbours_change() {
        let orders: Vec<Vec<usize>> = (0..6).map(|round| round_order(9, round)).collect();
        for order in &orders {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..9).collect::<Vec<_>>());
        }
        // Row 0's predecessor is not the same row in every round.
        let before_first: Vec<Option<usize>> = orders
            .iter()
            .map(|o| o.iter().position(|&m| m == 0).and_then(|at| at.checked_sub(1).map(|p| o[p])))
            .collect();
        assert!(before_first.iter().any(|p| *p != before_first[0]), "{orders:?}");
        assert_eq!(round_order(9, 3), orders[3], "the same order in every run");
        assert!(round_order(0, 0).is_empty() && round_order(1, 5) == [0]);
        // Two rows (bench stream's pairs) take turns at going first.
        let firsts: Vec<usize> = (0..6).map(|round| round_order(2, round)[0]).collect();
        assert!(firsts.contains(&0) && firsts.contains(&1), "{firsts:?}");
    }
}
