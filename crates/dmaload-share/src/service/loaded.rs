//! A file (or object) the service keeps: its sealed memfd, and the
//! thread that rebuilds its pages as 2 MiB pages once it is cached.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::lock;
use dmaload::buffer::Buffer;
use dmaload::error::{Error, Result};
use dmaload::sys_share::{page_size, HugePageCollapse};
use dmaload::LoadReport;

/// A loaded file, sealed: what every client of it gets a descriptor of.
pub(super) struct Loaded {
    pub(super) memfd: OwnedFd,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Memory it holds (whole pages).
    pub(super) bytes: u64,
    pub(super) path: PathBuf,
    /// The pages that hold it, as the status shows them.
    pub(super) pages: Mutex<String>,
    /// The memfd pinned for GPU clients, once the first asked.
    pub(super) registered: Mutex<Option<Arc<dmaload::cuda::RegisteredFile>>>,
}

/// A cached file's pages while [`Loaded::collapse_in_background`] works.
pub(super) const COLLAPSING: &str = "4 KiB, collapsing into 2 MiB";

/// Bytes collapsed at a time: between windows the thread looks whether the
/// file is still cached, so one dropped meanwhile stops taking huge pages
/// (and holding its memory past the limit) within a window.
const COLLAPSE_WINDOW: usize = 64 << 20;

/// How often, and how far apart, a window whose pages were in use is tried.
const COLLAPSE_ATTEMPTS: usize = 20;
const COLLAPSE_RETRY: Duration = Duration::from_millis(100);

/// How a background collapse ended.
enum CollapseEnd {
    Done,
    /// The file left the cache after `at` bytes.
    Dropped {
        at: usize,
    },
    /// The kernel refused at byte `at` (what came before stays collapsed).
    Failed {
        at: usize,
        err: io::Error,
    },
}

impl Loaded {
    /// Rebuilds the file's pages as 2 MiB pages on a thread of its own,
    /// window by window while the file stays cached, logging how it went:
    /// clients asking meanwhile map whichever pages the memfd holds at that
    /// moment, the bytes the same either way. The thread keeps only a weak
    /// reference: an evicted file is not kept alive by its collapse. The
    /// caller has marked the pages [`COLLAPSING`] already (before its reply).
    pub(super) fn collapse_in_background(self: &Arc<Loaded>, log: Arc<dyn Fn(&str) + Send + Sync>) {
        let file = Arc::downgrade(self);
        let path = self.path.clone();
        let bytes = self.bytes;
        let spawned = std::thread::Builder::new().name("dmaload-collapse".into()).spawn(move || {
            let started = Instant::now();
            let (pages, line) = match collapse_windows(&file) {
                CollapseEnd::Done => (
                    Some("2 MiB".to_owned()),
                    format!(
                        "collapsed {} into 2 MiB pages in {:.1} s",
                        path.display(),
                        started.elapsed().as_secs_f64()
                    ),
                ),
                CollapseEnd::Dropped { at } => (
                    None,
                    format!(
                        "stopped collapsing {} after {at} of {bytes} bytes: it left the cache",
                        path.display()
                    ),
                ),
                CollapseEnd::Failed { at: 0, err } => (
                    Some(format!("4 KiB (collapse failed: {err})")),
                    format!("{} stays in 4 KiB pages: collapse failed: {err}", path.display()),
                ),
                CollapseEnd::Failed { at, err } => (
                    Some(format!("4 KiB and 2 MiB (collapse failed at byte {at}: {err})")),
                    format!(
                        "{} stays in 4 KiB pages from byte {at} on: collapse failed there: {err}",
                        path.display()
                    ),
                ),
            };
            if let (Some(pages), Some(loaded)) = (pages, file.upgrade()) {
                *lock(&loaded.pages) = pages;
            }
            log(&line);
        });
        if let Err(err) = spawned {
            *lock(&self.pages) = format!("4 KiB (collapse failed: no thread: {err})");
        }
    }
}

