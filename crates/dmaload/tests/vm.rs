//! Segment tables and address-space binds on real files and real loads:
//! bytes read back through binds match the files, unbound pages fault,
//! bad requests are refused without touching anything, and `locate`
//! agrees with a linear walk on random tables.

mod common;

use std::fs::File;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::Arc;

use common::*;
use dmaload::vm::{Access, AddressSpace, BindOp, Locate, SegmentTable};
use dmaload::{ErrorKind, LoadOptions, MemoryKind};

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }) as usize
}

/// A file of `len` bytes whose byte `i` is `tag ^ pattern_byte(i)`: files
/// with different tags differ at every offset.
fn tagged_file(tag: u8, len: usize) -> (Arc<File>, Vec<u8>) {
    let bytes: Vec<u8> = (0..len).map(|i| tag ^ pattern_byte(i as u64)).collect();
    let mut file = tempfile::tempfile().unwrap();
    file.write_all(&bytes).unwrap();
    (Arc::new(file), bytes)
}

/// A small xorshift64* generator: the same sequence on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Two tagged files and a table of page-aligned extents interleaving them,
/// with the bytes the table should show.
fn interleaved_table() -> (SegmentTable, Vec<u8>) {
    let p = page();
    let (a, a_bytes) = tagged_file(0x00, 8 * p);
    let (b, b_bytes) = tagged_file(0xA5, 8 * p);
    let mut builder = SegmentTable::builder();
    let fa = builder.add_file(a).unwrap();
    let fb = builder.add_file(b).unwrap();
    let mut expected = Vec::new();
    // (file, first page, pages)
    for (file, first, pages) in [(fa, 3, 2), (fb, 0, 1), (fa, 0, 3), (fb, 5, 3), (fa, 7, 1)] {
        builder.push(file, (first * p) as u64, (pages * p) as u64).unwrap();
        let bytes = if file == fa { &a_bytes } else { &b_bytes };
        expected.extend_from_slice(&bytes[first * p..(first + pages) * p]);
    }
    let table = builder.build();
    assert_eq!(table.extents().len(), 5, "no two of these extents are contiguous");
    assert_eq!(table.len(), expected.len() as u64);
    (table, expected)
}

fn read(space: &AddressSpace, at: usize, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    space.read_at(at, &mut buf).unwrap();
    buf
}

#[test]
fn binds_spanning_extents_read_back_the_table_bytes() {
    let p = page();
    let (table, expected) = interleaved_table();
    let mut check = vec![0u8; expected.len()];
    table.read_at(0, &mut check).unwrap();
    assert_eq!(check, expected, "the table's own pread view");

    let mut space = AddressSpace::new(64 * p).unwrap();
    // The whole table, at an offset into the space.
    space.bind(2 * p, &table, 0, expected.len(), Access::Read).unwrap();
    assert_eq!(read(&space, 2 * p, expected.len()), expected);
    // From the middle of the first extent across the next three.
    let (offset, len) = (p, 6 * p);
    space.bind(32 * p, &table, offset as u64, len, Access::Read).unwrap();
    assert_eq!(read(&space, 32 * p, len), &expected[offset..offset + len]);
    // The same through the linear-walk lookup.
    let op = BindOp { at: 48 * p, offset: 4 * p as u64, len: 5 * p, access: Access::Read };
    space.bind_many_using(Locate::LinearWalk, &table, &[op]).unwrap();
    assert_eq!(read(&space, 48 * p, 5 * p), &expected[4 * p..9 * p]);
    // Unaligned reads inside the binding.
    assert_eq!(read(&space, 2 * p + 5, 3 * p - 11), &expected[5..3 * p - 6]);
}

