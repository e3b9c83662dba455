//! Loads and saves under a small RLIMIT_NOFILE, every limit from none to
//! spare up to a few: each fails with a clear error or falls back, and a
//! fallback forced by the limit names it. The only test of its binary, since
//! it lowers the limit of its whole process.

mod common;

use common::{assert_pattern, scratch_dir, write_pattern_file};
use dmaload::{LoadOptions, SaveOptions};

fn set_open_files_limit(soft: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit only writes `limit`, which lives across the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
    limit.rlim_cur = soft.min(limit.rlim_max);
    // SAFETY: setrlimit only reads `limit`.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
}

/// The numbers of the fds this process holds: those listed that are still
/// open once the listing's own fd is closed.
fn open_fds() -> Vec<u64> {
    let listed: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    let still_open = listed.iter().filter(|fd| std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok());
    still_open.map(|fd| fd.parse().unwrap()).collect()
}

/// The RLIMIT_NOFILE under which exactly `spare` new fds fit: the limit
/// caps fd numbers, not their count, and an inherited fd may sit high
/// (a shell's 255, a CI runner's pipe), so this counts free numbers.
fn limit_leaving(open: &[u64], spare: u64) -> u64 {
    (0..).filter(|n| !open.contains(n)).nth(spare as usize).unwrap()
}

#[test]
fn a_fallback_forced_by_rlimit_nofile_names_it() {
    let dir = scratch_dir();
    let path = dir.path().join("f.bin");
    write_pattern_file(&path, 1 << 20);
    let options = LoadOptions::default();
    // Warm up what a load keeps open for the process (its unmapping thread).
    drop(dmaload::load(&path, &options).unwrap());
    let open = open_fds();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| i as u8).collect();
    let saved = dir.path().join("saved.bin");
    let mut reasons = Vec::new();
    for spare in 0..12 {
        set_open_files_limit(limit_leaving(&open, spare));
        let loaded = dmaload::load(&path, &options);
        let save = dmaload::save(&data, &saved, &SaveOptions::default());
        set_open_files_limit(1 << 16);
        match save {
            Ok(report) => {
                assert_eq!(std::fs::read(&saved).unwrap(), data);
                // The save's own fallbacks (O_TMPFILE and such) need no fd.
                reasons.extend(
                    report
                        .fallbacks
                        .into_iter()
                        .filter(|f| f.from == "uring-fixed")
                        .map(|f| format!("save: {} -> {}: {}", f.from, f.to, f.reason)),
                );
            }
            Err(err) => assert_eq!(err.raw_os_error(), Some(libc::EMFILE), "save, {spare} spare: {err}"),
        }
        match loaded {
            Ok((buffer, report)) => {
                assert_pattern(&buffer, 0);
                reasons.extend(
                    report.fallbacks.into_iter().map(|f| format!("{} -> {}: {}", f.from, f.to, f.reason)),
                );
            }
            Err(err) => assert_eq!(err.raw_os_error(), Some(libc::EMFILE), "{spare} spare: {err}"),
        }
    }
    assert!(!reasons.is_empty(), "no limit forced a fallback");
    for reason in &reasons {
        assert!(reason.contains("RLIMIT_NOFILE"), "{reason}");
    }
}
