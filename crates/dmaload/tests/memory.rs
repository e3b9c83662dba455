//! Each host memory kind for real: what the kernel gives (checked in
//! /proc/self/smaps, not taken from the policy), the clear error where it
//! cannot, `auto`'s choice, and dropping a large buffer in the background.

mod common;

use common::*;
use dmaload::memory::MemoryFacts;
use dmaload::{Destination, LoadOptions, MemoryKind};

const MIB: u64 = 1 << 20;

/// The selected value of a THP policy file, read independently of the library.
fn thp_policy(file: &str) -> String {
    let text =
        std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{file}")).unwrap_or_default();
    text.split('[').nth(1).and_then(|rest| rest.split(']').next()).unwrap_or("absent").to_owned()
}

/// Unreserved free pages of the hugetlb pool and the huge page size, from
/// /proc/meminfo, independently of the library.
fn hugetlb_pool() -> (u64, u64) {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let field = |name: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map_or(0, |v| v.trim().trim_end_matches("kB").trim().parse().unwrap())
    };
    (field("HugePages_Free:") - field("HugePages_Rsvd:"), field("Hugepagesize:") * 1024)
}

fn load_as(
    path: &std::path::Path,
    kind: MemoryKind,
) -> dmaload::Result<(dmaload::Buffer, dmaload::LoadReport)> {
    dmaload::load(path, &LoadOptions { to: kind.into(), ..LoadOptions::default() })
}

fn pattern_file(dir: &tempfile::TempDir, len: u64) -> std::path::PathBuf {
    let path = dir.path().join(format!("f{len}"));
    write_pattern_file(&path, len);
    path
}

#[test]
fn a_plain_memfd_gets_small_pages_and_an_fd() {
    let dir = scratch_dir();
    let path = pattern_file(&dir, 16 * MIB + 5);
    let (buffer, report) = load_as(&path, MemoryKind::Memfd).unwrap();
    assert_pattern(&buffer, 0);
    assert!(buffer.memfd().unwrap().is_some());
    assert_eq!((report.memory, report.huge_pages), (MemoryKind::Memfd, false));
    assert_eq!(report.memory_reason, "asked for (memfd)");
    // MADV_NOHUGEPAGE: 4 KiB pages even where shmem_enabled is `always`.
    assert_eq!(buffer.huge_page_bytes().unwrap(), 0);
}

#[test]
fn a_huge_memfd_gets_huge_pages_where_the_shmem_policy_allows() {
    let dir = scratch_dir();
    let path = pattern_file(&dir, 64 * MIB + 3);
    let policy = thp_policy("shmem_enabled");
    match load_as(&path, MemoryKind::MemfdHuge) {
        Ok((buffer, report)) => {
            assert!(["always", "within_size", "advise", "force"].contains(&policy.as_str()), "{policy}");
            assert_pattern(&buffer, 0);
            assert!(buffer.memfd().unwrap().is_some() && report.huge_pages);
            let huge = buffer.huge_page_bytes().unwrap();
            // Free page reporting or fragmentation may cost a few 2 MiB
            // pages; most of the buffer must have them.
            assert!(huge >= 32 * MIB, "only {huge} bytes in huge pages under shmem_enabled {policy}");
        }
        Err(err) => {
            assert!(["never", "deny", "absent"].contains(&policy.as_str()), "{policy}: {err}");
            assert_eq!(err.kind(), dmaload::ErrorKind::InvalidInput);
            let message = err.to_string();
            assert!(
                message.contains("memfd-huge")
                    && message.contains(&policy)
                    && message.contains(dmaload::memory::SHMEM_HUGE_PAGES_HINT),
                "{message}"
            );
            skip(
                "a_huge_memfd_gets_huge_pages_where_the_shmem_policy_allows",
                &format!("shmem_enabled is {policy} (the refusal was checked)"),
            );
        }
    }
}

#[test]
fn a_hugetlb_memfd_uses_the_pool_or_says_how_to_grow_it() {
    let dir = scratch_dir();
    let len = 8 * MIB + 4097;
    let path = pattern_file(&dir, len);
    let (free, page) = hugetlb_pool();
    let needed = len.div_ceil(page.max(1));
    match load_as(&path, MemoryKind::Hugetlb) {
        Ok((buffer, report)) => {
            assert!(free >= needed, "{free} free pages");
            assert_pattern(&buffer, 0);
            assert!(report.huge_pages);
            // The whole mapping, rounded up to whole huge pages, is hugetlb.
            assert_eq!(buffer.huge_page_bytes().unwrap(), needed * page);
            let (buffer, _) = dmaload::LoadRequest::path(&path)
                .range(4095, MIB)
                .options(&LoadOptions { to: Destination::Hugetlb, ..LoadOptions::default() })
                .to_buffer()
                .unwrap();
            assert_pattern(&buffer, 4095);
        }
        Err(err) => {
            assert!(free < needed, "{free} free pages of {needed}: {err}");
            assert_eq!(err.kind(), dmaload::ErrorKind::InvalidInput);
            let message = err.to_string();
            assert!(message.contains("/proc/sys/vm/nr_hugepages") && message.contains("free"), "{message}");
            skip(
                "a_hugetlb_memfd_uses_the_pool_or_says_how_to_grow_it",
                &format!("the hugetlb pool has {free} free pages, {needed} needed (the refusal was checked)"),
            );
        }
    }
}

