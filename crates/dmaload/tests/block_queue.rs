//! `dmaload::share::BlockQueue` between two real processes: this test
//! binary re-executes itself for the peer (`peer_process_role`). Ordered,
//! bit-exact delivery; a fast producer against a slow consumer with both
//! policies; either side killed mid-stream; a hostile peer writing garbage
//! into the control page or sending the wrong objects.

mod common;

use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::scratch_dir;
use dmaload::share::{BlockQueue, BlockQueueOptions, Connection, Listener, QueueMemory, Role};

const PEER_ROLE: &str = "DMALOAD_QUEUE_TEST_ROLE";
const PEER_SOCKET: &str = "DMALOAD_QUEUE_TEST_SOCKET";
const WAIT: Option<Duration> = Some(Duration::from_secs(60));

/// The bytes of block `seq` of a test stream: `len` bytes that differ for
/// every block and position.
fn block_bytes(seq: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let x = (seq << 24 ^ i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x >> 40) as u8
        })
        .collect()
}

/// The length of block `seq`: mostly full, sometimes short, sometimes empty.
fn block_len(seq: u64, block_size: usize) -> usize {
    match seq % 13 {
        5 => 0,
        7 => (seq as usize * 31) % block_size,
        _ => block_size,
    }
}

/// Starts this test binary as the peer in `role`, connected to a listener
/// in a fresh directory, and returns the connection and the child.
fn spawn_peer(role: &str) -> (Connection, Child, tempfile::TempDir) {
    let dir = scratch_dir();
    let socket = dir.path().join("s");
    let listener = Listener::bind(&socket, 1).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "peer_process_role", "--nocapture", "--test-threads=1"])
        .env(PEER_ROLE, role)
        .env(PEER_SOCKET, &socket)
        .spawn()
        .unwrap();
    let conn = listener.accept().unwrap();
    assert_eq!(conn.peer_credentials().unwrap().pid, child.id());
    (conn, child, dir)
}

