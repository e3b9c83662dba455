//! `LoadRequest`: one request type whose verbs every front end runs. Each
//! verb is resolved the same way before anything is opened (options
//! checked, destination decided), and each source (path, open file, fd)
//! gives the same bytes.

mod common;

use std::os::fd::AsFd;

use common::*;
use dmaload::sink::{HostSink, StagingRing};
use dmaload::{heap, ErrorKind, LoadOptions, LoadRequest, Loaded, OpenFile};

fn to(destination: &str) -> LoadOptions {
    LoadOptions { to: destination.parse().unwrap(), ..LoadOptions::default() }
}

fn bytes_of(loaded: &Loaded) -> Vec<u8> {
    let mut bytes = Vec::new();
    loaded.read_each(|chunk| bytes.extend_from_slice(chunk)).unwrap();
    bytes
}

/// `load()`, the verb `dmaload load --to`, C's `dmaload_load` and Python's
/// loads run, puts a range where `options.to` says: a host kind gives a
/// buffer, a dma-buf kind a dma-buf (where this kernel makes one), from a
/// path, an open file or an fd alike.
#[test]
fn load_puts_the_range_where_the_options_name() {
    let dir = scratch_dir();
    let path = dir.path().join("model");
    write_pattern_file(&path, 3 << 20);
    let (offset, len) = (12_345, 1 << 20);
    let memfd = to("memfd");
    let opened = OpenFile::open(&path).unwrap();
    let fd = std::fs::File::open(&path).unwrap();
    for request in [LoadRequest::path(&path), LoadRequest::open(&opened), LoadRequest::fd(fd.as_fd())] {
        let (loaded, report) = request.range(offset, len).options(&memfd).load().unwrap();
        let Loaded::Host(buffer) = &loaded else { panic!("memfd is a host kind: {loaded:?}") };
        assert!(buffer.memfd().unwrap().is_some(), "memfd was asked for");
        assert_eq!(report.bytes, len);
        assert_pattern(&bytes_of(&loaded), offset);
    }
    // The whole file, by default.
    let (loaded, _) = LoadRequest::path(&path).load().unwrap();
    assert_eq!(bytes_of(&loaded).len(), 3 << 20);
    match (heap::udmabuf_probe(), heap::dma_heap_probe()) {
        (Err(a), Err(b)) => {
            skip("load_puts_the_range_where_the_options_name", &format!("no dma-buf: {a}; {b}"))
        }
        _ => {
            let dmabuf = to("dmabuf");
            let (loaded, _) = LoadRequest::path(&path).range(offset, len).options(&dmabuf).load().unwrap();
            assert!(matches!(loaded, Loaded::DmaBuf(_)), "{loaded:?}");
            assert_pattern(&bytes_of(&loaded), offset);
        }
    }
}

/// Every verb refuses bad options and a destination it cannot deliver
/// before it opens anything: a missing file is not what the error is
/// about.
#[test]
fn every_verb_refuses_a_bad_request_before_opening_the_file() {
    let dir = scratch_dir();
    let missing = dir.path().join("missing");
    let bad = LoadOptions { chunk_size: 0, ..LoadOptions::default() };
    let request = LoadRequest::path(&missing).options(&bad);
    let mut dst = vec![0u8; 4096];
    let mut ring = StagingRing::new(2, 1 << 20, 1 << 20).unwrap();
    let errors = [
        request.load().map(drop).unwrap_err(),
        request.to_buffer().map(drop).unwrap_err(),
        request.to_dmabuf().map(drop).unwrap_err(),
        request.fill(&mut dst).map(drop).unwrap_err(),
        request.to_sink(&mut ring, &mut HostSink::new(&mut vec![0u8; 4096], 0)).map(drop).unwrap_err(),
    ];
    for err in errors {
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("chunk size 0"), "{err}");
    }
    // The destination is decided before the open too.
    let dmabuf = to("udmabuf");
    let err = LoadRequest::path(&missing).options(&dmabuf).to_buffer().unwrap_err();
    assert!(err.to_string().contains("not a host Buffer"), "{err}");
    let memfd = to("memfd");
    let err = LoadRequest::path(&missing).options(&memfd).to_dmabuf().unwrap_err();
    assert!(err.to_string().contains("is not a dma-buf"), "{err}");
    // And the file is opened by the verbs that read it.
    let err = LoadRequest::path(&missing).load().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
}

/// `fill` takes its length from the memory: a range of another length is
/// refused, one of the same length or none is filled.
#[test]
fn fill_refuses_a_range_that_is_not_the_memory() {
    let dir = scratch_dir();
    let path = dir.path().join("model");
    write_pattern_file(&path, 1 << 20);
    let mut dst = vec![0u8; 10_000];
    let err = LoadRequest::path(&path).range(100, 9_999).fill(&mut dst).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(dst.iter().all(|&b| b == 0), "nothing read");
    LoadRequest::path(&path).range(100, 10_000).fill(&mut dst).unwrap();
    assert_pattern(&dst, 100);
    LoadRequest::path(&path).range(7, None).fill(&mut dst).unwrap();
    assert_pattern(&dst, 7);
}