/// Sharing a buffer's memfd first maps the buffer private copy-on-write,
/// and a private hugetlb mapping reserves as many pages of the pool as it
/// has. Where the pool cannot, no fd is handed out and the buffer keeps its
/// bytes: the failed remap used to unmap them (the next read faulted) and
/// hand out the fd unsealed.
#[test]
fn a_hugetlb_buffer_the_pool_cannot_copy_keeps_its_bytes_and_hands_out_no_fd() {
    const TEST: &str = "a_hugetlb_buffer_the_pool_cannot_copy_keeps_its_bytes_and_hands_out_no_fd";
    let dir = scratch_dir();
    let len = 8 * MIB + 4097;
    let path = pattern_file(&dir, len);
    let buffer = match load_as(&path, MemoryKind::Hugetlb) {
        Ok((buffer, _)) => buffer,
        Err(err) => return skip(TEST, &format!("no hugetlb pool to load into: {err}")),
    };
    let (free, page) = hugetlb_pool();
    let needed = len.div_ceil(page);
    match buffer.memfd() {
        Ok(fd) => {
            assert!(free >= needed, "{free} free pages, {needed} needed, yet the private mapping was made");
            let fd = fd.expect("hugetlb memory has a memfd");
            // SAFETY: F_GET_SEALS takes no argument; `fd` is open.
            let seals = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::F_GET_SEALS) };
            let wanted =
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
            assert_eq!(seals & wanted, wanted, "seals {seals:#x}");
            skip(TEST, &format!("the pool had {free} free pages, enough for the private copy (it was made)"));
        }
        Err(err) => {
            assert!(free < needed, "{free} free pages, {needed} needed: {err}");
            assert_eq!(err.errno(), libc::ENOMEM, "{err}");
            assert!(err.to_string().contains("/proc/sys/vm/nr_hugepages"), "{err}");
        }
    }
    assert_pattern(&buffer, 0);
}

#[test]
fn anonymous_thp_has_no_fd() {
    let dir = scratch_dir();
    let path = pattern_file(&dir, 8 * MIB + 1);
    let (buffer, report) = load_as(&path, MemoryKind::AnonymousThp).unwrap();
    assert_pattern(&buffer, 0);
    assert!(buffer.memfd().unwrap().is_none());
    let policy = thp_policy("enabled");
    assert_eq!(report.huge_pages, ["always", "madvise"].contains(&policy.as_str()), "{policy}");
    if !report.huge_pages {
        assert_eq!(buffer.huge_page_bytes().unwrap(), 0);
    }
}

#[test]
fn anonymous_memory_has_no_fd_and_4_kib_pages_whatever_the_policy() {
    let dir = scratch_dir();
    let path = pattern_file(&dir, 8 * MIB + 1);
    let (buffer, report) = load_as(&path, MemoryKind::Anonymous).unwrap();
    assert_pattern(&buffer, 0);
    assert!(buffer.memfd().unwrap().is_none());
    assert!(!report.huge_pages);
    assert_eq!(buffer.huge_page_bytes().unwrap(), 0, "MADV_NOHUGEPAGE, even where THP is always");
    let (a, _b) = dmaload::share::Connection::pair().unwrap();
    let err = buffer.send(&a).unwrap_err();
    assert!(err.to_string().contains("anonymous memory has no memfd to send"), "{err}");
}

#[test]
fn auto_gives_the_kind_the_rule_chooses_and_says_why() {
    let dir = scratch_dir();
    let len = 8 * MIB + 1;
    let path = pattern_file(&dir, len);
    for needs_fd in [true, false] {
        let options = LoadOptions { needs_fd, ..LoadOptions::default() };
        assert_eq!(options.to, Destination::Auto);
        let expected = MemoryFacts::read().choose(len, needs_fd);
        let (buffer, report) = dmaload::load(&path, &options).unwrap();
        assert_pattern(&buffer, 0);
        assert_eq!((report.memory, &report.memory_reason), (expected.kind, &expected.reason));
        assert_eq!(report.destination, expected.kind.name());
        if needs_fd {
            assert!(buffer.memfd().unwrap().is_some(), "auto must give an fd when one is needed");
        }
    }
}

#[test]
fn a_dropped_buffer_is_unmapped_in_the_background_and_the_memory_comes_back() {
    let dir = scratch_dir();
    let len = 96 * MIB;
    let path = pattern_file(&dir, len);
    let (buffer, _) = load_as(&path, MemoryKind::Memfd).unwrap();
    // The memfd's inode in /proc/self/maps names this mapping; its address
    // may be reused by another test's mapping once it is gone.
    let address = format!("{:x}-", buffer.as_ptr() as usize);
    let maps = || std::fs::read_to_string("/proc/self/maps").unwrap();
    let line = maps().lines().find(|l| l.starts_with(&address)).map(str::to_owned).unwrap();
    let inode = line.split_whitespace().nth(4).unwrap().to_owned();
    assert!(line.contains("memfd:dmaload"), "{line}");
    let mapped =
        || maps().lines().any(|l| l.contains("memfd:dmaload") && l.split_whitespace().nth(4) == Some(&inode));
    drop(buffer);
    // The drop returned; the unmapping may still be under way.
    dmaload::memory::wait_for_freed_memory();
    assert!(!mapped(), "the buffer's mapping is still there after the background unmapping");
    // A load right after many drops finds the memory free again.
    for _ in 0..4 {
        let (buffer, _) = load_as(&path, MemoryKind::Memfd).unwrap();
        assert_pattern(&buffer[..4096], 0);
    }
    dmaload::memory::wait_for_freed_memory();
}