/// Not a test of its own: the peer process of the tests below.
#[test]
fn peer_process_role() {
    let (Ok(role), Ok(socket)) = (std::env::var(PEER_ROLE), std::env::var(PEER_SOCKET)) else { return };
    let conn = Connection::connect(Path::new(&socket)).unwrap();
    match role.as_str() {
        "produce-10k" => {
            let mut queue = BlockQueue::attach(conn, WAIT).unwrap();
            assert_eq!(queue.role(), Role::Producer);
            for seq in 0..10_000u64 {
                let len = block_len(seq, queue.block_size());
                let mut block = queue.dequeue_free(WAIT).unwrap();
                assert_eq!(block.sequence(), seq);
                block.write_at(0, &block_bytes(seq, len)).unwrap();
                block.enqueue(len, seq ^ 0xA5A5).unwrap();
            }
            queue.finish().unwrap();
            queue.wait_drained(WAIT).unwrap();
        }
        "produce-fast-wait" | "produce-fast-drop" => {
            let drop_policy = role.ends_with("drop");
            let mut queue = BlockQueue::attach(conn, WAIT).unwrap();
            let mut dropped = 0u64;
            for seq in 0..600u64 {
                let block = if drop_policy {
                    queue.try_dequeue_free().unwrap()
                } else {
                    Some(queue.dequeue_free(WAIT).unwrap())
                };
                match block {
                    Some(mut block) => {
                        block.write_at(0, &seq.to_le_bytes()).unwrap();
                        block.enqueue(8, seq).unwrap();
                    }
                    None => dropped += 1,
                }
            }
            queue.finish().unwrap();
            queue.wait_drained(WAIT).unwrap();
            queue.connection().send(&dropped.to_le_bytes(), &[]).unwrap();
        }
        "produce-dmabuf" => {
            let mut queue = BlockQueue::attach(conn, WAIT).unwrap();
            assert!(queue.memory() != QueueMemory::Memfd);
            for seq in 0..200u64 {
                let mut block = queue.dequeue_free(WAIT).unwrap();
                block.write_at(0, &block_bytes(seq, 8192)).unwrap();
                block.enqueue(8192, seq).unwrap();
            }
            queue.finish().unwrap();
            queue.wait_drained(WAIT).unwrap();
            // Start and end of a bracket per block.
            assert_eq!(queue.cpu_syncs(), 400);
        }
        "produce-then-die" => {
            let mut queue = BlockQueue::attach(conn, WAIT).unwrap();
            for seq in 0..50u64 {
                let mut block = queue.dequeue_free(WAIT).unwrap();
                block.write_at(0, &block_bytes(seq, 4096)).unwrap();
                block.enqueue(4096, seq).unwrap();
            }
            // Killed, not finished: no end of stream is marked.
            std::process::abort();
        }
        "consume-forever" => {
            let mut queue = BlockQueue::attach(conn, WAIT).unwrap();
            loop {
                let filled = queue.dequeue_filled(1, WAIT).unwrap().expect("no end of stream");
                filled.release().unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        "hostile-consumer" => {
            // Takes the queue's objects by hand and writes garbage counts.
            let mut header = [0u8; 64];
            let (_, fds) = conn.recv(&mut header).unwrap();
            conn.send(b"dmaload block queue attached", &[]).unwrap();
            // The descriptors: control page, data, `filled`, `freed`.
            let [control, _data, filled, freed] = <[OwnedFd; 4]>::try_from(fds).unwrap().map(File::from);
            // Waits as a consumer would for the ring (4 blocks) to fill:
            // `consumer waiting` (word 6) asks the producer to signal
            // `filled` once it has produced 4 blocks, after which it waits
            // for a free block.
            control.write_all_at(&5u64.to_le_bytes(), 6 * 8).unwrap();
            let mut ready = [libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&filled),
                events: libc::POLLIN,
                revents: 0,
            }];
            // Armed, then checked once more (`produced`, word 1): blocks
            // produced before the arming signal nothing.
            let mut produced = [0u8; 8];
            control.read_exact_at(&mut produced, 8).unwrap();
            if u64::from_le_bytes(produced) < 4 {
                // SAFETY: one valid pollfd living across the call.
                assert_eq!(unsafe { libc::poll(ready.as_mut_ptr(), 1, 60_000) }, 1, "the ring never filled");
            }
            // `consumed` (word 2) beyond anything produced, and a wake-up
            // on the `freed` eventfd.
            control.write_all_at(&u64::MAX.to_le_bytes(), 2 * 8).unwrap();
            std::io::Write::write_all(&mut &freed, &1u64.to_le_bytes()).unwrap();
            std::thread::sleep(Duration::from_secs(30));
        }
        other => panic!("unknown role {other}"),
    }
}

fn create(conn: Connection, role: Role, block_size: usize, blocks: usize) -> BlockQueue {
    let options = BlockQueueOptions { block_size, blocks, memory: QueueMemory::Memfd };
    BlockQueue::create(conn, role, &options, WAIT).unwrap()
}

#[test]
fn ten_thousand_blocks_arrive_in_order_bit_exact() {
    let (conn, mut child, _dir) = spawn_peer("produce-10k");
    let mut queue = create(conn, Role::Consumer, 4096, 16);
    let mut seq = 0u64;
    let mut out = vec![0u8; 4096];
    while let Some(run) = queue.dequeue_filled(5, WAIT).unwrap() {
        assert!((1..=5).contains(&run.blocks()));
        assert_eq!(run.sequence(), seq);
        for i in 0..run.blocks() {
            let (len, tag) = run.block(i);
            assert_eq!((len, tag), (block_len(seq, 4096), seq ^ 0xA5A5), "block {seq}");
            run.read_at(i, 0, &mut out[..len]).unwrap();
            assert!(out[..len] == block_bytes(seq, len)[..], "block {seq} differs");
            // Only a run's last block may be short.
            assert!(len == 4096 || i + 1 == run.blocks());
            seq += 1;
        }
        run.release().unwrap();
    }
    assert_eq!(seq, 10_000);
    assert_eq!(queue.count(), 10_000);
    assert_eq!(queue.cpu_syncs(), 0, "memfd blocks need no dma-buf sync");
    assert!(child.wait().unwrap().success());
}

