//! dma-heap allocation, udmabuf export (one range and a list) and CPU
//! access through the dma-buf mmap, on a kernel that has them. Here they
//! skip with the reason; tests/vm/ci.sh runs them for real in a VM.

mod common;

use common::*;
use dmaload::heap::{self, CpuAccess, DmaBuf, DmaBufMap};
use dmaload::{ErrorKind, LoadOptions};

fn read_all(map: &DmaBufMap<'_>) -> Vec<u8> {
    let mut bytes = vec![0u8; map.len()];
    map.read_at(0, &mut bytes).unwrap();
    bytes
}

fn available(test: &str, probe: Result<(), String>) -> bool {
    match probe {
        Ok(()) => true,
        Err(reason) => {
            skip(test, &reason);
            false
        }
    }
}

#[test]
fn dma_heap_buffer_is_zeroed_writable_and_keeps_its_bytes() {
    if !available("dma_heap_buffer_is_zeroed_writable_and_keeps_its_bytes", heap::dma_heap_probe()) {
        return;
    }
    let buf = heap::dma_heap_alloc(3 << 20).unwrap();
    assert_eq!(buf.len(), 3 << 20);
    {
        let mut map = buf.map(CpuAccess::ReadWrite).unwrap();
        assert!(read_all(&map).iter().all(|&b| b == 0), "a fresh dma-heap buffer is zeroed");
        let pattern: Vec<u8> = (0..map.len() as u64).map(pattern_byte).collect();
        map.write_at(0, &pattern).unwrap();
    }
    let map = buf.map(CpuAccess::Read).unwrap();
    assert_pattern(&read_all(&map), 0);
    // Copies are bounds-checked.
    assert!(map.read_at(map.len() - 1, &mut [0u8; 2]).is_err());
}

#[test]
fn a_loaded_buffer_exports_as_a_udmabuf_with_the_same_bytes() {
    if !available("a_loaded_buffer_exports_as_a_udmabuf_with_the_same_bytes", heap::udmabuf_probe()) {
        return;
    }
    let dir = scratch_dir();
    let path = dir.path().join("model");
    write_pattern_file(&path, (4 << 20) + 123);
    // Direct I/O into the memfd (the only way to get it into a dma-buf), then export.
    let (buffer, report) = dmaload::load(&path, &LoadOptions::default()).unwrap();
    eprintln!("loaded with {} ({:?})", report.engine.name(), report.cache);
    let len = buffer.len();
    let dmabuf = buffer.into_dmabuf().map_err(|refused| refused.0).unwrap();
    assert_eq!(dmabuf.len(), (4 << 20) + 4096);
    let map = dmabuf.map(CpuAccess::Read).unwrap();
    assert_pattern(&read_all(&map)[..len], 0);
    // A range whose data starts inside a page: the dma-buf covers whole pages.
    let (ranged, _) = dmaload::LoadRequest::path(&path).range(5000, 70_000).to_buffer().unwrap();
    let (start, len) = (ranged.memfd_offset() % 4096, ranged.len());
    let dmabuf = ranged.into_dmabuf().map_err(|refused| refused.0).unwrap();
    let map = dmabuf.map(CpuAccess::Read).unwrap();
    assert_pattern(&read_all(&map)[start..start + len], 5000);
}

#[test]
fn udmabuf_create_list_joins_memfds_in_order() {
    if !available("udmabuf_create_list_joins_memfds_in_order", heap::udmabuf_probe()) {
        return;
    }
    let dir = scratch_dir();
    let (a_path, b_path) = (dir.path().join("a"), dir.path().join("b"));
    write_pattern_file(&a_path, 1 << 20);
    write_pattern_file(&b_path, 2 << 20);
    let (a, _) = dmaload::load(&a_path, &LoadOptions::default()).unwrap();
    let (b, _) = dmaload::LoadRequest::path(&b_path).range(1 << 20, 1 << 20).to_buffer().unwrap();
    let joined = DmaBuf::udmabuf_join(vec![a, b]).map_err(|refused| refused.0).unwrap();
    let map = joined.map(CpuAccess::Read).unwrap();
    // Both halves hold the pattern of their file offsets: 0.. and 1 MiB.., so
    // together they read as one pattern from 0.
    assert_pattern(&read_all(&map), 0);
}