#[test]
fn binds_write_through_to_the_file_and_read_only_binds_refuse_writes() {
    let p = page();
    let (table, expected) = interleaved_table();
    let mut space = AddressSpace::new(16 * p).unwrap();
    space.bind(0, &table, 0, 4 * p, Access::ReadWrite).unwrap();
    space.bind(8 * p, &table, 0, 4 * p, Access::Read).unwrap();
    // Straddles extent 0 (file A) and extent 1 (file B).
    space.write_at(2 * p - 3, b"hello!").unwrap();
    let mut back = [0u8; 6];
    table.read_at(2 * p as u64 - 3, &mut back).unwrap();
    assert_eq!(&back, b"hello!", "the write reached both files");
    assert_eq!(read(&space, 10 * p - 3, 6), b"hello!", "and shows in the other, shared binding");
    let err = space.write_at(8 * p, b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
    assert_eq!(read(&space, 8 * p, 1), &expected[..1]);
}

const CHILD: &str = "DMALOAD_VM_TEST_FAULT_CHILD";
const MARKER: &str = "child: about to read an unbound page";

#[test]
fn unbind_leaves_prot_none_so_a_read_faults() {
    let p = page();
    let (table, expected) = interleaved_table();
    let mut space = AddressSpace::new(8 * p).unwrap();
    space.bind(0, &table, 0, 4 * p, Access::Read).unwrap();
    space.unbind(p, 2 * p).unwrap();
    if std::env::var_os(CHILD).is_some() {
        let base = space.as_ptr();
        // SAFETY: page 0 is still bound readable, and nothing writes the test files.
        let first = unsafe { base.read_volatile() };
        // SAFETY: as above, for page 3.
        let last = unsafe { base.wrapping_add(3 * p).read_volatile() };
        assert_eq!((first, last), (expected[0], expected[3 * p]));
        println!("{MARKER}");
        std::io::stdout().flush().unwrap();
        // SAFETY: deliberately not: page 1 is PROT_NONE, so this read must
        // kill the process with SIGSEGV, which the parent checks.
        let byte = unsafe { base.wrapping_add(p).read_volatile() };
        println!("child: read {byte} from an unbound page");
        std::process::exit(0);
    }
    // In process: the safe copy reports the hole instead of crashing.
    let mut buf = [0u8; 1];
    let err = space.read_at(p + 7, &mut buf).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
    assert_eq!(read(&space, 3 * p, p), &expected[3 * p..4 * p], "the rest stays bound");
    // Never bound at all: the reservation itself is PROT_NONE.
    assert_eq!(space.read_at(5 * p, &mut buf).unwrap_err().raw_os_error(), Some(libc::EFAULT));

    // In a child: a plain load from the unbound page is SIGSEGV.
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "unbind_leaves_prot_none_so_a_read_faults", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(MARKER),
        "the child did not reach the read: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "child {:?}: {stdout}", out.status);
}

#[test]
fn overlapping_binds_replace_what_was_there() {
    let p = page();
    let (table, expected) = interleaved_table();
    let mut space = AddressSpace::new(16 * p).unwrap();
    space.bind(0, &table, 0, 4 * p, Access::Read).unwrap();
    // Pages 1..3 of the space now show table pages 6..8.
    space.bind(p, &table, 6 * p as u64, 2 * p, Access::Read).unwrap();
    let mut want = expected[..p].to_vec();
    want.extend_from_slice(&expected[6 * p..8 * p]);
    want.extend_from_slice(&expected[3 * p..4 * p]);
    assert_eq!(read(&space, 0, 4 * p), want);

    // In one batch, later ops win.
    let ops = [
        BindOp { at: 8 * p, offset: 0, len: 4 * p, access: Access::Read },
        BindOp { at: 9 * p, offset: 9 * p as u64, len: p, access: Access::Read },
        BindOp { at: 10 * p, offset: 2 * p as u64, len: 3 * p, access: Access::Read },
    ];
    space.bind_many(&table, &ops).unwrap();
    let mut want = expected[..p].to_vec();
    want.extend_from_slice(&expected[9 * p..10 * p]);
    want.extend_from_slice(&expected[2 * p..5 * p]);
    assert_eq!(read(&space, 8 * p, 5 * p), want);
}

#[test]
fn out_of_range_and_unaligned_requests_are_refused_before_any_change() {
    let p = page();
    let (table, expected) = interleaved_table();
    assert_eq!(AddressSpace::new(0).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(AddressSpace::new(p + 1).unwrap_err().kind(), ErrorKind::InvalidInput);
    let mut space = AddressSpace::new(4 * p).unwrap();
    space.bind(0, &table, 0, 4 * p, Access::Read).unwrap();
    let t = table.len();
    let bad_binds: [(usize, u64, usize); 9] = [
        (1, 0, p),                       // unaligned address
        (0, 1, p),                       // unaligned table offset
        (0, 0, p + 1),                   // unaligned length
        (3 * p, 0, 2 * p),               // past the end of the space
        (4 * p, 0, p),                   // starts at the end of the space
        (usize::MAX - p + 1, 0, p),      // address overflow
        (0, t - p as u64, 2 * p),        // past the end of the table
        (0, t, p),                       // starts at the end of the table
        (0, u64::MAX - p as u64 + 1, p), // offset overflow
    ];
    for (at, offset, len) in bad_binds {
        let err = space.bind(at, &table, offset, len, Access::Read).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "bind({at}, {offset}, {len}): {err}");
    }
    // A bad op anywhere in a batch: the good ops before it do not happen.
    let ops = [
        BindOp { at: 0, offset: 5 * p as u64, len: p, access: Access::Read },
        BindOp { at: p, offset: 0, len: p + 1, access: Access::Read },
    ];
    let err = space.bind_many(&table, &ops).unwrap_err();
    assert!(err.to_string().contains("bind 1 of 2"), "{err}");
    for (at, len) in [(1, p), (0, p - 1), (3 * p, 2 * p), (usize::MAX - p + 1, p)] {
        assert_eq!(space.unbind(at, len).unwrap_err().kind(), ErrorKind::InvalidInput, "unbind({at}, {len})");
    }
    assert_eq!(space.unbind_many(&[(0, p), (p, 7)]).unwrap_err().kind(), ErrorKind::InvalidInput);
    let mut buf = [0u8; 2];
    assert_eq!(space.read_at(4 * p - 1, &mut buf).unwrap_err().kind(), ErrorKind::InvalidInput);
    // Everything refused left the first binding as it was.
    assert_eq!(read(&space, 0, 4 * p), &expected[..4 * p]);

    // An extent at an unaligned file offset cannot be mapped.
    let (file, _) = tagged_file(1, 4 * p);
    let mut builder = SegmentTable::builder();
    let f = builder.add_file(file).unwrap();
    builder.push(f, 100, p as u64).unwrap();
    builder.push(f, 2 * p as u64, 2 * p as u64).unwrap();
    let odd = builder.build();
    let err = space.bind(0, &odd, 0, p, Access::Read).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("extent 0"), "{err}");
    // ... and a bind that needs its end is refused too, but the aligned
    // extent after it binds.
    assert!(space.bind(0, &odd, p as u64, p, Access::Read).is_ok());
    // Extents past their file's end are refused when pushed.
    let mut builder = SegmentTable::builder();
    let f = builder.add_file(tagged_file(2, p).0).unwrap();
    assert_eq!(builder.push(f, 1, p as u64).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(builder.push(f + 1, 0, 1).unwrap_err().kind(), ErrorKind::InvalidInput);
}

#[test]
fn a_table_over_several_loaded_files_matches_them_byte_for_byte() {
    let p = page();
    let dir = scratch_dir();
    let sizes = [(3 << 20) + 5 * p, 16 * p, (1 << 20) + 7];
    let mut paths = Vec::new();
    for (i, size) in sizes.iter().enumerate() {
        let path = dir.path().join(format!("shard-{i}.bin"));
        let bytes: Vec<u8> = (0..*size).map(|o| (i as u8 * 0x3b) ^ pattern_byte(o as u64)).collect();
        std::fs::write(&path, bytes).unwrap();
        paths.push(path);
    }
    // Small gathers: each buffer is filled in many segments.
    let options = LoadOptions { gather_size: 256 << 10, chunk_size: 64 << 10, ..LoadOptions::default() };
    let buffers: Vec<_> = paths.iter().map(|path| dmaload::load(path, &options).unwrap().0).collect();
    assert!(buffers[0].segments().len() > 4, "{:?}", buffers[0]);
    let refs: Vec<_> = buffers.iter().collect();
    let table = SegmentTable::from_buffers(&refs).unwrap();
    assert_eq!(table.extents().len(), 3, "each buffer's segments merge into one extent");
    assert_eq!(table.file_count(), 3);
    let all: Vec<u8> = paths.iter().flat_map(|path| std::fs::read(path).unwrap()).collect();
    assert_eq!(table.len(), all.len() as u64);
    let mut via_table = vec![0u8; all.len()];
    table.read_at(0, &mut via_table).unwrap();
    assert!(via_table == all, "the table's pread view differs from the files");

    // The first two shards are page-sized, so they bind as one run.
    let aligned = sizes[0] + sizes[1];
    let mut space = AddressSpace::new(8 << 20).unwrap();
    space.bind(0, &table, 0, aligned, Access::Read).unwrap();
    // The bytes outlive the buffers and the table: the mappings hold the memfds.
    drop(refs);
    drop(buffers);
    drop(table);
    let mut whole = vec![0u8; aligned];
    space.read_at(0, &mut whole).unwrap();
    assert!(whole == all[..aligned], "the bound view differs from the files");

    // No buffers: an empty table. Anonymous memory: refused.
    assert!(SegmentTable::from_buffers(&[]).unwrap().is_empty());
    let options = LoadOptions { to: MemoryKind::AnonymousThp.into(), ..options };
    let (anon, _) = dmaload::load(&paths[1], &options).unwrap();
    let err = SegmentTable::from_buffer(&anon).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("memfd"), "{err}");
}