/// A slow consumer: the producer waits (nothing lost) or drops (counted,
/// and the gaps in the tags are exactly the dropped blocks).
#[test]
fn fast_producer_slow_consumer_wait_and_drop() {
    for (role, drops) in [("produce-fast-wait", false), ("produce-fast-drop", true)] {
        let (conn, mut child, _dir) = spawn_peer(role);
        let mut queue = create(conn, Role::Consumer, 4096, 4);
        let mut tags = Vec::new();
        while let Some(run) = queue.dequeue_filled(1, WAIT).unwrap() {
            let mut seq = [0u8; 8];
            run.read_at(0, 0, &mut seq).unwrap();
            assert_eq!(u64::from_le_bytes(seq), run.block(0).1);
            tags.push(run.block(0).1);
            run.release().unwrap();
            std::thread::sleep(Duration::from_micros(300));
        }
        let mut report = [0u8; 8];
        let (len, _) = queue.connection().recv(&mut report).unwrap();
        assert_eq!(len, 8);
        let dropped = u64::from_le_bytes(report);
        assert!(tags.windows(2).all(|w| w[0] < w[1]), "{role}: out of order");
        let gaps: u64 = 600 - tags.len() as u64;
        assert_eq!(gaps, dropped, "{role}: the tags' gaps are the dropped blocks");
        if drops {
            assert!(dropped > 0, "a consumer 300 µs per block must make a 600-block burst drop");
        } else {
            assert_eq!(dropped, 0);
            assert_eq!(tags, (0..600).collect::<Vec<_>>());
        }
        assert!(child.wait().unwrap().success());
    }
}

