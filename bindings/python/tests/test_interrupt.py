"""Ctrl-C in a real child process blocked in a BlockQueue wait: a real
SIGINT raises KeyboardInterrupt and leaves nothing behind (no thread, no
descriptor, no block taken or half put). The child says when it is about
to wait; the parent then waits until the child's main thread sleeps in the
kernel (/proc/PID/wchan), so the signal lands in the wait. How late the
exception came is printed, not asserted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Builds a queue of 2 blocks between two ends in this one process.
SETUP = """
import os, signal, socket, sys, threading, time, dmaload
signal.signal(signal.SIGINT, signal.default_int_handler)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
ends = {}
creator = threading.Thread(target=lambda: ends.setdefault(
    "producer", dmaload.BlockQueue.create(a, "producer", block_size=4096, blocks=2)))
creator.start()
consumer = dmaload.BlockQueue.attach(b)
creator.join()
# join() returns when the thread's Python code is done; the kernel still
# lists the thread until it has exited, which the counts below must not see.
deadline = time.monotonic() + 30
while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < deadline:
    time.sleep(0.001)
producer = ends["producer"]
def state():
    return sorted(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
"""

# Each wait: what comes before it, the blocking call, and the checks after
# the KeyboardInterrupt that the queue is as it was.
WAITS = {
    "get on an empty queue": (
        "",
        "consumer.get()",
        "producer.put(b'x', tag=1); assert consumer.get(timeout=60) == (1, b'x')",
    ),
    "put on a full queue": (
        "producer.put(b'a', tag=0); producer.put(b'b', tag=1)",
        "producer.put(b'c', tag=2)",
        "producer.finish(); assert [consumer.get(timeout=60) for _ in range(3)] == [(0, b'a'), (1, b'b'), None]",
    ),
    "wait_drained with a block left": (
        "producer.put(b'a', tag=0); producer.finish()",
        "producer.wait_drained()",
        "assert consumer.get(timeout=60) == (0, b'a') and consumer.get(timeout=60) is None",
    ),
}


def _sleeping_in_the_kernel(pid: int) -> bool:
    with open(f"/proc/{pid}/wchan") as f:
        return f.read().strip() not in ("", "0")


def _interrupt(code: str, ready: str) -> float:
    """Runs `code` in a child, waits for its `ready` line and for its main
    thread to sleep in the kernel, sends SIGINT, and checks that the child
    printed INTERRUPTED then INTACT and exited 0. Returns how many ms after
    the signal the exception came (printed by the callers, not asserted)."""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        line = child.stdout.readline()
        assert line == ready + "\n", line + (child.stderr.read() if child.stderr else "")
        deadline = time.monotonic() + 60
        while not _sleeping_in_the_kernel(child.pid):
            assert time.monotonic() < deadline, "the child never blocked"
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=5)  # generous: the wait answers in milliseconds
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0 and "INTACT" in out, f"{child.returncode}\n{out}\n{err}"
    raised = float(next(line.split()[1] for line in out.splitlines() if line.startswith("INTERRUPTED")))
    return 1000 * (raised - sent)


@pytest.mark.parametrize("wait", sorted(WAITS))
def test_ctrl_c_ends_a_block_queue_wait_and_leaves_the_queue_as_it_was(wait: str) -> None:
    before, call, after = WAITS[wait]
    code = SETUP + textwrap.dedent(
        f"""
        {before}
        held = state()
        print("WAITING", flush=True)
        try:
            {call}
        except KeyboardInterrupt:
            print("INTERRUPTED", time.monotonic(), flush=True)
        else:
            sys.exit("the wait ended without the signal")
        assert state() == held, (state(), held)
        {after}
        print("INTACT", flush=True)
        """
    )
    print(f"{wait}: KeyboardInterrupt {_interrupt(code, 'WAITING'):.1f} ms after SIGINT")


def test_the_waits_still_time_out(tmp_path: Path) -> None:
    """Slicing the waits keeps their timeout: a get on an empty queue with
    a timeout is TimeoutError, not None or a hang."""
    code = SETUP + textwrap.dedent(
        """
        try:
            consumer.get(timeout=0.05)
        except TimeoutError:
            print("TIMED OUT", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "TIMED OUT" in out.stdout, out.stdout + out.stderr


def test_ctrl_c_ends_a_save_blocked_on_a_full_fifo(tmp_path: Path) -> None:
    """A FIFO whose reader never reads fills after 64 KiB and the save waits
    for room: Ctrl-C ends it with KeyboardInterrupt and leaves no thread or
    descriptor behind once the save's thread has seen the cancel (before
    saves took a token, this wait was for good).
    The child's progress callback says when bytes have gone in."""
    fifo = tmp_path / "fifo"
    code = textwrap.dedent(
        f"""
        import os, signal, sys, time, dmaload
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.mkfifo({str(fifo)!r})
        holder = os.open({str(fifo)!r}, os.O_RDWR)  # a reader that never reads
        def state():
            return sorted(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
        held = state()
        said = []
        def progress(done, total):
            if done and not said:
                said.append(done)
                print("FILLED", flush=True)
        try:
            dmaload.save(bytes(4 << 20), {str(fifo)!r}, progress=progress)
        except KeyboardInterrupt:
            print("INTERRUPTED", time.monotonic(), flush=True)
        else:
            sys.exit("the save ended without the signal")
        # A save that had not noticed the cancel within the call's grace
        # (a busy machine) is left to its thread, which ends at its next
        # look at the token: the state comes back by itself.
        deadline = time.monotonic() + 30
        while state() != held and time.monotonic() < deadline:
            time.sleep(0.001)
        assert state() == held, (state(), held)
        print("INTACT", flush=True)
        """
    )
    print(f"save to a full FIFO: KeyboardInterrupt {_interrupt(code, 'FILLED'):.1f} ms after SIGINT")


HANDSHAKES = {
    "create waiting for the peer to attach": "dmaload.BlockQueue.create(a, 'producer', block_size=4096, blocks=2)",
    "attach waiting for a queue": "dmaload.BlockQueue.attach(b)",
    "Buffer.receive waiting for a buffer": "dmaload.Buffer.receive(b)",
}


@pytest.mark.parametrize("call", sorted(HANDSHAKES))
def test_ctrl_c_ends_a_block_queue_handshake_and_leaves_nothing(call: str) -> None:
    """Ctrl-C in create (no peer attaches), attach (no queue comes) or
    Buffer.receive (no buffer comes): the wait ends with KeyboardInterrupt,
    and the process has the descriptors and threads it had before (a
    created queue's memfds are closed)."""
    code = textwrap.dedent(
        f"""
        import os, signal, socket, sys, time, dmaload
        signal.signal(signal.SIGINT, signal.default_int_handler)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        def state():
            return sorted(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
        held = state()
        print("WAITING", flush=True)
        try:
            {HANDSHAKES[call]}
        except KeyboardInterrupt:
            print("INTERRUPTED", time.monotonic(), flush=True)
        else:
            sys.exit("the wait ended without the signal")
        assert state() == held, (state(), held)
        print("INTACT", flush=True)
        """
    )
    print(f"{call}: KeyboardInterrupt {_interrupt(code, 'WAITING'):.1f} ms after SIGINT")


def test_buffer_receive_keeps_the_sockets_timeout() -> None:
    """Waiting in slices keeps a socket object's timeout: no buffer within
    it is TimeoutError, and a buffer sent later is still received whole."""
    import socket

    import dmaload

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        b.settimeout(0.2)
        with pytest.raises(TimeoutError, match="no buffer arrived"):
            dmaload.Buffer.receive(b)
        data = bytes(range(256)) * 64
        source = Path(f"/var/tmp/dmaload-receive-{os.getpid()}")
        source.write_bytes(data)
        try:
            with dmaload.load(source) as sent:
                sent.send(a)
            with dmaload.Buffer.receive(b) as received:
                assert bytes(memoryview(received)) == data
        finally:
            source.unlink()


def _filled_socket_code(path: Path) -> str:
    """A child's set-up: a loaded buffer, and a socket whose receiver has
    taken nothing until no message fits any more."""
    return textwrap.dedent(
        f"""
        import os, signal, socket, sys, time, dmaload
        signal.signal(signal.SIGINT, signal.default_int_handler)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        buffer = dmaload.load({str(path)!r})
        a.setblocking(False)
        try:
            while True:
                a.send(b"x" * 4096)
        except BlockingIOError:
            pass
        a.setblocking(True)
        def state():
            return sorted(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
        """
    )


def test_ctrl_c_ends_a_buffer_send_to_a_receiver_that_takes_nothing(tmp_path: Path) -> None:
    """Buffer.send on a socket the receiver never reads waits for room;
    Ctrl-C ends the wait with KeyboardInterrupt and nothing is left behind,
    and a socket object's timeout ends it with TimeoutError."""
    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 16))
    code = _filled_socket_code(path) + textwrap.dedent(
        """
        a.settimeout(0.2)
        try:
            buffer.send(a)
        except TimeoutError as e:
            assert "the receiver took nothing" in str(e), e
        else:
            sys.exit("the send did not time out")
        a.settimeout(None)
        held = state()
        print("WAITING", flush=True)
        try:
            buffer.send(a)
        except KeyboardInterrupt:
            print("INTERRUPTED", time.monotonic(), flush=True)
        else:
            sys.exit("the send ended without the signal")
        assert state() == held, (state(), held)
        print("INTACT", flush=True)
        """
    )
    print(f"Buffer.send: KeyboardInterrupt {_interrupt(code, 'WAITING'):.1f} ms after SIGINT")
