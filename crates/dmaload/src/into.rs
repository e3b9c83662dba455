//! [`crate::LoadRequest::fill`]: a file's bytes into memory the caller already has (an
//! existing allocation, a tensor, a C program's buffer).
//!
//! Where the memory lines up with the file, the engine reads straight into
//! it: the caller's pages are populated and registered gather by gather,
//! exactly as a fresh buffer's are, and only the edges (the bytes before
//! the first page boundary of the memory and after the last whole page, or
//! whole block of the alignment where that is larger) go through a staging
//! ring of two such pages or blocks. "Lines up" means that the file offset of the
//! first whole page of memory is a multiple of the read alignment: always
//! for buffered reads, and for direct I/O when memory address and file
//! offset agree modulo the alignment (page-aligned memory and an aligned
//! offset, say). Anything else goes through a staging ring and
//! [`HostSink`], one copy.

use crate::error::{Error, Result};
use crate::memory::MemoryKind;
use crate::memory::{MemoryChoice, MemoryFacts};
use crate::options::LoadOptions;
use crate::pagecache::cached_source_options;
use crate::pipeline::{fill_mapping, load_open_to_sink, open_range, with_kept_ring};
use crate::plan::Plan;
use crate::report::LoadReport;
use crate::sink::{HostSink, StagingRing};
use crate::source::OpenFile;
use crate::sys;
use crate::sys::mem::RawBytesMut;
use crate::types::{Fallback, IoMode};
use crate::verify::Expected;

/// Fills `dst` with the file's bytes from `offset` (see
/// [`crate::LoadRequest::fill_arriving`] for what `arrived` hears); the
/// request checked the options.
pub(crate) fn fill_into(
    file: &OpenFile,
    offset: u64,
    dst: RawBytesMut<'_>,
    options: &LoadOptions,
    arrived: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<LoadReport> {
    let mut dst = dst;
    let path = file.path();
    let len = dst.len() as u64;
    // A verified load is checked before anything is read, and reports no
    // bytes as arrived before they are checked.
    let expected = Expected::for_load(file, offset, Some(len), options.verify)?;
    let arrived = arrived.filter(|_| expected.is_none());
    let page = sys::mem::page_size();
    let address = dst.as_ptr() as usize;
    let head = (address.next_multiple_of(page) - address).min(dst.len());
    let warm = cached_source_options(file, offset, Some(len), options)?;
    let (options, cached) = match &warm {
        Some((warm, why)) => (warm, Some(why)),
        None => (options, None),
    };
    let mut opened = open_range(file.source(), path, offset, Some(len), options, false)?;
    opened.fallbacks.extend(cached.cloned());
    let body_offset = offset + head as u64;
    let align = opened.setup.align;
    // Whole pages of memory and whole blocks of the file (an alignment may
    // be larger than a page): the reads end where the body does.
    let block = page.max(align);
    let body = (dst.len() - head) / block * block;
    if body == 0 || !align.is_power_of_two() || body_offset % align as u64 != 0 {
        drop(opened);
        return staged(file, offset, dst, options, None);
    }
    let plan_for =
        |align| Plan::new(body_offset, body as u64, align, options.chunk_size, options.gather_size, page);
    let in_place = opened.read(options, plan_for, |setup, plan, options| {
        let (mut head_bytes, rest) = dst.reborrow().split_at(head);
        let (mut body_bytes, mut tail_bytes) = rest.split_at(body);
        // Bytes 0..n of the body are bytes 0..n of `dst` only without a head.
        let unchanged_to = |n: u64| {
            if let Some(arrived) = arrived.filter(|_| head == 0) {
                // Never report bytes of a file written meanwhile: the load
                // fails at its end, and nothing of it may be used.
                if file.source().check_unchanged(path, offset + len).is_ok() {
                    arrived(n);
                }
            }
        };
        let follow: Option<&(dyn Fn(u64) + Sync)> = arrived.and(Some(&unchanged_to));
        // The edges are read apart from the body: in file order, so that
        // a verified load hashes head, body and tail as they come.
        let verifier = expected.as_ref().map(Expected::verifier);
        read_edge(file, offset, head_bytes.reborrow(), block, options)?;
        if let Some(verifier) = &verifier {
            verifier.add(head_bytes.writer(), 0..head, offset);
        }
        let filled = fill_mapping(
            path,
            setup,
            plan,
            body as u64,
            options,
            body_bytes.writer(),
            follow,
            verifier.as_ref(),
        )?;
        let tail_offset = body_offset + body as u64;
        read_edge(file, tail_offset, tail_bytes.reborrow(), block, options)?;
        if let Some(verifier) = verifier {
            let tail = tail_bytes.len();
            verifier.add(tail_bytes.writer(), 0..tail, tail_offset);
            verifier.check(path)?;
        }
        Ok(filled)
    });
    let ((run, times), plan) = match in_place {
        Ok(done) => done,
        // Memory that direct I/O cannot reach (a device's mapping, such as a
        // dma-buf's, gives EFAULT) is still reachable by a copy.
        Err(err) if err.raw_os_error() == Some(libc::EFAULT) && options.mode != IoMode::Buffered => {
            let why = format!("the memory refused direct I/O into it ({err})");
            return staged(file, offset, dst, options, Some(Fallback::new("in place", "staging ring", why)));
        }
        Err(err) => return Err(err),
    };
    let waited = run.waited_for_memory;
    let memory = MemoryChoice { kind: MemoryKind::default(), reason: "the caller's memory".into() };
    let mut report = opened.report(&plan, run, options, memory, &MemoryFacts::read())?;
    report.destination = "caller memory (in place)".into();
    report.register_seconds = times.register.as_secs_f64();
    report.alloc_seconds = times.all.as_secs_f64();
    report.first_gather_seconds = times.first.as_secs_f64();
    report.io_seconds = (report.total_seconds - waited.as_secs_f64()).max(0.0);
    Ok(report)
}

/// Reads file bytes `offset..offset + dst.len()` (less than a `block`, a
/// page or one aligned read, around a boundary of one) into `dst` through a
/// staging ring of two such blocks: the same pipeline, whatever the
/// alignment of either end.
fn read_edge(
    file: &OpenFile,
    offset: u64,
    dst: RawBytesMut<'_>,
    block: usize,
    options: &LoadOptions,
) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    let page = sys::mem::page_size();
    let mut ring =
        StagingRing::new(2, block, page).map_err(|e| Error::io("allocate staging ring", file.path(), e))?;
    // The caller hashes an edge of a verified load with the rest.
    let quiet = LoadOptions { progress: None, verify: false, ..options.clone() };
    load_open_to_sink(
        file,
        offset,
        Some(dst.len() as u64),
        &mut ring,
        &mut HostSink::raw(dst, offset),
        &quiet,
    )?;
    Ok(())
}

/// The whole range through the process's kept staging ring (see
/// `pipeline::with_kept_ring`), copied into `dst`.
fn staged(
    file: &OpenFile,
    offset: u64,
    dst: RawBytesMut<'_>,
    options: &LoadOptions,
    fallback: Option<Fallback>,
) -> Result<LoadReport> {
    let len = dst.len() as u64;
    let (mut report, geometry) = with_kept_ring(file.path(), options.chunk_size, |ring| {
        let geometry = (ring.slots(), ring.slot_len());
        let sink = &mut HostSink::raw(dst, offset);
        load_open_to_sink(file, offset, Some(len), ring, sink, options).map(|r| (r, geometry))
    })?;
    report.fallbacks.extend(fallback);
    report.destination = format!("caller memory (staged through {} x {} bytes)", geometry.0, geometry.1);
    Ok(report)
}