#[test]
fn producer_errors_out_when_the_consumer_is_killed() {
    let (conn, mut child, _dir) = spawn_peer("consume-forever");
    let mut queue = create(conn, Role::Producer, 4096, 8);
    for seq in 0..100u64 {
        let mut block = queue.dequeue_free(WAIT).unwrap();
        block.write_at(0, &seq.to_le_bytes()).unwrap();
        block.enqueue(8, seq).unwrap();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let started = Instant::now();
    let err = loop {
        match queue.dequeue_free(WAIT) {
            Ok(block) => block.enqueue(0, 0).unwrap(),
            Err(err) => break err,
        }
    };
    assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{err}");
    assert!(err.to_string().contains("consumer went away"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "noticed in {:?}", started.elapsed());
}

#[test]
fn consumer_takes_what_a_killed_producer_enqueued_then_fails() {
    let (conn, mut child, _dir) = spawn_peer("produce-then-die");
    let mut queue = create(conn, Role::Consumer, 4096, 64);
    // Let the producer enqueue its 50 blocks and die first.
    assert!(!child.wait().unwrap().success());
    let mut out = vec![0u8; 4096];
    let mut seq = 0u64;
    let err = loop {
        match queue.dequeue_filled(1, WAIT) {
            Ok(Some(run)) => {
                run.read_at(0, 0, &mut out).unwrap();
                assert_eq!(out, block_bytes(seq, 4096));
                seq += 1;
                run.release().unwrap();
            }
            Ok(None) => panic!("a killed producer marked no end of stream"),
            Err(err) => break err,
        }
    };
    assert_eq!(seq, 50, "every block enqueued before the kill arrives");
    assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{err}");
    assert!(err.to_string().contains("without finishing"), "{err}");
}

#[test]
fn a_peer_writing_garbage_into_the_control_page_is_an_error() {
    let (conn, mut child, _dir) = spawn_peer("hostile-consumer");
    let mut queue = create(conn, Role::Producer, 4096, 4);
    let started = Instant::now();
    let err = loop {
        match queue.dequeue_free(WAIT) {
            Ok(block) => block.enqueue(8, 0).unwrap(),
            Err(err) => break err,
        }
    };
    assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");
    assert!(err.to_string().contains("consumer's count"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// The header and descriptors a real creator sends (a memfd queue of two
/// 4 KiB blocks), captured by hand: its attach is left to time out.
fn a_real_queues_header() -> (Vec<u8>, Vec<OwnedFd>) {
    let (a, b) = Connection::pair().unwrap();
    let creator = std::thread::spawn(move || {
        let options = BlockQueueOptions { block_size: 4096, blocks: 2, memory: QueueMemory::Memfd };
        BlockQueue::create(a, Role::Producer, &options, Some(Duration::from_millis(200)))
    });
    let mut header = [0u8; 64];
    let (len, fds) = b.recv(&mut header).unwrap();
    assert_eq!(creator.join().unwrap().unwrap_err().kind(), ErrorKind::TimedOut);
    (header[..len].to_vec(), fds)
}

/// The creator's side is hostile: the attacher refuses what could hurt it.
#[test]
fn hostile_creators_are_refused() {
    let send_and_attach = |header: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]| {
        let (a, b) = Connection::pair().unwrap();
        a.send(header, fds).unwrap();
        BlockQueue::attach(b, Some(Duration::from_secs(5))).unwrap_err()
    };
    let (header, fds) = a_real_queues_header();
    let header = &header[..];
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    let dir = scratch_dir();
    let plain = File::create(dir.path().join("f")).unwrap();
    plain.set_len(8192).unwrap();

    // Wrong descriptor counts, a plain file for the memory, a resizable
    // memfd, a pipe for an eventfd, an absurd shape.
    let err = send_and_attach(header, &borrowed[..3]);
    assert!(err.to_string().contains("four descriptors"), "{err}");
    let err = send_and_attach(header, &[borrowed[0], plain.as_fd(), borrowed[2], borrowed[3]]);
    assert!(err.to_string().contains("memfd sealed"), "{err}");
    let (pipe_r, _pipe_w) = std::io::pipe().unwrap();
    let err = send_and_attach(header, &[borrowed[0], borrowed[1], pipe_r.as_fd(), borrowed[3]]);
    assert!(err.to_string().contains("eventfd"), "{err}");
    let mut huge = header.to_vec();
    huge[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let err = send_and_attach(&huge, &borrowed);
    assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");
    let mut shape = header.to_vec();
    shape[16..24].copy_from_slice(&8192u64.to_le_bytes());
    let err = send_and_attach(&shape, &borrowed);
    assert!(err.to_string().contains("announced"), "{err}");
    let err = send_and_attach(b"short", &borrowed);
    assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");
    // The untouched objects attach.
    let (a, b) = Connection::pair().unwrap();
    a.send(header, &borrowed).unwrap();
    let queue = BlockQueue::attach(b, Some(Duration::from_secs(5))).unwrap();
    assert_eq!((queue.role(), queue.block_size(), queue.blocks()), (Role::Consumer, 4096, 2));
}

/// A creator that announces dma-buf blocks but sends a memfd, or a file
/// whose `/proc/self/fd` link reads `/dmabuf:…` (as a dma-buf's does), is
/// refused: a dma-buf is known by its filesystem, and a file could shrink
/// under the mapping.
#[test]
fn a_file_named_like_a_dmabuf_is_not_taken_for_one() {
    const TEST: &str = "a_file_named_like_a_dmabuf_is_not_taken_for_one";
    let (header, fds) = a_real_queues_header();
    let attach_as_dmabuf = |blocks: std::os::fd::BorrowedFd<'_>| {
        for memory in [QueueMemory::DmaHeap, QueueMemory::Udmabuf] {
            let mut forged = header.clone();
            let kind = QueueMemory::ALL.iter().position(|&m| m == memory).unwrap() as u64;
            forged[32..40].copy_from_slice(&kind.to_le_bytes());
            let (a, b) = Connection::pair().unwrap();
            a.send(&forged, &[fds[0].as_fd(), blocks, fds[2].as_fd(), fds[3].as_fd()]).unwrap();
            let err = BlockQueue::attach(b, Some(Duration::from_secs(5))).unwrap_err();
            assert!(err.to_string().contains("should be a dma-buf"), "{}: {err}", memory.name());
        }
    };
    attach_as_dmabuf(fds[1].as_fd());

    // A file at the root of a detached mount: its link is "/" and its path
    // there, the name a dma-buf's link has (old kernels: anon_inode:dmabuf).
    if !common::is_root() {
        return common::skip(TEST, "mounting a tmpfs needs root");
    }
    let dir = scratch_dir();
    let mount = dir.path().join("mnt");
    std::fs::create_dir(&mount).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&mount).status().unwrap();
    assert!(mounted.success(), "mount -t tmpfs {}", mount.display());
    let file = File::options().read(true).write(true).create_new(true).open(mount.join("dmabuf:x")).unwrap();
    file.set_len(8192).unwrap();
    let detached = Command::new("umount").arg("-l").arg(&mount).status().unwrap();
    assert!(detached.success(), "umount -l {}", mount.display());
    let link =
        std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file))).unwrap();
    assert_eq!(link, Path::new("/dmabuf:x"));
    attach_as_dmabuf(file.as_fd());
}

