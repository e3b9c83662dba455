//! A device error in the middle of a file: each engine fails with EIO and
//! names the offset, and returns no buffer. The error comes from a real
//! FUSE filesystem whose reads fail over one byte. The same filesystem also
//! stands for one whose direct-I/O alignment (its block size) is larger
//! than a page, as a network filesystem's may be.

mod common;

use std::path::Path;

use common::fuse::{self, FuseMount};
use common::{scratch_dir, skip};
use dmaload::{Engine, ErrorKind, LoadOptions};

/// Mounts a file `data` of `size` zero bytes whose reads fail over
/// `bad_offset`, with `blksize` as its block size.
fn mount_faulty(dir: &Path, size: u64, bad_offset: u64, blksize: usize) -> Result<FuseMount, String> {
    fuse::mount(
        dir,
        "mnt",
        "faulty_fuse.py",
        &[size.to_string(), bad_offset.to_string(), blksize.to_string()],
    )
}

#[test]
fn eio_mid_file_fails_the_load_and_names_the_offset() {
    let dir = scratch_dir();
    let size = 8u64 << 20;
    let bad = (5 << 20) + 12_345;
    let mount = match mount_faulty(dir.path(), size, bad, 4096) {
        Ok(mount) => mount,
        Err(reason) => return skip("eio_mid_file_fails_the_load_and_names_the_offset", &reason),
    };
    let path = mount.mountpoint.join("data");
    let chunk = 1u64 << 20;
    for engine in Engine::ALL {
        let opts = LoadOptions {
            engine,
            chunk_size: chunk as usize,
            gather_size: 2 << 20,
            ..LoadOptions::default()
        };
        let err = dmaload::load(&path, &opts).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io, "{engine:?}: {err}");
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{engine:?}: {err}");
        let at = err.offset().expect("an I/O error names its offset");
        assert!(at <= bad && bad - at < chunk, "{engine:?}: offset {at}, bad byte at {bad}");
        let message = err.to_string();
        assert!(
            message.contains("read") && message.contains("mnt/data") && message.contains(&at.to_string()),
            "{message}"
        );
    }
}

#[test]
fn an_alignment_larger_than_a_page_or_a_staging_slot_is_read_whole() {
    let dir = scratch_dir();
    let (size, align) = (3u64 << 20, 1usize << 20);
    let mount = match mount_faulty(dir.path(), size, size, align) {
        Ok(mount) => mount,
        Err(reason) => {
            return skip("an_alignment_larger_than_a_page_or_a_staging_slot_is_read_whole", &reason)
        }
    };
    let path = mount.mountpoint.join("data");
    let page = 4096;
    for engine in Engine::ALL {
        let opts = LoadOptions { engine, chunk_size: page, ..LoadOptions::default() };
        // Caller memory in line with the file: read in place, but in whole
        // blocks of the alignment, never past the end of the memory.
        let mut storage = vec![0xffu8; 8 * page];
        let start = (storage.as_ptr() as usize).next_multiple_of(page) - storage.as_ptr() as usize;
        let dst = &mut storage[start..start + 2 * page + 100];
        let report = dmaload::LoadRequest::path(&path).options(&opts).fill(dst).unwrap();
        assert_eq!(report.alignment, align, "{engine:?}: this test needs the file's block size as alignment");
        assert!(dst.iter().all(|&b| b == 0), "{engine:?}: bytes not loaded");
        // Staging slots of a page cannot hold an aligned read: buffered reads,
        // saying why, or in direct mode an error.
        let mut ring = dmaload::sink::StagingRing::new(2, page, page).unwrap();
        let mut dst = vec![0xffu8; 3 * page];
        let sink = &mut dmaload::sink::HostSink::new(&mut dst, 200_000);
        let report = dmaload::LoadRequest::path(&path)
            .range(200_000, Some(3 * page as u64))
            .options(&opts)
            .to_sink(&mut ring, sink)
            .unwrap();
        assert!(dst.iter().all(|&b| b == 0), "{engine:?}: bytes not loaded");
        assert!(report.fallbacks.iter().any(|f| f.reason.contains("staging slot")), "{:?}", report.fallbacks);
        let direct = LoadOptions { mode: dmaload::IoMode::Direct, ..opts };
        let sink = &mut dmaload::sink::HostSink::new(&mut dst, 0);
        let err = dmaload::LoadRequest::path(&path)
            .range(0, Some(3 * page as u64))
            .options(&direct)
            .to_sink(&mut ring, sink)
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::DirectIoUnavailable, "{engine:?}: {err}");
    }
}
