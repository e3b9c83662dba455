"""dmaload.BlockQueue between two real Python processes."""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import threading
import platform
import time

import pytest

import dmaload

PRODUCER = """
import os, socket, sys
import dmaload
sock = socket.socket(fileno=int(sys.argv[1]))
queue = dmaload.BlockQueue.attach(sock, timeout=30)
assert queue.role == "producer"
count, die = int(sys.argv[2]), sys.argv[3] == "die"
for seq in range(count):
    data = bytes([(seq * 7 + i) % 251 for i in range(seq % 5000)])
    assert queue.put(data, tag=seq * 3, timeout=30) == seq
if die:
    os.kill(os.getpid(), 9)
queue.finish()
queue.wait_drained(timeout=30)
"""


def start_producer(count: int, die: bool = False) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(theirs.fileno()), str(count), "die" if die else "finish"],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    return ours, child


def expected(seq: int) -> bytes:
    return bytes([(seq * 7 + i) % 251 for i in range(seq % 5000)])


def test_blocks_arrive_in_order_from_another_process() -> None:
    sock, child = start_producer(300)
    with dmaload.BlockQueue.create(sock, "consumer", block_size=8192, blocks=4, timeout=30) as queue:
        assert (queue.role, queue.block_size, queue.blocks, queue.memory) == ("consumer", 8192, 4, "memfd")
        seq = 0
        while (block := queue.get(timeout=30)) is not None:
            tag, data = block
            assert tag == seq * 3
            assert data == expected(seq)
            seq += 1
        assert seq == 300 and queue.count == 300
    assert child.wait(timeout=30) == 0


def test_a_killed_producer_is_broken_pipe_after_its_blocks() -> None:
    sock, child = start_producer(10, die=True)
    queue = dmaload.BlockQueue.create(sock, "consumer", block_size=8192, blocks=16, timeout=30)
    assert child.wait(timeout=30) == -signal.SIGKILL
    got = [queue.get(timeout=30) for _ in range(10)]
    assert [g[0] for g in got if g is not None] == [s * 3 for s in range(10)]
    with pytest.raises(BrokenPipeError, match="without finishing"):
        queue.get(timeout=30)


def test_timeouts_bad_arguments_and_the_pollable_fd() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with pytest.raises(ValueError, match="block size"):
        dmaload.BlockQueue.create(a, "producer", block_size=1000)
    with pytest.raises(ValueError, match="role"):
        dmaload.BlockQueue.create(a, "reader")
    attached: list[dmaload.BlockQueue] = []
    thread = threading.Thread(target=lambda: attached.append(dmaload.BlockQueue.attach(b, timeout=30)))
    thread.start()
    producer = dmaload.BlockQueue.create(a.fileno(), "producer", block_size=4096, blocks=2, timeout=30)
    thread.join()
    consumer = attached[0]
    with pytest.raises(TimeoutError):
        consumer.get(timeout=0.05)
    with pytest.raises(ValueError, match="block of 4096"):
        producer.put(bytes(5000))
    assert consumer.prepare_wait()
    assert producer.try_put(b"x" * 4096, tag=1) and producer.try_put(b"y", tag=2)
    assert not producer.try_put(b"z")
    assert select.select([consumer.wait_fd()], [], [], 10)[0]
    assert consumer.get() == (1, b"x" * 4096)
    producer.put(b"z", tag=3)  # into the block just given back
    with pytest.raises(TimeoutError):
        producer.put(b"w", timeout=0.05)
    producer.close()
    with pytest.raises(ValueError, match="closed"):
        producer.put(b"w")
    # What a producer enqueued before leaving still arrives, then the break.
    assert consumer.get() == (2, b"y") and consumer.get() == (3, b"z")
    with pytest.raises(BrokenPipeError):
        consumer.get(timeout=30)



def test_put_takes_any_bytes_like_object() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    attached: list[dmaload.BlockQueue] = []
    thread = threading.Thread(target=lambda: attached.append(dmaload.BlockQueue.attach(b, timeout=30)))
    thread.start()
    producer = dmaload.BlockQueue.create(a, "producer", block_size=4096, blocks=4, timeout=30)
    thread.join()
    consumer = attached[0]
    assert producer.put(bytearray(b"array"), tag=1) == 0
    assert producer.put(memoryview(b"..view..")[2:6], tag=2) == 1
    assert producer.try_put(memoryview(bytearray(b"try")), tag=3)
    with pytest.raises(ValueError, match="block of 4096"):
        producer.put(bytearray(5000))
    with pytest.raises(TypeError):
        producer.put("text")  # type: ignore[arg-type]
    # Too large is refused at once, not after a wait for a free block.
    assert producer.put(b"fill") == 3
    with pytest.raises(ValueError, match="block of 4096"):
        producer.put(bytes(5000), timeout=30)
    assert [consumer.get(timeout=30) for _ in range(3)] == [(1, b"array"), (2, b"view"), (3, b"try")]
    assert consumer.get(timeout=30) == (0, b"fill")

# A thread waits for the queue another thread holds (sleeping in poll(2) in
# `put`) while this process must still run Python: the consumer is here.
WAITS_WITHOUT_THE_GIL = """
import socket, sys, threading, time
import dmaload
sys.setswitchinterval(1000)  # the GIL changes hands only when a thread blocks
POLLS = {"x86_64": ("7", "271"), "aarch64": ("73",)}[sys.argv[1]]
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
attached = []
thread = threading.Thread(target=lambda: attached.append(dmaload.BlockQueue.attach(b, timeout=30)))
thread.start()
producer = dmaload.BlockQueue.create(a, "producer", block_size=4096, blocks=1, timeout=30)
thread.join()
consumer = attached[0]
producer.put(b"a")
putter = threading.Thread(target=producer.put, args=(b"b",))
putter.start()
# Handshake: the putter sleeps in poll(2), holding the queue.
while open(f"/proc/self/task/{putter.native_id}/syscall").read().split()[0] not in POLLS:
    time.sleep(0.001)
counted = []
reader = threading.Thread(target=lambda: counted.append(producer.count))
reader.start()  # returns once the reader gives up the GIL: waiting for the queue
assert consumer.get(timeout=30) == (0, b"a")
putter.join()
reader.join()
assert counted == [2], counted
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="poll(2) syscall numbers")
def test_a_thread_waiting_for_the_queue_lets_other_threads_run() -> None:
    child = subprocess.Popen([sys.executable, "-c", WAITS_WITHOUT_THE_GIL, platform.machine()])
    try:
        assert child.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        pytest.fail("a thread waiting for a BlockQueue another thread uses kept the GIL: the process hung")