/// Corrupt counts and lengths written into a live control page.
#[test]
fn corrupt_counts_and_lengths_are_refused() {
    for (word, value, expect) in
        [(1usize, 1u64 << 40, "producer's count"), (8, 1 << 30, "more than the block size")]
    {
        let (a, b) = Connection::pair().unwrap();
        let options = BlockQueueOptions { block_size: 4096, blocks: 4, memory: QueueMemory::Memfd };
        let creator = std::thread::spawn(move || {
            let mut header = [0u8; 64];
            let (_, fds) = b.recv(&mut header).unwrap();
            b.send(b"dmaload block queue attached", &[]).unwrap();
            (b, fds)
        });
        let mut queue = BlockQueue::create(a, Role::Consumer, &options, WAIT).unwrap();
        let (_b, fds) = creator.join().unwrap();
        let control = File::from(fds.into_iter().next().unwrap());
        if word == 8 {
            control.write_all_at(&1u64.to_le_bytes(), 8).unwrap();
        }
        control.write_all_at(&value.to_le_bytes(), word as u64 * 8).unwrap();
        let err = queue.dequeue_filled(4, WAIT).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidData, "{err}");
        assert!(err.to_string().contains(expect), "{err}");
    }
}

/// Offsets past a block, however large, are errors, never a panic.
#[test]
fn offsets_past_a_block_are_errors() {
    let (a, b) = Connection::pair().unwrap();
    let attacher = std::thread::spawn(move || BlockQueue::attach(b, WAIT).unwrap());
    let mut producer = create(a, Role::Producer, 4096, 2);
    let mut consumer = attacher.join().unwrap();
    let mut block = producer.dequeue_free(WAIT).unwrap();
    for offset in [4096, usize::MAX - 1, usize::MAX] {
        let err = block.write_at(offset, b"xy").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
        let err = block.read_at(offset, &mut [0; 2]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    }
    block.write_at(4094, b"xy").unwrap();
    block.enqueue(4096, 0).unwrap();
    let run = consumer.dequeue_filled(1, WAIT).unwrap().unwrap();
    for (i, offset) in [(0, usize::MAX), (1, 0)] {
        let err = run.read_at(i, offset, &mut [0; 2]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    }
    let mut tail = [0; 2];
    run.read_at(0, 4094, &mut tail).unwrap();
    assert_eq!(&tail, b"xy");
}

#[test]
fn shapes_outside_the_limits_are_refused() {
    for (block_size, blocks) in
        [(1000, 4), (2048, 4), (128 << 20, 2), (4096, 0), (4096, 1 << 20), (64 << 20, 2048)]
    {
        let (a, _b) = Connection::pair().unwrap();
        let options = BlockQueueOptions { block_size, blocks, memory: QueueMemory::Memfd };
        let err = BlockQueue::create(a, Role::Producer, &options, WAIT).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{block_size} × {blocks}: {err}");
    }
}

#[test]
fn a_timeout_bounds_every_wait() {
    let (a, b) = Connection::pair().unwrap();
    let attacher = std::thread::spawn(move || BlockQueue::attach(b, WAIT).unwrap());
    let mut consumer = create(a, Role::Consumer, 4096, 2);
    let mut producer = attacher.join().unwrap();
    let started = Instant::now();
    let err = consumer.dequeue_filled(1, Some(Duration::from_millis(50))).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(started.elapsed() >= Duration::from_millis(50));
    for _ in 0..2 {
        producer.dequeue_free(WAIT).unwrap().enqueue(4096, 0).unwrap();
    }
    let err = producer.dequeue_free(Some(Duration::from_millis(50))).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    // The pollable fd: armed, and readable once the producer enqueues.
    assert_eq!(consumer.dequeue_filled(2, WAIT).unwrap().unwrap().blocks(), 2);
    assert!(consumer.prepare_wait().unwrap());
    producer.dequeue_free(WAIT).unwrap().enqueue(1, 7).unwrap();
    let mut fds = [libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&consumer.wait_fd()),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: one valid pollfd living across the call.
    assert_eq!(unsafe { libc::poll(fds.as_mut_ptr(), 1, 10_000) }, 1);
    assert_eq!(consumer.dequeue_filled(1, WAIT).unwrap().unwrap().block(0), (1, 7));
    // A dropped producer ends the consumer's waits at once.
    drop(producer);
    let err = consumer.dequeue_filled(1, WAIT).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{err}");
}

/// Blocks in a dma-buf (system dma-heap, udmabuf): both processes map it
/// and bracket every CPU access with DMA_BUF_IOCTL_SYNC (counted, and an
/// ioctl the exporter refused would fail the stream). Runs in the VM of
/// tests/vm, skips where the kernel has neither.
#[test]
fn dmabuf_blocks_cross_processes_with_cpu_sync() {
    for memory in [QueueMemory::DmaHeap, QueueMemory::Udmabuf] {
        let probe = match memory {
            QueueMemory::DmaHeap => dmaload::heap::dma_heap_probe(),
            _ => dmaload::heap::udmabuf_probe(),
        };
        if let Err(why) = probe {
            common::skip(&format!("dmabuf_blocks_cross_processes_with_cpu_sync ({})", memory.name()), &why);
            continue;
        }
        let (conn, mut child, _dir) = spawn_peer("produce-dmabuf");
        let options = BlockQueueOptions { block_size: 8192, blocks: 8, memory };
        let mut queue = BlockQueue::create(conn, Role::Consumer, &options, WAIT).unwrap();
        let mut out = vec![0u8; 8192];
        let mut seq = 0u64;
        while let Some(run) = queue.dequeue_filled(1, WAIT).unwrap() {
            run.read_at(0, 0, &mut out).unwrap();
            assert!(out == block_bytes(seq, 8192), "{} block {seq} differs", memory.name());
            seq += 1;
            run.release().unwrap();
        }
        assert_eq!(seq, 200);
        assert_eq!(queue.cpu_syncs(), 400, "{}", memory.name());
        assert!(child.wait().unwrap().success(), "{}: the producer failed", memory.name());
        eprintln!("{}: 200 blocks, 400 CPU-access syncs on each side", memory.name());
    }
}

/// A peer that signals the eventfd without ever enqueueing cannot hold a
/// waiter past its timeout.
#[test]
fn wake_ups_without_progress_still_time_out() {
    let (a, b) = Connection::pair().unwrap();
    let peer = std::thread::spawn(move || {
        let mut header = [0u8; 64];
        let (_, fds) = b.recv(&mut header).unwrap();
        b.send(b"dmaload block queue attached", &[]).unwrap();
        (b, fds)
    });
    let options = BlockQueueOptions { block_size: 4096, blocks: 4, memory: QueueMemory::Memfd };
    let mut queue = BlockQueue::create(a, Role::Consumer, &options, WAIT).unwrap();
    let (_b, mut fds) = peer.join().unwrap();
    let filled = File::from(fds.remove(2));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spammer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = filled.write_all_at(&1u64.to_le_bytes(), 0);
            }
        })
    };
    let started = Instant::now();
    let err = queue.dequeue_filled(1, Some(Duration::from_millis(200))).unwrap_err();
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spammer.join().unwrap();
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// A producer and a consumer of one queue, both ends in this process.
fn queue_pair(blocks: usize) -> (BlockQueue, BlockQueue) {
    let (a, b) = Connection::pair().unwrap();
    let attacher = std::thread::spawn(move || BlockQueue::attach(b, WAIT).unwrap());
    let producer = create(a, Role::Producer, 4096, blocks);
    (producer, attacher.join().unwrap())
}

