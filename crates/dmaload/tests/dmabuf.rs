//! dma-heap allocation, udmabuf export (one range and a list) and CPU
//! access through the dma-buf mmap, on a kernel that has them. Here they
//! skip with the reason; tests/vm/ci.sh runs them for real in a VM.

mod common;

use common::*;
use dmaload::heap::{self, CpuAccess};
use dmaload::{ErrorKind, LoadOptions};

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
        assert!(map.iter().all(|&b| b == 0), "a fresh dma-heap buffer is zeroed");
        map.iter_mut().enumerate().for_each(|(i, b)| *b = pattern_byte(i as u64));
    }
    let map = buf.map(CpuAccess::Read).unwrap();
    assert_pattern(&map, 0);
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
    let dmabuf = buffer.export_dmabuf().unwrap();
    assert_eq!(dmabuf.len(), (4 << 20) + 4096);
    let map = dmabuf.map(CpuAccess::Read).unwrap();
    assert_pattern(&map[..buffer.len()], 0);
    // A range whose data starts inside a page: the dma-buf covers whole pages.
    let (ranged, _) = dmaload::load_range(&path, 5000, 70_000, &LoadOptions::default()).unwrap();
    let dmabuf = ranged.export_dmabuf().unwrap();
    let map = dmabuf.map(CpuAccess::Read).unwrap();
    let start = ranged.memfd_offset() % 4096;
    assert_pattern(&map[start..start + ranged.len()], 5000);
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
    let joined =
        heap::udmabuf_export(&[(a.memfd().unwrap(), 0, 1 << 20), (b.memfd().unwrap(), 0, 1 << 20)]).unwrap();
    let map = joined.map(CpuAccess::Read).unwrap();
    // Both halves hold the pattern of their file offsets: 0.. and 1 MiB.., so
    // together they read as one pattern from 0.
    assert_pattern(&map, 0);
}

#[test]
fn udmabuf_beyond_its_size_limit_says_which_limit() {
    if !available("udmabuf_beyond_its_size_limit_says_which_limit", heap::udmabuf_probe()) {
        return;
    }
    let Some(limit) = heap::udmabuf_size_limit() else {
        return skip("udmabuf_beyond_its_size_limit_says_which_limit", "size_limit_mb is not readable");
    };
    let memfds: Vec<_> = (0..2)
        .map(|_| {
            let dir = scratch_dir();
            let path = dir.path().join("f");
            write_pattern_file(&path, 4096);
            dmaload::load(&path, &LoadOptions::default()).unwrap().0
        })
        .collect();
    // Ranges past each memfd's size are refused too; the limit is checked on
    // the total first, so ask for just over it across two items.
    let half = (limit / 2 + 4096) / 4096 * 4096;
    let err =
        heap::udmabuf_export(&[(memfds[0].memfd().unwrap(), 0, half), (memfds[1].memfd().unwrap(), 0, half)])
            .unwrap_err();
    eprintln!("over the limit: {err}");
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("size_limit_mb"), "{err}");
    // Anonymous memory has nothing to export.
    let dir = scratch_dir();
    let path = dir.path().join("g");
    write_pattern_file(&path, 4096);
    let opts = LoadOptions { memory: dmaload::MemoryKind::AnonymousThp, ..LoadOptions::default() };
    let (anon, _) = dmaload::load(&path, &opts).unwrap();
    assert_eq!(anon.export_dmabuf().unwrap_err().kind(), ErrorKind::InvalidInput);
}