#[test]
fn anonymous_memory_has_nothing_to_export() {
    // (udmabuf's size limit is checked with the bench crate's udmabuf
    // buffers: crates/dmaload-bench/tests/transfer.rs.)
    let dir = scratch_dir();
    let path = dir.path().join("g");
    write_pattern_file(&path, 4096);
    let opts = LoadOptions { to: dmaload::Destination::AnonymousThp, ..LoadOptions::default() };
    let (anon, _) = dmaload::load(&path, &opts).unwrap();
    let (err, anon) = *anon.into_dmabuf().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(anon.len(), 4096, "a failed export gives the buffer back");
}

#[test]
fn a_loaded_memfd_is_sealed_against_writes_from_whoever_receives_it() {
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 3 << 20);
    let (buffer, _) = dmaload::load(&path, &LoadOptions::default()).unwrap();
    let received = std::fs::File::from(buffer.memfd().unwrap().unwrap().try_clone_to_owned().unwrap());
    // write(2) and ftruncate(2) are refused (EPERM)...
    let err = std::os::unix::fs::FileExt::write_at(&received, b"x", 0).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    assert!(received.set_len(1 << 20).is_err());
    // ...and so is a new writable shared mapping.
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&received);
    // SAFETY: a mapping the kernel places; it is refused here.
    let map = unsafe { libc::mmap(std::ptr::null_mut(), 4096, rw, libc::MAP_SHARED, fd, 0) };
    let err = std::io::Error::last_os_error();
    assert_eq!((map, err.raw_os_error()), (libc::MAP_FAILED, Some(libc::EPERM)), "{err}");
    assert_pattern(&buffer, 0);
    // udmabuf refuses such a memfd: the export says why instead of EINVAL.
    let (err, buffer) = *buffer.into_dmabuf().unwrap_err();
    assert!(err.to_string().contains("export before sharing the fd"), "{err}");
    assert_pattern(&buffer, 0);
}

#[test]
fn a_shared_buffer_memfd_cannot_be_exported_by_fd() {
    // The buffer lends its bytes as &[u8]: a dma-buf of its sealed memfd
    // would let devices write under that borrow, so it is refused before
    // udmabuf is even asked (this runs without /dev/udmabuf too).
    let dir = scratch_dir();
    let path = dir.path().join("f");
    write_pattern_file(&path, 1 << 20);
    let (buffer, _) = dmaload::load(&path, &LoadOptions::default()).unwrap();
    let fd = buffer.memfd().unwrap().unwrap();
    let err = heap::udmabuf_from_memfd(fd, 0, 1 << 20).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("sealed against writes"), "{err}");
    assert_pattern(&buffer, 0);
}

/// The range's bytes read back through a fresh mapping of the dma-buf
/// (`DMA_BUF_IOCTL_SYNC` read bracket), as `read_each` hands them out.
fn read_back(loaded: &dmaload::LoadedDmaBuf) -> Vec<u8> {
    let mut bytes = Vec::new();
    loaded.read_each(|part| bytes.extend_from_slice(part)).unwrap();
    assert_eq!(bytes.len() as u64, loaded.len);
    bytes
}

fn to(destination: &str) -> LoadOptions {
    LoadOptions { to: destination.parse().unwrap(), ..LoadOptions::default() }
}