/// A run held from one queue and given back to another is refused: the
/// other queue's producer must not get back blocks its consumer still
/// holds. The refused run comes back in the error, and goes home.
#[test]
fn a_run_from_another_queue_is_refused() {
    let (mut producer_a, mut consumer_a) = queue_pair(2);
    let (mut producer_b, mut consumer_b) = queue_pair(2);
    for (producer, byte) in [(&mut producer_a, b'a'), (&mut producer_b, b'b')] {
        for _ in 0..2 {
            let mut block = producer.dequeue_free(WAIT).unwrap();
            block.write_at(0, &[byte; 4096]).unwrap();
            block.enqueue(4096, 0).unwrap();
        }
    }
    // Both hold stream blocks 0 and 1 of their queue: the same sequence.
    let run_a = consumer_a.dequeue_filled(2, WAIT).unwrap().unwrap().hold();
    let run_b = consumer_b.dequeue_filled(2, WAIT).unwrap().unwrap().hold();
    assert_eq!((run_a.sequence(), run_b.sequence()), (0, 0));

    let err = consumer_b.release_held(run_a).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("another block queue"), "{err}");
    // Nothing of B went back: its producer finds no free block.
    assert!(producer_b.try_dequeue_free().unwrap().is_none());
    assert_eq!(consumer_b.count(), 0);

    let run_a = dmaload::share::ForeignRun::take(err).unwrap();
    consumer_a.release_held(run_a).unwrap();
    consumer_b.release_held(run_b).unwrap();
    for (producer, consumer) in [(&mut producer_a, &consumer_a), (&mut producer_b, &consumer_b)] {
        assert_eq!(consumer.count(), 2);
        assert_eq!(producer.try_dequeue_free().unwrap().unwrap().sequence(), 2);
    }
}