/// Collapses `file` window by window while it is still cached, saying in
/// its status how far it got. EAGAIN is the kernel
/// finding a page in use (a client mapping it that moment, or pins the
/// load's ring is dropping): the window is tried again a little later.
fn collapse_windows(file: &Weak<Loaded>) -> CollapseEnd {
    let map = |loaded: Arc<Loaded>| {
        HugePageCollapse::map(loaded.memfd.as_fd(), usize::try_from(loaded.bytes).unwrap_or(usize::MAX))
    };
    let collapse = match file.upgrade().map(map) {
        None => return CollapseEnd::Dropped { at: 0 },
        Some(Err(err)) => return CollapseEnd::Failed { at: 0, err },
        Some(Ok(collapse)) => collapse,
    };
    let len = collapse.len();
    let mut at = 0;
    while at < len {
        let window = at..(at + COLLAPSE_WINDOW).min(len);
        let mut attempts = 0;
        loop {
            // Not kept across the collapse: the cache alone keeps the file.
            match file.upgrade() {
                Some(loaded) => *lock(&loaded.pages) = format!("{COLLAPSING} ({}%)", at * 100 / len),
                None => return CollapseEnd::Dropped { at },
            }
            attempts += 1;
            match collapse.collapse(window.clone()) {
                Ok(()) => break,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock && attempts < COLLAPSE_ATTEMPTS => {
                    std::thread::sleep(COLLAPSE_RETRY)
                }
                Err(err) => return CollapseEnd::Failed { at, err },
            }
        }
        at = window.end;
    }
    CollapseEnd::Done
}

impl Loaded {
    /// A loaded buffer's memfd, sealed, as the cache keeps it.
    pub(super) fn seal(buffer: Buffer, report: LoadReport) -> Result<Loaded> {
        let (memfd, range) =
            buffer.into_sealed_memfd().map_err(|e| Error::io("seal memfd", &report.path, e))?;
        let bytes = (range.end as u64).div_ceil(page_size() as u64) * page_size() as u64;
        let pages = if report.huge_pages { "2 MiB" } else { "4 KiB" };
        Ok(Loaded {
            memfd,
            offset: range.start as u64,
            len: range.len() as u64,
            bytes,
            path: report.path,
            pages: Mutex::new(pages.into()),
            registered: Mutex::new(None),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::lock;
    use dmaload::{Destination, LoadOptions};

    /// The byte at `i` of a test file.
    fn byte(i: usize) -> u8 {
        (i % 251) as u8
    }

    /// A cached file of `len` bytes in a memfd's 4 KiB pages, loaded and
    /// sealed as the service keeps one.
    fn cached(len: usize) -> Arc<Loaded> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        std::fs::write(&path, (0..len).map(byte).collect::<Vec<u8>>()).unwrap();
        let options = LoadOptions { to: Destination::Memfd, ..LoadOptions::default() };
        let (buffer, report) = dmaload::load(&path, &options).unwrap();
        Arc::new(Loaded::seal(buffer, report).unwrap())
    }

    /// The cached file as a client maps it.
    fn handed_out(file: &Loaded) -> Buffer {
        let memfd = file.memfd.try_clone().unwrap();
        Buffer::from_sealed_memfd(memfd, file.offset, file.len, std::path::Path::new("test")).unwrap()
    }

    #[test]
    fn a_collapse_stops_at_its_next_window_once_the_file_has_left_the_cache() {
        let file = cached(2 * COLLAPSE_WINDOW);
        let weak = Arc::downgrade(&file);
        drop(file); // what eviction does when no request holds the file
        assert!(matches!(collapse_windows(&weak), CollapseEnd::Dropped { at: 0 }));
    }

    #[test]
    fn a_cached_file_collapses_window_by_window_to_its_end() {
        let len = COLLAPSE_WINDOW + (4 << 20);
        let file = cached(len);
        match collapse_windows(&Arc::downgrade(&file)) {
            CollapseEnd::Done => {}
            // An older kernel, no THP, shmem_enabled deny; or, at any
            // window, no huge page to be had (EAGAIN, ENOMEM).
            CollapseEnd::Failed { at, err }
                if at == 0 || matches!(err.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM)) =>
            {
                return println!("SKIP collapse at byte {at}: {err}");
            }
            CollapseEnd::Failed { at, err } => panic!("failed at byte {at}: {err}"),
            CollapseEnd::Dropped { at } => panic!("dropped at byte {at} while cached"),
        }
        // The status counted the windows: the last one started past half.
        assert_eq!(*lock(&file.pages), format!("{COLLAPSING} (94%)"));
        let buffer = handed_out(&file);
        assert!(buffer.iter().enumerate().all(|(i, &b)| b == byte(i)));
        assert_eq!(buffer.huge_page_bytes().unwrap(), len as u64);
    }
}