#[test]
fn load_dmabuf_from_a_dma_heap_holds_the_file_and_nothing_else() {
    if !available("load_dmabuf_from_a_dma_heap_holds_the_file_and_nothing_else", heap::dma_heap_probe()) {
        return;
    }
    let dir = scratch_dir();
    let path = dir.path().join("model");
    // Past one 8 MiB slot, not a whole page.
    let len = (19 << 20) + 123;
    write_pattern_file(&path, len);
    let (loaded, report) =
        dmaload::LoadRequest::path(&path).options(&to("dma-heap:system")).to_dmabuf().unwrap();
    eprintln!("{} via {} ({:?}): {}", report.bytes, report.engine.name(), report.cache, report.destination);
    assert!(report.destination.starts_with("dma-heap:system via staging ring"), "{}", report.destination);
    assert_eq!((loaded.data_offset, loaded.len, loaded.dmabuf.len()), (0, len, len.div_ceil(4096) * 4096));
    assert_pattern(&read_back(&loaded), 0);
    // The page's tail past the file is the heap's zeroes.
    let map = loaded.dmabuf.map(CpuAccess::Read).unwrap();
    assert!(read_all(&map)[len as usize..].iter().all(|&b| b == 0));
    // A range from an unaligned offset lands at the dma-buf's start.
    let (ranged, _) = dmaload::LoadRequest::path(&path)
        .range(5000, Some(3 << 20))
        .options(&to("dma-heap"))
        .to_dmabuf()
        .unwrap();
    assert_eq!(ranged.data_offset, 0);
    assert_pattern(&read_back(&ranged), 5000);
    // A file smaller than a page: one page of dma-buf, a ring of two small slots.
    let tiny = dir.path().join("tiny");
    write_pattern_file(&tiny, 100);
    let (loaded, _) = dmaload::LoadRequest::path(&tiny).options(&to("dma-heap:system")).to_dmabuf().unwrap();
    assert_eq!((loaded.len, loaded.dmabuf.len()), (100, 4096));
    assert_pattern(&read_back(&loaded), 0);
}

#[test]
fn the_dma_heap_sink_fills_through_a_ring_that_wraps() {
    if !available("the_dma_heap_sink_fills_through_a_ring_that_wraps", heap::dma_heap_probe()) {
        return;
    }
    let dir = scratch_dir();
    let path = dir.path().join("model");
    write_pattern_file(&path, (2 << 20) + 777);
    // Two 64 KiB slots for a megabyte: the ring wraps eight times over.
    let mut ring = dmaload::StagingRing::new(2, 64 << 10, 64 << 10).unwrap();
    let (offset, len) = (4097, 1 << 20);
    let heap = heap::DmaHeap::open("system").unwrap();
    let mut sink = dmaload::DmaHeapSink::allocate(heap, offset, len).unwrap();
    let opts = LoadOptions { chunk_size: 64 << 10, ..LoadOptions::default() };
    dmaload::LoadRequest::path(&path)
        .range(offset, Some(len))
        .options(&opts)
        .to_sink(&mut ring, &mut sink)
        .unwrap();
    let dmabuf = sink.into_dmabuf().unwrap();
    let map = dmabuf.map(CpuAccess::Read).unwrap();
    assert_pattern(&read_all(&map)[..len as usize], offset);
}

#[test]
fn load_dmabuf_through_udmabuf_is_the_memfd_itself() {
    if !available("load_dmabuf_through_udmabuf_is_the_memfd_itself", heap::udmabuf_probe()) {
        return;
    }
    let dir = scratch_dir();
    let path = dir.path().join("model");
    write_pattern_file(&path, (6 << 20) + 5);
    let (loaded, report) = dmaload::LoadRequest::path(&path).options(&to("udmabuf")).to_dmabuf().unwrap();
    assert_eq!(report.destination, "udmabuf (memfd exported, no copy)");
    assert_eq!(loaded.dmabuf.len(), (6 << 20) + 4096);
    assert_pattern(&read_back(&loaded), 0);
    // An unaligned range: the dma-buf covers whole pages, the bytes start inside.
    let (ranged, _) = dmaload::LoadRequest::path(&path)
        .range(5000, Some(70_000))
        .options(&to("udmabuf"))
        .to_dmabuf()
        .unwrap();
    // Direct I/O aligned the offset down to the device's block, udmabuf to the page.
    assert!(ranged.data_offset <= 5000 % 4096, "{}", ranged.data_offset);
    assert_pattern(&read_back(&ranged), 5000);
    let tiny = dir.path().join("tiny");
    write_pattern_file(&tiny, 100);
    let (loaded, _) = dmaload::LoadRequest::path(&tiny).options(&to("udmabuf")).to_dmabuf().unwrap();
    assert_eq!((loaded.len, loaded.dmabuf.len()), (100, 4096));
    assert_pattern(&read_back(&loaded), 0);
}