/// An index past a run is the caller's bug: `block`, `block_bytes` and a
/// held run's `block` panic as indexing does (their `# Panics`), with a
/// message naming the index and the run.
#[test]
fn a_block_index_past_the_run_panics_naming_it() {
    fn panic_message(f: impl FnOnce()) -> String {
        let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_err();
        payload.downcast_ref::<String>().cloned().unwrap_or_default()
    }
    let (mut producer, mut consumer) = queue_pair(2);
    producer.dequeue_free(WAIT).unwrap().enqueue(4096, 3).unwrap();
    let run = consumer.dequeue_filled(2, WAIT).unwrap().unwrap();
    assert_eq!(run.block(0), (4096, 3));
    assert_eq!(
        panic_message(|| {
            let _ = run.block(1);
        }),
        "block 1 of a run of 1 blocks"
    );
    assert_eq!(
        panic_message(|| {
            let _ = run.block_bytes(usize::MAX);
        }),
        format!("block {} of a run of 1 blocks", usize::MAX)
    );
    let held = run.hold();
    assert_eq!(
        panic_message(|| {
            let _ = held.block(2);
        }),
        "block 2 of a run of 1 blocks"
    );
    consumer.release_held(held).unwrap();
    assert_eq!(producer.try_dequeue_free().unwrap().unwrap().sequence(), 1);
}
