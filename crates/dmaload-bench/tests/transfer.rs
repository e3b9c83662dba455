//! Every transfer method in both directions, buffered and direct, round
//! trips content exactly, odd sizes included; refusals are the kernel's
//! documented ones. dma-heap / udmabuf rows run where the kernel has them
//! (the VM harness) and skip with the reason elsewhere.

// The library's test helpers (pattern files, scratch directories, SKIP lines).
#[path = "../../dmaload/tests/common/mod.rs"]
mod common;

use common::*;
use dmaload_bench::transfer::{
    transfer, Direction, MemoryType, Method, TransferBuffer, TransferFile, TransferOptions,
};

const SIZES: [u64; 5] = [1, 4095, 4097, (1 << 20) + 3, (3 << 20) + 511];

fn options() -> TransferOptions {
    // Small requests and pipe so even small sizes take several of each.
    TransferOptions { chunk_size: 64 << 10, queue_depth: 4, pipe_size: 64 << 10 }
}

/// The errno a refusal is allowed to carry, for combinations the kernel
/// does not support; `None` where the transfer must work.
fn allowed_refusals(kind: MemoryType, method: Method, direct: bool) -> &'static [i32] {
    match (kind, method) {
        // Cross-filesystem copy_file_range (memfd is tmpfs): EXDEV since 5.19.
        (MemoryType::Memfd | MemoryType::UdmabufMemfd, Method::CopyFileRange) => &[libc::EXDEV],
        (MemoryType::Memfd | MemoryType::UdmabufMemfd, _) => &[],
        // A dma-buf's mmap is a PFN mapping: no O_DIRECT, no registration.
        (_, Method::ReadWrite) if !direct => &[],
        (_, Method::ReadWrite | Method::Uring | Method::UringFixed) => &[libc::EFAULT, libc::EINVAL],
        // dma-buf fds implement neither read/write nor splice.
        _ => &[libc::EINVAL, libc::EXDEV, libc::EBADF, libc::EOPNOTSUPP, libc::ESPIPE],
    }
}

fn check_kind(kind: MemoryType, test: &str) -> bool {
    match kind.probe() {
        Ok(()) => true,
        Err(reason) => {
            skip(&format!("{test} [{}]", kind.name()), &reason);
            false
        }
    }
}

fn expect<T>(
    result: dmaload::Result<T>,
    kind: MemoryType,
    method: Method,
    direct: bool,
    what: &str,
) -> Option<T> {
    match result {
        Ok(v) => Some(v),
        Err(err) => {
            let errno = err.raw_os_error().unwrap_or(0);
            assert!(
                allowed_refusals(kind, method, direct).contains(&errno),
                "{what}: {} {} direct={direct}: unexpected error {err}",
                kind.name(),
                method.name()
            );
            eprintln!(
                "refused (as documented): {what} {} {} direct={direct}: {err}",
                kind.name(),
                method.name()
            );
            None
        }
    }
}

fn combos() -> Vec<(Method, bool)> {
    Method::ALL
        .into_iter()
        .flat_map(|m| [false, true].into_iter().filter(move |&d| d || !m.direct_only()).map(move |d| (m, d)))
        .collect()
}

fn reads_round_trip(kind: MemoryType) {
    let dir = scratch_dir();
    for size in SIZES {
        let path = dir.path().join(format!("in{size}"));
        write_pattern_file(&path, size + 8192);
        for (method, direct) in combos() {
            // Read `size` bytes at 0, and at an aligned offset inside the file.
            for offset in [0u64, 4096] {
                let file = TransferFile::open(&path, Direction::Read, direct).unwrap();
                let mut buf = TransferBuffer::new(kind, size as usize).unwrap();
                let what = format!("read {size}@{offset}");
                let done = transfer(&mut buf, &file, offset, method, Direction::Read, &options());
                if expect(done, kind, method, direct, &what).is_some() {
                    buf.with_bytes(|bytes| assert_pattern(bytes, offset)).unwrap();
                }
            }
        }
    }
}

