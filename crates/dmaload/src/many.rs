//! Several files at once (the shards of a model) under one memory budget:
//! the sum of their sizes is checked against the memory available before
//! anything is allocated, `concurrency` files load at a time, progress is
//! summed over all of them, and the first failure cancels the rest, so the
//! call returns every file or none.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, ErrorKind, Result};
use crate::options::LoadOptions;
use crate::system;

/// Files loaded at a time by default: enough to keep a fast disk busy
/// while each load's own queue covers one file.
pub const DEFAULT_CONCURRENCY: usize = 4;

/// Loads every file of `paths` with `load`, `concurrency` at a time, under
/// the module doc's budget, cancel and progress rules; what each load
/// made comes back in the order of `paths`. `load` is [`crate::load()`]
/// for host buffers, [`crate::format::safetensors::load`] for safetensors
/// files (each header validated before its file is loaded, and checked
/// again in the loaded bytes), or any load of one path.
///
/// ```no_run
/// # use std::path::PathBuf;
/// let shards = [PathBuf::from("model-1.safetensors"), PathBuf::from("model-2.safetensors")];
/// let options = dmaload::LoadOptions::default();
/// let loaded = dmaload::load_many(&shards, &options, 4, |path, options| {
///     dmaload::format::safetensors::load(path, options)
/// })?;
/// # Ok::<(), dmaload::format::safetensors::Error>(())
/// ```
pub fn load_many<T: Send, E: From<Error> + Send>(
    paths: &[PathBuf],
    options: &LoadOptions,
    concurrency: usize,
    load: impl Fn(&Path, &LoadOptions) -> std::result::Result<T, E> + Sync,
) -> std::result::Result<Vec<T>, E> {
    let first = paths.first().map_or(Path::new(""), |p| p.as_path());
    if concurrency == 0 {
        return Err(
            Error::new(ErrorKind::InvalidInput, "load", first, "concurrency must be at least 1").into()
        );
    }
    let sizes = paths
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).map_err(|e| Error::io("stat", p, e)))
        .collect::<Result<Vec<u64>>>()?;
    let total: u64 = sizes.iter().sum();
    if paths.len() > 1 {
        let budget =
            system::memory_budget_for(total).map_err(|e| Error::io("read /proc/meminfo", first, e))?;
        if total > budget.available {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                "load",
                first,
                format!(
                    "{} files need {total} bytes of memory but only {} are available ({})",
                    paths.len(),
                    budget.available,
                    budget.limited_by
                ),
            )
            .into());
        }
    }
    // Summed progress: each load reports its own count, which may restart
    // from zero on a retried load: only growth beyond what it showed counts.
    let done = Arc::new(AtomicU64::new(0));
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    // The file whose failure stopped the others: its error is the cause.
    let cause = AtomicUsize::new(usize::MAX);
    // The first failure stops the other files, never the caller's token.
    let group = options.cancel.child();
    let results: Vec<Mutex<Option<std::result::Result<T, E>>>> =
        paths.iter().map(|_| Mutex::new(None)).collect();
    let worker = || loop {
        let i = next.fetch_add(1, Ordering::AcqRel);
        if i >= paths.len() || failed.load(Ordering::Acquire) || group.is_cancelled() {
            break;
        }
        let mut file_options = LoadOptions { cancel: group.clone(), ..options.clone() };
        if let Some(callback) = options.progress.clone() {
            let (done, seen) = (done.clone(), AtomicU64::new(0));
            file_options.progress = Some(Arc::new(move |now: u64, _| {
                let before = seen.fetch_max(now, Ordering::AcqRel);
                let sum =
                    done.fetch_add(now.saturating_sub(before), Ordering::AcqRel) + now.saturating_sub(before);
                callback(sum.min(total), total);
            }));
        }
        let result = load(&paths[i], &file_options);
        if result.is_err() && !failed.swap(true, Ordering::AcqRel) {
            cause.store(i, Ordering::Release);
            group.cancel();
        }
        *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
    };
    std::thread::scope(|scope| {
        // This thread is one of the workers; helpers the process may not
        // create (RLIMIT_NPROC) only mean fewer files at a time.
        for _ in 1..concurrency.min(paths.len()) {
            if std::thread::Builder::new().name("dmaload-file".into()).spawn_scoped(scope, worker).is_err() {
                break;
            }
        }
        worker();
    });
    let mut results: Vec<_> =
        results.into_iter().map(|r| r.into_inner().unwrap_or_else(|p| p.into_inner())).collect();
    if let Some(Some(Err(err))) = results.get_mut(cause.load(Ordering::Acquire)).map(Option::take) {
        return Err(err);
    }
    let mut loaded = Vec::with_capacity(paths.len());
    for result in results {
        match result {
            Some(Ok(value)) => loaded.push(value),
            Some(Err(err)) => return Err(err),
            // Not started: the caller cancelled.
            None => return Err(crate::engine::cancelled_error("load", first, 0).into()),
        }
    }
    Ok(loaded)
}
