//! Random reads: every read is a full block from the file, registered or
//! not; impossible cells are refused with the reason.

#[path = "../../dmaload/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::*;
use dmaload_bench::iops::{random_reads, RandomReadOptions};

fn options(registered: bool) -> RandomReadOptions {
    RandomReadOptions {
        block_size: 4096,
        queue_depth: 8,
        registered,
        duration: Duration::from_millis(50),
        seed: 7,
    }
}

#[test]
fn random_reads_complete_registered_and_plain() {
    let dir = scratch_dir();
    let path = dir.path().join("blocks");
    write_pattern_file(&path, 1 << 20);
    for registered in [false, true] {
        match random_reads(&path, &options(registered)) {
            Ok(stats) => {
                assert!(stats.ios > 0, "registered={registered}: {stats:?}");
                assert!(stats.iops > 0.0 && stats.seconds > 0.0, "{stats:?}");
            }
            // O_DIRECT is refused on filesystems without it (tmpfs).
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                return skip("random_reads_complete_registered_and_plain", &err.to_string())
            }
            Err(err) => panic!("registered={registered}: {err}"),
        }
    }
}

#[test]
fn impossible_cells_are_refused_with_the_reason() {
    let dir = scratch_dir();
    let path = dir.path().join("small");
    write_pattern_file(&path, 1000);
    for (block_size, queue_depth) in [(4096, 1), (1000, 1), (512, 0)] {
        let cell = RandomReadOptions { block_size, queue_depth, ..options(false) };
        match random_reads(&path, &cell) {
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {}
            Err(err) => {
                assert_eq!(err.kind(), dmaload::ErrorKind::InvalidInput, "{err}");
                assert!(err.to_string().contains("queue depth"), "{err}");
            }
            Ok(stats) => panic!("bs {block_size} qd {queue_depth}: read {stats:?}"),
        }
    }
}