fn writes_round_trip(kind: MemoryType) {
    let dir = scratch_dir();
    for size in SIZES {
        for (method, direct) in combos() {
            let path = dir.path().join(format!("out{size}-{}-{direct}", method.name().replace('/', "")));
            let file = TransferFile::open(&path, Direction::Write, direct).unwrap();
            let mut buf = TransferBuffer::new(kind, size as usize).unwrap();
            // Two pieces: the buffer at 0, then again after it (aligned), as
            // the matrix bench writes one piece after another.
            let second = (size as usize).div_ceil(4096) as u64 * 4096;
            let mut ok = true;
            for offset in [0, second] {
                buf.with_bytes_mut(|b| {
                    b.iter_mut().enumerate().for_each(|(i, x)| *x = pattern_byte(offset + i as u64))
                })
                .unwrap();
                let what = format!("write {size}@{offset}");
                let done = transfer(&mut buf, &file, offset, method, Direction::Write, &options());
                ok &= expect(done, kind, method, direct, &what).is_some();
            }
            if !ok {
                continue;
            }
            file.sync().unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(
                bytes.len() as u64,
                second + size,
                "{} {} direct={direct}",
                kind.name(),
                method.name()
            );
            assert_pattern(&bytes[..size as usize], 0);
            assert_pattern(&bytes[second as usize..], second);
        }
    }
}

#[test]
fn memfd_every_method_reads_exactly() {
    reads_round_trip(MemoryType::Memfd);
}

#[test]
fn memfd_every_method_writes_exactly() {
    writes_round_trip(MemoryType::Memfd);
}

#[test]
fn dmabuf_kinds_every_method_both_directions() {
    for kind in [MemoryType::UdmabufMemfd, MemoryType::Udmabuf, MemoryType::DmaHeap] {
        if check_kind(kind, "dmabuf_kinds_every_method_both_directions") {
            reads_round_trip(kind);
            writes_round_trip(kind);
        }
    }
}

#[test]
fn direct_read_past_end_of_file_names_the_offset() {
    let dir = scratch_dir();
    let path = dir.path().join("short");
    write_pattern_file(&path, 10_000);
    for (method, direct) in combos() {
        let file = TransferFile::open(&path, Direction::Read, direct).unwrap();
        let mut buf = TransferBuffer::new(MemoryType::Memfd, 20_000).unwrap();
        match transfer(&mut buf, &file, 0, method, Direction::Read, &options()) {
            Err(err) if err.kind() == dmaload::ErrorKind::Truncated => {
                assert_eq!(err.offset(), Some(10_000), "{} direct={direct}: {err}", method.name());
                assert!(err.to_string().contains("file ended at offset 10000"), "{err}");
            }
            Err(err) if err.raw_os_error() == Some(libc::EXDEV) => {}
            other => panic!("{} direct={direct}: expected truncation, got {other:?}", method.name()),
        }
    }
}

#[test]
fn udmabuf_beyond_its_size_limit_says_which_limit() {
    let test = "udmabuf_beyond_its_size_limit_says_which_limit";
    if !check_kind(MemoryType::Udmabuf, test) {
        return;
    }
    let Some(limit) = dmaload::heap::udmabuf_size_limit() else {
        return skip(test, "size_limit_mb is not readable");
    };
    // A sparse memfd past the limit: udmabuf checks the size before it pins.
    let err = TransferBuffer::new(MemoryType::Udmabuf, (limit + 4096) as usize).map(drop).unwrap_err();
    eprintln!("over the limit: {err}");
    assert_eq!(err.kind(), dmaload::ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("size_limit_mb"), "{err}");
}

#[test]
fn memfd_memory_is_in_small_pages() {
    // The matrix's memfd rows measure 4 KiB pages whatever shmem_enabled
    // says: the mapping carries MADV_NOHUGEPAGE ("nh" in smaps' VmFlags).
    let buf = TransferBuffer::new(MemoryType::Memfd, 8 << 20).unwrap();
    let start = buf.with_bytes(|b| b.as_ptr() as usize).unwrap();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let lines: Vec<&str> = smaps.lines().collect();
    let at = lines.iter().position(|l| l.starts_with(&format!("{start:x}-"))).expect("the mapping in smaps");
    // The entry's fields ("Rss:", "VmFlags:", ...) up to the next mapping.
    let flags = lines[at + 1..]
        .iter()
        .take_while(|l| l.split_whitespace().next().is_some_and(|w| w.ends_with(':')))
        .find(|l| l.starts_with("VmFlags:"))
        .expect("VmFlags in smaps");
    assert!(flags.split_whitespace().any(|f| f == "nh"), "{flags}");
    drop(buf);
}