#[test]
fn a_shard_that_starts_mid_page_in_the_table_is_refused() {
    let p = page();
    let dir = scratch_dir();
    let odd = dir.path().join("odd.bin");
    let even = dir.path().join("even.bin");
    write_pattern_file(&odd, (p + 100) as u64);
    write_pattern_file(&even, (4 * p) as u64);
    let (a, _) = dmaload::load(&odd, &LoadOptions::default()).unwrap();
    let (b, _) = dmaload::load(&even, &LoadOptions::default()).unwrap();
    let table = SegmentTable::from_buffers(&[&a, &b]).unwrap();
    let mut space = AddressSpace::new(8 * p).unwrap();
    space.bind(0, &table, 0, p, Access::Read).unwrap();
    let err = space.bind(p, &table, p as u64, p, Access::Read).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("page boundaries"), "{err}");
}

#[test]
fn locate_agrees_with_a_linear_walk_on_random_tables() {
    let files = [tempfile::tempfile().unwrap(), tempfile::tempfile().unwrap()];
    for file in &files {
        file.set_len(1 << 40).unwrap(); // sparse: offsets anywhere
    }
    let files: Vec<Arc<File>> = files.into_iter().map(Arc::new).collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for case in 0..300 {
        let mut pushed = Vec::new(); // (file, file offset, len) as pushed
        let mut merged = SegmentTable::builder();
        let mut unmerged = SegmentTable::builder();
        let ids: Vec<u32> = files.iter().map(|f| merged.add_file(f.clone()).unwrap()).collect();
        for f in &files {
            unmerged.add_file(f.clone()).unwrap();
        }
        let count = 1 + rng.below(if case % 10 == 0 { 1000 } else { 200 });
        for _ in 0..count {
            let len = match rng.below(4) {
                0 => 1 + rng.below(8),
                1 => 4096 * (1 + rng.below(4)),
                _ => 1 + rng.below(100_000),
            };
            let (file, offset) = match pushed.last() {
                // Often continue the previous extent, so merging happens.
                Some(&(file, offset, prev)) if rng.below(3) == 0 => (file, offset + prev),
                _ => (ids[rng.below(2) as usize], rng.below(1 << 36)),
            };
            pushed.push((file, offset, len));
            merged.push(file, offset, len).unwrap();
            unmerged.push(file, offset, len).unwrap();
        }
        let merged = merged.build();
        let unmerged = unmerged.build_unmerged();
        assert_eq!(unmerged.extents().len(), pushed.len());
        assert!(merged.extents().len() <= pushed.len());
        let total: u64 = pushed.iter().map(|e| e.2).sum();
        assert_eq!((merged.len(), unmerged.len()), (total, total));

        // Probe every boundary and random offsets.
        let mut probes = vec![0, total - 1, total, total + 1, u64::MAX];
        let mut start = 0;
        for &(_, _, len) in &pushed {
            probes.extend([start, start + len - 1, start + len]);
            start += len;
        }
        probes.extend((0..200).map(|_| rng.below(total)));
        for offset in probes {
            // The reference: walk the list as pushed.
            let mut reference = None;
            let mut start = 0;
            for &(file, file_offset, len) in &pushed {
                if offset >= start && offset < start + len {
                    reference = Some((file, file_offset + offset - start));
                    break;
                }
                start += len;
            }
            for table in [&merged, &unmerged] {
                let found = table.locate(offset);
                assert_eq!(found, table.locate_linear(offset), "case {case}, offset {offset}");
                let resolved = found.map(|(i, within)| {
                    let e = table.extents()[i];
                    assert!(within < e.len);
                    assert_eq!(e.start + within, offset);
                    (e.file, e.offset + within)
                });
                assert_eq!(resolved, reference, "case {case}, offset {offset}");
            }
        }
    }
}