#[test]
fn dmabuf_says_which_producer_it_used_and_why() {
    let dir = scratch_dir();
    let path = dir.path().join("model");
    write_pattern_file(&path, 3 << 20);
    let outcome = dmaload::LoadRequest::path(&path).options(&to("dmabuf")).to_dmabuf();
    match (heap::udmabuf_probe(), heap::dma_heap_probe()) {
        (Ok(()), _) => {
            let (loaded, report) = outcome.unwrap();
            assert!(report
                .destination
                .starts_with("udmabuf (memfd exported, no copy) (dmabuf: /dev/udmabuf exists"));
            assert_pattern(&read_back(&loaded), 0);
        }
        (Err(why), Ok(())) => {
            let (loaded, report) = outcome.unwrap();
            assert!(report.destination.starts_with("dma-heap:system"), "{}", report.destination);
            let fallback = &report.fallbacks[0];
            assert_eq!((fallback.from.as_str(), fallback.to.as_str()), ("udmabuf", "dma-heap:system"));
            assert_eq!(fallback.reason, why);
            assert_pattern(&read_back(&loaded), 0);
        }
        (Err(_), Err(_)) => {
            let err = outcome.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
            assert!(err.to_string().contains("/dev/dma_heap/system"), "{err}");
            assert!(err.to_string().contains("and not udmabuf: /dev/udmabuf does not exist"), "{err}");
            skip("dmabuf_says_which_producer_it_used_and_why", "neither udmabuf nor a dma-heap here");
        }
    }
}

#[test]
fn dma_buf_loads_refuse_what_they_cannot_do_before_reading() {
    let dir = scratch_dir();
    let path = dir.path().join("model");
    write_pattern_file(&path, 1 << 20);
    // An unknown heap names its path (and whatever heaps exist).
    let err =
        dmaload::LoadRequest::path(&path).options(&to("dma-heap:no-such-heap")).to_dmabuf().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("/dev/dma_heap/no-such-heap"), "{err}");
    assert!(err.to_string().contains("heaps here:") || err.to_string().contains("no dma-heaps"), "{err}");
    // Nothing to put in a dma-buf.
    std::fs::write(dir.path().join("empty"), b"").unwrap();
    let err =
        dmaload::LoadRequest::path(&dir.path().join("empty")).options(&to("dmabuf")).to_dmabuf().unwrap_err();
    assert!(err.to_string().contains("empty range"), "{err}");
    // A range past the end, a missing file, a host destination.
    let err = dmaload::LoadRequest::path(&path)
        .range(0, Some(2 << 20))
        .options(&to("dmabuf"))
        .to_dmabuf()
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Truncated, "{err}");
    let err = dmaload::LoadRequest::path(&dir.path().join("missing"))
        .options(&to("dmabuf"))
        .to_dmabuf()
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    let err = dmaload::LoadRequest::path(&path).options(&to("memfd")).to_dmabuf().unwrap_err();
    assert!(err.to_string().contains("not a dma-buf destination"), "{err}");
    // udmabuf where the kernel has none says so; load() points at load_dmabuf.
    if let Err(why) = heap::udmabuf_probe() {
        let err = dmaload::LoadRequest::path(&path).options(&to("udmabuf")).to_dmabuf().unwrap_err();
        assert!(err.to_string().contains(&why), "{err}");
    }
    let err = dmaload::load(&path, &to("udmabuf")).unwrap_err();
    assert!(err.to_string().contains("load it with load_dmabuf"), "{err}");
}
