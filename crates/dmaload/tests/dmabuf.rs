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
    let (ranged, _) = dmaload::load_range(&path, 5000, 70_000, &LoadOptions::default()).unwrap();
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
    let (b, _) = dmaload::load_range(&b_path, 1 << 20, 1 << 20, &LoadOptions::default()).unwrap();
    let joined = DmaBuf::udmabuf_join(vec![a, b]).map_err(|refused| refused.0).unwrap();
    let map = joined.map(CpuAccess::Read).unwrap();
    // Both halves hold the pattern of their file offsets: 0.. and 1 MiB.., so
    // together they read as one pattern from 0.
    assert_pattern(&read_all(&map), 0);
}

#[test]
fn udmabuf_beyond_its_size_limit_says_which_limit() {
    if !available("udmabuf_beyond_its_size_limit_says_which_limit", heap::udmabuf_probe()) {
        return;
    }
    let Some(limit) = heap::udmabuf_size_limit() else {
        return skip("udmabuf_beyond_its_size_limit_says_which_limit", "size_limit_mb is not readable");
    };
    // A sparse memfd past the limit: udmabuf checks the size before it pins.
    let err = dmaload::transfer::TransferBuffer::new(
        dmaload::transfer::MemoryType::Udmabuf,
        (limit + 4096) as usize,
    )
    .map(drop)
    .unwrap_err();
    eprintln!("over the limit: {err}");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("size_limit_mb"), "{err}");
    // Anonymous memory has nothing to export.
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
    let received = std::fs::File::from(buffer.memfd().unwrap().try_clone_to_owned().unwrap());
    // write(2) and ftruncate(2) are refused (EPERM)...
    let err = std::os::unix::fs::FileExt::write_at(&received, b"x", 0).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    assert!(received.set_len(1 << 20).is_err());
    // ...and so is a new writable shared mapping.
    let err = dmaload::heap::SharedMapping::new(std::os::fd::AsFd::as_fd(&received), 4096).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    assert_pattern(&buffer, 0);
    // udmabuf refuses such a memfd: the export says why instead of EINVAL.
    let (err, buffer) = *buffer.into_dmabuf().unwrap_err();
    assert!(err.to_string().contains("export before sharing the fd"), "{err}");
    assert_pattern(&buffer, 0);
}