/// Whether the page at `addr` is unmapped (a `MAP_FIXED_NOREPLACE` mapping
/// of it succeeds only in a hole).
fn first_page_is_a_hole(addr: *const u8) -> bool {
    let p = page();
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE;
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
    let got = unsafe { libc::mmap(addr.cast_mut().cast(), p, libc::PROT_NONE, flags, -1, 0) };
    if got == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: unmapping the page this call just mapped, which nothing uses.
    unsafe { libc::munmap(got, p) };
    got.cast::<u8>().cast_const() == addr
}

#[test]
fn a_bind_the_kernel_refuses_leaves_no_hole_in_the_reservation() {
    let p = page();
    // A sysfs attribute: it has a size and an mmap method, and that method
    // refuses (ENODEV) after the kernel has taken away the old pages at the
    // address.
    let file = File::open("/sys/kernel/uevent_seqnum").unwrap();
    let mut builder = SegmentTable::builder();
    let f = builder.add_file(file).unwrap();
    builder.push(f, 0, p as u64).unwrap();
    let table = builder.build();
    let (good, _) = interleaved_table();

    let mut space = AddressSpace::new(4 * p).unwrap();
    space.bind(0, &good, 0, p, Access::Read).unwrap();
    let err = space.bind(0, &table, 0, p, Access::Read).unwrap_err();
    assert!(
        !first_page_is_a_hole(space.as_ptr()),
        "the refused bind left a hole another mmap can take: {err}"
    );
    let err = space.bind(2 * p, &table, 0, p, Access::Read).unwrap_err();
    assert!(
        !first_page_is_a_hole(space.as_ptr().wrapping_add(2 * p)),
        "a hole in a never-bound range: {err}"
    );
}
